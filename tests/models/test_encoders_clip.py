"""The ``clip`` tower equals transformers' ``CLIPVisionModel`` as LLaVA reads it (the hidden
state of ``vision_feature_layer``, the class token dropped or kept) on packed images, loaded
from a whole LLaVA directory and from CLIP checkpoints of their own; its processor equals
``CLIPImageProcessor`` (and ``LlavaImageProcessor`` with ``do_pad``) pixel for pixel."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omni.models.encoders.clip import ClipEncoder, ClipEncoderConfig
from model_helpers import LLAVA_TEXT, LLAVA_VISION, rel_err, save_tiny_llava

transformers = pytest.importorskip("transformers")
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil  # noqa: E402

# tall, already the crop's size, wide and smaller than the crop, odd sides
SHAPES = [(45, 37, 3), (30, 30, 3), (20, 64, 3), (33, 31, 3)]


def _images():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, size=s, dtype=np.uint8) for s in SHAPES]


def _packed(proc, images):
    items = [proc(img) for img in images]
    return torch.cat([it.features for it in items]), torch.tensor([list(it.size) for it in items]), items


@pytest.mark.parametrize("layer,strategy", [(-2, "default"), (-1, "full"), (1, "default"), (0, "full")])
def test_the_tower_equals_transformers(tmp_path, layer, strategy):
    hf = save_tiny_llava(tmp_path).model.vision_tower
    ours = ClipEncoder.from_pretrained(str(tmp_path), vision_feature_layer=layer,
                                       vision_feature_select_strategy=strategy).eval()
    c = ours.config
    assert (c.shortest_edge, c.crop_size, c.num_hidden_layers) == (36, 30, 3)  # read from the directory
    images = _images()
    features, sizes, items = _packed(ClipEncoder.processor(c), images)
    assert all(it.num_tokens == 25 + (strategy == "full") and it.size == (5, 5) for it in items)
    pixels = CLIPImageProcessorPil.from_pretrained(tmp_path)(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = hf(pixels, output_hidden_states=True).hidden_states[layer]
        got = ours(features, sizes)
    want = (want if strategy == "full" else want[:, 1:]).reshape(-1, 32)
    assert got.shape == want.shape == (len(images) * items[0].num_tokens, 32)
    assert rel_err(got, want) <= 1e-5
    # the layers that run train; the rest (and the post-layernorm) is carried, frozen
    ours.train()
    ours(features, sizes).square().mean().backward()
    run = c.layers_run
    for name, p in ours.named_parameters():
        unused = name.startswith("post_layernorm") or (name.startswith("encoder.layers.")
                                                      and int(name.split(".")[2]) >= run)
        assert p.requires_grad is not unused, name
        assert (p.grad is None) if unused else (p.grad is not None and p.grad.abs().sum() > 0), name


def test_a_packed_row_equals_each_image_alone():
    torch.manual_seed(0)
    enc = ClipEncoder(ClipEncoderConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                        image_size=30, patch_size=6, vision_feature_layer=-1)).eval()
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(0.0, 0.3)
        features, sizes, items = _packed(ClipEncoder.processor(enc.config), _images())
        packed = enc(features, sizes)
        alone = torch.cat([enc(it.features, torch.tensor([list(it.size)])) for it in items])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert enc(features[:0], sizes[:0]).shape == (0, 32)


@pytest.mark.parametrize("edge,pad", [(36, False), (24, False), (30, True)])
def test_the_processor_equals_transformers(edge, pad):
    """Shorter side to ``edge`` then the 30-pixel centre crop (24: the crop pads the resized
    image with zeros), or first padded to a square with the mean colour (LLaVA-1.5's pad)."""
    kwargs = dict(size={"shortest_edge": edge}, crop_size={"height": 30, "width": 30})
    theirs = LlavaImageProcessorPil(do_pad=True, **kwargs) if pad else CLIPImageProcessorPil(**kwargs)
    proc = ClipEncoder.processor(ClipEncoderConfig(**{**_arch(), "shortest_edge": edge, "pad_to_square": pad}))
    for img in _images():
        want = theirs(img, return_tensors="pt")["pixel_values"][0]
        got = torch.from_numpy(proc.pixels(img)).permute(2, 0, 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # patches in the Conv2d weight's order: (channel, row, col) of each patch, raster order
        patches = want.reshape(3, 5, 6, 5, 6).permute(1, 3, 0, 2, 4).reshape(25, 108)
        torch.testing.assert_close(proc(img).features, patches, rtol=1e-5, atol=1e-5)


def test_the_preprocessor_config_reads_back():
    """What the export writes (``hf_preprocessor_config``) loads into transformers' processor
    class and reads back into the same settings."""
    enc_cfg = ClipEncoderConfig(**{**_arch(), "shortest_edge": 40, "pad_to_square": True})
    enc = ClipEncoder(enc_cfg)
    pp = enc.hf_preprocessor_config()
    params = ClipEncoder.params_from_preprocessor_config(pp)
    assert params == {"image_mean": enc_cfg.image_mean, "image_std": enc_cfg.image_std, "shortest_edge": 40,
                      "crop_size": 30, "pad_to_square": True}
    theirs = LlavaImageProcessorPil(**{k: v for k, v in pp.items() if k != "image_processor_type"})
    img = _images()[0]
    torch.testing.assert_close(torch.from_numpy(ClipEncoder.processor(enc_cfg).pixels(img)).permute(2, 0, 1),
                               theirs(img, return_tensors="pt")["pixel_values"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["CLIPVisionModel", "CLIPModel"])
def test_clip_checkpoints_of_their_own_load(tmp_path, kind):
    """A CLIPVisionModel directory (transformers 5 saves it without a prefix) and a whole
    CLIPModel (the tower under vision_model.), with LLaVA's default feature choice."""
    torch.manual_seed(0)
    vision = {k: v for k, v in LLAVA_VISION.items() if k != "model_type"}
    if kind == "CLIPModel":
        model = transformers.CLIPModel(transformers.CLIPConfig(vision_config=vision, text_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))).eval()
        tower = model.vision_model
    else:
        model = tower = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**vision)).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(tmp_path)
    ours = ClipEncoder.from_pretrained(str(tmp_path)).eval()
    assert ClipEncoder.pretrained_projector(str(tmp_path)) is None  # no projector beside it
    features, sizes, _ = _packed(ClipEncoder.processor(ours.config), _images()[:2])
    pixels = features.reshape(2, 5, 5, 3, 6, 6).permute(0, 3, 1, 4, 2, 5).reshape(2, 3, 30, 30)
    with torch.no_grad():
        want = tower(pixels, output_hidden_states=True).hidden_states[-2][:, 1:].reshape(-1, 32)
        assert rel_err(ours(features, sizes), want) <= 1e-5


def test_what_the_tower_cannot_take_is_refused(tmp_path):
    with pytest.raises(ValueError, match="several layers"):
        ClipEncoder.build_config({**_arch(), "vision_feature_layer": [-2, -1]})
    with pytest.raises(ValueError, match="not a hidden state of a tower of 2 layers"):
        ClipEncoder.build_config({**_arch(), "vision_feature_layer": -4})
    with pytest.raises(ValueError, match="crops 24 pixels but the tower takes image_size=30"):
        ClipEncoder.build_config({**_arch(), "crop_size": 24})
    with pytest.raises(ValueError, match="resample=2"):
        ClipEncoder.params_from_preprocessor_config({"resample": 2})
    with pytest.raises(ValueError, match="the clip encoder loads CLIP towers"):
        ClipEncoder.params_from_hf_config({"model_type": "llava", "text_config": LLAVA_TEXT, "vision_config": {
            "model_type": "siglip_vision_model", "image_size": 30, "patch_size": 6}})
    enc = ClipEncoder(ClipEncoderConfig(**_arch()))
    with pytest.raises(ValueError, match="an image of 4x5 patches; the tower takes 5x5"):
        enc(torch.zeros(20, 108), torch.tensor([[4, 5]]))


def _arch():
    return dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=30,
                patch_size=6)
