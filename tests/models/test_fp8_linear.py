"""parallel.fp8: the decoder blocks' linear layers as torchao Float8Linear (e4m3 forward, e5m2
gradients, dynamic tensor-wise scales). FP8 rounds, so "equal to the eager run" is stated as:
the first step's loss within 0.5% and every gradient's cosine similarity with the unconverted
model's at least 0.98, and ten AdamW steps landing within 5% of the same loss. torch._scaled_mm
runs on the CPU here; the GPU check runs the same model under bf16 autocast on a GPU with FP8."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni.models.build import build_model
from omni.models.config import ModelConfig
from model_helpers import packed_row

pytest.importorskip("torchao")
from omni.models.llm.fp8 import convert_blocks_to_fp8  # noqa: E402

CFG = dict(family="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
           num_kv_heads=2)
MOE = dict(CFG, family="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32, mlp_only_layers=[0])


def _train(cfg: dict, fp8: bool, steps: int, device: str = "cpu", autocast: bool = False):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**cfg), {}, vocab_needed=0).to(device)
    if fp8:
        convert_blocks_to_fp8(model.llm.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mb, losses, first = packed_row([40, 24, 32], CFG["vocab_size"], 1, device), [], None
    for step in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(mb).ce_sum / mb.num_target_tokens
        loss.backward()
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return model, losses, first


def _compare(plain, fp8):
    (_, loss_a, grads_a), (_, loss_b, grads_b) = plain, fp8
    assert abs(loss_b[0] - loss_a[0]) <= 5e-3 * loss_a[0]
    for name in grads_a:
        cos = F.cosine_similarity(grads_a[name].flatten().float(), grads_b[name].flatten().float(), dim=0)
        assert cos >= 0.98, (name, float(cos))
    assert abs(loss_b[-1] - loss_a[-1]) <= 0.05 * loss_a[-1], (loss_a, loss_b)


def test_fp8_blocks_train_as_the_unconverted_model():
    _compare(_train(CFG, False, 10), _train(CFG, True, 10))


def test_what_is_converted_and_names_stay():
    from torchao.float8.float8_linear import Float8Linear

    model = build_model(ModelConfig(**MOE), {}, vocab_needed=0)
    names = list(model.state_dict())
    # block 0: q, k, v, o and the dense MLP (7); block 1: q, k, v, o and the shared expert's three
    assert convert_blocks_to_fp8(model.llm.layers) == 14
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert not any("router" in n or "embed" in n or "lm_head" in n for n in converted)
    assert list(model.state_dict()) == names  # checkpoints move between FP8 and bf16 runs


def test_the_layout_refuses_what_fp8_cannot_run():
    from parallel.sizing import LayoutError, Sizes, check_model_fits

    one = Sizes(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1, ep=1)
    check_model_fits(one, num_heads=4, num_kv_heads=2, num_layers=2, fp8=True, hidden_size=64)
    with pytest.raises(LayoutError, match=r"parallel.fp8=true with parallel.tp=2"):
        check_model_fits(Sizes(dp_replicate=1, dp_shard=1, tp=2, pp=1, cp=1, ep=1), num_heads=4, num_kv_heads=2,
                         num_layers=2, fp8=True, hidden_size=64)
    with pytest.raises(LayoutError, match="multiple of 16"):
        check_model_fits(one, num_heads=4, num_kv_heads=2, num_layers=2, fp8=True, hidden_size=72)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check runs it)")
def test_cuda_fp8_blocks_under_bf16_train_as_bf16():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9 or later")
    _compare(_train(CFG, False, 10, "cuda", autocast=True), _train(CFG, True, 10, "cuda", autocast=True))


def test_parallelize_converts_the_blocks():
    import torch.distributed as dist
    from torchao.float8.float8_linear import Float8Linear

    from omni.step.config import MultiplexConfig
    from omni.runtime.parallelize import parallelize
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    try:
        layout = init_layout(ParallelConfig(fp8=True), device="cpu")
        model = build_model(ModelConfig(**CFG), {}, vocab_needed=0)
        parallelize(model, layout, MultiplexConfig())
        assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 14
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_without_torchao_the_run_says_so(monkeypatch):
    import importlib.util

    from recipes import checks
    from omni.errors import ConfigError
    from recipes.schema import OmniConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    cfg = OmniConfig()
    cfg.parallel.fp8 = True
    with pytest.raises(ConfigError, match=r"parallel.fp8=True needs torchao.*pip install"):
        checks._parallel(cfg, None, None)


def test_the_device_says_where_fp8_runs():
    """CUDA before compute capability 8.9 cannot run FP8 matmuls: refused in one line; the CPU
    runs torch's slow reference kernel: a warning line; an FP8 GPU: nothing."""
    from unittest import mock

    from parallel.device_rules import DeviceRules, DeviceRulesError

    assert "slower than bf16" in DeviceRules(torch.device("cpu")).fp8_warning()
    gpu = DeviceRules(torch.device("cuda"), cuda=True)
    with mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)):
        with pytest.raises(DeviceRulesError, match=r"this GPU has 8\.0: use parallel.fp8=false"):
            gpu.fp8_warning()
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        assert gpu.fp8_warning() is None
