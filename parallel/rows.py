"""The shape of a step's rows: how many micro-batches a rank runs and how long each row is.

One home for the rule the trainer runs and the simulator costs (``omni.sim.simulate``). Plain
numbers only (no torch): every rank of a pipeline holds the same rows, so each derives the same
lengths from its own step batch and sizes its receive buffers without a size message.

- The count: at least one micro-batch per pipeline stage and a multiple of pp (the
  interleaved schedules run them in rounds of pp); ranks with fewer rows run empty ones.
- The lengths: a row is padded to a multiple of the tensor-parallel size (sequence
  parallelism splits it evenly). Under pipeline parallelism with Omni's executor each
  micro-batch keeps its own length (rounded up to ``8 * tp``: few distinct activation shapes),
  so an empty micro-batch costs ``8 * tp`` tokens, not a whole row. torch's own schedules
  (``zero_bubble``) allocate receive buffers from one shape, so there every row is padded to
  the step's longest.
"""
from __future__ import annotations

from typing import Sequence


def microbatch_multiple(pp: int) -> int:
    """What a step's micro-batch count per rank must be a multiple of (``microbatch_count``):
    the data planner packs that many (``data.balance``'s ``arrange``), so the pipeline gets
    rows of data instead of empty ones."""
    return max(1, pp)


def microbatch_count(n: int, pp: int) -> int:
    """How many micro-batches a step must run: at least one per stage, and a multiple of pp.
    The caller pads with empty ones."""
    multiple = microbatch_multiple(pp)
    return max(multiple, -(-n // multiple) * multiple)


def row_unit(tp: int, pp: int) -> int:
    """What every row's length is a multiple of: tp (sequence parallelism), and under PP
    ``8 * tp``: coarse lengths, so few distinct activation shapes (and cached programs)."""
    return 8 * tp if pp > 1 else tp


def row_lengths(tokens: Sequence[int], tp: int, pp: int, one_shape: bool = False) -> list[int]:
    """Each row's padded length, for rows of ``tokens`` real tokens (0 for an empty
    micro-batch). ``one_shape``: the pipeline needs one activation shape per step (torch's
    schedules): every row takes the longest's length."""
    unit = row_unit(tp, pp)
    lengths = [_round_up(max(t, 1), unit) for t in tokens]
    if one_shape and lengths:
        return [max(lengths)] * len(lengths)
    return lengths


def padded_fraction(tokens: Sequence[int], lengths: Sequence[int]) -> float:
    """Of the rows' tokens as the LLM runs them, the share that is padding."""
    total = sum(lengths)
    return 1.0 - sum(tokens) / total if total > 0 else 0.0


def step_padded_fraction(rank_rows: Sequence[Sequence[int]], tp: int, pp: int, one_shape: bool = False) -> float:
    """The padded fraction of a step whose DP rank r has rows of ``rank_rows[r]`` real tokens:
    under PP every rank runs the same schedulable count (the multiplexer lines the ranks'
    encoder chunks up so; the simulator likewise), the missing rows empty."""
    n = max((len(r) for r in rank_rows), default=0)
    if pp > 1:
        n = microbatch_count(n, pp)
    tokens = [list(r) + [0] * (n - len(r)) if pp > 1 else list(r) for r in rank_rows]
    lengths = [x for r in tokens for x in row_lengths(r, tp, pp, one_shape)]
    return padded_fraction([t for r in tokens for t in r], lengths)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit
