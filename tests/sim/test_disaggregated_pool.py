"""The disaggregated baseline's encoder pool is chosen once for the run (sim.encoder_gpus=0):
the fastest of the candidate sizes over every simulated step — a ratio schedule's too — not
re-chosen per step or per ratio."""
from __future__ import annotations

import pytest

from omni.sim.disaggregated import pool_candidates, step_with_pool
from omni.sim.simulate import simulate
from recipes.simulate_cmd import load_sim_config

BASE = ["workload=none", "cluster=h100", "cluster.num_gpus=32", "parallel.pp=2", "parallel.tp=2",
        "data.global_batch_size=64", "data.micro_batch_tokens=1024", "data.sample_tokens=256",
        "data.image_tokens_min=16", "data.image_tokens_max=64", "data.steps=2", "sim.placements=[disaggregated]",
        "multiplex.encoder_weights=replicated"]  # (hybrid groups of a node would rule out the 12-GPU pool)


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


def test_a_training_pool_adds_its_fill_and_drain_to_the_step():
    """Synchronous training: the LLM's first forward waits for the pool's first call, and the
    step for the pool's last backward and gradient sync where they outlast the LLM's tail; a
    frozen encoder may run a step ahead (only the pool's throughput counts)."""
    tail_comm, tail = {(0, 0): 0.2, (0, 1): 0.1}, {(0, 0): 0.05}
    pool = {"time_s": 3.0, "fill_s": 0.4, "drain_s": 0.6}
    assert step_with_pool(5.0, pool, tail_comm, tail) == pytest.approx(5.0 + 0.4 + (0.6 - 0.25))
    pool = {"time_s": 3.0, "fill_s": 0.4, "drain_s": 0.1}  # the drain hides behind the LLM's tail
    assert step_with_pool(5.0, pool, tail_comm, tail) == pytest.approx(5.4)
    pool = {"time_s": 7.0, "fill_s": 0.4, "drain_s": 0.1}  # the pool is the bottleneck
    assert step_with_pool(5.0, pool, tail_comm, tail) == pytest.approx(7.0)
    # end to end: the fill and drain come from the pool's own calls; none when the tower is frozen
    res = simulate(load_sim_config([*BASE, "data.image_ratio=0.8", "sim.encoder_gpus=8", "data.steps=1"]))
    frozen = simulate(load_sim_config([*BASE, "data.image_ratio=0.8", "sim.encoder_gpus=8", "data.steps=1",
                                       "encoders.vision.freeze=true"]))
    assert res["placements"]["disaggregated"]["step_time_s"] > frozen["placements"]["disaggregated"]["step_time_s"]
