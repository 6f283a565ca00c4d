"""Run a function on N local gloo ranks (CPU) so that a hang or a failure fails the test."""
from __future__ import annotations

import datetime
import faulthandler
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks are forked from a fork server that has imported these once (what a spawned rank spends
# most of its start-up on: about 6 s of CPU per rank on the 2-core CI machine, some 100 ranks per
# suite). The server has run no torch op, so no OpenMP pool or process group is forked with it.
# triton_interpreter: the ranks interpret kernels as the test process does (tests/triton_interpreter.py)
_PRELOAD = ["torch", "torch.distributed", "omni.runtime.trainer", "omni.runtime.parallelize", "parallel.layout",
            "triton_interpreter"]


def rendezvous_file() -> str:
    """A fresh path for a FileStore rendezvous (``init_method="file://..."``).

    Not a TCP port picked ahead of time: a port found free here can be taken by another process
    before rank 0 binds it (a gloo listener of a job running beside this one, with two pytest
    workers), and the ranks then connect to that process instead. The file is private to this
    call; gloo's own listeners bind the ports the kernel gives them."""
    fd, path = tempfile.mkstemp(prefix="omni_rdzv_")
    os.close(fd)
    os.unlink(path)  # FileStore creates it; a leftover file from another run would hold stale keys
    return path


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60.0) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes, each inside an
    initialised gloo default group. Re-raises a rank's exception; kills all ranks after
    ``timeout_s`` (a deadlock fails instead of blocking the suite)."""
    store = rendezvous_file()
    mp.set_forkserver_preload(_PRELOAD)
    # The fork server keeps the environment of its own start: each rank gets this one's.
    env = dict(os.environ)
    ctx = mp.start_processes(_entry, args=(world_size, store, timeout_s, env, fn, args), nprocs=world_size,
                             join=False, start_method="forkserver")
    deadline = _now() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - _now())):
        if _now() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"run_ranks: {world_size} ranks still running after {timeout_s:.0f}s (hang?)")


def _now() -> float:
    return time.monotonic()


def _entry(rank: int, world_size: int, store: str, timeout_s: float, env: dict, fn, args) -> None:
    # A rank that dies of a signal (a native crash, glibc's heap checks) prints its Python stack.
    faulthandler.enable(all_threads=True)
    os.environ.clear()
    os.environ.update(env, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # N ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
        # Every rank waits for the others before leaving: a rank that destroys its group while
        # a peer still builds its last subgroup resets that peer's connection. A whole
        # `omni train` (recipe_helpers.ranks_train) has already closed its group.
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_results(out_dir, world_size: int):
    """(rank, what it pickled to ``out_dir/rank{rank}.pkl``), rank by rank: what the workers of a
    ``run_ranks`` call wrote."""
    import pickle

    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
            yield rank, pickle.load(f)
