"""``parallel.compile``: ``torch.compile`` of the decoder blocks' shape-polymorphic parts.

What is compiled: each block's two RMSNorms and its dense SwiGLU MLP (elementwise chains inductor
fuses into few kernels). What stays eager: the attention, whose kernels take the packed documents'
lengths from the host (dynamo would guard on them and compile again for every new packing), and
MoE layers, whose routing sizes depend on the data. Compiled in place (``nn.Module.compile``), so
parameter names, checkpoints and FSDP/TP wrapping do not change; token counts are dynamic, so a new
row length does not compile again.
"""
from __future__ import annotations

from torch import nn


def compile_blocks(layers, backend: str = "inductor") -> int:
    """Compile the norms and dense MLPs of the decoder blocks ``layers``; returns how many modules
    were compiled. ``backend``: torch.compile's (``aot_eager`` traces without generating code:
    the tests' fast path)."""
    count = 0
    for block in layers:
        parts: list[nn.Module] = [block.input_layernorm, block.post_attention_layernorm]
        if not block.is_moe:
            parts.append(block.mlp)
        for module in parts:
            module.compile(backend=backend, dynamic=True)
            count += 1
    return count
