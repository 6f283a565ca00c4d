"""Balancing kernels: the shared cost model on packed segments, and greedy (LPT) assignment of
items to ranks, on the device.

- ``segment_costs``: alpha*L^2 + beta*L per segment of ``cu_seqlens`` and summed per pack, with
  the coefficients of ``dataloading.plan.cost.CostModel`` (its LLM terms, or an encoder's): the same
  formula the planner balances, never a second copy of the coefficients.
- ``greedy_assign``: items sorted heaviest first, each to the least-loaded rank — the LPT rule of
  ``dataloading.plan.balance`` and ``omni.step.encoder_plan`` — in one program that walks the items.

Both accumulate in fp64 and equal ``omni.kernels.reference`` bit for bit on integer costs.
``backend="auto"`` runs the kernels on CUDA tensors and the references elsewhere.
"""
from __future__ import annotations

import os

import torch

from dataloading.plan.cost import CostModel
from omni.kernels import reference


def _use_triton(t: torch.Tensor, backend: str) -> bool:
    """``backend`` "auto": the Triton kernel on CUDA, the reference elsewhere; "triton": the
    kernel (on the CPU only under ``TRITON_INTERPRET=1``, for tests); "torch": the reference."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel backend {backend!r} is not one of auto, triton, torch")
    if backend == "torch" or (backend == "auto" and not t.is_cuda):
        return False
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        if backend == "triton":
            raise ValueError("kernel backend 'triton' needs triton (pip install -e '.[triton]')")
        return False
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernel backend 'triton' runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
    return True


def cost_coefficients(cost: CostModel, modality: str | None = None) -> tuple[float, float]:
    """(alpha, beta) of the LLM (``modality`` None) or of one encoder, from the shared model."""
    if modality is None:
        return float(cost.alpha), float(cost.beta)
    a, b = cost.encoders.get(modality, (0.0, 0.0))
    return float(a), float(b)


def segment_costs(cu_seqlens: torch.Tensor, cost: CostModel, pack_ids: torch.Tensor | None = None,
                  n_packs: int | None = None, modality: str | None = None,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(cost per segment [n] fp64, cost per pack [n_packs] fp64). ``pack_ids``: each segment's
    pack (None: all in one pack). Give ``n_packs`` to avoid reading ``pack_ids.max()`` back
    from the device."""
    alpha, beta = cost_coefficients(cost, modality)
    n = cu_seqlens.numel() - 1
    if n_packs is None:
        n_packs = 1 if pack_ids is None else (int(pack_ids.max()) + 1 if n else 0)
    packs = torch.zeros(n, dtype=torch.int64, device=cu_seqlens.device) if pack_ids is None else pack_ids
    if not _use_triton(cu_seqlens, backend):
        return reference.segment_costs_reference(cu_seqlens, alpha, beta, packs, n_packs)
    from omni.kernels import _balance_triton as kern

    per = torch.empty(n, dtype=torch.float64, device=cu_seqlens.device)
    totals = torch.zeros(n_packs, dtype=torch.float64, device=cu_seqlens.device)
    if n:
        block = 1024
        kern.segment_costs[(-(-n // block),)](cu_seqlens, packs.to(torch.int32), per, totals, n, alpha, beta,
                                              BLOCK=block)
    return per, totals


def greedy_assign(costs: torch.Tensor, n_bins: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """LPT assignment of items with ``costs`` to ``n_bins`` ranks: (bin per item int64, load per
    bin fp64). Heaviest first, ties by lower item index; each to the least-loaded bin, ties to
    the lowest bin."""
    if n_bins < 1:
        raise ValueError(f"greedy_assign: need at least one bin, got {n_bins}")
    if not _use_triton(costs, backend):
        return reference.greedy_assign_reference(costs, n_bins)
    from omni.kernels import _balance_triton as kern

    c = costs.to(torch.float64)
    order = torch.argsort(-c, stable=True).to(torch.int32)
    assign = torch.empty(c.numel(), dtype=torch.int64, device=c.device)
    loads = torch.empty(n_bins, dtype=torch.float64, device=c.device)
    bins = 1 << max(0, (n_bins - 1).bit_length())
    kern.greedy_assign[(1,)](c, order, assign, loads, c.numel(), n_bins, BINS=bins)
    return assign, loads
