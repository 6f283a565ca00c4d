"""Parallelism knobs (the ``parallel`` config group). docs/parallelism.md explains each one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ParallelConfig:
    # Sizes of the five LLM dimensions; their product is the world size. dp_shard=-1 takes
    # whatever the others leave (torchrun's WORLD_SIZE / (dp_replicate * tp * pp * cp)).
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # Expert parallelism, borrowed from dp_shard x cp (must divide it): EP ranks hold different
    # experts and exchange tokens; they count as data-parallel ranks for everything else.
    ep: int = 1
    # Pipeline schedule: gpipe | 1f1b | interleaved_1f1b | zero_bubble.
    pp_schedule: str = "1f1b"
    # Model chunks per pipeline rank (virtual stages); interleaved_1f1b and zero_bubble need >= 2.
    pp_virtual_stages: int = 1
    # Context-parallel attention: ring (K/V travel around the ring) | ulysses (all-to-all over heads).
    cp_impl: str = "ring"
    # none | selective (keep matmul outputs, recompute the rest) | full (recompute every block).
    activation_checkpoint: str = "none"
    # Saved activations of these decoder blocks go to pinned host memory in the forward and come
    # back one block ahead of their backward: none | all | a list of block indices ([0, 1, 2]).
    activation_offload: Any = "none"
    # torch.compile the decoder blocks' norms and dense MLPs (attention and MoE routing stay eager;
    # parameter names do not change).
    compile: bool = False
    # The decoder blocks' linear layers in FP8 (torchao float8 training; omni/models/llm/fp8.py):
    # not the embeddings, the LM head, MoE experts or the encoders; tp must be 1.
    fp8: bool = False
    # The same for the encoders' layers (what an encoder call keeps until its backward):
    # none | selective | full.
    encoder_activation_checkpoint: str = "none"
    # FSDP parameter dtype: auto (bf16 params / fp32 reduce on GPU, fp32 on CPU) | bf16 | fp32.
    mixed_precision: str = "auto"
    # Keep sharded parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy).
    cpu_offload: bool = False
    # Communication scheduling (FSDP2). Blocks per FSDP unit: more blocks = fewer, bigger
    # all-gathers / reduce-scatters (a bucket); 1 = one per block.
    fsdp_blocks_per_unit: int = 1
    # Explicit prefetch depth: all-gather the next k units while the current one computes
    # (forward and backward); 0 leaves FSDP2's implicit one-ahead prefetch.
    fsdp_prefetch: int = 1
    # Reduce-scatter gradients after every micro-batch's backward (true: gradients stay sharded,
    # least memory) or only after the step's last one (false: one reduce per step, but each rank
    # holds unsharded gradients meanwhile). auto: true without pipeline parallelism, false with
    # it (a stage runs many backwards per step; one reduction, as Megatron-LM and torch's
    # pipeline schedules do). A YAML or command-line true/false arrives as a bool.
    fsdp_reduce_every_microbatch: str = "auto"
    # Free gathered parameters after forward: auto (yes, except under pipeline parallelism, where
    # each micro-batch would gather them again) | true | false.
    reshard_after_forward: str = "auto"
    # "auto": nccl on GPU, gloo on CPU.
    backend: str = "auto"
    # Seconds a collective waits for its peers before this rank fails (the torch.distributed
    # timeout of every group Omni creates, meshes included): a rank that died or hangs then ends
    # the job instead of holding the others forever. trainer.hang_timeout_s is the watchdog
    # that also catches hangs outside collectives. Keep it above the slowest checkpoint save.
    timeout_s: float = 600.0
    # Ranks per node: TP (and TP x CP where possible) groups must fit inside one.
    gpus_per_node: int = 8
