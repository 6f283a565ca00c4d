"""Scalar reductions over all ranks (metrics, loss normalisation). Gradients are reduced by FSDP
and ``omni.runtime.parallelize.ParallelModel.sync_gradients``."""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sums(values: list[float], device: torch.device) -> list[float]:
    """Sum several scalars over all ranks in one all-reduce."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()
