"""A plain (non-editable) install carries the Hydra configs and the console script."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _source_copy(tmp_path: Path) -> Path:
    """Build from a copy: pip writes build/ and *.egg-info next to the sources it builds."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "*.egg-info",
                                                             "runs", "tests"))
    return src


def test_wheel_contains_configs_and_entry_points(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(_source_copy(tmp_path))],
        check=True, timeout=300, cwd=tmp_path,
    )
    wheel = next(tmp_path.glob("omni_mm-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    on_disk = {str(p.relative_to(REPO)) for p in (REPO / "conf").rglob("*.yaml")}
    assert on_disk and on_disk <= names, on_disk - names
    for pkg in ("omni/__init__.py", "dataloading/__init__.py", "parallel/__init__.py", "recipes/cli.py"):
        assert pkg in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "omni = recipes.cli:entry" in text and "[omni.encoders]" in text


def test_installed_copy_composes_its_config(tmp_path):
    """Install into a bare folder and compose from there, away from the source tree."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(_source_copy(tmp_path))],
        check=True, timeout=300, cwd=tmp_path,
    )
    code = ("import recipes.compose as c, sys; cfg = c.compose_config(['experiment=demo_moe']); "
            "assert c.__file__.startswith(sys.argv[1]), c.__file__; print(cfg.model.num_experts)")
    out = subprocess.run([sys.executable, "-c", code, str(target)], env={"PYTHONPATH": str(target), "PATH": ""},
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "4"
