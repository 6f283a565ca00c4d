"""`omni export`: a Hugging Face directory or a trained run (single process, pp=2, dp_shard=2 x
tp=2) -> the family's own transformers directory. transformers loads it (model, tokenizer with
its chat template, image processor), its logits equal Omni's, and exporting the export again
writes the same bytes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hf_family_helpers import SAVERS, hf_inputs
from recipe_helpers import tiny_overrides, torchrun_train, train
from recipes.cli import main

transformers = pytest.importorskip("transformers")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


IMAGE = np.random.default_rng(1).integers(0, 256, size=(56, 84, 3), dtype=np.uint8)


def _prompt(loaded):
    """One image and a chat prompt, built as `omni generate` builds it: Omni's micro-batch and
    the image's MediaItem."""
    from dataloading.constructor import SampleConstructor
    from dataloading.sample import DecodedSample
    from omni.models.build import media_processors
    from recipes.generate_cmd import prompt_text

    text = prompt_text(loaded.tokenizer, ["image"], "what is this?")
    c = SampleConstructor({}, loaded.tokenizer, media_processors(loaded.model), None)
    mb, _ = c.build_prompt(DecodedSample("prompt", text, None, [("image", IMAGE)]))
    return mb, media_processors(loaded.model)["image"](IMAGE)


def _omni_logits(model, mb) -> torch.Tensor:
    with torch.no_grad():
        embeds = model.embed(mb.input_ids, mb.media)
        out = model.llm(inputs_embeds=embeds[None], position_ids=mb.position_ids[None], output_hidden=True,
                        rope_position_ids=mb.rope_position_ids)
        return model.llm.lm_logits(out.hidden_states[0])


def _check_export(out: Path, loaded) -> None:
    """transformers loads ``out`` whole (model, image processor, tokenizer), and its logits
    for the image prepared by its own image processor equal those of Omni's ``loaded`` model."""
    from PIL import Image

    hf = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    mb, item = _prompt(loaded)
    pad = loaded.tokenizer.placeholder_ids["image"]
    assert hf.config.image_token_id == pad
    with torch.no_grad():
        want = hf(**hf_inputs(out, [Image.fromarray(IMAGE)], mb.input_ids.numpy(), pad)).logits[0]
    got = _omni_logits(loaded.model, mb)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    # the exported tokenizer (and chat template) give the ids Omni built: the prompt as the
    # template renders it, the image's placeholder repeated once per merged patch
    from recipes.generate_cmd import prompt_text

    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = prompt_text(loaded.tokenizer, ["image"], "what is this?")
    if getattr(loaded.tokenizer, "chat_template", None):
        assert tok.chat_template == loaded.tokenizer.chat_template
        assert tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
            "type": "text", "text": "what is this?"}]}], tokenize=False, add_generation_prompt=True) == text
    placeholder = tok.convert_ids_to_tokens(pad)
    bos = [] if loaded.tokenizer.bos_id is None else [tok.bos_token_id]
    want_ids = bos + tok(text.replace(placeholder, placeholder * item.num_tokens), add_special_tokens=False)["input_ids"]
    assert mb.input_ids.tolist() == want_ids


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_a_hugging_face_directory_exports_to_itself_and_round_trips(tmp_path, family):
    from recipes.model_source import load_model

    hf, _ = SAVERS[family](tmp_path / "hf")
    assert main(["export", str(tmp_path / "hf"), "--out", str(tmp_path / "a")]) == 0
    back = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "a")
    assert type(back) is type(hf)
    want = hf.state_dict()
    got = back.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    _check_export(tmp_path / "a", load_model(str(tmp_path / "hf")))
    assert main(["export", str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 0
    first, second = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert first.keys() == second.keys() and all(first[k] == second[k] for k in first), \
        [k for k in first if first[k] != second.get(k)]


TOWERS = {"qwen2_vl": "qwen_vl", "qwen2_5_vl": "qwen_vl", "llava": "clip", "llava_onevision": "llava_ov",
          "llava_next": "llava_next"}


def _family_run(demo_root: Path, tmp_path: Path, run: str, family: str = "qwen2_5_vl",
                **layout) -> tuple[Path, list[str]]:
    """A fine-tuning run of a family's tiny directory on the demo's images and text."""
    hf_dir = tmp_path / "hf"
    if not hf_dir.exists():
        SAVERS[family](hf_dir)
    mix = tmp_path / "mix.yaml"  # images and text: the model has no audio encoder
    mix.write_text(f"sources:\n  - {{name: shapes, path: {demo_root / 'shapes'}, weight: 0.7}}\n"
                   f"  - {{name: text, path: {demo_root / 'text'}, weight: 0.3}}\n")
    extra = {"trainer.max_steps": 2, "data.global_batch_size": 4, "data.mixture": mix, "model.pretrained": hf_dir,
             "data.tokenizer": hf_dir, "encoders.vision.pretrained": hf_dir, "data.micro_batch_tokens": 512,
             **{f"parallel.{k}": v for k, v in layout.items()}}
    overrides = tiny_overrides(demo_root, tmp_path / run, **extra)
    return tmp_path / run, overrides + ["encoders=vision_only", f"encoders/vision={TOWERS[family]}"]


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_a_trained_run_exports_and_transformers_gives_omnis_logits(demo_root, tmp_path, family):
    from recipes.model_source import load_model

    run, overrides = _family_run(demo_root, tmp_path, "run", family)
    train(overrides)
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    loaded = load_model(str(run))
    start = load_model(str(tmp_path / "hf"))
    trained = dict(loaded.model.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in start.model.named_parameters()), "training changed nothing"
    _check_export(tmp_path / "out", loaded)
    assert main(["export", str(tmp_path / "out"), "--out", str(tmp_path / "again")]) == 0
    first, second = _files(tmp_path / "out"), _files(tmp_path / "again")
    assert all(first[k] == second[k] for k in ("config.json", "model.safetensors"))


@pytest.mark.parametrize("experiment", ["qwen2_vl_tiny", "llava_ov_tiny"])
def test_a_tiny_family_experiment_trains_exports_and_loads_in_transformers(demo_root, tmp_path, experiment):
    """The CPU presets of the families, trained from scratch (their projectors are the family's:
    Qwen's patch merger, LLaVA-OneVision's MLP with the image newline), are checkpoints of
    their family once exported, the byte tokenizer as transformers files."""
    from recipes.model_source import load_model

    run = tmp_path / "run"
    train(tiny_overrides(demo_root, run, **{"trainer.max_steps": 2, "data.mixture": demo_root / "vision.yaml"})
          + [f"experiment={experiment}"])
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    _check_export(tmp_path / "out", load_model(str(run)))


@pytest.mark.slow
@pytest.mark.parametrize("family,nproc,layout", [
    ("qwen2_5_vl", 2, dict(dp_shard=1, pp=2)), ("qwen2_5_vl", 4, dict(dp_shard=2, tp=2)),
    ("llava", 4, dict(dp_shard=2, tp=2)), ("llava_onevision", 2, dict(dp_shard=1, pp=2))],
    ids=["qwen2_5_vl pp=2", "qwen2_5_vl dp_shard=2 x tp=2", "llava dp_shard=2 x tp=2", "llava_onevision pp=2"])
def test_a_run_of_another_layout_exports(demo_root, tmp_path, family, nproc, layout):
    from recipes.model_source import load_model

    run, overrides = _family_run(demo_root, tmp_path, "run", family, **layout)
    torchrun_train(nproc, overrides, cwd=tmp_path)
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    _check_export(tmp_path / "out", load_model(str(run)))


def test_export_refuses_in_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "bert"}')
    assert main(["export", str(tmp_path / "other"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model_type='bert' is not a family Omni loads" in err and "qwen2_5_vl" in err
