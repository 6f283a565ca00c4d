"""Put a model on a layout: pipeline split, expert and tensor parallelism, activation
checkpointing, FSDP — in that order (each wraps what the previous one left).

Returns a ``ParallelModel``: this rank's model chunks (one, or one per virtual pipeline stage),
for a model with encoders the ``MediaTower`` (encoders and projectors, lifted out of the model
for the multiplexing runtime), and what the trainer must do besides ``backward``: sum the
gradients of parameters that FSDP does not own (MoE layers, replicated over the ranks that feed
them different tokens; replicated encoders), sum the two copies of a tied embedding that
pipeline parallelism splits over the first and last stage, and count each gradient once in the
norm.
"""
from __future__ import annotations

import contextlib
import copy
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from dataloading.plan.cost import CostModel
from omni.models.cost import default_cost_model
from omni.models.materialize import TensorSource, WeightSource, is_meta, materialize
from omni.models.llm.compile import compile_blocks
from omni.models.llm.fp8 import convert_blocks_to_fp8
from omni.models.llm.moe import MoE
from omni.models.llm.parallel_plan import apply_tensor_parallel
from omni.models.multimodal import OmniModel
from omni.step.config import MultiplexConfig
from omni.multiplex.media_tower import MediaTower
from omni.step.multiplex_rules import WEIGHT_MODES, encoder_shard_group, step_fills_bubbles
from omni.multiplex.runtime import Multiplexer
from omni.step.multiplex_rules import encoder_ranks
from omni.runtime.timeline import Timeline
from omni.step import StepShape
from parallel.data_parallel import all_reduce_coalesced
from parallel.fsdp import precision_policy, shard_model, undo_gradient_average
from parallel.layout import (Layout, LayoutError, check_model_fits, encoder_mesh,
                             pipeline_gradient_group)
from parallel.pipeline import PipelineRunner
from parallel.pipeline_schedule import split_layers, stage_ids
from parallel.pipeline_executor import PipelineExecutor
from parallel.pipeline_schedule import EXECUTOR_SCHEDULES
from parallel.activation_offload import ActivationOffload
from parallel.sizing import offload_layers, reduces_every_microbatch


@dataclass
class ParallelModel:
    chunks: list[OmniModel]
    stage_ids: list[int]
    num_stages: int
    # Runs every step, one stage included (``PipelineExecutor``; ``PipelineRunner`` for torch's
    # zero-bubble schedule), as ``shape``'s step programs say (``omni.step.plan_step``).
    runner: Optional[PipelineRunner | PipelineExecutor] = None
    shape: StepShape = field(default_factory=StepShape)
    # (parameters, group): gradients to all-reduce (sum) after backward. Includes the two copies
    # of a tied embedding, summed over {first stage, last stage}.
    replica_syncs: list = field(default_factory=list)
    # Parameters whose gradient another rank also holds on purpose (the last stage's copy of a
    # tied embedding): left out of the gradient norm so they count once.
    norm_skip: list = field(default_factory=list)
    # (parameters, mesh size): FSDP-sharded parameters whose gradients FSDP averaged.
    averaged: list = field(default_factory=list)
    # The encoder-LLM multiplexing runtime (None for a model without encoders).
    multiplexer: Optional[Multiplexer] = None
    # Per-step encoder / LLM / communication / idle time of this rank (None: not recorded).
    timeline: Optional[Timeline] = None
    # The encoders and projectors on a rank that encodes (None: no encoders, or stage0 on a
    # later stage). Same parameter names as in the full model.
    media: Optional[MediaTower] = None

    def __post_init__(self) -> None:
        if self.runner is None and self.num_stages == 1:  # (parallelize sets a pipeline's own)
            # One stage: no messages, so no shapes (hidden size and dtype unused); the first
            # stage's placeholder input goes where the model is (a GPU's, not the host).
            device = next((p.device for p in self.chunks[0].parameters()), torch.device("cpu"))
            self.runner = PipelineExecutor(self.chunks, self.stage_ids, 1, None, device, 0, torch.float32,
                                           self.timeline)

    @property
    def parts(self) -> list[nn.Module]:
        """Every module whose parameters this rank trains (one optimizer each)."""
        return [*self.chunks, *([self.media] if self.media is not None else [])]

    @contextlib.contextmanager
    def inline_encoders(self):
        """One process, one chunk: the model with its encoders back inside and no multiplexer,
        as the unsplit model runs them (evaluation, generation); restored afterwards."""
        model = self.chunks[0]
        if self.media is None or len(self.chunks) > 1:
            yield model
            return
        saved = (model.encoders, model.projectors, model.multiplexer)
        model.encoders, model.projectors, model.multiplexer = self.media.encoders, self.media.projectors, None
        try:
            yield model
        finally:
            model.encoders, model.projectors, model.multiplexer = saved

    def parameters(self):
        for part in self.parts:
            yield from part.parameters()

    def named_parameters(self):
        seen = set()
        for part in self.parts:
            for name, p in part.named_parameters():
                if name not in seen:
                    seen.add(name)
                    yield name, p

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """After backward: every gradient becomes the sum over the ranks that share it."""
        for params, size in self.averaged:
            undo_gradient_average(params, size)
            for p in params:
                # A sharded encoder that ran no backward in the step (a text-only step, or no
                # item of its modality anywhere: then no rank did) has no gradient; zeros, as for
                # an unused replica below, so AdamW decays it as the single process does.
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        for p in self.parameters():
            # DTensor gradients can come back in another placement than their parameter:
            # partial sums for replicated TP weights used on sequence shards (norm gains), a
            # replicated gradient for a vocabulary-parallel embedding whose only use is the
            # lookup. Bring each to its parameter's placement once, here.
            g = p.grad
            if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(g.device_mesh, p.placements)
        for params, group in self.replica_syncs:
            grads = []
            for p in params:
                if not p.requires_grad:  # frozen (LoRA's base, model.freeze): the same on every rank
                    continue
                # An unused replica (an encoder on a text-only step) gets zeros, as the single
                # process's zero touch gives it: AdamW then decays it the same way, also where
                # this rank holds the only copy.
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
            if dist.get_world_size(group) > 1:
                all_reduce_coalesced(grads, group)  # a few bucketed collectives, not one per tensor


def activation_dtype(layout: Layout) -> torch.dtype:
    """The dtype of the residual stream between pipeline stages (their send and receive
    buffers), the same on every stage: FSDP's compute dtype where FSDP shards the stages (it
    casts the embedding and every block, so the stream is in that dtype), else the weights'
    own dtype (fp32). bf16 autocast does not change it: autocast casts matmul inputs, and the
    residual additions and norms return to the stream's dtype (docs/parallelism.md, "Precision")."""
    if layout.fsdp_mesh().size() > 1:
        return precision_policy(layout.config.mixed_precision, layout.rules).param_dtype or torch.float32
    return torch.float32


def parallelize(model: OmniModel, layout: Layout, multiplex: MultiplexConfig | None = None,
                cost: CostModel | None = None, weights: WeightSource | None = None) -> ParallelModel:
    """Apply ``layout`` to ``model``. A model on the meta device (``build.build_meta_model``) is
    split and sharded there, then each rank materialises only its own part from ``weights``
    (left on meta when ``weights`` is None: for counting and planning). A materialised model
    (the same on every rank) goes the same way, its own tensors being the source. A model
    with encoders gets the multiplexing runtime (``multiplex``: its config, default
    colocated; ``cost``: the shared cost model, default from the model's FLOPs)."""
    pcfg, sizes = layout.config, layout.sizes
    multiplex = multiplex or MultiplexConfig()
    has_media = len(model.encoders) > 0
    if has_media and multiplex.encoder_weights not in WEIGHT_MODES:
        raise LayoutError(f"multiplex.encoder_weights={multiplex.encoder_weights!r} is not one of "
                          f"{', '.join(WEIGHT_MODES)}")
    if not is_meta(model):
        if weights is not None:
            raise ValueError("parallelize: weights= is for a model built on the meta device; this one has its own")
        weights = TensorSource.of(model)
        model.to("meta")
    # On the device even under parallel.cpu_offload: FSDP moves each unit's shards to pinned host
    # memory as soon as the unit is allocated, and what FSDP does not manage (MoE layers,
    # buffers) must be on the device.
    place = (lambda parts: materialize(parts, weights, layout.device)) if weights is not None else (lambda parts: None)
    if has_media:  # the encoders leave the model: the multiplexing runtime runs them
        cost = cost or default_cost_model(model)
        tower = MediaTower.take_from(model)
        for enc in tower.encoders.values():
            enc.activation_checkpoint = pcfg.encoder_activation_checkpoint
    c = model.llm.config
    check_model_fits(sizes, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, num_layers=c.num_layers,
                     num_experts=c.num_experts, virtual_stages=pcfg.pp_virtual_stages if sizes.pp > 1 else 1,
                     cp_impl=pcfg.cp_impl, activation_offload=pcfg.activation_offload,
                     fp8=pcfg.fp8, hidden_size=c.hidden_size)
    if pcfg.fp8:
        warning = layout.rules.fp8_warning()  # raises where the device has no FP8 matmuls
        if warning and layout.is_main:
            print(warning, file=sys.stderr, flush=True)
    virtual = pcfg.pp_virtual_stages if sizes.pp > 1 else 1
    num_stages = sizes.pp * virtual
    ids = stage_ids(layout.pp_rank, sizes.pp, virtual)
    layers = split_layers(c.num_layers, num_stages)
    chunks = []
    for sid in ids:
        # On meta a copy has no storage: each virtual stage's chunk is a skeleton until placed.
        chunk = model if len(ids) == 1 else copy.deepcopy(model)
        if num_stages > 1:
            chunk.keep_stage(layers[sid], first=sid == 0, last=sid == num_stages - 1)
        chunks.append(chunk)
    timeline = Timeline(layout.rank, enabled=multiplex.timeline, device=layout.device,  # CUDA events on a GPU
                        every=multiplex.timeline_every)
    pm = ParallelModel(chunks, ids, num_stages, timeline=timeline)
    for chunk in chunks:
        _apply_one(chunk, layout, pm)
    place(chunks)
    # Every step runs on a runner: Omni's executor (one stage included: F0 B0 F1 B1 ..., with a
    # cut before each forward), or torch's zero-bubble schedule.
    defer = not reduces_every_microbatch(pcfg, layout.sizes.pp) and layout.fsdp_mesh().size() > 1
    keep = not _reshard_after_forward(layout)
    fills = has_media and step_fills_bubbles(multiplex, sizes, pcfg.gpus_per_node)
    pm.shape = StepShape(pp=sizes.pp, virtual=virtual, tp=sizes.tp, schedule=pcfg.pp_schedule,
                         one_shape=num_stages > 1 and pcfg.pp_schedule not in EXECUTOR_SCHEDULES, tail_cuts=fills)
    if num_stages == 1:
        pm.runner = PipelineExecutor(chunks, ids, 1, None, layout.device, c.hidden_size, torch.float32, timeline,
                                     defer_grad_sync=defer, keep_gathered=keep)
    else:
        group, dtype = layout.mesh["pp"].get_group(), activation_dtype(layout)
        if pcfg.pp_schedule in EXECUTOR_SCHEDULES:  # Omni's executor, with cuts for encoder work
            groups = (group, pipeline_gradient_group(layout))
            pm.runner = PipelineExecutor(chunks, ids, num_stages, groups, layout.device, c.hidden_size, dtype,
                                         timeline, defer_grad_sync=defer, keep_gathered=keep)
        else:
            pm.runner = PipelineRunner(chunks, ids, num_stages, pcfg.pp_schedule, group, layout.device,
                                       c.hidden_size, dtype, timeline)
    if num_stages > 1 and c.tie_word_embeddings:
        # The first stage's embedding and the last stage's head copy (on different pipeline
        # ranks) receive each other's gradient.
        copies = [ch.llm.embed_tokens.weight for ch in chunks if ch.llm.embed_tokens is not None]
        pm.replica_syncs.append((copies, layout.group("tie")))
        pm.norm_skip = [ch.llm.embed_tokens.weight for ch in chunks
                        if ch.runtime.last_stage and ch.llm.embed_tokens is not None]
    if has_media:
        # media rows as wide as the first layer's input (DeepStack residuals included)
        _multiplex(pm, tower, layout, multiplex, cost, timeline, model.input_width, place)
    return pm


def _multiplex(pm: ParallelModel, tower: MediaTower, layout: Layout, cfg: MultiplexConfig, cost: CostModel,
               timeline, hidden_size: int, place: Callable[[list], None]) -> None:
    """The multiplexing runtime, fed by the first stage's chunk, and the encoder weights on
    every rank that encodes: replicated, with gradients summed over those ranks (a rank
    without media adds zeros: no dilution), FSDP-sharded over them (FSDP reduces), or hybrid:
    sharded inside shard groups and replicated across them (FSDP2's HSDP on a 2-D mesh)."""
    members = encoder_ranks(layout.sizes, cfg.placement)
    active = layout.rank in members
    shard = encoder_shard_group(cfg.encoder_weights, cfg.encoder_shard_group, layout.config.gpus_per_node,
                                len(members))
    # A single encoder rank (one process) holds whole weights whatever the mode: no FSDP on a
    # mesh of one.
    sharded = cfg.encoder_weights in ("sharded", "hybrid") and len(members) > 1
    # A single shard group is plain FSDP (a 1-D mesh: no all-reduce over a group of one).
    two_d = cfg.encoder_weights == "hybrid" and shard < len(members)
    # Every rank builds the mesh (it creates process groups), encoder rank or not.
    mesh = encoder_mesh(layout, first_stage_only=cfg.placement == "stage0",
                        shard_group=shard if two_d else None) if sharded else None
    if active:
        pm.media = tower
        if sharded:
            precision = precision_policy(layout.config.mixed_precision, layout.rules)
            params = tower.shard(mesh, precision, reshard_after_forward=_reshard_after_forward(layout),
                                 prefetch=layout.config.fsdp_prefetch, weights=cfg.encoder_weights)
            # FSDP averages over both dimensions of a 2-D mesh (reduce-scatter, then all-reduce).
            pm.averaged.append((params, mesh.size()))
        place([tower])  # only the ranks that encode hold encoder weights
    mux = Multiplexer(tower if active else None, layout, cfg, cost, hidden_size, timeline, held=tuple(pm.chunks))
    pm.multiplexer = mux
    if layout.pp_rank == 0:
        pm.chunks[0].multiplexer = mux  # the chunk that embeds
    if active and not sharded:
        params = tower.trainable()
        pm.replica_syncs.append((params, mux.group if mux.group is not None else dist.group.WORLD))
        if layout.pp_rank > 0:  # the copies on later stages are counted once, on the first stage
            pm.norm_skip = list(pm.norm_skip) + params


def _apply_one(chunk: OmniModel, layout: Layout, pm: ParallelModel) -> None:
    pcfg, sizes = layout.config, layout.sizes
    rt = chunk.runtime
    rt.checkpoint = pcfg.activation_checkpoint
    rt.fused_loss = layout.rules.fused_loss and sizes.tp == 1  # liger's kernel has no vocabulary split
    offloaded = offload_layers(pcfg.activation_offload, chunk.llm.config.num_layers)
    rt.offload = None if offloaded == set() else ActivationOffload(offloaded)
    if sizes.cp > 1:
        rt.cp_group, rt.cp_size, rt.cp_impl = layout.group("cp"), sizes.cp, pcfg.cp_impl
    moe_layers = [b.mlp for b in chunk.llm.layers if isinstance(b.mlp, MoE)]
    token_group = layout.group("token") if sizes.cp * sizes.tp > 1 else None
    for moe in moe_layers:
        if sizes.ep > 1:
            moe.enable_expert_parallel(layout.group("ep"), layout.ep_rank, sizes.ep)
            _experts_as_dtensors(moe, layout)
        if token_group is not None:
            moe.set_token_group(token_group)
    if sizes.tp > 1:
        rt.tp_mesh, rt.tp_group = layout.tp_mesh(), layout.tp_mesh().get_group()
        rt.tp_rank, rt.tp_size = layout.tp_rank, sizes.tp
        apply_tensor_parallel(chunk.llm, rt.tp_mesh)
    if pcfg.fp8:  # before compile (it compiles the FP8 casts too) and FSDP
        convert_blocks_to_fp8(chunk.llm.layers)
    if pcfg.compile:  # after TP (it compiles the DTensor modules), before FSDP wraps the blocks
        compile_blocks(chunk.llm.layers)
    # MoE parameters are not sharded by FSDP: the ranks of a stage route different tokens through
    # them, so their gradients are summed over the stage (experts: over the ranks holding the
    # same experts).
    for moe in moe_layers:
        experts = list(moe.experts.parameters())
        others = [p for p in moe.parameters() if all(p is not q for q in experts)]
        pm.replica_syncs.append((others, layout.group("stage")))
        pm.replica_syncs.append((experts, layout.group("expert_replicas")))
    # Qwen3's QK-norm gains under TP: each rank's heads give a part of a gain's gradient, so, like
    # the routers, they stay whole on every rank of the stage, outside FSDP, their gradients summed
    # over the stage (Megatron all-reduces them over TP; transformers' TP plan calls them
    # replicated_with_grad_allreduce).
    qk_norms = [p for b in chunk.llm.layers if b.self_attn.q_norm is not None
                for p in (b.self_attn.q_norm.weight, b.self_attn.k_norm.weight)] if sizes.tp > 1 else []
    if qk_norms:
        pm.replica_syncs.append((qk_norms, layout.group("stage")))
    if pcfg.cpu_offload and layout.device.type != "cuda":
        raise LayoutError("parallel.cpu_offload=true moves FSDP's sharded state from the GPU to host memory; "
                          "this run is on the CPU already: set parallel.cpu_offload=false")
    if layout.fsdp_mesh().size() > 1:
        blocks = list(chunk.llm.layers)
        per = pcfg.fsdp_blocks_per_unit
        units = [blocks[i:i + per] for i in range(0, len(blocks), per)]
        reshard = _reshard_after_forward(layout)
        ignored = [p for moe in moe_layers for p in moe.parameters()] + qk_norms
        sharded = shard_model(chunk, units, layout.fsdp_mesh(), precision=precision_policy(pcfg.mixed_precision, layout.rules),
                    cpu_offload=pcfg.cpu_offload, reshard_after_forward=reshard, prefetch=pcfg.fsdp_prefetch,
                    ignored=ignored)
        pm.averaged.append((sharded, layout.fsdp_mesh().size()))


def _reshard_after_forward(layout: Layout) -> bool:
    """``parallel.reshard_after_forward``; auto: only without pipeline parallelism (with it,
    several micro-batches are in flight and a unit would be gathered again for each backward)."""
    setting = layout.config.reshard_after_forward
    return layout.sizes.pp == 1 if setting == "auto" else str(setting).lower() == "true"


def _experts_as_dtensors(moe: MoE, layout: Layout) -> None:
    """Each EP rank's expert block becomes its shard of a DTensor over the EP mesh, so
    checkpoints store every expert once and reload under another EP size."""
    mesh = layout.ep_mesh()
    for name in ("w_gate_up", "w_down"):
        local = getattr(moe.experts, name)
        dt = DTensor.from_local(local.detach(), mesh, [Shard(0)], run_check=False)
        setattr(moe.experts, name, nn.Parameter(dt, requires_grad=local.requires_grad))
