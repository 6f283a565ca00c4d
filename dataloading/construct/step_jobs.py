"""A step's work as both data backends run it: the job one rank's constructor gets for a step
(``step_job``), building it (``BuildSteps``: the DataLoader workers' dataset and what the Ray
constructor actors run), and a data error carried back whole (``FailedStep``). Its own module so
that the inline loader and the Ray actors share it without importing each other."""
from __future__ import annotations

import os

import torch.utils.data as tud

from dataloading.construct.batch import StepBatch
from dataloading.construct.constructor import SampleConstructor
from dataloading.errors import DataError
from dataloading.plan.planner import StepPlan

SLOT_BYTES = 512  # per worker: "<pid> <step> <unit id>" of the sample it is on


class FailedStep:
    """A data error met while building a step in a worker or actor, carried back whole
    (DataLoader and Ray would re-wrap it as a multi-line traceback and lose its kind)."""

    def __init__(self, error: DataError):
        self.message, self.kind = str(error), error.kind


def step_job(plan: StepPlan, rank: int, state_after: dict) -> tuple:
    """What one rank's constructor needs for a step (both backends): (step, its micro-batches
    of unit ids, samples planned out, the step's balance over all ranks, the planner state
    after the step)."""
    stats = {"balance_max_over_mean": plan.stats["max_over_mean"],
             "balance_lower_bound": plan.stats["lower_bound"],
             "utilisation": plan.stats.get("utilisation", 1.0)}
    return plan.step, plan.rank(rank), plan.skipped, stats, state_after


class BuildSteps(tud.Dataset):
    """Builds one rank's step from a job (``step_job``): the 'dataset' the DataLoader workers
    index with jobs, and what the Ray constructor actors run."""

    def __init__(self, constructor: SampleConstructor, slots):
        self.constructor = constructor
        self.slots = slots

    def _mark(self, step: int, unit_id: str) -> None:
        info = tud.get_worker_info()
        if info is None or self.slots is None:
            return
        text = f"{os.getpid()} {step} {unit_id}".encode()[:SLOT_BYTES - 1]
        off = info.id * SLOT_BYTES
        self.slots[off:off + len(text) + 1] = text + b"\0"

    def __getitem__(self, job):
        step, micro_batches, skipped, stats, state = job
        try:
            mbs, met = self.constructor.build_planned(micro_batches, on_sample=lambda u: self._mark(step, u))
        except DataError as e:
            return FailedStep(e)
        for kind, n in skipped.items():  # planned out (over budget, too many media): counted too
            met[kind] = met.get(kind, 0) + n
        return StepBatch(step, mbs, met, plan_stats=stats), state
