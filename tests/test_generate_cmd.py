"""`omni generate`: greedy on a Hugging Face directory gives transformers' `generate` tokens for
the same image and prompt (the image prepared by transformers' own image processor, the prompt
by the tokenizer's chat template); a trained run answers; every wrong argument is one line
before the model is read."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from hf_family_helpers import LLM_CONFIGS, SAVERS, hf_inputs, save_tiny_llm, save_tiny_qwen2_5_vl
from recipe_helpers import tiny_overrides, train
from recipes.cli import main

transformers = pytest.importorskip("transformers")


def _image(path, h=56, w=84, seed=1):
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(path)
    return path


def _json_out(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_greedy_on_a_family_directory_equals_transformers_generate(tmp_path, capsys, family):
    from omni.models.build import media_processors
    from recipes.model_source import load_model

    hf, tok = SAVERS[family](tmp_path / "hf")
    img = _image(tmp_path / "a.png")
    argv = ["generate", "--model", str(tmp_path / "hf"), "--image", str(img), "--prompt", "what is this?",
            "--max-new-tokens", "12", "--greedy", "--json"]
    assert main(argv) == 0
    got = _json_out(capsys)
    # the reference: the chat template, the image placeholder repeated once per image token (what
    # the family's processor does), transformers' own image processor, and generate
    # (the count is Omni's processor's: transformers' processor classes need torchvision; its
    # model refuses a count that does not match the image features it computes)
    placeholder = tok.convert_ids_to_tokens(hf.config.image_token_id)
    loaded = load_model(str(tmp_path / "hf"))
    n = media_processors(loaded.model)["image"](np.asarray(Image.open(img).convert("RGB"))).num_tokens
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text", "text": "what is this?"}]}],
                                   tokenize=False, add_generation_prompt=True)
    bos = [] if tok.bos_token_id is None else [tok.bos_token_id]
    ids = np.asarray(bos + tok(text.replace(placeholder, placeholder * n), add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        inputs = hf_inputs(tmp_path / "hf", [Image.open(img)], ids, hf.config.image_token_id)
        want = hf.generate(**inputs, max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    if want and want[-1] == tok.eos_token_id:
        want = want[:-1]  # omni leaves the end of sequence out of its answer
    assert got["token_ids"] == want and len(want) >= 3
    assert got["text"] == tok.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("family", sorted(LLM_CONFIGS))
def test_greedy_on_an_llm_directory_equals_transformers_generate(tmp_path, capsys, family):
    """A language model alone (Qwen3: QK-norm, head_dim apart; Qwen3-MoE: routed experts beside a
    dense layer): the prompt through its chat template, and transformers' greedy tokens."""
    hf, tok = save_tiny_llm(tmp_path / "hf", family)
    assert main(["generate", "--model", str(tmp_path / "hf"), "--prompt", "what is this?", "--max-new-tokens", "12",
                 "--greedy", "--json"]) == 0
    got = _json_out(capsys)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "what is this?"}]}],
                                   tokenize=False, add_generation_prompt=True)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        want = hf.generate(input_ids=ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                           max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    if want and want[-1] == tok.eos_token_id:
        want = want[:-1]
    assert got["token_ids"] == want and len(want) >= 3


def test_sampling_repeats_with_its_seed(tmp_path, capsys):
    save_tiny_qwen2_5_vl(tmp_path / "hf", std=0.05)  # small weights: a flat distribution to draw from
    argv = ["generate", "--model", str(tmp_path / "hf"), "--prompt", "hello", "--max-new-tokens", "8",
            "--temperature", "1.5", "--top-p", "0.95", "--json"]
    runs = []
    for seed in ("1", "1", "2"):
        assert main(argv + ["--seed", seed]) == 0
        runs.append(_json_out(capsys)["token_ids"])
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("extra,message", [
    (["--greedy", "--temperature", "0.7"], "--greedy picks the most likely token"),
    (["--top-p", "1.5"], "--top-p=1.5 must be in (0, 1]"),
    (["--image", "/no/such.png"], "--image /no/such.png: no such file"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
])
def test_wrong_arguments_are_one_line(tmp_path, capsys, extra, message):
    (tmp_path / "m").mkdir()  # never read: the arguments fail first
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "hi", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("omni: error: ") and message in err and "\n" not in err, err


def test_a_trained_run_answers_and_refuses_media_it_has_no_encoder_for(demo_root, tmp_path, capsys):
    run = tmp_path / "run"
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: shapes, path: {demo_root / 'shapes'}, weight: 1.0}}\n")
    train(tiny_overrides(demo_root, run, **{"trainer.max_steps": 2, "data.mixture": mix}) + ["encoders=vision_only"])
    img = _image(tmp_path / "s.png", 64, 64)
    assert main(["generate", "--model", str(run), "--image", str(img), "--prompt", "Describe the image.",
                 "--max-new-tokens", "5", "--json"]) == 0
    out = _json_out(capsys)
    assert 0 < len(out["token_ids"]) <= 5 and isinstance(out["text"], str)
    wav = tmp_path / "t.wav"
    import soundfile

    soundfile.write(wav, np.zeros(1600, dtype=np.float32), 16000)
    assert main(["generate", "--model", str(run), "--audio", str(wav), "--prompt", "hi"]) == 2
    assert "the model has no audio encoder (it has: image)" in capsys.readouterr().err


def _generated_on_a_clip(tmp_path, capsys, saver, height: int, width: int):
    """A 3-second clip (2 frames a second: 6 frames, 3 temporal patches) given to `omni generate
    --video` on ``saver``'s tiny directory: (the transformers model, its tokenizer, Omni's tokens,
    the decoded clip, the vision tower's config, the chat template's text)."""
    from dataloading.formats.video import decode_video
    from media_helpers import clip_bytes
    from recipes.model_source import load_model

    hf, tok = saver(tmp_path / "hf")
    clip = tmp_path / "c.mp4"
    clip.write_bytes(clip_bytes(frames=30, rate=10, height=height, width=width, texture_seed=0))
    assert main(["generate", "--model", str(tmp_path / "hf"), "--video", str(clip), "--prompt", "what happens?",
                 "--max-new-tokens", "10", "--json"]) == 0
    got = _json_out(capsys)["token_ids"]
    config = load_model(str(tmp_path / "hf")).model.encoders["image"].config
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"},
                                                                 {"type": "text", "text": "what happens?"}]}],
                                   tokenize=False, add_generation_prompt=True)
    return hf, tok, got, decode_video(clip.read_bytes()), config, text


def _transformers_greedy(hf, tok, text: str, **inputs) -> list[int]:
    """transformers' greedy tokens (10 at most, EOS dropped) after ``text``, its video tokens
    typed as video (mm_token_type_ids 2)."""
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        want = hf.generate(input_ids=ids[None], mm_token_type_ids=(ids == hf.config.video_token_id).long()[None] * 2,
                           max_new_tokens=10, do_sample=False, **inputs)[0, len(ids):].tolist()
    return want[:-1] if want and want[-1] == tok.eos_token_id else want


def test_greedy_with_a_video_on_a_qwen_directory_equals_transformers_generate(tmp_path, capsys):
    """A clip through the chat template (<|vision_start|><|video_pad|><|vision_end|>), sampled
    at the default 2 frames per second; transformers gets the same frames as its video inputs,
    the video token once per merged patch and the seconds per temporal patch (its M-RoPE steps)."""
    pytest.importorskip("av")
    from omni.models.encoders.qwen_vl import QwenVisionEncoder

    hf, tok, got, clip, config, text = _generated_on_a_clip(tmp_path, capsys, save_tiny_qwen2_5_vl, 56, 84)
    item = QwenVisionEncoder.processor(config).video(clip)
    assert item.size[0] == 3  # 3 s at 2 frames per second: 6 frames, 3 temporal patches of 2
    want = _transformers_greedy(hf, tok, text.replace("<|video_pad|>", "<|video_pad|>" * item.num_tokens),
                                pixel_values_videos=item.features, video_grid_thw=torch.tensor([list(item.size)]),
                                second_per_grid_ts=torch.tensor([2 / (6 / 3.0)]))  # 2 frames per patch at 2 fps
    assert got == want and len(want) >= 3


def test_greedy_with_a_video_on_a_qwen3_vl_directory_equals_transformers_generate(tmp_path, capsys):
    """Qwen3-VL writes a clip frame by frame: the chat template's <|vision_start|><|video_pad|>
    <|vision_end|> becomes, per temporal patch, its time ("<0.5 seconds>") and the frame's own
    <|vision_start|>, video tokens and <|vision_end|> (transformers' Qwen3VLProcessor);
    transformers gets the clip's frames as one video of 3 temporal patches."""
    pytest.importorskip("av")
    from hf_family_helpers import save_tiny_qwen3_vl
    from omni.models.encoders.qwen3_vl import Qwen3VisionEncoder

    hf, tok, got, clip, config, text = _generated_on_a_clip(tmp_path, capsys, save_tiny_qwen3_vl, 64, 96)
    items = Qwen3VisionEncoder.processor(config).video(clip)
    assert len(items) == 3 and len({it.size for it in items}) == 1  # 6 frames at 2 a second, patches of 2
    _, gh, gw = items[0].size
    # frames at 0.25, 0.75, ..., 2.75 s; each patch's time is its two frames' mean
    frames = "".join(f"<{s} seconds><|vision_start|>" + "<|video_pad|>" * items[0].num_tokens + "<|vision_end|>"
                     for s in ("0.5", "1.5", "2.5"))
    want = _transformers_greedy(hf, tok, text.replace("<|vision_start|><|video_pad|><|vision_end|>", frames),
                                pixel_values_videos=torch.cat([it.features for it in items]),
                                video_grid_thw=torch.tensor([[3, gh, gw]]))
    assert got == want and len(want) >= 3


def test_media_that_cannot_be_used_is_one_line(tmp_path, capsys, monkeypatch):
    """An image whose grid the Qwen processor cannot make (aspect ratio over 200) and a video
    without the decoder extra, each one line; the video's before the model is read."""
    from media_helpers import clip_bytes

    save_tiny_qwen2_5_vl(tmp_path / "hf")
    wide = _image(tmp_path / "wide.png", 4, 1200)
    capsys.readouterr()  # transformers' own progress bar while saving
    assert main(["generate", "--model", str(tmp_path / "hf"), "--image", str(wide), "--prompt", "hi"]) == 2
    # read after the model: the line before it says where the image settings came from
    note, err = capsys.readouterr().err.strip().splitlines()
    assert note == f"omni: QwenVisionEncoder preprocessing from {tmp_path / 'hf' / 'preprocessor_config.json'}", note
    assert err.startswith("omni: error: ") and "aspect ratio over 200" in err, err
    pytest.importorskip("av")
    clip = tmp_path / "c.mp4"
    clip.write_bytes(clip_bytes())
    monkeypatch.setitem(__import__("sys").modules, "av", None)  # `import av` fails as if not installed
    assert main(["generate", "--model", str(tmp_path / "hf"), "--video", str(clip), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("omni: error: ") and "\n" not in err and "pip install 'omni-mm[video]'" in err, err
