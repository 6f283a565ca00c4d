"""A whole Qwen2.5-VL checkpoint through Omni equals transformers: the language model from
``model.pretrained``, the vision tower and its merger from the ``qwen_vl`` slot's
``pretrained``, one image processed by the plugin's processor and packed by the data plane
(placeholders, M-RoPE positions); the summed loss over the text targets equals the one from
transformers' logits. Without the M-RoPE positions it differs."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dataloading.construct.batch import IGNORE_INDEX
from dataloading.construct.constructor import Tokenized, assemble
from omni.models.build import build_model, media_processors
from omni.models.config import EncoderSlot, ModelConfig

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = 100


def _save(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32,
                           window_size=56, fullatt_block_indexes=[1]),
        image_token_id=IMAGE_TOKEN, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    with torch.no_grad():  # weights large enough that positions and windows matter
        for name, p in model.named_parameters():
            if "norm" not in name and "ln_q" not in name:
                p.normal_(0.0, 0.15)
    model = model.eval()
    model.save_pretrained(tmp_path)
    return model


def test_the_whole_model_equals_transformers(tmp_path):
    hf = _save(tmp_path)
    ours = build_model(ModelConfig(pretrained=str(tmp_path)), {"vision": EncoderSlot(name="qwen_vl",
                                                                                     pretrained=str(tmp_path))},
                       vocab_needed=128, seed=0).eval()
    assert ours.llm.config.mrope_section == [1, 1, 2]
    proc = media_processors(ours)["image"]
    img = np.random.default_rng(0).integers(0, 256, size=(56, 84, 3), dtype=np.uint8)
    item = proc(img)
    assert item.size == (1, 4, 6) and item.num_tokens == 6
    # text, vision start, six placeholders, vision end, text
    ids = np.array([5, 6, 102] + [IMAGE_TOKEN] * 6 + [103, 7, 8, 9, 10, 11], dtype=np.int64)
    labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    labels[9:-1] = ids[10:]  # the text after the image predicts its next token
    mb = assemble([Tokenized("s", ids, labels, [("image", item, np.arange(3, 9))])])
    with torch.no_grad():
        got = ours(mb).ce_sum
        flat = ours(dataclasses.replace(mb, rope_position_ids=None)).ce_sum
        # transformers computes its own M-RoPE positions from the token types (1: image)
        types = torch.from_numpy((ids == IMAGE_TOKEN).astype(np.int64))[None]
        logits = hf(input_ids=torch.from_numpy(ids)[None], pixel_values=item.features,
                    image_grid_thw=torch.tensor([[1, 4, 6]]), mm_token_type_ids=types).logits
    keep = torch.from_numpy(labels) != IGNORE_INDEX
    want = F.cross_entropy(logits[0][keep].float(), torch.from_numpy(labels)[keep], reduction="sum")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert abs(float(flat) - float(want)) > 1e-3


def test_greedy_generation_equals_transformers_generate(tmp_path):
    """The KV-cached generation (M-RoPE positions continuing after each prompt's largest) picks
    the tokens transformers' ``generate`` picks, for prompts with an image batched beside a
    longer and a text-only one."""
    from omni.runtime.generate import generate

    hf = _save(tmp_path)
    ours = build_model(ModelConfig(pretrained=str(tmp_path)), {"vision": EncoderSlot(name="qwen_vl",
                                                                                     pretrained=str(tmp_path))},
                       vocab_needed=128, seed=0).eval()
    proc = media_processors(ours)["image"]
    rng = np.random.default_rng(0)
    images = [proc(rng.integers(0, 256, size=(56, 84, 3), dtype=np.uint8)) for _ in range(2)]
    specs = [  # (ids, the image's first placeholder or None)
        (np.array([5, 6, 102] + [IMAGE_TOKEN] * 6 + [103, 7, 8], dtype=np.int64), 3),
        (np.array([9, 102] + [IMAGE_TOKEN] * 6 + [103, 12, 13, 14, 15, 16, 17], dtype=np.int64), 2),
        (np.array([20, 21, 22, 23], dtype=np.int64), None),
    ]
    prompts = [assemble([Tokenized(str(i), ids, np.full(ids.shape, IGNORE_INDEX),
                                   [] if at is None else [("image", images[i], np.arange(at, at + 6))])])
               for i, (ids, at) in enumerate(specs)]
    with torch.no_grad():
        got = generate(ours, prompts, eos_ids=(), max_new_tokens=8, device=torch.device("cpu"))
        for i, (ids, at) in enumerate(specs):
            # mm_token_type_ids (1: image) is what makes transformers compute M-RoPE positions;
            # its processor returns them, and without them it falls back to 1-D positions
            media = {} if at is None else dict(
                pixel_values=images[i].features, image_grid_thw=torch.tensor([[1, 4, 6]]),
                mm_token_type_ids=torch.from_numpy((ids == IMAGE_TOKEN).astype(np.int64))[None])
            want = hf.generate(input_ids=torch.from_numpy(ids)[None], max_new_tokens=8, do_sample=False, **media)
            assert got[i] == want[0, len(ids):].tolist(), f"prompt {i}"


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen2_5_vl"])
def test_a_packed_row_of_images_and_a_video_equals_transformers_per_sample(tmp_path, variant):
    """One packed row, two samples: two images of different sizes, and a 3 s clip. Omni's logits
    over the row equal transformers' for each sample run alone (the images and the video as
    transformers' image and video inputs, token types 1 and 2, seconds per temporal patch)."""
    pytest.importorskip("av")
    from dataloading.construct.constructor import SampleConstructor
    from dataloading.formats.sample import DecodedSample
    from dataloading.formats.video import decode_video
    from hf_family_helpers import save_tiny_qwen_vl
    from media_helpers import clip_bytes
    from model_helpers import omni_logits, rel_err
    from omni.models.families import load_pretrained, pretrained_tokenizer

    hf, _ = save_tiny_qwen_vl(tmp_path, variant)
    ours = load_pretrained(str(tmp_path)).eval()
    tok = pretrained_tokenizer(str(tmp_path))
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=s, dtype=np.uint8) for s in ((56, 84, 3), (84, 112, 3))]
    clip = decode_video(clip_bytes(frames=30, rate=10, height=56, width=84, texture_seed=1))
    c = SampleConstructor({}, tok, media_processors(ours), None)
    first = c.tokenize(DecodedSample("a", "two views <image> and <image> of one thing", "a shape", [
        ("image", images[0]), ("image", images[1])]))
    second = c.tokenize(DecodedSample("b", "<video>what happens?", "it turns red", [("video", clip)]))
    mb = assemble([first, second])
    with torch.no_grad():
        got = omni_logits(ours, mb)
        pad = tok.placeholder_ids["image"]
        a_items = [it for _, it, _ in first.media]
        types = torch.as_tensor(first.ids == pad, dtype=torch.int64)[None]
        want_a = hf(input_ids=torch.as_tensor(first.ids)[None], pixel_values=torch.cat([it.features for it in a_items]),
                    image_grid_thw=torch.tensor([list(it.size) for it in a_items]), mm_token_type_ids=types).logits[0]
        (_, video, _), = second.media
        ids_b = np.where(second.ids == pad, hf.config.video_token_id, second.ids)  # transformers finds videos by id
        extra = {"second_per_grid_ts": torch.tensor([1.0])} if variant == "qwen2_5_vl" else {}
        want_b = hf(input_ids=torch.as_tensor(ids_b)[None], pixel_values_videos=video.features,
                    video_grid_thw=torch.tensor([list(video.size)]), mm_token_type_ids=
                    torch.as_tensor(ids_b == hf.config.video_token_id, dtype=torch.int64)[None] * 2, **extra).logits[0]
    assert video.size[0] == 3 and len(a_items) == 2 and a_items[0].size != a_items[1].size
    n = len(first)
    assert rel_err(got[:n], want_a) <= 1e-5
    assert rel_err(got[n:], want_b) <= 1e-5
