"""Per-modality projector: encoder width -> LLM width."""
from __future__ import annotations

import torch
from torch import nn

ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}


class Projector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, hidden_mult: float = 1.0, activation: str = "gelu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"projector activation '{activation}' is unknown; use one of {sorted(ACTIVATIONS)}")
        hidden = max(1, int(round(out_dim * hidden_mult)))
        self.fc1 = nn.Linear(in_dim, hidden)
        self.act = ACTIVATIONS[activation]()
        self.fc2 = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
