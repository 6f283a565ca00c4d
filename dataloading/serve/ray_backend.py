"""The Ray backend of the data plane: the inline backend's planner and constructors as Ray actors.

What runs where (MegaScale-Data's disaggregated layout):

- ``PlannerActor``: the one Planner of a run (central state, metadata only), shared by every
  training rank's ``RayStepLoader`` (a named actor, ``omni-planner-<run id>``). It plans each
  step once and hands each rank its share.
- ``SourceLoaderActor``: per source, one or more actors holding that source's ``SourceReader``
  (the open shards live once per source, not once per rank and worker); they return raw sample
  fields. How many per source follows the source's weight times its measured cost per sample.
- ``ConstructorActor``: one per group of ``ranks_per_constructor`` DP ranks: a SampleConstructor
  whose readers are the source loaders; it decodes, tokenizes and packs exactly as the inline
  backend's worker does (it runs the same ``BuildSteps`` code).

The actors are plain classes in ``dataloading.serve.ray_actors``; this module wraps them with
``ray.remote`` and holds the driver side. ``RayStepLoader`` has StepLoader's interface and semantics: it keeps ``prefetch`` steps in
flight as object refs, and each step carries the planner state after it, which becomes the
committed state when the step is handed out. The same plan yields the same batches on both
backends.

Ray is an optional extra: importing this module works without it; using it raises a one-line
config DataError.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
import uuid
from collections import deque
from pathlib import Path

from dataloading.errors import DataError
from dataloading.serve.committed import CommittedSteps
from dataloading.serve.ray_actors import (ConstructorActor, PlannerActor, SourceLoaderActor, _Error, _RemoteReader,
                                          loader_counts, require_ray)
from dataloading.serve.ray_local import LOOPBACK, check_bind, start_local_ray

__all__ = ["RayStepLoader", "PlannerActor", "SourceLoaderActor", "ConstructorActor", "loader_counts",
           "default_run_id", "NAMESPACE"]

NAMESPACE = "omni"  # Ray namespace of the data plane's named actors
_PROBE_SAMPLES = 4  # samples timed per source at start-up to scale its loaders


# ---- the loader -----------------------------------------------------------------------------
def default_run_id(ray) -> str:
    """What names a run's actors: $OMNI_RUN_ID, else torchrun's run id, else this Ray job's id
    (then every driver gets its own actors: still correct, just not shared)."""
    for var in ("OMNI_RUN_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(var, "")
        if value and value != "none":
            return value
    return ray.get_runtime_context().get_job_id()


class RayStepLoader(CommittedSteps):
    """StepLoader's interface on the Ray data plane (see the module docstring).

    ``address``: a Ray cluster to join; without it (and without a running Ray or $RAY_ADDRESS)
    a local Ray is started, listening on ``bind`` (default loopback only; see
    ``dataloading.serve.ray_local``). ``total_loaders``: source loader actors to spread over the sources
    (default: one per source). ``ranks_per_constructor``: DP ranks sharing a constructor actor.
    ``run_id``: names the shared actors; all ranks of one run must agree (default
    ``default_run_id``). Actors are created on the first ``next()``.
    """

    def __init__(self, planner, constructor, dp_rank: int, prefetch: int = 2, *, address: str | None = None,
                 total_loaders: int | None = None, ranks_per_constructor: int = 1, run_id: str | None = None,
                 bind: str = LOOPBACK):
        super().__init__(planner, constructor, dp_rank, prefetch)
        if prefetch < 1 or ranks_per_constructor < 1 or (total_loaders is not None and total_loaders < 1):
            raise DataError(f"data.prefetch={prefetch}, ranks_per_constructor={ranks_per_constructor} and "
                            f"total_loaders={total_loaders} must be >= 1", kind="config")
        require_ray()  # fail now, with the install hint, if Ray is missing
        self.bind = check_bind(bind)  # and now, naming data.ray_bind, if it is not an address
        self.address = address
        self.total_loaders = total_loaders
        self.ranks_per_constructor = ranks_per_constructor
        self.run_id = run_id
        self.planner_actor = None  # the run's PlannerActor handle, once set up
        self._constructor_actor = None
        self._user = uuid.uuid4().hex
        self._origin: str | None = None
        self._next_step = 0
        self._inflight: deque = deque()  # (step, ref)
        self._loaded: dict | None = None  # a state loaded before the actors were set up
        self._first_loaders: dict = {}

    # ---- setting up -----------------------------------------------------------------------
    def _connect(self):
        ray = require_ray()
        if not ray.is_initialized():
            # Actors unpickle what this process imports (dataloading, the encoders' processors,
            # the tokenizer): give them this process's import path (harmless where omni-mm is
            # installed on the nodes).
            root = str(Path(__file__).resolve().parents[2])  # the repository root, above dataloading/
            env = {"env_vars": {"PYTHONPATH": os.pathsep.join([root, *(p or os.getcwd() for p in sys.path)])}}
            address = self.address or os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, log_to_driver=False, runtime_env=env)
            else:
                # "local": a new instance even where `ray start` left a cluster address behind; it
                # listens on self.bind (loopback unless data.ray_bind opens it)
                start_local_ray(ray, self.bind, num_cpus=2, include_dashboard=False, log_to_driver=False,
                                runtime_env=env)
        return ray

    def _actor(self, ray, cls, name: str, *args, **kwargs):
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            # Detached: the run's actors must outlive the loader (or driver) that happened to create
            # them; the last loader of the run to close kills them (a Ray started here ends with
            # this process anyway).
            return ray.remote(cls).options(name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
                                           num_cpus=0).remote(*args, **kwargs)

    def _loader(self, ray, run: str, source: str, i: int):
        return self._actor(ray, SourceLoaderActor, f"omni-loader-{run}-{source}-{i}", self.constructor.readers[source],
                           probe=_PROBE_SAMPLES if i == 0 else 0)

    def _fingerprint(self) -> str:
        p = self.planner
        return json.dumps({"seed": p.seed, "global_batch_size": p.global_batch_size, "dp_size": p.dp_size,
                           **dataclasses.asdict(p.packing), "sources": {n: len(t) for n, t in p.tables.items()},
                           "micro_batch_tokens": self.constructor.micro_batch_tokens}, sort_keys=True)

    def _setup(self) -> None:
        ray = self._connect()
        run = self.run_id or default_run_id(ray)
        pa = self._actor(ray, PlannerActor, f"omni-planner-{run}", self.planner)
        # Each source's first loader (which times the source) starts while the planner does.
        self._first_loaders = {n: self._loader(ray, run, n, 0) for n in self.constructor.readers}
        _get(ray, pa.attach.remote(self._user, self._fingerprint()))
        self.planner_actor = pa  # from here on close() detaches
        if self._loaded is not None:  # resumed: that is the run's committed state now
            pa.load_state_dict.remote(self._loaded)
            self._loaded = None
        try:
            self._start_workers(ray, run)
        except BaseException:
            self.close()
            raise

    def _start_workers(self, ray, run: str) -> None:
        pa = self.planner_actor
        readers = self.constructor.readers
        first, self._first_loaders = self._first_loaders, {}
        _get(ray, pa.adopt.remote(list(first.values())))
        layout = _get(ray, pa.loader_layout.remote())
        if layout is None:
            costs = dict(zip(first, _get(ray, [a.cost.remote() for a in first.values()])))
            p = self.planner.probabilities(self.planner.step)
            weights = dict(zip(self.planner.names, p.tolist()))
            proposal = loader_counts(costs, weights, self.total_loaders or len(readers))
            layout = _get(ray, pa.loader_layout.remote(proposal))
        loaders = {n: [first[n], *(self._loader(ray, run, n, i) for i in range(1, layout.get(n, 1)))]
                   for n in readers}
        remote = copy.copy(self.constructor)
        remote.readers = {n: _RemoteReader(n, hs) for n, hs in loaders.items()}
        group = self.dp_rank // self.ranks_per_constructor
        self._constructor_actor = self._actor(ray, ConstructorActor, f"omni-constructor-{run}-{group}", remote)
        _get(ray, pa.adopt.remote([self._constructor_actor, *(h for hs in loaders.values() for h in hs)]))

    # ---- producing ------------------------------------------------------------------------
    def _fill(self, ray) -> None:
        if self._origin is None:
            self._origin = _get(ray, self.planner_actor.open.remote(self.planner.state_dict(),
                                                                    dict(self.planner.weights)))
            self._next_step = self.planner.step
        while len(self._inflight) < self.prefetch:
            job = self.planner_actor.job.remote(self._next_step, self.dp_rank, self._origin)
            self._inflight.append((self._next_step, self._constructor_actor.build.remote(job)))
            self._next_step += 1

    def _drop_ahead(self) -> None:
        """Forget the built-ahead steps (the committed state does not include them). They are
        not cancelled: a cancelled actor task leaves a gap in the caller's task order that
        stalls the actor's later tasks; they finish and are dropped."""
        self._inflight = deque()
        self._origin = None

    # ---- consuming ------------------------------------------------------------------------
    def __iter__(self) -> "RayStepLoader":
        return self

    def __next__(self):
        if self.planner_actor is None:
            self._setup()
        ray = require_ray()
        self._fill(ray)
        t0 = time.perf_counter()
        _, ref = self._inflight.popleft()
        self._fill(ray)  # keep `prefetch` steps in flight while waiting for this one
        try:
            item = ray.get(ref)
        except Exception as e:
            err = _data_error(ray, e)
            self.close()
            if err is None:
                raise
            raise err from None
        wait = time.perf_counter() - t0
        if isinstance(item, _Error):
            self.close()
            raise item.error()
        batch = self._hand_out(item, wait)
        self.planner_actor.commit.remote(item[1])  # the run's committed state, for every rank
        return batch

    def close(self) -> None:
        """Drop the built-ahead steps and release this loader's hold on the run's actors (the
        last loader of the run kills them). A Ray this loader started stays up until exit;
        iterating again sets the actors up anew."""
        self._drop_ahead()
        pa = self.planner_actor
        self.planner_actor, self._constructor_actor = None, None
        if pa is None:
            return
        ray = require_ray()
        if not ray.is_initialized():
            return
        try:
            release = ray.get(pa.detach.remote(self._user))
        except Exception:
            return  # the planner actor is gone already
        if release is not None:
            for handle in [*release, pa]:
                try:
                    ray.kill(handle)
                except Exception:
                    pass

    def set_weights(self, weights) -> None:
        super().set_weights(weights)
        if self.planner_actor is not None:
            self.planner_actor.set_weights.remote(weights)

    # ---- checkpointing --------------------------------------------------------------------
    def load_state_dict(self, sd) -> None:
        super().load_state_dict(sd)
        if self.planner_actor is not None:
            self.planner_actor.load_state_dict.remote(sd["planner"])
        else:
            self._loaded = sd["planner"]


def _get(ray, refs):
    """ray.get, with a DataError raised in an actor coming back as that one-line DataError."""
    try:
        return ray.get(refs)
    except Exception as e:
        err = _data_error(ray, e)
        if err is None:
            raise
        raise err from None


def _data_error(ray, err: BaseException) -> DataError | None:
    """A failure in an actor as the one-line DataError it is (None: a bug, re-raise as is)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, DataError):
        return DataError(str(cause), kind=cause.kind)
    if isinstance(err, DataError) and not isinstance(err, ray.exceptions.RayError):
        return err
    died = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError)
    if isinstance(cause, died):
        err = cause
    if isinstance(err, died):
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "error_message" in ln or "dead because" in ln),
                   lines[-1] if lines else "")
        if "ModuleNotFoundError" in why or "ImportError" in why:
            return DataError(f"a data actor could not start ({why}); install omni-mm and the encoders' packages on "
                             f"the Ray cluster's nodes, or start the cluster from this environment", kind="config")
        return DataError(f"a data actor died ({type(err).__name__}: {why}); check the sample's media (a decoder "
                         f"crash or out-of-memory), or run with data.backend=inline data.num_workers=0 to see the "
                         f"error in-process", kind="worker_died")
    return None
