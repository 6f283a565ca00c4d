"""``parallel.fp8``: the decoder blocks' linear layers in FP8 through torchao's float8 training.

Converted: each block's attention projections and dense MLP (``nn.Linear`` -> torchao's
``Float8Linear``: dynamic tensor-wise scaling, e4m3 inputs and weights in the forward, e5m2
gradients, fp32/bf16 masters kept). Left in their dtype: the embeddings and the LM head (the
logits are the most precision-sensitive matmul, as torchtitan and Megatron leave them), MoE
routers and experts, and the encoders. ``torch._scaled_mm`` needs every dimension a multiple of
16. Parameter names do not change, so checkpoints move between FP8 and bf16 runs.
"""
from __future__ import annotations

from torch import nn

FP8_MULTIPLE = 16  # torch._scaled_mm's operand alignment


def fp8_linear_filter(module: nn.Module, name: str) -> bool:
    """Which linear layers of a block torchao converts: dense ones whose sizes fit FP8 GEMMs."""
    return (isinstance(module, nn.Linear) and "router" not in name and "experts" not in name
            and module.in_features % FP8_MULTIPLE == 0 and module.out_features % FP8_MULTIPLE == 0)


def convert_blocks_to_fp8(layers) -> int:
    """Swap the linear layers of the decoder blocks ``layers`` for torchao's Float8Linear, in
    place; returns how many. Needs torchao (``pip install -e ".[fp8]"``)."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    for block in layers:
        convert_to_float8_training(block, module_filter_fn=fp8_linear_filter)
    return sum(isinstance(m, Float8Linear) for block in layers for m in block.modules())
