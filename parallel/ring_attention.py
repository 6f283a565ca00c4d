"""Ring attention in memory linear in the local tokens: one autograd function for the whole ring.

Each CP rank holds ``T_loc`` tokens of a packed row; the keys and values travel around the ring
(cp - 1 hops) and each rank merges the attention of its queries against every visiting block with
an online softmax. The mask is explicit per token (``doc``, ``pos``: same document, and under
``causal`` key position not after the query's), so any layout works (zig-zag included).

Memory: the forward keeps, besides the inputs, only the output and the fp32 per-query log-sum-exp;
no visiting block and no score matrix is saved. The backward sends the blocks around the ring
again, recomputes each block's probabilities from the saved log-sum-exp (as FlashAttention's
backward does, Dao 2023, and ring attention's, Liu et al. 2023), and the block's key/value
gradients travel with it, reaching their owner after the last hop. Score matrices are computed
in chunks of query rows within ``SCORE_BYTES``, so the transient memory is bounded too.

Numerics: the scores, softmax statistics and accumulations run in fp32 (or wider) with autocast
off, whatever the input dtype: under bf16 autocast the scores would otherwise round to bf16.

Communication order: every rank issues the same sequence of batched sends and receives (forward
cp - 1 hops of k, v, doc, pos; backward cp - 1 hops of k, v and the two gradient accumulators,
then one hop of the accumulators), whether or not a block is live for it: NCCL matches
point-to-point operations by order only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from parallel.sizing import RING_SCORE_BYTES as SCORE_BYTES  # one home: the simulator prices it too


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


def ring_attention(q, k, v, doc, pos, group, causal: bool, scale: float,
                   hops: list[RingHop] | None = None, score_bytes: int = SCORE_BYTES) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, T, D], doc/pos int64 [B, T] (checked by the caller) ->
    [B, Hq, T, D] in q's dtype. ``hops``: the live part of each visiting block, planned on the
    host (None: found on the device, a read back per hop)."""
    return _Ring.apply(q, k, v, doc, pos, group, causal, scale, hops, score_bytes)


def mask(doc_q, pos_q, doc_k, pos_k, causal: bool) -> torch.Tensor:
    """Boolean [B, Tq, Tk]: True where the query may attend the key."""
    m = doc_q[:, :, None] == doc_k[:, None, :]
    if causal:
        m &= pos_k[:, None, :] <= pos_q[:, :, None]
    return m


def live_rows_cols(doc_q, pos_q, doc_k, pos_k, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
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


def exchange(tensors: list[torch.Tensor], send_to: int, recv_from: int, group) -> list[torch.Tensor]:
    """One ring hop of several tensors, batched (peers are global ranks)."""
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group, tag=i) for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, r, recv_from, group, tag=i) for i, r in enumerate(received)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc, pos, group, causal, scale, hops, score_bytes):
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        cp, nxt, prv = _ring_peers(group)
        with torch.autocast(q.device.type, enabled=False):
            # [B, Hkv, G, T, D]: query heads grouped under their kv head, so kv broadcasts (no repeat).
            q5 = q.to(acc).reshape(b, hkv, hq // hkv, t, d)
            out = torch.zeros_like(q5)
            lse = torch.full(q5.shape[:-1], float("-inf"), dtype=acc, device=q.device)
            block, visiting = (k, v, doc, pos), []
            for step in range(cp):
                if step:
                    block = exchange(list(block), nxt, prv, group)
                    visiting.append((block[2], block[3]))
                hop = _hop(step, hops, doc, pos, block[2], block[3], causal)
                if hop.live:
                    _block_forward(q5, out, lse, block, doc, pos, hop, causal, scale, acc, score_bytes)
        # The output is saved in q's dtype, as FlashAttention saves it: it is the tensor returned
        # (the output projection keeps it anyway), so the backward's rowsum(dO * O) costs no
        # second, fp32 copy of it.
        out = out.reshape(b, hq, t, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, doc, pos, out, lse)
        ctx.visiting, ctx.hops, ctx.group, ctx.causal, ctx.scale = visiting, hops, group, causal, scale
        ctx.score_bytes = score_bytes
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, doc, pos, out, lse = ctx.saved_tensors
        b, hq, t, d = q.shape
        acc = lse.dtype
        cp, nxt, prv = _ring_peers(ctx.group)
        with torch.autocast(q.device.type, enabled=False):
            shape = (*lse.shape, d)
            q5 = q.to(acc).reshape(shape)
            do5 = grad_out.to(acc).reshape(shape)
            delta = (do5 * out.to(acc).reshape(shape)).sum(-1)  # rowsum(dO * O): the softmax backward's term
            dq = torch.zeros_like(q5)
            k_s, v_s = k, v
            dk, dv = torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)
            for step in range(cp):
                if step:
                    k_s, v_s, dk, dv = exchange([k_s, v_s, dk, dv], nxt, prv, ctx.group)
                doc_s, pos_s = (doc, pos) if step == 0 else ctx.visiting[step - 1]
                hop = _hop(step, ctx.hops, doc, pos, doc_s, pos_s, ctx.causal)
                if hop.live:
                    _block_backward(q5, do5, lse, delta, dq, dk, dv, k_s, v_s, doc, pos, doc_s, pos_s, hop,
                                    ctx.causal, ctx.scale, acc, ctx.score_bytes)
            if cp > 1:  # this rank holds the accumulators of the block of rank + 1: send them home
                dk, dv = exchange([dk, dv], nxt, prv, ctx.group)
        return (dq.reshape(b, hq, t, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None, None, None)


def _ring_peers(group) -> tuple[int, int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, 0
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    return cp, dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)


def _hop(step: int, hops, doc, pos, doc_s, pos_s, causal: bool) -> RingHop:
    """The live part of the block a rank attends at ``step``. Under zig-zag chunks half of every
    visiting block is masked (its later chunk, or the local early chunk's queries); the own
    block is live everywhere (every token sees itself)."""
    if step == 0:
        return RingHop(None, None, True)
    if hops is not None:
        return hops[step - 1]
    rows, cols = live_rows_cols(doc, pos, doc_s, pos_s, causal)
    return RingHop(None if rows.numel() == doc.shape[1] else rows, cols, rows.numel() > 0)


def _row_chunks(hop: RingHop, t: int, per_row_bytes: int, score_bytes: int):
    """The live query rows in chunks whose score matrix stays within ``score_bytes``: slices of
    the rows, or slices of the row index tensor."""
    n = t if hop.rows is None else hop.rows.numel()
    c = max(1, score_bytes // max(per_row_bytes, 1))
    for a in range(0, n, c):
        yield slice(a, min(a + c, n)) if hop.rows is None else hop.rows[a: a + c]


def _cols(hop: RingHop, k_s, v_s, doc_s, pos_s):
    if hop.cols is None:
        return k_s, v_s, doc_s, pos_s
    c = hop.cols
    return k_s[:, :, c], v_s[:, :, c], doc_s[:, c], pos_s[:, c]


def _probabilities(q_c, k_c, allowed, scale, lse_c=None):
    """Scores of a chunk of queries against the block's keys [B, Hkv, G, c, Tk], masked to -inf.
    With ``lse_c`` (backward): the softmax probabilities exp(s - lse) instead."""
    s = q_c @ k_c[:, :, None].transpose(-1, -2)
    s.mul_(scale).masked_fill_(~allowed[:, None, None], float("-inf"))
    if lse_c is None:
        return s
    # A query that sees no key anywhere has lse = -inf; its masked scores give exp(-inf) = 0.
    finite = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
    return s.sub_(finite[..., None]).exp_()


def _block_forward(q5, out, lse, block, doc, pos, hop, causal, scale, acc, score_bytes):
    """Merge the attention of the live queries over one visiting block into ``out``/``lse``
    (in place: the forward runs without autograd)."""
    k_s, v_s, doc_s, pos_s = _cols(hop, *block)
    k_c, v_c = k_s.to(acc), v_s.to(acc)
    b, hkv, g, t, _ = q5.shape
    for r in _row_chunks(hop, t, b * hkv * g * k_c.shape[2] * 4, score_bytes):
        s = _probabilities(q5[..., r, :], k_c, mask(doc[:, r], pos[:, r], doc_s, pos_s, causal), scale)
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = s.sub_(m).exp_()
        total = e.sum(dim=-1)
        o_b = (e @ v_c[:, :, None]) / torch.where(total > 0, total, torch.ones_like(total))[..., None]
        lse_b = torch.where(total > 0, m[..., 0] + torch.log(total), torch.full_like(total, float("-inf")))
        o_m, lse_m = _merge(out[..., r, :], lse[..., r], o_b, lse_b)
        out[..., r, :] = o_m
        lse[..., r] = lse_m


def _merge(o_a, lse_a, o_b, lse_b):
    """Online-softmax combine of two partial results over disjoint key sets."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    seen = total > 0
    total = torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, m + torch.log(total), torch.full_like(total, float("-inf")))
    return (w_a[..., None] * o_a + w_b[..., None] * o_b) / total[..., None], lse


def _block_backward(q5, do5, lse, delta, dq, dk, dv, k_s, v_s, doc, pos, doc_s, pos_s, hop, causal, scale, acc,
                    score_bytes):
    """Add one visiting block's share to dq (this rank's queries) and to dk/dv (the block's
    accumulators, which travel with it), recomputing the probabilities chunk by chunk."""
    k_c, v_c, doc_c, pos_c = _cols(hop, k_s, v_s, doc_s, pos_s)
    k_c, v_c = k_c.to(acc), v_c.to(acc)
    b, hkv, g, t, d = q5.shape
    dk_b = torch.zeros(k_c.shape, dtype=acc, device=k_c.device)
    dv_b = torch.zeros_like(dk_b)
    for r in _row_chunks(hop, t, b * hkv * g * k_c.shape[2] * 4, score_bytes):
        q_c, do_c = q5[..., r, :], do5[..., r, :]
        p = _probabilities(q_c, k_c, mask(doc[:, r], pos[:, r], doc_c, pos_c, causal), scale, lse[..., r])
        dv_b += torch.einsum("bhgqk,bhgqd->bhkd", p, do_c)
        ds = do_c @ v_c[:, :, None].transpose(-1, -2)  # dP
        ds.sub_(delta[..., r, None]).mul_(p).mul_(scale)  # dS = P * (dP - delta), times the scale
        dq[..., r, :] += ds @ k_c[:, :, None]
        dk_b += torch.einsum("bhgqk,bhgqd->bhkd", ds, q_c)
    if hop.cols is None:
        dk += dk_b
        dv += dv_b
    else:
        dk.index_add_(2, hop.cols, dk_b)
        dv.index_add_(2, hop.cols, dv_b)
