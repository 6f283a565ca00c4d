"""The training run around its steps: resume, the loop (each step's host inputs built while
the device runs the one before), checkpoints, metrics, validation and the held-out evaluation
at the end. The step itself (global-token loss normalisation, the program's forwards and
backwards, gradient sync, clipping, AdamW) is ``omni.runtime.step_runner.StepRunner``.

Fault handling (docs/fault-tolerance.md): non-finite steps are skipped and counted, loss spikes
logged with their sample ids, a hang watchdog ends a stuck rank, a collective that times
out says at which step and phase, and Ctrl-C or SIGTERM stops every rank after the same step,
with a checkpoint there (omni/runtime/stop.py)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch.distributed as dist

from dataloading.construct.batch import MicroBatch, StepBatch
from dataloading.errors import DataError
from omni.errors import UserError
from omni.models.freeze import ModuleNames
from omni.models.multimodal import OmniModel
from omni.runtime.checkpoint import Checkpointer
from omni.runtime.config import CheckpointConfig, OptimConfig, TrainerConfig
from omni.runtime.final_eval import final_evaluation
from omni.runtime.guards import NonFiniteSteps
from omni.runtime.metrics import progress_bar
from omni.runtime.optim import PartOptimizers
from omni.runtime.parallelize import ParallelModel
from omni.runtime.stages import StageSchedule
from omni.runtime.step_journal import StepJournal
from omni.runtime.step_runner import HostInputs, StepRunner
from omni.runtime.stop import (STOP_GRACE_MIN_S, RunStopped, StopNow, StopOnSignal, exit_if_stuck,
                               interrupted_message, stopped_message)
from omni.runtime.timeline import (RunSummary, gather_step_times, peak_memory, reset_peak_memory, summarise_ranks,
                                   write_chrome_trace)
from omni.runtime.trackers import TrackedRun, open_trackers
from omni.runtime.validation import Validator
from omni.runtime.watchdog import Watchdog
from parallel.layout import Layout, host_group


class CollectiveTimeout(UserError):
    """A collective waited longer than parallel.timeout_s: a peer died or hangs."""


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return "Timed out" in text or "timed out" in text or "Timeout" in text


@dataclass
class FitResult:
    last_step: int
    losses: list[float]
    eval_accuracy: float | None
    skipped_steps: int = 0


class Trainer:
    def __init__(
        self,
        model: OmniModel | ParallelModel,
        loader,  # StepLoader-like: iterator of StepBatch with state_dict()/load_state_dict()
        layout: Layout,
        trainer_cfg: TrainerConfig,
        optim_cfg: OptimConfig,
        ckpt_cfg: CheckpointConfig,
        tokenizer=None,
        eval_samples: Callable[[], Iterable[tuple[MicroBatch, str]]] | None = None,
        full_model: Callable[[], OmniModel] | None = None,
        trace_step: int = 0,
        validator: Validator | None = None,
        run_config: dict | None = None,
        modules: ModuleNames | None = None,
        init_from: str | Path | None = None,
    ):
        """``model``: a ParallelModel from ``omni.runtime.parallelize`` (a bare OmniModel is
        wrapped as the one-process layout). ``full_model`` builds the unsharded model's skeleton
        (meta device), which the final evaluation fills with the gathered weights when the
        layout splits them. ``validator``: the periodic validation loss (``trainer.eval_every``).
        ``run_config``: the composed config as plain containers, for the experiment trackers.
        ``modules``: the model's module names (``optim.groups``, ``trainer.stages``; default:
        the encoder slots named after their modality). ``init_from``: a checkpoint folder whose
        model weights a run without a checkpoint of its own starts from (``model.init_from``)."""
        self.cfg = trainer_cfg
        self.layout = layout
        self.device = layout.device
        if isinstance(model, OmniModel):
            model = ParallelModel([model.to(self.device)], [0], 1)
        self.pm = model
        self.loader = loader
        self.tokenizer = tokenizer
        self.pad_id = getattr(tokenizer, "pad_id", None) or 0
        self.eval_samples = eval_samples
        self.full_model = full_model
        if modules is None:
            modules = ModuleNames.of_parameters(name for name, _ in self.pm.named_parameters())
        self.optim = PartOptimizers(self.pm.parts, optim_cfg, trainer_cfg.max_steps, modules)
        self.stages = StageSchedule(trainer_cfg.stages, modules) if trainer_cfg.stages else None
        self.init_from = None if init_from is None else Path(init_from)
        self.run_dir = Path(trainer_cfg.run_dir)
        self.ckpt_cfg = ckpt_cfg
        self.checkpointer = Checkpointer(ckpt_cfg, self.run_dir, rank=layout.rank, layout=asdict(layout.sizes),
                                         timeout=layout.timeout)
        self.journal = StepJournal(trainer_cfg, self.run_dir, layout.is_main)
        self.metrics = self.journal.metrics
        self.validator = validator
        self.run_config = run_config or {}
        self.watchdog = Watchdog(trainer_cfg.hang_timeout_s, layout.rank, self.run_dir)
        # Ctrl-C / SIGTERM during fit's loop: a stop after the step every rank agrees on, with a
        # checkpoint (omni/runtime/stop.py); ``steps.stopping`` is that agreement, from the step's sums.
        self._stop = StopOnSignal(announce=layout.is_main)
        # Host numbers and objects (global counts, sample ids, timelines) go over gloo (None: the
        # default group already is), never through the accelerator.
        self._host = host_group(layout)
        self._step, self._phase_name = 0, "starting"
        self._ahead: tuple | None = None  # (step, batch, HostInputs) built during the previous step
        self._loader_state: dict | None = None  # the loader's state before the step built ahead
        self._last = trainer_cfg.max_steps
        self.trace_step = trace_step
        self.steps = StepRunner(self.pm, layout, self.optim, clip=optim_cfg.clip_grad_norm,
                                precision=trainer_cfg.precision, pad_id=self.pad_id, stages=self.stages,
                                host=self._host, phase=lambda name: self._phase(name), stop_requested=lambda: self._stop.requested)

    @property
    def model(self) -> OmniModel:
        """The (first) model chunk this rank holds."""
        return self.pm.chunks[0]

    def _phase(self, name: str) -> None:
        """Tell the watchdog (and a collective-timeout message) where this rank is."""
        self._phase_name = name
        self.watchdog.beat(self._step, name)

    def train_step(self, batch: StepBatch, step: int | None = None, inputs: HostInputs | None = None,
                   before_read: Callable[[], None] | None = None) -> dict[str, float]:
        """One optimizer step (``StepRunner.run``); ``step`` defaults to fit's count."""
        return self.steps.run(batch, self._step if step is None else step, inputs, before_read)

    def fit(self) -> FitResult:
        start = 0
        resume = self.checkpointer.resume_path(self.pm.parts)  # a checkpoint of another model: refused
        if resume is not None:
            restored = self.checkpointer.load(resume, self.optim)
            start = restored.step
            self.loader.load_state_dict(restored.loader_state)
            self.journal.resume_at(start, restored.trainer)
            if self.layout.is_main:
                print(f"omni: resumed from {resume} (step {start})", flush=True)
        elif self.init_from is not None:  # a run with checkpoints of its own resumes from them instead
            self._guarded(self.checkpointer.load_weights, self.init_from, self.pm.parts)
            if self.layout.is_main:
                print(f"omni: model weights from {self.init_from} (model.init_from); optimizer, lr schedule and "
                      "data start fresh", flush=True)
        if self.layout.is_main:  # a resumed run continues its trackers' runs
            self.metrics.open(open_trackers(self.cfg, TrackedRun(
                self.run_dir, str(self.run_config.get("name") or self.run_dir.name), self.run_config, start)))
        self._step = start
        losses: list[float] = []
        last_saved = start
        bar = progress_bar(self.cfg.max_steps, start, enabled=self.cfg.progress and self.layout.is_main)
        it = iter(self.loader)
        step = start
        last = min(self.cfg.max_steps, self.cfg.stop_at or self.cfg.max_steps)
        self._last, self._ahead = last, None
        for part in self.pm.parts:
            part.train()
        summary = RunSummary()
        stats: dict = {"skipped": False}
        self._stop = StopOnSignal(announce=self.layout.is_main, below_bar=self.cfg.progress,
                                  on_request=self._watch_the_stop)
        self.steps.stopping = self._loop_done = False
        self._longest_step_s = 0.0
        try:
            with self.watchdog, self._stop:
                for step in range(start + 1, last + 1):
                    self._step = step
                    stats = self._guarded(self._one_step, it, step)
                    summary.add(stats)
                    losses.append(stats["loss"])
                    bar.update(1)
                    bar.set_postfix(loss=f"{stats['loss']:.3f}", tok_s=f"{stats['tokens_per_s']:,.0f}",
                                    lr=f"{stats['lr']:.2e}")
                    if self.validator is not None and self.validator.due(step):  # before the save: see truncate_after
                        self._phase("validation")
                        self.metrics.write(self._guarded(self.validator.run, self, step))
                    if self.ckpt_cfg.every and step % self.ckpt_cfg.every == 0 and not stats["skipped"]:
                        self._guarded(self._save, step)
                        last_saved = step
                    if self.steps.stopping:  # every rank read the same sum: all stop after this step
                        break
                self._loop_done = True  # (a stop's watch ends here: what follows is the save)
                bar.close()
                if self.layout.is_main and self.pm.timeline is not None and self.pm.timeline.enabled:
                    for line in summary.lines():
                        print(f"omni: {line}", flush=True)
                # A stop saves too (nothing is saved after a skipped step, though); a signal after
                # the last step's sum stops before the final evaluation, the end saved as usual.
                stopping = self.steps.stopping or self._stop.requested
                saves = self.ckpt_cfg.save_at_end or (stopping and self.ckpt_cfg.every > 0)
                if saves and step > last_saved and not stats["skipped"]:
                    self._guarded(self._save, step)
                    last_saved = step
                self._guarded(self.checkpointer.close)
        except NonFiniteSteps:
            self.checkpointer.close()  # a save in flight holds the last good state: finish it
            self.metrics.close(failed=True)
            raise
        except BaseException as exc:
            self.metrics.close(failed=True)  # the trackers' runs end as failed, not left running
            stopped = self._stopped_by_signal(exc)
            if stopped is not None:
                raise stopped from None
            raise
        finally:
            self._loop_done = True  # however fit ends, a stop's watch (exit_if_stuck) ends with it
        if stopping:
            self.metrics.close()
            raise RunStopped(self._stopped_line(step, last_saved, stats["skipped"]), self._stop.signum)
        finished = step >= self.cfg.max_steps
        accuracy = self._final_eval(step) if finished and self.cfg.eval_at_end and self.eval_samples else None
        self.metrics.close()
        return FitResult(last_step=step, losses=losses, eval_accuracy=accuracy, skipped_steps=self.journal.guard.skipped)

    def _watch_the_stop(self, signum: int) -> None:
        """On the first signal: a rank that then makes no progress for a few step times (a peer
        gone, a hang) ends at once instead of holding the signal until torchrun kills it."""
        grace = max(STOP_GRACE_MIN_S, 3.0 * self._longest_step_s)
        exit_if_stuck(signum, lambda: self.watchdog._now, lambda: self.steps.stopping or self._loop_done, grace,
                      self.layout.rank)

    def _newest_checkpoint(self) -> Path | None:
        done = self.checkpointer.completed()
        return done[-1] if done else None

    def _stopped_line(self, step: int, last_saved: int, skipped: bool) -> str:
        """The last line of a run stopped by a signal after ``step``."""
        newest = self._newest_checkpoint()
        saved = newest if last_saved == step and newest is not None and newest.name.endswith(f"_{step:08d}") \
            else None
        why = (f"step {step} was skipped, and nothing is saved after a skipped step" if skipped else
               "checkpoint.every=0 and checkpoint.save_at_end=false: this run saves none")
        return stopped_message(self._stop.signum, step, saved, newest, self.ckpt_cfg.resume, why)

    def _stopped_by_signal(self, exc: BaseException) -> RunStopped | None:
        """What ``exc`` means once a signal came: a second signal stops at once (the line says
        what is lost); a collective that fails after the first one (torchrun signals every rank
        when one of them has ended, and a peer may be gone already) ends the run as stopped.
        A user error stays one."""
        if self._stop.second is not None or isinstance(exc, StopNow):
            second = self._stop.second or exc.signum
            return RunStopped(interrupted_message(self._stop.signum or second, second, self._step,
                                                  self._newest_checkpoint(), self.ckpt_cfg.resume), second)
        if self._stop.requested and not isinstance(exc, (UserError, DataError, KeyboardInterrupt, SystemExit)):
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            why = f"a collective or save failed after the signal; another rank may have ended first: {first}"
            return RunStopped(stopped_message(self._stop.signum, self._step, None, self._newest_checkpoint(),
                                              self.ckpt_cfg.resume, why, during=True), self._stop.signum)
        return None

    def _one_step(self, it, step: int) -> dict:
        """Fetch, train, log and judge one step; returns its stats (``skipped`` included). The
        step's host inputs were usually built during the previous step (``_build_ahead``)."""
        t0 = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        with self.steps.strict_scope():
            if ahead is not None and ahead[0] == step:
                _, batch, inputs = ahead
            else:
                self._phase("waiting for data")
                batch, inputs = next(it), None
            self._phase("forward and backward")
            reset_peak_memory(self.device)
            timed = self._timed(step)
            if timed:
                self.pm.timeline.begin_step(step)
            if inputs is None:
                inputs = self.steps.host_inputs(batch)
            stats = self.train_step(batch, inputs=inputs, before_read=lambda: self._build_ahead(it, step + 1))
        self._phase("logging")
        stats.update(self._step_profile(step, timed))
        dt = time.perf_counter() - t0
        self._longest_step_s = max(self._longest_step_s, dt)
        stats["tokens_per_s"] = inputs.global_tokens / dt
        record = {"step": step, **stats, "step_time_s": dt, "data_wait_s": batch.data_wait_s, **batch.plan_stats}
        # Running totals kept by the loader (and in its checkpointed state), index-time ones included.
        problems = getattr(self.loader, "problems", None) or batch.problems
        if problems:
            record["data_problems"] = dict(problems)

        def last_good():
            done = self.checkpointer.completed()
            return str(done[-1]) if done else None

        self.journal.record(step, stats, record, lambda: self._gather_samples(batch), last_good)
        return stats

    def _build_ahead(self, it, step: int) -> None:
        """Step ``step``'s data and host inputs (counts, padding, the multiplexing plan, the
        batched copies), built while the device still runs the previous step (it is called
        before that step's one read): on a GPU the host work of one step overlaps the device
        work of the other. Not before a validation (which plans steps of its own) nor past the
        run's last step. The loader state the previous step ends with is kept for its
        checkpoint (the loader has moved on by a step)."""
        if step > self._last or (self.validator is not None and self.validator.due(step - 1)):
            return
        phase = self._phase_name
        self._phase("next step's inputs")
        self._loader_state = self.loader.state_dict()
        batch = next(it)
        self._ahead = (step, batch, self.steps.host_inputs(batch))
        self._phase(phase)

    def _save(self, step: int) -> None:
        self._phase("checkpoint save")
        # the loader's state after this step: it has moved on if the next step was built ahead
        state = self._loader_state if self._ahead is not None else self.loader.state_dict()
        self.checkpointer.save(step, self.optim, state, self.journal.guard.state_dict())
        if self.ckpt_cfg.async_save:
            self.metrics.write({"event": "checkpoint", "step": step, "blocked_s": self.checkpointer.last_block_s})

    def _guarded(self, fn, *args):
        """Run ``fn``; a collective that timed out becomes one line saying where this rank was."""
        try:
            return fn(*args)
        except RuntimeError as e:
            if not _is_timeout(e):
                raise
            raise CollectiveTimeout(
                f"rank {self.layout.rank}: a collective at step {self._step} ('{self._phase_name}') waited longer "
                f"than parallel.timeout_s={self.layout.timeout.total_seconds():g} s for its peers: another rank died "
                f"or hangs (the launcher's log and {self.run_dir / 'heartbeat'} say which); restart with "
                f"checkpoint.resume=auto, or raise parallel.timeout_s if steps or saves take that long "
                f"({str(e).splitlines()[0][:200]})") from e

    def _gather_samples(self, batch: StepBatch) -> dict[str, list[str]] | None:
        """The step's sample ids per data-parallel rank, on rank 0 (None elsewhere). One rank of
        each data-parallel position sends (its peers hold the same samples). A collective:
        every rank calls it at the same steps (the verdicts it depends on agree)."""
        holds = self.layout.counts_data and self.layout.cp_rank == 0
        mine = (self.layout.dp_rank, [sid for mb in batch.micro_batches for sid in mb.sample_ids]) if holds else None
        if self.layout.world_size == 1:
            return {str(mine[0]): mine[1]}
        got = [None] * self.layout.world_size if self.layout.is_main else None
        dist.gather_object(mine, got, dst=0, group=self._host)
        if got is None:
            return None
        return {str(dp): ids for dp, ids in sorted(x for x in got if x is not None)}

    def _timed(self, step: int) -> bool:
        """Whether the timeline records step ``step``: every ``multiplex.timeline_every``-th
        step and ``multiplex.trace_step``; no other step waits for its events or gathers."""
        tl = self.pm.timeline
        return tl is not None and tl.enabled and (tl.times(step) or step == self.trace_step)

    def _step_profile(self, step: int, timed: bool) -> dict:
        """The step's time split over ranks (encoder / LLM / communication / idle) on a timed
        step, the encoder plan's figures and peak memory; the Chrome trace of
        ``multiplex.trace_step``."""
        out: dict = {}
        tl = self.pm.timeline
        if timed:
            trace = step == self.trace_step
            per_rank = gather_step_times(tl.end_step(), group=self._host, keep_events=trace)  # over gloo
            out.update(summarise_ranks(per_rank))
            if trace and self.layout.is_main:
                write_chrome_trace(self.run_dir / f"trace_step{step}.json", per_rank)
        out.update(self.steps.mux_metrics)  # the step's own plan (the next one may be planned already)
        out.update(peak_memory(self.device))
        return out

    def _final_eval(self, step: int) -> float | None:
        """The held-out evaluation by greedy generation (``omni.runtime.final_eval``), logged."""
        result = final_evaluation(self.pm, self.layout, self.cfg, self.eval_samples, self.tokenizer, self.full_model,
                                  self._host, self._phase)
        if result is None:
            return None
        self.metrics.write(
            {"event": "eval", "step": step, "accuracy": result.accuracy, "num_samples": result.num_samples,
             "accuracy_by_group": result.by_group, "misses": result.examples}
        )
        if self.layout.is_main:
            groups = ", ".join(f"{g} {a:.3f}" for g, a in result.by_group.items())
            print(f"omni: held-out exact-match accuracy {result.accuracy:.3f} on {result.num_samples} samples "
                  f"({groups})", flush=True)
        return result.accuracy
