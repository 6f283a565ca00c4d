"""The hang watchdog: a rank that makes no progress for ``trainer.hang_timeout_s`` says where it
is stuck and exits, so the job ends (or the launcher restarts it) instead of hanging forever.

The training loop calls ``beat(step, phase)`` at every phase change (waiting for data, forward
and backward, gradient sync, optimizer, checkpoint save). A thread checks how long the current
phase has lasted; past the timeout it prints one line naming the rank, host, step and phase,
what the other ranks were last seen doing, and every thread's Python stack, then ends the
process with ``HANG_EXIT_CODE``.

A rank blocked in a collective, waiting for a stuck peer, makes no progress either, so the
first report may come from it rather than from the culprit: the report lists every rank's
phase and its own stacks (a rank waiting shows a collective on top; the culprit shows what it
is stuck in), and the heartbeat files keep each rank's last phase after the job has gone.

"What the other ranks were doing" comes from heartbeat files: each rank's thread rewrites
``<run_dir>/heartbeat/rank_NNNNN.json`` every quarter of the timeout, capped at 30 s. Files,
not a store, because they stay readable after the job is gone and need nothing from a process
group that may be the very thing that hangs. Collective timeouts (``parallel.timeout_s``) are the other guard: they
fail a rank that waits on a dead peer; the watchdog also catches hangs outside collectives
(a deadlocked kernel, a stuck filesystem call).
"""
from __future__ import annotations

import faulthandler
import json
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: worth a restart
FOLDER = "heartbeat"


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, run_dir: Path | None, interval_s: float | None = None):
        """``timeout_s`` <= 0 disables it (``beat`` still records, nothing watches)."""
        self.timeout_s = timeout_s
        self.rank = rank
        self.folder = Path(run_dir) / FOLDER if run_dir is not None else None
        self.interval_s = interval_s or (max(0.2, min(5.0, timeout_s / 10)) if timeout_s > 0 else 0.0)
        # Heartbeats are spaced wider than the checks: on thousands of ranks they are thousands
        # of small writes to a shared filesystem; a report extrapolates the phase age anyway.
        self.heartbeat_s = max(self.interval_s, min(30.0, timeout_s / 4))
        self.host = socket.gethostname()
        # (step, phase, monotonic start): replaced whole, so the thread always reads a consistent triple.
        self._now = (0, "starting", time.monotonic())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the loop's side --------------------------------------------------------------------
    def beat(self, step: int, phase: str) -> None:
        self._now = (step, phase, time.monotonic())

    def start(self) -> "Watchdog":
        if self.timeout_s > 0 and self._thread is None:
            if self.folder is not None:
                self.folder.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._watch, name="omni-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the thread's side --------------------------------------------------------------------
    def _watch(self) -> None:
        written = -math.inf
        while not self._stop.wait(self.interval_s):
            step, phase, since = self._now
            now = time.monotonic()
            stuck = now - since
            if now - written >= self.heartbeat_s:
                self._write_heartbeat(step, phase, stuck)
                written = now
            if stuck > self.timeout_s:
                self._report(step, phase, stuck)
                os._exit(HANG_EXIT_CODE)

    def _write_heartbeat(self, step: int, phase: str, age: float) -> None:
        if self.folder is None:
            return
        beat = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": step, "phase": phase,
                "phase_age_s": round(age, 1), "time": time.time()}
        path = self.folder / f"rank_{self.rank:05d}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(beat))
            os.replace(tmp, path)
        except OSError:
            pass  # a full or vanished disk must not kill training through its watchdog

    def others(self) -> list[str]:
        """The other ranks' last heartbeats, one phrase each."""
        if self.folder is None or not self.folder.is_dir():
            return []
        out = []
        now = time.time()
        for path in sorted(self.folder.glob("rank_*.json")):
            try:
                b = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if b.get("rank") == self.rank:
                continue
            seen = now - b["time"]
            out.append(f"rank {b['rank']} ({b['host']}) at step {b['step']} '{b['phase']}' for "
                       f"{b['phase_age_s'] + seen:.0f} s (last heartbeat {seen:.0f} s ago)")
        return out

    def _report(self, step: int, phase: str, stuck: float) -> None:
        others = self.others()
        peers = "; others: " + "; ".join(others) if others else ""
        print(f"omni: rank {self.rank} ({self.host}, pid {os.getpid()}) made no progress for {stuck:.0f} s at step "
              f"{step} in '{phase}' (trainer.hang_timeout_s={self.timeout_s:g}){peers}; exiting with code "
              f"{HANG_EXIT_CODE} (under torchrun --max-restarts the job restarts from its last checkpoint). "
              "Python stacks follow.", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
