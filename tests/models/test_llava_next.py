"""A whole LLaVA-NeXT directory through Omni equals transformers: the Llama language model from
``model.pretrained``, the CLIP tower, projector and newline from the ``llava_next`` slot's
``pretrained``. One packed row holds two anyres images of different aspect ratios (one wide,
tiled 2 x 2 and unpadded top and bottom; one tall, tiled 2 x 1 and unpadded left and right);
its logits equal transformers' logits of each sample run alone (relative error <= 1e-5). The
processor's pixels equal transformers' image processor's (its PIL variant) and its token counts
the planner's; the export loads in transformers with the same tensors and round-trips
bit-exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dataloading.construct.constructor import assemble
from hf_family_helpers import save_tiny_llava_next_chat
from model_helpers import (assert_export_round_trips, assert_tile_pixels, load_with_tower, media_sample, omni_logits,
                           plugin_and_hf_pixels, rel_err)
from omni.models.build import media_processors

transformers = pytest.importorskip("transformers")
PixelProcessor = transformers.LlavaNextImageProcessorPil


def _sample(name, before, after, item, token):
    return media_sample(name, before, after, item, token)


def _load(path):
    return load_with_tower(path, "llava_next")


@pytest.mark.parametrize("config", [dict(), dict(vision_feature_layer=-1)], ids=["layer-2", "layer-1"])
def test_a_packed_row_of_two_anyres_images_equals_transformers_each_alone(tmp_path, config):
    hf, _ = save_tiny_llava_next_chat(tmp_path, **config)
    ours = _load(tmp_path)
    proc = media_processors(ours)["image"]
    rng = np.random.default_rng(0)
    # 20 x 37: 2 x 2 tiles, the 8 x 8 grid unpadded to 4 rows; 37 x 11: 2 x 1 tiles, the 8 x 4
    # grid unpadded to 2 columns
    images = [rng.integers(0, 256, size=s, dtype=np.uint8) for s in [(20, 37, 3), (37, 11, 3)]]
    items = [proc(im) for im in images]
    assert [it.num_tokens for it in items] == [16 + 4 * 9, 16 + 8 * 3]
    assert [it.num_tokens for it in items] == [proc.num_tokens_from_meta({"height": i.shape[0], "width": i.shape[1]})
                                               for i in images]
    image_id = hf.config.image_token_id
    samples = [_sample("a", [5, 6], [7, 8, 9], items[0], image_id), _sample("b", [11], [12, 13], items[1], image_id)]
    pixels = PixelProcessor.from_pretrained(tmp_path)
    with torch.no_grad():
        packed, start = omni_logits(ours, assemble(samples)), 0
        for s, image in zip(samples, images):
            want = hf(input_ids=torch.from_numpy(s.ids)[None], **pixels(images=[image], return_tensors="pt")).logits[0]
            assert rel_err(packed[start:start + len(s)], want) <= 1e-5
            start += len(s)


@pytest.mark.parametrize("size", [(20, 37), (37, 11), (16, 16), (33, 15), (7, 50)])
def test_the_processor_equals_transformers_image_processor(tmp_path, size):
    from omni.models.encoders.llava_next import LlavaNextEncoder

    save_tiny_llava_next_chat(tmp_path)
    item, got = plugin_and_hf_pixels(LlavaNextEncoder, tmp_path, PixelProcessor, size)
    assert got["image_sizes"][0].tolist() == list(size)
    assert_tile_pixels(item, got["pixel_values"][0], size)


def test_export_loads_in_transformers_bit_identically_and_round_trips(tmp_path):
    """``omni export`` of the directory: transformers loads it with the same tensors (so the same
    logits), the image processor's settings are the directory's, Omni loads it back with
    transformers' logits, and exporting the export writes the same bytes."""
    hf, _ = save_tiny_llava_next_chat(tmp_path / "hf")
    assert_export_round_trips(tmp_path, hf, ("image_grid_pinpoints", "vision_feature_layer",
                                             "vision_feature_select_strategy", "image_token_id"), PixelProcessor)


def test_settings_the_layout_cannot_take_are_refused():
    from omni.models.encoders.llava_next import LlavaNextEncoder

    small = dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4)
    assert LlavaNextEncoder.build_config(small).image_grid_pinpoints == [[16, 32], [32, 16], [32, 32], [48, 16],
                                                                         [16, 48]]
    with pytest.raises(ValueError, match="needs the class token dropped"):
        LlavaNextEncoder.build_config({**small, "vision_feature_select_strategy": "full"})
    with pytest.raises(ValueError, match="shortest_edge=20"):
        LlavaNextEncoder.build_config({**small, "shortest_edge": 20})
    with pytest.raises(ValueError, match="positive multiple of image_size 16"):
        LlavaNextEncoder.build_config({**small, "image_grid_pinpoints": [[16, 24]]})
