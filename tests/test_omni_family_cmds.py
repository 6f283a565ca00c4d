"""`omni export` and `omni generate` on tiny Qwen2.5-Omni thinker directories, in the thinker-only
layout (what transformers saves for the thinker) and in the released checkpoints' layout (the
whole class, ``thinker.`` names): the export is the released layout, which transformers loads
with the thinker's weights and Omni exports again file for file; greedy generation from an image
and an audio clip gives transformers' tokens."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hf_omni_helpers import THINKERS, omni_hf_inputs, omni_prompt, omni_prompt_media, save_tiny_qwen2_5_omni, tone
from recipes.cli import main

transformers = pytest.importorskip("transformers")
LAYOUTS = pytest.mark.parametrize("released", [False, True], ids=["thinker-only", "released layout"])


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


# family -> the whole model's class (which the export is), the thinker's time step per second of video
WHOLE = {"qwen2_5_omni": ("Qwen2_5OmniForConditionalGeneration", 25), "qwen3_omni": ("Qwen3OmniMoeForConditionalGeneration", 13)}


@LAYOUTS
@pytest.mark.parametrize("family", sorted(THINKERS))
def test_a_thinker_directory_exports_in_the_released_layout(tmp_path, family, released):
    saver, _, whole_type, _, _ = THINKERS[family]
    whole_class, per_second = WHOLE[family]
    hf, _ = saver(tmp_path / "hf", released=released)
    assert main(["export", str(tmp_path / "hf"), "--out", str(tmp_path / "a")]) == 0
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (whole_type, [whole_class])
    assert config["thinker_config"]["position_id_per_seconds"] == per_second
    back = getattr(transformers, whole_class).from_pretrained(tmp_path / "a")
    assert not back.has_talker
    want, got = hf.state_dict(), back.thinker.state_dict()
    assert set(got) == set(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    written = _tensors(tmp_path / "a")
    assert all(k.startswith("thinker.") for k in written)
    if released:  # the directory's own tensors, name for name, bit for bit
        stored = _tensors(tmp_path / "hf")
        assert stored.keys() == written.keys() and all(torch.equal(stored[k], written[k]) for k in stored)
    # exported again: the same files
    assert main(["export", str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 0
    for name in ("config.json", "model.safetensors", "processor_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@LAYOUTS
@pytest.mark.parametrize("family", sorted(THINKERS))
def test_greedy_with_an_image_and_audio_equals_transformers_generate(tmp_path, capsys, family, released):
    import soundfile

    from dataloading.formats.media_codecs import decode_audio
    from omni.models.build import media_processors
    from recipes.model_source import load_model

    saver, _, _, image_token, audio_token = THINKERS[family]
    hf, tok = saver(tmp_path / "hf", released=released)
    image = np.random.default_rng(2).integers(0, 256, size=(56, 84, 3), dtype=np.uint8)
    Image.fromarray(image).save(tmp_path / "a.png")
    soundfile.write(tmp_path / "a.wav", tone(0.9, 660.0), 16000, subtype="PCM_16")
    prompt = "what do you see and hear?"
    assert main(["generate", "--model", str(tmp_path / "hf"), "--image", str(tmp_path / "a.png"), "--audio",
                 str(tmp_path / "a.wav"), "--prompt", prompt, "--max-new-tokens", "12", "--greedy", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the reference: the family's chat template, each placeholder repeated once per encoder
    # output (the counts Omni's processors give: transformers' model refuses counts that do not
    # match the features its own processors compute), transformers' inputs and generate
    wave, _ = decode_audio((tmp_path / "a.wav").read_bytes())
    loaded = load_model(str(tmp_path / "hf"))
    processors = media_processors(loaded.model)
    n_image, n_audio = processors["image"](image).num_tokens, processors["audio"]((wave, 16000)).num_tokens
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                                                 {"type": "text", "text": prompt}]}],
                                   tokenize=False, add_generation_prompt=True)
    text = text.replace(image_token, image_token * n_image).replace(audio_token, audio_token * n_audio)
    ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"])
    mb = omni_prompt(loaded, image, [wave], prompt)
    assert mb.input_ids.tolist() == ids.tolist()  # Omni's prompt is the family's
    inputs = omni_hf_inputs(tmp_path / "hf", [Image.open(tmp_path / "a.png")], [wave], ids)
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    if want and want[-1] == tok.eos_token_id:
        want = want[:-1]  # omni leaves the end of sequence out of its answer
    assert got["token_ids"] == want and len(want) >= 3


def test_the_tiny_preset_trains_both_towers_and_answers(demo_root, tmp_path, capsys):
    """`experiment=qwen2_5_omni_tiny` from scratch on the demo's mixture: both towers train
    (colocated under multiplexing), `omni generate` answers from an image and a clip, and the
    export is refused in one line (the byte tokenizer lacks the thinker's framing tokens, by
    which transformers would place the items)."""
    import soundfile

    from recipe_helpers import read_metrics, tiny_overrides, train
    from recipes.model_source import load_model

    run = tmp_path / "run"
    train(tiny_overrides(demo_root, run, **{"trainer.max_steps": 3}) + ["experiment=qwen2_5_omni_tiny"])
    steps = [r for r in read_metrics(run) if "loss" in r]
    assert len(steps) == 3 and all(np.isfinite(r["loss"]) for r in steps)
    model = load_model(str(run)).model
    assert sorted(model.encoders) == ["audio", "image"]
    Image.fromarray(np.random.default_rng(4).integers(0, 256, size=(32, 48, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    soundfile.write(tmp_path / "a.wav", tone(0.5, 330.0), 16000, subtype="PCM_16")
    capsys.readouterr()
    assert main(["generate", "--model", str(run), "--image", str(tmp_path / "a.png"), "--audio",
                 str(tmp_path / "a.wav"), "--prompt", "what is this?", "--max-new-tokens", "4", "--greedy",
                 "--json"]) == 0
    assert "token_ids" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("omni: error: a Qwen2.5-Omni thinker finds its images and clips by <|vision_bos|>")


def test_greedy_with_a_video_equals_transformers_generate(tmp_path, capsys):
    """A clip (2 frames a second, 3 temporal patches) between text: its frames take TMRoPE's
    timed positions (25 a second) and text resumes past the last frame's time, which outruns
    the grid; transformers gets the same frames as its video inputs."""
    pytest.importorskip("av")
    from dataloading.formats.video import decode_video
    from media_helpers import clip_bytes
    from omni.models.encoders.qwen_omni_vision import QwenOmniVisionEncoder
    from recipes.model_source import load_model

    hf, tok = save_tiny_qwen2_5_omni(tmp_path / "hf")
    clip = tmp_path / "c.mp4"
    clip.write_bytes(clip_bytes(frames=30, rate=10, height=56, width=84, texture_seed=0))  # 3 s
    prompt = "what happens?"
    assert main(["generate", "--model", str(tmp_path / "hf"), "--video", str(clip), "--prompt", prompt,
                 "--max-new-tokens", "10", "--greedy", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    enc = load_model(str(tmp_path / "hf")).model.encoders["image"]
    item = QwenOmniVisionEncoder.processor(enc.config).video(decode_video(clip.read_bytes()))
    assert item.size[0] == 3 and item.rope_grid[3] == 25.0  # 2 frames per temporal patch at 2 fps: 1 s each
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}],
                                   tokenize=False, add_generation_prompt=True)
    ids = torch.tensor(tok(text.replace("<|VIDEO|>", "<|VIDEO|>" * item.num_tokens), add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        want = hf.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None],
                           pixel_values_videos=item.features, video_grid_thw=torch.tensor([list(item.size)]),
                           video_second_per_grid=torch.tensor([1.0]), max_new_tokens=10,
                           do_sample=False)[0, len(ids):].tolist()
    if want and want[-1] == tok.eos_token_id:
        want = want[:-1]
    assert got["token_ids"] == want and len(want) >= 3


def test_a_run_fine_tuned_from_a_thinker_exports_and_transformers_gives_omnis_logits(demo_root, tmp_path):
    """Fine-tuned from the directory (its tokenizer, both towers pretrained) on the demo's shapes,
    tones and text, then exported: transformers' whole class holds the trained thinker, whose
    logits on an image and a clip equal Omni's."""
    from recipe_helpers import tiny_overrides, train
    from recipes.model_source import load_model

    save_tiny_qwen2_5_omni(tmp_path / "hf")
    hf_dir = tmp_path / "hf"
    run = tmp_path / "run"
    train(tiny_overrides(demo_root, run, **{
        "trainer.max_steps": 2, "model.pretrained": hf_dir, "data.tokenizer": hf_dir, "data.micro_batch_tokens": 768,
        "encoders.vision.pretrained": hf_dir, "encoders.audio.pretrained": hf_dir}) + ["encoders=omni"])
    loaded = load_model(str(run))
    start = load_model(str(hf_dir)).model.state_dict()
    assert any(not torch.equal(t, start[n]) for n, t in loaded.model.state_dict().items()), "training changed nothing"
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    back = transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(tmp_path / "out").thinker.eval()
    image = np.random.default_rng(6).integers(0, 256, size=(40, 70, 3), dtype=np.uint8)
    wave = tone(0.8, 550.0)
    mb = omni_prompt(loaded, image, [wave])
    inputs = omni_hf_inputs(tmp_path / "out", [Image.fromarray(image)], [wave], mb.input_ids.numpy())
    with torch.no_grad():
        want = back(**inputs).logits[0]
        got = loaded.model(mb.input_ids, media=mb.media, position_ids=mb.position_ids,
                           rope_position_ids=mb.rope_position_ids)[0]
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_a_qwen3_omni_run_trains_both_towers_answers_and_exports(demo_root, tmp_path, capsys):
    """Fine-tuned from a tiny Qwen3-Omni thinker (its tokenizer, both towers pretrained; the
    vision tower's DeepStack rows beside the audio tower's narrower ones) on the demo's shapes,
    tones and text: every part trains, `omni generate` answers from an image and a clip, and the
    export's thinker, loaded by transformers, gives Omni's logits."""
    import soundfile

    from hf_omni_helpers import save_tiny_qwen3_omni
    from recipe_helpers import tiny_overrides, train
    from recipes.model_source import load_model

    hf_dir, run = tmp_path / "hf", tmp_path / "run"
    save_tiny_qwen3_omni(hf_dir)
    train(tiny_overrides(demo_root, run, **{
        "trainer.max_steps": 2, "model.pretrained": hf_dir, "data.tokenizer": hf_dir, "data.micro_batch_tokens": 768,
        "encoders.vision.pretrained": hf_dir, "encoders.audio.pretrained": hf_dir}) + ["encoders=qwen3_omni"])
    trained, start = load_model(str(run)).model.state_dict(), load_model(str(hf_dir)).model.state_dict()
    for part in ("llm.", "encoders.image.", "encoders.audio.", "projectors.image.", "projectors.audio."):
        assert any(not torch.equal(t, start[n]) for n, t in trained.items() if n.startswith(part)), part
    Image.fromarray(np.random.default_rng(4).integers(0, 256, size=(40, 64, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    soundfile.write(tmp_path / "a.wav", tone(0.7, 330.0), 16000, subtype="PCM_16")
    capsys.readouterr()
    assert main(["generate", "--model", str(run), "--image", str(tmp_path / "a.png"), "--audio", str(tmp_path / "a.wav"),
                 "--prompt", "what is this?", "--max-new-tokens", "4", "--greedy", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]) >= 1
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    back = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(tmp_path / "out").thinker.eval()
    loaded = load_model(str(run))
    image, wave = np.random.default_rng(6).integers(0, 256, size=(40, 70, 3), dtype=np.uint8), tone(0.8, 550.0)
    mb = omni_prompt(loaded, image, [wave])
    with torch.no_grad():
        want = back(**omni_hf_inputs(tmp_path / "out", [Image.fromarray(image)], [wave], mb.input_ids.numpy())).logits[0]
        got = loaded.model(mb.input_ids, media=mb.media, position_ids=mb.position_ids,
                           rope_position_ids=mb.rope_position_ids)[0]
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_greedy_with_a_video_and_its_own_audio_equals_transformers_generate(tmp_path, capsys):
    """`--video-audio`: a 3-second clip's frames and its AAC track, interleaved in 2-second chunks
    between <|audio_bos|> and <|audio_eos|> inside the video's own tokens, with TMRoPE's positions
    (the two opening tokens share one, the audio counts up beside the frames' times); transformers
    gets the same frames and track with use_audio_in_video."""
    pytest.importorskip("av")
    from dataloading.formats.video import audio_track, decode_video
    from dataloading.construct.positions import video_with_audio
    from media_helpers import clip_with_audio_bytes
    from omni.models.encoders.qwen_omni_vision import QwenOmniVisionEncoder
    from recipes.model_source import load_model

    hf, tok = save_tiny_qwen2_5_omni(tmp_path / "hf")
    clip = tmp_path / "c.mp4"
    clip.write_bytes(clip_with_audio_bytes(seconds=3.0))
    prompt = "what happens?"
    assert main(["generate", "--model", str(tmp_path / "hf"), "--video", str(clip), "--video-audio", "--prompt", prompt,
                 "--max-new-tokens", "10", "--greedy", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    loaded = load_model(str(tmp_path / "hf"))
    item = QwenOmniVisionEncoder.processor(loaded.model.encoders["image"].config).video(decode_video(clip.read_bytes()))
    wave, rate = audio_track(clip.read_bytes())
    assert rate == 16000 and item.size[0] == 3
    n_audio = loaded.model.encoders["audio"].processor(loaded.model.encoders["audio"].config)((wave, rate)).num_tokens
    t, rows, cols, interval = item.rope_grid[:4]
    runs, _, _ = video_with_audio(t, rows, cols, interval, n_audio, 50.0)
    assert len(runs) >= 3 and {v for v, _ in runs} == {True, False}  # really interleaved
    # the family's text: the video's tokens replaced by the audio's framing and the runs
    inner = "<|audio_bos|>" + "".join(("<|VIDEO|>" if v else "<|AUDIO|>") * n for v, n in runs) + "<|audio_eos|>"
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}],
                                   tokenize=False, add_generation_prompt=True).replace("<|VIDEO|>", inner)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    video = dataclasses.replace(decode_video(clip.read_bytes()), audio=(wave, rate))
    mb = omni_prompt_media(loaded, [("video", video)], prompt)
    # Omni's prompt is the family's, runs and framing included (a video's placeholder is written
    # as its encoder's, the image one: the id under an encoder row is never read)
    video_id, image_id = tok.convert_tokens_to_ids("<|VIDEO|>"), tok.convert_tokens_to_ids("<|IMAGE|>")
    assert mb.input_ids.tolist() == [image_id if i == video_id else i for i in ids.tolist()]
    assert mb.rope_position_ids[0].max() > mb.input_ids.numel() // 2  # timed positions, not a text count
    audio_in = omni_hf_inputs(tmp_path / "hf", [], [wave], ids.numpy())
    with torch.no_grad():
        want = hf.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None],
                           pixel_values_videos=item.features, video_grid_thw=torch.tensor([list(item.size)]),
                           video_second_per_grid=torch.tensor([1.0]), input_features=audio_in["input_features"],
                           feature_attention_mask=audio_in["feature_attention_mask"], use_audio_in_video=True,
                           max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
    if want and want[-1] == tok.eos_token_id:
        want = want[:-1]
    assert got["token_ids"] == want and len(want) >= 3


@pytest.mark.parametrize("with_audio", [False, True], ids=["frames", "frames and track"])
def test_qwen3_omni_greedy_with_a_video_equals_transformers_generate(tmp_path, capsys, with_audio):
    """Qwen3-Omni: a 3-second clip as one item of 3 temporal patches, 13 positions apart
    (position_id_per_seconds 13 x 2 frames / 2 fps), no timestamps; with `--video-audio` its AAC
    track's tokens merged with the frames' token by token by time between <|audio_start|> and
    <|audio_end|>, laid out here by transformers' own Qwen3OmniMoeProcessor rule."""
    pytest.importorskip("av")
    from types import SimpleNamespace

    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    from dataloading.formats.video import audio_track, decode_video
    from hf_omni_helpers import save_tiny_qwen3_omni
    from media_helpers import clip_with_audio_bytes
    from omni.models.encoders.qwen3_omni_vision import Qwen3OmniVisionEncoder
    from recipes.model_source import load_model

    hf, tok = save_tiny_qwen3_omni(tmp_path / "hf")
    clip = tmp_path / "c.mp4"
    clip.write_bytes(clip_with_audio_bytes(seconds=3.0, height=64, width=96))
    prompt = "what happens?"
    assert main(["generate", "--model", str(tmp_path / "hf"), "--video", str(clip), "--prompt", prompt,
                 "--max-new-tokens", "10", "--greedy", "--json"] + ["--video-audio"] * with_audio) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    loaded = load_model(str(tmp_path / "hf"))
    item = Qwen3OmniVisionEncoder.processor(loaded.model.encoders["image"].config).video(decode_video(clip.read_bytes()))
    assert item.size[0] == 3 and item.rope_grid[3:] == (13.0, True)
    inner = "<|video_pad|>" * item.num_tokens
    extra = {}
    if with_audio:
        wave, rate = audio_track(clip.read_bytes())
        audio = loaded.model.encoders["audio"]
        n_audio = audio.processor(audio.config)((wave, rate)).num_tokens
        fake = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2), audio_bos_token="<|audio_start|>",
                               audio_eos_token="<|audio_end|>", video_token="<|video_pad|>", audio_token="<|audio_pad|>")
        inner = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
            fake, {"video_grid_thw": [torch.tensor(item.size)], "video_second_per_grid": [1.0]}, 0,
            {"num_audio_tokens": [n_audio]}, 0, position_id_per_seconds=13)
        assert "<|audio_pad|><|video_pad|>" in inner and "<|video_pad|><|audio_pad|>" in inner  # interleaved
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}],
                                   tokenize=False, add_generation_prompt=True).replace("<|video_pad|>", inner)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    if with_audio:
        audio_in = omni_hf_inputs(tmp_path / "hf", [], [wave], ids.numpy())
        extra = dict(input_features=audio_in["input_features"], feature_attention_mask=audio_in["feature_attention_mask"],
                     use_audio_in_video=True)
    with torch.no_grad():
        want = hf.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None],
                           pixel_values_videos=item.features, video_grid_thw=torch.tensor([list(item.size)]),
                           video_second_per_grid=torch.tensor([1.0]), max_new_tokens=10, do_sample=False,
                           **extra)[0, len(ids):].tolist()
    if want and want[-1] == tok.eos_token_id:
        want = want[:-1]
    assert got["token_ids"] == want and len(want) >= 3


def test_video_audio_mistakes_are_one_line(tmp_path, capsys):
    """--video-audio on a clip without an audio track, and on a model without an audio tower."""
    pytest.importorskip("av")
    from hf_family_helpers import save_tiny_qwen2_5_vl
    from media_helpers import clip_bytes, clip_with_audio_bytes

    save_tiny_qwen2_5_omni(tmp_path / "omni")
    save_tiny_qwen2_5_vl(tmp_path / "vl")
    (tmp_path / "silent.mp4").write_bytes(clip_bytes(frames=20, rate=10, height=56, width=84))
    (tmp_path / "sound.mp4").write_bytes(clip_with_audio_bytes(seconds=2.0))
    for model, clip, message in (("omni", "silent.mp4", "has no audio track; drop --video-audio"),
                                 ("vl", "sound.mp4", "the model has no audio encoder")):
        capsys.readouterr()
        assert main(["generate", "--model", str(tmp_path / model), "--video", str(tmp_path / clip),
                     "--video-audio", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("omni: error: --video-audio") and message in err[-1], err[-1]
