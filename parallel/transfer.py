"""Host-to-device copies, batched: one copy per dtype for a whole bundle of host tensors (a
micro-batch's ids, positions, labels, boundaries, media and index tensors), from pinned memory
and asynchronous on a GPU, handing back views of the device copy.

A pageable ``t.to("cuda")`` makes the host wait for the copy (the driver stages it through a
pinned buffer); one per tensor, ten to twenty per micro-batch, each also pays the launch
latency. Under the strict check (``parallel.strict_device``: CUDA's rules on the CPU) the
bundle is copied all the same, so the check sees device tensors, and the copies are counted.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from parallel import strict_device


def to_device(tensors: Sequence[torch.Tensor | None], device: torch.device | str) -> list[torch.Tensor | None]:
    """``tensors`` (host tensors, or None) on ``device``, same order, shapes and dtypes: one
    copy per dtype, from pinned memory and asynchronous on a GPU (so it may run inside the
    step: the host does not wait). On the CPU nothing moves, except under the strict check
    (CUDA's rules), where the bundle is copied and becomes device tensors. The results of one
    dtype are views of one buffer: treat them as read-only (every consumer here makes new
    tensors)."""
    out: list[torch.Tensor | None] = list(tensors)
    device = torch.device(device)
    pinned = device.type == "cuda"
    if not pinned and strict_device.active() is None:
        return out
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if strict_device.on_device(t):  # already there (features the peers sent ahead)
            continue
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, which in by_dtype.items():
        sizes = [tensors[i].numel() for i in which]
        total = sum(sizes)
        if pinned:
            flat = torch.empty(total, dtype=dtype, pin_memory=True)
            if total:
                torch.cat([tensors[i].reshape(-1) for i in which], out=flat)
            flat = flat.to(device, non_blocking=True)
        else:  # emulated: a copy all the same, so the host originals stay host tensors
            flat = torch.cat([tensors[i].reshape(-1) for i in which]) if total else torch.empty(0, dtype=dtype)
            strict_device.mark_copied(flat, copy=True)
        for i, piece in zip(which, torch.split(flat, sizes)):
            out[i] = piece.view(tensors[i].shape)
            if not pinned:
                strict_device.mark_copied(out[i])
    return out
