"""Batch types the data plane hands to the trainer (plain tensors, no distributed state)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100


@dataclass
class MediaInputs:
    """All items of one modality in one micro-batch, packed without padding."""

    features: torch.Tensor  # [sum n_units, feat_dim], items concatenated in order
    sizes: torch.Tensor  # int64 [n_items, k]: per-item size (image: grid_h, grid_w; audio: n_frames)
    num_tokens: torch.Tensor  # int64 [n_items]: LLM tokens per item
    # Flat positions (into the micro-batch's packed row) that receive the encoder outputs,
    # item after item; len == num_tokens.sum(), or len(output_rows) when that is set.
    positions: torch.Tensor
    # Under context parallelism a rank holds only some placeholders but still gets every item:
    # the rows of the concatenated encoder output (item after item) that go to ``positions``,
    # same order. None: all rows, in order.
    output_rows: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> "MediaInputs":
        rows = None if self.output_rows is None else self.output_rows.to(device)
        return MediaInputs(*(t.to(device) for t in (self.features, self.sizes, self.num_tokens, self.positions)),
                           output_rows=rows)


@dataclass
class CPInfo:
    """How a context-parallel rank's row was cut from the whole packed row (see
    dataloading/construct/context_parallel.py): what ring/Ulysses attention needs to put it back together.

    For cp_size > 1 every document was padded to a multiple of 2*cp_size and cut into 2*cp_size
    chunks of ``chunk_lens[d]`` tokens; rank r holds chunks r and 2*cp_size-1-r, so each document
    contributes 2*chunk_lens[d] local tokens. For cp_size == 1 nothing is padded or cut: the rank
    holds every document whole and ``chunk_lens`` equals ``doc_lens``."""

    cp_size: int
    cp_rank: int
    global_cu_seqlens: torch.Tensor  # int32 [n_docs + 1]: padded document boundaries of the whole row
    chunk_lens: torch.Tensor  # int32 [n_docs]
    doc_lens: torch.Tensor  # int32 [n_docs]: unpadded lengths (the padding of doc d is its tail)

    def to(self, device: torch.device | str) -> "CPInfo":
        return CPInfo(self.cp_size, self.cp_rank, self.global_cu_seqlens.to(device), self.chunk_lens.to(device),
                      self.doc_lens.to(device))


@dataclass
class MicroBatch:
    """One packed row: several samples concatenated, each restarting its positions at 0."""

    input_ids: torch.Tensor  # int64 [T]; placeholder tokens where media embeddings go
    position_ids: torch.Tensor  # int64 [T], restart at 0 at every sample
    labels: torch.Tensor  # int64 [T]: next-token target at each position, IGNORE_INDEX where no loss
    cu_seqlens: torch.Tensor  # int32 [n_samples + 1]
    media: dict[str, MediaInputs] = field(default_factory=dict)
    sample_ids: list[str] = field(default_factory=list)
    # Set when this is one context-parallel rank's share of a packed row; None: the whole row.
    cp: CPInfo | None = None
    # int64 [3, T]: M-RoPE positions (temporal, height, width) where an item of the row has a
    # ``rope_grid``; None: every row equals position_ids (text, and media without one).
    rope_position_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_target_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @staticmethod
    def empty(cp: "CPInfo | None" = None) -> "MicroBatch":
        """A placeholder with no tokens (pad it to the shape the step needs)."""
        z = torch.zeros(0, dtype=torch.int64)
        return MicroBatch(z, z.clone(), z.clone(), torch.zeros(1, dtype=torch.int32), cp=_empty_cp(cp))

    def padded(self, length: int, pad_id: int) -> "MicroBatch":
        """The row with ``length - num_tokens`` padding tokens appended (no loss, positions
        restarting at 0, so they form a document of their own that no real token sees).
        Pipeline stages need equal shapes and sequence parallelism a multiple of its size."""
        extra = length - self.num_tokens
        if extra < 0:
            raise ValueError(f"cannot pad a row of {self.num_tokens} tokens to {length}")
        if extra == 0:
            return self
        dev = self.input_ids.device
        tail = torch.arange(extra, dtype=self.position_ids.dtype, device=dev)
        rope = self.rope_position_ids
        return MicroBatch(
            input_ids=torch.cat([self.input_ids, torch.full((extra,), pad_id, dtype=self.input_ids.dtype, device=dev)]),
            position_ids=torch.cat([self.position_ids, tail]),
            labels=torch.cat([self.labels, torch.full((extra,), IGNORE_INDEX, dtype=self.labels.dtype, device=dev)]),
            cu_seqlens=torch.cat([self.cu_seqlens, self.cu_seqlens.new_tensor([length])]),
            media=dict(self.media), sample_ids=list(self.sample_ids), cp=self.cp,
            rope_position_ids=None if rope is None else torch.cat([rope, tail.expand(3, extra)], dim=1),
        )

    def to(self, device: torch.device | str) -> "MicroBatch":
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            labels=self.labels.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            media={m: x.to(device) for m, x in self.media.items()},
            sample_ids=list(self.sample_ids),
            cp=None if self.cp is None else self.cp.to(device),
            rope_position_ids=None if self.rope_position_ids is None else self.rope_position_ids.to(device),
        )


@dataclass
class StepBatch:
    """What one data-parallel rank trains on in one optimizer step."""

    step: int
    micro_batches: list[MicroBatch]
    # Data problems met while building this step (e.g. {"corrupt_sample": 1}); reported in metrics.
    problems: dict[str, int] = field(default_factory=dict)
    # The planner's balance of this step over all ranks (max/mean cost, lower bound, utilisation).
    plan_stats: dict[str, float] = field(default_factory=dict)
    # Seconds the trainer waited for this step (0 when the workers were ahead).
    data_wait_s: float = 0.0

    @property
    def num_target_tokens(self) -> int:
        return sum(mb.num_target_tokens for mb in self.micro_batches)

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)


def _empty_cp(cp: CPInfo | None) -> CPInfo | None:
    """The CP description of a row with no documents, for the same CP rank."""
    if cp is None:
        return None
    z = torch.zeros(0, dtype=torch.int32)
    return CPInfo(cp.cp_size, cp.cp_rank, torch.zeros(1, dtype=torch.int32), z, z.clone())
