"""Cut a packed micro-batch into the shares of its context-parallel (CP) ranks.

Every document of the row (delimited by ``cu_seqlens``) is padded to a multiple of 2*cp_size
and cut into 2*cp_size equal chunks; rank r gets chunks r and 2*cp_size-1-r. Under causal
attention chunk k costs about (k + 1/2)·chunk² (its queries see k earlier chunks and half of
their own), so pairing an early chunk with its mirror gives every rank the same work; a
contiguous split would leave the last rank with the most. Cutting per document (not the row as a
whole) keeps attention inside documents and the work balanced however lengths mix.

Positions keep their values in the whole document, so RoPE is unchanged (M-RoPE rows too).
Every rank keeps all of the row's media items (each rank runs or receives the encoder outputs);
``output_rows`` says which rows of the encoder output its local placeholders take.
"""
from __future__ import annotations

import torch

from dataloading.construct.batch import IGNORE_INDEX, CPInfo, MediaInputs, MicroBatch


def slice_for_cp(mb: MicroBatch, cp_size: int, cp_rank: int, pad_id: int) -> MicroBatch:
    """Rank ``cp_rank``'s share of the packed row ``mb`` (see the module docstring)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"slice_for_cp: cp_rank={cp_rank} must be in [0, cp_size) and cp_size >= 1 "
                         f"(cp_size={cp_size})")
    if mb.cp is not None:
        raise ValueError(f"slice_for_cp: the micro-batch is already CP rank {mb.cp.cp_rank}'s share of "
                         f"cp_size={mb.cp.cp_size}; slice the whole row")
    cu = mb.cu_seqlens.to(torch.int64)
    doc_lens = cu.diff()
    if cp_size == 1:  # one rank: nothing to balance, so no padding (the row is kept as is)
        info = CPInfo(1, 0, mb.cu_seqlens.to(torch.int32), doc_lens.to(torch.int32), doc_lens.to(torch.int32))
        return MicroBatch(mb.input_ids, mb.position_ids, mb.labels, mb.cu_seqlens, dict(mb.media),
                          list(mb.sample_ids), cp=info, rope_position_ids=mb.rope_position_ids)
    n_chunks = 2 * cp_size
    chunk_lens = (doc_lens + n_chunks - 1) // n_chunks
    info = CPInfo(cp_size, cp_rank, _cumsum0(chunk_lens * n_chunks).to(torch.int32),
                  chunk_lens.to(torch.int32), doc_lens.to(torch.int32))
    doc, offset = _local_layout(info)
    orig = cu[doc] + offset  # index into the unsliced row; >= its doc's end for padding
    real = offset < doc_lens[doc]
    last = cu[doc] + doc_lens[doc] - 1
    safe = torch.where(real, orig, last)  # a valid index; padding values are replaced below
    # Padding continues the document's positions: it comes after every real token, so under the
    # causal mask no real token attends to it.
    pad_step = offset - doc_lens[doc] + 1
    position_ids = torch.where(real, mb.position_ids[safe], mb.position_ids[last] + pad_step)
    rope = None  # M-RoPE rows: padding counts on from the last real token's, as above
    if mb.rope_position_ids is not None:
        rope = torch.where(real, mb.rope_position_ids[:, safe], mb.rope_position_ids[:, last] + pad_step)
    input_ids = torch.where(real, mb.input_ids[safe], torch.full_like(offset, pad_id))
    labels = torch.where(real, mb.labels[safe], torch.full_like(offset, IGNORE_INDEX))

    # Local index of each token of the unsliced row, -1 where another rank holds it.
    local_of = torch.full((mb.num_tokens,), -1, dtype=torch.int64, device=cu.device)
    local_of[safe[real]] = torch.arange(real.numel(), device=cu.device)[real]
    media = {}
    for modality, m in mb.media.items():
        loc = local_of[m.positions]
        keep = loc >= 0
        rows = torch.arange(m.positions.numel(), device=loc.device) if m.output_rows is None else m.output_rows
        media[modality] = MediaInputs(m.features, m.sizes, m.num_tokens, loc[keep], output_rows=rows[keep])
    local_cu = _cumsum0(2 * chunk_lens).to(torch.int32)
    return MicroBatch(input_ids, position_ids, labels, local_cu, media, list(mb.sample_ids), cp=info,
                      rope_position_ids=rope)


def merge_cp_slices(slices: list[MicroBatch]) -> MicroBatch:
    """The unsliced row back from the shares of all CP ranks (any order), padding dropped."""
    infos = [s.cp for s in slices]
    if not slices or any(i is None for i in infos):
        raise ValueError("merge_cp_slices: give the micro-batches slice_for_cp returned (each carries .cp)")
    cp_size = infos[0].cp_size
    if sorted(i.cp_rank for i in infos) != list(range(cp_size)) or any(i.cp_size != cp_size for i in infos):
        raise ValueError(f"merge_cp_slices: need exactly one slice per rank of cp_size={cp_size}; got ranks "
                         f"{[i.cp_rank for i in infos]} of sizes {[i.cp_size for i in infos]}")
    if any(not torch.equal(i.global_cu_seqlens, infos[0].global_cu_seqlens) for i in infos):
        raise ValueError("merge_cp_slices: the slices come from different rows (global_cu_seqlens differ)")
    first = slices[0]
    doc_lens = infos[0].doc_lens.to(torch.int64)
    cu = _cumsum0(doc_lens)
    total = int(cu[-1])
    device = first.input_ids.device
    input_ids = torch.empty(total, dtype=first.input_ids.dtype, device=device)
    position_ids = torch.empty(total, dtype=first.position_ids.dtype, device=device)
    labels = torch.empty(total, dtype=first.labels.dtype, device=device)
    rope = None if first.rope_position_ids is None else torch.empty(3, total, dtype=torch.int64, device=device)
    per_modality: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {m: [] for m in first.media}
    for s in slices:
        orig = _local_to_original(s.cp)
        real = orig >= 0
        input_ids[orig[real]] = s.input_ids[real]
        position_ids[orig[real]] = s.position_ids[real]
        labels[orig[real]] = s.labels[real]
        if rope is not None:
            rope[:, orig[real]] = s.rope_position_ids[:, real]
        for modality, m in s.media.items():
            rows = torch.arange(m.positions.numel(), device=device) if m.output_rows is None else m.output_rows
            per_modality[modality].append((rows, orig[m.positions]))
    media = {}
    for modality, parts in per_modality.items():
        rows = torch.cat([r for r, _ in parts])
        positions = torch.cat([p for _, p in parts])
        order = torch.argsort(rows)
        rows, positions = rows[order], positions[order]
        m = first.media[modality]
        # Every row placed exactly once is the unsliced layout: rows implied, in order.
        complete = torch.equal(rows, torch.arange(int(m.num_tokens.sum()), device=rows.device))
        media[modality] = MediaInputs(m.features, m.sizes, m.num_tokens, positions,
                                      output_rows=None if complete else rows)
    return MicroBatch(input_ids, position_ids, labels, cu.to(torch.int32), media,
                      list(first.sample_ids), rope_position_ids=rope)


def _cumsum0(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.new_zeros(1), x.cumsum(0)])


def _local_layout(info: CPInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """For each local token of rank ``info.cp_rank``: its document and its offset in the padded
    document. The rank's two chunks of a document sit side by side, chunk r first."""
    chunk = info.chunk_lens.to(torch.int64)
    dev = chunk.device
    if info.cp_size == 1:  # documents whole, unpadded
        doc = torch.repeat_interleave(torch.arange(chunk.numel(), device=dev), chunk)
        return doc, torch.arange(doc.numel(), device=dev) - _cumsum0(chunk)[doc]
    doc = torch.repeat_interleave(torch.arange(chunk.numel(), device=dev), 2 * chunk)
    u = torch.arange(doc.numel(), device=dev) - _cumsum0(2 * chunk)[doc]  # offset in the local pair of chunks
    c = chunk[doc]
    second = u >= c
    k = torch.where(second, 2 * info.cp_size - 1 - info.cp_rank, info.cp_rank)
    return doc, k * c + u - second * c


def _local_to_original(info: CPInfo) -> torch.Tensor:
    """For each local token: its index in the unsliced row, -1 for padding."""
    doc, offset = _local_layout(info)
    doc_lens = info.doc_lens.to(torch.int64)
    orig = _cumsum0(doc_lens)[doc] + offset
    return torch.where(offset < doc_lens[doc], orig, torch.full_like(orig, -1))


def local_documents(info: CPInfo, length: int) -> torch.Tensor:
    """Document number (in the whole row) of each of a CP rank's ``length`` local tokens. Tokens
    past the sliced row (padding added to even out micro-batch shapes) get a document of their
    own, different on every rank, so they attend only to themselves."""
    doc, _ = _local_layout(info)
    if length < doc.numel():
        raise ValueError(f"local_documents: length={length} is shorter than the {doc.numel()} sliced tokens")
    pad = torch.full((length - doc.numel(),), info.chunk_lens.numel() + 1 + info.cp_rank, dtype=doc.dtype,
                     device=doc.device)
    return torch.cat([doc, pad])


def local_positions(info: CPInfo, length: int) -> torch.Tensor:
    """Position of each of a CP rank's ``length`` local tokens when the row's positions count
    from 0 in every document (as packing makes them): its offset in its padded document; tokens
    past the sliced row count on from 0, as ``MicroBatch.padded`` numbers them. Lets one rank
    know a peer's positions without receiving them (the ring attention's hop plan)."""
    _, offset = _local_layout(info)
    if length < offset.numel():
        raise ValueError(f"local_positions: length={length} is shorter than the {offset.numel()} sliced tokens")
    return torch.cat([offset, torch.arange(length - offset.numel(), dtype=offset.dtype, device=offset.device)])


def local_real_tokens(info: CPInfo, length: int) -> torch.Tensor:
    """Which of a CP rank's ``length`` local tokens are real (not per-document or step padding)."""
    real = _local_to_original(info) >= 0
    if length < real.numel():
        raise ValueError(f"local_real_tokens: length={length} is shorter than the {real.numel()} sliced tokens")
    return torch.cat([real, real.new_zeros(length - real.numel())])
