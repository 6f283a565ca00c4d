"""The disaggregated baseline's encoder pool: ``sim.encoder_gpus`` GPUs that run only the
encoders, its candidate sizes, its calls, and how it sets the step of synchronous training."""
from __future__ import annotations

import dataclasses

import numpy as np

from omni.errors import ConfigError
from omni.step.multiplex_rules import chunks_per_cut_setting
from omni.sim import memory as mem
from omni.sim import sync
from omni.sim.config import SimConfig
from omni.sim.work import MicroBatchWork
from omni.sim.encoders import plan_chunks
from omni.sim.spec import ModelSpec
from omni.sim.machine import Machine
from parallel.sizing import Sizes


def pool_candidates(cfg: SimConfig) -> list[int]:
    """Encoder-pool sizes for the disaggregated baseline: ``sim.encoder_gpus`` alone, or with
    0 every whole number of LLM model-parallel groups up to half the cluster."""
    p = cfg.parallel
    mp = p.tp * p.pp * p.cp * p.dp_replicate
    world = cfg.cluster.num_gpus
    if not cfg.sim.encoder_gpus:
        sizes = [k * mp for k in range(1, max(1, world // (2 * mp)) + 1) if k * mp < world]
        if not sizes:  # a pool of one group would leave the LLM no GPU
            raise ConfigError(f"disaggregated: tp x pp x cp x dp_replicate = {mp} of cluster.num_gpus={world} leaves "
                              f"no whole model-parallel group for an encoder pool; drop disaggregated from "
                              f"sim.placements or simulate more GPUs")
        return sizes
    e = cfg.sim.encoder_gpus
    if e % mp or not 0 < e < world:
        raise ConfigError(f"sim.encoder_gpus={e} must be a positive multiple of tp x pp x cp x dp_replicate = {mp} "
                          f"below cluster.num_gpus={world}, so the LLM keeps whole model-parallel groups; or drop "
                          f"disaggregated from sim.placements")
    return [e]


def encoder_pool(cfg: SimConfig, spec: ModelSpec, m: Machine, groups: list[list[MicroBatchWork]], e: int,
                 sizes: Sizes) -> dict:
    """The disaggregated encoders: every chunk on the pool's GPUs, forward and backward, as
    ``multiplex.chunks_per_cut`` chunks per call (a pool feeds the LLM's pipeline call by call).

    Training the encoders synchronously, the pool cannot encode the next step while the LLM
    runs this one: that step's forward needs the weights this step's encoder backward updates,
    and that backward needs the LLM's embedding gradients of this step. Within a step the pool
    is one more pipeline stage in front of the LLM's first (as DistTrain orchestrates it): the
    first stage's forward of a micro-batch waits for the call that encodes it, and a call's
    backward for the first stage's backwards of its micro-batches (``first_stage_ready``,
    ``pool_end``). A frozen encoder has no backward: the pool may encode a whole step ahead,
    and only its throughput counts."""
    group_of = [r % sizes.dp for r in range(e)]
    # multiplex.chunks_per_cut=auto chooses groups of the LLM pipeline's cuts; a pool is not in
    # that pipeline and feeds it call by call, so auto means one chunk per call here (its first
    # call is what the LLM's first forward waits for); a number is taken as it is.
    mux = cfg.multiplex
    if chunks_per_cut_setting(mux.chunks_per_cut) is None:
        mux = dataclasses.replace(mux, chunks_per_cut=1)
    # The pool's GPUs are not the LLM's: every group's rows leave the pool's nodes.
    chunks = plan_chunks(m, spec, mux, groups, group_of, None, cfg.cluster.gpus_per_node,
                         sizes.tp * sizes.cp, None, placement="colocated",
                         group_node={g: -1 for g in range(sizes.dp)})
    compute = sum(c.forward_s + c.backward_s for c in chunks)
    grad_sync = sync.encoder_grad_sync(m, cfg, spec, e, cfg.cluster.gpus_per_node)
    trains = any(enc.trainable for enc in spec.encoders.values())
    static = mem.MemoryBreakdown()
    for modality in spec.encoders:
        static += mem.encoder_static_memory(spec, modality, shard=sync.encoder_shard(cfg, e),
                                            optimizer_bytes_per_param=cfg.sim.optimizer_bytes_per_param)
    # A pool call's activations live until the LLM's gradients come back: at worst the step's.
    static.activations = max((sum(c.gpu_activation_bytes[r] for c in chunks) for r in range(e)), default=0.0)
    busy = [sum(c.gpu_forward_s[r] + c.gpu_backward_s[r] for c in chunks) for r in range(e)]
    return {"time_s": compute + grad_sync, "busy_mean_s": float(np.mean(busy)) if busy else 0.0,
            "comm_s": compute - float(np.max(busy) if busy else 0.0) + grad_sync, "memory": static,
            "trains": trains, "grad_sync_s": grad_sync,
            # (micro-batches, forward s, backward s) of each call with items, in order
            "calls": [(list(c.chunks), c.forward_s, c.backward_s) for c in chunks if c.items]}


def first_stage_ready(pool: dict, n_micro: int) -> list[float] | None:
    """When each micro-batch's encoder rows have reached the LLM's first stage (None: a frozen
    pool, which encodes a step ahead). The pool runs every forward before any backward, each
    call as soon as the previous ends: a call's forward needs nothing from the LLM, and its
    backwards have release times (their gradients), so ordering by release time, forwards
    first, is the schedule that both feeds the LLM earliest and ends the pool's step earliest
    (single-machine makespan with release dates: Lawler, Lenstra, Rinnooy Kan and Shmoys,
    "Sequencing and Scheduling", 1993, 1|r_j|Cmax). The most favourable schedule the baseline
    could run, not a handicap."""
    if not pool["trains"]:
        return None
    ready = [0.0] * n_micro
    t = 0.0
    for chunks, forward_s, _ in pool["calls"]:
        t += forward_s
        for j in chunks:
            ready[j] = t
    return ready


def pool_end(pool: dict, backward_end: list[float]) -> float:
    """When the pool's step ends: after its forwards (``first_stage_ready``), each call's
    backward once the pool is free and the LLM's first stage has finished the backwards of the
    call's micro-batches (``backward_end``, ``StepTimeline.first_stage_backward_end``), in the
    order those gradients arrive; then its gradient sync. 0 for a frozen pool."""
    if not pool["trains"] or not pool["calls"]:
        return 0.0
    t = sum(forward_s for _, forward_s, _ in pool["calls"])
    for release, backward_s in sorted((max(backward_end[j] for j in chunks), backward_s)
                                      for chunks, _, backward_s in pool["calls"]):
        t = max(t, release) + backward_s
    return t + pool["grad_sync_s"]


def step_with_pool(llm_step: float, pool: dict, backward_end: list[float]) -> float:
    """The step of a disaggregated run: the LLM's (whose first stage already waited for the
    pool's forwards, ``first_stage_ready``), or the pool's end where its backwards and gradient
    sync outlast it (``pool_end``); never shorter than the pool's work."""
    return max(pool["time_s"], llm_step, pool_end(pool, backward_end))
