"""`omni export`: a Hugging Face directory or a trained run (single process, pp=2, dp_shard=2 x
tp=2) -> the family's own transformers directory. transformers loads it (model, tokenizer with
its chat template, image processor, processor), its logits equal Omni's, every token id its
config names is the tokenizer's, its `generate` stops where `omni generate` stops, and exporting
the export again writes the same bytes."""
from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from hf_family_helpers import LLM_CONFIGS, SAVERS, hf_inputs, image_prompt, model_logits
from recipe_helpers import ranks_train, tiny_overrides, train
from recipes.cli import main

transformers = pytest.importorskip("transformers")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


IMAGE = np.random.default_rng(1).integers(0, 256, size=(56, 84, 3), dtype=np.uint8)


def _prompt(loaded):
    return image_prompt(loaded, IMAGE)


def _check_export(out: Path, loaded) -> None:
    """transformers loads ``out`` whole (model, image processor, tokenizer), and its logits
    for the image prepared by its own image processor equal those of Omni's ``loaded`` model;
    its ids and processor are the tokenizer's and Omni's (``_check_ids``, ``_check_processor``)."""
    from PIL import Image

    hf = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    mb, item = _prompt(loaded)
    pad = loaded.tokenizer.placeholder_ids["image"]
    assert hf.config.image_token_id == pad
    _check_ids(out, loaded, hf)
    inputs = hf_inputs(out, [Image.fromarray(IMAGE)], mb.input_ids.numpy(), pad)
    _check_processor(out, loaded, mb, inputs["pixel_values"])
    with torch.no_grad():
        want = hf(**inputs).logits[0]
    got = model_logits(loaded.model, mb)
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


# The token behind each id field a family's config.json holds, besides the image placeholder
# (Omni's own) and bos/eos/pad (the tokenizer's): an id field not named here fails the check.
ID_TOKENS = {"video_token_id": "<|video_pad|>", "video_token_index": "<video>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
# The id fields each family's config class names at the top level (bos/eos/pad: in text_config).
TOP_IDS = {"qwen2_vl": {"image_token_id", *(k for k in ID_TOKENS if not k.endswith("index"))},
           "llava": {"image_token_index"}, "llava_next": {"image_token_index"},
           "llava_onevision": {"image_token_index", "video_token_index"}}
TOP_IDS["qwen2_5_vl"] = TOP_IDS["qwen3_vl"] = TOP_IDS["qwen3_vl_moe"] = TOP_IDS["qwen2_vl"]
TEXT_IDS = {"bos_token_id", "eos_token_id", "pad_token_id"}


def _id_fields(config: dict, where: str = ""):
    """(where, field, value) of every token id in a config.json, nested configs included."""
    for key, value in config.items():
        if isinstance(value, dict):
            yield from _id_fields(value, f"{where}{key}.")
        elif key.endswith(("_token_id", "_token_index")):
            yield where, key, value


def _stop_ids(tok, source: Path) -> set[int]:
    """Where `omni generate` stops on a model from ``source``: the tokenizer's eos, and those the
    source's generation_config.json adds."""
    config = source / "generation_config.json"
    extra = json.loads(config.read_text()).get("eos_token_id") if config.is_file() else None
    return {tok.eos_token_id, *(extra if isinstance(extra, list) else [] if extra is None else [extra])}


def _check_ids(out: Path, loaded, hf=None) -> None:
    """Every token id config.json names is the exported tokenizer's (-1 for a token its
    vocabulary lacks; bos/eos/pad in text_config), and generation_config.json, which transformers'
    model takes, has its bos and pad and stops where `omni generate` stops."""
    tok = transformers.AutoTokenizer.from_pretrained(out)
    vocab = tok.get_vocab()
    image = loaded.tokenizer.placeholder_ids.get("image")
    want = {"image_token_id": image, "image_token_index": image, "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
            **{k: vocab.get(t, -1) for k, t in ID_TOKENS.items()}}
    config = json.loads((out / "config.json").read_text())
    fields = list(_id_fields(config))
    for where, key, value in fields:
        assert key in want, f"config.json {where}{key} is not checked"
        assert value == want[key], f"config.json {where}{key}={value}, the tokenizer's is {want[key]}"
    text = "" if config["model_type"] not in TOP_IDS else "text_config."
    assert {k for w, k, _ in fields if w == text} >= TEXT_IDS
    top = TOP_IDS.get(config["model_type"], set()) | (TEXT_IDS if not text else set())
    assert {k for w, k, _ in fields if w == ""} == top
    gen = json.loads((out / "generation_config.json").read_text())
    stops = _stop_ids(tok, Path(loaded.weights))
    assert {k: gen.get(k) for k in ("bos_token_id", "pad_token_id")} == {"bos_token_id": tok.bos_token_id,
                                                                        "pad_token_id": tok.pad_token_id}
    assert set(gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]) == stops
    if hf is not None:  # what transformers' generate reads
        eos = hf.generation_config.eos_token_id
        assert set(eos if isinstance(eos, list) else [eos]) == stops
        assert hf.generation_config.bos_token_id == tok.bos_token_id


def _check_processor(out: Path, loaded, mb, pixels: torch.Tensor) -> None:
    """transformers' processor of the export turns the prompt and the image into Omni's ids and
    the image processor's pixels: ``AutoProcessor`` for LLaVA and LLaVA-NeXT; the processors of
    Qwen2-VL and LLaVA-OneVision also hold a video processor, which needs torchvision (not
    installed here), so their class is built from the export's files with that check skipped."""
    from PIL import Image

    from recipes.generate_cmd import prompt_text

    model_type = json.loads((out / "config.json").read_text())["model_type"]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    if model_type in ("llava", "llava_next"):
        proc = transformers.AutoProcessor.from_pretrained(out)
    else:
        if model_type != "llava_onevision" and "<|image_pad|>" not in tok.get_vocab():
            return  # Omni's byte tokenizer: Qwen2-VL's processor writes images as <|image_pad|>
        # Qwen2-VL's processor has no settings of its own (no processor_config.json)
        settings = json.loads((out / "processor_config.json").read_text()) if model_type == "llava_onevision" else {
            "processor_class": {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                                "qwen3_vl": "Qwen3VLProcessor", "qwen3_vl_moe": "Qwen3VLProcessor"}[model_type]}
        cls = getattr(transformers, settings.pop("processor_class"))
        settings.pop("image_processor", None)  # AutoImageProcessor reads it (nested) from the same file
        with mock.patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class", lambda *a: None):
            proc = cls(image_processor=transformers.AutoImageProcessor.from_pretrained(out), tokenizer=tok,
                       video_processor=None, **settings)
    got = proc(images=[Image.fromarray(IMAGE)], text=[prompt_text(loaded.tokenizer, ["image"], "what is this?")],
               return_tensors="pt")
    ids = got["input_ids"][0].tolist()
    # the helpers' byte-level tokenizers write no BOS of their own (Omni's data plane puts it first)
    bos = [] if loaded.tokenizer.bos_id is None or ids[:1] == [loaded.tokenizer.bos_id] else [loaded.tokenizer.bos_id]
    assert bos + ids == mb.input_ids.tolist()
    assert torch.equal(got["pixel_values"], pixels)
    if model_type in ("llava", "llava_next"):  # the file is what transformers' save_pretrained writes
        assert proc.to_json_string() == (out / "processor_config.json").read_text()


# Families whose export writes the files a transformers save of the directory holds, name for name
# (Qwen3-VL-MoE's experts as the released checkpoints store them: fused, hidden first). For the
# others transformers 5 saves its pre-5 names (Qwen2-VL's ``model.layers.``, LLaVA's
# ``language_model.model.``) where Omni writes the 5.x names, which transformers also loads.
SAME_FILES = {"qwen3_vl", "qwen3_vl_moe", "llava_onevision"}


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
    if family in SAME_FILES:  # the directory's own files, tensor for tensor (names, layouts, values)
        stored, written = _tensors(tmp_path / "hf"), _tensors(tmp_path / "a")
        assert stored.keys() == written.keys(), (sorted(stored.keys() - written.keys())[:3],
                                                 sorted(written.keys() - stored.keys())[:3])
        assert all(torch.equal(stored[k], written[k]) for k in stored), \
            [(k, tuple(stored[k].shape), tuple(written[k].shape)) for k in stored
             if not torch.equal(stored[k], written[k])][:3]
    _check_export(tmp_path / "a", load_model(str(tmp_path / "hf")))
    assert main(["export", str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 0
    first, second = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert first.keys() == second.keys() and all(first[k] == second[k] for k in first), \
        [k for k in first if first[k] != second.get(k)]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _ending_row(scores: torch.Tensor, head: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(k, row): an LM-head row that makes a token win greedy decoding first at new token k >= 2
    of the answer whose logits are ``scores`` [steps, vocab] (with that token held back, so
    the answer up to there is unchanged): ``c`` times token v's row, which beats the step's
    best logit ``top`` exactly where ``c > top / logit_v`` (the logit positive); k is the first
    step >= 2 where that ratio falls below all the earlier ones (by 1%, well above the two
    implementations' rounding), c between them."""
    top = scores.max(dim=1).values[:, None]
    ratio = torch.where(scores > 0, top / scores, torch.full_like(scores, float("inf")))
    for k in range(2, scores.shape[0]):
        before = ratio[:k].min(dim=0).values
        margin = torch.where(ratio[k].isfinite(), before / ratio[k], torch.zeros_like(before))
        v = int(margin.argmax())
        if margin[v] > 1.01:
            return k, head[v] * ratio[k, v] * margin[v].clamp(max=4.0).sqrt()
    raise AssertionError("no token's row can end this answer after 2 tokens")


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_transformers_generate_on_an_export_stops_where_omni_generate_stops(tmp_path, capsys, family):
    """A model whose greedy answer ends after a few tokens with an end of sequence: the
    tokenizer's eos (LLaVA's </s>) or, as Qwen's chat models do, <|endoftext|> listed beside it
    in generation_config.json. transformers' generate on the export, with nothing but the
    export's files, stops where `omni generate` stops."""
    from PIL import Image

    from recipes.model_source import load_model

    hf, tok = SAVERS[family](tmp_path / "hf")
    end = tok.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tok.get_vocab() else tok.eos_token_id
    source = load_model(str(tmp_path / "hf"))
    mb, _ = _prompt(source)
    pad = source.tokenizer.placeholder_ids["image"]
    assert end not in mb.input_ids.tolist()  # its embedding may change below (a tied head)
    limit = 16
    with torch.no_grad():  # the greedy answer with every eos held back
        free = hf.generate(**hf_inputs(tmp_path / "hf", [Image.fromarray(IMAGE)], mb.input_ids.numpy(), pad),
                           max_new_tokens=limit, min_new_tokens=limit, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
        new = free.sequences[0, mb.input_ids.numel():].tolist()
        k, row = _ending_row(torch.stack([s[0] for s in free.scores]), hf.get_output_embeddings().weight)
        hf.get_output_embeddings().weight[end] = row
    hf.generation_config.eos_token_id = sorted({tok.eos_token_id, end})
    hf.save_pretrained(tmp_path / "hf")
    assert main(["export", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 0
    img = tmp_path / "a.png"
    Image.fromarray(IMAGE).save(img)
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "out"), "--image", str(img), "--prompt", "what is this?",
                 "--max-new-tokens", str(limit), "--greedy", "--json"]) == 0
    omni = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    back = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        theirs = back.generate(**hf_inputs(tmp_path / "out", [Image.fromarray(IMAGE)], mb.input_ids.numpy(), pad),
                               max_new_tokens=limit, do_sample=False)[0, mb.input_ids.numel():].tolist()
    assert theirs == new[:k] + [end] and omni == new[:k], (theirs, omni, new, k)


TOWERS = {"qwen2_vl": "qwen_vl", "qwen2_5_vl": "qwen_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl", "llava": "clip",
          "llava_onevision": "llava_ov", "llava_next": "llava_next"}


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


@pytest.mark.parametrize("experiment", ["qwen2_vl_tiny", "qwen3_vl_tiny", "llava_ov_tiny"])
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
    ranks_train(nproc, overrides)
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    _check_export(tmp_path / "out", load_model(str(run)))


def test_an_llm_alone_exports_with_its_tokenizers_ids(tmp_path):
    """A Llama without a vision tower: config.json's bos/eos/pad are its tokenizer's (not
    LlamaConfig's defaults, 1 and 2), and so are generation_config.json's."""
    from hf_family_helpers import byte_level_tokenizer
    from recipes.model_source import load_model

    tok = byte_level_tokenizer(["<unk>", "<pad>", "<s>", "</s>"], eos="</s>")
    tok.bos_token, tok.pad_token = "<s>", "<pad>"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=272)).save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    assert main(["export", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (258, 259, 257)
    _check_ids(tmp_path / "out", load_model(str(tmp_path / "hf")),
               transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out"))


@pytest.mark.parametrize("family", sorted(LLM_CONFIGS))
def test_an_llm_directory_exports_bit_exact_in_the_released_layout(tmp_path, family):
    """``omni export`` of a Qwen3 / Qwen3-MoE directory writes every tensor transformers saved,
    bit for bit, under the same names (the experts one per expert, as the released checkpoints
    store them), a config transformers loads, and the tokenizer's ids."""
    from safetensors.torch import load_file

    from hf_family_helpers import save_tiny_llm
    from recipes.model_source import load_model

    hf, _ = save_tiny_llm(tmp_path / "hf", family)
    assert main(["export", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 0
    theirs = load_file(str(tmp_path / "hf" / "model.safetensors"))
    ours = {k: v for f in sorted((tmp_path / "out").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    if family == "qwen3_moe":
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in ours)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.model_type == family
    _check_ids(tmp_path / "out", load_model(str(tmp_path / "hf")), again)


def test_export_refuses_in_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "bert"}')
    assert main(["export", str(tmp_path / "other"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model_type='bert' is not a family Omni loads" in err and "qwen2_5_vl" in err
