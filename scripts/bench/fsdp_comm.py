"""FSDP communication scheduling: units (buckets), prefetch depth and reshard-after-forward.

Two gloo ranks on the CPU (``dp_shard=2``) train the same small dense decoder (llama family,
hidden 128, 8 blocks, vocab 256) through ``omni.runtime.trainer.Trainer.train_step`` on the
same synthetic packed micro-batches (4 micro-batches of 256 tokens per rank, documents of 16-128
tokens), once per variant of the FSDP knobs of ``parallel.config.ParallelConfig``:

- ``fsdp_blocks_per_unit`` B: blocks sharded together (one all-gather / reduce-scatter each);
- ``fsdp_prefetch`` P: explicit prefetch depth (0 = FSDP2's implicit prefetch);
- ``reshard_after_forward`` R: free the gathered parameters after forward (true) or keep them
  until backward (false: no backward all-gathers, more memory).

All variants live in the same two processes and run interleaved, step by step in a rotating
order, so load from other jobs hits them alike. Per variant: 1 warm-up step, ``--steps`` timed
steps (no profiler; their median is the step time), then ``--steps`` steps under
``torch.profiler`` (CPU activities), one profile per step. From each profile (rank 0):

- calls per step of ``c10d::_allgather_base_`` (all-gather) and ``c10d::_reduce_scatter_base_``
  (reduce-scatter), and of ``c10d::allreduce_`` (the trainer's own scalars);
- the time each collective is in flight: the ``gloo:*`` event that the gloo worker thread
  records from enqueue to completion, attributed to the c10d call that enqueued it;
- the collective share of the step: the union of those in-flight intervals over the profiled
  step's wall time, and the *exposed* part: in-flight time during which the training thread
  runs no ``aten::`` op (on gloo, FSDP2 issues its collectives with ``async_op=False``, so the
  training thread blocks and exposed ~= in flight; hiding them needs async collectives on their
  own streams, i.e. NCCL on GPU);
- the parameters held gathered from forward to backward (bytes of the unsharded, non-DTensor
  parameters registered on the model when its forward returns).

One Chrome trace per variant (rank 0, its last profiled step) goes to ``--out``, with the JSON
results. Ratios are against the default (B=1, P=1, R=true). Timings on a shared 2-core machine
move with the load; the counts do not.

    python scripts/bench/fsdp_comm.py [--steps 3] [--quick] [--out /tmp/omni-fsdp-traces]
        [--from-json /tmp/omni-fsdp-traces/fsdp_comm.json]
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from _common import median, parser, save, table

WORLD = 2
TOKENS = 256  # per micro-batch
MICRO = 4  # micro-batches per rank per step
# (blocks_per_unit, prefetch, reshard_after_forward); the first one is the reference.
# B = 4 runs with P = 0 as well, to see prefetch with big units. A variant that fails to build
# (the same way on every rank, before any collective) is reported as failed, not dropped.
VARIANTS = [(1, 1, True), (1, 0, True), (1, 2, True), (2, 1, True), (4, 1, True), (4, 0, True), (1, 1, False)]
QUICK_VARIANTS = [(1, 1, True), (4, 0, True), (1, 1, False)]


def label(v) -> str:
    b, p, r = v
    return f"B={b} P={p} R={'true' if r else 'false'}"


# ---- spawning (the pattern of tests/parallel/dist_helpers.py; scripts do not import tests/) ----
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int, *args, timeout_s: float = 900.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; kills them after ``timeout_s``."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(_entry, args=(world, _free_port(), timeout_s, fn, args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"fsdp_comm: ranks still running after {timeout_s:.0f}s")


def _entry(rank: int, world: int, port: int, timeout_s: float, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


# ---- model and data ------------------------------------------------------------------------
def build_model(num_layers: int):
    import torch

    from omni.models.llm import Decoder
    from omni.models.llm.config import DecoderConfig
    from omni.models.multimodal import OmniModel

    torch.manual_seed(0)
    cfg = DecoderConfig(family="llama", vocab_size=256, hidden_size=128, intermediate_size=384,
                        num_layers=num_layers, num_heads=4, num_kv_heads=2)
    return OmniModel(Decoder(cfg), {}, {})


def step_batch(rank: int, step: int):
    """MICRO packed rows of TOKENS tokens: documents of 16-128 tokens (the last one cut to fit),
    positions restarting per document, no target on a document's last token."""
    import torch

    from dataloading.construct.batch import IGNORE_INDEX, MicroBatch, StepBatch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    mbs = []
    for i in range(MICRO):
        lens = []
        while sum(lens) < TOKENS:
            lens.append(min(int(torch.randint(16, 129, (1,), generator=gen)), TOKENS - sum(lens)))
        ids, pos, labels = [], [], []
        for n in lens:
            doc = torch.randint(0, 256, (n + 1,), generator=gen)
            ids.append(doc[:-1])
            pos.append(torch.arange(n))
            lab = doc[1:].clone()
            lab[-1] = IGNORE_INDEX
            labels.append(lab)
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        mbs.append(MicroBatch(torch.cat(ids), torch.cat(pos), torch.cat(labels), cu,
                              sample_ids=[f"r{rank}s{step}m{i}"]))
    return StepBatch(step=step, micro_batches=mbs)


# ---- reading a profile ---------------------------------------------------------------------
KINDS = {"c10d::_allgather_base_": "all_gather", "c10d::_reduce_scatter_base_": "reduce_scatter",
         "c10d::allreduce_": "all_reduce"}


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> float:
    """Total length of the overlap of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def analyse(events) -> dict:
    """Counts, in-flight times (ms) and the exposed part of one profiled step's collectives."""
    calls = sorted(((e.time_range.start, e.time_range.end, e.name, e.thread) for e in events if e.name in KINDS))
    gloo = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.name.startswith("gloo:"))
    main = calls[0][3] if calls else None
    counts = {k: 0 for k in KINDS.values()}
    for c in calls:
        counts[KINDS[c[2]]] += 1
    # Each gloo event starts inside (just after) the enqueue of the c10d call that issued it.
    in_flight = {k: [] for k in KINDS.values()}
    backends = {}
    k = 0
    for start, end, name in gloo:
        while k + 1 < len(calls) and calls[k + 1][0] <= start:
            k += 1
        if not calls or calls[k][0] > start:
            continue
        kind = KINDS[calls[k][2]]
        in_flight[kind].append((start, end))
        backends.setdefault(kind, set()).add(name)
    busy = _union((e.time_range.start, e.time_range.end) for e in events
                  if e.thread == main and e.name.startswith("aten::"))
    comm = _union(iv for ivs in in_flight.values() for iv in ivs)
    total = _length(comm)
    return {"counts": counts,
            "ms": {kind: _length(_union(ivs)) / 1e3 for kind, ivs in in_flight.items()},
            "comm_ms": total / 1e3, "exposed_ms": (total - _intersect(comm, busy)) / 1e3,
            "backend_events": {kind: sorted(v) for kind, v in backends.items()}}


def collective_names(events) -> dict:
    """Every event name that looks like communication, with its count (to check the patterns)."""
    out: dict = {}
    for e in events:
        n = e.name.lower()
        if any(s in n for s in ("gather", "scatter", "reduce", "gloo", "c10d", "nccl")) and "FSDP::" not in e.name:
            out[e.name] = out.get(e.name, 0) + 1
    return out


# ---- one rank ------------------------------------------------------------------------------
def rank_main(rank: int, world: int, variants, steps: int, num_layers: int, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile

    from omni.runtime.config import CheckpointConfig, OptimConfig, TrainerConfig
    from omni.runtime.parallelize import parallelize
    from omni.runtime.trainer import Trainer
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    runs, failed = [], []
    for v in variants:
        b, p, r = v
        layout = init_layout(ParallelConfig(dp_shard=world, fsdp_blocks_per_unit=b, fsdp_prefetch=p,
                                            reshard_after_forward=str(r).lower()), device="cpu")
        model = build_model(num_layers)
        try:
            pm = parallelize(model, layout)
        except Exception as e:  # noqa: BLE001 - deterministic, on every rank alike, before any collective
            failed.append({"variant": list(v), "error": f"{type(e).__name__}: {e}"})
            continue
        held = {"bytes": 0}

        def after_forward(module, inputs, output, held=held, module_ref=model):
            gathered = sum(q.numel() * q.element_size() for q in module_ref.parameters() if not isinstance(q, DTensor))
            held["bytes"] = max(held["bytes"], gathered)

        model.register_forward_hook(after_forward)  # runs after FSDP's own post-forward hook
        trainer = Trainer(pm, None, layout,
                          TrainerConfig(max_steps=1000, run_dir=tempfile.mkdtemp(prefix="omni-fsdp-comm-"),
                                        progress=False, eval_at_end=False),
                          OptimConfig(lr=1e-3, warmup_steps=0), CheckpointConfig(save_at_end=False))
        runs.append({"variant": v, "trainer": trainer, "held": held, "times": [], "losses": [], "profiled": []})

    def one_step(run, step, prof=False, trace=False):
        batch = step_batch(rank, step)
        dist.barrier()
        if not prof:
            t0 = time.perf_counter()
            stats = run["trainer"].train_step(batch)
            run["times"].append(time.perf_counter() - t0)
            run["losses"].append(stats["loss"])
            return
        with profile(activities=[ProfilerActivity.CPU]) as p:
            t0 = time.perf_counter()
            stats = run["trainer"].train_step(batch)
            wall = time.perf_counter() - t0
        run["losses"].append(stats["loss"])
        if rank == 0:
            events = p.events()
            res = analyse(events)
            res["wall_ms"] = wall * 1e3
            res["names"] = collective_names(events)
            run["profiled"].append(res)
            b, pf, r = run["variant"]
            if trace:
                p.export_chrome_trace(str(Path(out) / f"trace_B{b}_P{pf}_R{'true' if r else 'false'}_rank0.json"))

    n = len(runs)
    step = 1
    for phase, count in (("warmup", 1), ("timed", steps), ("profiled", steps)):
        for s in range(count):
            for i in range(n):
                one_step(runs[(i + s) % n], step + s, prof=phase == "profiled", trace=s == count - 1)
        step += count
        if phase == "warmup":
            for run in runs:
                run["times"].clear()
        if rank == 0:
            print(f"  {phase}: done", flush=True)
    if rank == 0:
        rows = [{"variant": list(r["variant"]), "step_s": r["times"], "losses": r["losses"],
                 "held_param_bytes": r["held"]["bytes"], "profiled": r["profiled"]} for r in runs]
        (Path(out) / "_ranks.json").write_text(json.dumps({"rows": rows, "failed": failed}))


# ---- report --------------------------------------------------------------------------------
def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        prof = r["profiled"]
        per = lambda f: median([f(p) for p in prof])  # noqa: E731
        out.append({
            "variant": tuple(r["variant"]), "step_ms": median(r["step_s"]) * 1e3,
            "step_ms_range": (min(r["step_s"]) * 1e3, max(r["step_s"]) * 1e3),
            "profiled_step_ms": per(lambda p: p["wall_ms"]),
            "all_gather": per(lambda p: p["counts"]["all_gather"]),
            "reduce_scatter": per(lambda p: p["counts"]["reduce_scatter"]),
            "all_reduce": per(lambda p: p["counts"]["all_reduce"]),
            "ag_ms": per(lambda p: p["ms"]["all_gather"]), "rs_ms": per(lambda p: p["ms"]["reduce_scatter"]),
            "ms_per_ag": per(lambda p: p["ms"]["all_gather"] / max(p["counts"]["all_gather"], 1)),
            "comm_ms": per(lambda p: p["comm_ms"]),
            "comm_share": per(lambda p: p["comm_ms"] / p["wall_ms"]),
            "exposed_share": per(lambda p: p["exposed_ms"] / max(p["comm_ms"], 1e-9)),
            "held_mib": r["held_param_bytes"] / 2**20,
        })
    return out


def report(res: dict) -> str:
    s = res["summary"]
    ref = s[0]
    headers = ["variant (B, P, R)", "step ms median (min-max)", "vs default", "all-gathers / step",
               "reduce-scatters / step", "all-gather ms", "ms per all-gather", "reduce-scatter ms",
               "collectives ms (in flight)", "vs default",
               "collective share of step", "exposed share of collective time", "params held fwd->bwd MiB"]
    rows = []
    for x in s:
        lo, hi = x["step_ms_range"]
        rows.append([label(x["variant"]), f"{x['step_ms']:.0f} ({lo:.0f}-{hi:.0f})", f"{x['step_ms'] / ref['step_ms']:.2f}x",
                     f"{x['all_gather']:.0f}", f"{x['reduce_scatter']:.0f}", f"{x['ag_ms']:.0f}", f"{x['ms_per_ag']:.1f}",
                     f"{x['rs_ms']:.0f}",
                     f"{x['comm_ms']:.0f}", f"{x['comm_ms'] / ref['comm_ms']:.2f}x", f"{100 * x['comm_share']:.0f}%",
                     f"{100 * x['exposed_share']:.0f}%", f"{x['held_mib']:.2f}"])
    lines = [table(headers, rows), "",
             f"step ms: median of {res['steps']} unprofiled steps; the rest: median of {res['steps']} profiled steps "
             f"(rank 0). Profiled step ms (default): {ref['profiled_step_ms']:.0f}. "
             f"Trainer all-reduces per step: {ref['all_reduce']:.0f}.",
             f"losses identical across variants: {'yes' if res['losses_identical'] else 'NO'}",
             "collective events seen (default variant, one step): "
             + ", ".join(f"{k} x{v}" for k, v in sorted(res["event_names"].items())),
             "gloo events per c10d call: " + ", ".join(f"{k}: {'/'.join(v)}" for k, v in res["backend_events"].items())]
    lines += [f"FAILED {label(f['variant'])}: {f['error']}" for f in res.get("failed", [])]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.set_defaults(out="/tmp/omni-fsdp-traces")
    p.add_argument("--steps", type=int, default=3, help="timed steps and profiled steps per variant (default 3)")
    p.add_argument("--from-json", default="", help="re-print the table of a saved result (fsdp_comm.json)")
    args = p.parse_args()
    if args.from_json:
        import json

        res = json.loads(Path(args.from_json).read_text())
        res["summary"] = summarise(res["rows"])
        print(report(res))
        return
    variants = QUICK_VARIANTS if args.quick else VARIANTS
    steps = 1 if args.quick else args.steps
    layers = 4 if args.quick else 8
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"fsdp_comm: {WORLD} gloo ranks, {layers} blocks, {len(variants)} variants, {steps} timed + {steps} "
          f"profiled steps each; traces -> {out}", flush=True)
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    spawn(rank_main, WORLD, variants, steps, layers, str(out))
    import json

    got = json.loads((out / "_ranks.json").read_text())
    rows, failed = got["rows"], got["failed"]
    (out / "_ranks.json").unlink()
    default_prof = rows[0]["profiled"][-1]
    res = {"steps": steps, "layers": layers, "micro_batches": MICRO, "tokens_per_micro_batch": TOKENS,
           "world": WORLD, "rows": rows, "failed": failed, "summary": summarise(rows),
           "losses_identical": all(r["losses"] == rows[0]["losses"] for r in rows),
           "event_names": default_prof["names"], "backend_events": default_prof["backend_events"],
           "load_avg_start": load_start, "load_avg": os.getloadavg(), "wall_s": time.perf_counter() - t0}
    print(report(res))
    path = save(out, "fsdp_comm" + ("_quick" if args.quick else ""), res)
    print(f"\nwrote {path} and {len(rows)} traces in {out} ({res['wall_s']:.0f}s; "
          f"1-min load average {load_start[0]:.1f} at the start, {res['load_avg'][0]:.1f} at the end, on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    sys.exit(main())
