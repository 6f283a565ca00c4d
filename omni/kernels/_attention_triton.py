"""Triton kernels of ``varlen_attention``: FlashAttention-2-style forward (online softmax) and
backward (dQ, and dK/dV per KV head over its query-head group) on packed documents.

Work is a list of *items*: (tile, head), a tile being one block of rows of one document. The
tile lists are built on the device (``omni.kernels.tiles``) and ordered by cost, longest
first. With ``PERSISTENT`` a fixed grid of programs takes items from a shared counter: each
program that becomes free takes the longest item left, list scheduling over the sorted items,
i.e. LPT over programs. Without it one program runs per item in list order (the plain grid
the benchmark compares against). Items past the valid tiles (the list has a fixed, shape-given
length so that nothing is read back from the device) are skipped.

Everything accumulates in fp32; ``IEEE`` keeps fp32 inputs off TF32. Exponentials are base 2
(the scale is folded in), and the log-sum-exp saved for backward is base 2 as well.

Element offsets are int64: a document's first token (``start``) and the head index are cast
before they meet a stride, so ``(start + row) * stride + head * head_stride`` never wraps. In
int32 it wraps past 2**31 elements (262k tokens x 64 heads x 128 dims) and the kernels read
and write far from the tensor. Lengths and block indices stay int32 (within one document).
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _first(COUNTER, pid, PERSISTENT: tl.constexpr):
    """The program's first item: from the shared counter, or its own index (plain grid)."""
    if PERSISTENT:
        return tl.atomic_add(COUNTER, 1)
    return pid


@triton.jit
def _next(COUNTER, n_items, PERSISTENT: tl.constexpr):
    """The next item: from the shared counter, or none (plain grid: one item per program)."""
    if PERSISTENT:
        return tl.atomic_add(COUNTER, 1)
    return n_items


@triton.jit
def _item(ORDER, TILE_DOC, item, heads):
    """An item's tile, head (int64: see the module note) and document (< 0: a padding tile)."""
    tile = tl.load(ORDER + item // heads)
    return tile, (item % heads).to(tl.int64), tl.load(TILE_DOC + tile)


@triton.jit
def _tile_span(TILE_BLOCK, CU, tile, doc, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """A tile of a document: its block index, the document's first token (int64) and length,
    the block's positions in the document and which of them it has, and the head dims."""
    block = tl.load(TILE_BLOCK + tile)
    first = tl.load(CU + doc)
    length = tl.load(CU + doc + 1) - first
    at = block * BLOCK + tl.arange(0, BLOCK)
    return block, first.to(tl.int64), length, at, at < length, tl.arange(0, BLOCK_D)


@triton.jit
def _key_end(block, length, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Where the keys a block of query rows attends to end: the document's end, or (causal) the
    block's last row."""
    if CAUSAL:
        return tl.minimum((block + 1) * BLOCK_M, length)
    return length


@triton.jit
def _query_rows(Q, DO, LSE, DELTA, start, rows, row_ok, dims, head, s_qt, s_qh, s_dot, s_doh, s_lh, D):
    """What the backward reads of a block of query rows: q, dO, the saved log-sum-exp and delta,
    and the rows' element mask."""
    rd = row_ok[:, None] & (dims[None, :] < D)
    q = tl.load(Q + (start + rows)[:, None] * s_qt + head * s_qh + dims[None, :], mask=rd, other=0.0)
    do = tl.load(DO + (start + rows)[:, None] * s_dot + head * s_doh + dims[None, :], mask=rd, other=0.0)
    lse = tl.load(LSE + head * s_lh + start + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + head * s_lh + start + rows, mask=row_ok, other=0.0)
    return q, do, lse, delta, rd


@triton.jit
def _key_cols(K, V, start, cols, col_ok, dims, kv_head, s_kt, s_kh, s_vt, s_vh, D):
    """A block of key/value columns, [N, D] each, and their element mask."""
    cd = col_ok[:, None] & (dims[None, :] < D)
    k = tl.load(K + (start + cols)[:, None] * s_kt + kv_head * s_kh + dims[None, :], mask=cd, other=0.0)
    v = tl.load(V + (start + cols)[:, None] * s_vt + kv_head * s_vh + dims[None, :], mask=cd, other=0.0)
    return k, v, cd


@triton.jit
def _probs(q, k, lse, rows, cols, row_ok, col_ok, qk_scale, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """The forward's attention probabilities of a (rows, cols) block, recomputed from the saved
    log-sum-exp; 0 where masked."""
    ok = row_ok[:, None] & col_ok[None, :]
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None])
    return tl.where(ok, tl.exp2(_dot(q, tl.trans(k), IEEE) * qk_scale - lse[:, None]), 0.0)


@triton.jit
def _fwd_tile(Q, K, V, O, LSE, CU, TILE_DOC, TILE_BLOCK, ORDER, item, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot,
              s_oh, s_lh, qk_scale, H, GROUP, D, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    tile, head, doc = _item(ORDER, TILE_DOC, item, H)
    if doc >= 0:
        block, start, length, rows, row_ok, dims = _tile_span(TILE_BLOCK, CU, tile, doc, BLOCK_M, BLOCK_D)
        kv_head = head // GROUP
        cols0 = tl.arange(0, BLOCK_N)
        q = tl.load(Q + (start + rows)[:, None] * s_qt + head * s_qh + dims[None, :],
                    mask=row_ok[:, None] & (dims[None, :] < D), other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, _key_end(block, length, BLOCK_M, CAUSAL), BLOCK_N):
            cols = n0 + cols0
            col_ok = cols < length
            kt = tl.load(K + (start + cols)[None, :] * s_kt + kv_head * s_kh + dims[:, None],
                         mask=col_ok[None, :] & (dims[:, None] < D), other=0.0)
            s = _dot(q, kt, IEEE) * qk_scale
            ok = col_ok[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows with no valid key yet (padding rows) keep -inf: use 0 as their reference.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_ref[:, None])
            alpha = tl.exp2(m_i - m_ref)
            v = tl.load(V + (start + cols)[:, None] * s_vt + kv_head * s_vh + dims[None, :],
                        mask=col_ok[:, None] & (dims[None, :] < D), other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        l_safe = tl.where(row_ok, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(O + (start + rows)[:, None] * s_ot + head * s_oh + dims[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & (dims[None, :] < D))
        tl.store(LSE + head * s_lh + start + rows, m_i + tl.log2(l_safe), mask=row_ok)


@triton.jit
def attention_fwd(Q, K, V, O, LSE, CU, TILE_DOC, TILE_BLOCK, ORDER, COUNTER, n_items, s_qt, s_qh, s_kt, s_kh, s_vt,
                  s_vh, s_ot, s_oh, s_lh, qk_scale, H, GROUP, D, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PERSISTENT: tl.constexpr, IEEE: tl.constexpr):
    item = _first(COUNTER, tl.program_id(0), PERSISTENT)
    while item < n_items:
        _fwd_tile(Q, K, V, O, LSE, CU, TILE_DOC, TILE_BLOCK, ORDER, item, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot,
                  s_oh, s_lh, qk_scale, H, GROUP, D, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, IEEE)
        item = _next(COUNTER, n_items, PERSISTENT)


@triton.jit
def _dq_tile(Q, K, V, DO, DQ, LSE, DELTA, CU, TILE_DOC, TILE_BLOCK, ORDER, item, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh,
             s_dot, s_doh, s_dqt, s_dqh, s_lh, qk_scale, sm_scale, H, GROUP, D, CAUSAL: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    tile, head, doc = _item(ORDER, TILE_DOC, item, H)
    if doc >= 0:
        block, start, length, rows, row_ok, dims = _tile_span(TILE_BLOCK, CU, tile, doc, BLOCK_M, BLOCK_D)
        kv_head = head // GROUP
        cols0 = tl.arange(0, BLOCK_N)
        q, do, lse, delta, rd = _query_rows(Q, DO, LSE, DELTA, start, rows, row_ok, dims, head, s_qt, s_qh, s_dot,
                                            s_doh, s_lh, D)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, _key_end(block, length, BLOCK_M, CAUSAL), BLOCK_N):
            cols = n0 + cols0
            col_ok = cols < length
            k, v, cd = _key_cols(K, V, start, cols, col_ok, dims, kv_head, s_kt, s_kh, s_vt, s_vh, D)
            p = _probs(q, k, lse, rows, cols, row_ok, col_ok, qk_scale, CAUSAL, IEEE)
            dp = _dot(do, tl.trans(v), IEEE)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, IEEE)
        tl.store(DQ + (start + rows)[:, None] * s_dqt + head * s_dqh + dims[None, :],
                 (dq * sm_scale).to(DQ.dtype.element_ty), mask=rd)


@triton.jit
def attention_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, CU, TILE_DOC, TILE_BLOCK, ORDER, COUNTER, n_items, s_qt, s_qh, s_kt,
                     s_kh, s_vt, s_vh, s_dot, s_doh, s_dqt, s_dqh, s_lh, qk_scale, sm_scale, H, GROUP, D,
                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     PERSISTENT: tl.constexpr, IEEE: tl.constexpr):
    item = _first(COUNTER, tl.program_id(0), PERSISTENT)
    while item < n_items:
        _dq_tile(Q, K, V, DO, DQ, LSE, DELTA, CU, TILE_DOC, TILE_BLOCK, ORDER, item, s_qt, s_qh, s_kt, s_kh, s_vt,
                 s_vh, s_dot, s_doh, s_dqt, s_dqh, s_lh, qk_scale, sm_scale, H, GROUP, D, CAUSAL, BLOCK_M, BLOCK_N,
                 BLOCK_D, IEEE)
        item = _next(COUNTER, n_items, PERSISTENT)


@triton.jit
def _dkv_tile(Q, K, V, DO, DK, DV, LSE, DELTA, CU, TILE_DOC, TILE_BLOCK, ORDER, item, s_qt, s_qh, s_kt, s_kh, s_vt,
              s_vh, s_dot, s_doh, s_dkt, s_dkh, s_dvt, s_dvh, s_lh, qk_scale, sm_scale, H_KV, GROUP, D,
              CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              IEEE: tl.constexpr):
    tile, kv_head, doc = _item(ORDER, TILE_DOC, item, H_KV)
    if doc >= 0:
        block, start, length, cols, col_ok, dims = _tile_span(TILE_BLOCK, CU, tile, doc, BLOCK_N, BLOCK_D)
        rows0 = tl.arange(0, BLOCK_M)
        k, v, cd = _key_cols(K, V, start, cols, col_ok, dims, kv_head, s_kt, s_kh, s_vt, s_vh, D)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        lo = 0
        if CAUSAL:
            lo = (block * BLOCK_N // BLOCK_M) * BLOCK_M
        for g in range(0, GROUP):
            head = kv_head * GROUP + g
            for m0 in range(lo, length, BLOCK_M):
                rows = m0 + rows0
                row_ok = rows < length
                q, do, lse, delta, _ = _query_rows(Q, DO, LSE, DELTA, start, rows, row_ok, dims, head, s_qt, s_qh,
                                                   s_dot, s_doh, s_lh, D)
                p = _probs(q, k, lse, rows, cols, row_ok, col_ok, qk_scale, CAUSAL, IEEE)  # [M, N]
                dv += _dot(tl.trans(p).to(do.dtype), do, IEEE)
                dp = _dot(do, tl.trans(v), IEEE)
                ds = p * (dp - delta[:, None])
                dk += _dot(tl.trans(ds).to(q.dtype), q, IEEE)
        tl.store(DK + (start + cols)[:, None] * s_dkt + kv_head * s_dkh + dims[None, :],
                 (dk * sm_scale).to(DK.dtype.element_ty), mask=cd)
        tl.store(DV + (start + cols)[:, None] * s_dvt + kv_head * s_dvh + dims[None, :], dv.to(DV.dtype.element_ty),
                 mask=cd)


@triton.jit
def attention_bwd_dkv(Q, K, V, DO, DK, DV, LSE, DELTA, CU, TILE_DOC, TILE_BLOCK, ORDER, COUNTER, n_items, s_qt, s_qh,
                      s_kt, s_kh, s_vt, s_vh, s_dot, s_doh, s_dkt, s_dkh, s_dvt, s_dvh, s_lh, qk_scale, sm_scale, H_KV,
                      GROUP, D, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, PERSISTENT: tl.constexpr, IEEE: tl.constexpr):
    item = _first(COUNTER, tl.program_id(0), PERSISTENT)
    while item < n_items:
        _dkv_tile(Q, K, V, DO, DK, DV, LSE, DELTA, CU, TILE_DOC, TILE_BLOCK, ORDER, item, s_qt, s_qh, s_kt, s_kh, s_vt,
                  s_vh, s_dot, s_doh, s_dkt, s_dkh, s_dvt, s_dvh, s_lh, qk_scale, sm_scale, H_KV, GROUP, D, CAUSAL,
                  BLOCK_M, BLOCK_N, BLOCK_D, IEEE)
        item = _next(COUNTER, n_items, PERSISTENT)
