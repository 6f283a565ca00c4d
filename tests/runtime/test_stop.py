"""Ctrl-C and SIGTERM (omni/runtime/stop.py, docs/fault-tolerance.md "Stopping a run"): the
first signal stops the run after the step every rank agrees on, with a checkpoint there, and the
same command resumes from it with the losses of an uninterrupted run; a second signal stops at
once and says which steps that loses; the last line is printed once per job (rank 0 under
torchrun) and also goes to torchelastic's error file. The 2-rank torchrun cases are in
tests/runtime/test_faults.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from omni.runtime import stop as stop_mod
from omni.runtime.stop import RunStopped, StopNow, StopOnSignal
from omni.runtime.trainer import Trainer
from recipe_helpers import read_metrics, tiny_overrides, train
from recipes.errors import last_line

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def _signal_at(monkeypatch, at: dict[tuple[int, str], int]) -> None:
    """Send this process the signal ``at[(step, phase)]`` when the trainer enters that phase of
    that step: as a signal from outside would arrive, at a chosen point."""
    phase = Trainer._phase

    def patched(self, name):
        phase(self, name)
        sig = at.get((self._step, name))
        if sig is not None:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(Trainer, "_phase", patched)


@pytest.fixture(scope="module")
def reference(demo_root, tmp_path_factory):
    """The uninterrupted run's losses."""
    run_dir = tmp_path_factory.mktemp("stop") / "reference"
    train(tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": STEPS}))
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_a_signal_mid_interval_saves_that_step_and_the_rerun_resumes_there(reference, demo_root, tmp_path,
                                                                           monkeypatch):
    run_dir = tmp_path / "run"
    over = tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": STEPS, "checkpoint.every": 100})
    # SIGINT while step 3 runs, before its sums: every rank's flag rides in step 3's all-reduce.
    _signal_at(monkeypatch, {(3, "gradient sync"): signal.SIGINT})
    # What the process had: Python's default_int_handler, or SIG_IGN when it was started in the
    # background of a non-interactive shell (its SIGINT ignored from the start)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(RunStopped) as stopped:
        train(over)
    saved = run_dir / "checkpoints" / "step_00000003"
    assert stopped.value.exit_code == 130
    assert str(stopped.value) == (f"stopped at step 3 (Ctrl-C): checkpoint saved to {saved}; run the same command "
                                  "again to resume from step 3")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003"]
    assert signal.getsignal(signal.SIGINT) is before  # restored
    monkeypatch.undo()
    result = train(over)  # the same command
    assert result.last_step == STEPS
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert losses[step] == pytest.approx(reference[step], rel=1e-5), step


def test_a_second_signal_stops_at_once_and_says_what_is_lost(demo_root, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(stop_mod, "SAME_REQUEST_S", 0.0)
    # The first signal during step 4; the second while the stop's checkpoint is being saved.
    _signal_at(monkeypatch, {(4, "forward and backward"): signal.SIGINT, (4, "checkpoint save"): signal.SIGTERM})
    with pytest.raises(RunStopped) as stopped:
        train(tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": STEPS, "checkpoint.every": 2}))
    assert stopped.value.exit_code == 143  # the signal that stopped it at once
    assert str(stopped.value) == ("interrupted during step 4 (Ctrl-C, then SIGTERM), without saving: steps 3-4 are "
                                  "lost; run the same command again to resume from step 2")
    done = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith(".tmp-"))
    assert done == ["step_00000002"]
    # The stop's watch ends with the run, however it ended: left running (in a save's phase, which
    # it waits out) it would outlive the run in a process that goes on, as a test suite does.
    deadline = time.monotonic() + 5  # the watch looks every 0.25 s
    while any(t.name == "omni-stop-grace" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "omni-stop-grace" for t in threading.enumerate())


def test_a_duplicate_delivery_is_one_request_and_data_workers_leave_it_to_the_main_process():
    # what was there before (a library's handler left by an earlier test: Ray's driver sets one)
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal(announce=False) as stop:
        # A child forked meanwhile (a data worker) gets a process group of its own, out of reach
        # of signals sent to the training process's group, and the default handlers: a signal
        # sent to it alone (its pool's terminate) ends it as it would have.
        pid = os.fork()
        if pid == 0:
            own_group = os.getpgid(0) == os.getpid()
            defaults = (signal.getsignal(signal.SIGINT) is signal.default_int_handler
                        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
            os._exit((0 if own_group else 1) + (0 if defaults else 2))
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 and not stop.requested
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's copy and torchrun's, milliseconds apart
        except StopNow:
            pytest.fail("a signal delivered twice stopped the run at once")
        assert stop.signum == signal.SIGTERM and stop.second is None
        stop._first_at -= stop_mod.SAME_REQUEST_S
        with pytest.raises(StopNow):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.second == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) == (signal.SIG_DFL if before is None else before)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_the_last_line_once_per_job_and_in_torchelastics_report(tmp_path, monkeypatch, capsys, rank):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", rank)
    line = "omni: error: parallel.tp=3 does not divide 2 ranks"
    last_line(line)
    printed = capsys.readouterr().err
    assert printed == (f"{line}\n" if rank == "0" else "")  # the others leave it to the report
    failure = ProcessFailure(local_rank=int(rank), pid=1, exitcode=2, error_file=str(error_file))
    report = str(ChildFailedError("omni", {int(rank): failure}))
    assert report.strip().splitlines()[-2].strip() == f"traceback : {line}"
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")  # another launcher: every rank prints
    last_line(line)
    assert capsys.readouterr().err == f"{line}\n"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_process_group_stops_omni_train_with_a_checkpoint(reference, demo_root, tmp_path, sig):
    """The real thing: `omni train` in a process group of its own (as a shell runs it), with a
    data worker process, and the signal to the whole group once metrics.jsonl shows step 2: a
    terminal's Ctrl-C, or SIGTERM as torchrun forwards it to each worker's group. The data
    worker must outlive it (torch's workers die on a SIGTERM not sent by their parent)."""
    run_dir = tmp_path / "run"
    over = tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": STEPS, "checkpoint.every": 100,
                                                 "data.num_workers": 1})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "recipes.cli", "train", *over], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300  # liveness only
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and "omni: interrupted" not in err, err
    stopped = lines[-1]
    assert stopped.startswith("omni: stopped at step ") and stopped.endswith("; run the same command again to "
                                                                              "resume from step " + stopped.split()[4])
    step = int(stopped.split()[4])
    assert 2 <= step < STEPS, stopped  # mid-run: the signal came after step 2's line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{step:08d}"]
    assert max(_losses(run_dir)) == step
    result = train(over)  # the same command again
    assert result.last_step == STEPS
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert losses[s] == pytest.approx(reference[s], rel=1e-5), s


def test_a_child_forked_under_the_stop_handler_ends_on_its_own_signals():
    """A process forked while the handler is installed (a pool of the data plane, a data worker)
    gets the default handlers back: a SIGTERM sent to it alone (a pool's terminate) ends it. With
    the parent's handler inherited it raised a flag nobody read, and the pool waited forever."""
    import os

    ready_r, ready_w = os.pipe()
    with StopOnSignal(announce=False):
        pid = os.fork()
        if pid == 0:  # the child: wait for the parent's SIGTERM; a kept handler would let it time out
            signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
            signal.alarm(5)
            os.write(ready_w, b"1")  # running, its handlers as the fork left them
            while True:
                signal.pause()
        os.read(ready_r, 1)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    os.close(ready_r)
    os.close(ready_w)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status


def test_a_rank_stuck_after_the_signal_ends_instead_of_holding_it():
    """torchrun signals every rank when one has failed; a rank stuck with the dead one (in a
    collective, or hung) took the signal into its handler and held on until torchrun killed it
    30 s later. After the first signal a rank without progress for the grace ends at once; one
    whose phases move on, or in a save, is left alone."""
    import threading

    def child(progress, stopped) -> int:
        pid = os.fork()
        if pid == 0:
            stop_mod.exit_if_stuck(signal.SIGTERM, progress, stopped, 0.5, rank=1)
            time.sleep(1.5)
            os._exit(0)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    frozen = (2, "forward and backward", time.monotonic() - 100)
    assert child(lambda: frozen, lambda: False) == 143
    moving = lambda: (2, "forward and backward", time.monotonic())  # noqa: E731
    assert child(moving, lambda: False) == 0
    assert child(lambda: (2, "checkpoint save", time.monotonic() - 100), lambda: False) == 0
    agreed = threading.Event()
    agreed.set()
    assert child(lambda: frozen, agreed.is_set) == 0
