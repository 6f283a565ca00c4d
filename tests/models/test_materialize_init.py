"""Materialising a tower from the meta device takes each tensor's initialisation from its own
module (issue 38, item 6): a Qwen2.5-VL tower's RMSNorm gains come from RMSNorm.reset_parameters,
not from building the whole tower afresh on the host once per norm."""
from __future__ import annotations

import torch

from omni.models.encoders.qwen_vl import QwenVisionConfig, QwenVisionEncoder
from omni.models.materialize import SeededInit, named_tensors


def test_no_tensor_of_a_qwen2_5_vl_tower_rebuilds_the_tower(monkeypatch):
    cfg = QwenVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
                           fullatt_block_indexes=[3])
    with torch.device("meta"):
        tower = QwenVisionEncoder(cfg)
    built = []
    real_init = QwenVisionEncoder.__init__

    def counting_init(self, *a, **kw):
        built.append(1)
        real_init(self, *a, **kw)

    monkeypatch.setattr(QwenVisionEncoder, "__init__", counting_init)
    source = SeededInit(3)
    norms = 0
    for name, t in named_tensors(tower):
        value = source.read(name, tower, t.shape, tuple(slice(0, s) for s in t.shape))
        assert value.shape == t.shape
        if name.endswith(("norm1.weight", "norm2.weight")):
            norms += 1
            assert torch.equal(value, torch.ones_like(value))
    assert norms == 2 * cfg.num_hidden_layers
    assert built == []  # no tensor needed the tower built on the host
