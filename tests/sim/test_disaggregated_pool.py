"""The disaggregated baseline's encoder pool is chosen once for the run (sim.encoder_gpus=0):
the fastest of the candidate sizes over every simulated step — a ratio schedule's too — not
re-chosen per step or per ratio; trained synchronously, it is a stage in front of the LLM's
first."""
from __future__ import annotations

import pytest

from omni.sim.disaggregated import first_stage_ready, pool_candidates, pool_end, step_with_pool
from omni.sim.engine import simulate_step
from omni.sim.compare import simulate
from omni.sim.timing import StageWork
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


def test_the_first_stage_waits_for_every_pool_call_not_only_the_first():
    """Synchronous training: the pool is a stage in front of the LLM's first. With pool
    forwards of 4 s per micro-batch and a 1 s + 2 s LLM (pp=1), micro-batch i can start at
    4(i + 1): F0 4-5, B0 5-7, F1 8-9, B1 9-11, F2 12-13, B2 13-15, F3 16-17, B3 17-19. Charging
    only the first call's fill (the model before this test) gave 4 + 4 x 3 = 16 s."""
    n = 4
    pool = {"trains": True, "time_s": 4 * (4.0 + 1.0), "grad_sync_s": 0.5,
            "calls": [([j], 4.0, 1.0) for j in range(n)]}
    work = {(0, 0, i): StageWork(1.0, 2.0, 1.0, 1, 2.0) for i in range(n)}
    tl = simulate_step(pp=1, virtual=1, schedule="1f1b", groups=1, n_micro=n, work=work, p2p_s=0.0,
                       placement="none", chunks=[], encoder_cells={}, llm_activation={k: 1.0 for k in work},
                       tail_s={}, tail_comm_s={}, first_stage_ready=first_stage_ready(pool, n))
    assert first_stage_ready(pool, n) == [4.0, 8.0, 12.0, 16.0]
    assert tl.step_s == pytest.approx(19.0)
    assert tl.first_stage_backward_end == pytest.approx([7.0, 11.0, 15.0, 19.0])
    # The pool's backwards run once their gradients exist (all forwards done at 16 s): 7 -> 16-17,
    # 11 -> 17-18, 15 -> 18-19, 19 -> 19-20; then its gradient sync.
    assert pool_end(pool, tl.first_stage_backward_end) == pytest.approx(20.5)
    assert step_with_pool(tl.step_s, pool, tl.first_stage_backward_end) == pytest.approx(20.5)
    # a frozen pool encodes a step ahead: no wait, only its throughput counts
    frozen = {**pool, "trains": False}
    assert first_stage_ready(frozen, n) is None and pool_end(frozen, tl.first_stage_backward_end) == 0.0
    assert step_with_pool(12.0, frozen, []) == pytest.approx(20.0)


def test_a_training_pool_costs_more_than_a_frozen_one_end_to_end():
    res = simulate(load_sim_config([*BASE, "data.image_ratio=0.8", "sim.encoder_gpus=8", "data.steps=1"]))
    frozen = simulate(load_sim_config([*BASE, "data.image_ratio=0.8", "sim.encoder_gpus=8", "data.steps=1",
                                       "encoders.vision.freeze=true"]))
    assert res["placements"]["disaggregated"]["step_time_s"] > frozen["placements"]["disaggregated"]["step_time_s"]
