"""The training loop: micro-batch accumulation, global-token loss normalisation, AdamW with
warmup + cosine, clipping, checkpoints, metrics, and the held-out evaluation at the end."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch.distributed.fsdp import FSDPModule

from dataloading.batch import MicroBatch, StepBatch
from omni.errors import UserError
from omni.models.multimodal import OmniModel
from omni.runtime.checkpoint import Checkpointer
from omni.runtime.config import CheckpointConfig, OptimConfig, TrainerConfig
from omni.runtime.evaluate import evaluate
from omni.runtime.metrics import MetricsLog, progress_bar
from omni.runtime.optim import PartOptimizers
from omni.models.multimodal import Prepared
from omni.runtime.parallelize import ParallelModel, gather_full_model
from omni.runtime.timeline import (RunSummary, gather_step_times, peak_memory, reset_peak_memory, summarise_ranks,
                                   write_chrome_trace)
from parallel.data_parallel import all_reduce_sums
from parallel.grad_norm import clip_grads
from parallel.layout import Layout
from parallel.pipeline import microbatch_count


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@dataclass
class FitResult:
    last_step: int
    losses: list[float]
    eval_accuracy: float | None


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
    ):
        """``model``: a ParallelModel from ``omni.runtime.parallelize`` (a bare OmniModel is
        wrapped as the one-process layout). ``full_model`` builds an unsharded model, into which
        the final evaluation gathers the weights when the layout splits them."""
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
        self.optim = PartOptimizers(self.pm.parts, optim_cfg, trainer_cfg.max_steps)
        self.clip = optim_cfg.clip_grad_norm
        self.run_dir = Path(trainer_cfg.run_dir)
        self.ckpt_cfg = ckpt_cfg
        self.checkpointer = Checkpointer(ckpt_cfg, self.run_dir, rank=layout.rank)
        self.metrics = MetricsLog(self.run_dir, enabled=layout.is_main, tensorboard=trainer_cfg.tensorboard)
        self.trace_step = trace_step
        self.bf16 = trainer_cfg.precision == "bf16" or (trainer_cfg.precision == "auto" and self.device.type == "cuda")

    @property
    def model(self) -> OmniModel:
        """The (first) model chunk this rank holds."""
        return self.pm.chunks[0]

    def _autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _counts(self, batch: StepBatch) -> tuple[float, float]:
        """(target tokens, real micro-batches) of the whole global batch. Peers that hold the
        same tokens (TP, PP) or the same micro-batches (CP) count them once."""
        holder = self.layout.counts_data
        targets = batch.num_target_tokens if holder else 0
        real = sum(1 for mb in batch.micro_batches if mb.sample_ids) if holder and self.layout.cp_rank == 0 else 0
        return tuple(all_reduce_sums([targets, real], self.device))

    def _rows(self, batch: StepBatch) -> tuple[list[tuple[MicroBatch, int]], int]:
        """Every micro-batch padded as the layout needs (and, under PP, to one length and a
        schedulable count), still on the host, with its real token count; and the common length
        (0 when lengths may differ)."""
        tp, pp = self.layout.sizes.tp, self.layout.sizes.pp
        mbs = list(batch.micro_batches)
        length = 0
        if pp > 1:
            mbs += [MicroBatch.empty(mbs[0].cp if mbs else None)] * (microbatch_count(len(mbs), pp) - len(mbs))
            unit = 8 * tp  # coarse lengths: few distinct activation shapes, so few cached schedules
            length = _round_up(max(max(mb.num_tokens for mb in mbs), 1), unit)
        return [self._pad(mb, length) for mb in mbs], length

    def _pad(self, mb: MicroBatch, length: int) -> tuple[MicroBatch, int]:
        target = length or _round_up(max(mb.num_tokens, 1), self.layout.sizes.tp)
        return mb.padded(target, self.pad_id), mb.num_tokens

    def _prepare(self, row: tuple[MicroBatch, int], global_targets: float) -> Prepared:
        mb, real = row
        lengths = mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]
        longest = int(lengths.max()) if lengths.numel() else 0  # on the host, for the varlen kernels
        return self.model.prepare(mb.to(self.device), global_targets, real_tokens=real, max_seqlen=longest)

    def _span(self, kind: str, name: str):
        tl = self.pm.timeline
        return tl.span(kind, name) if tl is not None else contextlib.nullcontext()

    def train_step(self, batch: StepBatch) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns the step's metrics."""
        global_targets, global_real = self._counts(batch)
        if global_targets == 0:
            raise UserError(f"step {batch.step} has no target tokens in the whole global batch; check the data")
        # Every rank divides by the same global count, so summing gradients over ranks and
        # micro-batches yields the gradient of the mean loss over the whole global batch. Router
        # losses are averaged over the global batch's micro-batches the same way.
        for chunk in self.pm.chunks:
            chunk.runtime.aux_weight = 1.0 / max(global_real, 1.0)
        rows, length = self._rows(batch)
        prepared = [self._prepare(row, global_targets) for row in rows]
        mux = self.pm.multiplexer
        if mux is not None:
            # Every rank learns every group's media and plans the encoder chunks, from host-side
            # manifests (nothing is read back from the device); groups with fewer micro-batches
            # run empty ones, so the encoder chunks line up.
            n = mux.begin_step(prepared, [mux.describe(mb) for mb, _ in rows])
            cp = rows[0][0].cp if rows else None
            prepared += [self._prepare(self._pad(MicroBatch.empty(cp), length), global_targets)
                         for _ in range(n - len(prepared))]
        for i, p in enumerate(prepared):
            p.index = i
        ce_total, aux_total = 0.0, 0.0
        if self.pm.runner is not None:
            for chunk in self.pm.chunks:
                chunk.feed.reset(prepared)
            with self._autocast():
                if mux is not None:
                    mux.before_pipeline()
                # Between stages a TP rank holds its sequence shard of each row.
                self.pm.runner.run(length // self.layout.sizes.tp, len(prepared))
                if mux is not None:
                    mux.finish()
            for chunk in self.pm.chunks:
                ce_total += sum(chunk.feed.ce_sums)
                aux_total += sum(chunk.feed.aux_sums)
        else:
            # Every micro-batch runs, placeholders too: FSDP, TP, CP and EP collectives must
            # happen the same number of times on every rank.
            defer = not self.layout.config.fsdp_reduce_every_microbatch and isinstance(self.model, FSDPModule)
            if mux is not None:
                mux.before_pipeline()
            for i, p in enumerate(prepared):
                if defer:  # reduce-scatter once, after the last micro-batch
                    self.model.set_requires_gradient_sync(i == len(prepared) - 1)
                if mux is not None:
                    with self._autocast():
                        mux.cut(i)  # this micro-batch's encoder chunk, and the previous one's backward
                with self._autocast(), self._span("llm", f"forward mb{i}"):
                    parts = self.model(p)
                    loss = parts.ce_sum / global_targets
                with self._span("llm", f"backward mb{i}"):
                    loss.backward()
                ce_total += float(parts.ce_sum.detach())
                if parts.aux_loss is not None:
                    aux_total += float(parts.aux_loss)
            if mux is not None:
                with self._autocast():
                    mux.finish()
        with self._span("comm", "gradient sync"):
            self.pm.sync_gradients()
        with self._span("optim", "clip and step"):
            max_norm = self.clip if self.clip > 0 else math.inf
            grad_norm = clip_grads(list(self.pm.parameters()), max_norm, self.layout.stage_world,
                                   self.pm.norm_skip, self.device)
            lr = self.optim.lr
            self.optim.step()
            self.optim.zero_grad()
        # The last stage's TP ranks all hold the same (vocabulary-parallel) CE sum.
        counts_loss = self.layout.tp_rank == 0 and any(ch.runtime.last_stage for ch in self.pm.chunks)
        ce_sum, aux_sum = all_reduce_sums([ce_total if counts_loss else 0.0, aux_total], self.device)
        loss_value = ce_sum / global_targets
        if not math.isfinite(loss_value):
            raise UserError(
                f"the loss became {loss_value} at step {batch.step}; lower optim.lr or raise optim.warmup_steps"
            )
        out = {"loss": loss_value, "lr": lr, "grad_norm": grad_norm, "target_tokens": int(global_targets)}
        if aux_sum:
            out["aux_loss"] = aux_sum
        return out

    def fit(self) -> FitResult:
        start = 0
        resume = self.checkpointer.resume_path()
        if resume is not None:
            restored = self.checkpointer.load(resume, self.optim)
            start = restored.step
            self.loader.load_state_dict(restored.loader_state)
            self.metrics.truncate_after(start)
            if self.layout.is_main:
                print(f"omni: resumed from {resume} (step {start})", flush=True)
        losses: list[float] = []
        last_saved = start
        bar = progress_bar(self.cfg.max_steps, start, enabled=self.cfg.progress and self.layout.is_main)
        it = iter(self.loader)
        step = start
        last = min(self.cfg.max_steps, self.cfg.stop_at or self.cfg.max_steps)
        for part in self.pm.parts:
            part.train()
        summary = RunSummary()
        for step in range(start + 1, last + 1):
            t0 = time.perf_counter()
            batch = next(it)
            reset_peak_memory(self.device)
            if self.pm.timeline is not None:
                self.pm.timeline.begin_step(step)
            stats = self.train_step(batch)
            stats.update(self._step_profile(step))
            summary.add(stats)
            dt = time.perf_counter() - t0
            tokens = all_reduce_sums([batch.num_tokens if self.layout.counts_data else 0], self.device)[0]
            record = {"step": step, **stats, "tokens_per_s": tokens / dt, "step_time_s": dt,
                      "data_wait_s": batch.data_wait_s, **batch.plan_stats}
            # Running totals kept by the loader (and in its checkpointed state), index-time ones included.
            problems = getattr(self.loader, "problems", None) or batch.problems
            if problems:
                record["data_problems"] = dict(problems)
            losses.append(stats["loss"])
            if step % self.cfg.log_every == 0 or step == self.cfg.max_steps:
                self.metrics.write(record)
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", tok_s=f"{tokens / dt:,.0f}", lr=f"{stats['lr']:.2e}")
            if self.ckpt_cfg.every and step % self.ckpt_cfg.every == 0:
                self.checkpointer.save(step, self.optim, self.loader.state_dict())
                last_saved = step
        bar.close()
        if self.layout.is_main and self.pm.timeline is not None and self.pm.timeline.enabled:
            for line in summary.lines():
                print(f"omni: {line}", flush=True)
        if self.ckpt_cfg.save_at_end and step > last_saved:
            self.checkpointer.save(step, self.optim, self.loader.state_dict())
        finished = step >= self.cfg.max_steps
        accuracy = self._final_eval(step) if finished and self.cfg.eval_at_end and self.eval_samples else None
        self.metrics.close()
        return FitResult(last_step=step, losses=losses, eval_accuracy=accuracy)

    def _step_profile(self, step: int) -> dict:
        """The step's time split over ranks (encoder / LLM / communication / idle), the
        encoder plan's figures and peak memory; the Chrome trace of ``multiplex.trace_step``."""
        out: dict = {}
        tl = self.pm.timeline
        if tl is not None and tl.enabled:
            trace = step == self.trace_step
            per_rank = gather_step_times(tl.end_step(), keep_events=trace)
            out.update(summarise_ranks(per_rank))
            if trace and self.layout.is_main:
                write_chrome_trace(self.run_dir / f"trace_step{step}.json", per_rank)
        if self.pm.multiplexer is not None:
            out.update(self.pm.multiplexer.step_metrics())
        out.update(peak_memory(self.device))
        return out

    def _final_eval(self, step: int) -> float | None:
        """Greedy generation needs the whole model: under a split layout the weights are
        gathered into an unsharded copy on rank 0, which evaluates alone (others get None)."""
        if self.layout.world_size > 1:
            if self.full_model is None:
                return None
            model = gather_full_model(self.pm, self.layout, self.full_model)
            if model is None:
                return None
            whole = contextlib.nullcontext(model.to(self.device))
        else:
            whole = self.pm.inline_encoders()
        with whole as model:
            result = evaluate(model, self.eval_samples(), self.tokenizer, self.device,
                              max_new_tokens=self.cfg.max_new_tokens, batch_size=self.cfg.eval_batch_size,
                              limit=self.cfg.eval_samples)
        self.metrics.write(
            {"event": "eval", "step": step, "accuracy": result.accuracy, "num_samples": result.num_samples,
             "accuracy_by_group": result.by_group, "misses": result.examples}
        )
        if self.layout.is_main:
            groups = ", ".join(f"{g} {a:.3f}" for g, a in result.by_group.items())
            print(f"omni: held-out exact-match accuracy {result.accuracy:.3f} on {result.num_samples} samples "
                  f"({groups})", flush=True)
        return result.accuracy
