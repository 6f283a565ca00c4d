"""A whole LLaVA-OneVision directory through Omni equals transformers: the Qwen2 language model
from ``model.pretrained``, the SigLIP tower, projector and newline from the ``llava_ov`` slot's
``pretrained``. One packed row holds an anyres image of a non-square size (tiled, unpadded,
shrunk by ``anyres_max``) and a video of 4 frames (pooled 2 x 2); its logits equal
transformers' logits of each sample run alone (relative error <= 1e-5). The processor's pixels
equal transformers' image processor's (its PIL variant), its token counts those of the
planner's metadata; greedy ``omni generate`` equals transformers ``generate``; the export loads
in transformers with equal logits and round-trips bit-exactly."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dataloading.construct.constructor import assemble
from hf_family_helpers import save_tiny_llava_onevision
from model_helpers import (assert_export_round_trips, assert_tile_pixels, load_with_tower, media_sample, omni_logits,
                           plugin_and_hf_pixels, rel_err)
from omni.models.build import media_processors

transformers = pytest.importorskip("transformers")
PixelProcessor = transformers.LlavaOnevisionImageProcessorPil


class _Clip:
    """A decoded video stand-in (``dataloading.formats.video.Video``'s interface): ``frames`` at 4 fps."""

    def __init__(self, frames):
        self.images = frames
        h, w = frames[0].shape[:2]
        self.meta = {"width": w, "height": h, "frames": len(frames), "fps": 4.0, "duration": len(frames) / 4.0}

    def frames(self, times):
        return [self.images[min(int(t * 4.0), len(self.images) - 1)] for t in times]


def _sample(name, before, after, item, token):
    return media_sample(name, before, after, item, token)


def _load(path):
    return load_with_tower(path, "llava_ov")


def _video_pixels(frames):
    """transformers' video input for frames already of the tower's size (no resize): x/255, then
    (x - 0.5) / 0.5, as [1, n, C, H, W]."""
    x = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float() / 255.0
    return ((x - 0.5) / 0.5)[None]


@pytest.mark.parametrize("config", [dict(), dict(vision_feature_layer=-2, vision_aspect_ratio="anyres_max_1"),
                                    dict(tile=18)], ids=["ov", "layer-2-shrunk", "tiles-not-whole-patches"])
def test_a_packed_row_of_images_and_a_video_equals_transformers_each_alone(tmp_path, config):
    hf, tok = save_tiny_llava_onevision(tmp_path, **config)
    ours = _load(tmp_path)
    proc = media_processors(ours)["image"].with_options(fps=4.0)
    rng = np.random.default_rng(0)
    # 2 x 2 tiles (unpadded to 4 x 8 features), 1 x 2 tiles (an odd padding: 3 rows of image in
    # 4, one row more kept), and a video of 4 frames
    images = [rng.integers(0, 256, size=s, dtype=np.uint8) for s in [(20, 37, 3), (15, 37, 3)]]
    tile = config.get("tile", 16)
    frames = [rng.integers(0, 256, size=(tile, tile, 3), dtype=np.uint8) for _ in range(4)]
    items = [proc(images[0]), proc(images[1]), proc.video(_Clip(frames))]
    # 16 base tokens, then the tiles' rows with a newline each (shrunk to 2 x 5 by anyres_max_1)
    if tile == 16:
        assert [it.num_tokens for it in items] == ([16 + 4 * 9, 16 + 4 * 9] if not config else [16 + 2 * 6] * 2) + [17]
    assert [it.num_tokens for it in items[:2]] == [proc.num_tokens_from_meta({"height": i.shape[0], "width": i.shape[1]})
                                                   for i in images]
    assert items[2].num_tokens == proc.num_tokens_from_meta(_Clip(frames).meta)
    image_id, video_id = hf.config.image_token_id, hf.config.video_token_id
    # Omni writes a video's placeholders as the image's (dataloading.formats.media.as_encoder_placeholders)
    samples = [_sample("a", [5, 6], [7, 8, 9], items[0], image_id), _sample("b", [11], [12, 13, 14], items[2], image_id),
               _sample("c", [15], [16], items[1], image_id)]
    pixels = PixelProcessor.from_pretrained(tmp_path)
    inputs = [pixels(images=[images[0]], return_tensors="pt"), {"pixel_values_videos": _video_pixels(frames)},
              pixels(images=[images[1]], return_tensors="pt")]
    with torch.no_grad():
        packed, start = omni_logits(ours, assemble(samples)), 0
        for s, extra in zip(samples, inputs):
            ids = s.ids if "pixel_values" in extra else np.where(s.ids == image_id, video_id, s.ids)
            want = hf(input_ids=torch.from_numpy(ids)[None], **extra).logits[0]
            assert rel_err(packed[start:start + len(s)], want) <= 1e-5
            torch.testing.assert_close(packed[start:start + len(s)], omni_logits(ours, assemble([s])), rtol=1e-5,
                                       atol=1e-5)
            start += len(s)


@pytest.mark.parametrize("size", [(20, 37), (37, 20), (16, 16), (33, 15), (7, 50)])
def test_the_processor_equals_transformers_image_processor(tmp_path, size):
    from omni.models.encoders.llava_ov import LlavaOvEncoder

    save_tiny_llava_onevision(tmp_path)
    item, got = plugin_and_hf_pixels(LlavaOvEncoder, tmp_path, PixelProcessor, size)
    assert_tile_pixels(item, got["pixel_values"][0], size)


def test_export_loads_in_transformers_with_equal_logits_and_round_trips(tmp_path):
    """``omni export`` of the directory: transformers loads it with the same tensors (so the same
    logits), the image processor's settings are the directory's, Omni loads it back with the
    same logits, and exporting the export writes the same bytes."""
    hf, _ = save_tiny_llava_onevision(tmp_path / "hf", vision_feature_layer=-2, vision_aspect_ratio="anyres_max_1")
    assert_export_round_trips(tmp_path, hf, ("image_grid_pinpoints", "vision_aspect_ratio", "vision_feature_layer",
                                             "image_token_id", "video_token_id"), PixelProcessor)


def test_greedy_generate_on_the_directory_equals_transformers(tmp_path, capsys):
    from PIL import Image

    from recipes.cli import main

    hf, tok = save_tiny_llava_onevision(tmp_path / "hf")
    pixels = np.random.default_rng(3).integers(0, 256, size=(21, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    argv = ["generate", "--model", str(tmp_path / "hf"), "--image", str(tmp_path / "a.png"), "--prompt", "what is this?",
            "--max-new-tokens", "12", "--greedy", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    inputs = PixelProcessor.from_pretrained(tmp_path / "hf")(images=[np.asarray(Image.open(tmp_path / "a.png"))],
                                                             return_tensors="pt")
    # the placeholder repeated as transformers' processor counts it: the base tile's 16 tokens,
    # then the unpadded grid's rows with their newlines
    n = 16 + 4 * 9
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text.replace("<image>", "<image>" * n), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([ids]), **inputs, max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    if want and want[-1] == tok.eos_token_id:
        want = want[:-1]
    assert got["token_ids"] == want and len(want) >= 3
    assert got["text"] == tok.decode(want, skip_special_tokens=True)
