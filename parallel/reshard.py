"""Variable-split exchange of rows: how encoder inputs and outputs move between ranks.

Rank p sends ``send_counts[q]`` consecutive rows of its buffer to rank q and receives
``recv_counts[p']`` rows from each p', concatenated in source-rank order. The backward of the
exchange is the same exchange with the counts swapped: every gradient row goes back to the
rank and row it came from. Rows may be of any trailing shape; counts are host integers that
both sides computed from the same plan (no size negotiation, no device-to-host sync).

Two ways to move them (``multiplex.exchange``):

- ``all_to_all``: one ``all_to_all_single`` over the whole group; every rank takes part, with
  zero-row splits for the pairs that trade nothing.
- ``p2p``: one batch of point-to-point sends and receives (``batch_isend_irecv``) between the
  pairs that trade rows only (``p2p_transfers``). A rank that trades nothing posts nothing. The
  pairing comes from the counts, which every rank computed from the same global plan, so rank
  p posts a send to q exactly when q posts a receive from p, with the same number of rows.
  Each pair trades at most one message each way per exchange: NCCL matches the sends and
  receives of a pair by their order and checks no sizes, and with a single message per
  direction the order cannot disagree; gloo's matching by (source, tag) agrees too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

EXCHANGE_MODES = ("all_to_all", "p2p")


@dataclass(frozen=True)
class Transfer:
    """One point-to-point message of an exchange, seen from the rank that posts it."""

    send: bool
    peer: int  # rank in the exchange group
    lo: int  # rows [lo, hi) of the send buffer (send) or of the receive buffer (receive)
    hi: int


def p2p_transfers(send_counts: Sequence[int], recv_counts: Sequence[int], me: int) -> list[Transfer]:
    """Rank ``me``'s messages of an exchange: a send to every other rank it sends rows to and a
    receive from every other rank it receives rows from, sends first, each by peer. Its own
    rows are copied locally, not sent. Pure arithmetic on the counts: a rank can work out any
    other rank's list from that rank's counts (what the pairing tests do)."""
    out = []
    for send, counts in ((True, send_counts), (False, recv_counts)):
        at = 0
        for peer, c in enumerate(int(c) for c in counts):
            if c and peer != me:
                out.append(Transfer(send, peer, at, at + c))
            at += c
    return out


def exchange_rows(x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                  group: dist.ProcessGroup | None, mode: str = "all_to_all") -> torch.Tensor:
    """The plain exchange (no autograd). ``x`` has sum(send_counts) rows. ``mode``: one of
    ``EXCHANGE_MODES``."""
    if mode not in EXCHANGE_MODES:
        raise ValueError(f"exchange_rows: mode {mode!r} is not one of {', '.join(EXCHANGE_MODES)}")
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
    # Both collectives split along dim 0 only; flatten the trailing dims into the row.
    width = 1
    for d in x.shape[1:]:
        width *= d
    flat_x, flat_out = x.reshape(x.shape[0], width).contiguous(), out.reshape(out.shape[0], width)
    if mode == "p2p":
        _exchange_p2p(flat_x, flat_out, send_counts, recv_counts, group)
    else:
        dist.all_to_all_single(flat_out, flat_x, recv_counts, send_counts, group=group)
    return flat_out.reshape(out.shape)


def _exchange_p2p(x: torch.Tensor, out: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                  group: dist.ProcessGroup | None) -> None:
    me = dist.get_rank(group)
    s0, r0 = sum(send_counts[:me]), sum(recv_counts[:me])
    if send_counts[me]:
        out[r0:r0 + recv_counts[me]].copy_(x[s0:s0 + send_counts[me]])
    ops = []
    for t in p2p_transfers(send_counts, recv_counts, me):
        peer = t.peer if group is None else dist.get_global_rank(group, t.peer)
        if t.send:
            ops.append(dist.P2POp(dist.isend, x[t.lo:t.hi], peer, group))
        else:
            ops.append(dist.P2POp(dist.irecv, out[t.lo:t.hi], peer, group))
    if ops:  # batch_isend_irecv refuses an empty list; a rank that trades nothing waits for nothing
        for work in dist.batch_isend_irecv(ops):
            work.wait()
