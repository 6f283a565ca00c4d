"""``omni simulate``: the figures of each placement for a model, cluster, layout and mixture.

For every placement, ``cfg.data.steps`` steps are drawn by the data plane's balancer, their
encoder chunks planned by the runtime's planner, and the step run through the event-driven
schedule of ``omni.sim.engine``; the result is per placement: step time, tokens/s, MFU
(encoder FLOPs counted), bubble fraction, per-rank busy time, the worst GPU's peak memory and
whether it fits.

The disaggregated baseline gives ``sim.encoder_gpus`` GPUs (default: the pool size, in whole
LLM model-parallel groups up to half the cluster, that is fastest over the run's simulated
steps: one pool for the whole run) to the encoders alone; the LLM keeps its layout on the rest, with fewer
DP ranks. Trained synchronously, the pool is one more stage in front of the LLM's first: that
stage's forward of a micro-batch waits for the pool's call that encodes it, and each pool
backward for that stage's backwards of its micro-batches; the step waits for the pool's last
backward and gradient sync (``omni.sim.disaggregated``; a frozen encoder may run a step ahead). The Megatron-LM baselines (``megatron``,
``megatron_naive``) are described in ``omni.sim.megatron``. Comparing every placement (each on
its own searched layout where ``sim.search_layouts`` says) is ``omni.sim.compare``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from omni.errors import ConfigError
from omni.step.bubbles import busy_ranks, closing_modalities, forward_unit_cost
from omni.step.multiplex_rules import (CUT_PLACEMENTS, chunks_backward_after_pipeline, chunks_per_call,
                                  chunks_per_cut_candidates, cut_group_size, encoder_actions,
                                  encoder_ranks, forward_insertion_points, memory_budget_setting, step_fills_bubbles,
                                  PLACEMENTS, check_multiplex_layout)
from omni.sim import disaggregated, megatron
from omni.sim import memory as mem
from omni.sim import sync
from omni.sim.config import SimConfig
from omni.sim.data import MicroBatchWork, StepWork, draw_steps
from omni.sim.encoders import (BubbleTimes, ChunkTimes, call_actions, call_of_chunks, chunk_items,
                               item_activation_bytes, plan_bubble_calls, plan_chunks)
from omni.sim.engine import DECOMPOSITION, StepTimeline, programs, simulate_step
from omni.sim.spec import ModelSpec, model_spec
from omni.sim.timing import BF16, Machine, StageWork, stage_work
from parallel.config import ParallelConfig
from parallel.sizing import (LayoutError, Sizes, check_model_fits, check_sequence, offload_layers,
                             reduces_every_microbatch, resolve_sizes)
from omni.step import StepShape, plan_step
from parallel.pipeline_schedule import EXECUTOR_SCHEDULES, split_layers
from parallel.rows import microbatch_count, microbatch_multiple, row_lengths

GIB = 2.0**30


def describe_model(spec: ModelSpec) -> dict[str, Any]:
    return {"llm_params_b": spec.llm_params() / 1e9, "layers": spec.num_layers, "hidden": spec.hidden,
            "encoders": {m: {"params_b": e.params / 1e9, "layers": e.num_layers, "hidden": e.hidden}
                         for m, e in spec.encoders.items()}}


def llm_sizes(parallel: ParallelConfig, world: int, spec: ModelSpec, tokens: int, gpus_per_node: int) -> Sizes:
    """The training layout's own checks: a layout that passes is one ``omni train`` accepts."""
    sizes = resolve_sizes(parallel, world)
    c = spec.llm
    check_model_fits(sizes, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, num_layers=c.num_layers,
                     num_experts=c.num_experts, virtual_stages=parallel.pp_virtual_stages if sizes.pp > 1 else 1,
                     cp_impl=parallel.cp_impl, activation_offload=parallel.activation_offload,
                     fp8=parallel.fp8, hidden_size=c.hidden_size)
    check_sequence(sizes, tokens)
    if sizes.tp > gpus_per_node:
        raise LayoutError(f"parallel.tp={sizes.tp} spans nodes of cluster.gpus_per_node={gpus_per_node}; "
                          f"keep TP inside a node")
    if parallel.fp8:
        raise ConfigError("parallel.fp8=true: the simulator does not model FP8 matmuls and their casts; simulate the "
                          "run with parallel.fp8=false (its bf16 time is an upper bound)")
    if sizes.pp > 1 and parallel.pp_schedule not in EXECUTOR_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule}: the simulator replays "
                          f"{', '.join(EXECUTOR_SCHEDULES)} (Omni's executor); zero_bubble is not modelled")
    return sizes


def check_encoder_sp(cfg: SimConfig, sizes: Sizes, placement: str, pool: int = 0) -> None:
    """The multiplex config's rules on the layout a placement runs (the runtime's own,
    ``check_multiplex_layout``): multiplex.encoder_sp splits the encoder GPUs (``pool`` of them
    for the disaggregated baseline) into whole SP blocks inside a node, and so on."""
    mux = dataclasses.replace(cfg.multiplex, placement=placement if placement in PLACEMENTS else "colocated")
    try:
        check_multiplex_layout(mux, sizes, cfg.cluster.gpus_per_node, cfg.parallel.pp_schedule, encoder_gpus=pool)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def disaggregated_split(cfg: SimConfig) -> int:
    """GPUs the disaggregated baseline gives the encoders: ``sim.encoder_gpus``, or with 0 the
    smallest candidate of ``pool_candidates`` (for the up-front checks; the run's pool is
    chosen by ``simulate_placement``)."""
    return disaggregated.pool_candidates(cfg)[0]


def simulate_placement(cfg: SimConfig, spec: ModelSpec, m: Machine, placement: str,
                       cache: dict[tuple[int, str, int], list[StepWork]] | None = None) -> dict[str, Any]:
    if placement in CUT_PLACEMENTS and cfg.sim.chunks_per_cut_search and spec.encoders:
        return _chunks_per_cut_for_run(cfg, spec, m, placement, cache)
    if placement != "disaggregated":
        return _simulate_placement(cfg, spec, m, placement, cache, 0)
    cache = {} if cache is None else cache
    tried = {}
    for e in disaggregated.pool_candidates(cfg):
        try:
            tried[e] = _simulate_placement(cfg, spec, m, placement, cache, e)
        except (LayoutError, ConfigError):
            continue  # the LLM's layout does not fit the GPUs left (e.g. too few DP ranks)
    if not tried:
        raise ConfigError(f"disaggregated: no encoder pool of {disaggregated.pool_candidates(cfg)} GPUs leaves a valid LLM layout; "
                          f"set sim.encoder_gpus or drop disaggregated from sim.placements")
    best = _fastest_fitting(tried)
    out = tried[best]
    out["encoder_pool_search"] = {str(e): {"step_time_s": r["step_time_s"], "fits": r["fits"]} for e, r in tried.items()}
    return out


def _fastest_fitting(tried: dict[int, dict[str, Any]]) -> int:
    """The key of the fastest result that fits in memory (of the fastest overall if none does;
    ties: the smallest key), for the choices made for a whole run."""
    fitting = [k for k, r in tried.items() if r["fits"]] or list(tried)
    return min(fitting, key=lambda k: (tried[k]["step_time_s"], k))


def _chunks_per_cut_for_run(cfg: SimConfig, spec: ModelSpec, m: Machine, placement: str,
                            cache: dict[tuple[int, str, int], list[StepWork]] | None) -> dict[str, Any]:
    """``_groups_for_run``; with ``multiplex.fill_bubbles=auto`` under colocated, once with the
    bubble calls and once without, and the faster that fits (bubble calls keep their items'
    activations from the step's start to its cool-down: where memory is tight they may not
    fit, as a researcher would find and turn them off). The JSON's ``fill_bubbles_search``
    holds both."""
    with_bubbles = _groups_for_run(cfg, spec, m, placement, cache)
    if placement != "colocated" or str(cfg.multiplex.fill_bubbles).lower() != "auto" \
            or not with_bubbles.get("bubble_items"):
        return with_bubbles
    off = dataclasses.replace(cfg, multiplex=dataclasses.replace(cfg.multiplex, fill_bubbles="false"))
    without = _groups_for_run(off, spec, m, placement, cache)
    tried = {0: with_bubbles, 1: without}
    out = tried[_fastest_fitting(tried)]
    out["fill_bubbles_search"] = {
        name: {"step_time_s": r["step_time_s"], "fits": r["fits"], "chunks_per_cut": r["layout"]["chunks_per_cut"]}
        for name, r in (("auto", with_bubbles), ("false", without))}
    return out


def _groups_for_run(cfg: SimConfig, spec: ModelSpec, m: Machine, placement: str,
                    cache: dict[tuple[int, str, int], list[StepWork]] | None) -> dict[str, Any]:
    """``placement`` with the multiplex.chunks_per_cut chosen for the whole run, as a researcher
    would fix it in the training config: the fastest candidate whose every simulated step fits
    in memory (the fastest overall if none does). Fewer, larger calls pay the per-call fixed
    cost (a full weight read, the launches, the sharded weights' gathers) fewer times but keep
    more encoder activations alive; the trade is the workload's, so it is measured, not guessed."""
    cache = {} if cache is None else cache

    def run(g: int) -> dict[str, Any]:
        mux = dataclasses.replace(cfg.multiplex, chunks_per_cut=g)
        return _simulate_placement(dataclasses.replace(cfg, multiplex=mux), spec, m, placement, cache, 0)

    first = run(1)
    tried = {1: first}
    for g in chunks_per_cut_candidates(first["layout"]["max_micro_batches"])[1:]:
        tried[g] = run(g)
    best = _fastest_fitting(tried)
    out = tried[best]
    out["chunks_per_cut_search"] = {str(g): {"step_time_s": r["step_time_s"], "fits": r["fits"]}
                                    for g, r in tried.items()}
    return out


def _simulate_placement(cfg: SimConfig, spec: ModelSpec, m: Machine, placement: str,
                        cache: dict[tuple[int, str, int], list[StepWork]] | None, encoder_pool: int) -> dict[str, Any]:
    cluster = cfg.cluster
    world = cluster.num_gpus
    parallel = dataclasses.replace(cfg.parallel, dp_shard=-1) if encoder_pool else cfg.parallel
    sizes = llm_sizes(parallel, world - encoder_pool, spec, cfg.data.micro_batch_tokens, cluster.gpus_per_node)
    cache = {} if cache is None else cache
    cfg = megatron.run_config(cfg, placement)
    data = cfg.data
    key = (sizes.dp, data.balance, microbatch_multiple(sizes.pp))
    if key not in cache:
        cache[key] = draw_steps(data, spec, sizes.dp, microbatch_multiple(sizes.pp))
    steps = cache[key]
    runs = [_one_step(cfg, spec, m, sizes, placement, step, encoder_pool) for step in steps]
    return _summarise(cfg, spec, sizes, placement, steps, runs, encoder_pool)


def one_step_for_calibration(cfg: SimConfig) -> tuple["_Run", Sizes]:
    """The first simulated step of ``cfg.multiplex.placement`` with its per-event predictions."""
    spec = model_spec(cfg.model, cfg.encoders, cfg.parallel.encoder_activation_checkpoint)
    sizes = llm_sizes(cfg.parallel, cfg.cluster.num_gpus, spec, cfg.data.micro_batch_tokens, cfg.cluster.gpus_per_node)
    step = draw_steps(cfg.data, spec, sizes.dp, microbatch_multiple(sizes.pp))[0]
    return _one_step(cfg, spec, Machine(cfg.cluster), sizes, cfg.multiplex.placement, step, 0), sizes


@dataclasses.dataclass
class _Run:
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


def _one_step(cfg: SimConfig, spec: ModelSpec, m: Machine, sizes: Sizes, placement: str, step: StepWork,
              encoder_pool: int, record: bool = False) -> _Run:
    par, cluster = cfg.parallel, cfg.cluster
    pp, tp, cp, ep, v = sizes.pp, sizes.tp, sizes.cp, sizes.ep, par.pp_virtual_stages if sizes.pp > 1 else 1
    offload = offload_layers(par.activation_offload, spec.llm.num_layers)  # None: every block
    groups = [list(g) for g in step.groups]
    n = microbatch_count(max(len(g) for g in groups), pp)
    for g in groups:
        g += [MicroBatchWork() for _ in range(n - len(g))]
    first_encoder = megatron.first_stage_encoder(cfg, spec, m, sizes, placement, groups)  # None unless megatron
    first_layers = cfg.sim.first_stage_layers if megatron.is_megatron(placement) and v == 1 else 0
    stage_layers = megatron.stage_layers(spec.num_layers, pp * v, first_layers)
    last_stage = pp * v - 1
    # Each row's padded length as the trainer pads it (parallel.rows: its own length, rounded
    # up; Omni's executor sizes each micro-batch's buffers from the rows every stage holds).
    lengths = [row_lengths([mb.tokens for mb in g], tp, pp) for g in groups]
    shard = sizes.dp_shard * cp
    dp_shard_group = {s: sync.llm_shard_group(sizes, cluster.gpus_per_node, s) for s in range(pp)}
    dp_replicate_group = {s: sync.llm_replicate_group(sizes, cluster.gpus_per_node, s) for s in range(pp)}
    reshard = _reshard(par, pp)
    progs, backward_cuts = programs(par.pp_schedule, pp, v, n)
    # FSDP: gathers in the passes that find a stage's units sharded (every pass when weights
    # reshard after forward); gradients reduce-scattered in each backward without PP when
    # asked (PP reduces once per step).
    gathers = sync.stage_gathers(progs, pp, reshard) if shard > 1 else set()
    reduce_per_mb = shard > 1 and reduces_every_microbatch(par, pp)
    stage_local = {st: _local_params(spec, stage_layers[st], st == 0, st == last_stage, tp, ep)
                   for st in range(pp * v)}

    cache: dict[tuple, StageWork] = {}
    work, act = {}, {}
    row_tokens = 0  # every micro-batch's row as the LLM runs it, padding included
    llm_costs: dict[int, list[float]] = {}  # per DP group, each micro-batch's LLM cost (the runtime's manifests)
    for gi, mbs in enumerate(groups):
        for i, mb in enumerate(mbs):
            length = lengths[gi][i]
            # The runtime pads a row with one more document (an empty micro-batch is one
            # document of padding): it attends like any other.
            docs = mb.docs + ([length - mb.tokens] if length > mb.tokens else [])
            row_tokens += length
            llm_costs.setdefault(gi, []).append(float(np.sum(spec.cost.llm_cost(docs))))
            for st in range(pp * v):
                fsdp = (("f", st, i) in gathers, ("b", st, i) in gathers, reduce_per_mb)
                key = (st, length, tuple(docs), fsdp)
                if key not in cache:
                    moved = mem.offloaded_block_bytes(spec, stage_layers[st], length / cp, offload, tp=tp, ep=ep,
                                                      recompute=par.activation_checkpoint, element_bytes=BF16) \
                        if offload != set() else None
                    w = stage_work(m, spec, range(stage_layers[st][0], stage_layers[st][-1] + 1), st == 0,
                                   st == last_stage, length, docs, tp, cp, ep, cluster.gpus_per_node,
                                   par.activation_checkpoint, tp_overlap=megatron.overlaps_tp_comm(placement),
                                   offload_bytes=moved)
                    if any(fsdp):
                        w = sync.with_fsdp(m, w, stage_local[st], dp_shard_group[st % pp], dp_replicate_group[st % pp],
                                           len(stage_layers[st]), *fsdp)
                    cache[key] = w
                work[(gi, st, i)] = cache[key]
                act[(gi, st, i)] = mem.llm_activation_bytes(spec, stage_layers[st], length / cp, tp=tp, ep=ep,
                                                            recompute=par.activation_checkpoint, element_bytes=BF16,
                                                            first=st == 0, last=st == last_stage, offload=offload)
    if first_encoder:
        first_encoder.add_to_first_stage(work, act)
    crosses = sync.stage_sends_cross_nodes(sizes, cluster.gpus_per_node, v)
    p2p = {(gi, i): m.p2p(n / (tp * cp) * spec.hidden * BF16, crosses) if pp > 1 else 0.0
           for gi, ns in enumerate(lengths) for i, n in enumerate(ns)}

    # Encoder chunks: who encodes, planned by the runtime's planner.
    chunks: list[ChunkTimes] = []
    bubbles: list[BubbleTimes] = []
    encoder_cells: dict[tuple[int, int], list[int]] = {}
    members: list[int] = []
    sim_placement = placement
    group = 1
    if placement in ("colocated", "stage0", "encoder_first") and spec.encoders:
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
        chunks = plan_chunks(m, spec, cfg.multiplex, groups, group_of, eligible, cluster.gpus_per_node, tp * cp,
                             budget, placement, member_ranks=members, group_node=group_node,
                             taken={key for b in bubbles for key in b.call.placed},
                             busy=lambda c: busy_ranks([b.call for b in bubbles], member_stage, forward_at[c]))
        for i, r in enumerate(members):
            c = sizes.coords(r)
            encoder_cells.setdefault((_group(sizes, r), c["pp"]), []).append(i)
        # The runtime's chunk actions, as actions of the calls (cut groups) they belong to.
        actions = call_actions(encoder_actions(placement, n, backward_cuts, group,
                                               int(cfg.multiplex.lookahead)), chunks)
        sync.add_encoder_grad_traffic(m, cfg, spec, chunks, len(members), reshard)
        sync.add_encoder_collectives(m, cfg, spec, chunks, actions, members, cluster.gpus_per_node, reshard)
        sync.add_bubble_backward_costs(m, cfg, spec, bubbles, members, cluster.gpus_per_node, reshard)
    else:
        sim_placement = "none"

    # After the pipeline: exposed gradient synchronisation, then the optimizer.
    tail, tail_comm = {}, {}
    enc_local = sync.encoder_local_params(cfg, spec, len(members))
    enc_sync = sync.encoder_grad_sync(m, cfg, spec, members, cluster.gpus_per_node,
                                      sync.step_modalities(chunks)) if members else 0.0
    if enc_sync and sync.encoder_weights_sharded(cfg):
        # FSDP2 reduces each encoder layer from its post-backward hook in the step's last
        # encoder backward (replicated weights are all-reduced after it, by ParallelModel).
        last = next((max(c.gpu_backward_s, default=0.0) for c in reversed(chunks) if c.items), 0.0)
        layers = max((e.fsdp_units for e in spec.encoders.values()), default=1)
        enc_sync = sync.exposed_behind_backward(enc_sync, last, layers)
    for gi in range(sizes.dp):
        for s in range(pp):
            local = sum(stage_local[s + k * pp] for k in range(v))
            layers = sum(len(stage_layers[s + k * pp]) for k in range(v))
            last_bwd = work[(gi, s + (v - 1) * pp if v > 1 else s, n - 1)].backward_s
            comm = 0.0 if reduce_per_mb else sync.grad_sync(m, local, dp_shard_group[s], dp_replicate_group[s], layers,
                                                            last_bwd)
            if members and (gi, s) in encoder_cells:
                comm += enc_sync
            optimizer_params = local / shard + (enc_local if (gi, s) in encoder_cells else 0.0)
            if first_encoder and s == 0:
                comm += first_encoder.sync_s(gi, work)
                optimizer_params += first_encoder.optimizer_params
            tail_comm[(gi, s)] = comm
            tail[(gi, s)] = m.memory(28.0 * optimizer_params)
    # A disaggregated pool is a stage in front of the LLM's first: its forwards gate that
    # stage's (and its backwards wait for it, after the pipeline: disaggregated.pool_end).
    pool = disaggregated.encoder_pool(cfg, spec, m, groups, encoder_pool, sizes) if encoder_pool else None
    timeline = simulate_step(pp=pp, virtual=v, schedule=par.pp_schedule, groups=sizes.dp, n_micro=n, work=work,
                             p2p_s=p2p, placement=sim_placement, chunks=chunks, encoder_cells=encoder_cells,
                             llm_activation=act, tail_s=tail, tail_comm_s=tail_comm, record=record,
                             chunks_per_cut=group,
                             lookahead=int(cfg.multiplex.lookahead),
                             call_of=call_of_chunks(chunks) if chunks else None,
                             exchange=str(cfg.multiplex.exchange), bubbles=bubbles,
                             first_stage_ready=disaggregated.first_stage_ready(pool, n) if pool else None)
    if first_encoder:
        first_encoder.book(timeline)
    memory = []
    for tl in timeline.cells:
        stages = [tl.stage + k * pp for k in range(v)]
        b = mem.MemoryBreakdown()
        for st in stages:
            b += mem.static_memory(spec, stage_layers[st], st == 0, st == last_stage, tp=tp, ep=ep, shard=shard,
                                   optimizer_bytes_per_param=cfg.sim.optimizer_bytes_per_param,
                                   gather_whole_stage=not reshard, unsharded_grads=not reduces_every_microbatch(par, pp))
        if (tl.group, tl.stage) in encoder_cells:
            for modality in spec.encoders:
                b += mem.encoder_static_memory(spec, modality, shard=sync.encoder_shard(cfg, len(members)),
                                               optimizer_bytes_per_param=cfg.sim.optimizer_bytes_per_param,
                                               gather_whole=not reshard,
                                               unsharded_grads=sync.encoder_grads_unsharded(cfg, len(members), reshard))
        if first_encoder and tl.stage == 0:
            b += first_encoder.static
        # The worst moment: a block's backward on top of the live activations (on the last
        # stage the loss's logits instead, whichever is larger), or the optimizer step.
        tokens = max(lengths[tl.group]) / cp if pp > 1 else cfg.data.micro_batch_tokens / cp
        transient = max(mem.layer_transient_bytes(spec, stage_layers[st], tokens, tp=tp, ep=ep,
                                                  recompute=par.activation_checkpoint, element_bytes=BF16,
                                                  ring=cp > 1 and par.cp_impl == "ring")
                        + 2 * max(mem.offloaded_block_bytes(spec, stage_layers[st], tokens, offload, tp=tp, ep=ep,
                                                            recompute=par.activation_checkpoint,
                                                            element_bytes=BF16).values(), default=0.0)
                        for st in stages)
        if last_stage in stages:
            transient = max(transient, mem.head_transient_bytes(spec, tokens, tp=tp))
        step_peak = mem.optimizer_step_transient_bytes(b)
        if step_peak > tl.peak_activations + transient:
            b.transient = step_peak
        else:
            b.activations, b.transient = tl.peak_activations, transient
        memory.append(b)
    return _Run(timeline, memory, chunks, work, members, tail_comm, tail, pool=pool, bubbles=bubbles,
                chunks_per_cut=group, row_tokens=row_tokens)


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


def _summarise(cfg: SimConfig, spec: ModelSpec, sizes: Sizes, placement: str, steps: list[StepWork],
               runs: list[_Run], encoder_pool: int) -> dict[str, Any]:
    cluster = cfg.cluster
    world = cluster.num_gpus
    llm_step = [r.timeline.step_s for r in runs]
    step_s = [disaggregated.step_with_pool(t, r.pool, r.timeline.first_stage_backward_end) if r.pool else t
              for t, r in zip(llm_step, runs)]
    mean_step = float(np.mean(step_s))
    tokens = float(np.mean([s.tokens() for s in steps]))
    flops = float(np.mean([spec.mfu_flops(s.docs(), s.media()) for s in steps]))
    gpus_per_cell = sizes.tp * sizes.cp
    cells = runs[-1].timeline.cells
    per_rank = []
    for k, c in enumerate(cells):
        vals = [r.timeline.cells[k] for r in runs]
        per_rank.append({"group": c.group, "stage": c.stage, "gpus": gpus_per_cell,
                         "llm_s": float(np.mean([x.llm_s for x in vals])),
                         "encoder_s": float(np.mean([x.encoder_s for x in vals])),
                         "comm_s": float(np.mean([x.comm_s for x in vals])),
                         "idle_s": float(np.mean([x.idle_s(t) for x, t in zip(vals, step_s)]))})
    compute = sum((p["llm_s"] + p["encoder_s"]) * gpus_per_cell for p in per_rank)
    gpu_time = mean_step * (world - encoder_pool)
    if encoder_pool:
        pool_busy = float(np.mean([r.pool["busy_mean_s"] for r in runs]))
        per_rank.append({"group": -1, "stage": "encoder pool", "gpus": encoder_pool, "llm_s": 0.0,
                         "encoder_s": pool_busy, "comm_s": float(np.mean([r.pool["comm_s"] for r in runs])),
                         "idle_s": max(0.0, mean_step - pool_busy)})
        compute += pool_busy * encoder_pool
        gpu_time += mean_step * encoder_pool
    busy = [p["llm_s"] + p["encoder_s"] + p["comm_s"] for p in per_rank]
    # The step decomposed (engine.DECOMPOSITION), seconds, mean over the LLM cells and steps.
    decomposition = {term: float(np.mean([np.mean([tl.decomposition(t)[term] for tl in r.timeline.cells])
                                           for r, t in zip(runs, step_s)])) for term in DECOMPOSITION}
    memories = [b for r in runs for b in r.memory] + [r.pool["memory"] for r in runs if r.pool]
    worst = max(memories, key=lambda b: b.total)
    limit = (cluster.hbm_gib - cluster.memory_reserve_gib) * GIB
    # GPU groups over the limit in any simulated step (the worst step need not be the last).
    over = sum(1 for cell in zip(*(r.memory for r in runs)) if max(b.total for b in cell) > limit)
    if any(r.pool and r.pool["memory"].total > limit for r in runs):
        over += encoder_pool
    chunks = [c for r in runs for c in r.chunks]
    layout = {"dp_replicate": sizes.dp_replicate, "dp_shard": sizes.dp_shard, "tp": sizes.tp, "pp": sizes.pp,
              "cp": sizes.cp, "ep": sizes.ep, "pp_virtual_stages": cfg.parallel.pp_virtual_stages,
              "pp_schedule": cfg.parallel.pp_schedule, "micro_batches": max(len(g) for g in steps[-1].groups),
              "max_micro_batches": max(len(g) for s in steps for g in s.groups),
              "encoder_gpus": encoder_pool, "chunks_per_cut": max(r.chunks_per_cut for r in runs),
              "fill_bubbles": str(cfg.multiplex.fill_bubbles).lower(),
              "activation_checkpoint": cfg.parallel.activation_checkpoint,
              "first_stage_layers": cfg.sim.first_stage_layers if megatron.is_megatron(placement) else 0,
              "packing": cfg.data.balance, "tp_comm_overlap": megatron.overlaps_tp_comm(placement)}
    rows = float(np.mean([r.row_tokens for r in runs]))
    return {
        "step_time_s": mean_step,
        "tokens_per_s": tokens / mean_step if mean_step > 0 else 0.0,
        "mfu": flops / (mean_step * world * cluster.peak_tflops * 1e12) if mean_step > 0 else 0.0,
        # Waiting (pipeline bubbles, stragglers at collectives) as a share of all GPU time;
        # exposed communication is reported apart (comm_share).
        "bubble_fraction": sum(p["idle_s"] * p["gpus"] for p in per_rank) / gpu_time if gpu_time > 0 else 0.0,
        "comm_share": sum(p["comm_s"] * p["gpus"] for p in per_rank) / gpu_time if gpu_time > 0 else 0.0,
        "compute_share": compute / gpu_time if gpu_time > 0 else 0.0,
        "busy_s": {"min": float(min(busy)), "mean": float(np.mean(busy)), "max": float(max(busy))},
        "memory_gib": worst.gib(),
        "memory_limit_gib": limit / GIB,
        "fits": worst.total <= limit,
        "ranks_over_memory": over,
        "data_balance": float(np.mean([s.balance for s in steps])),
        # Of the LLM's row tokens (every DP group's micro-batches as run), the share that is padding.
        "padded_fraction": 1.0 - tokens / rows if rows > 0 else 0.0,
        "encoder_balance": float(np.mean([c.balance for c in chunks if c.items])) if any(c.items for c in chunks)
        else 1.0,
        "long_items": int(sum(c.long_items for c in chunks)),
        "bubble_items": float(np.mean([sum(len(b.call.placed) for b in r.bubbles) for r in runs])),
        "decomposition_s": decomposition,
        "image_ratios": [None if s.image_ratio is None else float(s.image_ratio) for s in steps],
        "layout": layout,
        "per_rank": per_rank,
    }


# -- pieces -------------------------------------------------------------------------------------


def _group(sizes: Sizes, rank: int) -> int:
    return sizes.dp_group(rank)


def _reshard(par: ParallelConfig, pp: int) -> bool:
    """parallel.reshard_after_forward as the runtime reads it (auto: not under PP)."""
    setting = str(par.reshard_after_forward).lower()
    return pp == 1 if setting == "auto" else setting == "true"


def _local_params(spec: ModelSpec, layers: list[int], first: bool, last: bool, tp: int, ep: int) -> float:
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
    free = (cfg.cluster.hbm_gib - cfg.cluster.memory_reserve_gib) * GIB
    layers = split_layers(spec.num_layers, sizes.pp)[0]
    static = mem.static_memory(spec, layers, True, sizes.pp == 1, tp=sizes.tp, ep=sizes.ep,
                               shard=sizes.dp_shard * sizes.cp).total
    return max(free - static, 0.0) / 4.0
