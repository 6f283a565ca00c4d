"""Encoder-LLM multiplexing: encoders on every rank, inserted into the LLM pipeline on demand.

Each step, the media of micro-batch j of *every* data-parallel group form encoder chunk j.
The ``multiplex.chunks_per_cut`` chunks of one insertion point (a *cut group*) are encoded by
all encoder ranks together in one call (``omni.step.encoder_cut.plan_cut``: short items
whole and balanced by cost, long items split over an SP block with Ulysses attention): one
feature exchange and one encoder pass per modality, and one exchange of the outputs straight
to the LLM ranks that embed them (first pipeline stage, the CP chunk and the TP/SP shard
holding each placeholder). The exchanges are a variable-split all-to-all over the encoder
ranks, or point-to-point sends between the pairs that trade rows (``multiplex.exchange``,
``parallel.reshard``).

The encoder graph is kept apart from the LLM's: the received rows are a leaf that the first
stage writes into its input embeddings; when the LLM's backward has filled that leaf's
gradient, the inverse all-to-all takes it back to the encoder ranks, which run the encoder
backward. So the forward of a cut group (F j for its chunks j) and its backward (B j) are
actions of their own, and ``placement`` decides where they go:

- ``colocated`` (the joint pipeline): at cut k of the pipeline executor (stage 0 about to run
  micro-batch k; a consistent cut on every rank, see ``parallel.pipeline_executor``) every
  rank runs the actions up to F k — the chunk stage 0 needs next, spread over all ranks at the
  moment it is needed. B j runs at the first cut after stage 0's backward of j (1F1B: cut
  j + pp; GPipe, and interleaved 1F1B with few micro-batches: after the pipeline), so the
  encoder activations alive at once are bounded by the micro-batches in flight. A cut
  group's backward is one pass through one graph, so it waits for its last chunk's
  gradient.
- ``stage0`` (Megatron-style baseline): the same on the first stage's ranks only; each data
  group's items stay on its own first-stage ranks.
- ``encoder_first``: every F before the LLM pipeline, every B after it: one insertion point,
  so the whole step's chunks are one call.

Under ``colocated`` with pipeline parallelism, *bubble calls* (``omni.step.bubbles``)
take some items off the cut groups: the later pipeline ranks encode them right after cut 0,
the rows reach stage 0 at the window's delivery cut, and the gradients come back at a tail
cut in the cool-down, where those ranks run the backward. ``omni.step.encoder_calls`` plans
every call of a step; this module runs them.

Every rank runs the same action list in the same order, so the collectives always match
(under ``exchange=p2p`` every rank posts the sends and receives of the same global plan).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dataloading.construct.batch import MicroBatch
from dataloading.plan.cost import CostModel
from omni.step.encoder_plan import SplitRules
from omni.step.media_manifest import MediaManifest, describe_media, row_doc_lengths
from omni.step.encoder_calls import Call, ChunkView, StepMedia, StepPlanner
from omni.kernels.reshard import scatter_rows
from omni.models.encoders.sequence_parallel import check_sequence_parallel
from omni.step.config import MultiplexConfig
from omni.multiplex.media_tower import MediaTower
from omni.step.multiplex_rules import (BEFORE_PIPELINE, check_multiplex_layout, cut_group_size, encoder_segments,
                                       encoder_ranks, memory_budget_setting, step_fills_bubbles)
from parallel.device_rules import free_memory_at_steady_state
from parallel.layout import Layout, LayoutError, host_group, new_group
from parallel.reshard import exchange_rows
from parallel.sizing import reduces_every_microbatch



class Multiplexer:
    def __init__(self, tower: MediaTower | None, layout: Layout, cfg: MultiplexConfig, cost: CostModel,
                 hidden_size: int, timeline=None, held: tuple = ()):
        """``tower``: this rank's encoders and projectors (None on a rank that does not encode:
        later pipeline stages under stage0). ``hidden_size``: the LLM width the projectors
        map to. ``held``: this rank's other model parts (the LLM chunks), whose gradients and
        optimizer state the memory budget leaves room for. Built on every rank, in the same
        order (it creates process groups)."""
        sizes, pcfg = layout.sizes, layout.config
        check_multiplex_layout(cfg, sizes, pcfg.gpus_per_node, pcfg.pp_schedule)
        self.cfg, self.layout, self.cost, self.timeline = cfg, layout, cost, timeline
        self.tower, self.hidden_size = tower, hidden_size
        self.device = layout.device
        self.members = encoder_ranks(layout.sizes, cfg.placement)
        self.active = layout.rank in self.members
        self.index = self.members.index(layout.rank) if self.active else -1
        self.group = None  # the encoder ranks' group for the all-to-alls (None: the world)
        if len(self.members) < layout.world_size:
            self.group = layout.group("stage") if self.active else None
        self.host_group = host_group(layout)
        self.group_of = [sizes.dp_group(r) for r in self.members]
        sp = self.sp = int(cfg.encoder_sp)
        self.chunks_per_cut = 1  # this step's (cut_group_size, set in plan)
        self.lookahead = int(cfg.lookahead)
        self.sp_group = self._sp_groups(layout, sp)
        encoders = tower.encoders if tower is not None else {}
        self.sp_modalities = [m for m, enc in encoders.items() if getattr(enc, "supports_sequence_parallel", False)]
        for m in self.sp_modalities if sp > 1 else ():
            try:  # fail at start-up, not at the first long item
                check_sequence_parallel(encoders[m], sp)
            except ValueError as e:
                raise LayoutError(str(e)) from None
        threshold = str(cfg.long_threshold).lower()
        self.long_threshold = None if threshold == "auto" else int(threshold)
        self.memory_limit = _memory_budget(cfg.encoder_memory_mib, layout, list(held) + ([tower] if tower else []))
        # The fixed cost of an SP pass in the cost model's units (``encoder_plan.splits``); no
        # measured value exists yet, so long_threshold=auto counts none (as before).
        self.split_fixed_cost = 0.0
        self.exchange = cfg.exchange
        element = layout.rules.activation_bytes  # bf16 activations under bf16 autocast
        # (an item's size in the plan is its output rows; its encoder runs tokens_per_row x as many tokens)
        self._item_bytes = (lambda m, rows: encoders[m].activation_bytes(rows * encoders[m].tokens_per_row, element)) \
            if encoders else None
        # Sharded weights: reduce-scatter a modality's gradients once, in its last backward of
        # the step, unless the LLM reduces every micro-batch too.
        self.reduce_every_chunk = reduces_every_microbatch(pcfg, layout.sizes.pp)
        # Bubble calls (omni.step.bubbles): the later pipeline ranks' idle time, in the
        # bubble windows of the step's program (which then holds their tail cuts).
        self.fill_bubbles = step_fills_bubbles(cfg, sizes, pcfg.gpus_per_node)
        if (self.exchange == "p2p" or self.fill_bubbles) and self.active and len(self.members) > 1:
            # NCCL: a batch of point-to-point ops that is the first collective on its group needs
            # every rank of the group in it; one small all-reduce here sets the group up (bubble
            # calls always exchange point to point).
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
        self.consumer = layout.pp_rank == 0
        self.announcer = layout.rank == layout.peer_source
        self.planner = StepPlanner(
            placement=cfg.placement, members=self.members, group_of=self.group_of,
            member_stage=[sizes.coords(r)["pp"] for r in self.members], sizes=sizes,
            virtual=pcfg.pp_virtual_stages if sizes.pp > 1 else 1, cost=cost,
            split=SplitRules(sp, self.long_threshold, tuple(self.sp_modalities), self._item_bytes, self.memory_limit,
                             self.split_fixed_cost),
            lookahead=self.lookahead, exchange=self.exchange,
            fill_bubbles=self.fill_bubbles, closing_rule=cfg.encoder_weights != "replicated", index=self.index,
            consumer=self.consumer, device=self.device)
        self._chunks: dict[int, ChunkView] = {}
        self._cuts: list[Call] = []
        self._actions: list[tuple[str, int]] = []
        self._segment_end: dict[int, int] = {}  # insertion point -> end of its actions in _actions
        self._cursor = 0
        self._local = []  # this rank's Prepared micro-batches of the step
        self._program = None  # the step's omni.step.StepProgram (``plan``)
        self._gathered: tuple = ([], [])  # (every rank's manifests, this rank's), from ``gather``
        self._last_backward: dict[str, int] = {}  # modality -> its last cut group of the step
        self._bubbles: list[Call] = []  # this step's bubble calls
        self.media: StepMedia | None = None
        self.stats = _StepStats()
        self._trainable = tower is not None and bool(tower.trainable())

    # -- groups ---------------------------------------------------------------------------
    def _sp_groups(self, layout: Layout, sp: int):
        if sp == 1:
            return None
        mine = None
        for b in range(len(self.members) // sp):
            block = self.members[b * sp:(b + 1) * sp]
            g = new_group(block, layout.timeout)
            if layout.rank in block:
                mine = g
        return mine

    # -- the step -------------------------------------------------------------------------
    def describe(self, mb: MicroBatch) -> MediaManifest:
        """The host-side manifest of one of this rank's micro-batches (padded and CP-sliced,
        not yet on the device): what ``gather`` exchanges."""
        if self.tower is None or not mb.media:
            return MediaManifest(doc_lengths=row_doc_lengths(mb))
        units = {m: enc.input_units for m, enc in self.tower.encoders.items()}
        return describe_media(mb, units, self.layout.sizes.tp, self.layout.tp_rank)

    def gather(self, manifests: list[MediaManifest], n_local: int) -> int:
        """Exchange the step's media manifests (one small gather of host objects over gloo):
        every rank learns every group's media. Returns the number of micro-batches every rank
        must run (the largest of the groups' ``n_local``; the step program pads with empty
        ones, so the encoder chunks line up)."""
        mine = {"n": n_local, "items": None, "needs": None, "feat": {}, "llm": None}
        if self.announcer and self.tower is not None:
            mine["items"] = [mf.items for mf in manifests]
            mine["feat"] = {m: f for mf in manifests for m, f in mf.features.items()}
            mine["llm"] = [float(self.cost.llm_cost(mf.doc_lengths).sum()) for mf in manifests]
        if self.consumer:
            mine["needs"] = [mf.rows for mf in manifests]
        everyone = [mine]
        if self.layout.world_size > 1:
            everyone = [None] * self.layout.world_size
            with self._span("comm", "media metadata"):
                dist.all_gather_object(everyone, mine, group=self.host_group)
        self._gathered = (everyone, manifests)
        return max(e["n"] for e in everyone)

    def plan(self, program, prepared: list) -> None:
        """Plan every chunk of the step against its program (``omni.step.StepProgram``: where
        each chunk's backward can run, the bubble windows), from the gathered manifests; every
        rank plans the same calls. ``prepared``: this rank's micro-batches, whose media the
        encoder calls read."""
        everyone, manifests = self._gathered
        n = program.n_micro
        self._local, self._program = prepared, program
        self.media = StepPlanner.collect(everyone, n, self.layout.sizes)
        self._chunks, self._cuts, self._bubbles, self._last_backward = {}, [], [], {}
        self.stats = _StepStats()
        self.chunks_per_cut = self._cut_group(n)
        if self.active:
            plan = self.planner.plan(self.media, everyone, manifests, list(program.backward_cuts),
                                     list(program.windows), self.chunks_per_cut)
            self._chunks, self._cuts, self._bubbles = plan.chunks, plan.calls, plan.bubbles
            self._last_backward = plan.last_backward
            s = self.stats
            s.long_items, s.over_memory, s.balance, s.bubble_items = (plan.long_items, plan.over_memory, plan.balance,
                                                                      plan.bubble_items)
        self._set_actions(n)

    def _cut_group(self, n: int) -> int:
        """This step's chunks per encoder call (``cut_group_size``), the same on every rank: it
        reads only the step's gathered media and the budget every rank agreed on."""
        def chunk_bytes() -> list[float]:
            return [sum(self._item_bytes(it.modality, it.tokens) or 0.0 for it in items) for items in self.media.items]

        return cut_group_size(self.cfg.chunks_per_cut, self.cfg.placement, n, list(self._program.backward_cuts),
                              self.lookahead, chunk_bytes if self._item_bytes is not None else None,
                              len(self.members), self.memory_limit)

    def _set_actions(self, n: int) -> None:
        segments = (encoder_segments(self.cfg.placement, n, list(self._program.backward_cuts), self.chunks_per_cut,
                                     self.lookahead) if self.active else {})
        self._actions, self._segment_end, self._cursor = [], {}, 0
        for k in sorted(segments):
            self._actions += segments[k]
            self._segment_end[k] = len(self._actions)

    # -- insertion points ----------------------------------------------------------------
    def cut(self, k: int) -> None:
        """At cut k of the LLM pipeline (``parallel.pipeline_executor``; without pipeline
        parallelism: before micro-batch k's forward): the deliveries of the bubble calls whose
        window closes here, then the actions of k's cut group's insertion point
        (``encoder_segments``; already done past a group's first cut); after cut 0's, the
        bubble call of this rank's pipeline rank."""
        if not (self.active and self.cfg.placement != "encoder_first" and self.media.n_chunks):
            return
        for cut in self._bubbles:
            if cut.bubble.window.deliver_cut == k:
                self._deliver(cut)
        self._run_to(self._segment_end[(k // self.chunks_per_cut) * self.chunks_per_cut])
        if k == 0:
            for cut in self._bubbles:
                if cut.bubble.stage == self.layout.pp_rank:
                    self._encode(cut)

    def tail(self, j: int) -> None:
        """At tail cut j (in the pipeline's cool-down): the bubble calls whose window ends here
        take back their rows' gradients, and this rank's runs its backward."""
        if not (self.active and self.media is not None and self.media.n_chunks):
            return
        for cut in self._bubbles:
            if cut.bubble.window.tail == j:
                self._return_gradients(cut)
                if cut.bubble.stage == self.layout.pp_rank:
                    self._encoder_backward(cut, last_of_step=False)

    def before_pipeline(self) -> None:
        if self.active and self.cfg.placement == "encoder_first" and self.media.n_chunks:
            self._run_to(self._segment_end[BEFORE_PIPELINE])

    def finish(self) -> None:
        """After the LLM's backward of the whole step: the remaining encoder backwards."""
        while self._cursor < len(self._actions):
            self._run(self._actions[self._cursor])
            self._cursor += 1
        if any(cut.table is not None or cut.recv is not None for cut in self._bubbles):
            raise RuntimeError("a bubble call's backward did not run (its tail cut is missing from the pipeline "
                               "programs: a bug)")
        self._local = []

    def _run_to(self, end: int) -> None:
        while self._cursor < end:
            self._run(self._actions[self._cursor])
            self._cursor += 1

    def _run(self, action: tuple[str, int]) -> None:
        """F j / B j run chunk j's cut group's call, once: the action list keeps a group's
        forwards together, and its backwards together (``encoder_actions``)."""
        kind, j = action
        cut = self._chunks[j].call
        if kind == "F" and not cut.forward_done:
            cut.forward_done = True
            self._forward(cut)
        elif kind == "B" and not cut.backward_done:
            cut.backward_done = True
            self._backward(cut)

    # -- the consumer side -------------------------------------------------------------------
    def embeddings(self, j: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """modality -> (rows [n, H], local positions [n]) for micro-batch j on this rank."""
        chunk = self._ran(j)
        rows: dict[str, list] = {}
        for src in chunk.sources:
            for m, idx in src.need_idx.items():
                rows.setdefault(m, []).append((src.call.recv.index_select(0, idx), src.positions[m]))
        return {m: (torch.cat([r for r, _ in parts]), torch.cat([p for _, p in parts])) for m, parts in rows.items()}

    def _ran(self, j: int) -> ChunkView:
        chunk = self._chunks.get(j)
        if chunk is None or any(src.call.recv is None for src in chunk.sources):
            raise RuntimeError(f"micro-batch {j}: its encoder chunk has not run on this rank (multiplexing "
                               f"placement {self.cfg.placement})")
        return chunk

    def write_embeddings(self, j: int, embeds: torch.Tensor) -> torch.Tensor:
        """``embeds`` [T, H] (this rank's row or TP shard of micro-batch j) with the received
        encoder rows written at their placeholders: one fused gather-and-scatter per modality
        and call (``omni.kernels.reshard.scatter_rows``; its PyTorch reference off the GPU)."""
        chunk = self._ran(j)
        for src in chunk.sources:
            for m, idx in src.need_idx.items():
                embeds = scatter_rows(embeds, src.call.recv, idx, src.positions[m])
        return embeds

    # -- one call's forward / backward ----------------------------------------------------------
    def _forward(self, cut: Call) -> None:
        if not cut.has_media:
            cut.recv = torch.zeros(0, self.hidden_size, device=self.device)
            return
        self._encode(cut)
        self._deliver(cut)

    def _encode(self, cut: Call) -> None:
        """Features to the ranks that encode them, and one encoder pass per modality of the call
        (the rows stay in this rank's table until ``_deliver``)."""
        rp = cut.plan.plan.ranks[self.index]
        name = _call_name(cut)
        feats = self._exchange_features(cut, rp, name)
        with self._span("encoder", f"F{name}"), _CountSaved() as saved:
            # Every encoder rank of the call encodes every modality of it, with no items if it
            # has none: sharded weights are gathered by all of them together. One call per
            # modality for all the call's chunks.
            parts = []
            for m in sorted(rp.short):
                dim, dtype = self.media.feat[m]
                short = rp.short[m]
                x = torch.cat([feats[(m, g, i)] for g, i in short]) if short else \
                    torch.zeros(0, dim, dtype=getattr(torch, dtype), device=self.device)
                long = rp.long[m]
                xl = torch.cat([feats[(m, g, i)] for g, i in long]) if long else None
                parts.append(self.tower.encode(m, x, self._sizes(cut, m, short), xl,
                                               self._sizes(cut, m, long) if long else None, self.sp_group))
            table = torch.cat(parts)
        cut.saved_bytes = saved.bytes
        cut.table = table
        s = self.stats
        s.live_bytes += cut.saved_bytes
        s.max_chunk_bytes = max(s.max_chunk_bytes, cut.saved_bytes)
        s.peak_live_bytes = max(s.peak_live_bytes, s.live_bytes)
        s.live_chunks += cut.media_chunks
        s.media_chunks += cut.media_chunks
        s.peak_live_chunks = max(s.peak_live_chunks, s.live_chunks)

    def _deliver(self, cut: Call) -> None:
        """Every output row of the call to the rank that embeds it (a rank that did not encode
        in it, such as stage 0 for a bubble call, only receives)."""
        rp = cut.plan.plan.ranks[self.index]
        table = cut.table if cut.table is not None else \
            torch.zeros(0, self.hidden_size, dtype=self.tower.output_dtype(self.device.type), device=self.device)
        with self._span("comm", f"F{_call_name(cut)} outputs"):
            recv = exchange_rows(table.detach().index_select(0, cut.send_idx), [len(s) for s in rp.out_send],
                                 rp.out_recv_counts, self.group, cut.exchange)
        # The received rows come from other ranks' tables: they need a gradient whenever any
        # encoder or projector trains, whether or not this rank encoded anything.
        cut.recv = recv.requires_grad_(self._trainable)

    def _backward(self, cut: Call) -> None:
        if cut.table is None:  # no media in this cut anywhere
            return
        self._return_gradients(cut)
        self._encoder_backward(cut, last_of_step=None)

    def _return_gradients(self, cut: Call) -> None:
        """The inverse of ``_deliver``: every row's gradient back to the rank and table row that
        produced it (kept for ``_encoder_backward``)."""
        rp = cut.plan.plan.ranks[self.index]
        # Every chunk of the call has added its rows' gradients (its backward runs only once the
        # last of them is complete).
        grad = cut.recv.grad if cut.recv.grad is not None else torch.zeros_like(cut.recv)
        with self._span("comm", f"B{_call_name(cut)} gradients"):
            cut.returned = exchange_rows(grad, rp.out_recv_counts, [len(s) for s in rp.out_send], self.group,
                                         cut.exchange)
        cut.recv = None

    def _encoder_backward(self, cut: Call, last_of_step: bool | None) -> None:
        """The encoder backward of this rank's part of the call (``last_of_step`` None: whether
        it is its modality's last cut group of the step)."""
        if cut.table is None:
            return
        rp = cut.plan.plan.ranks[self.index]
        if cut.table.requires_grad:
            for m in rp.short:
                last = cut.index == self._last_backward.get(m) if last_of_step is None else last_of_step
                self.tower.before_backward(m, last, self.reduce_every_chunk)
            g_table = torch.zeros_like(cut.table).index_add_(0, cut.send_idx, cut.returned.to(cut.table.dtype))
            with self._span("encoder", f"B{_call_name(cut)}"):
                cut.table.backward(g_table)
        cut.table = cut.returned = None
        self.stats.live_bytes -= cut.saved_bytes
        self.stats.live_chunks -= cut.media_chunks

    def _exchange_features(self, cut: Call, rp, name: str) -> dict[tuple, torch.Tensor]:
        """Every item this rank encodes in the call, as its feature rows (received from a
        holder, or local), by its key in the call's plan (modality, group, call index)."""
        origin = cut.plan.origin
        units = {it.key: it.units for it in cut.plan.items}
        starts: dict[tuple[int, str], np.ndarray] = {}  # (chunk, modality) -> this rank's feature offsets

        def local_rows(m: str, g: int, i: int) -> torch.Tensor:
            c, index = origin[(m, g, i)]
            j = cut.chunks[c]
            original = cut.original.get((c, m, g, index), index)
            media = self._local[j].mb.media[m]
            if (j, m) not in starts:
                # a holder sends only its own group's items, from its micro-batch's features
                mine = sorted((it for it in self.media.items[j] if it.group == g and it.modality == m),
                              key=lambda it: it.index)
                starts[(j, m)] = np.concatenate([[0], np.cumsum([it.units for it in mine])])
            st = starts[(j, m)]
            return media.features[int(st[original]):int(st[original + 1])]

        out = {}
        for m in sorted(rp.feat_send):
            dim, dtype = self.media.feat[m]
            pieces, send_counts = [], []
            for dst_items in rp.feat_send[m]:
                pieces += [local_rows(m, g, i) for g, i in dst_items]
                send_counts.append(sum(units[(m, g, i)] for g, i in dst_items))
            send = torch.cat(pieces) if pieces else torch.zeros(0, dim, dtype=getattr(torch, dtype), device=self.device)
            recv_counts = [sum(units[(m, g, i)] for g, i in src_items) for src_items in rp.feat_recv[m]]
            with self._span("comm", f"F{name} {m} inputs"):
                recv = exchange_rows(send, send_counts, recv_counts, self.group, cut.exchange)
            at = 0
            for src_items in rp.feat_recv[m]:
                for g, i in src_items:
                    out[(m, g, i)] = recv[at:at + units[(m, g, i)]]
                    at += units[(m, g, i)]
        return out

    def _sizes(self, cut: Call, m: str, items: list[tuple[int, int]]) -> torch.Tensor:
        """Host tensor: encoders read item sizes as numbers (a device copy would be read back)."""
        rows = []
        for g, i in items:
            c, index = cut.plan.origin[(m, g, i)]
            rows.append(self.media.sizes[(cut.chunks[c], m, g, cut.original.get((c, m, g, index), index))])
        width = len(rows[0]) if rows else next((len(v) for (jj, mm, _, _), v in self.media.sizes.items()
                                                if mm == m), 1)
        return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), width)

    def _span(self, kind: str, name: str):
        return contextlib.nullcontext() if self.timeline is None else self.timeline.span(kind, name)

    def step_metrics(self) -> dict[str, float]:
        s = self.stats
        return {"encoder_long_items": float(s.long_items), "encoder_balance_max_over_mean": s.balance,
                "encoder_peak_live_chunks": float(s.peak_live_chunks),
                "encoder_peak_activation_mib": s.peak_live_bytes / 2**20,
                "encoder_over_memory_items": float(s.over_memory), "encoder_bubble_items": float(s.bubble_items),
                "encoder_chunks_per_call": float(self.chunks_per_cut)}


def _call_name(cut: Call) -> str:
    """Timeline name of a call: its chunk, or its first and last chunks (a bubble call: with
    its pipeline rank)."""
    chunks = str(cut.chunks[0]) if len(cut.chunks) == 1 else f"{cut.chunks[0]}-{cut.chunks[-1]}"
    return f"{chunks} bubble{cut.bubble.stage}" if cut.bubble is not None else chunks


def _memory_budget(setting: str, layout: Layout, held: list[nn.Module]) -> float | None:
    """Bytes of activations one rank may spend on one item (``multiplex.encoder_memory_mib``):
    auto is a quarter of the device memory free at steady state, the smallest over ranks. It is
    read at start-up, before the gradients and the optimizer state of ``held`` (this rank's
    model parts) exist, so those are taken off (``free_memory_at_steady_state``): read as it
    was, the budget overstated what the second step has by about three times the trainable
    weights. Under the CPU's own rules: None (host memory, no budget worth planning around)."""
    budget = memory_budget_setting(setting)
    if budget != "auto":
        return budget
    free = free_memory_at_steady_state(layout.rules, held)
    if free is None:
        return None
    budget = torch.tensor([max(free, 0.0) / 4.0], dtype=torch.float64, device=layout.device)
    if layout.world_size > 1:  # every rank must plan with the same number
        dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    return float(budget)


@dataclass
class _StepStats:
    long_items: int = 0
    balance: float = 1.0
    live_chunks: int = 0
    peak_live_chunks: int = 0
    media_chunks: int = 0  # chunks of the step with media anywhere
    live_bytes: int = 0
    peak_live_bytes: int = 0
    max_chunk_bytes: int = 0
    over_memory: int = 0  # items over the activation budget even where they are encoded
    bubble_items: int = 0  # items encoded by bubble calls


class _CountSaved:
    """Counts the bytes autograd saves for backward inside the block (the encoder's
    activations), leaving out the weights: parameters and views of them (a transposed weight),
    replicated or gathered by FSDP alike."""

    def __init__(self):
        self.bytes = 0
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False
