"""The contract between the data plane and encoder plugins.

``dataloading`` never imports ``omni``: an encoder plugin hands the data plane a
*processor* (a small picklable object without weights) that turns decoded media into
the packed encoder input and says how many LLM placeholder tokens an item becomes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

#: Modality names the data format knows, with the file extensions that carry them.
MODALITY_EXTENSIONS: dict[str, tuple[str, ...]] = {
    "image": ("jpg", "jpeg", "png", "webp"),
    "audio": ("wav", "flac"),
}
#: Placeholder text per modality, as written in a sample's ``txt`` field.
PLACEHOLDERS: dict[str, str] = {"image": "<image>", "audio": "<audio>"}


@dataclass
class MediaItem:
    """One preprocessed media item, ready to be packed with others of its modality."""

    features: torch.Tensor  # [n_units, feat_dim]: image patches or audio frames
    size: tuple[int, ...]  # image: (grid_h, grid_w) in patches; audio: (n_frames,)
    num_tokens: int  # LLM placeholder tokens this item turns into
    # For an LLM with M-RoPE (Qwen2-VL): (frames, rows, cols, time interval) of the item's
    # placeholders (``dataloading.positions.mrope_position_ids``); set by processors of towers
    # made for it (qwen_vl). None: the item's placeholders count like text.
    rope_grid: tuple[int, int, int, float] | None = None


@runtime_checkable
class MediaProcessor(Protocol):
    """Raw decoded media -> encoder input. Implemented by every encoder plugin."""

    modality: str

    def __call__(self, raw: Any) -> MediaItem:
        """image: uint8 array [H, W, 3]; audio: (float32 waveform [n], sample_rate)."""
        ...

    def num_tokens_from_meta(self, meta: dict) -> int:
        """Token count from index metadata alone (image: height/width; audio:
        num_samples/sample_rate), so planning never decodes media."""
        ...


def configure_processors(processors: dict[str, MediaProcessor], options: dict[str, dict],
                         where: str) -> dict[str, MediaProcessor]:
    """The processors with one source's per-modality options applied (``with_options``)."""
    out = dict(processors)
    for modality, opts in options.items():
        if not opts or modality not in out:
            continue  # options for an encoder the model lacks: its samples fail with that message
        proc = out[modality]
        if not hasattr(proc, "with_options"):
            from dataloading.errors import DataError

            raise DataError(f"{where}: the {modality} encoder's processor ({type(proc).__name__}) takes no options, "
                            f"but {sorted(opts)} were given; remove them from the mixture", kind="config")
        out[modality] = proc.with_options(**opts)
    return out
