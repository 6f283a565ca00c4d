"""Layout sizing with plain numbers: the degree of every parallel dimension, which rank sits
where, and the checks a layout must pass for a launch and a model. Nothing here needs a process
group, so the simulator (``omni.sim``) and the config checks use it without importing
``torch.distributed``; ``parallel.layout`` builds the groups on top of it.

The world is a 5D grid ``pp x dp_replicate x dp_shard x cp x tp``, TP innermost and PP
outermost (see ``parallel.layout`` for why).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from itertools import product

from parallel.config import ParallelConfig

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
MESH_DIMS = ("pp", "dp_replicate", "dp_shard_cp", "tp")
EXPERT_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_cp_outer", "ep", "tp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
CP_IMPLS = ("ring", "ulysses")
# Ring attention computes each block's scores in chunks of query rows whose fp32 score matrix
# stays under this many bytes (parallel/ring_attention.py); its backward holds about three such
# buffers at once (the probabilities, their gradient, a contiguous copy for the key gradient).
RING_SCORE_BYTES = 128 * 2 ** 20
# The LM head and its cross-entropy run in chunks of targets whose fp32 logits stay under this
# many bytes (parallel/linear_cross_entropy.py).
LOSS_CHUNK_BYTES = 256 * 2 ** 20
CHECKPOINT_MODES = ("none", "selective", "full")
PRECISIONS = ("auto", "bf16", "fp32")
# parallel.reshard_after_forward; a YAML or command-line true/false arrives as a bool, read as "true"/"false".
RESHARD_CHOICES = ("auto", "true", "false")


class LayoutError(ValueError):
    """A parallel configuration that cannot run on this launch or this model."""


@dataclass(frozen=True)
class Sizes:
    """The degree of every dimension (plain numbers: no process group needed)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads different samples."""
        return self.dp_replicate * self.dp_shard

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> its index along every dimension (TP fastest-varying)."""
        out = {}
        for name in reversed(DIMS):
            size = getattr(self, name)
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in DIMS}

    def dp_group(self, rank: int) -> int:
        """The data-parallel index of ``rank``: which DP group's samples it reads (the one home of
        this rule: the data plane, the multiplexer and the simulator all ask here)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def dp_group_rank(self, group: int, **coords: int) -> int:
        """The rank of DP group ``group`` at ``coords`` along the other dimensions (default 0):
        ``dp_group``'s inverse."""
        return self.rank_of(**coords, dp_replicate=group // self.dp_shard, dp_shard=group % self.dp_shard)

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for name in DIMS:
            rank = rank * getattr(self, name) + coords.get(name, 0)
        return rank


def reduces_every_microbatch(cfg: ParallelConfig, pp: int) -> bool:
    """``parallel.fsdp_reduce_every_microbatch`` as the runtime reads it (auto: not under
    pipeline parallelism). The trainer, the pipeline executor, the multiplexer and the
    simulator all ask here."""
    setting = str(cfg.fsdp_reduce_every_microbatch).lower()
    return pp == 1 if setting == "auto" else setting == "true"


def frees_after_backward(last_of_step: bool, reshard_after_forward: bool) -> bool:
    """Whether FSDP units are freed after a backward: weights kept gathered after forward
    (``reshard_after_forward`` false) stay gathered until the step's last backward (one
    all-gather per unit and step); weights resharded after forward are freed after every
    backward too (FSDP2's default). The pipeline executor's LLM chunks, the encoder tower and
    the simulator follow it."""
    return last_of_step or reshard_after_forward


def resolve_sizes(cfg: ParallelConfig, world: int) -> Sizes:
    """The sizes for ``world`` ranks, with every launch-level mistake reported by name."""
    fixed = {"dp_replicate": cfg.dp_replicate, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp, "ep": cfg.ep}
    for name, value in fixed.items():
        if value < 1:
            raise LayoutError(f"parallel.{name}={value} must be >= 1")
    others = cfg.dp_replicate * cfg.tp * cfg.pp * cfg.cp
    if cfg.dp_shard == -1:
        if world % others:
            raise LayoutError(
                f"dp_replicate x tp x pp x cp = {cfg.dp_replicate} x {cfg.tp} x {cfg.pp} x {cfg.cp} = {others} "
                f"does not divide the {world} launched ranks; launch a multiple of {others} ranks or change the sizes"
            )
        dp_shard = world // others
    elif cfg.dp_shard < 1:
        raise LayoutError(f"parallel.dp_shard={cfg.dp_shard} must be >= 1, or -1 to use the remaining ranks")
    else:
        dp_shard = cfg.dp_shard
    sizes = Sizes(pp=cfg.pp, dp_replicate=cfg.dp_replicate, dp_shard=dp_shard, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep)
    if sizes.world != world:
        raise LayoutError(
            f"pp x dp_replicate x dp_shard x cp x tp = {cfg.pp} x {cfg.dp_replicate} x {dp_shard} x {cfg.cp} x "
            f"{cfg.tp} = {sizes.world}, but {world} ranks were launched; make the product equal the world size "
            f"(or set parallel.dp_shard=-1)"
        )
    if (dp_shard * cfg.cp) % cfg.ep:
        raise LayoutError(
            f"parallel.ep={cfg.ep} must divide dp_shard x cp = {dp_shard} x {cfg.cp}: expert parallelism borrows "
            f"those ranks; choose ep from the divisors of {dp_shard * cfg.cp}"
        )
    check_options(cfg)
    _check_nodes(sizes, cfg.gpus_per_node, world)
    return sizes


def check_options(cfg: ParallelConfig) -> None:
    """The rules on the options (not the sizes) of ``cfg``: they need no launch to check."""
    for key, value, allowed in (("pp_schedule", cfg.pp_schedule, PP_SCHEDULES), ("cp_impl", cfg.cp_impl, CP_IMPLS),
                                ("activation_checkpoint", cfg.activation_checkpoint, CHECKPOINT_MODES),
                                ("encoder_activation_checkpoint", cfg.encoder_activation_checkpoint,
                                 CHECKPOINT_MODES),
                                ("mixed_precision", cfg.mixed_precision, PRECISIONS)):
        if value not in allowed:
            raise LayoutError(f"parallel.{key}={value} is not one of {', '.join(allowed)}")
    if cfg.pp_virtual_stages < 1:
        raise LayoutError(f"parallel.pp_virtual_stages={cfg.pp_virtual_stages} must be >= 1")
    if cfg.pp_schedule in ("interleaved_1f1b", "zero_bubble") and cfg.pp > 1 and cfg.pp_virtual_stages < 2:
        raise LayoutError(
            f"parallel.pp_schedule={cfg.pp_schedule} runs several model chunks per pipeline rank; set "
            f"parallel.pp_virtual_stages=2 (or more), or use pp_schedule=1f1b"
        )
    if cfg.pp_schedule in ("gpipe", "1f1b") and cfg.pp_virtual_stages > 1:
        raise LayoutError(
            f"parallel.pp_schedule={cfg.pp_schedule} runs one model chunk per rank but pp_virtual_stages="
            f"{cfg.pp_virtual_stages}; use pp_schedule=interleaved_1f1b or zero_bubble, or pp_virtual_stages=1"
        )
    if cfg.fsdp_blocks_per_unit < 1 or cfg.fsdp_prefetch < 0:
        raise LayoutError("parallel.fsdp_blocks_per_unit must be >= 1 and parallel.fsdp_prefetch >= 0")
    if str(cfg.reshard_after_forward).lower() not in RESHARD_CHOICES:
        raise LayoutError(f"parallel.reshard_after_forward={cfg.reshard_after_forward} is not one of "
                          f"{', '.join(RESHARD_CHOICES)}")
    if cfg.timeout_s <= 0:
        raise LayoutError(f"parallel.timeout_s={cfg.timeout_s} must be > 0 (seconds a collective may wait)")


def _check_nodes(sizes: Sizes, gpus_per_node: int, world: int) -> None:
    """TP talks twice per layer: it must stay inside a node. CP x TP across nodes only warns."""
    if gpus_per_node < 1:
        raise LayoutError(f"parallel.gpus_per_node={gpus_per_node} must be >= 1")
    if world <= gpus_per_node:
        return
    if gpus_per_node % sizes.tp:
        raise LayoutError(
            f"parallel.tp={sizes.tp} does not fit in a node of {gpus_per_node} ranks (parallel.gpus_per_node): "
            f"tensor parallelism across nodes is too slow; choose tp from the divisors of {gpus_per_node}"
        )
    if gpus_per_node % (sizes.tp * sizes.cp):
        print(f"omni: warning: tp x cp = {sizes.tp * sizes.cp} spans nodes of {gpus_per_node} ranks; "
              f"context-parallel traffic will cross the network", file=sys.stderr, flush=True)


def check_model_fits(sizes: Sizes, *, num_heads: int, num_kv_heads: int, num_layers: int, num_experts: int = 0,
                     virtual_stages: int = 1, cp_impl: str = "ring", activation_offload="none", fp8: bool = False,
                     hidden_size: int = 0) -> None:
    """Model-dependent checks, with plain numbers (this package knows no model)."""
    offload_layers(activation_offload, num_layers)
    if fp8 and sizes.tp > 1:
        raise LayoutError(f"parallel.fp8=true with parallel.tp={sizes.tp}: FP8 linear layers are not split by TP "
                          f"here; use parallel.tp=1 (FSDP, PP, CP and EP work with FP8) or parallel.fp8=false")
    if fp8 and hidden_size % 16:
        raise LayoutError(f"parallel.fp8=true needs model.hidden_size a multiple of 16 (FP8 matmuls' alignment); "
                          f"it is {hidden_size}: use parallel.fp8=false")
    if num_heads % sizes.tp or num_kv_heads % sizes.tp:
        raise LayoutError(
            f"parallel.tp={sizes.tp} must divide the attention heads ({num_heads}) and the KV heads "
            f"({num_kv_heads}); choose tp from the common divisors"
        )
    stages = sizes.pp * virtual_stages
    if stages > 1 and num_layers % stages:
        raise LayoutError(
            f"{num_layers} layers cannot be split evenly into pp x pp_virtual_stages = {sizes.pp} x {virtual_stages} "
            f"= {stages} pipeline stages; choose sizes whose product divides {num_layers}"
        )
    if sizes.ep > 1:
        if num_experts == 0:
            raise LayoutError(f"parallel.ep={sizes.ep} needs a mixture-of-experts model (this one is dense); "
                              f"use model=tiny_moe or parallel.ep=1")
        if num_experts % sizes.ep:
            raise LayoutError(f"parallel.ep={sizes.ep} must divide the {num_experts} experts; choose ep from "
                              f"the divisors of {num_experts}")
    if cp_impl == "ulysses" and sizes.cp > 1 and num_heads % (sizes.cp * sizes.tp):
        raise LayoutError(f"parallel.cp_impl=ulysses splits the {num_heads // sizes.tp} heads of a TP rank over "
                          f"cp={sizes.cp} ranks; use cp_impl=ring or a cp that divides them")


def offload_layers(value, num_layers: int) -> set[int] | None:
    """``parallel.activation_offload``: none | all | a list of block indices (global, as in
    checkpoints) -> that set (None: every block; empty: none). LayoutError names a bad entry."""
    listed = not isinstance(value, (str, bool, int)) and value is not None  # a list (YAML's too)
    if value is None or value is False or (not listed and str(value).strip().lower() in ("none", "[]", "")):
        return set()
    if value is True or (not listed and str(value).strip().lower() == "all"):
        return None
    items = list(value) if listed else str(value).strip("[]").split(",")
    if listed and not items:
        return set()
    out = set()
    for item in items:
        try:
            i = int(str(item).strip())
        except ValueError:
            raise LayoutError(f"parallel.activation_offload={value!r}: {item!r} is not a block index; give none, "
                              f"all or a list of indices in 0..{num_layers - 1}") from None
        if not 0 <= i < num_layers:
            raise LayoutError(f"parallel.activation_offload={value!r}: block {i} is not in 0..{num_layers - 1}")
        out.add(i)
    return out


def check_sequence(sizes: Sizes, tokens: int, key: str = "data.micro_batch_tokens") -> None:
    """A row is cut into 2*cp zig-zag chunks and, under TP, into tp sequence shards."""
    unit = 2 * sizes.cp * sizes.tp if sizes.cp > 1 else sizes.tp
    if tokens % unit:
        raise LayoutError(
            f"{key}={tokens} is not divisible by {'2 x cp x tp' if sizes.cp > 1 else 'tp'} = {unit}; context "
            f"parallelism cuts each row into 2*cp chunks (and TP into tp shards): use a multiple of {unit}"
        )


def describe(sizes: Sizes) -> str:
    """e.g. "pp=2 x dp_shard=2 x tp=2 (ep=1)" — the sizes above 1, outermost first."""
    parts = [f"{d}={getattr(sizes, d)}" for d in DIMS if getattr(sizes, d) > 1]
    text = " x ".join(parts) or "single process"
    return text + (f" (ep={sizes.ep})" if sizes.ep > 1 else "")


def all_coords(sizes: Sizes):
    """Every rank's coordinates, in rank order (for tests and docs)."""
    return [dict(zip(DIMS, c)) for c in product(*(range(getattr(sizes, d)) for d in DIMS))]
