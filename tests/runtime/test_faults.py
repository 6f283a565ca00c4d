"""Fault tests: a real 2-rank `torchrun` job on the CPU demo, with one fault injected from
outside (tests/runtime/fault_launch.py), ends as docs/fault-tolerance.md says:

- a rank SIGKILLed mid-step or mid-save: torchrun --max-restarts restarts the job, which resumes
  from the last complete checkpoint; every logged loss equals the uninterrupted run's, bit for
  bit, and every step trains on the same samples (none lost, none repeated);
- the same checkpoints resumed by one process (a different world size): the data is re-planned
  (same global batches) and DCP reshards the state; losses equal to the float-sum tolerance;
- a rank that hangs: its watchdog names rank, step and phase, and the job exits non-zero;
  with the watchdog off, the peer's collective times out and says where it was;
- a data worker that hangs: the job exits non-zero naming the sample;
- Ctrl-C (SIGINT to torchrun's process group, as a terminal sends it) mid-interval: every rank
  stops after the same step with a checkpoint there, rank 0 alone says so, and the same command
  resumes there with the uninterrupted run's losses and samples;
- a user error under torchrun (an impossible layout, before or after the process group starts):
  rank 0 prints its `omni: error:` line once, and torchrun's failure report ends with it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipe_helpers import read_metrics, tiny_overrides, train

REPO = Path(__file__).resolve().parents[2]
LAUNCH = Path(__file__).with_name("fault_launch.py")
STEPS = 6
RUN = {"trainer.max_steps": STEPS, "data.global_batch_size": 8, "checkpoint.every": 2, "checkpoint.keep_last": 0,
       "trainer.log_samples": True, "parallel.dp_shard": 2}

pytestmark = pytest.mark.slow


# A liveness limit, not a performance bound: a job that has not ended by then hangs (the test
# fails with TimeoutExpired). Generous, since the two-core CI machine may be loaded; the faults
# themselves end the jobs within seconds (watchdog 8 s, collective timeout 10 s, worker 4 s).
LIVENESS_S = 600


def _command(run_dir: Path, demo_root: Path, fault: str | None = None, restarts: int = 0,
             shutdown_s: int | None = None, **extra) -> tuple[list[str], dict]:
    """``shutdown_s``: torchrun's --shutdown-timeout (how long it waits for the other ranks to
    stop after one has failed before it kills them; default 30 s)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("OMNI_FAULT", None)
    if fault:
        env["OMNI_FAULT"] = fault
    shutdown = [] if shutdown_s is None else ["--shutdown-timeout", str(shutdown_s)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), *shutdown, str(LAUNCH), "train",
           *tiny_overrides(demo_root, run_dir, **{**RUN, **extra})]
    return cmd, env


def _launch(run_dir: Path, demo_root: Path, fault: str | None = None, restarts: int = 0,
            timeout: float = LIVENESS_S, shutdown_s: int | None = None, **extra) -> subprocess.CompletedProcess:
    cmd, env = _command(run_dir, demo_root, fault, restarts, shutdown_s, **extra)
    return subprocess.run(cmd, env=env, cwd=run_dir.parent, capture_output=True, text=True, timeout=timeout)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def _samples(run_dir: Path) -> dict[int, dict[str, list[str]]]:
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    return {r["step"]: r["samples"] for r in map(json.loads, lines)}


def _all_ids(samples: dict) -> list[str]:
    return [sid for step in sorted(samples) for ids in samples[step].values() for sid in ids]


@pytest.fixture(scope="module")
def reference(demo_root, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faults") / "reference"
    out = _launch(run_dir, demo_root)
    assert out.returncode == 0, out.stderr[-3000:]
    losses, samples = _losses(run_dir), _samples(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1)) and sorted(samples) == list(range(1, STEPS + 1))
    ids = _all_ids(samples)
    assert len(ids) == STEPS * 8 and len(set(ids)) == len(ids)  # one epoch: no sample twice
    return run_dir, losses, samples


def _resumed_from(out: subprocess.CompletedProcess) -> list[int]:
    return [int(line.rsplit("(step ", 1)[1].rstrip(")")) for line in out.stdout.splitlines()
            if "omni: resumed from" in line]


def test_rank_killed_mid_step_restarts_from_last_checkpoint_exactly(reference, demo_root, tmp_path):
    _, ref_losses, ref_samples = reference
    run_dir = tmp_path / "run"
    # Asynchronous saves here: the step-4 checkpoint may still be in flight when rank 1 dies.
    out = _launch(run_dir, demo_root, fault="kill_mid_step:1:5", restarts=1, **{"checkpoint.async_save": True})
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = _resumed_from(out)
    assert len(resumed) == 1 and resumed[0] in (2, 4), out.stdout
    assert _losses(run_dir) == ref_losses  # bit for bit, every step
    assert _samples(run_dir) == ref_samples  # same samples, same ranks, each step once
    blocked = [r for r in read_metrics(run_dir) if r.get("event") == "checkpoint"]
    assert blocked and all(r["blocked_s"] >= 0 for r in blocked)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_rank_killed_mid_save_resumes_from_the_previous_checkpoint(reference, demo_root, tmp_path):
    _, ref_losses, ref_samples = reference
    run_dir = tmp_path / "run"
    # Rank 0 dies with every shard of step 4 written, before the manifest: step 4 never appears.
    out = _launch(run_dir, demo_root, fault="kill_mid_save:0:4", restarts=1)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _resumed_from(out) == [2], out.stdout
    assert _losses(run_dir) == ref_losses
    assert _samples(run_dir) == ref_samples
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
    losses, samples = _losses(run_dir), _samples(run_dir)
    assert sorted(losses) == [5, 6]
    for step in (5, 6):
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5)
        # The same global batch, arranged for one rank instead of two.
        assert sorted(samples[step]["0"]) == sorted(sid for ids in ref_samples[step].values() for sid in ids)


def test_hung_rank_is_reported_and_the_job_exits(demo_root, tmp_path):
    run_dir = tmp_path / "run"
    out = _launch(run_dir, demo_root, fault="hang:1:2",
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


def _error_line(run_dir: Path, demo_root: Path, fault: str, **extra) -> str:
    """Run a job that must fail on its own (not by the test's timeout): its one-line error."""
    # A hung rank holds on to its stop handler until torchrun kills it: 5 s, not 30, after the other failed.
    out = _launch(run_dir, demo_root, fault=fault, shutdown_s=5,
                  **{"trainer.max_steps": 3, "checkpoint.every": 0, **extra})
    assert out.returncode != 0, out.returncode
    return next(ln for ln in out.stderr.splitlines() if "omni: error:" in ln)


def test_collective_timeout_names_the_waiting_ranks_step(demo_root, tmp_path):
    line = _error_line(tmp_path / "run", demo_root, "hang:1:2",
                       **{"trainer.hang_timeout_s": 0, "parallel.timeout_s": 10})
    assert "rank 0: a collective at step 2" in line and "parallel.timeout_s=10" in line, line


def test_hung_data_worker_ends_the_job_naming_the_sample(demo_root, tmp_path):
    line = _error_line(tmp_path / "run", demo_root, "worker_hang:0:1",
                       **{"data.num_workers": 1, "data.worker_timeout_s": 4, "trainer.max_steps": 2})
    assert "no step from the data workers in 4 s" in line and "is on sample " in line, line


def _worker_tracebacks(output: str) -> list[str]:
    """Traceback lines from Omni's own code (a worker's), as opposed to torchrun's own."""
    return [ln for ln in output.splitlines() if ln.strip().startswith('File "') and
            any(f"{os.sep}{pkg}{os.sep}" in ln for pkg in ("omni", "recipes", "parallel", "dataloading"))]


def test_ctrl_c_under_torchrun_stops_every_rank_after_one_step_with_a_checkpoint(reference, demo_root, tmp_path):
    _, ref_losses, ref_samples = reference
    run_dir = tmp_path / "run"
    # A data worker too: it must outlive the signal torchrun forwards to the rank's process group.
    extra = {"checkpoint.every": 100, "data.num_workers": 1}
    cmd, env = _command(run_dir, demo_root, **extra)
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
    assert "omni: interrupted" not in out and "KeyboardInterrupt" not in out and not _worker_tracebacks(out), out
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == [f"step_{step:08d}"], names
    again = _launch(run_dir, demo_root, **extra)  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    assert _resumed_from(again) == [step], again.stdout
    losses = _losses(run_dir)
    assert sorted(losses) == sorted(ref_losses)
    for s in losses:
        assert losses[s] == pytest.approx(ref_losses[s], rel=1e-5), s
    assert _samples(run_dir) == ref_samples  # none lost, none repeated


@pytest.mark.parametrize("mistake,says", [
    ({"parallel.tp": 3}, "= 6, but 2 ranks were launched"),  # refused before the process group starts
    ({"model.init_from": "no/such/run"}, "model.init_from=no/such/run: no such run")],  # after it started
    ids=["tp3_on_2_ranks", "after_the_group_starts"])
def test_a_user_error_under_torchrun_is_one_line_that_ends_torchruns_report(demo_root, tmp_path, mistake, says):
    out = _launch(tmp_path / "run", demo_root, **{"trainer.max_steps": 2, **mistake})
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
    assert not _worker_tracebacks(text), text[-3000:]
    codes = re.findall(r"exitcode\s+: (-?\d+)", out.stderr)
    assert codes[-1] == "2" and set(codes) <= {"2", "-15"}, out.stderr[-3000:]  # the root cause comes last
