"""Per-op times from FLOPs and bytes (a roofline with efficiency factors) and collective times
from message sizes and where the group's GPUs sit (inside a node: NVLink; across nodes: the
network). Everything is seconds on one GPU of the cluster.

The work itself comes from the shared cost model (``ModelSpec.cost``: forward FLOPs, alpha for
the attention pairs and beta for the linear part); this module only turns it into time.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

from omni.errors import ConfigError
from omni.sim.config import ClusterConfig
from omni.sim.spec import ModelSpec

BF16 = 2  # bytes per element of activations and gathered weights

RING_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class CommGroup:
    """The GPUs of one collective as the cost model sees them: ``size`` members, ``per_node`` of
    them in each node the group touches (the same number in every node), so ``size // per_node``
    nodes. Concurrent groups of the same shape (the DP groups of a layout, one per TP rank)
    each own their members' NICs, so one group's time is the time of all of them."""

    size: int
    per_node: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.per_node < 1 or self.size % self.per_node:
            raise ValueError(f"a group of {self.size} GPUs cannot have {self.per_node} in each of its nodes")

    @property
    def nodes(self) -> int:
        return self.size // self.per_node

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1

    @classmethod
    def within_node(cls, size: int) -> "CommGroup":
        return cls(size, size)

    @classmethod
    def one_per_node(cls, size: int) -> "CommGroup":
        return cls(size, 1)

    @classmethod
    def from_ranks(cls, ranks: list[int], gpus_per_node: int) -> "CommGroup":
        """The group of these global ranks, node ``r // gpus_per_node``. Nodes holding unequal
        counts are modelled as the even spread with the most members per node that divides
        every count (fewer NICs and more node crossings than the real one: the slow side)."""
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"ranks of a group must be distinct and at least one: {ranks}")
        counts = Counter(r // gpus_per_node for r in ranks)
        return cls(len(ranks), math.gcd(*counts.values()))

    @classmethod
    def strided(cls, size: int, stride: int, gpus_per_node: int, first: int = 0) -> "CommGroup":
        """Ranks first, first + stride, ...: a parallel dimension whose inner dimensions (those
        that vary faster in the rank order) multiply to ``stride``."""
        return cls.from_ranks(list(range(first, first + size * stride, stride)), gpus_per_node)

    def split_by_node(self) -> tuple["CommGroup", "CommGroup"]:
        """The two levels of a hierarchical collective: the members inside one node, and one
        member from each node (as many such groups as members per node run side by side)."""
        return CommGroup.within_node(self.per_node), CommGroup.one_per_node(self.nodes)


def legacy_group(n: int, crosses_nodes: bool) -> CommGroup:
    """What the callers' (n, crosses_nodes) says about a group, read on the slow side: a group
    that crosses nodes has one member per node (one NIC each); one that does not, all in one."""
    return CommGroup.one_per_node(n) if crosses_nodes else CommGroup.within_node(n)


@dataclass(frozen=True)
class Machine:
    cluster: ClusterConfig

    def __post_init__(self) -> None:
        if int(self.cluster.nics_per_node) < 1:
            raise ConfigError(f"cluster.nics_per_node={self.cluster.nics_per_node} must be at least 1: the NICs one "
                              f"node has (8 on a DGX/HGX H100, one 400 Gb/s NIC per GPU)")

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

    def host_copy(self, bytes_moved: float) -> float:
        """One direction between the GPU and pinned host memory (PCIe)."""
        return bytes_moved / (self.cluster.host_gbps * 1e9)

    def overhead(self, ops: float) -> float:
        return ops * self.cluster.op_overhead_us * 1e-6

    # -- links -----------------------------------------------------------------------------
    def nvlink_bw(self) -> float:
        """Bytes/s one GPU sends into the node's fabric."""
        c = self.cluster
        return c.nvlink_gbps * 1e9 * c.nvlink_efficiency * c.comm_efficiency

    def nic_share_bw(self) -> float:
        """Bytes/s one GPU sends out of its node: its share of the node's NICs."""
        c = self.cluster
        return c.net_gbps * 1e9 * c.nics_per_node / c.gpus_per_node * c.net_efficiency * c.comm_efficiency

    def nvls_bw(self) -> float:
        """Bytes/s one GPU moves each way through the NVSwitch while it reduces (NVLink SHARP):
        below the ring's rate, as NVIDIA's NVLS figures show (see ClusterConfig.nvls)."""
        c = self.cluster
        return c.nvlink_gbps * 1e9 * c.nvls_efficiency * c.comm_efficiency

    def latency(self, crosses_nodes: bool) -> float:
        c = self.cluster
        return (c.net_latency_us if crosses_nodes else c.nvlink_latency_us) * 1e-6

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """(bytes/s, latency s) of one GPU's link."""
        return (self.nic_share_bw() if crosses_nodes else self.nvlink_bw()), self.latency(crosses_nodes)

    def _check(self, group: CommGroup) -> None:
        if group.per_node > self.cluster.gpus_per_node:
            raise ValueError(f"{group.per_node} members per node on a cluster of {self.cluster.gpus_per_node} "
                             f"GPUs per node")

    # -- ring collectives ------------------------------------------------------------------
    def ring_time(self, kind: str, nbytes: float, group: CommGroup) -> float:
        """NCCL's ring over ``group`` for a tensor of ``nbytes`` (the full, unsharded size).

        Every hop of the ring carries (n-1)/n of the tensor per pass (all_reduce: two passes, a
        reduce-scatter then an all-gather). NCCL runs many rings (channels) whose entry and exit
        GPUs rotate over the node, so of each GPU's traffic a share (m-1)/m goes over NVLink and
        1/m leaves the node through that GPU's NIC share: the node's m shares together carry
        every byte that crosses it. Both links run at once; the slower one sets the time. Each
        of the n-1 steps of a pass pays a latency, the net's on the (nodes - 1) steps that cross
        nodes (as NCCL's tuner counts them)."""
        if kind not in RING_KINDS:
            raise ValueError(f"unknown ring collective {kind!r}; one of {RING_KINDS}")
        n, m = group.size, group.per_node
        if n <= 1 or nbytes <= 0:
            return 0.0
        self._check(group)
        passes = 2.0 if kind == "all_reduce" else 1.0
        per_hop = (n - 1) / n * nbytes
        if group.crosses_nodes:
            transfer = max((m - 1) / m * per_hop / self.nvlink_bw(), per_hop / m / self.nic_share_bw())
        else:
            transfer = per_hop / self.nvlink_bw()
        inter_steps = group.nodes - 1
        steps = (n - 1 - inter_steps) * self.latency(False) + inter_steps * self.latency(True)
        return passes * (transfer + steps)

    def tree_all_reduce_time(self, nbytes: float, group: CommGroup) -> float:
        """NCCL's tree all-reduce across nodes: a chain through the m members of each node and a
        double binary tree over the nodes, reducing up and broadcasting down, pipelined. Each
        node sends the whole tensor up and down (2x nbytes over its NIC shares), each chain
        member forwards it both ways over NVLink; latency: the chain's m-1 steps and the tree's
        ceil(log2 nodes) levels, both ways. Inside one node NCCL's tree is the ring's chain:
        use the ring there."""
        if group.size <= 1 or nbytes <= 0:
            return 0.0
        self._check(group)
        if not group.crosses_nodes:
            return self.ring_time("all_reduce", nbytes, group)
        m = group.per_node
        transfer = max(2 * nbytes / (m * self.nic_share_bw()), 2 * nbytes / self.nvlink_bw() if m > 1 else 0.0)
        levels = math.ceil(math.log2(group.nodes))
        return transfer + 2 * ((m - 1) * self.latency(False) + levels * self.latency(True))

    def all_gather(self, nbytes: float, group: CommGroup) -> float:
        return self.ring_time("all_gather", nbytes, group)

    def reduce_scatter(self, nbytes: float, group: CommGroup) -> float:
        return self.ring_time("reduce_scatter", nbytes, group)

    def nvls_all_reduce_time(self, nbytes: float, group: CommGroup) -> float:
        """NCCL's NVLink SHARP all-reduce inside one node: the NVSwitch sums, for each member, its
        1/n slice of every member's tensor and hands it the sum, which the member multicasts back
        through the switch. Each GPU so sends its whole tensor plus its summed slice and receives
        as much: (n+1)/n x nbytes each way (NVIDIA's algbw = link bandwidth x n/(n+1)), plus one
        NCCL NVLS latency. Infinite where there is no NVLS: a group across nodes (NCCL's NVLS
        tree there is not modelled) or a cluster without it."""
        n = group.size
        if n <= 1 or nbytes <= 0:
            return 0.0
        if not self.cluster.nvls or group.crosses_nodes:
            return math.inf
        self._check(group)
        return nbytes * (n + 1) / n / self.nvls_bw() + self.cluster.nvls_latency_us * 1e-6

    def all_reduce(self, nbytes: float, group: CommGroup) -> float:
        """NCCL picks, per size, the fastest of ring, tree (it wins on many nodes at small sizes,
        where the ring's n-1 steps of latency dominate) and, inside a node, NVLS (it wins from
        4-5 GPUs up, where the ring's 2(n-1)/n passes outweigh NVLS's slower (n+1)/n)."""
        return min(self.ring_time("all_reduce", nbytes, group), self.tree_all_reduce_time(nbytes, group),
                   self.nvls_all_reduce_time(nbytes, group))

    def collective(self, kind: str, nbytes: float, group: CommGroup) -> float:
        """all_gather / reduce_scatter / all_reduce of a tensor of ``nbytes`` (full size) over
        ``group``; all_to_all of ``nbytes`` sent by each member to the others."""
        if kind == "all_to_all":
            return self.all_to_all_group(nbytes, group)
        return {"all_gather": self.all_gather, "reduce_scatter": self.reduce_scatter,
                "all_reduce": self.all_reduce}[kind](nbytes, group)

    # -- two-level (hierarchical) reductions -----------------------------------------------
    def two_level_reduce(self, nbytes: float, shard: CommGroup, replicate: CommGroup,
                         gather: bool = False) -> float:
        """HSDP's gradient reduction (FSDP inside ``shard``, replicated over ``replicate``):
        reduce-scatter the tensor in the shard group, then all-reduce each member's 1/shard
        part over its replicate group (the shard-size replicate groups run side by side, each
        on its own members' NICs); ``gather``: all-gather the result back inside the shard
        group (a hierarchical all-reduce). One bucket's phases run one after the other."""
        t = self.reduce_scatter(nbytes, shard) + self.all_reduce(nbytes / shard.size, replicate)
        return t + (self.all_gather(nbytes, shard) if gather else 0.0)

    def hierarchical_all_reduce(self, nbytes: float, group: CommGroup) -> float:
        """An all-reduce over ``group`` done in two levels: inside each node, then across nodes
        on each GPU's own NIC, then gathered back inside the node."""
        inside, across = group.split_by_node()
        return self.two_level_reduce(nbytes, inside, across, gather=True)

    # -- all-to-all and point to point ------------------------------------------------------
    def all_to_all_group(self, bytes_out: float, group: CommGroup) -> float:
        """One member sends ``bytes_out`` spread evenly over the other n - 1 (and receives as
        much). The part bound for the n - m members in other nodes leaves over the member's NIC
        share (every member of the node sends at once, so the node's shares are all busy); the
        part for the m - 1 in its own node goes over NVLink at the same time. One latency: the
        sends to all peers are issued together."""
        n, m = group.size, group.per_node
        if n <= 1 or bytes_out <= 0:
            return 0.0
        self._check(group)
        inside = bytes_out * (m - 1) / (n - 1) / self.nvlink_bw()
        leaving = bytes_out * (n - m) / (n - 1) / self.nic_share_bw()
        return max(inside, leaving) + self.latency(group.crosses_nodes)

    def p2p(self, nbytes: float, crosses_nodes: bool) -> float:
        """One GPU sends ``nbytes`` to one peer (its NIC share when the peer is in another
        node: the other GPUs of a pipeline stage send at the same time over theirs)."""
        if nbytes <= 0:
            return 0.0
        bw, lat = self.link(crosses_nodes)
        return nbytes / bw + lat

    # -- what nccl-tests would print --------------------------------------------------------
    def bus_bandwidth(self, kind: str, nbytes: float, group: CommGroup) -> float:
        """The model's bus bandwidth in GB/s, by nccl-tests' algebra (doc/PERFORMANCE.md):
        algbw = size / time; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for
        all_gather, reduce_scatter and all_to_all. ``nbytes`` is nccl-tests' size column: the
        full tensor (all_gather's output, reduce_scatter's input), all_to_all's per-rank buffer
        (of which (n-1)/n goes to the others)."""
        n = group.size
        if n <= 1 or nbytes <= 0:
            return 0.0
        sent = nbytes * (n - 1) / n if kind == "all_to_all" else nbytes
        algbw = nbytes / self.collective(kind, sent, group)
        factor = 2.0 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
        return algbw * factor / 1e9

    # -- the callers' interface of before (one member per node when the group crosses) ------
    def ring(self, kind: str, nbytes: float, n: int, crosses_nodes: bool) -> float:
        """A ring collective over n GPUs of a tensor of ``nbytes`` (the full, unsharded size),
        the group read by :func:`legacy_group` and the ring only (no tree), as before."""
        return self.ring_time(kind, nbytes, legacy_group(n, crosses_nodes))

    def all_to_all(self, bytes_out: float, n: int, crosses_nodes: bool) -> float:
        """One GPU sends ``bytes_out`` spread over the other n - 1 (and receives as much)."""
        return self.all_to_all_group(bytes_out, legacy_group(n, crosses_nodes))


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
