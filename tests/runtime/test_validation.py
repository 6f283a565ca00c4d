"""Periodic validation loss (``trainer.eval_every``): the value, its layouts, and that it
leaves training alone.

One single-process demo run validates after each of its two steps; a direct computation on
its final checkpoint (each held-out sample alone, unpacked, through the model's embeddings
and decoder, cross-entropy summed over the targets and divided by their count) must give its
step-2 line; dp_shard=2 and pp=2 (torchrun, gloo) must give its lines; and the same run
without validation must train to the same losses and the same weights, bit for bit.
"""
from __future__ import annotations

import json
import math
import tarfile

import pytest
import torch

from recipe_helpers import ranks_train, read_metrics, step_losses, tiny_overrides, train

# A small packing budget: the held-out set packs into three micro-batches (shapes twice), so
# dp_shard=2 splits a group over ranks and pads one rank with a micro-batch without targets.
COMMON = {"trainer.max_steps": 2, "trainer.eval_every": 1, "data.micro_batch_tokens": 256}
PER_GROUP = 3


def _validation_lines(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("event") == "validation"]


def _first_samples(tar, n: int) -> list[dict]:
    samples: dict[str, dict] = {}
    with tarfile.open(tar) as tf:
        for member in tf.getmembers():
            key, _, field = member.name.partition(".")
            if key not in samples and len(samples) == n:
                break
            samples.setdefault(key, {"__key__": key})[field] = tf.extractfile(member).read()
    return list(samples.values())


# Session-scoped: conftest runs the slow tests first, so pytest leaves this module and comes
# back, and would build a module-scoped fixture twice.
@pytest.fixture(scope="session")
def held_out(demo_root, tmp_path_factory):
    """A small held-out folder: the demo's first three shapes and three tones samples, in its
    layout (one sub-folder per group)."""
    from dataloading.index.shards import write_shards
    from dataloading.index.source_index import build_index

    out = tmp_path_factory.mktemp("held_out")
    for group in ("shapes", "tones"):
        tar = sorted((demo_root / "eval" / group).glob("*.tar"))[0]
        write_shards(_first_samples(tar, PER_GROUP), out / group, f"eval-{group}", PER_GROUP)
    build_index(out, workers=1, progress=False)
    return out


@pytest.fixture(scope="session")
def single(demo_root, held_out, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("validated")
    train(tiny_overrides(demo_root, run_dir, **COMMON, **{"data.eval_dir": held_out}))
    return run_dir


def test_validation_loss_equals_a_direct_computation(single, demo_root, held_out):
    from dataloading.construct.constructor import assemble
    from dataloading.construct.held_out import EvalSet, eval_options
    from dataloading.plan.mixture import load_mixture
    from omni.models.build import media_processors
    from recipes.model_source import load_model

    lines = _validation_lines(single)
    assert [r["step"] for r in lines] == [1, 2]  # every step, none at step 0
    loaded = load_model(str(single))  # the weights after step 2, one process
    model, tok = loaded.model.eval(), loaded.tokenizer
    samples = EvalSet(held_out, tok, media_processors(model),
                      options=eval_options(load_mixture(demo_root / "mixture.yaml").sources))
    assert len(samples) == 2 * PER_GROUP
    ce: dict[str, float] = {}
    targets: dict[str, int] = {}
    for key in samples.keys:
        sid = f"eval/{key}"
        c = samples._constructor(sid)  # the sample as its training source is prompted
        sample = c.fetch(sid)
        t = c.tokenize(sample)
        labels = torch.from_numpy(t.labels)
        # The targets are the response and the end of sequence, nothing of the prompt.
        assert labels[labels != -100].tolist() == tok.encode(sample.response) + [tok.eos_id]
        row = assemble([t])  # this sample alone: its media inputs at their placeholders
        with torch.no_grad():
            embeds = model.embed(row.input_ids, row.media)[None]
            logits = model.llm(inputs_embeds=embeds, position_ids=torch.arange(len(t))[None]).logits[0]
            loss = torch.nn.functional.cross_entropy(logits.double(), labels, ignore_index=-100, reduction="sum")
        group = samples.group(sid)
        ce[group] = ce.get(group, 0.0) + float(loss)
        targets[group] = targets.get(group, 0) + int((labels != -100).sum())
    assert sorted(ce) == ["shapes", "tones"]
    last = lines[-1]
    assert last["val_tokens"] == sum(targets.values())
    assert last["val_loss"] == pytest.approx(sum(ce.values()) / sum(targets.values()), rel=1e-5)
    for group in ce:
        assert last["val_loss_by_group"][group] == pytest.approx(ce[group] / targets[group], rel=1e-5)


def test_a_validation_pass_leaves_training_as_it_was(single, demo_root, held_out, tmp_path):
    """The same run without validation: the same losses (step 2 comes after a validation pass)
    and the same final weights, exactly."""
    from recipes.model_source import load_model

    plain = tmp_path / "plain"
    train(tiny_overrides(demo_root, plain, **{**COMMON, "trainer.eval_every": 0, "data.eval_dir": held_out}))
    assert not _validation_lines(plain)
    assert step_losses(plain) == step_losses(single)
    got, ref = load_model(str(single)).model.state_dict(), load_model(str(plain)).model.state_dict()
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"parallel.dp_shard": 2}, {"parallel.dp_shard": 1, "parallel.pp": 2}],
                         ids=["dp_shard=2", "pp=2"])
def test_layouts_validate_as_the_single_process(single, demo_root, held_out, tmp_path, layout):
    run_dir = tmp_path / "run"
    ranks_train(2, tiny_overrides(demo_root, run_dir, **COMMON, **layout, **{"data.eval_dir": held_out}))
    got, ref = _validation_lines(run_dir), _validation_lines(single)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2]
    for g, r in zip(got, ref):
        assert g["val_tokens"] == r["val_tokens"]
        assert g["val_loss_by_group"].keys() == r["val_loss_by_group"].keys()
        for key in r["val_loss_by_group"]:
            assert math.isclose(g["val_loss_by_group"][key], r["val_loss_by_group"][key], rel_tol=1e-5), (key, g, r)
        assert math.isclose(g["val_loss"], r["val_loss"], rel_tol=1e-5), (g, r)


def test_resume_keeps_each_validation_line_once(tmp_path):
    """A resume from step 2 keeps the validation lines up to it (measured before its
    checkpoint) and drops the interrupted run's later lines and its end-of-run eval."""
    from omni.runtime.metrics import MetricsLog

    log = MetricsLog(tmp_path, enabled=True)
    for rec in ({"step": 1, "loss": 3.0}, {"event": "validation", "step": 2, "val_loss": 2.5},
                {"step": 2, "loss": 2.0}, {"step": 3, "loss": 1.0}, {"event": "validation", "step": 3, "val_loss": 1.5},
                {"event": "eval", "step": 3, "accuracy": 0.5}):
        log.write(rec)
    log.truncate_after(2)
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [{"step": 1, "loss": 3.0}, {"event": "validation", "step": 2, "val_loss": 2.5},
                    {"step": 2, "loss": 2.0}]
