"""A whole Qwen3-VL checkpoint through Omni equals transformers on a packed row: two samples,
the first with two images of different sizes, the second with one; Omni's logits over the row
equal transformers' for each sample alone (1e-5 of their largest). DeepStack adds each image's
tower features after the first LLM layers at that image's positions only, and the interleaved
M-RoPE positions restart with each sample. So with a video (timestamps between its temporal
patches) beside an image."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dataloading.construct.constructor import SampleConstructor, assemble
from dataloading.formats.sample import DecodedSample
from omni.models.build import media_processors

transformers = pytest.importorskip("transformers")


def test_a_packed_row_of_images_equals_transformers_per_sample(tmp_path):
    from hf_family_helpers import save_tiny_qwen3_vl
    from model_helpers import omni_logits, rel_err
    from omni.models.families import load_pretrained, pretrained_tokenizer

    hf, _ = save_tiny_qwen3_vl(tmp_path)
    ours = load_pretrained(str(tmp_path)).eval()
    assert ours.deepstack_layers == 2 and ours.llm.config.mrope_interleaved
    tok = pretrained_tokenizer(str(tmp_path))
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=s, dtype=np.uint8) for s in ((48, 72, 3), (100, 60, 3), (96, 128, 3))]
    c = SampleConstructor({}, tok, media_processors(ours), None)
    first = c.tokenize(DecodedSample("a", "two views <image> and <image> of one thing", "a shape", [
        ("image", images[0]), ("image", images[1])]))
    second = c.tokenize(DecodedSample("b", "<image>what is it?", "a square", [("image", images[2])]))
    mb = assemble([first, second])
    pad = tok.placeholder_ids["image"]
    with torch.no_grad():
        got = omni_logits(ours, mb)
        wants = []
        for sample in (first, second):
            items = [it for _, it, _ in sample.media]
            wants.append(hf(input_ids=torch.as_tensor(sample.ids)[None],
                            pixel_values=torch.cat([it.features for it in items]),
                            image_grid_thw=torch.tensor([list(it.size) for it in items]),
                            mm_token_type_ids=torch.as_tensor(sample.ids == pad, dtype=torch.int64)[None]).logits[0])
    sizes = [it.size for s in (first, second) for _, it, _ in s.media]
    assert len(set(sizes)) == 3, sizes  # three grids of different shapes
    n = len(first)
    assert rel_err(got[:n], wants[0]) <= 1e-5
    assert rel_err(got[n:], wants[1]) <= 1e-5


def test_a_packed_row_with_a_video_equals_transformers_per_sample(tmp_path):
    """A sample with a 2-second clip (two temporal patches, each after its timestamp) and an image,
    packed after an image-only one: transformers gets the clip as one video of 2 temporal patches."""
    pytest.importorskip("av")
    from dataloading.formats.video import decode_video
    from hf_family_helpers import save_tiny_qwen3_vl
    from media_helpers import clip_bytes
    from model_helpers import omni_logits, rel_err
    from omni.models.families import load_pretrained, pretrained_tokenizer

    hf, hf_tok = save_tiny_qwen3_vl(tmp_path)
    ours = load_pretrained(str(tmp_path)).eval()
    tok = pretrained_tokenizer(str(tmp_path))
    rng = np.random.default_rng(1)
    image, other = (rng.integers(0, 256, size=s, dtype=np.uint8) for s in ((64, 40, 3), (48, 80, 3)))
    clip = decode_video(clip_bytes(frames=20, rate=10, height=64, width=96, texture_seed=2))
    c = SampleConstructor({}, tok, media_processors(ours), None)
    first = c.tokenize(DecodedSample("a", "<image>what is it?", "a square", [("image", other)]))
    second = c.tokenize(DecodedSample("b", "<video> then <image>: what changed?", "it turned red",
                                      [("video", clip), ("image", image)]))
    mb = assemble([first, second])
    pad, video_id = tok.placeholder_ids["image"], hf_tok.convert_tokens_to_ids("<|video_pad|>")
    frames = [it for _, it, _ in second.media if it.frame_text is not None]
    assert [it.frame_text for it in frames] == ["<0.5 seconds>", "<1.5 seconds>"]
    (img,) = [it for _, it, _ in second.media if it.frame_text is None]
    ids = second.ids.copy()
    ids[np.concatenate([p for _, it, p in second.media if it.frame_text is not None])] = video_id
    with torch.no_grad():
        got = omni_logits(ours, mb)
        want_first = hf(input_ids=torch.as_tensor(first.ids)[None], pixel_values=first.media[0][1].features,
                        image_grid_thw=torch.tensor([list(first.media[0][1].size)]),
                        mm_token_type_ids=torch.as_tensor(first.ids == pad, dtype=torch.int64)[None]).logits[0]
        want = hf(input_ids=torch.as_tensor(ids)[None], pixel_values=img.features,
                  image_grid_thw=torch.tensor([list(img.size)]),
                  pixel_values_videos=torch.cat([it.features for it in frames]),
                  video_grid_thw=torch.tensor([[len(frames), *frames[0].size[1:]]]),
                  mm_token_type_ids=torch.as_tensor((ids == pad) * 1 + (ids == video_id) * 2)[None]).logits[0]
    n = len(first)
    assert rel_err(got[:n], want_first) <= 1e-5
    assert rel_err(got[n:], want) <= 1e-5
