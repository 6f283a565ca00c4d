"""AdamW with decoupled weight decay on matrices only, per-module settings (``optim.groups``),
and a warmup + cosine schedule."""
from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import nn

from omni.models.freeze import LLM, ModuleNames
from omni.runtime.config import OptimConfig, OptimGroupConfig


def group_settings(groups: Mapping) -> dict[str, OptimGroupConfig]:
    """``optim.groups`` read into ``OptimGroupConfig`` entries; ValueError (one line) naming a
    setting that is not one, or a value out of range. The module names are checked by
    ``GroupPlan`` (they need the model's slots)."""
    out = {}
    for name, entry in (groups or {}).items():
        if isinstance(entry, OptimGroupConfig):
            out[name] = entry
            continue
        entry = dict(entry or {})
        unknown = sorted(set(entry) - {"lr", "weight_decay"})
        if unknown:
            raise ValueError(f"optim.groups.{name}.{unknown[0]}: not a group setting; a group sets lr and/or "
                             "weight_decay (norm gains and biases are never decayed)")
        out[name] = OptimGroupConfig(**entry)
    for name, g in out.items():
        if g.lr is not None and not (g.lr > 0 and math.isfinite(g.lr)):
            raise ValueError(f"optim.groups.{name}.lr={g.lr!r} must be a positive number, e.g. 2e-5")
        if g.weight_decay is not None and not g.weight_decay >= 0:
            raise ValueError(f"optim.groups.{name}.weight_decay={g.weight_decay!r} must be >= 0")
    return out


class GroupPlan:
    """Which ``optim.groups`` entry each parameter follows: the most specific name covering
    its module (``projector.vision`` before ``projectors``); parameters of modules no entry
    names follow ``optim`` itself (group None)."""

    def __init__(self, cfg: OptimConfig, names: ModuleNames):
        self.cfg = cfg
        self.names = names
        self.groups = group_settings(cfg.groups)
        self._covers = {name: names.resolve(f"optim.groups.{name}", [name]) for name in self.groups}
        seen: dict[frozenset, str] = {}
        for name, units in self._covers.items():
            if units in seen:
                raise ValueError(f"optim.groups.{seen[units]} and optim.groups.{name} name the same modules "
                                 f"({names.describe(units)}); keep one")
            seen[units] = name

    def group_of(self, param_name: str) -> str | None:
        unit = self.names.unit_of(param_name)
        covering = [(len(units), name) for name, units in self._covers.items() if unit in units]
        return min(covering)[1] if covering else None

    def peak_lr(self, group: str | None) -> float:
        lr = self.groups[group].lr if group is not None else None
        return self.cfg.lr if lr is None else lr

    def weight_decay(self, group: str | None) -> float:
        wd = self.groups[group].weight_decay if group is not None else None
        return self.cfg.weight_decay if wd is None else wd


def build_optimizer(model: nn.Module, cfg: OptimConfig, names: ModuleNames | None = None) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters, in groups that each hold one kind of tensor
    of one ``optim.groups`` entry (``names``: the model's module names; default read off the
    parameter names).

    torch runs AdamW's foreach kernels by default on CUDA, and a foreach op refuses a list that
    mixes DTensors with plain tensors ("got mixed torch.Tensor and DTensor"): a part whose
    norms stay plain beside tensor-parallel DTensor weights (tp > 1 without FSDP) would crash on
    its first GPU step. So sharded and plain parameters never share a group; each group keeps
    torch's per-device default (foreach on CUDA; on the CPU the per-parameter loop, which is
    also the faster one for DTensors there: foreach's sharding propagation costs more)."""
    from torch.distributed.tensor import DTensor

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = GroupPlan(cfg, names or ModuleNames.of_parameters(n for n, _ in named))
    groups: dict[tuple[str, bool, bool], list] = {}
    for name, p in named:
        # Norm gains, biases and other vectors are not decayed (standard for transformers).
        group = plan.group_of(name)
        groups.setdefault((group or "", p.ndim >= 2, isinstance(p, DTensor)), []).append(p)
    param_groups = [{"params": params, "lr": plan.peak_lr(group or None),
                     "weight_decay": plan.weight_decay(group or None) if decay else 0.0}
                    for (group, decay, sharded), params in sorted(groups.items(),
                                                                  key=lambda kv: (kv[0][0], not kv[0][1], kv[0][2]))]
    return torch.optim.AdamW(param_groups or [{"params": []}], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def start_state(opt: torch.optim.Optimizer) -> None:
    """Give every parameter its AdamW state now, as its first update would (step 0, zero
    moments): AdamW's own initialisation, run by one step of zero gradients at lr 0 (which
    leaves every weight as it is), then the step counts set back to 0. A checkpoint then holds
    the state of every parameter, also of one that has not been updated yet (a module waiting
    for its stage, ``trainer.stages``), and loads into any run of the model whatever has
    trained before it."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for state in opt.state.values():
        state["step"].zero_()
    opt.zero_grad(set_to_none=True)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at 0-based `step`: linear warmup, then cosine to `min_ratio`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Every group's lr is its own peak times the same factor (``lr_factor``)."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )


class PartOptimizers:
    """One AdamW and one schedule per model part (a pipeline rank may hold several stage
    chunks). Checkpoint utilities read state per (part, optimizer) pair, keyed by the original
    parameter names, so the parts' states merge into one layout-free checkpoint."""

    def __init__(self, parts: list[nn.Module], cfg: OptimConfig, total_steps: int, names: ModuleNames | None = None):
        self.cfg, self.total_steps = cfg, total_steps
        self.parts = list(parts)
        if names is None:
            names = ModuleNames.of_parameters(n for part in self.parts for n, _ in part.named_parameters())
        self.plan = GroupPlan(cfg, names)
        self.optimizers = [build_optimizer(p, cfg, names) for p in self.parts]
        for opt in self.optimizers:
            start_state(opt)
        self.schedulers = [build_scheduler(o, cfg, total_steps) for o in self.optimizers]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()
        for sched in self.schedulers:
            sched.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def _factor(self) -> float:
        return lr_factor(self.schedulers[0].last_epoch, self.cfg.warmup_steps, self.total_steps, self.cfg.min_lr_ratio)

    @property
    def lr(self) -> float:
        """The LLM's lr of the coming step (the same on every rank, whatever it holds)."""
        return self.plan.peak_lr(self.plan.group_of(LLM + ".")) * self._factor()

    def group_lrs(self) -> dict[str, float]:
        """``lr/<group>`` of each ``optim.groups`` entry for the coming step."""
        factor = self._factor()
        return {f"lr/{name}": self.plan.peak_lr(name) * factor for name in self.plan.groups}

    def scheduler_state(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        """The schedule's position from ``state`` (rank 0's first part's, as saved). Each
        scheduler keeps its own peaks (``base_lrs``: one per parameter group of its part, which
        differ between parts); the groups' current lr came back with the optimizer state."""
        for sched in self.schedulers:
            own = list(sched.base_lrs)
            sched.load_state_dict(state)
            sched.base_lrs = own
            sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
