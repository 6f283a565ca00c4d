"""What a step does beside its device work, and when: the next step's host work done while the
device still runs this one, the timeline only on the steps it reports, the replicated
gradients summed in few collectives, and the end-of-run evaluation of a split layout on every
rank's device. Each test fails on the code before its fix (the docstrings say how).
"""
from __future__ import annotations

import pickle
import tempfile

import pytest
import torch

from dataloading.construct.batch import StepBatch
from tests.parallel.dist_helpers import run_ranks
from tests.parallel.layout_harness import OPTIM, build, global_batches


class _Loader:
    """Fixed steps with a position for checkpoints, as a StepLoader has."""

    def __init__(self, steps):
        self.steps, self.next = steps, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.steps[self.next]
        self.next += 1
        return batch

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, sd):
        self.next = sd["next"]

    def close(self):
        pass


def _trainer(steps: int, media: tuple = (), every: int = 0, timeline_every: int = 10, **trainer):
    import torch.distributed as dist  # noqa: F401

    from omni.runtime.config import CheckpointConfig, TrainerConfig
    from omni.step.config import MultiplexConfig
    from omni.runtime.parallelize import parallelize
    from omni.runtime.trainer import Trainer
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    layout = init_layout(ParallelConfig(), device="cpu")
    pm = parallelize(build(False, 2, media), layout, MultiplexConfig(timeline_every=timeline_every))
    batches = [StepBatch(step=s + 1, micro_batches=mbs) for s, mbs in
               enumerate(global_batches(96, media, steps=steps, micro=2))]
    cfg = TrainerConfig(max_steps=steps, run_dir=tempfile.mkdtemp(prefix="omni-overlap-"), progress=False,
                        eval_at_end=False, **trainer)
    return Trainer(pm, _Loader(batches), layout, cfg, OPTIM, CheckpointConfig(every=every, save_at_end=False))


@pytest.fixture
def single_process():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_next_steps_host_work_runs_before_this_steps_read(single_process):
    """Host preparation of step N+1 (its counts, padding, multiplexing plan and copies)
    overlapped nothing: it ran after step N's read and optimizer. fit now builds it while the
    device still runs step N (before its read), and the losses are those of steps built one at
    a time; a checkpoint of step N records the loader as after step N."""
    trainer = _trainer(4, media=("image",), every=2)
    events = []
    host_inputs, optim_step, save = trainer.steps.host_inputs, trainer.optim.step, trainer.checkpointer.save

    def inputs(batch):
        events.append(("inputs", batch.step))
        return host_inputs(batch)

    def stepped():
        events.append(("optimizer", len([e for e in events if e[0] == "optimizer"]) + 1))
        optim_step()

    def saved(step, optim, loader_state, guard):
        events.append(("save", step, loader_state["next"]))

    trainer.steps.host_inputs, trainer.optim.step, trainer.checkpointer.save = inputs, stepped, saved
    losses = trainer.fit().losses
    assert events == [("inputs", 1), ("inputs", 2), ("optimizer", 1), ("inputs", 3), ("optimizer", 2),
                      ("save", 2, 2), ("inputs", 4), ("optimizer", 3), ("optimizer", 4), ("save", 4, 4)]
    import torch.distributed as dist

    dist.destroy_process_group()
    one_at_a_time = _trainer(4, media=("image",))
    alone = [one_at_a_time.train_step(next(one_at_a_time.loader), step=s)["loss"] for s in range(1, 5)]
    assert losses == alone


def test_the_timeline_is_gathered_only_on_the_steps_it_reports(single_process, monkeypatch):
    """The timeline (on by default) gathered every rank's pickled times world-wide every step
    (and on a GPU waited for the step's events). Now only every multiplex.timeline_every-th
    step and the trace step are timed."""
    import omni.runtime.trainer as trainer_module

    gathered = []
    real = trainer_module.gather_step_times

    def counting(local, group=None, keep_events=True):
        gathered.append(local.step)
        return real(local, group, keep_events)

    monkeypatch.setattr(trainer_module, "gather_step_times", counting)
    trainer = _trainer(7, media=("image",), timeline_every=3)
    trainer.trace_step = 5
    trainer.fit()
    assert gathered == [3, 5, 6]
    assert trainer.pm.timeline.every == 3


def _coalesced(rank, world, out_dir):
    from omni.step.config import MultiplexConfig
    from omni.runtime.parallelize import parallelize
    from parallel.config import ParallelConfig
    from parallel.data_parallel import all_reduce_coalesced
    from parallel.layout import init_layout
    import torch.distributed as dist

    # the mechanism: 40 tensors of two dtypes in 2 collectives, sums exact
    ts = [torch.full((i + 1,), float(rank + i), dtype=torch.float32 if i % 2 else torch.float64) for i in range(40)]
    calls = all_reduce_coalesced(ts, None)
    ok = calls == 40 and all(torch.equal(t, torch.full_like(t, float(2 * i + 1))) for i, t in enumerate(ts))
    ordered = sorted(range(40), key=lambda i: i % 2)  # dtypes grouped: one bucket each
    ts = [torch.full((i + 1,), float(rank), dtype=torch.float32 if i % 2 else torch.float64) for i in ordered]
    ok = ok and all_reduce_coalesced(ts, None) == 2 and all(float(t[0]) == 1.0 for t in ts)
    # the runtime: replicated encoders' gradients (dozens of tensors) in one collective
    layout = init_layout(ParallelConfig(dp_shard=2), device="cpu")
    pm = parallelize(build(False, 2, ("image", "audio")), layout, MultiplexConfig(encoder_weights="replicated"))
    for p in pm.parameters():
        p.grad = torch.ones_like(p)
    real, count = dist.all_reduce, [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        pm.sync_gradients()
    finally:
        dist.all_reduce = real
    n_encoder = sum(1 for p in pm.media.parameters() if p.requires_grad)
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump((ok, count[0], n_encoder, float(next(pm.media.parameters()).grad.flatten()[0])), f)


def test_replicated_gradients_are_summed_in_few_collectives(tmp_path):
    """Replicated encoder weights and tied-embedding copies had one all-reduce per tensor
    (hundreds of small NCCL calls at a real tower's size); now one per dtype and 64 MiB bucket."""
    run_ranks(_coalesced, 2, str(tmp_path), timeout_s=120)
    for rank in range(2):
        ok, calls, n_encoder, value = pickle.load(open(tmp_path / f"rank{rank}.pkl", "rb"))
        assert ok and n_encoder > 20 and calls == 1 and value == 2.0, (ok, calls, n_encoder, value)


def _replicated(rank, world, out_dir, sizes):
    from omni.models.materialize import named_tensors
    from omni.step.config import MultiplexConfig
    from omni.runtime.full_model import replicate_full_model
    from omni.runtime.parallelize import parallelize
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    layout = init_layout(ParallelConfig(**sizes), device="cpu")
    pm = parallelize(build(False, 4, ("image",)), layout, MultiplexConfig(placement="stage0"))
    whole = replicate_full_model(pm, layout, lambda: build(False, 4, ("image",)).to("meta"), torch.device("cpu"))
    ref = dict(named_tensors(build(False, 4, ("image",))))
    got = dict(named_tensors(whole))
    bad = sorted(set(ref) ^ set(got)) + [n for n in ref if n in got and not torch.equal(got[n], ref[n])]
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(bad, f)


@pytest.mark.parametrize("sizes", [dict(dp_shard=2), dict(dp_shard=1, pp=2)], ids=["dp_shard=2", "pp=2"])
def test_every_rank_gets_the_whole_model_for_the_evaluation(tmp_path, sizes):
    """A split layout's end-of-run evaluation gathered the model into rank 0's host memory and
    generated there on the CPU while every GPU idled (hours for 7B). Every rank now gets the
    whole model on its own device (each stage's tensors from its first holder: here pp=2 with
    the encoders on the first stage only) and evaluates its share of the samples."""
    run_ranks(_replicated, 2, str(tmp_path), sizes, timeout_s=120)
    for rank in range(2):
        assert pickle.load(open(tmp_path / f"rank{rank}.pkl", "rb")) == []


def test_shares_of_the_held_out_set_join_into_the_whole_result():
    from omni.runtime.evaluate import EvalResult, merge_results

    parts = [EvalResult(0.5, 2, {"a": 0.5}, [{"x": 1}], {"a": (1, 2)}),
             EvalResult(2 / 3, 3, {"a": 1.0, "b": 0.5}, [], {"a": (1, 1), "b": (1, 2)})]
    whole = merge_results(parts)
    assert (whole.accuracy, whole.num_samples, whole.by_group, whole.counts) == (
        3 / 5, 5, {"a": 2 / 3, "b": 0.5}, {"a": (2, 3), "b": (1, 2)})
