"""The Qwen2-VL / Qwen2.5-VL vision tower equals transformers' on packed images and videos.

Tiny random checkpoints are saved by transformers (the whole ForConditionalGeneration model,
as a user's directory holds it) and loaded by ``QwenVisionEncoder.from_pretrained``; our
patch states, put through transformers' own merger, must equal transformers' merged output
(which Qwen2.5-VL returns in the input's order after its window reordering)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omni.models.encoders.qwen_vl import QwenVisionConfig, QwenVisionEncoder
from omni.models.encoders.qwen_vl_processor import smart_resize
from omni.models.encoders.qwen_vl_windows import merge_order_positions, window_ids

transformers = pytest.importorskip("transformers")

TEXT = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]})
# (t, h, w) patch grids: a still image, a two-frame video, an image several windows wide (2 x 2
# merge groups per window below), one whose edge windows are cut, a single merge group
GRIDS = [[1, 4, 6], [2, 8, 4], [1, 12, 10], [1, 2, 2]]


def _save(tmp_path, variant: str):
    torch.manual_seed(0)
    if variant == "qwen2_5_vl":
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=TEXT, vision_config=dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2,
                                                 out_hidden_size=24, window_size=56, fullatt_block_indexes=[1, 3]))
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    else:
        cfg = transformers.Qwen2VLConfig(
            text_config=TEXT, vision_config=dict(depth=3, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=24))
        model = transformers.Qwen2VLForConditionalGeneration(cfg)
    # Weights large enough that attention is far from uniform: with the default 0.02 init the
    # scores are ~1e-3, and positions or windows would barely change the output.
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.normal_(0.0, 0.3)
    model = model.eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("variant", ["qwen2_5_vl", "qwen2_vl"])
def test_the_tower_equals_transformers(tmp_path, variant):
    hf = _save(tmp_path, variant)
    ours = QwenVisionEncoder.from_pretrained(str(tmp_path)).eval()
    c = ours.config
    assert c.variant == variant and c.hidden_size == 32 and ours.tokens_per_row == 4
    if variant == "qwen2_5_vl":
        assert [c.windowed(i) for i in range(4)] == [True, False, True, False]
    grid = torch.tensor(GRIDS)
    torch.manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), c.patch_dim)
    visual = hf.model.visual
    with torch.no_grad():
        want = visual(pixels, grid_thw=grid).pooler_output
        states = ours(pixels, grid)
        got = visual.merger(states)
    assert states.shape == (pixels.shape[0], 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # gradients flow to every weight
    ours.train()
    ours(pixels, grid).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.parameters())


def test_windows_change_the_result_where_an_image_spans_several():
    """Window attention is not full attention: the same weights without windows differ on an
    image wider than a window, and agree on one that fits in a single window."""
    torch.manual_seed(0)
    cfg = QwenVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                           window_size=56, fullatt_block_indexes=[1])
    windowed = QwenVisionEncoder(cfg).eval()
    full = QwenVisionEncoder(QwenVisionConfig(**{**cfg.__dict__, "window_size": 0})).eval()
    full.load_state_dict(windowed.state_dict())
    for grid, same in (([[1, 4, 4]], True), ([[1, 8, 4]], False)):
        g = torch.tensor(grid)
        x = torch.randn(int(g.prod()), cfg.patch_dim)
        with torch.no_grad():
            assert torch.allclose(windowed(x, g), full(x, g), atol=1e-6) is same


def test_positions_and_windows_follow_the_merge_order():
    # a 4 x 4 grid, merge 2: the first group is (0,0) (0,1) (1,0) (1,1), then the group to its right
    pos = merge_order_positions(1, 4, 4, 2)
    assert pos[:8].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    assert merge_order_positions(2, 2, 2, 2).tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]] * 2
    # 3 x 3 merge groups in windows of 2 groups per side: 2 x 2 windows, the edge ones cut
    ids = window_ids(1, 6, 6, 2, 2)
    per_group = ids[::4].tolist()
    assert per_group == [0, 0, 1, 0, 0, 1, 2, 2, 3]
    assert window_ids(2, 2, 2, 2, 2).tolist() == [0] * 4 + [1] * 4  # frames never share a window


def test_a_wrong_checkpoint_or_config_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="window_size 50 must be a multiple"):
        QwenVisionConfig(window_size=50)
    with pytest.raises(ValueError, match="variant 'qwen3'"):
        QwenVisionConfig(variant="qwen3")
    (tmp_path / "config.json").write_text('{"model_type": "siglip_vision_model"}')
    with pytest.raises(ValueError, match="model_type 'siglip_vision_model'.*qwen2_vl / qwen2_5_vl"):
        QwenVisionEncoder.from_pretrained(str(tmp_path))


def test_smart_resize_keeps_sides_multiples_of_a_merge_group_within_the_pixel_budget():
    # worked by hand from the rule (patch 14 x merge 2 = 28 pixels; 3136 .. 50176 pixels)
    assert smart_resize(100, 150, 28, 3136, 50176) == (112, 140)  # rounded to multiples of 28
    assert smart_resize(1000, 2000, 28, 3136, 50176) == (140, 308)  # over the budget: scaled down, floored
    assert smart_resize(20, 30, 28, 3136, 50176) == (56, 84)  # under the minimum: scaled up, ceiled
    with pytest.raises(ValueError, match="aspect ratio over 200"):
        smart_resize(10, 2500, 28, 3136, 50176)


def test_the_processor_lays_patches_out_as_the_tower_reads_them():
    """Each feature row is one patch in merge-window order (the tower's positions), flattened
    as (channel, frame, row, col) with the frame repeated; no resize at a target size."""
    cfg = QwenVisionConfig(image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0], max_pixels=28 * 28 * 64)
    proc = QwenVisionEncoder.processor(cfg)
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(56, 84, 3), dtype=np.uint8)  # 4 x 6 patches: no resize
    item = proc(img)
    assert item.size == (1, 4, 6) and item.num_tokens == 6 and item.features.shape == (24, 3 * 2 * 14 * 14)
    assert proc.num_tokens_from_meta({"height": 56, "width": 84}) == item.num_tokens
    pos = merge_order_positions(1, 4, 6, 2)
    for i in (0, 1, 2, 5, 23):
        r, c = pos[i].tolist()
        block = img[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14].astype(np.float32) / 255  # [P, P, C]
        want = np.broadcast_to(block.transpose(2, 0, 1)[:, None], (3, 2, 14, 14)).reshape(-1)
        np.testing.assert_allclose(item.features[i].numpy(), want, rtol=0, atol=1e-7)
    # a source's own budget; a larger image is resized into it
    small = proc.with_options(max_pixels=28 * 28 * 5)  # 300 x 300 -> 56 x 56 pixels
    assert small(rng.integers(0, 256, size=(300, 300, 3), dtype=np.uint8)).size == (1, 4, 4)
    with pytest.raises(ValueError, match="min_pixels"):
        proc.with_options(max_pixels=100)


def test_the_preprocessor_config_sets_the_pixel_budget(tmp_path):
    _save(tmp_path, "qwen2_vl")
    (tmp_path / "preprocessor_config.json").write_text(
        '{"size": {"shortest_edge": 6272, "longest_edge": 40000}, "image_mean": [0.5, 0.5, 0.5], '
        '"image_std": [0.5, 0.5, 0.5]}')
    c = QwenVisionEncoder.from_pretrained(str(tmp_path)).config
    assert (c.min_pixels, c.max_pixels, c.image_mean) == (6272, 40000, [0.5, 0.5, 0.5])


@pytest.mark.parametrize("variant", ["qwen2_5_vl", "qwen2_vl"])
def test_a_pretrained_slot_loads_the_tower_and_its_merger_as_the_projector(tmp_path, variant):
    """``encoders.vision.pretrained=<Qwen dir>`` through Omni's model builder: encoder plus
    projector equal transformers' merged vision output; an LLM of another width gets a fresh
    projector (with a warning), and ``projector.pretrained=false`` asks for one."""
    from omni.models.build import build_model
    from omni.models.config import EncoderSlot, ModelConfig, ProjectorConfig

    hf = _save(tmp_path, variant)
    slot = EncoderSlot(name="qwen_vl", pretrained=str(tmp_path))
    llm = ModelConfig(hidden_size=24, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    model = build_model(llm, {"vision": slot}, vocab_needed=272, seed=0).eval()
    proj = model.projectors["image"]
    assert isinstance(proj.norm, torch.nn.RMSNorm if variant == "qwen2_5_vl" else torch.nn.LayerNorm)
    grid = torch.tensor(GRIDS)
    pixels = torch.randn(int(grid.prod(-1).sum()), model.encoders["image"].config.patch_dim)
    with torch.no_grad():
        want = hf.model.visual(pixels, grid_thw=grid).pooler_output
        got = proj(model.encoders["image"](pixels, grid))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    with pytest.warns(UserWarning, match="maps to width 24, this LLM takes 32: the projector starts fresh"):
        other = build_model(ModelConfig(hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2,
                                        num_kv_heads=1), {"vision": slot}, vocab_needed=272, seed=0)
    assert other.projectors["image"].fc2.out_features == 32
    fresh = build_model(llm, {"vision": EncoderSlot(name="qwen_vl", pretrained=str(tmp_path),
                                                    projector=ProjectorConfig(pretrained=False))},
                        vocab_needed=272, seed=0)
    assert model.projectors["image"].fc1.out_features == 32 * 4  # the merger's width: ViT width x merge^2
    # projector.pretrained=false: a fresh merger (the family's projector shape, fresh_projector),
    # not the checkpoint's weights
    assert fresh.projectors["image"].fc1.out_features == 32 * 4
    assert not torch.equal(fresh.projectors["image"].fc1.weight, model.projectors["image"].fc1.weight)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_layers_give_the_same_gradients(mode):
    """``parallel.encoder_activation_checkpoint`` (the encoder's ``activation_checkpoint``)
    recomputes each block in the backward: same outputs and gradients as keeping everything."""
    torch.manual_seed(0)
    cfg = QwenVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                           window_size=56, fullatt_block_indexes=[1])
    kept, redone = QwenVisionEncoder(cfg), QwenVisionEncoder(cfg)
    redone.load_state_dict(kept.state_dict())
    redone.activation_checkpoint = mode
    grid = torch.tensor([[1, 8, 4], [2, 4, 4]])
    x = torch.randn(int(grid.prod(-1).sum()), cfg.patch_dim)
    outs = []
    for enc in (kept, redone):
        y = enc(x, grid)
        y.square().mean().backward()
        outs.append((y.detach(), {n: p.grad for n, p in enc.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0])
    for name, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], g, rtol=1e-5, atol=1e-6)
