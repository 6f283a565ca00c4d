"""Checkpoints: model + optimizer through torch.distributed.checkpoint (sharded, layout-free),
plus the scheduler, the data-loader state, the step and each rank's RNG.

Crash safety: every rank writes into ``.tmp-step_N``; once all have, rank 0 writes the
manifest (size and SHA-256 of every file, ``checkpoint_manifest``), flushes the folder to disk
and renames it to ``step_N`` in one atomic step. A folder named ``step_N`` is therefore always
complete; a run killed mid-save leaves only a ``.tmp-`` folder, which the next save clears.
``resume=auto`` also re-checks the newest folders against their manifests and skips, with a
message, one that was damaged afterwards (a truncated or corrupted file).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from omni.errors import ConfigError
from omni.runtime.checkpoint_manifest import fsync_dir, fsync_tree, verify, write_manifest
from omni.runtime.config import CheckpointConfig
from omni.runtime.optim import PartOptimizers
from parallel.layout import barrier

MARKER = "COMPLETE"
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
PREFIX = "step_"
TMP = ".tmp-"  # a checkpoint being written


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Restored:
    step: int
    loader_state: dict
    path: Path


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, rank: int = 0):
        self.cfg = cfg
        self.root = Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"
        self.rank = rank

    # -- discovery -------------------------------------------------------------------------
    def completed(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        done = [p for p in self.root.glob(f"{PREFIX}*") if (p / MARKER).exists()]
        return sorted(done, key=lambda p: int(p.name[len(PREFIX):]))

    def resume_path(self) -> Path | None:
        """What `checkpoint.resume` points at: None (start fresh) or a completed checkpoint."""
        choice = self.cfg.resume
        if choice == "never":
            return None
        if choice == "auto":
            for path in reversed(self.completed()):
                problem = _check(path)
                if problem is None:
                    return path
                if self.rank == 0:
                    print(f"omni: checkpoint {path} is damaged ({problem}); skipping it for an older one",
                          file=sys.stderr, flush=True)
            return None
        path = Path(choice)
        if not (path / MARKER).exists():
            raise ConfigError(
                f"checkpoint.resume={choice} is not a completed checkpoint folder (no {MARKER} file); "
                f"use checkpoint.resume=auto to pick the latest under {self.root}"
            )
        problem = _check(path)
        if problem is not None:
            raise ConfigError(f"checkpoint.resume={choice} is damaged ({problem}); use checkpoint.resume=auto "
                              f"to take the newest intact one under {self.root}")
        return path

    # -- save / load ---------------------------------------------------------------------------
    def save(self, step: int, optim: PartOptimizers, loader_state: dict) -> Path:
        """Every rank writes its shards (DCP); names are the unsplit model's, so the folder loads
        under any layout."""
        final = self.root / f"{PREFIX}{step:08d}"
        path = self.root / f"{TMP}{PREFIX}{step:08d}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"{TMP}*"):  # what an interrupted save left
                shutil.rmtree(stale, ignore_errors=True)
        barrier()
        dcp.save(_merged_state(optim), checkpoint_id=str(path))
        torch.save(rng_state(), path / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            torch.save(
                {"step": step, "scheduler": optim.scheduler_state(), "loader": loader_state},
                path / "trainer_state.pt",
            )
        barrier()
        if self.rank == 0:
            (path / MARKER).write_text(json.dumps({"step": step}))
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            write_manifest(path, {"step": step, "world_size": world})
            fsync_tree(path)
            if final.exists():  # the same step saved again (e.g. a re-run): the new one wins
                shutil.rmtree(final)
            os.rename(path, final)
            fsync_dir(self.root)
            self._prune()
        barrier()
        return final

    def load(self, path: Path, optim: PartOptimizers) -> Restored:
        state = _merged_state(optim)
        dcp.load(state, checkpoint_id=str(path))
        for part, opt in zip(optim.parts, optim.optimizers):
            set_state_dict(part, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=StateDictOptions(strict=False, flatten_optimizer_state_dict=True))
        extra = torch.load(path / "trainer_state.pt", weights_only=False)
        optim.load_scheduler_state(extra["scheduler"])
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.exists():  # absent when resuming on more ranks than were saved
            set_rng_state(torch.load(rng_file, weights_only=False))
        return Restored(step=int(extra["step"]), loader_state=extra["loader"], path=path)

    def _prune(self) -> None:
        if self.cfg.keep_last <= 0:
            return
        for old in self.completed()[: -self.cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def _check(path: Path) -> str | None:
    """Why ``path`` cannot be resumed from, or None. Folders saved before manifests existed
    (a COMPLETE marker, no manifest) are trusted as before."""
    if not (path / "manifest.json").exists():
        return None if (path / MARKER).exists() else "not complete"
    return verify(path)


def _merged_state(optim: PartOptimizers) -> dict:
    """Model and optimizer state of every part this rank holds, under the unsplit model's names."""
    model_sd, optim_sd = {}, {}
    for part, opt in zip(optim.parts, optim.optimizers):
        # Flattened optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): the parts'
        # dicts have disjoint keys and simply merge.
        m, o = get_state_dict(part, opt, options=FLAT)
        model_sd.update(m)
        optim_sd.update(o)
    return {"model": model_sd, "optim": optim_sd}
