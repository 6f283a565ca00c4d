"""Shared helpers for the end-to-end recipe tests."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from recipes.compose import compose_config
from recipes.train import run

REPO = Path(__file__).resolve().parents[1]


def tiny_overrides(demo_root: Path, run_dir: Path, **extra: object) -> list[str]:
    """A fast configuration of the demo: small batches, no progress bar, no final eval."""
    base = {
        "data.mixture": str(demo_root / "mixture.yaml"),
        "data.eval_dir": str(demo_root / "eval"),
        "data.global_batch_size": 4,
        "data.num_workers": 0,
        "trainer.run_dir": str(run_dir),
        "trainer.progress": False,
        "trainer.eval_at_end": False,
        "trainer.max_steps": 4,
        "optim.warmup_steps": 2,
        "checkpoint.every": 0,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def train(overrides: list[str]):
    return run(OmegaConf.to_object(compose_config(overrides)))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def step_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def ranks_train(nproc: int, overrides: list[str], timeout_s: float = 300.0) -> None:
    """`omni train` on ``nproc`` CPU ranks (gloo) forked from the suite's preloaded fork server
    (``dist_helpers.run_ranks``): what torchrun launches, the run joining the group the ranks
    already share, without each rank importing torch and Omni anew (some 6 s of CPU a rank on
    the 2-core machine). tests/parallel/test_cli_layouts.py keeps the user's launch
    (``torchrun_train``)."""
    parallel = str(REPO / "tests" / "parallel")
    if parallel not in sys.path:
        sys.path.insert(0, parallel)
    from dist_helpers import run_ranks

    run_ranks(_train_rank, nproc, [str(o) for o in overrides], timeout_s=timeout_s)


def _train_rank(rank: int, world_size: int, overrides: list[str]) -> None:
    train(overrides)


def torchrun_train(nproc: int, overrides: list[str], cwd: Path) -> None:
    """`omni train` on ``nproc`` CPU ranks (gloo) through torchrun, as a user launches it."""
    omni = shutil.which("omni", path=str(Path(sys.executable).parent))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    if omni:  # the user-facing path: torchrun --no-python omni train ...
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--no-python", omni, "train", *overrides]
    else:  # not installed as a script (e.g. a bare checkout): the same CLI as a module
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "recipes.cli", "train", *overrides]
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-2000:] + out.stderr[-4000:])
