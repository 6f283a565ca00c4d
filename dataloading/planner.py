"""The planner: central, metadata-only state deciding which samples each DP rank gets.

State is O(number of sources): per source (epoch, cursor) plus the global step. Nothing
that depends on the DP size is stored, so a run saved at dp_size=2 resumes at dp_size=4
with the same sample stream (only the split across ranks changes). Everything random is
derived from ``seed`` and a position (step, or source name + epoch), never stored:

- the permutation of a source in epoch ``e`` comes from (seed, crc32(name), e);
- the per-source sample counts of step ``s`` come from (seed, s): the global batch is split
  by the weights with randomised rounding (systematic sampling of the remainders), so every
  step has exactly ``global_batch_size`` samples and each source gets, on average, exactly
  its weight's share;
- the samples of a step go to DP ranks longest-first onto the least-loaded rank, balancing
  token counts (the cost model can replace tokens as the load later).
"""
from __future__ import annotations

import copy
import heapq
import logging
import zlib
from collections.abc import Mapping

import numpy as np

from dataloading.errors import DataError
from dataloading.index import SampleMeta, SourceIndex
from dataloading.media import PLACEHOLDERS, MediaProcessor
from dataloading.tokenizer import ByteTokenizer, Tokenizer, estimate_text_tokens

log = logging.getLogger("omni.data")

_COUNTS_TAG, _PERM_TAG = 1, 2  # keep the two random streams of a seed apart


def estimate_tokens(meta: SampleMeta, tokenizer: Tokenizer, processors: Mapping[str, MediaProcessor],
                    where: str = "") -> int:
    """Packed length of a sample from index metadata (exact for ByteTokenizer)."""
    placeholder_bytes = sum(len(PLACEHOLDERS[m].encode()) for m, _ in meta.media)
    n = (tokenizer.bos_id is not None) + 1  # BOS (if any) + EOS
    n += estimate_text_tokens(tokenizer, meta.text_bytes - placeholder_bytes)
    if meta.response_bytes is not None:
        n += estimate_text_tokens(tokenizer, meta.response_bytes)
    for modality, m in meta.media:
        if modality not in processors:
            raise DataError(f"{where or 'sample'} {meta.key}: has {modality} media but no {modality} processor "
                            f"was given; configure a {modality} encoder or drop the source", kind="config")
        n += int(processors[modality].num_tokens_from_meta(m))
    return n


def _seed_words(seed: int) -> int:
    return int(seed) & 0xFFFF_FFFF_FFFF_FFFF  # numpy seeds must be non-negative


class Planner:
    def __init__(self, sources: Mapping[str, SourceIndex], weights: Mapping[str, float], seed: int,
                 global_batch_size: int, dp_size: int, *, tokenizer: Tokenizer | None = None,
                 processors: Mapping[str, MediaProcessor] | None = None):
        if dp_size < 1 or global_batch_size < dp_size:
            raise DataError(f"data.global_batch_size={global_batch_size} must be >= the data-parallel size "
                            f"{dp_size} (every rank needs a sample each step)", kind="config")
        self.sources = dict(sources)
        self.seed = int(seed)
        self.global_batch_size = int(global_batch_size)
        self.dp_size = int(dp_size)
        # Sorted, so reordering the mixture file does not change the stream.
        self.names = sorted(self.sources)
        tokenizer = tokenizer or ByteTokenizer()
        processors = processors or {}
        self.tokens = {n: np.array([estimate_tokens(m, tokenizer, processors, f"source {n}: sample")
                                    for m in self.sources[n].samples], dtype=np.int64) for n in self.names}
        self.set_weights(weights)
        self.step = 0
        self.state = {n: (0, 0) for n in self.names}  # name -> (epoch, cursor)
        self._perms: dict[str, tuple[int, np.ndarray]] = {}
        self._keypos: dict[str, dict[str, int]] = {}

    # ---- configuration -------------------------------------------------------------
    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Change the mixture (curriculum); the state stays valid."""
        unknown = sorted(set(weights) - set(self.sources))
        if unknown:
            raise DataError(f"mixture weights name unknown sources {unknown}; known: {self.names}", kind="config")
        w = np.array([float(weights.get(n, 0.0)) for n in self.names])
        if (w < 0).any() or w.sum() <= 0:
            raise DataError(f"mixture weights {dict(weights)} must be >= 0 with a positive sum", kind="config")
        for n, wn in zip(self.names, w):
            if wn > 0 and len(self.sources[n]) == 0:
                raise DataError(f"source {n} has weight {wn} but no samples in {self.sources[n].folder}; "
                                f"fix the shards or set its weight to 0", kind="config")
        self.probs = w / w.sum()

    # ---- the random streams ---------------------------------------------------------
    def counts(self, step: int) -> dict[str, int]:
        """Samples per source in ``step``: floor of the share, remainders by systematic sampling."""
        exact = self.global_batch_size * self.probs
        base = np.floor(exact).astype(np.int64)
        rem = self.global_batch_size - int(base.sum())
        if rem > 0:
            rng = np.random.default_rng([_seed_words(self.seed), int(step), _COUNTS_TAG])
            # Each source is picked with probability equal to its fractional part (< 1, so
            # at most once), and exactly ``rem`` are picked.
            edges = np.cumsum(exact - base)
            picks = np.searchsorted(edges, rng.random() + np.arange(rem), side="right")
            np.add.at(base, np.minimum(picks, len(base) - 1), 1)
        return {n: int(c) for n, c in zip(self.names, base) if c > 0}

    def permutation(self, name: str, epoch: int) -> np.ndarray:
        cached = self._perms.get(name)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([_seed_words(self.seed), zlib.crc32(name.encode()), int(epoch), _PERM_TAG])
            cached = (epoch, rng.permutation(len(self.sources[name])))
            self._perms[name] = cached
        return cached[1]

    def _draw(self, step: int, state: dict[str, tuple[int, int]]) -> tuple[list[tuple[str, int]], dict]:
        """The (source, sample index) of one step, and the state after it."""
        state = dict(state)
        picked: list[tuple[str, int]] = []
        for name, k in self.counts(step).items():
            epoch, cursor = state[name]
            n = len(self.sources[name])
            while k > 0:
                take = min(k, n - cursor)
                picked.extend((name, int(i)) for i in self.permutation(name, epoch)[cursor:cursor + take])
                cursor, k = cursor + take, k - take
                if cursor == n:  # epoch boundary: continue in the next permutation
                    epoch, cursor = epoch + 1, 0
            state[name] = (epoch, cursor)
        return picked, state

    # ---- planning -------------------------------------------------------------------
    def plan(self, step: int | None = None) -> list[list[str]]:
        """Sample ids ``"<source>/<key>"`` for each DP rank at ``step`` (default: the current one).

        A later step is planned by simulating forward from the current state (cheap: no I/O).
        """
        step = self.step if step is None else int(step)
        if step < self.step:
            raise DataError(f"planner is at step {self.step}, cannot plan the past step {step}; load the "
                            f"state saved at that step instead", kind="config")
        state = self.state
        for s in range(self.step, step):
            state = self._draw(s, state)[1]
        picked = self._draw(step, state)[0]
        return self.split(picked)

    def split(self, picked: list[tuple[str, int]]) -> list[list[str]]:
        """Longest-first onto the least-loaded rank (ties: lowest rank), by token count."""
        items = sorted(((int(self.tokens[n][i]), f"{n}/{self.sources[n][i].key}") for n, i in picked),
                       key=lambda t: (-t[0], t[1]))
        heap = [(0, r) for r in range(self.dp_size)]
        ranks: list[list[str]] = [[] for _ in range(self.dp_size)]
        for tokens, sid in items:
            load, r = heapq.heappop(heap)
            ranks[r].append(sid)
            heapq.heappush(heap, (load + tokens, r))
        return ranks

    def sample_tokens(self, sample_id: str) -> int:
        name, key = sample_id.split("/", 1)
        idx = self._key_pos(name)[key]
        return int(self.tokens[name][idx])

    def _key_pos(self, name: str) -> dict[str, int]:
        if name not in self._keypos:
            self._keypos[name] = {m.key: i for i, m in enumerate(self.sources[name].samples)}
        return self._keypos[name]

    def advance(self) -> None:
        self.state = self._draw(self.step, self.state)[1]
        self.step += 1

    # ---- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": 1, "seed": self.seed, "step": self.step,
                "sources": {n: {"epoch": e, "cursor": c, "num_samples": len(self.sources[n])}
                            for n, (e, c) in self.state.items()}}

    def load_state_dict(self, sd: Mapping) -> None:
        if sd.get("version") != 1:
            raise DataError(f"data state version {sd.get('version')} is not supported (expected 1)", kind="config")
        if int(sd["seed"]) != self.seed:
            raise DataError(f"the checkpoint's data state uses seed {sd['seed']} but the planner has seed "
                            f"{self.seed}; resume with the same data seed", kind="config")
        state = {n: (0, 0) for n in self.names}  # a source new to the mixture starts fresh
        for name, s in sd["sources"].items():
            if name not in self.sources:
                log.warning("data state has source %r that is not in the mixture any more: dropped", name)
                continue
            n = len(self.sources[name])
            if s.get("num_samples", n) != n:
                log.warning("source %s had %s samples when saved, now %d: its order changes from here",
                            name, s["num_samples"], n)
            state[name] = (int(s["epoch"]), min(int(s["cursor"]), n))
        self.state = state
        self.step = int(sd["step"])

    def clone(self) -> "Planner":
        """Same sources and weights, independent state (the loader plans ahead on a clone)."""
        other = copy.copy(self)
        other.state = dict(self.state)
        other._perms = {}
        return other
