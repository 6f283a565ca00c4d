"""The pre-norm transformer layer that the CLIP and SigLIP vision towers share.

Both towers run the same layer: LayerNorm, bidirectional multi-head attention (q/k/v/out
projections with biases, scores scaled by head_dim**-0.5), residual, LayerNorm, a two-layer
MLP, residual. They differ only in what surrounds the stack (embeddings, the norms before and
after it) and in the MLP's activation, which the config names. Parameter names are those of
transformers' ``CLIPEncoderLayer`` / ``SiglipEncoderLayer`` (``layer_norm1``, ``self_attn.q_proj``,
``mlp.fc1``, ...), so a checkpoint loads key by key.

The config passed in needs ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_hidden_layers``, ``hidden_act`` and ``layer_norm_eps``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omni.models.encoders.blocks import AttentionSpec, activation, packed_self_attention


class ViTMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.act = activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTAttention(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, attention: AttentionSpec) -> torch.Tensor:
        return packed_self_attention(x, self.q_proj, self.k_proj, self.v_proj, self.out_proj, self.num_heads, attention)


class ViTLayer(nn.Module):
    """One pre-norm layer on packed tokens x [T, D]; ``attention`` keeps items apart."""

    def __init__(self, config: Any):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ViTAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ViTMLP(config)

    def forward(self, x: torch.Tensor, attention: AttentionSpec) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), attention)
        return x + self.mlp(self.layer_norm2(x))


class ViTLayers(nn.Module):
    """``layers``: the stack, under the name transformers gives it (``encoder.layers.N``)."""

    def __init__(self, config: Any):
        super().__init__()
        self.layers = nn.ModuleList(ViTLayer(config) for _ in range(config.num_hidden_layers))
