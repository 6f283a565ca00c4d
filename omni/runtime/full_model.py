"""The whole trained model out of a split layout, for what needs it in one piece: the end-of-run
evaluation (greedy generation) and tests.

``replicate_full_model`` puts a full copy on every rank's own device, each rank's tensors
gathered over their own meshes (``full_tensor``) and each stage's broadcast from its first
holder, so that every rank can generate for its share of the held-out samples on its GPU.
``gather_full_model`` puts one copy in rank 0's host memory instead (no device holds it).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from omni.models.materialize import SeededInit, fill_meta
from omni.models.multimodal import OmniModel
from omni.runtime.parallelize import ParallelModel
from parallel.layout import Layout, host_group


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (a meta skeleton's too: shapes and dtypes)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _full_tensors(pm: ParallelModel, layout: Layout):
    """Every tensor this rank holds, whole, one at a time: a DTensor gathered over its mesh (a
    collective every rank of the mesh runs, in the same order: ``state_dict`` order)."""
    for part in pm.parts:
        for name, t in part.state_dict().items():
            if isinstance(t, DTensor):
                if t.device != layout.device:  # parallel.cpu_offload: gather on the device
                    t = t.to(layout.device)
                t = t.full_tensor()
            yield name, t.detach()


def replicate_full_model(pm: ParallelModel, layout: Layout, build: Callable[[], OmniModel],
                         device: torch.device) -> OmniModel:
    """The whole model on every rank's ``device``: each tensor broadcast from the lowest rank
    that holds it (its pipeline stage's, its encoder ranks'), over the default group (the
    device's own: NCCL on GPUs); which rank holds what is exchanged once over the host group.
    Collective: every rank calls it."""
    local: dict[str, torch.Tensor] = {}
    for name, t in _full_tensors(pm, layout):
        local.setdefault(name, t)
    mine = {name: (tuple(t.shape), t.dtype) for name, t in local.items()}
    everyone: list = [None] * layout.world_size
    dist.all_gather_object(everyone, mine, group=host_group(layout))
    merged: dict[str, torch.Tensor] = {}
    for name in sorted({n for held in everyone for n in held}):
        src = min(r for r, held in enumerate(everyone) if name in held)
        shape, dtype = everyone[src][name]
        t = local[name].to(device).contiguous() if src == layout.rank else torch.empty(shape, dtype=dtype,
                                                                                         device=device)
        dist.broadcast(t, src=src)
        merged[name] = t
    model = build()
    model.load_state_dict(merged, strict=True, assign=True)
    fill_meta(model, SeededInit(0))  # derived buffers (rotary frequencies) are not in the state
    return model.to(device)


def gather_full_model(pm: ParallelModel, layout: Layout, build: Callable[[], OmniModel]) -> OmniModel | None:
    """An unsharded copy of the trained model in rank 0's host memory (None elsewhere): no GPU
    ever holds more than one full parameter.

    Each stage gathers its full tensors one at a time (a collective over the parameter's own
    mesh, on the device) and its first rank moves them to host memory; those ranks then send
    them, tensor by tensor, to rank 0 over a gloo group (never an object collective over
    NCCL). Rank 0 fills ``build()``'s skeleton (meta device) with them."""
    group = host_group(layout)  # None: the default group already is gloo
    sender = _first_of_stage(layout, layout.rank)
    state: dict = {}
    for name, t in _full_tensors(pm, layout):  # every rank joins the gathers; the senders keep a host copy
        if sender:
            state[name] = t.to("cpu", copy=True)
        del t
    senders = [r for r in range(layout.world_size) if _first_of_stage(layout, r)]
    if not layout.is_main:
        if sender:
            _send_tensors(state, dst=0, group=group)
        return None
    merged = dict(state)
    for src in senders:
        if src != layout.rank:
            merged.update(_recv_tensors(src, group))
    model = build()
    model.load_state_dict(merged, strict=True, assign=True)
    fill_meta(model, SeededInit(0))  # derived buffers (rotary frequencies) are not in the state
    return model


def _first_of_stage(layout: Layout, rank: int) -> bool:
    c = layout.sizes.coords(rank)
    return c["dp_replicate"] == c["dp_shard"] == c["cp"] == c["tp"] == 0


def _send_tensors(state: dict, dst: int, group) -> None:
    meta = [(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    dist.send_object_list([meta], dst=dst, group=group)
    for t in state.values():
        dist.send(t.contiguous(), dst=dst, group=group)


def _recv_tensors(src: int, group) -> dict:
    box = [None]
    dist.recv_object_list(box, src=src, group=group)
    out = {}
    for name, shape, dtype in box[0]:
        t = torch.empty(shape, dtype=dtype)
        dist.recv(t, src=src, group=group)
        out[name] = t
    return out
