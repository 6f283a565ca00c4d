"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine schedule."""
from __future__ import annotations

import math

import torch
from torch import nn

from omni.runtime.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters, in groups that each hold one kind of tensor.

    torch runs AdamW's foreach kernels by default on CUDA, and a foreach op refuses a list that
    mixes DTensors with plain tensors ("got mixed torch.Tensor and DTensor"): a part whose
    norms stay plain beside tensor-parallel DTensor weights (tp > 1 without FSDP) would crash on
    its first GPU step. So sharded and plain parameters never share a group; each group keeps
    torch's per-device default (foreach on CUDA; on the CPU the per-parameter loop, which is
    also the faster one for DTensors there: foreach's sharding propagation costs more)."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple[bool, bool], list] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        # Norm gains, biases and other vectors are not decayed (standard for transformers).
        groups.setdefault((p.ndim >= 2, isinstance(p, DTensor)), []).append(p)
    param_groups = [{"params": params, "weight_decay": cfg.weight_decay if decay else 0.0}
                    for (decay, sharded), params in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]
    return torch.optim.AdamW(param_groups or [{"params": []}], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


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
