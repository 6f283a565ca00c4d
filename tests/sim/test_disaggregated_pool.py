"""The disaggregated baseline's encoder pool is chosen once for the run (sim.encoder_gpus=0):
the fastest of the candidate sizes over every simulated step — a ratio schedule's too — not
re-chosen per step or per ratio."""
from __future__ import annotations

import pytest

from omni.sim.simulate import pool_candidates, simulate
from recipes.simulate_cmd import load_sim_config

BASE = ["workload=none", "cluster=h100", "cluster.num_gpus=32", "parallel.pp=2", "parallel.tp=2",
        "data.global_batch_size=64", "data.micro_batch_tokens=1024", "data.sample_tokens=256",
        "data.image_tokens_min=16", "data.image_tokens_max=64", "data.steps=2", "sim.placements=[disaggregated]"]


def test_candidates_are_whole_model_parallel_groups_up_to_half_the_cluster():
    assert pool_candidates(load_sim_config(BASE)) == [4, 8, 12, 16]
    assert pool_candidates(load_sim_config([*BASE, "sim.encoder_gpus=8"])) == [8]


def test_the_run_gets_the_fastest_pool_that_fits():
    res = simulate(load_sim_config([*BASE, "data.image_ratio=0.8"]))["placements"]["disaggregated"]
    search = res["encoder_pool_search"]
    assert sorted(int(e) for e in search) == [4, 8, 12, 16]
    fitting = {int(e): r["step_time_s"] for e, r in search.items() if r["fits"]}
    assert res["layout"]["encoder_gpus"] == min(fitting, key=fitting.get)
    assert res["step_time_s"] == pytest.approx(min(fitting.values()))
    # a fixed pool is simulated as asked
    fixed = simulate(load_sim_config([*BASE, "data.image_ratio=0.8", "sim.encoder_gpus=16"]))
    assert fixed["placements"]["disaggregated"]["layout"]["encoder_gpus"] == 16


def test_a_schedule_run_keeps_one_pool_for_all_its_steps():
    over = [*BASE, "data.steps=4", "data.image_ratio_schedule=[[0,0.1],[1,0.9]]"]
    res = simulate(load_sim_config(over))["placements"]["disaggregated"]
    ratios = res["image_ratios"]
    assert len(ratios) == 4 and ratios[0] < 0.3 < 0.7 < ratios[-1]  # the steps span the schedule
    assert isinstance(res["layout"]["encoder_gpus"], int)  # one pool, scored on all four steps
