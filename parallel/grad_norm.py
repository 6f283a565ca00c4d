"""Gradient norm and clipping across every parallel dimension.

Each rank adds the squared entries of the gradient pieces it holds, divided by how many ranks
hold an identical copy, and one all-reduce over the world sums the rest. A DTensor's copies are
the ranks of its Replicate mesh dimensions times the ranks of the pipeline stage outside its
mesh (none for a mesh spanning several stages); a plain tensor is held whole by every rank of
the stage (its gradient already summed).
Parameters stored twice on purpose (a tied embedding on the first and last pipeline stages)
are counted once: the caller lists the duplicate in ``skip``.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _copies(t: torch.Tensor, stage_world: int) -> int:
    if not isinstance(t, DTensor):
        return stage_world
    mesh = t.device_mesh
    # A mesh wider than a stage (encoder weights sharded over every rank) holds each shard once.
    n = max(1, stage_world // mesh.size())
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            n *= mesh.size(dim)
    return n


def global_grad_norm(params: Iterable[torch.nn.Parameter], stage_world: int, skip: Iterable = (),
                     device: torch.device | None = None) -> float:
    skip_ids = {id(p) for p in skip}
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None or id(p) in skip_ids:
            continue
        g = p.grad
        local = g.to_local() if isinstance(g, DTensor) else g
        total = total + local.double().pow(2).sum() / _copies(g, stage_world)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return math.sqrt(float(total))


@torch.no_grad()
def clip_grads(params: Iterable[torch.nn.Parameter], max_norm: float, stage_world: int, skip: Iterable = (),
               device: torch.device | None = None) -> float:
    """Scale every gradient so the global norm is at most ``max_norm``; returns the norm before."""
    params = list(params)
    norm = global_grad_norm(params, stage_world, skip, device)
    if math.isfinite(max_norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
