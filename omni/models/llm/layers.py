"""Building blocks of the decoder: RMSNorm, GQA attention and the pre-norm block (the SwiGLU MLP is in mlp.py).

Projections stay separate ``nn.Linear`` modules named as in HF checkpoints (q_proj, k_proj, ...):
the checkpoint mapping is then a prefix change, and tensor parallelism can shard q/k/v/gate/up
column-wise and o/down row-wise without splitting fused weights.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from omni.kernels.segment_attention import segment_attention

from ..attention import ContextParallelSegments, PackedSegments
from ..recompute import recompute
from .config import DecoderConfig
from .kv_cache import LayerCache
from .mlp import MLP
from .moe import MoE
from .rope import apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        """Unit gains. Materialising from the meta device calls this on a host copy
        (omni/models/materialize.py); without it, a norm inside an encoder made the whole
        encoder be built afresh on the host for each of its norms (minutes for a 670M tower)."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16 mean-of-squares loses too much), scale in the input dtype, as HF does.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    """Causal self-attention with grouped KV heads; packed rows are separated by ``segment_ids``
    (or the attention is described by a ``ContextParallelSegments``, a ``PackedSegments``, or in
    generation a ``LayerCache`` that also holds the earlier tokens' keys)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.resolved_head_dim()
        h, qkv_bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=config.o_proj_bias())
        # Qwen3's QK-norm: one gain over head_dim shared by every head (so a tensor-parallel shard
        # of the heads holds all of it, and its gradient is summed over the TP ranks).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm() else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm() else None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: Tuple[torch.Tensor, torch.Tensor],
        segment_ids: Optional[torch.Tensor],
    ) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts come from the weights, so a tensor-parallel shard (fewer local heads) works too.
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            # In the projections' dtype: an fp32 gain on a bf16 (autocast) head would make q and k
            # fp32 beside a bf16 v.
            q, k = self.q_norm(q).to(q.dtype), self.k_norm(k).to(k.dtype)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = apply_rotary(q, k, *cos_sin)
        if isinstance(segment_ids, (ContextParallelSegments, PackedSegments, LayerCache)):  # CP / varlen / KV cache
            out = segment_ids.attend(q, k, v, scale=self.head_dim**-0.5)
        else:
            out = segment_attention(q, k, v, segment_ids, causal=True, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DecoderBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). The MLP is an ``MoE``
    on sparse layers (see ``DecoderConfig.is_moe_layer``) and a dense ``MLP`` elsewhere."""

    def __init__(self, config: DecoderConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.mlp = MoE(config) if self.is_moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: Tuple[torch.Tensor, torch.Tensor],
        segment_ids,
        token_mask: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns (hidden, aux_loss); aux_loss is None on dense layers. ``token_mask`` marks the
        real tokens (MoE router statistics leave padding out)."""
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, segment_ids)
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            out, aux = self.mlp(h, token_mask)
            return x + out, aux
        return x + self.mlp(h), None


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the hidden state whose backward also sends ``weight`` into the aux loss, so
    a router loss computed on any pipeline stage is trained without reaching the last stage's
    loss (Megatron's MoEAuxLossAutoScaler idea)."""

    @staticmethod
    def forward(ctx, hidden, aux, weight: float):
        ctx.weight = weight
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


def attach_aux_loss(hidden: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
    return _AttachAuxLoss.apply(hidden, aux, weight)


def run_block(block: DecoderBlock, h, cos_sin, segments, token_mask, mode: str = "none"):
    """One block, with activation checkpointing ``mode``: none | selective | full."""
    return recompute(block, h, cos_sin, segments, token_mask, mode=mode)
