"""The simulated steps' data: every DP group's micro-batches as document lengths and media
items, arranged by the data plane's own balancer (``dataloading.plan.balance.arrange``, what the
planner runs every step) under the same cost model and packing budget as training.

Two sources (``data.source``):

- ``lengths``: samples drawn from distributions (``SimDataConfig``). Each sample is text-only
  or a media sample of one kind of ``data.media_mix`` (one image, several images, a many-frame
  video clip, an audio clip) with its own item counts and sizes and a short text around them,
  so a step mixes text-only, single-image and media-heavy samples: the imbalance the balancer
  and the multiplexed encoders exist for. ``data.image_ratio`` is the media share of the
  *batch's* LLM tokens in expectation; it sets how many samples are text-only (see
  ``SampleModel.solve``). ``data.image_ratio_schedule`` makes it change over the run.
- ``mixture``: the samples of a real mixture YAML, drawn by the planner from its metadata
  index exactly as ``omni train`` would draw them (no shard is opened); ``data.run_steps``
  spreads the simulated steps over the run, so the mixture's curriculum applies.

A media item is (modality, encoder tokens, LLM rows) (``MicroBatchWork.media``): what the tower
runs and what the LLM sees of it (part of ``MicroBatchWork.docs``). ``source=lengths`` asks the
tower for both (``EncoderAnchor.simulated_item`` / ``simulated_clip``: a tower in its own terms,
e.g. anyres tiles and their newlines); ``source=mixture`` has the rows from the index and the
tokens by ``encoder_tokens``.
"""
from __future__ import annotations

import math

import numpy as np

from dataloading.plan.balance import METHODS, arrange
from omni.errors import ConfigError
from omni.sim.config import SimDataConfig
from omni.sim.spec import ModelSpec
from omni.sim.sample_model import KINDS, SampleModel, media_kinds
from omni.sim.work import MicroBatchWork, StepWork, media_rows, step_media_share


def encoder_tokens(spec: ModelSpec, modality: str, rows):
    """The encoder tokens behind ``rows`` LLM placeholders of an indexed item (source=mixture:
    the index counts rows): ``tokens_per_row`` each (the projector's spatial merge)."""
    return rows * spec.encoders[modality].tokens_per_row


# ---- validation ------------------------------------------------------------------------------

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
    check_run_steps(cfg)
    if cfg.source != "lengths":  # the distributions below describe source=lengths only
        if cfg.image_ratio_schedule is not None:
            raise ConfigError("data.image_ratio_schedule describes data.source=lengths; a mixture's own "
                              "curriculum (weights over steps) applies at the steps data.run_steps spreads")
        return
    ratios = [cfg.image_ratio] if cfg.image_ratio_schedule is None else check_schedule(cfg.image_ratio_schedule)
    check_media_mix(cfg)
    if max(ratios) > 0 and not media_kinds(cfg, spec):
        have = sorted(spec.encoders) or "none"
        raise ConfigError(f"data.image_ratio={max(ratios)} needs an image encoder (or an audio one for "
                          f"data.media_mix.audio), the model has {have}; add encoders/vision=siglip, give a kind "
                          f"the model can encode a weight in data.media_mix, or set data.image_ratio=0")
    if not 1 <= cfg.image_tokens_min <= cfg.image_tokens_max:
        raise ConfigError(f"data.image_tokens_min={cfg.image_tokens_min} must be >= 1 and <= "
                          f"data.image_tokens_max={cfg.image_tokens_max}")
    for key in ("images_per_sample", "video_frames", "frame_tokens", "audio_tokens"):
        _check_range(key, getattr(cfg, key))
    if cfg.sample_tokens < 1 or cfg.sample_tokens > cfg.micro_batch_tokens:
        raise ConfigError(f"data.sample_tokens={cfg.sample_tokens} must be in [1, data.micro_batch_tokens="
                          f"{cfg.micro_batch_tokens}]")
    if cfg.sample_tokens_sigma < 0 or not math.isfinite(cfg.sample_tokens_sigma):
        raise ConfigError(f"data.sample_tokens_sigma={cfg.sample_tokens_sigma} must be >= 0 (0: fixed lengths)")
    if not 1 <= cfg.media_text_tokens < cfg.micro_batch_tokens:
        raise ConfigError(f"data.media_text_tokens={cfg.media_text_tokens} must be in [1, data.micro_batch_tokens)")
    if cfg.micro_batch_tokens < 2:
        raise ConfigError("data.micro_batch_tokens must be >= 2 under data.source=lengths (a media token and a "
                          "text token)")


def check_schedule(schedule) -> list[float]:
    """data.image_ratio_schedule: [[fraction, ratio], ...], fractions increasing in [0, 1],
    ratios in [0, 1]. Returns the ratios."""
    key = "data.image_ratio_schedule"
    fix = "write it as [[0, 0.1], [1, 0.9]]: [fraction_of_run, ratio] points, fractions increasing in [0, 1]"
    try:
        points = [(float(f), float(r)) for f, r in schedule]
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={schedule!r} is not a list of [fraction, ratio] pairs; {fix}") from None
    if not points:
        raise ConfigError(f"{key} is empty; {fix}, or leave it unset for a fixed data.image_ratio")
    fractions = [f for f, _ in points]
    if any(not 0.0 <= f <= 1.0 for f in fractions) or any(b <= a for a, b in zip(fractions, fractions[1:])):
        raise ConfigError(f"{key}: fractions {fractions} must be strictly increasing and in [0, 1]; {fix}")
    ratios = [r for _, r in points]
    if any(not 0.0 <= r <= 1.0 for r in ratios):
        raise ConfigError(f"{key}: ratios {ratios} must be in [0, 1] (0.9: a 9:1 media:text mix)")
    return ratios


def check_media_mix(cfg: SimDataConfig) -> None:
    for kind, weight in cfg.media_mix.items():
        if kind not in KINDS:
            raise ConfigError(f"data.media_mix.{kind}: not a media kind; use {', '.join(KINDS)}")
        if not (math.isfinite(float(weight)) and float(weight) >= 0):
            raise ConfigError(f"data.media_mix.{kind}={weight} must be a weight >= 0 (0 leaves the kind out)")


def check_run_steps(cfg: SimDataConfig) -> None:
    if cfg.run_steps < 0:
        raise ConfigError(f"data.run_steps={cfg.run_steps} must be >= 0 (0: the steps first_step .. "
                          f"first_step + steps - 1)")
    if cfg.run_steps and cfg.source != "mixture":
        raise ConfigError("data.run_steps spreads a mixture's steps over a run (data.source=mixture); for "
                          "data.source=lengths set data.image_ratio_schedule (fractions of the run)")
    if cfg.run_steps and cfg.run_steps < cfg.steps:
        raise ConfigError(f"data.run_steps={cfg.run_steps} must be >= data.steps={cfg.steps} (each simulated "
                          f"step a different step of the run)")


def _check_range(key: str, value) -> None:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value)
    if not ok or not 1 <= value[0] <= value[1]:
        raise ConfigError(f"data.{key}={value!r} must be [lo, hi] with 1 <= lo <= hi (integers)")


def ratio_at(schedule, fraction: float) -> float:
    """data.image_ratio_schedule at ``fraction`` of the run (linear between points, the end
    values outside them)."""
    return float(np.interp(fraction, [float(f) for f, _ in schedule], [float(r) for _, r in schedule]))


def step_ratios(cfg: SimDataConfig) -> list[tuple[float | None, float]]:
    """(fraction of the run, image ratio) of each simulated step (fraction None: no schedule)."""
    if cfg.image_ratio_schedule is None:
        return [(None, cfg.image_ratio)] * cfg.steps
    fractions = [(i + 0.5) / cfg.steps for i in range(cfg.steps)]
    return [(f, ratio_at(cfg.image_ratio_schedule, f)) for f in fractions]


# ---- source=lengths --------------------------------------------------------------------------

def draw_steps(cfg: SimDataConfig, spec: ModelSpec, dp: int, multiple: int = 1) -> list[StepWork]:
    """``cfg.steps`` steps over ``dp`` DP groups, packed as the runtime's planner packs them
    (micro-batches per group a multiple of ``multiple``: ``parallel.rows.microbatch_multiple``)."""
    check_data(cfg, spec)
    if cfg.source == "mixture":
        return _mixture_steps(cfg, spec, dp, multiple)
    model = SampleModel(cfg, spec)
    rng = np.random.default_rng(cfg.seed)
    steps = []
    for fraction, ratio in step_ratios(cfg):
        samples = model.draw(ratio, cfg.global_batch_size, rng)
        step = _arrange(samples, cfg, spec, dp, multiple)
        step.image_ratio, step.run_fraction = ratio, fraction
        step.samples, step.media_samples = len(samples), sum(1 for s in samples if s.media)
        steps.append(step)
    return steps


def _arrange(samples: list[MicroBatchWork], cfg: SimDataConfig, spec: ModelSpec, dp: int, multiple: int) -> StepWork:
    costs = np.asarray([spec.cost.sample_cost(s.docs, media_rows(s.media)) for s in samples])
    tokens = np.asarray([s.tokens for s in samples], dtype=np.int64)
    arr = arrange(costs, tokens, dp, cfg.micro_batch_tokens, cfg.balance, multiple=multiple)
    groups = [[MicroBatchWork([d for i in mb for d in samples[i].docs], [it for i in mb for it in samples[i].media])
               for mb in rank] for rank in arr.ranks]
    return StepWork(groups, float(arr.stats(costs)["max_over_mean"]))


# ---- source=mixture --------------------------------------------------------------------------

def mixture_steps(cfg: SimDataConfig) -> list[int]:
    """The planner steps simulated: spread evenly over the run's data.run_steps steps (step i
    at fraction (i + 0.5) / steps), or data.steps consecutive ones."""
    if not cfg.run_steps:
        return list(range(cfg.first_step, cfg.first_step + cfg.steps))
    return [cfg.first_step + int((i + 0.5) * cfg.run_steps / cfg.steps) for i in range(cfg.steps)]


def _mixture_steps(cfg: SimDataConfig, spec: ModelSpec, dp: int, multiple: int) -> list[StepWork]:
    from dataloading.config import DataConfig
    from dataloading.serve.loader import build_planner
    from dataloading.formats.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer)
    data = DataConfig(mixture=cfg.mixture, global_batch_size=cfg.global_batch_size,
                      micro_batch_tokens=cfg.micro_batch_tokens, balance=cfg.balance, balance_group=0,
                      over_budget=cfg.over_budget)
    planner, _ = build_planner(data, tokenizer, spec.processors, seed=cfg.seed, dp_size=dp, cost_model=spec.cost,
                               micro_batch_multiple=multiple, progress=False)
    steps = []
    for i, step in enumerate(mixture_steps(cfg)):
        plan = planner.plan(step)
        # the index counts an item by its placeholders; a simulated step by its encoder tokens
        groups = [[MicroBatchWork([plan.unit_tokens[u] for u in mb],
                                  [(m, int(encoder_tokens(spec, m, n)), int(n)) for u in mb
                                   for m, n in planner.unit_media(u)])
                   for mb in rank] for rank in plan.ranks]
        work = StepWork(groups, float(plan.stats["max_over_mean"]))
        work.image_ratio = step_media_share(work)
        units = [u for rank in plan.ranks for mb in rank for u in mb]
        work.samples, work.media_samples = len(units), sum(1 for u in units if planner.unit_media(u))
        work.run_fraction = (i + 0.5) / cfg.steps if cfg.run_steps else None
        steps.append(work)
    return steps
