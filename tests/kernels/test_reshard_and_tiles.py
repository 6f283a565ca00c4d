"""The resharding kernel equals its PyTorch reference exactly (Triton under TRITON_INTERPRET=1),
and the attention tile lists cover every block once, costliest first."""
from __future__ import annotations

import pytest
import torch

from omni.kernels import reference
from omni.kernels.reshard import scatter_rows
from omni.kernels.tiles import build_tiles


def _cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scatter_rows_forward_and_backward_equal_the_reference(dtype):
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(50, 40, generator=g).to(dtype).requires_grad_()
    rows = torch.randn(30, 40, generator=g).to(dtype).requires_grad_()
    idx = torch.randperm(30, generator=g)[:17]
    pos = torch.randperm(50, generator=g)[:17]
    out = scatter_rows(embeds, rows, idx, pos, backend="triton")
    grad = torch.randn(out.shape, generator=g).to(dtype)
    got = torch.autograd.grad(out, (embeds, rows), grad)
    ref = reference.scatter_rows_reference(embeds, rows, idx, pos)
    want = torch.autograd.grad(ref, (embeds, rows), grad)
    assert torch.equal(out, ref) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert float(got[0][pos].abs().sum()) == 0.0  # overwritten embeddings get no gradient


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("side", ["q", "kv"])
def test_tiles_cover_every_block_once_costliest_first(side, causal):
    lengths = [1, 70, 32, 5, 129]
    tiles = build_tiles(_cu(lengths), sum(lengths), 32, 16, causal, side)
    real = [(int(d), int(b)) for d, b in zip(tiles.doc, tiles.block) if d >= 0]
    assert sorted(real) == [(d, b) for d, n in enumerate(lengths) for b in range(-(-n // 32))]
    costs = tiles.cost[tiles.order.long()]
    assert torch.all(costs[:-1] >= costs[1:]) and int((tiles.cost >= 0).sum()) == len(real)
    # cost = blocks of 16 met on the other side
    by_tile = {(int(d), int(b)): int(c) for d, b, c in zip(tiles.doc, tiles.block, tiles.cost) if d >= 0}
    n = -(-129 // 16)
    if not causal:
        assert by_tile[(4, 2)] == n
    elif side == "q":
        assert by_tile[(4, 2)] == 6  # rows 64..95 see keys 0..95: six blocks of 16
    else:
        assert by_tile[(4, 2)] == n - 4  # keys 64..95 are seen by query blocks 4..8
