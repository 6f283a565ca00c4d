"""Selective activation recompute (``parallel.activation_checkpoint=selective``) keeps the output
of attention for every backend the CPU can run: a block's backward recomputes norms, rotary and
activations, never the attention forward. Counted on two tiny decoder blocks, forward plus
backward: the fused SDPA op on the CPU (once per block and length bucket), the Triton varlen
kernel (TRITON_INTERPRET=1, fp32; once per block) and the math SDPA variant (which reaches the
policy as its two bmms; the softmax between them is recomputed) each run as often as without
recompute; the gradients equal those without recompute. The CUDA-only SDPA variants and
flash-attn's ops are in the same save list (checked by name here)."""
from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from omni.kernels import _attention_triton
from omni.models.attention import PackedSegments
from omni.models.llm.config import DecoderConfig
from omni.models.llm.decoder import Decoder
from omni.models.recompute import SAVE_OP_NAMES, SAVE_OPS, _keep

LENGTHS = [5, 9, 2]
LAYERS = 2
CONFIG = DecoderConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=LAYERS, num_heads=4,
                       num_kv_heads=2)

# backend -> (model.attn_backend, the SDPA variant forced, the op that is attention's forward,
# its runs per block forward: the SDPA path runs one per length bucket, 9 | 5 | 2 here; the math
# variant two bmms per bucket)
BACKENDS = {
    "sdpa": ("sdpa", None, "aten::_scaled_dot_product_flash_attention_for_cpu", 3),
    "sdpa_math": ("sdpa", SDPBackend.MATH, "aten::bmm", 6),
    "triton": ("triton", None, "triton:attention_fwd", 1),
}


class _CountOps(TorchDispatchMode):
    """How often each op runs (ops the selective-checkpoint cache answers do not run)."""

    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


class _CountLaunches:
    """Stands in for a Triton kernel: counts its launches, then launches it."""

    def __init__(self, kernel, counts: collections.Counter, name: str):
        self.kernel, self.counts, self.name = kernel, counts, name

    def __getitem__(self, grid):
        self.counts[self.name] += 1
        return self.kernel[grid]


def _run(backend: str, mode: str, monkeypatch):
    attn_backend, variant = BACKENDS[backend][:2]
    torch.manual_seed(0)
    decoder = Decoder(CONFIG)
    with torch.no_grad():
        for p in decoder.parameters():
            p.normal_(0.0, 0.3)
    t = sum(LENGTHS)
    h = torch.randn(1, t, CONFIG.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    segments = PackedSegments.from_lengths(LENGTHS, "cpu", causal=True, backend=attn_backend)
    counts = collections.Counter()
    with monkeypatch.context() as patch:
        patch.setattr(_attention_triton, "attention_fwd",
                      _CountLaunches(_attention_triton.attention_fwd, counts, "triton:attention_fwd"))
        with sdpa_kernel(variant) if variant is not None else contextlib.nullcontext(), _CountOps(counts):
            out, _ = decoder.run_layers(h, decoder.rotary(positions, h.dtype), segments, checkpoint=mode)
            out.square().sum().backward()
    grads = {"h": h.grad, **{n: p.grad for n, p in decoder.named_parameters()}}
    return counts, grads


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_selective_recompute_runs_attention_once(backend, monkeypatch):
    attention, per_block = BACKENDS[backend][2:]
    plain, want = _run(backend, "none", monkeypatch)
    kept, got = _run(backend, "selective", monkeypatch)
    if backend != "sdpa_math":  # the math variant's backward runs bmms of its own (the gradients)
        assert plain[attention] == LAYERS * per_block, dict(plain)
    assert kept[attention] == plain[attention], (attention, kept[attention], plain[attention])
    # the recompute did happen (the norms' fp32 upcast ran again): the test would see a rerun
    assert kept["aten::rsqrt"] > plain["aten::rsqrt"]
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_save_list_names_every_attention_forward():
    """The GPU backends cannot run here: the save list holds each of their forward ops."""
    names = {op._schema.name for op in SAVE_OPS} | SAVE_OP_NAMES
    for op in ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        assert f"aten::{op}" in names, op
    # flash-attn's forwards (flash_attn_varlen_func, flash_attn_func), without importing it
    assert {"flash_attn::_flash_attn_varlen_forward", "flash_attn::_flash_attn_forward"} <= SAVE_OP_NAMES
    assert _keep(torch.ops.omni.varlen_attention_fwd.default)
    assert not _keep(torch.ops.aten._safe_softmax.default)
