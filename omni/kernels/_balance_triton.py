"""Triton kernels of ``omni.kernels.balance`` (see there)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def segment_costs(CU, PACK, PER, TOTAL, n, alpha, beta, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    lo = tl.load(CU + i, mask=ok, other=0).to(tl.float64)
    hi = tl.load(CU + i + 1, mask=ok, other=0).to(tl.float64)
    length = hi - lo
    cost = alpha * length * length + beta * length
    tl.store(PER + i, cost, mask=ok)
    # Integer costs add exactly in fp64 in any order, so the atomics stay deterministic there.
    tl.atomic_add(TOTAL + tl.load(PACK + i, mask=ok, other=0), cost, mask=ok)


@triton.jit
def greedy_assign(COST, ORDER, ASSIGN, LOADS, n, n_bins, BINS: tl.constexpr):
    bins = tl.arange(0, BINS)
    loads = tl.where(bins < n_bins, 0.0, float("inf")).to(tl.float64)
    for k in range(0, n):
        item = tl.load(ORDER + k)
        c = tl.load(COST + item)
        least = tl.min(loads, 0)
        # the least-loaded bin, the lowest one on ties
        target = tl.min(tl.where(loads == least, bins, BINS), 0)
        loads = tl.where(bins == target, loads + c, loads)
        tl.store(ASSIGN + item, target.to(tl.int64))
    tl.store(LOADS + bins, loads, mask=bins < n_bins)
