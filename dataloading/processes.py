"""Worker processes for the data plane's CPU-bound passes (indexing, token counting,
conversion) and its loader: one start method, one pool set-up and one "in order, in a pool"
loop for all."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from typing import Any, Callable, Iterable, Iterator

# The thread pools of the numeric libraries read these when they load (a spawned worker, or a
# library a worker imports first).
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def worker_context():
    """fork where the platform has it: the workers need no torch and start in milliseconds
    (spawn would import it again in each)."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def one_thread() -> None:
    """Keep a worker at one compute thread: a pool has a worker per core already, and a forked
    worker would otherwise start an OpenMP team as large as its parent's in its first torch op
    (workers x threads on the cores). torch's DataLoader workers do the same for themselves."""
    for var in _THREAD_VARS:
        os.environ[var] = "1"
    torch = sys.modules.get("torch")  # set only when loaded: a worker need not import torch
    if torch is not None:
        torch.set_num_threads(1)


def default_signals() -> None:
    """A pool worker ends on its pool's SIGTERM (``Pool.terminate``) whatever handler it inherited
    from its parent: a handler that only sets a flag (a training run's stop handler, a library's)
    leaves the worker waiting on its task queue and the pool's terminate waiting for it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _init_worker(initializer: Callable[..., None] | None, initargs: tuple, mask: set | None) -> None:
    default_signals()
    if mask is not None:  # the parent's mask, now that a terminate can only end this worker
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    one_thread()
    if initializer is not None:
        initializer(*initargs)


def worker_pool(workers: int, initializer: Callable[..., None] | None = None, initargs: tuple = ()):
    """A pool of ``workers`` processes, each at one compute thread, then set up by
    ``initializer(*initargs)``.

    SIGINT and SIGTERM are blocked while the workers are forked (a child inherits the mask) and
    unblocked in each worker once it has the default handlers: a ``terminate`` that reaches a
    worker still starting waits for that, instead of running the parent's handler in the child
    (which, if it only sets a flag, left the worker waiting on its task queue and the pool's
    terminate waiting for the worker: a hung test suite, twice). The parent's own signals
    arriving meanwhile are delivered when the pool exists."""
    can_mask = hasattr(signal, "pthread_sigmask")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS) if can_mask else None
    try:
        return worker_context().Pool(workers, initializer=_init_worker, initargs=(initializer, initargs, mask))
    finally:
        if can_mask:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def imap_in_workers(fn: Callable[[Any], Any], jobs: Iterable, workers: int,
                    initializer: Callable[..., None] | None = None, initargs: tuple = ()) -> Iterator:
    """``fn`` over ``jobs``, results in job order: in this process with one worker (no pool to
    start), else in a pool of ``workers`` processes each set up by ``initializer(*initargs)``."""
    if workers == 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, jobs)
        return
    with worker_pool(workers, initializer, initargs) as pool:
        yield from pool.imap(fn, jobs)
