"""experiment=llava_stage1 then experiment=llava_stage2 from it (a few steps each, in-process):
stage 1 trains the projector alone on captions; stage 2, on conversations, starts from stage 1's final weights
(model.init_from), keeps the vision tower bit-identical and trains the projector and the LLM;
a stage-2 run restarted after a stop resumes from its own checkpoint, not from stage 1's."""
from __future__ import annotations

import torch

from recipe_helpers import read_metrics, tiny_overrides, train


def _weights(run_dir, step=None) -> dict[str, torch.Tensor]:
    from recipes.model_source import load_model

    return {n: p.detach().clone() for n, p in load_model(str(run_dir), step=step).model.named_parameters()}


def _moved(a: dict, b: dict) -> set[str]:
    assert a.keys() == b.keys()
    return {n for n in a if not torch.equal(a[n], b[n])}


def test_stage1_trains_the_projector_and_stage2_starts_from_it(demo_root, tmp_path, monkeypatch, capsys):
    from omni.runtime.trainer import Trainer

    starts = []  # each run's weights before its first step
    real = Trainer.train_step

    def first_weights(self, batch, step=None, **kwargs):
        if not getattr(self, "_seen", False):
            self._seen = True
            starts.append({n: p.detach().clone() for n, p in self.pm.named_parameters()})
        return real(self, batch, step, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", first_weights)
    common = {"data.mixture": str(demo_root / "vision.yaml"), "data.num_workers": 0}
    stage1, stage2 = tmp_path / "stage1", tmp_path / "stage2"
    train(["experiment=llava_stage1", *tiny_overrides(demo_root, stage1, **common, **{"trainer.max_steps": 2})])
    end1 = _weights(stage1)
    assert _moved(starts[0], end1) == {n for n in end1 if n.startswith("projectors.")}  # the projector alone

    # Stage 2 on the preset's data, the demo's conversations (its plain chat template), with the
    # validation loss on the held-out conversations at step 3.
    chat = {"data.mixture": str(demo_root / "chat.yaml"), "data.eval_dir": str(demo_root / "eval_chat"),
            "data.num_workers": 0, "trainer.eval_every": 3, "trainer.eval_samples": 8}
    second = ["experiment=llava_stage2", f"model.init_from={stage1}",
              *tiny_overrides(demo_root, stage2, **chat, **{"trainer.max_steps": 3, "checkpoint.every": 1})]
    train(second + ["trainer.stop_at=2"])
    assert not _moved(starts[1], end1)  # step 0 of stage 2 is stage 1's last step
    capsys.readouterr()
    train(second)  # restarted: its own checkpoint wins over model.init_from
    assert "resumed from" in capsys.readouterr().out
    assert not _moved(starts[2], _weights(stage2, step=2))
    end2 = _weights(stage2)
    moved = _moved(end1, end2)
    assert not {n for n in moved if n.startswith("encoders.")}  # the tower stays bit-identical
    assert {n for n in end2 if n.startswith(("projectors.", "llm."))} <= moved
    records = read_metrics(stage2)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    validation = [r for r in records if r.get("event") == "validation"]
    assert [r["step"] for r in validation] == [3] and set(validation[0]["val_loss_by_group"]) == {"chat"}
    assert 0 < validation[0]["val_loss"] < 10 and validation[0]["val_tokens"] > 0
