"""The contract between the data plane and encoder plugins.

``dataloading`` never imports ``omni``: an encoder plugin hands the data plane a
*processor* (a small picklable object without weights) that turns decoded media into
the packed encoder input and says how many LLM placeholder tokens an item becomes.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

#: Media kinds the data format knows, with the file extensions that carry them.
MODALITY_EXTENSIONS: dict[str, tuple[str, ...]] = {
    "image": ("jpg", "jpeg", "png", "webp"),
    "audio": ("wav", "flac"),
    "video": ("mp4", "webm"),
}
#: Placeholder text per encoder modality, as written in a sample's ``txt`` field; each is one
#: token id of the tokenizer (``dataloading.formats.tokenizer``).
PLACEHOLDERS: dict[str, str] = {"image": "<image>", "audio": "<audio>"}
#: Media kinds that another modality's encoder takes. A video is a sequence of frames for the
#: vision tower (Qwen2-VL encodes it as one item of t x h x w patches, attending within each
#: temporal patch), so it has no encoder slot, projector, cost coefficients or placeholder id of
#: its own: its items are made by the image processor's ``video`` method and packed, encoded and
#: multiplexed as image items; only its placeholder text differs, and it becomes the image
#: placeholder id (``as_encoder_placeholders``).
ENCODED_AS: dict[str, str] = {"video": "image"}
#: Placeholder text of every media kind (the encoder modalities' and the video's).
MEDIA_PLACEHOLDERS: dict[str, str] = {**PLACEHOLDERS, "video": "<video>"}


def encoder_modality(kind: str) -> str:
    """The encoder modality (slot, packed items, cost) of a media kind: ``video`` -> ``image``."""
    return ENCODED_AS.get(kind, kind)


def as_encoder_placeholders(text: str) -> str:
    """``text`` with each placeholder of a kind without an encoder of its own written as its
    encoder's (``<video>`` -> ``<image>``): the tokenizer gives ids to the encoder modalities'
    placeholders, and a video's item takes an image placeholder's place. The items' kinds were
    matched to the placeholders before (``dataloading.formats.sample.parse_fields``)."""
    for kind, modality in ENCODED_AS.items():
        text = text.replace(MEDIA_PLACEHOLDERS[kind], PLACEHOLDERS[modality])
    return text


def takes_video(processor: Any) -> bool:
    """Whether an image processor can turn a video into an item (has a ``video`` method)."""
    return callable(getattr(processor, "video", None))


@dataclass
class MediaItem:
    """One preprocessed media item, ready to be packed with others of its modality."""

    features: torch.Tensor  # [n_units, feat_dim]: image patches or audio frames
    size: tuple[int, ...]  # image: (grid_h, grid_w) in patches; audio: (n_frames,)
    num_tokens: int  # LLM placeholder tokens this item turns into
    # For an LLM with M-RoPE (Qwen2-VL): (frames, rows, cols, time interval) of the item's
    # placeholders (``dataloading.construct.positions.mrope_position_ids``); set by processors of towers
    # made for it (qwen_vl). None: the item's placeholders count like text.
    rope_grid: tuple[int, int, int, float] | None = None


@runtime_checkable
class MediaProcessor(Protocol):
    """Raw decoded media -> encoder input. Implemented by every encoder plugin.

    An image processor may also take videos: a ``video(clip: dataloading.formats.video.Video) ->
    MediaItem`` method (frames sampled from ``clip``, an item of its own modality), and
    ``num_tokens_from_meta`` answering for a video's metadata too (it has a ``duration``)."""

    modality: str

    def __call__(self, raw: Any) -> MediaItem:
        """image: uint8 array [H, W, 3]; audio: (float32 waveform [n], sample_rate)."""
        ...

    def num_tokens_from_meta(self, meta: dict) -> int:
        """Token count from index metadata alone (image: height/width; audio:
        num_samples/sample_rate; video: ``dataloading.formats.video.video_meta``), so planning never
        decodes media."""
        ...


def processor_for(processors: Mapping[str, MediaProcessor], kind: str, where: str) -> MediaProcessor:
    """The processor of a media kind's encoder, or a one-line config DataError: no such encoder,
    or (video) an image encoder whose processor takes no video."""
    from dataloading.errors import DataError

    modality = encoder_modality(kind)
    proc = processors.get(modality)
    if proc is None:
        raise DataError(f"{where} has {kind} media but no {modality} processor was given; configure a {modality} "
                        f"encoder or drop the source", kind="config")
    if kind == "video" and not takes_video(proc):
        raise DataError(f"{where} has video media but the image encoder's processor ({type(proc).__name__}) cannot "
                        f"encode video; use a video-capable vision encoder (qwen_vl) or drop the source", kind="config")
    return proc


def configure_processors(processors: dict[str, MediaProcessor], options: dict[str, dict],
                         where: str) -> dict[str, MediaProcessor]:
    """The processors with one source's per-kind options applied (``with_options``); a video's
    options (``fps``, ``max_frames``, ...) go to the image processor that encodes videos. Options
    the processor refuses are a one-line config DataError."""
    from dataloading.errors import DataError

    out = dict(processors)
    for kind, opts in options.items():
        modality = encoder_modality(kind)
        if not opts or modality not in out:
            continue  # options for an encoder the model lacks: its samples fail with that message
        proc = out[modality]
        if not hasattr(proc, "with_options") or (kind == "video" and not takes_video(proc)):
            what = "video options" if kind == "video" else "options"
            raise DataError(f"{where}: the {modality} encoder's processor ({type(proc).__name__}) takes no {what}, "
                            f"but {sorted(opts)} were given; remove them from the mixture", kind="config")
        try:
            out[modality] = proc.with_options(**opts)
        except (TypeError, ValueError) as e:
            raise DataError(f"{where}: {kind} options {dict(opts)} are refused by {type(proc).__name__} ({e}); "
                            f"fix them in the mixture", kind="config") from None
    return out
