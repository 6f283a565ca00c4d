"""Qwen3OmniAudioEncoder: equal to transformers' Qwen3-Omni audio tower (Conv2d stem per chunk,
attention in windows of chunks, ln_post, proj1/act/proj2 as Omni's Projector) on packed clips
loaded from a saved thinker and from the released whole-model layout; its processor and token
counts equal Qwen3-Omni's processor's."""
import json
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dataloading.formats.media import MediaProcessor
from hf_omni_helpers import as_whole_model, audio_tower_rows, check_audio_config_round_trip, mel_clips, saved_thinker
from model_helpers import rel_err
from omni.models.encoders.qwen3_omni_audio import (Qwen3OmniAudioConfig, Qwen3OmniAudioEncoder, conv_tokens,
                                                   llm_tokens)
from omni.models.projector import Projector

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe as hf_proc  # noqa: E402

MEL, D, OUT = 16, 32, 40
# n_window 49: chunks of 98 frames, 13 tokens (one of the n_window transformers' tower runs with,
# its token count hard-coding 13 per chunk); n_window_infer 196: attention windows of 2 chunks;
# conv_chunksize 3: the convolutions run in several calls.
AUDIO = dict(num_mel_bins=MEL, d_model=D, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48,
             n_window=49, n_window_infer=196, conv_chunksize=3, downsample_hidden_size=8, output_dim=OUT,
             max_source_positions=64)
# Shorter than a chunk (odd and even), one chunk exactly, 3 and 5 chunks (windows 2 + 1, 2 + 2 + 1).
FRAMES = [5, 450, 97, 98, 211, 1, 40, 7]


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory):
    """A tiny random Qwen3OmniMoeThinkerForConditionalGeneration (a Qwen3-MoE text model) saved
    with save_pretrained (model_type qwen3_omni_moe_thinker, weights under audio_tower.*)."""
    cfg = transformers.Qwen3OmniMoeThinkerConfig(
        audio_config=AUDIO,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=OUT,
                           deepstack_visual_indexes=[0], num_position_embeddings=16, patch_size=4),
        text_config=dict(hidden_size=OUT, intermediate_size=48, moe_intermediate_size=16, num_experts=2,
                         num_experts_per_tok=1, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, vocab_size=128))
    torch.manual_seed(0)
    return saved_thinker(transformers.Qwen3OmniMoeThinkerForConditionalGeneration(cfg), tmp_path_factory, "qwen3_omni_thinker")


@pytest.fixture(scope="module")
def whole_model_dir(thinker_dir, tmp_path_factory):
    """The released layout: model_type qwen3_omni_moe, the tower's config as
    thinker_config.audio_config, weights under thinker.audio_tower.*; here n_window 50 (the
    released one) with windows of 3 chunks."""
    src, tower = thinker_dir
    return as_whole_model(src, tower, tmp_path_factory.mktemp("qwen3_omni_whole"), "qwen3_omni_moe", n_window=50, n_window_infer=300)


def _features(frames, seed=0):
    return mel_clips(frames, MEL, seed)


def _hf_rows(tower, clips, n_window=None, n_window_infer=None, head=True):
    """transformers' tower on the packed clips ([mel, total] and feature_lens, as the thinker
    calls it); ``head`` False: proj1/act/proj2 replaced by the identity (its ln_post rows)."""
    saved = tower.n_window, tower.n_window_infer, tower.proj1, tower.act, tower.proj2
    tower.n_window, tower.n_window_infer = n_window or saved[0], n_window_infer or saved[1]
    if not head:
        tower.proj1 = tower.act = tower.proj2 = torch.nn.Identity()
    try:
        with torch.no_grad():
            return tower(torch.cat(clips).T, feature_lens=torch.tensor([c.shape[0] for c in clips])).last_hidden_state
    finally:
        tower.n_window, tower.n_window_infer, tower.proj1, tower.act, tower.proj2 = saved


def _ours(path, clips):
    enc, proj, rows, out = audio_tower_rows(Qwen3OmniAudioEncoder, "qwen3_omni_audio", path, clips)
    assert isinstance(proj, Projector) and proj.merge == 1
    return enc, rows, out


def test_thinker_checkpoint_matches_transformers(thinker_dir):
    path, tower = thinker_dir
    clips = _features(FRAMES)
    enc, rows, out = _ours(path, clips)
    ref = _hf_rows(tower, clips)
    n = int(hf_proc._get_feat_extract_output_lengths(torch.tensor(FRAMES), 49).sum())
    assert rows.shape == (sum(llm_tokens(f, 49) for f in FRAMES), D) and out.shape == ref.shape == (n, OUT)
    err = rel_err(out, ref)
    print(f"thinker checkpoint, n_window 49: max abs diff / max abs = {err:.2e}")
    assert err <= 1e-5
    # the rows before the projector are transformers' ln_post output
    assert rel_err(rows, _hf_rows(tower, clips, head=False)) <= 1e-5
    # each clip alone gives its own rows (windows and chunk padding do not depend on the batch)
    with torch.no_grad():
        alone = torch.cat([enc(c, torch.tensor([[c.shape[0]]])) for c in clips])
    assert rel_err(alone, rows) <= 1e-5
    # proj1/proj2 are the projector's, not the tower's; k_proj keeps its bias
    assert not any(k.startswith("proj") for k in enc.state_dict())
    assert torch.equal(enc.state_dict()["layers.1.self_attn.k_proj.bias"], tower.layers[1].self_attn.k_proj.bias)


def test_transformers_pads_a_lone_short_clip_otherwise(thinker_dir):
    """transformers does not mask the chunk padding between its convolutions, and pads to its
    batch's longest chunk: a 5-frame clip alone (no padding) gets another last row than beside a
    full chunk. Ours is the latter, always."""
    path, tower = thinker_dir
    short, full = _features([5, 98], seed=3)
    enc = Qwen3OmniAudioEncoder.from_pretrained(path).eval()
    with torch.no_grad():
        ours = enc(short, torch.tensor([[5]]))
    beside = _hf_rows(tower, [short, full], head=False)[:1]
    assert rel_err(ours, beside) <= 1e-5
    assert rel_err(_hf_rows(tower, [short], head=False), beside) > 1e-3


def test_whole_model_checkpoint_layout_matches_transformers(thinker_dir, whole_model_dir):
    _, tower = thinker_dir
    frames = [301, 100, 99, 7, 250, 2]
    clips = _features(frames, seed=1)
    enc, _, out = _ours(whole_model_dir, clips)
    assert (enc.config.n_window, enc.config.n_window_infer, enc.config.num_mel_bins) == (50, 300, MEL)
    ref = _hf_rows(tower, clips, n_window=50, n_window_infer=300)
    assert out.shape[0] == int(hf_proc._get_feat_extract_output_lengths(torch.tensor(frames), 50).sum())
    err = rel_err(out, ref)
    print(f"whole-model layout (thinker.audio_tower.), n_window 50: max abs diff / max abs = {err:.2e}")
    assert err <= 1e-5


def test_projectors_shape():
    enc = Qwen3OmniAudioEncoder(Qwen3OmniAudioConfig(**{k: v for k, v in AUDIO.items() if k != "output_dim"}))
    proj = enc.new_projector(64, **{"hidden_mult": 2.0, "activation": "silu", **enc.fresh_projector()})
    assert isinstance(proj, Projector) and not hasattr(proj, "norm")
    assert (proj.fc1.in_features, proj.fc1.out_features, proj.fc2.out_features) == (D, D, 64)
    assert isinstance(proj.act, torch.nn.GELU) and proj.act.approximate == "none"


# --- token counts and the processor ---------------------------------------------------------------

@pytest.mark.parametrize("n_window", [49, 50, 51, 52])
def test_token_count_equals_transformers(n_window):
    frames = torch.arange(1, 1200)
    ref = hf_proc._get_feat_extract_output_lengths(frames, n_window).tolist()
    assert [llm_tokens(f, n_window) for f in frames.tolist()] == ref
    assert conv_tokens(2 * n_window) == 13


def _extractor():
    """WhisperFeatureExtractor as in Qwen3-Omni's preprocessor_config.json (chunk_length 300 s)."""
    return transformers.WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400,
                                                chunk_length=300, padding_value=0.0, dither=0.0)


def _wave(n, seed):
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000.0
    tone = 0.3 * np.sin(2 * np.pi * 440 * t) * np.linspace(0.2, 1.0, n)
    return (tone + 0.05 * rng.standard_normal(n)).astype(np.float32)


def test_processor_and_counts_equal_qwen3_omni_processing():
    """Features as Qwen3OmniMoeProcessor._process_audio gets them for one clip (its audio_kwargs:
    padding=True, truncation=False), its token counts (from the mask, and from the length in
    samples), and the tower's rows."""
    fe = _extractor()
    cfg = Qwen3OmniAudioConfig(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16,
                               downsample_hidden_size=4, n_window_infer=200)
    proc, enc = Qwen3OmniAudioEncoder.processor(cfg), Qwen3OmniAudioEncoder(cfg).eval()
    assert isinstance(proc, MediaProcessor) and pickle.loads(pickle.dumps(proc)).config == cfg
    fake = SimpleNamespace(n_window=hf_proc.Qwen3OmniMoeProcessor.n_window, feature_extractor=fe)
    items = []
    for n in (201, 321, 1000, 16000 + 37, 3 * 16000 + 159, 2 * 16000 + 160 * 100):
        wave = _wave(n, n)
        got = fe(wave, **hf_proc.Qwen3OmniMoeProcessor.audio_kwargs, return_tensors="pt")
        frames = int(got["attention_mask"].sum())
        tokens = int(hf_proc._get_feat_extract_output_lengths(got["attention_mask"].sum(-1), 50))
        item = proc((wave, 16000))
        assert frames == n // 160 and item.size == (frames,) and item.features.shape == (frames, 128)
        assert (item.features - got["input_features"][0, :, :frames].T).abs().max().item() <= 1e-5
        assert item.num_tokens == tokens == proc.num_tokens_from_meta({"num_samples": n, "sample_rate": 16000})
        assert tokens == hf_proc.Qwen3OmniMoeProcessor._get_num_audio_tokens(fake, n)
        items.append(item)
    with torch.no_grad():
        rows = enc(torch.cat([i.features for i in items]), torch.tensor([list(i.size) for i in items]))
    assert rows.shape == (sum(i.num_tokens for i in items), 16)
    # chunk_seconds: every piece is a clip of its own; the counts from metadata agree
    chunked = proc.with_options(chunk_seconds=0.5)
    pieces = chunked((_wave(24000, 1), 16000))
    assert len(pieces) == 3
    assert sum(p.num_tokens for p in pieces) == chunked.num_tokens_from_meta({"num_samples": 24000,
                                                                              "sample_rate": 16000})


def test_checkpoint_config_reading(thinker_dir):
    path, _ = thinker_dir
    check_audio_config_round_trip(Qwen3OmniAudioEncoder, path, D, OUT, "qwen3_omni_moe")
    enc = Qwen3OmniAudioEncoder.from_pretrained(path, max_frames=3000)
    # the simulator's and planner's hooks answer
    alpha, beta = enc.cost_coefficients()
    assert alpha == 0.0 and beta > 0 and enc.activation_bytes(100) > 0 and enc.attention_heads() == 4
    assert len(enc.layer_modules()) == 2 and enc.feature_width() == round(MEL * 98 / 13)


# --- mistakes: one clear line -------------------------------------------------------------------

def test_mistakes_raise_one_line(thinker_dir, tmp_path):
    path, _ = thinker_dir
    enc = Qwen3OmniAudioEncoder.from_pretrained(path)
    cases = [
        (lambda: enc(torch.zeros(10, 128), torch.tensor([[10]])), r"num_mel_bins = 16\], got \(10, 128\)"),
        (lambda: enc(torch.zeros(10, MEL), torch.tensor([[12]])), "sizes describe 12 input units but features has 10"),
        (lambda: enc(torch.zeros(10, MEL), torch.tensor([[10], [0]])), "a clip of 0 mel frames makes no LLM token"),
        (lambda: Qwen3OmniAudioEncoder.processor(Qwen3OmniAudioConfig())((np.zeros(200, np.float32), 16000)),
         "too short: 200 samples"),
        (lambda: Qwen3OmniAudioEncoder.processor(Qwen3OmniAudioConfig(max_frames=100))(
            (np.zeros(101 * 160, np.float32), 16000)), "too long: 101 mel frames"),
        (lambda: Qwen3OmniAudioEncoder.processor(Qwen3OmniAudioConfig(max_frames=100)).num_tokens_from_meta(
            {"num_samples": 101 * 160, "sample_rate": 16000}), "too long"),
        (lambda: Qwen3OmniAudioConfig(n_window_infer=60), "n_window_infer 60 must be >= 2 \\* n_window = 100"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            call()
        assert "\n" not in str(info.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    with pytest.raises(ValueError, match="model_type 'qwen2_5_omni'.*qwen3_omni_moe / qwen3_omni_moe_thinker"):
        Qwen3OmniAudioEncoder.from_pretrained(str(tmp_path))
    assert enc(torch.zeros(0, MEL), torch.zeros(0, 1, dtype=torch.int64)).shape == (0, D)
