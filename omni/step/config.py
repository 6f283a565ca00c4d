"""The ``multiplex`` group (``conf/multiplex/``): how encoder work joins a step. Its values are
checked by the rules that read them (``omni.step.multiplex_rules``); the step's program and the
multiplexer's plan follow from it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MultiplexConfig:
    """Encoder-LLM multiplexing (the ``multiplex`` group; see docs/multiplexing.md)."""

    # colocated: encoders on every rank, each chunk inserted into the LLM pipeline when the
    # first stage needs it (the joint pipeline). stage0: encoders on the first pipeline stage
    # only (Megatron-style). encoder_first: every encoder forward before the LLM pipeline.
    placement: str = "colocated"
    # Ranks that split one long media item (Ulysses over the encoder's heads); 1: never split.
    encoder_sp: int = 1
    # Encoder tokens above which an item is long (split over encoder_sp ranks). "auto": an item
    # whose cost alone exceeds its chunk's balanced share per rank, or whose estimated
    # activations exceed encoder_memory_mib.
    long_threshold: str = "auto"
    # Activation memory (MiB) one rank may spend encoding one item, for long_threshold=auto.
    # "auto": a quarter of the accelerator memory still free once the model is placed (the
    # smallest over ranks); no limit on the CPU. "none": no limit.
    encoder_memory_mib: str = "auto"
    # Encoder and projector weights on the encoder ranks: "replicated" (gradients all-reduced),
    # "sharded" (FSDP2 over all encoder ranks: weights, gradients and optimizer state split,
    # each encoder layer gathered when it runs) or "hybrid" (FSDP2 inside each shard group of
    # encoder_shard_group ranks, replicated across groups: HSDP).
    encoder_weights: str = "hybrid"
    # encoder_weights=hybrid: ranks per FSDP shard group (the weights are sharded inside a group,
    # replicated across groups, gradients reduce-scattered inside then all-reduced across).
    # 0: a node (parallel.gpus_per_node).
    encoder_shard_group: int = 0
    # How encoder inputs and output rows move between the ranks that trade them: "all_to_all"
    # (one collective over every encoder rank per insertion point) or "p2p" (point-to-point
    # sends between the pairs that trade rows only).
    exchange: str = "p2p"
    # Cut groups encoded ahead of the one the pipeline needs, where memory allows (0: off).
    lookahead: int = 0
    # Encoder work in the pipeline's bubbles (colocated, pp > 1): the later pipeline ranks
    # encode some of their data group's items while they wait for their first activation and
    # run the backward after their last action (docs/multiplexing.md, "Bubble calls"). "auto":
    # where it applies and multiplex.exchange=p2p; "true": where it applies (else an error);
    # "false": never.
    fill_bubbles: str = "auto"
    # Encoder chunks run together at one insertion point (colocated, stage0): at cut k (k a
    # multiple of it) the forwards of chunks k .. k + chunks_per_cut - 1, and the backwards that
    # became ready since the last such cut. Each call pays a fixed cost and each insertion point
    # is an exchange the encoder ranks wait for, so fewer of them are faster, at the price of
    # earlier encoder activations. "auto": per step, the largest group (up to one call per step)
    # whose live encoder activations fit encoder_memory_mib (omni.step.multiplex_rules.cut_group_size);
    # a number: that many; 1: one chunk per cut, the least encoder memory.
    chunks_per_cut: str = "auto"
    # Record each rank's encoder / LLM / communication / idle time (metrics.jsonl) on every
    # timeline_every-th step (and trace_step): only those steps pay for it (on a GPU the step's
    # events are waited for at its end, and every rank's times are gathered to the log).
    timeline: bool = True
    timeline_every: int = 10
    # Write a Chrome trace (chrome://tracing, Perfetto) of this step to <run_dir>/trace_step<N>.json; 0: none.
    trace_step: int = 0
