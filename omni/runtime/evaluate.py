"""Held-out evaluation: greedy generation and exact-match accuracy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from dataloading.batch import MicroBatch
from omni.models.multimodal import OmniModel


@dataclass
class EvalResult:
    accuracy: float
    num_samples: int
    by_group: dict[str, float]  # accuracy per group (e.g. per eval sub-folder), when known
    examples: list[dict]  # a few (expected, generated) pairs for the log


@torch.no_grad()
def greedy_generate(
    model: OmniModel, prompts: list[MicroBatch], eos_id: int, max_new_tokens: int, device: torch.device
) -> list[list[int]]:
    """Generate for a batch of prompts (each one packed row holding one sample).

    Rows are right-padded; attention is causal, so padding after a row's end never affects
    it. No KV cache: eval prompts are short and this keeps the model code single-path.
    """
    embeds = [model.embed(p.input_ids.to(device), {m: x.to(device) for m, x in p.media.items()}) for p in prompts]
    lengths = [e.shape[0] for e in embeds]
    batch, width = len(prompts), max(lengths) + max_new_tokens
    hidden = embeds[0].shape[1]
    buf = embeds[0].new_zeros(batch, width, hidden)
    for i, e in enumerate(embeds):
        buf[i, : e.shape[0]] = e
    generated: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    rows = torch.arange(batch, device=device)
    rope = mrope_generation_positions(prompts, width, device) if model.llm.config.mrope_section is not None else None
    for _ in range(max_new_tokens):
        cur = max(lengths)
        pos = torch.arange(cur, device=device).expand(batch, cur)
        out = model.llm(inputs_embeds=buf[:, :cur], position_ids=pos, output_hidden=True,
                        rope_position_ids=None if rope is None else rope[:, :, :cur])
        last = out.hidden_states[rows, torch.tensor(lengths, device=device) - 1]
        next_ids = model.llm.lm_logits(last).argmax(-1)
        new_embeds = model.llm.embed(next_ids)
        for i in range(batch):
            if done[i]:
                continue
            tok = int(next_ids[i])
            if tok == eos_id:
                done[i] = True
                continue
            generated[i].append(tok)
            buf[i, lengths[i]] = new_embeds[i]
            lengths[i] += 1
        if all(done):
            break
    return generated


def mrope_generation_positions(prompts: list[MicroBatch], width: int, device: torch.device) -> torch.Tensor:
    """M-RoPE positions [3, batch, width] for generating after each prompt: the prompt's own
    (``rope_position_ids``; text-only: its 1-D positions in every row), then every row counting
    on from the prompt's largest position plus one, as transformers' generation does (its
    ``mrope_position_deltas``)."""
    out = torch.empty(3, len(prompts), width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        n = p.num_tokens
        own = p.rope_position_ids if p.rope_position_ids is not None else p.position_ids.expand(3, n)
        out[:, i, :n] = own.cpu()
        out[:, i, n:] = int(own.max()) + 1 + torch.arange(width - n) if n else torch.arange(width)
    return out.to(device)


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
        outs = greedy_generate(model, [p for p, _ in pending], tokenizer.eos_id, max_new_tokens, device)
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
