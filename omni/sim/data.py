"""The simulated steps' data: every DP group's micro-batches as document lengths and media
items, arranged by the data plane's own balancer (``dataloading.balance.arrange``, what the
planner runs every step) under the same cost model and packing budget as training.

Two sources (``data.source``):

- ``lengths``: samples drawn from distributions (``SimDataConfig``): LLM tokens per sample
  log-normal, a share ``image_ratio`` of them image tokens, images of log-uniform size;
- ``mixture``: the samples of a real mixture YAML, drawn by the planner from its metadata
  index exactly as ``omni train`` would draw them (no shard is opened).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dataloading.balance import METHODS, arrange
from omni.errors import ConfigError
from omni.sim.config import SimDataConfig
from omni.sim.spec import ModelSpec

IMAGE = "image"


@dataclass
class MicroBatchWork:
    docs: list[int] = field(default_factory=list)  # LLM document lengths (text + media tokens)
    media: list[tuple[str, int]] = field(default_factory=list)  # (modality, encoder tokens)

    @property
    def tokens(self) -> int:
        return int(sum(self.docs))


@dataclass
class StepWork:
    groups: list[list[MicroBatchWork]]  # [DP group][micro-batch]
    balance: float  # max / mean cost over DP groups, as the balancer left it

    def tokens(self) -> int:
        return sum(mb.tokens for g in self.groups for mb in g)

    def media(self) -> list[tuple[str, int]]:
        return [it for g in self.groups for mb in g for it in mb.media]

    def docs(self) -> list[int]:
        return [d for g in self.groups for mb in g for d in mb.docs]


def check_data(cfg: SimDataConfig, spec: ModelSpec) -> None:
    where = "data"
    if cfg.source not in ("lengths", "mixture"):
        raise ConfigError(f"{where}.source={cfg.source!r}: use lengths (distributions) or mixture (a mixture YAML)")
    if cfg.source == "mixture" and not cfg.mixture:
        raise ConfigError("data.source=mixture needs data.mixture=/path/to/mixture.yaml")
    if not 0.0 <= cfg.image_ratio <= 1.0:
        raise ConfigError(f"data.image_ratio={cfg.image_ratio} must be in [0, 1] (0.9: a 9:1 image:text mix)")
    if cfg.global_batch_size < 1 or cfg.micro_batch_tokens < 1 or cfg.steps < 1 or cfg.first_step < 0:
        raise ConfigError("data.global_batch_size, data.micro_batch_tokens and data.steps must be >= 1, "
                          "data.first_step >= 0")
    if cfg.balance not in METHODS:
        raise ConfigError(f"data.balance={cfg.balance!r} is not one of {', '.join(METHODS)}")
    if cfg.source != "lengths":  # the distributions below describe source=lengths only
        return
    if cfg.image_ratio > 0 and IMAGE not in spec.encoders:
        raise ConfigError(f"data.image_ratio={cfg.image_ratio} needs an image encoder, the model has "
                          f"{sorted(spec.encoders) or 'none'}; add encoders/vision=siglip or set data.image_ratio=0")
    if not 1 <= cfg.image_tokens_min <= cfg.image_tokens_max:
        raise ConfigError(f"data.image_tokens_min={cfg.image_tokens_min} must be >= 1 and <= "
                          f"data.image_tokens_max={cfg.image_tokens_max}")
    if cfg.sample_tokens < 1 or cfg.sample_tokens > cfg.micro_batch_tokens:
        raise ConfigError(f"data.sample_tokens={cfg.sample_tokens} must be in [1, data.micro_batch_tokens="
                          f"{cfg.micro_batch_tokens}]")


def draw_steps(cfg: SimDataConfig, spec: ModelSpec, dp: int) -> list[StepWork]:
    """``cfg.steps`` steps over ``dp`` DP groups."""
    check_data(cfg, spec)
    if cfg.source == "mixture":
        return _mixture_steps(cfg, spec, dp)
    rng = np.random.default_rng(cfg.seed)
    return [_arrange([_draw_sample(cfg, rng) for _ in range(cfg.global_batch_size)], cfg, spec, dp)
            for _ in range(cfg.steps)]


def _draw_sample(cfg: SimDataConfig, rng: np.random.Generator) -> MicroBatchWork:
    if cfg.sample_tokens_sigma > 0:
        mu = math.log(cfg.sample_tokens) - cfg.sample_tokens_sigma ** 2 / 2  # mean stays sample_tokens
        n = int(round(rng.lognormal(mu, cfg.sample_tokens_sigma)))
    else:
        n = cfg.sample_tokens
    n = int(min(max(n, 2), cfg.micro_batch_tokens))
    images: list[tuple[str, int]] = []
    left = int(round(cfg.image_ratio * n))
    left = min(left, n - 1)  # at least one text token
    lo, hi = math.log(cfg.image_tokens_min), math.log(cfg.image_tokens_max)
    while left >= cfg.image_tokens_min:
        size = int(round(math.exp(rng.uniform(lo, hi))))
        size = min(size, left)
        images.append((IMAGE, size))
        left -= size
    return MicroBatchWork([n], images)


def _arrange(samples: list[MicroBatchWork], cfg: SimDataConfig, spec: ModelSpec, dp: int) -> StepWork:
    costs = np.asarray([spec.cost.sample_cost(s.docs, s.media) for s in samples])
    tokens = np.asarray([s.tokens for s in samples], dtype=np.int64)
    arr = arrange(costs, tokens, dp, cfg.micro_batch_tokens, cfg.balance)
    groups = [[MicroBatchWork([d for i in mb for d in samples[i].docs], [it for i in mb for it in samples[i].media])
               for mb in rank] for rank in arr.ranks]
    return StepWork(groups, float(arr.stats(costs)["max_over_mean"]))


def _mixture_steps(cfg: SimDataConfig, spec: ModelSpec, dp: int) -> list[StepWork]:
    from dataloading.loader import build_planner
    from dataloading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer)
    planner, _ = build_planner(cfg.mixture, tokenizer, spec.processors, dp_size=dp, progress=False,
                               seed=cfg.seed, global_batch_size=cfg.global_batch_size,
                               micro_batch_tokens=cfg.micro_batch_tokens, cost_model=spec.cost, balance=cfg.balance,
                               balance_group=0, over_budget=cfg.over_budget)
    steps = []
    for step in range(cfg.first_step, cfg.first_step + cfg.steps):
        plan = planner.plan(step)
        groups = [[MicroBatchWork([plan.unit_tokens[u] for u in mb], [it for u in mb for it in planner.unit_media(u)])
                   for mb in rank] for rank in plan.ranks]
        steps.append(StepWork(groups, float(plan.stats["max_over_mean"])))
    return steps
