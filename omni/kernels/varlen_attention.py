"""``varlen_attention``: attention over packed documents, q [T, H_q, D], k/v [T, H_kv, D],
documents delimited by ``cu_seqlens``; each document attends only within itself, so a pack
costs sum(L_i^2), not (sum L_i)^2.

Backends:

- ``"triton"``: the kernels of ``omni.kernels._attention_triton`` (forward and backward,
  online softmax, GQA, fp16/bf16 on GPU and fp32; head dims up to 128), scheduled by cost
  (``schedule="cost"``: persistent programs over the tiles longest first) or on a plain grid
  (``schedule="grid"``, for comparison). On the CPU it needs ``TRITON_INTERPRET=1`` (tests).
- ``"flash"``: flash-attn's ``flash_attn_varlen_func`` (optional extra, GPU, fp16/bf16).
- ``"sdpa"``: PyTorch's scaled-dot-product attention with a block-diagonal mask (any device).
- ``"auto"``: flash if installed and applicable, else triton on CUDA, else sdpa.
"""
from __future__ import annotations

import math
import os

import torch

from omni.kernels.tiles import build_tiles

BACKENDS = ("auto", "triton", "flash", "sdpa")
SCHEDULES = ("cost", "grid")


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     causal: bool = True, backend: str = "auto", scale: float | None = None,
                     schedule: str = "cost") -> torch.Tensor:
    """Attention of every document of the pack with itself -> [T, H_q, D] (differentiable).
    ``max_seqlen``: the longest document (host int; flash-attn needs it). ``scale``: default
    D**-0.5."""
    _check(q, k, v, cu_seqlens, backend, schedule)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    chosen = resolve_backend(backend, q)
    if q.shape[0] == 0:
        return q.new_zeros(q.shape) + 0.0 * (k.sum() + v.sum())  # keeps the graph: an empty pack
    if chosen == "flash":
        from flash_attn import flash_attn_varlen_func

        cu = cu_seqlens.to(torch.int32)
        return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal)
    if chosen == "triton":
        if not q.is_cuda and q.dtype == torch.bfloat16:
            # Interpreted (the CPU under CUDA's rules): the interpreter's bf16 arithmetic is wrong,
            # so the kernel runs on fp32 copies; on a GPU it reads bf16 and accumulates in fp32.
            out = triton_varlen_fwd(q.float(), k.float(), v.float(), cu_seqlens, causal, scale, schedule)[0]
            return out.to(q.dtype)
        return triton_varlen_fwd(q, k, v, cu_seqlens, causal, scale, schedule)[0]
    return sdpa_varlen(q, k, v, cu_seqlens, causal, scale)


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The backend ``backend`` stands for on ``q``'s device and dtype (raises if it cannot run)."""
    if backend == "auto":
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and _has("flash_attn"):
            return "flash"
        if q.is_cuda and _has("triton") and q.shape[-1] <= 128:
            return "triton"
        return "sdpa"
    if backend == "flash":
        if not _has("flash_attn"):
            raise ValueError("attention backend 'flash' needs flash-attn (pip install -e '.[flash]', GPU only); "
                             "use model.attn_backend=auto")
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention backend 'flash' runs fp16/bf16 on CUDA, got {q.dtype} on {q.device}; "
                             f"use model.attn_backend=auto")
    if backend == "triton":
        if not _has("triton"):
            raise ValueError("attention backend 'triton' needs triton (pip install -e '.[triton]'); "
                             "use model.attn_backend=auto")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention backend 'triton' runs on CUDA (or on the CPU under TRITON_INTERPRET=1, "
                             "for tests); use model.attn_backend=auto")
        if q.shape[-1] > 128:
            raise ValueError(f"attention backend 'triton' supports head dims up to 128, got {q.shape[-1]}")
    return backend


def sdpa_varlen(q, k, v, cu_seqlens, causal: bool, scale: float) -> torch.Tensor:
    """The PyTorch path: the pack as one row of SDPA with a block-diagonal (and causal) mask,
    bucketed by length (``omni.kernels.segment_attention``)."""
    from omni.kernels.segment_attention import segment_attention, segment_ids_from_cu_seqlens

    seg = segment_ids_from_cu_seqlens(cu_seqlens, q.shape[0])
    out = segment_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], seg[None],
                            causal=causal, scale=scale)
    return out[0].transpose(0, 1)


def _check(q, k, v, cu_seqlens, backend, schedule) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"attention schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"varlen_attention: q [T, H_q, D] and k, v [T, H_kv, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        # The dtype policy keeps q, k and v in the projections' dtype (omni.models.llm.rope.apply_rotary).
        raise ValueError(f"varlen_attention: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("varlen_attention: cu_seqlens must be a 1-D int32/int64 tensor [n_docs + 1]")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------------------------------------
# the Triton backend


def _blocks(q: torch.Tensor) -> tuple[int, int]:
    """(block rows, programs of a persistent grid). Interpreted (CPU tests): big blocks and few
    programs, since the interpreter pays per block; on a GPU 64-row blocks, two programs per SM."""
    if not q.is_cuda:
        return 32, 4
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return 64, 2 * sms


def _unit_last_dim(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any token and head strides (a transposed or sliced q/k/v is read in
    place, no copy) but read the head dims of a row contiguously."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _meta(q: torch.Tensor, causal: bool, block: int) -> dict:
    d = q.shape[-1]
    return dict(CAUSAL=causal, BLOCK_M=block, BLOCK_N=block, BLOCK_D=max(16, triton_next_pow2(d)),
                IEEE=q.dtype == torch.float32, num_warps=4 if d <= 64 else 8, num_stages=2)


# The Triton backend is a torch.library custom op, not an autograd.Function, so that the
# forward is one named op to whatever dispatches below autograd: selective activation
# checkpointing (omni.models.recompute) names it to keep its output instead of running the
# kernel again in the backward, and torch.compile treats it as one opaque call.
@torch.library.custom_op("omni::varlen_attention_fwd", mutates_args=())
def triton_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                      scale: float, schedule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H_q, D], base-2 log-sum-exp [H_q, T] fp32) of the Triton forward kernel."""
    from omni.kernels import _attention_triton as kern

    q, k, v = _unit_last_dim(q), _unit_last_dim(k), _unit_last_dim(v)
    t, h, d = q.shape
    h_kv = k.shape[1]
    block, programs = _blocks(q)
    cu = cu_seqlens.to(torch.int32)
    q_tiles = build_tiles(cu_seqlens, t, block, block, causal, "q", _order(schedule))
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(h, t, dtype=torch.float32, device=q.device)
    _run(kern.attention_fwd, q_tiles, h, schedule, programs,
         (q, k, v, o, lse, cu, q_tiles.doc, q_tiles.block, q_tiles.order),
         (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *o.stride()[:2], lse.stride(0), scale * kern.LOG2E, h,
          h // h_kv, d), _meta(q, causal, block))
    return o, lse


@triton_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, causal, scale, schedule):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("omni::varlen_attention_bwd", mutates_args=())
def triton_varlen_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool, scale: float,
                      schedule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the Triton backward kernels, from the forward's output and log-sum-exp."""
    from omni.kernels import _attention_triton as kern

    q, k, v = _unit_last_dim(q), _unit_last_dim(k), _unit_last_dim(v)
    # The incoming gradient may arrive in another dtype than the output (a consumer that
    # upcast it); the kernels need one dtype throughout.
    do = _unit_last_dim(do.to(o.dtype))
    t, h, d = q.shape
    h_kv = k.shape[1]
    block, programs = _blocks(q)
    cu = cu_seqlens.to(torch.int32)
    delta = (o.float() * do.float()).sum(-1).transpose(0, 1).contiguous()  # [H, T]
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    meta = _meta(q, causal, block)
    qk_scale = scale * kern.LOG2E
    group = h // h_kv
    strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *do.stride()[:2])
    # The tiles are rebuilt rather than kept from the forward: a few small device ops, and the
    # forward op's outputs stay plain tensors.
    qt = build_tiles(cu, t, block, block, causal, "q", _order(schedule))
    _run(kern.attention_bwd_dq, qt, h, schedule, programs,
         (q, k, v, do, dq, lse, delta, cu, qt.doc, qt.block, qt.order),
         (*strides, *dq.stride()[:2], lse.stride(0), qk_scale, scale, h, group, d), meta)
    kv_tiles = build_tiles(cu, t, block, block, causal, "kv", _order(schedule))
    _run(kern.attention_bwd_dkv, kv_tiles, h_kv, schedule, programs,
         (q, k, v, do, dk, dv, lse, delta, cu, kv_tiles.doc, kv_tiles.block, kv_tiles.order),
         (*strides, *dk.stride()[:2], *dv.stride()[:2], lse.stride(0), qk_scale, scale, h_kv, group, d), meta)
    return dq, dk, dv


@triton_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, causal, scale, schedule):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, causal, scale, schedule = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.causal, ctx.scale, ctx.schedule = causal, scale, schedule
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = triton_varlen_bwd(do, q, k, v, o, lse, cu_seqlens, ctx.causal, ctx.scale, ctx.schedule)
    return dq, dk, dv, None, None, None, None


triton_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def _order(schedule: str) -> str:
    return "cost" if schedule == "cost" else "natural"


def _run(kernel, tiles, heads: int, schedule: str, programs: int, tensors: tuple, scalars: tuple, meta: dict) -> None:
    """Launch ``kernel`` over tiles x heads items: a persistent grid taking items from a
    counter (``cost``), or one program per item (``grid``)."""
    n_items = tiles.bound * heads
    persistent = schedule == "cost"
    device = tensors[0].device
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    grid = (min(programs, n_items) if persistent else n_items,)
    kernel[grid](*tensors, counter, n_items, *scalars, PERSISTENT=persistent, **meta)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))
