"""A third-party encoder package (tests/plugin_pkg) installs and trains with no change to Omni."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLUGIN = Path(__file__).resolve().parent / "plugin_pkg"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    # Install a copy so the build never writes into the source tree.
    src = build / "plugin_pkg"
    subprocess.run(["cp", "-r", str(PLUGIN), str(src)], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(src)],
        check=True, timeout=300,
    )
    return site


def _omni(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "recipes.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_plugin_is_listed_with_its_package(plugin_site, tmp_path):
    out = _omni(["plugins"], plugin_site, tmp_path)
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if "toy_patch" in l)
    assert "omni-toy-plugin" in line
    assert any("siglip" in l and "built-in" in l for l in out.stdout.splitlines())


@pytest.mark.parametrize("how", ["entry_point", "target"])
def test_plugin_trains(plugin_site, demo_root, tmp_path, how):
    mixture = tmp_path / "images.yaml"
    mixture.write_text(f"sources:\n  - {{name: shapes, path: {demo_root / 'shapes'}, weight: 1.0}}\n")
    pick = ("encoders.vision.name=toy_patch" if how == "entry_point"
            else "encoders.vision._target_=omni_toy_plugin.ToyPatchEncoder")
    run_dir = tmp_path / "run"
    out = _omni(["train", "encoders=vision_only", "encoders/vision=siglip", pick,
                 f"data.mixture={mixture}", "data.global_batch_size=4", "trainer.max_steps=2",
                 "trainer.eval_at_end=false", "trainer.progress=false", f"trainer.run_dir={run_dir}"],
                plugin_site, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    # The toy encoder's parameters are really in the trained model's checkpoint.
    meta = (run_dir / "checkpoints" / "step_00000002" / ".metadata").read_bytes()
    assert b"encoders.image.mlp" in meta
