"""A pipeline executor (GPipe, 1F1B, interleaved 1F1B) with *consistent cuts* where other work
can join in.

torch.distributed.pipelining's schedules fuse a stage's sends with its next receive and wait
on both, so a collective that spans pipeline stages (the multiplexing runtime's encoder
chunks) cannot be placed inside them without deadlock. This executor runs each rank's own
program of forwards and backwards and posts every send as soon as it is due (see below), so
a rank only ever waits for data.

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

**Tail cuts.** With ``tail_cuts`` the programs also hold the tail cuts of the bubble windows
(``parallel.pipeline_schedule.bubble_windows``): consistent cuts placed the same way at the
end of rank 0's backward of a micro-batch, in the cool-down, where the later ranks have
finished their work and can take back encoder gradients and run encoder backwards without
holding up stage 0 (``on_tail``).

**Messages.** Activations travel on one process group, gradients on a second over the same
pipeline ranks (``groups``). On each group and each ordered pair of ranks the messages are
sent and received in the same order (the schedules below order a rank's forwards, and its
backwards, by one formula for every rank), which is what matching by order needs on gloo and
nccl alike (neither checks which message a receive gets, nccl not even its size).

**Why the sends cannot deadlock.** On nccl a send may not finish before its peer posts the
matching receive, and the operations of one group run one after another in the order they
were issued: two ranks that each put a send ahead of the receive the other one waits for
deadlock. Sending each message as soon as it exists and receiving it just before its use
(what this executor did, and what gloo, which buffers sends, tolerates) does exactly that
whenever a group's traffic runs around the ring of ranks: with interleaved stages stage
pp - 1 sends its activations to stage pp on rank 0 (and stage pp its gradients back), and at
pp = 2 one pair of ranks carries both directions on each group. Per-direction groups
would need four groups for pp = 2 alone and would still not order a rank's traffic across
its peers; the executor orders it instead. ``p2p_programs`` gives every message one key, the
start of the action that receives it in the as-soon-as-possible execution of the programs
(the model ``place_cuts`` uses); each rank issues its operations in key order, in one
``batch_isend_irecv`` per group and key range: before an action, the sends due by its start
and, on the action's group, the receive it needs (that batch waited, the others not); then
the sends due before the next action or cut starts, left in flight while the action runs.
Keys are a global order that respects every rank's program and every dependency, so the
operations with the smallest unfinished key are, on every rank and group, at the head of the
queue and already posted (every rank can reach them), and complete: by induction every
operation does, whatever the real timings. Before cut k every send due before it (its
receiver takes it before its own cut) is posted and every batch in flight waited for
(DRAIN): no point-to-point operation is open while a cut's collectives run. Both gloo and
nccl run the same batches. tests/parallel/test_pipeline_p2p.py replays them under nccl's
rules for every schedule and finds the pairing exact and no deadlock; the same replay of the
former traffic deadlocks for every interleaved case.

Stage modules take the previous stage's activation (a placeholder on the first stage) and
return the next activation, or on the last stage the micro-batch's loss, already scaled as
the caller wants it summed (no averaging here).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from parallel.pipeline_schedule import MARKERS, Action, _start_times, marker_times
from parallel.sizing import frees_after_backward

CHANNELS = ("act", "grad")  # the two process groups of ``PipelineExecutor``, in its ``groups`` order
DRAIN: Action = ("drain", -1, -1)  # wait for every batch still in flight
CACHED_P2P_PROGRAMS = 8


@dataclass(frozen=True)
class P2P:
    """One send or receive: on ``channel``, to or from pipeline rank ``peer``, of the tensor
    that global stage ``stage`` produced for micro-batch ``micro`` and stage ``dest`` takes
    (an activation going to stage + 1, or a gradient going to stage - 1)."""
    send: bool
    channel: str
    peer: int
    stage: int
    dest: int
    micro: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Batch:
    """One ``batch_isend_irecv`` on ``channel``'s group; ``wait``: the rank waits for it
    before going on (it holds the receive of the next action)."""
    channel: str
    ops: tuple[P2P, ...]
    wait: bool


Item = Union[Action, Batch]


def _message_in(kind: str, stage: int, micro: int, last: int) -> Optional[tuple[str, int, int]]:
    """(channel, sending stage, micro-batch) of the tensor an action receives, if any."""
    if kind == "f":
        return ("act", stage - 1, micro) if stage > 0 else None
    return ("grad", stage + 1, micro) if stage < last else None


def _message_out(kind: str, stage: int, micro: int, last: int) -> Optional[tuple[str, int, int]]:
    """(channel, sending stage, micro-batch) of the tensor an action sends, if any."""
    if kind == "f":
        return ("act", stage, micro) if stage < last else None
    return ("grad", stage, micro) if stage > 0 else None


def _receiver(channel: str, stage: int) -> int:
    return stage + 1 if channel == "act" else stage - 1


def p2p_programs(programs: Sequence[Sequence[Action]], pp: int, virtual: int, shapes: Sequence[tuple[int, ...]],
                 dtype: torch.dtype) -> list[list[Item]]:
    """Every rank's program with cuts (``place_cuts``) turned into what the executor issues:
    its actions and cuts with the ``Batch``es and ``DRAIN``s between them, every message of
    micro-batch i a [shapes[i]] tensor of ``dtype`` (see "Why the sends cannot deadlock" in the
    module docstring). Every rank of the pipeline derives the same shapes from the rows it
    holds, so no message carries a size.

    A message's key is the start of the action that receives it in the as-soon-as-possible
    execution (``_start_times``); a rank issues its operations in key order. Before action a:
    on each group one batch of the sends due by a's start plus, on a's group, the receive a
    needs (that batch last and waited, the others not); then, unwaited, the sends due before
    the next action or cut starts. Before cut k (at stage 0's F(0, k) start) or a tail cut
    (``place_cuts``): the sends due before it, then DRAIN. At the end: the rest, then DRAIN."""
    last = pp * virtual - 1
    bare = [[a for a in prog if a[0] not in MARKERS] for prog in programs]
    start = _start_times(bare, pp, virtual)
    key: dict[tuple[str, int, int], float] = {}  # message -> start of the action receiving it
    for r, prog in enumerate(bare):
        for pos, (kind, c, i) in enumerate(prog):
            if (m := _message_in(kind, c * pp + r, i, last)) is not None:
                key[m] = start[r][pos]
    n_micro = sum(1 for kind, c, _ in bare[0] if kind == "f" and c == 0)
    tails = sorted({a[1] for a in programs[0] if a[0] == "tail"})
    mark_time = {mark: t for t, mark in marker_times(bare, pp, virtual, n_micro, tails, start)}
    out = []
    for r, prog in enumerate(programs):
        times = iter(start[r])
        at = [next(times) if a[0] not in MARKERS else mark_time[a] for a in prog] + [float("inf")]
        items: list[Item] = []
        pending: list[tuple[str, int, int]] = []  # produced, not yet posted
        open_batches = False

        def post(until: float, strict: bool, recv: Optional[tuple[str, int, int]] = None) -> None:
            nonlocal open_batches
            due = [m for m in pending if key[m] < until or (not strict and key[m] == until)]
            for m in due:
                pending.remove(m)
            due.sort(key=lambda m: key[m])  # a receiver takes its messages in key order (stable: ties as produced)
            batches = []
            for channel in CHANNELS:
                ops = [P2P(True, ch, _receiver(ch, st) % pp, st, _receiver(ch, st), i, shapes[i], dtype)
                       for ch, st, i in due if ch == channel]
                waited = recv is not None and recv[0] == channel
                if waited:
                    ops.append(P2P(False, channel, recv[1] % pp, recv[1], _receiver(*recv[:2]), recv[2], shapes[recv[2]],
                                   dtype))
                if ops:
                    batches.append(Batch(channel, tuple(ops), waited))
            batches.sort(key=lambda b: b.wait)  # the waited one last: this rank's other sends are out first
            open_batches |= any(not b.wait for b in batches)
            items.extend(batches)

        for pos, action in enumerate(prog):
            kind, c, i = action
            if kind in MARKERS:
                post(at[pos], strict=True)
                if open_batches:
                    items.append(DRAIN)
                    open_batches = False
                items.append(action)
                continue
            stage = c * pp + r
            post(at[pos], strict=False, recv=_message_in(kind, stage, i, last))
            post(at[pos + 1], strict=True)
            items.append(action)
            if (m := _message_out(kind, stage, i, last)) is not None:
                pending.append(m)
        post(float("inf"), strict=True)
        if open_batches:
            items.append(DRAIN)
        out.append(items)
    return out


class PipelineExecutor:
    """Runs one step's micro-batches through this rank's stages, as the step's programs say."""

    def __init__(self, modules: Sequence[nn.Module], stage_ids: Sequence[int], num_stages: int,
                 groups: Optional[tuple[dist.ProcessGroup, dist.ProcessGroup]], device: torch.device,
                 hidden_size: int, dtype: torch.dtype, timeline=None, defer_grad_sync: bool = False,
                 keep_gathered: bool = False):
        """``modules``: this rank's model chunks, global stages ``stage_ids`` (looped:
        rank r + c * pp). ``groups``: (activations, gradients), both over the pipeline ranks
        (stage rank r = group rank r); None for one stage (pp = 1: no messages).
        ``timeline``: anything with ``span(kind, name)``. ``defer_grad_sync``: an FSDP chunk
        reduces its gradients only in its last backward of the step. ``keep_gathered``: FSDP
        chunks whose weights stay gathered after forward (``reshard_after_forward`` false) stay
        gathered after their backwards too, until the step's last: one all-gather per chunk and
        step, as the schedule's memory plan assumes (FSDP2 frees them after every backward by
        default, and would gather them again for the next micro-batch's forward).

        A stage module is called ``module(x, item, log)``: its input activation (a placeholder
        on the first stage), the micro-batch's own inputs (``run``'s ``inputs[i]``) and the
        step's ``log``; it returns the next activation, or on the last stage the loss to
        backpropagate."""
        self.modules, self.stage_ids = list(modules), list(stage_ids)
        self.num_stages = num_stages
        self.groups = dict(zip(CHANNELS, groups)) if groups is not None else {}
        self.pp = dist.get_world_size(groups[0]) if groups is not None else 1
        self.virtual = len(self.modules)
        if num_stages != self.pp * self.virtual or any(s % self.pp != self.stage_ids[0] for s in self.stage_ids):
            raise ValueError(f"stages {self.stage_ids} of {num_stages} are not one looped rank's of pp={self.pp}")
        self.rank = self.stage_ids[0]
        self.device, self.hidden_size, self.dtype = device, hidden_size, dtype
        self.timeline = timeline
        self.defer_grad_sync = defer_grad_sync
        self.keep_gathered = keep_gathered
        self._p2p: OrderedDict[tuple, list[list[Item]]] = OrderedDict()
        self._connected = self.pp == 1

    def p2p_programs(self, programs: Sequence[Sequence[Action]], lengths: Sequence[int]) -> list[list[Item]]:
        """Every rank's actions, cuts and point-to-point batches for ``programs`` (every rank's,
        with cuts: ``parallel.pipeline_schedule.place_cuts``) over micro-batches whose
        activations are [1, lengths[i], hidden]: what ``run`` issues, op for op (the few most
        recent are cached: row lengths change from step to step)."""
        key = (tuple(map(tuple, programs)), tuple(lengths))
        if key in self._p2p:
            self._p2p.move_to_end(key)
        else:
            while len(self._p2p) >= CACHED_P2P_PROGRAMS:
                self._p2p.popitem(last=False)
            self._p2p[key] = p2p_programs(programs, self.pp, self.virtual,
                                          [(1, n, self.hidden_size) for n in lengths], self.dtype)
        return self._p2p[key]

    def run(self, programs: Sequence[Sequence[Action]], lengths: Sequence[int], inputs: Sequence,
            log=None, at_cut: Optional[Callable[[int], None]] = None,
            at_tail: Optional[Callable[[int], None]] = None) -> None:
        """Forward and backward of ``len(lengths)`` micro-batches as ``programs`` order them
        (this rank's is ``programs[rank]``); micro-batch i's stage activations are
        [1, lengths[i], hidden] (each row keeps its own length: ``parallel.rows.row_lengths``)
        and its stage modules take ``inputs[i]`` and ``log``. ``at_cut(k)`` / ``at_tail(j)``
        run at the programs' cuts and tail cuts (the caller's encoder work)."""
        n_micro = len(lengths)
        if len(inputs) != n_micro:
            raise ValueError(f"{len(inputs)} micro-batch inputs for a step of {n_micro}")
        if not self._connected:
            self._connect()
        acts: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        to_send: dict[tuple[str, int, int], torch.Tensor] = {}
        received: dict[tuple[str, int, int], torch.Tensor] = {}
        in_flight: list = []  # (works, tensors) of unwaited batches: the tensors live until DRAIN
        last = self.num_stages - 1
        for item in self.p2p_programs(programs, lengths)[self.rank]:
            if isinstance(item, Batch):
                works, tensors = self._issue(item, to_send, received)
                if item.wait:
                    for work in works:
                        work.wait()
                else:
                    in_flight.append((works, tensors))
                continue
            kind, c, i = item
            if kind == "drain":
                for works, _ in in_flight:
                    for work in works:
                        work.wait()
                in_flight = []
                continue
            if kind == "cut":
                if at_cut is not None:
                    at_cut(c)
                continue
            if kind == "tail":
                if at_tail is not None:
                    at_tail(c)
                continue
            stage, module = self.stage_ids[c], self.modules[c]
            if kind == "f":
                x = received.pop(("act", stage - 1, i)).requires_grad_(True) if stage > 0 \
                    else torch.zeros(1, device=self.device)
                with self._span(f"stage{stage} forward mb{i}"):
                    out = module(x, inputs[i], log)
                acts[(c, i)], outputs[(c, i)] = x, out
                if stage < last:
                    to_send[("act", stage, i)] = out.detach().contiguous()
            else:
                out = outputs.pop((c, i))
                grad = None if stage == last else received.pop(("grad", stage + 1, i))
                self._set_grad_sync(module, i == n_micro - 1)
                with self._span(f"stage{stage} backward mb{i}"):
                    if stage == last:
                        out.backward()
                    else:
                        torch.autograd.backward(out, grad)
                x = acts.pop((c, i))
                if stage > 0:
                    to_send[("grad", stage, i)] = (x.grad if x.grad is not None else torch.zeros_like(x)).contiguous()
        if in_flight or to_send or received:
            raise RuntimeError("pipeline step ended with messages in flight (a bug in p2p_programs)")

    def _issue(self, batch: Batch, to_send: dict, received: dict) -> tuple[list, list[torch.Tensor]]:
        """Post one batch: its sends take their tensors from ``to_send``, its receives put
        fresh buffers into ``received``."""
        group = self.groups[batch.channel]
        ops, tensors = [], []
        for op in batch.ops:
            key = (op.channel, op.stage, op.micro)
            if op.send:
                t = to_send.pop(key)
                if tuple(t.shape) != op.shape or t.dtype != op.dtype:
                    # nccl would not notice (it matches by order, without a size check)
                    raise RuntimeError(f"pipeline stage {op.stage} sends a {t.dtype} tensor of shape "
                                       f"{tuple(t.shape)}; its receiver expects {op.dtype} {op.shape}")
                ops.append(dist.P2POp(dist.isend, t, group=group, group_peer=op.peer))
            else:
                t = received[key] = torch.empty(op.shape, dtype=op.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, t, group=group, group_peer=op.peer))
            tensors.append(t)
        return dist.batch_isend_irecv(ops), tensors

    def _connect(self) -> None:
        """One collective on each pipeline group before its first batch: nccl creates a group's
        communicator at its first operation with every member taking part, which batches
        between two ranks (and a cut's collectives keeping the others busy) would not give."""
        for group in self.groups.values():
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        self._connected = True

    def _span(self, name: str):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span("llm", name)

    def _set_grad_sync(self, module: nn.Module, last: bool) -> None:
        """FSDP reduces a chunk's gradients in every backward unless told to wait for the last
        (each chunk's backwards run in micro-batch order); weights kept gathered are freed in
        the last only."""
        if self.defer_grad_sync and hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(last)
        if self.keep_gathered and hasattr(module, "set_reshard_after_backward"):
            module.set_reshard_after_backward(frees_after_backward(last, reshard_after_forward=False))
