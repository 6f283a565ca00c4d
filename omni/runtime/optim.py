"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine schedule."""
from __future__ import annotations

import math

import torch
from torch import nn

from omni.runtime.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        # Norm gains, biases and other vectors are not decayed (standard for transformers).
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at 0-based `step`: linear warmup, then cosine to `min_ratio`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )


class PartOptimizers:
    """One AdamW and one schedule per model part (a pipeline rank may hold several stage
    chunks). Checkpoint utilities read state per (part, optimizer) pair, keyed by the original
    parameter names, so the parts' states merge into one layout-free checkpoint."""

    def __init__(self, parts: list[nn.Module], cfg: OptimConfig, total_steps: int):
        self.parts = list(parts)
        self.optimizers = [build_optimizer(p, cfg) for p in self.parts]
        self.schedulers = [build_scheduler(o, cfg, total_steps) for o in self.optimizers]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()
        for sched in self.schedulers:
            sched.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def scheduler_state(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        for sched in self.schedulers:
            sched.load_state_dict(state)
