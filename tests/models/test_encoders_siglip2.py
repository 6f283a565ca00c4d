"""The siglip2 plugin equals transformers' Siglip2VisionModel (NaFlex) on packed images.

Tiny random checkpoints are saved by transformers (a Siglip2VisionModel, and a full Siglip2Model
whose tower sits under ``vision_model.``) and loaded by ``Siglip2Encoder.from_pretrained``. The
reference input comes from transformers' own image processor (its PIL variant, which imports
without torchvision), so the processor is checked independently of the tower."""
from __future__ import annotations

import os
import pickle
import random
import sys

import numpy as np
import pytest
import torch

from omni.models.encoders.siglip2 import Siglip2Encoder, Siglip2EncoderConfig, naflex_grid

transformers = pytest.importorskip("transformers")
from transformers.models.siglip2.image_processing_pil_siglip2 import (  # noqa: E402
    Siglip2ImageProcessorPil, get_image_size_for_max_num_patches)

# hidden 32, 2 layers, 2 heads, patch 4, a 4 x 4 position table
TOWER = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
             num_patches=16, hidden_act="gelu_pytorch_tanh")
# (H, W) pixels: wide and tall images (grids of 3 x 5 and 5 x 3 at 16 patches: the table is
# shrunk along one axis and stretched along the other), one already at the table's 4 x 4 grid,
# a small one that is enlarged
SIZES = [(24, 40), (36, 20), (16, 16), (6, 9)]


def _images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in sizes]


def _randomise(module, seed=0):
    # Weights large enough that attention is far from uniform and the (resized) position
    # table moves the output: with transformers' init the scores are nearly flat.
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.15)


def _save_vision(tmp_path, max_num_patches=16):
    hf = transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(**TOWER, vision_use_head=True))
    _randomise(hf)
    hf = hf.eval()
    hf.save_pretrained(tmp_path)
    Siglip2ImageProcessorPil(patch_size=4, max_num_patches=max_num_patches).save_pretrained(tmp_path)
    return hf


def _hf_inputs(images, max_num_patches):
    proc = Siglip2ImageProcessorPil(patch_size=4, max_num_patches=max_num_patches)
    return proc(images=images, return_tensors="pt", input_data_format="channels_last")


def _ours_packed(enc, images, **options):
    proc = Siglip2Encoder.processor(enc.config)
    if options:
        proc = proc.with_options(**options)
    items = [proc(img) for img in images]
    return items, torch.cat([it.features for it in items]), torch.tensor([it.size for it in items])


def test_packed_images_equal_transformers_per_image(tmp_path):
    hf = _save_vision(tmp_path)
    ours = Siglip2Encoder.from_pretrained(str(tmp_path)).eval()
    assert ours.config.max_num_patches == 16 and ours.config.hidden_size == 32  # preprocessor_config.json read
    assert not any(n.startswith("head.") for n in ours.state_dict())  # the pooling head is not built
    images = _images(SIZES)
    inputs = _hf_inputs(images, 16)
    items, features, sizes = _ours_packed(ours, images)
    assert sizes.tolist() == inputs["spatial_shapes"].tolist() == [[3, 5], [5, 3], [4, 4], [3, 5]]
    with torch.no_grad():
        want = hf(**inputs).last_hidden_state
        got = ours(features, sizes)
    assert got.shape == (sum(h * w for h, w in sizes.tolist()), 32)
    start = 0
    for i, (h, w) in enumerate(sizes.tolist()):
        torch.testing.assert_close(got[start:start + h * w], want[i, :h * w], rtol=1e-5, atol=1e-5)
        start += h * w
    # gradients reach every weight
    ours.train()
    ours(features, sizes).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.parameters())


def test_grids_larger_than_the_position_table_equal_transformers(tmp_path):
    """A per-source budget above num_patches (``with_options``): the table is stretched."""
    hf = _save_vision(tmp_path)
    ours = Siglip2Encoder.from_pretrained(str(tmp_path)).eval()
    images = _images([(40, 24), (30, 30)], seed=1)
    inputs = _hf_inputs(images, 40)
    _, features, sizes = _ours_packed(ours, images, max_num_patches=40)
    assert sizes.tolist() == inputs["spatial_shapes"].tolist() == [[8, 5], [6, 6]]
    with torch.no_grad():
        want = hf(**inputs).last_hidden_state
        got = ours(features, sizes)
    torch.testing.assert_close(got[:40], want[0, :40], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[40:], want[1, :36], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [1, 5, 16, 64])
def test_the_processor_equals_transformers_image_processor(budget):
    """Resize (bilinear, to the NaFlex grid), rescale, normalise and the patch layout of each
    row equal Siglip2ImageProcessor's unpadded rows; the planner's count agrees."""
    sizes = [*SIZES, (8, 200), (200, 8), (1, 1), (57, 31)]
    images = _images(sizes, seed=2)
    want = _hf_inputs(images, budget)
    proc = Siglip2Encoder.processor(Siglip2EncoderConfig(**TOWER)).with_options(max_num_patches=budget)
    proc = pickle.loads(pickle.dumps(proc))  # data-loading workers receive it pickled
    for i, img in enumerate(images):
        item = proc(img)
        h, w = want["spatial_shapes"][i].tolist()
        assert item.size == (h, w) and item.num_tokens == h * w <= budget
        assert proc.num_tokens_from_meta({"height": img.shape[0], "width": img.shape[1]}) == h * w
        np.testing.assert_allclose(item.features.numpy(), want["pixel_values"][i, :h * w].numpy(), rtol=0, atol=1e-6)
        assert int(want["pixel_attention_mask"][i].sum()) == h * w


def test_the_grid_rule_equals_transformers_on_many_sizes():
    rng = random.Random(0)
    for _ in range(2000):
        p = rng.choice([4, 14, 16])
        budget = rng.choice([1, 3, 16, 256, 729, 1024])
        h = rng.choice([rng.randint(1, 64), rng.randint(1, 4000)])
        w = rng.choice([rng.randint(1, 64), rng.randint(1, 4000), h])
        th, tw = get_image_size_for_max_num_patches(h, w, p, budget)
        assert naflex_grid(h, w, p, budget) == (th // p, tw // p), (h, w, p, budget)


def test_a_packed_batch_equals_each_image_alone(tmp_path):
    """Loaded from a full Siglip2Model (text tower beside it, vision weights under vision_model.)."""
    cfg = transformers.Siglip2Config(
        vision_config={**TOWER, "vision_use_head": True},
        text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         vocab_size=64, max_position_embeddings=16))
    full = transformers.Siglip2Model(cfg)
    _randomise(full, seed=3)
    full.save_pretrained(tmp_path)
    ours = Siglip2Encoder.from_pretrained(str(tmp_path), max_num_patches=24).eval()
    assert ours.config.num_hidden_layers == 2 and ours.config.max_num_patches == 24
    torch.testing.assert_close(ours.embeddings.position_embedding.weight,
                               full.vision_model.embeddings.position_embedding.weight)
    images = _images(SIZES, seed=4)
    items, features, sizes = _ours_packed(ours, images)
    with torch.no_grad():
        packed = ours(features, sizes)
        alone = torch.cat([ours(it.features, torch.tensor([it.size])) for it in items])
        want = full.vision_model(**_hf_inputs(images, 24)).last_hidden_state
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    h, w = sizes[0].tolist()
    torch.testing.assert_close(packed[:h * w], want[0, :h * w], rtol=1e-5, atol=1e-5)


def _sp_worker(rank: int, world: int) -> None:
    """One image's tokens split over the group (long-item sequence parallelism): each member's
    rows and the summed gradients equal the single process's; the resized positions travel
    with the tokens because ``embed_inputs`` runs before the split."""
    import torch.distributed as dist

    from omni.models.encoders.sequence_parallel import encode_long_items, piece_bounds

    torch.manual_seed(0)
    enc = Siglip2Encoder(Siglip2EncoderConfig(**TOWER))
    _randomise(enc)
    sizes = torch.tensor([[3, 5], [5, 3]])
    features = torch.randn(30, 48, generator=torch.Generator().manual_seed(1))
    ref = enc(features, sizes)
    ref.square().sum().backward()
    want = {n: p.grad.clone() for n, p in enc.named_parameters()}
    enc.zero_grad(set_to_none=True)
    out, rows = encode_long_items(enc, features, sizes, None)
    mine = torch.cat([r + 15 * i for i, r in enumerate(rows)])
    assert [r.tolist() for r in rows] == [list(range(*piece_bounds(15, world, rank)))] * 2
    torch.testing.assert_close(out, ref.detach()[mine], rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    for name, p in enc.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        assert (g - want[name]).norm() <= 1e-5 * max(want[name].norm().item(), 1.0), name


def test_sequence_parallel_split_equals_the_whole_image():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
    from dist_helpers import run_ranks

    run_ranks(_sp_worker, 2, timeout_s=120)


def test_a_wrong_checkpoint_or_config_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="num_patches 12 is not a square"):
        Siglip2EncoderConfig(num_patches=12)
    with pytest.raises(ValueError, match="max_num_patches must be >= 1"):
        Siglip2Encoder.processor(Siglip2EncoderConfig(**TOWER)).with_options(max_num_patches=0)
    (tmp_path / "config.json").write_text('{"model_type": "siglip_vision_model"}')
    with pytest.raises(ValueError, match="model_type 'siglip_vision_model'.*siglip2_vision_model / siglip2"):
        Siglip2Encoder.from_pretrained(str(tmp_path))


def test_the_presets_build():
    """``encoders/vision=siglip2`` sets no architecture (a checkpoint's config.json, else
    transformers' defaults: siglip2-base-patch16-naflex's tower); the so400m shapes as the
    preset's comment writes them."""
    from omegaconf import OmegaConf

    from omni.models.encoders import build_encoder
    from recipes.compose import compose_config

    so400m = "+encoders.vision.params={hidden_size: 1152, intermediate_size: 4304, num_hidden_layers: 27, " \
             "num_attention_heads: 16}"
    counts = []
    for extra in ([], [so400m]):
        slot = OmegaConf.to_object(compose_config(["encoders=vision_only", "encoders/vision=siglip2", *extra]))
        slot = slot.encoders["vision"]
        with torch.device("meta"):
            enc = build_encoder(slot.name, slot.params)
        assert isinstance(enc, Siglip2Encoder) and enc.config.max_num_patches == 256
        counts.append(sum(p.numel() for p in enc.parameters()))
    # the vision towers of siglip2-base (about 86M parameters) and so400m (about 400M)
    assert 8.0e7 < counts[0] < 9.5e7 and 3.8e8 < counts[1] < 4.3e8, counts


def test_training_two_steps_on_the_demo_data(demo_root, tmp_path):
    from tests.recipe_helpers import read_metrics, tiny_overrides, train

    run_dir = tmp_path / "run"
    train(["encoders=vision_only", "encoders/vision=siglip2_tiny",
           *tiny_overrides(demo_root, run_dir, **{"data.mixture": demo_root / "vision.yaml", "trainer.max_steps": 2})])
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    assert len(steps) == 2 and all(np.isfinite(r["loss"]) for r in steps)
    assert max(r["encoder_peak_activation_mib"] for r in steps) > 0  # images went through the tower
