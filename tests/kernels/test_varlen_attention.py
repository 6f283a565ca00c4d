"""``varlen_attention(backend="triton")`` equals a naive per-document attention, forward and
every gradient (fp32, 1e-4 relative), under TRITON_INTERPRET=1 on the CPU: mixed lengths with
length-1 documents and lengths that are not multiples of the block, GQA ratios 1, 2, 3, 6,
causal and not, both schedules (cost-ordered persistent and plain grid). GPU-only checks (bf16,
flash-attn) skip without CUDA."""
from __future__ import annotations

import pytest
import torch

from omni.kernels import resolve_backend, varlen_attention
from omni.kernels.reference import attention_reference

# The interpreter's block is 32 rows: 1, 5, 17, 33, 40, 70 are not multiples of it.
LENGTHS = [1, 5, 17, 33, 2, 64, 40, 1, 70]
GQA = [(2, 2), (4, 2), (3, 1), (6, 1)]  # ratios 1, 2, 3, 6


def _pack(lengths, h_q, h_kv, d, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
               for h in (h_q, h_kv, h_kv))
    cu = torch.tensor([0, *lengths]).cumsum(0).to(device=device, dtype=torch.int32)
    return q, k, v, cu


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _check(lengths, h_q, h_kv, d, causal, schedule="cost", dtype=torch.float32, tol=1e-4):
    q, k, v, cu = _pack(lengths, h_q, h_kv, d, dtype)
    out = varlen_attention(q, k, v, cu, max(lengths), causal=causal, backend="triton", schedule=schedule)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = attention_reference(q32, k32, v32, cu, causal=causal)
    want = torch.autograd.grad(ref, (q32, k32, v32), grad.float())
    errors = {"out": _rel(out, ref), **{n: _rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), got, want)}}
    assert all(e <= tol for e in errors.values()), errors
    assert out.dtype == dtype and out.shape == q.shape


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("h_q,h_kv", GQA, ids=[f"gqa{q // kv}" for q, kv in GQA])
def test_triton_equals_per_document_attention(h_q, h_kv, causal):
    _check(LENGTHS, h_q, h_kv, 32, causal)


def test_plain_grid_schedule_and_odd_head_dim():
    # head dim 40 pads to a 64-wide block; the plain grid runs one program per tile and head
    _check([3, 31, 32, 33, 1], 4, 2, 40, causal=True, schedule="grid")


def test_single_long_document_and_fp16():
    _check([100], 2, 1, 32, causal=True, dtype=torch.float16, tol=2e-3)  # fp16 rounding, not the kernel


def test_sdpa_backend_and_auto_on_the_cpu():
    q, k, v, cu = _pack(LENGTHS, 4, 2, 16)
    assert resolve_backend("auto", q) == "sdpa"
    out = varlen_attention(q, k, v, cu, max(LENGTHS), causal=True, backend="auto")
    assert _rel(out, attention_reference(q, k, v, cu)) < 1e-5


def test_empty_pack_keeps_the_graph():
    q, k, v, _ = _pack([], 2, 2, 16)
    out = varlen_attention(q, k, v, torch.zeros(1, dtype=torch.int32), 0, backend="triton")
    assert out.shape == (0, 2, 16)
    out.sum().backward()  # no error: an empty micro-batch still runs backward
    assert k.grad is not None and float(k.grad.abs().sum()) == 0.0


def test_mistakes_name_the_fix():
    q, k, v, cu = _pack([4, 4], 3, 2, 16)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 KV heads"):
        varlen_attention(q, k, v, cu, 4)
    q, k, v, cu = _pack([4, 4], 2, 2, 16)
    with pytest.raises(ValueError, match="not one of auto, triton, flash, sdpa"):
        varlen_attention(q, k, v, cu, 4, backend="fast")
    with pytest.raises(ValueError, match="'flash' needs flash-attn|'flash' runs fp16/bf16 on CUDA"):
        varlen_attention(q, k, v, cu, 4, backend="flash")
    q, k, v, cu = _pack([4, 4], 2, 2, 160)
    with pytest.raises(ValueError, match="head dims up to 128"):
        varlen_attention(q, k, v, cu, 4, backend="triton")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("h_q,h_kv", [(8, 8), (16, 4)])
def test_gpu_bf16_triton_against_fp32_reference(h_q, h_kv):
    lengths = [1, 100, 777, 64, 2048, 3]
    q, k, v, cu = _pack(lengths, h_q, h_kv, 128, torch.bfloat16, device="cuda")
    out = varlen_attention(q, k, v, cu, max(lengths), causal=True, backend="triton")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = attention_reference(q32, k32, v32, cu)
    want = torch.autograd.grad(ref, (q32, k32, v32), grad.float())
    assert _rel(out, ref) < 2e-2 and all(_rel(a, b) < 3e-2 for a, b in zip(got, want))


@cuda
def test_gpu_triton_matches_flash_attn():
    pytest.importorskip("flash_attn")
    lengths = [513, 7, 1024, 300]
    q, k, v, cu = _pack(lengths, 16, 4, 64, torch.bfloat16, device="cuda")
    ours = varlen_attention(q, k, v, cu, max(lengths), backend="triton")
    flash = varlen_attention(q, k, v, cu, max(lengths), backend="flash")
    assert _rel(ours, flash) < 2e-2
