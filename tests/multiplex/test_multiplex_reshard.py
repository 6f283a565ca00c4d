"""Resharding round trip: every encoder output row lands on the LLM rank and position that owns
it (first pipeline stage, CP chunk, TP/SP shard), and every gradient row goes back to the
encoder output it came from.

4 ranks as cp=2 x tp=2 (one data group, rows cut by CP and then by TP) and as dp_shard=2 x tp=2
(two data groups: items cross groups when balanced). The reference is the inline path: the
model's own encoder outputs written at the micro-batch's placeholder positions.
"""
from __future__ import annotations

import pickle

import pytest
import torch

from dist_helpers import run_ranks


def _worker(rank, world, sizes, out_dir, mux_options=None):
    from dataloading.construct.context_parallel import slice_for_cp
    from layout_harness import build, global_batches
    from omni.step.config import MultiplexConfig
    from omni.runtime.parallelize import parallelize
    from omni.step import plan_step
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    layout = init_layout(ParallelConfig(**sizes), device="cpu")
    model = build(False, 4, ("image", "audio"))
    reference = build(False, 4, ("image", "audio"))  # the same weights, inline
    # replicated encoder weights: their gradients are whole tensors to compare with the inline model's
    pm = parallelize(model, layout, MultiplexConfig(encoder_sp=2, long_threshold="5", encoder_weights="replicated",
                                                    **(mux_options or {})))
    mux, chunk = pm.multiplexer, pm.chunks[0]
    mbs = global_batches(96, ("image", "audio"), long_items=True)[0]
    mine = mbs[layout.dp_rank::layout.dp_size]
    if layout.sizes.cp > 1:
        mine = [slice_for_cp(mb, layout.sizes.cp, layout.cp_rank, pad_id=0) for mb in mine]
    rows = [mb.padded(-(-mb.num_tokens // 2) * 2, 0) for mb in mine]
    prepared = [chunk.prepare(mb) for mb in rows]
    for i, p in enumerate(prepared):
        p.index = i
    n = mux.gather([mux.describe(mb) for mb in rows], len(prepared))
    mux.plan(plan_step(pm.shape, [mb.num_tokens for mb in rows], n), prepared)
    shard = {}
    problems = []
    seeds = torch.Generator().manual_seed(rank)
    for j in range(n):
        mux.cut(j)
        p = prepared[j] if j < len(prepared) else None
        got = mux.embeddings(j) if p is not None else {}
        for m, media in (p.mb.media.items() if p is not None else ()):
            full = reference.embed_media(m, media).detach()  # every row of the micro-batch's items
            rows = media.output_rows if media.output_rows is not None else torch.arange(media.positions.numel())
            t = p.mb.input_ids.numel() // layout.sizes.tp
            keep = media.positions // t == layout.tp_rank
            want_rows, want_pos = full[rows[keep]], media.positions[keep] - layout.tp_rank * t
            vals, pos = got.get(m, (torch.zeros(0, 32), torch.zeros(0, dtype=torch.int64)))
            if not torch.equal(pos, want_pos):
                problems.append(f"rank {rank} mb {j} {m}: positions {pos.tolist()} != {want_pos.tolist()}")
            elif not torch.allclose(vals, want_rows, rtol=1e-5, atol=1e-6):
                problems.append(f"rank {rank} mb {j} {m}: rows differ by {float((vals - want_rows).abs().max()):.2e}")
            # Backward: a random gradient per delivered row; the encoders must receive exactly
            # these at the rows they produced (checked through the parameter gradients below).
            g = torch.randn(vals.shape, generator=seeds)
            vals.backward(g)
            shard[(j, m)] = (rows[keep], g)
    mux.finish()
    grads = {name: p.grad.clone() for name, p in pm.media.named_parameters() if p.grad is not None}
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump({"problems": problems, "grads": grads, "shard": shard, "group": layout.dp_rank,
                     "long": mux.stats.long_items}, f)


@pytest.mark.parametrize("sizes", [dict(dp_shard=1, cp=2, tp=2), dict(dp_shard=2, tp=2)], ids=["cp2xtp2", "dp2xtp2"])
def test_embeddings_land_where_they_belong_and_gradients_return(sizes, tmp_path):
    _check_round_trip(sizes, tmp_path)


def test_grouped_calls_and_p2p_land_and_return(tmp_path):
    """Two chunks per encoder call (one receive buffer for both micro-batches, one backward for
    both) with point-to-point exchanges between the trading pairs only."""
    _check_round_trip(dict(dp_shard=2, tp=2), tmp_path, {"chunks_per_cut": 2, "exchange": "p2p"})


def _check_round_trip(sizes, tmp_path, mux_options=None):
    from layout_harness import build, global_batches

    run_ranks(_worker, 4, sizes, str(tmp_path), mux_options, timeout_s=180)
    results = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(4)]
    problems = [line for r in results for line in r["problems"]]
    assert not problems, "\n".join(problems[:20])
    assert results[0]["long"] > 0, "no item was split: the test would not cover SP pieces"
    # The encoders' gradients (summed over ranks) equal the inline model's under the same
    # per-row output gradients: each row's gradient went back to the output that produced it.
    model = build(False, 4, ("image", "audio"))
    dp = sizes["dp_shard"]
    mbs = global_batches(96, ("image", "audio"), long_items=True)[0]
    for g in range(dp):
        for j, mb in enumerate(mbs[g::dp]):
            for m, media in mb.media.items():
                out = model.embed_media(m, media)
                grad = torch.zeros_like(out)
                for r in results:
                    if r["group"] == g and (j, m) in r["shard"]:
                        rows, gr = r["shard"][(j, m)]
                        grad[rows] += gr
                out.backward(grad)
    refs = {n: p.grad for n, p in model.named_parameters() if n.startswith(("encoders", "projectors"))
            and p.grad is not None}
    scale = sum(float(g.norm()) ** 2 for g in refs.values()) ** 0.5
    for name, ref in refs.items():
        got = sum(r["grads"][name] for r in results if name in r["grads"])
        if float(ref.norm()) < 1e-7 * scale:  # zero in exact arithmetic (attention key biases)
            assert float(got.norm()) < 1e-6 * scale, f"{name}: {float(got.norm()):.2e} where the gradient is zero"
            continue
        err = float((got - ref).norm() / float(ref.norm()))
        assert err < 1e-5, f"{name}: relative error {err:.2e}"
