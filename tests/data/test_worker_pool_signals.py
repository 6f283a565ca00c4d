"""A data-plane pool ends on its terminate whatever SIGTERM handler its parent holds.

The suite hung here once: a pool was started while the process held a handler that only sets a
flag (a stop handler left behind, or a library's); its workers inherited it, ``Pool.terminate``'s
SIGTERM set the flag in each worker, the workers kept waiting on their task queue and the pool
waited for them forever (py-spy: the parent in ``Pool._terminate_pool``, a worker in
``SimpleQueue.get``). Resetting the handlers in the worker's initializer was not enough: a pool
terminated right after it started (two jobs, one worker fast enough for both) sent its SIGTERM to
a worker that had not run its initializer yet, and the suite hung again in
tests/test_threads.py; the signals are blocked across the fork now."""
import signal
import subprocess
import sys
import textwrap

import pytest

from dataloading.processes import imap_in_workers

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="POSIX signals")

_SCRIPT = textwrap.dedent("""
    import os, signal, time
    from dataloading.processes import imap_in_workers, worker_pool
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a flag-only handler, inherited by forks
    def job(i):
        time.sleep(0.01)
        return i
    for _ in range(5):
        it = imap_in_workers(job, range(200), 2)
        assert next(it) == 0
        it.close()  # the pool is terminated with jobs still queued
    # Libraries' fork hooks (torch's, wandb's, OpenTelemetry's) make a child slow to start.
    os.register_at_fork(after_in_child=lambda: time.sleep(0.05))
    for _ in range(10):
        with worker_pool(2):
            pass  # terminated at once: its SIGTERMs reach workers still starting
    print("ended")
""")


def test_a_pool_left_early_terminates_under_a_flag_only_parent_handler():
    # In a child interpreter: a hang must fail this test, not the suite (timeout for liveness only).
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ended", out.stderr


def _handlers(_):
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_pool_workers_get_the_default_handlers():
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        assert list(imap_in_workers(_handlers, range(2), workers=2)) == [(True, True), (True, True)]
    finally:
        signal.signal(signal.SIGTERM, previous)
