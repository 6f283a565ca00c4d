"""One simulated step of a placement on a layout: every stage's LLM work per micro-batch, the
encoder calls planned by the runtime's planner, the gradient sync and optimizer after the
pipeline, the event-driven schedule (``omni.sim.engine``) run over them, and each GPU group's
peak memory in it."""
from __future__ import annotations

import dataclasses

import numpy as np

from omni.sim import disaggregated, megatron
from omni.sim import memory as mem
from omni.sim import sync
from omni.sim.config import SimConfig
from omni.sim.data import draw_steps
from omni.sim.encoders import (BubbleTimes, ChunkTimes, call_actions, call_of_chunks, chunk_items,
                               item_activation_bytes, plan_bubble_calls, plan_chunks)
from omni.sim.engine import StepTimeline, programs, simulate_step
from omni.sim.layout_checks import llm_sizes
from omni.sim.machine import Machine
from omni.sim.spec import ModelSpec, model_spec
from omni.sim.timing import BF16, StageWork, stage_work
from omni.sim.work import MicroBatchWork, StepWork
from omni.step import StepShape, plan_step
from omni.step.bubbles import busy_ranks, closing_modalities, forward_unit_cost
from omni.step.multiplex_rules import (chunks_backward_after_pipeline, chunks_per_call, cut_group_size,
                                       encoder_actions, encoder_ranks, forward_insertion_points,
                                       memory_budget_setting, step_fills_bubbles)
from parallel.config import ParallelConfig
from parallel.pipeline_schedule import split_layers
from parallel.rows import microbatch_count, microbatch_multiple, row_lengths
from parallel.sizing import Sizes, offload_layers, reduces_every_microbatch


def one_step_for_calibration(cfg: SimConfig) -> tuple[StepRun, Sizes]:
    """The first simulated step of ``cfg.multiplex.placement`` with its per-event predictions."""
    spec = model_spec(cfg.model, cfg.encoders, cfg.parallel.encoder_activation_checkpoint)
    sizes = llm_sizes(cfg.parallel, cfg.cluster.num_gpus, spec, cfg.data.micro_batch_tokens, cfg.cluster.gpus_per_node)
    step = draw_steps(cfg.data, spec, sizes.dp, microbatch_multiple(sizes.pp))[0]
    return one_step(cfg, spec, Machine(cfg.cluster), sizes, cfg.multiplex.placement, step, 0), sizes


@dataclasses.dataclass
class StepRun:
    timeline: StepTimeline
    memory: list[mem.MemoryBreakdown]  # per cell (and per encoder-pool GPU)
    chunks: list[ChunkTimes]
    work: dict[tuple[int, int, int], StageWork] = dataclasses.field(default_factory=dict)
    members: list[int] = dataclasses.field(default_factory=list)  # encoder GPUs (global ranks)
    tail_comm: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    tail: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # optimizer, per cell
    pool: dict | None = None  # the disaggregated encoder pool (disaggregated.encoder_pool)
    bubbles: list[BubbleTimes] = dataclasses.field(default_factory=list)
    chunks_per_cut: int = 1  # the step's chunks per encoder call (cut_group_size)
    row_tokens: int = 0  # the LLM's rows over all DP groups and micro-batches, padding included


@dataclasses.dataclass(frozen=True)
class _Pipeline:
    """What every piece of one step reads of its pipeline: the layout's degrees, each virtual
    stage's layers, each row's padded length, and how FSDP shards and syncs the stages."""

    pp: int
    tp: int
    cp: int
    ep: int
    v: int  # virtual stages per pipeline rank
    n: int  # micro-batches per DP group
    stage_layers: list[list[int]]
    lengths: list[list[int]]  # [DP group][micro-batch]: the row's padded length
    offload: set[int] | None  # blocks whose activations go to the host (None: every block)
    shard: int
    reshard: bool
    shard_group: dict  # per pipeline rank, its dp_shard group (and replicate group below)
    replicate_group: dict
    stage_local: dict[int, float]  # per virtual stage, the parameters one GPU holds before sharding
    backward_cuts: list
    gathers: set
    reduce_per_mb: bool

    @property
    def last_stage(self) -> int:
        return self.pp * self.v - 1


def one_step(cfg: SimConfig, spec: ModelSpec, m: Machine, sizes: Sizes, placement: str, step: StepWork,
             encoder_pool: int, record: bool = False) -> StepRun:
    n = microbatch_count(max(len(g) for g in step.groups), sizes.pp)
    groups = [list(g) for g in step.groups]
    for g in groups:
        g += [MicroBatchWork() for _ in range(n - len(g))]
    first_encoder = megatron.first_stage_encoder(cfg, spec, m, sizes, placement, groups)  # None unless megatron
    p = _pipeline(cfg, spec, sizes, placement, groups, n)
    work, act, llm_costs, row_tokens = _llm_work(cfg, spec, m, placement, groups, p)
    if first_encoder:
        first_encoder.add_to_first_stage(work, act)
    crosses = sync.stage_sends_cross_nodes(sizes, cfg.cluster.gpus_per_node, p.v)
    p2p = {(gi, i): m.p2p(tokens / (p.tp * p.cp) * spec.hidden * BF16, crosses) if p.pp > 1 else 0.0
           for gi, ns in enumerate(p.lengths) for i, tokens in enumerate(ns)}
    enc = _encoder_calls(cfg, spec, m, sizes, placement, groups, llm_costs, p)
    cfg = enc.cfg  # multiplex.chunks_per_cut fixed for the step
    tail, tail_comm = _after_pipeline(cfg, spec, m, sizes, work, enc, first_encoder, p)
    # A disaggregated pool is a stage in front of the LLM's first: its forwards gate that
    # stage's (and its backwards wait for it, after the pipeline: disaggregated.pool_end).
    pool = disaggregated.encoder_pool(cfg, spec, m, groups, encoder_pool, sizes) if encoder_pool else None
    timeline = simulate_step(pp=p.pp, virtual=p.v, schedule=cfg.parallel.pp_schedule, groups=sizes.dp, n_micro=n,
                             work=work, p2p_s=p2p, placement=enc.sim_placement, chunks=enc.chunks,
                             encoder_cells=enc.cells, llm_activation=act, tail_s=tail, tail_comm_s=tail_comm,
                             record=record, chunks_per_cut=enc.chunks_per_cut,
                             lookahead=int(cfg.multiplex.lookahead),
                             call_of=call_of_chunks(enc.chunks) if enc.chunks else None,
                             exchange=str(cfg.multiplex.exchange), bubbles=enc.bubbles,
                             first_stage_ready=disaggregated.first_stage_ready(pool, n) if pool else None)
    if first_encoder:
        first_encoder.book(timeline)
    memory = [_cell_memory(cfg, spec, tl, enc, first_encoder, p) for tl in timeline.cells]
    return StepRun(timeline, memory, enc.chunks, work, enc.members, tail_comm, tail, pool=pool, bubbles=enc.bubbles,
                   chunks_per_cut=enc.chunks_per_cut, row_tokens=row_tokens)


def _pipeline(cfg: SimConfig, spec: ModelSpec, sizes: Sizes, placement: str, groups: list[list[MicroBatchWork]],
              n: int) -> _Pipeline:
    par, gpus_per_node = cfg.parallel, cfg.cluster.gpus_per_node
    pp, tp, cp, ep, v = sizes.pp, sizes.tp, sizes.cp, sizes.ep, par.pp_virtual_stages if sizes.pp > 1 else 1
    first_layers = cfg.sim.first_stage_layers if megatron.is_megatron(placement) and v == 1 else 0
    stage_layers = megatron.stage_layers(spec.num_layers, pp * v, first_layers)
    last_stage = pp * v - 1
    shard = sizes.dp_shard * cp
    reshard = _reshard(par, pp)
    progs, backward_cuts = programs(par.pp_schedule, pp, v, n)
    return _Pipeline(
        pp=pp, tp=tp, cp=cp, ep=ep, v=v, n=n, stage_layers=stage_layers,
        # Each row's padded length as the trainer pads it (parallel.rows: its own length, rounded
        # up; Omni's executor sizes each micro-batch's buffers from the rows every stage holds).
        lengths=[row_lengths([mb.tokens for mb in g], tp, pp) for g in groups],
        offload=offload_layers(par.activation_offload, spec.llm.num_layers),
        shard=shard, reshard=reshard,
        shard_group={s: sync.llm_shard_group(sizes, gpus_per_node, s) for s in range(pp)},
        replicate_group={s: sync.llm_replicate_group(sizes, gpus_per_node, s) for s in range(pp)},
        stage_local={st: local_params(spec, stage_layers[st], st == 0, st == last_stage, tp, ep)
                     for st in range(pp * v)},
        backward_cuts=backward_cuts,
        # FSDP: gathers in the passes that find a stage's units sharded (every pass when weights
        # reshard after forward); gradients reduce-scattered in each backward without PP when
        # asked (PP reduces once per step).
        gathers=sync.stage_gathers(progs, pp, reshard) if shard > 1 else set(),
        reduce_per_mb=shard > 1 and reduces_every_microbatch(par, pp))


def _llm_work(cfg: SimConfig, spec: ModelSpec, m: Machine, placement: str, groups: list[list[MicroBatchWork]],
              p: _Pipeline) -> tuple[dict, dict, dict[int, list[float]], int]:
    """Every (DP group, virtual stage, micro-batch)'s LLM work and the activations it keeps; per
    DP group each micro-batch's LLM cost (the runtime's manifests); the rows' tokens, padding
    included."""
    par = cfg.parallel
    tp, cp, ep = p.tp, p.cp, p.ep
    cache: dict[tuple, StageWork] = {}
    work, act = {}, {}
    row_tokens = 0  # every micro-batch's row as the LLM runs it, padding included
    llm_costs: dict[int, list[float]] = {}  # per DP group, each micro-batch's LLM cost (the runtime's manifests)
    for gi, mbs in enumerate(groups):
        for i, mb in enumerate(mbs):
            length = p.lengths[gi][i]
            # The runtime pads a row with one more document (an empty micro-batch is one
            # document of padding): it attends like any other.
            docs = mb.docs + ([length - mb.tokens] if length > mb.tokens else [])
            row_tokens += length
            llm_costs.setdefault(gi, []).append(float(np.sum(spec.cost.llm_cost(docs))))
            for st in range(p.pp * p.v):
                fsdp = (("f", st, i) in p.gathers, ("b", st, i) in p.gathers, p.reduce_per_mb)
                key = (st, length, tuple(docs), fsdp)
                if key not in cache:
                    moved = mem.offloaded_block_bytes(spec, p.stage_layers[st], length / cp, p.offload, tp=tp, ep=ep,
                                                      recompute=par.activation_checkpoint, element_bytes=BF16) \
                        if p.offload != set() else None
                    w = stage_work(m, spec, range(p.stage_layers[st][0], p.stage_layers[st][-1] + 1), st == 0,
                                   st == p.last_stage, length, docs, tp, cp, ep, cfg.cluster.gpus_per_node,
                                   par.activation_checkpoint, tp_overlap=megatron.overlaps_tp_comm(placement),
                                   offload_bytes=moved)
                    if any(fsdp):
                        w = sync.with_fsdp(m, w, p.stage_local[st], p.shard_group[st % p.pp],
                                           p.replicate_group[st % p.pp], len(p.stage_layers[st]), *fsdp)
                    cache[key] = w
                work[(gi, st, i)] = cache[key]
                act[(gi, st, i)] = mem.llm_activation_bytes(spec, p.stage_layers[st], length / cp, tp=tp, ep=ep,
                                                            recompute=par.activation_checkpoint, element_bytes=BF16,
                                                            first=st == 0, last=st == p.last_stage, offload=p.offload)
    return work, act, llm_costs, row_tokens


@dataclasses.dataclass
class _EncoderCalls:
    """The step's encoder work as the runtime plans it: who encodes (``members``, global
    ranks, and the (DP group, stage) cells they sit in), its chunks and bubble calls."""

    cfg: SimConfig  # with multiplex.chunks_per_cut fixed for the step
    chunks: list[ChunkTimes] = dataclasses.field(default_factory=list)
    bubbles: list[BubbleTimes] = dataclasses.field(default_factory=list)
    cells: dict[tuple[int, int], list[int]] = dataclasses.field(default_factory=dict)
    members: list[int] = dataclasses.field(default_factory=list)
    sim_placement: str = "none"  # the engine's placement ("none": no encoder work in the LLM's GPUs)
    chunks_per_cut: int = 1


def _encoder_calls(cfg: SimConfig, spec: ModelSpec, m: Machine, sizes: Sizes, placement: str,
                   groups: list[list[MicroBatchWork]], llm_costs: dict[int, list[float]],
                   p: _Pipeline) -> _EncoderCalls:
    """Encoder chunks: who encodes, planned by the runtime's planner."""
    if not (placement in ("colocated", "stage0", "encoder_first") and spec.encoders):
        return _EncoderCalls(cfg)
    cluster, n, backward_cuts = cfg.cluster, p.n, p.backward_cuts
    members = encoder_ranks(sizes, placement)
    group_of = [_group(sizes, r) for r in members]
    eligible = None
    if placement == "stage0":
        eligible = {}
        for i, g in enumerate(group_of):
            eligible.setdefault(g, []).append(i)
    budget = _encoder_memory_budget(cfg, spec, sizes)
    # multiplex.chunks_per_cut for this step (auto: the runtime's per-step choice, from the
    # same rule, the step's items and the same budget); every call below reads the number.
    group = cut_group_size(cfg.multiplex.chunks_per_cut, placement, n, backward_cuts, int(cfg.multiplex.lookahead),
                           lambda: [sum(item_activation_bytes(spec, it.modality, it.tokens)
                                        for g, mbs in enumerate(groups) for it in chunk_items(mbs[j], g, spec))
                                    for j in range(n)], len(members), budget)
    cfg = dataclasses.replace(cfg, multiplex=dataclasses.replace(cfg.multiplex, chunks_per_cut=group))
    # The node of each DP group's first-stage GPUs: its features' senders, its rows' receivers.
    group_node = {g: sizes.dp_group_rank(g, pp=0) // cluster.gpus_per_node for g in range(sizes.dp)}
    bubbles = _bubble_calls(cfg, spec, m, sizes, placement, groups, members, group_of, llm_costs, backward_cuts,
                            budget, group_node)
    member_stage = [sizes.coords(r)["pp"] for r in members]
    forward_at = forward_insertion_points(placement, n, backward_cuts, group,
                                          int(cfg.multiplex.lookahead))
    chunks = plan_chunks(m, spec, cfg.multiplex, groups, group_of, eligible, cluster.gpus_per_node, p.tp * p.cp,
                         budget, placement, member_ranks=members, group_node=group_node,
                         taken={key for b in bubbles for key in b.call.placed},
                         busy=lambda c: busy_ranks([b.call for b in bubbles], member_stage, forward_at[c]))
    cells: dict[tuple[int, int], list[int]] = {}
    for i, r in enumerate(members):
        c = sizes.coords(r)
        cells.setdefault((_group(sizes, r), c["pp"]), []).append(i)
    # The runtime's chunk actions, as actions of the calls (cut groups) they belong to.
    actions = call_actions(encoder_actions(placement, n, backward_cuts, group,
                                           int(cfg.multiplex.lookahead)), chunks)
    sync.add_encoder_grad_traffic(m, cfg, spec, chunks, len(members), p.reshard)
    sync.add_encoder_collectives(m, cfg, spec, chunks, actions, members, cluster.gpus_per_node, p.reshard)
    sync.add_bubble_backward_costs(m, cfg, spec, bubbles, members, cluster.gpus_per_node, p.reshard)
    return _EncoderCalls(cfg, chunks, bubbles, cells, members, placement, group)


def _after_pipeline(cfg: SimConfig, spec: ModelSpec, m: Machine, sizes: Sizes, work: dict, enc: _EncoderCalls,
                    first_encoder, p: _Pipeline) -> tuple[dict, dict]:
    """After the pipeline: exposed gradient synchronisation, then the optimizer, per (DP group,
    pipeline rank): (optimizer seconds, exposed communication seconds)."""
    pp, v, n = p.pp, p.v, p.n
    chunks, members, encoder_cells = enc.chunks, enc.members, enc.cells
    tail, tail_comm = {}, {}
    enc_local = sync.encoder_local_params(cfg, spec, len(members))
    enc_sync = sync.encoder_grad_sync(m, cfg, spec, members, cfg.cluster.gpus_per_node,
                                      sync.step_modalities(chunks)) if members else 0.0
    if enc_sync and sync.encoder_weights_sharded(cfg):
        # FSDP2 reduces each encoder layer from its post-backward hook in the step's last
        # encoder backward (replicated weights are all-reduced after it, by ParallelModel).
        last = next((max(c.gpu_backward_s, default=0.0) for c in reversed(chunks) if c.items), 0.0)
        layers = max((e.fsdp_units for e in spec.encoders.values()), default=1)
        enc_sync = sync.exposed_behind_backward(enc_sync, last, layers)
    for gi in range(sizes.dp):
        for s in range(pp):
            local = sum(p.stage_local[s + k * pp] for k in range(v))
            layers = sum(len(p.stage_layers[s + k * pp]) for k in range(v))
            last_bwd = work[(gi, s + (v - 1) * pp if v > 1 else s, n - 1)].backward_s
            comm = 0.0 if p.reduce_per_mb else sync.grad_sync(m, local, p.shard_group[s], p.replicate_group[s],
                                                              layers, last_bwd)
            if members and (gi, s) in encoder_cells:
                comm += enc_sync
            optimizer_params = local / p.shard + (enc_local if (gi, s) in encoder_cells else 0.0)
            if first_encoder and s == 0:
                comm += first_encoder.sync_s(gi, work)
                optimizer_params += first_encoder.optimizer_params
            tail_comm[(gi, s)] = comm
            tail[(gi, s)] = m.memory(28.0 * optimizer_params)
    return tail, tail_comm


def _cell_memory(cfg: SimConfig, spec: ModelSpec, tl, enc: _EncoderCalls, first_encoder,
                 p: _Pipeline) -> mem.MemoryBreakdown:
    """The peak memory of one GPU of a (DP group, pipeline rank) cell of the timeline."""
    par = cfg.parallel
    pp, tp, cp, ep, v = p.pp, p.tp, p.cp, p.ep, p.v
    members = enc.members
    stages = [tl.stage + k * pp for k in range(v)]
    b = mem.MemoryBreakdown()
    for st in stages:
        b += mem.static_memory(spec, p.stage_layers[st], st == 0, st == p.last_stage, tp=tp, ep=ep, shard=p.shard,
                               optimizer_bytes_per_param=cfg.sim.optimizer_bytes_per_param,
                               gather_whole_stage=not p.reshard, unsharded_grads=not reduces_every_microbatch(par, pp))
    if (tl.group, tl.stage) in enc.cells:
        for modality in spec.encoders:
            b += mem.encoder_static_memory(spec, modality, shard=sync.encoder_shard(cfg, len(members)),
                                           optimizer_bytes_per_param=cfg.sim.optimizer_bytes_per_param,
                                           gather_whole=not p.reshard,
                                           unsharded_grads=sync.encoder_grads_unsharded(cfg, len(members), p.reshard))
    if first_encoder and tl.stage == 0:
        b += first_encoder.static
    # The worst moment: a block's backward on top of the live activations (on the last
    # stage the loss's logits instead, whichever is larger), or the optimizer step.
    tokens = max(p.lengths[tl.group]) / cp if pp > 1 else cfg.data.micro_batch_tokens / cp
    transient = max(mem.layer_transient_bytes(spec, p.stage_layers[st], tokens, tp=tp, ep=ep,
                                              recompute=par.activation_checkpoint, element_bytes=BF16,
                                              ring=cp > 1 and par.cp_impl == "ring")
                    + 2 * max(mem.offloaded_block_bytes(spec, p.stage_layers[st], tokens, p.offload, tp=tp, ep=ep,
                                                        recompute=par.activation_checkpoint,
                                                        element_bytes=BF16).values(), default=0.0)
                    for st in stages)
    if p.last_stage in stages:
        transient = max(transient, mem.head_transient_bytes(spec, tokens, tp=tp))
    step_peak = mem.optimizer_step_transient_bytes(b)
    if step_peak > tl.peak_activations + transient:
        b.transient = step_peak
    else:
        b.activations, b.transient = tl.peak_activations, transient
    return b


def _bubble_calls(cfg: SimConfig, spec: ModelSpec, m: Machine, sizes: Sizes, placement: str,
                  groups: list[list[MicroBatchWork]], members: list[int], group_of: list[int],
                  llm_costs: dict[int, list[float]], backward_cuts: list, budget: float | None,
                  group_node: dict[int, int]) -> list[BubbleTimes]:
    """The step's bubble calls where ``multiplex.fill_bubbles`` applies (the runtime's rule,
    ``fills_bubbles``), planned by the runtime's own selection."""
    mux, par, cluster = cfg.multiplex, cfg.parallel, cfg.cluster
    if not step_fills_bubbles(dataclasses.replace(mux, placement=placement), sizes, cluster.gpus_per_node):
        return []
    pp, v = sizes.pp, par.pp_virtual_stages if sizes.pp > 1 else 1
    n = len(groups[0]) if groups else 0
    windows = list(plan_step(StepShape(pp=pp, virtual=v, schedule=par.pp_schedule, tail_cuts=True), [], n).windows)
    unit = {g: forward_unit_cost(costs, pp, v, sizes.tp * sizes.cp) for g, costs in llm_costs.items()}
    modalities = None
    if mux.encoder_weights != "replicated":
        items = [[it for g, mbs in enumerate(groups) for it in chunk_items(mbs[j], g, spec)] for j in range(n)]
        size = chunks_per_call(placement, n, int(mux.chunks_per_cut))
        modalities = closing_modalities(items, chunks_backward_after_pipeline(
            placement, n, backward_cuts, size, int(mux.lookahead)))
    member_stage = [sizes.coords(r)["pp"] for r in members]
    return plan_bubble_calls(m, spec, mux, groups, windows, members, member_stage, group_of, unit,
                             cluster.gpus_per_node, sizes.tp * sizes.cp, budget, group_node, modalities)


# -- pieces -------------------------------------------------------------------------------------


def _group(sizes: Sizes, rank: int) -> int:
    return sizes.dp_group(rank)


def _reshard(par: ParallelConfig, pp: int) -> bool:
    """parallel.reshard_after_forward as the runtime reads it (auto: not under PP)."""
    setting = str(par.reshard_after_forward).lower()
    return pp == 1 if setting == "auto" else setting == "true"


def local_params(spec: ModelSpec, layers: list[int], first: bool, last: bool, tp: int, ep: int) -> float:
    """Parameters one GPU of a stage holds before FSDP sharding (TP splits all, EP the experts)."""
    dense = sum(spec.layer_params[i] - spec.layer_expert_params[i] for i in layers)
    experts = sum(spec.layer_expert_params[i] for i in layers)
    n = dense / tp + experts / (ep * tp)
    if first:
        n += spec.embed_params / tp
    if last:
        n += (spec.head_params + spec.norm_params) / tp
    return n


def _encoder_memory_budget(cfg: SimConfig, spec: ModelSpec, sizes: Sizes) -> float | None:
    """multiplex.encoder_memory_mib as the runtime reads it on a GPU (auto: a quarter of what
    the model leaves free)."""
    budget = memory_budget_setting(cfg.multiplex.encoder_memory_mib)
    if budget != "auto":
        return budget
    free = (cfg.cluster.hbm_gib - cfg.cluster.memory_reserve_gib) * mem.GIB
    layers = split_layers(spec.num_layers, sizes.pp)[0]
    static = mem.static_memory(spec, layers, True, sizes.pp == 1, tp=sizes.tp, ep=sizes.ep,
                               shard=sizes.dp_shard * sizes.cp).total
    return max(free - static, 0.0) / 4.0
