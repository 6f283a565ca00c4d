"""What keeping the weights in step costs a simulated step: FSDP's gathers and
reduce-scatters of the backbone (in the passes where the runtime's FSDP2 units really run
them) and the encoders' gradient synchronisation, weight gathers and gradient accumulation
(replicated or sharded, by the sharded tower's own rules, ``omni.multiplex.media_tower``)."""
from __future__ import annotations

from collections.abc import Sequence
from itertools import product

from omni.step.multiplex_rules import encoder_gradient_reduction, encoder_shard_group, tower_grads_unsharded, tower_reshards_after_backward, tower_syncs_gradients
from omni.sim.config import SimConfig
from omni.sim.encoders import ChunkTimes
from omni.sim.spec import ModelSpec
from omni.sim.machine import CommGroup, Machine
from omni.sim.timing import BF16, StageWork
from parallel.sizing import Sizes, frees_after_backward, reduces_every_microbatch

FP32 = 4  # FSDP's reduce dtype under bf16 mixed precision; the replicated masters' dtype


# -- the runtime's groups, from its rank layout ---------------------------------------------------

def mesh_group(sizes: Sizes, gpus_per_node: int, dims: Sequence[str], **at: int) -> CommGroup:
    """The group along the layout dimensions ``dims`` (flattened, as the runtime's mesh flattens
    dp_shard x cp) through the rank at coordinates ``at`` (the others 0): its members' global
    ranks by ``Sizes.rank_of``, then the nodes they sit in. The other groups of that dimension
    in the same stage (one per TP rank, ...) run beside it on their own GPUs' links."""
    ranks = [sizes.rank_of(**{**at, **dict(zip(dims, idx))})
             for idx in product(*(range(getattr(sizes, d)) for d in dims))]
    return CommGroup.from_ranks(ranks, gpus_per_node)


def llm_shard_group(sizes: Sizes, gpus_per_node: int, pp_rank: int) -> CommGroup:
    """FSDP's shard group of a pipeline rank's LLM chunks (mesh dim dp_shard_cp)."""
    return mesh_group(sizes, gpus_per_node, ("dp_shard", "cp"), pp=pp_rank)


def llm_replicate_group(sizes: Sizes, gpus_per_node: int, pp_rank: int) -> CommGroup:
    """HSDP's replicate group of a pipeline rank's LLM chunks (mesh dim dp_replicate)."""
    return mesh_group(sizes, gpus_per_node, ("dp_replicate",), pp=pp_rank)


def stage_sends_cross_nodes(sizes: Sizes, gpus_per_node: int, virtual: int = 1) -> bool:
    """Whether a pipeline send leaves the node: each rank sends to the rank with the same other
    coordinates in the next pipeline rank (and, interleaved, the last to the first); the
    slowest pair of the exchange sets its time."""
    if sizes.pp == 1:
        return False
    for r in range(sizes.world):
        c = sizes.coords(r)
        if c["pp"] == sizes.pp - 1 and virtual == 1:
            continue
        peer = sizes.rank_of(**{**c, "pp": (c["pp"] + 1) % sizes.pp})
        if r // gpus_per_node != peer // gpus_per_node:
            return True
    return False


# -- FSDP2 units -------------------------------------------------------------------------------

def fsdp_gathers(passes: Sequence[str], reshard_after_forward: bool,
                 reshard_after_backward: Sequence[bool] | None = None) -> list[bool]:
    """Which passes of one FSDP2 unit ("f" / "b", in the order they run on the GPU) start with
    an all-gather of its weights: those that find it sharded. A unit starts the step sharded;
    a forward leaves it gathered unless it reshards after forward; a backward frees it when
    ``reshard_after_backward`` says so for that backward (None: FSDP2's default, always).
    Held to FSDP2 itself by tests/sim/test_sim_encoder_costs.py."""
    backward_frees = iter(reshard_after_backward) if reshard_after_backward is not None else None
    gathered, out = False, []
    for kind in passes:
        out.append(not gathered)
        if kind == "f":
            gathered = not reshard_after_forward
        else:
            gathered = not (next(backward_frees) if backward_frees is not None else True)
    return out


def llm_frees_after_backward(last_of_step: bool, reshard_after_forward: bool) -> bool:
    """Whether an LLM stage's FSDP units are freed after a backward: the pipeline executor's
    rule (``keep_gathered``: ``parallel.sizing.frees_after_backward``), which is the sharded
    tower's too — weights kept gathered after forward stay gathered until the step's last
    backward."""
    return frees_after_backward(last_of_step, reshard_after_forward)


def stage_gathers(programs: list[list[tuple]], pp: int, reshard_after_forward: bool) -> set[tuple[str, int, int]]:
    """(kind, global stage, micro-batch) of every LLM pass that all-gathers its stage's FSDP
    units, from the ranks' programs (``omni.sim.engine.programs``): every pass when weights
    reshard after forward; kept gathered (reshard_after_forward=false, the default under PP),
    the stage's first forward of the step only."""
    out = set()
    for rank, prog in enumerate(programs):
        passes: dict[int, list[tuple[str, int]]] = {}
        for kind, chunk, i in prog:
            if kind in ("f", "b"):
                passes.setdefault(chunk * pp + rank, []).append((kind, i))
        for stage, seq in passes.items():
            backwards = sum(1 for kind, _ in seq if kind == "b")
            frees = [llm_frees_after_backward(k == backwards - 1, reshard_after_forward) for k in range(backwards)]
            for (kind, i), gathers in zip(seq, fsdp_gathers([k for k, _ in seq], reshard_after_forward, frees)):
                if gathers:
                    out.add((kind, stage, i))
    return out


def with_fsdp(m: Machine, w: StageWork, local: float, shard: CommGroup, replicate: CommGroup, layers: int,
              gather_forward: bool, gather_backward: bool, reduce: bool) -> StageWork:
    """A stage's pass with FSDP's collectives over its ``shard`` group: a gather of the weights
    layer by layer behind the compute (one layer's gather has nothing to hide behind) in the
    passes that gather, and the backward's gradient reduction (``reduce``): the reduce-scatter
    in the shard group and, under HSDP, the all-reduce of the shard over ``replicate`` (FSDP2
    runs both in every backward that syncs)."""
    ag = m.all_gather(BF16 * local, shard)
    ag_f, ag_b = (ag if gather_forward else 0.0), (ag if gather_backward else 0.0)
    rs = m.two_level_reduce(FP32 * local, shard, replicate) if reduce else 0.0
    fwd_exposed = max(0.0, ag_f - w.forward_compute_s) + ag_f / max(layers, 1)
    bwd_exposed = max(0.0, ag_b + rs - w.backward_compute_s) + (ag_b + rs) / max(layers, 1)
    return StageWork(w.forward_s + fwd_exposed, w.backward_s + bwd_exposed, w.forward_compute_s, w.tokens,
                     w.backward_compute_s)


def grad_sync(m: Machine, local: float, shard: CommGroup, replicate: CommGroup, layers: int,
              last_backward: float) -> float:
    """Reduce once per step during the last backward: the reduce-scatter in the ``shard`` group,
    then the shard's all-reduce over ``replicate``. What does not hide behind the backward is
    exposed (at least the last layer's reduce)."""
    return exposed_behind_backward(m.two_level_reduce(FP32 * local, shard, replicate), last_backward, layers)


def exposed_behind_backward(t: float, backward: float, units: int) -> float:
    """What a gradient reduction of ``t`` seconds leaves exposed when FSDP2 issues it unit by
    unit from its post-backward hooks during a backward of ``backward`` seconds over ``units``
    units: it hides behind the units still to run, except at least the last unit's share."""
    if t <= 0.0:
        return 0.0
    return max(t - backward, t / max(units, 1))


# -- the encoders ------------------------------------------------------------------------------

def encoder_shard(cfg: SimConfig, members: int, gpus_per_node: int | None = None) -> int:
    """Encoder ranks per shard group of the encoder weights (the runtime's
    ``encoder_shard_group``: 1 replicated, all of them sharded, the shard group hybrid)."""
    if members < 1:
        return 1
    gpn = cfg.cluster.gpus_per_node if gpus_per_node is None else gpus_per_node
    return encoder_shard_group(cfg.multiplex.encoder_weights, int(cfg.multiplex.encoder_shard_group), gpn, members)


def encoder_groups(cfg: SimConfig, members: int | Sequence[int],
                   gpus_per_node: int | None = None) -> tuple[CommGroup, CommGroup]:
    """(shard, replicate) groups of the encoder weights over the encoder ranks ``members``
    (``encoder_ranks``'s global ranks; a count n: ranks 0..n-1, an encoder pool's own GPUs):
    consecutive ranks form a shard group and the groups replicate along the other dimension
    (``parallel.layout.encoder_mesh``). Replicated weights: groups of one, replicated over
    all; sharded: one group of all."""
    ranks = list(range(members)) if isinstance(members, int) else list(members)
    gpn = cfg.cluster.gpus_per_node if gpus_per_node is None else gpus_per_node
    size = encoder_shard(cfg, len(ranks), gpn)
    return CommGroup.from_ranks(ranks[:size], gpn), CommGroup.from_ranks(ranks[::size], gpn)


def encoder_weights_sharded(cfg: SimConfig) -> bool:
    """Sharded or hybrid: FSDP2 gathers the weights and reduces the gradients (in its groups)."""
    return cfg.multiplex.encoder_weights in ("sharded", "hybrid")


def encoder_local_params(cfg: SimConfig, spec: ModelSpec, members: int) -> float:
    total = sum(e.params for e in spec.encoders.values() if e.trainable)
    return total / max(encoder_shard(cfg, members), 1)


def encoder_grads_unsharded(cfg: SimConfig, members: int, reshard: bool) -> bool:
    """Whether the encoders' gradients are whole on every encoder GPU until the step's last
    backward: replicated weights always; sharded and hybrid ones by the tower's rule."""
    if encoder_shard(cfg, members) == 1:
        return True
    return tower_grads_unsharded(reshard, reduces_every_microbatch(cfg.parallel, _pp(cfg)), cfg.multiplex.encoder_weights)


def step_modalities(chunks: list[ChunkTimes]) -> list[str]:
    return sorted({mod for ch in chunks for mod in ch.modalities})


def encoder_backward_reduction(m: Machine, cfg: SimConfig, nbytes: float, shard: CommGroup, replicate: CommGroup,
                               last_of_step: bool, reshard: bool) -> float:
    """The gradient collectives sharded or hybrid weights run in one backward of a modality
    (``nbytes``: its whole fp32 gradients), as ``media_tower.encoder_gradient_reduction``
    says: the reduce-scatter inside the shard group, the all-reduce of the shard across the
    groups (HSDP's two levels, one after the other)."""
    reduce, all_reduce = encoder_gradient_reduction(cfg.multiplex.encoder_weights, last_of_step,
                                                    reduces_every_microbatch(cfg.parallel, _pp(cfg)), reshard)
    t = m.reduce_scatter(nbytes, shard) if reduce else 0.0
    return t + (m.all_reduce(nbytes / shard.size, replicate) if all_reduce else 0.0)


def encoder_grad_sync(m: Machine, cfg: SimConfig, spec: ModelSpec, members: int | Sequence[int], gpus_per_node: int,
                      modalities: Sequence[str] | None = None) -> float:
    """The step's gradient synchronisation of the encoders, fp32, over the encoder ranks
    ``members`` (see ``encoder_groups``). Replicated weights: one all-reduce of every trainable
    encoder's gradients, after the pipeline, in every step — also a text-only one
    (``ParallelModel.sync_gradients`` sums zeros then). Sharded and hybrid: what each
    modality's last backward of the step reduces (``encoder_backward_reduction``: sharded, the
    reduce-scatter; hybrid, the reduce-scatter in its group and the all-reduce across the
    groups; ``modalities``: those with items in the step; None: all); a modality that ran no
    backward has nothing to reduce."""
    shard, replicate = encoder_groups(cfg, members, gpus_per_node)
    if encoder_weights_sharded(cfg):
        present = set(spec.encoders) if modalities is None else set(modalities)
        params = sum(e.params for mod, e in spec.encoders.items() if e.trainable and mod in present)
        # The step's last backward reduces whether or not the weights reshard after forward.
        return encoder_backward_reduction(m, cfg, FP32 * params, shard, replicate, True, False) if params else 0.0
    params = sum(e.params for e in spec.encoders.values() if e.trainable)
    return m.all_reduce(FP32 * params, replicate)


def _modality_passes(chunks: list[ChunkTimes], actions: list[tuple[str, int]], modality: str) -> list[tuple[str, int]]:
    """The encoder actions that call ``modality`` (every chunk with an item of it anywhere:
    every encoder GPU calls it there, with no items if it has none), in the runtime's order."""
    return [(kind, j) for kind, j in actions if modality in chunks[j].modalities]


def add_encoder_collectives(m: Machine, cfg: SimConfig, spec: ModelSpec, chunks: list[ChunkTimes],
                            actions: list[tuple[str, int]], members: int | Sequence[int], gpus_per_node: int,
                            reshard: bool) -> None:
    """Sharded or hybrid encoder weights, per modality, in the passes where the tower runs them,
    over the encoder ranks ``members`` (see ``encoder_groups``): the all-gather (bf16) in the
    shard group of a pass that finds the weights sharded (kept gathered: the modality's first
    forward of the step; resharded after forward: every pass), and the gradient reduction
    (fp32, ``encoder_backward_reduction``) of a backward before the step's last that reduces
    (the last one's is the step's sync, ``encoder_grad_sync``). Layer-by-layer prefetch hides
    them behind the chunk's compute where the compute is longer; what is exposed is also kept
    as the chunk's ``weights_forward_s`` / ``weights_backward_s``. ``actions``: the step's
    encoder actions (``omni.step.multiplex_rules.encoder_actions``)."""
    if not encoder_weights_sharded(cfg) or not chunks:
        return
    shard, replicate = encoder_groups(cfg, members, gpus_per_node)
    fwd_comm = [0.0] * len(chunks)
    bwd_comm = [0.0] * len(chunks)
    for modality in step_modalities(chunks):
        e = spec.encoders[modality]
        gather = m.all_gather(BF16 * e.params, shard)
        passes = _modality_passes(chunks, actions, modality)
        backwards = [j for kind, j in passes if kind == "B"]
        frees = [tower_reshards_after_backward(j == backwards[-1], reshard) for j in backwards]
        for (kind, j), gathers in zip(passes, fsdp_gathers(["f" if k == "F" else "b" for k, _ in passes],
                                                           reshard, frees)):
            comm = fwd_comm if kind == "F" else bwd_comm
            comm[j] += gather if gathers else 0.0
            if kind == "B" and j != backwards[-1] and e.trainable:
                comm[j] += encoder_backward_reduction(m, cfg, FP32 * e.params, shard, replicate, False, reshard)
    for ch, f, b in zip(chunks, fwd_comm, bwd_comm):
        exposed_f = max(0.0, f - max(ch.gpu_forward_s, default=0.0))
        exposed_b = max(0.0, b - max(ch.gpu_backward_s, default=0.0))
        ch.forward_s += exposed_f
        ch.backward_s += exposed_b
        ch.weights_forward_s += exposed_f
        ch.weights_backward_s += exposed_b
        # The collectives couple the shard group's GPUs (p2p exchanges couple only traders).
        ch.weights_span_forward = shard.size if f > 0 else 0
        ch.weights_span_backward = shard.size if b > 0 else 0


def grad_accumulation_bytes(sharded: bool, accumulator: bool, syncs: bool, sharded_grad: bool, shard: int) -> float:
    """Bytes per trainable parameter that one backward call moves to keep the gradient, beyond
    the backward's matmuls (which write the compute-dtype weight gradient).

    Replicated (fp32 masters under bf16 autocast): the cast's backward turns the bf16 weight
    gradient into fp32 (read 2, write 4); from the step's second call on (``accumulator``: the
    parameter's .grad exists), AccumulateGrad adds it in place (read 4 + 4, write 4).

    Sharded (FSDP2, bf16 parameters, fp32 reduce dtype): a call that does not reduce-scatter
    upcasts the bf16 gradient into a new fp32 accumulator (read 2, write 4), or adds it into
    the accumulator (read 4 + 2, write 4); one that reduce-scatters first adds, then copies the
    fp32 gradient into the collective's input (read 4, write 4; from the bf16 one when there
    is no accumulator: read 2, write 4), and the reduced shard goes into an earlier call's
    (``sharded_grad``: read 4 + 4, write 4, on 1/shard of the parameters)."""
    if not sharded:
        return BF16 + FP32 + (3 * FP32 if accumulator else 0.0)
    into = (FP32 + BF16 + FP32) if accumulator else 0.0
    if not syncs:
        return into if accumulator else BF16 + FP32
    copy_in = 2 * FP32 if accumulator else BF16 + FP32
    return into + copy_in + (3 * FP32 / shard if sharded_grad else 0.0)


def add_encoder_grad_traffic(m: Machine, cfg: SimConfig, spec: ModelSpec, chunks: list[ChunkTimes],
                             members: int, reshard: bool) -> None:
    """Every encoder GPU's gradient bookkeeping in each chunk backward of a modality (items or
    not: each calls the backward), memory-bound: ``grad_accumulation_bytes`` for the call's
    place in the step. Chunk backwards run in chunk order (``encoder_actions``). Counted as
    encoder compute (it scales with ``cluster.encoder_efficiency`` like the rest of it)."""
    shard = encoder_shard(cfg, members)
    sharded = shard > 1
    reduce_every = reduces_every_microbatch(cfg.parallel, _pp(cfg))
    for modality in step_modalities(chunks):
        e = spec.encoders[modality]
        if not e.trainable:
            continue  # a frozen encoder runs no backward (see timing.encoder_work)
        calls = [j for j, ch in enumerate(chunks) if modality in ch.modalities]
        accumulator = sharded_grad = False
        for j in calls:
            syncs = sharded and tower_syncs_gradients(j == calls[-1], reshard, reduce_every,
                                                      cfg.multiplex.encoder_weights)
            nbytes = grad_accumulation_bytes(sharded, accumulator, syncs, sharded_grad, shard) * e.params
            t = m.memory(nbytes) / m.cluster.encoder_efficiency
            ch = chunks[j]
            ch.gpu_backward_s = [b + t for b in ch.gpu_backward_s]
            ch.backward_s += t
            if sharded:
                accumulator, sharded_grad = not syncs, sharded_grad or syncs
            else:
                accumulator = True


def _pp(cfg: SimConfig) -> int:
    return int(cfg.parallel.pp)


def add_bubble_backward_costs(m: Machine, cfg: SimConfig, spec: ModelSpec, bubbles: list, members: int | Sequence[int],
                              gpus_per_node: int, reshard: bool) -> None:
    """What a bubble call's backward adds beyond its matmuls, on every GPU of its pipeline
    rank: the gradient bookkeeping of a backward that is not the step's last
    (``grad_accumulation_bytes``; replicated weights add into the gradient, hybrid ones
    reduce-scatter theirs inside the shard group, which the rule keeps inside the pipeline
    rank), and the exposed part of that reduce-scatter (``encoder_backward_reduction``)."""
    shard_n = encoder_shard(cfg, members if isinstance(members, int) else len(members))
    sharded = shard_n > 1
    shard, replicate = encoder_groups(cfg, members, gpus_per_node)
    for b in bubbles:
        extra = comm = 0.0
        for modality in b.modalities:
            e = spec.encoders[modality]
            if not e.trainable:
                continue
            syncs = sharded and tower_syncs_gradients(False, reshard, reduces_every_microbatch(cfg.parallel, _pp(cfg)),
                                                      cfg.multiplex.encoder_weights)
            # Replicated: added into the step's gradient. Sharded weights that reduce here keep no
            # unsharded accumulator (every backward of a hybrid tower reduce-scatters), and add the
            # reduced shard into the shard of the step's earlier backwards.
            accumulator = not sharded or not syncs
            extra += m.memory(grad_accumulation_bytes(sharded, accumulator, syncs, syncs, shard_n) * e.params) \
                / m.cluster.encoder_efficiency
            if syncs:
                comm += encoder_backward_reduction(m, cfg, FP32 * e.params, shard, replicate, False, reshard)
        for cell in b.backward_s:
            b.backward_s[cell] += extra
            b.mean_backward_s[cell] += extra
        slowest = max(b.backward_s.values(), default=0.0)
        b.weights_backward_s = max(0.0, comm - slowest)
        for cell in b.backward_s:
            b.backward_s[cell] += b.weights_backward_s
