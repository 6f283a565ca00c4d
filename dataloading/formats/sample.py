"""One raw sample: its fields, their validation, media decoding and header-only metadata.

A sample is the files of a webdataset shard that share a key (see docs/data.md): its text,
either ``txt`` with an optional ``response.txt`` or a conversation, ``messages.json``
(``dataloading.formats.chat``); ``json`` (optional) and media: one item as a plain extension (``png``)
or several as numbered fields (``0.png``, ``1.wav``, ...), the i-th placeholder of the text
(of a conversation: over its turns in order) taking field i. A media item's *kind* (image, audio, video) is
what its field and placeholder say; a video is encoded by the image encoder
(``dataloading.formats.media.ENCODED_AS``) but keeps its kind here and in the index. The kinds, their
extensions and placeholders are their declarations' (``dataloading.formats.modality``); the
parsing functions take the registry to read them from.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from dataloading.errors import DataError
from dataloading.formats.chat import MESSAGES_FIELD, last_answer, parse_messages, prompt_text, render_segments
from dataloading.formats.modality import MODALITIES, Registry

_NUMBERED = re.compile(r"^(\d+)\.([A-Za-z0-9]+)$")
_FORMAT_HINT = "see docs/data.md (sample format)"


@dataclass
class RawSample:
    """Fields parsed and checked for consistency; media still encoded bytes."""

    sample_id: str
    text: str
    response: str | None
    media: list[tuple[str, str, bytes]]  # (modality, field name, encoded bytes), placeholder order
    meta: dict[str, Any] = field(default_factory=dict)
    # A conversation's turns (``text`` is then their contents joined, ``response`` None).
    messages: list[dict[str, str]] | None = None


@dataclass
class DecodedSample:
    sample_id: str
    text: str
    response: str | None
    # image: uint8 [H, W, 3]; audio: (float32 mono waveform [n], sample_rate);
    # video: dataloading.formats.video.Video (header read, frames decoded when the processor samples them)
    media: list[tuple[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None


def placeholder_modalities(text: str, modalities: Registry = MODALITIES) -> list[str]:
    """The media kinds of the placeholders in ``text`` (``<image>``, ``<audio>``, ``<video>``), in order."""
    return modalities.placeholder_kinds(text)


def _text(sample_id: str, fields: dict[str, bytes], name: str) -> str:
    try:
        return bytes(fields[name]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"sample {sample_id}: field {name!r} is not UTF-8 ({e.reason} at byte {e.start}); "
                        "re-encode the text as UTF-8", kind="bad_text") from None


def media_fields(sample_id: str, fields: dict[str, bytes],
                 modalities: Registry = MODALITIES) -> list[tuple[str, str]]:
    """(modality, field name) of the media fields, in placeholder order."""
    plain, numbered = [], {}
    for name in fields:
        kind = modalities.of_extension(name.lower())
        if kind is not None:
            plain.append((kind, name))
            continue
        m = _NUMBERED.match(name)
        if m is None:
            continue  # txt, response.txt, json and unknown extras (e.g. __url__) are not media
        index, kind = int(m.group(1)), modalities.of_extension(m.group(2).lower())
        if kind is None:
            known = sorted(ext for d in modalities for ext in d.extensions)
            raise DataError(f"sample {sample_id}: field {name!r} has an unsupported media type; use one of "
                            f"{known}", kind="bad_fields")
        if index in numbered:
            raise DataError(f"sample {sample_id}: fields {numbered[index][1]!r} and {name!r} share number {index}; "
                            "give every media item its own number", kind="bad_fields")
        numbered[index] = (kind, name)
    if plain and numbered:
        raise DataError(f"sample {sample_id}: mixes a plain media field ({plain[0][1]!r}) with numbered ones "
                        f"({numbered[min(numbered)][1]!r}); with several items number them all (0.png, 1.wav, ...)",
                        kind="bad_fields")
    if len(plain) > 1:
        raise DataError(f"sample {sample_id}: several plain media fields {sorted(n for _, n in plain)}; "
                        "number them in placeholder order (0.png, 1.wav, ...)", kind="bad_fields")
    if numbered and sorted(numbered) != list(range(len(numbered))):
        raise DataError(f"sample {sample_id}: media fields are numbered {sorted(numbered)}; number them "
                        f"0..{len(numbered) - 1} in placeholder order", kind="bad_fields")
    return plain or [numbered[i] for i in range(len(numbered))]


def parse_fields(sample_id: str, fields: dict[str, bytes], modalities: Registry = MODALITIES) -> RawSample:
    """Check a sample's fields against the format; raises DataError naming the sample."""
    messages = None
    if MESSAGES_FIELD in fields:
        if "txt" in fields or "response.txt" in fields:
            raise DataError(f"sample {sample_id}: has both {MESSAGES_FIELD} and txt/response.txt; a sample is a "
                            f"conversation or a prompt and response, {_FORMAT_HINT}", kind="bad_fields")
        messages = parse_messages(sample_id, fields[MESSAGES_FIELD])
        text, response = prompt_text(messages), None
    elif "txt" not in fields:
        raise DataError(f"sample {sample_id}: no 'txt' or '{MESSAGES_FIELD}' field (fields: {sorted(fields)}); every "
                        f"sample needs its text in <key>.txt or its conversation in <key>.{MESSAGES_FIELD}, "
                        f"{_FORMAT_HINT}", kind="bad_fields")
    else:
        text = _text(sample_id, fields, "txt")
        response = _text(sample_id, fields, "response.txt") if "response.txt" in fields else None
    if response is not None and placeholder_modalities(response, modalities):
        raise DataError(f"sample {sample_id}: response.txt contains a media placeholder; media go in the "
                        "prompt (txt) only", kind="placeholder_mismatch")
    media = media_fields(sample_id, fields, modalities)
    wanted = placeholder_modalities(text, modalities)
    have = [m for m, _ in media]
    if wanted != have:
        raise DataError(
            f"sample {sample_id}: text placeholders {wanted} do not match media fields "
            f"{[n for _, n in media]} ({have}); the i-th placeholder needs media field i of its modality "
            f"(one item: plain 'png'/'wav', several: '0.png', '1.wav', ...)", kind="placeholder_mismatch")
    meta: dict[str, Any] = {}
    if "json" in fields:
        try:
            meta = json.loads(bytes(fields["json"]).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise DataError(f"sample {sample_id}: field 'json' is not valid JSON ({e}); fix or drop it",
                            kind="bad_fields") from None
    return RawSample(sample_id, text, response, [(m, n, bytes(fields[n])) for m, n in media], meta, messages)


def media_meta(modality: str, data: bytes) -> dict[str, Any]:
    """Header-only metadata for the index: the pixels / samples / frames are not decoded."""
    declared = MODALITIES.get(modality)
    if declared is None:
        raise ValueError(f"unknown modality {modality!r}")
    return declared.read_meta(data)


def _media_error(sample_id: str, name: str, e: Exception) -> DataError:
    return DataError(f"sample {sample_id}: media field {name!r} cannot be decoded ({type(e).__name__}: {e}); "
                     "re-encode or remove the sample", kind="corrupt_media")


def read_meta(raw: RawSample) -> list[tuple[str, dict]]:
    out = []
    for modality, name, data in raw.media:
        try:
            out.append((modality, media_meta(modality, data)))
        except DataError:
            raise  # not this file's fault (a decoder extra is missing): the message says so
        except Exception as e:  # PIL, soundfile and PyAV raise many types on bad bytes
            raise _media_error(raw.sample_id, name, e) from None
    return out


def decode_sample(sample_id: str, fields: dict[str, bytes]) -> DecodedSample:
    raw = parse_fields(sample_id, fields)
    media = []
    for modality, name, data in raw.media:
        try:
            media.append((modality, MODALITIES[modality].decode(data)))
        except DataError:
            raise
        except Exception as e:
            raise _media_error(sample_id, name, e) from None
    return DecodedSample(sample_id, raw.text, raw.response, media, raw.meta, raw.messages)


def text_segments(tokenizer, sample: DecodedSample, options,
                  prompt_only: bool = False) -> tuple[list[tuple[str, bool]], bool]:
    """The sample's text as (text, gets a loss) pieces, and whether EOS follows as a target.
    ``options``: its source's ``SourceOptions`` (``assistant_loss``, ``chat_template``). One home
    for the constructor, which builds the sample from it, and the planner's token counts.

    A conversation is its chat-template rendering, the assistant turns (per the source's
    ``assistant_loss``) the targets, each closed by the template's own end of turn; held out
    (``prompt_only``) it is the turns before its last answer with the generation prompt.
    A prompt and response: the prompt (in the source's ``chat_template``) then the response
    and EOS as targets; a text alone is all target."""
    if sample.messages is not None:
        if prompt_only:
            question, _ = last_answer(sample.messages)
            return [(tokenizer.render_chat(question, add_generation_prompt=True), False)], False
        return render_segments(tokenizer, sample.sample_id, sample.messages, options.assistant_loss), False
    text = options.chat_template.replace("{prompt}", sample.text) if options.chat_template else sample.text
    if prompt_only:
        return [(text, False)], False
    if sample.response is None:
        return [(text, True)], True
    return [(text, False), (sample.response, True)], True
