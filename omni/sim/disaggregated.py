"""The disaggregated baseline's encoder pool: ``sim.encoder_gpus`` GPUs that run only the
encoders, its candidate sizes, its calls, and how it sets the step of synchronous training."""
from __future__ import annotations

import dataclasses

import numpy as np

from omni.errors import ConfigError
from omni.multiplex.rules import chunks_per_cut_setting
from omni.sim import memory as mem
from omni.sim import sync
from omni.sim.config import SimConfig
from omni.sim.data import MicroBatchWork
from omni.sim.encoders import plan_chunks
from omni.sim.spec import ModelSpec
from omni.sim.timing import Machine
from parallel.sizing import Sizes


def pool_candidates(cfg: SimConfig) -> list[int]:
    """Encoder-pool sizes for the disaggregated baseline: ``sim.encoder_gpus`` alone, or with
    0 every whole number of LLM model-parallel groups up to half the cluster."""
    p = cfg.parallel
    mp = p.tp * p.pp * p.cp * p.dp_replicate
    world = cfg.cluster.num_gpus
    if not cfg.sim.encoder_gpus:
        return [k * mp for k in range(1, max(1, world // (2 * mp)) + 1) if k * mp < world] or [mp]
    e = cfg.sim.encoder_gpus
    if e % mp or not 0 < e < world:
        raise ConfigError(f"sim.encoder_gpus={e} must be a positive multiple of tp x pp x cp x dp_replicate = {mp} "
                          f"below cluster.num_gpus={world}, so the LLM keeps whole model-parallel groups; or drop "
                          f"disaggregated from sim.placements")
    return [e]


def encoder_pool(cfg: SimConfig, spec: ModelSpec, m: Machine, groups: list[list[MicroBatchWork]], e: int,
                 sizes: Sizes) -> dict[str, float]:
    """The disaggregated encoders: every chunk on the pool's GPUs, forward and backward, as
    ``multiplex.chunks_per_cut`` chunks per call (a pool feeds the LLM's pipeline call by call).

    Training the encoders synchronously, the pool cannot encode the next step while the LLM
    runs this one: that step's forward needs the weights this step's encoder backward updates,
    and that backward needs the LLM's embedding gradients of this step. So within a step the
    LLM's first forward waits for the pool's first call (``fill_s``) and the pool's last
    backward, after the LLM's last, plus its gradient sync (``drain_s``) ends the step unless
    the LLM's own sync and optimizer take longer; in between, the pool's calls overlap the
    LLM's work. A frozen encoder has no backward: the pool may encode a whole step ahead, and
    only its throughput counts."""
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
    calls = [c for c in chunks if c.items]
    fill = calls[0].forward_s if calls and trains else 0.0
    drain = calls[-1].backward_s + grad_sync if calls and trains else 0.0
    static = mem.MemoryBreakdown()
    for modality in spec.encoders:
        static += mem.encoder_static_memory(spec, modality, shard=sync.encoder_shard(cfg, e),
                                            optimizer_bytes_per_param=cfg.sim.optimizer_bytes_per_param)
    # A pool call's activations live until the LLM's gradients come back: at worst the step's.
    static.activations = max((sum(c.gpu_activation_bytes[r] for c in chunks) for r in range(e)), default=0.0)
    busy = [sum(c.gpu_forward_s[r] + c.gpu_backward_s[r] for c in chunks) for r in range(e)]
    return {"time_s": compute + grad_sync, "busy_mean_s": float(np.mean(busy)) if busy else 0.0,
            "comm_s": compute - float(np.max(busy) if busy else 0.0) + grad_sync, "memory": static,
            "fill_s": fill, "drain_s": drain}


def step_with_pool(llm_step: float, pool: dict[str, float], tail_comm: dict, tail: dict) -> float:
    """The step of a disaggregated run: the LLM's, plus the pool's fill and what of its drain
    outlasts the LLM's own tail (its exposed gradient sync ``tail_comm`` and optimizer ``tail``
    per cell; ``encoder_pool``), and never shorter than the pool's work."""
    tail = max((tail_comm.get(c, 0.0) + tail.get(c, 0.0) for c in tail_comm), default=0.0)
    return max(pool["time_s"], llm_step + pool["fill_s"] + max(0.0, pool["drain_s"] - tail))
