"""Expert parallelism: token dispatch to the ranks that own the experts, and the way back.

An EP group of size ``ep`` splits ``E`` experts into ``ep`` contiguous blocks of ``E // ep``: EP
rank ``r`` owns experts ``[r * E/ep, (r + 1) * E/ep)``. The caller has already grouped its
(token, slot) rows by global expert id, so the rows for EP rank ``r`` are one contiguous slice and
a single variable-split ``all_to_all_single`` moves them. What arrives is ordered by source rank,
then by local expert; ``dispatch`` regroups it by local expert (all sources' rows for local expert
0 first) so a grouped expert kernel sees one contiguous slice per expert. ``combine`` undoes both
steps exactly.

Model-agnostic: nothing here knows about routers or weights, only rows and per-expert counts.
Both directions are differentiable (the backward of an all-to-all is the reverse all-to-all), so
every rank of the group must run the backward too, even one that sent or received no rows, and
all ranks must agree on whether the rows require grad.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from parallel.strict_device import host_read


class _AllToAllSingle(torch.autograd.Function):
    """Variable-split all-to-all whose backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_splits: List[int], recv_splits: List[int], group) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send_splits: List[int], recv_splits: List[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_splits,
                           input_split_sizes=send_splits, group=group)
    return out


@dataclass
class DispatchHandle:
    """What ``combine`` needs to send results back (opaque to callers)."""

    group: Optional[dist.ProcessGroup]
    send_splits: List[int]  # rows this rank sent to each EP rank
    recv_splits: List[int]  # rows this rank received from each EP rank
    to_source_order: torch.Tensor  # index: expert-grouped row -> position in the received order
    local_counts: torch.Tensor | None = None  # rows per local expert, on the device (grouped matmuls)


def dispatch(
    x_sorted: torch.Tensor, counts: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> Tuple[torch.Tensor, List[int], DispatchHandle]:
    """Send each row to the EP rank that owns its expert.

    x_sorted [M, H]: rows grouped by global expert id, ascending; counts int64 [E]: rows per
    expert (sums to M). Returns ``(x_local, local_counts, handle)``: x_local [M', H] holds every
    row any rank routed to this rank's experts, grouped by local expert; local_counts (a python
    list of length E/ep) is what ``Experts.forward`` wants; ``handle`` goes to ``combine``.
    """
    ep = dist.get_world_size(group)
    num_experts = counts.numel()
    if num_experts % ep != 0:
        raise ValueError(
            f"dispatch: {num_experts} experts cannot be split over an EP group of {ep} ranks; "
            "use an EP size that divides the number of experts."
        )
    local = num_experts // ep
    counts = counts.to(torch.int64).contiguous()
    # recv[s, e]: rows source rank s sends for our local expert e (equal splits of E/ep entries).
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    # The one host sync of a dispatch: all_to_all_single takes its split sizes as python lists.
    # Both directions and the per-local-expert counts are fetched in one transfer.
    recv = recv.view(ep, local)
    with host_read("expert-parallel split sizes"):
        sizes = torch.cat([counts.view(ep, local).sum(1), recv.sum(1), recv.sum(0)]).tolist()
    send_splits, recv_splits, local_counts = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
    x_recv = _AllToAllSingle.apply(x_sorted, send_splits, recv_splits, group)

    # Received blocks come in (source, expert) order; regroup them as (expert, source).
    block_start = torch.cumsum(recv.reshape(-1), 0) - recv.reshape(-1)  # start of block (s, e)
    sizes_t = recv.t().reshape(-1)  # block sizes in (expert, source) order
    starts_t = block_start.view(ep, local).t().reshape(-1)
    total = sum(recv_splits)
    # Row i of expert-grouped output comes from: start of its block + its offset within the block.
    out_block_start = torch.cumsum(sizes_t, 0) - sizes_t
    offset = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        out_block_start, sizes_t, output_size=total)
    to_source = (torch.repeat_interleave(starts_t, sizes_t, output_size=total) + offset).to(x_recv.device)
    return x_recv[to_source], local_counts, DispatchHandle(group, send_splits, recv_splits, to_source, recv.sum(0))


def combine(y_local: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Inverse of ``dispatch``: y_local [M', H'] in dispatch's output order -> [M, H'] in the
    caller's original ``x_sorted`` order."""
    # Out-of-place index_copy: row i goes back to its received position; the backward is a gather.
    y_recv = y_local.new_empty(y_local.shape).index_copy(0, handle.to_source_order, y_local)
    return _AllToAllSingle.apply(y_recv, handle.recv_splits, handle.send_splits, handle.group)
