"""Work tiles of the varlen attention kernels, built on the device from ``cu_seqlens``.

A tile is one block of ``block`` rows of one document. Its cost is the number of blocks it
meets on the other side: a query block meets the key blocks up to its diagonal (causal) or all
of them; a key block meets the query blocks from its diagonal on (causal) or all of them. The
list is sorted longest first, so that the kernels' persistent programs take the longest work
first (LPT over programs) and a few long documents do not run alone at the end.

Nothing is read back to the host: the list has a fixed length given by shapes alone,
``cdiv(total_tokens, block) + n_docs`` (an upper bound on the tiles), and the entries past the
real tiles are marked with document -1 and sorted last.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Tiles:
    doc: torch.Tensor  # int32 [bound]: the tile's document, -1 past the real tiles
    block: torch.Tensor  # int32 [bound]: the block index inside the document
    order: torch.Tensor  # int32 [bound]: tile indices, costliest first
    cost: torch.Tensor  # int64 [bound]: blocks met (-1 past the real tiles)

    @property
    def bound(self) -> int:
        return self.doc.numel()


def build_tiles(cu_seqlens: torch.Tensor, total_tokens: int, block: int, other_block: int, causal: bool,
                side: str, order: str = "cost") -> Tiles:
    """Tiles of ``block`` rows on ``side`` "q" (query blocks) or "kv" (key/value blocks), each
    meeting blocks of ``other_block`` rows on the other side. ``order``: "cost" (longest first)
    or "natural" (document by document)."""
    if side not in ("q", "kv") or order not in ("cost", "natural"):
        raise ValueError(f"build_tiles: side {side!r} must be q or kv, order {order!r} cost or natural")
    n_docs = cu_seqlens.numel() - 1
    if n_docs < 1:
        raise ValueError("build_tiles: cu_seqlens needs at least one document")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    per_doc = (lengths + block - 1) // block
    ends = torch.cumsum(per_doc, 0)
    bound = -(-total_tokens // block) + n_docs
    idx = torch.arange(bound, device=cu_seqlens.device)
    doc = torch.searchsorted(ends, idx, right=True).clamp_(max=n_docs - 1)
    valid = idx < ends[-1]
    blk = idx - (ends - per_doc)[doc]
    length = lengths[doc]
    other = (length + other_block - 1) // other_block
    if not causal:
        cost = other
    elif side == "q":  # key blocks up to the diagonal
        cost = torch.minimum(((blk + 1) * block + other_block - 1) // other_block, other)
    else:  # query blocks from the diagonal on
        cost = other - (blk * block) // other_block
    cost = torch.where(valid, cost, torch.full_like(cost, -1))
    if order == "cost":
        ranked = torch.argsort(-cost, stable=True)
    else:
        ranked = idx
    doc = torch.where(valid, doc, torch.full_like(doc, -1))
    return Tiles(doc.to(torch.int32), blk.to(torch.int32), ranked.to(torch.int32), cost)
