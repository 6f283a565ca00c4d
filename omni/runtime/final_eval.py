"""The end-of-run held-out evaluation (``trainer.eval_at_end``): greedy generation over the
held-out set, under any layout.

Greedy generation needs the whole model. Under a split layout every rank gets a full copy on
its own device (``omni.runtime.full_model.replicate_full_model``) and generates for its share of
the held-out samples, and the shares are joined; above ``trainer.eval_max_gib`` that copy is not
made and the evaluation is skipped with a note (every rank would hold the whole model beside
its training state). Before, the weights were gathered into rank 0's host memory and generated
there on the CPU while every GPU waited: hours for a 7B model.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch.distributed as dist

from omni.runtime.config import TrainerConfig
from omni.runtime.evaluate import EvalResult, evaluate, merge_results
from omni.runtime.full_model import model_bytes, replicate_full_model
from omni.runtime.parallelize import ParallelModel
from parallel.layout import Layout


def final_evaluation(pm: ParallelModel, layout: Layout, cfg: TrainerConfig, samples: Callable[[], Iterable],
                     tokenizer, full_model: Callable | None, host_group, phase: Callable[[str], None]) -> EvalResult | None:
    """The joined result on every rank, or None (no full-model builder under a split layout, or
    a model over ``cfg.eval_max_gib``). ``full_model`` builds the unsharded model's skeleton on
    the meta device; ``host_group``: the gloo group the shares' results travel over;
    ``phase``: tells the hang watchdog what this rank does."""
    shard = (0, 1)
    if layout.world_size > 1:
        if full_model is None:
            return None
        size = model_bytes(full_model()) / 2**30  # the meta skeleton: shapes and dtypes only
        if size > cfg.eval_max_gib:
            if layout.is_main:
                print(f"omni: end-of-run evaluation skipped: every rank would hold the whole {size:.1f} GiB model, "
                      f"over trainer.eval_max_gib={cfg.eval_max_gib:g}; evaluate with omni export and omni "
                      f"generate, or raise trainer.eval_max_gib", flush=True)
            return None
        phase("evaluation")
        whole = contextlib.nullcontext(replicate_full_model(pm, layout, full_model, layout.device))
        shard = (layout.rank, layout.world_size)
    else:
        whole = pm.inline_encoders()
    with whole as model:
        result = evaluate(model, samples(), tokenizer, layout.device, max_new_tokens=cfg.max_new_tokens,
                          batch_size=cfg.eval_batch_size, limit=cfg.eval_samples, shard=shard)
    if layout.world_size > 1:
        parts: list = [None] * layout.world_size
        dist.all_gather_object(parts, result, group=host_group)
        result = merge_results(parts)
    return result
