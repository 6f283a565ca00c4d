"""`omni data plan`: the dry run on a skewed two-source mixture (long-tailed text + images of
varied size) at dp 16 — Omni's arrangement keeps every step within 5% of the mean cost, the
plain order does visibly worse, and both hold the same samples."""
import io
import json

import numpy as np
import pytest

from dataloading.index.shards import write_shards
from dataloading.index.source_index import build_index
from recipes.cli import main
from recipes.plan_cmd import plan_main


@pytest.fixture(scope="module")
def skewed_mixture(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("skewed")
    rng = np.random.default_rng(0)
    lengths = np.minimum(30 + (rng.pareto(1.2, 600) * 80).astype(int), 1500)  # 30..1500, heavy tail
    write_shards(({"__key__": f"t{i:04d}", "txt": "lorem ipsum " * (n // 12) + "x" * (n % 12)}
                  for i, n in enumerate(lengths)), root / "text", "text", samples_per_shard=200)

    def png(h, w):
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (int(h) % 256, 80, 160)).save(buf, format="PNG")
        return buf.getvalue()

    sizes = rng.integers(8, 129, size=(300, 2))
    write_shards(({"__key__": f"i{i:04d}", "txt": "<image>\nDescribe the picture in detail.",
                   "png": png(h, w), "response.txt": "a picture " * int(rng.integers(1, 30))}
                  for i, (h, w) in enumerate(sizes)), root / "images", "images", samples_per_shard=100)
    for name in ("text", "images"):
        build_index(root / name, workers=1, progress=False)
    mix = root / "mix.yaml"
    mix.write_text("sources:\n  - {name: text, path: text, weight: 0.6}\n  - {name: images, path: images, weight: 0.4}\n")
    return mix


def run_plan(mix, balance, steps=6):
    out = io.StringIO()
    overrides = [f"data.mixture={mix}", "data.micro_batch_tokens=4096", "data.global_batch_size=256"]
    assert plan_main(overrides, dp=16, steps=steps, balance=balance, as_json=True, out=out) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


def imbalance(step):
    costs = [r["cost"] for r in step["ranks"]]
    return max(costs) / (sum(costs) / len(costs))


def test_balanced_beats_none_on_the_same_samples(skewed_mixture):
    ours, plain = run_plan(skewed_mixture, "balanced"), run_plan(skewed_mixture, "none")
    for a, b in zip(ours, plain):
        assert a["step"] == b["step"] and len(a["ranks"]) == len(b["ranks"]) == 16
        assert sorted(s for r in a["ranks"] for s in r["samples"]) == sorted(s for r in b["ranks"] for s in r["samples"])
        assert sum(len(r["samples"]) for r in a["ranks"]) == 256
        assert imbalance(a) <= 1.05 and abs(imbalance(a) - a["max_over_mean"]) < 1e-9
        assert imbalance(b) > 1.15  # visibly worse
        for r in a["ranks"]:
            assert set(r) >= {"cost", "tokens", "samples"} and all(s.count("/") == 1 for s in r["samples"])


def test_human_table_summary_and_state_files(skewed_mixture, tmp_path, capsys):
    state = tmp_path / "state.json"
    argv = ["data", "plan", f"data.mixture={skewed_mixture}", "data.micro_batch_tokens=4096",
            "data.global_batch_size=256", "--dp", "16", "--steps", "3", "--save-state", str(state)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| step | max/mean | lower bound | utilisation |" in out and "summary over 3 steps" in out
    assert "text 6" in out and "(target 60.0%)" in out
    assert json.loads(state.read_text())["step"] == 3
    # continuing from the saved state equals planning 6 steps in one go
    out = io.StringIO()
    plan_main([f"data.mixture={skewed_mixture}", "data.micro_batch_tokens=4096", "data.global_batch_size=256"],
              dp=16, steps=3, as_json=True, load_state=str(state), out=out)
    continued = [json.loads(line) for line in out.getvalue().splitlines()]
    assert continued == run_plan(skewed_mixture, "balanced")[3:]


def test_plan_errors_are_one_line(tmp_path, capsys):
    assert main(["data", "plan", f"data.mixture={tmp_path / 'none.yaml'}", "--dp", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omni: error: mixture file") and err.count("\n") == 1


def test_load_state_from_a_training_checkpoint(skewed_mixture, tmp_path):
    import torch

    overrides = [f"data.mixture={skewed_mixture}", "data.micro_batch_tokens=4096", "data.global_batch_size=256"]
    state = tmp_path / "s.json"
    plan_main(overrides, dp=16, steps=2, as_json=True, save_state=str(state), out=io.StringIO())
    ckpt = tmp_path / "trainer_state.pt"
    torch.save({"step": 2, "loader": {"planner": json.loads(state.read_text()), "problems": {}}}, ckpt)
    a, b = io.StringIO(), io.StringIO()
    plan_main(overrides, dp=16, steps=1, as_json=True, load_state=str(ckpt), out=a)
    plan_main(overrides, dp=16, steps=1, as_json=True, load_state=str(state), out=b)
    assert json.loads(a.getvalue())["step"] == 2 and a.getvalue() == b.getvalue()


def test_plan_with_a_pretrained_hf_llama(skewed_mixture, tmp_path):
    """`model.pretrained=<a saved HF llama>` crashed ("Cannot copy out of meta tensor"): planning
    builds the structure on the meta device, so it reads config.json and no weights."""
    import torch
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from recipes.compose import compose_config
    from recipes.data_plane import model_for_planning

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=288, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    overrides = [f"data.mixture={skewed_mixture}", "data.micro_batch_tokens=4096", "data.global_batch_size=64",
                 f"model.pretrained={tmp_path / 'llama'}"]
    out = io.StringIO()
    assert plan_main(overrides, dp=4, steps=2, as_json=True, out=out) == 0
    steps = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [s["step"] for s in steps] == [0, 1] and sum(len(r["samples"]) for r in steps[0]["ranks"]) == 64
    # The plan's costs are those of the checkpoint's architecture, not the preset's.
    model = model_for_planning(OmegaConf.to_object(compose_config(overrides)), 272)
    c = model.llm.config
    assert (c.hidden_size, c.num_layers, c.intermediate_size, c.vocab_size) == (64, 2, 160, 288)


def test_plan_without_a_mixture_says_it_plans_the_demo(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMNI_CACHE", str(tmp_path / "cache"))
    assert main(["data", "plan", "data.demo_scale=0.02", "data.global_batch_size=8", "--dp", "2", "--steps", "1",
                 "--json"]) == 0
    captured = capsys.readouterr()
    notes = [l for l in captured.err.splitlines() if "no data.mixture given" in l]
    assert len(notes) == 1, captured.err
    assert "demo mixture" in notes[0] and str(tmp_path / "cache") in notes[0] and "data.mixture=" in notes[0]
    assert json.loads(captured.out.splitlines()[0])["step"] == 0  # stdout stays JSON


def test_the_padded_fraction_of_each_step_as_the_layout_runs_it(skewed_mixture, capsys):
    """`omni data plan` reports the share of the LLM rows that would be padding (parallel.rows:
    the trainer's padded_fraction in metrics.jsonl, the simulator's per placement)."""
    base = [f"data.mixture={skewed_mixture}", "data.micro_batch_tokens=4096", "data.global_batch_size=256"]
    out = io.StringIO()
    plan_main(base, dp=16, steps=2, as_json=True, out=out)
    assert [json.loads(line)["padded_fraction"] for line in out.getvalue().splitlines()] == [0.0, 0.0]  # rows as they are
    out = io.StringIO()
    plan_main([*base, "parallel.pp=2", "parallel.tp=2"], dp=16, steps=2, as_json=True, out=out)
    piped = [json.loads(line)["padded_fraction"] for line in out.getvalue().splitlines()]
    assert all(0 < p < 0.05 for p in piped), piped  # rows rounded up to 16 tokens, empty ones 16
    assert main(["data", "plan", *base, "parallel.pp=2", "parallel.tp=2", "--dp", "16", "--steps", "2"]) == 0
    table = capsys.readouterr().out
    assert "| padded % |" in table and "tp=2 x pp=2" in table and "padded rows" in table
