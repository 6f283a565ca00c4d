"""The multiplexing runtime plans a step from host-side manifests alone: it never reads a
tensor back from the device (on a GPU, every such read would stall the host until the queued
kernels finish). Checked by handing it micro-batches on the ``meta`` device, whose values
cannot be read at all: the plan, the routes and the index tensors are still built."""
from __future__ import annotations

import os
import pickle
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
from dist_helpers import run_ranks  # noqa: E402


def _worker(rank, world, out_dir):
    from layout_harness import build, global_batches
    from omni.step.config import MultiplexConfig
    from omni.runtime.parallelize import parallelize
    from omni.step import plan_step
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    layout = init_layout(ParallelConfig(), device="cpu")
    pm = parallelize(build(False, 4, ("image", "audio")), layout, MultiplexConfig(encoder_sp=1))
    mux, chunk = pm.multiplexer, pm.chunks[0]
    rows = global_batches(96, ("image", "audio"))[0]
    manifests = [mux.describe(mb) for mb in rows]  # on the host, before the move
    prepared = [chunk.prepare(mb.to("meta")) for mb in rows]
    n = mux.gather(manifests, len(prepared))
    mux.plan(plan_step(pm.shape, [mb.num_tokens for mb in rows], n), prepared)
    placed = {j: {m: (tuple(idx.shape), str(idx.device)) for src in mux._chunks[j].sources
                  for m, idx in src.need_idx.items()} for j in range(n)}
    tokens = [{m: int(media.num_tokens.sum()) for m, media in mb.media.items()} for mb in rows]
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump({"n": n, "placed": placed, "tokens": tokens}, f)


def test_the_step_plan_reads_nothing_from_the_device(tmp_path):
    run_ranks(_worker, 1, str(tmp_path), timeout_s=120)
    result = pickle.load(open(tmp_path / "rank0.pkl", "rb"))
    assert result["n"] == len(result["tokens"]) > 0
    for j, want in enumerate(result["tokens"]):
        # every placeholder of micro-batch j has its receive index, on the layout's device
        assert result["placed"][j] == {m: ((t,), "cpu") for m, t in want.items()}
    assert any(result["tokens"]), "no media: the test plans nothing"
