"""Spatial merge (a vision tower's ``spatial_merge``, Qwen2-VL's 2x2 patch merger): the
processor makes grids of whole merge blocks and counts one LLM placeholder per block; the
encoder emits each block's patches together (the same outputs as raster order, permuted); the
projector joins them (norm, concatenation, MLP); the model's cost model counts a media item by
its placeholders with the encoder's tokens behind them."""
import dataclasses

import numpy as np
import pytest
import torch

from omni.models.build import build_model
from omni.models.cost import default_cost_model
from omni.models.encoders.siglip import SiglipEncoder, SiglipEncoderConfig, SiglipProcessor, merge_order
from omni.models.projector import Projector

TINY = SiglipEncoderConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=2)


@pytest.mark.parametrize("hw", [(32, 64), (17, 90), (5, 5), (64, 64)])
def test_processor_grids_are_whole_blocks_and_count_one_token_per_block(hw):
    plain = SiglipProcessor(dataclasses.replace(TINY, max_patches=40))
    merged = SiglipProcessor(dataclasses.replace(TINY, max_patches=40, spatial_merge=2))
    gh, gw = merged.grid(*hw)
    assert gh % 2 == 0 and gw % 2 == 0 and gh * gw <= 40
    img = np.random.default_rng(0).integers(0, 255, size=(*hw, 3), dtype=np.uint8)
    item = merged(img)
    assert item.size == (gh, gw) and item.features.shape[0] == gh * gw
    assert item.num_tokens == gh * gw // 4 == merged.num_tokens_from_meta({"height": hw[0], "width": hw[1]})
    assert plain(img).num_tokens == plain(img).features.shape[0]  # unchanged without merging
    square = merged.with_options(resize="square", max_patches=30)
    assert square.grid(*hw) == (4, 4)


def test_merge_order_groups_each_block():
    order = merge_order(4, 6, 2).tolist()
    assert order[:4] == [0, 1, 6, 7] and order[4:8] == [2, 3, 8, 9] and sorted(order) == list(range(24))


def test_encoder_emits_blocks_together_with_raster_outputs():
    plain = SiglipEncoder(TINY)
    merged = SiglipEncoder(dataclasses.replace(TINY, spatial_merge=2))
    merged.load_state_dict(plain.state_dict())
    sizes = torch.tensor([[4, 6], [2, 2]])
    features = torch.randn(28, 12)
    want = plain(features, sizes)
    perm = torch.cat([merge_order(4, 6, 2), merge_order(2, 2, 2) + 24])
    torch.testing.assert_close(merged(features, sizes), want[perm], rtol=1e-5, atol=1e-6)
    assert merged.tokens_per_row == 4 and plain.tokens_per_row == 1
    with pytest.raises(ValueError, match="does not split into 2x2 blocks"):
        merged(torch.randn(6, 12), torch.tensor([[2, 3]]))


def test_projector_joins_each_group_of_neighbours():
    proj = Projector(16, 32, merge=4)
    x = torch.randn(8, 16)
    got = proj(x)
    want = proj.fc2(proj.act(proj.fc1(proj.norm(x).reshape(2, 64))))
    assert got.shape == (2, 32)
    torch.testing.assert_close(got, want)
    assert proj(torch.zeros(0, 16)).shape == (0, 32)
    with pytest.raises(ValueError, match="do not make rows of 4"):
        proj(torch.randn(6, 16))


def test_the_cost_model_counts_placeholders_with_the_tokens_behind_them():
    from omegaconf import OmegaConf

    from recipes.compose import compose_config

    cfg = OmegaConf.to_object(compose_config(["+encoders.vision.params.spatial_merge=2"]))
    model = build_model(cfg.model, cfg.encoders, vocab_needed=272)
    enc = model.encoders["image"]
    assert enc.tokens_per_row == 4 and model.projectors["image"].merge == 4
    a, b = enc.cost_coefficients()
    proj = sum(p.numel() for p in model.projectors["image"].parameters() if p.dim() > 1)
    assert default_cost_model(model).encoders["image"] == (a * 16, b * 4 + 2 * proj)
