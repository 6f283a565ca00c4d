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


def local_grad_square_sum(params: Iterable[torch.nn.Parameter], stage_world: int, skip: Iterable = (),
                          device: torch.device | None = None) -> torch.Tensor:
    """This rank's share of the squared global norm, on the device (fp64, 0-dim): summed over
    the world it is the squared norm. Nothing is read back, so the caller can fold the
    all-reduce into one it makes anyway (the trainer's per-step reduction).

    Gradients are grouped by (device, dtype, copies) and each group goes through one fused
    ``_foreach_norm``, which reads every gradient once and accumulates its norm in fp32 (fp64
    gradients in fp64): no gradient-sized temporary (an fp64 copy, its square) is ever made.
    The per-tensor norms, one number each, are squared and summed in fp64."""
    skip_ids = {id(p) for p in skip}
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None or id(p) in skip_ids:
            continue
        g = p.grad
        local = g.to_local() if isinstance(g, DTensor) else g
        groups.setdefault((local.device, local.dtype, _copies(g, stage_world)), []).append(local)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (_, dtype, copies), grads in groups.items():
        norms = torch._foreach_norm(grads, 2, dtype=None if dtype == torch.float64 else torch.float32)
        total = total + torch.stack(norms).double().square().sum() / copies
    return total


@torch.no_grad()
def scale_to_max_norm_(params: Iterable[torch.nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Clipping with the norm still on the device (no host read): gradients are multiplied by
    ``max_norm / (norm + 1e-6)`` where ``norm > max_norm`` and by exactly 1 elsewhere (a
    non-finite norm included: the numeric guards skip that step)."""
    if not math.isfinite(max_norm):
        return
    coef = torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.mul_(coef.to(g.device))  # fp32 gradients: one fp32 rounding of coef

