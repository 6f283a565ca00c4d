"""Resharding kernels: where encoder outputs go under the LLM layout, and writing them into
the LLM's input embeddings.

- ``route_rows``: for placeholder positions of a packed row, the rank (CP chunk x TP shard,
  ``rank = cp_rank * tp + tp_rank``) that embeds each and its local position there — the zig-zag
  CP slicing of ``dataloading.construct.context_parallel`` followed by TP's equal sequence shards — plus
  the rows per rank.
- ``send_maps``: the rows in send order (grouped by destination, stable) and the counts per
  destination: the index maps of a variable-split all-to-all.
- ``scatter_rows``: embeddings with ``rows[row_index[i]]`` written at ``positions[i]``, one fused
  kernel for the gather and the scatter; backward: the rows' gradient gathered from those
  positions, and no gradient for the overwritten embeddings.

Each equals its reference in ``omni.kernels.reference`` exactly. ``backend="auto"`` runs the
kernels on CUDA tensors and the references elsewhere (the multiplexing runtime on the CPU).
"""
from __future__ import annotations

import torch

from omni.kernels import reference
from omni.kernels.balance import _use_triton


def route_rows(positions: torch.Tensor, local_len: int, cp_size: int, tp_size: int, world: int,
               chunk_lens: torch.Tensor | None = None, doc_starts: torch.Tensor | None = None, backend: str = "auto"):
    """(rank [n] int64, local position [n] int64, rows per rank [world] int32). ``local_len``:
    a rank's (padded) row length, cut into ``tp_size`` shards. Under CP (``cp_size`` > 1):
    ``chunk_lens`` [n_docs] and ``doc_starts`` [n_docs] of the padded whole row."""
    if cp_size > 1 and (chunk_lens is None or doc_starts is None):
        raise ValueError("route_rows: context parallelism needs chunk_lens and doc_starts")
    if local_len % tp_size:
        raise ValueError(f"route_rows: a row of {local_len} tokens does not split into {tp_size} TP shards")
    if not _use_triton(positions, backend):
        rank, local = reference.route_rows_reference(positions, local_len, cp_size, tp_size, chunk_lens, doc_starts)
        return rank, local, torch.bincount(rank, minlength=world).to(torch.int32)
    from omni.kernels import _reshard_triton as kern

    n = positions.numel()
    dev = positions.device
    rank = torch.empty(n, dtype=torch.int64, device=dev)
    local = torch.empty(n, dtype=torch.int64, device=dev)
    counts = torch.zeros(world, dtype=torch.int32, device=dev)
    cp = cp_size > 1
    if cp:
        chunk = chunk_lens.to(device=dev, dtype=torch.int64)
        starts = doc_starts.to(device=dev, dtype=torch.int64)
        local_starts = torch.cumsum(2 * chunk, 0) - 2 * chunk
        n_docs = chunk.numel()
    else:
        chunk = starts = local_starts = positions  # unused
        n_docs = 1
    if n:
        block = 1024
        kern.route_rows[(-(-n // block),)](positions.to(torch.int64), starts, local_starts, chunk, rank, local, counts,
                                           n, n_docs, local_len, cp_size, tp_size, CP=cp,
                                           SEARCH_STEPS=max(1, n_docs.bit_length()), BLOCK=block)
    return rank, local, counts


def send_maps(dest_rank: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows in send order: grouped by destination rank, stable inside one; rows per rank)."""
    order = torch.argsort(dest_rank, stable=True)
    return order, torch.bincount(dest_rank.to(torch.int64), minlength=world)


def scatter_rows(embeds: torch.Tensor, rows: torch.Tensor, row_index: torch.Tensor, positions: torch.Tensor,
                 backend: str = "auto") -> torch.Tensor:
    """``embeds`` [T, H] (out of place) with ``rows[row_index[i]]`` at ``positions[i]``;
    differentiable in both. ``positions`` must be distinct."""
    if not _use_triton(embeds, backend):
        return reference.scatter_rows_reference(embeds, rows, row_index, positions)
    return _ScatterRows.apply(embeds, rows, row_index, positions)


def _grid(n: int, width: int):
    block_r, block_h = 32, min(256, 1 << max(0, (width - 1).bit_length()))
    return (-(-n // block_r), -(-width // block_h)), block_r, block_h


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, embeds, rows, row_index, positions):
        from omni.kernels import _reshard_triton as kern

        out = embeds.contiguous().clone()
        rows_c = rows.contiguous()
        idx, pos = row_index.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        n, width = idx.numel(), out.shape[1]
        if n:
            grid, br, bh = _grid(n, width)
            kern.scatter_rows[grid](out, rows_c, idx, pos, n, width, out.stride(0), rows_c.stride(0),
                                    BLOCK_R=br, BLOCK_H=bh)
        ctx.save_for_backward(idx, pos)
        ctx.rows_shape, ctx.rows_dtype = rows.shape, rows.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from omni.kernels import _reshard_triton as kern

        idx, pos = ctx.saved_tensors
        grad_embeds = grad_out.contiguous().clone()
        # fp32 accumulation for the rows' gradient (atomics), cast to the rows' dtype after
        grad_rows = torch.zeros(ctx.rows_shape, dtype=torch.float32, device=grad_out.device)
        n, width = idx.numel(), grad_embeds.shape[1]
        if n:
            grid, br, bh = _grid(n, width)
            kern.gather_rows_grad[grid](grad_embeds, grad_rows, idx, pos, n, width, grad_embeds.stride(0),
                                        grad_rows.stride(0), BLOCK_R=br, BLOCK_H=bh)
        return grad_embeds, grad_rows.to(ctx.rows_dtype), None, None
