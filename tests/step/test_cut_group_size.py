"""multiplex.chunks_per_cut=auto (``omni.step.multiplex_rules.cut_group_size``): per step, the
largest cut group whose live encoder activations fit the per-rank budget, one call per step
without a budget; the settings it accepts; and the simulator choosing by the same rule."""
from __future__ import annotations

import pytest

from omni.step.multiplex_rules import (chunks_per_cut_candidates, chunks_per_cut_setting, cut_group_size,
                                  peak_live_encoder_bytes)
from parallel.sizing import LayoutError

# 1F1B with pp=2, 6 micro-batches: stage 0 finishes micro-batch j's backward before cut j + 2.
PP2_CUTS = [2, 3, 4, 5, 6, None]


def test_settings():
    assert chunks_per_cut_setting("auto") is None and chunks_per_cut_setting("AUTO") is None
    assert chunks_per_cut_setting(3) == 3 and chunks_per_cut_setting("2") == 2
    for bad in ("0", "-1", "two", 1.5):
        with pytest.raises(LayoutError, match="must be auto or a count >= 1"):
            chunks_per_cut_setting(bad)
    assert chunks_per_cut_candidates(6) == [1, 2, 4, 6] and chunks_per_cut_candidates(0) == [1]


def test_peak_live_bytes_follows_the_action_list():
    """Each chunk's bytes live from its group's forward to its group's backward."""
    ones = [1.0] * 6
    # a call per chunk under 1F1B pp=2: cut k runs B(k-2) before F(k), so 2 alive at most
    assert peak_live_encoder_bytes("colocated", 6, PP2_CUTS, 1, 0, ones) == 2.0
    # groups of 2: chunks 0-1 at cut 0, 2-3 at cut 2; group 0's backward waits for chunk 1's
    # (cut 3), rounded up to the next group cut (4): 4 alive before it
    assert peak_live_encoder_bytes("colocated", 6, PP2_CUTS, 2, 0, ones) == 4.0
    # groups of 4: group 0 needs chunk 3's backward (cut 5), after the pipeline's last group cut
    # (4): everything alive until after the pipeline, as with one call per step
    assert peak_live_encoder_bytes("colocated", 6, PP2_CUTS, 4, 0, ones) == 6.0
    assert peak_live_encoder_bytes("colocated", 6, PP2_CUTS, 6, 0, ones) == 6.0
    weights = [5.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert peak_live_encoder_bytes("colocated", 6, PP2_CUTS, 1, 0, weights) == 5.0


@pytest.mark.parametrize("budget,members,expected", [
    (None, 2, 6),  # no budget (the CPU): one call per step
    (3.0, 2, 6),  # all 6 chunks alive, 3 per rank: fits
    (2.9, 2, 2),  # groups of 4 keep all 6 alive too; groups of 2 peak at 4, 2 per rank
    (2.0, 2, 2),
    (1.9, 2, 1),  # a call per chunk peaks at 2 chunks, 1 per rank
    (0.1, 2, 1),  # nothing fits: one chunk per call, the least memory
])
def test_auto_takes_the_largest_group_that_fits(budget, members, expected):
    ones = [1.0] * 6
    got = cut_group_size("auto", "colocated", 6, PP2_CUTS, 0, lambda: ones, members, budget)
    assert got == expected
    peak = peak_live_encoder_bytes("colocated", 6, PP2_CUTS, got, 0, ones) / members
    assert budget is None or got == 1 or peak <= budget
    # a number is taken as it is, whatever the budget
    assert cut_group_size(3, "colocated", 6, PP2_CUTS, 0, lambda: ones, members, budget) == 3


def test_simulator_chooses_by_the_runtime_rule():
    """``omni simulate`` with auto: per step the rule's group, reported in the layout; a budget
    too small for any group gives the explicit one-chunk run exactly."""
    from omni.sim.compare import simulate
    from recipes.simulate_cmd import load_sim_config

    base = ["workload=none", "cluster=h100", "cluster.num_gpus=8", "parallel.pp=2", "parallel.tp=2",
            "data.global_batch_size=32", "data.micro_batch_tokens=1024", "data.sample_tokens=256",
            "data.image_tokens_min=16", "data.image_tokens_max=64", "data.steps=2", "sim.placements=[colocated]"]

    def run(*over):
        return simulate(load_sim_config([*base, *over]))["placements"]["colocated"]

    auto, one = run(), run("multiplex.chunks_per_cut=1")
    assert auto["layout"]["chunks_per_cut"] == auto["layout"]["max_micro_batches"] > 1
    whole = run(f"multiplex.chunks_per_cut={auto['layout']['max_micro_batches']}")
    assert auto["step_time_s"] == whole["step_time_s"]
    tiny = run("multiplex.encoder_memory_mib=0.000001")
    assert tiny["layout"]["chunks_per_cut"] == 1
    assert tiny["step_time_s"] == pytest.approx(one["step_time_s"], rel=1e-12)
