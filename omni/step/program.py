"""``plan_step``: a step's rows and every pipeline rank's program, from the layout's constants
(``StepShape``) and the step's row sizes. One home for the rules the trainer, the pipeline
executor, the multiplexer and the simulator used to restate:

- the micro-batch count (``parallel.rows.microbatch_count``: a multiple of pp, the largest any
  data-parallel group needs when the groups' encoder chunks must line up);
- each row's padded length (``parallel.rows.row_lengths``; the empty micro-batches a count adds
  take the shortest length, or the step's one shape under torch's schedules);
- the programs (``parallel.pipeline_schedule``): every rank's forwards and backwards with the
  consistent cuts, and the tail cuts of the bubble windows when the multiplexer fills them.
  Without pipeline parallelism the program is 1F1B of one stage, F0 B0 F1 B1 ..., with cut k
  before F0 k: one execution path for every layout.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

from parallel.pipeline_schedule import (EXECUTOR_SCHEDULES, Action, BubbleWindow, bubble_windows,
                                        encoder_backward_cuts, place_cuts, rank_programs)
from parallel.rows import microbatch_count, row_lengths

ONE_STAGE_SCHEDULE = "1f1b"  # pp = 1: each micro-batch's backward right after its forward


@dataclass(frozen=True)
class StepShape:
    """What a layout fixes about every step. ``schedule``: the pipeline schedule
    (``parallel.pp_schedule``; one stage runs 1F1B whatever it says); ``one_shape``: every row
    takes the step's longest length (torch's own schedules, which allocate buffers from one
    shape); ``tail_cuts``: the programs hold the bubble windows' tail cuts (the multiplexer
    fills the windows with encoder work)."""

    pp: int = 1
    virtual: int = 1
    tp: int = 1
    schedule: str = ONE_STAGE_SCHEDULE
    one_shape: bool = False
    tail_cuts: bool = False

    @property
    def schedule_run(self) -> str:
        """The schedule whose programs run: the configured one under PP, 1F1B for one stage."""
        return self.schedule if self.pp > 1 else ONE_STAGE_SCHEDULE

    @property
    def has_programs(self) -> bool:
        """Omni's executor runs the step (torch's schedules run it otherwise, without cuts)."""
        return self.schedule_run in EXECUTOR_SCHEDULES


@dataclass(frozen=True)
class StepProgram:
    """One step as every rank runs it. ``lengths[i]``: micro-batch i's padded row length (the
    same on every rank of a pipeline: they hold the same rows); ``real[i]``: its real tokens
    (0 for the empty micro-batches the count adds); ``programs[r]``: pipeline rank r's actions,
    ("f" | "b", model chunk, micro-batch), ("cut", k, -1) and ("tail", j, -1) (empty under
    torch's schedules); ``backward_cuts[j]``: the first cut at which stage 0 has finished
    micro-batch j's backward (None: after the pipeline); ``windows[r]``: rank r's bubble window
    (None for rank 0; empty without tail cuts)."""

    shape: StepShape
    lengths: tuple[int, ...]
    real: tuple[int, ...]
    programs: tuple[tuple[Action, ...], ...]
    backward_cuts: tuple[Optional[int], ...]
    windows: tuple[Optional[BubbleWindow], ...]

    @property
    def n_micro(self) -> int:
        return len(self.lengths)

    @property
    def shards(self) -> list[int]:
        """Each micro-batch's activation length between stages: a TP rank holds 1/tp of the row."""
        return [n // self.shape.tp for n in self.lengths]


def step_micro_batches(counts: Sequence[int], pp: int) -> int:
    """How many micro-batches every rank runs: ``counts`` are the data-parallel groups' own (every
    group's when the multiplexer lines their encoder chunks up, else this rank's), the count a
    multiple of pp (``microbatch_count``)."""
    return microbatch_count(max(counts, default=0), pp)


def plan_step(shape: StepShape, row_tokens: Sequence[int], n_micro: Optional[int] = None) -> StepProgram:
    """The step of this rank's rows (``row_tokens``: each micro-batch's real tokens) run as
    ``n_micro`` micro-batches (default: ``step_micro_batches`` of its own count)."""
    n = step_micro_batches([len(row_tokens)], shape.pp) if n_micro is None else n_micro
    if n < len(row_tokens):
        raise ValueError(f"a step of {n} micro-batches cannot hold {len(row_tokens)} rows")
    real = tuple(row_tokens) + (0,) * (n - len(row_tokens))
    lengths = tuple(row_lengths(real, shape.tp, shape.pp, one_shape=shape.one_shape))
    programs, cuts, windows = _programs(shape, n) if shape.has_programs else ((), (), ())
    return StepProgram(shape, lengths, real, programs, cuts, windows)


@functools.lru_cache(maxsize=64)
def _programs(shape: StepShape, n: int):
    """(programs with cuts, encoder backward cuts, bubble windows) of ``n`` micro-batches: a
    function of the shape and the count only (cached: a few counts recur)."""
    schedule = shape.schedule_run
    windows = tuple(bubble_windows(schedule, shape.pp, shape.virtual, n)) if shape.tail_cuts and shape.pp > 1 else ()
    tails = [w.tail for w in windows if w is not None]
    programs = place_cuts(rank_programs(schedule, shape.pp, shape.virtual, n), shape.pp, shape.virtual, n, tails)
    frozen = tuple(tuple(p) for p in programs)
    return frozen, tuple(encoder_backward_cuts(frozen[0], n)), windows
