"""Fault tests, the hangs and the user errors: a real 2-rank `torchrun` job on the CPU demo
(tests/runtime/fault_helpers.py) ends as docs/fault-tolerance.md says:

- a rank that hangs: its watchdog names rank, step and phase, and the job exits non-zero;
  with the watchdog off, the peer's collective times out and says where it was;
- a data worker that hangs: the job exits non-zero naming the sample;
- a user error under torchrun (an impossible layout, before or after the process group starts):
  rank 0 prints its `omni: error:` line once, and torchrun's failure report ends with it.
"""
from __future__ import annotations

import json
import re

import pytest

from fault_helpers import error_line, launch, worker_tracebacks

pytestmark = pytest.mark.slow


def test_hung_rank_is_reported_and_the_job_exits(demo_root, tmp_path):
    run_dir = tmp_path / "run"
    out = launch(run_dir, demo_root, fault="hang:1:2",
                  **{"trainer.hang_timeout_s": 8, "trainer.max_steps": 3, "checkpoint.every": 0})
    assert out.returncode != 0
    # The first watchdog to fire ends the job: the hung rank's, or its peer's, blocked in a
    # collective waiting for it. Either report names its own rank, step and phase and, from the
    # heartbeats, the other's; its Python stacks follow.
    line = next(ln for ln in out.stderr.splitlines() if "made no progress" in ln)
    me = int(line.split("omni: rank ", 1)[1].split()[0])
    assert "at step 2 in 'forward and backward'" in line and "exiting with code 75" in line, line
    assert f"others: rank {1 - me} " in line and "at step 2 'forward and backward'" in line, line
    assert "Current thread" in out.stderr and 'File "' in out.stderr.split("Python stacks follow.", 1)[1]
    beats = {json.loads(p.read_text())["rank"] for p in (run_dir / "heartbeat").glob("rank_*.json")}
    assert beats == {0, 1}


def test_collective_timeout_names_the_waiting_ranks_step(demo_root, tmp_path):
    line = error_line(tmp_path / "run", demo_root, "hang:1:2",
                       **{"trainer.hang_timeout_s": 0, "parallel.timeout_s": 10})
    assert "rank 0: a collective at step 2" in line and "parallel.timeout_s=10" in line, line


def test_hung_data_worker_ends_the_job_naming_the_sample(demo_root, tmp_path):
    line = error_line(tmp_path / "run", demo_root, "worker_hang:0:1",
                       **{"data.num_workers": 1, "data.worker_timeout_s": 4, "trainer.max_steps": 2})
    assert "no step from the data workers in 4 s" in line and "is on sample " in line, line


@pytest.mark.parametrize("mistake,says", [
    ({"parallel.tp": 3}, "= 6, but 2 ranks were launched"),  # refused before the process group starts
    ({"model.init_from": "no/such/run"}, "model.init_from=no/such/run: no such run")],  # after it started
    ids=["tp3_on_2_ranks", "after_the_group_starts"])
def test_a_user_error_under_torchrun_is_one_line_that_ends_torchruns_report(demo_root, tmp_path, mistake, says):
    out = launch(tmp_path / "run", demo_root, **{"trainer.max_steps": 2, **mistake})
    assert out.returncode != 0
    text = out.stdout + out.stderr
    # torchrun prints its failure report after the workers are gone, and a worker cannot keep
    # it from printing; each rank's error file makes the report's root cause end with the line.
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert set(lines[-1]) == {"="}, lines[-3:]
    line = lines[-2].strip().removeprefix("traceback : ")
    assert line.startswith("omni: error: ") and says in line, lines[-3:]
    # Rank 0 prints it; rank 1 exits quietly with the same code (or, should it come second,
    # torchrun's SIGTERM ends it first): never twice, and no worker traceback.
    own = [ln for ln in text.splitlines() if ln.startswith("omni: error: ")]
    printed = sum(ln.count(line) for ln in text.splitlines() if not ln.strip().startswith("traceback : "))
    assert own in ([line], []) and printed == len(own), text[-3000:]
    assert not worker_tracebacks(text), text[-3000:]
    codes = re.findall(r"exitcode\s+: (-?\d+)", out.stderr)
    assert codes[-1] == "2" and set(codes) <= {"2", "-15"}, out.stderr[-3000:]  # the root cause comes last
