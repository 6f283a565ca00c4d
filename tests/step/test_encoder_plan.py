"""The encoder-chunk plan: every item encoded once, every output row delivered to the rank that
asked for it, balanced by cost, and features fetched only from ranks that hold them.

The exchanges are simulated with plain arrays: each rank's output table holds labels
(modality, group, item, row) instead of vectors, so a misrouted row is visible by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dataloading.construct.batch import MediaInputs, MicroBatch
from dataloading.plan.cost import CostModel
from omni.step.encoder_plan import ItemMeta, SplitRules, piece_bounds, plan_chunk
from omni.step.media_manifest import describe_media

COST = CostModel(encoders={"image": (1.0, 10.0), "audio": (2.0, 1.0)})


def _items(rng, groups: int, per_group: int, long_every: int = 0) -> list[ItemMeta]:
    out = []
    for g in range(groups):
        for m in ("image", "audio"):
            for i in range(per_group):
                tokens = int(rng.integers(1, 20))
                if long_every and i % long_every == 0:
                    tokens = int(rng.integers(60, 120))
                out.append(ItemMeta(g, m, i, tokens, units=2 * tokens))
    return out


def _needs(items, group_of, rng) -> dict[int, dict[str, np.ndarray]]:
    """Each group's rows split among its ranks at random (like CP chunks x TP shards)."""
    needs: dict[int, dict[str, list]] = {}
    for g in sorted(set(group_of)):
        ranks = [r for r, gg in enumerate(group_of) if gg == g]
        for m in ("image", "audio"):
            total = sum(it.tokens for it in items if it.group == g and it.modality == m)
            owner = rng.integers(0, len(ranks), total)
            for k, r in enumerate(ranks):
                rows = np.flatnonzero(owner == k)
                rng.shuffle(rows)  # any order: the plan must follow the asker's order
                needs.setdefault(r, {})[m] = rows
    return needs


def _simulate(plan, items, needs, group_of, sp):
    """Run the plan on labels; returns what each rank received for its needs."""
    world = len(group_of)
    by_key = {it.key: it for it in items}
    tables = []
    for r, rp in enumerate(plan.ranks):
        labels = []
        for m in sorted(rp.short):
            for g, i in rp.short[m]:
                labels += [(m, g, i, row) for row in range(by_key[(m, g, i)].tokens)]
            for g, i in rp.long[m]:
                lo, hi = piece_bounds(by_key[(m, g, i)].tokens, sp, r % sp)
                labels += [(m, g, i, row) for row in range(lo, hi)]
        assert len(labels) == rp.table_size
        tables.append(labels)
    recv = [[] for _ in range(world)]
    for src, rp in enumerate(plan.ranks):
        for dst in range(world):
            recv[dst] += [tables[src][t] for t in rp.out_send[dst]]
    for dst in range(world):
        assert [plan.ranks[src].out_recv_counts for src in [dst]][0] == [len(plan.ranks[s].out_send[dst])
                                                                       for s in range(world)]
    got = {}
    for q, per in needs.items():
        for m, _ in per.items():
            got[(q, m)] = [recv[q][k] for k in plan.ranks[q].need_index[m]]
    return got


def _expected(items, needs, group_of):
    out = {}
    for q, per in needs.items():
        g = group_of[q]
        for m, rows in per.items():
            toks = [it.tokens for it in sorted((it for it in items if it.group == g and it.modality == m),
                                               key=lambda it: it.index)]
            starts = np.concatenate([[0], np.cumsum(toks)])
            labels = []
            for row in rows.tolist():
                i = int(np.searchsorted(starts, row, side="right") - 1)
                labels.append((m, g, i, row - int(starts[i])))
            out[(q, m)] = labels
    return out


@pytest.mark.parametrize("sp,long_every,threshold", [(1, 0, None), (2, 3, 40), (4, 2, None), (2, 0, 1000)])
def test_every_row_reaches_the_rank_that_asked(sp, long_every, threshold):
    rng = np.random.default_rng(sp * 10 + long_every)
    group_of = [0, 0, 1, 1, 2, 2, 3, 3]  # 4 data groups x 2 ranks (e.g. TP or CP peers)
    items = _items(rng, 4, 5, long_every)
    needs = _needs(items, group_of, rng)
    plan = plan_chunk(items, needs, group_of, 8, COST,
                      split=SplitRules(sp=sp, long_threshold=threshold, sp_modalities=("image", "audio")))
    assert _simulate(plan, items, needs, group_of, sp) == _expected(items, needs, group_of)
    # every item encoded exactly once (whole, or by exactly one SP block)
    seen = {}
    for r, rp in enumerate(plan.ranks):
        for m in rp.short:
            for g, i in rp.short[m]:
                seen.setdefault((m, g, i), set()).add(("short", r))
            for g, i in rp.long[m]:
                seen.setdefault((m, g, i), set()).add(("long", r // sp))
    assert set(seen) == {it.key for it in items}
    assert all(len(v) == 1 for v in seen.values())
    if sp > 1 and long_every and threshold is not None:
        assert plan.long_items == sum(1 for it in items if it.tokens > threshold)


def test_features_come_from_holders_and_reach_every_encoder():
    rng = np.random.default_rng(7)
    group_of = [0, 0, 1, 1]
    items = _items(rng, 2, 6, long_every=3)
    needs = _needs(items, group_of, rng)
    plan = plan_chunk(items, needs, group_of, 4, COST,
                      split=SplitRules(sp=2, long_threshold=50, sp_modalities=("image",)))
    for m in ("image", "audio"):
        for src, rp in enumerate(plan.ranks):
            for dst in range(4):
                sent = rp.feat_send[m][dst]
                assert sent == plan.ranks[dst].feat_recv[m][src]
                assert all(g == group_of[src] for g, _ in sent)  # only a holder sends
        for r, rp in enumerate(plan.ranks):
            received = sorted(k for src in range(4) for k in rp.feat_recv[m][src])
            assert received == sorted(rp.short[m] + rp.long[m])
    # audio is not splittable here: no long audio item even above the threshold
    assert all(not rp.long["audio"] for rp in plan.ranks)


def test_short_items_are_balanced_by_cost():
    rng = np.random.default_rng(3)
    group_of = list(range(8))
    items = _items(rng, 8, 6)
    plan = plan_chunk(items, {}, group_of, 8, COST)
    loads = np.array([rp.load for rp in plan.ranks])
    costs = [float(COST.media_cost(it.modality, it.tokens)) for it in items]
    assert loads.sum() == pytest.approx(sum(costs))
    assert loads.max() <= sum(costs) / 8 + max(costs)  # the LPT bound
    assert plan.max_over_mean == pytest.approx(loads.max() / loads.mean())
    # a skewed mix: all media in one group still spreads over all ranks
    skewed = [it for it in items if it.group == 0]
    plan = plan_chunk(skewed, {}, group_of, 8, COST)
    assert sum(1 for rp in plan.ranks if rp.load > 0) == 8


def test_eligible_ranks_confine_a_group_to_its_own_ranks():
    rng = np.random.default_rng(5)
    group_of = [0, 0, 1, 1]
    items = _items(rng, 2, 4)
    needs = _needs(items, group_of, rng)
    eligible = {0: [0, 1], 1: [2, 3]}
    plan = plan_chunk(items, needs, group_of, 4, COST, eligible=eligible)
    for r, rp in enumerate(plan.ranks):
        for m in rp.short:
            assert all(group_of[r] == g for g, _ in rp.short[m])
    assert _simulate(plan, items, needs, group_of, 1) == _expected(items, needs, group_of)
    assert all(not any(x for per in rp.feat_send.values() for d, x in enumerate(per) if group_of[d] != group_of[r])
               for r, rp in enumerate(plan.ranks))


def test_auto_threshold_splits_items_heavier_than_a_fair_share():
    group_of = [0, 1, 2, 3]
    items = [ItemMeta(0, "image", 0, 200, 200)] + [ItemMeta(g, "image", i, 5, 5) for g in range(4) for i in
                                                   range(1 if g == 0 else 0, 3)]
    plan = plan_chunk(items, {}, group_of, 4, COST, split=SplitRules(sp=2, sp_modalities=("image",)))
    assert plan.long_items == 1
    assert plan.ranks[0].long["image"] == [(0, 0)] or plan.ranks[2].long["image"] == [(0, 0)]
    plan = plan_chunk(items, {}, group_of, 4, COST, split=SplitRules(sp=1, sp_modalities=("image",)))
    assert plan.long_items == 0


def test_auto_threshold_splits_items_over_the_memory_budget():
    """Eight equal items: none is heavier than a fair share, so cost alone splits nothing;
    with a memory budget below one item's activations every one is split, and an item over
    the budget even in sp pieces is counted (the metrics report it)."""
    items = [ItemMeta(g, "image", i, 40, 40) for g in range(4) for i in range(2)]
    per_token = lambda m, tokens: 1000.0 * tokens  # bytes of activations
    plain = plan_chunk(items, {}, [0, 1, 2, 3], 4, COST, split=SplitRules(sp=2, sp_modalities=("image",)))
    assert plain.long_items == 0 and plain.over_memory == 0
    roomy = plan_chunk(items, {}, [0, 1, 2, 3], 4, COST,
                       split=SplitRules(sp=2, sp_modalities=("image",), item_bytes=per_token, memory_limit=50_000.0))
    assert roomy.long_items == 0
    tight = plan_chunk(items, {}, [0, 1, 2, 3], 4, COST,
                       split=SplitRules(sp=2, sp_modalities=("image",), item_bytes=per_token, memory_limit=30_000.0))
    assert tight.long_items == 8 and tight.over_memory == 0  # 40 000 bytes, 20 000 per SP member
    too_big = plan_chunk(items, {}, [0, 1, 2, 3], 4, COST,
                         split=SplitRules(sp=2, sp_modalities=("image",), item_bytes=per_token, memory_limit=10_000.0))
    assert too_big.long_items == 8 and too_big.over_memory == 8
    # An explicit token threshold is the user's choice: memory does not override it.
    fixed = plan_chunk(items, {}, [0, 1, 2, 3], 4, COST,
                       split=SplitRules(sp=2, long_threshold=100, sp_modalities=("image",), item_bytes=per_token, memory_limit=30_000.0))
    assert fixed.long_items == 0 and fixed.over_memory == 8
    # An encoder that cannot estimate its memory (None) is never split for it.
    unknown = plan_chunk(items, {}, [0, 1, 2, 3], 4, COST,
                         split=SplitRules(sp=2, sp_modalities=("image",), item_bytes=lambda m, t: None, memory_limit=1.0))
    assert unknown.long_items == 0


def _row_with_media() -> MicroBatch:
    """12 tokens: an image of 2x2 patches at positions 2..5 and one of 1x3 at 8..10."""
    ids = torch.arange(12)
    media = MediaInputs(torch.randn(7, 12), torch.tensor([[2, 2], [1, 3]]), torch.tensor([4, 3]),
                        torch.tensor([2, 3, 4, 5, 8, 9, 10]))
    return MicroBatch(ids, ids.clone(), ids.clone(), torch.tensor([0, 12], dtype=torch.int32), media={"image": media})


def test_describe_media_lists_items_and_the_rows_each_shard_embeds():
    mb = _row_with_media()
    units = {"image": lambda sizes: [int(h) * int(w) for h, w in sizes.tolist()]}
    whole = describe_media(mb, units)
    assert whole.items == [("image", 0, 4, 4, (2, 2)), ("image", 1, 3, 3, (1, 3))]
    assert whole.rows["image"].tolist() == list(range(7))
    assert whole.positions["image"].tolist() == [2, 3, 4, 5, 8, 9, 10]
    assert whole.features == {"image": (12, "float32")}
    # Sequence parallelism over 2 TP ranks: shards of 6 tokens, positions relative to the shard.
    first, second = (describe_media(mb, units, tp_size=2, tp_rank=r) for r in (0, 1))
    assert first.rows["image"].tolist() == [0, 1, 2, 3] and first.positions["image"].tolist() == [2, 3, 4, 5]
    assert second.rows["image"].tolist() == [4, 5, 6] and second.positions["image"].tolist() == [2, 3, 4]
    # Under CP a rank holds some placeholders: output_rows says which rows they take.
    mb.media["image"].output_rows = torch.tensor([0, 1, 6])
    mb.media["image"].positions = torch.tensor([0, 1, 7])
    assert describe_media(mb, units).rows["image"].tolist() == [0, 1, 6]


def test_describe_media_refuses_device_tensors():
    mb = _row_with_media().to("meta")
    with pytest.raises(ValueError, match="describe the image inputs before moving the micro-batch to the device"):
        describe_media(mb, {"image": lambda sizes: [4, 3]})


def test_piece_bounds_cover_an_item_once():
    for n in (1, 2, 5, 8, 13):
        for sp in (1, 2, 3, 4):
            rows = [r for m in range(sp) for r in range(*piece_bounds(n, sp, m))]
            assert rows == list(range(n))


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="must divide"):
        plan_chunk([], {}, [0, 1, 2], 3, COST, split=SplitRules(sp=2))
    items = [ItemMeta(0, "image", 0, 3, 3)]
    with pytest.raises(ValueError, match="needs image output row 5"):
        plan_chunk(items, {0: {"image": np.array([5])}}, [0], 1, COST)
