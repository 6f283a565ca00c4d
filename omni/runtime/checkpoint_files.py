"""A checkpoint folder's plain files and its single-process reader: the folder names and marker,
every generator's state as tensors and plain values, the small files loaded without unpickling
objects, and ``load_model_weights`` (one process reads the model of a folder saved under any
layout: ``omni export``, ``omni generate``). The distributed save and resume are
``omni.runtime.checkpoint``."""
from __future__ import annotations

import contextlib
import pickle
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from omni.errors import ConfigError
from omni.models.materialize import SeededInit, Sources, WeightSource, materialize
from omni.runtime.checkpoint_manifest import read_manifest
from omni.runtime.model_fingerprint import describe, fingerprint, local_entries

MARKER = "COMPLETE"
PREFIX = "step_"
TMP = ".tmp-"  # a checkpoint being written
TRAINER_STATE = "trainer_state.pt"


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values (loadable with weights_only)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "gauss": float(gauss)}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_plain(path: Path) -> Any:
    """A small checkpoint file (trainer state, RNG): tensors and plain values only. A file that
    needs more (arbitrary pickled objects, which could run code) is refused, not loaded."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path} holds pickled objects beyond tensors and plain values, which Omni never writes; "
                          f"refusing to load it ({first}); resume from a checkpoint this run wrote, or "
                          "checkpoint.resume=never to start fresh") from None


def completed_checkpoints(root: Path) -> list[Path]:
    """The completed checkpoint folders under ``root`` (``step_N`` with its marker), oldest first."""
    if not root.is_dir():
        return []
    done = [p for p in root.glob(f"{PREFIX}*") if (p / MARKER).exists()]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX):]))


@contextlib.contextmanager
def single_process_quietly():
    """DCP warns on every ``no_dist`` call that it assumes one process: here that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class _FilledByCheckpoint(WeightSource):
    """Storage only, for the tensors a checkpoint holds (DCP writes them next)."""

    def __init__(self, names: set[str]):
        self.names = names

    def has(self, name: str) -> bool:
        return name in self.names

    def read(self, name, model, shape, index):
        return torch.empty([len(range(*s.indices(n))) for s, n in zip(index, shape)])


def load_model_weights(model: nn.Module, path: str | Path) -> None:
    """The model weights of the checkpoint folder ``path`` (saved under any layout) into
    ``model``, the whole model built on the meta device, in this one process: what ``omni
    export`` and ``omni generate`` read. Refused in one line, before any weight is read, when
    the checkpoint holds another model; tensors no checkpoint holds (computed buffers such as
    the rotary frequencies) come from the model's own rules."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise ConfigError(f"{path} is not a completed checkpoint folder (no {MARKER} file)")
    manifest, _ = read_manifest(path)
    saved = (manifest or {}).get("model")
    here = fingerprint(local_entries([model]))
    if isinstance(saved, dict) and saved.get("sha256") != here["sha256"]:
        raise ConfigError(f"checkpoint {path} holds another model ({describe(saved)}) than its run's config "
                          f"builds ({describe(here)})")
    with single_process_quietly():
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    held = {k[len("model."):] for k in keys if k.startswith("model.")}
    wanted = set(model.state_dict())
    if wanted - held:
        missing = sorted(wanted - held)
        raise ConfigError(f"checkpoint {path} lacks {len(missing)} of the model's tensors (first: {missing[0]})")
    materialize([model], Sources([("", _FilledByCheckpoint(held))], SeededInit(0)), torch.device("cpu"))
    with single_process_quietly():
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
