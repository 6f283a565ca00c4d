"""Pipeline parallelism on torch.distributed.pipelining: stage placement and schedules.

Stages are placed "looped": with ``pp`` ranks and ``v`` model chunks per rank, rank r runs
stages r, r + pp, r + 2*pp, ... This is what the interleaved and zero-bubble schedules expect
(and the plain ones with v = 1).

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

from collections import OrderedDict
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")
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
        if (schedule in MULTI_STAGE) != (len(modules) > 1):
            raise ValueError(f"pipeline schedule {schedule} with {len(modules)} stage(s) per rank: interleaved "
                             f"schedules need several, gpipe/1f1b exactly one")
        self.modules, self.ids, self.num_stages = list(modules), list(ids), num_stages
        self.schedule_name, self.group, self.device = schedule, group, device
        self.hidden_size, self.dtype = hidden_size, dtype
        self.timeline = timeline
        # Least recently used schedules are dropped first: each holds its stages' receive
        # buffers, so only a few row lengths are kept.
        self._cache: OrderedDict[tuple[int, int], object] = OrderedDict()

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
            arg = stages if self.schedule_name in MULTI_STAGE else stages[0]
            self._cache[key] = cls(arg, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)
        return self._cache[key]

    def run(self, length: int, n_micro: int) -> None:
        """Forward and backward of ``n_micro`` micro-batches whose stage activations are
        [1, length, hidden]. The stage modules read their inputs themselves (see the caller)."""
        schedule = self._schedule(length, n_micro)
        # One placeholder scalar per micro-batch (the schedule splits along dim 0); the stage
        # modules read their real inputs themselves (see the caller).
        kwargs = {"return_outputs": False}
        if self.num_stages - 1 in self.ids:
            kwargs.update(target=torch.zeros(n_micro, device=self.device), losses=[])
        args = (torch.zeros(n_micro, device=self.device),) if 0 in self.ids else ()
        schedule.step(*args, **kwargs)


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
