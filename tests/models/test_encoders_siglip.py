"""SiglipEncoder: packed variable-size images equal transformers' SiglipVisionModel per image."""
import pickle

import numpy as np
import pytest
import torch

from dataloading.formats.media import MediaProcessor
from model_helpers import saved_hf_model
from omni.models.encoders.siglip import SiglipEncoder, SiglipEncoderConfig, patch_grid

transformers = pytest.importorskip("transformers")

TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (h, w, 3)).astype(np.uint8)


def _pixels(features: torch.Tensor, grid, p: int = 8) -> torch.Tensor:
    """Patches of one item back to the [1, C, H, W] image HF's Conv2d sees."""
    gh, gw = grid
    return features.reshape(gh, gw, 3, p, p).permute(2, 0, 3, 1, 4).reshape(1, 3, gh * p, gw * p)


@pytest.fixture(scope="module")
def vision_ckpt(tmp_path_factory):
    return saved_hf_model(transformers.SiglipVisionModel, transformers.SiglipVisionConfig(**TINY), tmp_path_factory,
                          "siglip_vision")


def test_packed_images_match_hf_per_image(vision_ckpt):
    path, hf = vision_ckpt
    enc = SiglipEncoder.from_pretrained(path, max_patches=24).eval()
    proc = SiglipEncoder.processor(enc.config)
    # three sizes the patch divides, and one over the budget (resized, aspect ratio kept)
    items = [proc(_image(h, w, i)) for i, (h, w) in enumerate([(32, 32), (48, 32), (16, 40), (50, 70)])]
    assert [it.size for it in items] == [(4, 4), (6, 4), (2, 5), (4, 5)]
    feats = torch.cat([it.features for it in items])
    sizes = torch.tensor([it.size for it in items], dtype=torch.int64)
    with torch.no_grad():
        out = enc(feats, sizes)
    assert out.shape == (sum(it.num_tokens for it in items), enc.output_dim)
    start = 0
    for it in items:
        with torch.no_grad():
            ref = hf(_pixels(it.features, it.size), interpolate_pos_encoding=True).last_hidden_state[0]
        assert _rel(out[start : start + it.num_tokens], ref) <= 1e-5, it.size
        start += it.num_tokens


def test_loads_vision_tower_of_full_siglip_model(tmp_path):
    torch.manual_seed(1)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=99,
                pad_token_id=1, bos_token_id=2, eos_token_id=3)
    cfg = transformers.SiglipConfig(text_config=text, vision_config=TINY)
    hf = transformers.SiglipModel(cfg).eval()
    hf.save_pretrained(tmp_path)
    enc = SiglipEncoder.from_pretrained(str(tmp_path), max_patches=12).eval()
    assert enc.config.hidden_size == 32 and enc.config.max_patches == 12
    item = SiglipEncoder.processor(enc.config)(_image(24, 32, 5))
    assert item.size == (3, 4)  # already a multiple of the patch and within the budget
    with torch.no_grad():
        out = enc(item.features, torch.tensor([item.size]))
        ref = hf.vision_model(_pixels(item.features, item.size), interpolate_pos_encoding=True).last_hidden_state[0]
    assert _rel(out, ref) <= 1e-5


def test_processor_pixels_match_hf_image_processor():
    proc = SiglipEncoder.processor(SiglipEncoderConfig(**TINY))
    img = _image(16, 24, 3)
    item = proc(img)
    ref = transformers.SiglipImageProcessor(do_resize=False)(img, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(_pixels(item.features, item.size), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("hw", [(32, 32), (100, 37), (7, 300), (1, 1), (640, 480), (3, 5000), (15, 17)])
def test_processor_tokens_agree_with_meta_and_budget(hw):
    cfg = SiglipEncoderConfig(**TINY, max_patches=20, min_patches=4)
    proc = SiglipEncoder.processor(cfg)
    item = proc(_image(*hw, seed=0))
    gh, gw = item.size
    assert item.num_tokens == gh * gw == item.features.shape[0]
    assert item.features.shape[1] == 3 * 8 * 8
    assert proc.num_tokens_from_meta({"height": hw[0], "width": hw[1]}) == item.num_tokens
    assert 4 <= gh * gw <= 20 or (gh * gw <= 20 and min(gh, gw) == 1)


def test_patch_grid_keeps_aspect_ratio_within_budget():
    rng = np.random.RandomState(0)
    for _ in range(300):
        h, w = (int(v) for v in rng.randint(1, 2000, size=2))
        gh, gw = patch_grid(h, w, patch=14, max_patches=256, min_patches=16)
        assert 1 <= gh * gw <= 256
        if min(h, w) >= 14 * 8 and max(h, w) <= 14 * 16:  # an ordinary image that fits: nearest multiples
            assert (gh, gw) == (round(h / 14), round(w / 14))
        if 0.5 < h / w < 2:  # aspect ratio kept to within a patch per side
            r = (gh / gw) / (h / w)
            lo, hi = gh / (gh + 1) * gw / (gw + 1), (gh + 1) / gh * (gw + 1) / gw
            assert lo <= r <= hi, (h, w, gh, gw)


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    enc = SiglipEncoder(SiglipEncoderConfig(**TINY))
    proc = SiglipEncoder.processor(enc.config)
    items = [proc(_image(24, 40, 0)), proc(_image(32, 32, 1))]
    out = enc(torch.cat([i.features for i in items]), torch.tensor([i.size for i in items]))
    out.square().sum().backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert enc(torch.zeros(0, 192), torch.zeros(0, 2, dtype=torch.int64)).shape == (0, 32)


def test_random_init_is_deterministic_and_processor_picklable():
    cfg = SiglipEncoder.build_config(TINY)
    torch.manual_seed(3)
    a = SiglipEncoder(cfg).state_dict()
    torch.manual_seed(3)
    b = SiglipEncoder(cfg).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    proc = SiglipEncoder.processor(cfg)
    assert isinstance(proc, MediaProcessor) and proc.modality == "image"
    clone = pickle.loads(pickle.dumps(proc))
    img = _image(20, 30, 0)
    assert torch.equal(clone(img).features, proc(img).features)


def test_cost_coefficients_and_hydra_config():
    omegaconf = pytest.importorskip("omegaconf")
    enc = SiglipEncoder(SiglipEncoderConfig(**TINY))
    alpha, beta = enc.cost_coefficients()
    assert alpha == 4 * 2 * 32
    assert beta == 2 * (8 * 32 * 32 + 4 * 32 * 64) + 2 * 3 * 64 * 32
    conf = omegaconf.OmegaConf.structured(SiglipEncoderConfig)
    assert conf.max_patches is None and list(conf.image_mean) == [0.5, 0.5, 0.5]


def test_from_pretrained_errors(tmp_path, vision_ckpt):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SiglipEncoder.from_pretrained(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        SiglipEncoder.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "whisper"}')
    with pytest.raises(ValueError, match="model_type 'whisper'"):
        SiglipEncoder.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="unknown config key 'max_patchez'.*valid keys"):
        SiglipEncoder.from_pretrained(vision_ckpt[0], max_patchez=3)


def test_from_scratch_position_table_varies_in_every_channel():
    """Where a patch sits must be readable from every frequency of the initial 2D sin-cos table
    (the demo's 8x8 grid): with MAE's temperature of 10000 most of them barely change across it
    (the slowest sine spans 7e-4 there)."""
    from omni.models.encoders.vit import sincos_2d

    side, dim = 8, 96
    quarter = dim // 4
    table = sincos_2d(side, dim).reshape(side, side, dim)
    by_y, by_x = table[:, 0, : dim // 2], table[0, :, dim // 2:]  # y channels down a column, x along a row
    for name, part in (("y", by_y), ("x", by_x)):
        sines = part[:, :quarter]  # [sin(f_i * c) for each frequency f_i], then the cosines
        spread = sines.max(0).values - sines.min(0).values
        assert bool((spread > 0.4).all()), (name, spread)
    assert torch.equal(table[:, 3, : dim // 2], by_y) and torch.equal(table[5, :, dim // 2:], by_x)
