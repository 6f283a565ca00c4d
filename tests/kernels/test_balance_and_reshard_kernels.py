"""The balancing and resharding kernels equal their PyTorch references exactly (Triton under
TRITON_INTERPRET=1), the routing reference agrees with the data plane's own CP slicing and TP
shards, and the attention tile lists cover every block once, costliest first."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from dataloading.construct.context_parallel import slice_for_cp
from dataloading.plan.cost import CostModel
from omni.kernels import reference
from omni.kernels.balance import greedy_assign, segment_costs
from omni.kernels.reshard import route_rows, scatter_rows, send_maps
from omni.kernels.tiles import build_tiles

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
from layout_harness import global_batches  # noqa: E402


def _cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_segment_costs_equal_the_reference_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 3000, (1,), generator=g))  # more than one kernel block at times
    lengths = torch.randint(1, 500, (n,), generator=g).tolist()
    packs = torch.sort(torch.randint(0, 7, (n,), generator=g)).values
    cost = CostModel(alpha=3.0, beta=11.0, encoders={"image": (2.0, 5.0)})
    for modality, (a, b) in ((None, (3.0, 11.0)), ("image", (2.0, 5.0))):
        per, totals = segment_costs(_cu(lengths), cost, packs, 7, modality=modality, backend="triton")
        want_per, want_totals = reference.segment_costs_reference(_cu(lengths), a, b, packs, 7)
        assert torch.equal(per, want_per) and torch.equal(totals, want_totals)
    # the planner's own cost model gives the same numbers
    assert torch.equal(segment_costs(_cu(lengths), cost, backend="triton")[1],
                       torch.tensor([float(cost.llm_cost(lengths).sum())], dtype=torch.float64))


@pytest.mark.parametrize("n_items,n_bins", [(1, 1), (40, 3), (300, 8), (97, 13)])
def test_greedy_assignment_equals_lpt_reference(n_items, n_bins):
    g = torch.Generator().manual_seed(n_items)
    costs = torch.randint(1, 20, (n_items,), generator=g).double()  # many ties
    got = greedy_assign(costs, n_bins, backend="triton")
    want = reference.greedy_assign_reference(costs, n_bins)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert float(want[1].sum()) == float(costs.sum())


def test_routes_follow_the_data_planes_cp_slicing_and_tp_shards():
    """For every (cp, tp), where each image placeholder of a packed row really lands after
    ``slice_for_cp`` and TP's sequence shards, computed by the reference and by the kernel."""
    rows = [mb for step in global_batches(96, ("image",), steps=2) for mb in step if "image" in mb.media]
    checked = 0
    for mb in rows:
        positions = mb.media["image"].positions
        for cp, tp in ((1, 2), (2, 1), (2, 2), (4, 1)):
            truth_rank = torch.full((positions.numel(),), -1)
            truth_pos = torch.full((positions.numel(),), -1)
            for r in range(cp):
                part = slice_for_cp(mb, cp, r, 0) if cp > 1 else mb
                media = part.media["image"]
                out_rows = media.output_rows if media.output_rows is not None else torch.arange(positions.numel())
                local_len = -(-part.input_ids.numel() // tp) * tp
                shard = local_len // tp
                truth_rank[out_rows] = r * tp + media.positions // shard
                truth_pos[out_rows] = media.positions % shard
            if cp > 1:
                info = slice_for_cp(mb, cp, 0, 0).cp
                chunk, starts = info.chunk_lens, info.global_cu_seqlens[:-1].to(torch.int64)
                orig = torch.cat([torch.zeros(1, dtype=torch.int64), info.doc_lens.to(torch.int64).cumsum(0)[:-1]])
                doc = torch.searchsorted(orig, positions, right=True) - 1
                padded = positions - orig[doc] + starts[doc]  # the position in the padded whole row
                local_len = -(-part.input_ids.numel() // tp) * tp
            else:
                chunk = starts = None
                padded = positions
            want = reference.route_rows_reference(padded, local_len, cp, tp, chunk, starts)
            assert torch.equal(want[0], truth_rank) and torch.equal(want[1], truth_pos), (cp, tp)
            rank, local, counts = route_rows(padded, local_len, cp, tp, cp * tp, chunk, starts, backend="triton")
            assert torch.equal(rank, want[0]) and torch.equal(local, want[1])
            assert counts.tolist() == torch.bincount(want[0], minlength=cp * tp).tolist()
            checked += positions.numel()
    assert checked > 50


def test_send_maps_group_rows_by_destination_stably():
    dest = torch.tensor([2, 0, 1, 0, 2, 2, 1, 0])
    order, counts = send_maps(dest, 4)
    want_order, want_counts = reference.send_maps_reference(dest, 4)
    assert torch.equal(order, want_order) and torch.equal(counts, want_counts)
    assert order.tolist() == [1, 3, 7, 2, 6, 0, 4, 5] and counts.tolist() == [3, 2, 3, 0]


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
