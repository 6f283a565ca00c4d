"""Encoder-LLM multiplexing trains like the single-process run with inline encoders: under
every placement (colocated joint pipeline, stage0, encoder_first), with long-short sequence
parallelism really splitting items, with CP, with two encoders; the losses, gradient norms and
the first step's gradients of every parameter (encoders and projectors included) agree to 1e-5
(fp32). Also: text-only steps, and steps where only one data group holds media, under every
placement (no hang, no skew).
"""
from __future__ import annotations

import pickle

import pytest

from dist_helpers import run_ranks
from layout_harness import compare, reference, run_layout

IMAGE = {"moe": False, "num_layers": 4, "media": ("image",)}
BOTH = {"moe": False, "num_layers": 4, "media": ("image", "audio")}
LONG = {"long_items": True}
# Image items of >= 6x1 patches, audio of >= 12 tokens: the long ones of LONG, and some short ones.
SPLIT = {"encoder_sp": 2, "long_threshold": "5"}
PP_TP_DP = dict(pp=2, tp=2, dp_shard=2, pp_schedule="1f1b")

LAYOUTS = {
    2: [
        ("dp_shard=2 colocated", dict(dp_shard=2), IMAGE, {}, {}),
        ("pp=2 1f1b colocated", dict(dp_shard=1, pp=2, pp_schedule="1f1b"), IMAGE, {}, {}),
        ("pp=2 gpipe colocated", dict(dp_shard=1, pp=2, pp_schedule="gpipe"), IMAGE, {}, {}),
        ("tp=2 colocated sp=2 long items", dict(dp_shard=1, tp=2), BOTH, LONG, SPLIT),
        ("cp=2 ring stage0", dict(dp_shard=1, cp=2), IMAGE, {}, {"placement": "stage0"}),
    ],
    8: [
        ("pp=2 x tp=2 x dp_shard=2 colocated", PP_TP_DP, IMAGE, {}, {}),
        ("pp=2 x tp=2 x dp_shard=2 stage0", PP_TP_DP, IMAGE, {}, {"placement": "stage0"}),
        ("pp=2 x tp=2 x dp_shard=2 encoder_first", PP_TP_DP, IMAGE, {}, {"placement": "encoder_first"}),
        ("pp=2 x tp=2 x dp_shard=2 colocated, encoder_sp=2, long items split", PP_TP_DP, IMAGE, LONG, SPLIT),
        ("pp=2 x cp=2 x tp=2 colocated", dict(pp=2, cp=2, tp=2, dp_shard=1, pp_schedule="1f1b"), IMAGE, {}, {}),
        ("pp=2 x tp=2 x dp_shard=2 colocated, vision + audio, sp=2", PP_TP_DP, BOTH, LONG, SPLIT),
    ],
}


def _worker(rank, world, layouts, out_dir):
    results = []
    for name, sizes, model, data, mux in layouts:
        try:
            results.append((name, run_layout(rank, sizes, data=data, multiplex=mux, **model), None))
        except Exception as e:
            raise RuntimeError(f"layout [{name}] failed on rank {rank}") from e
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_multiplexing_equals_single_process(world, tmp_path):
    layouts = LAYOUTS[world]
    refs = {}
    for _, _, model, data, _ in layouts:
        key = (tuple(sorted(model.items())), tuple(sorted(data.items())))
        if key not in refs:
            refs[key] = reference(data=data, **model)
    run_ranks(_worker, world, layouts, str(tmp_path), timeout_s=120 * len(layouts))
    problems = []
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            for (name, _, model, data, _), (_, result, _) in zip(layouts, pickle.load(f)):
                ref = refs[(tuple(sorted(model.items())), tuple(sorted(data.items())))]
                problems += [f"[{name}] rank {rank}: {line}" for line in compare(result, ref)]
    assert not problems, "\n".join(problems[:40])
