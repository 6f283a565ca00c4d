"""Triton kernels of ``omni.kernels.reshard`` (see there)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_block(IDX, POS, n, width, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's block of both kernels: its columns ``h``, the in-bounds mask ``ok`` of
    [BLOCK_R, BLOCK_H], and its pairs' source rows ``idx[r]`` and positions ``pos[r]``."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (r < n)[:, None] & (h < width)[None, :]
    src = tl.load(IDX + r, mask=r < n, other=0)
    dst = tl.load(POS + r, mask=r < n, other=0)
    return h, ok, src, dst


@triton.jit
def scatter_rows(OUT, ROWS, IDX, POS, n, width, s_out, s_rows, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    h, ok, src, dst = _row_block(IDX, POS, n, width, BLOCK_R, BLOCK_H)
    vals = tl.load(ROWS + src[:, None] * s_rows + h[None, :], mask=ok, other=0.0)
    tl.store(OUT + dst[:, None] * s_out + h[None, :], vals.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def gather_rows_grad(GRAD_OUT, GRAD_ROWS, IDX, POS, n, width, s_go, s_gr, BLOCK_R: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """grad_rows[idx[i]] += grad_out[pos[i]]; then grad_out[pos[i]] = 0 (those positions were
    overwritten in the forward, so the embeddings below them get no gradient)."""
    h, ok, src, dst = _row_block(IDX, POS, n, width, BLOCK_R, BLOCK_H)
    g = tl.load(GRAD_OUT + dst[:, None] * s_go + h[None, :], mask=ok, other=0.0)
    tl.atomic_add(GRAD_ROWS + src[:, None] * s_gr + h[None, :], g.to(GRAD_ROWS.dtype.element_ty), mask=ok)
    tl.store(GRAD_OUT + dst[:, None] * s_go + h[None, :], tl.zeros_like(g), mask=ok)
