"""Measure the model's forward+backward time per micro-batch, for fitting the cost model."""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from dataloading.construct.batch import MicroBatch
from omni.models.multimodal import OmniModel


def micro_batch_work(mb: MicroBatch) -> tuple[list[int], list[tuple[str, int]]]:
    """What the cost model sees of a micro-batch: document lengths and (modality, n) per item."""
    lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
    media = [(m, int(n)) for m, x in mb.media.items() for n in x.num_tokens.tolist()]
    return lengths, media


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_micro_batches(model: OmniModel, micro_batches: Sequence[MicroBatch], device: torch.device,
                       repeats: int = 3, progress=None) -> list[float]:
    """Median seconds of forward + backward per micro-batch (gradients are discarded).

    Every micro-batch runs once untimed first: the first pass over a new shape or modality
    pays for allocator growth and kernel selection, which is not the steady-state cost.
    """
    model.to(device).train()
    for mb in micro_batches:
        model(mb.to(device)).ce_sum.backward()
    model.zero_grad(set_to_none=True)
    times = []
    for mb in micro_batches:
        mb = mb.to(device)
        runs = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            parts = model(mb)
            loss = parts.ce_sum if parts.aux_loss is None else parts.ce_sum + parts.aux_loss
            loss.backward()
            _sync(device)
            runs.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        times.append(statistics.median(runs))
        if progress is not None:
            progress.update(1)
    return times
