"""Packed-row attention: the bucketed path equals the block-diagonal-mask reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni.kernels.segment_attention import _buckets, segment_attention


def _reference(q, k, v, seg, causal):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    t = q.shape[2]
    mask = seg[:, :, None] == seg[:, None, :]
    if causal:
        mask = mask & torch.ones(t, t, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths", [[5, 17, 3, 40, 1, 22, 9], [64], [2, 2, 2, 2], [1, 100]])
def test_bucketed_equals_masked(causal, lengths):
    torch.manual_seed(0)
    t = sum(lengths)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    q = torch.randn(1, 4, t, 16, requires_grad=True)
    k = torch.randn(1, 2, t, 16, requires_grad=True)
    v = torch.randn(1, 2, t, 16, requires_grad=True)
    out, ref = segment_attention(q, k, v, seg, causal), _reference(q, k, v, seg, causal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g_out = torch.autograd.grad(out.square().sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(g_out, g_ref):
        # Some gradients are exactly zero in theory (a segment's first query under causal
        # attention sees only itself): compare against the gradient's scale, not 0.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def test_non_contiguous_segments_use_the_mask():
    torch.manual_seed(0)
    seg = torch.tensor([[0, 0, 1, 1, 0, 0]])  # segment 0 appears twice: not a packed row
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    torch.testing.assert_close(segment_attention(q, k, v, seg, False), _reference(q, k, v, seg, False))


def test_buckets_bound_padding():
    lengths = [100, 90, 60, 50, 10, 9, 1]
    groups = _buckets(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert all(lengths[i] >= 0.75 * lengths[g[0]] for i in g)
