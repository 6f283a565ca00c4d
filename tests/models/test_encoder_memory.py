"""The encoders' activation-memory estimate (what ``multiplex.long_threshold=auto`` compares
with ``multiplex.encoder_memory_mib``) against what autograd really keeps, counted by the
multiplexing runtime's own counter (weights left out)."""
import pytest
import torch

from omni.models.encoders.siglip import SiglipEncoder, SiglipEncoderConfig
from omni.models.encoders.whisper import WhisperEncoder, WhisperEncoderConfig
from omni.multiplex.runtime import _CountSaved


def _siglip():
    return SiglipEncoder(SiglipEncoderConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=64, patch_size=4))


def _whisper():
    return WhisperEncoder(WhisperEncoderConfig(num_mel_bins=16, d_model=64, encoder_layers=2,
                                               encoder_attention_heads=4, encoder_ffn_dim=256,
                                               max_source_positions=1024))


CASES = [("siglip", _siglip, [(4, 4), (16, 16), (32, 32)]), ("whisper", _whisper, [(32,), (512,), (2000,)])]


@pytest.mark.parametrize("name,build,items", CASES, ids=[c[0] for c in CASES])
def test_activation_estimate_tracks_what_autograd_keeps(name, build, items):
    torch.manual_seed(0)
    enc = build()
    for size in items:
        sizes = torch.tensor([size])
        features = torch.randn(sum(enc.input_units(sizes)), 48 if name == "siglip" else 16)
        with _CountSaved() as saved:
            out = enc.encode_chunk(features, sizes)
        estimate = enc.activation_bytes(out.shape[0], element_bytes=4)
        # Linear in the tokens (memory-efficient attention keeps no n^2 scores) and within a
        # small factor: the estimate leaves out the front-end's few values per token.
        assert 0.7 * estimate <= saved.bytes <= 1.5 * estimate, (size, saved.bytes, estimate)


def test_counter_leaves_out_weights_and_their_views():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    with _CountSaved() as saved:
        lin(x)  # keeps x (for the weight's gradient) and the transposed weight (a view)
    assert saved.bytes == x.numel() * 4
