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

from dataloading.formats.modality import AUDIO, MODALITIES

#: The maps of the media kinds, derived from their declarations (``dataloading.formats.modality``).
#: Field extensions per kind.
MODALITY_EXTENSIONS: dict[str, tuple[str, ...]] = {m.name: m.extensions for m in MODALITIES}
#: Placeholder text per encoder modality, as written in a sample's ``txt`` field; each is one
#: token id of the tokenizer (``dataloading.formats.tokenizer``).
PLACEHOLDERS: dict[str, str] = {m.name: m.placeholder for m in MODALITIES if not m.encoded_as}
#: Media kinds that another modality's encoder takes (video -> image): their items are made by
#: that encoder's processor and packed, encoded and multiplexed as its items.
ENCODED_AS: dict[str, str] = {m.name: m.encoded_as for m in MODALITIES if m.encoded_as}
#: Placeholder text of every media kind (the encoder modalities' and the video's).
MEDIA_PLACEHOLDERS: dict[str, str] = {m.name: m.placeholder for m in MODALITIES}


def encoder_modality(kind: str) -> str:
    """The encoder modality (slot, packed items, cost) of a media kind: ``video`` -> ``image``."""
    return MODALITIES.encoder_of(kind)


def as_encoder_placeholders(text: str) -> str:
    """``text`` with each placeholder of a kind without an encoder of its own written as its
    encoder's (``<video>`` -> ``<image>``): the tokenizer gives ids to the encoder modalities'
    placeholders, and a video's item takes an image placeholder's place. The items' kinds were
    matched to the placeholders before (``dataloading.formats.sample.parse_fields``)."""
    for kind, modality in ENCODED_AS.items():
        text = text.replace(MEDIA_PLACEHOLDERS[kind], PLACEHOLDERS[modality])
    return text


@dataclass
class MediaItem:
    """One preprocessed media item, ready to be packed with others of its modality."""

    features: torch.Tensor  # [n_units, feat_dim]: image patches or audio frames
    size: tuple[int, ...]  # image: (grid_h, grid_w) in patches; audio: (n_frames,)
    num_tokens: int  # LLM placeholder tokens this item turns into
    # For an LLM with M-RoPE (Qwen2-VL): (frames, rows, cols, time interval[, text resumes past
    # the item's largest position]) of the item's placeholders
    # (``dataloading.construct.positions.mrope_position_ids``); set by processors of towers made
    # for it (qwen_vl, qwen_omni_vision). None: the item's placeholders count like text.
    rope_grid: tuple | None = None
    # A video's own audio track, encoded by the audio tower, its tokens interleaved with the
    # frames' in chunks of ``track_chunk`` rotary positions (Qwen2.5-Omni's use_audio_in_video:
    # ``dataloading.construct.positions.video_with_audio``), or token by token by time with
    # ``track_chunk`` 0 (Qwen3-Omni's: ``video_with_audio_by_time``); None: the frames alone.
    track: "MediaItem | None" = None
    track_chunk: float = 0.0
    # One frame of a clip that a family writes frame by frame (Qwen3-VL: a timestamp before each
    # temporal patch): this text, then the family's opening token, the item's placeholders and
    # its closing token; the placeholder's own opening and closing tokens are dropped
    # (``dataloading.construct.constructor``). None: the item sits inside its placeholder's frame.
    frame_text: str | None = None


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


def takes_video_track(processor: MediaProcessor) -> bool:
    """Whether a video's processor was asked for each clip's own audio track (a source's
    ``video: {audio: true}``): the constructor then decodes the track for the audio tower and the
    planner counts its tokens."""
    return bool(getattr(processor, "video_audio", False))


def family_frame(tokenizer: Any, kind: str) -> Any:
    """The model family's placeholder tokens of a media kind (``PlaceholderTokens``: its token,
    opening and closing ones), None for a tokenizer without a family's (the byte tokenizer)."""
    return getattr(tokenizer, "family_tokens", {}).get(kind)


def track_framing(tokenizer: Any) -> tuple[str, str] | None:
    """The opening and closing tokens a video's own audio track goes between with its frames
    (the family's audio framing), None for a tokenizer that lacks them."""
    frame = family_frame(tokenizer, AUDIO.name)
    return (frame.before, frame.after) if frame is not None and frame.before and frame.after else None


def frame_texts_from_meta(processor: MediaProcessor, meta: dict) -> list[str]:
    """The texts a processor writes before the frames of a clip (``MediaItem.frame_text``), from
    index metadata (its optional ``frame_texts_from_meta``); [] for one that writes none."""
    texts = getattr(processor, "frame_texts_from_meta", None)
    return list(texts(meta)) if texts is not None else []


def processor_for(processors: Mapping[str, MediaProcessor], kind: str, where: str) -> MediaProcessor:
    """The processor of a media kind's encoder, or a one-line config DataError: no such encoder,
    or (video) an image encoder whose processor takes no video (``Modality.made_by``)."""
    from dataloading.errors import DataError

    modality = encoder_modality(kind)
    proc = processors.get(modality)
    if proc is None:
        raise DataError(f"{where} has {kind} media but no {modality} processor was given; configure a {modality} "
                        f"encoder or drop the source", kind="config")
    declared = MODALITIES.get(kind)
    if declared is not None and not declared.made_by(proc):
        raise DataError(f"{where} has {kind} media but the {modality} encoder's processor ({type(proc).__name__}) "
                        f"cannot encode {kind}; use {declared.item_hint} or drop the source", kind="config")
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
        # A kind made by a method of its own (video) needs that method for its options to mean anything.
        declared = MODALITIES.get(kind)
        own_method = declared is not None and declared.item_method is not None
        if not hasattr(proc, "with_options") or (own_method and not declared.made_by(proc)):
            what = f"{kind} options" if own_method else "options"
            raise DataError(f"{where}: the {modality} encoder's processor ({type(proc).__name__}) takes no {what}, "
                            f"but {sorted(opts)} were given; remove them from the mixture", kind="config")
        try:
            out[modality] = proc.with_options(**opts)
        except (TypeError, ValueError) as e:
            raise DataError(f"{where}: {kind} options {dict(opts)} are refused by {type(proc).__name__} ({e}); "
                            f"fix them in the mixture", kind="config") from None
    return out
