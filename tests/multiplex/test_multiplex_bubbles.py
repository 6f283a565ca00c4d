"""Bubble calls (multiplex.fill_bubbles, omni/step/bubbles.py): the later pipeline ranks
encode some of their data group's items while they wait for their first activation, deliver
the rows to stage 0 at their window's delivery cut, take the gradients back at its tail cut
and run the backward there. Every layout trains like the single-process run with inline
encoders (losses, gradient norms and every first-step gradient to 1e-5, fp32), on 2, 4 and 8
ranks: 1F1B and interleaved 1F1B, replicated and hybrid encoder weights (shard groups inside
a pipeline rank), p2p and all_to_all cut-group exchanges, grouped calls (whose forwards before
a delivery cut leave the busy ranks out), a frozen encoder, bf16 autocast; and every layout really gave the
bubbles items (a layout that fills nothing tests nothing)."""
from __future__ import annotations

import pytest

from layout_harness import check_named_layouts, run_named_layouts

BOTH = {"moe": False, "num_layers": 4, "media": ("image", "audio")}
FROZEN = {**BOTH, "frozen": ("image",)}
SHORT = {"steps": 3}
MANY = {"steps": 2, "micro": 8}  # enough micro-batches per data group for a window to hold some
ON = {"fill_bubbles": "true", "exchange": "p2p"}
REPLICATED = {**ON, "encoder_weights": "replicated"}
PP2 = dict(dp_shard=1, pp=2, pp_schedule="1f1b")
PP2_DP2 = dict(dp_shard=2, pp=2, pp_schedule="1f1b")
PP4 = dict(dp_shard=1, pp=4, pp_schedule="1f1b")
PP_TP_DP = dict(pp=2, tp=2, dp_shard=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)

LAYOUTS = {
    2: [
        ("pp=2 1f1b, replicated, p2p", PP2, BOTH, SHORT, REPLICATED),
        ("pp=2 1f1b, replicated, frozen vision tower", PP2, FROZEN, SHORT, REPLICATED),
        # bf16 autocast: a rank that encodes nothing in a bubble call still receives bf16 rows
        ("pp=2 1f1b, replicated, bf16 autocast", PP2, {**BOTH, "precision": "bf16"}, SHORT, REPLICATED),
    ],
    4: [
        ("pp=2 x dp_shard=2, hybrid (a shard group per pipeline rank)", PP2_DP2, BOTH, MANY,
         {**ON, "encoder_weights": "hybrid", "encoder_shard_group": 2}),
        ("pp=4 1f1b, replicated, all_to_all cut groups of 2", PP4, BOTH, SHORT,
         {**REPLICATED, "exchange": "all_to_all", "chunks_per_cut": 2}),
    ],
    8: [
        ("pp=2 x tp=2 x dp_shard=2 interleaved, hybrid", PP_TP_DP, BOTH, MANY,
         {**ON, "encoder_weights": "hybrid", "encoder_shard_group": 4}),
    ],
}


def _bubble_items(pm, result):
    result["bubble_items"] = result.get("bubble_items", 0) + pm.multiplexer.stats.bubble_items


def _worker(rank, world, layouts, out_dir):
    run_named_layouts(rank, layouts, out_dir, probe=_bubble_items)


def _filled(name, rank, sizes, mux, result):
    return [] if result.get("bubble_items") else ["no bubble call took an item (the layout tests nothing)"]


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_bubble_calls_equal_single_process(world, tmp_path):
    check_named_layouts(world, LAYOUTS[world], tmp_path, _worker, extra=_filled)
