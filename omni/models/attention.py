"""Attention over packed rows: tokens attend only inside their own segment.

A packed row holds several documents (or several images / audio clips for an encoder).
Segments are identified by an integer id per token; attention never crosses a segment
boundary, so a packed row computes exactly what running each segment alone would.

``segment_attention`` is the portable PyTorch path (SDPA with a block-diagonal mask).
``PackedSegments`` carries the same segments as ``cu_seqlens`` too, so that attention can run on
the varlen kernels of ``omni.kernels`` (flash-attn or Triton) where they apply, and fall back to
``segment_attention`` elsewhere (``model.attn_backend``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.transfer import to_device


@dataclass
class ContextParallelSegments:
    """Stands in for segment ids when a context-parallel rank holds zig-zag chunks of a packed
    row: each local token's document (numbered across the whole row) and position in it are
    enough for ring or Ulysses attention to apply the right mask (same document, key not after
    the query) whichever rank the keys come from."""

    doc: torch.Tensor  # int64 [B, T_local]
    pos: torch.Tensor  # int64 [B, T_local]
    group: dist.ProcessGroup
    impl: str  # ring | ulysses
    # parallel.cp_attention.RingHop per ring hop, planned on the host from the CP layout (None:
    # the ring finds each hop's live rows on the device).
    hops: list | None = None
    # ulysses: the whole row's document order (parallel.cp_attention.UlyssesPlan) and its
    # documents as a varlen pack, planned on the host (None: read back once per call)
    ulysses: object = None
    packed: PackedSegments | None = None
    backend: str = "sdpa"  # model.attn_backend where the varlen kernels apply, else sdpa

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        from parallel.cp_attention import cp_attention

        return cp_attention(q, k, v, self.doc, self.pos, self.group, impl=self.impl, causal=True, scale=scale,
                            hops=self.hops, ulysses=self.ulysses, local_attention=self._local)

    def _local(self, q, k, v, lengths: tuple, causal: bool, scale: float) -> torch.Tensor:
        """Ulysses' attention over the whole row sorted into documents: the same varlen path as
        attention without CP."""
        packed = self.packed
        if packed is None:
            packed = PackedSegments.from_lengths(list(lengths), q.device, causal, self.backend)
        return packed.attend(q, k, v, scale)


def uses_varlen_kernels(backend: str, device: torch.device) -> bool:
    """Whether ``model.attn_backend`` may pick a varlen kernel on ``device`` (``auto`` does on
    CUDA only; the PyTorch path needs no ``cu_seqlens``)."""
    return backend in ("triton", "flash") or (backend == "auto" and torch.device(device).type == "cuda")


@dataclass
class PackedSegments:
    """The documents (or media items) of one packed row, for ``omni.kernels.varlen_attention``:
    ``cu_seqlens`` on the device and the longest length on the host (nothing is read back),
    plus the segment ids the PyTorch path needs. ``backend``: ``model.attn_backend``."""

    ids: torch.Tensor  # int64 [1, T]
    cu_seqlens: torch.Tensor  # int32 [n + 1], on the row's device
    max_seqlen: int
    causal: bool = True
    backend: str = "auto"
    # The segments' lengths on the host (None: not known there): the PyTorch path then reads
    # nothing back from the device to find them.
    lengths: tuple[int, ...] | None = None

    @classmethod
    def from_lengths(cls, lengths: list[int], device, causal: bool, backend: str) -> "PackedSegments":
        cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
        ids, cu = to_device([ids[None], cu], device)  # built on the host, moved together
        return cls(ids, cu, max(lengths, default=0), causal, backend, tuple(int(n) for n in lengths))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """q [1, H_q, T, D], k/v [1, H_kv, T, D] -> [1, H_q, T, D]."""
        from omni.kernels import resolve_backend, varlen_attention

        backend = resolve_backend(self.backend, q)
        if backend == "sdpa":
            return segment_attention(q, k, v, self.ids, causal=self.causal, scale=scale, lengths=self.lengths)
        out = varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), self.cu_seqlens,
                               self.max_seqlen, causal=self.causal, backend=backend, scale=scale)
        return out.transpose(0, 1)[None]


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
