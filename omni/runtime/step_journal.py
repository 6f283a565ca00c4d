"""What a run writes about its steps, and its verdicts on them: ``metrics.jsonl`` (and the
experiment trackers behind it), ``flagged_steps.jsonl`` (non-finite and spiking steps with their
sample ids), ``samples.jsonl`` (``trainer.log_samples``), the loss-spike detector and the
bad-step guard that stops a run after too many non-finite steps in a row (docs/fault-tolerance.md).
The trainer runs the steps; this records them."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from omni.runtime.config import TrainerConfig
from omni.runtime.guards import BadStepGuard, SpikeDetector
from omni.runtime.metrics import MetricsLog

FLAGGED = "flagged_steps.jsonl"  # non-finite and spiking steps, with their sample ids


class StepJournal:
    def __init__(self, cfg: TrainerConfig, run_dir: Path, is_main: bool):
        self.cfg, self.run_dir, self.is_main = cfg, run_dir, is_main
        self.metrics = MetricsLog(run_dir, enabled=is_main)
        self.flagged = MetricsLog(run_dir, enabled=is_main, name=FLAGGED)
        self.samples = MetricsLog(run_dir, enabled=is_main and cfg.log_samples, name="samples.jsonl")
        self.guard = BadStepGuard(cfg.max_bad_steps)
        self.spikes = SpikeDetector(cfg.loss_spike_sigmas, cfg.loss_spike_window)

    def resume_at(self, step: int, guard_state: dict) -> None:
        """A resumed run: the guard's counts as saved, and every log cut back to ``step``."""
        self.guard.load_state_dict(guard_state)
        for log in (self.metrics, self.flagged, self.samples):
            log.truncate_after(step)

    def record(self, step: int, stats: dict, record: dict, samples_of: Callable[[], Optional[dict]],
               last_good: Callable[[], Optional[str]]) -> None:
        """Judge and log one step: ``stats`` (the step's figures; ``skipped_steps`` is set here),
        ``record`` (what ``metrics.jsonl`` gets), ``samples_of()`` its sample ids per data-parallel
        rank (a collective: called on every rank for the same steps), ``last_good()`` the newest
        completed checkpoint (named should a streak of bad steps stop the run). Raises
        ``NonFiniteSteps`` through the guard."""
        bad = stats["skipped"]
        spike = None if bad else self.spikes.check(stats["loss"])
        samples = samples_of() if (bad or spike or self.cfg.log_samples) else None
        stats["skipped_steps"] = record["skipped_steps"] = self.guard.skipped + int(bad)
        if step % self.cfg.log_every == 0 or step == self.cfg.max_steps or bad:
            self.metrics.write(record)
        if self.cfg.log_samples:
            self.samples.write({"step": step, "samples": samples})
        flagged = self.run_dir / FLAGGED
        if bad or spike:
            kind = {"kind": "non_finite", "loss": stats["loss"], "grad_norm": stats["grad_norm"]} if bad \
                else {"kind": "loss_spike", **spike}
            self.flagged.write({"step": step, **kind, "samples": samples})
            if spike and self.is_main:
                print(f"omni: loss spike at step {step}: {spike['loss']:.4g} against a mean of "
                      f"{spike['window_mean']:.4g} (+{spike['sigmas']:.1f} sigma); sample ids in {flagged}", flush=True)
        if bad and self.is_main:
            print(f"omni: step {step} skipped: loss {stats['loss']}, gradient norm {stats['grad_norm']} "
                  f"(skipped so far: {stats['skipped_steps']}; sample ids in {flagged})", flush=True)
        # named in the message should this streak stop the run (not listed every step)
        self.guard.record(step, bad, f"last loss {stats['loss']}, gradient norm {stats['grad_norm']}",
                          last_good() if bad else None, str(flagged))
