"""The process layout: which rank does what. Passed around explicitly (no global state).

Only data parallelism is wired at this stage; the 5D mesh (TP/PP/CP/EP) extends this
object without changing how the rest of the code asks it questions.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.config import ParallelConfig


class LayoutError(ValueError):
    """A parallel configuration that cannot run on this launch."""


@dataclass(frozen=True)
class Layout:
    world_size: int
    rank: int
    dp_size: int
    dp_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _pick_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_layout(cfg: ParallelConfig, device: str = "auto") -> Layout:
    """Join (or create) the process group and describe this rank's place in it.

    A single process still gets a real (world size 1) gloo group, so checkpointing and
    collectives take the same code path as a multi-rank launch.
    """
    dev = _pick_device() if device == "auto" else torch.device(device)
    if not dist.is_initialized():
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world if cfg.dp_shard == -1 else cfg.dp_shard
    if dp != world:
        raise LayoutError(
            f"parallel.dp_shard={cfg.dp_shard} does not match the {world} launched ranks; "
            f"set parallel.dp_shard={world} (or -1) or launch {dp} ranks"
        )
    return Layout(world_size=world, rank=rank, dp_size=dp, dp_rank=rank, device=dev)


def barrier() -> None:
    """Wait for every rank (a no-op for a single process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
