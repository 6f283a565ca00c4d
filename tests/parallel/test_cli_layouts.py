"""The acceptance layouts from the command line: `torchrun ... --no-python omni train` on the CPU
demo (gloo), compared with the single-process run of the same config.

The data plane picks the same global batch at every data-parallel size (only the arrangement
changes) and the loss is normalised by the global target count, so a dense run's logged losses
equal the single-process ones. For the MoE demo the router loss depends on how samples are
grouped into micro-batches, so only the first loss (before any update) must be equal.

CI runs the checkpoint re-layout (4 FSDP ranks with sharded encoders, then tp=2 x pp=2 with
replicated ones and the final evaluation gathering the weights); the layouts are opt-in (`pytest -m scale`), because eight ranks on two
cores take about a minute each. tests/parallel/test_layouts_equal_single.py proves
every combination equal to the single-process run in CI, below the CLI.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from recipe_helpers import read_metrics, step_losses, tiny_overrides, torchrun_train as _torchrun, train

COMMON = {"trainer.max_steps": 3, "data.global_batch_size": 8}


_REFERENCE: dict = {}


def _reference(demo_root: Path, tmp_path_factory, experiment: str) -> list[float]:
    if experiment not in _REFERENCE:
        run_dir = tmp_path_factory.mktemp(f"single-{experiment}")
        train(tiny_overrides(demo_root, run_dir, experiment=experiment, **COMMON))
        _REFERENCE[experiment] = step_losses(run_dir)
    return _REFERENCE[experiment]


def _check(losses: list[float], ref: list[float], moe: bool) -> None:
    assert len(losses) == len(ref) == COMMON["trainer.max_steps"]
    assert all(math.isfinite(x) for x in losses)
    compared = ref[:1] if moe else ref
    for ours, want in zip(losses, compared):
        assert abs(ours - want) <= 1e-5 * abs(want), (losses, ref)


# torch's zero-bubble schedule takes no encoder insertion: encoders run before the pipeline.
ENCODER_FIRST = {"multiplex.placement": "encoder_first"}

OPT_IN = [
    ("dp_shard=4 x ep=4 x tp=2", 8, dict(dp_shard=4, ep=4, tp=2), "demo_moe"),
    ("dp_shard=2 x tp=2 x pp=2", 8, dict(dp_shard=2, tp=2, pp=2), "demo"),
    ("dp_shard=2", 2, dict(dp_shard=2), "demo"),
    ("dp_replicate=2 x dp_shard=2", 4, dict(dp_replicate=2, dp_shard=2), "demo"),
    ("tp=2", 2, dict(dp_shard=1, tp=2), "demo"),
    *[(f"pp=2 {s}", 2, dict(dp_shard=1, pp=2, pp_schedule=s, pp_virtual_stages=v, **placement), "demo")
      for s, v, placement in (("gpipe", 1, {}), ("1f1b", 1, {}), ("interleaved_1f1b", 2, {}),
                              ("zero_bubble", 2, ENCODER_FIRST))],
    ("pp=4 interleaved", 4, dict(dp_shard=1, pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=2), "demo8"),
    ("pp=2 x dp_shard=2 colocated sharded encoders", 4,
     dict(dp_shard=2, pp=2, **{"multiplex.encoder_weights": "sharded"}), "demo"),
    # Encoder-LLM multiplexing placements and long-short SP on the demo's vision + audio data.
    *[(f"pp=2 x tp=2 x dp_shard=2 {p}", 8, dict(dp_shard=2, tp=2, pp=2, **{"multiplex.placement": p}), "demo")
      for p in ("stage0", "encoder_first")],
    ("pp=2 x dp_shard=2 colocated encoder_sp=2", 4,
     dict(dp_shard=2, pp=2, **{"multiplex.encoder_sp": 2, "multiplex.long_threshold": 16}), "demo"),
    ("cp=2 ring", 2, dict(dp_shard=1, cp=2, cp_impl="ring"), "demo"),
    ("cp=2 ulysses", 2, dict(dp_shard=1, cp=2, cp_impl="ulysses"), "demo"),
    ("ep=2", 2, dict(dp_shard=2, ep=2), "demo_moe"),
    ("ep=4", 4, dict(dp_shard=4, ep=4), "demo_moe"),
    ("dp_shard=2 x cp=2 x tp=2", 8, dict(dp_shard=2, cp=2, tp=2), "demo"),
    ("dp_replicate=2 x dp_shard=2 x cp=2", 8, dict(dp_replicate=2, dp_shard=2, cp=2), "demo"),
]


def _run_layout(demo_root, tmp_path, tmp_path_factory, nproc, sizes, experiment, eval_opts=None):
    eval_opts = eval_opts or {}
    extra = {}
    if experiment == "demo8":  # 4 pipeline ranks x 2 virtual stages need 8 layers
        experiment, extra = "demo", {"model.num_layers": 8}
    ref_key = experiment if not extra else "demo8"
    if ref_key not in _REFERENCE:
        run_dir = tmp_path_factory.mktemp(f"single-{ref_key}")
        train(tiny_overrides(demo_root, run_dir, experiment=experiment, **extra, **COMMON))
        _REFERENCE[ref_key] = step_losses(run_dir)
    run_dir = tmp_path / "run"
    over = tiny_overrides(demo_root, run_dir, experiment=experiment, **extra, **COMMON,
                          **{k if "." in k else f"parallel.{k}": v for k, v in sizes.items()}, **eval_opts)
    _torchrun(nproc, over, tmp_path)
    _check(step_losses(run_dir), _REFERENCE[ref_key], moe=experiment == "demo_moe")
    return run_dir


@pytest.mark.scale
@pytest.mark.parametrize("name,nproc,sizes,experiment", OPT_IN, ids=[c[0] for c in OPT_IN])
def test_cli_layout_opt_in(name, nproc, sizes, experiment, demo_root, tmp_path, tmp_path_factory):
    _run_layout(demo_root, tmp_path, tmp_path_factory, nproc, sizes, experiment)


@pytest.mark.slow
def test_checkpoint_from_dp_shard4_resumes_at_tp2_pp2(demo_root, tmp_path, tmp_path_factory):
    """Saved by 4 FSDP ranks at step 2 (encoder weights FSDP-sharded too), resumed by tp=2 x
    pp=2 with replicated encoders: step 3's loss is the single-process run's (weights,
    optimizer state, schedule and data position all carried)."""
    ref = _reference(demo_root, tmp_path_factory, "demo")
    run_dir = tmp_path / "run"
    first = tiny_overrides(demo_root, run_dir, **COMMON, **{"trainer.stop_at": 2, "checkpoint.every": 2,
                                                            "parallel.dp_shard": 4,
                                                            "multiplex.encoder_weights": "sharded"})
    _torchrun(4, first, tmp_path)
    assert step_losses(run_dir) == pytest.approx(ref[:2], rel=1e-5)
    # The final evaluation gathers the split weights into one model on rank 0.
    second = tiny_overrides(demo_root, run_dir, **COMMON, **{"parallel.dp_shard": 1, "parallel.tp": 2,
                                                             "parallel.pp": 2, "trainer.eval_at_end": True,
                                                             "trainer.eval_samples": 4, "trainer.max_new_tokens": 8,
                                                             "multiplex.trace_step": 3})
    _torchrun(4, second, tmp_path)
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    # The step's time split over the 4 ranks, and a Chrome trace with every rank's lanes.
    for key in ("busy_encoder_s", "busy_llm_s", "busy_comm_s", "idle_s", "bubble_fraction", "imbalance"):
        assert key in records[2], key
    assert 0.0 <= records[2]["bubble_fraction"] < 1.0 and records[2]["imbalance"] >= 1.0
    trace = json.loads((run_dir / "trace_step3.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    # (a call of several chunks is named by its first and last: "F0-3")
    assert {e["name"].split()[0].split("-")[0] for e in spans} >= {"F0", "B0", "stage0", "stage1"}
    assert abs(records[2]["loss"] - ref[2]) <= 1e-5 * abs(ref[2]), (records, ref)
    evals = [r for r in read_metrics(run_dir) if r.get("event") == "eval"]
    assert len(evals) == 1 and evals[0]["num_samples"] == 4
