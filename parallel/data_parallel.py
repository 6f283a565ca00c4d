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


# Gradients summed together in one all-reduce, at most this many bytes at a time (DDP's buckets
# are 25 MiB: big enough that a call's fixed cost is small, small enough that the flat copy's
# extra memory is).
BUCKET_BYTES = 64 * 2**20


@torch.no_grad()
def all_reduce_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup | None,
                         bucket_bytes: int = BUCKET_BYTES) -> int:
    """Sum each tensor over ``group`` in place, in few collectives: consecutive tensors of one
    dtype are flattened into buckets of up to ``bucket_bytes`` (a tensor larger than that is a
    bucket of its own, reduced in place), one all-reduce per bucket. Per-tensor all-reduces of
    hundreds of small gradients (norm gains, biases, a replicated encoder's) each pay a
    collective's fixed latency. Every rank must pass the same tensors (shapes, dtypes, order):
    the buckets then match. Returns the number of collectives issued."""
    calls = 0
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal calls, size
        if not bucket:
            return
        if len(bucket) == 1 and bucket[0].is_contiguous():
            dist.all_reduce(bucket[0], group=group)
        else:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat, group=group)
            for t, piece in zip(bucket, torch.split(flat, [t.numel() for t in bucket])):
                t.copy_(piece.view_as(t))
        calls += 1
        bucket.clear()
        size = 0

    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (t.dtype != bucket[0].dtype or size + nbytes > bucket_bytes):
            flush()
        bucket.append(t)
        size += nbytes
    flush()
    return calls
