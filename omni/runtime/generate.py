"""KV-cached batched generation: the engine behind ``omni generate`` and the end-of-run evaluation.

Each prompt is a ``MicroBatch`` holding one sample (text with placeholders, its media, its
positions). The prompts are embedded (media encoded and written at their placeholders), run
once through the backbone right-padded into one batch, and then each step feeds every row its
last token through the ``KVCache``, so a step costs one token per row, not the whole prefix.
Rows keep their own cached lengths; the cache's mask hides a shorter row's padding.

Positions continue as transformers' generation continues them: the first generated token sits
one past the prompt's largest position (``generation_start``), for M-RoPE in all three rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from dataloading.construct.batch import MicroBatch
from omni.models.llm import KVCache
from omni.models.multimodal import OmniModel


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: the most likely one (``greedy``), or drawn from the
    softmax of logits / ``temperature`` restricted to the ``top_k`` most likely tokens (0: all)
    and then to the smallest set whose probability reaches ``top_p`` (nucleus sampling).
    ``seed`` seeds the draws, so a run repeats exactly."""

    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use greedy for the most likely token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0: no limit)")


GREEDY = Sampling()


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """logits [B, V] with every token outside the nucleus set to -inf: the most likely tokens,
    in order, until their probability reaches ``p`` (at least one token is always kept)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.float().softmax(-1)
    # A token is kept when the tokens before it have not reached p yet.
    before = probs.cumsum(-1) - probs
    drop_sorted = before >= p
    drop_sorted[:, 0] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits [B, V] with all but the ``k`` largest of each row set to -inf (0: unchanged)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def choose_next(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator]) -> torch.Tensor:
    """The next token of each row, logits [B, V] -> int64 [B]."""
    if sampling.greedy:
        return logits.argmax(-1)
    scores = logits.float() / sampling.temperature
    scores = top_p_filter(top_k_filter(scores, sampling.top_k), sampling.top_p)
    return torch.multinomial(scores.softmax(-1), 1, generator=generator)[:, 0]


def generation_start(prompt: MicroBatch, mrope: bool) -> int:
    """The position of the first generated token: one past the prompt's largest position (its
    M-RoPE rows when ``mrope`` and it has them), as transformers continues after a prompt
    (``mrope_position_deltas``); for a plain text prompt, its length."""
    own = prompt.rope_position_ids if mrope and prompt.rope_position_ids is not None else prompt.position_ids
    return int(own.max()) + 1


def _prompt_positions(prompts: list[MicroBatch], width: int, mrope: bool, starts: list[int]) -> torch.Tensor:
    """The rotary positions of the right-padded prompts: [3, B, width] for M-RoPE (a text prompt's
    1-D positions in every row), else [B, width]. The padding continues from ``starts``; no real
    token sees it, so that only keeps the table in range."""
    out = torch.empty(3 if mrope else 1, len(prompts), width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        n = p.num_tokens
        own = p.rope_position_ids if mrope and p.rope_position_ids is not None else p.position_ids
        out[:, i, :n] = own.cpu()
        out[:, i, n:] = starts[i] + torch.arange(width - n)
    return out if mrope else out[0]


@torch.no_grad()
def generate(
    model: OmniModel,
    prompts: list[MicroBatch],
    eos_ids: Iterable[int],
    max_new_tokens: int,
    device: torch.device | str,
    sampling: Sampling = GREEDY,
    on_logits: Optional[Callable[[torch.Tensor], None]] = None,
) -> list[list[int]]:
    """Up to ``max_new_tokens`` tokens after each prompt (one packed sample per ``MicroBatch``);
    a row stops at any of ``eos_ids`` (left out of its result). ``on_logits`` sees each step's
    next-token logits [B, V] before the choice (a finished row's are meaningless)."""
    if not prompts:
        return []
    device = torch.device(device)
    eos = set(int(e) for e in eos_ids)
    llm = model.llm
    mrope = llm.config.mrope_section is not None
    embeds = [model.embed(p.input_ids.to(device), {m: x.to(device) for m, x in p.media.items()}) for p in prompts]
    lengths = [e.shape[0] for e in embeds]
    if min(lengths) == 0:
        raise ValueError("generate needs prompts of at least one token")
    generated: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens <= 0:
        return generated
    batch, width = len(prompts), max(lengths)
    buf = embeds[0].new_zeros(batch, width, embeds[0].shape[-1])
    for i, e in enumerate(embeds):
        buf[i, : e.shape[0]] = e
    starts = [generation_start(p, mrope) for p in prompts]
    positions = _prompt_positions(prompts, width, mrope, starts).to(device)
    # The prompt, then one slot per generated token but the last (it is never fed back).
    cache = KVCache(batch, width + max_new_tokens - 1, device)
    out = llm(inputs_embeds=buf, output_hidden=True, cache=cache,
              **({"rope_position_ids": positions} if mrope else {"position_ids": positions}))
    cache.trim(lengths)
    rows = torch.arange(batch, device=device)
    logits = llm.lm_logits(out.hidden_states[rows, torch.tensor(lengths, device=device) - 1])
    generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)
    start = torch.tensor(starts, device=device)
    done = [False] * batch
    for step in range(max_new_tokens):
        if on_logits is not None:
            on_logits(logits)
        next_ids = choose_next(logits, sampling, generator)
        for i, tok in enumerate(next_ids.tolist()):
            if done[i]:
                continue
            if tok in eos:
                done[i] = True
            else:
                generated[i].append(tok)
        if all(done) or step == max_new_tokens - 1:
            break
        # Finished rows keep stepping (their tokens are ignored): the batch keeps its shape.
        pos = (start + step)[:, None]  # [B, 1]
        kwargs = {"rope_position_ids": pos.expand(3, batch, 1)} if mrope else {"position_ids": pos}
        out = llm(inputs_embeds=llm.embed(next_ids)[:, None], output_hidden=True, cache=cache, **kwargs)
        logits = llm.lm_logits(out.hidden_states[:, -1])
    return generated
