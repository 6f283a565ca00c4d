"""The samples of ``data.source=lengths``: each text-only or a media sample of one kind of
``data.media_mix``, its items made by the tower of the drawn sizes, the media share of the batch
solved for ``data.image_ratio`` (``SampleModel``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dataloading.formats.modality import MODALITIES
from omni.sim.config import SimDataConfig
from omni.sim.spec import ModelSpec
from omni.sim.work import MicroBatchWork

IMAGE = "image"  # the media kind that multi_image draws several of


def _kinds() -> dict[str, str]:
    """media_mix kind -> the encoder modality whose cost coefficients its items are charged: a
    media kind's declaration says it (``Modality.encoder``; video frames are image items, the
    vision encoder being a ViT that encodes each frame), and ``multi_image``, the simulator's
    own kind of several images per sample, follows ``image``."""
    out = {}
    for m in MODALITIES:
        out[m.name] = m.encoder
        if m.name == IMAGE:
            out["multi_image"] = m.encoder
    return out


KINDS = _kinds()
# Draws per media kind behind the expected token counts the mix is solved with (a fixed seed:
# the solve is deterministic; the expectations' relative error is below 0.5%).
EXPECTATION_DRAWS = 1 << 15
EXPECTATION_SEED = 20240518


def media_kinds(cfg: SimDataConfig, spec: ModelSpec) -> dict[str, float]:
    """The kinds of data.media_mix the model can encode, with weights summing to 1 ({}: none)."""
    kinds = {k: float(w) for k, w in cfg.media_mix.items() if float(w) > 0 and KINDS[k] in spec.encoders}
    total = sum(kinds.values())
    return {k: w / total for k, w in kinds.items()} if total > 0 else {}


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
