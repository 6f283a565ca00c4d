"""What the encoder planner knows of one rank's micro-batch: its ``MediaManifest`` (items, sizes,
which output rows land where under the rank's CP and TP shares, the row's documents), read on the
host before the batch moves to the device, so planning and routing never wait for the
accelerator (``omni.step.encoder_plan``)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dataloading.construct.batch import MicroBatch
from parallel.strict_device import on_device


@dataclass
class MediaManifest:
    """One rank's micro-batch as the encoder planner sees it: plain host numbers."""

    # (modality, index, tokens, feature rows, sizes row) per item, modalities in sorted order
    items: list[tuple[str, int, int, int, tuple[int, ...]]] = field(default_factory=list)
    # modality -> the output rows (indices into the concatenated outputs of the micro-batch's
    # items) this rank embeds, and where: positions in its row (its TP shard under SP)
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    positions: dict[str, np.ndarray] = field(default_factory=dict)
    features: dict[str, tuple[int, str]] = field(default_factory=dict)  # modality -> (width, dtype name)
    # The packed row's documents (the whole row's under CP): what its LLM work costs.
    doc_lengths: list[int] = field(default_factory=list)


def row_doc_lengths(mb: MicroBatch) -> list[int]:
    """The document lengths of a host-side micro-batch's whole packed row (under context
    parallelism, of the row it was cut from), for the cost model's LLM term."""
    cu = mb.cp.global_cu_seqlens if mb.cp is not None and mb.cp.cp_size > 1 else mb.cu_seqlens
    return [int(x) for x in (cu[1:] - cu[:-1]).tolist()]


def describe_media(mb: MicroBatch, units_of: Mapping[str, Callable[[object], Sequence[int]]],
                   tp_size: int = 1, tp_rank: int = 0) -> MediaManifest:
    """The manifest of a host-side (padded, CP-sliced) micro-batch. ``units_of[m](sizes)``:
    feature rows per item of modality m. Under sequence parallelism (``tp_size`` > 1) the row
    is cut into ``tp_size`` equal shards and this rank embeds only the placeholders of shard
    ``tp_rank`` (positions relative to it)."""
    out = MediaManifest()
    for m in sorted(mb.media):
        media = mb.media[m]
        # It reads the items' sizes, token counts and placeholder positions, which stay on the
        # host; of the features (on the device when the data peers sent them ahead) only their
        # shape and dtype, which the host knows.
        read = (media.sizes, media.num_tokens, media.positions, media.output_rows)
        if any(on_device(t) for t in read):
            raise ValueError(f"describe_media reads host tensors; describe the {m} inputs before moving the "
                             f"micro-batch to the device")
        units = [int(u) for u in units_of[m](media.sizes)]
        for i, (tok, u, size) in enumerate(zip(media.num_tokens.tolist(), units, media.sizes.tolist())):
            out.items.append((m, i, int(tok), u, tuple(int(s) for s in size)))
        pos = media.positions.numpy().astype(np.int64)
        rows = (media.output_rows.numpy().astype(np.int64) if media.output_rows is not None
                else np.arange(pos.size, dtype=np.int64))
        if tp_size > 1:
            shard = mb.input_ids.numel() // tp_size
            keep = (pos // shard) == tp_rank
            pos, rows = pos[keep] - tp_rank * shard, rows[keep]
        out.rows[m], out.positions[m] = rows, pos
        out.features[m] = (int(media.features.shape[1]), str(media.features.dtype).replace("torch.", ""))
    out.doc_lengths = row_doc_lengths(mb)
    return out
