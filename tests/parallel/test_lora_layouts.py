"""LoRA under FSDP2, tensor and pipeline parallelism trains like the single-process run: the first
5 losses, the gradient norms and the first step's gradients of every adapter (fp32, relative
error <= 1e-5), with the base weights frozen on every rank.

The equality harness (``layout_harness``) builds its tiny model through ``build``; here that
model gets adapters (rank 4 on the LLM's q/k/v/o and gate/up/down, and on the vision tower's
q/k/v when it has one) whose B starts non-zero, so that A's first gradient is not zero either.
One spawn of 2 ranks runs every layout.
"""
from __future__ import annotations

import pytest

import layout_harness
from layout_harness import check_named_layouts, run_named_layouts
from layout_models import random_adapters

DENSE = {"moe": False, "num_layers": 2}
WITH_IMAGES = {"moe": False, "num_layers": 2, "media": ("image",)}


def _with_adapters(build):
    def lora_build(*args, **kwargs):
        from omni.models import lora
        from omni.models.config import LoraConfig

        model = build(*args, **kwargs)
        modules = ["llm", "encoders"] if len(model.encoders) else ["llm"]
        lora.inject(model, LoraConfig(rank=4, alpha=8.0, modules=modules), {m: m for m in model.encoders})
        # A as peft draws it (scale 1/sqrt(in)), B of the base weights' size: an adapted layer
        # computes about what its base does (a far larger B puts the attention in a saturated
        # regime where roundoff grows from step to step).
        random_adapters(model, seed=7)
        return model
    return lora_build


def _worker(rank, world, layouts, out_dir):
    layout_harness.build = _with_adapters(layout_harness.build)
    run_named_layouts(rank, layouts, out_dir)


LAYOUTS = [
    ("tp=2", dict(dp_shard=1, tp=2), DENSE, {}, {}),
    ("pp=2 1f1b", dict(dp_shard=1, pp=2, pp_schedule="1f1b"), DENSE, {}, {}),
    # FSDP2 over blocks that hold frozen base weights beside trainable adapters, and over the
    # vision tower (adapted too) beside its fully trained projector.
    ("dp_shard=2, images, sharded tower", dict(dp_shard=2), WITH_IMAGES, {}, {"encoder_weights": "sharded"}),
]


def _frozen_stay_frozen(name, rank, sizes, mux, result):
    """Only adapters (and the projector) get gradients: the base is frozen on every rank."""
    return [f"grad {n}: a base weight got a gradient" for n in result["grads"]
            if ".lora_" not in n and not n.startswith("projectors.")]


def test_lora_layouts_equal_single_process(tmp_path, monkeypatch):
    monkeypatch.setattr(layout_harness, "build", _with_adapters(layout_harness.build))
    check_named_layouts(2, LAYOUTS, tmp_path, _worker, extra=_frozen_stay_frozen)


@pytest.mark.scale
def test_lora_layouts_on_four_ranks(tmp_path, monkeypatch):
    """Opt-in (pytest -m scale; about a minute on two cores): FSDP2 over TP-sharded blocks (a
    replicated A beside DTensors in one FSDP unit), and TP x PP with the adapted tower."""
    monkeypatch.setattr(layout_harness, "build", _with_adapters(layout_harness.build))
    layouts = [("dp_shard=2 x tp=2", dict(dp_shard=2, tp=2), DENSE, {}, {}),
               ("tp=2 x pp=2, images", dict(dp_shard=1, tp=2, pp=2), WITH_IMAGES, {}, {})]
    check_named_layouts(4, layouts, tmp_path, _worker, extra=_frozen_stay_frozen)
