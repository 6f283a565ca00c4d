"""MoE experts under bf16 compute with fp32 masters: one compute-dtype copy of a layer's expert
stacks, shared by every micro-batch in flight (parallel/shared_cast.py), instead of a copy per
micro-batch kept by each backward; the same outputs and gradients, bit for bit, and fresh weights
after every optimizer step (the fused AdamW does not bump version counters)."""
from __future__ import annotations

import copy

import pytest
import torch

from omni.models.llm.config import DecoderConfig
from omni.models.llm.moe import MoE

H, I, E = 32, 24, 4  # rows of 64, 48 and 48 bytes in bf16: grouped_mm's 16-byte alignment holds


def _moe(intermediate: int = I, hidden: int = H, experts: int = E) -> MoE:
    torch.manual_seed(0)
    cfg = DecoderConfig(family="qwen2_moe", vocab_size=64, hidden_size=hidden, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2, num_experts=experts, num_experts_per_tok=2,
                        moe_intermediate_size=intermediate, shared_expert_intermediate_size=16, norm_topk_prob=True)
    layer = MoE(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


class _PerUseCast:
    """The behaviour before: every use casts the stacks afresh."""

    def get(self, w, dtype):
        return w.to(dtype)


def _expert_copy_bytes(layer: MoE, rows: list[torch.Tensor]) -> int:
    """Bytes of the distinct bf16 storages holding expert weights (a stack, or one expert's slice
    of it) kept for the backward of ``rows``, each a micro-batch forwarded before any backward
    (as pipeline parallelism does). Token counts differ from every weight dimension, so no
    activation matches."""
    shapes = {tuple(w.shape[-2:]) for w in (layer.experts.w_gate_up, layer.experts.w_down)}
    storages = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and t.dim() >= 2 and (tuple(t.shape[-2:]) in shapes
                                                            or tuple(t.shape[-2:])[::-1] in shapes):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    outs = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        for x in rows:
            outs.append(layer(x)[0])
    sum(o.float().sum() for o in outs).backward()
    return sum(storages.values())


@pytest.mark.parametrize("intermediate", [I, 20], ids=["grouped_mm", "per-expert loop"])
def test_micro_batches_in_flight_share_one_copy_of_the_experts(intermediate):
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randn(n, H, generator=gen).requires_grad_() for n in (7, 13, 5)]  # as a block's input
    layer = _moe(intermediate)
    one_copy = 2 * (layer.experts.w_gate_up.numel() + layer.experts.w_down.numel())
    assert _expert_copy_bytes(layer, rows) == one_copy
    layer.experts._casts = _PerUseCast()  # before: each micro-batch's backward keeps its own
    assert _expert_copy_bytes(layer, rows) >= (len(rows) if intermediate == I else 2) * one_copy


def test_shared_copy_gives_the_same_results_and_follows_the_optimizer():
    """Three steps of two micro-batches each (both forwarded before either backward), fused
    AdamW: the outputs, the aux losses and the gradients equal those of casting per use."""
    gen = torch.Generator().manual_seed(2)
    shared = _moe()
    per_use = copy.deepcopy(shared)
    per_use.experts._casts = _PerUseCast()
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05, fused=True) for m in (shared, per_use)]
    for step in range(3):
        rows = [torch.randn(n, H, generator=gen) for n in (9, 6)]
        results = []
        for layer, opt in zip((shared, per_use), opts):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs = [layer(x) for x in rows]
            loss = sum(y.float().square().mean() + aux for y, aux in outs)
            loss.backward()
            results.append(([y.detach() for y, _ in outs], {n: p.grad.clone() for n, p in layer.named_parameters()}))
            opt.step()
            opt.zero_grad(set_to_none=True)
        (ys_a, grads_a), (ys_b, grads_b) = results
        for a, b in zip(ys_a, ys_b):
            assert torch.equal(a, b), f"step {step}: outputs differ"
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), f"step {step}: gradient of {name} differs"
            assert grads_a[name].dtype == torch.float32


def test_no_copy_is_kept_between_steps_or_outside_autograd():
    layer = _moe()
    x = torch.randn(8, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)[0].float().sum().backward()
        with torch.no_grad():
            layer(x)
    entries = layer.experts._casts._entries
    assert entries and all(ref() is None for _, _, ref, *_ in entries.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check runs it)")
def test_cuda_micro_batches_in_flight_hold_one_copy():
    """On a GPU (bf16 grouped_mm on sm90+, the loop elsewhere), experts of 100 MB in bf16: four
    micro-batches in flight hold one copy of them, not four."""
    layer = _moe(intermediate=2048, hidden=1024, experts=8).cuda()
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(16, 1024, generator=gen).cuda().requires_grad_() for _ in range(4)]
    copy_bytes = 2 * (layer.experts.w_gate_up.numel() + layer.experts.w_down.numel())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outs = [layer(x)[0] for x in rows]
    held = torch.cuda.memory_allocated() - base
    assert copy_bytes <= held < 1.5 * copy_bytes, (held, copy_bytes)
    sum(o.float().sum() for o in outs).backward()
