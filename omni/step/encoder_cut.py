"""Several encoder chunks planned as one: the ``multiplex.chunks_per_cut`` chunks of an insertion
point balanced together and routed in one feature exchange per modality, one encoder call per
modality and one output exchange, so the fixed cost of a call is paid once per cut rather than
once per chunk (``omni.step.encoder_plan.plan_chunk`` plans each call)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dataloading.plan.cost import CostModel
from omni.step.encoder_plan import ChunkPlan, ItemMeta, plan_chunk


@dataclass
class CutPlan:
    """Several encoder chunks planned as one (``plan_cut``): one call's plan over their items.

    Inside ``plan`` an item is named by (modality, group, cut index): a group's items of one
    modality numbered on through the chunks (chunk 0's first, then chunk 1's, ...), and their
    output rows likewise, so the group's items of the cut read as one long micro-batch.
    ``origin`` maps a cut index back to the chunk and the item's index in it."""

    plan: ChunkPlan
    origin: dict[tuple[str, int, int], tuple[int, int]]  # (modality, group, cut index) -> (chunk, index)
    # need_index[r][c][modality]: into rank r's receive buffer of the cut, the rows rank r asked
    # for in chunk c (in its order); what ``RankPlan.need_index`` is for a single chunk.
    need_index: list[list[dict[str, np.ndarray]]]
    items: list[ItemMeta]  # the cut's items, renumbered


def plan_cut(
    items_by_chunk: Sequence[Sequence[ItemMeta]],
    needs_by_chunk: Sequence[Mapping[int, Mapping[str, np.ndarray]]],
    group_of: Sequence[int],
    world: int,
    cost: CostModel,
    pinned: Mapping[tuple[int, str, int, int], int] | None = None,
    **kwargs,
) -> CutPlan:
    """Plan the chunks of one insertion point together: ``items_by_chunk[c]`` and
    ``needs_by_chunk[c]`` are what ``plan_chunk`` takes for chunk c (item indices and rows
    relative to chunk c's micro-batches); ``kwargs`` are ``plan_chunk``'s. The items are
    balanced as one set (and the auto long threshold compares them with the cut's share per
    rank), and every rank gets one receive buffer for the cut, ``need_index`` saying where in it
    each chunk's rows are. One chunk: the plan is ``plan_chunk``'s, indices unchanged.
    ``pinned``: (chunk position c, modality, group, index in chunk c) -> the rank that encodes
    the item whole."""
    merged: list[ItemMeta] = []
    origin: dict[tuple[str, int, int], tuple[int, int]] = {}
    before: dict[tuple[str, int], tuple[int, int]] = {}  # (modality, group) -> (items, rows) of earlier chunks
    row_base: list[dict[tuple[str, int], int]] = []
    before_of: list[dict[tuple[str, int], int]] = []  # per chunk: items of earlier chunks, per (modality, group)
    for c, items in enumerate(items_by_chunk):
        row_base.append({k: rows for k, (_, rows) in before.items()})
        before_of.append({k: n_items for k, (n_items, _) in before.items()})
        seen = dict(before)
        for it in items:
            n_items, n_rows = before.get((it.modality, it.group), (0, 0))
            renamed = ItemMeta(it.group, it.modality, n_items + it.index, it.tokens, it.units)
            merged.append(renamed)
            origin[renamed.key] = (c, it.index)
            k, r = seen.get((it.modality, it.group), (0, 0))
            seen[(it.modality, it.group)] = (k + 1, r + it.tokens)
        before = seen
    needs: dict[int, dict[str, list[np.ndarray]]] = {}
    lengths: dict[int, dict[str, list[int]]] = {}
    for c, per_rank in enumerate(needs_by_chunk):
        for q, per_modality in per_rank.items():
            for m, rows in per_modality.items():
                rows = np.asarray(rows, dtype=np.int64)
                needs.setdefault(q, {}).setdefault(m, []).append(rows + row_base[c].get((m, group_of[q]), 0))
                lengths.setdefault(q, {}).setdefault(m, [0] * len(needs_by_chunk))[c] = rows.size
    flat = {q: {m: np.concatenate(parts) for m, parts in per.items()} for q, per in needs.items()}
    renamed_pins = {}
    for key, r in (pinned or {}).items():
        c, m, g, i = key
        renamed_pins[(m, g, i + before_of[c].get((m, g), 0))] = r
    plan = plan_chunk(merged, flat, group_of, world, cost, pinned=renamed_pins, **kwargs)
    need_index = [[{} for _ in needs_by_chunk] for _ in range(world)]
    for q, per in lengths.items():
        for m, counts in per.items():
            at = 0
            for c, n in enumerate(counts):
                if c < len(needs_by_chunk) and m in needs_by_chunk[c].get(q, {}):
                    need_index[q][c][m] = plan.ranks[q].need_index[m][at:at + n]
                at += n
    return CutPlan(plan, origin, need_index, merged)
