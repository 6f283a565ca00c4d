"""Encoder-LLM multiplexing trains like the single-process run with inline encoders: under
every placement (colocated joint pipeline, stage0, encoder_first), with long-short sequence
parallelism really splitting items, with CP, with two encoders, with encoder weights replicated,
FSDP-sharded over the encoder ranks, or hybrid (HSDP: sharded inside shard groups, replicated
across them); the losses, gradient norms and the first step's gradients of every parameter
(encoders and projectors included) agree to 1e-5 (fp32). Also: text-only steps, and steps where
only one data group holds media, under every placement (no hang, no skew); and under hybrid
weights a rank holds only gradient shards between encoder backwards.
"""
from __future__ import annotations

import pickle

import pytest

from omni.step.config import MultiplexConfig
from layout_harness import check_named_layouts, run_named_layouts
from layout_models import MICRO_PER_STEP

IMAGE = {"moe": False, "num_layers": 4, "media": ("image",)}
BOTH = {"moe": False, "num_layers": 4, "media": ("image", "audio")}
FROZEN_VISION = {**BOTH, "frozen": ("image",)}  # a frozen vision tower beside a training audio encoder
LONG = {"long_items": True, "steps": 3}
SHORT = {"steps": 3}  # 8 ranks on 2 cores: 3 steps keep the suite within its budget
# Image items of >= 6x1 patches, audio of >= 12 tokens: the long ones of LONG, and some short ones.
SPLIT = {"encoder_sp": 2, "long_threshold": "5"}
SHARDED = {"encoder_weights": "sharded"}  # encoder and projector weights FSDP-sharded over the encoder ranks
# Sharded inside shard groups (default: a node), replicated across them; a call per chunk, so a
# step has several encoder backwards to reduce-scatter after (the default, auto, has one call
# per step on the CPU: LAYOUTS' default layouts run it)
HYBRID = {"encoder_weights": "hybrid", "chunks_per_cut": 1}
PP_TP_DP = dict(pp=2, tp=2, dp_shard=2, pp_schedule="1f1b")
PP2 = dict(dp_shard=1, pp=2, pp_schedule="1f1b")
PP2_DP2 = dict(dp_shard=2, pp=2, pp_schedule="1f1b")
INTERLEAVED = dict(dp_shard=1, pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
TEXT = {"text_only": True, "steps": 2}
ONE_GROUP = {"only_group": 0, "dp": 2, "steps": 3}  # data group 1 never has media
PLACEMENTS = ("colocated", "stage0", "encoder_first")

LAYOUTS = {
    2: [
        ("dp_shard=2 colocated", dict(dp_shard=2), IMAGE, {}, {}),
        # one chunk per cut: _check_memory_bound's subject (auto would make one call per step)
        ("pp=2 1f1b colocated", PP2, IMAGE, {}, {"chunks_per_cut": 1}),
        ("pp=2 1f1b encoder_first", PP2, IMAGE, {}, {"placement": "encoder_first"}),
        # interleaved 1F1B, two model chunks per rank; with 8 micro-batches chunk j's encoder
        # backward runs inside the pipeline (at cut 4 or 6), not after it
        ("pp=2 interleaved_1f1b encoder_first", INTERLEAVED, IMAGE, SHORT, {"placement": "encoder_first"}),
        ("pp=2 interleaved_1f1b colocated, 8 micro-batches", INTERLEAVED, IMAGE, {"steps": 3, "micro": 8},
         {"chunks_per_cut": 1}),
        # two encoder chunks per insertion point: forwards of j and j + 1 together, backwards
        # deferred to the next group's cut
        ("pp=2 interleaved_1f1b colocated, 8 micro-batches, 2 chunks per cut", INTERLEAVED, IMAGE,
         {"steps": 3, "micro": 8}, {"chunks_per_cut": 2}),
        ("tp=2 colocated, 3 chunks per cut", dict(dp_shard=1, tp=2), BOTH, LONG, {"chunks_per_cut": 3}),
        # torch's zero-bubble schedule takes no encoder insertion: encoders before the pipeline
        ("pp=2 zero_bubble encoder_first", dict(dp_shard=1, pp=2, pp_schedule="zero_bubble", pp_virtual_stages=2),
         IMAGE, {"steps": 2}, {"placement": "encoder_first"}),
        ("pp=2 gpipe colocated, sharded encoders", dict(dp_shard=1, pp=2, pp_schedule="gpipe"), IMAGE, {}, SHARDED),
        ("tp=2 colocated sp=2 long items", dict(dp_shard=1, tp=2), BOTH, LONG, SPLIT),
        # auto threshold with a tiny activation budget (about 12 encoder tokens): memory splits items
        ("tp=2 colocated sp=2, items over the memory budget split", dict(dp_shard=1, tp=2), IMAGE, LONG,
         {"encoder_sp": 2, "encoder_memory_mib": "0.02"}),
        # ... and every gradient (LLM and encoders) reduce-scattered once per step
        ("dp_shard=2 colocated sp=2 long items, sharded encoders, one reduce per step",
         dict(dp_shard=2, fsdp_reduce_every_microbatch=False), BOTH, LONG, {**SPLIT, **SHARDED}),
        ("cp=2 ring stage0", dict(dp_shard=1, cp=2), IMAGE, {}, {"placement": "stage0"}),
        ("dp_shard=2 colocated, frozen vision + trainable audio, sharded encoders", dict(dp_shard=2), FROZEN_VISION,
         SHORT, SHARDED),
        *[(f"pp=2 text only {p}", PP2, IMAGE, TEXT, {"placement": p}) for p in PLACEMENTS],
        # sharded encoder weights that run no backward in a step still get (zero) gradients:
        # AdamW then decays them as the single process does
        ("pp=2 text only colocated, sharded encoders", PP2, IMAGE, TEXT, {"placement": "colocated", **SHARDED}),
        # the GPU default on the CPU: bf16 autocast, fp32 weights (no FSDP on the LLM)
        ("pp=2 1f1b colocated bf16 autocast", PP2, {**IMAGE, "precision": "bf16"}, SHORT, {}),
        # ... with replicated encoder weights, and with sharded ones (fp32 DTensors on the CPU:
        # autocast must not share one bf16 copy of them over the step's calls, StepRunner.autocast)
        ("pp=2 1f1b colocated bf16 autocast, replicated encoders", PP2, {**IMAGE, "precision": "bf16"}, SHORT,
         {"encoder_weights": "replicated"}),
        ("pp=2 1f1b colocated bf16 autocast, sharded encoders", PP2, {**IMAGE, "precision": "bf16"}, SHORT, SHARDED),
    ],
    # stage0 with its encoder weights sharded over the first stage's ranks only
    4: [(f"pp=2 x dp_shard=2 media on one data group only, {p}{', sharded encoders' if p == 'stage0' else ''}",
         PP2_DP2, BOTH, ONE_GROUP, {"placement": p, **(SHARDED if p == "stage0" else {})}) for p in PLACEMENTS],
    8: [
        ("pp=2 x tp=2 x dp_shard=2 colocated", PP_TP_DP, IMAGE, SHORT, {}),
        ("pp=2 x tp=2 x dp_shard=2 stage0, sharded encoders", PP_TP_DP, IMAGE, SHORT,
         {"placement": "stage0", **SHARDED}),
        ("pp=2 x tp=2 x dp_shard=2 encoder_first", PP_TP_DP, IMAGE, SHORT, {"placement": "encoder_first"}),
        ("pp=2 x cp=2 x tp=2 colocated", dict(pp=2, cp=2, tp=2, dp_shard=1, pp_schedule="1f1b"), IMAGE, SHORT, {}),
        # long-short SP really splitting items of both encoders (vision and audio), their weights
        # sharded over all 8 ranks (both pipeline stages)
        ("pp=2 x tp=2 x dp_shard=2 colocated, vision + audio, encoder_sp=2, long items split, sharded encoders",
         PP_TP_DP, BOTH, LONG, {**SPLIT, **SHARDED}),
    ],
}


# Hybrid encoder weights on at least two shard groups each: (R replicas x S ranks per group).
HYBRID_LAYOUTS = {
    2: [
        # groups of one rank (parallel.gpus_per_node=1 as the default group): pure replication,
        # through HSDP's all-reduce; two encoders, no PP (resharded after each forward)
        ("dp_shard=2 colocated, vision + audio, hybrid 2 x 1 (nodes of 1)", dict(dp_shard=2, gpus_per_node=1), BOTH,
         SHORT, HYBRID),
        # PP: weights stay gathered for the step, gradients still reduce-scattered every backward
        ("pp=2 1f1b colocated, hybrid 2 x 1", PP2, IMAGE, SHORT, {**HYBRID, "encoder_shard_group": 1}),
        # ... also when the LLM reduces once per step (the flag is the LLM's and sharded mode's)
        ("pp=2 1f1b colocated, hybrid 2 x 1, LLM reduces once per step", {**PP2, "fsdp_reduce_every_microbatch": False},
         IMAGE, SHORT, {**HYBRID, "encoder_shard_group": 1}),
        ("cp=2 ring stage0, hybrid 2 x 1", dict(dp_shard=1, cp=2), IMAGE, SHORT,
         {"placement": "stage0", **HYBRID, "encoder_shard_group": 1}),
    ],
    4: [
        ("dp_shard=4 colocated sp=2 long items, vision + audio, hybrid 2 x 2 (nodes of 2)",
         dict(dp_shard=4, gpus_per_node=2), BOTH, LONG, {**SPLIT, **HYBRID}),
        ("pp=2 x dp_shard=2 colocated, vision + audio, hybrid 2 x 2", PP2_DP2, BOTH, SHORT,
         {**HYBRID, "encoder_shard_group": 2}),
        # stage0: the groups live inside the first stage's two ranks
        ("pp=2 x dp_shard=2 stage0, frozen vision + trainable audio, hybrid 2 x 1", PP2_DP2, FROZEN_VISION, SHORT,
         {"placement": "stage0", **HYBRID, "encoder_shard_group": 1}),
    ],
    8: [
        ("pp=2 x tp=2 x dp_shard=2 colocated, hybrid 2 x 4 (nodes of 4)", {**PP_TP_DP, "gpus_per_node": 4}, IMAGE,
         SHORT, HYBRID),
        ("pp=2 x tp=2 x dp_shard=2 stage0, vision + audio, hybrid 2 x 2", PP_TP_DP, BOTH, SHORT,
         {"placement": "stage0", **HYBRID, "encoder_shard_group": 2}),
        ("tp=2 x dp_shard=4 colocated, hybrid 4 x 2", dict(tp=2, dp_shard=4), IMAGE, SHORT,
         {**HYBRID, "encoder_shard_group": 2}),
    ],
}


def _memory(pm, result):
    """After each step: how much encoder activation memory was alive at once; and how the
    encoder weights are held (the fraction of their elements this rank stores)."""
    from torch.distributed.tensor import DTensor

    s = pm.multiplexer.stats
    result.setdefault("encoder_memory", []).append((s.peak_live_chunks, s.peak_live_bytes, s.max_chunk_bytes,
                                                    s.media_chunks))
    result["long_items"] = result.get("long_items", 0) + s.long_items
    if pm.media is not None:
        params = list(pm.media.parameters())
        result["encoder_sharded"] = all(isinstance(p, DTensor) for p in params)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
        result["encoder_local_fraction"] = local / sum(p.numel() for p in params)
        result["encoder_mesh_shape"] = tuple(params[0].device_mesh.shape) if result["encoder_sharded"] else None


def _watch_encoder_gradients(pm, result):
    """Sharded or hybrid encoder weights: before each encoder chunk's backward, how many
    encoder gradient elements this rank still holds from the step's earlier backwards, full-size
    (FSDP's unsharded gradients, accumulated without a reduce-scatter) and sharded (reduce-
    scattered shards, FSDP's partial HSDP sums included). Reads FSDP2's per-group state."""
    from torch.distributed.fsdp import FSDPModule

    tower = pm.media
    if tower is None or not tower.sharded:
        return
    groups = list({id(g): g for m in tower.modules() if isinstance(m, FSDPModule)
                   for g in m._get_fsdp_state()._fsdp_param_groups}.values())
    shard_ranks = next(p for p in tower.parameters()).device_mesh.shape[-1]
    trainable = tower.trainable()
    result["encoder_grad_full"] = sum(p.numel() for p in trainable)
    # A rank's shard of a parameter: ceil(rows / S) rows (FSDP pads the first dimension).
    result["encoder_grad_shard_bound"] = sum(-(-p.shape[0] // shard_ranks) * (p.numel() // p.shape[0])
                                             for p in trainable)
    held = result.setdefault("encoder_grads_held", [])
    real = tower.before_backward

    def before_backward(modality, last_of_step, reduce_every_chunk):
        full = shard = 0
        for g in groups:
            if g._partial_reduce_output is not None:
                shard += g._partial_reduce_output.numel()
            for fp in g.fsdp_params:
                if fp.unsharded_accumulated_grad is not None:
                    full += fp.unsharded_accumulated_grad.numel()
                if hasattr(fp, "_unsharded_param") and fp._unsharded_param.grad is not None:
                    full += fp._unsharded_param.grad.numel()
                if fp.sharded_param.grad is not None:
                    shard += fp.sharded_param.grad.to_local().numel()
        held.append((full, shard))
        real(modality, last_of_step, reduce_every_chunk)

    tower.before_backward = before_backward


def _worker(rank, world, layouts, out_dir):
    run_named_layouts(rank, layouts, out_dir, probe=_memory, instrument=_watch_encoder_gradients)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_multiplexing_equals_single_process(world, tmp_path):
    _check_equal(world, LAYOUTS[world], tmp_path)
    if world == 2:
        _check_memory_bound(tmp_path)


@pytest.mark.parametrize("world", sorted(HYBRID_LAYOUTS))
def test_hybrid_encoder_weights_equal_single_process(world, tmp_path):
    """HSDP encoder weights (``multiplex.encoder_weights=hybrid``) train like the single
    process, sharded over each group and replicated over >= 2 groups; between encoder
    backwards a rank holds only gradient shards (reduce-scattered inside its group after every
    backward, whatever parallel.fsdp_reduce_every_microbatch says)."""
    layouts = HYBRID_LAYOUTS[world]
    _check_equal(world, layouts, tmp_path)
    problems = []
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            results = pickle.load(f)
        for (name, sizes, _, data, _), (_, result, _) in zip(layouts, results):
            dp = sizes.get("dp_shard", 1) * sizes.get("dp_replicate", 1)
            chunks = -(-data.get("micro", MICRO_PER_STEP) // dp)  # encoder chunks per step
            problems += [f"[{name}] rank {rank}: {line}" for line in _gradients_held(result, sizes, chunks)]
    assert not problems, "\n".join(problems[:40])


def _gradients_held(result, sizes, chunks: int) -> list[str]:
    """Per backward reduce-scatter: never a full-size gradient between two encoder backwards,
    at most one shard of each (and, with several chunks per step, some shard held)."""
    held = result.get("encoder_grads_held")
    if held is None:  # a later stage under stage0 holds no encoders
        return []
    if not held:
        return ["no encoder backward was watched"]
    bad = []
    if any(full for full, _ in held):
        bad.append(f"full-size encoder gradients held between backwards: {held}")
    if any(shard > result["encoder_grad_shard_bound"] for _, shard in held):
        bad.append(f"more than one shard of the encoder gradients held (bound "
                   f"{result['encoder_grad_shard_bound']}): {held}")
    if chunks > 1 and not any(shard for _, shard in held):
        bad.append("no gradient shard held at any backward: the check saw nothing")
    return bad


def _check_equal(world, layouts, tmp_path):
    check_named_layouts(world, layouts, tmp_path, _worker,
                        extra=lambda name, rank, sizes, mux, result: _weights_held(result, mux, sizes))


def _weights_held(result, mux, sizes) -> list[str]:
    """Sharded encoder weights are DTensors split over every encoder rank (the first stage's
    under stage0); hybrid ones over the ranks of a shard group (multiplex.encoder_shard_group,
    else a node of parallel.gpus_per_node), on a (groups, group size) mesh; replicated ones are
    whole on every encoder rank, as are any weights when only one rank encodes."""
    if "encoder_sharded" not in result:  # a later stage under stage0 holds no encoders
        return [] if mux.get("placement") == "stage0" else ["no encoder weights on an encoder rank"]
    weights = mux.get("encoder_weights", MultiplexConfig().encoder_weights)
    if weights == "replicated":
        return [] if not result["encoder_sharded"] else ["replicated encoder weights are DTensors"]
    ranks = 1
    for d in ("pp", "dp_shard", "cp", "tp"):
        ranks *= sizes.get(d, 1)
    if mux.get("placement") == "stage0":
        ranks //= sizes.get("pp", 1)
    if ranks == 1:  # one encoder rank holds whole weights: FSDP over a mesh of one would only cost
        return [] if not result["encoder_sharded"] else ["encoder weights are DTensors on a single encoder rank"]
    shape = (ranks,)
    if weights == "hybrid":
        group = mux.get("encoder_shard_group") or min(sizes.get("gpus_per_node", 8), ranks)
        shape = (ranks // group, group) if group < ranks else (ranks,)
    frac = result["encoder_local_fraction"]
    if not result["encoder_sharded"] or not frac <= 1.0 / shape[-1] + 0.05:
        return [f"encoder weights not sharded over {shape[-1]} ranks (sharded: {result['encoder_sharded']}, "
                f"{frac:.2f} of the elements held here)"]
    if result["encoder_mesh_shape"] != shape:
        return [f"encoder weights on a mesh of shape {result['encoder_mesh_shape']}, not {shape}"]
    return []


def _check_memory_bound(tmp_path):
    """Under the joint pipeline (1F1B, pp=2) a rank keeps the encoder activations of at most pp
    chunks (the micro-batches in flight); encoder_first keeps every chunk of the step. Under
    interleaved 1F1B the bound follows stage 0's backwards."""
    with open(tmp_path / "rank0.pkl", "rb") as f:
        runs = {name: result for name, result, _ in pickle.load(f)}
    colocated, first = runs["pp=2 1f1b colocated"], runs["pp=2 1f1b encoder_first"]
    steps = list(zip(colocated["encoder_memory"], first["encoder_memory"]))
    for (chunks, peak, largest, _), (chunks_f, peak_f, _, media_f) in steps:
        assert chunks <= 2 and peak <= 2 * largest, (chunks, peak, largest)
        assert chunks_f == media_f  # every chunk with media is alive when the pipeline starts
        if media_f > 2:
            assert peak < peak_f, (peak, peak_f)
    assert any(media_f > 2 for _, (_, _, _, media_f) in steps), "no step has more media chunks than pp"
    # Interleaved 1F1B (pp=2, 2 chunks per rank, 8 micro-batches): stage 0 finishes the
    # backwards of micro-batches 0-1 before cut 4 and 2-3 before cut 6, so their encoder
    # backwards run there and at most 4 of the 8 chunks are alive at once.
    interleaved = runs["pp=2 interleaved_1f1b colocated, 8 micro-batches"]["encoder_memory"]
    assert all(chunks <= 4 for chunks, _, _, _ in interleaved), interleaved
    assert any(media > 4 for _, _, _, media in interleaved), "no step has more than 4 media chunks"


def test_hybrid_shard_group_rules():
    """The shard group of hybrid encoder weights: a node by default (all encoder ranks where
    they fit in one), or multiplex.encoder_shard_group; it must divide the encoder ranks, and
    the key means nothing for other modes. check_config refuses mistakes in one line, with
    the launch (stage0: the first stage's ranks only) or without it."""
    from omegaconf import OmegaConf

    from omni.errors import ConfigError
    from omni.step.multiplex_rules import encoder_shard_group
    from parallel.layout import LayoutError
    from recipes.checks import check_config
    from recipes.compose import compose_config

    assert encoder_shard_group("hybrid", 0, 4, 8) == 4
    assert encoder_shard_group("hybrid", 0, 8, 4) == 4
    assert encoder_shard_group("hybrid", 2, 8, 8) == 2
    assert encoder_shard_group("sharded", 0, 4, 8) == 8
    assert encoder_shard_group("replicated", 0, 4, 8) == 1
    with pytest.raises(LayoutError, match="parallel.gpus_per_node=3 .* divisor of 8"):
        encoder_shard_group("hybrid", 0, 3, 8)

    def config(*overrides):
        return OmegaConf.to_object(compose_config(["multiplex.encoder_weights=hybrid", *overrides]))

    check_config(config("multiplex.encoder_shard_group=2"), world_size=8)
    check_config(config("multiplex.encoder_shard_group=4", "multiplex.placement=stage0", "parallel.pp=2"),
                 world_size=8)
    for overrides, world, needle in [
            (["multiplex.encoder_shard_group=3"], 8, "multiplex.encoder_shard_group=3 does not divide the 8"),
            (["parallel.gpus_per_node=3"], 8, "parallel.gpus_per_node=3 .* does not divide the 8"),
            (["multiplex.encoder_shard_group=8", "multiplex.placement=stage0", "parallel.pp=2"], 8,
             "does not divide the 4 encoder ranks")]:
        with pytest.raises(ConfigError, match=needle):
            check_config(config(*overrides), world_size=world)
    with pytest.raises(ConfigError, match="multiplex.encoder_shard_group=-1 must be >= 0"):
        config("multiplex.encoder_shard_group=-1")
    with pytest.raises(ConfigError, match="only applies to multiplex.encoder_weights=hybrid"):
        compose_config(["multiplex.encoder_weights=sharded", "multiplex.encoder_shard_group=2"])
