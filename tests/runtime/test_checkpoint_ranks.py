"""Checkpoint hashing and verification on 2 gloo ranks: each rank hashes the files it wrote (in
parallel, outside any barrier) and the manifest rank 0 writes equals hashing every file
serially; on resume each rank checks only its share and a damaged file in the other rank's
share still makes both skip the folder. The model fingerprint is the same on every layout."""
from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
from dist_helpers import run_ranks  # noqa: E402

from omni.runtime.checkpoint_manifest import MANIFEST, share  # noqa: E402


def _recording(record: list, fn):
    def wrapped(folder, names):
        names = list(names)
        record.extend(names)
        return fn(folder, names)
    return wrapped


def _save_and_resume(rank, world, run_dir, async_save):
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from omni.runtime import checkpoint as ckpt_mod
    from omni.runtime import checkpoint_manifest as manifest_mod
    from omni.runtime.config import CheckpointConfig, OptimConfig
    from omni.runtime.optim import PartOptimizers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))  # every rank writes shards of its own
    optim = PartOptimizers([model], OptimConfig(warmup_steps=1), total_steps=10)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    record = {"own": [], "leftover": []}
    ckpt_mod.seal = _recording(record["own"], ckpt_mod.seal)  # what each rank hashes itself
    manifest_mod.seal = _recording(record["leftover"], manifest_mod.seal)  # rank 0's sweep of the rest
    cfg = CheckpointConfig(async_save=async_save, keep_last=0)
    ckpt = ckpt_mod.Checkpointer(cfg, run_dir, rank=rank, layout={"dp_shard": world}, timeout=timedelta(seconds=60))
    for step in (1, 2):
        ckpt.save(step, optim, {"planner": {"step": step}})
    ckpt.close()
    record["fingerprint"] = ckpt.model_fingerprint([model])

    # Damage one file of step 2 that rank 1 checks (rank 0 never reads it).
    newest = ckpt.root / "step_00000002"
    if rank == 0:
        files = json.loads((newest / MANIFEST).read_text())["files"]
        victim = newest / share(files, 1, world)[0]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    hashed = record["verified"] = []
    real_sha = manifest_mod.sha256
    manifest_mod.sha256 = lambda p: hashed.append(str(p.relative_to(p.parent.parent))) or real_sha(p)
    resumed = ckpt_mod.Checkpointer(CheckpointConfig(resume="auto"), run_dir, rank=rank).resume_path([model])
    record["resumed"] = resumed.name
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def _serial(folder):
    """Every file's size and SHA-256, hashed here in one process."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[str(p.relative_to(folder))] = {"bytes": p.stat().st_size,
                                               "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    return out


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_each_rank_hashes_its_files_and_checks_its_share(tmp_path, async_save):
    run_ranks(_save_and_resume, 2, str(tmp_path), async_save, timeout_s=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    folder = tmp_path / "checkpoints" / "step_00000001"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["world_size"] == 2
    assert manifest["files"] == _serial(folder)  # parallel hashing == serial hashing
    # Rank 1 hashed its own shard and RNG state, twice (two saves); rank 0 never re-read them.
    assert sorted(set(ranks[1]["own"])) == ["__1_0.distcp", "rng_rank1.pt"]
    assert not {"__1_0.distcp", "rng_rank1.pt"} & set(ranks[0]["own"] + ranks[0]["leftover"])
    assert set(ranks[0]["leftover"]) == {"COMPLETE"} and ranks[1]["leftover"] == []
    assert ranks[0]["fingerprint"] == ranks[1]["fingerprint"]
    # Resume: step 2 is damaged in rank 1's share; both ranks fall back to step 1, whose files
    # the two ranks checked between them, each file once.
    assert [r["resumed"] for r in ranks] == ["step_00000001", "step_00000001"]
    step1 = [sorted(f.split("/", 1)[1] for f in r["verified"] if f.startswith("step_00000001/")) for r in ranks]
    assert sorted(step1[0] + step1[1]) == sorted(manifest["files"]) and not set(step1[0]) & set(step1[1])
    assert all(step1)


def _fingerprints(rank, world, out_dir):
    from layout_harness import build

    from omni.runtime.checkpoint import Checkpointer
    from omni.runtime.config import CheckpointConfig
    from omni.step.config import MultiplexConfig
    from omni.runtime.parallelize import parallelize
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    out = {}
    for name, sizes, weights in (("pp2", {"pp": 2}, "replicated"), ("tp2", {"tp": 2}, "replicated"),
                                 ("dp_shard2", {"dp_shard": 2}, "sharded")):
        layout = init_layout(ParallelConfig(**sizes), device="cpu")
        pm = parallelize(build(False, 4, ("image", "audio")), layout, MultiplexConfig(encoder_weights=weights))
        out[name] = Checkpointer(CheckpointConfig(), out_dir, rank=rank).model_fingerprint(pm.parts)
    with open(os.path.join(out_dir, f"fp{rank}.json"), "w") as f:
        json.dump(out, f)


def test_the_model_fingerprint_is_the_same_on_every_layout(tmp_path):
    """Pipeline stages hold some layers, TP and FSDP hold slices (DTensors): the fingerprint is
    still the full, unsplit model's."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
    from layout_harness import build

    from omni.runtime.model_fingerprint import fingerprint, local_entries

    run_ranks(_fingerprints, 2, str(tmp_path), timeout_s=180)
    full = json.loads(json.dumps(fingerprint(local_entries([build(False, 4, ("image", "audio"))]))))
    assert full["summary"]["layers"] == 4 and full["summary"]["encoders"] == ["audio", "image"]
    for rank in range(2):
        got = json.loads((tmp_path / f"fp{rank}.json").read_text())
        assert got == {"pp2": full, "tp2": full, "dp_shard2": full}, rank
