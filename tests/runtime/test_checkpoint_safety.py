"""Crash-safe checkpoints: a folder named step_N is complete (written under .tmp-, manifest of
sizes and checksums, renamed atomically), an interrupted save leaves nothing resume would
take, and resume=auto skips a checkpoint damaged afterwards, with a message, for an older one."""
import json

import pytest

from omni.errors import ConfigError
from omni.runtime.checkpoint import Checkpointer
from omni.runtime.checkpoint_manifest import MANIFEST, verify
from omni.runtime.config import CheckpointConfig
from recipe_helpers import read_metrics, tiny_overrides, train


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_or_interrupted_checkpoints_are_never_resumed(demo_root, tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(tiny_overrides(demo_root, run_dir, **{"checkpoint.every": 2, "trainer.max_steps": 4,
                                                "checkpoint.keep_last": 0}))
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]  # no .tmp- left
    for step in (2, 4):
        folder = root / f"step_{step:08d}"
        manifest = json.loads((folder / MANIFEST).read_text())
        assert manifest["step"] == step and manifest["world_size"] == 1
        on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST}
        assert set(manifest["files"]) == on_disk and any(f.endswith(".distcp") for f in on_disk)
        assert verify(folder) is None

    # Damage the newest after the fact: resume=auto takes the older one and says why.
    latest = root / "step_00000004"
    shard = next(p for p in sorted(latest.iterdir()) if p.suffix == ".distcp")
    _flip_a_byte(shard)
    assert "does not match its checksum" in verify(latest)
    ckpt = Checkpointer(CheckpointConfig(resume="auto"), run_dir)
    assert ckpt.resume_path() == root / "step_00000002"
    assert "step_00000004 is damaged" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="is damaged"):  # named explicitly: refused, not loaded
        Checkpointer(CheckpointConfig(resume=str(latest)), run_dir).resume_path()

    # A save killed midway leaves a .tmp- folder: never resumed, cleared by the next save.
    stale = root / ".tmp-step_00000006"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half")
    assert ckpt.resume_path() == root / "step_00000002"

    # Training resumes from step 2, redoes steps 3-4, and writes an intact step 4 again.
    (run_dir / "metrics.jsonl").unlink()
    train(tiny_overrides(demo_root, run_dir, **{"checkpoint.every": 2, "trainer.max_steps": 4,
                                                "checkpoint.resume": "auto", "checkpoint.keep_last": 0}))
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [3, 4]
    assert not stale.exists() and verify(latest) is None


class _RunsCode:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_would_run_code_is_refused_unopened(demo_root, tmp_path):
    import torch

    from omni.runtime.checkpoint_manifest import write_manifest

    run_dir = tmp_path / "run"
    over = tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 2})
    train(over)
    folder = run_dir / "checkpoints" / "step_00000002"
    state = torch.load(folder / "trainer_state.pt", weights_only=True)  # what Omni writes loads safely
    marker = tmp_path / "pwned"
    state["loader"]["payload"] = _RunsCode(marker)
    torch.save(state, folder / "trainer_state.pt")
    write_manifest(folder, json.loads((folder / MANIFEST).read_text()))  # even with a matching manifest
    with pytest.raises(ConfigError, match="trainer_state.pt holds pickled objects beyond tensors"):
        train(tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 3}))
    assert not marker.exists()
