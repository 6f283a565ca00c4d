"""Data-parallel gradient and metric reduction."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def all_reduce_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum gradients over data-parallel ranks.

    Losses are already normalised by the global number of target tokens, so a sum (not a
    mean) gives the gradient of the global-batch loss. Parameters without a gradient on
    this rank (e.g. an encoder that saw no media here) contribute zeros, so ranks that did
    no work for a module do not dilute its gradient.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    grads = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def all_reduce_sum(value: float | int, device: torch.device) -> float:
    """Sum a scalar over all ranks (e.g. target-token counts for loss normalisation)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item()


def all_reduce_sums(values: list[float], device: torch.device) -> list[float]:
    """Sum several scalars over all ranks in one all-reduce."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()
