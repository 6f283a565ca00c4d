"""checkpoint.verify on resume (full / size / none), the split of the files over ranks, and the
model fingerprint that refuses a checkpoint of another model before any weight is read."""
from __future__ import annotations

import json

import pytest
import torch

from omni.errors import ConfigError
from omni.runtime import checkpoint as checkpoint_mod
from omni.runtime.checkpoint import Checkpointer
from omni.runtime.checkpoint_manifest import MANIFEST, share, verify
from omni.runtime.config import CheckpointConfig, OptimConfig
from omni.runtime.model_fingerprint import describe, fingerprint, local_entries
from omni.runtime.optim import PartOptimizers


def _optim(width: int = 16, seed: int = 0) -> PartOptimizers:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    return PartOptimizers([model], OptimConfig(warmup_steps=1), total_steps=10)


@pytest.fixture
def two_checkpoints(tmp_path):
    """Folders for steps 1 and 2 of a small model, and the newest one's largest shard."""
    ckpt = Checkpointer(CheckpointConfig(keep_last=0), tmp_path)
    optim = _optim()
    for step in (1, 2):
        ckpt.save(step, optim, {"planner": {"step": step}})
    ckpt.close()
    root = tmp_path / "checkpoints"
    newest = root / "step_00000002"
    shard = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    return tmp_path, root / "step_00000001", newest, shard


def _resume(run_dir, mode, resume="auto"):
    return Checkpointer(CheckpointConfig(resume=resume, verify=mode), run_dir).resume_path(_optim().parts)


def test_a_truncated_file_is_caught_by_size_and_full_not_checked_by_none(two_checkpoints, capsys):
    run_dir, older, newest, shard = two_checkpoints
    shard.write_bytes(shard.read_bytes()[:-10])
    for mode in ("size", "full"):
        assert "bytes, the manifest says" in verify(newest, mode)
        assert _resume(run_dir, mode) == older
        assert f"{newest} is damaged ({shard.name} has" in capsys.readouterr().err
        with pytest.raises(ConfigError, match="is damaged"):  # named explicitly: refused
            _resume(run_dir, mode, resume=str(newest))
    assert verify(newest, "none") is None
    assert _resume(run_dir, "none") == newest  # trusts the manifest's presence


def test_a_same_size_corruption_is_caught_by_full_only(two_checkpoints):
    run_dir, older, newest, shard = two_checkpoints
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "does not match its checksum" in verify(newest, "full")
    assert _resume(run_dir, "full") == older
    assert verify(newest, "size") is None and _resume(run_dir, "size") == newest
    assert _resume(run_dir, "none") == newest


def test_none_still_needs_a_complete_folder(two_checkpoints):
    """`none` skips reading the files, not the manifest: a folder whose manifest cannot be read
    is still skipped for an older one."""
    run_dir, older, newest, _ = two_checkpoints
    (newest / MANIFEST).write_text("{not json")
    assert verify(newest, "none") == f"{MANIFEST} is unreadable"
    assert _resume(run_dir, "none") == older


def test_the_files_are_split_over_ranks_by_bytes():
    files = {f"f{i}": {"bytes": b, "sha256": ""} for i, b in enumerate([100, 90, 50, 40, 30, 5, 5, 1])}
    for world in (1, 2, 3, 8, 11):
        shares = [share(files, r, world) for r in range(world)]
        flat = [f for s in shares for f in s]
        assert sorted(flat) == sorted(files) and len(flat) == len(set(flat))  # each file exactly once
    loads = [sum(files[f]["bytes"] for f in share(files, r, 2)) for r in range(2)]
    # Largest first, each to the least loaded rank: 100 | 90, 50 | 40, 30 | 5, 5, 1.
    assert loads == [170, 151]


def test_a_checkpoint_of_another_model_is_refused_before_any_read(tmp_path, monkeypatch):
    ckpt = Checkpointer(CheckpointConfig(), tmp_path)
    final = ckpt.save(2, _optim(16), {})
    manifest = json.loads((final / MANIFEST).read_text())
    assert manifest["model"]["summary"]["parameters"] == 8 * 16 + 16 + 16 * 4 + 4

    def no_read(*a, **k):
        raise AssertionError("DCP read a checkpoint of another model")

    monkeypatch.setattr(checkpoint_mod.dcp, "load", no_read)
    monkeypatch.setattr(checkpoint_mod, "verify", no_read)  # refused before the files are checked, too
    for resume in ("auto", str(final)):
        other = Checkpointer(CheckpointConfig(resume=resume), tmp_path)
        with pytest.raises(ConfigError) as err:
            other.resume_path(_optim(32).parts)
        line = str(err.value)
        assert "\n" not in line and str(final) in line
        assert "holds another model (212 parameters: 0 layers, no encoders, float32)" in line
        assert "than the config builds (420 parameters" in line
        assert "checkpoint.resume=never" in line and "trainer.run_dir" in line
    with pytest.raises(ConfigError, match="holds another model"):  # load() itself checks too
        Checkpointer(CheckpointConfig(), tmp_path).load(final, _optim(32))


def test_a_checkpoint_without_a_fingerprint_still_loads(tmp_path):
    """Saved before fingerprints existed: resumed as before."""
    optim = _optim(16)
    final = Checkpointer(CheckpointConfig(), tmp_path).save(3, optim, {"planner": {"step": 3}})
    manifest = json.loads((final / MANIFEST).read_text())
    del manifest["model"]
    (final / MANIFEST).write_text(json.dumps(manifest))
    ckpt = Checkpointer(CheckpointConfig(resume="auto"), tmp_path)
    fresh = _optim(16, seed=1)
    assert ckpt.resume_path(fresh.parts) == final
    assert ckpt.load(final, fresh).step == 3
    for a, b in zip(fresh.parts[0].parameters(), optim.parts[0].parameters()):
        assert torch.equal(a, b)


def test_the_fingerprint_reads_names_shapes_and_dtypes_only():
    """Built on the meta device (no values) it equals the materialised model's; any change of
    a name, a shape or a dtype changes it."""
    from omegaconf import OmegaConf

    from omni.models.build import build_model
    from recipes.compose import compose_config

    cfg = OmegaConf.to_object(compose_config([]))
    torch.manual_seed(0)
    real = fingerprint(local_entries([build_model(cfg.model, cfg.encoders, vocab_needed=272)]))
    with torch.device("meta"):
        meta = fingerprint(local_entries([build_model(cfg.model, cfg.encoders, vocab_needed=272)]))
    assert meta == real
    s = real["summary"]
    assert (s["vocab"], s["hidden"], s["layers"], s["encoders"], s["dtypes"]) == (272, 128, 4, ["audio", "image"],
                                                                                 ["float32"])
    assert describe(real).startswith(f"{s['parameters'] / 1e6:.2f}M parameters: vocab 272, hidden 128, 4 layers")

    base = {"a.weight": ([4, 3], "float32"), "b.weight": ([3], "float32")}
    digest = fingerprint(base)["sha256"]
    assert fingerprint(dict(reversed(base.items())))["sha256"] == digest  # order does not matter
    for changed in ({"a.weight": ([3, 4], "float32"), "b.weight": ([3], "float32")},
                    {"a.weight": ([4, 3], "bfloat16"), "b.weight": ([3], "float32")},
                    {"a.weight": ([4, 3], "float32"), "c.weight": ([3], "float32")}):
        assert fingerprint(changed)["sha256"] != digest
