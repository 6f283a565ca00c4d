"""The Ray data plane's actors, as plain classes (``ray_backend`` wraps them with ``ray.remote``;
the tests also run them in-process). Importing this module needs no Ray.

- ``PlannerActor``: the run's one Planner; plans each step once, for every rank.
- ``SourceLoaderActor``: one source's SourceReader; serves raw sample fields by key.
- ``ConstructorActor``: a SampleConstructor whose readers are source loaders; builds a rank's
  step with the inline worker's code.
"""
from __future__ import annotations

import hashlib
import json
import time
import zlib
from collections import OrderedDict

from dataloading.errors import DataError

_CACHE_STEPS = 64  # plans kept per planner actor (ranks are at most a few steps apart)
_MAX_ORIGINS = 16


def require_ray():
    """The ray module, or a one-line config DataError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise DataError("data.backend=ray needs Ray, which is not installed: pip install 'omni-mm[ray]' "
                        "(or use data.backend=inline)", kind="config") from None
    return ray


class _Error:
    """A DataError met in an actor, carried back whole (Ray would wrap a raised one in a
    multi-line RayTaskError)."""

    def __init__(self, message: str, kind: str):
        self.message, self.kind = message, kind

    @classmethod
    def of(cls, err: DataError) -> "_Error":
        return cls(str(err), err.kind)

    def error(self) -> DataError:
        return DataError(self.message, kind=self.kind)


# ---- the planner --------------------------------------------------------------------------
class PlannerActor:
    """Holds the run's Planner. Plans are cached per (origin, step) in a bounded LRU.

    An *origin* is a (planner state, weights) pair a loader starts planning from (after it was
    built, resumed or re-weighted); ``plan(step, origin)`` is a pure function of it, so ranks
    that start from the same state share plans, and one rank resuming or re-weighting never
    changes what another rank gets. ``load_state_dict`` / ``set_weights`` act on the default
    origin (the actor's own planner); ``state_dict()`` is the committed state: the state after
    the latest step a loader handed out to its trainer.
    """

    def __init__(self, planner, cache_steps: int = _CACHE_STEPS):
        self.planner = planner
        self._default = [planner, None]  # the default origin: load_state_dict / set_weights act on it
        self.committed = planner.state_dict()
        self.cache_steps = int(cache_steps)
        self._origins: OrderedDict[str, list] = OrderedDict()
        self._cache: OrderedDict[tuple[str, int], tuple] = OrderedDict()  # -> (StepPlan | None, state after)
        self._users: set[str] = set()
        self._fingerprint: str | None = None
        self._actors: dict[str, object] = {}  # the run's other actors, by actor id
        self._layout: dict[str, int] | None = None

    # ---- origins and plans -------------------------------------------------------------
    def open(self, state: dict, weights: dict) -> str:
        """Register the state and weights a loader plans from; returns the origin's id."""
        key = hashlib.sha1(json.dumps([state, sorted((n, repr(w)) for n, w in weights.items())],
                                      sort_keys=True).encode()).hexdigest()[:16]
        if key in self._origins:
            self._origins.move_to_end(key)
            return key
        base = self.planner.clone()
        base.set_weights(weights)
        base.load_state_dict(state)
        self._origins[key] = [base, None]
        while len(self._origins) > _MAX_ORIGINS:
            self._origins.popitem(last=False)
        return key

    def _origin(self, origin: str | None) -> list:
        """[planner at the origin, frontier: a clone at the next step not planned yet (or None)]."""
        if origin is None:
            return self._default
        try:
            return self._origins[origin]
        except KeyError:
            raise DataError(f"planner actor: origin {origin} was evicted (more than {_MAX_ORIGINS} loaders "
                            "restarted at once); restart the loader", kind="config") from None

    def _entry(self, step: int, origin: str | None) -> tuple:
        record = self._origin(origin)
        base, frontier = record
        if step < base.step:
            raise DataError(f"planner is at step {base.step}, cannot plan the past step {step}; load the state "
                            f"saved at that step instead", kind="config")
        hit = self._cache.get((origin, step))
        if hit is not None and hit[0] is not None:
            self._cache.move_to_end((origin, step))
            return hit
        if frontier is not None and frontier.step <= step:
            work = frontier  # the usual case: the next step (keeps the planner's permutation cache warm)
        else:  # an evicted or skipped step: simulate from the latest state known before it
            work = base.clone()
            for s in range(step - 1, base.step - 1, -1):
                known = self._cache.get((origin, s))
                if known is not None:
                    work.load_state_dict(known[1])
                    break
        while work.step < step:
            work.advance()
            self._put((origin, work.step - 1), (None, work.state_dict()))
        plan = work.plan()
        work.advance()
        entry = (plan, work.state_dict())
        self._put((origin, step), entry)
        if frontier is None or work.step > frontier.step:
            record[1] = work
        return entry

    def _put(self, key: tuple, entry: tuple) -> None:
        if key in self._cache and entry[0] is None:
            return  # never replace a plan by a bare state
        self._cache[key] = entry
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_steps:
            self._cache.popitem(last=False)

    def plan(self, step: int, origin: str | None = None):
        """The StepPlan of ``step`` (all ranks)."""
        return self._entry(int(step), origin)[0]

    def job(self, step: int, rank: int, origin: str | None = None):
        """What one rank's constructor needs: the inline loader's job tuple
        (step, micro-batches, skipped, plan stats, planner state after the step), or an _Error."""
        try:
            plan, state = self._entry(int(step), origin)
        except DataError as e:
            return _Error.of(e)
        from dataloading.construct.step_jobs import step_job

        return step_job(plan, rank, state)

    # ---- central state -----------------------------------------------------------------
    def commit(self, state: dict) -> None:
        """A loader handed out the step before ``state``."""
        if int(state["step"]) >= int(self.committed["step"]):
            self.committed = state

    def state_dict(self) -> dict:
        return dict(self.committed)

    def load_state_dict(self, sd: dict) -> None:
        self.planner.load_state_dict(sd)
        self.committed = self.planner.state_dict()
        self._forget(None)

    def set_weights(self, weights) -> None:
        self.planner.set_weights(weights)
        self._forget(None)

    def _forget(self, origin) -> None:
        self._origin(origin)[1] = None
        for key in [k for k in self._cache if k[0] == origin]:
            del self._cache[key]

    # ---- bookkeeping for the loaders -----------------------------------------------------
    def loader_layout(self, counts: dict[str, int] | None = None) -> dict[str, int] | None:
        """Source loaders per source: the first proposal wins, so every rank routes alike."""
        if self._layout is None and counts is not None:
            self._layout = dict(counts)
        return self._layout

    def attach(self, user: str, fingerprint: str) -> None:
        """A loader joins the run; its data configuration must be the run's."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint
        elif fingerprint != self._fingerprint:
            raise DataError(f"this run's data actors were started with another data configuration ({self._fingerprint}"
                            f", here {fingerprint}); give every rank the same data settings, or give this run its "
                            f"own OMNI_RUN_ID (stale actors of an old run: ray.kill them or restart the cluster)",
                            kind="config")
        self._users.add(user)

    def adopt(self, actors: list) -> None:
        """Source loaders and constructors of the run, released with it."""
        for handle in actors:
            self._actors[handle._actor_id.hex()] = handle

    def detach(self, user: str) -> list | None:
        """A loader leaves; the last one gets the run's other actors to kill (else None)."""
        self._users.discard(user)
        return None if self._users else list(self._actors.values())


# ---- source loaders -----------------------------------------------------------------------
class SourceLoaderActor:
    """One source's SourceReader (its open shards); serves raw sample fields by key."""

    def __init__(self, reader, probe: int = 0):
        self.reader = reader
        self.seconds_per_sample = self._measure(probe) if probe else None

    def _measure(self, n: int) -> float:
        """Seconds per sample of fetch + decode over the source's first ``n`` samples (after
        one untimed fetch that opens the shard). Deliberately simple: a start-up estimate of
        the source's relative preprocessing cost, not a profile."""
        from itertools import islice

        from dataloading.formats.sample import decode_sample

        keys = list(islice(iter(self.reader.locate), n + 1))
        if not keys:
            return 0.0
        try:
            self.reader.get(keys[0])
        except DataError:
            pass
        t0, done = time.perf_counter(), 0
        for key in keys[1:] or keys:
            try:
                decode_sample(f"{self.reader.name}/{key}", self.reader.get(key))
                done += 1
            except DataError:
                pass  # a bad sample is the constructor's to report
        return (time.perf_counter() - t0) / max(1, done)

    def cost(self) -> float | None:
        return self.seconds_per_sample

    def fetch(self, keys: list[str]) -> list:
        """Raw fields of each key (``{field: bytes}``), or an _Error for a key that failed."""
        out = []
        for key in keys:
            try:
                out.append(self.reader.get(key))
            except DataError as e:
                out.append(_Error.of(e))
        return out


def loader_counts(costs: dict[str, float], weights: dict[str, float], total: int) -> dict[str, int]:
    """Loaders per source: max(1, round(total x weight x seconds_per_sample / sum of the same))."""
    load = {n: max(0.0, float(weights.get(n, 0.0))) * max(0.0, float(c or 0.0)) for n, c in costs.items()}
    whole = sum(load.values())
    if whole <= 0:
        return {n: 1 for n in costs}
    return {n: max(1, round(total * x / whole)) for n, x in load.items()}


class _RemoteReader:
    """Stands in for a SourceReader inside a ConstructorActor: ``get(key)`` returns the raw
    fields from the source's loader actors (a key always goes to the same one)."""

    def __init__(self, name: str, loaders: list):
        self.name = name
        self.loaders = list(loaders)
        self._got: dict[str, object] = {}

    def _route(self, key: str) -> int:
        return zlib.crc32(key.encode()) % len(self.loaders)

    def prefetch(self, keys) -> None:
        """Fetch many keys at once: one call per loader actor, all in flight together."""
        ray = require_ray()
        by_loader: dict[int, list[str]] = {}
        for key in dict.fromkeys(keys):
            if key not in self._got:
                by_loader.setdefault(self._route(key), []).append(key)
        calls = [(ks, self.loaders[i].fetch.remote(ks)) for i, ks in by_loader.items()]
        for ks, ref in calls:
            self._got.update(zip(ks, ray.get(ref)))

    def get(self, key: str) -> dict[str, bytes]:
        if key not in self._got:
            self.prefetch([key])
        fields = self._got[key]
        if isinstance(fields, _Error):
            raise fields.error()
        return fields

    def clear(self) -> None:
        self._got.clear()


# ---- constructors -------------------------------------------------------------------------
class ConstructorActor:
    """A SampleConstructor (readers = source loaders) building steps for a group of DP ranks."""

    def __init__(self, constructor):
        self.constructor = constructor

    def build(self, job):
        """The inline worker's step: ``(StepBatch, planner state after it)``, or an _Error."""
        if isinstance(job, _Error):
            return job
        from dataloading.construct.step_jobs import BuildSteps, FailedStep
        from dataloading.plan.pieces import split_piece

        readers = self.constructor.readers
        wanted: dict[str, list[str]] = {}
        for mb in job[1]:
            for uid in mb:
                source, _, key = split_piece(uid)[0].partition("/")
                wanted.setdefault(source, []).append(key)
        try:
            for source, keys in wanted.items():
                if isinstance(readers.get(source), _RemoteReader):
                    readers[source].prefetch(keys)
            out = BuildSteps(self.constructor, None)[job]
        finally:
            for r in readers.values():
                if isinstance(r, _RemoteReader):
                    r.clear()
        return _Error(out.message, out.kind) if isinstance(out, FailedStep) else out
