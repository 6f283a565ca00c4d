"""Parallelism knobs (the ``parallel`` config group)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    # Data-parallel degree; -1 takes every rank of the launch (torchrun's WORLD_SIZE).
    dp_shard: int = -1
    # "auto": nccl on GPU, gloo on CPU.
    backend: str = "auto"
    gpus_per_node: int = 8
