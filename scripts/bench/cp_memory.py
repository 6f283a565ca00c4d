"""Peak memory per rank of a training step under context parallelism (cp = 2) on long documents,
now and before ring and Ulysses attention ran in linear memory (issue 38, item 1).

Before (``--before``, default cff966f, run from a git worktree of it): the ring kept every hop's
masked score matrix and its softmax for the backward (up to ``[B, Hq, T_loc, T_loc]`` per hop and
layer, in bf16 under autocast), and Ulysses built a dense ``[B, 1, T, T]`` mask that SDPA turned
into a ``[T, T]`` attention matrix per head. Now: the ring keeps per-query log-sum-exps and
recomputes in the backward, chunk by chunk; Ulysses attends over the whole row sorted into
documents through the varlen path (SDPA per length bucket here).

Each point is one ``Trainer.train_step`` of a small Llama-style decoder (``--layers``: 2 and 4 layers,
hidden 128, 2 query heads and 1 KV head of 64 dims, vocabulary 2048, bf16 autocast) on one row
holding one document of ``tokens`` tokens, cut zig-zag over two gloo CP ranks (T_loc = tokens / 2),
in a fresh process per point, each rank limited to ``--limit-gib`` of address space. Reported per
rank: the peak resident memory (VmHWM) above what the rank held once its model, optimizer and
row existed; the larger of the two ranks. Nothing is asserted here
(tests/parallel/test_cp_attention.py holds the equality and the linear saved memory).

    python scripts/bench/cp_memory.py [--tokens 8192,16384,32768,65536] [--before-tokens 8192,16384,32768]
        [--layers 2,4] [--impls ring,ulysses] [--doc docs/benchmarks.md]
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (REPO, before_now_cells, in_fresh_process, parser, proc_status_bytes, publish, save_measured, table,
                     worktree)

SECTION = "## Context parallelism memory: ring and Ulysses in linear memory (CPU)"
GIB = 2 ** 30
CP = 2


def _rank(rank: int, world: int, store: str, tokens: int, impl: str, layers: int, limit_gib: float, out: str):
    import json
    import resource

    import torch
    import torch.distributed as dist

    from dataloading.construct.batch import MicroBatch, StepBatch
    from dataloading.construct.context_parallel import slice_for_cp
    from omni.models.llm import Decoder, DecoderConfig
    from omni.models.multimodal import OmniModel
    from omni.runtime.config import CheckpointConfig, OptimConfig, TrainerConfig
    from omni.step.config import MultiplexConfig
    from omni.runtime.parallelize import parallelize
    from omni.runtime.trainer import Trainer
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    limit = int(limit_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    result = {"rank": rank, "tokens": tokens}
    try:
        torch.manual_seed(0)
        llm = Decoder(DecoderConfig(family="llama", vocab_size=2048, hidden_size=128, intermediate_size=256,
                                    num_layers=layers, num_heads=2, num_kv_heads=1,
                                    max_position_embeddings=2 * tokens, tie_word_embeddings=True))
        layout = init_layout(ParallelConfig(cp=CP, cp_impl=impl), device="cpu")
        pm = parallelize(OmniModel(llm, {}, {}), layout, MultiplexConfig())
        run_dir = tempfile.mkdtemp(prefix="omni-cp-mem-")
        trainer = Trainer(pm, None, layout, TrainerConfig(max_steps=1, run_dir=run_dir, progress=False,
                                                          eval_at_end=False, precision="bf16"),
                          OptimConfig(lr=1e-3), CheckpointConfig(save_at_end=False))
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 2048, (tokens + 1,), generator=gen)
        mb = MicroBatch(ids[:-1], torch.arange(tokens), ids[1:].clone(),
                        torch.tensor([0, tokens], dtype=torch.int32), sample_ids=["long"])
        local = slice_for_cp(mb, CP, layout.cp_rank, pad_id=0)
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
        base = proc_status_bytes("VmRSS")
        t0 = time.perf_counter()
        trainer.train_step(StepBatch(step=1, micro_batches=[local]))
        result.update(fits=True, peak_above_inputs=proc_status_bytes("VmHWM") - base,
                      seconds=time.perf_counter() - t0)
    except (RuntimeError, MemoryError) as e:  # the address-space limit: an allocation failed
        result.update(fits=False, error=str(e).splitlines()[0][:200])
    Path(out).write_text(json.dumps(result))
    # a rank that failed to allocate leaves its peer waiting in a collective: no clean shutdown
    sys.stdout.flush()
    import os

    os._exit(0)


def child(tokens: int, impl: str, layers: int, limit_gib: float, timeout_s: float = 1800.0) -> dict:
    """Both CP ranks of one point, as subprocesses; the worse rank's peak, or ``fits: False``."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        outs = [str(Path(tmp) / f"rank{r}.json") for r in range(CP)]
        code = ("import sys; sys.path.insert(1, {bench!r}); import cp_memory as m; "
                "m._rank({r}, {w}, {store!r}, {tokens}, {impl!r}, {layers}, {limit}, {out!r})")
        procs = [subprocess.Popen([sys.executable, "-c", code.format(bench=str(REPO / "scripts" / "bench"), r=r, w=CP,
                                                                      store=store, tokens=tokens, impl=impl,
                                                                      layers=layers, limit=limit_gib, out=outs[r])])
                 for r in range(CP)]
        results = []
        deadline = time.time() + timeout_s
        for p, out in zip(procs, outs):
            while p.poll() is None and not Path(out).exists() and time.time() < deadline:
                time.sleep(0.5)
            if Path(out).exists():
                time.sleep(0.5)
                results.append(json.loads(Path(out).read_text()))
        for p in procs:  # a rank left waiting on a peer that ran out of memory
            p.kill()
            p.wait()
    fits = len(results) == CP and all(r["fits"] for r in results)
    if not fits:
        errors = [r.get("error", "") for r in results if not r.get("fits")]
        return {"fits": False, "tokens": tokens, "error": errors[0] if errors else "no result"}
    return {"fits": True, "tokens": tokens, "peak_above_inputs": max(r["peak_above_inputs"] for r in results),
            "per_rank": [r["peak_above_inputs"] for r in results], "seconds": max(r["seconds"] for r in results)}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", default="8192,16384,32768,65536")
    p.add_argument("--before-tokens", default="8192,16384,32768")
    p.add_argument("--impls", default="ring,ulysses")
    p.add_argument("--before", default="cff966f", help="the commit measured as before")
    p.add_argument("--layers", default="2,4", help="decoder layer counts (the quadratic part is per layer)")
    p.add_argument("--limit-gib", type=float, default=10.0)
    p.add_argument("--doc", default=None, help="markdown file whose section is (re)written")
    args = p.parse_args()
    t0 = time.perf_counter()
    now_sizes = [int(v) for v in args.tokens.split(",")]
    before_sizes = [int(v) for v in args.before_tokens.split(",")]
    points: dict = {}
    with worktree(args.before) as old:
        for layers in (int(v) for v in args.layers.split(",")):
            for impl in args.impls.split(","):
                for n in sorted(set(now_sizes) | set(before_sizes)):
                    args_ = (n, impl, layers, args.limit_gib)
                    now = in_fresh_process("cp_memory", "child", *args_) if n in now_sizes else None
                    then = in_fresh_process("cp_memory", "child", *args_, repo=old) if n in before_sizes else None
                    points[f"{layers}/{impl}/{n}"] = {"layers": layers, "impl": impl, "tokens": n, "now": now,
                                                      "before": then}
                    print(layers, impl, n, points[f"{layers}/{impl}/{n}"], flush=True)

    lim = args.limit_gib
    rows = [[r["layers"], r["impl"], r["tokens"], r["tokens"] // CP, *before_now_cells(r, lim)] for r in points.values()]
    head = save_measured(args.out, "cp_memory", t0, layers=args.layers.split(","), before_commit=args.before,
                         limit_gib=args.limit_gib, points=points)
    body = (head + " One `Trainer.train_step` "
            f"of a Llama-style decoder of `layers` layers (hidden 128, 2 query heads and 1 KV head of 64 dims, bf16 "
            f"autocast) on one row holding one document of `tokens` tokens, cut zig-zag over 2 gloo CP ranks; each "
            f"point in fresh processes, each rank limited to {args.limit_gib:.0f} GiB of address space. Per rank: the "
            f"peak resident memory above what the rank held once its model, optimizer and row existed (the larger "
            f"rank). `before`: {args.before} from a worktree of that commit.\n\n"
            + table(["layers", "impl", "tokens", "per rank", "before: peak GiB", "now: peak GiB", "before / now",
                     "now: seconds"], rows)
            + "\n\nBefore, the ring kept each hop's masked score matrix and its softmax for the backward "
            "(T_loc x T_loc per head, per hop and layer) and Ulysses a dense mask and SDPA's T x T attention "
            "per head: the part above `now` is quadratic in the tokens and proportional to the layers. Now the "
            "ring keeps the output and one fp32 log-sum-exp per query and head and recomputes each block in the "
            "backward in chunks of query rows (`parallel/ring_attention.py`; up to three chunks of at most 128 MiB "
            "of scores alive, a constant that dominates `now` at these small widths); Ulysses sorts the row into "
            "documents and attends per document (`parallel/cp_attention.py`). Both grow linearly in the tokens. "
            "`over Nx`: before exceeded the limit, so the ratio is at least N.\n")
    publish(body, args.doc, SECTION)


if __name__ == "__main__":
    sys.exit(main())
