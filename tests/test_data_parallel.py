"""`torchrun ... omni train` on 2 CPU ranks (gloo) equals the single-process run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_helpers import step_losses, tiny_overrides, train

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_ranks_match_single_process(demo_root, tmp_path):
    common = {"trainer.max_steps": 4, "data.global_batch_size": 8}
    single = tmp_path / "single"
    train(tiny_overrides(demo_root, single, **common))
    multi = tmp_path / "multi"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "recipes.cli", "train", *tiny_overrides(demo_root, multi, **common)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = step_losses(single), step_losses(multi)
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)
