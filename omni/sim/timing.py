"""Per-op times from FLOPs and bytes (a roofline with efficiency factors) and collective times
from message sizes and where the group's GPUs sit (inside a node: NVLink; across nodes: the
network). Everything is seconds on one GPU of the cluster.

The work itself comes from the shared cost model (``ModelSpec.cost``: forward FLOPs, alpha for
the attention pairs and beta for the linear part); this module only turns it into time.
"""
from __future__ import annotations

from dataclasses import dataclass

from omni.sim.config import ClusterConfig
from omni.sim.spec import ModelSpec

BF16 = 2  # bytes per element of activations and gathered weights


@dataclass(frozen=True)
class Machine:
    cluster: ClusterConfig

    # -- compute ---------------------------------------------------------------------------
    def gemm(self, flops: float, bytes_moved: float = 0.0) -> float:
        c = self.cluster
        return max(flops / (c.peak_tflops * 1e12 * c.gemm_efficiency), self.memory(bytes_moved))

    def attention(self, flops: float) -> float:
        c = self.cluster
        return flops / (c.peak_tflops * 1e12 * c.attention_efficiency)

    def memory(self, bytes_moved: float) -> float:
        c = self.cluster
        return bytes_moved / (c.hbm_gbps * 1e9 * c.memory_efficiency)

    def overhead(self, ops: float) -> float:
        return ops * self.cluster.op_overhead_us * 1e-6

    # -- communication ---------------------------------------------------------------------
    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """(bytes/s, latency s) of one GPU's link."""
        c = self.cluster
        if crosses_nodes:
            return c.net_gbps * 1e9 * c.comm_efficiency, c.net_latency_us * 1e-6
        return c.nvlink_gbps * 1e9 * c.comm_efficiency, c.nvlink_latency_us * 1e-6

    def ring(self, kind: str, nbytes: float, n: int, crosses_nodes: bool) -> float:
        """A ring collective over n GPUs of a tensor of ``nbytes`` (the full, unsharded size):
        all_gather / reduce_scatter move (n-1)/n of it, all_reduce twice that."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw, lat = self.link(crosses_nodes)
        factor = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}[kind]
        return factor * ((n - 1) / n * nbytes / bw + (n - 1) * lat)

    def all_to_all(self, bytes_out: float, n: int, crosses_nodes: bool) -> float:
        """One GPU sends ``bytes_out`` spread over the other n - 1 (and receives as much)."""
        if n <= 1 or bytes_out <= 0:
            return 0.0
        bw, lat = self.link(crosses_nodes)
        return bytes_out / bw + lat

    def p2p(self, nbytes: float, crosses_nodes: bool) -> float:
        if nbytes <= 0:
            return 0.0
        bw, lat = self.link(crosses_nodes)
        return nbytes / bw + lat


@dataclass(frozen=True)
class StageWork:
    """The LLM work of one pipeline stage on one micro-batch, per GPU of its TP x CP group."""

    forward_s: float
    backward_s: float
    forward_compute_s: float  # of forward_s, the compute (the rest is exposed TP/CP/EP communication)
    tokens: int
    backward_compute_s: float = 0.0  # of backward_s, the compute (recomputation included)


def stage_work(m: Machine, spec: ModelSpec, layers: range, first: bool, last: bool, length: int,
               doc_lengths: list[int], tp: int, cp: int, ep: int, gpus_per_node: int, recompute: str) -> StageWork:
    """Forward and backward time of ``layers`` on one micro-batch padded to ``length`` tokens
    with documents ``doc_lengths`` (real tokens), on one GPU of a TP x CP group.

    GEMMs: 2 x active parameters per token, split over TP and CP (each CP rank holds 1/cp of
    the tokens). Attention: the cost model's alpha per layer x sum L^2, split over TP (heads)
    and CP (balanced chunks). Elementwise work (norms, rotary, activations, residuals) is
    memory-bound. TP with sequence parallelism runs two all-gathers and two reduce-scatters of
    the activations per layer each way; CP's ring passes K/V behind the attention; EP's
    all-to-alls carry every routed token out and back.
    """
    c = spec.llm
    h = c.hidden_size
    t_local = length / cp  # tokens of this GPU's sequence share (TP shards the width, SP the norms)
    pairs = sum(L * L for L in doc_lengths)
    kv_width = c.num_kv_heads * c.resolved_head_dim()
    tp_cross = tp > gpus_per_node
    cp_cross = tp * cp > gpus_per_node
    ep_cross = ep * tp * cp > gpus_per_node if ep > 1 else False
    fwd_compute = fwd_comm = attn_fwd = 0.0
    alpha = spec.attention_alpha_per_layer()
    for i in layers:
        active = spec.layer_active[i]
        weights = (spec.layer_params[i] - spec.layer_expert_params[i]) / tp + spec.layer_expert_params[i] / (ep * tp)
        gemm = m.gemm(2.0 * active * t_local / tp, BF16 * (weights + 6 * t_local * h / tp))
        attn = m.attention(alpha * pairs / (tp * cp))
        elementwise = m.memory(BF16 * 24 * t_local * h / tp)
        fwd_compute += gemm + attn + elementwise + m.overhead(14)
        attn_fwd += attn
        act = BF16 * t_local * h
        tp_comm = 2 * m.ring("all_gather", act, tp, tp_cross) + 2 * m.ring("reduce_scatter", act, tp, tp_cross)
        cp_comm = max(0.0, (cp - 1) * m.p2p(2 * BF16 * t_local * kv_width / tp, cp_cross) - attn)
        ep_comm = 0.0
        if c.is_moe_layer(i) and ep > 1:
            routed = BF16 * t_local * h / tp * c.num_experts_per_tok * (ep - 1) / ep
            ep_comm = 2 * m.all_to_all(routed, ep, ep_cross)
        fwd_comm += tp_comm + cp_comm + ep_comm
    if last:
        head = 2.0 * c.vocab_size * h * t_local / tp
        # Logits in fp32 and the cross-entropy's softmax are memory-bound passes over T x V/tp.
        fwd_compute += m.gemm(head, BF16 * c.vocab_size * h / tp) + m.memory(3 * 4 * t_local * c.vocab_size / tp)
    if first:
        fwd_compute += m.memory(BF16 * t_local * h)  # the embedding gather
    forward = fwd_compute + fwd_comm
    # Recomputation: selective reruns the attention, full the whole forward (its TP traffic too).
    redo_compute = {"none": 0.0, "selective": attn_fwd, "full": fwd_compute}[recompute]
    redo_comm = fwd_comm if recompute == "full" else 0.0
    backward_compute = 2.0 * fwd_compute + redo_compute
    return StageWork(forward, backward_compute + fwd_comm + redo_comm, fwd_compute, int(sum(doc_lengths)),
                     backward_compute)


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
        compute = (m.gemm(sum(e.beta * n / sp for n, sp in mine), BF16 * e.params)
                   + m.attention(sum(e.alpha * n * n / sp for n, sp in mine))
                   + m.memory(BF16 * 16 * tokens * e.hidden * e.num_layers)
                   + m.overhead(12 * e.num_layers)) / m.cluster.encoder_efficiency
        comm = sum(4 * e.num_layers * m.all_to_all(BF16 * n / sp * e.hidden * (sp - 1) / sp, sp, sp > gpus_per_node)
                   for n, sp in mine if sp > 1)
        fwd += compute + comm
        bwd += 2.0 * compute + comm if e.trainable else 0.0
    return EncoderWork(fwd, bwd)
