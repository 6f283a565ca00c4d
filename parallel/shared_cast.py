"""Compute-dtype copies of weights that the autocast cache does not cover, made once and shared by
every micro-batch in flight.

Autocast casts a leaf parameter once per autocast region and reuses the copy; a weight that
reaches the matmul through another op (an expert's slice of a stacked parameter, a DTensor's
local shard) or through an op that is not on autocast's lists (``F.grouped_mm``) is cast at every
use instead, and each use's backward keeps its own copy. For MoE experts, stacked fp32 weights
under bf16 compute, that is a copy of the layer's experts per micro-batch in flight (~2.8 GiB
per layer and micro-batch at Mixtral's size).

``SharedCast.get(w, dtype)`` returns ``w`` in ``dtype`` (a DTensor: its local shard), differentiable
back to ``w`` (the gradient is cast back to ``w``'s dtype, as autocast's cast does). The copy is
shared while it lives: the cache keeps a weak reference to its storage, so a later call (the next
micro-batch under pipeline parallelism, whose predecessors still hold the copy for their
backward) reuses it, and the copy is freed as soon as no graph holds it: never more than one copy
per weight, none between steps or during the optimizer step. Why a reused copy is never stale: a
copy is only reused while some micro-batch's graph holds it for its backward, and the optimizer
runs after every backward of the step; outside autograd (evaluation, generation) nothing is
reused. (The version counter is checked too, but the fused optimizers and DTensor's updates do
not bump it, so it is not what keeps a copy fresh.)
"""
from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor


class SharedCast:
    """Per-owner cache (a module keeps one): ``get`` as described in the module doc."""

    def __init__(self):
        self._entries: dict[tuple[int, torch.dtype], tuple] = {}

    # A copied or pickled module starts with an empty cache (its copies belong to the original).
    def __deepcopy__(self, memo) -> SharedCast:
        return SharedCast()

    def __getstate__(self) -> dict:
        return {"_entries": {}}

    def get(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        src = w.to_local() if isinstance(w, DTensor) else w
        if src.dtype == dtype:
            return src
        if not (torch.is_grad_enabled() and w.requires_grad):
            return src.to(dtype)  # no graph will keep it: nothing to share
        key = (id(w), dtype)
        entry = self._entries.get(key)
        cached = None
        if entry is not None:
            owner, version, ref, size, stride, offset = entry
            storage = ref()
            if owner() is w and storage is not None and version == w._version:
                cached = torch.empty(0, dtype=dtype, device=src.device).set_(storage, offset, size, stride)
        if cached is None:
            cached = src.detach().to(dtype)
            self._entries[key] = (weakref.ref(w), w._version, weakref.ref(cached.untyped_storage()), cached.size(),
                                  cached.stride(), cached.storage_offset())
        return _Cast.apply(src, cached)


class _Cast(torch.autograd.Function):
    """``cached`` (a copy of ``w`` in another dtype) as a differentiable function of ``w``."""

    @staticmethod
    def forward(ctx, w, cached):
        ctx.dtype = w.dtype
        return cached.view_as(cached)  # a view: shares the copy's storage, nothing new is made

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None
