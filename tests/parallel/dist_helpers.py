"""Run a function on N local gloo ranks (CPU) so that a hang or a failure fails the test."""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60.0) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes, each inside an
    initialised gloo default group. Re-raises a rank's exception; kills all ranks after
    ``timeout_s`` (a deadlock fails instead of blocking the suite)."""
    port = free_port()
    ctx = mp.spawn(_entry, args=(world_size, port, timeout_s, fn, args), nprocs=world_size, join=False)
    deadline = _now() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - _now())):
        if _now() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"run_ranks: {world_size} ranks still running after {timeout_s:.0f}s (hang?)")


def _now() -> float:
    return time.monotonic()


def _entry(rank: int, world_size: int, port: int, timeout_s: float, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # N ranks share two cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
