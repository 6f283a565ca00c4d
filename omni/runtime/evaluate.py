"""Held-out evaluation: greedy generation (``omni.runtime.generate``) and exact-match accuracy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from dataloading.batch import MicroBatch
from omni.models.multimodal import OmniModel
from omni.runtime.generate import generate


@dataclass
class EvalResult:
    accuracy: float
    num_samples: int
    by_group: dict[str, float]  # accuracy per group (e.g. per eval sub-folder), when known
    examples: list[dict]  # a few (expected, generated) pairs for the log


def evaluate(
    model: OmniModel,
    samples: Iterable[tuple[MicroBatch, str]],
    tokenizer,
    device: torch.device,
    max_new_tokens: int,
    batch_size: int,
    limit: int,
) -> EvalResult:
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

    for item in samples:
        if total + len(pending) >= limit:
            break
        pending.append(item)
        if len(pending) == batch_size:
            flush()
    if pending:
        flush()
    model.train(was_training)
    by_group = {g: c / n for g, (c, n) in sorted(groups.items())}
    return EvalResult(accuracy=correct / max(1, total), num_samples=total, by_group=by_group, examples=examples)
