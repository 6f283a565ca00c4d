"""Encoder-LLM multiplexing: encoders on every rank, inserted into the LLM pipeline on demand.

Each step, the media of micro-batch j of *every* data-parallel group form encoder chunk j.
Chunk j is encoded by all encoder ranks together (``dataloading.encoder_plan``: short items
whole and balanced by cost, long items split over an SP block with Ulysses attention), and
its outputs travel by one variable-split all-to-all straight to the LLM ranks that embed them
(first pipeline stage, the CP chunk and the TP/SP shard holding each placeholder).

The encoder graph is kept apart from the LLM's: the received rows are a leaf that the first
stage writes into its input embeddings; when the LLM's backward has filled that leaf's
gradient, the inverse all-to-all takes it back to the encoder ranks, which run the encoder
backward. So the forward of chunk j (F j) and its backward (B j) are actions of their own,
and ``placement`` decides where they go:

- ``colocated`` (the joint pipeline): at cut k of the pipeline executor (stage 0 about to run
  micro-batch k, stage s about to receive micro-batch k - s: a consistent cut, see
  ``parallel.pipeline_executor``) every rank runs the actions up to F k — the chunk stage 0
  needs next, spread over all ranks at the moment it is needed. B j runs ``window`` chunks
  later (1F1B: pp, when j's embedding gradient is back on stage 0; GPipe: after the
  pipeline), so the encoder activations alive at once are bounded by the micro-batches in
  flight.
- ``stage0`` (Megatron-style baseline): the same on the first stage's ranks only; each data
  group's items stay on its own first-stage ranks.
- ``encoder_first``: every F before the LLM pipeline, every B after it.

Every rank runs the same action list in the same order, so the collectives always match.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from dataloading.cost import CostModel
from dataloading.encoder_plan import ChunkPlan, ItemMeta, plan_chunk
from omni.models.encoders.sequence_parallel import check_sequence_parallel, encode_long_items
from omni.runtime.config import MultiplexConfig
from parallel.layout import Layout, LayoutError
from parallel.pipeline_executor import EXECUTOR_SCHEDULES
from parallel.reshard import exchange_rows

PLACEMENTS = ("colocated", "stage0", "encoder_first")
INSERTING_SCHEDULES = EXECUTOR_SCHEDULES


@dataclass
class _Chunk:
    plan: ChunkPlan
    table: torch.Tensor | None = None  # this rank's encoder outputs (with the encoder graph)
    recv: torch.Tensor | None = None  # rows received for this rank's placeholders (the LLM's leaf)
    saved_bytes: int = 0  # activation bytes the encoder graph of this chunk keeps


@dataclass
class StepMedia:
    """What the exchange at the start of a step tells every rank."""

    n_chunks: int
    items: list[list[ItemMeta]]  # per chunk
    sizes: dict = field(default_factory=dict)  # (chunk, modality, group, index) -> sizes row
    feat: dict = field(default_factory=dict)  # modality -> (feature dim, dtype name)


class Multiplexer:
    def __init__(self, model, layout: Layout, cfg: MultiplexConfig, cost: CostModel, timeline=None):
        """``model``: this rank's first model chunk (holding the encoders and projectors when
        this rank encodes). Built on every rank, in the same order (it creates the SP groups)."""
        if cfg.placement not in PLACEMENTS:
            raise LayoutError(f"multiplex.placement={cfg.placement!r} is not one of {', '.join(PLACEMENTS)}")
        sizes, pcfg = layout.sizes, layout.config
        if cfg.placement != "encoder_first" and sizes.pp > 1 and pcfg.pp_schedule not in INSERTING_SCHEDULES:
            raise LayoutError(
                f"multiplex.placement={cfg.placement} inserts encoder work into the {'/'.join(INSERTING_SCHEDULES)} "
                f"pipeline schedules, not {pcfg.pp_schedule}: set parallel.pp_schedule=1f1b or "
                f"multiplex.placement=encoder_first")
        self.cfg, self.layout, self.cost, self.timeline = cfg, layout, cost, timeline
        self.model = model
        self.device = layout.device
        coords = [sizes.coords(r) for r in range(layout.world_size)]
        # Encoder ranks: everyone, or the first stage only (stage0).
        self.members = [r for r in range(layout.world_size) if cfg.placement != "stage0" or coords[r]["pp"] == 0]
        self.active = layout.rank in self.members
        self.index = self.members.index(layout.rank) if self.active else -1
        self.group = None
        if len(self.members) < layout.world_size:
            self.group = layout.group("stage") if self.active else None
        self.group_of = [coords[r]["dp_replicate"] * sizes.dp_shard + coords[r]["dp_shard"] for r in self.members]
        sp = int(cfg.encoder_sp)
        if sp < 1 or len(self.members) % sp or sp > max(1, pcfg.gpus_per_node):
            raise LayoutError(f"multiplex.encoder_sp={sp} must divide the {len(self.members)} encoder ranks and fit "
                              f"in a node (parallel.gpus_per_node={pcfg.gpus_per_node})")
        self.sp = sp
        self.sp_group = self._sp_groups(layout, sp)
        self.sp_modalities = [m for m, enc in (model.encoders.items() if model is not None else ())
                              if getattr(enc, "supports_sequence_parallel", False)]
        for m in self.sp_modalities if sp > 1 else ():
            try:  # fail at start-up, not at the first long item
                check_sequence_parallel(model.encoders[m], sp)
            except ValueError as e:
                raise LayoutError(str(e)) from None
        threshold = str(cfg.long_threshold).lower()
        self.long_threshold = None if threshold == "auto" else int(threshold)
        # Chunk j's backward runs `window` chunks later (pipeline stage 0 then has its
        # embedding gradient).
        if cfg.placement == "encoder_first" or (sizes.pp > 1 and pcfg.pp_schedule == "gpipe"):
            self.window = math.inf
        else:
            self.window = sizes.pp
        self.consumer = layout.pp_rank == 0
        self.announcer = layout.rank == layout.peer_source
        self._chunks: dict[int, _Chunk] = {}
        self._actions: list[tuple[str, int]] = []
        self._cursor = 0
        self._local = []  # this rank's Prepared micro-batches of the step
        self._needs: dict[int, dict[str, torch.Tensor]] = {}  # micro-batch -> modality -> local positions
        self.media: StepMedia | None = None
        self.stats = _StepStats()
        self._trainable = model is not None and any(
            p.requires_grad for mods in (model.encoders, model.projectors) for p in mods.parameters())
        # Storage of the encoder/projector weights: autograd saves them too, but they are not activations.
        self._param_storage = set() if model is None else {
            p.untyped_storage().data_ptr() for mods in (model.encoders, model.projectors) for p in mods.parameters()}

    # -- groups ---------------------------------------------------------------------------
    def _sp_groups(self, layout: Layout, sp: int):
        if sp == 1:
            return None
        mine = None
        for b in range(len(self.members) // sp):
            block = self.members[b * sp:(b + 1) * sp]
            g = dist.new_group(block)
            if layout.rank in block:
                mine = g
        return mine

    # -- the step -------------------------------------------------------------------------
    def begin_step(self, prepared: list) -> int:
        """Exchange the step's media metadata (one small host-side gather over the world) and
        plan every chunk. Returns the number of micro-batches every rank must run (the
        largest count of any group; the caller pads with empty ones)."""
        self._local = prepared
        mine = {"n": len(prepared), "items": None, "needs": None, "feat": {}}
        if self.announcer and self.model is not None:
            mine["items"], mine["feat"] = self._describe_items(prepared)
        if self.consumer:
            mine["needs"] = self._describe_needs(prepared)
        everyone = [None] * self.layout.world_size
        if self.layout.world_size > 1:
            with self._span("comm", "media metadata"):
                dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        n = max(e["n"] for e in everyone)
        self.media = self._collect(everyone, n)
        self._chunks = {}
        self.stats = _StepStats()
        if self.active:
            needs_by_chunk = [{i: everyone[r]["needs"][j] for i, r in enumerate(self.members)
                               if everyone[r]["needs"] is not None and j < len(everyone[r]["needs"])}
                              for j in range(n)]
            eligible = None
            if self.cfg.placement == "stage0":
                eligible = {}
                for i, g in enumerate(self.group_of):
                    eligible.setdefault(g, []).append(i)
            for j in range(n):
                plan = plan_chunk(self.media.items[j], needs_by_chunk[j], self.group_of, len(self.members), self.cost,
                                  sp=self.sp, long_threshold=self.long_threshold, sp_modalities=self.sp_modalities,
                                  eligible=eligible)
                self._chunks[j] = _Chunk(plan)
                self.stats.long_items += plan.long_items
                self.stats.balance = max(self.stats.balance, plan.max_over_mean)
        self._actions = self._action_list(n) if self.active else []
        self._cursor = 0
        return n

    def _describe_items(self, prepared: list):
        items, feat = [], {}
        for p in prepared:
            per = []
            for m, media in sorted(p.mb.media.items()):
                enc = self.model.encoders[m]
                units = enc.input_units(media.sizes)
                feat[m] = (int(media.features.shape[1]), str(media.features.dtype).replace("torch.", ""))
                for i, (tok, u, size) in enumerate(zip(media.num_tokens.tolist(), units, media.sizes.tolist())):
                    per.append((m, i, int(tok), int(u), tuple(int(s) for s in size)))
            items.append(per)
        return items, feat

    def _describe_needs(self, prepared: list) -> list[dict[str, np.ndarray]]:
        """Per micro-batch and modality, the output rows this rank embeds (its CP rows, and
        under sequence parallelism only those in its TP shard) and where they go."""
        rt = self.model.runtime if self.model is not None else None
        tp_size, tp_rank = (rt.tp_size, rt.tp_rank) if rt is not None else (1, 0)
        out = []
        self._needs = {}
        for j, p in enumerate(prepared):
            need = {}
            for m, media in p.mb.media.items():
                pos = media.positions.cpu()
                rows = media.output_rows.cpu() if media.output_rows is not None else torch.arange(pos.numel())
                if tp_size > 1:
                    shard = p.mb.input_ids.numel() // tp_size
                    keep = (pos // shard) == tp_rank
                    pos, rows = pos[keep] - tp_rank * shard, rows[keep]
                need[m] = rows.numpy().astype(np.int64)
                self._needs.setdefault(j, {})[m] = pos.to(self.device)
            out.append(need)
        return out

    def _collect(self, everyone: list, n: int) -> StepMedia:
        media = StepMedia(n, [[] for _ in range(n)])
        for r, e in enumerate(everyone):
            media.feat.update(e["feat"])
            if e["items"] is None:
                continue
            c = self.layout.sizes.coords(r)
            g = c["dp_replicate"] * self.layout.sizes.dp_shard + c["dp_shard"]
            for j, per in enumerate(e["items"]):
                for m, i, tok, units, size in per:
                    media.items[j].append(ItemMeta(g, m, i, tok, units))
                    media.sizes[(j, m, g, i)] = size
        return media

    def _action_list(self, n: int) -> list[tuple[str, int]]:
        acts = []
        for k in range(n):
            if k - self.window >= 0:
                acts.append(("B", int(k - self.window)))
            acts.append(("F", k))
        done_b = {k for a, k in acts if a == "B"}
        acts += [("B", k) for k in range(n) if k not in done_b]
        return acts

    # -- insertion points ----------------------------------------------------------------
    def cut(self, k: int) -> None:
        """At cut k of the LLM pipeline (``parallel.pipeline_executor``; without pipeline
        parallelism: before micro-batch k's forward): the actions up to chunk k's forward."""
        if self.active and self.cfg.placement != "encoder_first" and self.media.n_chunks:
            self._run_until(("F", min(k, self.media.n_chunks - 1)))

    def before_pipeline(self) -> None:
        if self.active and self.cfg.placement == "encoder_first" and self.media.n_chunks:
            self._run_until(("F", self.media.n_chunks - 1))

    def finish(self) -> None:
        """After the LLM's backward of the whole step: the remaining encoder backwards."""
        while self._cursor < len(self._actions):
            self._run(self._actions[self._cursor])
            self._cursor += 1
        self._local, self._needs = [], {}

    def _run_until(self, target: tuple[str, int]) -> None:
        if target in self._actions[:self._cursor]:
            return
        while self._cursor < len(self._actions):
            action = self._actions[self._cursor]
            self._run(action)
            self._cursor += 1
            if action == target:
                return

    def _run(self, action: tuple[str, int]) -> None:
        kind, j = action
        if kind == "F":
            self._forward(j)
        else:
            self._backward(j)

    # -- the consumer side -------------------------------------------------------------------
    def embeddings(self, j: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """modality -> (rows [n, H], local positions [n]) for micro-batch j on this rank."""
        chunk = self._chunks.get(j)
        if chunk is None or chunk.recv is None:
            raise RuntimeError(f"micro-batch {j}: its encoder chunk has not run on this rank (multiplexing "
                               f"placement {self.cfg.placement})")
        rp = chunk.plan.ranks[self.index]
        out = {}
        for m, pos in self._needs.get(j, {}).items():
            idx = torch.as_tensor(rp.need_index[m], device=self.device)
            out[m] = (chunk.recv.index_select(0, idx), pos)
        return out

    # -- one chunk forward / backward ---------------------------------------------------------
    def _forward(self, j: int) -> None:
        chunk = self._chunks[j]
        rp = chunk.plan.ranks[self.index]
        if not self.media.items[j]:
            chunk.recv = torch.zeros(0, self._width(), device=self.device)
            return
        feats = self._exchange_features(j, rp)
        with self._span("encoder", f"F{j}"), _CountSaved(self._param_storage) as saved:
            parts = []
            for m in sorted(rp.short):
                enc, proj = self.model.encoders[m], self.model.projectors[m]
                short = rp.short[m]
                if short:
                    x = torch.cat([feats[(m, g, i)] for g, i in short])
                    parts.append(proj(enc(x, self._sizes(j, m, short))))
                if rp.long[m]:
                    x = torch.cat([feats[(m, g, i)] for g, i in rp.long[m]])
                    out, _ = encode_long_items(enc, x, self._sizes(j, m, rp.long[m]), self.sp_group)
                    parts.append(proj(out))
            width = self._width()
            table = torch.cat(parts) if parts else torch.zeros(0, width, device=self.device)
        chunk.saved_bytes = saved.bytes
        chunk.table = table
        send_idx = torch.as_tensor(np.concatenate(rp.out_send) if rp.out_send else np.zeros(0, np.int64),
                                   device=self.device)
        with self._span("comm", f"F{j} outputs"):
            recv = exchange_rows(table.detach().index_select(0, send_idx), [len(s) for s in rp.out_send],
                                 rp.out_recv_counts, self.group)
        # The received rows come from other ranks' tables: they need a gradient whenever any
        # encoder or projector trains, whether or not this rank encoded anything.
        chunk.recv = recv.requires_grad_(self._trainable)
        self.stats.live_bytes += chunk.saved_bytes
        self.stats.max_chunk_bytes = max(self.stats.max_chunk_bytes, chunk.saved_bytes)
        self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, self.stats.live_bytes)
        self.stats.live_chunks += 1
        self.stats.media_chunks += 1
        self.stats.peak_live_chunks = max(self.stats.peak_live_chunks, self.stats.live_chunks)

    def _backward(self, j: int) -> None:
        chunk = self._chunks[j]
        if chunk.table is None:  # no media in this chunk anywhere
            return
        rp = chunk.plan.ranks[self.index]
        grad = chunk.recv.grad if chunk.recv.grad is not None else torch.zeros_like(chunk.recv)
        with self._span("comm", f"B{j} gradients"):
            back = exchange_rows(grad, rp.out_recv_counts, [len(s) for s in rp.out_send], self.group)
        if chunk.table.requires_grad:
            send_idx = torch.as_tensor(np.concatenate(rp.out_send), device=self.device)
            g_table = torch.zeros_like(chunk.table).index_add_(0, send_idx, back.to(chunk.table.dtype))
            with self._span("encoder", f"B{j}"):
                chunk.table.backward(g_table)
        chunk.table = chunk.recv = None
        self.stats.live_bytes -= chunk.saved_bytes
        self.stats.live_chunks -= 1

    def _exchange_features(self, j: int, rp) -> dict[tuple, torch.Tensor]:
        """Every item this rank encodes, as its feature rows (received from a holder, or local)."""
        local = self._local[j].mb.media if j < len(self._local) else {}
        mine = self.group_of[self.index]
        out = {}
        for m in sorted(rp.feat_send):
            dim, dtype = self.media.feat[m]
            units = {(it.group, it.index): it.units for it in self.media.items[j] if it.modality == m}
            pieces, send_counts = [], []
            if m in local:
                starts = np.concatenate([[0], np.cumsum([units[(mine, i)] for i in range(len(local[m].num_tokens))])])
            for dst_items in rp.feat_send[m]:
                for g, i in dst_items:
                    pieces.append(local[m].features[int(starts[i]):int(starts[i + 1])])
                send_counts.append(sum(units[k] for k in dst_items))
            send = torch.cat(pieces) if pieces else torch.zeros(0, dim, dtype=getattr(torch, dtype), device=self.device)
            recv_counts = [sum(units[k] for k in src_items) for src_items in rp.feat_recv[m]]
            with self._span("comm", f"F{j} {m} inputs"):
                recv = exchange_rows(send, send_counts, recv_counts, self.group)
            at = 0
            for src_items in rp.feat_recv[m]:
                for k in src_items:
                    out[(m, *k)] = recv[at:at + units[k]]
                    at += units[k]
        return out

    def _sizes(self, j: int, m: str, items: list[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor([self.media.sizes[(j, m, g, i)] for g, i in items], dtype=torch.int64,
                            device=self.device)

    def _width(self) -> int:
        return self.model.llm.config.hidden_size

    def _span(self, kind: str, name: str):
        return contextlib.nullcontext() if self.timeline is None else self.timeline.span(kind, name)

    def step_metrics(self) -> dict[str, float]:
        s = self.stats
        return {"encoder_long_items": float(s.long_items), "encoder_balance_max_over_mean": s.balance,
                "encoder_peak_live_chunks": float(s.peak_live_chunks),
                "encoder_peak_activation_mib": s.peak_live_bytes / 2**20}


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


class _CountSaved:
    """Counts the bytes autograd saves for backward inside the block (the encoder's
    activations), leaving out the parameters themselves."""

    def __init__(self, params: set):
        self.params = params
        self.bytes = 0
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            ptr = None
        if ptr not in self.params:
            self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False
