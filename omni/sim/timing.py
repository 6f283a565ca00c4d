"""The time of the model's work on one GPU: an LLM pipeline stage's forward and backward on a
micro-batch (``stage_work``) and an encoder chunk's (``encoder_work``), counted op by op and
timed by the cluster's roofline and collectives (``omni.sim.machine``).

The work itself comes from the shared cost model (``ModelSpec.cost``: forward FLOPs, alpha for
the attention pairs and beta for the linear part); this module only turns it into time.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from omni.sim.machine import CommGroup, Machine
from omni.sim.spec import ModelSpec

BF16 = 2  # bytes per element of activations and gathered weights


@dataclass(frozen=True)
class StageWork:
    """The LLM work of one pipeline stage on one micro-batch, per GPU of its TP x CP group."""

    forward_s: float
    backward_s: float
    forward_compute_s: float  # of forward_s, the compute (the rest is exposed TP/CP/EP communication)
    tokens: int
    backward_compute_s: float = 0.0  # of backward_s, the compute (recomputation included)


@functools.lru_cache(maxsize=256)  # a pure function of four integers, asked for every stage and micro-batch
def _stage_groups(tp: int, cp: int, ep: int, gpus_per_node: int) -> tuple[CommGroup, bool, CommGroup]:
    """The TP group, whether the CP ring crosses nodes (its slowest hop) and the EP group, as
    the runtime lays them out (parallel.sizing: TP innermost, CP next; EP is the innermost part
    of dp_shard x cp, so its ranks are tp apart too)."""
    return (CommGroup.strided(tp, 1, gpus_per_node), CommGroup.strided(cp, tp, gpus_per_node).crosses_nodes,
            CommGroup.strided(ep, tp, gpus_per_node))


def stage_work(m: Machine, spec: ModelSpec, layers: range, first: bool, last: bool, length: int,
               doc_lengths: list[int], tp: int, cp: int, ep: int, gpus_per_node: int, recompute: str,
               tp_overlap: bool = False, offload_bytes: dict[int, float] | None = None) -> StageWork:
    """Forward and backward time of ``layers`` on one micro-batch padded to ``length`` tokens
    with documents ``doc_lengths`` (real tokens), on one GPU of a TP x CP group.

    GEMMs: 2 x active parameters per token, split over TP and CP (each CP rank holds 1/cp of
    the tokens). Attention: the cost model's alpha per layer x sum L^2, split over TP (heads)
    and CP (balanced chunks). Elementwise work (norms, rotary, activations, residuals) is
    memory-bound. TP with sequence parallelism runs two all-gathers and two reduce-scatters of
    the activations per layer each way; CP's ring passes K/V behind the attention; EP's
    all-to-alls carry every routed token out and back.

    ``tp_overlap``: the TP collectives run under the GEMMs they feed, in ``tp`` chunks, as
    Megatron-LM's ``--tp-comm-overlap`` (Transformer Engine's userbuffers ring exchange) does:
    what shows is the part the layer's GEMMs cannot cover, plus one chunk to fill the pipeline.

    ``offload_bytes``: per offloaded block, the bytes its saved tensors send to host memory
    (``parallel.activation_offload``). The copy out runs beside the block's forward and the copy
    back beside the backward of the block after it (brought back one block ahead); what the
    compute does not cover shows.
    """
    c = spec.llm
    h = c.hidden_size
    t_local = length / cp  # tokens of this GPU's sequence share (TP shards the width, SP the norms)
    pairs = sum(L * L for L in doc_lengths)
    kv_width = c.num_kv_heads * c.resolved_head_dim()
    tp_group, cp_cross, ep_group = _stage_groups(tp, cp, ep, gpus_per_node)
    alpha = spec.attention_alpha_per_layer()

    def layer(i: int) -> tuple[float, float, float]:
        """Layer ``i``'s forward (compute, attention, exposed communication)."""
        active = spec.layer_active[i]
        weights = (spec.layer_params[i] - spec.layer_expert_params[i]) / tp + spec.layer_expert_params[i] / (ep * tp)
        gemm = m.gemm(2.0 * active * t_local / tp, BF16 * (weights + 6 * t_local * h / tp))
        attn = m.attention(alpha * pairs / (tp * cp))
        elementwise = m.memory(BF16 * 24 * t_local * h / tp)
        act = BF16 * t_local * h
        tp_comm = 2 * m.all_gather(act, tp_group) + 2 * m.reduce_scatter(act, tp_group)
        if tp_overlap and tp > 1:
            tp_comm = max(0.0, tp_comm - gemm) + min(tp_comm, gemm) / tp
        cp_comm = max(0.0, (cp - 1) * m.p2p(2 * BF16 * t_local * kv_width / tp, cp_cross) - attn)
        ep_comm = 0.0
        if c.is_moe_layer(i) and ep > 1:
            routed = BF16 * t_local * h / tp * c.num_experts_per_tok * (ep - 1) / ep
            ep_comm = 2 * m.all_to_all_group(routed, ep_group)
        return gemm + attn + elementwise + m.overhead(14), attn, tp_comm + cp_comm + ep_comm

    fwd_compute = fwd_comm = attn_fwd = offload_fwd = offload_bwd = 0.0
    for i, (compute, attn, comm) in zip(layers, spec.by_kind(layers, layer)):
        fwd_compute += compute
        attn_fwd += attn
        fwd_comm += comm
        if offload_bytes and i in offload_bytes:
            copy = m.host_copy(offload_bytes[i])
            offload_fwd += max(0.0, copy - compute)
            offload_bwd += max(0.0, copy - 2.0 * compute)  # beside a block's backward (2 forwards)
    if last:
        head = 2.0 * c.vocab_size * h * t_local / tp
        # Logits in fp32 and the cross-entropy's softmax are memory-bound passes over T x V/tp.
        fwd_compute += m.gemm(head, BF16 * c.vocab_size * h / tp) + m.memory(3 * 4 * t_local * c.vocab_size / tp)
    if first:
        fwd_compute += m.memory(BF16 * t_local * h)  # the embedding gather
    forward = fwd_compute + fwd_comm + offload_fwd
    # Recomputation: selective reruns the attention, full the whole forward (its TP traffic too).
    redo_compute = {"none": 0.0, "selective": attn_fwd, "full": fwd_compute}[recompute]
    redo_comm = fwd_comm if recompute == "full" else 0.0
    backward_compute = 2.0 * fwd_compute + redo_compute
    return StageWork(forward, backward_compute + fwd_comm + redo_comm + offload_bwd, fwd_compute,
                     int(sum(doc_lengths)), backward_compute)


@dataclass(frozen=True)
class EncoderWork:
    forward_s: float
    backward_s: float


def encoder_work(m: Machine, spec: ModelSpec, items: list[tuple[str, int, int]], gpus_per_node: int) -> EncoderWork:
    """One GPU's part of an encoder chunk: ``items`` as (modality, tokens, sp) — an item split
    over an SP block of ``sp`` GPUs costs each member 1/sp of it plus the Ulysses all-to-alls
    (four per layer each way, each moving (sp-1)/sp of the member's activations). One encoder
    call per modality reads its weights once. A frozen encoder runs no backward (its inputs
    are pixels or frames, which need no gradient)."""
    fwd = bwd = 0.0
    for modality in sorted({mod for mod, _, _ in items}):
        e = spec.encoders[modality]
        mine = [(n, sp) for mod, n, sp in items if mod == modality]
        tokens = sum(n / sp for n, sp in mine)
        elementwise = m.memory(BF16 * 16 * tokens * e.hidden * e.num_layers)
        compute = (m.gemm(sum(e.beta * n / sp for n, sp in mine), BF16 * e.params)
                   + m.attention(sum(e.alpha * n * n / sp for n, sp in mine))
                   + elementwise + m.overhead(12 * e.num_layers)) / m.cluster.encoder_efficiency
        comm = sum(4 * e.num_layers * m.all_to_all(BF16 * n / sp * e.hidden * (sp - 1) / sp, sp, sp > gpus_per_node)
                   for n, sp in mine if sp > 1)
        fwd += compute + comm
        # Activation checkpointing (parallel.encoder_activation_checkpoint): full reruns the
        # forward, its Ulysses all-to-alls included; selective reruns the elementwise ops.
        again = {"none": 0.0, "selective": elementwise / m.cluster.encoder_efficiency,
                 "full": compute + comm}[e.recompute]
        bwd += 2.0 * compute + comm + again if e.trainable else 0.0
    return EncoderWork(fwd, bwd)
