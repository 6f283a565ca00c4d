"""The main layouts under the GPU's rules on the CPU (``trainer.device_rules=cuda``): bf16
autocast and bf16 FSDP parameters as ``auto`` takes them on a GPU, media features sent to the
"device" ahead of the step, batched host-to-device copies, the host group of its own, and the
strict device check (``parallel/strict_device.py``) on every step: no host read of a tensor a
GPU would hold, and at most one host sync per step (the step's losses and gradient norm),
counted. Each layout trains like its single-process bf16 run (``layout_harness.compare_bf16``:
losses and norms within ``BF16_TOL``, gradients as close to the fp32 run's as the single-process
bf16 run's are).

Where the GPU would run the Triton varlen kernels (``model.attn_backend=auto``), the layout
marked ``triton`` (the headline: colocated at pp=2 x dp_shard=2, LLM and both encoders) runs them
interpreted, against a single-process run on the same kernels (the interpreter is slow: one
layout); the others take the PyTorch path, which under these rules also reads nothing back
(segment lengths from the host).
"""
from __future__ import annotations

import pickle

import pytest

from dist_helpers import rank_results, run_ranks
from layout_harness import compare, compare_bf16, covered, reference, run_layout
from layout_models import MICRO_PER_STEP

BF16 = {"precision": "bf16"}  # the reference runs under bf16 autocast too
BOTH = {"moe": False, "num_layers": 4, "media": ("image", "audio"), **BF16}
IMAGE = {"moe": False, "num_layers": 4, "media": ("image",), **BF16}
MOE = {"moe": True, "num_layers": 4, "media": ("image",), **BF16}
QWEN = {"moe": False, "num_layers": 4, "media": ("image",), **BF16}
TWO = {"steps": 2}
PP2 = dict(dp_shard=1, pp=2, pp_schedule="1f1b")
PP2_DP2 = dict(dp_shard=2, pp=2, pp_schedule="1f1b")

# (name, sizes, model, data, multiplex, attention backend)
LAYOUTS = {
    1: [
        ("single process, image + audio", {}, BOTH, TWO, {}, "sdpa"),
        ("single process, MoE", {}, MOE, TWO, {}, "sdpa"),
    ],
    2: [
        ("dp_shard=2, image + audio", dict(dp_shard=2), BOTH, TWO, {}, "sdpa"),
        ("tp=2, image + audio", dict(dp_shard=1, tp=2), BOTH, TWO, {}, "sdpa"),
        ("pp=2 1f1b, image + audio", PP2, BOTH, TWO, {}, "sdpa"),
        ("pp=2 interleaved_1f1b", dict(dp_shard=1, pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
         IMAGE, TWO, {}, "sdpa"),
        ("cp=2 ring", dict(dp_shard=1, cp=2), IMAGE, TWO, {}, "sdpa"),
        ("cp=2 ulysses", dict(dp_shard=1, cp=2, cp_impl="ulysses"), IMAGE, TWO, {}, "sdpa"),
        ("ep=2 MoE", dict(dp_shard=2, ep=2), MOE, TWO, {}, "sdpa"),
        # trainer.precision=fp32: FSDP's auto dtype follows it (fp32), so the MoE layers, which
        # FSDP does not own, get an fp32 stream (bf16 before: F.linear(bf16, fp32) raised)
        ("dp_shard=2 MoE, trainer.precision=fp32", dict(dp_shard=2), {**MOE, "precision": "fp32"}, TWO, {}, "sdpa"),
        ("dp_shard=2, Qwen2.5-VL tower", dict(dp_shard=2), QWEN, {"steps": 2, "vision": "qwen", "merge": 2}, {},
         "sdpa"),
        ("tp=2, LLaVA-OneVision tower", dict(dp_shard=1, tp=2), IMAGE, {"steps": 2, "vision": "llava_ov"}, {},
         "sdpa"),
        ("dp_shard=2, LoRA", dict(dp_shard=2), {**IMAGE, "lora": 4}, TWO, {}, "sdpa"),
        # long-short SP: long items of both encoders split over the two ranks (Ulysses)
        ("tp=2, encoder_sp=2, long items split", dict(dp_shard=1, tp=2), BOTH, {"steps": 2, "long_items": True},
         {"encoder_sp": 2, "long_threshold": "5"}, "sdpa"),
    ],
    4: [
        ("tp=2 x pp=2, image + audio", dict(dp_shard=1, tp=2, pp=2, pp_schedule="1f1b"), BOTH, TWO, {}, "sdpa"),
        ("pp=2 x dp_shard=2 colocated, image + audio", PP2_DP2, BOTH, TWO, {"placement": "colocated"}, "triton"),
        ("pp=2 x dp_shard=2 stage0, image + audio", PP2_DP2, BOTH, TWO, {"placement": "stage0"}, "sdpa"),
    ],
}


def _long_items(pm, result):
    if pm.multiplexer is not None:
        result["long_items"] = result.get("long_items", 0) + pm.multiplexer.stats.long_items


def _worker(rank, world, layouts, out_dir):
    results = []
    for name, sizes, model, data, mux, backend in layouts:
        try:
            results.append(run_layout(rank, sizes, data=data, multiplex=mux, device_rules="cuda",
                                      attn_backend=backend, probe=_long_items, **model))
        except Exception as e:
            raise RuntimeError(f"layout [{name}] failed on rank {rank}") from e
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_layouts_under_cuda_rules_equal_single_process(world, tmp_path):
    layouts = LAYOUTS[world]
    refs, truths = {}, {}
    for _, _, model, data, _, backend in layouts:  # each with the layout's attention kernels
        key = (tuple(sorted(model.items())), tuple(sorted(data.items())), backend)
        if key not in refs:
            refs[key] = reference(data=data, attn_backend=backend, **model)
            truths[key] = reference(data=data, **{**model, "precision": "fp32"})
    run_ranks(_worker, world, layouts, str(tmp_path), timeout_s=150 * len(layouts))
    problems = []
    by_layout: dict[str, list] = {name: [] for name, *_ in layouts}
    for rank, results in rank_results(tmp_path, world):
        for (name, sizes, model, data, mux, backend), result in zip(layouts, results):
            key = (tuple(sorted(model.items())), tuple(sorted(data.items())), backend)
            lines = (compare(result, refs[key], 1e-5) if model["precision"] == "fp32" else
                     compare_bf16(result, refs[key], truths[key]))
            problems += [f"[{name}] rank {rank}: {line}" for line in lines]
            if mux.get("encoder_sp", 1) > 1 and not result.get("long_items"):
                problems.append(f"[{name}]: no item was long enough to be split (the layout tests nothing)")
            # one: the step's losses and gradient norm; under EP also the all-to-all's split
            # sizes, one read per MoE layer and micro-batch forward (docs/parallelism.md)
            allowed = 1 + (model["num_layers"] * MICRO_PER_STEP // sizes.get("dp_shard", 1) if sizes.get("ep", 1) > 1
                           else 0)
            if any(n is None or n > allowed for n in result["host_syncs"]):
                problems.append(f"[{name}] rank {rank}: host syncs per step {result['host_syncs']} (at most {allowed})")
            by_layout[name].append(result)
    for name, _, model, data, _, backend in layouts:
        ref = refs[(tuple(sorted(model.items())), tuple(sorted(data.items())), backend)]
        problems += [f"[{name}]: {line}" for line in covered(by_layout[name], ref)]
    assert not problems, "\n".join(problems[:40])
