"""Multiplexing's rules as pure functions of plain numbers: which ranks encode, which encoder
actions each insertion point runs, how many chunks one call encodes, how the encoder weights
are grouped and when their gradients are reduced and their weights freed. The runtime
(``omni.multiplex.runtime``, ``omni.multiplex.media_tower``), the config checks and the
simulator (``omni.sim``) all call these; nothing here needs torch or a process group.
"""
from __future__ import annotations

from collections.abc import Callable

from parallel.sizing import LayoutError, Sizes, frees_after_backward

PLACEMENTS = ("colocated", "stage0", "encoder_first")
# The placements whose encoder calls sit at the pipeline's cuts (multiplex.chunks_per_cut applies).
CUT_PLACEMENTS = ("colocated", "stage0")
WEIGHT_MODES = ("replicated", "sharded", "hybrid")


def check_shard_group_setting(weights: str, setting: int) -> None:
    """``multiplex.encoder_shard_group`` on its own (no launch needed): >= 0, and set only for
    hybrid weights (elsewhere it would be silently ignored)."""
    if setting < 0:
        raise LayoutError(f"multiplex.encoder_shard_group={setting} must be >= 0 (0: one node, "
                          f"parallel.gpus_per_node)")
    if setting and weights != "hybrid":
        raise LayoutError(f"multiplex.encoder_shard_group={setting} only applies to multiplex.encoder_weights=hybrid "
                          f"(here {weights}); set encoder_weights=hybrid or encoder_shard_group=0")


def encoder_shard_group(weights: str, setting: int, gpus_per_node: int, members: int) -> int:
    """Ranks per FSDP shard group of the encoder weights among the ``members`` encoder ranks
    (consecutive ranks form a group; ``members`` divided by it is the number of replicas):
    1 for replicated weights, every member for sharded ones, for hybrid
    ``multiplex.encoder_shard_group`` (0: a node, ``parallel.gpus_per_node``, or all members
    where they fit in one)."""
    check_shard_group_setting(weights, setting)
    if weights != "hybrid":
        return members if weights == "sharded" else 1
    size = setting or min(gpus_per_node, members)
    if members % size:
        key = f"multiplex.encoder_shard_group={setting}" if setting else \
            f"parallel.gpus_per_node={gpus_per_node} (the default multiplex.encoder_shard_group)"
        raise LayoutError(f"{key} does not divide the {members} encoder ranks of multiplex.encoder_weights=hybrid; "
                          f"set multiplex.encoder_shard_group to a divisor of {members}")
    return size


def encoder_gradient_reduction(weights: str, last_of_step: bool, reduce_every_chunk: bool,
                               reshard_after_forward: bool) -> tuple[bool, bool]:
    """Sharded or hybrid encoder weights, before one chunk's backward through a modality:
    (reduce-scatter its gradients in this backward, all-reduce them across the shard groups in
    it). ``sharded``: both in the step's last backward, or in every one if the weights are
    resharded after each forward and ``reduce_every_chunk`` (``parallel.fsdp_reduce_every_
    microbatch``). ``hybrid``: the reduce-scatter (inside a group: a node by default, cheap) in
    every backward, whatever ``reduce_every_chunk`` says, so no full-size fp32 gradient lives
    between backwards; the all-reduce (across groups) in the last only. Each shard accumulates
    the group's sum until the step's last backward adds the other groups'."""
    if weights == "hybrid":
        return True, last_of_step
    reduce = last_of_step or (reduce_every_chunk and reshard_after_forward)
    return reduce, reduce


def chunks_per_call(placement: str, n: int, chunks_per_cut: int) -> int:
    """Chunks per encoder call (a cut group): the step's ``cut_group_size`` where the calls are
    inserted into the pipeline; encoder_first has one insertion point, before it, so one call
    for the whole step (its activations live until after the pipeline either way). The
    simulator groups its chunks by the same rule."""
    return max(n, 1) if placement == "encoder_first" else chunks_per_cut


def chunks_per_cut_setting(setting) -> int | None:
    """``multiplex.chunks_per_cut`` read: a count >= 1, or None for "auto" (``cut_group_size``
    chooses per step). The config checks, the runtime and the simulator read it this way."""
    text = str(setting).strip().lower()
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise LayoutError(f"multiplex.chunks_per_cut={setting!r} must be auto or a count >= 1")
    return int(text)


def chunks_per_cut_candidates(micro_batches: int) -> list[int]:
    """The cut-group sizes worth telling apart for a step of ``micro_batches`` chunks: 1, 2, 4,
    ... below it, and the count itself (one call per step). ``cut_group_size`` (auto) and the
    simulator's search (``sim.chunks_per_cut_search``) both choose among these."""
    out, g = [], 1
    while g < micro_batches:
        out.append(g)
        g *= 2
    return out + [max(micro_batches, 1)]


def peak_live_encoder_bytes(placement: str, n: int, backward_cuts: list[int | None], group: int, lookahead: int,
                            chunk_bytes: list[float]) -> float:
    """The most encoder activation bytes alive at once over a step run in ``encoder_segments``'
    order with cut groups of ``group`` chunks: a chunk's bytes live from its forward to its
    backward (``chunk_bytes[j]``: what autograd keeps for chunk j's items, over all ranks)."""
    segments = encoder_segments(placement, n, backward_cuts, group, lookahead)
    live = peak = 0.0
    for k in sorted(segments):
        for kind, j in segments[k]:
            live += chunk_bytes[j] if kind == "F" else -chunk_bytes[j]
            peak = max(peak, live)
    return peak


def cut_group_size(setting, placement: str, n: int, backward_cuts: list[int | None], lookahead: int,
                   chunk_bytes: Callable[[], list[float]] | None, members: int, budget: float | None) -> int:
    """The chunks per encoder call for one step of ``n`` chunks (``multiplex.chunks_per_cut``).
    A number: itself. auto: the largest of ``chunks_per_cut_candidates(n)`` whose live encoder
    activations, spread over the ``members`` encoder ranks, stay within ``budget`` bytes per
    rank (``multiplex.encoder_memory_mib``) at every moment of the step; with no budget (the
    CPU) or no byte estimate, n: one call per step. Each call pays a fixed cost (a full weight
    read, the weight gathers, the launches, an exchange everyone waits for), so fewer calls are
    faster until their activations do not fit: what ``omni simulate``'s search finds on
    workloads A-D and the 8-rank CPU benchmark measures (docs/multiplexing.md). 1 is always
    kept as the last resort. ``chunk_bytes()``: each chunk's activation bytes over all ranks,
    computed only when auto has a budget to check."""
    fixed = chunks_per_cut_setting(setting)
    if fixed is not None:
        return fixed
    candidates = chunks_per_cut_candidates(n)
    if budget is None or chunk_bytes is None:
        return candidates[-1]
    per_chunk = chunk_bytes()
    for g in reversed(candidates):
        peak = peak_live_encoder_bytes(placement, n, backward_cuts, g, lookahead, per_chunk)
        if peak / max(members, 1) <= budget:
            return g
    return 1


BEFORE_PIPELINE = -1  # the insertion point of encoder_first's forwards


def encoder_segments(placement: str, n: int, backward_cuts: list[int | None], group: int = 1,
                     lookahead: int = 0) -> dict[int, list[tuple[str, int]]]:
    """The encoder chunks' forwards and backwards of a step, in the order every encoder rank
    runs them, by insertion point: cut k (k a multiple of ``group``, multiplex.chunks_per_cut),
    ``BEFORE_PIPELINE`` (encoder_first) and n (after the pipeline). The runtime's
    ``Multiplexer`` and the simulator (``omni.sim.engine``) both run these lists.

    ("F", j) for a group of ``group`` chunks at the group's first cut (the runtime encodes the
    group in one call), ``lookahead`` (multiplex.lookahead) groups early: the first cut runs
    groups 0 .. lookahead. ("B", j) for the whole group, together, at the first group cut at or
    after the last ``backward_cuts[j]`` of the group (where stage 0 has finished micro-batch
    j's backward; None: after the pipeline): one call's graph has one backward, which needs
    every chunk's gradient. encoder_first: every forward before the pipeline, every backward
    after it."""
    if placement == "encoder_first":
        return {BEFORE_PIPELINE: [("F", j) for j in range(n)], n: [("B", j) for j in range(n)]}
    ready = []
    for k in range(0, n, group):
        cuts = backward_cuts[k:k + group]
        last = None if any(r is None for r in cuts) else max(cuts)
        ready += [None if last is None else -(-last // group) * group] * len(cuts)
    segments: dict[int, list[tuple[str, int]]] = {}
    forwarded = 0  # chunks whose forward is already placed
    for k in range(0, n, group):
        upto = min((k // group + lookahead) * group + group, n)
        segments[k] = [("B", j) for j in range(n) if ready[j] == k] + [("F", i) for i in range(forwarded, upto)]
        forwarded = max(forwarded, upto)
    segments[n] = [("B", j) for j in range(n) if ready[j] is None or ready[j] >= n]
    return segments


def forward_insertion_points(placement: str, n: int, backward_cuts: list[int | None], group: int = 1,
                             lookahead: int = 0) -> list[int]:
    """The insertion point where each cut group's forward runs (``encoder_segments``;
    ``BEFORE_PIPELINE`` counts as the first)."""
    segments = encoder_segments(placement, n, backward_cuts, group, lookahead)
    size = max(n, 1) if placement == "encoder_first" else group
    at: dict[int, int] = {}
    for k in sorted(segments):
        for kind, j in segments[k]:
            if kind == "F":
                at.setdefault(j // size, max(k, 0))
    return [at.get(c, 0) for c in range(-(-n // size))]


def chunks_backward_after_pipeline(placement: str, n: int, backward_cuts: list[int | None], group: int = 1,
                                   lookahead: int = 0) -> list[int]:
    """The chunks whose call runs its backward after the pipeline (``encoder_segments``' last
    insertion point), on every encoder rank."""
    segments = encoder_segments(placement, n, backward_cuts, group, lookahead)
    return sorted({j for kind, j in segments.get(n, []) if kind == "B"})


def encoder_actions(placement: str, n: int, backward_cuts: list[int | None], group: int = 1,
                    lookahead: int = 0) -> list[tuple[str, int]]:
    """``encoder_segments`` flattened in the order they run."""
    segments = encoder_segments(placement, n, backward_cuts, group, lookahead)
    return [a for k in sorted(segments) for a in segments[k]]


def step_fills_bubbles(cfg, sizes: Sizes, gpus_per_node: int) -> bool:
    """``fills_bubbles`` of a multiplex config (``omni.runtime.config.MultiplexConfig``) on the
    LLM layout ``sizes``: the one answer the step's programs (their tail cuts), the runtime and
    the simulator share."""
    members = len(encoder_ranks(sizes, cfg.placement))
    shard = encoder_shard_group(cfg.encoder_weights, int(cfg.encoder_shard_group), gpus_per_node, members)
    return fills_bubbles(cfg.fill_bubbles, cfg.placement, sizes, cfg.encoder_weights, shard, cfg.exchange)


def check_multiplex_layout(cfg, sizes: Sizes, gpus_per_node: int, pp_schedule: str, encoder_gpus: int = 0) -> None:
    """Every rule of a ``multiplex`` config (``omni.step.config.MultiplexConfig``) on an LLM layout,
    in one place: the runtime's ``Multiplexer`` runs it at start-up, ``recipes.checks`` before
    anything starts, the simulator for each layout it costs. ``encoder_gpus``: the GPUs that
    encode when they are not the layout's own (the simulator's disaggregated pool); raises
    ``LayoutError`` naming the key and the fix."""
    from parallel.pipeline_schedule import EXECUTOR_SCHEDULES
    from parallel.reshard import EXCHANGE_MODES

    if cfg.placement not in PLACEMENTS:
        raise LayoutError(f"multiplex.placement={cfg.placement!r} is not one of {', '.join(PLACEMENTS)}")
    if cfg.exchange not in EXCHANGE_MODES:
        raise LayoutError(f"multiplex.exchange={cfg.exchange!r} is not one of {', '.join(EXCHANGE_MODES)}")
    if cfg.placement != "encoder_first" and sizes.pp > 1 and pp_schedule not in EXECUTOR_SCHEDULES:
        raise LayoutError(
            f"multiplex.placement={cfg.placement} inserts encoder work into the {'/'.join(EXECUTOR_SCHEDULES)} "
            f"pipeline schedules, not {pp_schedule}: set parallel.pp_schedule=1f1b or "
            f"multiplex.placement=encoder_first")
    try:
        chunks_per_cut_setting(cfg.chunks_per_cut)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None
    if isinstance(cfg.lookahead, bool) or not isinstance(cfg.lookahead, int) or cfg.lookahead < 0:
        raise LayoutError(f"multiplex.lookahead={cfg.lookahead} must be a whole number of cut groups >= 0 (0: off)")
    members = encoder_gpus or len(encoder_ranks(sizes, cfg.placement))
    sp = int(cfg.encoder_sp)
    if sp < 1 or members % sp:
        raise LayoutError(f"multiplex.encoder_sp={sp} must divide the {members} encoder ranks (the GPUs that run "
                          f"encoders under placement {cfg.placement}); choose a divisor of {members}")
    if sp > max(1, gpus_per_node):
        raise LayoutError(f"multiplex.encoder_sp={sp} must fit in a node (parallel.gpus_per_node={gpus_per_node}): "
                          f"an SP block's all-to-alls run every encoder layer")
    own = sizes.tp * sizes.cp
    if cfg.placement == "stage0" and own % sp:
        raise LayoutError(f"multiplex.encoder_sp={sp}: under placement stage0 a DP group's items stay on its "
                          f"{own} first-stage GPUs (tp x cp), so an SP block cannot span more; use encoder_sp "
                          f"dividing {own}")
    if not encoder_gpus:
        step_fills_bubbles(cfg, sizes, gpus_per_node)  # fill_bubbles=true where it cannot apply; the shard group


BUBBLE_SETTINGS = ("auto", "true", "false")


def fills_bubbles(setting: str, placement: str, sizes: Sizes, weights: str, shard_group: int, exchange: str) -> bool:
    """Whether a step gives the later pipeline ranks' idle time encoder work (bubble calls,
    ``omni.step.bubbles``): ``multiplex.fill_bubbles`` = auto (where it applies and the
    exchanges are point to point, so a cut waits only for its partners), true (where it
    applies, else an error naming why) or false.

    It applies to ``colocated`` under pipeline parallelism when every collective of the
    encoder weights stays inside one pipeline rank's GPUs, because a bubble call runs on those
    alone: replicated weights (reduced after the step), or ``hybrid`` whose shard groups
    (``shard_group`` consecutive ranks) divide a pipeline rank's ranks; not ``sharded``, whose
    collectives span every encoder rank. ``sizes``: the LLM layout (``parallel.sizing.Sizes``)."""
    text = str(setting).lower()
    if text not in BUBBLE_SETTINGS:
        raise LayoutError(f"multiplex.fill_bubbles={setting!r} is not one of {', '.join(BUBBLE_SETTINGS)}")
    if text == "false":
        return False
    per_stage = sizes.world // sizes.pp
    why = None
    if placement != "colocated":
        why = f"multiplex.placement={placement} (bubble calls are colocated's)"
    elif sizes.pp < 2:
        why = "no pipeline parallelism (parallel.pp=1 has no bubbles)"
    elif weights == "sharded":
        why = "multiplex.encoder_weights=sharded (its collectives span every pipeline rank)"
    elif weights == "hybrid" and per_stage % shard_group:
        why = (f"multiplex.encoder_weights=hybrid with shard groups of {shard_group} ranks that cross pipeline "
               f"ranks of {per_stage} (set multiplex.encoder_shard_group to a divisor of {per_stage})")
    if why is not None:
        if text == "true":
            raise LayoutError(f"multiplex.fill_bubbles=true cannot apply here: {why}; set multiplex.fill_bubbles=auto")
        return False
    return text == "true" or exchange == "p2p"


def encoder_ranks(sizes: Sizes, placement: str) -> list[int]:
    """The ranks that run encoder work: every rank, or the first pipeline stage's (stage0)."""
    return [r for r in range(sizes.world) if placement != "stage0" or sizes.coords(r)["pp"] == 0]


def memory_budget_setting(setting: str) -> float | str | None:
    """``multiplex.encoder_memory_mib`` read: bytes, "auto" (decided on the device), or None (no
    limit). The simulator reads it the same way."""
    text = str(setting).lower()
    if text in ("none", "auto"):
        return None if text == "none" else "auto"
    try:
        return float(text) * 2**20
    except ValueError:
        raise LayoutError(f"multiplex.encoder_memory_mib={setting!r} is not a number of MiB, auto or none") from None


# -- the sharded tower's rules, as pure functions (MediaTower.before_backward follows them; the
# simulator, omni.sim, calls them to charge the same collectives and memory) -------------------


def tower_syncs_gradients(last_of_step: bool, reshard_after_forward: bool, reduce_every_chunk: bool,
                          weights: str = "sharded") -> bool:
    """Whether a sharded (or hybrid) modality reduce-scatters its gradients in this backward
    (``encoder_gradient_reduction``'s first answer)."""
    return encoder_gradient_reduction(weights, last_of_step, reduce_every_chunk, reshard_after_forward)[0]


def tower_reshards_after_backward(last_of_step: bool, reshard_after_forward: bool) -> bool:
    """Whether a sharded modality's weights are freed after this backward
    (``parallel.sizing.frees_after_backward``, the LLM chunks' rule too)."""
    return frees_after_backward(last_of_step, reshard_after_forward)


def tower_grads_unsharded(reshard_after_forward: bool, reduce_every_chunk: bool, weights: str = "sharded") -> bool:
    """Whether a sharded modality's gradients stay unsharded between its backwards of a step:
    when a backward does not reduce-scatter, FSDP2 keeps the whole gradient, upcast to its
    reduce dtype (fp32 under bf16 mixed precision), and adds each later backward's into it,
    until the reduce-scatter of the step's last backward."""
    return not tower_syncs_gradients(False, reshard_after_forward, reduce_every_chunk, weights)
