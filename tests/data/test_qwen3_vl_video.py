"""Qwen3-VL's videos: one item per temporal patch with the timestamp its processor writes before
it (transformers' Qwen3VLProcessor), the frames sampled as Qwen2-VL's; in a packed row each frame
is written as the family does (its text, the opening token, the placeholders, the closing token),
placed as an image for M-RoPE, and the planner's length is the row's. Greedy generation on a
Qwen3-VL directory equals transformers' (tests/test_generate_cmd.py). Qwen3-Omni's tower takes a
clip whole, without timestamps (its generation: tests/test_omni_family_cmds.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dataloading.construct.constructor import SampleConstructor
from dataloading.errors import DataError
from dataloading.formats.media import frame_texts_from_meta, processor_for
from dataloading.formats.tokenizer import ByteTokenizer
from dataloading.formats.video import decode_video, frame_times
from dataloading.index.source_index import build_index, load_index
from dataloading.plan.sample_length import estimate_tokens
from omni.models.encoders.qwen3_omni_vision import Qwen3OmniVisionEncoder
from omni.models.encoders.qwen3_vl import Qwen3VisionConfig, Qwen3VisionEncoder
from omni.models.encoders.qwen_vl_processor import QwenVisionProcessor

av = pytest.importorskip("av")

# conf/encoders/vision/qwen3_vl_tiny.yaml's tower: 8-pixel patches, merge 2, so 48 x 32 frames
# are 6 x 4 patches without a resize
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, patch_size=8,
            num_position_embeddings=64, deepstack_visual_indexes=[0, 1], min_pixels=256, max_pixels=4096)


@pytest.fixture(scope="module")
def mp4():
    from media_helpers import clip_bytes

    return clip_bytes("mp4", "mpeg4", 20, 10, 32, 48)  # 2 s at 10 frames a second


def _processor():
    return Qwen3VisionEncoder.processor(Qwen3VisionConfig(**TINY))


def test_a_clip_is_one_item_per_temporal_patch_each_after_its_timestamp(mp4):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    proc = _processor()
    clip = decode_video(mp4)
    items = proc.video(clip)
    # 2 frames a second: 4 frames at 0.25, 0.75, 1.25, 1.75 s, two temporal patches of 2
    assert [it.size for it in items] == [(1, 4, 6)] * 2 and [it.num_tokens for it in items] == [6, 6]
    assert [it.rope_grid for it in items] == [(1, 2, 3, 1.0)] * 2  # each an image for M-RoPE
    assert [it.frame_text for it in items] == ["<0.5 seconds>", "<1.5 seconds>"]
    # transformers' rule: the mean of each temporal patch's frame times, one decimal
    fps = 10.0
    want = Qwen3VLProcessor._calculate_timestamps(None, list(frame_times(2.0, 4) * fps), fps, 2)
    assert [it.frame_text for it in items] == [f"<{s:.1f} seconds>" for s in want]
    # the frames are Qwen2-VL's clip, split: the tower attends within each temporal patch
    whole = QwenVisionProcessor.video(proc, clip)
    assert whole.size == (2, 4, 6)
    torch.testing.assert_close(torch.cat([it.features for it in items]), whole.features, rtol=0, atol=0)
    assert frame_texts_from_meta(proc, clip.meta) == ["<0.5 seconds>", "<1.5 seconds>"]
    assert proc.num_tokens_from_meta(clip.meta) == 12 and frame_texts_from_meta(proc, {"height": 32, "width": 48}) == []


def test_a_row_writes_each_frame_after_its_timestamp_and_the_plan_predicts_its_length(tmp_path, mp4):
    from dataloading.index.shards import write_shards

    write_shards([{"__key__": "v0", "txt": "<video>\nWhat changes?", "mp4": mp4, "response.txt": "red"}],
                 tmp_path / "clips", "clips", samples_per_shard=4)
    build_index(tmp_path / "clips", workers=1, progress=False)
    (meta,) = load_index(tmp_path / "clips").samples
    tok = ByteTokenizer(["image"])
    procs = {"image": _processor()}
    constructor = SampleConstructor({"clips": load_index(tmp_path / "clips").reader("clips")}, tok, procs, 512)
    (mb,) = constructor.build(["clips/v0"])
    ids = mb.input_ids.tolist()
    pad = tok.placeholder_ids["image"]
    stamp = [ord(c) for c in "<0.5 seconds>"]
    second = [ord(c) for c in "<1.5 seconds>"]
    # a byte tokenizer has no family tokens: each frame is its text, then its placeholders
    assert ids[:1 + 13 + 6 + 13 + 6 + 1] == [tok.bos_id] + stamp + [pad] * 6 + second + [pad] * 6 + [ord("\n")]
    assert mb.media["image"].positions.tolist() == list(range(14, 20)) + list(range(33, 39))
    assert mb.media["image"].sizes.tolist() == [[1, 4, 6], [1, 4, 6]]
    assert len(ids) == estimate_tokens(meta, tok, procs)
    # M-RoPE: each frame an image (1 x 2 x 3 merged), text after it 3 (max(rows, cols)) further
    rope = mb.rope_position_ids
    assert rope[:, 14:20].tolist() == [[14] * 6, [14, 14, 14, 15, 15, 15], [14, 15, 16] * 2]
    assert rope[:, 20].tolist() == [17] * 3 and rope[0, 33:39].tolist() == [30] * 6
    # no labels on the timestamps or the placeholders
    assert (mb.labels[:39] == -100).all()


def test_qwen3_omni_takes_a_clip_whole_and_refuses_an_fps_that_makes_its_step_fractional(mp4):
    from dataloading.formats.media import configure_processors

    proc = Qwen3OmniVisionEncoder.processor(Qwen3VisionConfig(**TINY, tokens_per_second=13))
    item = proc.video(decode_video(mp4))  # one item, no timestamps; 13 x 2 frames / 2 fps positions apart
    assert item.size == (2, 4, 6) and item.frame_text is None and item.rope_grid == (2, 2, 3, 13.0, True)
    assert frame_texts_from_meta(proc, decode_video(mp4).meta) == [] and processor_for({"image": proc}, "video", "s")
    assert configure_processors({"image": proc}, {"video": {"fps": 1}}, "source clips")["image"].patch_step() == 26
    with pytest.raises(DataError, match=r"\(13\) x 2 / fps \(3\) = 8.66667 positions, which Omni keeps whole") as e:
        configure_processors({"image": proc}, {"video": {"fps": 3}}, "source clips")
    assert e.value.kind == "config"
    np.testing.assert_equal(proc(np.zeros((32, 48, 3), np.uint8)).size, (1, 4, 6))  # images as Qwen3-VL's
