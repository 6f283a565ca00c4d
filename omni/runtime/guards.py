"""Numeric guards: what the trainer does with a step whose loss or gradient norm is not finite,
and the loss-spike detector.

Every rank reaches the same verdict: the loss is all-reduced and the gradient norm is global, so
a skipped step is skipped everywhere (no collective is left unmatched).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from omni.errors import UserError


class NonFiniteSteps(UserError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


@dataclass
class BadStepGuard:
    """Counts skipped steps; ``max_in_a_row`` consecutive ones stop the run."""

    max_in_a_row: int
    skipped: int = 0  # over the run (restored on resume)
    streak: list[int] = field(default_factory=list)  # steps of the current run of bad ones

    def __post_init__(self):
        if self.max_in_a_row < 1:
            raise UserError(f"trainer.max_bad_steps={self.max_in_a_row} must be >= 1 (1: stop at the first "
                            "non-finite step)")

    @staticmethod
    def is_bad(loss: float, grad_norm: float) -> bool:
        return not (math.isfinite(loss) and math.isfinite(grad_norm))

    def record(self, step: int, bad: bool, detail: str, last_checkpoint: str | None, inspect: str) -> None:
        """Note the step's verdict; raises ``NonFiniteSteps`` once the streak is too long."""
        if not bad:
            self.streak = []
            return
        self.skipped += 1
        self.streak.append(step)
        if len(self.streak) >= self.max_in_a_row:
            first, last = self.streak[0], self.streak[-1]
            where = f"steps {first}-{last}" if first != last else f"step {first}"
            kept = (f"the last good checkpoint is {last_checkpoint}" if last_checkpoint
                    else "no checkpoint was written")
            raise NonFiniteSteps(
                f"{len(self.streak)} step(s) in a row had a non-finite loss or gradient norm ({where}; {detail}); "
                f"stopped without saving: {kept}. Their sample ids are in {inspect}. Lower optim.lr, raise "
                "optim.warmup_steps or check those samples, then resume with checkpoint.resume=auto "
                "(trainer.max_bad_steps sets how many in a row are tolerated)")

    def state_dict(self) -> dict:
        return {"skipped": self.skipped}

    def load_state_dict(self, sd: dict) -> None:
        self.skipped = int(sd.get("skipped", 0))


class SpikeDetector:
    """A loss more than ``sigmas`` standard deviations above the mean of the previous
    ``window`` good steps is a spike (needs at least ``min(window, 10)`` of them first)."""

    def __init__(self, sigmas: float, window: int):
        if sigmas < 0:
            raise UserError(f"trainer.loss_spike_sigmas={sigmas} must be >= 0 (0: no spike detection)")
        if window < 2:
            raise UserError(f"trainer.loss_spike_window={window} must be >= 2 (steps the spread is measured over)")
        self.sigmas = sigmas
        self.history: deque[float] = deque(maxlen=max(window, 2))
        self.warmup = min(max(window, 2), 10)

    @property
    def enabled(self) -> bool:
        return self.sigmas > 0

    def check(self, loss: float) -> dict | None:
        """The spike's figures, or None. A spike stays out of the history, so one bad batch
        does not widen what counts as normal for the next."""
        out = None
        if self.enabled and len(self.history) >= self.warmup:
            n = len(self.history)
            mean = sum(self.history) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / (n - 1))
            if loss > mean + self.sigmas * std and loss > mean:
                out = {"loss": loss, "window_mean": mean, "window_std": std,
                       "sigmas": (loss - mean) / std if std > 0 else math.inf}
        if out is None:
            self.history.append(loss)
        return out
