"""Attention over packed rows: tokens attend only inside their own segment.

A packed row holds several documents (or several images / audio clips for an encoder).
Segments are identified by an integer id per token; attention never crosses a segment
boundary, so a packed row computes exactly what running each segment alone would.

This is the portable PyTorch path (SDPA with a block-diagonal mask). The varlen kernels
of ``omni.kernels`` plug in behind the same function signature.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """A new segment starts wherever ``position_ids`` restarts at 0. Shape [B, T] -> [B, T]."""
    starts = (position_ids == 0).to(torch.int64)
    # A row that does not start at position 0 (e.g. a continuation) still forms one segment.
    starts[..., 0] = 1
    return torch.cumsum(starts, dim=-1)


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``cu_seqlens`` [n+1] (0, l0, l0+l1, ...) -> segment id per token [total]."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    if ids.numel() != total:
        raise ValueError(f"cu_seqlens covers {ids.numel()} tokens but the input has {total}")
    return ids


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: torch.Tensor | None,
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, T, D] (Hq a multiple of Hkv), segment_ids [B, T] or None.

    Returns [B, Hq, T, D].
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    if segment_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    t = q.shape[2]
    mask = segment_ids[:, :, None] == segment_ids[:, None, :]
    if causal:
        mask = mask & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
