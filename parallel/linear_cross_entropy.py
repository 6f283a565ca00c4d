"""The LM head and its cross-entropy in one autograd function that never holds vocabulary-sized
logits for all targets (issue 38).

``F.cross_entropy(F.linear(hidden, weight).float(), labels)`` keeps ``[targets, vocab]`` logits in
the compute dtype and in fp32 for the backward, plus their fp32 gradient: 8k targets x 152k
vocabulary is ~12 GiB per micro-batch. Here the targets go through in chunks of rows: the forward
keeps only each row's log-sum-exp and target logit, and the backward recomputes each chunk's
logits (one more LM-head matmul, as Liger-Kernel's and cut-cross-entropy's fused losses do), so
the peak is one chunk's ``[rows, vocab]`` buffers.

Under tensor parallelism each rank holds vocabulary rows ``[start, start + V_local)`` of the head;
the per-row statistics are combined over the group with three all-reduces of ``[targets]``
vectors per call (the max and the sum of the log-sum-exps, the target logit), as many as the
unchunked vocabulary-parallel loss; every rank issues them in the same order, once per call.
The gradient of ``hidden`` is this rank's share (the caller sums it over the group, as for the
unchunked head), the head's gradient is this rank's rows.

Numerics: the matmuls run in the autocast dtype when autocast is on (as ``F.linear`` would), the
softmax and the loss in fp32; the backward casts the chunk's logit gradient to that dtype before
its two matmuls, as autocast's linear backward does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# The fp32 logits of one chunk stay under this many bytes (the backward holds about three such
# buffers: the logits, their softmax and the scaled gradient). One home: the simulator prices it.
from parallel.sizing import LOSS_CHUNK_BYTES as CHUNK_BYTES


def chunk_rows(vocab_local: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: one chunk's fp32 logits within ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * max(vocab_local, 1)))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, start: int,
                group: dist.ProcessGroup | None, rows: int) -> torch.Tensor:
        dtype = _compute_dtype(hidden)
        h, w = hidden.to(dtype), weight.to(dtype)
        n, v_local = h.shape[0], w.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        target = torch.zeros(n, dtype=torch.float32, device=h.device)
        local = labels - start
        mine = (local >= 0) & (local < v_local)
        safe = torch.where(mine, local, torch.zeros_like(local))
        for a in range(0, n, rows):
            b = min(a + rows, n)
            logits = (h[a:b] @ w.t()).float()
            lse[a:b] = torch.logsumexp(logits, dim=-1)
            target[a:b] = torch.where(mine[a:b], logits.gather(1, safe[a:b, None])[:, 0], target[a:b])
        if group is not None and dist.get_world_size(group) > 1:
            # log(sum_r exp(lse_r)): shifted by the largest, so no rank's exp overflows
            top = lse.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            total = (lse - top).exp()
            dist.all_reduce(total, group=group)
            lse = top + total.log()
            dist.all_reduce(target, group=group)
        ctx.save_for_backward(hidden, weight, lse, safe, mine)
        ctx.dtype, ctx.rows = dtype, rows
        return (lse - target).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, lse, safe, mine = ctx.saved_tensors
        dtype, rows = ctx.dtype, ctx.rows
        h, w = hidden.to(dtype), weight.to(dtype)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        minus_one = -mine.to(torch.float32)[:, None]
        for a in range(0, h.shape[0], rows):
            b = min(a + rows, h.shape[0])
            logits = (h[a:b] @ w.t()).float()
            # softmax minus the one-hot of the targets in this rank's rows, times the upstream grad
            g = (logits - lse[a:b, None]).exp_().scatter_add_(1, safe[a:b, None], minus_one[a:b])
            g = (g * grad).to(dtype)
            if grad_h is not None:
                grad_h[a:b] = (g @ w).to(hidden.dtype)
            if grad_w is not None:
                grad_w += (g.t() @ h[a:b]).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, start: int = 0,
                         group: dist.ProcessGroup | None = None, rows: int | None = None) -> torch.Tensor:
    """Sum over the rows of ``hidden`` [N, H] of CE(hidden @ weight.T, labels), ``weight`` [V_local, H]
    being vocabulary rows ``[start, start + V_local)`` of the head (all of it without TP; ``group``:
    the TP group the rows are split over). ``rows``: targets per chunk (default: one chunk's fp32
    logits within ``CHUNK_BYTES``)."""
    return _LinearCrossEntropy.apply(hidden, weight, labels, start, group, rows or chunk_rows(weight.shape[0]))


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same sum through liger-kernel's fused linear cross-entropy (Triton: the logits of a
    chunk of rows never leave the kernel's tiles; weight gradients accumulated in fp32). Whole
    vocabulary only (no TP); the caller checks that liger-kernel is installed
    (``DeviceRules.fused_loss``)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, labels, reduction="sum", accum_dtype=torch.float32)
