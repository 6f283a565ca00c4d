"""The data constructor: fetch samples by id, decode, tokenize, pack into MicroBatches.

Token layout of one sample (positions restart at 0 for every sample in a packed row)::

    [bos] + txt (each placeholder expanded to the item's num_tokens placeholder ids)
          + response + [eos]

``labels[t] = ids[t + 1]`` (the model at position t predicts token t+1), except
IGNORE_INDEX where the target is a media placeholder, on the last position of the sample,
and, when the sample has a response, wherever the target is still part of the prompt.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dataloading.batch import IGNORE_INDEX, MediaInputs, MicroBatch
from dataloading.errors import DataError, ProblemCounter
from dataloading.media import MediaItem, MediaProcessor
from dataloading.sample import DecodedSample, decode_sample
from dataloading.shards import SourceReader
from dataloading.tokenizer import Tokenizer

log = logging.getLogger("omni.data")

# Problems that are the configuration's fault, not one sample's: never skipped.
_ALWAYS_RAISE = frozenset({"config", "over_budget"})


@dataclass
class Tokenized:
    sample_id: str
    ids: np.ndarray  # int64 [L]
    labels: np.ndarray  # int64 [L]
    media: list[tuple[str, MediaItem, np.ndarray]]  # (modality, item, positions in the sample)

    def __len__(self) -> int:
        return len(self.ids)


class SampleConstructor:
    def __init__(self, source_readers: Mapping[str, SourceReader], tokenizer: Tokenizer,
                 processors: Mapping[str, MediaProcessor], micro_batch_tokens: int | None,
                 problems: ProblemCounter | None = None):
        self.readers = dict(source_readers)
        self.tokenizer = tokenizer
        self.processors = dict(processors)
        self.micro_batch_tokens = micro_batch_tokens
        self.problems = problems or ProblemCounter()
        self._placeholder_of = dict(tokenizer.placeholder_ids)
        self._placeholder_set = frozenset(self._placeholder_of.values())

    # ---- one sample -----------------------------------------------------------------
    def fetch(self, sample_id: str) -> DecodedSample:
        source, _, key = sample_id.partition("/")
        if source not in self.readers:
            raise DataError(f"sample {sample_id}: unknown source {source!r}; known: {sorted(self.readers)}",
                            kind="config")
        return decode_sample(sample_id, self.readers[source].get(key))

    def _media_item(self, sample_id: str, modality: str, raw) -> MediaItem:
        proc = self.processors.get(modality)
        if proc is None:
            raise DataError(f"sample {sample_id} has {modality} media but no {modality} processor was given; "
                            f"configure a {modality} encoder or drop the source", kind="config")
        try:
            item = proc(raw)
        except Exception as e:  # a processor failing on one input is that sample's problem
            raise DataError(f"sample {sample_id}: the {modality} processor failed ({type(e).__name__}: {e}); "
                            "check the media or the processor settings", kind="media_error") from None
        if item.num_tokens < 1:
            raise DataError(f"sample {sample_id}: the {modality} processor gave {item.num_tokens} tokens; "
                            "a media item needs at least one", kind="media_error")
        return item

    def tokenize(self, sample: DecodedSample, prompt_only: bool = False) -> Tokenized:
        tok = self.tokenizer
        items = [(m, self._media_item(sample.sample_id, m, raw)) for m, raw in sample.media]
        ids: list[int] = [] if tok.bos_id is None else [tok.bos_id]
        positions: list[np.ndarray] = []
        for t in tok.encode(sample.text):
            if t in self._placeholder_set:
                k = len(positions)
                modality, item = items[k]  # parse_fields checked count and modalities
                assert t == self._placeholder_of[modality], "placeholder order validated in parse_fields"
                positions.append(np.arange(len(ids), len(ids) + item.num_tokens))
                ids.extend([t] * item.num_tokens)
            else:
                ids.append(t)
        response_start = len(ids)
        if not prompt_only:
            if sample.response is not None:
                ids.extend(tok.encode(sample.response))
            ids.append(tok.eos_id)
        ids_arr = np.asarray(ids, dtype=np.int64)
        labels = np.full(len(ids_arr), IGNORE_INDEX, dtype=np.int64)
        if not prompt_only:
            labels[:-1] = ids_arr[1:]
            is_media = np.zeros(len(ids_arr), dtype=bool)
            for p in positions:
                is_media[p] = True
            labels[:-1][is_media[1:]] = IGNORE_INDEX  # never predict a placeholder
            if sample.response is not None:
                labels[:response_start - 1] = IGNORE_INDEX  # targets inside the prompt
        budget = self.micro_batch_tokens
        if budget is not None and len(ids_arr) > budget:
            raise DataError(f"sample {sample.sample_id} needs {len(ids_arr)} tokens but data.micro_batch_tokens="
                            f"{budget}; raise data.micro_batch_tokens or lower the image patch budget",
                            kind="over_budget")
        return Tokenized(sample.sample_id, ids_arr, labels, [(m, it, p) for (m, it), p in zip(items, positions)])

    # ---- a step's worth -------------------------------------------------------------
    def build(self, sample_ids: Sequence[str]) -> list[MicroBatch]:
        return self.build_with_problems(sample_ids)[0]

    def build_with_problems(self, sample_ids: Sequence[str]) -> tuple[list[MicroBatch], dict[str, int]]:
        """Micro-batches of the given samples, and the problems met (kind -> count)."""
        met: dict[str, int] = {}
        done = []
        for sid in sample_ids:
            self.problems.add_seen()
            try:
                done.append(self.tokenize(self.fetch(sid)))
            except DataError as e:
                if e.kind in _ALWAYS_RAISE:
                    raise
                met[e.kind] = met.get(e.kind, 0) + 1
                self.problems.report(e)  # raises under on_error=stop or past max_skip_fraction
        return [assemble(group) for group in pack(done, self.micro_batch_tokens)], met

    def build_prompt(self, sample: DecodedSample) -> tuple[MicroBatch, str]:
        """Evaluation input: the prompt alone (labels all IGNORE_INDEX) and the expected response."""
        return assemble([self.tokenize(sample, prompt_only=True)]), sample.response or ""


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
    return MicroBatch(
        input_ids=torch.from_numpy(np.concatenate([s.ids for s in samples])),
        position_ids=torch.from_numpy(np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])),
        labels=torch.from_numpy(np.concatenate([s.labels for s in samples])),
        cu_seqlens=torch.from_numpy(offsets.astype(np.int32)),
        media=media,
        sample_ids=[s.sample_id for s in samples])


def dummy_micro_batch(pad_id: int) -> MicroBatch:
    """One pad token, no loss: lets a rank with fewer micro-batches keep collectives in step."""
    return MicroBatch(input_ids=torch.tensor([pad_id], dtype=torch.int64),
                      position_ids=torch.zeros(1, dtype=torch.int64),
                      labels=torch.tensor([IGNORE_INDEX], dtype=torch.int64),
                      cu_seqlens=torch.tensor([0, 1], dtype=torch.int32))


class EvalSet:
    """Held-out samples with a response, as (prompt MicroBatch, expected response string)."""

    def __init__(self, folder: str | Path, tokenizer: Tokenizer, processors: Mapping[str, MediaProcessor],
                 name: str = "eval", limit: int | None = None, problems: ProblemCounter | None = None):
        from dataloading.index import load_index

        index = load_index(folder)
        self.name = name
        with_response = [m for m in index.samples if m.response_bytes is not None]
        # A model without (say) an audio encoder cannot answer audio questions: evaluate what it
        # can, and say how much was left out.
        usable = [m for m in with_response if all(mod in processors for mod, _ in m.media)]
        self.left_out = len(with_response) - len(usable)
        if self.left_out:
            missing = sorted({mod for m in with_response for mod, _ in m.media} - set(processors))
            log.warning("eval %s: %d sample(s) need a %s encoder the model lacks; evaluating the other %d",
                        folder, self.left_out, "/".join(missing), len(usable))
        self.keys = [m.key for m in usable][:limit]
        self.constructor = SampleConstructor({name: index.reader(name)}, tokenizer, processors, None,
                                             problems or ProblemCounter("stop"))

    def __len__(self) -> int:
        return len(self.keys)

    def group(self, sample_id: str) -> str:
        """The sub-folder a sample's shard sits in (e.g. "shapes", "tones"): accuracy is also
        reported per group."""
        shard = self.constructor.readers[self.name].locate[sample_id.split("/", 1)[1]][0]
        return shard.split("/", 1)[0] if "/" in shard else "all"

    def __iter__(self) -> Iterator[tuple[MicroBatch, str]]:
        c = self.constructor
        for key in self.keys:
            c.problems.add_seen()
            try:
                item = c.build_prompt(c.fetch(f"{self.name}/{key}"))
            except DataError as e:
                if e.kind in _ALWAYS_RAISE:
                    raise
                c.problems.report(e)
                continue
            yield item
