"""A GPipe / 1F1B pipeline executor with *consistent cuts* where other work can join in.

torch.distributed.pipelining's schedules fuse a stage's sends with its next receive and wait
on both, so a collective that spans pipeline stages (the multiplexing runtime's encoder
chunks) cannot be placed inside them without deadlock. This executor runs one stage per rank
with its own program and posts every send as soon as its tensor exists, so a rank only ever
waits for data. Cut k is a point in every stage's program where the executed prefixes fit
together (a consistent cut): stage 0 is about to run micro-batch k's forward, stage s is about
to receive micro-batch k - s, and every stage has finished the backwards of micro-batches
<= k - pp (1F1B; none under GPipe). Nothing in a prefix waits for anything after another
stage's cut, so a callback that runs a collective over all ranks at cut k cannot deadlock.
Cut k of a stage with k < s is at the start of the step.

Stage modules take the previous stage's activation (a placeholder on the first stage) and
return the next activation, or on the last stage the micro-batch's loss, already scaled as
the caller wants it summed (no averaging here).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

EXECUTOR_SCHEDULES = ("gpipe", "1f1b")


def stage_program(schedule: str, stage: int, num_stages: int, n_micro: int) -> list[tuple[str, int]]:
    """The ordered ("cut", k) / ("f", i) / ("b", i) actions of ``stage``. 1F1B: pp - s - 1
    warm-up forwards, then alternating forward and backward, then the remaining backwards."""
    if schedule not in EXECUTOR_SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {', '.join(EXECUTOR_SCHEDULES)}")
    if schedule == "gpipe":
        order = [("f", i) for i in range(n_micro)] + [("b", i) for i in range(n_micro)]
    else:
        warm = min(n_micro, num_stages - stage - 1)
        order = [("f", i) for i in range(warm)]
        for i in range(warm, n_micro):
            order += [("f", i), ("b", i - warm)]
        order += [("b", i) for i in range(n_micro - warm, n_micro)]
    program = [("cut", k) for k in range(min(stage, n_micro))]
    for action in order:
        if action[0] == "f" and action[1] + stage < n_micro:
            program.append(("cut", action[1] + stage))
        program.append(action)
    return program


class PipelineExecutor:
    """Runs one step of ``n_micro`` micro-batches through this rank's stage."""

    def __init__(self, module: nn.Module, stage: int, num_stages: int, schedule: str, group: dist.ProcessGroup,
                 device: torch.device, hidden_size: int, dtype: torch.dtype, timeline=None,
                 defer_grad_sync: bool = False):
        """``group``: the pipeline group (stage i = group rank i). ``timeline``: anything with
        ``span(kind, name)``. ``defer_grad_sync``: an FSDP stage reduces its gradients only in
        the last backward of the step."""
        if schedule not in EXECUTOR_SCHEDULES:
            raise ValueError(f"pipeline schedule {schedule!r} is not one of {', '.join(EXECUTOR_SCHEDULES)}")
        self.module, self.stage, self.num_stages, self.schedule = module, stage, num_stages, schedule
        self.group, self.device, self.hidden_size, self.dtype = group, device, hidden_size, dtype
        self.timeline = timeline
        self.defer_grad_sync = defer_grad_sync
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.prev = None if self.first else dist.get_global_rank(group, stage - 1)
        self.next = None if self.last else dist.get_global_rank(group, stage + 1)
        # Called at each cut k (see the module docstring); set by the caller per step.
        self.on_cut: Optional[Callable[[int], None]] = None

    def run(self, length: int, n_micro: int) -> None:
        """Forward and backward of ``n_micro`` micro-batches whose stage activations are
        [1, length, hidden]."""
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        sends: list = []
        last_b = n_micro - 1
        for kind, i in stage_program(self.schedule, self.stage, self.num_stages, n_micro):
            if kind == "cut":
                if self.on_cut is not None:
                    self.on_cut(i)
            elif kind == "f":
                x = self._recv(length, self.prev).requires_grad_(True) if not self.first else \
                    torch.zeros(1, device=self.device)
                with self._span(f"forward mb{i}"):
                    out = self.module(x)
                inputs[i], outputs[i] = x, out
                if not self.last:
                    sends.append(dist.isend(out.detach().contiguous(), self.next, group=self.group))
            else:
                out = outputs.pop(i)
                grad = None if self.last else self._recv(length, self.next)
                self._set_grad_sync(i == last_b)
                with self._span(f"backward mb{i}"):
                    if self.last:
                        out.backward()
                    else:
                        torch.autograd.backward(out, grad)
                x = inputs.pop(i)
                if not self.first:
                    g = x.grad if x.grad is not None else torch.zeros_like(x)
                    sends.append(dist.isend(g.contiguous(), self.prev, group=self.group))
        for work in sends:
            work.wait()

    def _recv(self, length: int, src: int) -> torch.Tensor:
        buf = torch.empty(1, length, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(buf, src, group=self.group)
        return buf

    def _span(self, name: str):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span("llm", f"stage{self.stage} {name}")

    def _set_grad_sync(self, last: bool) -> None:
        """FSDP reduces a stage's gradients in every backward unless told to wait for the last."""
        if self.defer_grad_sync and hasattr(self.module, "set_requires_gradient_sync"):
            self.module.set_requires_gradient_sync(last)
