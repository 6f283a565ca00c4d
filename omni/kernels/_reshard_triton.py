"""Triton kernels of ``omni.kernels.reshard`` (see there)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def route_rows(POS, DOC_START, LOCAL_START, CHUNK, RANK, LOCAL, COUNTS, n, n_docs, local_len, cp_size, tp_size,
               CP: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    p = tl.load(POS + i, mask=ok, other=0)
    if CP:
        # the document holding p: the last one starting at or before p (binary search)
        lo = p * 0
        hi = lo + n_docs
        for _ in range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            open_ = hi - lo > 1
            right = tl.load(DOC_START + mid, mask=ok & open_, other=0) <= p
            lo = tl.where(open_ & right, mid, lo)
            hi = tl.where(open_ & ~right, mid, hi)
        c = tl.load(CHUNK + lo, mask=ok, other=1)
        within = p - tl.load(DOC_START + lo, mask=ok, other=0)
        chunk = within // c
        first = chunk < cp_size
        cp_rank = tl.where(first, chunk, 2 * cp_size - 1 - chunk)
        local = tl.load(LOCAL_START + lo, mask=ok, other=0) + tl.where(first, 0, c) + within % c
    else:
        local = p
        cp_rank = p * 0
    shard = local_len // tp_size
    rank = cp_rank * tp_size + local // shard
    tl.store(RANK + i, rank.to(tl.int64), mask=ok)
    tl.store(LOCAL + i, (local % shard).to(tl.int64), mask=ok)
    tl.atomic_add(COUNTS + rank, tl.full(rank.shape, 1, tl.int32), mask=ok)


@triton.jit
def scatter_rows(OUT, ROWS, IDX, POS, n, width, s_out, s_rows, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (r < n)[:, None] & (h < width)[None, :]
    src = tl.load(IDX + r, mask=r < n, other=0)
    dst = tl.load(POS + r, mask=r < n, other=0)
    vals = tl.load(ROWS + src[:, None] * s_rows + h[None, :], mask=ok, other=0.0)
    tl.store(OUT + dst[:, None] * s_out + h[None, :], vals.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def gather_rows_grad(GRAD_OUT, GRAD_ROWS, IDX, POS, n, width, s_go, s_gr, BLOCK_R: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """grad_rows[idx[i]] += grad_out[pos[i]]; then grad_out[pos[i]] = 0 (those positions were
    overwritten in the forward, so the embeddings below them get no gradient)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (r < n)[:, None] & (h < width)[None, :]
    src = tl.load(IDX + r, mask=r < n, other=0)
    dst = tl.load(POS + r, mask=r < n, other=0)
    g = tl.load(GRAD_OUT + dst[:, None] * s_go + h[None, :], mask=ok, other=0.0)
    tl.atomic_add(GRAD_ROWS + src[:, None] * s_gr + h[None, :], g.to(GRAD_ROWS.dtype.element_ty), mask=ok)
    tl.store(GRAD_OUT + dst[:, None] * s_go + h[None, :], tl.zeros_like(g), mask=ok)
