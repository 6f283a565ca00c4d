"""A placement's figures over its simulated steps: step time, tokens/s, MFU (encoder FLOPs
counted), the shares of waiting, communication and compute, per-rank busy time, the step's
decomposition, the worst GPU's peak memory and whether it fits, and the layout it ran."""
from __future__ import annotations

from typing import Any

import numpy as np

from omni.sim import disaggregated, megatron
from omni.sim import memory as mem
from omni.sim.config import SimConfig
from omni.sim.engine import DECOMPOSITION
from omni.sim.one_step import StepRun
from omni.sim.spec import ModelSpec
from omni.sim.work import StepWork
from parallel.sizing import Sizes


def summarise(cfg: SimConfig, spec: ModelSpec, sizes: Sizes, placement: str, steps: list[StepWork],
              runs: list[StepRun], encoder_pool: int) -> dict[str, Any]:
    cluster = cfg.cluster
    world = cluster.num_gpus
    llm_step = [r.timeline.step_s for r in runs]
    step_s = [disaggregated.step_with_pool(t, r.pool, r.timeline.first_stage_backward_end) if r.pool else t
              for t, r in zip(llm_step, runs)]
    mean_step = float(np.mean(step_s))
    tokens = float(np.mean([s.tokens() for s in steps]))
    flops = float(np.mean([spec.mfu_flops(s.docs(), s.media()) for s in steps]))
    gpus_per_cell = sizes.tp * sizes.cp
    cells = runs[-1].timeline.cells
    per_rank = []
    for k, c in enumerate(cells):
        vals = [r.timeline.cells[k] for r in runs]
        per_rank.append({"group": c.group, "stage": c.stage, "gpus": gpus_per_cell,
                         "llm_s": float(np.mean([x.llm_s for x in vals])),
                         "encoder_s": float(np.mean([x.encoder_s for x in vals])),
                         "comm_s": float(np.mean([x.comm_s for x in vals])),
                         "idle_s": float(np.mean([x.idle_s(t) for x, t in zip(vals, step_s)]))})
    compute = sum((p["llm_s"] + p["encoder_s"]) * gpus_per_cell for p in per_rank)
    gpu_time = mean_step * (world - encoder_pool)
    if encoder_pool:
        pool_busy = float(np.mean([r.pool["busy_mean_s"] for r in runs]))
        per_rank.append({"group": -1, "stage": "encoder pool", "gpus": encoder_pool, "llm_s": 0.0,
                         "encoder_s": pool_busy, "comm_s": float(np.mean([r.pool["comm_s"] for r in runs])),
                         "idle_s": max(0.0, mean_step - pool_busy)})
        compute += pool_busy * encoder_pool
        gpu_time += mean_step * encoder_pool
    busy = [p["llm_s"] + p["encoder_s"] + p["comm_s"] for p in per_rank]
    # The step decomposed (engine.DECOMPOSITION), seconds, mean over the LLM cells and steps.
    decomposition = {term: float(np.mean([np.mean([tl.decomposition(t)[term] for tl in r.timeline.cells])
                                           for r, t in zip(runs, step_s)])) for term in DECOMPOSITION}
    memories = [b for r in runs for b in r.memory] + [r.pool["memory"] for r in runs if r.pool]
    worst = max(memories, key=lambda b: b.total)
    limit = (cluster.hbm_gib - cluster.memory_reserve_gib) * mem.GIB
    # GPU groups over the limit in any simulated step (the worst step need not be the last).
    over = sum(1 for cell in zip(*(r.memory for r in runs)) if max(b.total for b in cell) > limit)
    if any(r.pool and r.pool["memory"].total > limit for r in runs):
        over += encoder_pool
    chunks = [c for r in runs for c in r.chunks]
    layout = {"dp_replicate": sizes.dp_replicate, "dp_shard": sizes.dp_shard, "tp": sizes.tp, "pp": sizes.pp,
              "cp": sizes.cp, "ep": sizes.ep, "pp_virtual_stages": cfg.parallel.pp_virtual_stages,
              "pp_schedule": cfg.parallel.pp_schedule, "micro_batches": max(len(g) for g in steps[-1].groups),
              "max_micro_batches": max(len(g) for s in steps for g in s.groups),
              "encoder_gpus": encoder_pool, "chunks_per_cut": max(r.chunks_per_cut for r in runs),
              "fill_bubbles": str(cfg.multiplex.fill_bubbles).lower(),
              "activation_checkpoint": cfg.parallel.activation_checkpoint,
              "first_stage_layers": cfg.sim.first_stage_layers if megatron.is_megatron(placement) else 0,
              "packing": cfg.data.balance, "tp_comm_overlap": megatron.overlaps_tp_comm(placement)}
    rows = float(np.mean([r.row_tokens for r in runs]))
    return {
        "step_time_s": mean_step,
        "tokens_per_s": tokens / mean_step if mean_step > 0 else 0.0,
        "mfu": flops / (mean_step * world * cluster.peak_tflops * 1e12) if mean_step > 0 else 0.0,
        # Waiting (pipeline bubbles, stragglers at collectives) as a share of all GPU time;
        # exposed communication is reported apart (comm_share).
        "bubble_fraction": sum(p["idle_s"] * p["gpus"] for p in per_rank) / gpu_time if gpu_time > 0 else 0.0,
        "comm_share": sum(p["comm_s"] * p["gpus"] for p in per_rank) / gpu_time if gpu_time > 0 else 0.0,
        "compute_share": compute / gpu_time if gpu_time > 0 else 0.0,
        "busy_s": {"min": float(min(busy)), "mean": float(np.mean(busy)), "max": float(max(busy))},
        "memory_gib": worst.gib(),
        "memory_limit_gib": limit / mem.GIB,
        "fits": worst.total <= limit,
        "ranks_over_memory": over,
        "data_balance": float(np.mean([s.balance for s in steps])),
        # Of the LLM's row tokens (every DP group's micro-batches as run), the share that is padding.
        "padded_fraction": 1.0 - tokens / rows if rows > 0 else 0.0,
        "encoder_balance": float(np.mean([c.balance for c in chunks if c.items])) if any(c.items for c in chunks)
        else 1.0,
        "long_items": int(sum(c.long_items for c in chunks)),
        "bubble_items": float(np.mean([sum(len(b.call.placed) for b in r.bubbles) for r in runs])),
        "decomposition_s": decomposition,
        "image_ratios": [None if s.image_ratio is None else float(s.image_ratio) for s in steps],
        "layout": layout,
        "per_rank": per_rank,
    }
