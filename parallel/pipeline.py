"""The zero-bubble pipeline schedule, on torch.distributed.pipelining (GPipe, 1F1B and
interleaved 1F1B run on Omni's executor, ``parallel.pipeline_executor``, which can host encoder
work at its cuts; torch's fused sends and receives cannot).

Stages are placed "looped" (``parallel.pipeline_schedule.stage_ids``): with ``pp`` ranks and
``v`` model chunks per rank, rank r runs stages r, r + pp, r + 2*pp, ...

Inputs: torch's stages call a module with the previous stage's activation only, so each chunk
gets its micro-batch's inputs from a forward pre-hook that hands it ``inputs[i]`` and the step's
log at its i-th call (every schedule runs a stage's forwards in micro-batch order); the model
itself takes them as arguments, as under the executor.

Shapes: torch's stages allocate receive buffers from fixed activation shapes. Packed rows
vary in length from step to step, so the caller pads a step's micro-batches to one length
(``parallel.rows.row_lengths(one_shape=True)``) and schedules are built per (length,
micro-batch count) and cached. Omni's executor (``parallel.pipeline_executor``) takes a length
per micro-batch instead.

Point-to-point traffic is torch's: its runtime issues unbatched isend / irecv on the one
pipeline group, each receive placed by its planner where the matching send goes, so every
rank issues its operations in one global order; tests/parallel/test_pipeline_p2p.py replays
the order of the schedule built here under nccl's rules (a send completes only when the
receive is posted, one group's operations in issue order) and finds it pairs and completes.
Omni cannot batch it or split its groups without rewriting torch's runtime.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble

SCHEDULES = {"zero_bubble": ScheduleInterleavedZeroBubble}  # the rest run on Omni's executor
CACHED_SCHEDULES = 4


class PipelineRunner:
    """Runs one step's micro-batches through this rank's stages with the chosen schedule."""

    def __init__(self, modules: Sequence[nn.Module], ids: Sequence[int], num_stages: int, schedule: str,
                 group: dist.ProcessGroup, device: torch.device, hidden_size: int, dtype: torch.dtype,
                 timeline=None):
        """``timeline``: anything with ``span(kind, name)`` (a context manager); each stage's
        forward and backward computations are recorded as "llm" spans, so the time between
        them is what the rank spent waiting (bubbles, activation transfers)."""
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
        if len(modules) < 2:
            raise ValueError(f"pipeline schedule {schedule} runs several stages per rank, not {len(modules)}")
        self.modules, self.ids, self.num_stages = list(modules), list(ids), num_stages
        self.schedule_name, self.group, self.device = schedule, group, device
        self.hidden_size, self.dtype = hidden_size, dtype
        self.timeline = timeline
        # Least recently used schedules are dropped first: each holds its stages' receive
        # buffers, so only a few row lengths are kept.
        self._cache: OrderedDict[tuple[int, int], object] = OrderedDict()
        self._step: Optional[tuple[Sequence, object]] = None  # (inputs, log) of the running step
        self._calls = [0] * len(self.modules)
        for c, module in enumerate(self.modules):
            module.register_forward_pre_hook(functools.partial(self._feed, c), with_kwargs=True)

    def _feed(self, c: int, module: nn.Module, args: tuple, kwargs: dict):
        """Chunk c's i-th call of the step gets micro-batch i's inputs and the step's log."""
        if self._step is None or len(args) != 1:
            return None  # not called by the schedule (evaluation): as the caller called it
        inputs, log = self._step
        i = self._calls[c]
        if i >= len(inputs):
            raise RuntimeError(f"pipeline stage {self.ids[c]} ran more forwards than the step's {len(inputs)} "
                               "micro-batches")
        self._calls[c] += 1
        return (args[0], inputs[i], log), kwargs

    def _schedule(self, length: int, n_micro: int):
        key = (length, n_micro)
        if key in self._cache:
            self._cache.move_to_end(key)
        else:
            while len(self._cache) >= CACHED_SCHEDULES:
                self._cache.popitem(last=False)
            # requires_grad: torch sends gradients back only for activations that want them.
            act = torch.empty(1, length, self.hidden_size, dtype=self.dtype, device="meta", requires_grad=True)
            stages = []
            for module, sid in zip(self.modules, self.ids):
                first, last = sid == 0, sid == self.num_stages - 1
                inp = torch.empty(1, device="meta") if first else act
                out = torch.empty((), dtype=torch.float32, device="meta") if last else act
                stage = PipelineStage(module, sid, self.num_stages, self.device, input_args=(inp,),
                                      output_args=(out,), group=self.group)
                if self.timeline is not None:
                    _time_stage(stage, self.timeline, sid)
                stages.append(stage)
            cls = SCHEDULES[self.schedule_name]
            # The last stage returns each micro-batch's loss already divided by the global target
            # count, so the schedule must neither average nor rescale gradients.
            loss_fn: Callable = _identity_loss
            self._cache[key] = cls(stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)
        return self._cache[key]

    def run(self, programs: Sequence, lengths: Sequence[int], inputs: Sequence, log=None, at_cut=None,
            at_tail=None) -> None:
        """Forward and backward of ``len(lengths)`` micro-batches, all [1, lengths[0], hidden]
        between stages (one shape: ``parallel.rows.row_lengths(one_shape=True)``); the same
        call as the executor's. torch's schedule has no programs of Omni's and no cuts:
        ``programs`` must be empty and ``at_cut`` / ``at_tail`` None (the multiplexer inserts
        no work here: ``omni.multiplex.runtime``)."""
        if programs or at_cut is not None or at_tail is not None:
            raise ValueError(f"the {self.schedule_name} schedule has no cuts for other work")
        if len(set(lengths)) > 1:
            raise ValueError(f"the {self.schedule_name} schedule takes one activation shape per step, not {sorted(set(lengths))}")
        n_micro = len(lengths)
        schedule = self._schedule(lengths[0], n_micro)
        # One placeholder scalar per micro-batch (the schedule splits along dim 0); the stage
        # modules get their real inputs from ``_feed``.
        kwargs = {"return_outputs": False}
        if self.num_stages - 1 in self.ids:
            kwargs.update(target=torch.zeros(n_micro, device=self.device), losses=[])
        args = (torch.zeros(n_micro, device=self.device),) if 0 in self.ids else ()
        self._step, self._calls = (inputs, log), [0] * len(self.modules)
        try:
            schedule.step(*args, **kwargs)
        finally:
            self._step = None


def _time_stage(stage: PipelineStage, timeline, sid: int) -> None:
    """Record the stage's computations (not its waits) as "llm" spans of ``timeline``."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        inner = getattr(stage, name, None)
        if inner is None:
            continue

        def timed(*args, _inner=inner, _name=name, **kwargs):
            with timeline.span("llm", f"stage{sid} {_name.split('_')[0]} mb{args[0] if args else ''}"):
                return _inner(*args, **kwargs)

        setattr(stage, name, timed)


def _identity_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output
