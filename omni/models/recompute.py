"""Activation checkpointing of one block (a decoder block, an encoder layer): ``mode`` none |
selective | full, one rule for the backbone (``parallel.activation_checkpoint``) and the encoders
(``parallel.encoder_activation_checkpoint``)."""
from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "selective", "full")

# Outputs worth keeping under selective recompute: the matmuls (costly to redo); norms,
# activations, rotary and softmax are recomputed. Attention kernels are kept too, for every
# backend ``omni.models.attention`` and ``omni.kernels.varlen_attention`` dispatch to; an
# attention op missing here runs again in the backward of every block.
SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,  # also the math SDPA variant, which reaches the policy decomposed
    torch.ops.aten._grouped_mm.default,  # the MoE experts' matmuls (omni.models.llm.moe)
    # SDPA's fused variants, each the one op its backend runs (cuDNN is preferred on Hopper)
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}

# Attention ops of other libraries, by qualified name so that none of them need be installed
# or imported to build the policy: our Triton varlen kernel (a torch.library op registered by
# omni.kernels.varlen_attention) and flash-attn's forwards (torch.library ops since flash-attn
# 2.6; ``flash_attn_varlen_func`` dispatches the varlen one).
SAVE_OP_NAMES = {
    "omni::varlen_attention_fwd",
    "flash_attn::_flash_attn_forward",
    "flash_attn::_flash_attn_varlen_forward",
}


def _keep(op) -> bool:
    if op in SAVE_OPS:
        return True
    schema = getattr(op, "_schema", None)  # OpOverloads; higher-order ops have none
    return schema is not None and schema.name in SAVE_OP_NAMES


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if _keep(op) else CheckpointPolicy.PREFER_RECOMPUTE


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
