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

from omni.kernels import resolve_backend, varlen_attention
# The PyTorch path over packed segments lives with the kernels it is the reference of.
from omni.kernels.segment_attention import segment_attention
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
        """Built on the host and moved to ``device`` together (None: left on the host, for a
        caller that moves them with the rest of its bundle)."""
        cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))[None]
        if device is not None:
            ids, cu = to_device([ids, cu], device)
        return cls(ids, cu, max(lengths, default=0), causal, backend, tuple(int(n) for n in lengths))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """q [1, H_q, T, D], k/v [1, H_kv, T, D] -> [1, H_q, T, D]."""
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
