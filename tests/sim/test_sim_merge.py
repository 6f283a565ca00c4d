"""A vision tower with a spatial merge (``encoders.vision.params.spatial_merge``) in the
simulator: an image of n encoder tokens fills n / merge^2 LLM placeholders (the tower's own
answer, ``EncoderAnchor.simulated_item``), drawn items are whole merge groups, the image ratio still sets
the media share of the LLM's tokens, the planners count items by their placeholders, and the
encoder does merge^2 times the work per LLM token."""
from __future__ import annotations

import pytest

from omni.sim.data import draw_steps
from omni.sim.work import media_rows, step_media_share
from omni.sim.one_step import one_step_for_calibration
from omni.sim.spec import model_spec
from recipes.simulate_cmd import load_sim_config

BASE = ["workload=A", "encoders.vision.params.spatial_merge=1", "encoders.vision.params.max_patches=1024",
        "cluster.num_gpus=16", "data.global_batch_size=32", "data.steps=2", "data.image_ratio=0.6",
        "multiplex.placement=colocated", "sim.chunks_per_cut_search=false"]
MERGED = [*BASE, "encoders.vision.params.spatial_merge=2"]


def _spec_and_steps(over):
    cfg = load_sim_config(over)
    spec = model_spec(cfg.model, cfg.encoders)
    return cfg, spec, draw_steps(cfg.data, spec, 2)


def test_items_fill_a_placeholder_per_merge_group():
    cfg, spec, steps = _spec_and_steps(MERGED)
    assert spec.encoders["image"].tokens_per_row == 4
    items = [it for s in steps for it in s.media()]
    assert items and all(n % 4 == 0 and rows == n // 4 for _, n, rows in items)
    assert media_rows(items[:3]) == [(m, n // 4) for m, n, _ in items[:3]]
    assert spec.encoders["image"].item(1024) == (1024, 256) and spec.encoders["image"].item(1023) == (1024, 256)
    for s in steps:  # the documents hold the placeholders, not the encoder tokens
        for g in s.groups:
            for mb in g:
                assert mb.tokens <= cfg.data.micro_batch_tokens
    share = sum(step_media_share(s) for s in steps) / len(steps)
    assert share == pytest.approx(0.6, abs=0.1)


def test_the_cost_model_counts_rows_and_the_encoder_runs_tokens():
    _, plain, _ = _spec_and_steps(BASE)
    _, merged, _ = _spec_and_steps(MERGED)
    e0, e1 = plain.encoders["image"], merged.encoders["image"]
    assert e1.alpha == pytest.approx(e0.alpha) and e1.beta < e0.beta + 1e-9  # per encoder token
    # one placeholder's cost: the encoder's four tokens behind it
    n = 64
    row_cost = merged.cost.media_cost("image", n)
    assert row_cost == pytest.approx(e1.alpha * (4 * n) ** 2 + e1.beta * 4 * n, rel=1e-9)


def test_merging_makes_the_encoder_a_bigger_share_of_the_step():
    run0, _ = one_step_for_calibration(load_sim_config(BASE))
    run1, _ = one_step_for_calibration(load_sim_config(MERGED))
    enc = lambda run: sum(c.encoder_s for c in run.timeline.cells) / len(run.timeline.cells)  # noqa: E731
    llm = lambda run: sum(c.llm_s for c in run.timeline.cells) / len(run.timeline.cells)  # noqa: E731
    assert enc(run1) / llm(run1) > 2.5 * enc(run0) / llm(run0)
