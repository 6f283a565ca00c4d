"""The layout: rank order and every validation error (no processes needed)."""
from __future__ import annotations

import pytest

from parallel.config import ParallelConfig
from parallel.layout import LayoutError, Sizes, all_coords, check_model_fits, check_sequence, resolve_sizes


def test_rank_order_is_tp_innermost_then_cp_dp_and_pp_outermost():
    sizes = Sizes(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2)
    coords = all_coords(sizes)
    assert [c["tp"] for c in coords[:4]] == [0, 1, 0, 1]  # neighbours differ in tp first
    assert [c["cp"] for c in coords[:4]] == [0, 0, 1, 1]
    assert [c["dp_shard"] for c in coords[:8]] == [0] * 4 + [1] * 4
    assert [c["pp"] for c in coords] == [0] * 8 + [1] * 8
    for rank, c in enumerate(coords):
        assert sizes.coords(rank) == c and sizes.rank_of(**c) == rank


def test_dp_shard_minus_one_takes_the_remaining_ranks():
    sizes = resolve_sizes(ParallelConfig(tp=2, pp=2), world=16)
    assert (sizes.dp_shard, sizes.dp) == (4, 4)


@pytest.mark.parametrize("cfg,world,match", [
    (ParallelConfig(dp_shard=2, tp=2), 8, r"= 4, but 8 ranks were launched"),
    (ParallelConfig(tp=3), 8, r"does not divide the 8 launched ranks"),
    (ParallelConfig(dp_shard=2, ep=4), 2, r"parallel.ep=4 must divide dp_shard x cp = 2 x 1"),
    (ParallelConfig(pp=2, pp_schedule="interleaved_1f1b"), 2, r"set parallel.pp_virtual_stages=2"),
    (ParallelConfig(pp=2, pp_virtual_stages=2), 2, r"use pp_schedule=interleaved_1f1b or zero_bubble"),
    (ParallelConfig(pp_schedule="dualpipe"), 1, r"pp_schedule=dualpipe is not one of gpipe, 1f1b"),
    (ParallelConfig(cp_impl="allgather"), 1, r"cp_impl=allgather is not one of ring, ulysses"),
    (ParallelConfig(tp=16, gpus_per_node=8), 16, r"tp=16 does not fit in a node of 8 ranks"),
    (ParallelConfig(tp=0), 1, r"parallel.tp=0 must be >= 1"),
])
def test_launch_errors_name_the_key_and_the_fix(cfg, world, match):
    with pytest.raises(LayoutError, match=match):
        resolve_sizes(cfg, world)


def test_model_errors_name_the_numbers():
    model = dict(num_heads=4, num_kv_heads=2, num_layers=4, num_experts=4)
    check_model_fits(Sizes(tp=2, pp=2, ep=2, dp_shard=2), **model)  # fits
    with pytest.raises(LayoutError, match=r"tp=4 must divide the attention heads \(4\) and the KV heads \(2\)"):
        check_model_fits(Sizes(tp=4), **model)
    with pytest.raises(LayoutError, match=r"4 layers cannot be split evenly into pp x pp_virtual_stages = 4 x 2"):
        check_model_fits(Sizes(pp=4), **model, virtual_stages=2)
    with pytest.raises(LayoutError, match=r"ep=8 must divide the 4 experts"):
        check_model_fits(Sizes(ep=8, dp_shard=8), **model)
    with pytest.raises(LayoutError, match=r"needs a mixture-of-experts model"):
        check_model_fits(Sizes(ep=2, dp_shard=2), **{**model, "num_experts": 0})
    with pytest.raises(LayoutError, match=r"cp_impl=ulysses splits the 4 heads"):
        check_model_fits(Sizes(cp=8), **model, cp_impl="ulysses")


def test_sequence_must_split_into_2cp_chunks_and_tp_shards():
    check_sequence(Sizes(cp=2, tp=2), 1024)
    with pytest.raises(LayoutError, match=r"micro_batch_tokens=1000 is not divisible by 2 x cp x tp = 24"):
        check_sequence(Sizes(cp=3, tp=4), 1000)
    with pytest.raises(LayoutError, match=r"not divisible by tp = 4"):
        check_sequence(Sizes(tp=4), 1022)


def test_dp_group_rank_inverts_dp_group():
    from parallel.sizing import Sizes

    sizes = Sizes(pp=2, dp_replicate=2, dp_shard=3, cp=2, tp=2)
    for g in range(sizes.dp):
        for pp in range(2):
            r = sizes.dp_group_rank(g, pp=pp, tp=1)
            assert sizes.dp_group(r) == g and sizes.coords(r)["pp"] == pp and sizes.coords(r)["tp"] == 1
