"""The simulator's collective-communication model (omni/sim/machine.py): NCCL-like rings whose
node crossings use every NIC the group owns in a node, NCCL's tree for all-reduce across nodes,
NVLink SHARP all-reduce inside a node, two-level (HSDP) reductions, all-to-all over groups that
span nodes, and nccl-tests' bus bandwidth algebra. Times are the model's, from the cluster
presets; nothing here is measured (tests/sim/test_link_calibration.py holds the presets to
published figures)."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import yaml

from omni.errors import ConfigError
from omni.sim.config import ClusterConfig
from omni.sim.machine import CommGroup, Machine

REPO = Path(__file__).resolve().parents[2]
GiB = 2 ** 30
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
H100 = ClusterConfig()  # the defaults are the h100 preset's wiring: 8 GPUs, 8 NICs of 50 GB/s per node
NIC = 50.0 * H100.net_efficiency * H100.comm_efficiency  # GB/s one NIC carries
NVL = 450.0 * H100.nvlink_efficiency * H100.comm_efficiency  # GB/s one GPU's NVLink carries in a ring


def machine(**changes) -> Machine:
    return Machine(dataclasses.replace(H100, **changes))


# -- the group description ------------------------------------------------------------------

def test_group_from_ranks_counts_members_per_node():
    assert CommGroup.from_ranks(list(range(16)), 8) == CommGroup(16, 8)
    assert CommGroup.from_ranks(list(range(0, 256, 8)), 8) == CommGroup(32, 1)  # DP peers when tp=8
    assert CommGroup.from_ranks(list(range(0, 32, 2)), 8) == CommGroup(16, 4)  # tp=2: 4 peers in a node
    assert CommGroup.strided(16, 2, 8) == CommGroup(16, 4)
    assert CommGroup.strided(4, 8, 8, first=3) == CommGroup.one_per_node(4)
    assert CommGroup(256, 8).nodes == 32 and CommGroup(8, 8).crosses_nodes is False


def test_uneven_groups_are_read_on_the_slow_side():
    """3 members in one node and 1 in another: modelled as one per node (one NIC each, every
    hop a node crossing), the even spread that divides both counts."""
    assert CommGroup.from_ranks([0, 1, 2, 8], 8) == CommGroup(4, 1)
    assert CommGroup.from_ranks([0, 1, 2, 3, 8, 9], 8) == CommGroup(6, 2)
    with pytest.raises(ValueError):
        CommGroup(12, 8)
    with pytest.raises(ValueError):
        CommGroup.from_ranks([0, 0], 8)


def test_split_by_node_gives_the_two_levels():
    inside, across = CommGroup(256, 8).split_by_node()
    assert inside == CommGroup.within_node(8) and across == CommGroup.one_per_node(32)


def test_nics_per_node_must_be_positive():
    with pytest.raises(ConfigError, match="cluster.nics_per_node"):
        machine(nics_per_node=0)


def test_presets_give_each_gpu_its_own_nic_where_the_hardware_does():
    """DGX/HGX H100, H200, H800 and DGX A100: one NIC per GPU (400, 400, 400, 200 Gb/s); the L20
    nodes share a 200 Gb/s NIC between two GPUs, which leaves each GPU the 12.5 GB/s it had before."""
    presets = {name: yaml.safe_load((REPO / "conf" / "cluster" / f"{name}.yaml").read_text())
               for name in ("h100", "h200", "h800", "a100", "l20")}
    for name, gbps in (("h100", 50.0), ("h200", 50.0), ("h800", 50.0), ("a100", 25.0)):
        assert presets[name]["nics_per_node"] == presets[name]["gpus_per_node"] == 8
        assert presets[name]["net_gbps"] == gbps
    l20 = presets["l20"]
    assert l20["net_gbps"] * l20["nics_per_node"] / l20["gpus_per_node"] == 12.5


# -- rings ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_a_ring_over_full_nodes_uses_every_nic(kind):
    """256 GPUs, 8 in each of 32 nodes: NCCL's rings leave each node over all 8 NICs, so at
    large sizes the collective is ~8x faster than the one-NIC model (the callers' old
    ``ring(..., crosses_nodes=True)``), and its bus bandwidth is the node's NICs together."""
    m = machine()
    size = 64 * GiB
    one_nic = m.ring(kind, size, 256, True)
    assert one_nic / m.ring_time(kind, size, CommGroup(256, 8)) == pytest.approx(8.0, rel=0.02)
    # What leaves a node is bound by all of its NICs: 8 (or 4) x 50 GB/s x the NICs' efficiency.
    for nics in (8, 4):
        assert machine(nics_per_node=nics).bus_bandwidth(kind, size, CommGroup(256, 8)) == pytest.approx(
            nics * NIC, rel=0.01)


@pytest.mark.parametrize("kind", KINDS)
def test_one_member_per_node_keeps_one_nic(kind):
    """Data-parallel peers when tp=8 fills a node: each ring member sends over its own NIC only
    (rail-optimised), which is the old model exactly, and the bus bandwidth tends to what one
    NIC carries."""
    m = machine()
    g = CommGroup.one_per_node(32)
    for size in (8.0, 1 << 20, GiB):
        assert m.ring_time(kind, size, g) == pytest.approx(m.ring(kind, size, 32, True), rel=1e-12)
    assert m.bus_bandwidth(kind, 64 * GiB, g) == pytest.approx(NIC, rel=0.01)


def test_shared_nics_halve_a_lone_member_s_share():
    """Two GPUs to a NIC (4 NICs, 8 GPUs a node): one member per node gets half a NIC, as the
    other GPU's group sends over the same NIC at the same time."""
    m = machine(nics_per_node=4)
    assert m.bus_bandwidth("all_gather", 64 * GiB, CommGroup.one_per_node(32)) == pytest.approx(NIC / 2, rel=0.01)


@pytest.mark.parametrize("kind", KINDS)
def test_inside_a_node_the_ring_is_the_callers_old_one(kind):
    m = machine()
    for n in (2, 4, 8):
        for size in (8.0, 1 << 20, GiB):
            assert m.ring_time(kind, size, CommGroup.within_node(n)) == pytest.approx(
                m.ring(kind, size, n, False), rel=1e-12)
    # The ring's bus bandwidth at large sizes is NVLink's effective rate (NVLS off for all_reduce).
    assert machine(nvls=False).bus_bandwidth(kind, 64 * GiB, CommGroup.within_node(8)) == pytest.approx(NVL, rel=0.01)


# -- NVLink SHARP ---------------------------------------------------------------------------

def test_nvls_all_reduce_moves_n_plus_1_over_n_of_the_tensor_at_its_own_rate():
    """Inside a node NVLS moves (n+1)/n of the tensor each way per GPU, so its busbw is
    2(n-1)/(n+1) x its link rate: below the ring's at 2-3 GPUs (NCCL keeps the ring there), above
    it from 5 GPUs up, ~1.3x the ring's on 8."""
    m = machine()
    link = 450.0 * H100.nvls_efficiency * H100.comm_efficiency
    for n in (2, 3, 4, 5, 8):
        g = CommGroup.within_node(n)
        nvls = 64 * GiB / m.nvls_all_reduce_time(64 * GiB, g) * 2 * (n - 1) / n / 1e9
        assert nvls == pytest.approx(link * 2 * (n - 1) / (n + 1), rel=0.01)
        assert m.bus_bandwidth("all_reduce", 64 * GiB, g) == pytest.approx(max(nvls, NVL), rel=0.01)
    assert m.bus_bandwidth("all_reduce", 64 * GiB, CommGroup.within_node(8)) / NVL == pytest.approx(1.3, abs=0.02)


def test_nvls_needs_the_flag_and_one_node():
    m = machine()
    assert m.nvls_all_reduce_time(GiB, CommGroup(16, 8)) == math.inf  # NCCL's NVLS tree: not modelled
    assert machine(nvls=False).nvls_all_reduce_time(GiB, CommGroup.within_node(8)) == math.inf
    assert m.nvls_all_reduce_time(GiB, CommGroup.within_node(1)) == 0.0
    off = machine(nvls=False)
    assert off.all_reduce(GiB, CommGroup.within_node(8)) == off.ring_time("all_reduce", GiB, CommGroup.within_node(8))


def test_nvlink_is_the_bound_when_few_gpus_per_node_have_many_nics():
    """A ring's per-GPU NVLink load is (m-1)/m of its traffic: with NICs far faster than NVLink
    (here 8 x 1000 GB/s) the crossing ring runs at m/(m-1) x NVLink's effective rate."""
    m = machine(net_gbps=1000.0)
    assert m.bus_bandwidth("all_gather", 64 * GiB, CommGroup(16, 8)) == pytest.approx(NVL * 8 / 7, rel=0.01)


# -- latency --------------------------------------------------------------------------------

def test_tiny_messages_cost_the_latency_of_every_ring_step():
    """8 bytes: the ring's n-1 steps each pay a latency (the net's on the nodes-1 steps that
    cross nodes), which is all but 1e-4 of the time, so the time grows with the ring's length
    and the bus bandwidth is ~0."""
    m = machine()
    lat_nv, lat_net = H100.nvlink_latency_us * 1e-6, H100.net_latency_us * 1e-6
    for n in (2, 4, 8):
        assert m.all_gather(8.0, CommGroup.within_node(n)) == pytest.approx((n - 1) * lat_nv, rel=1e-4)
    assert m.all_gather(8.0, CommGroup(256, 8)) == pytest.approx((255 - 31) * lat_nv + 31 * lat_net, rel=1e-4)
    assert m.ring_time("all_reduce", 8.0, CommGroup(256, 8)) == pytest.approx(
        2 * ((255 - 31) * lat_nv + 31 * lat_net), rel=1e-4)
    assert m.bus_bandwidth("all_gather", 8.0, CommGroup(256, 8)) < 1e-4


def test_all_reduce_takes_the_tree_across_many_nodes_at_small_sizes_and_the_ring_when_large():
    """Across 32 nodes a tree's latency is 2 x (chain of 7 + log2(32) levels) steps against the
    ring's 2 x 255; at large sizes over 2 nodes the ring moves (n-1)/n of what the tree does."""
    m = machine()
    g = CommGroup(256, 8)
    lat_nv, lat_net = H100.nvlink_latency_us * 1e-6, H100.net_latency_us * 1e-6
    assert m.all_reduce(8.0, g) == pytest.approx(2 * (7 * lat_nv + 5 * lat_net), rel=1e-4)
    assert m.all_reduce(8.0, g) < m.ring_time("all_reduce", 8.0, g) / 10
    two_nodes = CommGroup(16, 8)
    assert m.all_reduce(GiB, two_nodes) == m.ring_time("all_reduce", GiB, two_nodes)
    assert m.ring_time("all_reduce", GiB, two_nodes) < m.tree_all_reduce_time(GiB, two_nodes)
    # Inside a node there is no tree: the ring, or NVLS with its one latency against the ring's 14.
    node = CommGroup.within_node(8)
    assert m.tree_all_reduce_time(8.0, node) == m.ring_time("all_reduce", 8.0, node)
    assert m.all_reduce(8.0, node) == pytest.approx(H100.nvls_latency_us * 1e-6, rel=1e-3)


# -- bus bandwidth --------------------------------------------------------------------------

@pytest.mark.parametrize("group", [CommGroup.within_node(8), CommGroup(16, 8), CommGroup(256, 8)])
def test_bus_bandwidth_is_nccl_tests_algebra(group):
    m = machine()
    n = group.size
    for size in (1 << 20, GiB):
        assert m.bus_bandwidth("all_reduce", size, group) == pytest.approx(
            size / m.all_reduce(size, group) * 2 * (n - 1) / n / 1e9, rel=1e-12)
        for kind in ("all_gather", "reduce_scatter"):
            assert m.bus_bandwidth(kind, size, group) == pytest.approx(
                size / m.collective(kind, size, group) * (n - 1) / n / 1e9, rel=1e-12)
        sent = size * (n - 1) / n  # all_to_all: the per-rank buffer less the rank's own chunk
        assert m.bus_bandwidth("all_to_all", size, group) == pytest.approx(
            size / m.all_to_all_group(sent, group) * (n - 1) / n / 1e9, rel=1e-12)


def test_ring_bus_bandwidth_is_the_same_for_every_ring_collective_at_large_sizes():
    """busbw is built to be comparable across collectives: a ring all-reduce (two passes) and
    an all-gather (one) report the same link speed."""
    m = machine()
    for g in (CommGroup.within_node(8), CommGroup(256, 8)):
        ar = m.ring_time("all_reduce", 64 * GiB, g)
        ag = m.all_gather(64 * GiB, g)
        assert ar == pytest.approx(2 * ag, rel=1e-9)


# -- all-to-all and p2p ---------------------------------------------------------------------

def test_all_to_all_sends_only_the_leaving_share_over_the_nics():
    """Of what a member sends to the n-1 others, (n-m)/(n-1) leaves the node over its NIC share:
    on 2 nodes of 8 the bus bandwidth is 15/8 of a NIC, tending to one NIC on many nodes (the
    rule the nccl-tests maintainers give for alltoall)."""
    m = machine()
    assert m.bus_bandwidth("all_to_all", 64 * GiB, CommGroup(16, 8)) == pytest.approx(NIC * 15 / 8, rel=0.01)
    assert m.bus_bandwidth("all_to_all", 64 * GiB, CommGroup(256, 8)) == pytest.approx(NIC * 255 / 248, rel=0.01)
    # One per node: everything leaves, as the callers' old all_to_all(..., crosses_nodes=True).
    assert m.all_to_all_group(GiB, CommGroup.one_per_node(8)) == pytest.approx(m.all_to_all(GiB, 8, True), rel=1e-12)
    assert m.all_to_all_group(GiB, CommGroup.within_node(8)) == pytest.approx(m.all_to_all(GiB, 8, False), rel=1e-12)


def test_p2p_across_nodes_uses_the_sender_s_nic_share():
    m = machine(nics_per_node=4)
    lat = H100.net_latency_us * 1e-6
    assert m.p2p(GiB, True) == pytest.approx(GiB / (NIC / 2 * 1e9) + lat, rel=1e-12)


def test_comm_efficiency_scales_both_links():
    """The factor --calibrate fits multiplies the per-link efficiencies; the cpu preset sets those
    to 1, so its one measured factor (gloo over loopback) is its whole link efficiency."""
    half = machine(comm_efficiency=0.5)
    assert half.nvlink_bw() == pytest.approx(machine().nvlink_bw() / 2, rel=1e-12)
    assert half.nic_share_bw() == pytest.approx(machine().nic_share_bw() / 2, rel=1e-12)
    assert half.nvls_bw() == pytest.approx(machine().nvls_bw() / 2, rel=1e-12)
    cpu = ClusterConfig(**yaml.safe_load((REPO / "conf" / "cluster" / "cpu.yaml").read_text()))
    assert Machine(cpu).nvlink_bw() == pytest.approx(cpu.nvlink_gbps * 1e9 * cpu.comm_efficiency, rel=1e-12)
    assert cpu.nvls is False


# -- two-level (HSDP) reductions ------------------------------------------------------------

def test_two_level_reduce_is_the_sum_of_its_parts():
    m = machine()
    shard, replicate = CommGroup.within_node(8), CommGroup.one_per_node(32)
    for size in (1 << 20, GiB):
        parts = m.reduce_scatter(size, shard) + m.all_reduce(size / 8, replicate)
        assert m.two_level_reduce(size, shard, replicate) == pytest.approx(parts, rel=1e-12)
        assert m.two_level_reduce(size, shard, replicate, gather=True) == pytest.approx(
            parts + m.all_gather(size, shard), rel=1e-12)
        assert m.hierarchical_all_reduce(size, CommGroup(256, 8)) == pytest.approx(
            parts + m.all_gather(size, shard), rel=1e-12)


def test_two_level_reduce_beats_the_flat_ring_where_latency_weighs_and_pays_its_inner_phase_when_large():
    """HSDP on 32 nodes x 8 (shard inside the node, replicas across): the two-level reduction
    has 7 + 2 x 31 ring steps against the flat 256-ring's 2 x 255, so it wins at gradient-bucket
    sizes. At large sizes the flat ring, leaving each node over all 8 NICs, moves the same bytes
    across nodes as the replicas' all-reduce does; the two-level then costs its intra-node
    reduce-scatter on top (at most)."""
    m = machine()
    flat = CommGroup(256, 8)
    shard, replicate = flat.split_by_node()
    for size in (1 << 20, 16 << 20, 64 << 20):
        assert m.two_level_reduce(size, shard, replicate) < m.ring_time("all_reduce", size, flat)
    big = 8 * GiB
    two_level = m.two_level_reduce(big, shard, replicate)
    flat_ring = m.ring_time("all_reduce", big, flat)
    assert flat_ring < two_level <= flat_ring + m.reduce_scatter(big, shard)


def test_the_callers_old_interface_still_answers():
    m = machine()
    assert m.ring("all_reduce", 0.0, 8, True) == 0.0 and m.ring("all_gather", GiB, 1, True) == 0.0
    assert math.isclose(m.all_to_all(1.0, 1, True), 0.0)
    with pytest.raises(ValueError):
        m.ring("broadcast", GiB, 8, False)
