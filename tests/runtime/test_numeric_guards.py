"""Numeric guards: a step whose loss is not finite (a NaN batch, injected here into the model's
loss) is skipped with weights, optimizer moments and the lr schedule untouched, counted and
logged with its sample ids; K bad steps in a row stop the run (non-zero exit, one line, no save
after them); a loss spike is logged with its sample ids and training goes on."""
from __future__ import annotations

import json

import pytest
import torch

from omni.models.multimodal import OmniModel
from omni.runtime.guards import BadStepGuard, NonFiniteSteps, SpikeDetector
from omni.runtime.trainer import Trainer
from recipe_helpers import read_metrics, tiny_overrides, train
from recipes.cli import main as cli


def _inject(monkeypatch, factor_at: dict[int, float]) -> dict:
    """Multiply the loss of the steps in ``factor_at`` (trainer steps) by their factor; returns
    a dict that collects each step's weights and optimizer state after the step."""
    seen = {"step": 0, "after": {}}
    phase = Trainer._phase

    def track(self, name):
        seen["step"] = self._step
        phase(self, name)

    ce_sum = OmniModel._ce_sum

    def poisoned(self, h, p):
        out = ce_sum(self, h, p)
        factor = factor_at.get(seen["step"])
        return out if factor is None else out * factor

    one_step = Trainer._one_step

    def snapshot(self, it, step):
        stats = one_step(self, it, step)
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        opt = self.optim.optimizers[0]
        moments = {id(p): (s["exp_avg"].clone(), float(s["step"])) for p, s in opt.state.items()}
        seen["after"][step] = (params, moments, self.optim.lr)
        return stats

    monkeypatch.setattr(Trainer, "_phase", track)
    monkeypatch.setattr(OmniModel, "_ce_sum", poisoned)
    monkeypatch.setattr(Trainer, "_one_step", snapshot)
    return seen


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k][0] if isinstance(a[k], tuple) else a[k],
                                                    b[k][0] if isinstance(b[k], tuple) else b[k]) for k in a)


def test_a_nan_step_is_skipped_with_the_optimizer_untouched(demo_root, tmp_path, monkeypatch):
    seen = _inject(monkeypatch, {3: float("nan")})
    run_dir = tmp_path / "run"
    result = train(tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 5, "trainer.log_samples": True,
                                                         "checkpoint.every": 1, "checkpoint.keep_last": 0}))
    assert result.last_step == 5 and result.skipped_steps == 1
    after = seen["after"]
    params2, moments2, lr2 = after[2]
    params3, moments3, lr3 = after[3]
    assert _same(params3, params2)  # no update from the bad step
    assert moments3.keys() == moments2.keys() and all(
        torch.equal(moments3[k][0], moments2[k][0]) and moments3[k][1] == moments2[k][1] for k in moments2)
    assert lr3 == lr2  # the schedule did not advance either
    assert not _same(after[4][0], params3)  # and training goes on
    records = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}
    assert records[3]["loss"] is None and records[3]["skipped"] is True
    assert [records[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert all(records[s]["loss"] > 0 for s in (1, 2, 4, 5))
    # No checkpoint after the bad step: every checkpoint holds a good state.
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_00000001", "step_00000002", "step_00000004", "step_00000005"]
    flagged = [json.loads(x) for x in (run_dir / "flagged_steps.jsonl").read_text().splitlines()]
    samples = {json.loads(x)["step"]: json.loads(x)["samples"] for x in (run_dir / "samples.jsonl").read_text().splitlines()}
    assert [(f["step"], f["kind"]) for f in flagged] == [(3, "non_finite")]
    assert flagged[0]["samples"] == samples[3] and len(samples[3]["0"]) == 4


def test_bad_steps_in_a_row_stop_the_run_keeping_the_last_good_checkpoint(demo_root, tmp_path, monkeypatch, capsys):
    _inject(monkeypatch, {3: float("nan"), 4: float("inf")})
    run_dir = tmp_path / "run"
    over = tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 6, "checkpoint.every": 1,
                                                 "checkpoint.keep_last": 0, "trainer.max_bad_steps": 2})
    assert cli(["train", *over]) == 2  # the CLI's exit code for a run that stopped on a user-facing error
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("omni: error: 2 step(s) in a row had a non-finite loss or gradient norm (steps 3-4")
    assert "the last good checkpoint is" in err and err.count("step_00000002") == 1
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_00000001", "step_00000002"]
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2, 3, 4]
    # Resuming starts from the last good state (the poison is gone: the data was the culprit).
    monkeypatch.undo()
    result = train(over)
    assert result.last_step == 6 and result.skipped_steps == 0


def test_a_loss_spike_is_logged_with_its_samples_and_training_goes_on(demo_root, tmp_path, monkeypatch):
    _inject(monkeypatch, {8: 20.0})
    run_dir = tmp_path / "run"
    result = train(tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 8, "trainer.log_samples": True,
                                                         "trainer.loss_spike_window": 5,
                                                         "trainer.loss_spike_sigmas": 6.0}))
    assert result.skipped_steps == 0 and result.last_step == 8
    flagged = [json.loads(x) for x in (run_dir / "flagged_steps.jsonl").read_text().splitlines()]
    assert [(f["step"], f["kind"]) for f in flagged] == [(8, "loss_spike")]
    assert flagged[0]["sigmas"] > 6 and flagged[0]["loss"] > 10 * flagged[0]["window_mean"]
    samples = {json.loads(x)["step"]: json.loads(x)["samples"] for x in (run_dir / "samples.jsonl").read_text().splitlines()}
    assert flagged[0]["samples"] == samples[8]


def test_guard_and_detector_units():
    guard = BadStepGuard(2)
    guard.record(1, True, "", None, "x")
    guard.record(2, False, "", None, "x")  # a good step breaks the streak
    guard.record(3, True, "", None, "x")
    with pytest.raises(NonFiniteSteps, match=r"steps 3-4.*no checkpoint was written"):
        guard.record(4, True, "", None, "x")
    assert guard.skipped == 3
    with pytest.raises(Exception, match="trainer.max_bad_steps=0 must be >= 1"):
        BadStepGuard(0)
    spikes = SpikeDetector(sigmas=3.0, window=4)
    assert [spikes.check(x) for x in (2.0, 2.1, 1.9, 2.0)] == [None] * 4
    assert spikes.check(5.0)["sigmas"] > 3
    assert spikes.check(2.05) is None  # the spike did not join the history
    assert SpikeDetector(sigmas=0, window=4).check(100.0) is None
