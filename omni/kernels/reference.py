"""Pure-PyTorch references of every kernel in ``omni.kernels``: what the tests compare them
with, and what runs on the CPU. Written for clarity, not speed (loops over documents)."""
from __future__ import annotations

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Each document on its own, with explicit softmax (q [T, H_q, D], k/v [T, H_kv, D])."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    out = []
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qd = q[a:b].transpose(0, 1)  # [H, L, D]
        kd = k[a:b].transpose(0, 1).repeat_interleave(group, 0)
        vd = v[a:b].transpose(0, 1).repeat_interleave(group, 0)
        scores = qd @ kd.transpose(1, 2) * scale
        if causal:
            n = b - a
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        out.append((scores.softmax(-1) @ vd).transpose(0, 1))
    return torch.cat(out) if out else q.new_zeros(q.shape)


def scatter_rows_reference(embeds: torch.Tensor, rows: torch.Tensor, row_index: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
    """``embeds`` [T, H] with ``rows[row_index[i]]`` written at ``positions[i]`` (out of place)."""
    return embeds.index_copy(0, positions, rows.index_select(0, row_index).to(embeds.dtype))
