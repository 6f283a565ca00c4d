"""Media kinds, one declaration each.

Everything the data plane, the converter, ``omni generate`` and the simulator know about a
media kind (its placeholder, file extensions, decoder, mixture options, how records name it,
which encoder takes it) is a field of its ``Modality``; the maps other modules read
(``dataloading.formats.media.MODALITY_EXTENSIONS``, ``PLACEHOLDERS``, ...) are derived from
``MODALITIES``, never written out again. Adding a kind is one declaration here, plus an encoder
plugin whose processor makes its items (``dataloading.formats.media.MediaProcessor``) unless
another encoder takes it, as the vision encoder takes video.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dataloading.formats.media_codecs import (audio_meta, decode_audio, decode_image, image_meta, sniff_audio,
                                              sniff_image)
from dataloading.formats.video import decode_video, sniff_video, video_meta


@dataclass(frozen=True)
class Modality:
    """One media kind: what a sample's field and placeholder, the index, a mixture and the
    converter's records call it, and what turns its bytes into an encoder's item."""

    name: str  # the kind, as the index, mixtures and media manifests write it
    placeholder: str  # its text in a sample's prompt (each becomes the encoder's placeholder id)
    extensions: tuple[str, ...]  # the (lower-case) field extensions that carry it
    description: str  # what a file refused as this kind should have been: "an image (PNG, JPEG, WebP)"
    read_meta: Callable[[bytes], dict]  # header-only metadata for the index: nothing is decoded
    decode: Callable[[bytes], Any]  # bytes -> what its processor takes
    sniff: Callable[[bytes], str | None]  # the field extension of bytes without a file name (may raise)
    # Per-source mixture options, given to its encoder's processor (``with_options``): key -> the
    # type of a positive number (int, float) or a tuple of the allowed values.
    options: Mapping[str, Any] = field(default_factory=dict)
    record_keys: tuple[str, ...] = ()  # keys of a converted record that list its items, read in this order
    part_types: tuple[str, ...] = ()  # chat content-part types that stand for an item (OpenAI's, transformers')
    # The encoder modality that encodes it ("": its own). The encoder's slot, packed items,
    # placeholder id and cost coefficients (the planner's and the simulator's) are then that one's.
    encoded_as: str = ""
    item_method: str | None = None  # the processor method that makes its items (None: calling the processor)
    item_hint: str = ""  # the encoder to configure when the processor lacks ``item_method``
    decodes_lazily: bool = False  # ``decode`` reads only the header (the converter then checks no more)
    byte_token_id: int | None = None  # its placeholder's reserved id in the byte tokenizer (encoder modalities)

    @property
    def encoder(self) -> str:
        """The encoder modality that encodes it: its own name unless ``encoded_as`` says another."""
        return self.encoded_as or self.name

    def made_by(self, processor: Any) -> bool:
        """Whether ``processor`` (its encoder's) can make its items."""
        return self.item_method is None or callable(getattr(processor, self.item_method, None))

    def make_item(self, processor: Any, raw: Any) -> Any:
        """Decoded media -> the processor's item(s) (a video: the image processor's ``video``)."""
        return processor(raw) if self.item_method is None else getattr(processor, self.item_method)(raw)


class Registry:
    """Declarations by name, in their order, with the lookups derived from them once. Names,
    extensions, placeholders and part types must be unique, and ``encoded_as`` must name a
    declared kind that has an encoder of its own."""

    def __init__(self, declarations: Iterable[Modality]) -> None:
        self._by_name: dict[str, Modality] = {}
        self._of_extension: dict[str, str] = {}
        self._of_placeholder: dict[str, str] = {}
        self._of_part_type: dict[str, str] = {}
        for m in declarations:
            _claim(self._by_name, m.name, m, "name")
            for ext in m.extensions:
                _claim(self._of_extension, ext, m.name, "extension")
            _claim(self._of_placeholder, m.placeholder, m.name, "placeholder")
            for part in m.part_types:
                _claim(self._of_part_type, part, m.name, "content part type")
        for m in self:
            if m.encoder not in self._by_name or self._by_name[m.encoder].encoded_as:
                raise ValueError(f"modality {m.name!r} is encoded as {m.encoder!r}, which is not a declared "
                                 "modality with an encoder of its own")
        self.placeholder_re = re.compile("|".join(re.escape(p) for p in self._of_placeholder))

    def __iter__(self) -> Iterator[Modality]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Modality:
        return self._by_name[name]

    def get(self, name: str) -> Modality | None:
        return self._by_name.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def of_extension(self, ext: str) -> str | None:
        """The kind a (lower-case) field extension carries, or None."""
        return self._of_extension.get(ext)

    def of_placeholder(self, text: str) -> str | None:
        """The kind of a placeholder text (``<video>`` -> video), or None."""
        return self._of_placeholder.get(text)

    def of_part_type(self, part_type: str) -> str | None:
        """The kind a chat content part's type stands for (``image_url`` -> image), or None."""
        return self._of_part_type.get(part_type)

    def placeholder_kinds(self, text: str) -> list[str]:
        """The kinds of the placeholders in ``text``, in order."""
        return [self._of_placeholder[p] for p in self.placeholder_re.findall(text)]

    def encoder_of(self, kind: str) -> str:
        """The encoder modality of a kind (``video`` -> ``image``); an undeclared name is its own."""
        m = self._by_name.get(kind)
        return m.encoder if m is not None else kind


def _claim(taken: dict, key: str, value: Any, what: str) -> None:
    if key in taken:
        raise ValueError(f"two modalities declare the {what} {key!r}; each must be one modality's")
    taken[key] = value


IMAGE = Modality(
    "image", "<image>", ("jpg", "jpeg", "png", "webp"), "an image (PNG, JPEG, WebP)",
    read_meta=image_meta, decode=decode_image, sniff=sniff_image,
    options={"max_patches": int, "min_patches": int, "resize": ("fit", "square")},
    record_keys=("images", "image"), part_types=("image", "image_url"), byte_token_id=259)
AUDIO = Modality(
    "audio", "<audio>", ("wav", "flac"), "an audio file (WAV, FLAC)",
    read_meta=audio_meta, decode=decode_audio, sniff=sniff_audio,
    options={"chunk_seconds": float},
    record_keys=("audios", "audio"), part_types=("audio", "input_audio"), byte_token_id=260)
# A video is a sequence of frames for the vision tower (Qwen2-VL encodes it as one item of
# t x h x w patches, attending within each temporal patch), so it has no encoder slot, projector,
# cost coefficients or placeholder id of its own: its items are made by the image processor's
# ``video`` method and packed, encoded and multiplexed as image items; only its placeholder text
# differs, and it becomes the image placeholder id (``dataloading.formats.media.as_encoder_placeholders``).
# Its frames stay encoded until the processor samples them (``dataloading.formats.video``).
# ``audio: true`` gives its own audio track to the audio tower too, where the model interleaves
# the two (Qwen2.5-Omni's use_audio_in_video: ``dataloading.formats.media.takes_video_track``).
VIDEO = Modality(
    "video", "<video>", ("mp4", "webm"), "a video (MP4, WebM)",
    read_meta=video_meta, decode=decode_video, sniff=sniff_video,
    options={"fps": float, "min_frames": int, "max_frames": int, "max_video_pixels": int, "audio": (True, False)},
    record_keys=("videos", "video"), part_types=("video", "video_url"),
    encoded_as="image", item_method="video",
    item_hint="a video-capable vision encoder (qwen_vl, qwen3_vl, the Omni towers)",
    decodes_lazily=True)

#: The media kinds Omni knows, in the order their maps list them.
MODALITIES = Registry((IMAGE, AUDIO, VIDEO))
