"""The simulator's collectives over the groups the runtime really builds (its rank layout,
``parallel.sizing``; the encoder mesh, ``parallel.layout.encoder_mesh``), and hybrid encoder
weights (HSDP: sharded inside shard groups, replicated across them) by the tower's own rules
(``omni.multiplex.media_tower``)."""
from __future__ import annotations

import io
import json

import pytest

from omni.step.multiplex_rules import encoder_gradient_reduction, tower_grads_unsharded
from omni.step.multiplex_rules import encoder_ranks
from omni.sim import sync
from omni.sim.encoders import ChunkTimes
from omni.sim.layout_checks import llm_sizes
from omni.sim.one_step import one_step_for_calibration
from omni.sim.spec import model_spec
from omni.sim.machine import CommGroup, Machine
from omni.sim.timing import BF16, StageWork
from parallel.sizing import Sizes, reduces_every_microbatch
from recipes.simulate_cmd import load_sim_config, simulate_main

FP32 = 4
C = ["workload=C"]
# 8 GPUs in one node, pp 2 x tp 2 x dp_shard 2, the demo model and encoders (image and audio).
SMALL = ["workload=none", "cluster=h100", "cluster.num_gpus=8", "parallel.pp=2", "parallel.tp=2",
         "data.global_batch_size=32", "data.micro_batch_tokens=1024", "data.sample_tokens=256",
         "data.image_tokens_min=16", "data.image_tokens_max=64", "data.steps=1",
         "multiplex.placement=colocated", "multiplex.encoder_weights=replicated", "multiplex.exchange=all_to_all"]
HYBRID_4 = [*SMALL, "multiplex.encoder_weights=hybrid", "multiplex.encoder_shard_group=4"]


def _setup(over: list[str]):
    cfg = load_sim_config(over)
    spec = model_spec(cfg.model, cfg.encoders)
    sizes = llm_sizes(cfg.parallel, cfg.cluster.num_gpus, spec, cfg.data.micro_batch_tokens,
                      cfg.cluster.gpus_per_node)
    return cfg, spec, Machine(cfg.cluster), sizes


def _bare_chunks(k: int, modality: str = "image") -> list[ChunkTimes]:
    """k encoder calls of one modality with no compute to hide the weight collectives behind."""
    return [ChunkTimes(0.0, 0.0, [0.0], [0.0], [0.0], items=1, modalities=[modality]) for _ in range(k)]


# -- 1. groups from the rank layout ----------------------------------------------------------------

def test_llm_fsdp_gather_with_tp8_is_unchanged_one_nic_per_peer():
    """Workload C (256 H100, tp=8): each FSDP group has one member per node, so its gather runs
    on one NIC per GPU, as the one-NIC model charged it."""
    cfg, spec, m, sizes = _setup(C)
    local = 1.1e9  # parameters of a stage on one GPU, before sharding
    for stage in range(sizes.pp):
        shard = sync.llm_shard_group(sizes, 8, stage)
        assert shard == CommGroup(8, 1)
        w = sync.with_fsdp(m, StageWork(0.0, 0.0, 0.0, 0), local, shard,
                           sync.llm_replicate_group(sizes, 8, stage), 10, True, False, False)
        old = m.ring("all_gather", BF16 * local, 8, True)
        assert w.forward_s == pytest.approx(old + old / 10, rel=1e-12)


def test_sharded_vit_gather_over_256_gpus_uses_every_nic_of_the_node():
    """Workload C's sharded ViT-10B: the gather spans all 256 GPUs, 8 per node, so the node's 8
    NICs carry it: ~8x faster than one NIC per GPU at these sizes."""
    cfg, spec, m, sizes = _setup([*C, "multiplex.encoder_weights=sharded"])
    members = encoder_ranks(sizes, "colocated")
    assert sync.encoder_groups(cfg, members, 8) == (CommGroup(256, 8), CommGroup(1, 1))
    params = spec.encoders["image"].params
    chunks = _bare_chunks(1)
    sync.add_encoder_collectives(m, cfg, spec, chunks, [("F", 0), ("B", 0)], len(members), 8, False)
    one_nic = m.ring("all_gather", BF16 * params, 256, True)
    assert chunks[0].forward_s == pytest.approx(m.all_gather(BF16 * params, CommGroup(256, 8)), rel=1e-12)
    assert chunks[0].weights_forward_s == chunks[0].forward_s
    assert 7.5 < one_nic / chunks[0].forward_s < 8.0


def test_pipeline_sends_cross_nodes_by_the_layout():
    """Stage s's rank r sends to rank r + world/pp: with 2 ranks per stage on nodes of 4, the
    send from stage 1 to stage 2 leaves the node (one slow pair sets the exchange's time)."""
    assert sync.stage_sends_cross_nodes(Sizes(pp=4, tp=2), 4) is True
    assert sync.stage_sends_cross_nodes(Sizes(pp=2, tp=2), 4) is False
    assert sync.stage_sends_cross_nodes(Sizes(pp=2, dp_shard=4, tp=2), 8) is True
    # Interleaved: the last pipeline rank sends on to the first.
    assert sync.stage_sends_cross_nodes(Sizes(pp=2, tp=4), 8, virtual=1) is False
    assert sync.stage_sends_cross_nodes(Sizes(pp=2, tp=4), 8, virtual=2) is False


def test_hsdp_reduce_every_microbatch_all_reduces_across_replicas():
    """FSDP2 under HSDP runs both levels in a backward that syncs: the reduce-scatter in the
    shard group and the all-reduce across replicas."""
    m = Machine(load_sim_config(SMALL).cluster)
    shard, replicate = CommGroup(8, 8), CommGroup(4, 1)
    w = sync.with_fsdp(m, StageWork(0.0, 0.0, 0.0, 0), 1e9, shard, replicate, 1, False, False, True)
    rs, ar = m.reduce_scatter(FP32 * 1e9, shard), m.all_reduce(FP32 * 1e9 / 8, replicate)
    assert ar > 0
    assert w.backward_s == pytest.approx(2 * (rs + ar), rel=1e-12)  # one layer: + that layer's reduce


# -- 2. hybrid encoder weights -----------------------------------------------------------------------

@pytest.mark.parametrize("every", ["false", "true"])
def test_hybrid_encoder_memory_is_a_shard_groups_share(every):
    """Weights and optimizer state 1/shard_group of the replicated ones on every encoder GPU;
    gradients too where the tower reduce-scatters between backwards, else whole fp32."""
    over = [f"parallel.fsdp_reduce_every_microbatch={every}"]
    (hyb, _), (rep, _) = (one_step_for_calibration(load_sim_config([*HYBRID_4, *over])),
                          one_step_for_calibration(load_sim_config([*SMALL, *over])))
    cfg, spec, _, _ = _setup([*HYBRID_4, *over])
    assert sync.encoder_shard(cfg, 8) == 4
    params = sum(e.params for e in spec.encoders.values())  # all trainable here
    grads_divisor = 1 if tower_grads_unsharded(False, reduces_every_microbatch(cfg.parallel, 2), "hybrid") else 4
    for h, r in zip(hyb.memory, rep.memory):
        assert r.params - h.params == pytest.approx(params * 4 * (1 - 1 / 4), rel=1e-9)
        assert r.optimizer - h.optimizer == pytest.approx(params * 8 * (1 - 1 / 4), rel=1e-9)
        assert r.grads - h.grads == pytest.approx(params * 4 * (1 - 1 / grads_divisor), rel=1e-9)


def test_hybrid_gathers_inside_the_node_and_all_reduces_once_per_step():
    """Workload C hybrid: shard groups of one node (8 consecutive GPUs), 32 replicas one per node.
    The gather runs on NVLink; a backward before the step's last runs at most the group's
    reduce-scatter (as ``encoder_gradient_reduction`` says), never the cross-group all-reduce,
    which the step's sync charges once: reduce-scatter in the group, then the all-reduce of
    the 1/8 shard across the groups."""
    for every in ("false", "true"):
        cfg, spec, m, sizes = _setup([*C, "multiplex.encoder_weights=hybrid",
                                      f"parallel.fsdp_reduce_every_microbatch={every}"])
        members = encoder_ranks(sizes, "colocated")
        shard, replicate = sync.encoder_groups(cfg, members, 8)
        assert (shard, replicate) == (CommGroup.within_node(8), CommGroup.one_per_node(32))
        params = spec.encoders["image"].params
        chunks = _bare_chunks(3)
        actions = [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
        sync.add_encoder_collectives(m, cfg, spec, chunks, actions, members, 8, False)
        gather = m.all_gather(BF16 * params, CommGroup.within_node(8))
        assert [c.forward_s for c in chunks] == [gather, 0.0, 0.0]  # kept gathered: once per step
        reduce, all_reduce = encoder_gradient_reduction("hybrid", False, every == "true", False)
        assert not all_reduce
        rs = m.reduce_scatter(FP32 * params, shard)
        assert [c.backward_s for c in chunks] == [rs if reduce else 0.0] * 2 + [0.0]
        step_sync = sync.encoder_grad_sync(m, cfg, spec, members, 8)
        assert step_sync == pytest.approx(rs + m.all_reduce(FP32 * params / 8, replicate), rel=1e-12)


def test_hybrid_step_charges_the_encoder_sync_once_at_the_end():
    """Same step, same LLM work: each encoder cell's tail carries its encoder sync once, the
    hybrid one (reduce-scatter in the group, all-reduce across groups) in place of the
    replicated all-reduce."""
    cfg = load_sim_config(HYBRID_4)
    hyb, _ = one_step_for_calibration(cfg)
    rep, _ = one_step_for_calibration(load_sim_config(SMALL))
    spec, m = model_spec(cfg.model, cfg.encoders), Machine(cfg.cluster)
    hyb_sync = sync.encoder_grad_sync(m, cfg, spec, hyb.members, 8, sync.step_modalities(hyb.chunks))
    rep_sync = sync.encoder_grad_sync(m, load_sim_config(SMALL), spec, rep.members, 8)
    shard, replicate = CommGroup.within_node(4), CommGroup.within_node(2)
    params = sum(e.params for e in spec.encoders.values())
    assert sync.step_modalities(hyb.chunks) == sorted(spec.encoders)
    assert hyb_sync == pytest.approx(m.reduce_scatter(FP32 * params, shard)
                                     + m.all_reduce(FP32 * params / 4, replicate), rel=1e-12)
    # FSDP2 issues it layer by layer in the step's last encoder backward: what is exposed.
    last = next(max(c.gpu_backward_s) for c in reversed(hyb.chunks) if c.items)
    layers = max(e.fsdp_units for e in spec.encoders.values())  # siglip's layers: it runs SP
    exposed = sync.exposed_behind_backward(hyb_sync, last, layers)
    assert exposed < hyb_sync
    for cell, comm in hyb.tail_comm.items():
        assert comm - exposed == pytest.approx(rep.tail_comm[cell] - rep_sync, rel=1e-9), cell


def test_hybrid_shard_group_must_divide_the_encoder_ranks():
    cfg = load_sim_config([*SMALL, "multiplex.encoder_weights=hybrid", "multiplex.encoder_shard_group=3"])
    with pytest.raises(ValueError, match="multiplex.encoder_shard_group=3"):
        sync.encoder_shard(cfg, 8)


def test_workload_c_9_to_1_hybrid_runs_and_reports():
    out = io.StringIO()
    over = [*C, "data.image_ratio=0.9", "multiplex.encoder_weights=hybrid", "data.steps=1",
            "sim.placements=[colocated]"]
    assert simulate_main(over, out=out, as_json=True) == 0
    p = json.loads(out.getvalue())["placements"]["colocated"]
    assert p["step_time_s"] > 0 and p["tokens_per_s"] > 0
