"""parallel.activation_offload: the saved activations of the chosen decoder blocks leave during the
forward and come back one offloaded block ahead of their backward; training is unchanged.

On the CPU the device is the host, so the runtime moves nothing; ``emulate=True`` copies anyway, so
these tests check the bookkeeping a GPU relies on (which blocks, every saved tensor replaced by its
copy, the prefetch order, several micro-batches in flight, recompute) and the results, bit for bit.
The CUDA streams and pinned buffers run in scripts/gpu_check.sh.
"""
from __future__ import annotations

import pytest
import torch

from omni.models.build import build_model
from omni.models.config import ModelConfig
from tests.models.model_helpers import packed_row
from parallel.activation_offload import ActivationOffload
from parallel.sizing import LayoutError, offload_layers

CFG = dict(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
           num_kv_heads=2)


def _grads(offload: ActivationOffload | None, checkpoint: str = "none", in_flight: bool = False):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**CFG), {}, vocab_needed=0)
    model.runtime.offload, model.runtime.checkpoint = offload, checkpoint
    rows = [packed_row([9, 14], CFG["vocab_size"], 1), packed_row([5, 6, 11], CFG["vocab_size"], 2)]
    if in_flight:  # both forwards before either backward, as a pipeline stage runs them
        losses = [model(mb).ce_sum for mb in rows]
        for loss in reversed(losses):
            loss.backward()
    else:
        losses = []
        for mb in rows:
            losses.append(model(mb).ce_sum)
            losses[-1].backward()
    return [loss.detach() for loss in losses], {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpoint,in_flight", [("none", False), ("none", True), ("full", False),
                                                  ("selective", True)])
def test_offloaded_blocks_train_as_before(checkpoint, in_flight):
    ref_losses, ref = _grads(None, checkpoint, in_flight)
    offload = ActivationOffload({1, 2}, min_bytes=0, emulate=True)
    offload.log = []
    losses, got = _grads(offload, checkpoint, in_flight)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    log = offload.log
    assert {i for what, i in log if what == "offload"} == {1, 2}  # only the chosen blocks
    # per micro-batch backward: block 2's tensors come back when it starts (nothing ahead of it
    # is offloaded) and it fetches block 1's ahead, so block 1 never waits
    assert log.count(("prefetch", 1)) == 2
    assert ("late", 1) not in log and ("late", 2) in log
    assert log.index(("prefetch", 1)) == log.index(("late", 2)) - 1  # issued as block 2's backward starts


def test_nothing_moves_on_the_cpu_or_outside_autograd():
    offload = ActivationOffload(None, min_bytes=0)  # not emulated: the CPU is the host
    offload.log = []
    _grads(offload)
    assert offload.log == []
    offload = ActivationOffload(None, min_bytes=0, emulate=True)
    with torch.no_grad():
        assert not offload.applies(0)


def test_the_setting_names_a_bad_block():
    assert offload_layers("none", 4) == set() and offload_layers("all", 4) is None
    assert offload_layers([0, 3], 4) == {0, 3} and offload_layers("[1,2]", 4) == {1, 2}
    with pytest.raises(LayoutError, match=r"block 4 is not in 0\.\.3"):
        offload_layers([0, 4], 4)
    with pytest.raises(LayoutError, match="'x' is not a block index"):
        offload_layers("x", 4)


def test_parallelize_sets_the_chosen_blocks():
    import torch.distributed as dist

    from omni.step.config import MultiplexConfig
    from omni.runtime.parallelize import parallelize
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    try:
        for value, expected in (([1, 3], {1, 3}), ("all", None), ("none", "off")):
            layout = init_layout(ParallelConfig(activation_offload=value), device="cpu")
            model = build_model(ModelConfig(**CFG), {}, vocab_needed=0)
            parallelize(model, layout, MultiplexConfig())
            offload = model.runtime.offload
            assert (offload is None) if expected == "off" else offload.layers == expected
            dist.destroy_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check runs it)")
def test_cuda_offload_equals_eager_and_lowers_the_peak():
    """On a GPU: the same losses and gradients (bit for bit) with every block offloaded, and the
    peak allocated memory of a forward and backward lower by more than what two blocks keep."""
    cfg = dict(CFG, hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8, num_kv_heads=4)

    def run(offload):
        torch.manual_seed(0)
        model = build_model(ModelConfig(**cfg), {}, vocab_needed=0).cuda()
        model.runtime.offload = offload
        mb = packed_row([700, 900, 448], cfg["vocab_size"], 3, "cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(mb).ce_sum
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, torch.cuda.max_memory_allocated() - base

    loss_a, grads_a, peak_a = run(None)
    loss_b, grads_b, peak_b = run(ActivationOffload(None))
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert peak_b < peak_a, (peak_a, peak_b)
