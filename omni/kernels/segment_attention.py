"""The PyTorch path of attention over packed segments: SDPA with a block-diagonal (and causal) mask,
or, where the segments are contiguous and their lengths known, one SDPA per bucket of similar
lengths (about sum(L_i^2), not (sum L_i)^2). What ``varlen_attention(backend="sdpa")`` runs and
the reference the Triton kernels are checked against; the models call it where no varlen kernel
applies (``omni.models.attention``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.transfer import to_device


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
    lengths: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, T, D] (Hq a multiple of Hkv), segment_ids [B, T] or None.
    ``lengths``: the contiguous segments' lengths when the host knows them (B = 1); else they
    are read from ``segment_ids`` (a host sync when those are on a GPU).

    Returns [B, Hq, T, D].
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    if segment_ids is None and lengths is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if q.shape[0] == 1:
        if lengths is None:
            lengths = _contiguous_lengths(segment_ids[0])
        if lengths is not None:
            if len(lengths) == 1:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            return _bucketed_attention(q, k, v, list(lengths), causal, scale)
    t = q.shape[2]
    mask = segment_ids[:, :, None] == segment_ids[:, None, :]
    if causal:
        mask = mask & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)


def _contiguous_lengths(segment_ids: torch.Tensor) -> list[int] | None:
    """Lengths of the runs of equal ids, or None if an id occurs in two separate runs."""
    ids, counts = torch.unique_consecutive(segment_ids, return_counts=True)
    if ids.numel() != torch.unique(ids).numel():
        return None
    return counts.tolist()


def _buckets(lengths: list[int], slack: float = 0.75) -> list[list[int]]:
    """Segment indices grouped so that each group pads to its longest member: longest first, a
    new group whenever a segment is shorter than `slack` x the group's longest (bounds padding)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] >= slack * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _bucketed_attention(q, k, v, lengths: list[int], causal: bool, scale: float | None) -> torch.Tensor:
    """Attention of a packed row costing about sum(L_i^2) instead of T^2: segments of similar
    length are gathered into a padded batch per bucket and run through SDPA, then scattered back.

    Padding repeats a segment's last token. Under causal attention pads come after every real
    query, so no mask is needed; otherwise a key-padding mask hides them. Every index is built
    on the host from ``lengths`` and moved in one batched copy: nothing is read back.
    """
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    lens = torch.tensor(lengths)
    plans, host = [], []
    for group in _buckets(lengths):
        g = torch.tensor(group)
        width = lengths[group[0]]
        offs = torch.arange(width)
        valid = offs[None, :] < lens[g][:, None]  # [n, width]
        idx = starts[g][:, None] + torch.minimum(offs[None, :], lens[g][:, None] - 1)
        plans.append(idx.shape)
        # gather rows, valid slots of the padded batch, their rows, the key-padding mask
        host += [idx.reshape(-1), valid.reshape(-1).nonzero().squeeze(1), idx[valid], valid]
    moved = to_device(host, q.device)
    outs, where = [], []
    for b, shape in enumerate(plans):
        flat, keep, rows, valid = moved[4 * b: 4 * b + 4]
        # [1, H, T, D] -> [n, H, width, D]
        qb, kb, vb = (x[0][:, flat].unflatten(1, shape).transpose(0, 1) for x in (q, k, v))
        mask = None if causal else valid[:, None, None, :]
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=causal, scale=scale)
        outs.append(ob.transpose(0, 1).flatten(1, 2).index_select(1, keep))  # [H, n_valid, D]
        where.append(rows)
    out = q.new_zeros(q.shape[1:])
    out = out.index_copy(1, torch.cat(where), torch.cat(outs, dim=1))
    return out[None]
