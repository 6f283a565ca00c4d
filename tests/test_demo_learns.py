"""The README's demo, as it runs by default: the loss falls, held-out accuracy reaches 0.9, and no
loss spike is reported."""
from __future__ import annotations

import pytest

from recipe_helpers import read_metrics, train


@pytest.mark.slow(first=True)  # by far the longest test: started first under pytest-xdist
def test_default_demo_learns(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE", str(tmp_path / "cache"))  # generated on first use, as for a user
    run_dir = tmp_path / "run"
    result = train([f"trainer.run_dir={run_dir}", "trainer.progress=false"])
    records = read_metrics(run_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 600
    assert sum(losses[-50:]) / 50 < 0.25 * sum(losses[:50]) / 50
    final = records[-1]
    assert final["event"] == "eval" and final["num_samples"] == 64
    assert final["accuracy"] >= 0.9, final
    assert result.eval_accuracy == final["accuracy"]
    # A healthy run raises no loss-spike warning (the detector is calibrated on this demo).
    flagged = run_dir / "flagged_steps.jsonl"
    spikes = [line for line in flagged.read_text().splitlines() if "loss_spike" in line] if flagged.exists() else []
    assert not spikes, spikes
