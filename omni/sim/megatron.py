"""The Megatron-LM baselines of ``omni simulate``: ``megatron`` (tuned, as its users run it) and
``megatron_naive`` (a default configuration held to the workload's layout).

Megatron-LM trains a vision-language model (its LLaVA model, ``examples/multimodal``) with the
vision encoder and projector built only on the first pipeline stage ("when we use pipelining,
the encoder will live on only the first stage", ``LLaVAModel``'s ``add_encoder``), as part of
that stage's embedding:

- in the first stage's forward of every micro-batch the ViT encodes that micro-batch's own
  images, and its backward runs inside the same stage's backward of the micro-batch: no other
  stage and no other DP group helps, so stage 0 carries the whole encoder load and the pipeline
  is unbalanced (the event-driven engine finds the cost of that by itself: the encoder time is
  added to the stage-0 ``StageWork`` of each micro-batch);
- the ViT is tensor-parallel over the stage's TP group (the LLM's tp): its GEMMs and attention
  heads split over tp, with the TP collectives of every layer exposed (Megatron's example runs
  the ViT without tp_comm_overlap) — two all-reduces per layer each way, which the ring model
  prices as the two all-gathers and two reduce-scatters of sequence parallelism. CP ranks each
  encode the whole micro-batch (the ViT is built with context_parallel_size=1);
- weights under Megatron's distributed optimizer (``--use-distributed-optimizer``,
  ``--overlap-grad-reduce``, ``--overlap-param-gather``): bf16 weights whole for the step, a full
  fp32 gradient buffer reduce-scattered once per step behind the last backward, fp32 master
  weights and moments sharded over DP, the updated weights all-gathered behind the next step's
  first forward. For the LLM this is ``parallel.reshard_after_forward=false`` with
  ``fsdp_reduce_every_microbatch=false`` (``run_config``); for the encoder,
  ``first_stage_encoder``.

What the two differ in:

| | ``megatron`` (tuned) | ``megatron_naive`` |
|---|---|---|
| layout | searched (``omni.sim.search.megatron_candidates``): pp including 1 (``--pipeline-model-parallel-size``), tp (``--tensor-model-parallel-size``), virtual stages (``--num-layers-per-virtual-pipeline-stage``), fewer LLM layers on the first stage (``--decoder-first-pipeline-num-layers``), recompute (``--recompute-granularity``) | the workload's own (colocated's) |
| packing | each DP rank packs its own share largest first (``data.balance=packed``: Megatron-Energon's packing, a knapsack over a buffer) | next-fit in order (``data.balance=none``) |
| LLM TP communication | overlapped with the GEMMs (``--tp-comm-overlap``; ``timing.stage_work``) | exposed |

Both pad pipeline rows as Omni's trainer does (``parallel.rows``: each micro-batch its own
length, empty ones short), which Megatron-LM does with ``--variable-seq-lengths`` (each
micro-batch's shape sent ahead of it): the baseline is not charged padding its users avoid.

The LLM side is otherwise the simulator's own (the same ``stage_work``, schedule and gradient
sync as the other placements), so with no images ``megatron_naive`` takes the LLM-only step of
``stage0`` (with the distributed optimizer's weight handling).

Two simplifications, both in Megatron's favour: Megatron's ViT runs without sequence
parallelism, so its norms and residual adds (and the activations they keep) are replicated over
TP, where this model splits every roofline term and every activation over tp. The encoder is
recomputed as ``parallel.encoder_activation_checkpoint`` says for every placement (Megatron's
``--recompute-vision``; off by default).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from omni.sim import memory as mem
from omni.sim import sync
from omni.sim.config import SimConfig, SimDataConfig
from omni.sim.work import MicroBatchWork
from omni.sim.engine import StepTimeline
from omni.sim.spec import ModelSpec
from omni.sim.machine import CommGroup, Machine
from omni.sim.timing import BF16, StageWork, encoder_work
from parallel.pipeline_schedule import split_layers
from parallel.sizing import Sizes

PLACEMENTS = ("megatron", "megatron_naive")
TUNED = "megatron"
# How each packs a step (a dataloading.plan.balance method).
PACKING = {"megatron": "packed", "megatron_naive": "none"}


def is_megatron(placement: str) -> bool:
    return placement in PLACEMENTS


def overlaps_tp_comm(placement: str) -> bool:
    """The LLM's TP collectives under its GEMMs (``--tp-comm-overlap``): the tuned baseline."""
    return placement == TUNED


def data_config(cfg: SimConfig, placement: str) -> SimDataConfig:
    """The data a placement draws: each Megatron baseline packs its own way (``PACKING``), every
    other placement as ``data.balance`` says."""
    if is_megatron(placement):
        return dataclasses.replace(cfg.data, balance=PACKING[placement])
    return cfg.data


def run_config(cfg: SimConfig, placement: str) -> SimConfig:
    """``cfg`` as a Megatron placement runs it: the distributed optimizer's weights (whole for the
    step, gradients reduced once per step) and its packing. Other placements: unchanged."""
    if not is_megatron(placement):
        return cfg
    par = dataclasses.replace(cfg.parallel, reshard_after_forward=False, fsdp_reduce_every_microbatch=False)
    return dataclasses.replace(cfg, parallel=par, data=data_config(cfg, placement))


def first_stage_options(num_layers: int, pp: int, count: int = 4) -> list[int]:
    """LLM layers the first stage may take below an even share, as Megatron users give it
    (``--decoder-first-pipeline-num-layers``, the rest split evenly over the other stages):
    ``count`` of the valid values spread from just below even down to one layer."""
    if pp < 2 or num_layers % pp:
        return []
    even = num_layers // pp
    valid = [f for f in range(even - 1, 0, -1) if (num_layers - f) % (pp - 1) == 0]
    if len(valid) <= count:
        return valid
    return sorted({valid[round(i * (len(valid) - 1) / (count - 1))] for i in range(count)}, reverse=True)


def stage_layers(num_layers: int, stages: int, first_stage_layers: int = 0) -> list[list[int]]:
    """Consecutive blocks of layers per (virtual) stage: even, or ``first_stage_layers`` on the
    first and the rest split evenly over the others."""
    if first_stage_layers <= 0 or stages < 2:
        return split_layers(num_layers, stages)
    rest, others = num_layers - first_stage_layers, stages - 1
    if first_stage_layers >= num_layers or rest % others:
        raise ValueError(f"sim.first_stage_layers={first_stage_layers} leaves {rest} layers, which do not split "
                         f"evenly over {others} stages")
    per = rest // others
    return [list(range(first_stage_layers))] + [
        list(range(first_stage_layers + s * per, first_stage_layers + (s + 1) * per)) for s in range(others)]


@dataclass(frozen=True)
class EncoderPass:
    """One pass (forward or backward) of a micro-batch's images on one GPU of stage 0."""

    compute_s: float
    comm_s: float  # the TP collectives, exposed

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


def tp_rank_encoder_compute(m: Machine, spec: ModelSpec, media: list[tuple[str, int, int]], tp: int,
                            gpus_per_node: int) -> tuple[float, float]:
    """(forward, backward) compute of one TP rank encoding ``media`` (whole items) with the
    encoder TP-split over ``tp`` GPUs.

    TP divides every roofline term of ``timing.encoder_work`` by tp (GEMM FLOPs and weight
    bytes, attention heads, elementwise traffic) but not the fixed cost of each kernel launch:
    so it is ``encoder_work`` on a machine whose per-op overhead is tp times larger, divided by
    tp. (A ``tp`` argument of ``encoder_work`` would say this directly.)"""
    launch_tp = Machine(dataclasses.replace(m.cluster, op_overhead_us=m.cluster.op_overhead_us * tp))
    w = encoder_work(launch_tp, spec, [(mod, n, 1) for mod, n, _ in media], gpus_per_node)
    return w.forward_s / tp, w.backward_s / tp


def tp_layer_comm(m: Machine, act_bytes: float, group: CommGroup) -> float:
    """One transformer layer's TP collectives over the TP ``group``, one pass: two all-gathers
    and two reduce-scatters of the layer's activations (``act_bytes``, whole), as in
    ``timing.stage_work`` for the LLM."""
    return 2 * m.all_gather(act_bytes, group) + 2 * m.reduce_scatter(act_bytes, group)


def micro_batch_passes(m: Machine, spec: ModelSpec, mb: MicroBatchWork, tp: int,
                       gpus_per_node: int) -> tuple[EncoderPass, EncoderPass]:
    """Forward and backward of one micro-batch's images on one GPU of stage 0's TP group."""
    fwd_compute, bwd_compute = tp_rank_encoder_compute(m, spec, mb.media, tp, gpus_per_node)
    fwd_comm = bwd_comm = 0.0
    tp_group = CommGroup.strided(tp, 1, gpus_per_node)  # TP innermost: consecutive ranks
    for modality in sorted({mod for mod, _, _ in mb.media}):
        e = spec.encoders[modality]
        tokens = sum(n for mod, n, _ in mb.media if mod == modality)  # one batched call per encoder
        comm = e.num_layers * tp_layer_comm(m, BF16 * tokens * e.hidden, tp_group)
        fwd_comm += comm
        # a frozen encoder runs no backward; a recomputed one reruns the forward's collectives
        bwd_comm += comm * (2 if e.recompute == "full" else 1) if e.trainable else 0.0
    return EncoderPass(fwd_compute, fwd_comm), EncoderPass(bwd_compute, bwd_comm)


def encoder_static_memory(cfg: SimConfig, spec: ModelSpec, tp: int, dp: int) -> mem.MemoryBreakdown:
    """The encoders' weights, gradients and optimizer state on one GPU of stage 0: TP splits
    them all; the distributed optimizer shards the fp32 master weights and the moments over
    the ``dp`` ranks, keeps the bf16 weights whole and a full fp32 gradient buffer."""
    out = mem.MemoryBreakdown()
    for modality in spec.encoders:
        sharded = mem.encoder_static_memory(spec, modality, shard=dp, gather_whole=True,
                                            optimizer_bytes_per_param=cfg.sim.optimizer_bytes_per_param)
        whole = mem.encoder_static_memory(spec, modality, shard=1)
        b = dataclasses.replace(sharded, grads=whole.grads)
        out = mem.MemoryBreakdown(**{f.name: getattr(out, f.name) + getattr(b, f.name) / tp
                                     for f in dataclasses.fields(mem.MemoryBreakdown)})
    return out


@dataclass
class FirstStageEncoder:
    """The encoder work and state Megatron puts on the first pipeline stage, per DP group and
    micro-batch; ``omni.sim.simulate`` folds it into the stage-0 work, memory and tail."""

    forward: dict[tuple[int, int], EncoderPass] = field(default_factory=dict)  # (group, micro-batch)
    backward: dict[tuple[int, int], EncoderPass] = field(default_factory=dict)
    activation: dict[tuple[int, int], float] = field(default_factory=dict)  # bytes kept until backward
    static: mem.MemoryBreakdown = field(default_factory=mem.MemoryBreakdown)
    optimizer_params: float = 0.0  # encoder parameters this GPU's optimizer updates
    # Per DP group: the exposed part of the gradient reduce-scatter over the DP group. The
    # encoder's gradients are the stage's last (its backward ends the micro-batch's), so only
    # the last micro-batch's encoder backward hides them.
    grad_reduce_s: dict[int, float] = field(default_factory=dict)
    param_gather_s: float = 0.0  # all-gather of the updated weights over the DP group, whole

    def add_to_first_stage(self, work: dict[tuple[int, int, int], StageWork],
                           act: dict[tuple[int, int, int], float]) -> None:
        """Each micro-batch's encoder forward and backward join stage 0's, as in Megatron's
        first-stage embedding; its activations join the stage's."""
        for (g, i), f in self.forward.items():
            b = self.backward[(g, i)]
            w = work[(g, 0, i)]
            work[(g, 0, i)] = StageWork(w.forward_s + f.total_s, w.backward_s + b.total_s,
                                        w.forward_compute_s + f.compute_s, w.tokens,
                                        w.backward_compute_s + b.compute_s)
            act[(g, 0, i)] += self.activation[(g, i)]

    def sync_s(self, group: int, work: dict[tuple[int, int, int], StageWork]) -> float:
        """Exposed encoder weight sync of a DP group's stage 0: the gradient reduce-scatter
        (``grad_reduce_s``, behind the last micro-batch's encoder backward), and the updated
        weights' all-gather behind the next step's first stage-0 forward."""
        gather = max(0.0, self.param_gather_s - work[(group, 0, 0)].forward_s)
        return self.grad_reduce_s.get(group, 0.0) + gather

    def book(self, timeline: StepTimeline) -> None:
        """The engine booked the encoder compute as stage-0 LLM time: move it to ``encoder_s``."""
        for tl in timeline.cells:
            if tl.stage != 0:
                continue
            enc = sum(f.compute_s + self.backward[k].compute_s for k, f in self.forward.items() if k[0] == tl.group)
            tl.llm_s -= enc
            tl.encoder_s += enc
            tl.add("llm_compute", -enc)
            tl.add("encoder_compute", enc)


def first_stage_encoder(cfg: SimConfig, spec: ModelSpec, m: Machine, sizes: Sizes, placement: str,
                        groups: list[list[MicroBatchWork]]) -> FirstStageEncoder | None:
    """What the encoders add to stage 0 under a Megatron placement (None under the others):
    ``groups[g][i]``, DP group g's micro-batch i (padded to the step's count)."""
    if not is_megatron(placement):
        return None
    tp, gpn = sizes.tp, cfg.cluster.gpus_per_node
    dp = sizes.dp * sizes.cp  # Megatron's data-parallel group for dense weights spans CP too
    out = FirstStageEncoder()
    for g, mbs in enumerate(groups):
        for i, mb in enumerate(mbs):
            if not mb.media:
                continue
            out.forward[(g, i)], out.backward[(g, i)] = micro_batch_passes(m, spec, mb, tp, gpn)
            out.activation[(g, i)] = sum(mem.encoder_activation_bytes(spec, mod, n, sp=tp) for mod, n, _ in mb.media)
    if not spec.encoders:
        return out
    out.static = encoder_static_memory(cfg, spec, tp, dp)
    trained = sum(e.params for e in spec.encoders.values() if e.trainable) / tp
    out.optimizer_params = trained / dp
    layers = sum(e.num_layers for e in spec.encoders.values())
    # Megatron's DP group of stage 0 (with CP): the ranks of every DP and CP index at one TP rank.
    dp_group = sync.mesh_group(sizes, gpn, ("dp_replicate", "dp_shard", "cp"), pp=0)
    for g, mbs in enumerate(groups):
        last = out.backward.get((g, len(mbs) - 1))
        out.grad_reduce_s[g] = sync.grad_sync(m, trained, dp_group, CommGroup(1, 1), layers,
                                              last.total_s if last else 0.0)
    out.param_gather_s = m.all_gather(BF16 * trained, dp_group)
    return out
