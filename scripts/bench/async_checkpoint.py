"""How long a checkpoint save holds the training loop: synchronous vs checkpoint.async_save,
side by side on the same model and disk, with the ratio.

    python scripts/bench/async_checkpoint.py [--sizes 25,100] [--repeats 3]

Sizes are millions of parameters (fp32, AdamW state included, so ~12 bytes per parameter
are saved). One process (a world-size-1 gloo group), CPU tensors: "the copy to host" is a
memory copy here; on a GPU it is the device-to-host transfer.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from omni.runtime.checkpoint import Checkpointer  # noqa: E402
from omni.runtime.config import CheckpointConfig, OptimConfig  # noqa: E402
from omni.runtime.optim import PartOptimizers  # noqa: E402
from parallel.config import ParallelConfig  # noqa: E402
from parallel.layout import init_layout, shutdown  # noqa: E402


def _model(millions: int) -> tuple[torch.nn.Module, PartOptimizers]:
    width = 2048
    layers = max(1, round(millions * 1e6 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optim = PartOptimizers([model], OptimConfig(warmup_steps=1), total_steps=10)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()  # Adam moments exist, as in training
    return model, optim


def _time_saves(optim, root: Path, async_save: bool, repeats: int) -> tuple[list[float], list[float]]:
    ckpt = Checkpointer(CheckpointConfig(async_save=async_save, keep_last=1, dir=str(root)), root, rank=0)
    blocked, total = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        ckpt.save(i + 1, optim, {})
        blocked.append(time.perf_counter() - t0)
        ckpt.wait()
        total.append(time.perf_counter() - t0)
    ckpt.close()
    return blocked, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="25,100", help="model sizes, millions of parameters")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    init_layout(ParallelConfig(), device="cpu")
    try:
        print("| parameters | saved | sync: step held (s) | async: step held (s) | async: until published (s) "
              "| held, async / sync |")
        print("|---|---|---|---|---|---|")
        for m in (int(x) for x in args.sizes.split(",")):
            model, optim = _model(m)
            n = sum(p.numel() for p in model.parameters())
            with tempfile.TemporaryDirectory() as d:
                sync_blocked, _ = _time_saves(optim, Path(d) / "sync", False, args.repeats)
                async_blocked, async_total = _time_saves(optim, Path(d) / "async", True, args.repeats)
                saved = sum(f.stat().st_size for f in (Path(d) / "async").rglob("*") if f.is_file())
            s, a, t = (statistics.median(x) for x in (sync_blocked, async_blocked, async_total))
            print(f"| {n / 1e6:.0f}M | {saved / 2**20:.0f} MiB | {s:.2f} | {a:.2f} | {t:.2f} | {a / s:.2f}x |",
                  flush=True)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
