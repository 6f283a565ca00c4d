"""A step's encoder calls, planned on every rank from the step's gathered manifests (plain
host numbers; the one device copy is the index upload at the end): the cut groups' calls
(``omni.step.encoder_cut.plan_cut``), the bubble calls (``omni.step.bubbles``), and, on a
consumer rank, where each micro-batch's rows land in the calls' receive buffers. The
multiplexing runtime (``omni.multiplex.runtime``) runs what this plans.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dataloading.plan.cost import CostModel
from omni.step.bubbles import (BubbleCall, busy_ranks, closing_modalities, forward_unit_cost,
                                    select_bubble_items, split_items, split_rows)
from omni.step.encoder_cut import CutPlan, plan_cut
from omni.step.encoder_plan import ItemMeta, SplitRules
from omni.step.media_manifest import MediaManifest
from omni.step.multiplex_rules import chunks_backward_after_pipeline, chunks_per_call, forward_insertion_points
from parallel.sizing import Sizes
from parallel.transfer import to_device


@dataclass
class Call:
    """One encoder call of a step: a cut group's (chunks ``chunks``), or a bubble call's."""

    index: int  # the step's cut groups, in order (bubble calls: -1 - their pipeline rank)
    chunks: list[int]
    plan: CutPlan
    has_media: bool  # any item in any of its chunks, on any rank
    media_chunks: int  # of its chunks, those with media anywhere
    # (chunk position in the call, modality, group, index in the call's numbering) -> the
    # item's index in its micro-batch (the call may hold only some of a micro-batch's items)
    original: dict = field(default_factory=dict)
    exchange: str = "all_to_all"  # of its features, rows and gradients
    bubble: BubbleCall | None = None
    send_idx: torch.Tensor | None = None  # device: table rows to send, in send order
    table: torch.Tensor | None = None  # this rank's encoder outputs (with the encoder graph)
    recv: torch.Tensor | None = None  # rows received for this rank's placeholders (the LLM's leaf)
    returned: torch.Tensor | None = None  # gradients of the rows this rank sent, back from their users
    saved_bytes: int = 0  # activation bytes the encoder graph of this call keeps
    forward_done: bool = False
    backward_done: bool = False


@dataclass
class Source:
    """Where some of micro-batch j's rows are: in one call's receive buffer. Device index
    tensors, built once per step (one host-to-device copy)."""

    call: Call
    need_idx: dict = field(default_factory=dict)  # modality -> receive-buffer row per placeholder
    positions: dict = field(default_factory=dict)  # modality -> local placeholder positions


@dataclass
class ChunkView:
    """Micro-batch j's view of the calls that encode its items: its cut group's, and the
    bubble calls that took some of them."""

    call: Call
    sources: list[Source] = field(default_factory=list)


@dataclass
class StepMedia:
    """What the exchange at the start of a step tells every rank."""

    n_chunks: int
    items: list[list[ItemMeta]]  # per chunk
    sizes: dict = field(default_factory=dict)  # (chunk, modality, group, index) -> sizes row
    feat: dict = field(default_factory=dict)  # modality -> (feature dim, dtype name)
    llm: dict = field(default_factory=dict)  # group -> the LLM cost of each of its micro-batches


@dataclass
class StepPlan:
    calls: list[Call]  # the cut groups'
    bubbles: list[Call]  # the bubble calls'
    chunks: dict[int, ChunkView]
    last_backward: dict[str, int]  # modality -> its last cut group of the step
    long_items: int = 0
    over_memory: int = 0
    balance: float = 1.0
    bubble_items: int = 0


@dataclass
class StepPlanner:
    """What every rank plans a step with (the encoder ranks and the multiplex settings)."""

    placement: str
    members: list[int]  # the encoder ranks (global)
    group_of: list[int]  # each member's data group
    member_stage: list[int]  # each member's pipeline rank
    sizes: Sizes
    virtual: int  # model chunks per pipeline rank
    cost: CostModel
    split: SplitRules  # the long-short split
    lookahead: int
    exchange: str
    fill_bubbles: bool
    closing_rule: bool  # sharded or hybrid weights: a bubble call leaves each modality's last item
    index: int  # this rank among the members (-1: not one)
    consumer: bool  # this rank embeds rows (the first pipeline stage)
    device: torch.device

    @staticmethod
    def collect(everyone: list, n: int, sizes: Sizes) -> StepMedia:
        """The step's media from every rank's gathered announcement."""
        media = StepMedia(n, [[] for _ in range(n)])
        for r, e in enumerate(everyone):
            media.feat.update(e["feat"])
            if e.get("llm") is not None:
                media.llm[sizes.dp_group(r)] = e["llm"]
            if e["items"] is None:
                continue
            g = sizes.dp_group(r)
            for j, per in enumerate(e["items"]):
                for m, i, tok, units, size in per:
                    media.items[j].append(ItemMeta(g, m, i, tok, units))
                    media.sizes[(j, m, g, i)] = size
        return media

    def plan(self, media: StepMedia, everyone: list, manifests: list[MediaManifest],
             backward_cuts: list[int | None], windows: list, group: int) -> StepPlan:
        """Every call of the step; ``backward_cuts``, ``windows``: the pipeline's (encoder
        backward cut per chunk, ``bubble_windows``); ``group``: the step's chunks per cut
        (``omni.step.multiplex_rules.cut_group_size``)."""
        n = media.n_chunks
        needs_by_chunk = [{i: everyone[r]["needs"][j] for i, r in enumerate(self.members)
                           if everyone[r]["needs"] is not None and j < len(everyone[r]["needs"])}
                          for j in range(n)]
        eligible = None
        if self.placement == "stage0":
            eligible = {}
            for i, g in enumerate(self.group_of):
                eligible.setdefault(g, []).append(i)
        size = chunks_per_call(self.placement, n, group)
        bubbles = self._bubble_calls(media, n, size, backward_cuts, windows) if self.fill_bubbles else []
        owner = {key: b for b, call in enumerate(bubbles) for key in call.placed}
        parts = split_items(media.items, lambda j, it: owner.get((j, it.modality, it.group, it.index), "cut"))
        regular = parts.get("cut")
        step = StepPlan([], [], {}, {}, bubble_items=sum(len(call.placed) for call in bubbles))
        indices = IndexUpload(self.device)
        # Each cut group is balanced on top of the step's earlier ones, so that the same ranks do
        # not take the first items of every call (their encoder activations would pile up until
        # the backwards).
        carried = np.zeros(len(self.members))
        forward_at = forward_insertion_points(self.placement, n, backward_cuts, group, self.lookahead)
        for c, first in enumerate(range(0, n, size)):
            js = list(range(first, min(first + size, n)))
            sub = [regular.items[j] if regular is not None else [] for j in js]
            busy = busy_ranks(bubbles, self.member_stage, forward_at[c])
            allowed = eligible
            if busy:
                allowed = {g: [i for i in (eligible or {}).get(g, range(len(self.members))) if i not in busy]
                           for g in set(self.group_of) | {it.group for its in sub for it in its}}
            cut_plan = plan_cut(sub, [self._source_needs(media, needs_by_chunk[j], j, "cut", owner) for j in js],
                                self.group_of, len(self.members), self.cost, split=self.split,
                                eligible=allowed, base_loads=carried, busy=busy)
            carried = carried + np.asarray([rp.load for rp in cut_plan.plan.ranks])
            call = Call(c, js, cut_plan, has_media=any(sub), media_chunks=sum(1 for x in sub if x),
                        original={(js.index(key[0]),) + key[1:]: i
                                  for key, i in (regular.original if regular else {}).items() if key[0] in js},
                        exchange=self.exchange)
            step.calls.append(call)
            self._add_routes(step, media, call, indices, manifests, "cut", owner)
            for it in cut_plan.items:
                step.last_backward[it.modality] = c
        for b, bubble in enumerate(bubbles):
            sub = parts[b]
            js = bubble.chunks
            pins = {(js.index(j), m, g, k): bubble.placed[(j, m, g, sub.original[(j, m, g, k)])]
                    for (j, m, g, k) in sub.original}
            cut_plan = plan_cut([sub.items[j] for j in js],
                                [self._source_needs(media, needs_by_chunk[j], j, b, owner) for j in js],
                                self.group_of, len(self.members), self.cost, pinned=pins)
            call = Call(-1 - bubble.stage, js, cut_plan, has_media=True,
                        media_chunks=sum(1 for j in js if sub.items[j]),
                        original={(js.index(key[0]),) + key[1:]: i for key, i in sub.original.items()},
                        exchange="p2p", bubble=bubble)
            step.bubbles.append(call)
            self._add_routes(step, media, call, indices, manifests, b, owner)
        for j in range(n):
            step.chunks.setdefault(j, ChunkView(step.calls[j // size]))
        plans = [c.plan.plan for c in step.calls + step.bubbles]
        step.long_items = sum(p.long_items for p in plans)
        step.over_memory = sum(p.over_memory for p in plans)
        step.balance = max([1.0] + [c.plan.plan.max_over_mean for c in step.calls])
        indices.upload()
        return step

    def _bubble_calls(self, media: StepMedia, n: int, size: int, backward_cuts: list[int | None],
                      windows: list) -> list[BubbleCall]:
        """This step's bubble calls (``omni.step.bubbles``), the same on every rank."""
        windows = [w for w in windows if w is not None]
        if not windows:
            return []
        unit = {g: forward_unit_cost(costs, self.sizes.pp, self.virtual, self.sizes.tp * self.sizes.cp)
                for g, costs in media.llm.items()}
        modalities = None
        if self.closing_rule:
            end_chunks = chunks_backward_after_pipeline(self.placement, n, backward_cuts, size, self.lookahead)
            modalities = closing_modalities(media.items, end_chunks)
        return select_bubble_items(media.items, windows, self.member_stage, self.group_of, unit, self.cost,
                                   modalities, self.split.item_bytes, self.split.memory_limit)

    def _source_needs(self, media: StepMedia, needs: dict, j: int, source, owner: dict) -> dict:
        """The rows each consumer asked for in chunk j that ``source`` (a bubble call's index,
        or "cut") produces, renumbered over that source's items."""
        out = {}
        for q, per in needs.items():
            g = self.group_of[q]
            out[q] = {}
            for m, rows in per.items():
                mine = _items_of(media, j, g, m)
                keep = [owner.get((j, m, g, it.index), "cut") == source for it in mine]
                out[q][m] = split_rows(rows, [it.tokens for it in mine], keep)[1]
        return out

    def _add_routes(self, step: StepPlan, media: StepMedia, call: Call, indices: "IndexUpload",
                    manifests: list[MediaManifest], source, owner: dict) -> None:
        """This rank's send order for ``call``, and, on a consumer, where each of its chunks'
        rows from it land."""
        rp = call.plan.plan.ranks[self.index]
        indices.add(call, "send_idx", np.concatenate(rp.out_send) if rp.out_send else np.zeros(0, np.int64))
        if not self.consumer:
            return
        g = self.group_of[self.index]
        for pos_in_call, j in enumerate(call.chunks):
            if j >= len(manifests):
                continue
            chunk = step.chunks.setdefault(j, ChunkView(call)) if source == "cut" else step.chunks[j]
            src = Source(call)
            routed = source == "cut"  # (the index views arrive at upload)
            for m, pos in manifests[j].positions.items():
                mine = _items_of(media, j, g, m)
                keep = [owner.get((j, m, g, it.index), "cut") == source for it in mine]
                mask, _ = split_rows(manifests[j].rows[m], [it.tokens for it in mine], keep)
                if not mask.any() and source != "cut":  # (the cut group's source lists every modality)
                    continue
                indices.add(src.need_idx, m, call.plan.need_index[self.index][pos_in_call][m])
                indices.add(src.positions, m, np.asarray(pos)[mask])
                routed = True
            if routed:
                chunk.sources.append(src)


def _items_of(media: StepMedia, j: int, g: int, m: str) -> list[ItemMeta]:
    """Data group g's items of modality m in micro-batch j, in their order."""
    return sorted((it for it in media.items[j] if it.group == g and it.modality == m), key=lambda it: it.index)


class IndexUpload:
    """Collects a step's small index arrays and moves them to the device in one copy (from
    pinned memory, asynchronous on CUDA), handing out views."""

    def __init__(self, device: torch.device):
        self.device = device
        self._parts: list[tuple[object, str, np.ndarray]] = []

    def add(self, target, key: str, values: np.ndarray) -> None:
        """``target[key]`` (a dict) or ``target.key`` (an object) becomes the device copy of ``values``."""
        self._parts.append((target, key, np.asarray(values, dtype=np.int64)))

    def upload(self) -> None:
        if not self._parts:
            return
        flat, = to_device([torch.from_numpy(np.concatenate([a for _, _, a in self._parts]))], self.device)
        at = 0
        for target, key, a in self._parts:
            view = flat[at:at + a.size]
            at += a.size
            if isinstance(target, dict):
                target[key] = view
            else:
                setattr(target, key, view)
        self._parts = []
