"""The Ray backend gives the inline backend's batches, resumes alike, reports errors alike.

One local Ray (2 CPUs) is started for the whole module. Starting actors is the slow part (a
process each, importing torch), so the tests that need the full demo mixture join one run,
"shared", which a module fixture keeps alive; only the over-budget check starts a (one-source)
run of its own.
"""
import copy
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")


from dataloading.config import DataConfig  # noqa: E402
from dataloading.errors import DataError  # noqa: E402
from dataloading.formats.tokenizer import ByteTokenizer  # noqa: E402
from dataloading.serve.loader import build_loader  # noqa: E402
from dataloading.serve.ray_actors import (ConstructorActor, PlannerActor, SourceLoaderActor, _Error,  # noqa: E402
                                          _RemoteReader)
from dataloading.serve.ray_backend import NAMESPACE, RayStepLoader, loader_counts  # noqa: E402
from step_asserts import assert_same_step, take  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # Actors unpickle this checkout's classes and the test processors (tests/data/conftest.py).
    path = os.pathsep.join([str(ROOT), *(p for p in sys.path if p)])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


SHARED = dict(run_id="shared", ranks_per_constructor=2)  # ranks 0 and 1 share one constructor actor


def inline(demo_dir, processors, rank=0, dp=2, budget=1024, mixture="mixture.yaml", **kw):
    data = DataConfig(mixture=str(demo_dir / mixture), global_batch_size=8, micro_batch_tokens=budget, num_workers=0,
                      **kw)
    return build_loader(data, ByteTokenizer(), processors, seed=7, dp_size=dp, dp_rank=rank, progress=False)


def on_ray(demo_dir, processors, rank=0, budget=1024, mixture="mixture.yaml", on_error="skip", **kw):
    """A RayStepLoader over a fresh planner and constructor (build_loader's, unstarted)."""
    base = inline(demo_dir, processors, rank, budget=budget, mixture=mixture, on_error=on_error)
    return RayStepLoader(base.planner, base.constructor, rank, prefetch=2, **kw)


@pytest.fixture(scope="module")
def shared_run(demo_dir, processors):
    """Keeps the "shared" run's actors up for the module; the last close releases them."""
    keeper = on_ray(demo_dir, processors, **SHARED)
    next(keeper)
    yield "shared"
    keeper.close()
    assert wait_released("shared") == []


@pytest.fixture(scope="module")
def one_source(demo_dir, tmp_path_factory):
    """A mixture of the demo's `tones` source alone (fewer actors to start)."""
    mixture = tmp_path_factory.mktemp("ray") / "tones_only.yaml"
    mixture.write_text(f"sources:\n  - name: tones\n    path: {demo_dir / 'tones'}\n    weight: 1\n")
    return mixture


def same(a, b):
    assert_same_step(a, b, media_fields=("features", "sizes", "num_tokens", "positions"), stats=True)


def run_actors(run):
    """Names of the live actors of a run (planner, source loaders, constructors)."""
    mine = (f"omni-planner-{run}", f"omni-loader-{run}-", f"omni-constructor-{run}-")
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and (a["name"] == mine[0] or a["name"].startswith(mine[1:])))


def wait_released(run, timeout=10.0):
    deadline = time.monotonic() + timeout
    while run_actors(run) and time.monotonic() < deadline:
        time.sleep(0.1)
    return run_actors(run)


def test_ray_and_inline_backends_give_identical_batches(demo_dir, processors, shared_run):
    for rank in (0, 1):
        ld = on_ray(demo_dir, processors, rank, **SHARED)
        got = take(ld, 4)
        expected = take(inline(demo_dir, processors, rank), 4)
        assert [b.step for b in got] == [0, 1, 2, 3]
        for a, b in zip(got, expected):
            same(a, b)
        assert all(b.data_wait_s >= 0 and b.num_target_tokens > 0 for b in got)
        assert ld.state_dict()["planner"]["step"] == 4 and ld.problems == {}
        ld.close()
    assert run_actors(shared_run)  # closing these two left the keeper's actors up


def test_resume_gives_the_uninterrupted_batches(demo_dir, processors, shared_run, monkeypatch):
    first = on_ray(demo_dir, processors, **SHARED)
    take(first, 2)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["planner"]["step"] == 2  # committed state, not how far the actors ran ahead
    expected = take(first, 2)
    first.close()

    monkeypatch.setenv("OMNI_RUN_ID", shared_run)  # build_loader's default run id: join the run
    data = DataConfig(mixture=str(demo_dir / "mixture.yaml"), global_batch_size=8, micro_batch_tokens=1024,
                      backend="ray")
    resumed = build_loader(data, ByteTokenizer(), processors, seed=7, dp_size=2, dp_rank=0, progress=False)
    assert isinstance(resumed, RayStepLoader)
    resumed.load_state_dict(state)
    got = take(resumed, 1)
    actor = resumed.planner_actor
    assert ray.get(actor.state_dict.remote())["step"] == 3  # the run's committed state
    assert ray.get(actor.plan.remote(3)).ranks == inline(demo_dir, processors).planner.plan(3).ranks
    got += take(resumed, 1)
    resumed.close()
    uninterrupted = take(inline(demo_dir, processors), 4)[2:]
    assert [b.step for b in got] == [2, 3]
    for a, b, c in zip(got, expected, uninterrupted):
        same(a, b)
        same(a, c)


def test_errors_in_actors_reach_the_caller_as_one_line(demo_dir, processors, one_source, shared_run):
    # From the planner actor (its plan): a sample over the token budget.
    over = on_ray(demo_dir, processors, mixture=one_source, budget=16, run_id="budget")
    with pytest.raises(DataError, match=r"needs \d+ tokens but data.micro_batch_tokens=16") as info:
        take(over, 2)
    assert info.value.kind == "over_budget" and "\n" not in str(info.value)
    assert over.planner_actor is None and wait_released("budget") == []  # actors released, not left running

    # From the planner actor (raised there): a rank joining the run with other data settings.
    odd = on_ray(demo_dir, processors, budget=512, **SHARED)
    with pytest.raises(DataError, match="another data configuration") as info:
        next(odd)
    assert info.value.kind == "config" and "\n" not in str(info.value)

    # From a constructor actor: every image fails to process, and on_error=stop. (Rank 1 with a
    # constructor actor of its own, "omni-constructor-shared-1"; the other tests never use it.)
    bad = on_ray(demo_dir, processors, 1, on_error="stop", run_id=shared_run, ranks_per_constructor=1)
    bad.constructor.processors["image"] = lambda raw: 1 / 0  # a decoder that fails on every image
    bad.constructor._source_processors.clear()
    with pytest.raises(DataError, match="the image processor failed .ZeroDivisionError") as info:
        take(bad, 3)
    assert info.value.kind == "media_error" and "\n" not in str(info.value)
    assert bad.planner_actor is None


def test_a_source_loader_error_reaches_the_constructor_as_that_sample_s_problem(demo_dir, processors):
    """The actors' code in this process (ray.put stands in for the calls): a shard that is gone."""
    base = inline(demo_dir, processors, on_error="stop")
    reader = base.constructor.readers["tones"]
    reader.locate = {k: ("gone.tar", reader.locate[k][1]) for k in reader.locate}
    here = SimpleNamespace(fetch=SimpleNamespace(remote=lambda keys: ray.put(SourceLoaderActor(reader).fetch(keys))))
    constructor = copy.copy(base.constructor)
    constructor.readers = {**constructor.readers, "tones": _RemoteReader("tones", [here])}
    planner = PlannerActor(base.planner)
    jobs = [planner.job(s, r) for s in range(4) for r in (0, 1)]
    assert any(u.startswith("tones/") for job in jobs for mb in job[1] for u in mb)
    out = [ConstructorActor(constructor).build(job) for job in jobs]
    errors = [o for o in out if isinstance(o, _Error)]
    assert errors and {e.kind for e in errors} == {"missing_shard"}
    assert "gone.tar: file not found" in errors[0].message and "\n" not in errors[0].message


def test_ranks_share_one_planner_actor_and_split_each_step(demo_dir, processors, shared_run):
    r0, r1 = on_ray(demo_dir, processors, 0, **SHARED), on_ray(demo_dir, processors, 1, **SHARED)
    steps = [(next(r0), next(r1)) for _ in range(3)]
    names = run_actors(shared_run)
    assert names.count(f"omni-planner-{shared_run}") == 1
    assert r0.planner_actor._actor_id == r1.planner_actor._actor_id
    assert r0._constructor_actor._actor_id == r1._constructor_actor._actor_id  # ranks_per_constructor=2
    layout = ray.get(r0.planner_actor.loader_layout.remote())
    assert layout.keys() == {"shapes", "tones", "text"}
    assert sum(n.startswith("omni-loader-") for n in names) == sum(layout.values())
    planner = inline(demo_dir, processors).planner  # the same plan, made here
    for a, b in steps:
        assert a.step == b.step
        plan = planner.plan(a.step)
        ids = [s for batch in (a, b) for mb in batch.micro_batches for s in mb.sample_ids]
        assert len(ids) == len(set(ids)) and sorted(ids) == sorted(plan.samples)
    r0.close()
    r1.close()


def test_loader_counts_follow_weight_times_cost_and_ray_is_optional(monkeypatch, demo_dir, processors):
    assert loader_counts({"img": 0.01, "txt": 0.0001}, {"img": 0.5, "txt": 0.5}, total=10) == {"img": 10, "txt": 1}
    assert loader_counts({"a": 0.0, "b": 0.0}, {"a": 1.0, "b": 0.0}, total=4) == {"a": 1, "b": 1}
    base = inline(demo_dir, processors)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(DataError, match=r"pip install 'omni-mm\[ray\]'") as info:
        RayStepLoader(base.planner, base.constructor, 0)
    assert info.value.kind == "config"


def test_omni_train_with_the_ray_backend_equals_inline(demo_root, tmp_path):
    """`data.backend=ray` is one config key: the same training losses as the inline backend."""
    from recipe_helpers import step_losses, tiny_overrides, train

    common = {"trainer.max_steps": 3, "data.global_batch_size": 4}
    train(tiny_overrides(demo_root, tmp_path / "inline", **common))
    train(tiny_overrides(demo_root, tmp_path / "ray", **common, **{"data.backend": "ray"}))
    a, b = step_losses(tmp_path / "inline"), step_losses(tmp_path / "ray")
    assert len(a) == 3 and a == b
