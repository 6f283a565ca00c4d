"""Small helpers shared by the data-plane benchmarks (tables, results, machine info).

Imported by the scripts in this folder (``python scripts/bench/<name>.py`` puts the folder on
``sys.path``); holds no benchmark logic.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run from anywhere without PYTHONPATH; last, so that a child of
    sys.path.append(str(REPO))  # in_fresh_process(repo=...) imports that checkout's packages


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fast smoke mode (small sizes, few repeats)")
    p.add_argument("--out", default=str(REPO / "docs" / "img"),
                   help="folder for the JSON results and the PNG plot (default: docs/img/)")
    return p


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def git_state() -> dict:
    """The commit measured and whether dataloading/ had uncommitted changes (read-only git)."""
    import subprocess

    def run(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": run("rev-parse", "--short", "HEAD"),
            "dirty": sorted(line[3:] for line in run("status", "--porcelain", "--", "dataloading").splitlines())}


def median(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table; floats get 3 significant decimals unless pre-formatted."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def in_fresh_process(module: str, function: str, *args, repo: Path | None = None) -> dict:
    """``module.function(*args)`` (a script of this folder) in a new interpreter, its JSON result
    back: a measurement whose process-wide peak or start-up must be its own. ``repo``: another
    checkout (a worktree of an older commit) whose packages the function imports instead."""
    import subprocess

    call = f"{function}({', '.join(map(repr, args))})"
    code = (f"import sys, json; sys.path.insert(1, {str(REPO / 'scripts' / 'bench')!r}); import {module} as m; "
            f"print(json.dumps(m.{call}))")
    # python -c puts the working directory first on sys.path: the checkout's packages win.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo or REPO, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def worktree(commit: str):
    """A detached git worktree of ``commit`` in a temporary folder (the "before" of a
    before/now benchmark: ``in_fresh_process(..., repo=path)`` imports its packages), removed
    afterwards."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(path), commit], check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)


def peak_cell(r: dict | None, limit_gib: float) -> str:
    """A before/now memory point (``peak_above_inputs`` and ``fits``, or None) as a table cell."""
    if r is None:
        return "not run"
    return f"{r['peak_above_inputs'] / 2**30:.2f}" if r["fits"] else f"over {limit_gib:.0f} GiB"


def peak_ratio(before: dict | None, now: dict | None, limit_gib: float) -> str:
    """before / now of two memory points; a lower bound ("over Nx") where before exceeded the limit."""
    if not (before and now and now["fits"]):
        return ""
    if before["fits"]:
        return f"{before['peak_above_inputs'] / now['peak_above_inputs']:.1f}x"
    return f"over {limit_gib * 2**30 / now['peak_above_inputs']:.0f}x"


def before_now_cells(point: dict, limit_gib: float) -> list[str]:
    """A point's ``before`` and ``now`` memory measurements as table cells: each peak, their
    ratio, and the seconds ``now`` took where it fit."""
    before, now = point["before"], point["now"]
    return [peak_cell(before, limit_gib), peak_cell(now, limit_gib), peak_ratio(before, now, limit_gib),
            f"{now['seconds']:.0f}" if now and now["fits"] else ""]


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def save(out: str | Path, name: str, results: dict) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    results = {"benchmark": name, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(),
               "git": git_state(), **results}
    path.write_text(json.dumps(results, indent=1, default=float) + "\n")
    return path


def save_and_plot(out: str | Path, name: str, results: dict, plot) -> None:
    """Save ``results`` as ``name``.json in ``out``, draw ``plot(results, png)`` beside it, and
    say where (with the run's ``wall_s``)."""
    path = save(out, name, results)
    png = path.with_suffix(".png")
    plot(results, png)
    print(f"\nwrote {path} and {png} ({results['wall_s']:.0f}s)")


def run_record(t0: float, **fields) -> dict:
    """``fields`` and where and when the run was made: the commit, the machine, the seconds since
    ``t0`` and the clock time (what a measured doc section cites, ``measured_on_cpu``)."""
    return {**fields, "git": git_state(), "machine": machine(), "seconds": time.perf_counter() - t0,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def measured_on_cpu(script: str, res: dict) -> str:
    """The first words of a doc section measured on this machine's CPU: the script and the run
    (``run_record``) that measured it."""
    return (f"**Measured** on this machine's CPU: `scripts/bench/{script}` (commit {res['git']['commit']}, "
            f"{res['time']}, {res['seconds']:.0f} s; {res['machine'].get('cpu', '')}).")


def save_measured(out: str | Path, name: str, t0: float, **fields) -> str:
    """The end of a bench measured on this CPU (``scripts/bench/<name>.py``): its run record
    (``run_record`` of ``fields``) saved as ``name``.json in ``out`` (the path printed); returns
    the first words of its doc section (``measured_on_cpu``)."""
    res = run_record(t0, **fields)
    print(save(out, name, res))
    return measured_on_cpu(f"{name}.py", res)


def publish(body: str, doc: str | None, section: str) -> None:
    """Print a doc section's body and, with ``--doc``, (re)write the section in that file."""
    print(body)
    if doc:
        write_doc_section(Path(doc), section, body)


def write_doc_section(doc: Path, section: str, body: str) -> None:
    """(Re)write the markdown section headed ``section`` (up to the next "## ") of ``doc``, or
    append it."""
    text = doc.read_text() if doc.exists() else ""
    body = f"{section}\n\n{body}"
    if section in text:
        start = text.index(section)
        nxt = text.find("\n## ", start + len(section))
        text = text[:start] + body + (text[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + body
    doc.write_text(text)
