"""How the decoder is split under tensor parallelism (Megatron-style, with sequence parallelism).

Between blocks every TP rank holds 1/tp of the row's tokens (sequence parallel). Norms run on
those shards; attention and the dense MLP all-gather the row, compute their heads / hidden
columns (q/k/v, gate/up column-parallel; o/down row-parallel) and reduce-scatter back to
shards. The embedding is split by vocabulary rows; the LM head (or the tied embedding) too,
and the loss never gathers the vocabulary (``parallel.tensor_parallel``). MoE layers run on
each rank's own token shard (experts are not TP-split); their parameters are replicated over
TP and their gradients summed by the runtime.
"""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from .. import lora
from .decoder import Decoder


def apply_tensor_parallel(llm: Decoder, tp_mesh: DeviceMesh) -> None:
    """Shard ``llm`` (or the part of it one pipeline stage holds) over ``tp_mesh`` in place.
    A layer with LoRA adapters (``omni.models.lora``) gets its plan entry split over its base
    layer and adapters."""
    # SequenceParallel registers the norm gains anew as parameters that require gradients:
    # frozen ones (LoRA's base model, model.freeze) are frozen again afterwards.
    frozen = {name for name, p in llm.named_parameters() if not p.requires_grad}
    plan = {}
    if llm.embed_tokens is not None:
        # Full row out: media embeddings are written into it before it is cut into shards.
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if llm.norm is not None:
        plan["norm"] = SequenceParallel(use_local_output=True)
    if llm.lm_head is not None:
        plan["lm_head"] = ColwiseParallel()  # weight rows = vocabulary; the loss reads the local rows
    if plan:
        parallelize_module(llm, tp_mesh, lora.tensor_parallel_plan(llm, plan))
    for block in llm.layers:
        block_plan = {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None), use_local_output=True),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
        }
        if block.is_moe:
            block_plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1), None),
                                                   desired_input_layouts=(Shard(1), None), use_local_output=True)
        else:
            block_plan.update({
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            })
        parallelize_module(block, tp_mesh, lora.tensor_parallel_plan(block, block_plan))
    for name, p in llm.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
