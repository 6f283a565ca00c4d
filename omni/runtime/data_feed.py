"""Data peers fetch once and share.

Ranks that consume the same samples — the tensor-, context- and pipeline-parallel peers of
one data-parallel rank — do not each run a loader: the group's source rank runs the
StepLoader and broadcasts every step to the others, with the loader state, so any of them
can checkpoint. Context-parallel peers then keep only their zig-zag slice of each row.

What travels where: the step's host objects (token ids, labels, positions, boundaries, media
manifests, sample ids, the loader state) are pickled over the peers' gloo group, because they
are needed on the host (CP slicing, the loss's target positions, the encoder plan); an object
collective over NCCL would copy them through the device and back. The media features (the
bulk) go over the peers' device group straight into each rank's device, once, when that group
is not gloo; on gloo they ride in the pickle.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from dataloading.construct.batch import StepBatch
from dataloading.construct.context_parallel import slice_for_cp
from parallel.broadcast import broadcast_object
from parallel.strict_device import mark_copied
from parallel.transfer import to_device


class _Features(NamedTuple):
    """Stands in for a media features tensor in the pickled step (it follows over the device)."""

    shape: tuple
    dtype: torch.dtype


class PeerFeed:
    def __init__(self, loader, group: dist.ProcessGroup | None, src: int, cp_size: int = 1, cp_rank: int = 0,
                 pad_id: int = 0, host_group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 features_on_device: bool | None = None):
        """``loader`` on rank ``src`` (None elsewhere); ``group`` holds the peers (None: world);
        ``host_group``: the same peers over gloo (None: ``group`` is used for host objects too,
        right when it is gloo). ``device``: where the features train; ``features_on_device``
        (default: when ``group`` is not gloo; ``DeviceRules.features_on_device`` in a run) sends
        them over ``group`` into it."""
        is_src = not dist.is_initialized() or dist.get_rank() == src
        if is_src == (loader is None):
            raise ValueError(f"rank {dist.get_rank() if dist.is_initialized() else 0}: the source rank {src} "
                             "needs the loader and only it")
        self.loader = loader
        self.group = group
        self.host_group = group if host_group is None else host_group
        self.src = src
        self.cp_size, self.cp_rank, self.pad_id = cp_size, cp_rank, pad_id
        self.device = torch.device("cpu") if device is None else torch.device(device)
        if features_on_device is None:
            features_on_device = dist.is_initialized() and dist.get_backend(group) != "gloo"
        self.features_on_device = features_on_device
        self._state: dict | None = None
        self.problems: dict[str, int] = {}

    def __iter__(self) -> "PeerFeed":
        return self

    def __next__(self) -> StepBatch:
        split = self.features_on_device and dist.is_initialized() and dist.get_world_size(self.group) > 1
        features: list[torch.Tensor] = []
        if self.loader is not None:
            batch = next(self.loader)
            if split:
                batch, features = _take_features(batch)
            payload = (batch, self.loader.state_dict())
        else:
            payload = None
        batch, self._state = broadcast_object(payload, self.src, self.host_group)
        if split:
            batch = _put_features(batch, self._broadcast_features(batch, features))
        self.problems = dict(self._state.get("problems", {}))
        if self.cp_size > 1:
            batch.micro_batches = [slice_for_cp(mb, self.cp_size, self.cp_rank, self.pad_id)
                                   for mb in batch.micro_batches]
        return batch

    def _broadcast_features(self, skeleton: StepBatch, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every features tensor of the step on this rank's device: one broadcast per dtype of
        one flat buffer, sized from the pickled shapes (no size message)."""
        marks = [m.features for mb in skeleton.micro_batches for m in mb.media.values()]
        out: list[torch.Tensor | None] = [None] * len(marks)
        for dtype in sorted({m.dtype for m in marks}, key=str):
            which = [i for i, m in enumerate(marks) if m.dtype == dtype]
            sizes = [_numel(marks[i].shape) for i in which]
            if self.loader is not None:  # the source
                flat, = to_device([torch.cat([features[i].reshape(-1) for i in which])], self.device)
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
                mark_copied(flat)  # (under the strict check: a device buffer, as on a GPU)
            dist.broadcast(flat, src=self.src, group=self.group)
            for i, piece in zip(which, torch.split(flat, sizes)):
                out[i] = piece.view(marks[i].shape)
        return out

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


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _take_features(batch: StepBatch) -> tuple[StepBatch, list[torch.Tensor]]:
    """The step with every media features tensor replaced by its shape, and those tensors in
    order (micro-batch, then modality)."""
    taken: list[torch.Tensor] = []

    def strip(mb):
        media = {}
        for name, m in mb.media.items():
            taken.append(m.features)
            media[name] = replace(m, features=_Features(tuple(m.features.shape), m.features.dtype))
        return replace(mb, media=media)

    return replace(batch, micro_batches=[strip(mb) for mb in batch.micro_batches]), taken


def _put_features(batch: StepBatch, features: list[torch.Tensor]) -> StepBatch:
    it = iter(features)

    def fill(mb):
        return replace(mb, media={name: replace(m, features=next(it)) for name, m in mb.media.items()})

    return replace(batch, micro_batches=[fill(mb) for mb in batch.micro_batches])
