"""The pipeline schedules as pure programs: each rank's order of forwards and backwards (GPipe,
1F1B, interleaved 1F1B), the *consistent cuts* where encoder work joins in, and where each
chunk's encoder backward can run. Plain numbers only (no torch, no process group): the
executor (``parallel.pipeline_executor``, which explains the cuts) runs them, the multiplexing
runtime and the simulator (``omni.sim``) read them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

EXECUTOR_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

Action = tuple[str, int, int]  # ("f" | "b", model chunk, micro-batch), or ("cut", k, -1)


def stage_ids(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The global stage indices rank ``pp_rank`` runs (looped placement)."""
    return [pp_rank + k * pp for k in range(virtual)]


def split_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """Consecutive, equal blocks of layers per stage (the layout checks divisibility)."""
    per = num_layers // num_stages
    return [list(range(s * per, (s + 1) * per)) for s in range(num_stages)]


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


MARKERS = ("cut", "tail")  # the insertion points a program with cuts holds besides its actions


def place_cuts(programs: Sequence[Sequence[Action]], pp: int, virtual: int, n_micro: int,
               tails: Sequence[int] = ()) -> list[list[Action]]:
    """Insert ("cut", k, -1) into every rank's program (see the module docstring): before its
    first action that would start no earlier than F(0, k) if every action started as soon as
    its rank and its input allowed (forward 1, backward 2 time units). ``tails``: micro-batches
    j that also get a *tail cut* ("tail", j, -1), placed the same way at the end of rank 0's
    backward of j through model chunk 0 (where its embedding gradient is complete; in the
    cool-down, where the other ranks have finished or idle). A tail cut and a cut at the same
    moment come tail first, on every rank."""
    start = _start_times(programs, pp, virtual)
    marks = marker_times(programs, pp, virtual, n_micro, tails, start)
    out = []
    for r, prog in enumerate(programs):
        with_cuts: list[Action] = []
        m = 0
        for pos, action in enumerate(prog):
            while m < len(marks) and start[r][pos] >= marks[m][0]:
                with_cuts.append(marks[m][1])
                m += 1
            with_cuts.append(action)
        with_cuts += [mark for _, mark in marks[m:]]
        out.append(with_cuts)
    return out


def marker_times(programs: Sequence[Sequence[Action]], pp: int, virtual: int, n_micro: int,
                 tails: Sequence[int] = (), start: Optional[list[list[float]]] = None) -> list[tuple[float, Action]]:
    """Every cut and tail cut with its moment in the as-soon-as-possible execution of the
    programs (without cuts), in the order every rank meets them."""
    start = _start_times(programs, pp, virtual) if start is None else start
    prog0 = programs[0]
    cut_t = {i: start[0][pos] for pos, (kind, c, i) in enumerate(prog0) if kind == "f" and c == 0}
    tail_t = {i: start[0][pos] + BACKWARD_TIME for pos, (kind, c, i) in enumerate(prog0) if kind == "b" and c == 0}
    marks = [(cut_t[k], 1, ("cut", k, -1)) for k in range(n_micro)]
    marks += [(tail_t[j], 0, ("tail", j, -1)) for j in sorted(set(tails))]
    return [(t, mark) for t, _, mark in sorted(marks)]


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


@dataclass(frozen=True)
class BubbleWindow:
    """Where a pipeline rank other than 0 idles in the as-soon-as-possible execution of the
    programs (time units: a forward through one model chunk 1, a backward 2), and the insertion
    points around it: encoder work it runs there is off the pipeline's critical path.

    Before its first action the rank waits for its first activation (``before`` units); the
    last cut before that action is ``deliver_cut`` (stage 0 meets it after its forwards of
    micro-batches 0 .. deliver_cut - 1). After its last action it waits for the step to end;
    ``tail`` is the first micro-batch j whose rank-0 backward (model chunk 0) ends after that
    action has started, so its tail cut lands at the end of the rank's program, where stage 0
    has the embedding gradients of micro-batches 0 .. tail; ``after`` units remain from there
    (or from the rank's end, if later) to the end of the step."""

    rank: int
    before: float
    deliver_cut: int
    tail: int
    after: float

    @property
    def chunks(self) -> range:
        """Micro-batches whose encoder work fits the window: needed by stage 0 no earlier than
        the delivery cut, their embedding gradient complete by the tail cut."""
        return range(self.deliver_cut, self.tail + 1)


def bubble_windows(schedule: str, pp: int, virtual: int, n_micro: int) -> list[Optional[BubbleWindow]]:
    """The ``BubbleWindow`` of every pipeline rank (None for rank 0, which idles only between
    its own actions)."""
    programs = rank_programs(schedule, pp, virtual, n_micro)
    start = _start_times(programs, pp, virtual)

    def end(r: int, pos: int) -> float:
        return start[r][pos] + (FORWARD_TIME if programs[r][pos][0] == "f" else BACKWARD_TIME)

    step_end = max(end(r, len(p) - 1) for r, p in enumerate(programs))
    cut_t = {i: start[0][pos] for pos, (kind, c, i) in enumerate(programs[0]) if kind == "f" and c == 0}
    tail_t = {i: end(0, pos) for pos, (kind, c, i) in enumerate(programs[0]) if kind == "b" and c == 0}
    out: list[Optional[BubbleWindow]] = [None]
    for r in range(1, pp):
        first, last = start[r][0], start[r][-1]
        deliver = max(k for k in range(n_micro) if cut_t[k] <= first)
        tail = min((j for j in range(n_micro) if tail_t[j] > last), key=lambda j: tail_t[j])
        out.append(BubbleWindow(r, first, deliver, tail, max(0.0, step_end - max(end(r, len(programs[r]) - 1),
                                                                                tail_t[tail]))))
    return out


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
