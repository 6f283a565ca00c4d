"""Encoder activation checkpointing (parallel.encoder_activation_checkpoint, set on each encoder
by ``parallelize``): the same outputs and gradients, and far less kept for backward."""

import pytest
import torch

from omni.models.encoders.siglip import SiglipEncoder, SiglipEncoderConfig
from omni.models.encoders.whisper import WhisperEncoder, WhisperEncoderConfig


def _saved_bytes(fn):
    total = [0]

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


@pytest.mark.parametrize("kind", ["siglip", "whisper"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputed_layers_give_the_same_gradients_and_keep_less(kind, mode):
    torch.manual_seed(0)
    if kind == "siglip":
        enc = SiglipEncoder(SiglipEncoderConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                num_attention_heads=4, image_size=16, patch_size=2))
        features, sizes = torch.randn(4 * 6 + 9, 12), torch.tensor([[4, 6], [3, 3]])
    else:
        enc = WhisperEncoder(WhisperEncoderConfig(num_mel_bins=8, d_model=32, encoder_layers=3,
                                                  encoder_attention_heads=4, encoder_ffn_dim=64,
                                                  max_source_positions=64))
        features, sizes = torch.randn(20, 8), torch.tensor([[12], [8]])
    plain, kept = _saved_bytes(lambda: enc(features, sizes))
    plain.square().sum().backward()
    want = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
    enc.zero_grad(set_to_none=True)
    enc.activation_checkpoint = mode
    out, recomputed = _saved_bytes(lambda: enc(features, sizes))
    out.square().sum().backward()
    torch.testing.assert_close(out, plain)
    assert {n for n, p in enc.named_parameters() if p.grad is not None} == set(want)
    for n, p in enc.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)
    assert recomputed < kept * (0.6 if mode == "full" else 0.95)
