"""Fault tests: a real 2-rank `torchrun` job on the CPU demo, with one fault injected from
outside (tests/runtime/fault_launch.py), ends as docs/fault-tolerance.md says:

- a rank SIGKILLed mid-step or mid-save: torchrun --max-restarts restarts the job, which resumes
  from the last complete checkpoint; every logged loss equals the uninterrupted run's, bit for
  bit, and every step trains on the same samples (none lost, none repeated);
- the same checkpoints resumed by one process (a different world size): the data is re-planned
  (same global batches) and DCP reshards the state; losses equal to the float-sum tolerance;
- Ctrl-C (SIGINT to torchrun's process group, as a terminal sends it) mid-interval: every rank
  stops after the same step with a checkpoint there, rank 0 alone says so, and the same command
  resumes there with the uninterrupted run's losses and samples;

Hangs and user errors: test_faults_hangs.py (a file of its own so that two test processes share
the fault tests).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from fault_helpers import (LIVENESS_S, RUN, STEPS, all_ids, command, launch, losses_of, resumed_from, samples_of,
                           worker_tracebacks)
from recipe_helpers import read_metrics, tiny_overrides, train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(demo_root, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faults") / "reference"
    out = launch(run_dir, demo_root)
    assert out.returncode == 0, out.stderr[-3000:]
    losses, samples = losses_of(run_dir), samples_of(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1)) and sorted(samples) == list(range(1, STEPS + 1))
    ids = all_ids(samples)
    assert len(ids) == STEPS * 8 and len(set(ids)) == len(ids)  # one epoch: no sample twice
    return run_dir, losses, samples


def test_rank_killed_mid_step_restarts_from_last_checkpoint_exactly(reference, demo_root, tmp_path):
    _, ref_losses, ref_samples = reference
    run_dir = tmp_path / "run"
    # Asynchronous saves here: the step-4 checkpoint may still be in flight when rank 1 dies.
    out = launch(run_dir, demo_root, fault="kill_mid_step:1:5", restarts=1, **{"checkpoint.async_save": True})
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = resumed_from(out)
    assert len(resumed) == 1 and resumed[0] in (2, 4), out.stdout
    assert losses_of(run_dir) == ref_losses  # bit for bit, every step
    assert samples_of(run_dir) == ref_samples  # same samples, same ranks, each step once
    blocked = [r for r in read_metrics(run_dir) if r.get("event") == "checkpoint"]
    assert blocked and all(r["blocked_s"] >= 0 for r in blocked)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_rank_killed_mid_save_resumes_from_the_previous_checkpoint(reference, demo_root, tmp_path):
    _, ref_losses, ref_samples = reference
    run_dir = tmp_path / "run"
    # Rank 0 dies with every shard of step 4 written, before the manifest: step 4 never appears.
    out = launch(run_dir, demo_root, fault="kill_mid_save:0:4", restarts=1)
    assert out.returncode == 0, out.stderr[-3000:]
    assert resumed_from(out) == [2], out.stdout
    assert losses_of(run_dir) == ref_losses
    assert samples_of(run_dir) == ref_samples
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000004", "step_00000006"]  # the redone step 4, no .tmp-


def test_resume_on_a_different_world_size_replans_data_and_reshards(reference, demo_root, tmp_path):
    ref_dir, ref_losses, ref_samples = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir / "checkpoints" / "step_00000004", run_dir / "checkpoints" / "step_00000004")
    # One process picks up what two saved: DCP reshards the FSDP state, the planner re-plans
    # step 5 onwards for one data-parallel rank.
    over = {**RUN, "parallel.dp_shard": -1}
    result = train(tiny_overrides(demo_root, run_dir, **over))
    assert result.last_step == STEPS
    losses, samples = losses_of(run_dir), samples_of(run_dir)
    assert sorted(losses) == [5, 6]
    for step in (5, 6):
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5)
        # The same global batch, arranged for one rank instead of two.
        assert sorted(samples[step]["0"]) == sorted(sid for ids in ref_samples[step].values() for sid in ids)


def test_ctrl_c_under_torchrun_stops_every_rank_after_one_step_with_a_checkpoint(reference, demo_root, tmp_path):
    _, ref_losses, ref_samples = reference
    run_dir = tmp_path / "run"
    # A data worker too: it must outlive the signal torchrun forwards to the rank's process group.
    extra = {"checkpoint.every": 100, "data.num_workers": 1}
    cmd, env = command(run_dir, demo_root, **extra)
    # torchrun in a process group of its own, as a shell runs it; its workers are in sessions of
    # their own (torchrun starts them so), so the terminal's SIGINT reaches torchrun only, which
    # forwards it to every worker.
    proc = subprocess.Popen(cmd, env=env, cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + LIVENESS_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=LIVENESS_S)[0]
    assert proc.returncode != 0  # torchrun's own status after a signal: 1
    # rank 0's line; rank 1 stopped at the same step, quietly
    assert out.count("omni: stopped at step ") == 1, out[-3000:]
    stopped = [ln for ln in out.splitlines() if ln.startswith("omni: stopped at step ")]
    step = int(stopped[0].split()[4])
    assert 1 <= step < STEPS, stopped
    assert stopped[0].endswith(f"checkpoints/step_{step:08d}; run the same command again to resume from step {step}")
    assert "omni: interrupted" not in out and "KeyboardInterrupt" not in out and not worker_tracebacks(out), out
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == [f"step_{step:08d}"], names
    again = launch(run_dir, demo_root, **extra)  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    assert resumed_from(again) == [step], again.stdout
    losses = losses_of(run_dir)
    assert sorted(losses) == sorted(ref_losses)
    for s in losses:
        assert losses[s] == pytest.approx(ref_losses[s], rel=1e-5), s
    assert samples_of(run_dir) == ref_samples  # none lost, none repeated
