"""End-to-end: `omni train` on the demo data — metrics, learning, exact resume, presets."""
from __future__ import annotations

import math

import pytest

from recipe_helpers import read_metrics, step_losses, tiny_overrides, train


def test_metrics_lines_and_checkpoint(demo_root, tmp_path):
    run_dir = tmp_path / "run"
    result = train(tiny_overrides(demo_root, run_dir, **{"checkpoint.every": 2, "trainer.max_steps": 4}))
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["lr"] > 0 and "grad_norm" in r
    assert result.last_step == 4
    done = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert done == ["step_00000002", "step_00000004"]
    assert (run_dir / "config.yaml").exists()


def test_loss_falls_under_bf16_autocast(demo_root, tmp_path):
    """The GPU default precision (bf16 autocast, fp32 weights), on the CPU: the demo learns."""
    losses = step_losses_of(demo_root, tmp_path, steps=30, precision="bf16")
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.75 * first, (first, last)


def step_losses_of(demo_root, tmp_path, steps, precision="fp32"):
    run_dir = tmp_path / "run"
    train(tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": steps, "optim.lr": 2e-3,
                                                "data.global_batch_size": 8, "trainer.precision": precision}))
    return step_losses(run_dir)


@pytest.mark.parametrize("experiment", ["demo", "demo_moe"])
def test_resume_is_exact(demo_root, tmp_path, experiment):
    """12 steps straight == 6 steps, stop, resume, 6 more (losses bit-identical), through the
    data plane's worker processes (demo) and in-process construction (demo_moe)."""
    common = {"experiment": experiment, "trainer.max_steps": 12, "data.global_batch_size": 4,
              "data.num_workers": 1 if experiment == "demo" else 0}
    straight = tmp_path / "straight"
    train(tiny_overrides(demo_root, straight, **common))
    split = tmp_path / "split"
    train(tiny_overrides(demo_root, split, **common, **{"trainer.stop_at": 6}))
    assert [r["step"] for r in read_metrics(split)] == list(range(1, 7))
    train(tiny_overrides(demo_root, split, **common, **{"checkpoint.resume": "auto"}))
    a, b = step_losses(straight), step_losses(split)
    assert len(a) == len(b) == 12
    assert a == b
    record = read_metrics(split)[-1]
    assert record["data_wait_s"] >= 0 and record["balance_max_over_mean"] >= record["balance_lower_bound"] >= 1


def test_resume_never_starts_over(demo_root, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 2}))
    first = step_losses(run_dir)
    (run_dir / "metrics.jsonl").unlink()
    train(tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 2, "checkpoint.resume": "never"}))
    assert step_losses(run_dir) == first


def test_final_eval_line(demo_root, tmp_path):
    run_dir = tmp_path / "run"
    result = train(tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 1, "trainer.eval_at_end": True,
                                                         "trainer.eval_samples": 4, "trainer.max_new_tokens": 4}))
    last = read_metrics(run_dir)[-1]
    assert last["event"] == "eval" and 0.0 <= last["accuracy"] <= 1.0 and last["num_samples"] == 4
    assert result.eval_accuracy == last["accuracy"]


@pytest.mark.slow
def test_a_pipeline_run_under_the_gpus_rules(demo_root, tmp_path):
    """`omni train` on 2 ranks (pp=2) with trainer.device_rules=cuda, as the README shows it:
    the layout's rules reach the data peers (features sent ahead to the "device"), the strict
    check runs every step and counts one host sync, and the end-of-run evaluation runs on both
    ranks (each its share of the samples, joined on rank 0)."""
    from recipe_helpers import torchrun_train

    run_dir = tmp_path / "run"
    torchrun_train(2, tiny_overrides(demo_root, run_dir, **{
        "parallel.pp": 2, "trainer.device_rules": "cuda", "model.attn_backend": "sdpa", "trainer.max_steps": 3,
        "trainer.eval_at_end": True, "trainer.eval_samples": 4, "trainer.max_new_tokens": 4}), tmp_path)
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["host_syncs"] for r in steps] == [1, 1, 1] and all(r["host_to_device_copies"] > 0 for r in steps)
    # Each row padded to its own length (parallel.rows; the equality layouts check the value)
    assert all(0 <= r["padded_fraction"] < 0.5 for r in steps), [r["padded_fraction"] for r in steps]
    evals = [r for r in records if r.get("event") == "eval"]
    assert len(evals) == 1 and evals[0]["num_samples"] == 4
