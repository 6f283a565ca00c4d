"""A single-process checkpoint leaves no thread behind.

Saved through DCP's planning collectives on the one-rank gloo group, the gathered plans were
copied on gloo's own thread; the OpenMP team that copy started stayed, the process then held
more OpenMP threads than cores, and libgomp gave up spinning at its barriers: every later demo
step took about twice as long. Counting threads (not timing steps) catches it on any machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = r"""
import json, os, sys
import torch
torch.set_num_threads(2)  # the CLI's default here: an OpenMP team of two, as in the demo
sys.path.insert(0, sys.argv[3])
from omni.runtime.trainer import Trainer
from recipe_helpers import tiny_overrides, train

counts = {}
step_once = Trainer._one_step

def counting(self, it, step):
    out = step_once(self, it, step)
    counts[step] = len(os.listdir("/proc/self/task"))
    return out

Trainer._one_step = counting
run_dir = sys.argv[2]
train(tiny_overrides(__import__("pathlib").Path(sys.argv[1]), run_dir, **{
    "checkpoint.every": 2, "trainer.max_steps": 4, "checkpoint.keep_last": 0}))
train(tiny_overrides(__import__("pathlib").Path(sys.argv[1]), run_dir, **{
    "checkpoint.every": 0, "trainer.max_steps": 6, "checkpoint.resume": "auto"}))
print(json.dumps(counts))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_saves_and_resume_in_one_process_start_no_threads(demo_root, tmp_path):
    tests_dir = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(demo_root), str(tmp_path / "run"), str(tests_dir)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "assuming the intent" not in out.stderr  # DCP's one-process warning, on every save and load
    counts = {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    assert sorted(counts) == [1, 2, 3, 4, 5, 6]  # steps 5-6 ran after a resume from step 4
    # Step 1 ends before any save; saves follow steps 2 and 4, the resume loads step 4.
    assert {s: counts[s] for s in counts} == {s: counts[1] for s in counts}, counts
