"""One encoder call per insertion point (multiplex.chunks_per_cut > 1: the cut's chunks planned,
exchanged and encoded together; encoder_first: the whole step) and point-to-point exchanges
(multiplex.exchange=p2p: batched sends between the pairs that trade rows only) train like the
single-process run with inline encoders: losses, gradient norms and every first-step gradient
agree to 1e-5 (fp32), on 2, 4 and 8 ranks, with and without pipeline parallelism, under
colocated, stage0 (p2p inside the first stage's group: group ranks are not global ranks) and
encoder_first. The all_to_all mode with grouped calls is also covered by
test_multiplex_equal_single.py's chunks_per_cut layouts."""
from __future__ import annotations


import pytest

from layout_harness import check_named_layouts, run_named_layouts

IMAGE = {"moe": False, "num_layers": 4, "media": ("image",)}
BOTH = {"moe": False, "num_layers": 4, "media": ("image", "audio")}
LONG = {"long_items": True, "steps": 3}
SHORT = {"steps": 3}
SPLIT = {"encoder_sp": 2, "long_threshold": "5"}
P2P = {"exchange": "p2p"}
PP2 = dict(dp_shard=1, pp=2, pp_schedule="1f1b")
PP2_DP2 = dict(dp_shard=2, pp=2, pp_schedule="1f1b")
PP_TP_DP = dict(pp=2, tp=2, dp_shard=2, pp_schedule="1f1b")

LAYOUTS = {
    2: [
        ("pp=2 1f1b colocated, 2 chunks per call, p2p", PP2, IMAGE, SHORT, {"chunks_per_cut": 2, **P2P}),
        # items cross the two data groups; long items split over both ranks inside a 2-chunk call
        ("dp_shard=2 colocated sp=2 long items, 2 chunks per call, p2p", dict(dp_shard=2), BOTH, LONG,
         {**SPLIT, "chunks_per_cut": 2, **P2P}),
    ],
    4: [
        ("pp=2 x dp_shard=2 stage0, 2 chunks per call, p2p", PP2_DP2, BOTH, SHORT,
         {"placement": "stage0", "chunks_per_cut": 2, **P2P}),
        ("pp=2 x dp_shard=2 colocated, 3 chunks per call, all_to_all", PP2_DP2, BOTH, SHORT, {"chunks_per_cut": 3}),
        ("pp=2 x dp_shard=2 encoder_first, one call per step, p2p", PP2_DP2, BOTH, SHORT,
         {"placement": "encoder_first", **P2P}),
        # each cut group encoded one insertion point early (multiplex.lookahead)
        ("pp=2 x dp_shard=2 colocated, lookahead 1, p2p", PP2_DP2, BOTH, SHORT, {"lookahead": 1, **P2P}),
    ],
    8: [
        ("pp=2 x tp=2 x dp_shard=2 colocated, 2 chunks per call, p2p", PP_TP_DP, IMAGE, SHORT,
         {"chunks_per_cut": 2, **P2P}),
        # p2p alone on these 8 ranks is the default now: test_multiplex_equal_single.py's
        # "pp=2 x tp=2 x dp_shard=2 colocated"
    ],
}


def _long_items(pm, result):
    result["long_items"] = result.get("long_items", 0) + pm.multiplexer.stats.long_items


def _worker(rank, world, layouts, out_dir):
    run_named_layouts(rank, layouts, out_dir, probe=_long_items)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_grouped_calls_and_p2p_equal_single_process(world, tmp_path):
    check_named_layouts(world, LAYOUTS[world], tmp_path, _worker)
