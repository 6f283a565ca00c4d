"""Checkpoints: model + optimizer through torch.distributed.checkpoint (sharded, layout-free),
plus the scheduler, the data-loader state, the step and each rank's RNG.

Crash safety: every rank writes into ``.tmp-step_N``, then hashes and flushes the files it
wrote (in parallel, no barrier around it); the small results reach rank 0 over gloo, which
writes the manifest (size and SHA-256 of every file, ``checkpoint_manifest``), flushes it and
renames the folder to ``step_N`` in one atomic step. A folder named ``step_N`` is therefore
always complete; a run killed mid-save leaves only a ``.tmp-`` folder, which the next save
clears. On resume (``checkpoint.verify``) each rank re-checks its share of the files against
the manifest; ``resume=auto`` skips, with a message, a folder damaged after its save.

Which model: the manifest holds the model's fingerprint (``model_fingerprint``); a checkpoint
of another model is refused in one line before any weight is read, also under ``resume=auto``
(it is not damaged: the run dir belongs to another model).

Asynchronous saves (``checkpoint.async_save``): the step blocks only while DCP copies the
state to host memory; a background thread writes the shards over a process group of its own
(the training loop keeps using the others). Every rank's DCP save returns once all shards and
DCP's metadata are written; the same thread then hashes the rank's files, and on rank 0
writes the manifest and renames. The next save, and the end of training, wait for it.

Loading never unpickles arbitrary objects: the small files (trainer state, RNG) hold only
tensors and plain Python values and load with ``weights_only=True``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from omni.errors import ConfigError
from omni.models import lora
from omni.runtime.checkpoint_files import (MARKER, PREFIX, TMP, TRAINER_STATE, completed_checkpoints, load_plain,
                                          rng_state, set_rng_state, single_process_quietly)
from omni.runtime.checkpoint_manifest import MANIFEST, fsync_dir, read_manifest, seal, verify, write_manifest
from omni.runtime.config import CheckpointConfig
from omni.runtime.model_fingerprint import describe, fingerprint, local_entries, merge
from omni.runtime.optim import PartOptimizers
from parallel.layout import barrier, new_group

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class Restored:
    step: int
    loader_state: dict
    path: Path
    trainer: dict  # the trainer's own counters (skipped steps, ...)


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, rank: int = 0, layout: dict | None = None,
                 timeout=None):
        """``layout``: the sizes recorded in each manifest. ``timeout``: the collective timeout
        of the asynchronous writer's own process group."""
        self.cfg = cfg
        self.root = Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"
        self.rank = rank
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # One process: DCP without its planning collectives. Through a one-rank gloo group they
        # copy the gathered plans on gloo's own thread; an OpenMP team started there stays, the
        # process then holds more OpenMP threads than cores, and libgomp stops spinning at its
        # barriers for good: every later training step took about twice as long (0.25 s ->
        # 0.47 s per demo step after the first save, scripts/bench/checkpoint_slowdown.py).
        self._no_dist = self.world == 1
        self.layout = dict(layout or {})
        self.last_block_s = 0.0  # how long the latest save held the training loop
        self._pending: Future | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._fingerprint: dict | None = None
        # The group for host objects (hash results, verdicts, the model's parameter list) and
        # the background writer: gloo, so they never go through the accelerator. None: the
        # default group (already gloo, and no background writer whose collectives could
        # interleave with the training loop's). The training thread uses the writer's group
        # only while no save is in flight: resume comes before any save, and save() waits first.
        self._group = None
        if cfg.async_save:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-checkpoint")
        if self.world > 1 and (cfg.async_save or dist.get_backend() != "gloo"):
            self._group = new_group(None, timeout, backend="gloo")

    # -- discovery -------------------------------------------------------------------------
    def completed(self) -> list[Path]:
        return completed_checkpoints(self.root)

    def resume_path(self, parts: list[nn.Module] | None = None) -> Path | None:
        """What `checkpoint.resume` points at: None (start fresh) or a completed checkpoint.
        ``parts``: the model this rank trains; a checkpoint of another model is refused (a
        UserError) before its files are read. Every rank calls it (the checks are shared)."""
        choice = self.cfg.resume
        if choice == "never":
            return None
        model = None if parts is None else self.model_fingerprint(parts)
        if choice == "auto":
            for path in reversed(self._candidates()):
                self._refuse_other_model(path, model)
                problem = self._check(path)
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
        self._refuse_other_model(path, model)
        problem = self._check(path)
        if problem is not None:
            raise ConfigError(f"checkpoint.resume={choice} is damaged ({problem}); use checkpoint.resume=auto "
                              f"to take the newest intact one under {self.root}")
        return path

    # -- save / load ---------------------------------------------------------------------------
    def save(self, step: int, optim: PartOptimizers, loader_state: dict, trainer_state: dict | None = None) -> Path:
        """Every rank writes its shards (DCP); names are the unsplit model's, so the folder loads
        under any layout. With ``checkpoint.async_save`` this returns once the state is copied
        to host memory; ``wait()`` (or the next save) returns once the folder is complete."""
        self.wait()
        t0 = time.perf_counter()
        final = self.root / f"{PREFIX}{step:08d}"
        path = self.root / f"{TMP}{PREFIX}{step:08d}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"{TMP}*"):  # what an interrupted save left
                shutil.rmtree(stale, ignore_errors=True)
        barrier()
        path.mkdir(parents=True, exist_ok=True)
        # The small files first, synchronously: they are part of what the manifest covers, and
        # every rank writes its own before it joins DCP's collectives, so before rank 0's
        # DCP save can return.
        torch.save(rng_state(), path / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            torch.save({"step": step, "scheduler": optim.scheduler_state(), "loader": loader_state,
                        "trainer": dict(trainer_state or {})}, path / TRAINER_STATE)
        meta = {"step": step, "world_size": self.world, "layout": self.layout, "data": loader_state,
                "model": self.model_fingerprint(optim.parts)}
        state = _merged_state(optim)
        if self._writer is None:
            with single_process_quietly():
                dcp.save(state, checkpoint_id=str(path), no_dist=self._no_dist)  # returns once every rank's shards are written
            self._seal_and_publish(path, final, meta)
            barrier()  # rank 0's rename is done before anyone looks for the folder
        else:
            upload = dcp.async_save(state, checkpoint_id=str(path), process_group=self._group)
            self._pending = self._writer.submit(self._finish_async, upload, path, final, meta)
        self.last_block_s = time.perf_counter() - t0
        return final

    def _finish_async(self, upload: Future, path: Path, final: Path, meta: dict) -> Path:
        upload.result()  # every rank's returns once all shards and DCP's metadata are written
        self._seal_and_publish(path, final, meta)  # on the writer's own group, still in this thread
        return final

    def _own_files(self, path: Path) -> list[str]:
        """What this rank wrote into ``path``: its RNG state and its DCP shards (DCP's file
        writer names them ``__<rank>_<n>.distcp``), on rank 0 also the trainer state and DCP's
        metadata. A file under another name is still covered: rank 0 hashes whatever no rank
        claimed (``write_manifest``)."""
        names = [f"rng_rank{self.rank}.pt", *(p.name for p in path.glob(f"__{self.rank}_*.distcp"))]
        if self.rank == 0:
            names += [TRAINER_STATE, ".metadata"]
        return [n for n in names if (path / n).is_file()]

    def _seal_and_publish(self, path: Path, final: Path, meta: dict) -> None:
        """Every rank hashes and flushes its own files, all at once: the gather waits only for
        the slowest rank's share, not for one rank reading the whole checkpoint. Rank 0 then
        publishes."""
        shares = self._gather(seal(path, self._own_files(path)))
        if self.rank == 0:
            self._publish(path, final, meta, {rel: e for s in shares for rel, e in s.items()})

    def _publish(self, path: Path, final: Path, meta: dict, sealed: dict) -> None:
        """Rank 0, once every file is in ``path`` and sealed by its rank: manifest (flushed with
        the folder), atomic rename, retention."""
        (path / MARKER).write_text(json.dumps({"step": meta["step"]}))
        write_manifest(path, meta, sealed)
        if final.exists():  # the same step saved again (e.g. a re-run): the new one wins
            shutil.rmtree(final)
        os.rename(path, final)
        fsync_dir(self.root)
        self._prune()

    @property
    def pending(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is complete and visible. Every
        rank calls it at the same points (next save, end of training), so the writer's group
        is idle afterwards."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
            barrier()  # rank 0's rename is done before anyone looks for the folder

    def close(self) -> None:
        self.wait()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def load(self, path: Path, optim: PartOptimizers) -> Restored:
        self._refuse_other_model(path, self.model_fingerprint(optim.parts))  # before DCP reads anything
        state = _merged_state(optim)
        with single_process_quietly():
            dcp.load(state, checkpoint_id=str(path), no_dist=self._no_dist)
        for part, opt in zip(optim.parts, optim.optimizers):
            if not _trains(opt):
                set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
                continue
            set_state_dict(part, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=StateDictOptions(strict=False, flatten_optimizer_state_dict=True))
        extra = load_plain(path / TRAINER_STATE)
        optim.load_scheduler_state(extra["scheduler"])
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.exists():  # absent when resuming on more ranks than were saved
            set_rng_state(load_plain(rng_file))
        return Restored(step=int(extra["step"]), loader_state=extra["loader"], path=path,
                        trainer=dict(extra.get("trainer", {})))

    def load_weights(self, path: Path, parts: list[nn.Module], key: str = "model.init_from") -> None:
        """The model weights of the checkpoint ``path`` (saved under any layout) into the parts
        this rank trains; nothing else (``model.init_from``: the optimizer, the schedule, the
        data and the step start fresh). A checkpoint of another model is refused in one line
        before any weight is read. Every rank calls it."""
        path = Path(path)
        saved = (read_manifest(path)[0] or {}).get("model")
        here = self.model_fingerprint(parts)
        fresh_adapters = False
        if isinstance(saved, dict) and saved.get("sha256") != here["sha256"]:
            # A run with LoRA adapters started from one without (LLaVA stage 2 after stage 1):
            # its base weights under their plain names, the adapters as initialised.
            fresh_adapters = saved.get("sha256") == self.model_fingerprint(parts, lora.without_adapters)["sha256"]
            if not fresh_adapters:
                raise ConfigError(f"{key}={path} holds another model ({describe(saved)}) than the config builds "
                                  f"({describe(here)}); point {key} at a run of this model")
        state = {}
        for part in parts:
            state.update(get_model_state_dict(part))
        with single_process_quietly():
            dcp.load({"model": lora.without_adapters(state) if fresh_adapters else state}, checkpoint_id=str(path),
                     no_dist=self._no_dist)
        for part in parts:
            set_model_state_dict(part, state, options=StateDictOptions(strict=False))

    def _prune(self) -> None:
        if self.cfg.keep_last <= 0:
            return
        for old in self.completed()[: -self.cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


    # -- which model, and is it intact -------------------------------------------------------
    def model_fingerprint(self, parts: list[nn.Module], view=None) -> dict:
        """The full model's fingerprint (names, global shapes, dtypes), the same on every rank
        and every layout: each rank lists the parameters it holds, rank 0 merges. Once per run.
        ``view``: of the entries as ``view`` maps them (not kept; e.g. ``lora.without_adapters``)."""
        if view is not None:
            shares = self._gather(view(local_entries(parts)))
            return self._broadcast(fingerprint(merge(shares)) if self.rank == 0 else None)
        if self._fingerprint is None:
            shares = self._gather(local_entries(parts))
            self._fingerprint = self._broadcast(fingerprint(merge(shares)) if self.rank == 0 else None)
        return self._fingerprint

    def _refuse_other_model(self, path: Path, model: dict | None) -> None:
        """One line, before any weight is read, when ``path`` holds another model than ``model``.
        Checkpoints saved before fingerprints existed are not checked; an unreadable manifest is
        left to ``_check``, which calls the folder damaged."""
        manifest, _ = read_manifest(path)
        saved = (manifest or {}).get("model")
        if model is None or not isinstance(saved, dict) or saved.get("sha256") == model["sha256"]:
            return
        there, here = describe(saved), describe(model)
        if there == here:
            here += " (same sizes, other parameter names, shapes or dtypes)"
        where = "checkpoint.dir" if self.cfg.dir else "trainer.run_dir"
        raise ConfigError(f"checkpoint {path} holds another model ({there}) than the config builds ({here}); "
                          f"give this model its own {where}, or start it fresh with checkpoint.resume=never")

    def _check(self, path: Path) -> str | None:
        """Why ``path`` cannot be resumed from, or None: each rank checks its share of the files
        (``checkpoint.verify``), the first problem found on any rank decides for all. Folders
        saved before manifests existed (a COMPLETE marker, no manifest) are trusted as before."""
        if (path / MANIFEST).exists():
            local = verify(path, self.cfg.verify, self.rank, self.world)
        else:
            local = None if (path / MARKER).exists() else "not complete"
        return next((p for p in self._all_gather(local) if p is not None), None)

    def _candidates(self) -> list[Path]:
        """Rank 0's list of completed checkpoints, so every rank checks the same folders in the
        same order (and their collectives pair up) even if a rank sees the disk differently."""
        return self._broadcast(self.completed() if self.rank == 0 else None)

    # -- host objects over the gloo group -----------------------------------------------------
    def _gather(self, obj: Any) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._group)
        return out

    def _all_gather(self, obj: Any) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


def _trains(opt: torch.optim.Optimizer) -> bool:
    return any(group["params"] for group in opt.param_groups)


def _merged_state(optim: PartOptimizers) -> dict:
    """Model and optimizer state of every part this rank holds, under the unsplit model's names."""
    model_sd, optim_sd = {}, {}
    for part, opt in zip(optim.parts, optim.optimizers):
        # Flattened optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): the parts'
        # dicts have disjoint keys and simply merge. A part in which nothing trains (a frozen
        # LLM's chunk, model.freeze) has weights only.
        m, o = get_state_dict(part, opt, options=FLAT) if _trains(opt) else (get_model_state_dict(part), {})
        model_sd.update(m)
        optim_sd.update(o)
    return {"model": model_sd, "optim": optim_sd}
