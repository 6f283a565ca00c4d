"""Shared helpers for the end-to-end recipe tests."""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from recipes.compose import compose_config
from recipes.train import run


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
