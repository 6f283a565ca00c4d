"""The held-out set as validation micro-batches: every sample tokenized and labelled exactly as
training labels it (its training source's prompt options, ``eval_options``), packed per group
(the eval folder's sub-folder: shapes, tones, ...) under the training packing budget.

The result is a pure function of the folder, the tokenizer, the processors and the budget, so
every rank builds the same list in the same order and takes its share of it (the trainer's
``omni/runtime/validation.py``)."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dataloading.construct.batch import MicroBatch
from dataloading.construct.constructor import EvalSet, SampleConstructor, Tokenized, _ALWAYS_RAISE, assemble, pack
from dataloading.errors import DataError, ProblemCounter
from dataloading.formats.media import MediaProcessor
from dataloading.formats.tokenizer import Tokenizer
from dataloading.plan.mixture import SourceOptions

log = logging.getLogger("omni.data")


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
