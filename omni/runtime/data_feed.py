"""Data peers fetch once and share.

Ranks that consume the same samples — the tensor-, context- and pipeline-parallel peers of
one data-parallel rank — do not each run a loader: the group's source rank runs the
StepLoader and broadcasts every step to the others, with the loader state, so any of them
can checkpoint. Context-parallel peers then keep only their zig-zag slice of each row.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist

from dataloading.batch import StepBatch
from dataloading.context_parallel import slice_for_cp
from parallel.broadcast import broadcast_object


class PeerFeed:
    def __init__(self, loader, group: dist.ProcessGroup | None, src: int, cp_size: int = 1, cp_rank: int = 0,
                 pad_id: int = 0):
        """``loader`` on rank ``src`` (None elsewhere); ``group`` holds the peers (None: world)."""
        is_src = not dist.is_initialized() or dist.get_rank() == src
        if is_src == (loader is None):
            raise ValueError(f"rank {dist.get_rank() if dist.is_initialized() else 0}: the source rank {src} "
                             "needs the loader and only it")
        self.loader = loader
        self.group = group
        self.src = src
        self.cp_size, self.cp_rank, self.pad_id = cp_size, cp_rank, pad_id
        self._state: dict | None = None
        self.problems: dict[str, int] = {}

    def __iter__(self) -> "PeerFeed":
        return self

    def __next__(self) -> StepBatch:
        if self.loader is not None:
            batch = next(self.loader)
            payload = (batch, self.loader.state_dict())
        else:
            payload = None
        batch, self._state = broadcast_object(payload, self.src, self.group)
        self.problems = dict(self._state.get("problems", {}))
        if self.cp_size > 1:
            batch.micro_batches = [slice_for_cp(mb, self.cp_size, self.cp_rank, self.pad_id)
                                   for mb in batch.micro_batches]
        return batch

    def state_dict(self) -> dict:
        if self.loader is not None:
            return self.loader.state_dict()
        if self._state is None:
            raise RuntimeError("no step received yet: the loader state lives on the source rank")
        return self._state

    def load_state_dict(self, sd: Mapping) -> None:
        if self.loader is not None:
            self.loader.load_state_dict(sd)
        self._state = dict(sd)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
