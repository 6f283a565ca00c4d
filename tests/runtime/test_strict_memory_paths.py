"""Issue 38's new model paths under CUDA's rules on the CPU: the strict device check
(parallel/strict_device.py) around a bf16 training forward and backward finds no host read of a
tensor a GPU would hold, and no host sync, on each of them: FP8 linear layers (torchao's dynamic
scales stay on the device), activation offloading (emulated copies), MoE experts' shared
compute-dtype copy. (Compiled blocks are not here: under the check's Python dispatch modes dynamo
does not compile, so the check would only see the eager code.) Their equality with the eager
paths is in their own tests
(tests/models/test_fp8_linear.py, tests/parallel/test_activation_offload.py,
tests/models/test_compile_blocks.py, tests/models/test_moe_shared_cast.py); CP attention, the
chunked loss and the Qwen tower run under this check in tests/parallel/test_device_rules_layouts.py."""
from __future__ import annotations

import pytest
import torch

from omni.models.build import build_model
from omni.models.config import ModelConfig
from tests.models.model_helpers import packed_row
from parallel.strict_device import StrictDevice

CPU = torch.device("cpu")
CFG = dict(family="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
           num_kv_heads=2)
MOE = dict(CFG, family="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)


@pytest.mark.parametrize("path", ["fp8", "offload", "moe"])
def test_the_path_reads_nothing_back(path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**(MOE if path == "moe" else CFG)), {}, vocab_needed=0)
    if path == "fp8":
        pytest.importorskip("torchao")
        from omni.models.llm.fp8 import convert_blocks_to_fp8

        convert_blocks_to_fp8(model.llm.layers)
    elif path == "offload":
        from parallel.activation_offload import ActivationOffload

        model.runtime.offload = ActivationOffload(None, min_bytes=0, emulate=True)
    strict = StrictDevice()
    strict.mark_module(model)
    with strict:
        p = model.prepare(packed_row([20, 12, 16], 64), device=CPU)
        strict.begin_step()
        with strict.device_window():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                parts = model(p)
            loss = parts.ce_sum if parts.aux_loss is None else parts.ce_sum + parts.aux_loss
            loss.backward()
    assert strict.sync_count == 0, dict(strict.syncs)
    assert all(q.grad is not None for q in model.parameters() if q.requires_grad)
