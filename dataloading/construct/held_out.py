"""The held-out samples (the eval folder's, with a response), built two ways:

- ``EvalSet``: as prompts and their expected responses, for the end-of-run evaluation by
  generation (``omni/runtime/evaluate.py``);
- ``ValidationSet``: as validation micro-batches, every sample tokenized and labelled exactly as
  training labels it (its training source's prompt options, ``eval_options``), packed per group
  (the eval folder's sub-folder: shapes, tones, ...) under the training packing budget. The
  result is a pure function of the folder, the tokenizer, the processors and the budget, so
  every rank builds the same list in the same order and takes its share of it (the trainer's
  ``omni/runtime/validation.py``)."""
from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dataloading.construct.batch import MicroBatch
from dataloading.construct.constructor import _ALWAYS_RAISE, SampleConstructor, Tokenized, assemble, pack
from dataloading.errors import DataError, ProblemCounter
from dataloading.formats.media import MediaProcessor, encoder_modality
from dataloading.formats.tokenizer import Tokenizer
from dataloading.plan.mixture import SourceOptions

log = logging.getLogger("omni.data")


def eval_options(sources: Sequence) -> tuple[dict[str, SourceOptions], SourceOptions | None]:
    """The prompt options (chat template, media options) a held-out sample is built with, from
    the training mixture's sources (``SourceSpec``): per sub-folder, those of the training
    source of the same name (the demo's eval/shapes answers as the shapes source was trained);
    for any other sample, the options every training source shares (None when they differ:
    there is no one way the model was prompted)."""
    by_name = {s.name: s.options for s in sources}
    distinct = {repr(o) for o in by_name.values()}
    shared = next(iter(by_name.values())) if len(distinct) == 1 else None
    return by_name, shared


class EvalSet:
    """Held-out samples with a response, as (prompt MicroBatch, expected response string).
    ``options``: ``eval_options`` of the training mixture (None: the samples as written)."""

    def __init__(self, folder: str | Path, tokenizer: Tokenizer, processors: Mapping[str, MediaProcessor],
                 name: str = "eval", limit: int | None = None, problems: ProblemCounter | None = None,
                 options: tuple[Mapping[str, SourceOptions], SourceOptions | None] | None = None):
        from dataloading.index.source_index import load_index

        index = load_index(folder)
        self.name = name
        with_response = [m for m in index.samples if m.response_bytes is not None]
        # A model without (say) an audio encoder cannot answer audio questions: evaluate what it
        # can, and say how much was left out.
        usable = [m for m in with_response if all(encoder_modality(mod) in processors for mod, _ in m.media)]
        self.left_out = len(with_response) - len(usable)
        if self.left_out:
            missing = sorted({encoder_modality(mod) for m in with_response for mod, _ in m.media} - set(processors))
            log.warning("eval %s: %d sample(s) need an encoder of %s the model lacks; evaluating the other %d",
                        folder, self.left_out, "/".join(missing), len(usable))
        self.keys = [m.key for m in usable][:limit]
        self.constructor = SampleConstructor({name: index.reader(name)}, tokenizer, processors, None,
                                             problems or ProblemCounter("stop"))
        self._options = options
        self._by_group: dict[str, SampleConstructor] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def group(self, sample_id: str) -> str:
        """The sub-folder a sample's shard sits in (e.g. "shapes", "tones"): accuracy is also
        reported per group."""
        shard = self.constructor.readers[self.name].locate[sample_id.split("/", 1)[1]][0]
        return shard.split("/", 1)[0] if "/" in shard else "all"

    def _constructor(self, sample_id: str) -> SampleConstructor:
        """The constructor with the prompt options of the sample's sub-folder (``eval_options``)."""
        if self._options is None:
            return self.constructor
        by_name, shared = self._options
        group = self.group(sample_id)
        opts = by_name.get(group, shared)
        if opts is None:
            return self.constructor
        if group not in self._by_group:
            c = self.constructor
            self._by_group[group] = SampleConstructor(c.readers, c.tokenizer, c.processors, None, c.problems,
                                                      options={self.name: opts})
        return self._by_group[group]

    def __iter__(self) -> Iterator[tuple[MicroBatch, str]]:
        for key in self.keys:
            c = self._constructor(f"{self.name}/{key}")
            c.problems.add_seen()
            try:
                item = c.build_prompt(c.fetch(f"{self.name}/{key}"))
            except DataError as e:
                if e.kind in _ALWAYS_RAISE:
                    raise
                c.problems.report(e)
                continue
            yield item


@dataclass
class ValidationBatch:
    group: str  # the sub-folder its samples come from ("all" for a flat folder)
    micro_batch: MicroBatch


class ValidationSet(EvalSet):
    """Held-out samples with a response (the ones the end-of-run evaluation scores, at most
    ``limit``), as training micro-batches of one group each."""

    def __init__(self, folder: str | Path, tokenizer: Tokenizer, processors: Mapping[str, MediaProcessor],
                 micro_batch_tokens: int | None, over_budget: str = "error", limit: int | None = None,
                 options: tuple[Mapping[str, SourceOptions], SourceOptions | None] | None = None,
                 problems: ProblemCounter | None = None):
        super().__init__(folder, tokenizer, processors, limit=limit, problems=problems, options=options)
        self.micro_batch_tokens = micro_batch_tokens
        self.over_budget = over_budget
        self.too_long = 0  # samples longer than the budget that over_budget could not fit
        self._with_budget: dict[SampleConstructor, SampleConstructor] = {}

    def _budgeted(self, sample_id: str) -> SampleConstructor:
        """The sample's constructor (its group's prompt options) with the training budget and
        over-budget policy (``SampleConstructor.fit_budget``: truncate, or split into pieces)."""
        c = self._constructor(sample_id)
        if c not in self._with_budget:
            self._with_budget[c] = SampleConstructor(c.readers, c.tokenizer, c.processors, self.micro_batch_tokens,
                                                     c.problems, options=c.options, over_budget=self.over_budget)
        return self._with_budget[c]

    def _pieces(self, sample_id: str) -> list[Tokenized]:
        c = self._budgeted(sample_id)
        whole = c.tokenize(c.fetch(sample_id))
        first = c.fit_budget(whole, None)
        if first.sample_id == whole.sample_id:  # whole, or truncated
            return [first]
        budget = self.micro_batch_tokens  # split: every piece, as training plans them
        return [c.fit_budget(whole, k) for k in range(-(-len(whole) // budget))]

    def batches(self) -> list[ValidationBatch]:
        """Every held-out sample's micro-batches: groups in name order, each packed first-fit
        decreasing under the budget. A sample longer than the budget that the over-budget policy
        does not fit (error, skip) is left out and counted in ``too_long``; a broken one is a
        problem as in ``EvalSet``."""
        by_group: dict[str, list[Tokenized]] = {}
        for key in self.keys:
            sid = f"{self.name}/{key}"
            self.constructor.problems.add_seen()
            try:
                by_group.setdefault(self.group(sid), []).extend(self._pieces(sid))
            except DataError as e:
                if e.kind == "over_budget":
                    self.too_long += 1
                    continue
                if e.kind in _ALWAYS_RAISE:
                    raise
                self.constructor.problems.report(e)
        if self.too_long:
            log.warning("validation: %d held-out sample(s) are longer than data.micro_batch_tokens=%s and left out",
                        self.too_long, self.micro_batch_tokens)
        return [ValidationBatch(group, assemble(samples))
                for group in sorted(by_group) for samples in pack(by_group[group], self.micro_batch_tokens)]
