"""The Megatron-LM baselines of `omni simulate`: encoders inside the first pipeline stage's forward
and backward of each micro-batch, TP-split over the stage's TP group, weights under Megatron's
distributed optimizer. The mechanics are checked on ``megatron_naive`` (the workload's layout,
in-order packing, TP communication exposed); the tuned ``megatron`` (its layout searched, packing
largest first, TP communication overlapped) in tests/sim/test_megatron_tuned.py."""
from __future__ import annotations

import dataclasses
import io
import json

import pytest

from omni.sim import megatron
from omni.sim.config import SimConfig
from omni.sim.data import draw_steps
from omni.sim.work import MicroBatchWork
from omni.sim.compare import simulate
from omni.sim.layout_checks import llm_sizes
from omni.sim.one_step import one_step
from omni.sim.spec import model_spec
from omni.sim.machine import Machine
from omni.sim.timing import encoder_work
from recipes.simulate_cmd import load_sim_config, simulate_main

SMALL = ["workload=none", "cluster=h100", "cluster.num_gpus=8", "parallel.pp=2", "parallel.tp=2",
         "data.global_batch_size=32", "data.micro_batch_tokens=1024", "data.sample_tokens=256",
         "data.image_tokens_min=16", "data.image_tokens_max=64", "data.steps=2"]


NAIVE = "megatron_naive"


def _figures(*over: str) -> dict:
    return simulate(load_sim_config([*SMALL, *over]))["placements"]


def _runs(cfg: SimConfig):
    """One step of megatron and of the LLM alone (the LLM side of the disaggregated baseline with
    no encoder GPUs: no encoder work or state anywhere), on the same layout and data."""
    spec = model_spec(cfg.model, cfg.encoders)
    m = Machine(cfg.cluster)
    sizes = llm_sizes(cfg.parallel, cfg.cluster.num_gpus, spec, cfg.data.micro_batch_tokens, cfg.cluster.gpus_per_node)
    step = draw_steps(megatron.data_config(cfg, NAIVE), spec, sizes.dp)[0]
    return (one_step(cfg, spec, m, sizes, NAIVE, step, 0), one_step(cfg, spec, m, sizes, "disaggregated", step, 0),
            spec, m, sizes, step)


def test_encoder_time_lands_on_stage_zero_only():
    p = _figures(f"sim.placements=[{NAIVE}]")[NAIVE]
    first = [r for r in p["per_rank"] if r["stage"] == 0]
    later = [r for r in p["per_rank"] if r["stage"] != 0]
    assert first and later
    assert all(r["encoder_s"] > 0 for r in first) and all(r["encoder_s"] == 0 for r in later)
    busy = lambda r: r["llm_s"] + r["encoder_s"] + r["comm_s"]  # noqa: E731
    assert min(busy(r) for r in first) > max(busy(r) for r in later)


def test_stage_zero_work_is_the_llm_work_plus_its_micro_batch_encoder_passes():
    cfg = load_sim_config(SMALL)
    run, llm, spec, m, sizes, step = _runs(cfg)
    enc = megatron.first_stage_encoder(cfg, spec, m, sizes, NAIVE, [list(g) for g in step.groups])
    checked = 0
    for (g, st, i), w in run.work.items():
        base = llm.work[(g, st, i)]
        if st != 0 or (g, i) not in enc.forward:
            assert w == base
            continue
        f, b = enc.forward[(g, i)], enc.backward[(g, i)]
        assert f.compute_s > 0 and f.comm_s > 0 and b.compute_s > f.compute_s
        assert w.forward_s == pytest.approx(base.forward_s + f.compute_s + f.comm_s)
        assert w.backward_s == pytest.approx(base.backward_s + b.compute_s + b.comm_s)
        assert w.forward_compute_s == pytest.approx(base.forward_compute_s + f.compute_s)
        checked += 1
    assert checked > 0
    # The engine booked the LLM compute alike; the encoder compute is reported apart.
    for a, b in zip(run.timeline.cells, llm.timeline.cells):
        if a.stage != 0:
            assert a.encoder_s == 0
        else:
            assert a.encoder_s == pytest.approx(sum(f.compute_s + enc.backward[k].compute_s
                                                    for k, f in enc.forward.items() if k[0] == a.group))
            # The encoder's weight sync is exposed on stage 0 after the pipeline.
            assert run.tail_comm[(a.group, 0)] > llm.tail_comm[(a.group, 0)]
    assert run.timeline.step_s > llm.timeline.step_s


def test_encoder_compute_per_gpu_scales_as_one_over_tp():
    cfg = load_sim_config([*SMALL, "cluster.op_overhead_us=0"])
    spec = model_spec(cfg.model, cfg.encoders)
    m = Machine(cfg.cluster)
    media = [("image", 48, 48), ("image", 64, 64), ("image", 20, 20)]  # (modality, tokens, rows): no merge
    whole = encoder_work(m, spec, [(mod, n, 1) for mod, n, _ in media], cfg.cluster.gpus_per_node)
    assert megatron.tp_rank_encoder_compute(m, spec, media, 1, 8) == pytest.approx((whole.forward_s, whole.backward_s))
    for tp in (2, 4):
        f, b = megatron.tp_rank_encoder_compute(m, spec, media, tp, 8)
        assert (f, b) == pytest.approx((whole.forward_s / tp, whole.backward_s / tp))
    # A kernel launch costs every TP rank the same: with launch overheads a rank does more than 1/tp.
    with_launch = Machine(load_sim_config(SMALL).cluster)
    one = megatron.tp_rank_encoder_compute(with_launch, spec, media, 1, 8)[0]
    assert megatron.tp_rank_encoder_compute(with_launch, spec, media, 4, 8)[0] > one / 4
    # TP collectives only where there is TP.
    mb = MicroBatchWork([200], media)
    assert megatron.micro_batch_passes(m, spec, mb, 1, 8)[0].comm_s == 0
    assert megatron.micro_batch_passes(m, spec, mb, 2, 8)[0].comm_s > 0


def test_without_images_megatron_takes_the_llm_only_step():
    """No media and no encoders: the same LLM work as stage0 and colocated (all packed in order
    here, so every placement draws the same micro-batches)."""
    places = _figures("encoders=none", "data.image_ratio=0", "data.balance=none",
                      "sim.placements=[megatron_naive,stage0,colocated]", "parallel.reshard_after_forward=false",
                      "parallel.fsdp_reduce_every_microbatch=false")
    t = places["stage0"]["step_time_s"]
    for name in ("megatron_naive", "colocated"):
        assert places[name]["step_time_s"] == pytest.approx(t, rel=1e-12)
        assert places[name]["memory_gib"]["total"] == pytest.approx(places["stage0"]["memory_gib"]["total"])


def test_without_images_the_llm_work_is_stage0s():
    """Encoders present but no image: every stage's work is the LLM's (the encoder only adds
    its weight sync and state on stage 0)."""
    cfg = load_sim_config([*SMALL, "data.image_ratio=0"])
    run, llm, *_ = _runs(cfg)
    assert run.work == llm.work
    assert [c.llm_s for c in run.timeline.cells if c.stage != 0] == [c.llm_s for c in llm.timeline.cells
                                                                     if c.stage != 0]


def test_in_order_packing_is_less_balanced_than_omnis():
    places = _figures("sim.placements=[megatron_naive,stage0]", "sim.search_layouts=[]")
    assert places[NAIVE]["data_balance"] > places["stage0"]["data_balance"]
    assert places[NAIVE]["layout"]["packing"] == "none" and places["stage0"]["layout"]["packing"] == "balanced"


def test_stage_zero_memory_holds_the_encoder():
    cfg = load_sim_config(SMALL)
    run, llm, spec, m, sizes, step = _runs(cfg)
    tp, dp = sizes.tp, sizes.dp * sizes.cp
    params = sum(e.params for e in spec.encoders.values())
    static = megatron.encoder_static_memory(cfg, spec, tp, dp)
    # Distributed optimizer: bf16 weights whole, fp32 gradient buffer whole, fp32 masters and
    # moments sharded over DP; TP splits everything.
    assert static.gathered == pytest.approx(2 * params / tp)
    assert static.grads == pytest.approx(4 * params / tp)
    assert static.params == pytest.approx(4 * params / (tp * dp))
    assert static.optimizer == pytest.approx(cfg.sim.optimizer_bytes_per_param * params / (tp * dp))
    # Megatron's table for bf16 parameters with fp32 gradients: 6 + 12/d bytes per parameter.
    assert static.total * tp / params == pytest.approx(6 + 12 / dp)
    for cell, a, b in zip(run.timeline.cells, run.memory, llm.memory):
        if cell.stage == 0:
            for name in ("params", "grads", "optimizer", "gathered"):
                assert getattr(a, name) == pytest.approx(getattr(b, name) + getattr(static, name))
            assert cell.live_llm_peak > next(c for c in llm.timeline.cells
                                             if (c.group, c.stage) == (cell.group, 0)).live_llm_peak
        else:
            assert dataclasses.astuple(a) == pytest.approx(dataclasses.astuple(b))
    worst_first = max(b.total for c, b in zip(run.timeline.cells, run.memory) if c.stage == 0)
    assert worst_first > max(b.total for c, b in zip(run.timeline.cells, run.memory) if c.stage != 0)


def test_megatron_appears_in_simulate_text_and_json():
    out = io.StringIO()
    assert simulate_main(SMALL, out=out) == 0
    text = out.getvalue()
    assert "vs megatron" in text
    rows = {line.split()[0] for line in text.splitlines() if line.strip()}
    assert {"megatron", NAIVE} <= rows
    out = io.StringIO()
    assert simulate_main(SMALL, out=out, as_json=True) == 0
    places = json.loads(out.getvalue())["placements"]
    assert {"megatron", NAIVE} <= set(places)
    for name in ("megatron", NAIVE):
        assert places[name]["step_time_s"] > 0 and places[name]["fits"]
        assert any(r["encoder_s"] > 0 for r in places[name]["per_rank"])
