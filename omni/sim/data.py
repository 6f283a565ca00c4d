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
from dataclasses import dataclass, field

import numpy as np

from dataloading.plan.balance import METHODS, arrange
from omni.errors import ConfigError
from omni.sim.config import SimDataConfig
from omni.sim.spec import ModelSpec

IMAGE = "image"
AUDIO = "audio"
# media_mix kind -> the modality (encoder) of its items. Video frames are image items: the
# model's vision encoder is a ViT that encodes each frame.
KINDS = {"image": IMAGE, "multi_image": IMAGE, "video": IMAGE, "audio": AUDIO}
# Draws per media kind behind the expected token counts the mix is solved with (a fixed seed:
# the solve is deterministic; the expectations' relative error is below 0.5%).
EXPECTATION_DRAWS = 1 << 15
EXPECTATION_SEED = 20240518


def encoder_tokens(spec: ModelSpec, modality: str, rows):
    """The encoder tokens behind ``rows`` LLM placeholders of an indexed item (source=mixture:
    the index counts rows): ``tokens_per_row`` each (the projector's spatial merge)."""
    return rows * spec.encoders[modality].tokens_per_row


def media_rows(media) -> list[tuple[str, int]]:
    """(modality, encoder tokens, LLM rows) items as the shared cost model and the planners
    count them: by their LLM placeholders."""
    return [(m, int(rows)) for m, _, rows in media]


@dataclass
class MicroBatchWork:
    docs: list[int] = field(default_factory=list)  # LLM document lengths (text + media tokens)
    media: list[tuple[str, int, int]] = field(default_factory=list)  # (modality, encoder tokens, LLM rows)

    @property
    def tokens(self) -> int:
        return int(sum(self.docs))


@dataclass
class StepWork:
    groups: list[list[MicroBatchWork]]  # [DP group][micro-batch]
    balance: float  # max / mean cost over DP groups, as the balancer left it
    # The media share the step was drawn at (source=lengths: image_ratio or the schedule's value
    # at run_fraction; source=mixture: the realised share of the planner's step).
    image_ratio: float | None = None
    run_fraction: float | None = None  # where in the run the step sits (None: no schedule / run_steps)
    samples: int = 0  # the step's samples, and how many of them carry media (for the report)
    media_samples: int = 0

    def tokens(self) -> int:
        return sum(mb.tokens for g in self.groups for mb in g)

    def media(self) -> list[tuple[str, int, int]]:
        return [it for g in self.groups for mb in g for it in mb.media]

    def docs(self) -> list[int]:
        return [d for g in self.groups for mb in g for d in mb.docs]


def media_llm_tokens(media) -> int:
    """LLM tokens of (modality, encoder tokens, LLM rows) items."""
    return int(sum(rows for _, _, rows in media))


def sample_media_share(work: MicroBatchWork) -> float:
    """The share of a sample's (or micro-batch's) LLM tokens that come from media."""
    return media_llm_tokens(work.media) / work.tokens if work.tokens else 0.0


def step_media_share(step: StepWork) -> float:
    """The share of a step's LLM tokens that come from media (what image_ratio sets in expectation)."""
    total = step.tokens()
    return media_llm_tokens(step.media()) / total if total else 0.0


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


def media_kinds(cfg: SimDataConfig, spec: ModelSpec) -> dict[str, float]:
    """The kinds of data.media_mix the model can encode, with weights summing to 1 ({}: none)."""
    kinds = {k: float(w) for k, w in cfg.media_mix.items() if float(w) > 0 and KINDS[k] in spec.encoders}
    total = sum(kinds.values())
    return {k: w / total for k, w in kinds.items()} if total > 0 else {}


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


@dataclass(frozen=True)
class Mix:
    """How a step at a given image ratio is drawn."""

    media_samples: float  # probability that a sample is a media sample (the rest are text-only)
    text_scale: float  # factor on data.media_text_tokens (1 unless the ratio needs shorter text)


@dataclass
class _KindDraws:
    """A media kind's expectation draws: media LLM tokens per sample and the standard normals
    of its text, so the text's expected length can be re-evaluated at any scale."""

    media: np.ndarray  # [N] media LLM tokens
    z: np.ndarray  # [N]


class SampleModel:
    """Per-sample heterogeneity of ``source=lengths``.

    A text-only sample has T ~ log-normal(mean data.sample_tokens) LLM tokens. A media sample is
    of one kind (weights data.media_mix) with M media LLM tokens (its items' counts and sizes)
    and t ~ log-normal(mean s * data.media_text_tokens) text tokens. A share q of the samples
    are media samples. The expected media share of the batch is then

        q E[M] / (q (E[M] + E[t]) + (1 - q) E[T]),

    and ``solve(r)`` picks q for it to equal r at s = 1; above r_max = E[M] / (E[M] + E[t]) (an
    all-media batch) q = 1 and s shrinks the text around the media until the share is r, down
    to one text token per sample (so r = 1 still leaves one). Every sample fits one micro-batch:
    items that would overflow it are dropped (a first item is shrunk to fit), the text capped.
    """

    def __init__(self, cfg: SimDataConfig, spec: ModelSpec):
        self.cfg, self.spec = cfg, spec
        self.kinds = media_kinds(cfg, spec)
        self.budget = int(cfg.micro_batch_tokens)
        rng = np.random.default_rng(EXPECTATION_SEED)
        self.text_only_mean = float(self._text_only(EXPECTATION_DRAWS, rng).mean())
        self._draws = {}
        for kind in self.kinds:
            items = self._media(kind, EXPECTATION_DRAWS, rng)
            self._draws[kind] = _KindDraws(items.llm(), rng.standard_normal(EXPECTATION_DRAWS))
        self.media_mean = sum(w * self._draws[k].media.mean() for k, w in self.kinds.items())

    # -- the solve -----------------------------------------------------------------------------
    def media_text_mean(self, scale: float) -> float:
        """E[text tokens of a media sample] at ``scale`` x data.media_text_tokens."""
        return sum(w * self._text_around(self._draws[k].media, self._draws[k].z, scale).mean()
                   for k, w in self.kinds.items())

    def solve(self, ratio: float) -> Mix:
        if ratio <= 0 or not self.kinds:
            return Mix(0.0, 1.0)
        m, t_only, t_media = self.media_mean, self.text_only_mean, self.media_text_mean(1.0)
        if ratio <= m / (m + t_media):
            q = ratio * t_only / ((1 - ratio) * m - ratio * t_media + ratio * t_only)
            return Mix(float(min(q, 1.0)), 1.0)
        target = m * (1 - ratio) / ratio  # text per media sample that makes the share `ratio`
        lo, hi = 0.0, 1.0  # media_text_mean is non-decreasing in the scale
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.media_text_mean(mid) < target else (lo, mid)
        return Mix(1.0, hi)

    def expected_share(self, mix: Mix) -> float:
        q = mix.media_samples
        media = q * self.media_mean
        total = media + q * self.media_text_mean(mix.text_scale) + (1 - q) * self.text_only_mean
        return media / total if total else 0.0

    # -- drawing -------------------------------------------------------------------------------
    def draw(self, ratio: float, n: int, rng: np.random.Generator) -> list[MicroBatchWork]:
        """``n`` samples at image ratio ``ratio``, in drawn order (what balance=none keeps)."""
        mix = self.solve(ratio)
        kinds = list(self.kinds)
        is_media = rng.random(n) < mix.media_samples
        kind_of = rng.choice(len(kinds), size=n, p=[self.kinds[k] for k in kinds]) if kinds else np.zeros(n, int)
        samples: list[MicroBatchWork | None] = [None] * n
        text_only = np.flatnonzero(~is_media)
        for i, length in zip(text_only, self._text_only(len(text_only), rng)):
            samples[i] = MicroBatchWork([int(length)], [])
        for k, kind in enumerate(kinds):
            where = np.flatnonzero(is_media & (kind_of == k))
            items = self._media(kind, len(where), rng)
            llm = items.llm()
            text = self._text_around(llm, rng.standard_normal(len(where)), mix.text_scale)
            for i, tok, rows, k_row, m, t in zip(where, items.tokens, items.rows, items.keep, llm, text):
                samples[i] = MicroBatchWork([int(m + t)], [(KINDS[kind], int(x), int(r))
                                                           for x, r in zip(tok[k_row], rows[k_row])])
        return samples

    def _text_only(self, n: int, rng: np.random.Generator) -> np.ndarray:
        cfg = self.cfg
        if cfg.sample_tokens_sigma > 0:
            lengths = rng.lognormal(_lognormal_mu(cfg.sample_tokens, cfg.sample_tokens_sigma),
                                    cfg.sample_tokens_sigma, n)
        else:
            lengths = np.full(n, float(cfg.sample_tokens))
        return np.clip(np.rint(lengths), 2, self.budget)

    def _text_around(self, media_llm: np.ndarray, z: np.ndarray, scale: float) -> np.ndarray:
        """Text tokens of media samples with ``media_llm`` media tokens, from standard normals
        ``z``: at least one, at most what the micro-batch leaves."""
        sigma = self.cfg.sample_tokens_sigma
        mean = scale * self.cfg.media_text_tokens
        text = mean * np.exp(sigma * z - sigma ** 2 / 2) if mean > 0 else np.zeros_like(z)
        return np.clip(np.rint(text), 1, self.budget - media_llm)

    def _media(self, kind: str, n: int, rng: np.random.Generator) -> "_Items":
        """The items of ``n`` media samples of ``kind``, as the tower makes them of the drawn
        sizes (``EncoderSpec.item`` / ``clip``: its own terms), those that fit kept."""
        cfg = self.cfg
        e = self.spec.encoders[KINDS[kind]]
        if kind == "video":  # one clip: frames of one size
            frames = rng.integers(cfg.video_frames[0], cfg.video_frames[1] + 1, n)
            size = _log_uniform(rng, *cfg.frame_tokens, (n, 1))[:, 0]
            counts, tokens, rows = _per_value(e.clip, 3, frames, size)
            slots = max(1, int(counts.max(initial=1)))
            tokens = np.broadcast_to(tokens[:, None], (n, slots))
            rows = np.broadcast_to(rows[:, None], (n, slots))
        else:
            lo, hi = tuple(cfg.images_per_sample) if kind == "multi_image" else (1, 1)
            span = cfg.audio_tokens if kind == "audio" else (cfg.image_tokens_min, cfg.image_tokens_max)
            counts = rng.integers(lo, hi + 1, n)
            tokens, rows = _per_value(e.item, 2, _log_uniform(rng, *span, (n, hi)))
        return self._fit(tokens, rows, counts)

    def _fit(self, tokens: np.ndarray, rows: np.ndarray, counts: np.ndarray) -> "_Items":
        """Keep each sample's first ``count`` items that fit its micro-batch with one text token;
        a first item too large alone is shrunk to fit (a processor would downscale it: its
        encoder tokens per row kept)."""
        room = self.budget - 1
        tokens, rows = tokens.astype(np.int64), rows.astype(np.int64)  # copies: the video's are broadcast views
        big = rows[:, 0] > room
        tokens[big, 0] = np.maximum(1, tokens[big, 0] * room // rows[big, 0])
        rows[big, 0] = room
        used = np.cumsum(rows, axis=1)
        keep = (np.arange(rows.shape[1])[None, :] < counts[:, None]) & (used <= room)
        return _Items(tokens, rows, keep)


@dataclass
class _Items:
    """Media items of drawn samples, [sample, slot]: encoder tokens, LLM rows, and which the sample holds."""

    tokens: np.ndarray
    rows: np.ndarray
    keep: np.ndarray

    def llm(self) -> np.ndarray:
        """Media LLM tokens per sample."""
        return (self.rows * self.keep).sum(axis=1).astype(float)


def _per_value(fn, outputs: int, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """``fn`` (a tower's answer, ``outputs`` numbers) of every element of ``arrays`` (same
    shape), asked once per distinct value: the draws repeat few sizes, and a tower answers in Python."""
    # One int64 code per element (each column's rank among its distinct values, mixed-radix):
    # np.unique over rows (axis=0) sorts them as opaque records, ~50x slower than over integers.
    columns = [np.unique(np.asarray(a, dtype=np.int64).ravel(), return_inverse=True) for a in arrays]
    code = np.zeros(columns[0][1].size, dtype=np.int64)
    for values, index in columns:
        code = code * len(values) + index.ravel()
    distinct, inverse = np.unique(code, return_inverse=True)
    unique = np.empty((len(distinct), len(columns)), dtype=np.int64)
    rest = distinct.copy()
    for j in reversed(range(len(columns))):
        values = columns[j][0]
        unique[:, j] = values[rest % len(values)]
        rest //= len(values)
    answers = np.asarray([fn(*(int(v) for v in key)) for key in unique], dtype=np.int64).reshape(len(unique), outputs)
    shape = np.shape(arrays[0])
    return tuple(answers[inverse.ravel(), j].reshape(shape) for j in range(outputs))


def _log_uniform(rng: np.random.Generator, lo: int, hi: int, shape) -> np.ndarray:
    return np.rint(np.exp(rng.uniform(math.log(lo), math.log(hi), shape)))


def _lognormal_mu(mean: float, sigma: float) -> float:
    """The mu of a log-normal of this mean and sigma."""
    return math.log(mean) - sigma ** 2 / 2


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
