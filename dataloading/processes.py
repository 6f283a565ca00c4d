"""Worker processes for the data plane's CPU-bound passes (indexing, token counting,
conversion) and its loader: one start method and one "in order, in a pool" loop for all."""
from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable, Iterable, Iterator


def worker_context():
    """fork where the platform has it: the workers need no torch and start in milliseconds
    (spawn would import it again in each)."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def imap_in_workers(fn: Callable[[Any], Any], jobs: Iterable, workers: int,
                    initializer: Callable[..., None] | None = None, initargs: tuple = ()) -> Iterator:
    """``fn`` over ``jobs``, results in job order: in this process with one worker (no pool to
    start), else in a pool of ``workers`` processes each set up by ``initializer(*initargs)``."""
    if workers == 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, jobs)
        return
    with worker_context().Pool(workers, initializer=initializer, initargs=initargs) as pool:
        yield from pool.imap(fn, jobs)
