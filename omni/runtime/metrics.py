"""metrics.jsonl (one JSON object per line), the experiment trackers it fans out to, and the
progress bar."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from omni.runtime.trackers import Tracker, scalars


class MetricsLog:
    """Appends to <run_dir>/<name> (metrics.jsonl unless named) on the main rank only, and hands
    every record with a step to the trackers (``omni.runtime.trackers``: TensorBoard, wandb,
    MLflow), which ``open`` attaches once the run knows whether it resumes."""

    def __init__(self, run_dir: Path, enabled: bool, name: str = "metrics.jsonl"):
        self.path = run_dir / name
        self.enabled = enabled
        self.trackers: list[Tracker] = []
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)

    def open(self, trackers: Sequence[Tracker]) -> None:
        """From now on every record also goes to ``trackers`` (the main rank's)."""
        if self.enabled:
            self.trackers = list(trackers)

    def truncate_after(self, step: int) -> None:
        """On resume from `step`, drop lines the interrupted run wrote past it, so the log
        reads as one run. A validation line (event=validation) of a step up to `step` stays: the
        trainer validates a step before saving its checkpoint, so the resumed run, which starts
        after it, never measures it again. End-of-run eval lines go (the run is not over)."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("step", -1) <= step and rec.get("event") != "eval":
                kept.append(line)
        self.path.write_text("".join(k + "\n" for k in kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.trackers and "step" in record:
            values = scalars(record)
            for tracker in self.trackers:
                tracker.write(record["step"], values)

    def close(self, failed: bool = False) -> None:
        """Finish the trackers' runs (``failed``: the run ended by an error)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close(failed)


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm:
    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", unit="step", dynamic_ncols=True)
