"""Every torchrun command in the README, docs/*.md, `omni train --help` and scripts/launch/ works
as written after the README's install command, without an activated virtual environment:
the launcher and the program it starts are paths into the `.venv` that install creates
(issue 17: `torchrun ... --no-python omni train` said "No such file or directory: 'omni'")."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The executables the install put beside the interpreter running these tests.
BIN = Path(sys.executable).parent


def _install_venv() -> str:
    """The folder the README's install command creates (`python3 -m venv .venv && ...`)."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"python3 -m venv (\S+) && \1/bin/pip install", readme)
    assert m, "the README's install command creates a venv and installs into it"
    return m.group(1)


def _doc_commands() -> list[tuple[str, str]]:
    """(where, command) for every torchrun command line in the docs and the CLI's help."""
    from recipes.cli import build_parser

    texts = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]}
    train = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "train")[1]
    texts["omni train --help"] = train.format_help()
    out = []
    for where, text in texts.items():
        in_code = where.startswith("omni ")  # the help text is all commands; markdown only in ``` blocks
        lines = text.splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            if stripped.startswith("```"):
                in_code = not in_code
            elif in_code and re.match(r"^\S*torchrun\s", stripped):
                command = stripped
                while command.endswith("\\"):  # continued on the next line
                    i += 1
                    command = command[:-1] + " " + lines[i].strip()
                out.append((where, command.split(" #")[0]))
    return out


COMMANDS = _doc_commands()


def _check(argv: list[str], where: str, venv: str) -> None:
    launcher = argv[0]
    assert launcher.startswith(f"{venv}/bin/") or Path(launcher).is_absolute(), (
        f"{where}: `{launcher}` needs an activated venv; write {venv}/bin/torchrun")
    assert (BIN / Path(launcher).name).exists(), f"{where}: {launcher} is not installed"
    assert "--no-python" in argv, f"{where}: torchrun must start the omni executable (--no-python)"
    program = argv[argv.index("--no-python") + 1]
    assert program.startswith(f"{venv}/bin/") or Path(program).is_absolute(), (
        f"{where}: `--no-python {program}` needs an activated venv; write --no-python {venv}/bin/omni")
    assert (BIN / Path(program).name).exists(), f"{where}: {program} is not installed"


def test_there_are_torchrun_examples():
    wheres = {w for w, _ in COMMANDS}
    assert {"README.md", "omni train --help", "docs/parallelism.md"} <= wheres


@pytest.mark.parametrize("where,command", COMMANDS, ids=[f"{w}:{c[:50]}" for w, c in COMMANDS])
def test_documented_torchrun_commands_name_installed_executables(where, command):
    _check(shlex.split(command), where, _install_venv())


def test_launch_scripts_default_to_the_installed_executables(tmp_path):
    """The scripts find the repository's venv themselves (here: print the command, DRY_RUN=1)."""
    venv = ROOT / _install_venv()
    if not (venv / "bin" / "omni").exists():
        pytest.skip(f"the tests do not run from the README's install ({venv} has no omni)")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\necho node0\n")
    (fake / "scontrol").chmod(0o755)
    # A PATH without the venv: nothing may rely on an activated environment.
    env = {"PATH": f"{fake}:/usr/bin:/bin", "DRY_RUN": "1", "MASTER_ADDR": "node0", "NNODES": "1",
           "SLURM_JOB_NODELIST": "node0", "SLURM_NNODES": "1", "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT),
           "HOME": os.environ.get("HOME", "/tmp")}
    for script in ("multinode_torchrun.sh", "slurm.sbatch"):
        out = subprocess.run(["bash", str(ROOT / "scripts" / "launch" / script)], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        argv = shlex.split(out.stdout.strip())
        argv = argv[1:] if argv[0] == "srun" else argv
        assert Path(argv[0]) == venv / "bin" / "torchrun" and Path(argv[0]).exists(), (script, argv[0])
        program = Path(argv[argv.index("--no-python") + 1])
        assert program == venv / "bin" / "omni" and program.exists(), (script, program)
