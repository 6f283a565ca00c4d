"""The planner: central, metadata-only state deciding which samples each DP rank gets, and how.

State is O(number of sources): per source (epoch, cursor), the global step and the seed.
Nothing depends on the DP size, so a run saved at dp=8 resumes at dp=4 with the same sample
stream (only the arrangement changes). Everything random is derived from ``seed`` and a
position, never stored:

- the permutation of a source in epoch ``e`` comes from (seed, crc32(name), e);
- the per-source sample counts of step ``s`` come from the weights at ``s`` (constants or
  piecewise-linear schedules) and each source's *deficit* (its share so far minus what it
  got, kept in the state): every step has exactly ``global_batch_size`` samples, the
  remainders go to the sources furthest behind (ties broken by a draw from (seed, s)), so a
  source's count never strays more than about one sample from its cumulative share — the
  mixture holds over any window of steps, not just on average;
- the arrangement over ranks and micro-batches is ``dataloading.plan.balance.arrange`` on the
  samples' costs (``dataloading.plan.cost.CostModel``) and token counts.

``plan(step)`` is a pure function of (seed, state, step, dp size, balance settings) and only
reads lengths from the metadata index: planning never opens a tar.
"""
from __future__ import annotations

import copy
import logging
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from dataloading.errors import DataError
from dataloading.formats.media import MediaProcessor, configure_processors
from dataloading.formats.tokenizer import ByteTokenizer, Tokenizer
from dataloading.index.source_index import SourceIndex
from dataloading.plan.balance import arrange
from dataloading.plan.cost import CostModel
from dataloading.plan.mixture import SourceOptions, WeightSchedule
from dataloading.plan.packing import Packing
from dataloading.plan.pieces import PIECE_SEP, split_piece
from dataloading.plan.sample_length import estimate_tokens, layout_tokens, media_entries
from dataloading.plan.token_counts import chat_token_counts

log = logging.getLogger("omni.data")

_COUNTS_TAG, _PERM_TAG, _ORDER_TAG = 1, 2, 3  # keep the random streams of a seed apart


def _seed_words(seed: int) -> int:
    return int(seed) & 0xFFFF_FFFF_FFFF_FFFF  # numpy seeds must be non-negative


class SourceTable:
    """What planning needs of one source, compactly: keys, lengths, costs, policies.

    It keeps no reference to the index's per-sample objects (hundreds of bytes each): once the
    tables and the readers are built, the loaded index can be freed.
    """

    def __init__(self, name: str, index: SourceIndex, tokenizer: Tokenizer,
                 processors: Mapping[str, MediaProcessor], cost: CostModel, options: SourceOptions,
                 progress: bool = True):
        self.name = name
        self.folder = index.folder
        self.options = options
        self.processors = configure_processors(dict(processors), options.media, f"source {name}")
        template = len(options.chat_template.encode()) - len("{prompt}") if options.chat_template else 0
        where = f"source {name}: sample"
        n = len(index)
        self.tokens = np.zeros(n, dtype=np.int64)
        self.media_cost = np.zeros(n)
        self.num_media = np.zeros(n, dtype=np.int64)
        # Every media item's (modality, encoder tokens), flat: sample i's are
        # [media_start[i], media_start[i] + num_media[i]) (what the scale simulator replays).
        self.media_start = np.zeros(n, dtype=np.int64)
        flat_tokens: list[int] = []
        flat_modality: list[str] = []
        # Conversations are counted exactly (their length depends on the chat template).
        chat = (chat_token_counts(name, index, tokenizer, options, progress=progress)
                if any(m.chat for m in index.samples) else {})
        for i, meta in enumerate(index.samples):
            entries = media_entries(meta, self.processors, where)
            modalities, items = [m for m, _ in entries], [k for _, k in entries]
            if meta.key in chat:
                self.tokens[i] = chat[meta.key] + sum(items) + layout_tokens(meta, tokenizer, self.processors, where)
            else:
                self.tokens[i] = estimate_tokens(meta, tokenizer, self.processors, where, template, entries)
            # A video costs what its encoder's item of that many tokens costs (an image item's).
            self.media_cost[i] = sum(float(cost.media_cost(m, k)) for m, k in zip(modalities, items))
            self.num_media[i] = len(items)
            self.media_start[i] = len(flat_tokens)
            flat_tokens += items
            flat_modality += modalities
        self.media_tokens = np.asarray(flat_tokens, dtype=np.int64)
        self.media_modality = flat_modality
        self.cost = np.asarray(cost.llm_cost(self.tokens)) + self.media_cost
        self.keys = [meta.key for meta in index.samples]

    def __len__(self) -> int:
        return len(self.keys)

    def key(self, i: int) -> str:
        return self.keys[i]


@dataclass
class StepPlan:
    """One step's arrangement: for each DP rank its micro-batches of unit ids."""

    step: int
    ranks: list[list[list[str]]]  # rank -> micro-batch -> unit ids ("src/key" or "src/key#k")
    rank_cost: list[float]
    rank_tokens: list[int]
    stats: dict[str, float]
    sources: dict[str, int]  # samples drawn per source
    samples: list[str]  # the drawn sample ids, in draw order
    skipped: dict[str, int] = field(default_factory=dict)  # kind -> samples planned out (counted)
    unit_cost: dict[str, float] = field(default_factory=dict)
    unit_tokens: dict[str, int] = field(default_factory=dict)

    def rank(self, r: int) -> list[list[str]]:
        return self.ranks[r]

    def rank_units(self, r: int) -> list[str]:
        """Rank r's unit ids, micro-batch after micro-batch."""
        return [u for mb in self.ranks[r] for u in mb]

    def to_json(self) -> dict:
        return {"step": self.step, **{k: v for k, v in self.stats.items()}, "sources": self.sources,
                "skipped": self.skipped,
                "ranks": [{"cost": c, "tokens": t, "samples": [u for mb in mbs for u in mb],
                           "micro_batches": mbs}
                          for c, t, mbs in zip(self.rank_cost, self.rank_tokens, self.ranks)]}


class Planner:
    def __init__(self, sources: Mapping[str, SourceIndex | SourceTable], weights: Mapping[str, float | WeightSchedule],
                 seed: int, global_batch_size: int, dp_size: int, *, tokenizer: Tokenizer | None = None,
                 processors: Mapping[str, MediaProcessor] | None = None, cost_model: CostModel | None = None,
                 options: Mapping[str, SourceOptions] | None = None, packing: Packing = Packing()):
        if dp_size < 1 or global_batch_size < dp_size:
            raise DataError(f"data.global_batch_size={global_batch_size} must be >= the data-parallel size "
                            f"{dp_size} (every rank needs a sample each step)", kind="config")
        self.seed = int(seed)
        self.global_batch_size = int(global_batch_size)
        self.dp_size = int(dp_size)
        self.packing = packing
        self.cost_model = cost_model or CostModel()
        # Sorted, so reordering the mixture file does not change the stream.
        self.names = sorted(sources)
        options = options or {}
        tokenizer = tokenizer or ByteTokenizer()
        # A source may come as a ready SourceTable (build_planner makes them one index at a time,
        # so only one source's per-sample objects are in memory at once).
        self.tables = {n: sources[n] if isinstance(sources[n], SourceTable) else
                       SourceTable(n, sources[n], tokenizer, processors or {}, self.cost_model,
                                   options.get(n, SourceOptions())) for n in self.names}
        self.set_weights(weights)
        self.step = 0
        self.state = {n: (0, 0, 0.0) for n in self.names}  # name -> (epoch, cursor, deficit)
        self._perms: dict[str, tuple[int, np.ndarray]] = {}
        self._keypos: dict[str, dict[str, int]] = {}

    # ---- configuration -------------------------------------------------------------
    def set_weights(self, weights: Mapping[str, float | WeightSchedule]) -> None:
        """Change the mixture (curriculum); the state stays valid."""
        unknown = sorted(set(weights) - set(self.tables))
        if unknown:
            raise DataError(f"mixture weights name unknown sources {unknown}; known: {self.names}", kind="config")
        self.weights = {n: weights.get(n, 0.0) for n in self.names}
        for n, w in self.weights.items():
            peak = max(p[1] for p in w.points) if isinstance(w, WeightSchedule) else float(w)
            if peak < 0:
                raise DataError(f"mixture weight of {n} must be >= 0, got {w}", kind="config")
            if peak > 0 and len(self.tables[n]) == 0:
                raise DataError(f"source {n} has weight {peak} but no samples in {self.tables[n].folder}; "
                                f"fix the shards or set its weight to 0", kind="config")
        self.probabilities(0)  # fail now on an all-zero mixture

    def probabilities(self, step: int) -> np.ndarray:
        w = np.array([w.at(step) if isinstance(w, WeightSchedule) else float(w) for w in self.weights.values()])
        if w.sum() <= 0:
            raise DataError(f"all mixture weights are 0 at step {step}; give a source a positive weight there",
                            kind="config")
        return w / w.sum()

    # ---- the random streams ---------------------------------------------------------
    def counts(self, step: int, state: Mapping[str, tuple] | None = None) -> dict[str, int]:
        """Samples per source in ``step`` given the deficits in ``state`` (default: current)."""
        state = self.state if state is None else state
        probs = self.probabilities(step)
        deficit = np.array([state[n][2] for n in self.names])
        want = np.where(probs > 0, self.global_batch_size * probs + deficit, 0.0)  # weight 0: nothing owed
        base = np.maximum(np.floor(want), 0).astype(np.int64)
        rem = self.global_batch_size - int(base.sum())
        rng = np.random.default_rng([_seed_words(self.seed), int(step), _COUNTS_TAG])
        tiebreak = rng.random(len(base))
        frac = want - base
        if rem > 0:  # the sources furthest behind get the remaining samples
            order = np.lexsort((tiebreak, -frac))
            base[order[:rem]] += 1
        elif rem < 0:  # sources ahead of their share (clipped at 0 above) give back
            order = [i for i in np.lexsort((tiebreak, frac)) if base[i] > 0]
            base[order[:-rem]] -= 1
        return {n: int(c) for n, c in zip(self.names, base) if c > 0}

    def permutation(self, name: str, epoch: int) -> np.ndarray:
        cached = self._perms.get(name)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([_seed_words(self.seed), zlib.crc32(name.encode()), int(epoch), _PERM_TAG])
            cached = (epoch, rng.permutation(len(self.tables[name])))
            self._perms[name] = cached
        return cached[1]

    def _draw(self, step: int, state: dict[str, tuple]) -> tuple[list[tuple[str, int]], dict]:
        """The (source, sample index) of one step, and the state after it."""
        counts = self.counts(step, state)
        probs = dict(zip(self.names, self.probabilities(step).tolist()))
        state = {n: (e, c, (d + self.global_batch_size * probs[n] - counts.get(n, 0)) if probs[n] > 0 else 0.0)
                 for n, (e, c, d) in state.items()}
        picked: list[tuple[str, int]] = []
        for name, k in counts.items():
            epoch, cursor, deficit = state[name]
            n = len(self.tables[name])
            while k > 0:
                take = min(k, n - cursor)
                picked.extend((name, int(i)) for i in self.permutation(name, epoch)[cursor:cursor + take])
                cursor, k = cursor + take, k - take
                if cursor == n:  # epoch boundary: continue in the next permutation
                    epoch, cursor = epoch + 1, 0
            state[name] = (epoch, cursor, deficit)
        # Interleave the sources (seeded by the step): the step's set is fixed, and its order is
        # what `balance=none` keeps — a randomly mixed stream, as a per-rank mixing loader reads.
        rng = np.random.default_rng([_seed_words(self.seed), int(step), _ORDER_TAG])
        picked = [picked[i] for i in rng.permutation(len(picked))]
        return picked, state

    # ---- samples -> units of work (the over-budget policy) --------------------------
    def _units(self, picked: list[tuple[str, int]]) -> tuple[list[str], list[int], list[float], dict[str, int]]:
        ids, tokens, costs, skipped = [], [], [], {}
        budget = self.packing.budget

        def add(unit_id: str, n: int, cost: float) -> None:
            ids.append(unit_id)
            tokens.append(n)
            costs.append(cost)

        for name, i in picked:
            t = self.tables[name]
            sid = f"{name}/{t.key(i)}"
            if t.options.max_media is not None and t.num_media[i] > t.options.max_media:
                skipped["too_many_media"] = skipped.get("too_many_media", 0) + 1
                continue
            n = int(t.tokens[i])
            if budget is None or n <= budget:
                add(sid, n, float(t.cost[i]))
                continue
            policy = t.options.over_budget or self.packing.over_budget
            if policy == "error":
                raise DataError(f"sample {sid} needs {n} tokens but data.micro_batch_tokens={budget}; raise "
                                f"data.micro_batch_tokens, lower the image patch budget, or set data.over_budget "
                                f"(truncate, split, skip)", kind="over_budget")
            if policy == "skip":
                skipped["over_budget"] = skipped.get("over_budget", 0) + 1
            elif policy == "truncate":
                add(sid, budget, float(self.cost_model.llm_cost(budget)) + float(t.media_cost[i]))
            else:  # split: pieces of `budget` tokens, each its own document
                k = math.ceil(n / budget)
                for p in range(k):
                    size = min(budget, n - p * budget)
                    # media cost goes with the first piece (an estimate: the constructor knows where items fall)
                    add(f"{sid}{PIECE_SEP}{p}", size,
                        float(self.cost_model.llm_cost(size)) + (float(t.media_cost[i]) if p == 0 else 0.0))
        return ids, tokens, costs, skipped

    # ---- planning -------------------------------------------------------------------
    def plan(self, step: int | None = None, dp_size: int | None = None, balance: str | None = None) -> StepPlan:
        """The arrangement of ``step`` (default: the current one) over ``dp_size`` ranks.

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
        return self.arrange(step, picked, dp_size or self.dp_size, balance or self.packing.balance)

    def arrange(self, step: int, picked: list[tuple[str, int]], dp_size: int, balance: str) -> StepPlan:
        ids, tokens, costs, skipped = self._units(picked)
        cost_arr = np.asarray(costs, dtype=np.float64)
        pk = self.packing
        arr = arrange(cost_arr, np.asarray(tokens, dtype=np.int64), dp_size, pk.budget, balance, pk.balance_group,
                      pk.micro_batch_multiple)
        ranks = [[[ids[i] for i in mb] for mb in rank] for rank in arr.ranks]
        counts: dict[str, int] = {}
        for name, _ in picked:
            counts[name] = counts.get(name, 0) + 1
        samples = [f"{n}/{self.tables[n].key(i)}" for n, i in picked]
        return StepPlan(step, ranks, arr.rank_cost.tolist(), arr.rank_tokens.tolist(), arr.stats(cost_arr),
                        counts, samples, skipped, dict(zip(ids, costs)), dict(zip(ids, tokens)))

    def unit_media(self, unit_id: str) -> list[tuple[str, int]]:
        """A unit's media items as (modality, encoder tokens); a split sample's go with its first
        piece, as its cost does."""
        sid, piece = split_piece(unit_id)
        if piece:
            return []
        name, key = sid.split("/", 1)
        t = self.tables[name]
        i = self._key_pos(name)[key]
        lo, n = int(t.media_start[i]), int(t.num_media[i])
        return [(t.media_modality[k], int(t.media_tokens[k])) for k in range(lo, lo + n)]

    def sample_tokens(self, sample_id: str) -> int:
        name, key = split_piece(sample_id)[0].split("/", 1)
        return int(self.tables[name].tokens[self._key_pos(name)[key]])

    def _key_pos(self, name: str) -> dict[str, int]:
        if name not in self._keypos:
            self._keypos[name] = {k: i for i, k in enumerate(self.tables[name].keys)}
        return self._keypos[name]

    def advance(self) -> None:
        self.state = self._draw(self.step, self.state)[1]
        self.step += 1

    # ---- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": 2, "seed": self.seed, "step": self.step,
                "sources": {n: {"epoch": e, "cursor": c, "deficit": d, "num_samples": len(self.tables[n])}
                            for n, (e, c, d) in self.state.items()}}

    def load_state_dict(self, sd: Mapping) -> None:
        if sd.get("version") not in (1, 2):  # v1 had no deficits: they start at 0
            raise DataError(f"data state version {sd.get('version')} is not supported (expected 2)", kind="config")
        if int(sd["seed"]) != self.seed:
            raise DataError(f"the checkpoint's data state uses seed {sd['seed']} but the planner has seed "
                            f"{self.seed}; resume with the same data seed", kind="config")
        state = {n: (0, 0, 0.0) for n in self.names}  # a source new to the mixture starts fresh
        for name, s in sd["sources"].items():
            if name not in self.tables:
                log.warning("data state has source %r that is not in the mixture any more: dropped", name)
                continue
            n = len(self.tables[name])
            if s.get("num_samples", n) != n:
                log.warning("source %s had %s samples when saved, now %d: its order changes from here",
                            name, s["num_samples"], n)
            state[name] = (int(s["epoch"]), min(int(s["cursor"]), n), float(s.get("deficit", 0.0)))
        self.state = state
        self.step = int(sd["step"])

    def clone(self) -> "Planner":
        """Same sources and weights, independent state (the loader plans ahead on a clone)."""
        other = copy.copy(self)
        other.state = dict(self.state)
        other._perms = {}
        return other
