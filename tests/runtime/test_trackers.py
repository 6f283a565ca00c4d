"""Experiment trackers (``trainer.log_to``): TensorBoard, wandb (offline) and MLflow (file store)
hold the loss curve of metrics.jsonl, the same floats, also across a resume.

The demo trains to step 2 (``trainer.stop_at``, as if preempted; validation at step 2), then
resumes to step 3. Each tracker is read back with its own reader: MLflow's client, TensorBoard's
EventAccumulator, and wandb's offline transaction log (``run-<id>.wandb``) through wandb's own
protobuf ``Record`` (wandb has no public reader of offline runs; the log is LevelDB's record
format, read by ``_wandb_records``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipe_helpers import read_metrics, tiny_overrides, train


def _wandb_records(path: Path):
    """The protobuf records of a wandb transaction log: a 7-byte header (":W&B", magic, version),
    then LevelDB log records in 32 KiB blocks (4-byte checksum, 2-byte length, 1-byte type:
    1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a header is padding."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, parts = 7, 32768, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def _wandb_history(folder: Path) -> tuple[set[str], dict[str, dict[int, float]]]:
    """The run ids and every logged number by key and step, over the offline runs in ``folder``."""
    ids, history = set(), {}
    for log in sorted(folder.glob("offline-run-*/run-*.wandb")):
        for record in _wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                step = int(row.pop("_step"))
                for key, value in row.items():
                    history.setdefault(key, {})[step] = value
    return ids, history


def _tensorboard(folder: Path, key: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return {e.step: float(make_ndarray(e.tensor_proto)) for e in acc.Tensors(key)}


def test_trackers_hold_the_loss_curve_across_a_resume(demo_root, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default: offline
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(demo_root, run_dir, **{
        "trainer.max_steps": 3, "trainer.eval_every": 2, "trainer.eval_samples": 4,
        "trainer.log_to": "[jsonl,tensorboard,wandb,mlflow]"})
    train(overrides + ["trainer.stop_at=2"])
    first_ids = json.loads((run_dir / "trackers.json").read_text())
    train(overrides)  # resumes from the step-2 checkpoint
    assert json.loads((run_dir / "trackers.json").read_text()) == first_ids  # the same runs continue

    records = read_metrics(run_dir)
    loss = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(loss) == [1, 2, 3]
    validation = [r for r in records if r.get("event") == "validation"]
    assert [r["step"] for r in validation] == [2]  # measured once, before the stop; not again on resume
    val = validation[0]

    client = MlflowClient((run_dir / "mlruns").as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "omni"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == first_ids["mlflow"] and run.info.status == "FINISHED"
    assert run.info.run_name == run.data.params["name"]  # the config's name
    assert run.data.params["trainer.max_steps"] == "3" and run.data.params["trainer.eval_every"] == "2"
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == loss
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 3  # each step once
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val_loss")] == \
        [(2, val["val_loss"])]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val_loss.shapes")] == \
        [(2, val["val_loss_by_group"]["shapes"])]

    ids, history = _wandb_history(run_dir / "wandb")
    assert ids == {first_ids["wandb"]}  # two offline launches of one run
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2
    assert history["loss"] == loss
    assert history["val_loss"] == {2: val["val_loss"]}
    assert history["val_loss/shapes"] == {2: val["val_loss_by_group"]["shapes"]}

    assert _tensorboard(run_dir / "tensorboard", "loss") == loss
    assert _tensorboard(run_dir / "tensorboard", "val_loss") == {2: val["val_loss"]}


class _Recorder:
    def __init__(self):
        self.rows, self.closed = [], None

    def write(self, step, values):
        self.rows.append((step, values))

    def close(self, failed=False):
        self.closed = failed


def test_every_record_with_a_step_reaches_the_trackers_as_flat_numbers(tmp_path):
    from omni.runtime.metrics import MetricsLog

    log = MetricsLog(tmp_path, enabled=True)
    tracker = _Recorder()
    log.open([tracker])
    log.write({"step": 1, "loss": 2.5, "skipped": False, "data_problems": {"corrupt_sample": 2}, "note": "x"})
    log.write({"event": "eval", "step": 3, "accuracy": 0.5, "num_samples": 4, "accuracy_by_group": {"shapes": 0.25},
               "misses": [{"expected": "a", "got": "b"}]})
    log.write({"event": "validation", "step": 3, "val_loss": 1.5, "val_loss_by_group": {"tones": 1.25},
               "val_tokens": 10})
    log.write({"event": "no step"})
    log.close(failed=True)
    assert tracker.rows == [
        (1, {"loss": 2.5, "skipped": 0.0, "data_problems/corrupt_sample": 2.0}),
        (3, {"accuracy": 0.5, "num_samples": 4.0, "accuracy/shapes": 0.25}),
        (3, {"val_loss": 1.5, "val_loss/tones": 1.25, "val_tokens": 10.0})]
    assert tracker.closed is True
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4  # the run record has them all


def test_tracker_choices_and_missing_packages_are_one_line_errors(monkeypatch):
    import importlib.util

    from omni.errors import ConfigError
    from recipes.compose import compose_config

    with pytest.raises(ConfigError, match=r"trainer.log_to lists 'wandbb'.*did you mean wandb\?"):
        compose_config(["trainer.log_to=[jsonl,wandbb]"])
    with pytest.raises(ConfigError, match=r"trainer.wandb.mode='onlin'"):
        compose_config(["trainer.log_to=[wandb]", "trainer.wandb.mode=onlin"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        compose_config(["trainer.log_to=[jsonl,mlflow]"])
    assert str(err.value) == ("trainer.log_to lists mlflow, but mlflow is not installed: "
                              "pip install 'omni-mm[mlflow]'")
    compose_config(["trainer.log_to=[jsonl]", "trainer.tensorboard=true"])  # the older switch still works


def test_the_older_tensorboard_switch_adds_tensorboard_once():
    from omni.runtime.config import TrainerConfig
    from omni.runtime.trackers import tracker_names

    assert tracker_names(TrainerConfig()) == []
    assert tracker_names(TrainerConfig(tensorboard=True)) == ["tensorboard"]
    assert tracker_names(TrainerConfig(log_to=["jsonl", "tensorboard", "mlflow"], tensorboard=True)) == \
        ["tensorboard", "mlflow"]
