"""The resharding kernel: encoder outputs written into the LLM's input embeddings.

- ``scatter_rows``: embeddings with ``rows[row_index[i]]`` written at ``positions[i]``, one fused
  kernel for the gather and the scatter; backward: the rows' gradient gathered from those
  positions, and no gradient for the overwritten embeddings.

It equals its reference in ``omni.kernels.reference`` exactly. ``backend="auto"`` runs the
kernels on CUDA tensors and the references elsewhere (the multiplexing runtime on the CPU).
"""
from __future__ import annotations

import os

import torch

from omni.kernels import reference


def use_triton(t: torch.Tensor, backend: str) -> bool:
    """``backend`` "auto": the Triton kernel on CUDA, the reference elsewhere; "triton": the
    kernel (on the CPU only under ``TRITON_INTERPRET=1``, for tests); "torch": the reference."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel backend {backend!r} is not one of auto, triton, torch")
    if backend == "torch" or (backend == "auto" and not t.is_cuda):
        return False
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        if backend == "triton":
            raise ValueError("kernel backend 'triton' needs triton (pip install -e '.[triton]')")
        return False
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernel backend 'triton' runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
    return True


def scatter_rows(embeds: torch.Tensor, rows: torch.Tensor, row_index: torch.Tensor, positions: torch.Tensor,
                 backend: str = "auto") -> torch.Tensor:
    """``embeds`` [T, H] (out of place) with ``rows[row_index[i]]`` at ``positions[i]``;
    differentiable in both. ``positions`` must be distinct."""
    if not use_triton(embeds, backend):
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
