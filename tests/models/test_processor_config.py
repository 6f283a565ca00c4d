"""An encoder's preprocessing comes from where transformers 5 reads it: a processor saved by
transformers 5 keeps its image processor's settings nested in processor_config.json (and writes
no preprocessor_config.json), which Omni reads before preprocessor_config.json, as transformers
does; one line says which file (or that there is none and the defaults are used)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hf_family_helpers import byte_level_tokenizer, save_tiny_llava_chat

transformers = pytest.importorskip("transformers")
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402

IMAGE = np.random.default_rng(3).integers(0, 256, size=(45, 37, 3), dtype=np.uint8)


def _save_processor(path, **image_settings) -> None:
    """transformers' own LlavaProcessor (a CLIP image processor, the tiny LLaVA's tokenizer)
    saved into ``path``, the model's preprocessor_config.json gone: what a LLaVA directory saved
    by transformers 5 holds."""
    (path / "preprocessor_config.json").unlink()
    tok = byte_level_tokenizer(["<unk>", "<s>", "</s>", "<image>"], eos="</s>")
    transformers.LlavaProcessor(image_processor=CLIPImageProcessorPil(**image_settings), tokenizer=tok, patch_size=6,
                                vision_feature_select_strategy="default", num_additional_image_tokens=1
                                ).save_pretrained(path)


def _omni_pixels(path) -> torch.Tensor:
    """The image as Omni's LLaVA model of ``path`` prepares it, [C, H, W]."""
    from omni.models import load_pretrained

    enc = load_pretrained(str(path)).encoders["image"]
    return torch.from_numpy(type(enc).processor(enc.config).pixels(IMAGE)).permute(2, 0, 1)


def test_image_settings_nested_in_processor_config_are_read(tmp_path, capsys):
    # settings far from CLIP's defaults (Omni's fallback): another normalisation, a larger resize
    save_tiny_llava_chat(tmp_path)
    _save_processor(tmp_path, size={"shortest_edge": 40}, crop_size={"height": 30, "width": 30},
                    image_mean=[0.5, 0.5, 0.5], image_std=[0.25, 0.25, 0.25])
    assert not (tmp_path / "preprocessor_config.json").exists()  # transformers 5 nests them
    assert "image_processor" in json.loads((tmp_path / "processor_config.json").read_text())
    capsys.readouterr()
    got = _omni_pixels(tmp_path)
    err = capsys.readouterr().err
    want = transformers.AutoImageProcessor.from_pretrained(tmp_path)(IMAGE, return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert f"omni: ClipEncoder preprocessing from {tmp_path / 'processor_config.json'}" in err, err
    # the processor (its prompt expansion) loads from the same file, and gives the same pixels
    proc = transformers.AutoProcessor.from_pretrained(tmp_path)
    torch.testing.assert_close(proc(images=[IMAGE], text=["<image>"], return_tensors="pt")["pixel_values"][0], want)

    # both files: processor_config.json first, as transformers reads them
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 30}, "image_mean": [0.1] * 3}))
    capsys.readouterr()
    torch.testing.assert_close(_omni_pixels(tmp_path), want, rtol=1e-5, atol=1e-5)
    assert str(tmp_path / "processor_config.json") in capsys.readouterr().err


def test_without_settings_the_defaults_are_named(tmp_path, capsys):
    save_tiny_llava_chat(tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()
    capsys.readouterr()
    _omni_pixels(tmp_path)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("omni: ")]
    want = (f"omni: {tmp_path} has no processor_config.json (image_processor) or preprocessor_config.json; "
            "ClipEncoder preprocesses with its defaults")
    assert lines == [want], lines
