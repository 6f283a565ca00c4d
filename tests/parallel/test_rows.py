"""The shape of a step's rows (parallel.rows): the rule the trainer pads by and the simulator
costs. The trainer's side is held to it in every equality layout (layout_harness.compare checks
each step's padded_fraction against expected_padded_fraction); the simulator's here."""
from __future__ import annotations

import pytest

from parallel.rows import microbatch_count, padded_fraction, row_lengths, row_unit


def test_each_row_keeps_its_own_length_under_the_executor():
    # tp=2, pp=2: rows rounded up to 16 tokens; an empty micro-batch costs 16, not a whole row
    assert row_unit(2, 2) == 16 and row_unit(2, 1) == 2
    assert row_lengths([8190, 3000, 0, 16], 2, 2) == [8192, 3008, 16, 16]
    # without PP a row needs only a multiple of tp (sequence parallelism)
    assert row_lengths([7, 0, 8], 2, 1) == [8, 2, 8]


def test_torchs_schedules_take_one_shape_per_step():
    assert row_lengths([8190, 3000, 0], 2, 2, one_shape=True) == [8192] * 3
    assert row_lengths([], 2, 2, one_shape=True) == []


def test_count_and_padded_fraction():
    assert [microbatch_count(n, 4) for n in (0, 1, 4, 5, 9)] == [4, 4, 4, 8, 12]
    assert microbatch_count(3, 1) == 3
    tokens = [100, 50, 0, 0]
    lengths = row_lengths(tokens, 1, 2)
    assert lengths == [104, 56, 8, 8]
    assert padded_fraction(tokens, lengths) == pytest.approx(1 - 150 / 176)
    assert padded_fraction([], []) == 0.0


def test_the_simulator_pads_rows_as_the_runtime_does():
    """At C 9:1 (the issue's case) colocated's rows were ~20% padding when every pipeline row
    took its group's longest length and the empty micro-batches ran whole rows; each row at its
    own length, at most 5% (measured 0.4%)."""
    from omni.sim.compare import simulate
    from recipes.simulate_cmd import load_sim_config

    cfg = load_sim_config(["workload=C", "data.image_ratio=0.9", "sim.placements=[colocated]", "data.steps=1"])
    colocated = simulate(cfg)["placements"]["colocated"]
    assert colocated["layout"]["pp"] > 1  # the case where rows were padded to one length
    assert colocated["padded_fraction"] <= 0.05
