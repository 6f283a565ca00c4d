"""Run a function on N local gloo ranks (CPU) so that a hang or a failure fails the test."""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks are forked from a fork server that has imported these once (what a spawned rank spends
# most of its start-up on: about 6 s of CPU per rank on the 2-core CI machine, some 100 ranks per
# suite). The server has run no torch op, so no OpenMP pool or process group is forked with it.
_PRELOAD = ["torch", "torch.distributed", "omni.runtime.trainer", "omni.runtime.parallelize", "parallel.layout"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60.0) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes, each inside an
    initialised gloo default group. Re-raises a rank's exception; kills all ranks after
    ``timeout_s`` (a deadlock fails instead of blocking the suite)."""
    port = free_port()
    mp.set_forkserver_preload(_PRELOAD)
    # The fork server keeps the environment of its own start: each rank gets this one's.
    env = dict(os.environ)
    ctx = mp.start_processes(_entry, args=(world_size, port, timeout_s, env, fn, args), nprocs=world_size,
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


def _entry(rank: int, world_size: int, port: int, timeout_s: float, env: dict, fn, args) -> None:
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # N ranks share two cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
        # Rank 0 hosts the rendezvous store: leaving before the others have built their last
        # group (a subgroup without rank 0 still meets there) resets their connection.
        dist.barrier()
    finally:
        dist.destroy_process_group()
