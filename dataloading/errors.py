"""Data errors and the problem counter.

A data problem (corrupt shard, bad sample, sample over budget, bad config) must end in one
line that names the culprit and the fix, and nothing may be dropped silently: skipped
samples are counted per kind, logged, reported per step, and a run that skips too much stops.
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("omni.data")

ON_ERROR_POLICIES = ("skip", "stop")


class DataError(Exception):
    """A user-facing data problem. ``str(err)`` is one line: culprit, problem, fix.

    ``kind`` is a short slug (``corrupt_shard``, ``placeholder_mismatch``, ...) under which
    the problem is counted when the policy lets the run go on.
    """

    def __init__(self, message: str, kind: str = "data_error"):
        # One line, always: the CLI prints str(err) without a traceback.
        super().__init__(" ".join(str(message).split()))
        self.kind = kind

    def __reduce__(self):
        # Keep the kind across processes (an index pool worker, a spawned loader worker):
        # the default pickling rebuilds from the message alone.
        return type(self), (str(self), self.kind)


class ProblemCounter:
    """Counts data problems per kind and applies the ``on_error`` policy.

    - ``on_error="stop"``: the first problem raises its DataError.
    - ``on_error="skip"``: the problem is counted and logged (the first few of each kind in
      full), and the caller drops the sample. If the skipped share exceeds
      ``max_skip_fraction`` the run stops: a systematic problem (wrong path, wrong budget)
      must not quietly burn a training run. To let a few early problems through, the share is
      taken over ``max(seen, grace)`` samples.
    Thread-safe: the loader's background thread and the main thread may both report.
    """

    def __init__(self, on_error: str = "skip", max_skip_fraction: float = 0.01, grace: int = 1000,
                 log_first: int = 5):
        if on_error not in ON_ERROR_POLICIES:
            raise DataError(f"data.on_error={on_error!r} is not a policy; use one of {ON_ERROR_POLICIES}",
                            kind="config")
        if not 0.0 <= max_skip_fraction <= 1.0:
            raise DataError(f"data.max_skip_fraction={max_skip_fraction} must be in [0, 1]", kind="config")
        self.on_error = on_error
        self.max_skip_fraction = float(max_skip_fraction)
        self.grace = int(grace)
        self.log_first = int(log_first)
        self.seen = 0
        self.counts: dict[str, int] = {}
        self.examples: dict[str, str] = {}  # first message per kind, for the summary
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # picklable (spawned workers, Ray actors): the lock is not
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def add_seen(self, n: int = 1) -> None:
        with self._lock:
            self.seen += n

    def report(self, err: DataError) -> None:
        """Record one problem; raises ``err`` under ``stop`` or when too much was skipped."""
        if self.on_error == "stop":
            raise err
        with self._lock:
            n = self.counts.get(err.kind, 0) + 1
            self.counts[err.kind] = n
            self.examples.setdefault(err.kind, str(err))
            skipped, seen = self.skipped, self.seen
        if n <= self.log_first:
            log.warning("skipping: %s", err)
        elif n == self.log_first + 1:
            log.warning("more %r problems: counting them silently from now on (see the step metrics)", err.kind)
        limit = self.max_skip_fraction * max(seen, self.grace)
        if skipped > limit:
            raise DataError(
                f"too many bad samples: {skipped} skipped of {seen} seen (data.max_skip_fraction="
                f"{self.max_skip_fraction}); counts {self.counts}; last: {err}", kind="too_many_problems")

    def summary(self) -> str:
        if not self.counts:
            return f"no data problems in {self.seen} samples"
        parts = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        return f"{self.skipped} of {self.seen} samples skipped ({parts})"
