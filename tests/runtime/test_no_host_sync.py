"""No host sync on the hot path: a train step reads the device a constant number of times,
whatever its number of micro-batches (one process and 2 data-parallel gloo ranks, CPU).

On the CPU every tensor is a host tensor, so "a device read" is counted structurally: inside
``StepRunner.device_step`` (forward, backward, gradient sync, clipping, optimizer), every call
that needs a tensor's value on the host — ``item``/``float``/``int``/``bool`` (all of them go
through ``aten._local_scalar_dense``), ``tolist``, and the ops whose output size depends on the
data (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave``
without ``output_size``). On a GPU each of those waits for the device. The optimizer's own
``step`` is left out: torch keeps AdamW's step counters on the host (not capturable), so its
``item`` calls read host memory on a GPU too. Host work before (``StepRunner.host_inputs``: the
batch's counts, padding, target positions, CP hop plans) reads host tensors only by design.
"""
from __future__ import annotations

import collections
import contextlib
import tempfile

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dataloading.construct.batch import StepBatch
from tests.parallel.dist_helpers import run_ranks
from tests.parallel.layout_harness import OPTIM, build, global_batches

aten = torch.ops.aten
_DATA_DEPENDENT = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                   aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
                   aten.repeat_interleave.Tensor}


class HostReads(TorchDispatchMode):
    """Counts device-to-host reads (see the module docstring), by op."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            if func in _DATA_DEPENDENT and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
                self.counts[str(func)] += 1
            elif func is aten.index.Tensor and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                   for i in args[1]):
                self.counts["boolean index"] += 1
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def tolist_counted(self):
        real = torch.Tensor.tolist

        def counted(t):
            if not self.paused:
                self.counts["tolist"] += 1
            return real(t)

        torch.Tensor.tolist = counted
        try:
            yield
        finally:
            torch.Tensor.tolist = real

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def _reads_per_step(sizes: dict, micro: int, moe: bool = True, backend: str = "triton") -> list[dict]:
    """Device reads of each of 2 steps of the tiny MoE model with ``micro`` micro-batches per
    step and rank. ``backend``: the varlen kernels' path (what ``auto`` picks on a GPU; the
    Triton interpreter here), whose lengths come from the host."""
    from omni.runtime.parallelize import parallelize
    from omni.runtime.config import CheckpointConfig, TrainerConfig
    from omni.step.config import MultiplexConfig
    from omni.runtime.trainer import Trainer
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    layout = init_layout(ParallelConfig(**sizes), device="cpu")
    model = build(moe, 2)
    model.set_attn_backend(backend)
    pm = parallelize(model, layout, MultiplexConfig())
    trainer = Trainer(pm, None, layout, TrainerConfig(max_steps=10, run_dir=tempfile.mkdtemp(prefix="omni-sync-"),
                                                      progress=False, eval_at_end=False),
                      OPTIM, CheckpointConfig(save_at_end=False))
    reads = HostReads()
    device_step, optim_step = trainer.steps.device_step, trainer.optim.step

    def counted_step(*args):
        with reads, reads.tolist_counted():
            return device_step(*args)

    def uncounted_optim():
        with reads.pause():
            optim_step()

    trainer.steps.device_step, trainer.optim.step = counted_step, uncounted_optim
    out = []
    dp = layout.dp_size
    for step, mbs in enumerate(global_batches(96, micro=micro * dp, steps=2)):
        reads.counts.clear()
        trainer.train_step(StepBatch(step=step + 1, micro_batches=mbs[layout.dp_rank::dp]))
        out.append(dict(reads.counts))
    return out


def _check(sizes: dict) -> None:
    few, many = _reads_per_step(sizes, 1), _reads_per_step(sizes, 3)
    for counts in few + many:
        assert counts == {"tolist": 1}, f"device reads in one step: {counts} (expected one tolist)"
    assert few == many


def test_one_process_step_reads_the_device_once():
    import torch.distributed as dist

    try:
        _check({})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dp_rank(rank: int, world: int) -> None:
    _check({"dp_shard": 2})


def test_data_parallel_step_reads_the_device_once():
    run_ranks(_dp_rank, 2, timeout_s=240)


def test_host_plans_match_what_the_device_would_find():
    """The loss's target index, the ring's hop plan and Ulysses' document order, built on the
    host from the layout, are what the device-side rules find from the real (sliced) peers' rows."""
    from dataloading.construct.context_parallel import local_documents, slice_for_cp
    from omni.models.attention import ContextParallelSegments
    from omni.models.multimodal import _plan_cp_attention
    from parallel.cp_attention import plan_ulysses
    from parallel.ring_attention import live_rows_cols as _live_rows_cols
    from dataloading.construct.batch import IGNORE_INDEX

    model = build(False, 2)
    for mb in global_batches(96, steps=1, micro=3)[0]:
        p = model.prepare(mb)
        assert torch.equal(p.target_index, (mb.labels != IGNORE_INDEX).nonzero().squeeze(1))
        assert p.num_targets == mb.num_target_tokens
        for cp in (2, 4):
            slices = [slice_for_cp(mb, cp, r, 0) for r in range(cp)]
            length = max(s.num_tokens for s in slices) + 3  # plus step padding, as the trainer adds
            slices = [s.padded(length, 0) for s in slices]
            docs = [local_documents(s.cp, length) for s in slices]
            gathered = plan_ulysses(torch.cat(docs)[None], torch.cat([s.position_ids for s in slices])[None], True)
            for r in range(cp):
                def planned(impl):
                    seg = ContextParallelSegments(docs[r][None], slices[r].position_ids[None], None, impl)
                    return _plan_cp_attention(seg, slices[r].cp, slices[r].position_ids)

                uly = planned("ulysses")
                assert torch.equal(uly.ulysses.order, gathered.order) and uly.ulysses.lengths == gathered.lengths
                assert uly.packed.lengths == gathered.lengths
                hops = planned("ring").hops
                assert hops is not None and len(hops) == cp - 1
                for step, hop in enumerate(hops, start=1):
                    peer = (r - step) % cp
                    rows, cols = _live_rows_cols(docs[r][None], slices[r].position_ids[None], docs[peer][None],
                                                 slices[peer].position_ids[None], True)
                    assert hop.live == (rows.numel() > 0)
                    assert torch.equal(torch.arange(length) if hop.rows is None else hop.rows, rows)
                    assert torch.equal(torch.arange(length) if hop.cols is None else hop.cols, cols)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check runs it)")
def test_cuda_step_synchronises_once():
    """On a GPU, torch's own sync detector: the device step makes one synchronising call (the
    step's read), whatever the number of micro-batches."""
    import warnings

    import torch.distributed as dist

    from omni.runtime.config import CheckpointConfig, TrainerConfig
    from omni.step.config import MultiplexConfig
    from omni.runtime.parallelize import parallelize
    from omni.runtime.trainer import Trainer
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    try:
        layout = init_layout(ParallelConfig(), device="cuda")
        pm = parallelize(build(True, 2), layout, MultiplexConfig())
        trainer = Trainer(pm, None, layout, TrainerConfig(max_steps=10, run_dir=tempfile.mkdtemp(prefix="omni-sync-"),
                                                          progress=False, eval_at_end=False, precision="bf16"),
                          OPTIM, CheckpointConfig(save_at_end=False))
        device_step = trainer.steps.device_step
        syncs = []

        def watched(*args):
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return device_step(*args)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    syncs.append(sum("synchroniz" in str(w.message) for w in seen))

        trainer.steps.device_step = watched
        for micro in (1, 1, 3):  # the first step also sets things up (not counted)
            trainer.train_step(StepBatch(step=1, micro_batches=global_batches(96, micro=micro, steps=1)[0]))
        assert syncs[1:] == [1, 1], syncs
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
