"""WhisperEncoder: equal to transformers' Whisper encoder at full length, per clip when packed,
and its processor equal to WhisperFeatureExtractor on the clip's own samples."""
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dataloading.formats.media import MediaProcessor
from model_helpers import saved_hf_model
from omni.models.encoders import resample as resample_mod
from omni.models.encoders.resample import resample
from omni.models.encoders.whisper import WhisperEncoder, WhisperEncoderConfig

transformers = pytest.importorskip("transformers")
from transformers.models.whisper import modeling_whisper as hf_whisper  # noqa: E402

MEL, POS = 16, 32  # 16 mel bins, 32 positions -> 64 input frames
HF_CFG = dict(
    d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=MEL, max_source_positions=POS, vocab_size=64,
    max_target_positions=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
)
TINY = dict(num_mel_bins=MEL, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
            max_source_positions=POS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def whisper_ckpt(tmp_path_factory):
    """A WhisperForConditionalGeneration checkpoint (weights under model.encoder.*) and its encoder."""
    path, hf = saved_hf_model(transformers.WhisperForConditionalGeneration, transformers.WhisperConfig(**HF_CFG),
                              tmp_path_factory, "whisper")
    return path, hf.model.encoder


@pytest.fixture(scope="module")
def encoder(whisper_ckpt):
    return WhisperEncoder.from_pretrained(whisper_ckpt[0]).eval()


def _hf_manual(hf_enc, feats: torch.Tensor) -> torch.Tensor:
    """HF's encoder modules applied by hand to a clip of any length (HF's forward insists on 64)."""
    x = feats.T[None]
    h = F.gelu(hf_enc.conv2(F.gelu(hf_enc.conv1(x))))[0].T
    h = h + hf_enc.embed_positions.weight[: h.shape[0]]
    h = h[None]
    for layer in hf_enc.layers:
        h = layer(h, None)
    return hf_enc.layer_norm(h)[0]


def test_full_length_matches_hf_encoder(whisper_ckpt, encoder):
    _, hf_enc = whisper_ckpt
    feats = torch.randn(2 * POS, MEL, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = encoder(feats, torch.tensor([[2 * POS]]))
        ref = hf_enc(feats.T[None]).last_hidden_state[0]
    assert out.shape == (POS, 32)
    assert _rel(out, ref) <= 1e-5


@pytest.mark.parametrize("frames", [37, 20, 1])
def test_short_clip_matches_hf_modules(whisper_ckpt, encoder, frames):
    _, hf_enc = whisper_ckpt
    feats = torch.randn(frames, MEL, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        out = encoder(feats, torch.tensor([[frames]]))
        ref = _hf_manual(hf_enc, feats)
    assert out.shape == ((frames + 1) // 2, 32)
    assert _rel(out, ref) <= 1e-5


def test_packed_clips_equal_each_clip_alone(encoder):
    g = torch.Generator().manual_seed(1)
    clips = [torch.randn(n, MEL, generator=g) for n in (64, 17, 30, 3)]
    with torch.no_grad():
        packed = encoder(torch.cat(clips), torch.tensor([[c.shape[0]] for c in clips]))
        alone = [encoder(c, torch.tensor([[c.shape[0]]])) for c in clips]
    assert packed.shape[0] == sum(a.shape[0] for a in alone) == 32 + 9 + 15 + 2
    assert _rel(packed, torch.cat(alone)) <= 1e-5


def test_loads_whisper_model_and_encoder_only_dirs(tmp_path, whisper_ckpt, encoder):
    _, hf_enc = whisper_ckpt
    model = transformers.WhisperModel(transformers.WhisperConfig(**HF_CFG))
    model.encoder.load_state_dict(hf_enc.state_dict())
    model.save_pretrained(tmp_path / "model")  # weights under encoder.*
    hf_enc.save_pretrained(tmp_path / "enc")  # weights at the top level
    ref = encoder.state_dict()
    for sub in ("model", "enc"):
        got = WhisperEncoder.from_pretrained(str(tmp_path / sub)).state_dict()
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), sub
    with pytest.raises(ValueError, match="model_type 'siglip'"):
        (tmp_path / "bad").mkdir()
        (tmp_path / "bad" / "config.json").write_text('{"model_type": "siglip"}')
        WhisperEncoder.from_pretrained(str(tmp_path / "bad"))


@pytest.mark.parametrize("num_samples", [8037, 10240, 201, 4000])
def test_processor_features_equal_feature_extractor(num_samples):
    proc = WhisperEncoder.processor(WhisperEncoderConfig(**TINY))
    wave = (0.3 * np.random.RandomState(num_samples).randn(num_samples)).astype(np.float32)
    item = proc((wave, 16000))
    fe = transformers.WhisperFeatureExtractor(feature_size=MEL)
    ref = fe(wave, sampling_rate=16000, padding="longest", return_tensors="pt")["input_features"][0]
    assert ref.shape[1] == num_samples // 160  # HF on the clip alone: no 30 s padding either
    assert item.size == (num_samples // 160,) and item.num_tokens == (num_samples // 160 + 1) // 2
    torch.testing.assert_close(item.features, ref.T, rtol=0, atol=1e-5)


def test_processor_tokens_agree_with_meta_and_limits():
    proc = WhisperEncoder.processor(WhisperEncoderConfig(**TINY))
    rng = np.random.RandomState(0)
    for n, sr in [(16000 * 0.4, 16000), (3000, 8000), (22050 * 0.5, 22050), (44100 * 0.6, 44100), (333, 16000)]:
        n = int(n)
        item = proc((rng.randn(n).astype(np.float32), sr))
        assert item.num_tokens == proc.num_tokens_from_meta({"num_samples": n, "sample_rate": sr})
        assert item.features.shape == (item.size[0], MEL)
    with pytest.raises(ValueError, match="too long.*max_frames 64"):
        proc((np.zeros(65 * 160, np.float32), 16000))
    with pytest.raises(ValueError, match="too long"):
        proc.num_tokens_from_meta({"num_samples": 65 * 160, "sample_rate": 16000})
    with pytest.raises(ValueError, match="too short"):
        proc((np.zeros(150, np.float32), 16000))


@pytest.mark.parametrize("orig,new", [(8000, 16000), (44100, 16000), (22050, 16000), (48000, 16000)])
@pytest.mark.parametrize("polyphase", [True, False])
def test_resample_preserves_a_tone(orig, new, polyphase, monkeypatch):
    freq, n = 440.0, orig // 2 + 7
    wave = np.sin(2 * np.pi * freq * np.arange(n) / orig).astype(np.float32)
    out = resample(wave, orig, new)
    if not polyphase:  # the per-output gather fallback computes the same filter
        monkeypatch.setattr(resample_mod, "_POLYPHASE_MAX_WEIGHTS", 0)
        gathered = resample(wave, orig, new)
        np.testing.assert_allclose(gathered, out, rtol=0, atol=1e-5)
        out = gathered
    assert out.shape == (-(-n * new // orig),)
    want = np.sin(2 * np.pi * freq * np.arange(out.shape[0]) / new)
    inner = slice(200, out.shape[0] - 200)  # away from the zero-padded edges
    assert np.abs(out[inner] - want[inner]).max() < 2e-3


def test_gradients_init_cost_and_pickling():
    torch.manual_seed(0)
    cfg = WhisperEncoder.build_config(TINY)
    enc = WhisperEncoder(cfg)
    assert torch.allclose(enc.embed_positions.weight, hf_whisper.sinusoids(POS, 32))
    feats = torch.randn(64 + 21, MEL)
    enc(feats, torch.tensor([[64], [21]])).square().sum().backward()
    for name, p in enc.named_parameters():
        if name == "embed_positions.weight":
            assert not p.requires_grad  # fixed sinusoids, as in Whisper
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    torch.manual_seed(0)
    again = WhisperEncoder(cfg).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in enc.state_dict().items())
    alpha, beta = enc.cost_coefficients()
    assert alpha == 4 * 2 * 32 and beta == 2 * (8 * 32 * 32 + 4 * 32 * 64) + 12 * MEL * 32 + 6 * 32 * 32
    proc = WhisperEncoder.processor(cfg)
    assert isinstance(proc, MediaProcessor) and proc.modality == "audio"
    wave = np.random.RandomState(0).randn(3000).astype(np.float32)
    assert torch.equal(pickle.loads(pickle.dumps(proc))((wave, 16000)).features, proc((wave, 16000)).features)
    with pytest.raises(ValueError, match="exceeds max_source_positions"):
        enc(torch.randn(66, MEL), torch.tensor([[66]]))
    assert enc(torch.zeros(0, MEL), torch.zeros(0, 1, dtype=torch.int64)).shape == (0, 32)
    omegaconf = pytest.importorskip("omegaconf")
    assert omegaconf.OmegaConf.structured(WhisperEncoderConfig).max_frames is None
