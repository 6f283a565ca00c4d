"""Asynchronous saves: save() returns once the state is copied to host memory, while the shards
are still being written; the folder appears only when the writer is done, and holds the state
of the moment of the save even if training changed the weights meanwhile."""
from __future__ import annotations

import threading

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from omni.runtime.checkpoint import Checkpointer
from omni.runtime.checkpoint_manifest import verify
from omni.runtime.config import CheckpointConfig, OptimConfig
from omni.runtime.optim import PartOptimizers
from parallel.config import ParallelConfig
from parallel.layout import init_layout, shutdown


def _model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = PartOptimizers([model], OptimConfig(warmup_steps=1), total_steps=10)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()  # optimizer moments exist
    optim.zero_grad()
    return model, optim


def test_async_save_blocks_only_for_the_copy_and_publishes_when_written(tmp_path, monkeypatch):
    release = threading.Event()
    writing = threading.Event()
    write_data = FileSystemWriter.write_data

    def held(self, plan, planner):
        writing.set()
        assert release.wait(60), "the test never released the writer"
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held)
    init_layout(ParallelConfig(), device="cpu")
    try:
        model, optim = _model_and_optim(0)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt = Checkpointer(CheckpointConfig(async_save=True), tmp_path, rank=0, layout={"dp_shard": 1})
        final = ckpt.save(3, optim, {"planner": {"step": 3}}, {"skipped": 0})
        # save() came back while the writer is held: nothing visible yet.
        assert writing.wait(30) and ckpt.pending
        assert not final.exists() and (tmp_path / "checkpoints" / ".tmp-step_00000003").is_dir()
        with torch.no_grad():  # training goes on and changes the weights in place
            for p in model.parameters():
                p.add_(1.0)
        release.set()
        ckpt.close()
        assert not ckpt.pending and final.is_dir() and verify(final) is None

        fresh, fresh_optim = _model_and_optim(1)
        restored = Checkpointer(CheckpointConfig(resume="auto"), tmp_path).load(final, fresh_optim)
        assert restored.step == 3 and restored.loader_state == {"planner": {"step": 3}}
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, saved[k]), k  # the moment of the save, not the later weights
    finally:
        release.set()
        shutdown()


def test_async_folder_appears_without_a_later_save(tmp_path):
    """The writer publishes on its own: no next save or wait() is needed for the folder to appear."""
    init_layout(ParallelConfig(), device="cpu")
    try:
        _, optim = _model_and_optim(0)
        ckpt = Checkpointer(CheckpointConfig(async_save=True), tmp_path, rank=0)
        final = ckpt.save(1, optim, {})
        for _ in range(600):
            if final.is_dir() and not ckpt.pending:
                break
            threading.Event().wait(0.05)
        assert final.is_dir() and verify(final) is None
        ckpt.close()
    finally:
        shutdown()
