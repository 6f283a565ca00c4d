"""FSDP2 / HSDP wrapping with the communication-scheduling knobs.

Each *unit* (a few consecutive blocks, an encoder) gets its own ``fully_shard`` call: one
all-gather before its forward, one reduce-scatter after its backward. ``blocks_per_unit``
is the bucket size: bigger units mean fewer, larger collectives (less per-call latency, less
overlap). ``prefetch`` sets how many units ahead are gathered while the current one computes,
in forward and in backward (explicit prefetching, the ByteScheduler/PACE idea of issuing the
next communication early, in priority order). On a 2D mesh (dp_replicate, dp_shard) FSDP2
runs HSDP: shards within dp_shard, all-reduces gradients across dp_replicate.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from parallel.device_rules import DeviceRules


def precision_policy(mode: str, rules: DeviceRules) -> MixedPrecisionPolicy:
    """``parallel.mixed_precision``: bf16 parameters with fp32 gradient reduction, or plain
    fp32; auto follows what the run computes in (``DeviceRules.fsdp_bf16``)."""
    if rules.fsdp_bf16(mode):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(root: nn.Module, units: Sequence[Sequence[nn.Module]], mesh: DeviceMesh, *,
                precision: MixedPrecisionPolicy, cpu_offload: bool = False, reshard_after_forward: bool = True,
                prefetch: int = 1, ignored: Iterable[nn.Parameter] = ()) -> list[nn.Parameter]:
    """``fully_shard`` every unit (a list of modules sharded together), then the root (what is
    left: embeddings, norms, projectors). ``ignored`` parameters stay unsharded (their gradients
    are reduced by the caller). Returns the sharded parameters: FSDP averages their gradients
    over the mesh, and the caller, whose losses are already normalised globally, multiplies them
    back by the mesh size (see ``undo_gradient_average``)."""
    ignored = set(ignored)
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    common = dict(mesh=mesh, mp_policy=precision, offload_policy=offload)
    wrapped = []
    for unit in units:
        mods = list(unit)
        own = {p for m in mods for p in m.parameters()} & ignored
        target = mods[0] if len(mods) == 1 else mods
        fully_shard(target, reshard_after_forward=reshard_after_forward, ignored_params=own or None, **common)
        # A grouped unit shares one FSDP state; its first module stands for it when prefetching.
        wrapped.append(mods[0])
    wrapped.append(fully_shard(root, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None,
                               **common))
    wrapped.pop()  # the root: gathered first, nothing to prefetch it behind
    if prefetch > 0 and len(wrapped) > 1:
        for i, unit in enumerate(wrapped):
            unit.set_modules_to_forward_prefetch(wrapped[i + 1: i + 1 + prefetch])
            earlier = wrapped[max(0, i - prefetch): i]
            unit.set_modules_to_backward_prefetch(list(reversed(earlier)))
    return [p for p in root.parameters() if p not in ignored]


@torch.no_grad()
def undo_gradient_average(params: Iterable[nn.Parameter], mesh_size: int) -> None:
    """Turn FSDP's averaged gradients into sums. (FSDP2 can sum directly with a gradient divide
    factor of 1, but that needs a pre-multiplied reduce, which gloo lacks; a power-of-two
    multiply is exact anyway.)"""
    if mesh_size == 1:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(mesh_size)
