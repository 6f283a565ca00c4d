"""The data constructor: fetch samples by id, decode, tokenize, pack into MicroBatches.

Token layout of one sample (positions restart at 0 for every sample in a packed row)::

    [bos] + txt (each placeholder expanded to the item's num_tokens placeholder ids)
          + response + [eos]
    [bos] + a conversation rendered by the chat template (dataloading.formats.chat)

``labels[t] = ids[t + 1]`` (the model at position t predicts token t+1) where token t+1 gets a
loss: the response and EOS (all of a text without response), a conversation's assistant turns;
never a media placeholder; IGNORE_INDEX elsewhere and on the last position. The labels are per
position, so packing, splitting and CP slicing carry each turn's mask along.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dataloading.construct.batch import IGNORE_INDEX, MediaInputs, MicroBatch
from dataloading.construct.positions import mrope_position_ids, video_with_audio, video_with_audio_by_time
from dataloading.errors import DataError, ProblemCounter
from dataloading.formats.chat import last_answer
from dataloading.formats.media import (MediaItem, MediaProcessor, as_encoder_placeholders, configure_processors,
                                       encoder_modality, family_frame, processor_for, takes_video_track,
                                       track_framing)
from dataloading.formats.modality import AUDIO, MODALITIES, VIDEO
from dataloading.formats.sample import DecodedSample, decode_sample, text_segments
from dataloading.formats.tokenizer import Tokenizer
from dataloading.formats.video import audio_track
from dataloading.index.shards import ShardPool, SourceReader
from dataloading.plan.mixture import SourceOptions
from dataloading.plan.pieces import PIECE_SEP, split_piece

# Problems that are the configuration's fault, not one sample's: never skipped.
_ALWAYS_RAISE = frozenset({"config", "over_budget"})
_DEFAULT_OPTIONS = SourceOptions()


@dataclass
class Tokenized:
    sample_id: str
    ids: np.ndarray  # int64 [L]
    labels: np.ndarray  # int64 [L]
    media: list[tuple[str, MediaItem, np.ndarray]]  # (modality, item, positions in the sample)
    # (start, relative positions [3, n], resume) of spans with explicit M-RoPE positions (a video
    # and its audio track interleaved: positions.video_with_audio)
    spans: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)


class SampleConstructor:
    """Turns planned unit ids into MicroBatches. Picklable: it is sent to worker processes."""

    def __init__(self, source_readers: Mapping[str, SourceReader], tokenizer: Tokenizer,
                 processors: Mapping[str, MediaProcessor], micro_batch_tokens: int | None,
                 problems: ProblemCounter | None = None, options: Mapping[str, SourceOptions] | None = None,
                 over_budget: str = "error", max_open_shards: int = 256):
        self.readers = dict(source_readers)
        self.shard_pool = ShardPool(max_open_shards)
        for reader in self.readers.values():
            if isinstance(reader, SourceReader):
                reader.pool = self.shard_pool
        self.tokenizer = tokenizer
        self.processors = dict(processors)
        self.micro_batch_tokens = micro_batch_tokens
        self.problems = problems or ProblemCounter()
        self.options = dict(options or {})
        self.over_budget = over_budget
        self._source_processors = {n: configure_processors(self.processors, o.media, f"source {n}")
                                   for n, o in self.options.items()}
        self._placeholder_of = dict(tokenizer.placeholder_ids)
        self._placeholder_set = frozenset(self._placeholder_of.values())

    def _options(self, sample_id: str) -> SourceOptions:
        return self.options.get(sample_id.partition("/")[0], _DEFAULT_OPTIONS)

    def _processors(self, sample_id: str) -> Mapping[str, MediaProcessor]:
        return self._source_processors.get(sample_id.partition("/")[0], self.processors)

    # ---- one sample -----------------------------------------------------------------
    def fetch(self, sample_id: str) -> DecodedSample:
        source, _, key = sample_id.partition("/")
        if source not in self.readers:
            raise DataError(f"sample {sample_id}: unknown source {source!r}; known: {sorted(self.readers)}",
                            kind="config")
        return decode_sample(sample_id, self.readers[source].get(key))

    def _media_items(self, sample_id: str, kind: str, raw) -> list[MediaItem]:
        """One placeholder's media: a single item, or consecutive chunks (e.g. long audio); a
        video is one item made by the image processor's ``video`` method (``Modality.make_item``)."""
        proc = processor_for(self._processors(sample_id), kind, f"sample {sample_id}")
        if kind == VIDEO.name and takes_video_track(proc) and raw.audio is None:
            raw = self._track_of(sample_id, raw)
        try:
            item = MODALITIES[kind].make_item(proc, raw)
        except DataError:
            raise  # already one line with its kind (e.g. the video decoder is not installed)
        except Exception as e:  # a processor failing on one input is that sample's problem
            raise DataError(f"sample {sample_id}: the {kind} processor failed ({type(e).__name__}: {e}); "
                            "check the media or the processor settings", kind="media_error") from None
        items = list(item) if isinstance(item, (list, tuple)) else [item]
        if not items or any(it.num_tokens < 1 for it in items):
            raise DataError(f"sample {sample_id}: the {kind} processor gave an item without tokens; "
                            "a media item needs at least one", kind="media_error")
        if getattr(raw, "audio", None) is not None:  # a video with its own audio track
            items[0] = self._with_track(sample_id, items, raw.audio)
        return items

    def _track_of(self, sample_id: str, clip):
        """The clip with its own audio track decoded (``Video.audio``); unchanged without one."""
        try:
            track = audio_track(clip.data)
        except DataError:
            raise  # the decoder is not installed: one line naming the extra
        except Exception as e:
            raise DataError(f"sample {sample_id}: the video's audio track does not decode ({type(e).__name__}: {e})",
                            kind="media_error") from None
        return clip if track is None else dataclasses.replace(clip, audio=track)

    def _with_track(self, sample_id: str, items: list[MediaItem], audio) -> MediaItem:
        """The video's item with its audio track's item (``MediaItem.track``), encoded by the
        audio tower; one line when the model cannot take it."""
        proc = processor_for(self._processors(sample_id), VIDEO.name, f"sample {sample_id}")
        chunk = float(getattr(proc, "track_chunk_positions", 0.0))
        if (len(items) != 1 or not getattr(proc, "takes_track", False) or items[0].rope_grid is None
                or track_framing(self.tokenizer) is None):
            raise DataError(f"sample {sample_id}: a video's audio track goes beside its frames only in a model that "
                            "interleaves them (the Qwen2.5-Omni and Qwen3-Omni thinkers, with their own tokenizer)",
                            kind="config")
        track = self._media_items(sample_id, AUDIO.name, audio)
        if len(track) != 1:
            raise DataError(f"sample {sample_id}: the video's audio track became {len(track)} chunks; its clip must be "
                            "one (no audio chunk_seconds for a video's track)", kind="config")
        return dataclasses.replace(items[0], track=track[0], track_chunk=chunk)

    def segments(self, sample: DecodedSample, prompt_only: bool = False) -> tuple[list[tuple[str, bool]], bool]:
        """The sample's text as (text, gets a loss) pieces, and whether EOS follows as a target
        (``text_segments`` under the sample's source options)."""
        return text_segments(self.tokenizer, sample, self._options(sample.sample_id), prompt_only)

    def tokenize(self, sample: DecodedSample, prompt_only: bool = False) -> Tokenized:
        tok = self.tokenizer
        # Items go under their encoder's modality: a video is packed and encoded as an image item.
        items = [(encoder_modality(m), self._media_items(sample.sample_id, m, raw)) for m, raw in sample.media]
        pieces, eos = self.segments(sample, prompt_only)
        ids: list[int] = [] if tok.bos_id is None else [tok.bos_id]
        target = [False] * len(ids)  # does the token get predicted (a loss on it)?
        media: list[tuple[str, MediaItem, np.ndarray]] = []
        spans: list = []
        k = 0
        closing = None  # a dropped frame's closing token, still to come
        for text, is_target in pieces:
            for t in tok.encode(as_encoder_placeholders(text)):
                if t == closing:
                    closing = None
                    continue
                if t in self._placeholder_set:
                    modality, chunks = items[k]  # parse_fields checked count and modalities
                    k += 1
                    assert t == self._placeholder_of[modality], "placeholder order validated in parse_fields"
                    if chunks[0].frame_text is not None:  # written frame by frame: the placeholder's frame goes
                        closing = self._drop_frame(ids, target)
                    before = len(ids)
                    for chunk in chunks:
                        if chunk.track is not None:
                            self._interleave(chunk, t, ids, media, spans)
                            continue
                        if chunk.frame_text is not None:
                            self._framed(chunk, t, ids, media)
                            continue
                        media.append((modality, chunk, np.arange(len(ids), len(ids) + chunk.num_tokens)))
                        ids.extend([t] * chunk.num_tokens)
                    target.extend([False] * (len(ids) - before))  # never predict a placeholder
                else:
                    ids.append(t)
                    target.append(is_target)
        if eos:
            ids.append(tok.eos_id)
            target.append(True)
        ids_arr = np.asarray(ids, dtype=np.int64)
        # labels[t] is the target at position t: token t + 1, where that token gets a loss.
        labels = np.full(len(ids_arr), IGNORE_INDEX, dtype=np.int64)
        wanted = np.asarray(target[1:], dtype=bool)
        labels[:-1][wanted] = ids_arr[1:][wanted]
        return Tokenized(sample.sample_id, ids_arr, labels, media, spans)

    def _frame_ids(self) -> tuple[int | None, int | None]:
        """The ids of the opening and closing tokens the family frames a video's item with (None
        without a family's tokens: a byte tokenizer writes the frames bare)."""
        frame = family_frame(self.tokenizer, VIDEO.name)
        if frame is None:
            return None, None
        return tuple(self.tokenizer.token_id(x) if x else None for x in (frame.before, frame.after))

    def _drop_frame(self, ids: list[int], target: list[bool]) -> int | None:
        """Drop the opening token just written before a placeholder whose items come framed one by
        one (as transformers' Qwen3-VL processor collapses the chat template's wrapper); return
        the closing token to skip when it comes."""
        opening, closing = self._frame_ids()
        if opening is None or not ids or ids[-1] != opening:
            return None  # the placeholder was written bare
        ids.pop()
        target.pop()
        return closing

    def _framed(self, item: MediaItem, placeholder: int, ids: list[int], media: list) -> None:
        """One frame of a clip as its family writes it: its text, the opening token, the item's
        placeholders, the closing token (``MediaItem.frame_text``)."""
        opening, closing = self._frame_ids()
        ids.extend(self.tokenizer.encode(item.frame_text))
        ids.extend([opening] if opening is not None else [])
        media.append((VIDEO.encoder, item, np.arange(len(ids), len(ids) + item.num_tokens)))
        ids.extend([placeholder] * item.num_tokens)
        ids.extend([closing] if closing is not None else [])

    def _interleave(self, video: MediaItem, video_id: int, ids: list[int], media: list, spans: list) -> None:
        """A video and its track between the audio's opening and closing tokens, their tokens in
        chunks (``video_with_audio``), each item's rows at its own positions, the span's M-RoPE
        positions explicit."""
        t, rows, cols, interval = video.rope_grid[:4]
        if video.track_chunk:  # Qwen2.5-Omni: in chunks of positions
            runs, rel, resume = video_with_audio(t, rows, cols, interval, video.track.num_tokens, video.track_chunk)
        else:  # Qwen3-Omni: token by token, by time
            runs, rel, resume = video_with_audio_by_time(t, rows, cols, interval, video.track.num_tokens)
        opening, closing = (self.tokenizer.token_id(x) for x in track_framing(self.tokenizer))
        audio_id = self._placeholder_of[AUDIO.name]
        start = len(ids)
        ids.append(opening)
        at = {True: [], False: []}
        for is_video, count in runs:
            at[is_video].extend(range(len(ids), len(ids) + count))
            ids.extend([video_id if is_video else audio_id] * count)
        ids.append(closing)
        media.append((VIDEO.encoder, video, np.asarray(at[True], dtype=np.int64)))
        media.append((AUDIO.name, video.track, np.asarray(at[False], dtype=np.int64)))
        spans.append((start, rel, resume))

    def fit_budget(self, t: Tokenized, piece: int | None) -> Tokenized:
        """Apply the over-budget policy: whole, truncated, or piece ``piece`` of a split."""
        budget = self.micro_batch_tokens
        if budget is None or (piece is None and len(t) <= budget):
            return t
        policy = self._options(t.sample_id).over_budget or self.over_budget
        sid = t.sample_id
        if piece is not None or policy == "split":
            piece = piece or 0
            lo, hi = piece * budget, min(len(t), (piece + 1) * budget)
            if lo >= len(t):
                raise DataError(f"sample {sid}: piece {piece} starts at token {lo} but the sample has {len(t)} "
                                "(the index's length estimate was high); the piece is dropped", kind="split_piece_empty")
            cuts = range(budget, len(t), budget)
            for first, last in _whole_runs(t):  # a cut anywhere inside one drops every piece (each counted)
                if any(first < c <= last for c in cuts):
                    raise DataError(f"sample {sid}: splitting it at {budget} tokens would cut a media item in two; "
                                    "raise data.micro_batch_tokens or use over_budget: truncate/skip for this source",
                                    kind="split_cuts_media")
            return _slice(t, f"{sid}{PIECE_SEP}{piece}", lo, hi)
        if policy == "truncate":
            cut = budget
            for first, last in sorted(_whole_runs(t), reverse=True):  # never keep part of one: cut before it
                if first < cut <= last:
                    cut = first
            return _slice(t, sid, 0, cut)
        raise DataError(f"sample {sid} needs {len(t)} tokens but data.micro_batch_tokens={budget}; raise "
                        f"data.micro_batch_tokens, lower the image patch budget, or set data.over_budget "
                        f"(truncate, split, skip)", kind="over_budget")

    # ---- a step's worth -------------------------------------------------------------
    def build(self, sample_ids: Sequence[str]) -> list[MicroBatch]:
        return self.build_with_problems(sample_ids)[0]

    def build_with_problems(self, sample_ids: Sequence[str]) -> tuple[list[MicroBatch], dict[str, int]]:
        """Micro-batches of the given samples packed here (first-fit decreasing), and the
        problems met (kind -> count)."""
        done, met = self._tokenize_all(sample_ids)
        return [assemble(group) for group in pack(done, self.micro_batch_tokens)], met

    def build_planned(self, micro_batches: Sequence[Sequence[str]],
                      on_sample=None) -> tuple[list[MicroBatch], dict[str, int]]:
        """The planner's micro-batches, in its arrangement. An empty one (every sample skipped,
        or a rank with less work) becomes a one-token no-loss micro-batch, so every rank keeps
        the planned count. If the real lengths overflow the budget (the index only estimates
        lengths for subword tokenizers) the micro-batch is re-packed into more rows."""
        out: list[MicroBatch] = []
        met: dict[str, int] = {}
        for ids in micro_batches:
            done, m = self._tokenize_all(ids, on_sample)
            for k, v in m.items():
                met[k] = met.get(k, 0) + v
            groups = pack(done, self.micro_batch_tokens) if done else [[]]
            if len(groups) > 1:
                met["repacked"] = met.get("repacked", 0) + 1
            out.extend(assemble(g) if g else dummy_micro_batch(self.tokenizer.eos_id) for g in groups)
        return out, met

    def _tokenize_all(self, unit_ids: Sequence[str], on_sample=None) -> tuple[list[Tokenized], dict[str, int]]:
        met: dict[str, int] = {}
        done = []
        for uid in unit_ids:
            if on_sample is not None:
                on_sample(uid)  # the loader records it: a worker that dies is reported with it
            self.problems.add_seen()
            sid, piece = split_piece(uid)
            try:
                done.append(self.fit_budget(self.tokenize(self.fetch(sid)), piece))
            except DataError as e:
                if e.kind in _ALWAYS_RAISE:
                    raise
                met[e.kind] = met.get(e.kind, 0) + 1
                self.problems.report(e)  # raises under on_error=stop or past max_skip_fraction
        return done, met

    def build_prompt(self, sample: DecodedSample) -> tuple[MicroBatch, str]:
        """Evaluation input: the prompt alone (labels all IGNORE_INDEX) and the expected response
        (of a conversation: its last answer)."""
        expected = last_answer(sample.messages)[1] if sample.messages is not None else sample.response or ""
        return assemble([self.tokenize(sample, prompt_only=True)]), expected


def pack(samples: Sequence[Tokenized], budget: int | None) -> list[list[Tokenized]]:
    """First-fit decreasing: longest first, each into the first micro-batch it fits."""
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]), i))
    bins: list[list[Tokenized]] = []
    free: list[float] = []
    cap = float("inf") if budget is None else budget
    for i in order:
        n = len(samples[i])
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(samples[i])
                free[b] -= n
                break
        else:
            bins.append([samples[i]])
            free.append(cap - n)
    return bins


def assemble(samples: Sequence[Tokenized]) -> MicroBatch:
    """Concatenate tokenized samples into one packed row with its media inputs."""
    lengths = [len(s) for s in samples]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    per_modality: dict[str, list[tuple[MediaItem, np.ndarray]]] = {}
    for s, off in zip(samples, offsets):
        for modality, item, pos in s.media:
            per_modality.setdefault(modality, []).append((item, pos + off))
    media = {}
    for modality, entries in per_modality.items():
        media[modality] = MediaInputs(
            features=torch.cat([it.features for it, _ in entries]),
            sizes=torch.tensor([list(it.size) for it, _ in entries], dtype=torch.int64),
            num_tokens=torch.tensor([it.num_tokens for it, _ in entries], dtype=torch.int64),
            positions=torch.from_numpy(np.concatenate([p for _, p in entries]).astype(np.int64)))
    rope = None
    if any(item.rope_grid is not None for s in samples for _, item, _ in s.media) or any(s.spans for s in samples):
        # an interleaved video's positions come with its span (the frames' rows are not contiguous)
        rope = torch.cat([mrope_position_ids(len(s), [(int(pos[0]), *item.rope_grid) for _, item, pos in s.media
                                                      if item.rope_grid is not None and item.track is None],
                                             s.spans) for s in samples], dim=1)
    return MicroBatch(
        input_ids=torch.from_numpy(np.concatenate([s.ids for s in samples])),
        position_ids=torch.from_numpy(np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])),
        labels=torch.from_numpy(np.concatenate([s.labels for s in samples])),
        cu_seqlens=torch.from_numpy(offsets.astype(np.int32)),
        media=media,
        sample_ids=[s.sample_id for s in samples],
        rope_position_ids=rope)


def _whole_runs(t: Tokenized) -> list[tuple[int, int]]:
    """(first, last) token of each run a cut must not go through: a media item's placeholders,
    an interleaved video's span with its opening and closing tokens."""
    return ([(int(p[0]), int(p[-1])) for _, _, p in t.media]
            + [(start, start + rel.shape[1] - 1) for start, rel, _ in t.spans])


def _slice(t: Tokenized, unit_id: str, lo: int, hi: int) -> Tokenized:
    """Tokens [lo, hi) of a sample as a document of its own; media fully inside are kept.

    The last label keeps its target (the next token of the sample): predicting it needs only
    the prefix, which the row holds."""
    labels = t.labels[lo:hi].copy()
    media = [(m, it, p - lo) for m, it, p in t.media if p[0] >= lo and p[-1] < hi]
    spans = [(start - lo, rel, resume) for start, rel, resume in t.spans if start >= lo and start + rel.shape[1] <= hi]
    return Tokenized(unit_id, t.ids[lo:hi], labels, media, spans)


def dummy_micro_batch(pad_id: int) -> MicroBatch:
    """One pad token, no loss: lets a rank with fewer micro-batches keep collectives in step."""
    return MicroBatch(input_ids=torch.tensor([pad_id], dtype=torch.int64),
                      position_ids=torch.zeros(1, dtype=torch.int64),
                      labels=torch.tensor([IGNORE_INDEX], dtype=torch.int64),
                      cu_seqlens=torch.tensor([0, 1], dtype=torch.int32))
