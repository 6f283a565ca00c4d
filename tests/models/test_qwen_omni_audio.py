"""QwenOmniAudioEncoder: equal to transformers' Qwen2.5-Omni audio tower (chunked convs and
attention, pairs pooling, ln_post, proj as the projector) on packed clips loaded from a saved
thinker, and its processor equal to WhisperFeatureExtractor as Qwen2.5-Omni's processor calls it."""
import json
import pickle

import numpy as np
import pytest
import torch

from dataloading.formats.media import MediaProcessor
from hf_omni_helpers import as_whole_model, audio_tower_rows, check_audio_config_round_trip, mel_clips, saved_thinker
from model_helpers import rel_err
from omni.models.encoders.qwen_omni_audio import (LinearProjector, QwenOmniAudioConfig, QwenOmniAudioEncoder,
                                                  llm_tokens)

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths  # noqa: E402

MEL, D, OUT = 16, 32, 40
# n_window 3: chunks of 6 frames, 3 tokens each, so pooled pairs straddle chunk boundaries.
AUDIO = dict(num_mel_bins=MEL, d_model=D, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48,
             n_window=3, output_dim=OUT, max_source_positions=64)
# Odd and even frame counts: shorter than a chunk (3, 5), one chunk (6), 3+ chunks (20, 27).
FRAMES = [27, 5, 20, 6, 3, 14]


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory):
    """A tiny random Qwen2_5OmniThinkerForConditionalGeneration saved with save_pretrained
    (config.json: model_type qwen2_5_omni_thinker, weights under audio_tower.*), and its tower."""
    cfg = transformers.Qwen2_5OmniThinkerConfig(
        audio_config=AUDIO,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=OUT,
                           fullatt_block_indexes=[0]),
        text_config=dict(hidden_size=OUT, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 3]}))
    torch.manual_seed(0)
    return saved_thinker(transformers.Qwen2_5OmniThinkerForConditionalGeneration(cfg), tmp_path_factory, "qwen_omni_thinker")


@pytest.fixture(scope="module")
def whole_model_dir(thinker_dir, tmp_path_factory):
    """The layout of the released checkpoints: model_type qwen2_5_omni, the tower's config as
    thinker_config.audio_config, weights under thinker.audio_tower.*; here with n_window 4."""
    src, tower = thinker_dir
    return as_whole_model(src, tower, tmp_path_factory.mktemp("qwen_omni_whole"), "qwen2_5_omni", n_window=4)


def _features(frames, seed=0):
    return mel_clips(frames, MEL, seed)


def _hf_rows(tower, clips, n_window=None):
    """transformers' tower on the packed clips ([mel, total] and feature_lens, as the thinker calls it)."""
    saved = tower.n_window
    tower.n_window = n_window or saved
    try:
        with torch.no_grad():
            return tower(torch.cat(clips).T, feature_lens=torch.tensor([c.shape[0] for c in clips])).last_hidden_state
    finally:
        tower.n_window = saved


def _ours(path, clips):
    enc, proj, rows, out = audio_tower_rows(QwenOmniAudioEncoder, "qwen_omni_audio", path, clips)
    assert isinstance(proj, LinearProjector)
    return enc, rows, out


def test_thinker_checkpoint_matches_transformers(thinker_dir):
    path, tower = thinker_dir
    clips = _features(FRAMES)
    enc, rows, out = _ours(path, clips)
    ref = _hf_rows(tower, clips)
    assert rows.shape == (sum(llm_tokens(f) for f in FRAMES), D)
    assert out.shape == ref.shape == (int(_get_feat_extract_output_lengths(torch.tensor(FRAMES)).sum()), OUT)
    err = rel_err(out, ref)
    print(f"thinker checkpoint, n_window 3: max abs diff / max abs = {err:.2e}")
    assert err <= 1e-5
    # the rows before proj are transformers' ln_post output
    with torch.no_grad():
        assert rel_err(rows, _hf_ln_post(tower, clips)) <= 1e-5
    # each clip alone gives its own rows (attention and pooling stay inside each clip)
    with torch.no_grad():
        alone = torch.cat([enc(c, torch.tensor([[c.shape[0]]])) for c in clips])
    assert rel_err(alone, rows) <= 1e-5
    # proj is the projector; audio_bos_eos_token, which the thinker never reads, is carried as a
    # buffer (for the export), bit for bit, and trains nothing
    assert not any(n.startswith("proj.") for n in enc.state_dict())
    assert "audio_bos_eos_token.weight" not in dict(enc.named_parameters())
    assert torch.equal(enc.state_dict()["audio_bos_eos_token.weight"], tower.audio_bos_eos_token.weight)


def _hf_ln_post(tower, clips):
    """transformers' tower with proj replaced by the identity: its ln_post rows."""
    proj = tower.proj
    tower.proj = torch.nn.Identity()
    try:
        return _hf_rows(tower, clips)
    finally:
        tower.proj = proj


def test_whole_model_checkpoint_layout_matches_transformers(thinker_dir, whole_model_dir):
    _, tower = thinker_dir
    clips = _features([31, 8, 9, 2 * 8 + 1], seed=1)
    enc, _, out = _ours(whole_model_dir, clips)
    assert enc.config.n_window == 4 and enc.config.num_mel_bins == MEL
    err = rel_err(out, _hf_rows(tower, clips, n_window=4))
    print(f"whole-model layout (thinker.audio_tower.), n_window 4: max abs diff / max abs = {err:.2e}")
    assert err <= 1e-5


def test_fresh_projector_is_one_linear():
    enc = QwenOmniAudioEncoder(QwenOmniAudioConfig(**{k: v for k, v in AUDIO.items() if k != "output_dim"}))
    proj = enc.new_projector(64, hidden_mult=2.0, activation="silu")
    assert isinstance(proj, torch.nn.Linear) and proj.bias is not None
    assert (proj.in_features, proj.out_features) == (D, 64)
    assert sorted(n for n, _ in proj.named_parameters()) == ["bias", "weight"]


# --- the processor ----------------------------------------------------------------------------

def _extractor(chunk_length=300):
    """WhisperFeatureExtractor as in Qwen2.5-Omni's preprocessor_config.json (chunk_length 300 s)."""
    return transformers.WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400,
                                                chunk_length=chunk_length, padding_value=0.0, dither=0.0)


def _reference(fe, wave):
    """What Qwen2_5OmniProcessor._process_audio gets for one clip: features and frame count."""
    got = fe(wave, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")
    frames = int(got["attention_mask"].sum())
    return got["input_features"][0, :, :frames].T, frames


def _wave(n, seed):
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000.0
    tone = 0.3 * np.sin(2 * np.pi * 440 * t) * np.linspace(0.2, 1.0, n)
    return (tone + 0.05 * rng.standard_normal(n)).astype(np.float32)


@pytest.mark.parametrize("n", [321, 1000, 16000, 7 * 16000 + 37])
def test_processor_equals_qwen_omni_feature_extraction(n):
    proc = QwenOmniAudioEncoder.processor(QwenOmniAudioConfig())
    wave = _wave(n, n)
    ref, frames = _reference(_extractor(), wave)
    item = proc((wave, 16000))
    assert frames == -(-n // 160) and item.size == (frames,) and item.features.shape == (frames, 128)
    assert (item.features - ref).abs().max().item() <= 1e-5
    tokens = int(_get_feat_extract_output_lengths(torch.tensor(frames)))
    assert item.num_tokens == tokens == proc.num_tokens_from_meta({"num_samples": n, "sample_rate": 16000})


@pytest.mark.parametrize("n", [480000, 479990])
def test_processor_at_the_extractors_full_length(n):
    """A clip that fills (nearly) all of the extractor's padded length: the STFT reflects at the
    same end as transformers'."""
    proc = QwenOmniAudioEncoder.processor(QwenOmniAudioConfig(max_frames=3000))
    wave = _wave(n, 7)
    ref, frames = _reference(_extractor(chunk_length=30), wave)
    item = proc((wave, 16000))
    assert item.size == (frames,) and (item.features - ref).abs().max().item() <= 1e-5


def test_tokens_equal_the_towers_rows():
    cfg = QwenOmniAudioConfig(d_model=32, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=48, n_window=4,
                              max_source_positions=16)
    enc, proc = QwenOmniAudioEncoder(cfg).eval(), QwenOmniAudioEncoder.processor(cfg)
    assert isinstance(proc, MediaProcessor) and pickle.loads(pickle.dumps(proc)).config == cfg
    items = [proc((_wave(n, n), 16000)) for n in (400, 1601, 5000)]
    with torch.no_grad():
        rows = enc(torch.cat([i.features for i in items]), torch.tensor([list(i.size) for i in items]))
    assert rows.shape[0] == sum(i.num_tokens for i in items)
    # chunk_seconds: every piece is a clip of its own; the counts from metadata agree
    chunked = proc.with_options(chunk_seconds=0.12)
    pieces = chunked((_wave(5000, 1), 16000))
    assert len(pieces) > 1
    assert sum(p.num_tokens for p in pieces) == chunked.num_tokens_from_meta({"num_samples": 5000,
                                                                              "sample_rate": 16000})


def test_checkpoint_config_reading(thinker_dir):
    path, _ = thinker_dir
    check_audio_config_round_trip(QwenOmniAudioEncoder, path, D, OUT, "qwen2_5_omni")


# --- mistakes: one clear line -------------------------------------------------------------------

def test_mistakes_raise_one_line(thinker_dir, tmp_path):
    path, _ = thinker_dir
    proc = QwenOmniAudioEncoder.processor(QwenOmniAudioConfig(max_frames=100))
    with pytest.raises(ValueError, match="too long: 101 mel frames"):
        proc((np.zeros(100 * 160 + 1, np.float32), 16000))
    with pytest.raises(ValueError, match="too long"):
        proc.num_tokens_from_meta({"num_samples": 101 * 160, "sample_rate": 16000})
    with pytest.raises(ValueError, match="too short: 320 samples"):
        proc((np.zeros(320, np.float32), 16000))
    enc = QwenOmniAudioEncoder.from_pretrained(path)
    with pytest.raises(ValueError, match=r"num_mel_bins = 16\], got \(10, 128\)"):
        enc(torch.zeros(10, 128), torch.tensor([[10]]))
    with pytest.raises(ValueError, match="sizes describe 12 input units but features has 10 rows"):
        enc(torch.zeros(10, MEL), torch.tensor([[12]]))
    with pytest.raises(ValueError, match="a clip of 2 mel frames makes no LLM token"):
        enc(torch.zeros(12, MEL), torch.tensor([[10], [2]]))
    with pytest.raises(ValueError, match="n_window 80 must be in"):
        QwenOmniAudioConfig(n_window=80, max_source_positions=64)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(ValueError, match="model_type 'whisper'.*qwen2_5_omni / qwen2_5_omni_thinker"):
        QwenOmniAudioEncoder.from_pretrained(str(tmp_path))
    assert enc(torch.zeros(0, MEL), torch.zeros(0, 1, dtype=torch.int64)).shape == (0, D)
