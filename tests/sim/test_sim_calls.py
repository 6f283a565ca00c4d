"""The simulator encodes a cut group in one call, as the runtime does (multiplex.chunks_per_cut
chunks planned together, one encoder pass per modality, its fixed cost paid once), and follows
the runtime's insertion points (encoder_segments, with multiplex.lookahead)."""
from __future__ import annotations

import pytest

from omni.runtime.multiplex import chunks_per_call
from omni.sim.simulate import one_step_for_calibration
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
    plain, ahead = _run("multiplex.lookahead=0"), _run("multiplex.lookahead=1")
    assert len([c for c in plain.chunks if c.items]) >= 2
    peak = lambda run: max(tl.live_encoder_peak for tl in run.timeline.cells)  # noqa: E731
    assert peak(ahead) > peak(plain)
    assert sum(c.items for c in ahead.chunks) == sum(c.items for c in plain.chunks)
