"""Stage schedules (``trainer.stages``): which modules train at each step.

A stage is a function of the step alone (so a resume in the middle of a stage continues it),
e.g. ``[{steps: 500, train: [projectors]}, {train: [all]}]``: steps 1-500 train the projectors
only, every later step everything ``model.freeze`` leaves.

How a module sits a stage out: it keeps ``requires_grad`` and its place in the optimizer
(the same parameter groups and state keys all run long, so every checkpoint loads in every
stage), computes its gradients, and the trainer drops them (``grad = None``) after the
gradient sync, before the norm and the step. AdamW skips a parameter without a gradient
entirely (no update, no moment update, no weight decay) and the clipping norm leaves it out,
so the modules that train get exactly the update of a run where the others were frozen from
the start. Toggling ``requires_grad`` at the boundaries instead would save those gradients,
but FSDP2, the TP plan, the pipeline executor and the multiplexer (a frozen encoder runs no
backward, and all ranks must agree on it) each read it once, when the model is set up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from torch import nn

from omni.models.freeze import ALL, ModuleNames


@dataclass(frozen=True)
class Stage:
    number: int  # 1-based
    first_step: int
    last_step: int | None  # None: to the end of the run
    train: frozenset[str]  # units (omni.models.freeze)


class StageSchedule:
    def __init__(self, stages: Sequence, names: ModuleNames):
        """``stages``: ``trainer.stages`` entries (``steps``, ``train``), checked by
        ``check_stages``."""
        self.names = names
        self.stages: list[Stage] = []
        first = 1
        for i, s in enumerate(stages):
            last = None if s.steps is None or i == len(stages) - 1 else first + s.steps - 1
            self.stages.append(Stage(i + 1, first, last, names.resolve(f"trainer.stages[{i}].train", s.train, True)))
            first = (last or first) + 1

    def at(self, step: int) -> Stage:
        """The stage of optimizer step ``step`` (1-based)."""
        for stage in self.stages:
            if stage.last_step is None or step <= stage.last_step:
                return stage
        return self.stages[-1]

    def idle(self, stage: Stage, named_params: Iterable[tuple[str, nn.Parameter]]) -> list[nn.Parameter]:
        """The trainable parameters among ``named_params`` that sit ``stage`` out."""
        return [p for name, p in named_params if p.requires_grad and self.names.unit_of(name) not in stage.train]

    def describe(self, stage: Stage, trainable: Iterable[str]) -> str:
        """The log line of a stage's start: its steps, what trains and what waits."""
        trainable = set(trainable)
        steps = f"steps {stage.first_step}-{stage.last_step}" if stage.last_step else f"from step {stage.first_step}"
        waits = trainable - stage.train
        return (f"stage {stage.number}/{len(self.stages)} ({steps}): training {self.names.describe(stage.train & trainable)}"
                + (f"; unchanged: {self.names.describe(waits)}" if waits else ""))


def check_stages(stages: Sequence, names: ModuleNames, frozen: Iterable[str]) -> None:
    """ValueError (one line) for a schedule that cannot run: a stage without a length before
    the last, a length below 1, an unknown module, a stage in which nothing would train."""
    trainable = set(names.units) - set(frozen)
    for i, s in enumerate(stages):
        key = f"trainer.stages[{i}]"
        if s.steps is None and i < len(stages) - 1:
            raise ValueError(f"{key} has no steps: only the last stage may run to the end; give it steps: N")
        if s.steps is not None and (int(s.steps) != s.steps or s.steps < 1):
            raise ValueError(f"{key}.steps={s.steps!r} must be a whole number of optimizer steps >= 1")
        if not s.train:
            raise ValueError(f"{key}.train is empty; list the modules that train in it, or [{ALL}]")
        units = names.resolve(f"{key}.train", s.train, with_all=True)
        if not units & trainable:
            raise ValueError(f"{key}.train={list(s.train)} trains nothing: model.freeze freezes "
                             f"{names.describe(units)} for the whole run")
