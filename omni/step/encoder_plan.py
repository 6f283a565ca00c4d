"""Where each media item of an encoder chunk is encoded, and where its outputs go.

The encoder-LLM multiplexing runtime runs, for micro-batch j of every data-parallel group at
once, one *encoder chunk*: all media items of micro-batch j, wherever they came from, are
spread over the encoder ranks; then every output row travels to the one LLM rank that embeds
it. This module decides both from metadata alone (plain numbers, no tensors, no collectives),
so every rank computes the same plan and the exchanges need no negotiation:

- **Long-short split**: an item whose encoder token count exceeds the long threshold is split
  over an SP block (``sp`` consecutive ranks, Ulysses attention); the rest are *short* and
  encoded whole on one rank. With ``long_threshold=auto`` an item is split only where that
  pays: it alone exceeds the balanced share per rank, and splitting takes more off its rank
  than the fixed cost the SP pass adds (``split_fixed_cost``), or it does not fit the memory
  budget whole.
- **Balancing**: long items first, then short ones, heaviest first (by the shared cost model),
  each onto the least-loaded eligible rank (a block's load counts 1/sp of the item on each
  member). Ties prefer a rank that already holds the item's features (no transfer), then the
  lowest rank.
- **Features**: a rank that encodes an item it does not hold receives its feature rows from a
  holder (the item's data group), round-robin over holders to spread the sending.
- **Outputs**: row ``i`` of an item is produced by its short rank, or by the SP member whose
  piece holds it (``piece_bounds``), and sent to every rank that needs it.

Buffers are laid out canonically: what rank p sends to rank q is ordered by (modality, group,
item, row), and q reads its receive buffer in source-rank order, so both sides agree without
exchanging indices.

``omni.step.encoder_cut.plan_cut`` plans several chunks (the ``multiplex.chunks_per_cut`` chunks of one insertion
point) as one: their items are balanced together and routed in one feature exchange per
modality, one encoder call per modality and one output exchange, so the fixed cost of a call
is paid once per cut rather than once per chunk.

The plan's inputs come from ``omni.step.media_manifest.describe_media``: each rank's host-side view of its micro-batch
(items, sizes, and which output rows land where under its CP and TP shares), read before the
batch moves to the device, so planning and routing never wait for the accelerator.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataloading.plan.cost import CostModel


@dataclass(frozen=True)
class ItemMeta:
    """One media item of one micro-batch: what planning needs to know about it."""

    group: int  # the data group (data-parallel rank) whose micro-batch holds it
    modality: str
    index: int  # position among that micro-batch's items of this modality
    tokens: int  # encoder tokens = output rows
    units: int  # feature rows (patches, mel frames) the encoder reads

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.modality, self.group, self.index)


@dataclass(frozen=True)
class SplitRules:
    """The long-short split of a step's encoder calls, fixed for the run: SP blocks of ``sp``
    ranks; ``long_threshold``: encoder tokens above which an item is long (None: ``auto``, an
    item whose cost alone exceeds the call's balanced share per rank and whose split pays
    (``splits``), or whose activations ``item_bytes(modality, tokens)`` exceed ``memory_limit``
    bytes); only ``sp_modalities`` can be split; ``split_fixed_cost``: the SP pass's fixed cost in
    the cost model's units."""

    sp: int = 1
    long_threshold: int | None = None
    sp_modalities: Sequence[str] = ()
    item_bytes: Callable[[str, int], float | None] | None = None
    memory_limit: float | None = None
    split_fixed_cost: float = 0.0


NO_SPLIT = SplitRules()


@dataclass
class RankPlan:
    """One rank's part of an encoder chunk."""

    # modality -> per peer rank: the items (group, index) whose full features go to / come from it.
    feat_send: dict[str, list[list[tuple[int, int]]]] = field(default_factory=dict)
    feat_recv: dict[str, list[list[tuple[int, int]]]] = field(default_factory=dict)
    # modality -> items encoded whole here / long items of this rank's SP block (same list and
    # order on every member of the block).
    short: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    long: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    sp_block: int | None = None
    # The local output table: for modality in sorted order, the short items' rows (item after
    # item), then this member's pieces of the long items. out_send[q]: table rows for rank q.
    out_send: list[np.ndarray] = field(default_factory=list)
    out_recv_counts: list[int] = field(default_factory=list)
    # modality -> index into the receive buffer for each row this rank asked for (its order).
    need_index: dict[str, np.ndarray] = field(default_factory=dict)
    table_size: int = 0  # rows of the local output table
    load: float = 0.0  # planned encoder cost on this rank


@dataclass
class ChunkPlan:
    ranks: list[RankPlan]
    long_items: int
    max_over_mean: float  # encoder load balance of the chunk (1.0 = perfect)
    # Items whose estimated activation memory exceeds the budget even where they are encoded
    # (whole, or split over sp ranks): candidates for out-of-memory, reported in the metrics.
    over_memory: int = 0


def piece_bounds(n_tokens: int, sp: int, member: int, granule: int = 1) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of an item of ``n_tokens`` that SP member ``member`` of ``sp``
    holds: pieces of ceil(n/sp) rows (the last members of a short item may hold none, e.g. 3
    tokens over 4 members: 1, 1, 1, 0). ``granule``: pieces are whole groups of that many rows
    (an encoder whose projector merges ``granule`` tokens into one output row: its token pieces
    are the output rows' pieces times the granule; ``n_tokens`` is then a multiple of it)."""
    if sp < 1 or not 0 <= member < sp or n_tokens < 0 or granule < 1 or n_tokens % granule:
        raise ValueError(f"piece_bounds: need sp >= 1, 0 <= member < sp, n_tokens >= 0 and a multiple of "
                         f"granule >= 1, got sp={sp}, member={member}, n_tokens={n_tokens}, granule={granule}")
    n = n_tokens // granule
    c = -(-n // sp)
    lo = min(member * c, n)
    return lo * granule, min(lo + c, n) * granule


@dataclass
class Assignment:
    """Who encodes what in one chunk (``assign_items``): the part of the plan that decides the
    work; ``plan_chunk`` adds the routes. The scale simulator (``omni.sim``) uses it alone."""

    placed: dict[tuple, int]  # short item key -> rank
    long_of_block: dict[int, list[ItemMeta]]  # SP block -> its long items
    block_of: dict[tuple, int]  # long item key -> SP block
    loads: np.ndarray  # [world] planned cost per rank (base loads included)
    chunk_loads: np.ndarray  # [world] of which this chunk's
    memory: dict[tuple, float]  # item key -> estimated activation bytes (when a limit is set)
    sp: int

    def block(self, b: int) -> list[int]:
        return list(range(b * self.sp, (b + 1) * self.sp))

    @property
    def balance(self) -> float:
        """This chunk's max / mean cost over ranks (1.0 = perfect)."""
        mean = float(self.chunk_loads.mean()) if self.chunk_loads.size else 0.0
        return float(self.chunk_loads.max() / mean) if mean > 0 else 1.0


def assign_items(
    items: Sequence[ItemMeta],
    group_of: Sequence[int],
    world: int,
    cost: CostModel,
    split: SplitRules = NO_SPLIT,
    eligible: Mapping[int, Sequence[int]] | None = None,
    base_loads: Sequence[float] | None = None,
    pinned: Mapping[tuple, int] | None = None,
) -> Assignment:
    """The long-short split and the balancing of ``plan_chunk`` (its docstring has the
    arguments). ``base_loads``: cost each rank already carries (e.g. earlier chunks of the step)
    that the balancing evens out too; None: zeros. ``split``: ``SplitRules``.
    ``pinned``: item key -> the rank that encodes it whole, decided elsewhere (a bubble call's
    items, ``omni.step.bubbles``)."""
    sp, long_threshold, sp_modalities = split.sp, split.long_threshold, split.sp_modalities
    item_bytes, memory_limit, split_fixed_cost = split.item_bytes, split.memory_limit, split.split_fixed_cost
    if sp < 1 or world % sp:
        raise ValueError(f"encoder SP size {sp} must divide the {world} encoder ranks")
    group_arr = np.asarray(group_of, dtype=np.int64)
    # Without eligibility every rank may encode any group's items, also a group none of the
    # ranks belongs to (a disaggregated encoder pool smaller than the LLM's DP size).
    groups = sorted(set(group_of) | ({it.group for it in items} if eligible is None else set()))
    allowed = {g: np.arange(world) if eligible is None else np.asarray(sorted(eligible[g]), dtype=np.int64)
               for g in groups}
    costs = {it.key: float(cost.media_cost(it.modality, it.tokens)) for it in items}
    total = sum(costs.values())
    share = total / world if world else 0.0
    n_blocks = world // sp
    memory = {it.key: _bytes(item_bytes, it) for it in items} if memory_limit is not None else {}

    pinned = pinned or {}

    def is_long(it: ItemMeta) -> bool:
        if sp == 1 or it.modality not in sp_modalities or it.tokens < sp or it.key in pinned:
            return False
        if long_threshold is None:
            return (bool(memory) and memory[it.key] > memory_limit) or \
                splits(costs[it.key], share, sp, split_fixed_cost)
        return it.tokens > long_threshold

    base = np.zeros(world) if base_loads is None else np.asarray(base_loads, dtype=np.float64)
    loads = base.copy()
    order = sorted(items, key=lambda it: (-costs[it.key], it.key))
    long_of_block: dict[int, list[ItemMeta]] = {}
    block_of: dict[tuple, int] = {}
    placed: dict[tuple, int] = {}
    block_ok: dict[int, np.ndarray] = {}
    # Long items first (each fills a whole SP block), then the short ones fill in around them.
    for it in [it for it in order if is_long(it)] + [it for it in order if not is_long(it)]:
        if it.key not in placed and is_long(it):  # onto the SP block whose busiest member is least loaded
            if it.group not in block_ok:
                ok = np.zeros(world, dtype=bool)
                ok[allowed[it.group]] = True
                block_ok[it.group] = np.flatnonzero(ok.reshape(n_blocks, sp).all(axis=1))
            ok_blocks = block_ok[it.group]
            if ok_blocks.size == 0:
                raise ValueError(f"no encoder SP block of {sp} ranks may encode group {it.group}'s {it.modality} "
                                 f"items; lower multiplex.encoder_sp")
            busiest = loads.reshape(n_blocks, sp).max(axis=1)[ok_blocks]
            b = int(ok_blocks[int(np.argmin(busiest))])  # argmin: the lowest block among ties
            long_of_block.setdefault(b, []).append(it)
            block_of[it.key] = b
            loads[b * sp:(b + 1) * sp] += costs[it.key] / sp
        elif it.key in pinned:
            placed[it.key] = int(pinned[it.key])
            loads[placed[it.key]] += costs[it.key]
        else:  # onto the least-loaded eligible rank, preferring one that holds the features
            cand = allowed[it.group]
            cl = loads[cand]
            ties = cand[cl == cl.min()]
            local = ties[group_arr[ties] == it.group]
            r = int(local[0] if local.size else ties[0])
            placed[it.key] = r
            loads[r] += costs[it.key]
    return Assignment(placed, long_of_block, block_of, loads, loads - base, memory, sp)


def splits(cost: float, share: float, sp: int, fixed_cost: float = 0.0) -> bool:
    """``long_threshold=auto``'s cost rule: does splitting an item of ``cost`` over an SP block
    of ``sp`` ranks shorten the encoder call, whose balanced share per rank is ``share``?

    Whole, the item keeps its rank busy for ``cost``, the call's critical path when it exceeds
    the share. Split, each member of the block carries ``cost / sp`` plus ``fixed_cost``: what
    the SP pass costs whatever the item's size (the Ulysses all-to-alls of every layer, each a
    fixed latency, in the cost model's units). So it pays when ``cost > share`` and
    ``cost * (1 - 1/sp) > fixed_cost``. The share is the whole call's: under
    ``multiplex.chunks_per_cut`` > 1 the cut group's items, so an item that would stand out in
    one chunk but not among its cut's is encoded whole. ``fixed_cost`` 0: the SP pass is free
    (the rule before the fixed cost was counted)."""
    return cost > share and cost * (1.0 - 1.0 / sp) > fixed_cost


def plan_chunk(
    items: Sequence[ItemMeta],
    needs: Mapping[int, Mapping[str, np.ndarray]],
    group_of: Sequence[int],
    world: int,
    cost: CostModel,
    split: SplitRules = NO_SPLIT,
    busy: frozenset[int] | set[int] = frozenset(),
    **balancing: Any,
) -> ChunkPlan:
    """Plan one encoder chunk over ranks ``0..world-1`` (indices into the exchange group).

    ``items``: every item of the chunk, all groups. ``needs[r][modality]``: the rows rank r
    embeds, as indices into the concatenated outputs (item after item) of its group's
    micro-batch for that modality. ``group_of[r]``: rank r's data group (whose features it
    holds). ``eligible[g]``: the ranks allowed to encode group g's items (None: all).
    ``split``: the long-short split's rules (``SplitRules``). ``balancing``: ``assign_items``'
    keywords (``eligible``, ``base_loads``, ``pinned``), passed on as they are, so that their
    defaults have one home. ``busy``: ranks that send no
    features to others (they are running other work; a group whose holders are all busy sends
    from them anyway).
    """
    a = assign_items(items, group_of, world, cost, split, **balancing)
    sp = split.sp
    plans = [RankPlan() for _ in range(world)]
    holders: dict[int, list[int]] = {}
    for r, g in enumerate(group_of):
        holders.setdefault(g, []).append(r)
    holders = {g: [r for r in hs if r not in busy] or hs for g, hs in holders.items()}
    placed, long_of_block, block_of, memory = a.placed, a.long_of_block, a.block_of, a.memory
    blocks = [a.block(b) for b in range(world // sp)]

    by_key = {it.key: it for it in items}
    # Features: who sends what to whom.
    sent = {g: 0 for g in holders}

    def sender(it: ItemMeta, dst: int) -> int:
        if group_of[dst] == it.group:
            return dst
        hs = holders[it.group]
        s = hs[sent[it.group] % len(hs)]
        sent[it.group] += 1
        return s

    for p in plans:
        p.feat_send = {m: [[] for _ in range(world)] for m in sorted({it.modality for it in items})}
        p.feat_recv = {m: [[] for _ in range(world)] for m in p.feat_send}
    for it in sorted(items, key=lambda it: it.key):
        dsts = [placed[it.key]] if it.key in placed else blocks[block_of[it.key]]
        for dst in dsts:
            src = sender(it, dst)
            plans[src].feat_send[it.modality][dst].append((it.group, it.index))
            plans[dst].feat_recv[it.modality][src].append((it.group, it.index))
    # Who encodes what, and the local output tables.
    row_home: dict[tuple, list[tuple[int, int, int]]] = {}  # key -> [(rank, lo, table offset of lo)]
    for r, p in enumerate(plans):
        p.load = float(a.chunk_loads[r])
        b = r // sp
        p.sp_block = b if b in long_of_block else None
        offset = 0
        for m in sorted({it.modality for it in items}):
            p.short[m] = sorted((k[1], k[2]) for k, rr in placed.items() if rr == r and k[0] == m)
            for g, i in p.short[m]:
                n = by_key[(m, g, i)].tokens
                row_home.setdefault((m, g, i), []).append((r, 0, offset))
                offset += n
            p.long[m] = sorted((it.group, it.index) for it in long_of_block.get(b, []) if it.modality == m)
            for g, i in p.long[m]:
                lo, hi = piece_bounds(by_key[(m, g, i)].tokens, sp, r - b * sp)
                row_home.setdefault((m, g, i), []).append((r, lo, offset))
                offset += hi - lo
        p.table_size = offset
    # Outputs: the rows each rank needs, from the rank that produced them.
    starts = _item_starts(items)
    send_rows: list[list[list[tuple]]] = [[[] for _ in range(world)] for _ in range(world)]  # [src][dst]
    for q in range(world):
        g = group_of[q]
        for m, rows in sorted(needs.get(q, {}).items()):
            rows = np.asarray(rows, dtype=np.int64)
            if rows.size == 0:
                continue
            st = starts.get((m, g))
            if st is None or rows.max() >= st[-1]:
                raise ValueError(f"rank {q} needs {m} output row {int(rows.max())} but group {g}'s micro-batch has "
                                 f"{0 if st is None else int(st[-1])}")
            item = np.searchsorted(st, rows, side="right") - 1
            for row, i in zip(rows.tolist(), item.tolist()):
                within = row - int(st[i])
                src, table = _producer(row_home[(m, g, i)], within)
                send_rows[src][q].append(((m, g, i, within), table))
    for src in range(world):
        plans[src].out_send = []
        for q in range(world):
            rows = sorted(set(send_rows[src][q]))
            plans[src].out_send.append(np.asarray([t for _, t in rows], dtype=np.int64))
            send_rows[src][q] = [k for k, _ in rows]
    for q in range(world):
        p = plans[q]
        p.out_recv_counts = [len(send_rows[src][q]) for src in range(world)]
        where: dict[tuple, int] = {}
        base = 0
        for src in range(world):
            for k, key in enumerate(send_rows[src][q]):
                where[key] = base + k
            base += len(send_rows[src][q])
        g = group_of[q]
        for m, rows in needs.get(q, {}).items():
            rows = np.asarray(rows, dtype=np.int64)
            st = starts.get((m, g), np.zeros(1, dtype=np.int64))
            item = np.searchsorted(st, rows, side="right") - 1
            p.need_index[m] = np.asarray([where[(m, g, i, r - int(st[i]))] for r, i in zip(rows.tolist(), item.tolist())],
                                         dtype=np.int64)
    over = sum(1 for it in items if memory.get(it.key, 0.0) / (sp if it.key in block_of else 1) > split.memory_limit) \
        if memory else 0
    return ChunkPlan(plans, len(block_of), a.balance, over)


def _bytes(item_bytes, it: ItemMeta) -> float:
    b = item_bytes(it.modality, it.tokens) if item_bytes is not None else None
    return 0.0 if b is None else float(b)


def _item_starts(items: Sequence[ItemMeta]) -> dict[tuple[str, int], np.ndarray]:
    """(modality, group) -> first output row of each item in the concatenation, plus the total."""
    tokens: dict[tuple[str, int], dict[int, int]] = {}
    for it in items:
        tokens.setdefault((it.modality, it.group), {})[it.index] = it.tokens
    out = {}
    for key, per in tokens.items():
        n = [per[i] for i in range(len(per))]
        out[key] = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    return out


def _producer(homes: list[tuple[int, int, int]], within: int) -> tuple[int, int]:
    """(rank, table row) that produced row ``within`` of an item (its short rank, or the SP
    member whose piece holds the row)."""
    for rank, lo, offset in reversed(homes):
        if within >= lo:
            return rank, offset + within - lo
    raise AssertionError("row before the first piece")
