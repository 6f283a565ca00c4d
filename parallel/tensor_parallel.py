"""Tensor-parallel pieces that DTensor plans do not cover: the vocabulary's split over the TP
ranks (the vocabulary-parallel loss is parallel/linear_cross_entropy.py) and moving a full row
into and out of the sequence-parallel layout."""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Rows [start, end) of a vocabulary sharded like DTensor's Shard(0) (torch.chunk sizes)."""
    per = -(-vocab_size // tp_size)
    start = min(tp_rank * per, vocab_size)
    return start, min(start + per, vocab_size)


def scatter_to_sequence_shards(full: torch.Tensor, mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """This TP rank's sequence shard of a row every TP rank holds in full. The backward
    all-gathers the shards' gradients, so what produced ``full`` gets the whole gradient."""
    return DTensor.from_local(full, mesh, [Replicate()], run_check=False).redistribute(
        mesh, [Shard(dim)]).to_local()


def gather_sequence_shards(local: torch.Tensor, mesh: DeviceMesh, dim: int = 1,
                           partial_grad: bool = False) -> torch.Tensor:
    """The full row from the TP ranks' sequence shards (an all-gather). ``partial_grad``: the
    full row's gradient differs per rank and must be summed (e.g. under a vocabulary-parallel
    loss), instead of being the same on every rank."""
    full = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False).redistribute(mesh, [Replicate()])
    return full.to_local(grad_placements=[Partial()] if partial_grad else None)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a plain tensor is returned as is)."""
    return t.to_local() if isinstance(t, DTensor) else t
