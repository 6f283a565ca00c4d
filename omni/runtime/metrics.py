"""metrics.jsonl (one JSON object per line), optional TensorBoard, and the progress bar."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tqdm import tqdm


class MetricsLog:
    """Appends to <run_dir>/<name> (metrics.jsonl unless named) on the main rank only."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = False, name: str = "metrics.jsonl"):
        self.path = run_dir / name
        self.enabled = enabled
        self._tb = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError as exc:  # pragma: no cover - optional extra
                    raise ImportError(
                        "trainer.tensorboard=true needs TensorBoard: pip install 'omni-mm[tensorboard]'"
                    ) from exc
                self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """On resume from `step`, drop lines the interrupted run wrote past it, so the log
        reads as one run."""
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
        if self._tb is not None and "step" in record:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm:
    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", unit="step", dynamic_ncols=True)
