"""``omni simulate``: the figures of each placement for a model, cluster, layout and mixture.

For every placement, ``cfg.data.steps`` steps are drawn by the data plane's balancer, their
encoder chunks planned by the runtime's planner, and the step run through the event-driven
schedule of ``omni.sim.engine``; the result is per placement: step time, tokens/s, MFU
(encoder FLOPs counted), bubble fraction, per-rank busy time, the worst GPU's peak memory and
whether it fits.

The disaggregated baseline gives ``sim.encoder_gpus`` GPUs (default: the pool size, in whole
LLM model-parallel groups up to half the cluster, that is fastest over the run's simulated
steps: one pool for the whole run) to the encoders alone; the LLM keeps its layout on the rest, with fewer
DP ranks. Trained synchronously, the pool is one more stage in front of the LLM's first: that
stage's forward of a micro-batch waits for the pool's call that encodes it, and each pool
backward for that stage's backwards of its micro-batches; the step waits for the pool's last
backward and gradient sync (``omni.sim.disaggregated``; a frozen encoder may run a step ahead). The Megatron-LM baselines (``megatron``,
``megatron_naive``) are described in ``omni.sim.megatron``. Comparing every placement (each on
its own searched layout where ``sim.search_layouts`` says) is ``omni.sim.compare``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from omni.errors import ConfigError
from omni.sim import disaggregated, megatron
from omni.sim.config import SimConfig
from omni.sim.data import draw_steps
from omni.sim.layout_checks import llm_sizes
from omni.sim.one_step import one_step
from omni.sim.spec import ModelSpec
from omni.sim.summary import summarise
from omni.sim.machine import Machine
from omni.sim.work import StepWork
from omni.step.multiplex_rules import CUT_PLACEMENTS, chunks_per_cut_candidates
from parallel.sizing import LayoutError
from parallel.rows import microbatch_multiple


def simulate_placement(cfg: SimConfig, spec: ModelSpec, m: Machine, placement: str,
                       cache: dict[tuple[int, str, int], list[StepWork]] | None = None) -> dict[str, Any]:
    if placement in CUT_PLACEMENTS and cfg.sim.chunks_per_cut_search and spec.encoders:
        return _chunks_per_cut_for_run(cfg, spec, m, placement, cache)
    if placement != "disaggregated":
        return _simulate_placement(cfg, spec, m, placement, cache, 0)
    cache = {} if cache is None else cache
    tried = {}
    for e in disaggregated.pool_candidates(cfg):
        try:
            tried[e] = _simulate_placement(cfg, spec, m, placement, cache, e)
        except (LayoutError, ConfigError):
            continue  # the LLM's layout does not fit the GPUs left (e.g. too few DP ranks)
    if not tried:
        raise ConfigError(f"disaggregated: no encoder pool of {disaggregated.pool_candidates(cfg)} GPUs leaves a valid LLM layout; "
                          f"set sim.encoder_gpus or drop disaggregated from sim.placements")
    best = _fastest_fitting(tried)
    out = tried[best]
    out["encoder_pool_search"] = {str(e): {"step_time_s": r["step_time_s"], "fits": r["fits"]} for e, r in tried.items()}
    return out


def _fastest_fitting(tried: dict[int, dict[str, Any]]) -> int:
    """The key of the fastest result that fits in memory (of the fastest overall if none does;
    ties: the smallest key), for the choices made for a whole run."""
    fitting = [k for k, r in tried.items() if r["fits"]] or list(tried)
    return min(fitting, key=lambda k: (tried[k]["step_time_s"], k))


def _chunks_per_cut_for_run(cfg: SimConfig, spec: ModelSpec, m: Machine, placement: str,
                            cache: dict[tuple[int, str, int], list[StepWork]] | None) -> dict[str, Any]:
    """``_groups_for_run``; with ``multiplex.fill_bubbles=auto`` under colocated, once with the
    bubble calls and once without, and the faster that fits (bubble calls keep their items'
    activations from the step's start to its cool-down: where memory is tight they may not
    fit, as a researcher would find and turn them off). The JSON's ``fill_bubbles_search``
    holds both."""
    with_bubbles = _groups_for_run(cfg, spec, m, placement, cache)
    if placement != "colocated" or str(cfg.multiplex.fill_bubbles).lower() != "auto" \
            or not with_bubbles.get("bubble_items"):
        return with_bubbles
    off = dataclasses.replace(cfg, multiplex=dataclasses.replace(cfg.multiplex, fill_bubbles="false"))
    without = _groups_for_run(off, spec, m, placement, cache)
    tried = {0: with_bubbles, 1: without}
    out = tried[_fastest_fitting(tried)]
    out["fill_bubbles_search"] = {
        name: {"step_time_s": r["step_time_s"], "fits": r["fits"], "chunks_per_cut": r["layout"]["chunks_per_cut"]}
        for name, r in (("auto", with_bubbles), ("false", without))}
    return out


def _groups_for_run(cfg: SimConfig, spec: ModelSpec, m: Machine, placement: str,
                    cache: dict[tuple[int, str, int], list[StepWork]] | None) -> dict[str, Any]:
    """``placement`` with the multiplex.chunks_per_cut chosen for the whole run, as a researcher
    would fix it in the training config: the fastest candidate whose every simulated step fits
    in memory (the fastest overall if none does). Fewer, larger calls pay the per-call fixed
    cost (a full weight read, the launches, the sharded weights' gathers) fewer times but keep
    more encoder activations alive; the trade is the workload's, so it is measured, not guessed."""
    cache = {} if cache is None else cache

    def run(g: int) -> dict[str, Any]:
        mux = dataclasses.replace(cfg.multiplex, chunks_per_cut=g)
        return _simulate_placement(dataclasses.replace(cfg, multiplex=mux), spec, m, placement, cache, 0)

    first = run(1)
    tried = {1: first}
    for g in chunks_per_cut_candidates(first["layout"]["max_micro_batches"])[1:]:
        tried[g] = run(g)
    best = _fastest_fitting(tried)
    out = tried[best]
    out["chunks_per_cut_search"] = {str(g): {"step_time_s": r["step_time_s"], "fits": r["fits"]}
                                    for g, r in tried.items()}
    return out


def _simulate_placement(cfg: SimConfig, spec: ModelSpec, m: Machine, placement: str,
                        cache: dict[tuple[int, str, int], list[StepWork]] | None, encoder_pool: int) -> dict[str, Any]:
    cluster = cfg.cluster
    world = cluster.num_gpus
    parallel = dataclasses.replace(cfg.parallel, dp_shard=-1) if encoder_pool else cfg.parallel
    sizes = llm_sizes(parallel, world - encoder_pool, spec, cfg.data.micro_batch_tokens, cluster.gpus_per_node)
    cache = {} if cache is None else cache
    cfg = megatron.run_config(cfg, placement)
    data = cfg.data
    key = (sizes.dp, data.balance, microbatch_multiple(sizes.pp))
    if key not in cache:
        cache[key] = draw_steps(data, spec, sizes.dp, microbatch_multiple(sizes.pp))
    steps = cache[key]
    runs = [one_step(cfg, spec, m, sizes, placement, step, encoder_pool) for step in steps]
    return summarise(cfg, spec, sizes, placement, steps, runs, encoder_pool)
