"""parallel.compile: the decoder blocks' norms and dense MLPs under torch.compile train as the eager
model does (fp32, within 1e-5 of the largest gradient; compiled code may sum in another order),
under each recompute mode, keep their parameter names, and do not compile again for new packings.
On the CPU the tests trace with ``aot_eager`` (dynamo and AOTAutograd, no code generation: seconds,
not minutes); the GPU check compiles with inductor."""
from __future__ import annotations

import pytest
import torch

from omni.models.build import build_model
from omni.models.config import ModelConfig
from model_helpers import packed_row
from omni.models.llm.compile import compile_blocks

CFG = dict(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
           num_kv_heads=2)
MOE = dict(CFG, family="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32, mlp_only_layers=[0])
ROWS = ([9, 14], [5, 6, 11], [30], [7, 7, 7, 7])


def _train(cfg: dict, backend: str | None, checkpoint: str = "none", device: str = "cpu"):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**cfg), {}, vocab_needed=0).to(device)
    model.runtime.checkpoint = checkpoint
    names = [n for n, _ in model.named_parameters()]
    if backend:
        compile_blocks(model.llm.layers, backend=backend)
    losses = []
    for i, lengths in enumerate(ROWS):
        loss = model(packed_row(lengths, CFG["vocab_size"], i, device)).ce_sum
        loss.backward()
        losses.append(loss.detach())
    return model, names, torch.stack(losses), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("cfg,checkpoint", [(CFG, "none"), (CFG, "selective"), (CFG, "full"), (MOE, "none")],
                         ids=["dense", "dense-selective", "dense-full", "moe"])
def test_compiled_blocks_train_as_eager(cfg, checkpoint):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, names, ref_losses, ref = _train(cfg, None, checkpoint)
    model, compiled_names, losses, got = _train(cfg, "aot_eager", checkpoint)
    assert compiled_names == names == [n for n, _ in model.named_parameters()]
    assert model.state_dict().keys() == build_model(ModelConfig(**cfg), {}, vocab_needed=0).state_dict().keys()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    for name in ref:
        scale = ref[name].abs().max()
        assert (got[name] - ref[name]).abs().max() <= 1e-5 * scale, name
    # the norms and the dense MLP each compiled once, whatever the packing of the four rows
    assert 2 <= counters["stats"]["unique_graphs"] <= 6, dict(counters["stats"])  # it did compile
    assert not counters["recompiles"], dict(counters["recompiles"])


def test_moe_blocks_keep_the_experts_eager():
    model = build_model(ModelConfig(**MOE), {}, vocab_needed=0)
    assert compile_blocks(model.llm.layers, backend="aot_eager") == 2 * 3 + 1  # 6 norms, 1 dense MLP


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check runs it)")
def test_cuda_inductor_blocks_train_as_eager():
    import torch._dynamo

    torch._dynamo.reset()
    cfg = dict(CFG, hidden_size=256, intermediate_size=688)
    _, _, ref_losses, ref = _train(cfg, None, device="cuda")
    _, _, losses, got = _train(cfg, "inductor", device="cuda")
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=0)
    for name in ref:
        assert (got[name] - ref[name]).abs().max() <= 1e-4 * ref[name].abs().max(), name
