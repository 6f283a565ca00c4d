"""The cluster as the cost model sees it: per-op times from FLOPs and bytes (a roofline with
efficiency factors) and collective times from message sizes and where the group's GPUs sit
(inside a node: NVLink; across nodes: the network). Everything is seconds on one GPU.
``omni.sim.timing`` counts a stage's and an encoder chunk's ops and asks this model their time."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from omni.errors import ConfigError
from omni.sim.config import ClusterConfig

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
