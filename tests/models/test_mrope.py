"""M-RoPE (Qwen2-VL's multimodal rotary positions) equals transformers: the position ids of a
sequence with images and a video (``get_rope_index``), and the Qwen2.5-VL text model's hidden
states for given 3-D positions, through the native decoder."""
from __future__ import annotations

import pytest
import torch

from omni.models.llm import DecoderConfig
from dataloading.construct.positions import mrope_position_ids

transformers = pytest.importorskip("transformers")

TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})


def _vlm():
    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=dict(depth=1, hidden_size=16, intermediate_size=16,
                                                                             num_heads=2, out_hidden_size=32,
                                                                             tokens_per_second=4))
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()


def test_positions_equal_get_rope_index():
    """text 3, an image of 4 x 6 patches, text 2, a video of 3 x 4 x 8 patches at 0.7 s per
    temporal patch (x 4 tokens per second: frames 2.8 positions apart, floored), text 4, an
    image taller than wide, text 1."""
    layout = [(0, 3), (1, (1, 4, 6)), (0, 2), (2, (3, 4, 8)), (0, 4), (1, (1, 6, 2)), (0, 1)]
    types, items, images, videos = [], [], [], []
    for kind, what in layout:
        if kind == 0:
            types += [0] * what
            continue
        t, h, w = what
        n = t * (h // 2) * (w // 2)
        items.append((len(types), t, h // 2, w // 2, 4 * 0.7 if kind == 2 else 1))
        (videos if kind == 2 else images).append(list(what))
        types += [kind] * n
    ids = torch.zeros(1, len(types), dtype=torch.long)
    want, _ = _vlm().model.get_rope_index(ids, torch.tensor([types]), image_grid_thw=torch.tensor(images),
                                          video_grid_thw=torch.tensor(videos), second_per_grid_ts=torch.tensor([0.7]))
    got = mrope_position_ids(len(types), items)
    assert torch.equal(got, want[:, 0])
    # text alone is 1-D RoPE in every row; two items need no text between them
    assert torch.equal(mrope_position_ids(5, []), torch.arange(5).expand(3, 5))
    both = mrope_position_ids(8, [(0, 1, 1, 2, 1), (2, 1, 2, 1, 1)])
    assert both[:, :2].tolist() == [[0, 0], [0, 0], [0, 1]] and both[:, 2:4].tolist() == [[2, 2], [2, 3], [2, 2]]
    with pytest.raises(ValueError, match="overlaps"):
        mrope_position_ids(8, [(0, 1, 1, 2, 1), (1, 1, 1, 1, 1)])


def test_a_qwen2_5_vl_directory_loads_its_language_model_and_equals_it(tmp_path):
    """``load_pretrained`` (what model.pretrained uses) on a whole Qwen2.5-VL directory: the
    text model with M-RoPE (the vision tower's weights are left to the encoder slot); logits
    equal transformers' for 3-D positions around two images, and differ with 1-D ones."""
    from omni.models.hf_io import load_pretrained_llm as load_pretrained

    hf = _vlm()
    with torch.no_grad():  # weights large enough that positions matter
        for p in hf.model.language_model.parameters():
            p.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(str(tmp_path)).eval()
    cfg = ours.config
    assert cfg.family == "qwen2" and cfg.mrope_section == [1, 1, 2] and cfg.attention_bias
    ids = torch.randint(0, 128, (1, 14))
    pos = mrope_position_ids(14, [(2, 1, 2, 3, 1), (10, 1, 1, 2, 1)])[:, None]
    with torch.no_grad():
        want = hf.lm_head(hf.model.language_model(input_ids=ids, position_ids=pos).last_hidden_state)
        got = ours(input_ids=ids, rope_position_ids=pos).logits
        plain = ours(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, want, atol=1e-3)  # 1-D positions differ where the images are
    with pytest.raises(ValueError, match="must be three sections"):
        DecoderConfig(hidden_size=32, num_heads=4, num_kv_heads=2, mrope_section=[1, 1, 1]).validate()
    with pytest.raises(ValueError, match="M-RoPE.*exports with its vision tower"):
        cfg.to_hf()
