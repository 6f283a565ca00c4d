"""One optimizer step on this rank: the step's host inputs (global counts, its program, rows
ready on the device), forward and backward as the program orders them, the gradient sync,
clipping and the optimizer, with one read of the device per step.

``omni.runtime.trainer.Trainer`` owns the run around the steps (resume, the loop, saves,
stops, logging); this class owns the step itself, so the two can be read (and tested) apart.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dataloading.construct.batch import MicroBatch, StepBatch
from omni.errors import UserError
from omni.models.multimodal import OmniModel, Prepared, StageLog
from omni.runtime.guards import BadStepGuard
from omni.runtime.optim import PartOptimizers
from omni.runtime.parallelize import ParallelModel
from omni.runtime.stages import Stage, StageSchedule
from omni.step import StepProgram, plan_step
from parallel.data_parallel import all_reduce_sums
from parallel.grad_norm import local_grad_square_sum, scale_to_max_norm_
from parallel.layout import Layout
from parallel.strict_device import StrictDevice, host_read


def _device_sum(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of detached 0-dim losses in fp64 (the precision the logged totals always had),
    on the device: nothing is read back."""
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([p.to(torch.float64) for p in parts]).sum()


@dataclass
class HostInputs:
    """A step's host work (``StepRunner.host_inputs``): its program (``omni.step.plan_step``: the
    micro-batch count, each row's length, every pipeline rank's actions), its micro-batches
    ready on the device, and the global batch's target and token counts."""

    program: StepProgram
    prepared: list[Prepared]
    global_targets: float
    global_tokens: float


class StepRunner:
    def __init__(self, pm: ParallelModel, layout: Layout, optim: PartOptimizers, *, clip: float, precision: str,
                 pad_id: int, stages: StageSchedule | None, host: dist.ProcessGroup | None,
                 phase: Callable[[str], None], stop_requested: Callable[[], bool]):
        """``host``: the group host numbers (global counts) go over (``parallel.layout.host_group``:
        gloo, never the accelerator; None: the default group already is). ``phase`` tells the hang watchdog where the step is; ``stop_requested`` whether a
        signal asked this rank to stop (it rides along with the step's one read, so every rank
        learns whether any was asked: ``stopping``)."""
        self.pm, self.layout, self.device, self.optim = pm, layout, layout.device, optim
        self.clip, self.pad_id, self.stages = clip, pad_id, stages
        self._phase, self._stop_requested = phase, stop_requested
        self.stage: Stage | None = None
        self._idle: list[torch.nn.Parameter] = []  # trainable, but sitting the current stage out
        self.stopping = False  # some rank was asked to stop: every rank stops after this step
        self.mux_metrics: dict = {}  # the last step's multiplexing plan figures
        self._host = host
        # bf16 autocast as the layout's device rules take trainer.precision (auto: bf16 under CUDA's).
        self.bf16 = replace(layout.rules, precision=precision).bf16
        # CUDA's rules on the CPU: the strict device check (parallel/strict_device.py) runs every
        # step; the parameters and buffers are where a GPU would hold them.
        self.strict = StrictDevice() if layout.rules.emulated else None
        if self.strict is not None:
            for part in pm.parts:
                self.strict.mark_module(part)
        # Autocast keeps the bf16 copy of an fp32 weight for the whole autocast region (the
        # step). For fp32 DTensor parameters (FSDP's, TP's) used by several forwards before
        # their backwards (pipeline micro-batches, encoder calls at the cuts), that shared copy
        # gave wrong gradients (sharded encoder weights under pp=2: 30-80% off; tests/multiplex/
        # test_multiplex_equal_single.py). So they are cast at every use instead; bf16 FSDP
        # parameters (the GPU default) need no cast at all.
        self._autocast_cache = not any(isinstance(p, DTensor) and p.dtype == torch.float32
                                       for p in pm.parameters())

    @property
    def model(self) -> OmniModel:
        """The (first) model chunk this rank holds."""
        return self.pm.chunks[0]

    def autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, cache_enabled=self._autocast_cache)

    def strict_scope(self):
        """The strict device check around what feeds a step too (``fit`` fetches the step's data
        under it: the features the data peers send ahead are device tensors, as on a GPU)."""
        return contextlib.nullcontext() if self.strict is None else self.strict

    def host_work(self):
        """Host work inside the step's device window (the next step's inputs): host tensors
        there are host tensors, under the strict check too."""
        return contextlib.nullcontext() if self.strict is None else self.strict.outside_window()

    def _span(self, kind: str, name: str):
        tl = self.pm.timeline
        return tl.span(kind, name) if tl is not None else contextlib.nullcontext()

    # ---- the step ---------------------------------------------------------------------
    def run(self, batch: StepBatch, step: int, inputs: HostInputs | None = None,
            before_read: Callable[[], None] | None = None) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns the step's metrics.
        ``step``: the optimizer step it is (1-based), which picks the training stage.
        ``inputs``: the step's host inputs when they were built ahead; ``before_read``: host
        work to do while the device runs the step, before the host waits for its read."""
        self.enter_stage(step)
        with self.strict_scope():
            if inputs is None:
                inputs = self.host_inputs(batch)
            window = contextlib.nullcontext() if self.strict is None else self.strict.device_window()
            with window:
                out = self.device_step(inputs, before_read)
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

    def enter_stage(self, step: int) -> None:
        """``trainer.stages``: the parameters whose gradients the stage of ``step`` drops
        (omni/runtime/stages.py), and one line when a stage begins (or a resumed run is in it)."""
        if self.stages is None:
            return
        stage = self.stages.at(max(step, 1))
        if stage is self.stage:
            return
        self.stage = stage
        # Every part's own parameters: a tied embedding's two copies on one rank both sit out.
        named = [(name, p) for part in self.pm.parts for name, p in part.named_parameters()]
        self._idle = self.stages.idle(stage, named)
        if self.layout.is_main:
            trainable = {self.stages.names.unit_of(name) for name, p in named if p.requires_grad}
            print(f"omni: {self.stages.describe(stage, trainable)}", flush=True)

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

    def host_inputs(self, batch: StepBatch) -> HostInputs:
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

    def forward_backward(self, program: StepProgram, prepared: list[Prepared]) -> tuple[list[torch.Tensor],
                                                                                        list[torch.Tensor]]:
        """Forward and backward of the step's micro-batches, as its program orders them on every
        layout (one pipeline stage included): their CE sums and router losses (detached, on the
        device), in the order they ran. Every micro-batch runs, empty ones too: FSDP, TP, CP and
        EP collectives must happen the same number of times on every rank."""
        log = StageLog()
        mux = self.pm.multiplexer
        with self.autocast():
            if mux is not None:
                mux.before_pipeline()
            self.pm.runner.run(program.programs, program.shards, prepared, log,
                               at_cut=mux.cut if mux is not None and program.programs else None,
                               at_tail=mux.tail if mux is not None and program.shape.tail_cuts else None)
            if mux is not None:
                mux.finish()
        return log.ce_sums, log.aux_sums

    def counts_loss(self) -> bool:
        """The last stage's TP ranks all hold the same (vocabulary-parallel) CE sum: one counts it."""
        return self.layout.tp_rank == 0 and any(ch.runtime.last_stage for ch in self.pm.chunks)

    def device_step(self, inputs: HostInputs, before_read: Callable[[], None] | None = None) -> dict[str, float]:
        """Forward, backward, gradient sync and optimizer step. Losses stay on the device; the
        step reads the device once: one ``tolist`` of [CE sum, router loss, squared gradient
        norm], all-reduced together, which the log and the non-finite guard need (tests/runtime/
        test_no_host_sync.py holds it to that). ``before_read`` runs just before that read, while
        a GPU still works through the step. A fourth number rides along: whether this rank was
        asked to stop (a signal); summed over ranks, every rank stops after the same step."""
        ce_parts, aux_parts = self.forward_backward(inputs.program, inputs.prepared)
        lengths, global_targets = inputs.program.lengths, inputs.global_targets
        mux = self.pm.multiplexer
        self.mux_metrics = mux.step_metrics() if mux is not None else {}  # before the next step's plan
        self._phase("gradient sync")
        with self._span("comm", "gradient sync"):
            self.pm.sync_gradients()
            for p in self._idle:  # sitting this stage out: no update, no decay, not in the norm
                p.grad = None
        self._phase("optimizer")
        with self._span("optim", "clip and step"):
            params = list(self.pm.parameters())
            # torch.full, not torch.tensor: a host number becomes a device value without a copy
            stop = torch.full((), float(self._stop_requested()), dtype=torch.float64, device=self.device)
            # The rows' padded lengths ride along, counted once per group holding the same rows.
            rows = torch.full((), float(sum(lengths) if self.layout.counts_data else 0), dtype=torch.float64,
                              device=self.device)
            sums = torch.stack([_device_sum(ce_parts if self.counts_loss() else [], self.device),
                                _device_sum(aux_parts, self.device),
                                local_grad_square_sum(params, self.layout.stage_world, self.pm.norm_skip,
                                                      self.device), stop, rows])
            if self.layout.world_size > 1:
                dist.all_reduce(sums)  # one collective for the loss, the router loss, the norm, the stop, the rows
            max_norm = self.clip if self.clip > 0 else math.inf
            scale_to_max_norm_(params, sums[2].sqrt(), max_norm)
            if before_read is not None:
                with self.host_work():
                    before_read()
            with host_read("the step's losses and gradient norm"):
                ce_sum, aux_sum, square, stops, row_tokens = sums.tolist()  # the step's one device read
            self.stopping = stops > 0
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
        if self.stage is not None:
            out["stage"] = self.stage.number
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
        inputs = self.host_inputs(batch)
        ce_parts, _ = self.forward_backward(inputs.program, inputs.prepared)
        for p in self.pm.parameters():
            p.grad = None
        return ce_parts if self.counts_loss() else []
