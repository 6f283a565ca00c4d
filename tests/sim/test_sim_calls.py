"""The simulator encodes a cut group in one call, as the runtime does (multiplex.chunks_per_cut
chunks planned together, one encoder pass per modality, its fixed cost paid once), and follows
the runtime's insertion points (encoder_segments, with multiplex.lookahead)."""
from __future__ import annotations

import pytest

from omni.step.multiplex_rules import chunks_per_call
from omni.sim.one_step import one_step_for_calibration
from recipes.simulate_cmd import load_sim_config

SMALL = ["workload=none", "cluster=h100", "cluster.num_gpus=8", "parallel.pp=2", "parallel.tp=2",
         "data.global_batch_size=32", "data.micro_batch_tokens=1024", "data.sample_tokens=256",
         "data.image_tokens_min=16", "data.image_tokens_max=64", "data.steps=1", "data.image_ratio=0.6"]


def _run(*over):
    run, _ = one_step_for_calibration(load_sim_config([*SMALL, *over]))
    return run


@pytest.mark.parametrize("placement,group", [("colocated", 1), ("colocated", 2), ("colocated", 3),
                                             ("stage0", 2), ("encoder_first", 2)])
def test_one_call_per_cut_group(placement, group):
    run = _run(f"multiplex.placement={placement}", f"multiplex.chunks_per_cut={group}")
    chunks = [j for call in run.chunks for j in call.chunks]
    n = len(chunks)
    size = chunks_per_call(placement, n, group)
    assert chunks == list(range(n))  # every chunk in exactly one call, in order
    assert [c.chunks for c in run.chunks] == [list(range(k, min(k + size, n))) for k in range(0, n, size)]
    single = _run(f"multiplex.placement={placement}", "multiplex.chunks_per_cut=1")
    assert sum(c.items for c in run.chunks) == sum(c.items for c in single.chunks)


def test_grouping_pays_the_fixed_cost_once_per_call():
    """Per-call launches and weight reads: encoding the same items in fewer calls costs the
    busiest GPU less in total (the per-call fixed cost is paid once per cut group)."""
    one, four = _run("multiplex.chunks_per_cut=1"), _run("multiplex.chunks_per_cut=4")
    assert len(four.chunks) < len(one.chunks)
    total = lambda run: sum(sum(c.gpu_forward_s) for c in run.chunks)  # noqa: E731
    assert total(four) < total(one)


def test_lookahead_keeps_more_encoder_activations_alive():
    """Encoding a cut group one insertion point early (the runtime's encoder_segments) holds
    its activations longer: the encoder peak grows, the step's work does not change."""
    plain, ahead = (_run("multiplex.chunks_per_cut=1", f"multiplex.lookahead={n}") for n in (0, 1))
    assert len([c for c in plain.chunks if c.items]) >= 2
    peak = lambda run: max(tl.live_encoder_peak for tl in run.timeline.cells)  # noqa: E731
    assert peak(ahead) > peak(plain)
    assert sum(c.items for c in ahead.chunks) == sum(c.items for c in plain.chunks)


def test_sharded_encoder_sync_hides_behind_the_last_encoder_backward():
    """FSDP2 reduces each encoder layer from its post-backward hook during the step's last
    encoder backward: what the step's end pays is at most the reduction, at least one layer's
    share, and less than the whole when that backward is long enough (replicated weights are
    all-reduced after it: exposed whole)."""
    from omni.sim import sync

    assert sync.exposed_behind_backward(1.0, 0.4, 10) == pytest.approx(0.6)
    assert sync.exposed_behind_backward(1.0, 5.0, 10) == pytest.approx(0.1)
    assert sync.exposed_behind_backward(0.0, 5.0, 10) == 0.0
    run = _run("multiplex.encoder_weights=sharded")
    spec_sync = max(run.tail_comm.values())
    replicated = _run("multiplex.encoder_weights=replicated")
    assert spec_sync < max(replicated.tail_comm.values())


def test_p2p_cells_wait_only_for_their_partners():
    """multiplex.exchange=p2p: an insertion point couples the cells that trade features or rows
    (and share a weight collective), not every encoder GPU. Two DP groups whose items stay on
    their own GPUs, group 0's LLM work slower: under all_to_all group 1 waits for group 0 at
    the second cut; under p2p it does not."""
    from omni.sim.encoders import ChunkTimes
    from omni.sim.engine import simulate_step
    from omni.sim.timing import StageWork

    def call(j):
        return ChunkTimes(0.1, 0.2, [0.1, 0.1], [0.2, 0.2], [1.0, 1.0], items=2, modalities=["image"], chunks=[j],
                          trades=[[0], [1]])

    work = {(g, 0, i): StageWork(1.0 if g else 3.0, 2.0, 1.0, 10, 2.0) for g in range(2) for i in range(2)}
    steps = {}
    for exchange in ("all_to_all", "p2p"):
        t = simulate_step(pp=1, virtual=1, schedule="1f1b", groups=2, n_micro=2, work=work, p2p_s=0.0,
                          placement="colocated", chunks=[call(0), call(1)], encoder_cells={(0, 0): [0], (1, 0): [1]},
                          llm_activation={k: 0.0 for k in work}, tail_s={}, tail_comm_s={}, exchange=exchange)
        steps[exchange] = {(tl.group, tl.stage): tl for tl in t.cells}
    assert steps["all_to_all"][(1, 0)].parts["cut_wait"] > 0  # waits for group 0 at cut 1
    assert steps["p2p"][(1, 0)].parts.get("cut_wait", 0.0) == 0  # trades with nobody else
    assert steps["p2p"][(1, 0)].end_s < steps["all_to_all"][(1, 0)].end_s
    assert steps["p2p"][(0, 0)].end_s == pytest.approx(steps["all_to_all"][(0, 0)].end_s)


@pytest.mark.parametrize("over,nodes", [([], 8), (["cluster=cpu"], 64), (["cluster.gpus_per_node=4"], 4)])
def test_the_layouts_node_size_is_the_clusters(over, nodes):
    """load_sim_config: parallel.gpus_per_node (layout checks, encoder shard groups) follows the
    cluster preset's, so the two can never disagree."""
    cfg = load_sim_config(over)
    assert cfg.parallel.gpus_per_node == cfg.cluster.gpus_per_node == nodes


def test_simulate_checks_the_multiplex_group_as_training_does():
    """A misspelt multiplex value is one clear error before any simulation (it would otherwise
    be read as the default exchange)."""
    from omni.errors import ConfigError

    with pytest.raises(ConfigError, match="multiplex.exchange='pp2'"):
        load_sim_config([*SMALL, "multiplex.exchange=pp2"])


def _placements(*over):
    from omni.sim.compare import simulate

    return simulate(load_sim_config([*SMALL, "sim.placements=[colocated]", *over]))["placements"]["colocated"]


def test_chunks_per_cut_search_takes_the_fastest_group_that_fits():
    """sim.chunks_per_cut_search: colocated runs with the multiplex.chunks_per_cut of the
    fastest candidate (1, 2, 4, ... up to one call per step) that fits at every simulated step,
    exactly that candidate's simulation; with less memory a smaller group wins."""
    from omni.step.multiplex_rules import chunks_per_cut_candidates

    assert chunks_per_cut_candidates(7) == [1, 2, 4, 7] and chunks_per_cut_candidates(4) == [1, 2, 4]
    assert chunks_per_cut_candidates(1) == [1]
    found = _placements("sim.chunks_per_cut_search=true")
    each = {g: _placements(f"multiplex.chunks_per_cut={g}")
            for g in chunks_per_cut_candidates(found["layout"]["max_micro_batches"])}
    assert sorted(int(g) for g in found["chunks_per_cut_search"]) == sorted(each)
    best = min((g for g in each if each[g]["fits"]), key=lambda g: each[g]["step_time_s"])
    assert best > 1  # the fixed cost per call makes grouping pay here
    assert found["layout"]["chunks_per_cut"] == best
    assert found["step_time_s"] == each[best]["step_time_s"]
    # Memory: a limit between the one-call-per-chunk run's peak and the best group's rules the
    # latter (and every larger group, whose encoder activations live longer) out.
    small, big = each[1]["memory_gib"]["total"], each[best]["memory_gib"]["total"]
    assert big > small
    tight = _placements("sim.chunks_per_cut_search=true", "cluster.memory_reserve_gib=0",
                        f"cluster.hbm_gib={(small + big) / 2}")
    chosen = tight["layout"]["chunks_per_cut"]
    assert chosen < best and tight["fits"]
    assert tight["chunks_per_cut_search"][str(best)]["fits"] is False
