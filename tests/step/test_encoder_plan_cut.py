"""One encoder call per insertion point: ``plan_cut`` plans the chunks of a cut group as one
(items balanced together, one receive buffer per rank), and every chunk's rows still reach the
rank and order that asked for them. The exchanges are simulated on labels (chunk, modality,
group, item, row): a row of the wrong micro-batch is visible by name."""
from __future__ import annotations

import numpy as np
import pytest

from dataloading.plan.cost import CostModel
from omni.step.encoder_cut import plan_cut
from omni.step.encoder_plan import ItemMeta, SplitRules, piece_bounds, plan_chunk, splits
from test_encoder_plan import _expected as expected_chunk

COST = CostModel(encoders={"image": (1.0, 10.0), "audio": (2.0, 1.0)})
MODALITIES = ("image", "audio")


def _chunk_items(rng, groups: int, long_every: int = 0) -> list[ItemMeta]:
    out = []
    for g in range(groups):
        for m in MODALITIES:
            for i in range(int(rng.integers(0, 4))):  # some groups have none of a modality
                tokens = int(rng.integers(60, 120)) if long_every and i % long_every == 0 else int(rng.integers(1, 20))
                out.append(ItemMeta(g, m, i, tokens, units=2 * tokens))
    return out


def _chunk_needs(items, group_of, rng) -> dict[int, dict[str, np.ndarray]]:
    """Each group's rows of the chunk split among its ranks at random, in a random order."""
    needs: dict[int, dict[str, np.ndarray]] = {}
    for g in sorted(set(group_of)):
        ranks = [r for r, gg in enumerate(group_of) if gg == g]
        for m in MODALITIES:
            total = sum(it.tokens for it in items if it.group == g and it.modality == m)
            if not total:
                continue
            owner = rng.integers(0, len(ranks), total)
            for k, r in enumerate(ranks):
                rows = np.flatnonzero(owner == k)
                rng.shuffle(rows)
                needs.setdefault(r, {})[m] = rows
    return needs


def _labels_of(items, c):
    """(chunk, modality, group, index, row) of every row of chunk c's items."""
    return {it.key: [(c, it.modality, it.group, it.index, row) for row in range(it.tokens)] for it in items}


def _simulate_cut(cut, items_by_chunk, group_of, sp):
    """Run the cut's plan on labels: each rank's table (its short items, then its pieces of
    its block's long items), the output exchange, and every rank's rows per chunk."""
    world = len(group_of)
    labels = {}
    for c, items in enumerate(items_by_chunk):
        for it in items:
            labels[(c, it.key)] = _labels_of([it], c)[it.key]
    tokens = {it.key: it.tokens for it in cut.items}
    tables = []
    for r, rp in enumerate(cut.plan.ranks):
        table = []
        for m in sorted(rp.short):
            for g, i in rp.short[m]:
                c, index = cut.origin[(m, g, i)]
                table += labels[(c, (m, g, index))]
            for g, i in rp.long[m]:
                c, index = cut.origin[(m, g, i)]
                lo, hi = piece_bounds(tokens[(m, g, i)], sp, r % sp)
                table += labels[(c, (m, g, index))][lo:hi]
        assert len(table) == rp.table_size
        tables.append(table)
    recv = [[] for _ in range(world)]
    for src, rp in enumerate(cut.plan.ranks):
        for dst in range(world):
            recv[dst] += [tables[src][t] for t in rp.out_send[dst]]
    return {(q, c, m): [recv[q][k] for k in idx] for q in range(world)
            for c, per in enumerate(cut.need_index[q]) for m, idx in per.items()}


def _expected(items_by_chunk, needs_by_chunk, group_of):
    """Each chunk's expected (chunk, modality, group, item, offset) labels, from the one-chunk
    reference of test_encoder_plan.py."""
    out = {}
    for c, (items, needs) in enumerate(zip(items_by_chunk, needs_by_chunk)):
        for (q, m), labels in expected_chunk(items, needs, group_of).items():
            out[(q, c, m)] = [(c, *label) for label in labels]
    return out


@pytest.mark.parametrize("chunks,sp,long_every,threshold", [(3, 1, 0, None), (2, 2, 2, 40), (4, 4, 2, None)])
def test_every_chunks_rows_reach_the_rank_that_asked(chunks, sp, long_every, threshold):
    rng = np.random.default_rng(100 * chunks + sp)
    group_of = [0, 0, 1, 1, 2, 2, 3, 3]
    items_by_chunk = [_chunk_items(rng, 4, long_every) for _ in range(chunks)]
    needs_by_chunk = [_chunk_needs(items, group_of, rng) for items in items_by_chunk]
    cut = plan_cut(items_by_chunk, needs_by_chunk, group_of, 8, COST,
                   split=SplitRules(sp=sp, long_threshold=threshold, sp_modalities=MODALITIES))
    assert _simulate_cut(cut, items_by_chunk, group_of, sp) == _expected(items_by_chunk, needs_by_chunk, group_of)
    # every item of every chunk is in the one call exactly once
    assert sorted(cut.origin.values()) == sorted((c, it.index) for c, items in enumerate(items_by_chunk)
                                                 for it in items)
    assert len(cut.items) == sum(len(items) for items in items_by_chunk)
    encoded = [(m, g, i) for rp in cut.plan.ranks for m in rp.short for g, i in rp.short[m]]
    encoded += [(m, g, i) for b, rp in enumerate(cut.plan.ranks) if b % sp == 0 for m in rp.long for g, i in rp.long[m]]
    assert sorted(encoded) == sorted(it.key for it in cut.items)


def test_features_of_the_cut_come_from_holders():
    """The feature routes name cut items; a holder of the item's group sends each one, and each
    encoder receives exactly the items it encodes (the runtime reads them back by ``origin``)."""
    rng = np.random.default_rng(5)
    group_of = [0, 0, 1, 1]
    items_by_chunk = [_chunk_items(rng, 2, long_every=2) for _ in range(3)]
    needs_by_chunk = [_chunk_needs(items, group_of, rng) for items in items_by_chunk]
    cut = plan_cut(items_by_chunk, needs_by_chunk, group_of, 4, COST,
                   split=SplitRules(sp=2, long_threshold=50, sp_modalities=("image",)))
    for m in sorted(cut.plan.ranks[0].feat_send):
        for src, rp in enumerate(cut.plan.ranks):
            for dst in range(4):
                assert rp.feat_send[m][dst] == cut.plan.ranks[dst].feat_recv[m][src]
                assert all(g == group_of[src] for g, _ in rp.feat_send[m][dst])
        for rp in cut.plan.ranks:
            assert sorted(k for src in range(4) for k in rp.feat_recv[m][src]) == sorted(rp.short[m] + rp.long[m])


def test_one_chunk_is_plan_chunk():
    rng = np.random.default_rng(11)
    group_of = [0, 0, 1, 1]
    items = _chunk_items(rng, 2, long_every=2)
    needs = _chunk_needs(items, group_of, rng)
    alone = plan_chunk(items, needs, group_of, 4, COST, split=SplitRules(sp=2, sp_modalities=MODALITIES))
    cut = plan_cut([items], [needs], group_of, 4, COST, split=SplitRules(sp=2, sp_modalities=MODALITIES))
    assert cut.origin == {it.key: (0, it.index) for it in items}
    for a, b, q in zip(alone.ranks, cut.plan.ranks, range(4)):
        assert a.short == b.short and a.long == b.long and a.feat_send == b.feat_send
        assert [x.tolist() for x in a.out_send] == [x.tolist() for x in b.out_send]
        assert {m: v.tolist() for m, v in a.need_index.items()} == \
            {m: v.tolist() for m, v in cut.need_index[q][0].items()}


def test_auto_split_pays_only_above_the_fixed_cost_and_the_cuts_share():
    # the rule alone
    assert splits(100.0, 50.0, 2)
    assert not splits(40.0, 50.0, 2)  # not above the share: whole is as fast
    assert not splits(100.0, 50.0, 2, fixed_cost=60.0)  # halving saves 50 < 60
    assert splits(100.0, 50.0, 4, fixed_cost=60.0)  # quartering saves 75 > 60
    # in the planner: one big image and small ones on 2 ranks (one SP block of 2)
    big = ItemMeta(0, "image", 0, 30, 30)  # cost 30^2 + 300 = 1200
    small = [ItemMeta(1, "image", i, 10, 10) for i in range(4)]  # cost 200 each
    one = plan_cut([[big, *small]], [{}], [0, 1], 2, COST, split=SplitRules(sp=2, sp_modalities=("image",)))
    assert one.plan.long_items == 1  # 1200 > share (2000 / 2) and the SP pass is free
    costly = plan_cut([[big, *small]], [{}], [0, 1], 2, COST,
                      split=SplitRules(sp=2, sp_modalities=("image",), split_fixed_cost=700.0))
    assert costly.plan.long_items == 0  # halving saves 600, the pass costs 700
    # the same chunk in a cut with a second, busier chunk: the call's share (2600) exceeds the item
    other = [ItemMeta(1, "image", i, 10, 10) for i in range(6)]
    grouped = plan_cut([[big, *small], other], [{}, {}], [0, 1], 2, COST,
                       split=SplitRules(sp=2, sp_modalities=("image",)))
    assert grouped.plan.long_items == 0
