"""The `omni` command line: help texts, --cfg job, data demo/index, plugins."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from recipes.cli import main


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["data", "--help"], ["data", "demo", "--help"],
                                  ["data", "index", "--help"], ["plugins", "--help"]])
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: omni" in out


def test_train_help_lists_groups_and_options(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for needle in ("experiment", "demo_moe", "tiny_moe", "trainer.max_steps"):
        assert needle in out


def test_cfg_job_prints_composed_config(capsys):
    assert main(["train", "--cfg", "job", "experiment=demo_moe", "trainer.max_steps=7"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["name"] == "demo_moe" and cfg["model"]["num_experts"] == 4
    assert cfg["trainer"]["max_steps"] == 7 and cfg["trainer"]["run_dir"] == "runs/demo_moe"
    assert set(cfg["encoders"]) == {"vision", "audio"}


def test_required_keys_exist(capsys):
    overrides = ["trainer.max_steps=3", "trainer.run_dir=/tmp/x", "trainer.seed=5", "checkpoint.every=2",
                 "checkpoint.resume=never", "data.mixture=/m.yaml", "data.global_batch_size=8",
                 "data.micro_batch_tokens=512"]
    assert main(["train", "--cfg", "job", *overrides]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["checkpoint"]["resume"] == "never" and cfg["data"]["micro_batch_tokens"] == 512


def test_data_demo_and_index(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["data", "demo", "--out", str(out), "--scale", "0.02"]) == 0
    mixture = yaml.safe_load((out / "mixture.yaml").read_text())
    assert [s["name"] for s in mixture["sources"]] == ["shapes", "tones", "text"]
    index = out / "shapes" / "omni_index.jsonl"
    first = index.read_text()
    index.unlink()
    assert main(["data", "index", str(out / "shapes"), "--workers", "2"]) == 0
    assert index.read_text().splitlines()[1:] == first.splitlines()[1:]


def test_plugins_lists_builtins(capsys):
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(l.split()[:2] == ["encoder", "siglip"] for l in lines)
    assert any(l.split()[:2] == ["encoder", "whisper"] for l in lines)


def test_console_script_module_entry():
    out = subprocess.run([sys.executable, "-m", "recipes.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "train" in out.stdout


def test_train_help_lists_the_encoder_presets(capsys):
    # Nested groups (one per encoder slot) were missing from the list (issue 17).
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    lines = capsys.readouterr().out.splitlines()
    vision = next(l for l in lines if l.split()[:1] == ["encoders/vision"])
    audio = next(l for l in lines if l.split()[:1] == ["encoders/audio"])
    assert {"siglip", "siglip_demo", "vit_1b"} <= set(vision.replace(",", " ").split()[1:])
    assert {"whisper", "whisper_demo"} <= set(audio.replace(",", " ").split()[1:])


@pytest.mark.parametrize("value,reads", [("true", True), ("false", False), ("True", True), ("auto", True)])
def test_reshard_after_forward_true_false_auto_from_the_command_line(value, reads):
    """`parallel.reshard_after_forward=true` was refused ("True is not one of auto, true, false"):
    Hydra and YAML turn true into a bool before the string field sees it."""
    import torch
    from omegaconf import OmegaConf

    from omni.runtime.parallelize import _reshard_after_forward
    from parallel.layout import Layout, Sizes, check_options
    from recipes.compose import compose_config

    cfg = OmegaConf.to_object(compose_config([f"parallel.reshard_after_forward={value}"]))
    check_options(cfg.parallel)
    layout = Layout(world_size=1, rank=0, device=torch.device("cpu"), sizes=Sizes(), config=cfg.parallel)
    assert _reshard_after_forward(layout) is reads


def test_reshard_after_forward_from_yaml():
    from omegaconf import OmegaConf

    from parallel.config import ParallelConfig
    from parallel.layout import check_options

    for text in ("reshard_after_forward: true", "reshard_after_forward: false", "reshard_after_forward: auto"):
        check_options(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ParallelConfig),
                                                          yaml.safe_load(text))))


# ---- run names: runs/<experiment name>, the name saying what runs (issue 17) ------------------

def _named(overrides):
    from recipes.compose import compose_config

    cfg = compose_config(overrides)
    return cfg.name, cfg.trainer.run_dir


def test_the_preset_names_the_run_while_its_model_and_data_are_used():
    assert _named([]) == ("demo", "runs/demo")
    assert _named(["experiment=demo_moe"]) == ("demo_moe", "runs/demo_moe")
    # How it trains does not change what it trains.
    assert _named(["trainer.max_steps=5", "optim.lr=1e-3", "parallel.dp_shard=1", "model.attn_backend=sdpa"]) == \
        ("demo", "runs/demo")


def test_another_model_or_data_gets_its_own_run_dir(tmp_path):
    moe, moe_dir = _named(["model=tiny_moe"])
    assert moe.startswith("tiny_moe-") and moe_dir == f"runs/{moe}"
    assert _named(["model=tiny_moe"])[0] == moe  # the same experiment again finds its own folder
    deeper = _named(["model.num_layers=2"])[0]
    vision = _named(["encoders=vision_only"])[0]
    mixture = _named([f"data.mixture={tmp_path / 'mix.yaml'}"])[0]
    assert deeper.startswith("tiny-") and vision.startswith("tiny-") and mixture.startswith("tiny-")
    assert len({"demo", moe, deeper, vision, mixture}) == 5
    # An explicit name or run dir wins.
    assert _named(["model=tiny_moe", "name=mine"]) == ("mine", "runs/mine")
    assert _named(["model=tiny_moe", "trainer.run_dir=/tmp/x"])[1] == "/tmp/x"


def test_a_pretrained_model_names_the_run_after_its_folder(tmp_path):
    ckpt = tmp_path / "my_llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama", "vocab_size": 300, "hidden_size": 64, '
                                      '"intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, '
                                      '"num_key_value_heads": 2}')
    name, run_dir = _named([f"model.pretrained={ckpt}"])
    assert name.startswith("my_llama-") and run_dir == f"runs/{name}"
