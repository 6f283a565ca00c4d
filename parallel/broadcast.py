"""Broadcast a picklable Python object (e.g. a step's batch) within a process group."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """``obj`` from global rank ``src`` to every rank of ``group``; returns it on every rank.

    Tensors inside travel pickled (the batch is small next to activations), so this works on
    gloo and nccl alike; a group of one returns ``obj`` without communicating.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
