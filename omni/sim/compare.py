"""``omni simulate``'s comparison: every placement of ``sim.placements`` on one model, cluster and
mixture, each on the configured layout or, for the placements ``sim.search_layouts`` names, on
the fastest layout that fits as ``omni plan`` finds it (the tuned Megatron baseline by default).

Every placement draws the same samples (one seed) and arranges them its own way; the JSON says
per placement which layout and packing it ran (``layout``) and, for a searched one, how many
layouts the search tried (``layout_search``)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from omni.errors import ConfigError
from omni.sim import megatron
from omni.sim.config import PLACEMENTS, SimConfig
from omni.sim.data import check_data
from omni.sim.layout_checks import check_encoder_sp, disaggregated_split, llm_sizes
from omni.sim.once import Warnings
from omni.sim.search import plan_layouts, with_layout
from omni.sim.simulate import simulate_placement
from omni.sim.spec import describe_model, model_spec
from omni.sim.machine import Machine
from omni.sim.work import StepWork
from omni.sim.workload import describe_workload


def check_placements(cfg: SimConfig) -> None:
    for key, names in (("sim.placements", cfg.sim.placements), ("sim.search_layouts", cfg.sim.search_layouts)):
        for p in names:
            if p not in PLACEMENTS:
                raise ConfigError(f"{key}: {p!r} is not one of {', '.join(PLACEMENTS)}")


def simulate(cfg: SimConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every placement of ``cfg.sim.placements``, as one JSON-able object."""
    spec = model_spec(cfg.model, cfg.encoders, cfg.parallel.encoder_activation_checkpoint)
    machine = Machine(cfg.cluster)
    check_placements(cfg)
    check_data(cfg.data, spec)
    warned = Warnings()  # the layout checks run for every placement and chunk count: their warnings once
    searched = [p for p in cfg.sim.placements if p in cfg.sim.search_layouts]
    for placement in cfg.sim.placements:  # every mistake is reported before anything runs
        if placement in searched:
            continue  # its own layout comes from the search, which checks each
        pool = disaggregated_split(cfg) if placement == "disaggregated" else 0
        parallel = dataclasses.replace(cfg.parallel, dp_shard=-1) if pool else cfg.parallel
        with warned.of(placement):
            sizes = llm_sizes(parallel, cfg.cluster.num_gpus - pool, spec, cfg.data.micro_batch_tokens,
                              cfg.cluster.gpus_per_node)
        if not megatron.is_megatron(placement):  # Megatron runs no encoder SP
            check_encoder_sp(cfg, sizes, placement, pool)
    out: dict[str, Any] = {"model": describe_model(spec), "cluster": dataclasses.asdict(cfg.cluster),
                           "placements": {}}
    cache: dict[tuple[int, str, int], list[StepWork]] = {}
    for placement in cfg.sim.placements:
        run_cfg, search = cfg, None
        if placement in searched:
            if progress:
                progress(f"{placement} (searching its layout)")
            plan = plan_layouts(cfg, placement=placement, top_k=1)
            best = plan["ranked"][0]["layout"]
            run_cfg = with_layout(cfg, best)
            search = {"searched": plan["searched"], "simulated": plan["simulated"],
                      "rejected_counts": plan["rejected_counts"]}
        if progress:
            progress(placement)
        with warned.of(placement):
            # A searched layout has its own data-parallel size: its steps are drawn apart.
            res = simulate_placement(run_cfg, spec, machine, placement, {} if search else cache)
        if search:
            res["layout_search"] = search
        out["placements"][placement] = res
    out["warnings"] = warned.lines("placements")
    out["layout"] = next(iter(out["placements"].values()))["layout"] if out["placements"] else {}
    # Every placement draws the same samples (one seed), arranged its own way: any set describes them.
    out["workload"] = describe_workload(cfg, next(iter(cache.values()), []))
    return out
