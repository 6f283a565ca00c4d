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
