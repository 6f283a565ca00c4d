"""``omni plan``: search layouts for a model, cluster and mixture and rank them by simulated
throughput, under the GPUs' memory.

The search runs in three rounds so that thousands of layouts cost seconds, not hours:

1. every combination of the knobs (``candidates``) goes through the training layout's own
   checks (heads divisible by TP, layers by the stages, rows by 2 x CP x TP, ...): what fails is
   rejected with the check's own message;
2. the rest are simulated for one step with colocated (or the chosen) placement; a layout
   whose worst GPU exceeds its memory is rejected as out of memory;
3. the fastest few are re-simulated over every configured step, with the encoder SP sizes
   tried on top and ``multiplex.chunks_per_cut`` (and, under ``fill_bubbles=auto``, bubble calls
   or not) chosen for the run as ``omni simulate`` does with ``sim.chunks_per_cut_search`` (the
   fastest that fits); the final ranking is by
   tokens/s.

Every layout that lost says why, compared with the winner: out of memory, a larger pipeline
bubble, more exposed communication, or more compute (recomputation).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from omni.errors import ConfigError
from omni.sim import megatron
from omni.sim.config import SimConfig
from omni.sim.once import Warnings
from omni.sim.layout_checks import check_encoder_sp, llm_sizes
from omni.sim.simulate import simulate_placement
from omni.sim.spec import ModelSpec, model_spec
from omni.sim.machine import Machine
from omni.sim.work import StepWork
from omni.sim.workload import describe_workload
from parallel.sizing import LayoutError

CHECKPOINTS = ("none", "selective", "full")


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidates(cfg: SimConfig, spec: ModelSpec) -> list[dict[str, Any]]:
    """Every combination of the searched knobs (before any check)."""
    world, node = cfg.cluster.num_gpus, cfg.cluster.gpus_per_node
    base = cfg.data.micro_batch_tokens
    tokens = sorted({t for t in (base // 2, base, base * 2) if t >= cfg.data.sample_tokens})
    out = []
    experts = spec.llm.num_experts
    for tp, pp, cp, rep in itertools.product(_divisors(node, node), _divisors(spec.num_layers, 16), (1, 2, 4),
                                             (1, 2)):
        mp = tp * pp * cp * rep
        if world % mp:
            continue
        shard = world // mp
        for v, ckpt, mbt in itertools.product((1, 2) if pp > 1 else (1,), CHECKPOINTS, tokens):
            for ep in (_divisors(shard * cp, experts) if experts else [1]):
                out.append({"dp_replicate": rep, "dp_shard": shard, "tp": tp, "pp": pp, "pp_virtual_stages": v,
                            "pp_schedule": "interleaved_1f1b" if v > 1 else ("1f1b" if pp > 1 else cfg.parallel.pp_schedule),
                            "cp": cp, "ep": ep, "activation_checkpoint": ckpt, "micro_batch_tokens": mbt,
                            "encoder_sp": 1, "long_threshold": "auto",
                            "chunks_per_cut": cfg.multiplex.chunks_per_cut,
                            "fill_bubbles": cfg.multiplex.fill_bubbles})
    return out


def megatron_candidates(cfg: SimConfig, spec: ModelSpec) -> list[dict[str, Any]]:
    """The layouts a Megatron-LM user tries for the ``megatron`` baseline: TP inside a node
    (``--tensor-model-parallel-size``), every pipeline depth that divides the layers, 1 included
    (``--pipeline-model-parallel-size``), two virtual stages per rank (``--num-layers-per-virtual-
    pipeline-stage``), fewer LLM layers on the first stage, which also runs the encoders
    (``--decoder-first-pipeline-num-layers``), selective or full recomputation
    (``--recompute-granularity``), context parallelism 1, 2 or 4 (``--context-parallel-size``;
    the ViT is not split by it: each CP rank encodes the whole micro-batch); data parallel over
    the rest under the distributed optimizer. The sequence length (``micro_batch_tokens``) and
    expert parallelism stay the workload's: they are the data's and the model's."""
    world, node = cfg.cluster.num_gpus, cfg.cluster.gpus_per_node
    par = cfg.parallel
    out = []
    for tp, pp, cp in itertools.product(_divisors(node, node), _divisors(spec.num_layers, 16), (1, 2, 4)):
        mp = tp * pp * cp
        if world % mp:
            continue
        stage_splits = [(1, 0)] + ([(1, f) for f in megatron.first_stage_options(spec.num_layers, pp)] + [(2, 0)]
                                   if pp > 1 else [])
        for (v, first), ckpt in itertools.product(stage_splits, ("selective", "full")):
            out.append({"dp_replicate": 1, "dp_shard": world // mp, "tp": tp, "pp": pp, "pp_virtual_stages": v,
                        "pp_schedule": "interleaved_1f1b" if v > 1 else ("1f1b" if pp > 1 else par.pp_schedule),
                        "cp": cp, "ep": par.ep, "activation_checkpoint": ckpt,
                        "micro_batch_tokens": cfg.data.micro_batch_tokens, "encoder_sp": 1,
                        "long_threshold": "auto", "chunks_per_cut": cfg.multiplex.chunks_per_cut,
                        "fill_bubbles": cfg.multiplex.fill_bubbles, "first_stage_layers": first})
    return out


def with_layout(cfg: SimConfig, layout: dict[str, Any]) -> SimConfig:
    par = dataclasses.replace(cfg.parallel, **{k: layout[k] for k in ("dp_replicate", "dp_shard", "tp", "pp",
                                                                       "pp_virtual_stages", "pp_schedule", "cp", "ep",
                                                                       "activation_checkpoint")})
    mux = dataclasses.replace(cfg.multiplex, encoder_sp=layout["encoder_sp"], long_threshold=layout["long_threshold"],
                              chunks_per_cut=layout["chunks_per_cut"],
                              fill_bubbles=layout.get("fill_bubbles", cfg.multiplex.fill_bubbles))
    data = dataclasses.replace(cfg.data, micro_batch_tokens=layout["micro_batch_tokens"])
    sim = dataclasses.replace(cfg.sim, first_stage_layers=layout.get("first_stage_layers", 0))
    return dataclasses.replace(cfg, parallel=par, multiplex=mux, data=data, sim=sim)


def train_overrides(layout: dict[str, Any]) -> list[str]:
    """The layout as `omni train` overrides."""
    par = [f"parallel.{k}={layout[k]}" for k in ("dp_replicate", "dp_shard", "tp", "pp", "pp_virtual_stages",
                                                  "pp_schedule", "cp", "ep", "activation_checkpoint")]
    return par + [f"multiplex.encoder_sp={layout['encoder_sp']}", f"multiplex.long_threshold={layout['long_threshold']}",
                  f"multiplex.chunks_per_cut={layout['chunks_per_cut']}",
                  f"multiplex.fill_bubbles={layout.get('fill_bubbles', 'auto')}",
                  f"data.micro_batch_tokens={layout['micro_batch_tokens']}"]


def plan_layouts(cfg: SimConfig, placement: str = "colocated", top_k: int | None = None,
                 progress: Callable[[int, int], None] | None = None, first_round: int = 12) -> dict[str, Any]:
    """The layouts of ``placement`` ranked by simulated tokens/s (the module's three rounds);
    the Megatron baselines search the knobs their users tune (``megatron_candidates``)."""
    spec = model_spec(cfg.model, cfg.encoders, cfg.parallel.encoder_activation_checkpoint)
    machine = Machine(cfg.cluster)
    top_k = top_k or cfg.sim.top_k
    rejected: list[dict[str, Any]] = []
    valid = []
    warned = Warnings()  # the layout checks' warnings, said once after the search
    searched_layouts = megatron_candidates(cfg, spec) if megatron.is_megatron(placement) else candidates(cfg, spec)
    for layout in searched_layouts:
        c = with_layout(cfg, layout)
        try:
            with warned.of(_key(layout)):
                llm_sizes(c.parallel, cfg.cluster.num_gpus, spec, layout["micro_batch_tokens"],
                          cfg.cluster.gpus_per_node)
            if layout["pp"] > 1 and layout["pp_virtual_stages"] > 1 and cfg.data.global_batch_size < layout["pp"]:
                raise LayoutError("fewer samples than pipeline stages")
        except (LayoutError, ConfigError) as e:
            rejected.append({"layout": layout, "reason": "invalid", "detail": str(e)})
            continue
        valid.append((layout, c))
    if not valid:
        raise ConfigError(f"no layout of {cfg.cluster.num_gpus} GPUs passes the layout checks for this model; "
                          f"first reason: {rejected[0]['detail'] if rejected else 'none searched'}")
    one_step = dataclasses.replace(cfg.data, steps=1)
    # Round 2 simulates the configured multiplex.chunks_per_cut; round 3 chooses it per layout.
    caches: dict[int, dict[int, list[StepWork]]] = {}  # micro_batch_tokens -> dp -> steps
    scored = []
    for n, (layout, c) in enumerate(valid):
        if progress:
            progress(n, len(valid))
        c1 = dataclasses.replace(c, data=one_step, sim=dataclasses.replace(c.sim, chunks_per_cut_search=False))
        with warned.of(_key(layout)):
            res = simulate_placement(c1, spec, machine, placement, caches.setdefault(layout["micro_batch_tokens"], {}))
        if not res["fits"]:
            m = res["memory_gib"]
            rejected.append({"layout": layout, "reason": "out of memory",
                             "detail": f"{m['total']:.1f} GiB > {res['memory_limit_gib']:.1f} GiB (activations "
                                       f"{m['activations']:.1f}, optimizer {m['optimizer']:.1f})", "result": _brief(res)})
            continue
        scored.append((res["tokens_per_s"], layout, c, res))
    if not scored:
        raise ConfigError(f"every valid layout runs out of memory on {cfg.cluster.num_gpus} x {cfg.cluster.name} "
                          f"({cfg.cluster.hbm_gib} GiB); use more GPUs, a smaller model, or shorter micro-batches")
    scored.sort(key=lambda x: -x[0])
    finalists = []
    seen: set = set()
    full_caches: dict[int, dict[int, list[StepWork]]] = {}
    for _, layout, c, _ in scored[:first_round]:
        for sp in [1] if megatron.is_megatron(placement) else _sp_sizes(spec, cfg.cluster.gpus_per_node):
            lay = {**layout, "encoder_sp": sp}
            if not megatron.is_megatron(placement):  # Megatron runs no encoder SP
                try:
                    with warned.of(_key(layout)):
                        check_encoder_sp(with_layout(cfg, lay), llm_sizes(c.parallel, cfg.cluster.num_gpus, spec,
                                                                          lay["micro_batch_tokens"],
                                                                          cfg.cluster.gpus_per_node), placement)
                except ConfigError:
                    continue
            with warned.of(_key(layout)):
                c3 = with_layout(cfg, lay)
                res = simulate_placement(dataclasses.replace(c3, sim=dataclasses.replace(c3.sim, chunks_per_cut_search=True)), spec,
                                         machine, placement, full_caches.setdefault(lay["micro_batch_tokens"], {}))
            lay["chunks_per_cut"] = res["layout"]["chunks_per_cut"]
            lay["fill_bubbles"] = res["layout"].get("fill_bubbles", lay["fill_bubbles"])
            if sp > 1 and res["long_items"] == 0:
                continue  # nothing to split: the same layout as sp=1
            key = (_key(layout), round(res["step_time_s"], 9))
            if key in seen:
                continue  # no different from a variant already kept (e.g. no media to group)
            seen.add(key)
            if res["fits"]:
                finalists.append((res["tokens_per_s"], lay, res))
    finalists.sort(key=lambda x: -x[0])
    best = finalists[0][2]
    ranked = [{"layout": lay, "overrides": train_overrides(lay), **_brief(res)} for _, lay, res in finalists[:top_k]]
    for _, lay, res in finalists[top_k:]:
        rejected.append({"layout": lay, "reason": _why_slower(res, best), "result": _brief(res)})
    for _, lay, _, res in scored[first_round:]:
        rejected.append({"layout": lay, "reason": _why_slower(res, best), "result": _brief(res)})
    counts: dict[str, int] = {}
    for r in rejected:
        counts[r["reason"]] = counts.get(r["reason"], 0) + 1
    searched = len(valid) + sum(1 for r in rejected if r["reason"] == "invalid")
    return {"placement": placement, "searched": searched,
            "simulated": len(scored) + sum(1 for r in rejected if r["reason"] == "out of memory"),
            "ranked": ranked, "rejected_counts": counts, "rejected": rejected,
            "cluster": dataclasses.asdict(cfg.cluster), "warnings": warned.lines(f"of the {searched} layouts searched"),
            "workload": describe_workload(cfg, next(iter(full_caches[finalists[0][1]["micro_batch_tokens"]].values())))}


def _key(layout: dict[str, Any]) -> tuple:
    """A candidate layout's identity, whatever encoder SP size and chunk grouping it is tried with."""
    return tuple(sorted((k, str(v)) for k, v in layout.items() if k not in ("encoder_sp", "chunks_per_cut",
                                                                            "fill_bubbles")))


def _sp_sizes(spec: ModelSpec, node: int) -> list[int]:
    sizes = [1]
    for sp in (2, 4, 8):
        if sp <= node and any(e.supports_sp and e.heads % sp == 0 for e in spec.encoders.values()):
            sizes.append(sp)
    return sizes


def _brief(res: dict[str, Any]) -> dict[str, Any]:
    return {k: res[k] for k in ("step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "fits", "decomposition_s")} | \
        {"memory_gib": res["memory_gib"]["total"], "comm_share": _share(res, "comm_s")}


def _share(res: dict[str, Any], key: str) -> float:
    ranks = [r for r in res["per_rank"] if isinstance(r["stage"], int)]
    return sum(r[key] for r in ranks) / (len(ranks) * res["step_time_s"]) if ranks and res["step_time_s"] else 0.0


def _why_slower(res: dict[str, Any], best: dict[str, Any]) -> str:
    """The component that grew most against the winner, as a share of the step."""
    d_bubble = res["bubble_fraction"] - best["bubble_fraction"]
    d_comm = _share(res, "comm_s") - _share(best, "comm_s")
    d_compute = _share(res, "llm_s") * res["step_time_s"] / best["step_time_s"] - _share(best, "llm_s")
    reason = max((d_bubble, "slower: pipeline bubbles"), (d_comm, "slower: communication"),
                 (d_compute, "slower: compute (recomputation, padding)"))
    return reason[1]
