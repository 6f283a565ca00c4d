"""Bubble calls' planning (omni/step/bubbles.py) and when they apply
(omni.step.multiplex_rules.fills_bubbles), on plain numbers: a call takes only items of its
window's micro-batches and of its own cell's data group, never more per GPU than the window's
capacity, never more activations per GPU than the memory budget, and only modalities whose last backward is a
cut group's after every window; the rows of a subset are renumbered consistently; a rank busy
with its call is left out of the cut groups before its delivery cut."""
from __future__ import annotations

import numpy as np
import pytest

from dataloading.plan.cost import CostModel
from omni.step.bubbles import (busy_ranks, capacity, closing_modalities, forward_unit_cost, select_bubble_items,
                                    split_items, split_rows)
from omni.step.encoder_plan import ItemMeta
from omni.step.multiplex_rules import fills_bubbles
from parallel.pipeline_schedule import BubbleWindow, bubble_windows
from parallel.sizing import LayoutError, Sizes

COST = CostModel(alpha=0.0, beta=1.0, encoders={"image": (0.0, 1.0), "audio": (0.0, 1.0)})


def _items(n_chunks, groups, per=3, tokens=10):
    return [[ItemMeta(g, m, k, tokens + k, tokens + k) for g in range(groups) for m in ("image", "audio")
             for k in range(per)] for _ in range(n_chunks)]


def test_selection_respects_windows_groups_capacity_and_memory():
    n, groups = 8, 2
    windows = bubble_windows("1f1b", 4, 1, n)
    items = _items(n, groups)
    # encoder ranks: pipeline rank s, data group g, two GPUs per cell (rank order: pp outermost)
    member_stage = [s for s in range(4) for _ in range(groups * 2)]
    group_of = [g for _ in range(4) for g in range(groups) for _ in range(2)]
    unit = {0: 4.0, 1: 6.0}
    limit = 100.0
    calls = select_bubble_items(items, windows, member_stage, group_of, unit, COST,
                                item_bytes=lambda m, t: 3.0 * t, memory_limit=limit)
    assert calls, "nothing taken: the test checks nothing"
    seen = set()
    for call in calls:
        w = call.window
        for (j, m, g, k), r in call.placed.items():
            assert j in w.chunks, "an item of a micro-batch outside the window"
            assert member_stage[r] == w.rank and group_of[r] == g, "encoded outside its own cell"
            assert (j, m, g, k) not in seen, "an item taken twice"
            seen.add((j, m, g, k))
        for r, load in call.loads.items():
            assert load <= capacity(w, unit[group_of[r]]) + 1e-9
            assert sum(3.0 * (10 + k) for (j, m, g, k), rr in call.placed.items() if rr == r) <= limit, \
                "a GPU's bubble activations over the budget"
            got = sum(COST.media_cost(m, 10 + k) for (j, m, g, k), rr in call.placed.items() if rr == r)
            assert load == pytest.approx(float(got))
    # the latest pipeline rank has the most time before its first action: it took something
    assert any(c.stage == 3 for c in calls)


def test_capacity_is_the_tighter_of_the_two_idle_spells():
    w = BubbleWindow(rank=1, before=2.0, deliver_cut=2, tail=5, after=2.0)
    # the forward (a third of an item's cost) fits 2 units, the backward (two thirds) 2 units
    assert capacity(w, 1.0) == pytest.approx(3.0)
    assert capacity(BubbleWindow(1, 1.0, 1, 5, 10.0), 1.0) == pytest.approx(3.0)
    assert forward_unit_cost([30.0, 90.0], pp=2, virtual=2, gpus_per_cell=2) == pytest.approx(60.0 / 24)


def test_a_modality_keeps_its_last_item_with_the_cut_groups():
    windows = bubble_windows("1f1b", 2, 1, 4)  # rank 1: micro-batches 1..2
    items = [[ItemMeta(0, "image", 0, 4, 4)], [ItemMeta(0, "audio", 0, 4, 4), ItemMeta(0, "image", 0, 5, 5)],
             [ItemMeta(0, "image", 0, 6, 6)], []]
    # audio's last item (micro-batch 1) is backwarded at a cut: no bubble call may take audio;
    # image's last one (micro-batch 2) after the pipeline: it stays, the earlier may go
    closing = closing_modalities(items, end_chunks=[2, 3])
    assert closing == {"image": 2}
    calls = select_bubble_items(items, windows, [0, 1], [0, 0], {0: 100.0}, COST, modalities=closing)
    assert {key for c in calls for key in c.placed} == {(1, "image", 0, 0)}


def test_subsets_renumber_items_and_rows():
    items = [[ItemMeta(0, "image", k, t, t) for k, t in enumerate([3, 2, 4])]]
    parts = split_items(items, lambda j, it: "b" if it.index == 1 else "cut")
    assert [it.index for it in parts["cut"].items[0]] == [0, 1]
    assert parts["cut"].original == {(0, "image", 0, 0): 0, (0, "image", 0, 1): 2}
    assert [(it.index, it.tokens) for it in parts["b"].items[0]] == [(0, 2)]
    rows = np.asarray([0, 3, 4, 5, 8, 2])  # item 0: rows 0-2, item 1: 3-4, item 2: 5-8
    mask, new = split_rows(rows, [3, 2, 4], [True, False, True])
    assert mask.tolist() == [True, False, False, True, True, True]
    assert new.tolist() == [0, 3, 6, 2]
    mask, new = split_rows(rows, [3, 2, 4], [False, True, False])
    assert new.tolist() == [0, 1]


def test_busy_ranks_are_those_before_their_delivery_cut():
    windows = bubble_windows("1f1b", 4, 1, 8)
    member_stage = [0, 1, 2, 3]
    calls = select_bubble_items(_items(8, 1), windows, member_stage, [0, 0, 0, 0], {0: 10.0}, COST)
    stages = {c.stage for c in calls}
    assert busy_ranks(calls, member_stage, 0) == set()  # cut 0: everyone, before the bubble calls start
    for k in (1, 2, 3, 4):
        assert busy_ranks(calls, member_stage, k) == {s for s in stages if k < s}


def test_when_bubble_calls_apply():
    pp2 = Sizes(pp=2, dp_shard=4)
    assert fills_bubbles("auto", "colocated", pp2, "replicated", 1, "p2p")
    assert not fills_bubbles("auto", "colocated", pp2, "replicated", 1, "all_to_all")
    assert fills_bubbles("true", "colocated", pp2, "replicated", 1, "all_to_all")
    assert fills_bubbles("auto", "colocated", pp2, "hybrid", 4, "p2p")
    assert not fills_bubbles("auto", "colocated", pp2, "hybrid", 8, "p2p")  # a shard group spans both stages
    assert not fills_bubbles("false", "colocated", pp2, "replicated", 1, "p2p")
    for placement, sizes, weights, group in (("stage0", pp2, "replicated", 1), ("colocated", Sizes(dp_shard=8),
                                             "replicated", 1), ("colocated", pp2, "sharded", 8),
                                             ("colocated", pp2, "hybrid", 8)):
        assert not fills_bubbles("auto", placement, sizes, weights, group, "p2p")
        with pytest.raises(LayoutError, match="multiplex.fill_bubbles=true cannot apply here"):
            fills_bubbles("true", placement, sizes, weights, group, "p2p")
    with pytest.raises(LayoutError, match="is not one of auto, true, false"):
        fills_bubbles("yes", "colocated", pp2, "replicated", 1, "p2p")
