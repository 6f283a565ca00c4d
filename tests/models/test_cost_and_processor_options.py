"""The planner's default cost model comes from the model config; processors take per-source
options from the mixture file (image patch budget / resize policy, audio chunking)."""
import numpy as np
import pytest

from omni.models.build import build_model, media_processors
from omni.models.config import ModelConfig
from omni.models.cost import default_cost_model, llm_cost_coefficients
from omni.models.encoders.siglip import SiglipEncoderConfig, SiglipProcessor
from omni.models.encoders.whisper import WhisperEncoderConfig, WhisperProcessor, output_frames


def test_default_cost_model_is_flops():
    from recipes.compose import compose_config
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(compose_config([]))
    model = build_model(cfg.model, cfg.encoders, vocab_needed=272)
    cm = default_cost_model(model)
    c = model.llm.config
    alpha, beta = llm_cost_coefficients(model.llm)
    assert alpha == 2 * c.num_layers * c.num_heads * c.resolved_head_dim()
    assert beta == 2 * model.llm.num_active_params()
    assert (cm.alpha, cm.beta) == (alpha, beta)
    assert set(cm.encoders) == {"image", "audio"}
    a, b = model.encoders["image"].cost_coefficients()
    proj = sum(p.numel() for p in model.projectors["image"].parameters() if p.dim() > 1)
    assert cm.encoders["image"] == (a, b + 2 * proj)
    assert isinstance(ModelConfig(), ModelConfig)


def test_siglip_options_change_grid_and_token_count():
    proc = SiglipProcessor(SiglipEncoderConfig(image_size=64, patch_size=8))
    meta = {"height": 32, "width": 64}
    assert proc.num_tokens_from_meta(meta) == 4 * 8
    small = proc.with_options(max_patches=16)
    assert small.num_tokens_from_meta(meta) <= 16 and proc.max_patches == 64  # a copy
    square = proc.with_options(resize="square", max_patches=30)
    assert square.grid(32, 64) == (5, 5)
    img = np.random.default_rng(0).integers(0, 255, size=(32, 64, 3), dtype=np.uint8)
    for p in (proc, small, square):
        item = p(img)
        assert item.num_tokens == p.num_tokens_from_meta(meta) == item.features.shape[0]
    with pytest.raises(ValueError, match="resize policy 'stretch'"):
        proc.with_options(resize="stretch")


def test_whisper_chunking_splits_long_clips_into_equal_chunks():
    cfg = WhisperEncoderConfig(max_source_positions=100)  # max_frames 200 = 2 s at 16 kHz
    proc = WhisperProcessor(cfg)
    meta = {"num_samples": 16000 * 5, "sample_rate": 16000}
    with pytest.raises(ValueError, match="audio clip too long"):
        proc.num_tokens_from_meta(meta)
    chunked = proc.with_options(chunk_seconds=2.0)
    assert chunked.chunk_bounds(16000 * 5) == [(0, 26667), (26667, 53333), (53333, 80000)]
    wave = np.sin(np.arange(16000 * 5) / 7).astype(np.float32)
    items = chunked((wave, 16000))
    assert len(items) == 3 and [it.size[0] for it in items] == [166, 166, 166]
    assert sum(it.num_tokens for it in items) == chunked.num_tokens_from_meta(meta) == 3 * output_frames(166)
    # resampled input: chunked after resampling to 16 kHz, the count from metadata agrees
    wave8k = wave[::2].copy()
    assert sum(it.num_tokens for it in chunked((wave8k, 8000))) == chunked.num_tokens_from_meta(
        {"num_samples": len(wave8k), "sample_rate": 8000})
    with pytest.raises(ValueError, match="chunk_seconds=3.0 must be in"):
        proc.with_options(chunk_seconds=3.0)
    assert len(media_processors(build_model(ModelConfig(), {}, 272))) == 0
