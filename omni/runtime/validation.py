"""Periodic validation loss (``trainer.eval_every``): the mean next-token loss over the target
tokens of the held-out set, per group (the eval folder's sub-folders) and overall.

Every rank holds the same validation micro-batches (``dataloading.construct.held_out.ValidationSet``,
built the same way everywhere); data-parallel rank r takes every dp-th of them, and its TP, CP
and PP peers the same ones (CP ranks their zig-zag slice), as the training loader hands a step
out. The share runs through the training step's own forward and backward
(``StepRunner.losses_without_update``: exact under every layout, multiplexing included), with no
update and its gradients dropped. The per-group CE sums of all ranks meet in one all-reduce,
and the losses are divided by the target tokens counted on the host.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from dataloading.construct.batch import StepBatch
from dataloading.construct.constructor import dummy_micro_batch
from dataloading.construct.context_parallel import slice_for_cp
from dataloading.construct.held_out import ValidationBatch
from omni.errors import UserError
from parallel.strict_device import host_read
from parallel.layout import Layout


class Validator:
    def __init__(self, batches: Sequence[ValidationBatch], layout: Layout, every: int, pad_id: int = 0):
        """``batches``: the whole validation set, in the same order on every rank."""
        self.every = every
        self.layout = layout
        self.groups = sorted({b.group for b in batches})
        self.targets = {g: sum(b.micro_batch.num_target_tokens for b in batches if b.group == g) for g in self.groups}
        if sum(self.targets.values()) == 0:
            raise UserError("trainer.eval_every: the held-out set has no sample with target tokens to validate on; "
                            "check data.eval_dir (or the mixture's eval: folder), or set trainer.eval_every=0")
        dp, cp = layout.dp_size, layout.sizes.cp
        mine = list(batches)[layout.dp_rank::dp]
        # Every data-parallel rank runs as many micro-batches (their collectives must pair up):
        # the short ones add one-token micro-batches without targets.
        count = -(-len(batches) // dp)
        self._group_of = torch.tensor([self.groups.index(b.group) for b in mine], dtype=torch.int64)
        rows = [b.micro_batch for b in mine] + [dummy_micro_batch(pad_id)] * (count - len(mine))
        if cp > 1:
            rows = [slice_for_cp(mb, cp, layout.cp_rank, pad_id) for mb in rows]
        self._rows = rows

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def run(self, trainer, step: int) -> dict:
        """Validate the weights after ``step`` (a collective: every rank calls it at the same
        steps); the metrics.jsonl record (the same on every rank)."""
        ce = trainer.steps.losses_without_update(StepBatch(step, list(self._rows)))
        device = self.layout.device
        sums = torch.zeros(len(self.groups), dtype=torch.float64, device=device)
        mine = len(self._group_of)
        if ce and mine:  # this rank counts the loss: its share's CE sums, by group
            sums.index_add_(0, self._group_of.to(device), torch.stack([c.to(torch.float64) for c in ce[:mine]]))
        if self.layout.world_size > 1:
            dist.all_reduce(sums)
        with host_read("the validation losses"):
            totals = sums.tolist()  # the validation's one device read
        tokens = sum(self.targets.values())
        record = {"event": "validation", "step": step, "val_loss": sum(totals) / tokens,
                  "val_loss_by_group": {g: t / self.targets[g] for g, t in zip(self.groups, totals)
                                        if self.targets[g]},
                  "val_tokens": tokens}
        if self.layout.is_main:
            groups = ", ".join(f"{g} {v:.4f}" for g, v in record["val_loss_by_group"].items())
            print(f"omni: step {step} validation loss {record['val_loss']:.4f} ({groups}) over {tokens} target "
                  "tokens", flush=True)
        return record
