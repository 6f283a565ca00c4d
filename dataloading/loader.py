"""StepLoader: the per-DP-rank iterator of StepBatches, with exact resume.

A background thread plans and builds the next ``prefetch`` steps on a *clone* of the
planner. Each built step travels with the planner state after it; when the step is handed
out, that state becomes the committed one. So ``state_dict()`` after step s resumes exactly
at step s+1, however far the thread had run ahead (Megatron-Energon's rule: save keys and
cursors, never buffered tensors).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from pathlib import Path

from dataloading.batch import StepBatch
from dataloading.constructor import SampleConstructor
from dataloading.errors import DataError, ProblemCounter
from dataloading.media import MediaProcessor
from dataloading.index import SourceIndex
from dataloading.planner import Planner
from dataloading.tokenizer import Tokenizer


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class StepLoader:
    def __init__(self, planner: Planner, constructor: SampleConstructor, dp_rank: int, prefetch: int = 2):
        if not 0 <= dp_rank < planner.dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside dp_size={planner.dp_size}")
        self.planner = planner  # holds the committed state
        self.constructor = constructor
        self.dp_rank = dp_rank
        self.prefetch = prefetch
        self.problems: dict[str, int] = {}  # totals over the steps handed out
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None

    # ---- producing ------------------------------------------------------------------
    def _build(self, work: Planner) -> tuple[StepBatch, dict]:
        step = work.step
        ids = work.plan()[self.dp_rank]
        micro_batches, met = self.constructor.build_with_problems(ids)
        work.advance()
        return StepBatch(step, micro_batches, met), work.state_dict()

    def _produce(self, work: Planner, q: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = self._build(work)
            except BaseException as e:  # handed to the consumer, re-raised there
                item = _Failed(e)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failed):
                return

    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(self.planner.clone(), self._queue, self._stop),
                                        name=f"omni-data-rank{self.dp_rank}", daemon=True)
        self._thread.start()

    # ---- consuming ------------------------------------------------------------------
    def __iter__(self) -> "StepLoader":
        return self

    def __next__(self) -> StepBatch:
        if self.prefetch <= 0:  # synchronous: handy for debugging
            work = self.planner.clone()
            batch, state = self._build(work)
        else:
            if self._thread is None:
                self._start()
            item = self._queue.get()
            if isinstance(item, _Failed):
                self.close()
                raise item.error
            batch, state = item
        self.planner.load_state_dict(state)
        for k, v in batch.problems.items():
            self.problems[k] = self.problems.get(k, 0) + v
        return batch

    def close(self) -> None:
        """Stop the background thread; buffered steps are dropped (the state does not include them)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._thread = self._queue = self._stop = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Change the mixture from the next step on (curriculum); prefetched steps are rebuilt."""
        self.close()
        self.planner.set_weights(weights)

    # ---- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"planner": self.planner.state_dict(), "problems": dict(self.problems)}

    def load_state_dict(self, sd: Mapping) -> None:
        self.close()
        self.planner.load_state_dict(sd["planner"])
        self.problems = dict(sd.get("problems", {}))


def build_loader(mixture: str | Path, tokenizer: Tokenizer, processors: Mapping[str, MediaProcessor], *,
                 seed: int, global_batch_size: int, dp_size: int, dp_rank: int, micro_batch_tokens: int,
                 on_error: str = "skip", max_skip_fraction: float = 0.01, prefetch: int = 2,
                 build_missing_index: bool = False, progress: bool = True) -> StepLoader:
    """Mixture YAML -> indices -> Planner + SampleConstructor -> StepLoader for one DP rank."""
    from dataloading.index import load_index
    from dataloading.mixture import load_mixture

    mix = load_mixture(mixture)
    indices = {s.name: load_index(s.path, build_if_missing=build_missing_index, progress=progress)
               for s in mix.sources}
    planner = Planner(indices, mix.weights, seed, global_batch_size, dp_size, tokenizer=tokenizer,
                      processors=processors)
    constructor = SampleConstructor({n: ix.reader(n) for n, ix in indices.items()}, tokenizer, processors,
                                    micro_batch_tokens, ProblemCounter(on_error, max_skip_fraction))
    loader = StepLoader(planner, constructor, dp_rank, prefetch)
    loader.problems.update(_index_problems(indices, on_error))
    return loader


def _index_problems(indices: Mapping[str, SourceIndex], on_error: str) -> dict[str, int]:
    """Samples and shards the index left out count as data problems of the run too: under
    `on_error=stop` they stop it before the first step, under `skip` they show in the metrics."""
    counts: dict[str, int] = {}
    for name, ix in indices.items():
        for kind, n in ix.problems.items():
            if on_error == "stop":
                example = ix.header.get("examples", {}).get(kind, "")
                raise DataError(
                    f"source {name} ({ix.folder}): its index left out {n} sample(s)/shard(s) with {kind}, "
                    f"e.g. {example}; fix the data and rerun `omni data index {ix.folder}`, or set data.on_error=skip",
                    kind=kind,
                )
            counts[f"index_{kind}"] = counts.get(f"index_{kind}", 0) + n
    return counts
