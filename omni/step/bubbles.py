"""Encoder work in the pipeline's bubbles: which media items the later pipeline ranks encode
while they wait for their first activation, and how a step's items split into the calls that
encode them. Plain numbers (no tensors, no collectives): the runtime's ``Multiplexer`` and
the simulator (``omni.sim``) both plan with these functions.

Under 1F1B (and GPipe, interleaved 1F1B) pipeline rank s > 0 waits at the start of a step
until stage 0's first activations reach it, and at the end of a step it finishes before
stage 0 does (``parallel.pipeline_schedule.bubble_windows``). A *bubble call* gives that rank
encoder work there:

- its forward runs right after the step's first insertion point (cut 0), on the ranks of
  pipeline rank s only, over items of their own data group (whose features they hold: no
  feature exchange); its output rows reach stage 0 at the window's delivery cut, the last
  cut before the rank's first action, point to point between the two;
- the embedding gradients of those rows come back at the window's tail cut, in the
  cool-down after stage 0's backward of the window's last micro-batch, and the rank runs the
  backward there, after its own last action.

So the window takes only micro-batches that stage 0 needs no earlier than the delivery cut
and whose gradients are complete by the tail cut (``BubbleWindow.chunks``), and per GPU no
more encoder work than the idle time before the first action (the forward) and after the
tail cut (the backward) can hold, in the shared cost model's units (``capacity``). The rest
of the step's items are encoded as before, in the cut groups' calls; a rank busy with its
bubble call takes no item of the cut groups whose forward runs before its delivery cut, and
sends them no features (``busy_ranks``), so stage 0 never waits for it there.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dataloading.plan.cost import CostModel
from omni.step.encoder_plan import ItemMeta
from parallel.pipeline_schedule import BubbleWindow

# A forward of a model chunk is one time unit of the pipeline programs, its backward two; the
# cost model counts a micro-batch's forward and backward together, and so does an item's cost.
PASSES_PER_FORWARD = 3.0


def forward_unit_cost(llm_costs: Sequence[float], pp: int, virtual: int, gpus_per_cell: int) -> float:
    """One time unit of the pipeline programs (a forward through one model chunk) in the cost
    model's units, per GPU of a pipeline cell, for a data group whose micro-batches have these
    LLM costs (forward and backward, the whole model, one GPU): their mean spread over the
    model chunks, the cell's GPUs and the three passes."""
    mean = float(np.mean(llm_costs)) if len(llm_costs) else 0.0
    return mean / (PASSES_PER_FORWARD * pp * virtual * max(gpus_per_cell, 1))


def capacity(window: BubbleWindow, unit_cost: float) -> float:
    """Encoder cost (forward and backward, cost-model units) one GPU of ``window``'s rank can
    take: its forward (a third) within the idle time before its first action, its backward
    (two thirds) within the time left after the tail cut."""
    return min(PASSES_PER_FORWARD * window.before, PASSES_PER_FORWARD / 2.0 * window.after) * unit_cost


@dataclass
class BubbleCall:
    """The encoder work of one pipeline rank's bubble window, over all data groups."""

    window: BubbleWindow
    # (chunk, modality, group, index) -> member index (into the encoder ranks) that encodes it
    placed: dict[tuple[int, str, int, int], int] = field(default_factory=dict)
    loads: dict[int, float] = field(default_factory=dict)  # member index -> planned cost

    @property
    def stage(self) -> int:
        return self.window.rank

    @property
    def chunks(self) -> list[int]:
        return list(self.window.chunks)


def closing_modalities(items_by_chunk: Sequence[Sequence[ItemMeta]], end_chunks: Sequence[int]) -> dict[str, int]:
    """Modality -> the micro-batch whose items of it stay with the cut groups, so that the
    modality's last backward of the step is a cut group's call that every encoder rank runs
    after the pipeline: its last micro-batch with an item, where that micro-batch's call runs
    its backward after the pipeline (``end_chunks``). A modality whose last item is backwarded
    earlier is left out. Sharded and hybrid weights finish their gradient reduction (and
    release weights kept gathered) in the modality's last backward, so a bubble call, whose
    backward runs at a tail cut on one pipeline rank only, may take items of these modalities
    only, and not those of that micro-batch."""
    last: dict[str, int] = {}
    for j, items in enumerate(items_by_chunk):
        for it in items:
            last[it.modality] = j
    ends = set(end_chunks)
    return {m: j for m, j in last.items() if j in ends}


def select_bubble_items(
    items_by_chunk: Sequence[Sequence[ItemMeta]],
    windows: Sequence[BubbleWindow | None],
    member_stage: Sequence[int],
    group_of: Sequence[int],
    unit_cost: Mapping[int, float],
    cost: CostModel,
    modalities: Mapping[str, int] | None = None,
    item_bytes: Callable[[str, int], float | None] | None = None,
    memory_limit: float | None = None,
) -> list[BubbleCall]:
    """The bubble calls of a step: for each pipeline rank with a window (latest first: their
    windows are the narrowest), the items it takes, each onto the least-loaded GPU of its own
    data group's cell there, heaviest first, while it fits that GPU's ``capacity``.

    ``member_stage[i]``, ``group_of[i]``: encoder rank i's pipeline rank and data group;
    ``unit_cost[g]``: ``forward_unit_cost`` of data group g; ``modalities``: those a bubble
    call may take, each but in the micro-batch it maps to (``closing_modalities``; None: all,
    anywhere). A call's activations live from the step's start to its tail cut, as one item's
    do through its call: with ``memory_limit`` (``multiplex.encoder_memory_mib``, the bytes
    one rank may spend on one item) a GPU's bubble items together stay within it
    (``item_bytes``), and a larger item stays with the cut groups, which can split it."""
    calls: list[BubbleCall] = []
    taken: set[tuple[int, str, int, int]] = set()
    cells: dict[tuple[int, int], list[int]] = {}
    for i, (s, g) in enumerate(zip(member_stage, group_of)):
        cells.setdefault((s, g), []).append(i)
    for window in sorted((w for w in windows if w is not None), key=lambda w: -w.rank):
        call = BubbleCall(window)
        candidates = []
        for j in window.chunks:
            for it in items_by_chunk[j] if j < len(items_by_chunk) else ():
                key = (j, it.modality, it.group, it.index)
                if key in taken or (modalities is not None and modalities.get(it.modality, j) == j):
                    continue
                b = item_bytes(it.modality, it.tokens) if item_bytes is not None else None
                candidates.append((float(cost.media_cost(it.modality, it.tokens)), key, float(b or 0.0)))
        held: dict[int, float] = {}  # member -> activation bytes of its bubble items
        for c, key, b in sorted(candidates, key=lambda x: (-x[0], x[1])):
            ranks = cells.get((window.rank, key[2]), [])
            if not ranks or c <= 0.0:
                continue
            r = min(ranks, key=lambda i: (call.loads.get(i, 0.0), i))
            fits = memory_limit is None or held.get(r, 0.0) + b <= memory_limit
            if fits and call.loads.get(r, 0.0) + c <= capacity(window, unit_cost.get(key[2], 0.0)):
                call.placed[key] = r
                call.loads[r] = call.loads.get(r, 0.0) + c
                held[r] = held.get(r, 0.0) + b
                taken.add(key)
        if call.placed:
            calls.append(call)
    return calls


def busy_ranks(calls: Sequence[BubbleCall], member_stage: Sequence[int], insertion_point: int) -> set[int]:
    """Encoder ranks still running a bubble call's forward at an insertion point after the
    first (every rank of a pipeline rank with a bubble call, before its delivery cut): a cut
    group whose forward runs there gives them no item and takes no features from them."""
    stages = {c.stage for c in calls if 0 < insertion_point < c.window.deliver_cut}
    return {i for i, s in enumerate(member_stage) if s in stages}


@dataclass
class Subset:
    """Some of a step's items, renumbered for planning as a call of their own: in each chunk a
    data group's items of one modality are numbered 0, 1, ... in their original order, and so
    are their output rows."""

    items: list[list[ItemMeta]]  # per chunk
    original: dict[tuple[int, str, int, int], int]  # (chunk, modality, group, new index) -> original index


def split_items(items_by_chunk: Sequence[Sequence[ItemMeta]],
                owner: Callable[[int, ItemMeta], object]) -> dict[object, Subset]:
    """The step's items by ``owner(chunk, item)`` (a call's name), each part renumbered."""
    out: dict[object, Subset] = {}
    for j, items in enumerate(items_by_chunk):
        for it in sorted(items, key=lambda it: it.key):
            sub = out.setdefault(owner(j, it), Subset([[] for _ in items_by_chunk], {}))
            k = sum(1 for x in sub.items[j] if x.modality == it.modality and x.group == it.group)
            sub.items[j].append(ItemMeta(it.group, it.modality, k, it.tokens, it.units))
            sub.original[(j, it.modality, it.group, k)] = it.index
    return out


def split_rows(rows: np.ndarray, tokens: Sequence[int], keep: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Output rows of one data group's micro-batch and modality (indices into its items'
    concatenated outputs; ``tokens[i]``: item i's rows) restricted to the items ``keep``: (a
    mask over ``rows`` of those that belong to a kept item, their indices into the kept items'
    concatenated outputs), order preserved."""
    rows = np.asarray(rows, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
    kept_starts = np.concatenate([[0], np.cumsum([t if k else 0 for t, k in zip(tokens, keep)])]).astype(np.int64)
    item = np.searchsorted(starts, rows, side="right") - 1
    mask = np.asarray(keep, dtype=bool)[item] if len(tokens) else np.zeros(rows.size, dtype=bool)
    return mask, (rows - starts[item] + kept_starts[item])[mask]
