"""A pipeline executor (GPipe, 1F1B, interleaved 1F1B) with *consistent cuts* where other work
can join in.

torch.distributed.pipelining's schedules fuse a stage's sends with its next receive and wait
on both, so a collective that spans pipeline stages (the multiplexing runtime's encoder
chunks) cannot be placed inside them without deadlock. This executor runs each rank's own
program of forwards and backwards and posts every send as soon as its tensor exists, so a
rank only ever waits for data.

**Cuts.** Cut k is where encoder chunk k must be ready: on stage 0's rank, just before the
forward of micro-batch k, F(0, k). Every other rank gets cut k at the same moment of the
as-soon-as-possible execution of the programs (forward 1, backward 2 time units): before its
first action that would start no earlier than F(0, k). Inputs end before their consumers
start, so the actions before a cut are closed under "happens before" (program order plus
data): no action before a cut waits for anything after another rank's cut, and a callback that
runs a collective over all ranks at cut k cannot deadlock, whatever the schedule. Placing cuts
by time rather than at the earliest consistent point lets each rank finish the work it can do
anyway before meeting the others (under 1F1B, stage s meets stage 0's F(0, k) while running its
own forward of micro-batch k, not one tick earlier).

**Channels.** Activations and gradients travel on two process groups over the same pipeline
ranks. On each group and each ordered pair of ranks the messages are sent and received in the
same order (the schedules below order a rank's forwards, and its backwards, by one formula for
every rank), so matching by order is safe on gloo and nccl alike, also when a pair carries both
kinds (interleaved stages with pp = 2).

Stage modules take the previous stage's activation (a placeholder on the first stage) and
return the next activation, or on the last stage the micro-batch's loss, already scaled as
the caller wants it summed (no averaging here).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

EXECUTOR_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

Action = tuple[str, int, int]  # ("f" | "b", model chunk, micro-batch), or ("cut", k, -1)


def rank_programs(schedule: str, pp: int, virtual: int, n_micro: int) -> list[list[Action]]:
    """For every pipeline rank, its ordered forward and backward actions (no cuts). Rank r's
    chunk c is global stage c * pp + r (looped placement)."""
    if schedule not in EXECUTOR_SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {', '.join(EXECUTOR_SCHEDULES)}")
    if (schedule == "interleaved_1f1b") != (virtual > 1):
        raise ValueError(f"schedule {schedule} with {virtual} model chunk(s) per rank: interleaved_1f1b needs "
                         f"several, gpipe/1f1b exactly one")
    if schedule == "interleaved_1f1b":
        return [_interleaved(pp, virtual, n_micro, r) for r in range(pp)]
    out = []
    for s in range(pp):
        if schedule == "gpipe":
            order = [("f", 0, i) for i in range(n_micro)] + [("b", 0, i) for i in range(n_micro)]
        else:
            warm = min(n_micro, pp - s - 1)
            order = [("f", 0, i) for i in range(warm)]
            for i in range(warm, n_micro):
                order += [("f", 0, i), ("b", 0, i - warm)]
            order += [("b", 0, i) for i in range(n_micro - warm, n_micro)]
        out.append(order)
    return out


def _interleaved(pp: int, v: int, n_micro: int, rank: int) -> list[Action]:
    """Megatron's interleaved 1F1B: micro-batches in rounds of pp, each round through chunk 0,
    then chunk 1, ... (forwards) and in reverse chunk order (backwards); (pp - rank - 1) * 2 +
    (v - 1) * pp warm-up forwards, then one forward and one backward at a time."""
    if n_micro % pp:
        raise ValueError(f"interleaved_1f1b runs micro-batches in rounds of pp={pp}; got {n_micro}")
    total = n_micro * v

    def step(k: int, forward: bool) -> tuple[int, int]:
        in_round = k % (pp * v)
        chunk = in_round // pp
        return (chunk if forward else v - 1 - chunk), (k // (pp * v)) * pp + k % pp

    warm = total if n_micro == pp else min(total, (pp - rank - 1) * 2 + (v - 1) * pp)
    order = [("f", *step(k, True)) for k in range(warm)]
    for i in range(total - warm):
        order += [("f", *step(warm + i, True)), ("b", *step(i, False))]
    order += [("b", *step(k, False)) for k in range(total - warm, total)]
    return order


FORWARD_TIME, BACKWARD_TIME = 1.0, 2.0  # the model time of place_cuts (a backward ~ two forwards)


def place_cuts(programs: Sequence[Sequence[Action]], pp: int, virtual: int, n_micro: int) -> list[list[Action]]:
    """Insert ("cut", k, -1) into every rank's program (see the module docstring): before its
    first action that would start no earlier than F(0, k) if every action started as soon as
    its rank and its input allowed (forward 1, backward 2 time units)."""
    start = _start_times(programs, pp, virtual)
    t = {i: start[0][pos] for pos, (kind, c, i) in enumerate(programs[0]) if kind == "f" and c == 0}
    out = []
    for r, prog in enumerate(programs):
        with_cuts: list[Action] = []
        k = 0
        for pos, action in enumerate(prog):
            while k < n_micro and start[r][pos] >= t[k]:
                with_cuts.append(("cut", k, -1))
                k += 1
            with_cuts.append(action)
        with_cuts += [("cut", kk, -1) for kk in range(k, n_micro)]
        out.append(with_cuts)
    return out


def _start_times(programs: Sequence[Sequence[Action]], pp: int, virtual: int) -> list[list[float]]:
    """Each action's start in the as-soon-as-possible execution of the programs (raises if
    they deadlock). An action's inputs finish before it starts and durations are positive, so
    the actions starting before any time t form a prefix closed under "happens before": cuts
    placed by time are consistent."""
    last_stage = pp * virtual - 1
    start = [[0.0] * len(p) for p in programs]
    end: dict[tuple[str, int, int], float] = {}  # ("f"/"b", stage, micro-batch) -> end time
    cursor, free = [0] * len(programs), [0.0] * len(programs)
    left = sum(len(p) for p in programs)
    while left:
        progressed = False
        for r, prog in enumerate(programs):
            while cursor[r] < len(prog):
                kind, c, i = prog[cursor[r]]
                stage = c * pp + r
                if kind == "f":
                    dep = ("f", stage - 1, i) if stage > 0 else None
                else:
                    dep = ("b", stage + 1, i) if stage < last_stage else ("f", stage, i)
                if dep is not None and dep not in end:
                    break
                begin = max(free[r], end[dep] if dep is not None else 0.0)
                start[r][cursor[r]] = begin
                free[r] = end[(kind, stage, i)] = begin + (FORWARD_TIME if kind == "f" else BACKWARD_TIME)
                cursor[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline programs deadlock (a bug in the schedule)")
    return start


def encoder_backward_cuts(program0: Sequence[Action], n_micro: int) -> list[Optional[int]]:
    """For micro-batch j, the first cut k at which stage 0 has finished j's backward (its
    embedding gradient is complete), from stage 0's rank's program with cuts; None: only after
    the pipeline (GPipe)."""
    ready: list[Optional[int]] = [None] * n_micro
    finished = set()
    for kind, c, i in program0:
        if kind == "b" and c == 0:
            finished.add(i)
        elif kind == "cut":
            for j in finished:
                if ready[j] is None:
                    ready[j] = c  # c holds k for a cut
    return ready


class PipelineExecutor:
    """Runs one step of ``n_micro`` micro-batches through this rank's stages."""

    def __init__(self, modules: Sequence[nn.Module], stage_ids: Sequence[int], num_stages: int, schedule: str,
                 groups: tuple[dist.ProcessGroup, dist.ProcessGroup], device: torch.device, hidden_size: int,
                 dtype: torch.dtype, timeline=None, defer_grad_sync: bool = False):
        """``modules``: this rank's model chunks, global stages ``stage_ids`` (looped:
        rank r + c * pp). ``groups``: (activations, gradients), both over the pipeline ranks
        (stage rank r = group rank r). ``timeline``: anything with ``span(kind, name)``.
        ``defer_grad_sync``: an FSDP chunk reduces its gradients only in its last backward of
        the step."""
        self.modules, self.stage_ids = list(modules), list(stage_ids)
        self.num_stages, self.schedule = num_stages, schedule
        self.act_group, self.grad_group = groups
        self.pp = dist.get_world_size(self.act_group)
        self.virtual = len(self.modules)
        if num_stages != self.pp * self.virtual or any(s % self.pp != self.stage_ids[0] for s in self.stage_ids):
            raise ValueError(f"stages {self.stage_ids} of {num_stages} are not one looped rank's of pp={self.pp}")
        rank_programs(schedule, self.pp, self.virtual, self.pp)  # validates schedule and chunk count
        self.rank = self.stage_ids[0]
        self.device, self.hidden_size, self.dtype = device, hidden_size, dtype
        self.timeline = timeline
        self.defer_grad_sync = defer_grad_sync
        # Called at each cut k (see the module docstring); set by the caller.
        self.on_cut: Optional[Callable[[int], None]] = None
        self._programs: dict[int, list[list[Action]]] = {}

    def programs(self, n_micro: int) -> list[list[Action]]:
        """Every rank's program with cuts, for ``n_micro`` micro-batches (cached)."""
        if n_micro not in self._programs:
            self._programs[n_micro] = place_cuts(rank_programs(self.schedule, self.pp, self.virtual, n_micro),
                                                 self.pp, self.virtual, n_micro)
        return self._programs[n_micro]

    def encoder_backward_cuts(self, n_micro: int) -> list[Optional[int]]:
        return encoder_backward_cuts(self.programs(n_micro)[0], n_micro)

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.act_group, stage % self.pp)

    def run(self, length: int, n_micro: int) -> None:
        """Forward and backward of ``n_micro`` micro-batches whose stage activations are
        [1, length, hidden]."""
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        sends: list = []
        last = self.num_stages - 1
        for kind, c, i in self.programs(n_micro)[self.rank]:
            if kind == "cut":
                if self.on_cut is not None:
                    self.on_cut(c)
                continue
            stage, module = self.stage_ids[c], self.modules[c]
            if kind == "f":
                x = self._recv(length, self._peer(stage - 1), self.act_group).requires_grad_(True) if stage > 0 \
                    else torch.zeros(1, device=self.device)
                with self._span(f"stage{stage} forward mb{i}"):
                    out = module(x)
                inputs[(c, i)], outputs[(c, i)] = x, out
                if stage < last:
                    sends.append(dist.isend(out.detach().contiguous(), self._peer(stage + 1), group=self.act_group))
            else:
                out = outputs.pop((c, i))
                grad = None if stage == last else self._recv(length, self._peer(stage + 1), self.grad_group)
                self._set_grad_sync(module, i == n_micro - 1)
                with self._span(f"stage{stage} backward mb{i}"):
                    if stage == last:
                        out.backward()
                    else:
                        torch.autograd.backward(out, grad)
                x = inputs.pop((c, i))
                if stage > 0:
                    g = x.grad if x.grad is not None else torch.zeros_like(x)
                    sends.append(dist.isend(g.contiguous(), self._peer(stage - 1), group=self.grad_group))
        for work in sends:
            work.wait()

    def _recv(self, length: int, src: int, group: dist.ProcessGroup) -> torch.Tensor:
        buf = torch.empty(1, length, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(buf, src, group=group)
        return buf

    def _span(self, name: str):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span("llm", name)

    def _set_grad_sync(self, module: nn.Module, last: bool) -> None:
        """FSDP reduces a chunk's gradients in every backward unless told to wait for the last
        (each chunk's backwards run in micro-batch order)."""
        if self.defer_grad_sync and hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(last)
