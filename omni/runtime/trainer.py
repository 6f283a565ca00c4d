"""The training loop: micro-batch accumulation, global-token loss normalisation, AdamW with
warmup + cosine, clipping, checkpoints, metrics, and the held-out evaluation at the end.

Fault handling (docs/fault-tolerance.md): non-finite steps are skipped and counted, loss spikes
logged with their sample ids, a hang watchdog ends a stuck rank, a collective that times
out says at which step and phase, and Ctrl-C or SIGTERM stops every rank after the same step,
with a checkpoint there (omni/runtime/stop.py)."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
import torch.distributed as dist

from dataloading.construct.batch import MicroBatch, StepBatch
from dataloading.errors import DataError
from omni.errors import UserError
from omni.models.multimodal import OmniModel
from omni.runtime.checkpoint import Checkpointer
from omni.runtime.config import CheckpointConfig, OptimConfig, TrainerConfig
from omni.runtime.final_eval import final_evaluation
from omni.runtime.guards import BadStepGuard, NonFiniteSteps
from omni.runtime.metrics import progress_bar
from omni.runtime.step_journal import StepJournal
from omni.runtime.trackers import TrackedRun, open_trackers
from omni.runtime.validation import Validator
from omni.runtime.optim import PartOptimizers
from omni.runtime.stages import Stage, StageSchedule
from omni.models.freeze import ModuleNames
from omni.models.multimodal import Prepared, StageLog
from omni.runtime.parallelize import ParallelModel
from omni.runtime.timeline import (RunSummary, gather_step_times, peak_memory, reset_peak_memory, summarise_ranks,
                                   write_chrome_trace)
from parallel.data_parallel import all_reduce_sums
from parallel.grad_norm import local_grad_square_sum, scale_to_max_norm_
from omni.runtime.stop import (STOP_GRACE_MIN_S, RunStopped, StopNow, StopOnSignal, exit_if_stuck,
                               interrupted_message, stopped_message)
from omni.runtime.watchdog import Watchdog
from parallel.layout import Layout, host_group
from parallel.strict_device import StrictDevice, host_read
from omni.step import StepProgram, plan_step


def _device_sum(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of detached 0-dim losses in fp64 (the precision the logged totals always had),
    on the device: nothing is read back."""
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([p.to(torch.float64) for p in parts]).sum()




class CollectiveTimeout(UserError):
    """A collective waited longer than parallel.timeout_s: a peer died or hangs."""


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return "Timed out" in text or "timed out" in text or "Timeout" in text


@dataclass
class HostInputs:
    """A step's host work (``Trainer._host_inputs``): its program (``omni.step.plan_step``: the
    micro-batch count, each row's length, every pipeline rank's actions), its micro-batches
    ready on the device, and the global batch's target and token counts."""

    program: StepProgram
    prepared: list[Prepared]
    global_targets: float
    global_tokens: float


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
        self._stage: Stage | None = None
        self._idle: list[torch.nn.Parameter] = []  # trainable, but sitting the current stage out
        self.init_from = None if init_from is None else Path(init_from)
        self.clip = optim_cfg.clip_grad_norm
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
        # checkpoint (omni/runtime/stop.py); ``_stopping`` is that agreement, from the step's sums.
        self._stop = StopOnSignal(announce=layout.is_main)
        self._stopping = False
        # Host numbers and objects (global counts, sample ids, timelines) go over gloo (None: the
        # default group already is), never through the accelerator.
        self._host = host_group(layout)
        self._step, self._phase_name = 0, "starting"
        self._ahead: tuple | None = None  # (step, batch, HostInputs) built during the previous step
        self._loader_state: dict | None = None  # the loader's state before the step built ahead
        self._last = trainer_cfg.max_steps
        self._mux_metrics: dict = {}
        self.trace_step = trace_step
        # bf16 autocast as the layout's device rules take trainer.precision (auto: bf16 under CUDA's).
        self.bf16 = replace(layout.rules, precision=trainer_cfg.precision).bf16
        # CUDA's rules on the CPU: the strict device check (parallel/strict_device.py) runs every
        # step; the parameters and buffers are where a GPU would hold them.
        self.strict = StrictDevice() if layout.rules.emulated else None
        if self.strict is not None:
            for part in self.pm.parts:
                self.strict.mark_module(part)
        # Autocast keeps the bf16 copy of an fp32 weight for the whole autocast region (the
        # step). For fp32 DTensor parameters (FSDP's, TP's) used by several forwards before
        # their backwards (pipeline micro-batches, encoder calls at the cuts), that shared copy
        # gave wrong gradients (sharded encoder weights under pp=2: 30-80% off; tests/multiplex/
        # test_multiplex_equal_single.py). So they are cast at every use instead; bf16 FSDP
        # parameters (the GPU default) need no cast at all.
        self._autocast_cache = not any(isinstance(p, DTensor) and p.dtype == torch.float32
                                       for p in self.pm.parameters())

    @property
    def model(self) -> OmniModel:
        """The (first) model chunk this rank holds."""
        return self.pm.chunks[0]

    def _autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, cache_enabled=self._autocast_cache)

    def _counts(self, batch: StepBatch) -> tuple[float, float, float]:
        """(target tokens, real micro-batches, tokens) of the whole global batch, from host
        numbers over the host (gloo) group: nothing touches the accelerator. Peers that hold the
        same tokens (TP, PP) or the same micro-batches (CP) count them once."""
        holder = self.layout.counts_data
        targets = batch.num_target_tokens if holder else 0
        real = sum(1 for mb in batch.micro_batches if mb.sample_ids) if holder and self.layout.cp_rank == 0 else 0
        tokens = batch.num_tokens if holder else 0
        return tuple(all_reduce_sums([targets, real, tokens], torch.device("cpu"), self._host))

    def _prepare(self, row: tuple[MicroBatch, int], global_targets: float) -> Prepared:
        mb, real = row
        lengths = mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]
        longest = int(lengths.max()) if lengths.numel() else 0  # on the host, for the varlen kernels
        # The host row: prepare derives what it needs on the host (targets, CP hops) and moves
        # the row to the device once.
        return self.model.prepare(mb, global_targets, real_tokens=real, max_seqlen=longest, device=self.device)

    def _span(self, kind: str, name: str):
        tl = self.pm.timeline
        return tl.span(kind, name) if tl is not None else contextlib.nullcontext()

    def _phase(self, name: str) -> None:
        """Tell the watchdog (and a collective-timeout message) where this rank is."""
        self._phase_name = name
        self.watchdog.beat(self._step, name)

    def train_step(self, batch: StepBatch, step: int | None = None, inputs: HostInputs | None = None,
                   before_read: Callable[[], None] | None = None) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns the step's metrics.
        ``step``: the optimizer step it is (1-based; default fit's count), which picks the stage.
        ``inputs``: the step's host inputs when they were built ahead (``fit``); ``before_read``:
        host work to do while the device runs the step, before the host waits for its read (the
        next step's inputs)."""
        self._enter_stage(self._step if step is None else step)
        with self.strict_scope():
            if inputs is None:
                inputs = self._host_inputs(batch)
            window = contextlib.nullcontext() if self.strict is None else self.strict.device_window()
            with window:
                out = self._device_step(inputs, before_read)
        # Of the rows the LLM ran (every rank's, empty micro-batches included), the share that is
        # padding: what parallel.rows' per-row lengths keep small (the simulator's padded_fraction).
        rows = out.pop("row_tokens")
        out["padded_fraction"] = max(0.0, 1.0 - inputs.global_tokens / rows) if rows > 0 else 0.0
        if self.strict is not None:
            # what the strict check counted since the step's data arrived: the host syncs
            # (declared reads) and the batched host-to-device copies
            out.update(host_syncs=self.strict.sync_count, host_to_device_copies=self.strict.copies)
            self.strict.begin_step()
        return out

    def strict_scope(self):
        """The strict device check around what feeds a step too (``fit`` fetches the step's data
        under it: the features the data peers send ahead are device tensors, as on a GPU)."""
        return contextlib.nullcontext() if self.strict is None else self.strict

    def _enter_stage(self, step: int) -> None:
        """``trainer.stages``: the parameters whose gradients the stage of ``step`` drops
        (omni/runtime/stages.py), and one line when a stage begins (or a resumed run is in it)."""
        if self.stages is None:
            return
        stage = self.stages.at(max(step, 1))
        if stage is self._stage:
            return
        self._stage = stage
        # Every part's own parameters: a tied embedding's two copies on one rank both sit out.
        named = [(name, p) for part in self.pm.parts for name, p in part.named_parameters()]
        self._idle = self.stages.idle(stage, named)
        if self.layout.is_main:
            trainable = {self.stages.names.unit_of(name) for name, p in named if p.requires_grad}
            print(f"omni: {self.stages.describe(stage, trainable)}", flush=True)

    def _host_inputs(self, batch: StepBatch) -> HostInputs:
        """The step's host work: global counts (over the host group), the step's program, and
        every micro-batch's inputs built on the host, padded as the program says and moved to
        the device once."""
        global_targets, global_real, global_tokens = self._counts(batch)
        if global_targets == 0:
            raise UserError(f"step {batch.step} has no target tokens in the whole global batch; check the data")
        # Every rank divides by the same global count, so summing gradients over ranks and
        # micro-batches yields the gradient of the mean loss over the whole global batch. Router
        # losses are averaged over the global batch's micro-batches the same way.
        for chunk in self.pm.chunks:
            chunk.runtime.aux_weight = 1.0 / max(global_real, 1.0)
        mbs = list(batch.micro_batches)
        tokens = [mb.num_tokens for mb in mbs]
        program = plan_step(self.pm.shape, tokens)
        rows = [mb.padded(n, self.pad_id) for mb, n in zip(mbs, program.lengths)]
        mux = self.pm.multiplexer
        if mux is not None:
            # Every rank learns every group's media from host-side manifests (nothing is read
            # back from the device); groups with fewer micro-batches run empty ones, so the
            # encoder chunks line up.
            n = mux.gather([mux.describe(mb) for mb in rows], program.n_micro)
            if n != program.n_micro:
                program = plan_step(self.pm.shape, tokens, n)
        cp = mbs[0].cp if mbs else None
        rows += [MicroBatch.empty(cp).padded(n, self.pad_id) for n in program.lengths[len(rows):]]
        prepared = [self._prepare((mb, real), global_targets) for mb, real in zip(rows, program.real)]
        for i, p in enumerate(prepared):
            p.index = i
        if mux is not None:
            mux.plan(program, prepared[:len(mbs)])
        return HostInputs(program, prepared, global_targets, global_tokens)

    def _forward_backward(self, program: StepProgram, prepared: list[Prepared]) -> tuple[list[torch.Tensor],
                                                                                         list[torch.Tensor]]:
        """Forward and backward of the step's micro-batches, as its program orders them on every
        layout (one pipeline stage included): their CE sums and router losses (detached, on the
        device), in the order they ran. Every micro-batch runs, empty ones too: FSDP, TP, CP and
        EP collectives must happen the same number of times on every rank."""
        log = StageLog()
        mux = self.pm.multiplexer
        with self._autocast():
            if mux is not None:
                mux.before_pipeline()
            self.pm.runner.run(program.programs, program.shards, prepared, log,
                               at_cut=mux.cut if mux is not None and program.programs else None,
                               at_tail=mux.tail if mux is not None and program.shape.tail_cuts else None)
            if mux is not None:
                mux.finish()
        return log.ce_sums, log.aux_sums

    def _counts_loss(self) -> bool:
        """The last stage's TP ranks all hold the same (vocabulary-parallel) CE sum: one counts it."""
        return self.layout.tp_rank == 0 and any(ch.runtime.last_stage for ch in self.pm.chunks)

    def _device_step(self, inputs: HostInputs, before_read: Callable[[], None] | None = None) -> dict[str, float]:
        """Forward, backward, gradient sync and optimizer step. Losses stay on the device; the
        step reads the device once: one ``tolist`` of [CE sum, router loss, squared gradient
        norm], all-reduced together, which the log and the non-finite guard need (tests/runtime/
        test_no_host_sync.py holds it to that). ``before_read`` runs just before that read, while
        a GPU still works through the step. A fourth number rides along: whether this rank was
        asked to stop (a signal); summed over ranks, every rank stops after the same step."""
        ce_parts, aux_parts = self._forward_backward(inputs.program, inputs.prepared)
        lengths, global_targets = inputs.program.lengths, inputs.global_targets
        mux = self.pm.multiplexer
        self._mux_metrics = mux.step_metrics() if mux is not None else {}  # before the next step's plan
        self._phase("gradient sync")
        with self._span("comm", "gradient sync"):
            self.pm.sync_gradients()
            for p in self._idle:  # sitting this stage out: no update, no decay, not in the norm
                p.grad = None
        self._phase("optimizer")
        with self._span("optim", "clip and step"):
            params = list(self.pm.parameters())
            # torch.full, not torch.tensor: a host number becomes a device value without a copy
            stop = torch.full((), float(self._stop.requested), dtype=torch.float64, device=self.device)
            # The rows' padded lengths ride along, counted once per group holding the same rows.
            rows = torch.full((), float(sum(lengths) if self.layout.counts_data else 0), dtype=torch.float64,
                              device=self.device)
            sums = torch.stack([_device_sum(ce_parts if self._counts_loss() else [], self.device),
                                _device_sum(aux_parts, self.device),
                                local_grad_square_sum(params, self.layout.stage_world, self.pm.norm_skip,
                                                      self.device), stop, rows])
            if self.layout.world_size > 1:
                dist.all_reduce(sums)  # one collective for the loss, the router loss, the norm, the stop, the rows
            max_norm = self.clip if self.clip > 0 else math.inf
            scale_to_max_norm_(params, sums[2].sqrt(), max_norm)
            if before_read is not None:
                with self._host_work():
                    before_read()
            with host_read("the step's losses and gradient norm"):
                ce_sum, aux_sum, square, stops, row_tokens = sums.tolist()  # the step's one device read
            self._stopping = stops > 0
            loss_value, grad_norm = ce_sum / global_targets, math.sqrt(square)
            lr, group_lrs = self.optim.lr, self.optim.group_lrs()
            # The loss and the norm are the same on every rank (all-reduced), so every rank
            # skips the same steps. A skipped step leaves weights, optimizer moments and the lr
            # schedule as they were; only its gradients are dropped.
            bad = BadStepGuard.is_bad(loss_value, grad_norm) or not math.isfinite(aux_sum)
            if not bad:
                self.optim.step()
            self.optim.zero_grad()
        out = {"loss": loss_value, "lr": lr, **group_lrs, "grad_norm": grad_norm,
               "target_tokens": int(global_targets), "skipped": bad, "row_tokens": row_tokens}
        if self._stage is not None:
            out["stage"] = self._stage.number
        if aux_sum:
            out["aux_loss"] = aux_sum
        return out

    def losses_without_update(self, batch: StepBatch) -> list[torch.Tensor]:
        """The training step's forward and backward over ``batch``, with no update (validation,
        ``omni/runtime/validation.py``): the micro-batches' CE sums in order on the ranks that
        count the loss, none elsewhere. The backward runs because the training path is the one
        that is exact under every layout (the pipeline executor and the multiplexer interleave
        forwards and backwards); its gradients are dropped here, and nothing else moves: no
        gradient sync, optimizer, lr schedule, guard or spike detector."""
        inputs = self._host_inputs(batch)
        ce_parts, _ = self._forward_backward(inputs.program, inputs.prepared)
        for p in self.pm.parameters():
            p.grad = None
        return ce_parts if self._counts_loss() else []

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
        self._stopping = self._loop_done = False
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
                    if self._stopping:  # every rank read the same sum: all stop after this step
                        break
                self._loop_done = True  # (a stop's watch ends here: what follows is the save)
                bar.close()
                if self.layout.is_main and self.pm.timeline is not None and self.pm.timeline.enabled:
                    for line in summary.lines():
                        print(f"omni: {line}", flush=True)
                # A stop saves too (nothing is saved after a skipped step, though); a signal after
                # the last step's sum stops before the final evaluation, the end saved as usual.
                stopping = self._stopping or self._stop.requested
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
        exit_if_stuck(signum, lambda: self.watchdog._now, lambda: self._stopping or self._loop_done, grace,
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
        with self.strict_scope():
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
                inputs = self._host_inputs(batch)
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
        self._ahead = (step, batch, self._host_inputs(batch))
        self._phase(phase)

    def _host_work(self):
        """Host work inside the step's device window (the next step's inputs): host tensors
        there are host tensors, under the strict check too."""
        return contextlib.nullcontext() if self.strict is None else self.strict.outside_window()

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
        out.update(self._mux_metrics)  # the step's own plan (the next one may be planned already)
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
