"""The GPU's rules taken on the CPU (``trainer.device_rules=cuda``, ``parallel/device_rules.py``)
and the strict device check (``parallel/strict_device.py``), piece by piece; the layouts under
them are in tests/parallel/test_device_rules_layouts.py.

Each finding the rules brought to light has its test here: every one of them fails on the code
before its fix (the docstrings say how).
"""
from __future__ import annotations

import pytest
import torch

from parallel.device_rules import DeviceRulesError, free_memory_at_steady_state, resolve_device_rules
from parallel.strict_device import HostSyncError, StrictDevice, host_read, on_device
from parallel.transfer import to_device

CPU = torch.device("cpu")


# -- the decisions ------------------------------------------------------------------------------
def test_auto_takes_the_devices_own_rules_and_cuda_takes_the_gpus():
    cpu = resolve_device_rules("auto", CPU)
    gpu = resolve_device_rules("cuda", CPU)
    assert (cpu.cuda, cpu.emulated, cpu.bf16, cpu.features_on_device) == (False, False, False, False)
    assert (gpu.cuda, gpu.emulated, gpu.bf16, gpu.features_on_device) == (True, True, True, True)
    assert cpu.attention_backend("auto") == "auto" and gpu.attention_backend("auto") == "triton"  # auto: per call
    assert gpu.attention_backend("sdpa") == "sdpa"  # a choice of the user's stays
    assert cpu.device_memory_bytes() is None and gpu.device_memory_bytes() == 80 * 2**30
    assert resolve_device_rules("cuda", CPU, memory_gib=24).device_memory_bytes() == 24 * 2**30
    assert (gpu.activation_bytes, cpu.activation_bytes) == (2, 4)


def test_fsdp_auto_dtype_follows_what_the_run_computes_in():
    """MoE under FSDP with trainer.precision=fp32 on a GPU crashed: FSDP's auto was bf16 on any
    CUDA device (it cast the block input) while the router and experts, outside FSDP, stayed
    fp32 with no autocast to reconcile them. auto now follows the run's precision."""
    from parallel.fsdp import precision_policy

    assert precision_policy("auto", resolve_device_rules("cuda", CPU, "fp32")).param_dtype is None
    assert precision_policy("auto", resolve_device_rules("cuda", CPU, "auto")).param_dtype == torch.bfloat16
    assert precision_policy("auto", resolve_device_rules("auto", CPU, "bf16")).param_dtype == torch.bfloat16
    assert precision_policy("bf16", resolve_device_rules("auto", CPU, "fp32")).param_dtype == torch.bfloat16


def test_moe_takes_a_bf16_stream_with_fp32_weights_and_no_autocast():
    """parallel.mixed_precision=bf16 with trainer.precision=fp32: FSDP hands the MoE layer (not
    FSDP's) a bf16 stream. Before the fix: F.linear(bf16, fp32) raised in the router."""
    from tests.parallel.layout_harness import build

    model = build(True, 2)
    block = model.llm.layers["0"].mlp
    x = torch.randn(1, 12, model.llm.config.hidden_size)
    out, aux = block(x.to(torch.bfloat16))
    ref, _ = block(x.to(torch.bfloat16).float())
    assert out.dtype == torch.bfloat16 and torch.isfinite(aux)
    assert torch.allclose(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_cuda_rules_on_the_cpu_need_the_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DeviceRulesError, match="TRITON_INTERPRET=1"):
        resolve_device_rules("cuda", CPU).attention_backend("auto")
    with pytest.raises(DeviceRulesError, match="device_rules='gpu' is not one of auto, cuda"):
        resolve_device_rules("gpu", CPU)


def test_the_encoder_budget_leaves_room_for_gradients_and_optimizer_state():
    """The encoder memory budget (multiplex.encoder_memory_mib=auto) was read at start-up, before
    the gradients and AdamW's moments existed: about three times the trainable weights too
    much. It is now the free memory at steady state."""
    rules = resolve_device_rules("cuda", CPU, memory_gib=1.0)
    lin = torch.nn.Linear(100, 100)  # 10,100 fp32 parameters
    frozen = torch.nn.Linear(10, 10).requires_grad_(False)  # 110: held, no gradient or moments
    free = free_memory_at_steady_state(rules, [lin, frozen])
    weights = (10_100 + 110) * 4
    assert free == 2**30 - weights - 10_100 * 4 - 10_100 * 8  # parameters, gradients, two fp32 moments
    assert free_memory_at_steady_state(resolve_device_rules("auto", CPU), [lin]) is None  # host memory


# -- the strict check ---------------------------------------------------------------------------
def _strict_linear():
    strict = StrictDevice()
    lin = torch.nn.Linear(4, 4)
    strict.mark_module(lin)
    return strict, lin


@pytest.mark.parametrize("read", [
    ("item", lambda g: g.sum().item()),
    ("bool", lambda g: bool(g.sum() > 0)),
    ("tolist", lambda g: g.tolist()),
    ("numpy", lambda g: g.detach().numpy()),
    ("cpu", lambda g: g.cpu()),
    ("nonzero", lambda g: g.nonzero()),
    ("boolean-mask indexing", lambda g: g[g > 0]),
    ("masked_select", lambda g: g.masked_select(g > 0)),
    ("unique", lambda g: torch.unique(g)),
    ("repeat_interleave without output_size", lambda g: torch.repeat_interleave(g[0].long().abs() % 3)),
], ids=lambda r: r[0] if isinstance(r, tuple) else None)
def test_every_kind_of_host_read_of_a_device_tensor_raises_with_its_call_site(read):
    name, fn = read
    strict, lin = _strict_linear()
    with strict, strict.device_window():
        g = lin(torch.zeros(2, 4, device=lin.weight.device))
        with pytest.raises(HostSyncError, match=r"test_device_rules\.py:\d+"):
            fn(g)


def test_host_tensors_stay_readable_and_declared_reads_are_counted():
    strict, lin = _strict_linear()
    with strict:
        x, = to_device([torch.ones(3, 4)], CPU)
        with strict.device_window():
            rows = torch.tensor([2, 0])  # no device: a host tensor, as on a GPU
            assert rows.tolist() == [2, 0]
            y = lin(x).sum()
            with host_read("the step's loss"):
                y.item()
                y.item()
    assert dict(strict.syncs) == {"the step's loss": 2} and strict.copies == 1
    assert on_device(x) and on_device(y) and not on_device(rows)


def test_host_data_copied_in_the_step_or_mixed_with_device_tensors_is_refused():
    strict, lin = _strict_linear()
    with strict, strict.device_window():
        x = torch.zeros(2, 4, device=lin.weight.device)  # made on the device: fine
        with pytest.raises(HostSyncError, match="pageable host-to-device copy"):
            torch.ones(2, 4).to(x.device)
        with pytest.raises(HostSyncError, match="pageable host-to-device copy"):
            torch.tensor([1.0, 2.0], device=x.device)
        with pytest.raises(HostSyncError, match="mixes a device tensor with a host tensor"):
            lin(x) + torch.ones(2, 4)
        lin(x) * torch.tensor(2.0)  # a 0-dim host scalar is fine on CUDA too


def test_batched_copies_one_per_dtype_and_views_of_them():
    strict = StrictDevice()
    host = [torch.arange(5), torch.ones(2, 3), None, torch.arange(3).view(3, 1), torch.zeros(4, dtype=torch.bool)]
    with strict:
        moved = to_device(host, CPU)
    assert strict.copies == 3  # int64, float32, bool
    for h, m in zip(host, moved):
        assert (h is None and m is None) or (torch.equal(h, m) and m is not h and on_device(m))
    assert to_device(host, CPU)[0] is host[0]  # no check running, CPU rules: nothing moves


def test_describe_media_takes_features_already_on_the_device():
    """Every multi-GPU layout with an encoder and tp, pp or cp > 1 crashed at its first step with
    media: the peers' feed had put the features on the GPU and describe_media refused them,
    though it reads only their shape. Under the strict check the features are device tensors,
    and the old refusal ("describe_media reads host tensors") comes back if put back."""
    from dataloading.construct.batch import MediaInputs, MicroBatch
    from omni.step.media_manifest import describe_media

    feats = torch.randn(6, 8)
    strict = StrictDevice()
    strict.mark(feats)
    media = MediaInputs(feats, torch.tensor([[2, 3]]), torch.tensor([6]), torch.arange(1, 7))
    mb = MicroBatch(torch.zeros(8, dtype=torch.long), torch.arange(8), torch.zeros(8, dtype=torch.long),
                    torch.tensor([0, 8], dtype=torch.int32), media={"image": media})
    with strict:
        out = describe_media(mb, {"image": lambda sizes: [int(h) * int(w) for h, w in sizes.tolist()]})
    assert out.items == [("image", 0, 6, 6, (2, 3))] and out.features == {"image": (8, "float32")}
    strict.mark(media.positions)  # what it does read must be on the host
    with strict, pytest.raises(ValueError, match="describe_media reads host tensors"):
        describe_media(mb, {"image": lambda sizes: [6]})


def test_a_micro_batch_moves_in_one_copy_per_dtype():
    """A multimodal micro-batch reached the device in 10-16 blocking pageable copies (ids,
    positions, labels, boundaries, each media field, targets, masks, one by one). prepare now
    moves everything in one batched copy per dtype (pinned and asynchronous on a GPU)."""
    from tests.parallel.layout_harness import build, global_batches

    model = build(False, 2, ("image", "audio"))
    mb = global_batches(96, ("image", "audio"), steps=1, micro=1)[0][0]
    assert set(mb.media) == {"image", "audio"}
    strict = StrictDevice()
    with strict:
        p = model.prepare(mb, real_tokens=mb.num_tokens - 2, device=CPU)
    assert strict.copies == len({torch.int64, torch.int32, torch.float32, torch.bool}) == 4
    moved = [p.mb.input_ids, p.mb.labels, p.mb.cu_seqlens, p.target_index, p.token_mask,
             *(t for x in p.mb.media.values() for t in (x.features, x.sizes, x.positions))]
    assert all(on_device(t) for t in moved)
    assert not on_device(mb.input_ids)  # the host row stays a host row


def test_a_model_over_eval_max_gib_is_not_gathered_for_the_evaluation(capsys):
    """Above trainer.eval_max_gib a split layout's end-of-run evaluation is skipped with one
    line, before any rank gathers anything."""
    import dataclasses
    import tempfile

    from omni.runtime.config import CheckpointConfig, TrainerConfig
    from omni.runtime.trainer import Trainer
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout
    from tests.parallel.layout_harness import OPTIM, build

    import torch.distributed as dist

    try:
        layout = init_layout(ParallelConfig(), device="cpu")
        cfg = TrainerConfig(max_steps=1, run_dir=tempfile.mkdtemp(prefix="omni-eval-"), progress=False,
                            eval_max_gib=1e-6)
        trainer = Trainer(build(False, 2), None, layout, cfg, OPTIM, CheckpointConfig(save_at_end=False),
                          full_model=lambda: build(False, 2).to("meta"), eval_samples=lambda: [])
        trainer.layout = dataclasses.replace(layout, world_size=2)  # as one rank of two
        assert trainer._final_eval(1) is None
        out = capsys.readouterr().out
        assert "omni: end-of-run evaluation skipped" in out and "trainer.eval_max_gib=1e-06" in out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
