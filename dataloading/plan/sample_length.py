"""A sample's packed length and its media items' encoder tokens, from index metadata alone (no
media is decoded): what the planner balances and packs. Exact for the byte tokenizer; an
estimate of the text for subword ones (the constructor re-packs a micro-batch that overflows)."""
from __future__ import annotations

from collections.abc import Mapping

from dataloading.errors import DataError
from dataloading.formats.media import (MEDIA_PLACEHOLDERS, MediaProcessor, encoder_modality, family_frame,
                                       frame_texts_from_meta, processor_for, takes_video_track, track_framing)
from dataloading.formats.modality import AUDIO, VIDEO
from dataloading.formats.tokenizer import Tokenizer, estimate_text_tokens
from dataloading.index.source_index import SampleMeta


def media_entries(meta: SampleMeta, processors: Mapping[str, MediaProcessor], where: str = "") -> list[tuple[str, int]]:
    """(encoder modality, encoder tokens) of every item the sample's media become: a video's
    from the image processor that encodes it, then its own audio track's, from the audio
    processor, where the source asks for it (``video: {audio: true}``)."""
    out = []
    for kind, m in meta.media:
        proc = processor_for(processors, kind, f"{where or 'sample'} {meta.key}:")
        try:
            out.append((encoder_modality(kind), int(proc.num_tokens_from_meta(m))))
            if kind == VIDEO.name and takes_video_track(proc):
                out.extend(_track(meta, m, processors, where))
        except ValueError as e:  # e.g. an audio clip over max_frames without chunking, a video over its budget
            raise DataError(f"{where or 'sample'} {meta.key}: {e}", kind="media_error") from None
    return out


def _track(meta: SampleMeta, m: dict, processors: Mapping[str, MediaProcessor], where: str) -> list[tuple[str, int]]:
    if "track" not in m:
        raise DataError(f"{where or 'sample'} {meta.key}: its index predates videos' audio tracks, which "
                        "video: {audio: true} needs; rebuild it with `omni data index FOLDER`", kind="config")
    if m["track"] is None:  # a clip without sound: its frames alone
        return []
    proc = processor_for(processors, AUDIO.name, f"{where or 'sample'} {meta.key}: (its video's audio track)")
    return [(AUDIO.name, int(proc.num_tokens_from_meta(m["track"])))]


def layout_tokens(meta: SampleMeta, tokenizer: Tokenizer, processors: Mapping[str, MediaProcessor],
                  where: str = "") -> int:
    """Tokens a family's layout writes beyond the text and the placeholders: the text before each
    frame of a clip written frame by frame (Qwen3-VL's timestamps, ``MediaItem.frame_text``)
    and, where the family frames a video, one more opening and closing pair per frame but the
    first; an interleaved audio track's opening and closing tokens."""
    frame = family_frame(tokenizer, VIDEO.name)
    pair = 0 if frame is None else bool(frame.before) + bool(frame.after)
    n = 0
    for kind, m in meta.media:
        proc = processor_for(processors, kind, f"{where or 'sample'} {meta.key}:")
        texts = frame_texts_from_meta(proc, m)
        if texts:
            n += estimate_text_tokens(tokenizer, sum(len(t.encode()) for t in texts)) + pair * (len(texts) - 1)
        if kind == VIDEO.name and takes_video_track(proc) and m.get("track") is not None:
            n += _track_frame(tokenizer, meta, where)
    return n


def _track_frame(tokenizer: Tokenizer, meta: SampleMeta, where: str) -> int:
    """The interleaved span's opening and closing tokens: the family's audio framing, which a
    tokenizer without the family's tokens (the byte tokenizer) lacks."""
    if track_framing(tokenizer) is None:
        raise DataError(f"{where or 'sample'} {meta.key}: video: {{audio: true}} interleaves a clip's own track "
                        "with its frames between the family's audio tokens, which this tokenizer lacks; train "
                        "with the model's own tokenizer (data.tokenizer=DIR) or drop the option", kind="config")
    return 2


def estimate_tokens(meta: SampleMeta, tokenizer: Tokenizer, processors: Mapping[str, MediaProcessor],
                    where: str = "", template_bytes: int = 0, entries: list[tuple[str, int]] | None = None) -> int:
    """Packed length of a sample from index metadata (exact for ByteTokenizer); ``entries``: its
    ``media_entries`` when the caller has them already."""
    placeholder_bytes = sum(len(MEDIA_PLACEHOLDERS[m].encode()) for m, _ in meta.media)
    n = (tokenizer.bos_id is not None) + 1  # BOS (if any) + EOS
    n += estimate_text_tokens(tokenizer, meta.text_bytes - placeholder_bytes + template_bytes)
    if meta.response_bytes is not None:
        n += estimate_text_tokens(tokenizer, meta.response_bytes)
    items = media_entries(meta, processors, where) if entries is None else entries
    return n + sum(k for _, k in items) + layout_tokens(meta, tokenizer, processors, where)
