"""The tuned Megatron-LM baseline (placement ``megatron``): packing largest first over each rank's
own share (``data.balance=packed``), its layout searched as Megatron-LM users tune it (pp from 1,
tp, virtual stages, a lighter first stage, recomputation), its LLM TP communication under the
GEMMs; and ``megatron_naive``, the default configuration it replaced."""
from __future__ import annotations

import numpy as np
import pytest

from dataloading.plan.balance import arrange, assign_ranks
from omni.sim import megatron
from omni.sim.compare import simulate
from omni.sim.search import megatron_candidates, with_layout
from omni.sim.simulate import simulate_placement
from omni.sim.spec import model_spec
from omni.sim.machine import Machine
from omni.sim.timing import stage_work
from recipes.simulate_cmd import load_sim_config

SMALL = ["workload=none", "cluster=h100", "cluster.num_gpus=8", "parallel.pp=2", "parallel.tp=2",
         "data.global_batch_size=32", "data.micro_batch_tokens=1024", "data.sample_tokens=256",
         "data.image_tokens_min=16", "data.image_tokens_max=64", "data.steps=2"]


def test_packed_ranks_read_consecutive_runs_of_equal_tokens_and_pack_them_largest_first():
    tokens = np.array([6, 5, 4, 5, 9, 1, 2, 8])
    ranks = assign_ranks(np.ones(len(tokens)), tokens, 2, "packed")
    assert ranks == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 20 tokens each, in the plain order
    # Next-fit in order needs three rows of 10 for [6, 5, 4, 5]; largest first needs two.
    naive = arrange(np.ones(4), tokens[:4], 1, budget=10, method="none")
    packed = arrange(np.ones(4), tokens[:4], 1, budget=10, method="packed")
    assert naive.num_micro_batches == 3 and packed.num_micro_batches == 2
    assert sorted(i for mb in packed.ranks[0] for i in mb) == [0, 1, 2, 3]


def test_uneven_first_stage_layers_and_the_options_a_user_tries():
    assert megatron.stage_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert megatron.stage_layers(8, 3, first_stage_layers=2) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    with pytest.raises(ValueError, match="do not split evenly"):
        megatron.stage_layers(8, 3, first_stage_layers=3)
    for layers, pp in ((80, 4), (80, 2), (96, 8), (32, 4)):
        options = megatron.first_stage_options(layers, pp)
        assert options and all(1 <= f < layers // pp and (layers - f) % (pp - 1) == 0 for f in options)
    assert megatron.first_stage_options(80, 1) == []


def test_the_search_space_is_a_megatron_users():
    cfg = load_sim_config(SMALL)
    spec = model_spec(cfg.model, cfg.encoders)
    layouts = megatron_candidates(cfg, spec)
    assert {lay["pp"] for lay in layouts} >= {1, 2} and {lay["cp"] for lay in layouts} >= {1, 2}
    assert {lay["activation_checkpoint"] for lay in layouts} == {"selective", "full"}
    assert any(lay["first_stage_layers"] > 0 for lay in layouts)
    assert any(lay["pp_virtual_stages"] == 2 for lay in layouts)
    assert all(lay["micro_batch_tokens"] == cfg.data.micro_batch_tokens and lay["encoder_sp"] == 1 for lay in layouts)
    assert all(lay["tp"] * lay["pp"] * lay["cp"] * lay["dp_shard"] == cfg.cluster.num_gpus for lay in layouts)


def test_tp_communication_under_the_gemms_shows_less_and_computes_the_same():
    cfg = load_sim_config(SMALL)
    spec = model_spec(cfg.model, cfg.encoders)
    m = Machine(cfg.cluster)
    docs = [512, 512]
    args = (m, spec, range(0, 2), True, False, 1024, docs)
    for tp in (1, 2, 8):
        plain = stage_work(*args, tp, 1, 1, 8, "none")
        overlapped = stage_work(*args, tp, 1, 1, 8, "none", tp_overlap=True)
        assert overlapped.forward_compute_s == plain.forward_compute_s
        if tp == 1:
            assert overlapped == plain
        else:
            exposed, hidden = plain.forward_s - plain.forward_compute_s, overlapped.forward_s - overlapped.forward_compute_s
            assert 0 < hidden < exposed


def test_simulate_searches_megatron_and_reports_each_placements_layout_and_packing():
    cfg = load_sim_config([*SMALL, "sim.placements=[colocated,megatron,megatron_naive]"])
    places = simulate(cfg)["placements"]
    tuned, naive = places["megatron"], places["megatron_naive"]
    assert tuned["layout_search"]["searched"] > 1
    assert tuned["layout"]["packing"] == "packed" and tuned["layout"]["tp_comm_overlap"] is True
    assert naive["layout"]["packing"] == "none" and naive["layout"]["tp_comm_overlap"] is False
    assert places["colocated"]["layout"]["packing"] == "balanced"
    # naive runs the configured layout; the tuned one is never slower (the search includes it)
    assert (naive["layout"]["pp"], naive["layout"]["tp"]) == (2, 2)
    assert tuned["step_time_s"] <= naive["step_time_s"]
    for p in places.values():
        assert 0 <= p["padded_fraction"] < 1
    # the reported layout is the one that ran: simulating it directly gives the same step
    lay = tuned["layout"]
    chosen = {"dp_replicate": lay["dp_replicate"], "dp_shard": lay["dp_shard"], "tp": lay["tp"], "pp": lay["pp"],
              "pp_virtual_stages": lay["pp_virtual_stages"], "pp_schedule": lay["pp_schedule"], "cp": lay["cp"],
              "ep": lay["ep"], "activation_checkpoint": lay["activation_checkpoint"],
              "micro_batch_tokens": cfg.data.micro_batch_tokens, "encoder_sp": 1, "long_threshold": "auto",
              "chunks_per_cut": lay["chunks_per_cut"], "first_stage_layers": lay["first_stage_layers"]}
    spec = model_spec(cfg.model, cfg.encoders)
    again = simulate_placement(with_layout(cfg, chosen), spec, Machine(cfg.cluster), "megatron", {})
    assert again["step_time_s"] == pytest.approx(tuned["step_time_s"], rel=1e-12)


def test_a_bad_search_placement_is_one_line():
    from omni.errors import ConfigError

    with pytest.raises(ConfigError, match="sim.search_layouts: 'megatorn' is not one of"):
        simulate(load_sim_config([*SMALL, "sim.search_layouts=[megatorn]"]))
