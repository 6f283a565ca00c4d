"""cp_attention (ring and Ulysses) on gloo ranks equals full attention over the unsliced row."""
from __future__ import annotations

import pytest
import torch

from dataloading.construct.batch import MicroBatch
from dataloading.construct.context_parallel import _local_layout, _local_to_original, slice_for_cp
from dist_helpers import run_ranks
from parallel.cp_attention import cp_attention
from parallel.ring_attention import live_rows_cols as _live_rows_cols, mask as _mask

ROWS = [[5, 1, 9, 4, 7], [3, 12, 1, 6]]  # document lengths per row: a length-1 doc, none divisible by 2*cp
D = 8
PAD_DOC = 1000  # doc id of padding that must not be attended (tail padding; slicer padding if not causal)


def _reference(q, k, v, g, doc_lens, causal):
    """Naive fp64 attention over one whole row [H, N, D] with the doc mask, and its q/k/v grads."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    rep = q.shape[0] // k.shape[0]
    kk, vv = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones_like(mask).tril()
    s = (q @ kk.transpose(-1, -2)) / D**0.5
    out = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv
    (out * g).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _local_share(doc_lens, cp, rank):
    """(doc, pos, index in the unsliced row or -1) of rank's local tokens, via slice_for_cp."""
    n = sum(doc_lens)
    cu = torch.tensor([0] + doc_lens).cumsum(0).to(torch.int32)
    pos_ids = torch.cat([torch.arange(length) for length in doc_lens])
    mb = MicroBatch(torch.zeros(n, dtype=torch.int64), pos_ids, torch.zeros(n, dtype=torch.int64), cu)
    info = slice_for_cp(mb, cp, rank, pad_id=0).cp
    doc, offset = _local_layout(info)
    return doc, offset, _local_to_original(info)


def _check_case(rank, cp, impl, causal, hq, hkv):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)  # same full rows on every rank
    full = [[torch.randn(h, sum(lens), D, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]
            for lens in ROWS]
    refs = [_reference(*f, lens, causal) for f, lens in zip(full, ROWS)]
    shares = [_local_share(lens, cp, rank) for lens in ROWS]
    t_loc = max(orig.numel() for _, _, orig in shares)  # the caller pads rows to one length
    noise = torch.Generator().manual_seed(100 + rank)  # padding values differ per rank: must not leak

    def local(x, orig):  # [H, N, D] full row -> [H, t_loc, D], random at padding
        out = torch.randn(x.shape[0], t_loc, D, generator=noise, dtype=torch.float64)
        real = orig >= 0
        out[:, : orig.numel()][:, real] = x[:, orig[real]]
        return out

    q, k, v, g, docs, poss, reals = [], [], [], [], [], [], []
    for (fq, fk, fv, fg), (doc, pos, orig) in zip(full, shares):
        q.append(local(fq, orig)), k.append(local(fk, orig)), v.append(local(fv, orig))
        gl = local(fg, orig)
        real = torch.zeros(t_loc, dtype=torch.bool)
        real[: orig.numel()] = orig >= 0
        gl[:, ~real] = 0  # padding outputs are don't-care: no upstream gradient
        g.append(gl)
        pad_doc = doc if causal else torch.where(orig >= 0, doc, PAD_DOC)
        tail = t_loc - orig.numel()
        # tail padding: a document of its own per rank, as local_documents gives it (causal
        # Ulysses needs distinct positions within a document)
        docs.append(torch.cat([pad_doc, torch.full((tail,), PAD_DOC + 1 + rank)]))
        poss.append(torch.cat([pos, torch.arange(tail)]))
        reals.append(real)
    q, k, v = (torch.stack(x).float().requires_grad_(True) for x in (q, k, v))
    out = cp_attention(q, k, v, torch.stack(docs), torch.stack(poss), None, impl=impl, causal=causal)
    (out * torch.stack(g).float()).sum().backward()

    tag = f"cp={cp} rank={rank} impl={impl} causal={causal} hq={hq} hkv={hkv}"
    assert out.dtype == torch.float32 and out.shape == q.shape, tag
    for name, x in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(x).all(), f"{tag}: {name} not finite"
    for b, ((_, _, orig), real, ref) in enumerate(zip(shares, reals, refs)):
        idx = orig[orig >= 0]
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
            torch.testing.assert_close(got[b][:, real].double(), want[:, idx], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{tag} row {b} {name}: {m}")
        # Nothing real attends padding keys, and padding queries carry no gradient.
        assert k.grad[b][:, ~real].abs().max() == 0 and v.grad[b][:, ~real].abs().max() == 0, tag


def _check_contiguous(rank, cp, impl):
    """A plain contiguous split (not zig-zag): the explicit mask needs no layout knowledge. Under
    ring, rank 0 sees nothing of the block it receives last while rank 1 does: the backward must
    not hang on that hop."""
    lens = [7, 5]
    gen = torch.Generator().manual_seed(7)
    fq, fk, fv, fg = (torch.randn(h, 12, D, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref = _reference(fq, fk, fv, fg, lens, True)
    mine = slice(6 * rank, 6 * rank + 6)
    doc = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))[None, mine]
    pos = torch.cat([torch.arange(n) for n in lens])[None, mine]
    q, k, v = (x[None, :, mine].float().requires_grad_(True) for x in (fq, fk, fv))
    out = cp_attention(q, k, v, doc, pos, None, impl=impl)
    (out * fg[None, :, mine].float()).sum().backward()
    for got, want in zip((out, q.grad, k.grad, v.grad), ref):
        torch.testing.assert_close(got[0].double(), want[:, mine], rtol=1e-5, atol=1e-5)


def _zig_zag_long_document(rank, cp, n, hq, hkv, gen_seed, magnitude=1.0):
    """One row of two documents (n - 3 and 3 tokens) cut zig-zag over ``cp`` ranks: the full
    fp64 q, k, v, upstream gradient, and this rank's share (doc, pos, index or -1)."""
    lens = [n - 3, 3]
    gen = torch.Generator().manual_seed(gen_seed)
    full = [torch.randn(h, n, D, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]
    full[0] = full[0] * magnitude
    doc, pos, orig = _local_share(lens, cp, rank)
    doc = torch.where(orig >= 0, doc, doc)  # slicer padding keeps its document (causal)
    return lens, full, doc, pos, orig


def _local_rows(x, orig):
    """[H, N, D] full row -> [1, H, T_loc, D]: this rank's tokens, zero at padding."""
    out = torch.zeros(x.shape[0], orig.numel(), D, dtype=x.dtype)
    out[:, orig >= 0] = x[:, orig[orig >= 0]]
    return out[None]


def _check_bf16_autocast(rank, cp, impl):
    """Under bf16 autocast, CP attention is at least as accurate as the model's single-process
    attention in bf16 (``segment_attention``: SDPA over each document), both measured against
    fp64 on the same bf16 inputs. Scores of magnitude ~30 make a bf16 score matrix (8 bits of
    mantissa) visible. Stated tolerance: the output within 1e-2 of its largest element; each
    gradient within 1e-2 of its largest element or 1.25x the single-process error, whichever
    is larger (SDPA's own bf16 backward rounds its probability gradients to bf16)."""
    from omni.kernels.segment_attention import segment_attention

    lens, (fq, fk, fv, fg), doc, pos, orig = _zig_zag_long_document(rank, cp, 61, 4, 2, 5, magnitude=12.0)
    fq, fk, fv = (x.bfloat16().double() for x in (fq, fk, fv))  # the reference sees the same inputs
    ref = _reference(fq, fk, fv, fg, lens, True)
    single = [x[None].bfloat16().requires_grad_(True) for x in (fq, fk, fv)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s_out = segment_attention(*single, None, causal=True, lengths=tuple(lens))
    (s_out.float() * fg[None].float()).sum().backward()
    idx = orig[orig >= 0]  # both errors over this rank's tokens
    s_err = [(got[0][:, idx].double() - want[:, idx]).abs().max() / want[:, idx].abs().max()
             for got, want in zip((s_out, *(x.grad for x in single)), ref)]
    q, k, v = (_local_rows(x, orig).bfloat16().requires_grad_(True) for x in (fq, fk, fv))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cp_attention(q, k, v, doc[None], pos[None], None, impl=impl)
    assert out.dtype == torch.bfloat16
    (out.float() * _local_rows(fg, orig).float()).sum().backward()
    real = orig >= 0
    for i, (name, got, want) in enumerate(zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref)):
        want = want[:, orig[real]]
        err = (got[0][:, real].double() - want).abs().max() / want.abs().max()
        bound = 1e-2 if name == "out" else max(1e-2, 1.25 * float(s_err[i]))
        assert err <= bound, (f"bf16 {impl} cp={cp} rank={rank} {name}: {err:.2e} of the largest element "
                              f"(single process {s_err[i]:.2e})")


def _check_linear_memory(rank, cp, impl):
    """Nothing the backward keeps grows with T_loc x T_loc: every saved tensor is at most the
    size of q (for Ulysses, of q after the all-to-all: the same count of elements)."""
    t_loc = 256
    lens, (fq, fk, fv, fg), doc, pos, orig = _zig_zag_long_document(rank, cp, cp * t_loc - 2, 4, 2, 9)
    q, k, v = (_local_rows(x, orig).float().requires_grad_(True) for x in (fq, fk, fv))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        out = cp_attention(q, k, v, doc[None], pos[None], None, impl=impl)
    assert max(saved) <= q.numel() < t_loc * t_loc, (impl, sorted(saved)[-5:])
    (out * _local_rows(fg, orig).float()).sum().backward()
    ref = _reference(fq, fk, fv, fg, lens, True)
    real = orig >= 0
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
        torch.testing.assert_close(got[0][:, real].double(), want[:, orig[real]], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"long {impl} cp={cp} rank={rank} {name}: {m}")


def _check_chunked_ring(rank, cp):
    """The ring in chunks of query rows (a score budget of a few rows) gives the same result,
    to one row at a time."""
    import torch.distributed as dist

    from parallel.ring_attention import ring_attention

    lens, (fq, fk, fv, fg), doc, pos, orig = _zig_zag_long_document(rank, cp, 45, 4, 2, 3)
    ref = _reference(fq, fk, fv, fg, lens, True)
    real = orig >= 0
    for budget in (4 * 4 * 8 * 3, 1):  # 3 rows per chunk at most; one row
        q, k, v = (_local_rows(x, orig).float().requires_grad_(True) for x in (fq, fk, fv))
        out = ring_attention(q, k, v, doc[None], pos[None], dist.group.WORLD, True, D ** -0.5, score_bytes=budget)
        (out * _local_rows(fg, orig).float()).sum().backward()
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
            torch.testing.assert_close(got[0][:, real].double(), want[:, orig[real]], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"chunked ring budget={budget} rank={rank} {name}: {m}")


def _cp2_worker(rank, world):
    for impl in ("ring", "ulysses"):
        _check_bf16_autocast(rank, world, impl)
        _check_linear_memory(rank, world, impl)
    _check_chunked_ring(rank, world)

    for impl in ("ring", "ulysses"):
        for causal in (True, False):
            for hq, hkv in ((4, 2), (4, 1)):  # Hkv=1 does not split over cp=2: Ulysses repeats kv
                _check_case(rank, world, impl, causal, hq, hkv)
        _check_contiguous(rank, world, impl)
    x = torch.zeros(1, 3, 4, D)
    idx = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"Hq=3 .*cp=2.*impl='ring'"):
        cp_attention(x, x[:, :1], x[:, :1], idx, idx, None, impl="ulysses")


def _cp4_worker(rank, world):
    for impl in ("ring", "ulysses"):
        _check_case(rank, world, impl, True, 4, 2)
        _check_bf16_autocast(rank, world, impl)
        _check_linear_memory(rank, world, impl)
    _check_chunked_ring(rank, world)


def test_cp2_ring_and_ulysses_match_full_attention():
    run_ranks(_cp2_worker, 2)


def test_cp4_ring_and_ulysses_match_full_attention():
    run_ranks(_cp4_worker, 4)


def test_bad_inputs_name_the_problem():
    q = torch.zeros(1, 4, 6, D)
    kv = torch.zeros(1, 2, 6, D)
    idx = torch.zeros(1, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match="impl='flash' is unknown"):
        cp_attention(q, kv, kv, idx, idx, None, impl="flash")
    with pytest.raises(ValueError, match="doc must be int64; got torch.int32"):
        cp_attention(q, kv, kv, idx.int(), idx, None)
    with pytest.raises(ValueError, match=r"pos must be \[B, T_loc\] = \(1, 6\); got \(1, 5\)"):
        cp_attention(q, kv, kv, idx, idx[:, :5], None)
    with pytest.raises(ValueError, match="Hq=4 must be a multiple of Hkv=3"):
        cp_attention(q, torch.zeros(1, 3, 6, D), torch.zeros(1, 3, 6, D), idx, idx, None)
    with pytest.raises(ValueError, match="must match q"):
        cp_attention(q, kv[:, :, :5], kv[:, :, :5], idx, idx, None)


@pytest.mark.parametrize("causal", [True, False])
def test_live_rows_and_cols_agree_with_the_mask(causal):
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        b, tq, tk = 2, 5, 6
        doc_q, doc_k = torch.randint(0, 4, (b, tq), generator=gen), torch.randint(0, 4, (b, tk), generator=gen)
        pos_q, pos_k = torch.randint(0, 10, (b, tq), generator=gen), torch.randint(0, 10, (b, tk), generator=gen)
        mask = _mask(doc_q, pos_q, doc_k, pos_k, causal)
        rows, cols = _live_rows_cols(doc_q, pos_q, doc_k, pos_k, causal)
        assert torch.equal(rows, mask.any(dim=(0, 2)).nonzero().squeeze(1))
        assert torch.equal(cols, mask.any(dim=(0, 1)).nonzero().squeeze(1))


def test_zig_zag_blocks_compute_half():
    """Between two different ranks' zig-zag shares, only half of the score matrix is live."""
    shares = [_local_share(ROWS[0], 2, r) for r in range(2)]
    (doc0, pos0, _), (doc1, pos1, _) = shares
    t = doc0.numel()
    for dq, pq, dk, pk in ((doc0, pos0, doc1, pos1), (doc1, pos1, doc0, pos0)):
        rows, cols = _live_rows_cols(dq[None], pq[None], dk[None], pk[None], True)
        assert rows.numel() * cols.numel() == t * t // 2
