"""Scalar reductions over all ranks (metrics, loss normalisation). Gradients are reduced by FSDP
and ``omni.runtime.parallelize.ParallelModel.sync_gradients``."""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sums(values: list[float], device: torch.device, group: dist.ProcessGroup | None = None) -> list[float]:
    """Sum several scalars over the ranks of ``group`` (None: the world) in one all-reduce.
    For host numbers pass a gloo group (``parallel.layout.host_group``) and the CPU: the
    reduction then never touches (or waits for) the accelerator."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()
