"""Bubble calls in the simulator (multiplex.fill_bubbles): it plans them with the runtime's own
rule and selection (omni.step.bubbles), runs them where the runtime does (after cut 0 on
the later pipeline ranks, rows to stage 0 at the delivery cut, gradients back and the
backward at the tail cut), books their activations from forward to backward, and a step that
moves encoder work off stage 0's critical path into the later stages' idle time is faster."""
from __future__ import annotations

import pytest

from omni.sim.one_step import one_step_for_calibration
from recipes.simulate_cmd import load_sim_config

# Workload A's models (LLaMA-12B, ViT-1B) on two nodes of 8 GPUs, pp=2 (a node per pipeline
# rank), 1F1B, media-heavy, replicated encoder weights (no per-call weight collectives).
SMALL = ["workload=A", "cluster.num_gpus=16", "parallel.pp_schedule=1f1b", "parallel.pp_virtual_stages=1",
         "data.global_batch_size=32", "data.steps=1", "data.image_ratio=0.7", "multiplex.exchange=p2p",
         "multiplex.encoder_weights=replicated", "multiplex.placement=colocated", "sim.chunks_per_cut_search=false"]


def _run(*over):
    run, sizes = one_step_for_calibration(load_sim_config([*SMALL, *over]))
    return run, sizes


def test_bubble_calls_take_items_off_the_cut_groups():
    off, _ = _run("multiplex.fill_bubbles=false", "multiplex.chunks_per_cut=64")
    on, sizes = _run("multiplex.fill_bubbles=true", "multiplex.chunks_per_cut=64")
    assert on.bubbles and not off.bubbles
    taken = sum(len(b.call.placed) for b in on.bubbles)
    assert taken > 0
    assert sum(c.items for c in on.chunks) + taken == sum(c.items for c in off.chunks)
    for b in on.bubbles:
        assert b.stage >= 1 and set(b.forward_s) == {(g, b.stage) for g in range(sizes.dp)}
        assert all(j in b.call.window.chunks for (j, _, _, _) in b.call.placed)


def test_bubble_calls_shorten_a_step_with_one_call_per_step():
    """Where one call per step fits (colocated then runs encoder_first's schedule), moving the
    window's items into the later stage's idle time takes them off stage 0's path."""
    off, _ = _run("multiplex.fill_bubbles=false", "multiplex.chunks_per_cut=64")
    on, _ = _run("multiplex.fill_bubbles=true", "multiplex.chunks_per_cut=64")
    first, _ = _run("multiplex.fill_bubbles=false", "multiplex.placement=encoder_first")
    assert off.timeline.step_s == pytest.approx(first.timeline.step_s, rel=1e-9)
    assert on.timeline.step_s < off.timeline.step_s


def test_bubble_activations_live_from_cut_zero_to_the_tail():
    on, _ = _run("multiplex.fill_bubbles=true", "multiplex.chunks_per_cut=64")
    off, _ = _run("multiplex.fill_bubbles=false", "multiplex.chunks_per_cut=64")
    b = on.bubbles[0]
    cell = next(c for c in on.timeline.cells if (c.group, c.stage) in b.activation and b.activation[(c.group, c.stage)])
    assert cell.live_encoder_peak >= b.activation[(cell.group, cell.stage)]
    # stage 0 no longer keeps those items' activations
    zero = lambda run: max(c.live_encoder_peak for c in run.timeline.cells if c.stage == 0)  # noqa: E731
    assert zero(on) < zero(off)


def test_the_runtime_rule_decides_where_they_apply():
    for over in (["multiplex.exchange=all_to_all"], ["multiplex.encoder_weights=sharded"],
                 ["parallel.pp=1"]):
        run, _ = _run("multiplex.fill_bubbles=auto", *over)
        assert not run.bubbles, over
    run, _ = _run("multiplex.fill_bubbles=auto")
    assert run.bubbles
