"""Tensor-parallel pieces that DTensor plans do not cover: the vocabulary-parallel cross-entropy
(logits never gathered over the vocabulary) and moving a full row into and out of the
sequence-parallel layout."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Rows [start, end) of a vocabulary sharded like DTensor's Shard(0) (torch.chunk sizes)."""
    per = -(-vocab_size // tp_size)
    start = min(tp_rank * per, vocab_size)
    return start, min(start + per, vocab_size)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of logits split over the vocabulary: each rank holds columns
    [start, end). Three small all-reduces (max, sum of exp, target logit) replace gathering
    [N, V] logits; the backward is local (softmax minus one-hot on the rank's columns)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, start: int, group: dist.ProcessGroup):
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max[:, None]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        local = labels - start
        mine = (local >= 0) & (local < logits.shape[-1])
        safe = torch.where(mine, local, torch.zeros_like(local))
        target = torch.where(mine, shifted.gather(1, safe[:, None])[:, 0], torch.zeros_like(row_max))
        dist.all_reduce(target, group=group)
        loss = (sum_exp.log() - target).sum()
        ctx.save_for_backward(exp / sum_exp[:, None], safe, mine)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, safe, mine = ctx.saved_tensors
        # softmax minus the one-hot of the targets in this rank's columns: a scatter of -1 (0
        # for targets elsewhere), no boolean selection (its size would be read back)
        g = softmax.scatter_add(1, safe[:, None], -mine.to(softmax.dtype)[:, None])
        return g * grad, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, start: int,
                                 group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over rows of CE(logits, labels); ``local_logits`` [N, V_local] are columns
    [start, start + V_local) of the full logits. Every rank of ``group`` gets the same value."""
    if group is None or dist.get_world_size(group) == 1:
        return torch.nn.functional.cross_entropy(local_logits.float(), labels, reduction="sum")
    return _VocabParallelCrossEntropy.apply(local_logits, labels, start, group)


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
