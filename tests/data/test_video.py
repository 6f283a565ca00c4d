"""Video as a modality: mp4 / webm fields decoded with PyAV, frames sampled by fps / max_frames
at evenly spaced times, Qwen2-VL's video patches (checked against a reference written from the
layout the tower reads, and through transformers' tower), the pixel budget, the missing-extra
error, the index's metadata and token counts, the cost in `omni data plan`, and two training
steps of a tiny Qwen2.5-VL-style model on a video source."""
from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest
import torch

from dataloading.config import DataConfig
from dataloading.construct.constructor import SampleConstructor
from dataloading.errors import DataError
from dataloading.formats.tokenizer import ByteTokenizer
from dataloading.formats.video import decode_video, frame_times, sample_count, video_meta
from dataloading.index.shards import write_shards
from dataloading.index.source_index import build_index, load_index
from dataloading.plan.cost import CostModel
from dataloading.plan.mixture import load_mixture
from dataloading.plan.sample_length import estimate_tokens
from dataloading.serve.loader import build_planner
from media_helpers import clip_bytes as media_clip_bytes
from omni.models.encoders.qwen_vl import QwenVisionConfig, QwenVisionEncoder
from omni.models.encoders.qwen_vl_windows import merge_order_positions

av = pytest.importorskip("av")

FRAMES, RATE, H, W = 20, 10, 32, 48  # a 2 s clip of 48 x 32 pixels at 10 frames per second
# The qwen_vl_tiny preset's tower (conf/encoders/vision/qwen_vl_tiny.yaml): 8-pixel patches,
# merge 2, so the 48 x 32 frames are 6 x 4 patches without a resize.
TINY = dict(variant="qwen2_5_vl", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            patch_size=8, window_size=32, fullatt_block_indexes=[1], min_pixels=256, max_pixels=4096)


def clip_bytes(fmt: str = "mp4", codec: str = "mpeg4", frames: int = FRAMES, rate: int = RATE) -> bytes:
    """Frame i is flat grey-green with red 10 + 12 i (mod 256), so a decoded frame of the first 20 tells its index."""
    return media_clip_bytes(fmt, codec, frames, rate, H, W)


def frame_index(frame: np.ndarray) -> int:
    return int(round((float(frame[..., 0].mean()) - 10) / 12))


def tiny_processor(**options):
    proc = QwenVisionEncoder.processor(QwenVisionConfig(**TINY, image_mean=[0.0] * 3, image_std=[1.0] * 3))
    return proc.with_options(**options) if options else proc


@pytest.fixture(scope="module")
def mp4():
    return clip_bytes()


@pytest.mark.parametrize("fmt,codec", [("mp4", "mpeg4"), ("webm", "libvpx-vp9")])
def test_a_clip_decodes_and_its_header_gives_the_metadata(fmt, codec):
    data = clip_bytes(fmt, codec)
    # WebM stores no frame count: it comes from the duration and the rate
    assert video_meta(data) == {"width": W, "height": H, "frames": FRAMES, "fps": 10.0, "duration": 2.0, "track": None}
    frames = decode_video(data).frames([0.05, 0.95, 1.0, 1.95, 7.0])
    assert all(f.shape == (H, W, 3) and f.dtype == np.uint8 for f in frames)
    # the frame on screen at each time; past the end, the last one
    assert [frame_index(f) for f in frames] == [0, 9, 10, 19, 19]


def test_frames_are_sampled_by_fps_and_max_frames_at_evenly_spaced_times(mp4):
    meta = video_meta(mp4)
    assert sample_count(meta, fps=2.0, min_frames=2, max_frames=768, multiple=2) == 4
    assert sample_count(meta, fps=2.0, min_frames=2, max_frames=2, multiple=2) == 2
    assert sample_count(meta, fps=1.5, min_frames=2, max_frames=768, multiple=2) == 2  # 3 -> whole temporal patches
    assert sample_count(meta, fps=0.1, min_frames=4, max_frames=768, multiple=2) == 4  # at least min_frames
    assert sample_count(meta, fps=60.0, min_frames=4, max_frames=768, multiple=2) == 20  # never more than the clip has
    np.testing.assert_allclose(frame_times(2.0, 4), [0.25, 0.75, 1.25, 1.75])
    clip = decode_video(mp4)
    assert [frame_index(f) for f in clip.frames(frame_times(2.0, 4))] == [2, 7, 12, 17]
    assert [frame_index(f) for f in clip.frames(frame_times(2.0, 2))] == [5, 15]
    # through the processor: fps 2 gives 4 frames (2 temporal patches), max_frames 2 one
    assert tiny_processor().video(clip).size == (2, 4, 6)
    assert tiny_processor(max_frames=2).video(clip).size == (1, 4, 6)  # min_frames follows it down
    assert tiny_processor(fps=5.0).video(clip).size == (5, 4, 6)
    one_frame = decode_video(clip_bytes(frames=1))  # repeated to fill one temporal patch
    assert one_frame.meta["frames"] == 1 and tiny_processor().video(one_frame).size == (1, 4, 6)


def reference_video_patches(frames: list[np.ndarray], t: int, p: int, merge: int) -> np.ndarray:
    """Qwen2-VL's video input from its description: consecutive frames grouped in temporal
    patches of t; each temporal patch cut into p x p patches visited in merge-window order (the
    tower's positions); each patch flattened as (channel, frame, pixel row, pixel col)."""
    x = np.stack(frames).astype(np.float32) / 255  # mean 0, std 1: only the scaling
    n, height, width, _ = x.shape
    pos = merge_order_positions(1, height // p, width // p, merge).tolist()
    rows = []
    for k in range(n // t):
        for r, c in pos:
            block = x[k * t:(k + 1) * t, r * p:(r + 1) * p, c * p:(c + 1) * p, :]  # [T, P, P, C]
            rows.append(block.transpose(3, 0, 1, 2).reshape(-1))
    return np.stack(rows)


@pytest.mark.parametrize("variant,interval", [("qwen2_5_vl", 2.0), ("qwen2_vl", 1.0)])
def test_qwen_video_patches_equal_the_reference_and_the_metadata_count(mp4, variant, interval):
    cfg = QwenVisionConfig(**{**TINY, "variant": variant}, image_mean=[0.0] * 3, image_std=[1.0] * 3)
    proc = QwenVisionEncoder.processor(cfg)
    clip = decode_video(mp4)
    item = proc.video(clip)
    want = reference_video_patches(clip.frames(frame_times(2.0, 4)), t=2, p=8, merge=2)
    assert item.features.shape == (2 * 4 * 6, 3 * 2 * 8 * 8)
    np.testing.assert_allclose(item.features.numpy(), want, rtol=0, atol=1e-7)
    # 2 temporal patches of 4 x 6 patches merged 2 x 2; Qwen2.5-VL's temporal step is
    # tokens_per_second (2) x 2 frames per temporal patch / 2 frames sampled per second
    assert item.size == (2, 4, 6) and item.num_tokens == 12
    assert item.rope_grid == (2, 2, 3, interval, False)  # text resumes past the grid (Qwen2-VL)
    assert proc.num_tokens_from_meta(clip.meta) == item.num_tokens


def test_the_video_through_our_tower_equals_transformers_video_features(tmp_path, mp4):
    from tests.models.test_encoders_qwen_vl import _save

    hf = _save(tmp_path, "qwen2_vl")
    ours = QwenVisionEncoder.from_pretrained(str(tmp_path)).eval()
    item = QwenVisionEncoder.processor(ours.config).video(decode_video(mp4))  # 14-pixel patches: resized
    grid = torch.tensor([item.size])
    assert item.size == (2, 4, 6)
    with torch.no_grad():
        want = hf.model.get_video_features(pixel_values_videos=item.features, video_grid_thw=grid).pooler_output
        got = hf.model.visual.merger(ours(item.features, grid))
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)  # one tensor per video


def test_the_pixel_budget_shrinks_frames_then_drops_frames_then_is_one_error(mp4):
    clip = decode_video(mp4)
    # 4 frames of 16 x 16 fit 1024 pixels (each frame's share is 512)
    small = tiny_processor(max_video_pixels=2048).video(clip)
    assert small.size == (2, 2, 2) and small.features.shape[0] == 8
    # 10 frames wanted at fps 5; 1536 pixels hold 6 of the smallest (16 x 16)
    assert tiny_processor(fps=5.0, max_video_pixels=1536).video_grid(clip.meta) == (6, 2, 2)
    with pytest.raises(ValueError, match=r"needs at least 4 frames of 16x16 pixels \(1024 pixels\) but "
                                         r"max_video_pixels is 1000; raise video.max_video_pixels"):
        tiny_processor(max_video_pixels=1000).num_tokens_from_meta(clip.meta)
    with pytest.raises(ValueError, match="multiples of the tower's temporal patch"):
        tiny_processor(max_frames=5)


def write_video_source(root, name="clips", key="v0", data=None, fields=None):
    sample = {"__key__": key, "txt": "<video>\nWhat changes?", "mp4": data, "response.txt": "it turns red"}
    write_shards([{**sample, **(fields or {})}], root / name, name, samples_per_shard=8)
    return root / name


def test_a_missing_decoder_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys, mp4):
    from recipes.cli import main

    write_video_source(tmp_path, data=mp4)
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now fails as if it were not installed
    with pytest.raises(DataError, match=r"need the PyAV decoder.*pip install 'omni-mm\[video\]'") as e:
        video_meta(mp4)
    assert e.value.kind == "config" and "\n" not in str(e.value)
    # indexing stops on it instead of leaving every video out as corrupt
    with pytest.raises(DataError, match=r"pip install 'omni-mm\[video\]'"):
        build_index(tmp_path / "clips", workers=1, progress=False)
    capsys.readouterr()
    assert main(["data", "index", str(tmp_path / "clips"), "--workers", "1"]) != 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("omni")]  # the rest: the progress bar
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("omni: error: video fields (mp4, webm) need the PyAV decoder, which is not installed; "
                               "run `pip install 'omni-mm[video]'`"), lines


def test_a_video_sample_indexes_and_builds_a_row_whose_length_the_plan_predicts(tmp_path, mp4):
    folder = write_video_source(tmp_path, data=mp4)
    build_index(folder, workers=1, progress=False)
    (meta,) = load_index(folder).samples
    assert meta.media == [("video", {"width": W, "height": H, "frames": FRAMES, "fps": 10.0, "duration": 2.0,
                                     "track": None})]
    tok = ByteTokenizer(["image"])
    procs = {"image": tiny_processor()}
    constructor = SampleConstructor({"clips": load_index(folder).reader("clips")}, tok, procs, 256)
    (mb,) = constructor.build(["clips/v0"])
    image = mb.media["image"]  # a video is an item of the vision encoder
    assert image.sizes.tolist() == [[2, 4, 6]] and image.num_tokens.tolist() == [12]
    ids = mb.input_ids.tolist()
    assert ids[:14] == [tok.bos_id] + [tok.placeholder_ids["image"]] * 12 + [ord("\n")]
    assert image.positions.tolist() == list(range(1, 13))
    assert len(ids) == estimate_tokens(meta, tok, procs)
    # M-RoPE: the second temporal patch is 2 positions on (interval 2.0), text after 1 + max(2, 3)
    assert mb.rope_position_ids[0, 1:13].tolist() == [1] * 6 + [3] * 6
    assert mb.rope_position_ids[:, 13].tolist() == [4, 4, 4]
    # an image tower without video support refuses in one line
    from omni.models.encoders.siglip import SiglipEncoder

    siglip = SampleConstructor({"clips": load_index(folder).reader("clips")}, tok,
                               {"image": SiglipEncoder.processor(SiglipEncoder.Config())}, 256)
    with pytest.raises(DataError, match="SiglipProcessor\\) cannot encode video; use a video-capable"):
        siglip.build(["clips/v0"])


def test_the_planner_costs_the_video_as_an_image_item_and_refuses_one_over_budget(tmp_path, mp4):
    write_video_source(tmp_path, data=mp4)
    build_index(tmp_path / "clips", workers=1, progress=False)
    mix = tmp_path / "mix.yaml"
    mix.write_text("sources:\n  - {name: clips, path: clips, weight: 1, video: {fps: 1, max_frames: 2}}\n")
    tok = ByteTokenizer(["image"])
    cost = CostModel(alpha=0.0, beta=1.0, encoders={"image": (0.5, 10.0)})
    data = DataConfig(mixture=str(mix), global_batch_size=1, micro_batch_tokens=256)
    planner, _ = build_planner(data, tok, {"image": tiny_processor()}, seed=0, dp_size=1, cost_model=cost,
                               progress=False)
    plan = planner.plan()
    # fps 1 over 2 s: 2 frames, one temporal patch of 4 x 6 patches = 6 tokens; text 1 + 14 + 12 + 1
    assert planner.unit_media("clips/v0") == [("image", 6)]
    assert plan.unit_cost["clips/v0"] == pytest.approx(34 + 0.5 * 36 + 10 * 6)
    mix.write_text("sources:\n  - {name: clips, path: clips, weight: 1, video: {max_video_pixels: 1000}}\n")
    with pytest.raises(DataError, match=r"source clips: sample v0: a 48x32 video of 2 s needs at least 4 frames"
                                        r".*raise video.max_video_pixels"):
        build_planner(data, tok, {"image": tiny_processor()}, seed=0, dp_size=1, cost_model=cost, progress=False)
    mix.write_text("sources:\n  - {name: clips, path: clips, weight: 1, video: {fps: 0}}\n")
    with pytest.raises(DataError, match=r"video.fps must be a positive float"):
        load_mixture(mix)


@pytest.fixture(scope="module")
def video_mixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    clips = [clip_bytes(), clip_bytes("webm", "libvpx-vp9"), clip_bytes(frames=30)]
    samples = [{"__key__": f"v{i}", "txt": "<video>\nWhat changes?", ("webm" if i % 3 == 1 else "mp4"): clips[i % 3],
                "response.txt": "it turns red"} for i in range(6)]
    write_shards(samples, root / "clips", "clips", samples_per_shard=4)
    build_index(root / "clips", workers=1, progress=False)
    mix = root / "mix.yaml"
    mix.write_text("sources:\n  - {name: clips, path: clips, weight: 1, video: {fps: 2, max_frames: 4}}\n")
    return mix


def test_omni_data_plan_shows_the_video_cost_and_a_budget_error_in_one_line(video_mixture, tmp_path, capsys):
    from omegaconf import OmegaConf

    from recipes.cli import main
    from recipes.compose import compose_config
    from recipes.data_plane import model_for_planning, planner_kwargs
    from recipes.plan_cmd import plan_main
    from recipes.run_info import run_tokenizer

    overrides = ["experiment=qwen2_vl_tiny", f"data.mixture={video_mixture}", "data.global_batch_size=2"]
    out = io.StringIO()
    assert plan_main(overrides, dp=1, steps=1, as_json=True, out=out) == 0
    (step,) = [json.loads(line) for line in out.getvalue().splitlines()]
    cfg = OmegaConf.to_object(compose_config(overrides))
    cost = planner_kwargs(cfg, model_for_planning(cfg, run_tokenizer(cfg).vocab_size))["cost_model"]
    (rank,) = step["ranks"]
    n = len(rank["samples"])
    # every clip: 4 frames at 2 fps of 4 x 6 patches -> 12 image tokens, each costed by the
    # vision tower's coefficients; the row's own cost is the LLM's
    assert n == 2 and cost.encoders["image"][0] > 0
    llm = sum(float(cost.llm_cost(rank["tokens"] // n)) for _ in range(n))
    assert rank["tokens"] == n * (1 + 12 + 14 + 12 + 1)
    assert rank["cost"] == pytest.approx(llm + n * float(cost.media_cost("image", 12)), rel=1e-9)
    over = tmp_path / "over.yaml"
    over.write_text(video_mixture.read_text().replace("max_frames: 4", "max_video_pixels: 1000")
                    .replace("path: clips", f"path: {video_mixture.parent / 'clips'}"))
    capsys.readouterr()
    assert main(["data", "plan", "experiment=qwen2_vl_tiny", f"data.mixture={over}", "--dp", "1", "--steps", "1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omni: error: source clips: sample v") and \
        "max_video_pixels is 1000; raise video.max_video_pixels" in err[0], err


@pytest.mark.parametrize("experiment", ["qwen2_vl_tiny", "qwen3_vl_tiny"])  # Qwen3-VL: a timestamp per frame
def test_a_tiny_qwen_vl_model_trains_two_steps_on_videos(video_mixture, tmp_path, experiment):
    from recipe_helpers import read_metrics, train

    run_dir = tmp_path / "run"
    result = train([f"experiment={experiment}", f"data.mixture={video_mixture}", "data.global_batch_size=2",
                    "data.num_workers=0", f"trainer.run_dir={run_dir}", "trainer.progress=false",
                    "trainer.eval_at_end=false", "trainer.max_steps=2", "optim.warmup_steps=1", "checkpoint.every=0"])
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    assert result.last_step == 2 and [r["step"] for r in steps] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in steps)
    # both samples' targets ("it turns red" + EOS) and the clips through the vision tower
    assert all(r["target_tokens"] == 26 and r["encoder_peak_activation_mib"] > 0 for r in steps)
