"""scripts/gpu_check.sh's setup part, run as on the lent GPU machine: a python3 that is a virtual
environment with torch but without hydra, webdataset and the rest (their wheels travel in .whl/),
and no network (the rest of the script: tests/test_gpu_check.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
# What the lent machine's python3 lacks (its wheels travel in .whl/; docs/benchmarks.md, "GPU check").
LACKING = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "webdataset", "wids", "braceexpand", "soundfile")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lent_python(root: Path, pip: bool) -> Path:
    """A stand-in for the lent machine's python3: a virtual environment (made from this
    interpreter's base, as the lent one's own) whose packages are this test's (torch,
    transformers, pytest, ...) less those the lent machine lacks and less Omni's install. Its
    site-packages gets a .pth naming a folder of links to the kept entries of this interpreter's
    site-packages. ``pip``: whether it has pip of its own (one made by uv has none). Returns its
    bin folder."""
    site = Path(torch.__file__).resolve().parents[1]
    hide = {_canonical(n) for n in (*LACKING, "omni-mm")}
    hidden = {"__pycache__"}
    for dist in metadata.distributions(path=[str(site)]):
        if _canonical(dist.metadata["Name"]) in hide | ({"pip"} if not pip else set()):
            hidden.update(f.parts[0] for f in dist.files or () if f.parts[0] != "..")
    farm = root / "lent_site"
    farm.mkdir()
    for entry in site.iterdir():
        if entry.name not in hidden and not entry.name.endswith(".pth"):
            (farm / entry.name).symlink_to(entry)
    venv = root / "lent_python"
    subprocess.run([sys.executable, "-m", "venv", *([] if pip else ["--without-pip"]), str(venv)], check=True,
                   timeout=180, capture_output=True)
    (venv_site,) = venv.glob("lib/python*/site-packages")
    (venv_site / "lent_packages.pth").write_text(f"{farm}\n")
    return venv / "bin"


def _pack(name: str, dest: Path) -> Path:
    """A wheel of an installed distribution: its installed files and dist-info, zipped under the
    name pip expects (what pip unpacks from a wheel, less the byte code and the scripts)."""
    dist = metadata.distribution(name)
    tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    tag = next((x for x in tags if x.startswith(("py3", "cp3"))), tags[0])
    path = dest / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for f in dist.files:
            if f.parts[0] != ".." and "__pycache__" not in f.parts:
                z.write(f.locate(), f.as_posix())
    return path


def _wheels(dest: Path) -> str:
    """The lent machine's wheels: the checkout's .whl/ or the shared folder beside the checkout,
    where a session keeps them; elsewhere (CI clones only the repository, and the wheels are not
    in git) wheels packed from this interpreter's own installs of the same distributions."""
    dest.mkdir()
    for src in (REPO / ".whl", REPO.parent / "shared" / "gpu-wheels"):
        found = sorted(src.glob("*.whl"))
        names = {_canonical(w.name.split("-")[0]) for w in found}
        if all(_canonical(n) in names for n in LACKING):
            for w in found:
                shutil.copy(w, dest)
            return str(src)
    for name in LACKING:
        _pack(name, dest)
    return "packed from this interpreter's installs"


@pytest.mark.parametrize("pip", [True, False], ids=["pip", "no_pip"])
def test_setup_offline_as_on_the_lent_machine(tmp_path, pip):
    if pip and importlib.util.find_spec("ensurepip") is None:
        pytest.skip("this Python has no ensurepip (a distribution's python3 without its venv package): "
                    "no venv with pip can be made offline; the no_pip case covers the setup")
    bin_dir = _lent_python(tmp_path, pip)
    probe = ("import importlib.util, json, sys; print(json.dumps({m: importlib.util.find_spec(m) is not None "
             "for m in sys.argv[1:]}))")
    modules = ["torch", "transformers", "pytest", "pip", "hydra", "omegaconf", "webdataset", "wids", "braceexpand",
               "soundfile", "omni"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPU_CHECK_PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    seen = subprocess.run(["python3", "-c", probe, *modules], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert seen.returncode == 0, seen.stderr
    # The stand-in is faithful: torch and friends, none of what the wheels bring, no Omni.
    assert json.loads(seen.stdout) == {m: m in ("torch", "transformers", "pytest") or (m == "pip" and pip)
                                       for m in modules}

    source = _wheels(tmp_path / "whl")
    versions = {}
    for w in (tmp_path / "whl").glob("*.whl"):
        dist, version = w.name.split("-")[:2]
        versions[_canonical(dist)] = version
    out, work = tmp_path / "out", tmp_path / "work"
    # setup, then a part that runs what setup chose (it fails here for want of CUDA, and says so).
    env.update(OUT=str(out), GPU_CHECK_WORK=str(work), GPU_CHECK_WHEELS=str(tmp_path / "whl"), GPU_CHECK_OFFLINE="1",
               GPU_CHECK_PARTS="setup env")
    p = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    log = (out / "setup" / "log.txt").read_text() if (out / "setup" / "log.txt").exists() else ""
    rows = [line.split("\t")[:2] for line in (out / "parts.tsv").read_text().splitlines()]
    cuda = torch.cuda.is_available()
    assert rows == [["setup", "ok"], ["env", "ok" if cuda else "failed"]], (
        f"wheels {source}\n" + p.stdout[-3000:] + p.stderr[-3000:] + log[-3000:])
    assert json.loads((out / "env.json").read_text())["executable"] == str(bin_dir / "python3")
    assert ("with pip (no index, no dependencies)" if pip else "has no pip") in log
    # Nothing was installed into that python3: alone, it still lacks what the wheels bring.
    again = subprocess.run(["python3", "-c", probe, "hydra", "webdataset"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert json.loads(again.stdout) == {"hydra": False, "webdataset": False}

    # What the later parts source: that python3 itself, the wheels' folder and the checkout.
    chosen = subprocess.run(["bash", "-c", 'source "$1" && printf "%s\\n%s\\n%s\\n" "$PY" "$PYTHONPATH" "$SETUP_MODE"',
                             "_", str(work / "setup.env")], capture_output=True, text=True, timeout=30)
    py, pythonpath, mode = chosen.stdout.splitlines()
    assert (py, mode) == (str(bin_dir / "python3"), "offline")
    assert pythonpath.split(":")[:2] == [str(work / "site"), str(REPO)]
    check = ("import importlib.metadata as md, json, sys\n"
             "import omni, hydra, omegaconf, webdataset, wids, braceexpand, soundfile, recipes.cli\n"
             "mods = dict(omni=omni, hydra=hydra, omegaconf=omegaconf, webdataset=webdataset, wids=wids)\n"
             "print(json.dumps({'files': {k: m.__file__ for k, m in mods.items()}, 'prefix': sys.prefix,\n"
             "  'versions': {d: md.version(d) for d in sys.argv[1:]}}))\n")
    got = subprocess.run(["bash", "-c", 'source "$1" && shift && "$PY" -c "$@"', "_", str(work / "setup.env"), check,
                          *LACKING], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in env.items() if k != "PYTHONPATH"})
    assert got.returncode == 0, got.stderr[-3000:]
    res = json.loads(got.stdout)
    assert res["prefix"] == str(bin_dir.parent)
    assert res["versions"] == {d: versions[_canonical(d)] for d in LACKING}, source
    for name in ("hydra", "omegaconf", "webdataset", "wids"):
        assert Path(res["files"][name]).is_relative_to(work / "site"), res["files"]
    assert Path(res["files"]["omni"]).is_relative_to(REPO / "omni")
    md = (out / "gpu_check.md").read_text()
    assert "| interpreter and packages | ok |" in md and f"offline: {bin_dir / 'python3'}" in md
