"""The `vicuna_v1` chat template that docs/configuration.md gives for LLaVA-1.5 (issue 36): it
renders a turn's content given as a string (the converted data's) and as a list of parts (what
`omni generate` and transformers pass), the same text for the same turn, and `omni generate`
takes a model trained with it."""
from __future__ import annotations

import re

import numpy as np
from PIL import Image

from dataloading.formats.chat import parse_messages, render_segments, render_template
from recipe_helpers import REPO, tiny_overrides, train
from recipes.cli import main

SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. The assistant gives helpful, "
          "detailed, and polite answers to the human's questions. ")


def _documented_template() -> str:
    doc = (REPO / "docs" / "configuration.md").read_text()
    after = doc[doc.index("`vicuna_v1` conversation"):]
    return re.search(r"```jinja\n(.*?)```", after, re.S).group(1)


def test_list_content_renders_as_the_string_it_stands_for():
    template = _documented_template()
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = [{"role": "user", "content": "<image>\nWhat is it?"}]
    want = SYSTEM + "USER: <image>\nWhat is it? ASSISTANT:"
    assert render_template(template, parts, True, eos_token="</s>") == want
    assert render_template(template, text, True, eos_token="</s>") == want
    answered = text + [{"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]
    assert render_template(template, answered, False, eos_token="</s>") == \
        SYSTEM + "USER: <image>\nWhat is it? ASSISTANT: A cat.</s>"


def test_training_and_generate_with_the_documented_template(demo_root, tmp_path, capsys):
    from dataloading.formats.tokenizer import load_tokenizer
    from recipes.generate_cmd import prompt_text

    template = tmp_path / "vicuna_v1.jinja"
    template.write_text(_documented_template())
    # the training side: a conversation's answer is the span that gets a loss
    tok = load_tokenizer("byte", modalities=["image"], chat_template=template.read_text())
    turns = parse_messages("s", b'[{"role": "user", "content": "<image>\\nWhat is it?"}, '
                                b'{"role": "assistant", "content": "A cat."}]')
    assert [t for t, target in render_segments(tok, "s", turns) if target] == [" A cat.<eos>"]  # the byte tokenizer's EOS
    # omni generate on a run trained with it
    run = tmp_path / "run"
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: shapes, path: {demo_root / 'shapes'}, weight: 1.0}}\n")
    train(tiny_overrides(demo_root, run, **{"trainer.max_steps": 1, "data.mixture": mix,
                                            "data.chat_template": template}) + ["encoders=vision_only"])
    saved = load_tokenizer(run / "tokenizer")
    assert prompt_text(saved, ["image"], "What is it?") == SYSTEM + "USER: <image>\nWhat is it? ASSISTANT:"
    img = tmp_path / "a.png"
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(img)
    capsys.readouterr()
    assert main(["generate", "--model", str(run), "--image", str(img), "--prompt", "What is it?",
                 "--max-new-tokens", "3"]) == 0, capsys.readouterr().err
