"""Per-modality projector: encoder width -> LLM width, optionally merging neighbouring tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}
NORMS = ("layer", "rms")


class Projector(nn.Module):
    """fc2(act(fc1(x))). With ``merge`` k > 1 (an encoder's ``tokens_per_row``), each group of
    k consecutive encoder tokens (the encoder emits neighbours together) becomes one row:
    normed (``norm``: LayerNorm, or RMSNorm as Qwen2.5-VL's merger), concatenated, then the
    MLP, as Qwen2-VL's patch merger does. ``hidden``: the MLP's width (default: ``hidden_mult``
    x ``out_dim``; a checkpoint's merger sets it exactly)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_mult: float = 1.0, activation: str = "gelu",
                 merge: int = 1, norm: str = "layer", hidden: Optional[int] = None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"projector activation '{activation}' is unknown; use one of {sorted(ACTIVATIONS)}")
        if merge < 1:
            raise ValueError(f"projector merge must be >= 1 tokens per row, got {merge}")
        if norm not in NORMS:
            raise ValueError(f"projector norm '{norm}' is unknown; use one of {NORMS}")
        self.merge = merge
        if merge > 1:
            self.norm = nn.LayerNorm(in_dim, eps=1e-6) if norm == "layer" else nn.RMSNorm(in_dim, eps=1e-6)
        hidden = hidden if hidden is not None else max(1, int(round(out_dim * hidden_mult)))
        self.fc1 = nn.Linear(in_dim * merge, hidden)
        self.act = ACTIVATIONS[activation]()
        self.fc2 = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor, sizes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``sizes``: the items' sizes (``EncoderAnchor.new_projector``'s call contract); this
        projector works token by token and does not read them."""
        if self.merge > 1:
            if x.shape[0] % self.merge:
                raise ValueError(f"projector: {x.shape[0]} encoder tokens do not make rows of {self.merge}")
            x = self.norm(x).reshape(x.shape[0] // self.merge, x.shape[1] * self.merge)
        return self.fc2(self.act(self.fc1(x)))


@dataclass
class PretrainedProjector:
    """A projector an encoder's checkpoint holds (Qwen-VL's patch merger): its shape, and for
    each of the ``Projector``'s tensors the checkpoint's name."""

    out_dim: int
    hidden: int
    activation: str = "gelu"
    norm: str = "layer"
    names: dict[str, str] = field(default_factory=dict)  # our tensor name -> the checkpoint's
