"""A Qwen2-VL / Qwen2.5-VL model, and a LLaVA-1.5 one, loaded into Omni exports back to a
directory that transformers loads with every tensor bit-identical to the original, and export ->
load -> export is bit-exact; Omni's own CLIP + projector composition exports as LLaVA and
computes the same in transformers; a model that is not one is refused, naming the part."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from omni.models.build import build_model
from omni.models.config import EncoderSlot, ModelConfig
from omni.models.families.llava import export_llava
from omni.models.families.qwen_vl import export_qwen_vl

transformers = pytest.importorskip("transformers")

TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})


def _save(path, variant):
    torch.manual_seed(0)
    if variant == "qwen2_5_vl":
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=TEXT, vision_config=dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2,
                                                 out_hidden_size=32, window_size=56, fullatt_block_indexes=[1]),
            image_token_id=100)
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    else:
        cfg = transformers.Qwen2VLConfig(text_config=TEXT, vision_config=dict(depth=2, embed_dim=16, mlp_ratio=2,
                                                                              num_heads=2, hidden_size=32),
                                         image_token_id=100)
        model = transformers.Qwen2VLForConditionalGeneration(cfg)
    model.save_pretrained(path)
    return model.eval()


def _omni(path):
    return build_model(ModelConfig(pretrained=str(path)), {"vision": EncoderSlot(name="qwen_vl", pretrained=str(path))},
                       vocab_needed=128, seed=0)


@pytest.mark.parametrize("variant", ["qwen2_5_vl", "qwen2_vl"])
def test_export_loads_in_transformers_bit_exact_and_round_trips(tmp_path, variant):
    hf = _save(tmp_path / "orig", variant)
    export_qwen_vl(_omni(tmp_path / "orig"), str(tmp_path / "out"), image_token_id=100)
    back = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf) and back.config.image_token_id == 100
    assert back.config.text_config.rope_parameters["mrope_section"] == [1, 1, 2]
    want, got = hf.state_dict(), back.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # export -> load -> export: the same tensors under the same names
    export_qwen_vl(_omni(tmp_path / "out"), str(tmp_path / "again"), image_token_id=100)
    first, second = load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)


def test_a_model_that_is_not_a_qwen_vl_is_refused(tmp_path):
    from omegaconf import OmegaConf

    from recipes.compose import compose_config

    cfg = OmegaConf.to_object(compose_config([]))  # the demo: SigLIP + Whisper + Llama
    with pytest.raises(ValueError, match="needs the qwen_vl image encoder"):
        export_qwen_vl(build_model(cfg.model, cfg.encoders, vocab_needed=272), str(tmp_path), image_token_id=1)
    tiny = OmegaConf.to_object(compose_config(["encoders=vision_only", "encoders/vision=qwen_vl_tiny"]))
    with pytest.raises(ValueError, match="Qwen2 with M-RoPE; this backbone is family='llama'"):
        export_qwen_vl(build_model(tiny.model, tiny.encoders, vocab_needed=272), str(tmp_path), image_token_id=1)


def _llava(path):
    return build_model(ModelConfig(pretrained=str(path)), {"vision": EncoderSlot(name="clip", pretrained=str(path))},
                       vocab_needed=128, seed=0)


def test_llava_export_loads_in_transformers_bit_exact_and_round_trips(tmp_path):
    from model_helpers import save_tiny_llava

    hf = save_tiny_llava(tmp_path / "orig", vision_feature_layer=-3)
    ours = _llava(tmp_path / "orig")
    export_llava(ours, str(tmp_path / "out"), image_token_id=100)
    back = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf) and back.config.image_token_id == 100 and back.config.image_seq_length == 25
    assert back.config.vision_feature_layer == -3 and back.config.vision_feature_select_strategy == "default"
    want, got = hf.state_dict(), back.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the processor's settings travel with it
    again = _llava(tmp_path / "out")
    assert again.encoders["image"].config == ours.encoders["image"].config
    export_llava(again, str(tmp_path / "again"), image_token_id=100)
    first, second = load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)


def test_omnis_own_clip_composition_exports_as_llava(tmp_path):
    """A clip tower trained from scratch with Omni's default projector (two layers, as wide as
    the LLM, GELU) is LLaVA's composition: transformers computes the same logits from the
    exported directory."""
    import numpy as np
    from model_helpers import omni_logits
    from omegaconf import OmegaConf

    from dataloading.construct.batch import IGNORE_INDEX
    from dataloading.construct.constructor import Tokenized, assemble
    from omni.models.build import media_processors
    from recipes.compose import compose_config

    cfg = OmegaConf.to_object(compose_config(["encoders=vision_only", "encoders/vision=clip_tiny"]))
    ours = build_model(cfg.model, cfg.encoders, vocab_needed=272, seed=0).eval()
    with torch.no_grad():  # away from the fresh init (zero biases, unit norms), so a dropped part shows
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    export_llava(ours, str(tmp_path), image_token_id=260)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    item = media_processors(ours)["image"](np.random.default_rng(0).integers(0, 256, (70, 50, 3), dtype=np.uint8))
    ids = np.array([3, 4] + [260] * item.num_tokens + [5, 6], dtype=np.int64)
    row = assemble([Tokenized("s", ids, np.full(ids.shape, IGNORE_INDEX), [("image", item, np.arange(2, 66))])])
    pixels = item.features.reshape(8, 8, 3, 8, 8).permute(2, 0, 3, 1, 4).reshape(1, 3, 64, 64)
    with torch.no_grad():
        got = omni_logits(ours, row)
        want = hf(input_ids=torch.from_numpy(ids)[None], pixel_values=pixels).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_model_that_is_not_a_llava_is_refused(tmp_path):
    from omegaconf import OmegaConf

    from recipes.compose import compose_config

    def built(*overrides):
        cfg = OmegaConf.to_object(compose_config(list(overrides)))
        return build_model(cfg.model, cfg.encoders, vocab_needed=272)

    with pytest.raises(ValueError, match="siglip tower does not export as LLaVA: its output is the post-layernorm"):
        export_llava(built("encoders=vision_only"), str(tmp_path), image_token_id=1)
    with pytest.raises(ValueError, match="needs the clip image encoder"):
        export_llava(built("encoders=vision_only", "encoders/vision=qwen_vl_tiny"), str(tmp_path), image_token_id=1)
    with pytest.raises(ValueError, match=r"holds an image encoder only; this model also has \['audio'\]"):
        export_llava(built("encoders/vision=clip_tiny"), str(tmp_path), image_token_id=1)
    with pytest.raises(ValueError, match="64 -> 256 -> 128; LLaVA's is 64 -> 128 -> 128"):
        export_llava(built("encoders=vision_only", "encoders/vision=clip_tiny", "encoders.vision.projector.hidden_mult=2"),
                     str(tmp_path), image_token_id=1)
