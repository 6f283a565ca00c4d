"""Attention over a packed row that context parallelism (CP) has cut across the ranks of a group.

Each CP rank holds T_loc tokens of the row (under the zig-zag layout: two chunks of every
document). Every local token carries ``doc`` (the document's index in the row, numbered alike on
all ranks) and ``pos`` (its position inside the document; padding continues after the real end).
The mask is then explicit and needs no chunk bookkeeping: query i sees key j iff
``doc[j] == doc[i]`` and, when causal, ``pos[j] <= pos[i]``. Token order therefore never matters,
which is what lets both mechanisms below work on any layout. Both run in memory linear in the
tokens (no T x T mask or score matrix is kept):

- ``ring`` (``parallel.ring_attention``): the keys/values travel around the ring (cp-1 hops);
  each rank merges the blockwise attention of its queries with an online softmax in fp32 and
  keeps only the per-query log-sum-exp; the backward recomputes.
- ``ulysses``: an all-to-all trades the token split for a head split; every rank sorts the whole
  row's tokens into documents (``UlyssesPlan``) and attends over them as a varlen pack, through
  the caller's local attention (the model's varlen kernels) or, without one, SDPA per document;
  a second all-to-all trades back.

Under ``causal=False`` the padding a slicer adds to a document carries that document's id, so
real tokens would attend to it: give padding its own ``doc`` id in that case.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from parallel.ring_attention import RingHop, live_rows_cols, ring_attention
from parallel.strict_device import host_read
from parallel.transfer import to_device

IMPLS = ("ring", "ulysses")

# attention over a pack of whole documents: (q [1, Hq, N, D], k, v [1, Hkv, N, D], the documents'
# lengths in order (host ints), causal, scale) -> [1, Hq, N, D]
LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple, bool, float], torch.Tensor]


@dataclass
class UlyssesPlan:
    """Where the whole row's tokens go for Ulysses' local attention: ``order`` sorts the gathered
    tokens (the CP ranks' shares in rank order, batch rows flattened) into documents, by position
    inside each under causal; ``inverse`` puts them back; ``lengths`` (host ints) are the
    documents' token counts in that order."""

    order: torch.Tensor  # int64 [B * cp * T_loc]
    inverse: torch.Tensor  # int64 [B * cp * T_loc]
    lengths: tuple[int, ...]

    def to(self, device) -> UlyssesPlan:
        order, inverse = to_device([self.order, self.inverse], device)
        return UlyssesPlan(order, inverse, self.lengths)


def plan_ulysses(doc: torch.Tensor, pos: torch.Tensor, causal: bool) -> UlyssesPlan:
    """The ``UlyssesPlan`` of a whole row given on the host: ``doc``/``pos`` [B, cp * T_loc], the CP
    ranks' local tokens concatenated in rank order. Under causal, the positions of one
    document must differ (the mask's ``pos_k <= pos_q`` is then the sorted order's)."""
    b, n = doc.shape
    row = torch.arange(b, dtype=torch.int64)[:, None].expand(b, n).reshape(-1)
    d, p = doc.reshape(-1).to(torch.int64), pos.reshape(-1).to(torch.int64)
    # stable sorts, least significant key first: position, then document, then batch row
    order = torch.arange(b * n)
    for key in ((p, d, row) if causal else (d, row)):
        order = order[torch.sort(key[order], stable=True).indices]
    rd = torch.stack([row[order], d[order]])
    starts = torch.ones(b * n, dtype=torch.bool)
    starts[1:] = (rd[:, 1:] != rd[:, :-1]).any(0)
    if causal and n:
        same = ~starts[1:] & (p[order][1:] == p[order][:-1])
        if same.any():
            i = int(same.nonzero()[0, 0])
            raise ValueError(f"cp_attention(impl='ulysses'): two tokens of document {int(d[order][i])} (row "
                             f"{int(row[order][i])}) have position {int(p[order][i])}; causal attention needs "
                             f"distinct positions within a document (give padding its own document id)")
    bounds = starts.nonzero().squeeze(1).tolist() + [b * n]
    lengths = tuple(hi - lo for lo, hi in zip(bounds[:-1], bounds[1:]))
    return UlyssesPlan(order, torch.empty_like(order).scatter_(0, order, torch.arange(b * n)), lengths)


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc: torch.Tensor,
    pos: torch.Tensor,
    group: dist.ProcessGroup | None,
    impl: str = "ring",
    causal: bool = True,
    scale: float | None = None,
    hops: list[RingHop] | None = None,
    ulysses: UlyssesPlan | None = None,
    local_attention: LocalAttention | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the keys of the whole row, all CP ranks together.

    q [B, Hq, T_loc, D]; k, v [B, Hkv, T_loc, D] with Hq a multiple of Hkv (query head h uses kv
    head h // (Hq/Hkv), as ``repeat_interleave`` does); doc, pos int64 [B, T_loc]. T_loc must be
    the same on every rank of ``group`` (the caller pads; None means the default group). Returns
    [B, Hq, T_loc, D] in q's dtype: what full attention over the whole row with the doc/pos mask
    gives at this rank's tokens. Gradients w.r.t. q, k, v are exact. Every rank of the group must
    call it with the same ``impl``, ``causal`` and head counts.

    ``ring``: each hop computes only the query rows and key columns of the visiting block that
    the mask leaves live (about half of the block under zig-zag) and skips a block with none.
    ``hops`` (``plan_ring_hops``, one per hop after the first, causal): those rows and columns
    known on the host from the CP layout; without it each hop finds them on the device, which
    reads their number back (a host sync per hop).

    ``ulysses``: ``ulysses`` (``plan_ulysses``) is the whole row's document order known on the
    host; without it the gathered doc/pos are read back once per call to make it.
    ``local_attention`` attends over the sorted pack (the model's varlen backend); without it,
    PyTorch's SDPA per document.
    """
    _check_inputs(q, k, v, doc, pos, impl)
    group = dist.group.WORLD if group is None else group
    cp = dist.get_world_size(group)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if impl == "ulysses":
        return _ulysses_attention(q, k, v, doc, pos, group, cp, causal, scale, ulysses, local_attention)
    if hops is not None and (len(hops) != cp - 1 or not causal):
        raise ValueError(f"cp_attention: {len(hops)} planned hops for cp={cp} (causal={causal}); plan cp-1 causal hops")
    return ring_attention(q, k, v, doc, pos, group, causal, scale, hops)


def plan_ring_hops(doc: torch.Tensor, pos: torch.Tensor, visiting: list[tuple[torch.Tensor, torch.Tensor]],
                   causal: bool = True) -> list[RingHop]:
    """The ``RingHop`` of each visiting block, given on the host: ``doc``/``pos`` [B, T_loc] of this
    rank, ``visiting[s-1]`` the (doc, pos) of the block hop s brings (that of CP rank
    ``rank - s``). The same rule as the ring applies without a plan, so the result is the same."""
    t = doc.shape[1]
    out = []
    for doc_k, pos_k in visiting:
        rows, cols = live_rows_cols(doc, pos, doc_k, pos_k, causal)
        out.append(RingHop(None if rows.numel() == t else rows, None if cols.numel() == t else cols,
                           rows.numel() > 0))
    return out


def _check_inputs(q, k, v, doc, pos, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"cp_attention: impl={impl!r} is unknown; use one of {IMPLS}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"cp_attention: q, k, v must be [B, H, T_loc, D]; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"cp_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    b, hq, t, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, t, d):
        raise ValueError(f"cp_attention: k/v {tuple(k.shape)} must match q {tuple(q.shape)} in B, T_loc and D")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"cp_attention: Hq={hq} must be a multiple of Hkv={k.shape[1]} (grouped-query attention)")
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"cp_attention: q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("doc", doc), ("pos", pos)):
        if x.dtype != torch.int64:
            raise ValueError(f"cp_attention: {name} must be int64; got {x.dtype} (use .long())")
        if tuple(x.shape) != (b, t):
            raise ValueError(f"cp_attention: {name} must be [B, T_loc] = {(b, t)}; got {tuple(x.shape)}")


# ------------------------------------------------------------------------------------- ulysses


def _ulysses_attention(q, k, v, doc, pos, group, cp: int, causal: bool, scale: float,
                       plan: UlyssesPlan | None, local_attention: LocalAttention | None) -> torch.Tensor:
    hq, hkv = q.shape[1], k.shape[1]
    if hq % cp:
        raise ValueError(f"cp_attention(impl='ulysses'): Hq={hq} query heads do not split over cp={cp} ranks; "
                         f"use a cp size that divides Hq, or impl='ring'")
    if hkv % cp:  # kv heads cannot be split as they are: give every query head its own copy
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    if cp > 1:
        q, k, v = (_tokens_to_heads(x, group, cp) for x in (q, k, v))
    if plan is None:
        full = _gather_tokens(torch.stack([doc, pos]), group, cp) if cp > 1 else torch.stack([doc, pos])
        with host_read("ulysses document order"):
            plan = plan_ulysses(full[0].cpu(), full[1].cpu(), causal)
        plan = plan.to(q.device)
    b, h, n, d = q.shape
    # [B, h, N, D] -> one pack [1, h, B*N, D] in document order
    packed = [x.transpose(0, 1).reshape(1, x.shape[1], b * n, d).index_select(2, plan.order) for x in (q, k, v)]
    attend = _sdpa_per_document if local_attention is None else local_attention
    out = attend(*packed, plan.lengths, causal, scale).index_select(2, plan.inverse)
    out = out.reshape(h, b, n, d).transpose(0, 1)
    return _heads_to_tokens(out, group, cp) if cp > 1 else out


def _sdpa_per_document(q, k, v, lengths: tuple, causal: bool, scale: float) -> torch.Tensor:
    """The portable local attention: SDPA over each document alone (no mask, so PyTorch's fused
    kernels apply and memory stays linear in the document)."""
    rep = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        part = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(q[:, :, part], k[:, :, part], v[:, :, part], is_causal=causal,
                                                   scale=scale, enable_gqa=rep > 1))
        start += n
    return torch.cat(outs, dim=2) if outs else q.clone()


def _tokens_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, H, T_loc, D] on every rank -> [B, H/cp, cp*T_loc, D]: rank i keeps head slice i of
    all ranks' tokens, concatenated in rank order."""
    b, h, t, d = x.shape
    send = x.reshape(b, cp, h // cp, t, d).transpose(0, 1)  # [dst rank, B, H/cp, T, D]
    recv = _AllToAll.apply(group, send)  # [src rank, B, H/cp, T, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _heads_to_tokens(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Inverse of ``_tokens_to_heads``."""
    b, h, ct, d = x.shape
    t = ct // cp
    send = x.reshape(b, h, cp, t, d).permute(2, 0, 1, 3, 4)  # [dst rank (token owner), B, h, T, D]
    recv = _AllToAll.apply(group, send)  # [src rank (head slice), B, h, T, D]
    return recv.transpose(0, 1).reshape(b, cp * h, t, d)


def _gather_tokens(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[..., B, T_loc] -> [..., B, cp*T_loc], tokens in rank order (no gradient)."""
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dim 0 (size cp). It is its own adjoint: the gradient takes
    the same exchange back."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return None, _all_to_all(grad, ctx.group)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out
