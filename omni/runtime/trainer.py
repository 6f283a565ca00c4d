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

from dataloading.batch import MicroBatch, StepBatch
from omni.errors import UserError
from omni.models.multimodal import OmniModel
from omni.runtime.checkpoint import Checkpointer
from omni.runtime.config import CheckpointConfig, OptimConfig, TrainerConfig
from omni.runtime.evaluate import evaluate
from omni.runtime.metrics import MetricsLog, progress_bar
from omni.runtime.optim import build_optimizer, build_scheduler
from parallel.data_parallel import all_reduce_gradients, all_reduce_sum
from parallel.layout import Layout


@dataclass
class FitResult:
    last_step: int
    losses: list[float]
    eval_accuracy: float | None


class Trainer:
    def __init__(
        self,
        model: OmniModel,
        loader,  # StepLoader-like: iterator of StepBatch with state_dict()/load_state_dict()
        layout: Layout,
        trainer_cfg: TrainerConfig,
        optim_cfg: OptimConfig,
        ckpt_cfg: CheckpointConfig,
        tokenizer=None,
        eval_samples: Callable[[], Iterable[tuple[MicroBatch, str]]] | None = None,
    ):
        self.cfg = trainer_cfg
        self.layout = layout
        self.device = layout.device
        self.model = model.to(self.device)
        self.loader = loader
        self.tokenizer = tokenizer
        self.eval_samples = eval_samples
        self.optimizer = build_optimizer(self.model, optim_cfg)
        self.scheduler = build_scheduler(self.optimizer, optim_cfg, trainer_cfg.max_steps)
        self.clip = optim_cfg.clip_grad_norm
        self.run_dir = Path(trainer_cfg.run_dir)
        self.ckpt_cfg = ckpt_cfg
        self.checkpointer = Checkpointer(ckpt_cfg, self.run_dir, rank=layout.rank)
        self.metrics = MetricsLog(self.run_dir, enabled=layout.is_main, tensorboard=trainer_cfg.tensorboard)
        self.bf16 = trainer_cfg.precision == "bf16" or (trainer_cfg.precision == "auto" and self.device.type == "cuda")

    def _autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def train_step(self, batch: StepBatch) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns the step's metrics."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        # Every rank divides by the same global count, so summing gradients over ranks and
        # micro-batches yields the gradient of the mean loss over the whole global batch.
        global_targets = all_reduce_sum(batch.num_target_tokens, self.device)
        if global_targets == 0:
            raise UserError(f"step {batch.step} has no target tokens in the whole global batch; check the data")
        # Placeholder micro-batches (no samples: the planner gave this rank less work) carry no
        # loss; with data parallelism alone nothing needs them, so they are not run.
        # FSDP and pipeline schedules will have to run them to keep their collectives in step.
        real = [mb for mb in batch.micro_batches if mb.sample_ids]
        n_micro = max(1, len(real))
        ce_total = 0.0
        aux_total = 0.0
        for mb in real:
            with self._autocast():
                parts = self.model(mb.to(self.device))
                loss = parts.ce_sum / global_targets
                if parts.aux_loss is not None:
                    # Router losses are per micro-batch means already; average them over micro-batches.
                    loss = loss + parts.aux_loss / n_micro
                    aux_total += float(parts.aux_loss.detach()) / n_micro
            loss.backward()
            ce_total += float(parts.ce_sum.detach())
        all_reduce_gradients(params)
        max_norm = self.clip if self.clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_value = all_reduce_sum(ce_total, self.device) / global_targets
        if not math.isfinite(loss_value):
            raise UserError(
                f"the loss became {loss_value} at step {batch.step}; lower optim.lr or raise optim.warmup_steps"
            )
        out = {"loss": loss_value, "lr": lr, "grad_norm": grad_norm, "target_tokens": int(global_targets)}
        if aux_total:
            out["aux_loss"] = aux_total
        return out

    def fit(self) -> FitResult:
        start = 0
        resume = self.checkpointer.resume_path()
        if resume is not None:
            restored = self.checkpointer.load(resume, self.model, self.optimizer, self.scheduler)
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
        self.model.train()
        for step in range(start + 1, last + 1):
            t0 = time.perf_counter()
            batch = next(it)
            stats = self.train_step(batch)
            dt = time.perf_counter() - t0
            tokens = all_reduce_sum(batch.num_tokens, self.device)
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
                self.checkpointer.save(step, self.model, self.optimizer, self.scheduler, self.loader.state_dict())
                last_saved = step
        bar.close()
        if self.ckpt_cfg.save_at_end and step > last_saved:
            self.checkpointer.save(step, self.model, self.optimizer, self.scheduler, self.loader.state_dict())
        finished = step >= self.cfg.max_steps
        accuracy = self._final_eval(step) if finished and self.cfg.eval_at_end and self.eval_samples else None
        self.metrics.close()
        return FitResult(last_step=step, losses=losses, eval_accuracy=accuracy)

    def _final_eval(self, step: int) -> float:
        # Every rank evaluates the same held-out samples; rank 0 reports.
        result = evaluate(
            self.model,
            self.eval_samples(),
            self.tokenizer,
            self.device,
            max_new_tokens=self.cfg.max_new_tokens,
            batch_size=self.cfg.eval_batch_size,
            limit=self.cfg.eval_samples,
        )
        self.metrics.write(
            {"event": "eval", "step": step, "accuracy": result.accuracy, "num_samples": result.num_samples,
             "accuracy_by_group": result.by_group, "misses": result.examples}
        )
        if self.layout.is_main:
            groups = ", ".join(f"{g} {a:.3f}" for g, a in result.by_group.items())
            print(f"omni: held-out exact-match accuracy {result.accuracy:.3f} on {result.num_samples} samples "
                  f"({groups})", flush=True)
        return result.accuracy
