"""What a run says and keeps about itself (issue 17): the banner and `<run_dir>/config.yaml`
describe the model that really ran (a `model.pretrained` checkpoint's, not the preset's), the
tokenizer it used is saved in `<run_dir>/tokenizer/` and loads back with the same ids, and a
vision-only model's vocabulary gains only `<image>`."""
from __future__ import annotations

import re

import torch
import yaml

from dataloading.formats.tokenizer import load_tokenizer
from recipe_helpers import tiny_overrides
from recipes.cli import main


def _word_tokenizer(path):
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "a": 1, "square": 2, "<s>": 3, "</s>": 4}
    core = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(path)
    return len(vocab)


def test_pretrained_vision_only_run_records_what_ran(demo_root, tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    n_words = _word_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    ckpt = tmp_path / "my_llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=n_words, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=False)).save_pretrained(ckpt)
    mix = tmp_path / "mix.yaml"  # no audio source: the model has no audio encoder
    mix.write_text(f"sources:\n  - {{name: shapes, path: {demo_root / 'shapes'}, weight: 0.7}}\n"
                   f"  - {{name: text, path: {demo_root / 'text'}, weight: 0.3}}\n")
    run_dir = tmp_path / "run"
    argv = ["train", *tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 1, "data.global_batch_size": 2}),
            f"data.mixture={mix}", f"model.pretrained={ckpt}", f"data.tokenizer={tmp_path / 'tok'}",
            "encoders=vision_only"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    banner = next(l for l in out.splitlines() if l.startswith("omni: ") and "run dir" in l)
    # Not "omni: demo:", and the backbone named is the checkpoint's.
    assert re.match(r"omni: my_llama-[0-9a-f]{6}: llama 2 layers x 64, vocab 6 \(from .*my_llama\)", banner), banner
    assert "encoders vision=siglip" in banner and "audio" not in banner

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    model = saved["model"]
    assert model["pretrained"] == str(ckpt) and saved["name"].startswith("my_llama-")
    assert (model["hidden_size"], model["num_layers"], model["intermediate_size"], model["tie_word_embeddings"]) == \
        (64, 2, 96, False)
    # Only <image> joined the vocabulary: one more than the user's tokenizer, not two.
    assert model["vocab_size"] == n_words + 1

    tok = load_tokenizer(run_dir / "tokenizer")
    used = load_tokenizer(tmp_path / "tok", modalities=["image"])
    text = "a <image> square <audio> a"
    assert tok.vocab_size == n_words + 1 and list(tok.placeholder_ids) == ["image"]
    assert tok.encode(text) == used.encode(text)


def test_demo_run_saves_its_byte_tokenizer(demo_root, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 1,
                                                                  "data.global_batch_size": 2})]) == 0
    tok = load_tokenizer(run_dir / "tokenizer")
    assert repr(tok) == "ByteTokenizer()" and set(tok.placeholder_ids) == {"image", "audio"}
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["vocab_size"] == 272 and saved["model"]["pretrained"] is None
