"""Per-modality projector: encoder width -> LLM width, optionally merging neighbouring tokens."""
from __future__ import annotations

import torch
from torch import nn

ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}


class Projector(nn.Module):
    """fc2(act(fc1(x))). With ``merge`` k > 1 (an encoder's ``tokens_per_row``), each group of
    k consecutive encoder tokens (the encoder emits neighbours together) becomes one row:
    layer-normed, concatenated, then the MLP, as Qwen2-VL's patch merger does."""

    def __init__(self, in_dim: int, out_dim: int, hidden_mult: float = 1.0, activation: str = "gelu",
                 merge: int = 1):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"projector activation '{activation}' is unknown; use one of {sorted(ACTIVATIONS)}")
        if merge < 1:
            raise ValueError(f"projector merge must be >= 1 tokens per row, got {merge}")
        self.merge = merge
        if merge > 1:
            self.norm = nn.LayerNorm(in_dim, eps=1e-6)
        hidden = max(1, int(round(out_dim * hidden_mult)))
        self.fc1 = nn.Linear(in_dim * merge, hidden)
        self.act = ACTIVATIONS[activation]()
        self.fc2 = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merge > 1:
            if x.shape[0] % self.merge:
                raise ValueError(f"projector: {x.shape[0]} encoder tokens do not make rows of {self.merge}")
            x = self.norm(x).reshape(x.shape[0] // self.merge, x.shape[1] * self.merge)
        return self.fc2(self.act(self.fc1(x)))
