"""Variable-split all-to-all of rows: how encoder inputs and outputs move between ranks.

Rank p sends ``send_counts[q]`` consecutive rows of its buffer to rank q and receives
``recv_counts[p']`` rows from each p', concatenated in source-rank order. The backward of the
exchange is the same exchange with the counts swapped: every gradient row goes back to the
rank and row it came from. Rows may be of any trailing shape; counts are host integers that
both sides computed from the same plan (no size negotiation, no device-to-host sync).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable


def exchange_rows(x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                  group: dist.ProcessGroup | None) -> torch.Tensor:
    """The plain exchange (no autograd). ``x`` has sum(send_counts) rows."""
    send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if x.shape[0] != sum(send_counts):
        raise ValueError(f"exchange_rows: {x.shape[0]} rows to send but the counts add up to {sum(send_counts)}")
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    world = 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)
    if world == 1:
        out.copy_(x)
        return out
    if len(send_counts) != world or len(recv_counts) != world:
        raise ValueError(f"exchange_rows: {len(send_counts)}/{len(recv_counts)} counts for a group of {world} ranks")
    if x.dim() == 1:
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
        return out
    # all_to_all_single splits along dim 0 only; flatten the trailing dims into the row.
    width = 1
    for d in x.shape[1:]:
        width *= d
    flat_out = out.reshape(out.shape[0], width)
    dist.all_to_all_single(flat_out, x.reshape(x.shape[0], width).contiguous(), recv_counts, send_counts, group=group)
    return flat_out.reshape(out.shape)


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        ctx.counts, ctx.group = (list(send_counts), list(recv_counts)), group
        return exchange_rows(x, send_counts, recv_counts, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return exchange_rows(grad.contiguous(), recv_counts, send_counts, ctx.group), None, None, None


def exchange_rows_autograd(x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                           group: dist.ProcessGroup | None) -> torch.Tensor:
    """``exchange_rows`` whose backward is the inverse exchange. Every rank of the group must
    run the backward too (ranks that received nothing included), in the same order."""
    return _ExchangeRows.apply(x, list(send_counts), list(recv_counts), group)
