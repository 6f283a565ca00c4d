"""Numeric guards: what the trainer does with a step whose loss or gradient norm is not finite,
and the loss-spike detector.

Every rank reaches the same verdict: the loss is all-reduced and the gradient norm is global, so
a skipped step is skipped everywhere (no collective is left unmatched).
"""
from __future__ import annotations

import math
import statistics
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
    """A loss is a spike when it lies more than ``sigmas`` robust standard deviations above the
    median loss of the previous ``window`` good steps (detection starts once ``min(window, 10)``
    of them are in). The standard deviation is read off the window's upper tail: the distance
    from the median to the 95th percentile, divided by 1.645 (what it is for normal data).

    Calibrated on the default demo's real loss curve (tests/runtime/data/demo_loss_curve.json,
    tests/runtime/test_spike_calibration.py). A healthy step's loss is skewed to the right: a batch
    that happens to hold a long text sample is dominated by the text source's loss (1.64 at step
    524 where its neighbours have about 0.2). The mean and standard deviation of the window called
    such batches +12 sigma; a median is not pulled by them, and the upper tail counts them as the
    normal spread they are. The log scale or the median absolute deviation do worse there: the
    near-zero losses of image-heavy batches widen them until a loss 20 times the median is no
    longer flagged late in training. On that curve the largest healthy step is +6.1 under the
    defaults (window 100, 10 sigmas), and a loss 20 times the window's median is flagged at every
    step (+14 or more). Early in training the falling loss stays below the median, so the fast
    descent flags nothing; ``MIN_SPREAD`` (1% of the median) keeps a window of near-equal losses
    from turning a wobble into many sigmas.
    """

    MIN_HISTORY = 10
    TAIL_QUANTILE = 0.95
    TAIL_SIGMAS = 1.6449  # the normal distribution's 95th percentile, in standard deviations
    MIN_SPREAD = 0.01  # as a fraction of the median

    def __init__(self, sigmas: float, window: int):
        if sigmas < 0:
            raise UserError(f"trainer.loss_spike_sigmas={sigmas} must be >= 0 (0: no spike detection)")
        if window < 2:
            raise UserError(f"trainer.loss_spike_window={window} must be >= 2 (steps the spread is measured over)")
        self.sigmas = sigmas
        self.history: deque[float] = deque(maxlen=window)
        self.warmup = min(window, self.MIN_HISTORY)

    @property
    def enabled(self) -> bool:
        return self.sigmas > 0

    def spread(self) -> tuple[float, float]:
        """(median, robust standard deviation) of the window."""
        median = statistics.median(self.history)
        tail = statistics.quantiles(self.history, n=100, method="inclusive")[round(100 * self.TAIL_QUANTILE) - 1]
        return median, max((tail - median) / self.TAIL_SIGMAS, self.MIN_SPREAD * abs(median), 1e-12)

    def check(self, loss: float) -> dict | None:
        """The spike's figures, or None. A spike stays out of the history, so one bad batch
        does not widen what counts as normal for the next."""
        out = None
        if self.enabled and len(self.history) >= self.warmup:
            median, spread = self.spread()
            z = (loss - median) / spread
            if z > self.sigmas:
                out = {"loss": loss, "window_mean": sum(self.history) / len(self.history), "window_median": median,
                       "window_spread": spread, "sigmas": z}
        if out is None:
            self.history.append(loss)
        return out
