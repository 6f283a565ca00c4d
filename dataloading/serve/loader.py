"""StepLoader: the per-DP-rank iterator of StepBatches, with exact (and elastic) resume.

The planner runs here, in the training process (it is cheap: metadata only); the constructors
(fetch, decode, tokenize, pack) run in ``torch.utils.data.DataLoader`` worker processes that
build the next ``prefetch`` steps per worker while the trainer computes. Each step travels
with the planner state after it; when the step is handed out, that state becomes the committed
one. So ``state_dict()`` after step s resumes exactly at step s+1, however far the workers had
run ahead (Megatron-Energon's rule: save keys and cursors, never buffered tensors).

``num_workers=0`` builds each step synchronously in the calling thread (handy for debugging).
"""
from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch.utils.data as tud

from dataloading.config import DataConfig
from dataloading.construct.batch import StepBatch
from dataloading.construct.constructor import SampleConstructor
from dataloading.construct.step_jobs import SLOT_BYTES as _SLOT_BYTES, BuildSteps, FailedStep, step_job
from dataloading.errors import DataError, ProblemCounter
from dataloading.formats.media import MediaProcessor
from dataloading.formats.tokenizer import Tokenizer
from dataloading.index.source_index import SourceIndex
from dataloading.plan.planner import Planner
from dataloading.processes import worker_context
from dataloading.serve.committed import CommittedSteps
from dataloading.serve.ray_local import check_bind

BACKENDS = ("inline", "ray")


def _identity(x):
    return x


class _StepJobs:
    """The sampler: plans steps ahead on a clone of the planner, one job per step."""

    def __init__(self, planner: Planner, dp_rank: int):
        self.planner = planner
        self.dp_rank = dp_rank

    def __iter__(self) -> Iterator[tuple]:
        work = self.planner.clone()
        while True:
            plan = work.plan()
            work.advance()
            yield step_job(plan, self.dp_rank, work.state_dict())


class StepLoader(CommittedSteps):
    def __init__(self, planner: Planner, constructor: SampleConstructor, dp_rank: int, prefetch: int = 2,
                 num_workers: int = 1, worker_timeout_s: float = 600.0):
        super().__init__(planner, constructor, dp_rank, prefetch)
        if num_workers < 0 or prefetch < 1:
            raise DataError(f"data.num_workers={num_workers} must be >= 0 and data.prefetch={prefetch} >= 1",
                            kind="config")
        self.num_workers = num_workers
        # A worker stuck (a hung network mount, a decoder in an endless loop) must not hang the
        # run: past this many seconds for one step the run stops naming the sample it is on.
        self.worker_timeout_s = worker_timeout_s
        self._iter = None
        self._slots = None

    # ---- producing ------------------------------------------------------------------
    def _start(self) -> None:
        ctx = worker_context()
        self._slots = ctx.Array(ctypes.c_char, _SLOT_BYTES * max(1, self.num_workers), lock=False)
        loader = tud.DataLoader(
            BuildSteps(self.constructor, self._slots), sampler=_StepJobs(self.planner, self.dp_rank),
            batch_size=None, collate_fn=_identity, num_workers=self.num_workers,
            prefetch_factor=self.prefetch if self.num_workers else None,
            multiprocessing_context=ctx if self.num_workers else None,
            timeout=self.worker_timeout_s if self.num_workers else 0,
            persistent_workers=False)
        self._iter = iter(loader)

    def _workers_doing(self, err: BaseException, verb: str, others: str = "was on") -> str:
        """What each worker was doing, from its slot; the one named in ``err`` first."""
        raw = bytes(self._slots) if self._slots is not None else b""
        doing = []
        for w in range(self.num_workers):
            text = raw[w * _SLOT_BYTES:(w + 1) * _SLOT_BYTES].split(b"\0", 1)[0].decode(errors="replace")
            if text:
                pid, step, unit = text.split(" ", 2)
                if pid in str(err):
                    doing.insert(0, f"worker pid {pid} {verb} sample {unit} (step {step})")
                else:
                    doing.append(f"worker pid {pid} {others} sample {unit} (step {step})")
        return "; ".join(doing) or "no sample had been started"

    # ---- consuming ------------------------------------------------------------------
    def __iter__(self) -> "StepLoader":
        return self

    def __next__(self) -> StepBatch:
        if self._iter is None:
            self._start()
        t0 = time.perf_counter()
        try:
            item = next(self._iter)
        except DataError:
            self.close()
            raise
        except RuntimeError as e:
            msg = str(e)
            if "worker" in msg and "exited unexpectedly" in msg:
                err = DataError(f"a data worker died: {self._workers_doing(e, 'died on')} ({msg}); check that "
                                "sample's media (a decoder crash or out-of-memory), or run with data.num_workers=0 "
                                "to see the error in-process", kind="worker_died")
            elif "timed out" in msg:
                err = DataError(f"no step from the data workers in {self.worker_timeout_s:g} s: "
                                f"{self._workers_doing(e, 'is on', 'is on')}; check the storage the shards live on, or raise "
                                "data.worker_timeout_s if steps are that slow to build", kind="worker_timeout")
            else:
                self.close()
                raise
            self.close()
            raise err from None
        wait = time.perf_counter() - t0
        if isinstance(item, FailedStep):
            self.close()
            raise DataError(item.message, kind=item.kind)
        return self._hand_out(item, wait)

    def close(self) -> None:
        """Stop the workers; built-ahead steps are dropped (the state does not include them)."""
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def _drop_ahead(self) -> None:
        self.close()  # the workers hold the built-ahead steps


def build_planner(data: DataConfig, tokenizer: Tokenizer, processors: Mapping[str, MediaProcessor], *, seed: int,
                  dp_size: int, cost_model=None, micro_batch_multiple: int = 1, build_missing_index: bool = False,
                  progress: bool = True) -> tuple[Planner, dict]:
    """``data.mixture`` -> indices -> Planner (and the indices, for constructors: their key locators
    and headers; the per-sample objects are freed once the planner's tables are made).

    ``data``: the run's data config, its mixture a file (the demo's path where the config names
    none; ``recipes/data_plane.py`` resolves it); the planner reads its global batch, packing
    budget, balancing and over-budget policy. The arguments are what the config does not say:
    the seed, this run's data-parallel size, the cost model (None: ``CostModel()``), the
    pipeline's micro-batch multiple."""
    from dataloading.index.source_index import load_index
    from dataloading.plan.cost import CostModel
    from dataloading.plan.mixture import load_mixture
    from dataloading.plan.packing import Packing
    from dataloading.plan.planner import SourceTable

    if data.mixture is None:
        raise DataError("data.mixture is not set; give the mixture file (the demo's when running the demo)",
                        kind="config")
    mix = load_mixture(data.mixture)
    cost_model = cost_model or CostModel()
    indices, tables = {}, {}
    for s in mix.sources:  # one at a time: only one source's per-sample objects live at once
        ix = load_index(s.path, build_if_missing=build_missing_index, progress=progress)
        tables[s.name] = SourceTable(s.name, ix, tokenizer, processors, cost_model, s.options, progress=progress)
        ix.release_samples()
        indices[s.name] = ix
    weights = {s.name: s.weight for s in mix.sources}
    planner = Planner(tables, weights, seed, data.global_batch_size, dp_size, tokenizer=tokenizer,
                      processors=processors, cost_model=cost_model, options={s.name: s.options for s in mix.sources},
                      packing=Packing.of(data, micro_batch_multiple))
    return planner, indices


def build_loader(data: DataConfig, tokenizer: Tokenizer, processors: Mapping[str, MediaProcessor], *, seed: int,
                 dp_size: int, dp_rank: int, cost_model=None, micro_batch_multiple: int = 1,
                 build_missing_index: bool = False, progress: bool = True) -> StepLoader:
    """``data.mixture`` -> indices -> Planner + SampleConstructor -> a loader for one DP rank.

    ``data``: the run's data config, as ``build_planner`` takes it; the loader also reads its
    workers, prefetch, shard cap, bad-sample policy and backend. ``data.backend="inline"``:
    planner here, constructors in DataLoader workers (StepLoader). ``"ray"``: the same planner
    and constructors as Ray actors (RayStepLoader); the same plan yields the same batches.
    """
    if data.backend not in BACKENDS:
        raise DataError(f"data.backend={data.backend!r} is not a backend; use one of {list(BACKENDS)}", kind="config")
    if data.backend == "ray":
        check_bind(data.ray_bind)  # before the indices are read
    planner, indices = build_planner(data, tokenizer, processors, seed=seed, dp_size=dp_size, cost_model=cost_model,
                                     micro_batch_multiple=micro_batch_multiple,
                                     build_missing_index=build_missing_index, progress=progress)
    constructor = SampleConstructor({n: ix.reader(n) for n, ix in indices.items()}, tokenizer, processors,
                                    data.micro_batch_tokens, ProblemCounter(data.on_error, data.max_skip_fraction),
                                    options={n: t.options for n, t in planner.tables.items()},
                                    over_budget=data.over_budget, max_open_shards=data.max_open_shards)
    index_problems = _index_problems(indices, data.on_error)
    if data.backend == "ray":
        from dataloading.serve.ray_backend import RayStepLoader

        loader = RayStepLoader(planner, constructor, dp_rank, data.prefetch, address=data.ray_address,
                               bind=data.ray_bind)
    else:
        loader = StepLoader(planner, constructor, dp_rank, data.prefetch, data.num_workers, data.worker_timeout_s)
    loader.problems.update(index_problems)
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


def skipped_summary(per_rank: Sequence[Mapping[str, int]], metrics: str | Path) -> str | None:
    """The end-of-run line on the problems ``data.on_error=skip`` let through (None: there were
    none). ``per_rank``: each data-parallel rank's loader totals (``StepLoader.problems``). A
    rank counts the samples it met; the index's (``index_<kind>``) every rank counts alike, once."""
    totals: dict[str, int] = {}
    for problems in per_rank:
        for kind, n in problems.items():
            totals[kind] = max(totals.get(kind, 0), n) if kind.startswith("index_") else totals.get(kind, 0) + n
    totals = {k: n for k, n in totals.items() if n}
    if not totals:
        return None
    kinds = ", ".join(f"{k}={n}" for k, n in sorted(totals.items()))
    where = [f"counts by step in {metrics} (data_problems)"]
    if any(not k.startswith("index_") for k in totals):
        where.append("the first few of each kind logged above")
    if any(k.startswith("index_") for k in totals):
        where.append("examples of the index_ kinds in each source's omni_index.jsonl header")
    return f"omni: {sum(totals.values())} bad sample(s) skipped (data.on_error=skip): {kinds}; {', '.join(where)}"
