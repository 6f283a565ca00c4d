"""Experiment trackers: where the metrics go besides ``metrics.jsonl`` (``trainer.log_to``).

``metrics.jsonl`` is always written (``omni.runtime.metrics.MetricsLog``): it is the run's own
record, which a resume truncates to the checkpoint's step and tests and tools read. The trackers
here are extra sinks, opened on the main rank only: TensorBoard, Weights & Biases, MLflow. Each
takes a step's numbers as ``write(step, values)`` and ends with ``close(failed)``.

A resumed run continues the same tracker run: the wandb and MLflow run ids are kept in
``<run_dir>/trackers.json`` and reopened, and TensorBoard hides the events the interrupted run
wrote past the resume step (``purge_step``). wandb and MLflow cannot take back what they were
sent: a run resumed from a checkpoint older than its last logged step shows those steps twice
there (metrics.jsonl holds them once).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from omni.errors import UserError

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
WANDB_MODES = ("offline", "online", "disabled")
# tracker -> (the module it imports, the extra of omni-mm that installs it)
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow")}
RUN_IDS = "trackers.json"  # the wandb and MLflow run ids of this run dir, for resume


class Tracker(Protocol):
    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


@dataclass
class TrackedRun:
    """What a tracker records about the run besides its metrics."""

    run_dir: Path
    name: str  # the config's ``name``: the tracker run's name
    config: dict  # the composed config, plain containers: wandb's run config, MLflow's params
    start_step: int = 0  # the checkpoint step a resumed run starts from (0: a fresh run)


def tracker_names(cfg) -> list[str]:
    """The extra sinks ``trainer`` (a TrainerConfig) asks for, in order, once each: ``log_to``
    without jsonl (always written), plus tensorboard for the older ``trainer.tensorboard=true``."""
    names = [n for n in cfg.log_to if n != "jsonl"]
    if cfg.tensorboard:
        names.append("tensorboard")
    return list(dict.fromkeys(names))


def missing_package(name: str) -> str | None:
    """The one-line fix when tracker ``name``'s package is not installed (None: it is)."""
    module, extra = _PACKAGES[name]
    if importlib.util.find_spec(module) is not None:
        return None
    return f"trainer.log_to lists {name}, but {module} is not installed: pip install 'omni-mm[{extra}]'"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as the flat numbers a tracker plots: booleans as 0/1, nested
    numbers under ``key/sub`` (``val_loss_by_group: {shapes: x}`` -> ``val_loss/shapes``,
    ``data_problems: {corrupt: 2}`` -> ``data_problems/corrupt``); the step, strings, lists and
    missing values (None) left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or value is None:
            continue
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
        elif isinstance(value, dict):
            prefix = key.removesuffix("_by_group")
            out.update({f"{prefix}/{sub}": v for sub, v in scalars(value).items()})
    return out


def open_trackers(cfg, run: TrackedRun) -> list[Tracker]:
    """The trackers ``cfg`` (a TrainerConfig) lists, opened for ``run``; on resume
    (``run.start_step > 0``) the wandb and MLflow runs this run dir logged to before."""
    names = tracker_names(cfg)
    for name in names:  # recipes/checks.py says so before training; here for the Python API
        problem = missing_package(name)
        if problem:
            raise UserError(problem)
    ids_file = run.run_dir / RUN_IDS
    ids = json.loads(ids_file.read_text()) if run.start_step > 0 and ids_file.exists() else {}
    trackers: list[Tracker] = []
    try:
        for name in names:
            if name == "tensorboard":
                trackers.append(TensorBoardTracker(run.run_dir / "tensorboard", run.start_step))
            elif name == "wandb":
                tracker = WandbTracker(cfg.wandb, run, ids.get("wandb"))
                ids["wandb"] = tracker.run_id
                trackers.append(tracker)
            elif name == "mlflow":
                tracker = MlflowTracker(cfg.mlflow, run, ids.get("mlflow"))
                ids["mlflow"] = tracker.run_id
                trackers.append(tracker)
    except BaseException:
        for tracker in trackers:
            tracker.close(failed=True)
        raise
    if ids:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        ids_file.write_text(json.dumps(ids, indent=1) + "\n")
    return trackers


class TensorBoardTracker:
    """Scalars in ``<run_dir>/tensorboard``, in double precision (the values metrics.jsonl holds,
    not rounded to float32)."""

    def __init__(self, folder: Path, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        # On resume, events the interrupted run wrote past the checkpoint are hidden.
        self.writer = SummaryWriter(str(folder), purge_step=start_step + 1 if start_step else None)

    def write(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step, new_style=True, double_precision=True)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run named after the config's ``name``, the composed config as its config; offline
    unless ``trainer.wandb.mode`` (or WANDB_MODE) says otherwise."""

    def __init__(self, cfg, run: TrackedRun, run_id: str | None):
        import wandb

        folder = Path(cfg.dir) if cfg.dir else run.run_dir
        folder.mkdir(parents=True, exist_ok=True)
        mode = cfg.mode or os.environ.get("WANDB_MODE") or "offline"
        # reinit=create_new: one process may hold several runs (the Python API trains more
        # than once); this one is finished by close, never through wandb's module-level run.
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=run.name, dir=str(folder), mode=mode,
                              config=run.config, id=run_id, resume="allow" if run_id else None,
                              reinit="create_new")
        self.run_id = self.run.id

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """The composed config as MLflow params: dotted keys, values as text (lists and mappings
    as JSON), each cut to MLflow's longest param value."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, name + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            out[_mlflow_key(name)] = text[:MAX_PARAM_VAL_LENGTH]
    return out


def _mlflow_key(name: str) -> str:
    """MLflow keys take letters, digits, _ - . / : and spaces; anything else becomes _."""
    return re.sub(r"[^\w\-./: ]", "_", name)


def _mlflow_metric(name: str) -> str:
    """A metric's MLflow name: ``val_loss/shapes`` becomes ``val_loss.shapes``, because the file
    store keeps each metric in a file named by its key, and ``val_loss`` cannot be a file and
    the folder of ``shapes`` at once."""
    return _mlflow_key(name).replace("/", ".")


class MlflowTracker:
    """An MLflow run (``trainer.mlflow.experiment``) with the flattened config as params and one
    metric per number per step (``key/sub`` named ``key.sub``: ``_mlflow_metric``). The default
    store is a folder in the run dir, ``file:<run_dir>/mlruns``: the file store needs no database
    package (mlflow-skinny has none), and MLflow 3 asks for MLFLOW_ALLOW_FILE_STORE=true to use
    it, which is set for a file store unless the environment already says otherwise."""

    def __init__(self, cfg, run: TrackedRun, run_id: str | None):
        from mlflow.tracking import MlflowClient

        uri = cfg.tracking_uri or (run.run_dir.resolve() / "mlruns").as_uri()
        if urlparse(uri).scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            exp = self.client.get_experiment_by_name(cfg.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(cfg.experiment)
            run_id = self.client.create_run(exp_id, run_name=run.name).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._log_params(flat_params(run.config))

    def _log_params(self, params: dict[str, str]) -> None:
        """MLflow refuses to change a logged param: a resumed run adds only keys the first
        launch did not have (its values are the run's params)."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

        known = self.client.get_run(self.run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in known]
        for i in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def write(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_mlflow_metric(k), v, stamp, step)
                                                    for k, v in values.items()])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
