"""``model.attn_backend=triton`` (the varlen Triton kernels, interpreted on the CPU) trains the
multimodal model like the PyTorch SDPA path: the backbone's packed causal attention and the
encoders' per-item attention, losses and every gradient."""
from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
from layout_harness import build, global_batches  # noqa: E402

from omni.models.attention import PackedSegments  # noqa: E402


def _run(backend: str, autocast: torch.dtype | None = None):
    """Two micro-batches forward and backward; ``autocast``: under CPU autocast to that dtype
    (fp32 weights, as the Trainer runs ``trainer.precision=bf16`` without FSDP)."""
    model = build(False, 4, ("image", "audio"))
    model.set_attn_backend(backend)
    total = 0.0
    for mb in global_batches(96, ("image", "audio"))[0][:2]:
        with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
            parts = model(mb)
        parts.ce_sum.backward()
        total += float(parts.ce_sum.detach())
    return model, total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_triton_backend_trains_like_sdpa():
    _, loss_ref, grads_ref = _run("sdpa")
    model, loss, grads = _run("triton")
    assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
    scale = sum(float(g.norm()) ** 2 for g in grads_ref.values()) ** 0.5
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        ref = grads_ref[name]
        if float(ref.norm()) < 1e-7 * scale:  # zero in exact arithmetic (attention key biases)
            assert float(g.norm()) < 1e-6 * scale, name
            continue
        assert float((g - ref).norm() / ref.norm()) <= 1e-5, name
    # the kernels really ran: the backbone's segments were the varlen kind
    mb = global_batches(96, ("image",))[0][0]
    assert isinstance(model.prepare(mb).segments, PackedSegments)
    assert model.encoders["image"].attn_backend == "triton"


def test_unknown_backend_is_refused():
    from omni.errors import ConfigError
    from omni.models.build import build_model
    from omni.models.config import ModelConfig

    with pytest.raises(ConfigError, match="model.attn_backend='cuda' is not one of auto, triton, flash, sdpa"):
        build_model(ModelConfig(attn_backend="cuda"), {}, vocab_needed=10)


def test_triton_backend_under_half_precision_autocast():
    """The GPU default path (autocast, fp32 weights) on the varlen kernels: rotary must hand
    attention q, k and v in one dtype. Under bf16 the forward and backward must run (the
    interpreter computes bf16 wrongly, so its numbers are not compared); fp16, which the
    interpreter computes right, is compared with the SDPA path under the same autocast."""
    _, loss, grads = _run("triton", torch.bfloat16)
    assert torch.isfinite(torch.tensor(loss)) and all(torch.isfinite(g).all() for g in grads.values())
    _, loss_ref, grads_ref = _run("sdpa", torch.float16)
    _, loss, grads = _run("triton", torch.float16)
    assert grads.keys() == grads_ref.keys()
    # fp16 keeps 11 mantissa bits (relative rounding up to 2^-11 = 4.9e-4); the kernel and SDPA
    # round at different places (online softmax, tile order). The loss is summed in fp32 (seen:
    # 6e-7 apart); a gradient goes back through four layers of fp16 products (seen: 1.5e-3 at
    # most), so 1e-3 and 5e-3 are two and ten roundings.
    assert abs(loss - loss_ref) <= 1e-3 * abs(loss_ref), (loss, loss_ref)
    scale = sum(float(g.float().norm()) ** 2 for g in grads_ref.values()) ** 0.5
    for name, g in grads.items():
        ref = grads_ref[name].float()
        if float(ref.norm()) < 1e-6 * scale:  # zero in exact arithmetic (attention key biases): roundoff only
            assert float((g.float() - ref).norm()) < 1e-5 * scale, name
            continue
        assert float((g.float() - ref).norm() / ref.norm()) <= 5e-3, name


def test_rotary_keeps_the_projection_dtype():
    from omni.models.llm.rope import apply_rotary

    q, k = torch.randn(1, 4, 6, 8, dtype=torch.bfloat16), torch.randn(1, 2, 6, 8, dtype=torch.bfloat16)
    cos, sin = torch.randn(1, 6, 8), torch.randn(1, 6, 8)  # fp32 tables, as beside an fp32 residual stream
    rq, rk = apply_rotary(q, k, cos, sin)
    assert rq.dtype == rk.dtype == torch.bfloat16
    exact = q.float() * cos[:, None] + torch.cat((-q.float()[..., 4:], q.float()[..., :4]), -1) * sin[:, None]
    assert torch.equal(rq, exact.to(torch.bfloat16))  # rotated in fp32, rounded once
