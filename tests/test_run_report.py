"""What a run says about itself (issue 36): a LoRA run's banner says LoRA (rank, the layers it
adapts, the adapter weights), the run ends saying where its checkpoints are, and
`omni train --cfg job` under `model.pretrained` shows the checkpoint's architecture, marked."""
from __future__ import annotations

import re

import torch
import yaml

from recipe_helpers import tiny_overrides
from recipes.cli import main


def test_a_lora_run_says_lora_and_where_its_checkpoints_are(demo_root, tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", *tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 3, "checkpoint.every": 2}),
            "model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q_proj,v_proj]"]
    assert main(argv) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    banner = next(l for l in lines if "run dir" in l)
    # the demo's 4 layers, each with q_proj and v_proj adapted: A [4, 128] and B [out, 4]
    m = re.search(r"\(LoRA rank 4, alpha 8 on llm \(8 layers: q_proj, v_proj\), ([\d,]+) adapter weights; "
                  r"(\d+\.\d\d)M trainable", banner)
    assert m, banner
    assert int(m.group(1).replace(",", "")) == 4 * (4 * (128 + 128) + 4 * (128 + 64))
    # the last checkpoint is step 3 (saved at the end), the one at step 2 before it
    assert lines[-1] == f"omni: checkpoints in {run_dir / 'checkpoints'} (latest step 3)", lines[-3:]


def test_a_run_without_lora_or_checkpoints_says_neither(demo_root, tmp_path, capsys):
    argv = ["train", *tiny_overrides(demo_root, tmp_path / "run", **{"trainer.max_steps": 1,
                                                                      "checkpoint.save_at_end": "false"})]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "LoRA" not in out and "checkpoints in" not in out and "skipped" not in out


def test_cfg_job_shows_the_pretrained_architecture(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt = tmp_path / "my_llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, rope_theta=5e5,
                                 tie_word_embeddings=True)).save_pretrained(ckpt)
    assert main(["train", "--cfg", "job", "model=hf", f"model.pretrained={ckpt}"]) == 0
    text = capsys.readouterr().out
    model = yaml.safe_load(text)["model"]
    assert (model["hidden_size"], model["num_layers"], model["intermediate_size"], model["vocab_size"],
            model["rope_theta"], model["tie_word_embeddings"]) == (64, 2, 96, 300, 5e5, True)
    mark = f"# from {ckpt / 'config.json'}"
    assert f"  hidden_size: 64  {mark}" in text.splitlines()
    # what the checkpoint does not decide is shown unmarked
    assert not any(mark in line for line in text.splitlines() if "attn_backend" in line or "pretrained" in line)
    # without a checkpoint nothing is marked
    assert main(["train", "--cfg", "job"]) == 0
    assert "# from" not in capsys.readouterr().out
