"""Helpers shared by the model tests."""
from __future__ import annotations

import torch


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Fresh models have norms at 1 and biases at 0; perturb them so a dropped norm or bias
    would show, and make routing decisive (no near-ties between experts)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "router" in name or name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    return model


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()
