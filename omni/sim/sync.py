"""What keeping the weights in step costs a simulated step: FSDP's gathers and
reduce-scatters of the backbone (per micro-batch or once per step, as the runtime does them)
and the encoders' gradient synchronisation and weight gathers (replicated or sharded)."""
from __future__ import annotations

from omni.sim.config import SimConfig
from omni.sim.encoders import ChunkTimes
from omni.sim.spec import ModelSpec
from omni.sim.timing import BF16, Machine, StageWork


def with_fsdp(m: Machine, w: StageWork, local: float, shard: int, cross: bool, layers: int, gather: bool,
               reduce: bool) -> StageWork:
    """FSDP per micro-batch: each pass gathers the weights layer by layer behind the compute
    (``gather``; one layer's gather has nothing to hide behind), and backward reduce-scatters
    the gradients (``reduce``)."""
    ag = m.ring("all_gather", BF16 * local, shard, cross) if gather else 0.0
    rs = m.ring("reduce_scatter", 4.0 * local, shard, cross) if reduce else 0.0
    fwd_exposed = max(0.0, ag - w.forward_compute_s) + ag / max(layers, 1)
    bwd_exposed = max(0.0, ag + rs - w.backward_compute_s) + (ag + rs) / max(layers, 1)
    return StageWork(w.forward_s + fwd_exposed, w.backward_s + bwd_exposed, w.forward_compute_s, w.tokens,
                     w.backward_compute_s)


def grad_sync(m: Machine, local: float, shard: int, replicate: int, cross: bool, layers: int,
               last_backward: float) -> float:
    """Reduce once per step during the last backward: what does not hide behind it is exposed
    (at least the last layer's reduce)."""
    t = 0.0
    if shard > 1:
        t += m.ring("reduce_scatter", 4.0 * local, shard, cross)
    if replicate > 1:
        t += m.ring("all_reduce", 4.0 * local / shard, replicate, True)
    if t == 0.0:
        return 0.0
    return max(t - last_backward, t / max(layers, 1))


def encoder_shard(cfg: SimConfig, members: int) -> int:
    return members if cfg.multiplex.encoder_weights == "sharded" else 1


def encoder_local_params(cfg: SimConfig, spec: ModelSpec, members: int) -> float:
    total = sum(e.params for e in spec.encoders.values() if e.trainable)
    return total / max(encoder_shard(cfg, members), 1)


def encoder_grad_sync(m: Machine, cfg: SimConfig, spec: ModelSpec, members: int, gpus_per_node: int) -> float:
    """Replicated encoder weights: one all-reduce of the gradients per step; sharded: one
    reduce-scatter (the runtime's, in the step's last encoder backward). fp32 gradients."""
    params = sum(e.params for e in spec.encoders.values() if e.trainable)
    cross = members > gpus_per_node
    if cfg.multiplex.encoder_weights == "sharded":
        return m.ring("reduce_scatter", 4.0 * params, members, cross)
    return m.ring("all_reduce", 4.0 * params, members, cross)


def add_encoder_gathers(m: Machine, cfg: SimConfig, spec: ModelSpec, chunks: list[ChunkTimes], members: int,
                         gpus_per_node: int, reshard: bool) -> None:
    """Sharded encoder weights are all-gathered (bf16) before they run: once per step in the
    first chunk's forward when they stay gathered (PP, reshard_after_forward=auto), else in
    every chunk's forward and again in its backward. Layer-by-layer prefetch hides a gather
    behind the chunk's compute where the compute is longer."""
    if cfg.multiplex.encoder_weights != "sharded" or not chunks:
        return
    gather = m.ring("all_gather", BF16 * sum(e.params for e in spec.encoders.values()), members,
                    members > gpus_per_node)
    for j, ch in enumerate(chunks):
        if j == 0 or reshard:
            ch.forward_s += max(0.0, gather - max(ch.gpu_forward_s, default=0.0))
        if reshard:
            ch.backward_s += max(0.0, gather - max(ch.gpu_backward_s, default=0.0))
