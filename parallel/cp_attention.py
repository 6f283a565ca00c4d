"""Attention over a packed row that context parallelism (CP) has cut across the ranks of a group.

Each CP rank holds T_loc tokens of the row (under the zig-zag layout: two chunks of every
document). Every local token carries ``doc`` (the document's index in the row, numbered alike on
all ranks) and ``pos`` (its position inside the document; padding continues after the real end).
The mask is then explicit and needs no chunk bookkeeping: query i sees key j iff
``doc[j] == doc[i]`` and, when causal, ``pos[j] <= pos[i]``. Token order therefore never matters,
which is what lets both mechanisms below work on any layout.

- ``ring``: the keys/values travel around the ring (cp-1 hops); each rank merges the blockwise
  attention of its queries against every visiting block with an online softmax (fp32 or wider).
- ``ulysses``: an all-to-all trades the token split for a head split, every rank attends over the
  whole row for Hq/cp heads, and a second all-to-all trades back.

Under ``causal=False`` the padding a slicer adds to a document carries that document's id, so
real tokens would attend to it: give padding its own ``doc`` id in that case.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

IMPLS = ("ring", "ulysses")


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
) -> torch.Tensor:
    """Attention of this rank's queries over the keys of the whole row, all CP ranks together.

    q [B, Hq, T_loc, D]; k, v [B, Hkv, T_loc, D] with Hq a multiple of Hkv (query head h uses kv
    head h // (Hq/Hkv), as ``repeat_interleave`` does); doc, pos int64 [B, T_loc]. T_loc must be
    the same on every rank of ``group`` (the caller pads; None means the default group). Returns
    [B, Hq, T_loc, D] in q's dtype: what full attention over the whole row with the doc/pos mask
    gives at this rank's tokens. Gradients w.r.t. q, k, v are exact. Every rank of the group must
    call it with the same ``impl``, ``causal`` and head counts.

    ``ring``: each hop computes only the query rows and key columns of the visiting block that
    the mask leaves live (taken over all batch rows; about half of the block under zig-zag) and
    skips a block with none. Hops are not yet overlapped with the math. Backward: the hop is an
    autograd Function (the gradient of a visiting block travels the ring the other way) and
    autograd differentiates the blockwise math, so memory holds every visiting k/v block and its
    live score matrix (up to [B, Hq, T_loc, T_loc]) per hop; nothing is recomputed. ``hops``
    (``plan_ring_hops``, one per hop after the first, causal): the live rows and columns known on
    the host from the CP layout; without it each hop finds them on the device, which reads their
    number back (a host sync per hop).
    """
    _check_inputs(q, k, v, doc, pos, impl)
    group = dist.group.WORLD if group is None else group
    cp = dist.get_world_size(group)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if impl == "ulysses":
        return _ulysses_attention(q, k, v, doc, pos, group, cp, causal, scale)
    if hops is not None and (len(hops) != cp - 1 or not causal):
        raise ValueError(f"cp_attention: {len(hops)} planned hops for cp={cp} (causal={causal}); plan cp-1 causal hops")
    return _ring_attention(q, k, v, doc, pos, group, cp, causal, scale, hops)


@dataclass
class RingHop:
    """One ring hop's live part: the query rows that see some key of the visiting block and the
    keys some query sees (index tensors; None: all of them). ``live``: whether anything does."""

    rows: torch.Tensor | None
    cols: torch.Tensor | None
    live: bool

    def to(self, device) -> RingHop:
        return RingHop(None if self.rows is None else self.rows.to(device),
                       None if self.cols is None else self.cols.to(device), self.live)


def plan_ring_hops(doc: torch.Tensor, pos: torch.Tensor, visiting: list[tuple[torch.Tensor, torch.Tensor]],
                   causal: bool = True) -> list[RingHop]:
    """The ``RingHop`` of each visiting block, given on the host: ``doc``/``pos`` [B, T_loc] of this
    rank, ``visiting[s-1]`` the (doc, pos) of the block hop s brings (that of CP rank
    ``rank - s``). The same rule as the ring applies without a plan, so the result is the same."""
    t = doc.shape[1]
    out = []
    for doc_k, pos_k in visiting:
        rows, cols = _live_rows_cols(doc, pos, doc_k, pos_k, causal)
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


def _mask(doc_q, pos_q, doc_k, pos_k, causal: bool) -> torch.Tensor:
    """Boolean [B, Tq, Tk]: True where the query may attend the key."""
    mask = doc_q[:, :, None] == doc_k[:, None, :]
    if causal:
        mask &= pos_k[:, None, :] <= pos_q[:, :, None]
    return mask


# ---------------------------------------------------------------------------------------- ring


def _ring_attention(q, k, v, doc, pos, group, cp: int, causal: bool, scale: float,
                    hops: list[RingHop] | None = None) -> torch.Tensor:
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax statistics never below fp32
    # [B, Hkv, G, T, D]: query heads grouped under their kv head, so kv broadcasts (no repeat).
    q5 = q.to(acc).reshape(b, hkv, hq // hkv, t, d) * scale
    rank = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prv = dist.get_global_rank(group, (rank - 1) % cp)
    out = q5.new_zeros(q5.shape)
    lse = q5.new_full((*q5.shape[:-1], 1), float("-inf"))
    block = (k, v, doc, pos)
    for step in range(cp):
        if step:
            block = _RingHop.apply(group, nxt, prv, *block)
        k_s, v_s, doc_s, pos_s = block
        # Under zig-zag chunks half of every visiting block is masked: either its later chunk
        # (a rank earlier in the ring) or the local early chunk's queries (a later rank). Compute
        # only the rows and columns that see something; skip a block that sees nothing. The own
        # block (step 0) is live everywhere (every token sees itself).
        if step == 0:
            hop = RingHop(None, None, True)
        elif hops is not None:
            hop = hops[step - 1]
        else:
            rows, cols = _live_rows_cols(doc, pos, doc_s, pos_s, causal)
            hop = RingHop(None if rows.numel() == t else rows, cols, rows.numel() > 0)
        if not hop.live:
            continue
        rows, cols = hop.rows, hop.cols
        doc_q, pos_q, q_b = (doc, pos, q5) if rows is None else (doc[:, rows], pos[:, rows], q5[..., rows, :])
        if cols is not None:
            k_s, v_s, doc_s, pos_s = k_s[:, :, cols], v_s[:, :, cols], doc_s[:, cols], pos_s[:, cols]
        mask = _mask(doc_q, pos_q, doc_s, pos_s, causal)
        o_b, lse_b = _block_attention(q_b, k_s.to(acc)[:, :, None], v_s.to(acc)[:, :, None], mask[:, None, None])
        if rows is None:
            out, lse = _merge(out, lse, o_b, lse_b)
        else:
            o_m, lse_m = _merge(out[..., rows, :], lse[..., rows, :], o_b, lse_b)
            out, lse = out.index_copy(-2, rows, o_m), lse.index_copy(-2, rows, lse_m)
    if torch.is_grad_enabled() and cp > 1 and (k.requires_grad or v.requires_grad):
        # The last hop's backward must run on every rank (its peers wait for the gradient it
        # sends); if this rank skipped that block, keep it in the graph with a zero weight.
        out = out + 0.0 * (block[0].sum() + block[1].sum()).to(acc)
    return out.reshape(b, hq, t, d).to(q.dtype)


def _live_rows_cols(doc_q, pos_q, doc_k, pos_k, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the queries that see some key and of the keys that some query sees (in any
    batch row), from per-document ranges in O(T log T) instead of the T² mask: under causal,
    a query sees its document's earliest key iff any, and a key is seen by the latest query."""
    b, tq = doc_q.shape
    ids, inv = torch.unique(torch.cat([doc_q, doc_k], dim=1), return_inverse=True)
    n = ids.numel()
    slot = inv + n * torch.arange(b, device=inv.device)[:, None]  # one slot per (row, document)
    slot_q, slot_k = slot[:, :tq], slot[:, tq:]
    if not causal:  # only presence matters
        pos_q, pos_k = torch.zeros_like(pos_q), torch.zeros_like(pos_k)
    big = torch.iinfo(torch.int64)
    q_last = torch.full((b * n,), big.min, dtype=torch.int64, device=doc_q.device)
    q_last.scatter_reduce_(0, slot_q.reshape(-1), pos_q.reshape(-1), "amax")
    k_first = torch.full((b * n,), big.max, dtype=torch.int64, device=doc_q.device)
    k_first.scatter_reduce_(0, slot_k.reshape(-1), pos_k.reshape(-1), "amin")
    rows = (pos_q >= k_first[slot_q]).any(dim=0)
    cols = (pos_k <= q_last[slot_k]).any(dim=0)
    return rows.nonzero().squeeze(1), cols.nonzero().squeeze(1)


def _block_attention(q5, k5, v5, mask):
    """Masked softmax attention of one block and its log-sum-exp; -inf lse (and zero output)
    for a query that sees no key here, without NaN in forward or backward."""
    s = (q5 @ k5.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    # The shift is a constant for the math (lse = m + log Σ exp(s - m) for any m): detach it.
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    seen = total > 0
    total = torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, m + torch.log(total), torch.full_like(total, float("-inf")))
    return (e @ v5) / total, lse


def _merge(o_a, lse_a, o_b, lse_b):
    """Online-softmax combine of two partial results over disjoint key sets."""
    m = torch.maximum(lse_a, lse_b).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    seen = total > 0
    total = torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, m + torch.log(total), torch.full_like(total, float("-inf")))
    return (w_a * o_a + w_b * o_b) / total, lse


class _RingHop(torch.autograd.Function):
    """Send (k, v, doc, pos) to the next rank and receive the previous rank's; the gradients of
    k and v travel back the other way."""

    @staticmethod
    def forward(ctx, group, nxt: int, prv: int, k, v, doc, pos):
        ctx.group, ctx.nxt, ctx.prv = group, nxt, prv
        received = _exchange([k, v, doc, pos], send_to=nxt, recv_from=prv, group=group)
        ctx.mark_non_differentiable(received[2], received[3])
        return tuple(received)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_k, grad_v, _grad_doc, _grad_pos):
        grad_k, grad_v = _exchange([grad_k, grad_v], send_to=ctx.prv, recv_from=ctx.nxt, group=ctx.group)
        return None, None, None, grad_k, grad_v, None, None


def _exchange(tensors: list[torch.Tensor], send_to: int, recv_from: int, group) -> list[torch.Tensor]:
    """One ring hop of several tensors, batched (peers are global ranks)."""
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group, tag=i) for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, r, recv_from, group, tag=i) for i, r in enumerate(received)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


# ------------------------------------------------------------------------------------- ulysses


def _ulysses_attention(q, k, v, doc, pos, group, cp: int, causal: bool, scale: float) -> torch.Tensor:
    hq, hkv = q.shape[1], k.shape[1]
    if hq % cp:
        raise ValueError(f"cp_attention(impl='ulysses'): Hq={hq} query heads do not split over cp={cp} ranks; "
                         f"use a cp size that divides Hq, or impl='ring'")
    if hkv % cp:  # kv heads cannot be split as they are: give every query head its own copy
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    if cp > 1:
        q, k, v = (_tokens_to_heads(x, group, cp) for x in (q, k, v))
        doc, pos = _gather_tokens(torch.stack([doc, pos]), group, cp)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    mask = _mask(doc, pos, doc, pos, causal)[:, None]  # every query sees itself: no empty row
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return _heads_to_tokens(out, group, cp) if cp > 1 else out


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
