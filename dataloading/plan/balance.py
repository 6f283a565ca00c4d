"""Grouped length-balanced reordering: arrange a step's samples over DP ranks and micro-batches.

The samples of a step are fixed by the mixture; only their arrangement changes. The goal is
the smallest *maximum* rank cost (every step waits for the slowest rank), under the packing
budget (each micro-batch holds at most ``budget`` tokens) and with the same number of
micro-batches on every rank (pipeline and FSDP schedules need equal counts).

Methods (``data.balance``):

- ``none``: the plain order, equal sample counts per rank, micro-batches filled in order. The
  baseline every data-parallel loader that reads its own slice gets.
- ``packed``: each rank reads its own consecutive run of the plain order, as many samples as
  make its share of the step's tokens (no balancing of cost across ranks), packed largest first
  into micro-batches: what a Megatron-LM user gets from Megatron-Energon's packing (a buffer of
  samples packed into full rows by a ``select_samples_to_pack`` knapsack) instead of next-fit.
- ``sorted_greedy``: longest first onto the rank with the fewest *tokens* (length balancing
  without the attention term), micro-batches first-fit decreasing.
- ``lpt``: largest *cost* first onto the least-loaded rank (Graham's LPT, <= 4/3 of optimal).
- ``kk``: Karmarkar-Karp multi-way differencing on cost.
- ``balanced`` (default): the better of LPT and KK, then a refinement pass of moves and swaps
  off the most loaded rank.

Grouping: with ``group_size`` G < number of ranks, samples are first dealt to the R/G groups
(LPT on cost, so groups carry equal work), then arranged within each group independently —
G trades planning time (KK is O(n * G log G)) for balance.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np

from dataloading.errors import DataError

METHODS = ("none", "packed", "sorted_greedy", "lpt", "kk", "balanced")
IN_ORDER_RANKS = ("none", "packed")  # methods that keep the plain order's ranks
KK_ITEMS_PER_RANK = 4  # `balanced` also tries KK when a rank gets at most this many items
REFINE_TOLERANCE = 1e-3  # refinement stops within 0.1% of the lower bound
REFINE_PARTNERS = 16  # bins tried per refinement round, lightest first
PACK_CANDIDATES = 4  # least-loaded micro-batches tried per item before the roomiest one


@dataclass
class Arrangement:
    """Item indices per rank per micro-batch, with what the balancer achieved."""

    ranks: list[list[list[int]]]
    rank_cost: np.ndarray  # [R]
    rank_tokens: np.ndarray  # [R]
    budget: int | None

    @property
    def num_micro_batches(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0

    def stats(self, costs: np.ndarray) -> dict[str, float]:
        """max/mean cost over ranks, the lower bound max(mean, largest item)/mean, utilisation."""
        mean = float(self.rank_cost.mean()) if len(self.rank_cost) else 0.0
        largest = float(costs.max()) if len(costs) else 0.0
        mx = float(self.rank_cost.max()) if len(self.rank_cost) else 0.0
        out = {"max_over_mean": mx / mean if mean > 0 else 1.0,
               "lower_bound": max(mean, largest) / mean if mean > 0 else 1.0,
               "max_cost": mx, "mean_cost": mean, "micro_batches": self.num_micro_batches}
        if self.budget:
            slots = len(self.ranks) * self.num_micro_batches * self.budget
            out["utilisation"] = float(self.rank_tokens.sum()) / slots if slots else 1.0
        return out


# ---- rank assignment ---------------------------------------------------------------------
def _lpt(weights: np.ndarray, k: int) -> list[list[int]]:
    """Heaviest first onto the lightest bin (ties: lowest bin index, then item order)."""
    order = np.lexsort((np.arange(len(weights)), -weights))
    heap = [(0.0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in order.tolist():
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + float(weights[i]), b))
    return bins


def _kk(weights: np.ndarray, k: int) -> list[list[int]]:
    """Karmarkar-Karp differencing for k bins.

    A partial solution is k bins kept heaviest first; only the non-empty ones are stored (the
    rest are implicit zeros), so early merges of small partials cost O(their size), not O(k).
    Merging the two partials with the largest spread pairs the heaviest bins of one with the
    lightest of the other. Plain lists: numpy's per-call overhead would dominate.
    """
    heap = [(-w, i, [(w, [i])]) for i, w in enumerate(weights.tolist())]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        _, _, b1 = heapq.heappop(heap)
        _, _, b2 = heapq.heappop(heap)
        p1, p2 = len(b1), len(b2)
        merged = []
        # Full vectors: b1 + zeros, and zeros + reversed(b2) (lightest first); add slot by slot.
        for j in sorted(set(range(p1)) | set(range(max(0, k - p2), k))):
            r = k - 1 - j  # slot j of reversed(b2) is b2[r] (b2 is heaviest first)
            if j < p1 and r < p2:
                s, items = b1[j]
                items.extend(b2[r][1])  # neither partial is used again: reuse their lists
                merged.append((s + b2[r][0], items))
            else:
                merged.append(b1[j] if j < p1 else b2[r])
        merged.sort(key=lambda t: -t[0])
        low = merged[-1][0] if len(merged) == k else 0.0
        heapq.heappush(heap, (low - merged[0][0], tie, merged))
        tie += 1
    bins = [items for _, items in heap[0][2]] if heap else []
    return bins + [[] for _ in range(k - len(bins))]


def _loads(bins: list[list[int]], weights: np.ndarray) -> np.ndarray:
    return np.array([float(weights[b].sum()) if b else 0.0 for b in bins])


def _refine(bins: list[list[int]], weights: np.ndarray, max_rounds: int | None = None) -> list[list[int]]:
    """Move or swap items off the most loaded bin while that lowers the maximum.

    Stops once the maximum is within REFINE_TOLERANCE of the lower bound max(mean, largest
    item) — nothing measurable is left to gain — or after a fixed number of rounds (never a
    time limit: the plan must be a pure function of its inputs).
    """
    k = len(bins)
    bins = [list(b) for b in bins]
    loads = _loads(bins, weights)
    bound = max(float(loads.mean()), float(weights.max()) if len(weights) else 0.0)
    for _ in range(max_rounds or 2 * k + 16):
        a = int(np.argmax(loads))
        top = loads[a]
        if top <= bound * (1 + REFINE_TOLERANCE):
            break
        improved = False
        wa = weights[bins[a]]
        # Partners: the lightest bins only (where a move or swap is most likely to fit); trying
        # every bin each round costs O(k) numpy calls for little gain at large k.
        for b in np.argsort(loads)[:REFINE_PARTNERS].tolist():
            if b == a or loads[b] >= top:
                break
            gap = top - loads[b]
            # Move one item a -> b: new max of the pair is max(top - w, load_b + w) < top.
            ok = (wa > 0) & (wa < gap)
            if ok.any():
                i = int(np.argmin(np.abs(wa - gap / 2) + np.where(ok, 0, np.inf)))
                j = bins[a].pop(i)
                bins[b].append(j)
                loads[a] -= weights[j]
                loads[b] += weights[j]
                improved = True
                break
            # Swap x in a with y in b, 0 < x - y < gap: both sides end below top.
            if bins[b]:
                wb = weights[bins[b]]
                d = wa[:, None] - wb[None, :]
                ok = (d > 0) & (d < gap)
                if ok.any():
                    score = np.where(ok, np.abs(d - gap / 2), np.inf)
                    i, jb = np.unravel_index(int(np.argmin(score)), score.shape)
                    x, y = bins[a][i], bins[b][jb]
                    bins[a][i], bins[b][jb] = y, x
                    loads[a] += weights[y] - weights[x]
                    loads[b] += weights[x] - weights[y]
                    improved = True
                    break
        if not improved:
            break
    return bins


def _assign(method: str, costs: np.ndarray, tokens: np.ndarray, k: int) -> list[list[int]]:
    n = len(costs)
    if method == "none":
        return [list(range(r * n // k, (r + 1) * n // k)) for r in range(k)]
    if method == "packed":
        return _token_slices(tokens, k)
    if method == "sorted_greedy":
        return _lpt(tokens.astype(np.float64), k)
    if method == "lpt":
        return _lpt(costs, k)
    if method == "kk":
        return _kk(costs, k)
    # balanced: the better start, then refinement. With many items per rank LPT is already
    # within a hair of optimal and KK's O(n k log k) merges are not worth their time; with few
    # (the hard regime, where one long item decides the step) both are tried.
    start = _lpt(costs, k)
    if n <= KK_ITEMS_PER_RANK * k:
        kk = _kk(costs, k)
        if _loads(kk, costs).max() < _loads(start, costs).max():
            start = kk
    return _refine(start, costs)


def _token_slices(tokens: np.ndarray, k: int) -> list[list[int]]:
    """The plain order cut into ``k`` consecutive slices of about equal tokens: a loader that
    streams its own samples into full rows takes as many as fill them, not a fixed count."""
    n = len(tokens)
    if n == 0:
        return [[] for _ in range(k)]
    ends = np.cumsum(tokens, dtype=np.float64)
    cuts = [0] + [int(np.searchsorted(ends, ends[-1] * r / k, side="left")) + 1 for r in range(1, k)] + [n]
    cuts = [min(max(c, 0), n) for c in cuts]
    for r in range(1, k + 1):  # non-decreasing, so every slice is a (maybe empty) run
        cuts[r] = max(cuts[r], cuts[r - 1])
    return [list(range(cuts[r], cuts[r + 1])) for r in range(k)]


def assign_ranks(costs: np.ndarray, tokens: np.ndarray, num_ranks: int, method: str = "balanced",
                 group_size: int = 0) -> list[list[int]]:
    """Item indices per rank."""
    if method not in METHODS:
        raise DataError(f"data.balance={method!r} is not a method; use one of {list(METHODS)}", kind="config")
    g = num_ranks if group_size in (0, None) or group_size >= num_ranks else int(group_size)
    if num_ranks % g:
        raise DataError(f"data.balance_group={group_size} must divide the data-parallel size {num_ranks}",
                        kind="config")
    if method in IN_ORDER_RANKS or g == num_ranks:
        return _assign(method, costs, tokens, num_ranks)
    groups = _lpt(costs, num_ranks // g) if method != "sorted_greedy" else _lpt(tokens.astype(np.float64),
                                                                                num_ranks // g)
    ranks: list[list[int]] = []
    for members in groups:
        idx = np.asarray(sorted(members), dtype=np.int64)
        for local in _assign(method, costs[idx], tokens[idx], g):
            ranks.append(idx[local].tolist())
    return ranks


# ---- micro-batches within a rank ---------------------------------------------------------
def _ffd_bins(tokens: list[int], budget: int) -> int:
    """Bins needed by best-fit decreasing (as good as first-fit decreasing; O(n log m))."""
    rooms: list[int] = []  # sorted free space of the open bins
    for t in sorted(tokens, reverse=True):
        i = bisect.bisect_left(rooms, t)  # the tightest bin it fits in
        if i == len(rooms):
            bisect.insort(rooms, budget - t)
        else:
            bisect.insort(rooms, rooms.pop(i) - t)
    return len(rooms)


def _pack(items: list[int], costs: list[float], tokens: list[int], m: int, budget: int | None,
          by_cost: bool, in_order: bool) -> list[list[int]] | None:
    """Items into exactly ``m`` micro-batches under ``budget``; None if they do not fit.

    ``in_order``: next-fit in the given order (the baseline). Otherwise largest first, each into
    the least-loaded micro-batch (by cost, or by tokens) that still has room for it. Plain
    Python and a heap: m is small, and per-item numpy calls would cost more than the loop.
    """
    bins: list[list[int]] = [[] for _ in range(m)]
    cap = float("inf") if budget is None else float(budget)
    room = [cap] * m
    if in_order:
        b = 0
        for i in items:
            while b < m and tokens[i] > room[b]:
                b += 1
            if b == m:
                return None
            bins[b].append(i)
            room[b] -= tokens[i]
        return bins
    key = costs if by_cost else tokens
    # Largest first onto the least-loaded micro-batch with room for it: the few least loaded
    # are tried (a heap, with stale entries skipped), else the roomiest one. O(n log m).
    loads = [0.0] * m
    heap = [(0.0, b) for b in range(m)]
    for i in sorted(items, key=lambda j: (-key[j], j)):
        t = tokens[i]
        tried, chosen = [], -1
        while heap and len(tried) < PACK_CANDIDATES:
            load, b = heapq.heappop(heap)
            if load != loads[b]:
                continue  # stale: b was filled through the roomiest-bin path
            tried.append(b)
            if t <= room[b]:
                chosen = b
                break
        if chosen < 0:
            most = max(room)
            if most < t:
                return None
            chosen = room.index(most)
        for b in tried:
            if b != chosen:
                heapq.heappush(heap, (loads[b], b))
        bins[chosen].append(i)
        room[chosen] -= t
        loads[chosen] += key[i]
        heapq.heappush(heap, (loads[chosen], chosen))
    return bins


def arrange(costs, tokens, num_ranks: int, budget: int | None, method: str = "balanced",
            group_size: int = 0, multiple: int = 1) -> Arrangement:
    """Assign items to ranks, then to the same number of micro-batches on every rank, a
    multiple of ``multiple`` (the pipeline's: ``parallel.rows.microbatch_multiple``). A
    pipeline runs a multiple of its stages' micro-batches whatever the data holds, each as long
    as the longest (one shape); spreading the items over them all, instead of padding with empty
    ones of full length, shortens the longest and so every row."""
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if budget is not None and len(tokens) and tokens.max() > budget:
        i = int(np.argmax(tokens))
        raise DataError(f"item {i} has {tokens[i]} tokens, over the micro-batch budget {budget}", kind="over_budget")
    ranks = assign_ranks(costs, tokens, num_ranks, method, group_size)
    in_order = method == "none"
    tl = tokens.tolist()
    by_cost = method not in ("none", "packed", "sorted_greedy")
    if budget is None:
        m = 1
    elif in_order:  # next-fit count in the plain order
        m = max(1, max(_next_fit_bins([tl[i] for i in r], budget) for r in ranks))
    else:
        m = max(1, max(_ffd_bins([tl[i] for i in r], budget) for r in ranks))
    multiple = max(1, int(multiple))
    m = -(-m // multiple) * multiple
    cost_list, token_list = costs.tolist(), tokens.tolist()
    while True:  # cost-balanced packing may need one more micro-batch (round) than first-fit
        packed = [_pack(r, cost_list, token_list, m, budget, by_cost, in_order) for r in ranks]
        if all(p is not None for p in packed):
            break
        m += multiple
    rank_cost = np.array([float(costs[r].sum()) if r else 0.0 for r in ranks])
    rank_tokens = np.array([int(tokens[r].sum()) if r else 0 for r in ranks], dtype=np.int64)
    return Arrangement(packed, rank_cost, rank_tokens, budget)


def _next_fit_bins(tokens: list[int], budget: int) -> int:
    bins, room = 0, 0
    for t in tokens:
        if bins == 0 or t > room:
            bins, room = bins + 1, budget
        room -= t
    return bins
