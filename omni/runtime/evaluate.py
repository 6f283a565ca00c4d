"""Held-out evaluation: greedy generation (``omni.runtime.generate``) and exact-match accuracy."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from dataloading.construct.batch import MicroBatch
from omni.models.multimodal import OmniModel
from omni.runtime.generate import generate


@dataclass
class EvalResult:
    accuracy: float
    num_samples: int
    by_group: dict[str, float]  # accuracy per group (e.g. per eval sub-folder), when known
    examples: list[dict]  # a few (expected, generated) pairs for the log
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)  # group -> (correct, samples)


def merge_results(parts: list[EvalResult]) -> EvalResult:
    """One result from the ranks' shares of the held-out set (``evaluate(..., shard=...)``)."""
    counts: dict[str, list[int]] = {}
    for part in parts:
        for g, (c, n) in part.counts.items():
            tally = counts.setdefault(g, [0, 0])
            tally[0] += c
            tally[1] += n
    return _result(counts, [e for part in parts for e in part.examples][:8])


def _result(counts: dict, examples: list[dict]) -> EvalResult:
    correct, total = sum(c for c, _ in counts.values()), sum(n for _, n in counts.values())
    return EvalResult(accuracy=correct / max(1, total), num_samples=total,
                      by_group={g: c / n for g, (c, n) in sorted(counts.items())}, examples=examples,
                      counts={g: (c, n) for g, (c, n) in sorted(counts.items())})


def evaluate(
    model: OmniModel,
    samples: Iterable[tuple[MicroBatch, str]],
    tokenizer,
    device: torch.device,
    max_new_tokens: int,
    batch_size: int,
    limit: int,
    shard: tuple[int, int] = (0, 1),
) -> EvalResult:
    """Greedy generation over the first ``limit`` held-out samples. ``shard`` = (index, count):
    this process takes every count-th of them from the index-th (the ranks of a split layout
    each evaluate their share; ``merge_results`` joins them)."""
    was_training = model.training
    model.eval()
    correct = total = 0
    group_of = getattr(samples, "group", None)
    groups: dict[str, list[int]] = {}
    examples: list[dict] = []
    pending: list[tuple[MicroBatch, str]] = []

    def flush() -> None:
        nonlocal correct, total
        outs = generate(model, [p for p, _ in pending], {tokenizer.eos_id}, max_new_tokens, device)
        for (prompt, expected), ids in zip(pending, outs):
            text = tokenizer.decode(ids).strip()
            ok = text == expected.strip()
            correct += ok
            total += 1
            group = group_of(prompt.sample_ids[0]) if group_of and prompt.sample_ids else "all"
            tally = groups.setdefault(group, [0, 0])
            tally[0] += ok
            tally[1] += 1
            if not ok and len(examples) < 8:  # the misses say more than the hits
                examples.append({"sample": prompt.sample_ids[:1], "expected": expected, "generated": text})
        pending.clear()

    index, count = shard
    for i, item in enumerate(samples):
        if i >= limit:
            break
        if i % count != index:
            continue
        pending.append(item)
        if len(pending) == batch_size:
            flush()
    if pending:
        flush()
    model.train(was_training)
    return _result(groups, examples)
