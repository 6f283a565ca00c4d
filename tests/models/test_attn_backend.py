"""``model.attn_backend=triton`` (the varlen Triton kernels, interpreted on the CPU) trains the
multimodal model like the PyTorch SDPA path: the backbone's packed causal attention and the
encoders' per-item attention, losses and every gradient."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
from layout_harness import build, global_batches  # noqa: E402

from omni.models.attention import PackedSegments  # noqa: E402


def _run(backend: str):
    model = build(False, 4, ("image", "audio"))
    model.set_attn_backend(backend)
    total = 0.0
    for mb in global_batches(96, ("image", "audio"))[0][:2]:
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
