"""Activation checkpointing of one block (a decoder block, an encoder layer): ``mode`` none |
selective | full, one rule for the backbone (``parallel.activation_checkpoint``) and the encoders
(``parallel.encoder_activation_checkpoint``)."""
from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "selective", "full")

# Outputs worth keeping under selective recompute: the matmuls (costly to redo); norms,
# activations, rotary and softmax are recomputed. Attention kernels are kept too.
SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._grouped_mm.default,  # the MoE experts' matmuls (omni.models.llm.moe)
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def recompute(fn, *args, mode: str = "none"):
    """``fn(*args)``, keeping for backward what ``mode`` says: everything (none), the matmul and
    attention outputs plus the inputs (selective), or the inputs only (full: the forward runs
    again in the backward)."""
    if mode == "none" or not torch.is_grad_enabled():
        return fn(*args)
    if mode == "full":
        return checkpoint(fn, *args, use_reentrant=False)
    if mode == "selective":
        return checkpoint(fn, *args, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts,
                                                                             _selective_policy))
    raise ValueError(f"activation checkpoint mode {mode!r} is not one of {', '.join(MODES)}")
