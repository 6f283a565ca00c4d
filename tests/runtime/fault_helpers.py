"""Shared by the fault tests (test_faults.py, test_faults_hangs.py): a real 2-rank `torchrun` job on
the CPU demo with one fault injected from outside (tests/runtime/fault_launch.py), and what to
read from its run folder and output."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from recipe_helpers import read_metrics, tiny_overrides

REPO = Path(__file__).resolve().parents[2]
LAUNCH = Path(__file__).with_name("fault_launch.py")
STEPS = 6
RUN = {"trainer.max_steps": STEPS, "data.global_batch_size": 8, "checkpoint.every": 2, "checkpoint.keep_last": 0,
       "trainer.log_samples": True, "parallel.dp_shard": 2}

# A liveness limit, not a performance bound: a job that has not ended by then hangs (the test
# fails with TimeoutExpired). Generous, since the two-core CI machine may be loaded; the faults
# themselves end the jobs within seconds (watchdog 8 s, collective timeout 10 s, worker 4 s).
LIVENESS_S = 600


def command(run_dir: Path, demo_root: Path, fault: str | None = None, restarts: int = 0,
             shutdown_s: int | None = None, stop_grace_s: float | None = None, **extra) -> tuple[list[str], dict]:
    """``shutdown_s``: torchrun's --shutdown-timeout (how long it waits for the other ranks to
    stop after one has failed before it kills them; default 30 s). ``stop_grace_s``: how long a
    rank that makes no progress after a stop signal holds on before it ends (the trainer's
    STOP_GRACE_MIN_S, 10 s; tests/runtime/fault_launch.py sets it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("OMNI_FAULT", None)
    env.pop("OMNI_STOP_GRACE_S", None)
    if stop_grace_s is not None:
        env["OMNI_STOP_GRACE_S"] = str(stop_grace_s)
    if fault:
        env["OMNI_FAULT"] = fault
    shutdown = [] if shutdown_s is None else ["--shutdown-timeout", str(shutdown_s)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), *shutdown, str(LAUNCH), "train",
           *tiny_overrides(demo_root, run_dir, **{**RUN, **extra})]
    return cmd, env


def launch(run_dir: Path, demo_root: Path, fault: str | None = None, restarts: int = 0,
            timeout: float = LIVENESS_S, shutdown_s: int | None = None, stop_grace_s: float | None = None,
            **extra) -> subprocess.CompletedProcess:
    cmd, env = command(run_dir, demo_root, fault, restarts, shutdown_s, stop_grace_s, **extra)
    return subprocess.run(cmd, env=env, cwd=run_dir.parent, capture_output=True, text=True, timeout=timeout)


def losses_of(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def samples_of(run_dir: Path) -> dict[int, dict[str, list[str]]]:
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    return {r["step"]: r["samples"] for r in map(json.loads, lines)}


def all_ids(samples: dict) -> list[str]:
    return [sid for step in sorted(samples) for ids in samples[step].values() for sid in ids]


def resumed_from(out: subprocess.CompletedProcess) -> list[int]:
    return [int(line.rsplit("(step ", 1)[1].rstrip(")")) for line in out.stdout.splitlines()
            if "omni: resumed from" in line]


def error_line(run_dir: Path, demo_root: Path, fault: str, **extra) -> str:
    """Run a job that must fail on its own (not by the test's timeout): its one-line error."""
    # A hung rank holds on to its stop handler until torchrun kills it: 5 s, not 30, after the other
    # failed; or until its own stop grace ends it: 2 s, not 10 (its line is not asserted here).
    out = launch(run_dir, demo_root, fault=fault, shutdown_s=5, stop_grace_s=2,
                  **{"trainer.max_steps": 3, "checkpoint.every": 0, **extra})
    assert out.returncode != 0, out.returncode
    return next(ln for ln in out.stderr.splitlines() if "omni: error:" in ln)


def worker_tracebacks(output: str) -> list[str]:
    """Traceback lines from Omni's own code (a worker's), as opposed to torchrun's own."""
    return [ln for ln in output.splitlines() if ln.strip().startswith('File "') and
            any(f"{os.sep}{pkg}{os.sep}" in ln for pkg in ("omni", "recipes", "parallel", "dataloading"))]
