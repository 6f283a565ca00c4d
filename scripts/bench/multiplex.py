"""Encoder-LLM multiplexing placements side by side on an image-heavy and a text-heavy mixture:
``stage0``, ``encoder_first``, ``colocated``, ``colocated`` with FSDP-sharded encoder weights and
``colocated`` with long-short sequence parallelism (see docs/multiplexing.md).

Each variant is a real training run of the CLI on the CPU:

    torchrun --standalone --nproc-per-node 8 --no-python <venv>/bin/omni train ...

(``-m recipes.cli train`` when the ``omni`` script is not installed next to the interpreter), with
``OMP_NUM_THREADS=1`` and ``PYTHONPATH=<repo>``, gloo, fp32. Layout (``--world 8``, the default):
``parallel.pp=2 parallel.tp=2 parallel.dp_shard=2 parallel.pp_schedule=1f1b`` (ranks 0-3 are the
first pipeline stage, 4-7 the second; consecutive rank pairs are TP groups). ``--world 4`` runs
the older ``parallel.pp=2 parallel.dp_shard=2`` layout on 4 ranks.

Data: the generated demo dataset (``omni data demo --scale 0.25``, written once into
``--out/demo``) with two mixtures written next to it (``--mixes``, default both):
``mixture_image_heavy.yaml`` (shapes 0.8, tones 0.1, text 0.1) and ``mixture_text_heavy.yaml``
(shapes 0.1, tones 0.1, text 0.8); the demo's own mixture is 0.6 / 0.2 / 0.2. The workload is made
encoder-heavy through ``encoders.vision.params.*``: patch 4 instead of 8 (the demo's 32-64 px
images become 64-256 patches instead of 16-64) and a wider, deeper SigLIP tower (see VISION). The
LLM (the demo's 4-layer, hidden-128 llama) and the audio encoder stay as in the demo.

Variants (the first is the reference of every ratio; speedup = its step time / the variant's):

- ``stage0``: Megatron-style, encoders only on the first pipeline stage;
- ``encoder_first``: encoders on every rank, every chunk's forward before the LLM pipeline and
  every backward after it;
- ``colocated``: encoders on every rank, each chunk inserted into the 1F1B pipeline (the default),
  encoder weights replicated and their gradients all-reduced over all ranks after backward;
- ``colocated+sharded``: the same with ``multiplex.encoder_weights=sharded``: encoder and
  projector weights FSDP-sharded over all encoder ranks (all-gathers inside the encoder chunks,
  one reduce-scatter in the last chunk backward, instead of the all-reduce);
- ``colocated+sp2``: ``colocated`` with ``multiplex.encoder_sp=2`` and
  ``multiplex.long_threshold`` (default 192 encoder tokens: images of 14x14 patches and more are
  split over 2 ranks);
- ``colocated+grouped``: ``colocated`` with ``multiplex.chunks_per_cut=4``: one encoder call per
  modality for 4 micro-batches' items (the per-call fixed cost paid once per insertion point);
- ``colocated+hybrid+p2p``: workloads A-D's multiplexing settings (issue 18) on two "nodes" of 4
  ranks (``parallel.gpus_per_node=4``): ``multiplex.encoder_weights=hybrid`` (FSDP inside each
  group of 4, replicated across the two), ``multiplex.exchange=p2p`` and ``chunks_per_cut=4``;
- ``colocated+hybrid+p2p+bubbles``: the same with bubble calls (``multiplex.fill_bubbles=true``);
- ``defaults``: the built-in multiplexing settings (colocated, hybrid, p2p, ``fill_bubbles=auto``,
  ``chunks_per_cut=auto``: one call per step on the CPU) on the same two "nodes" of 4.

The variants other than ``defaults`` pin one chunk per cut unless they say otherwise (the
default before ``chunks_per_cut=auto``), so each name keeps the meaning of the earlier tables.

For every mixture, every run trains ``--steps`` steps from the same seed on the same samples; the
first ``--warmup`` steps are dropped. From ``<run_dir>/metrics.jsonl`` (written by rank 0; the
timeline fields are means over the ranks, see docs/multiplexing.md) per variant: median step
time (``step_time_s``, rank 0's wall time of the whole step, data construction included, with
``data.num_workers=0``) with min-max over all timed steps of all repeats, the means of
``bubble_fraction``, ``busy_encoder_s``, ``busy_llm_s``, ``busy_comm_s``, ``busy_optim_s``,
``idle_s`` and ``imbalance`` (max over ranks of busy time / mean), the largest
``encoder_peak_activation_mib`` (rank 0) and ``peak_rss_gib``, the mean ``encoder_long_items``
per step, and every step's loss. Placements change where work runs, not the math, so within a
mixture losses must agree across variants to 1e-5 relative; the report says whether they do.
Within a mixture, variants run ``--repeats`` times in a rotating order (repeat r starts with
variant r), so machine noise is spread over all of them.

Two diagnostics: each run's CPU seconds (the reaped torchrun tree, ``os.times``) over its wall
time x cores, which shows whether the run had the cores to itself and how much work it did in all;
and, from the traced step, the seconds per rank after each rank's last recorded span. The
timeline times encoder chunks, LLM stage work, the multiplexer's all-to-alls and the gradient
sync (``comm``), and clipping with the optimizer step (``optim``); what follows the last span (the
loss all-reduce, the end of the step) counts as idle. Collectives inside spans count as the span's
kind: FSDP's and TP's inside the LLM stages as LLM, and the sharded encoder's all-gathers and
reduce-scatter inside the encoder chunks as encoder.

The first repeat writes a Chrome trace (``multiplex.trace_step``) of its last step for every
variant; they are copied to ``--out/trace_<mixture>_<variant>.json`` and that step is left out
of the timings. The micro-batches per data-parallel rank are counted in the traces. JSON results
go to ``--out`` (default /tmp/omni-multiplex-bench, outside the repository); two plots:
``--plot`` (default docs/img/multiplex_placements.png: the mean per-rank time split, one panel
per mixture) and ``--schedule-plot`` (default docs/img/multiplex_schedule.png: the traced step of
``stage0``, ``colocated`` and ``colocated+sharded`` on the image-heavy mixture, one row per
rank, schedule_plot.py).
``--from-json`` re-prints the tables and redraws both plots from a saved result (the schedule
plot from the traces next to the JSON). This file runs the training; the summaries, tables and
plots are in multiplex_report.py.

Defaults: 5 steps, the first 2 dropped, 2 repeats: 5 timed steps per variant and mixture, about
30 minutes on 2 cores. ``--quick`` (2 steps, none dropped, 1 repeat, 4-layer tower, batch 24, only
the schedule plot's three variants unless ``--variants`` says otherwise; about 5 minutes) writes both
plots into ``--out``; its one timed step per variant says nothing about speed.

    python scripts/bench/multiplex.py [--world 8] [--mixes image_heavy,text_heavy] [--steps 5]
        [--warmup 2] [--repeats 2] [--variants stage0,colocated,...] [--quick] [--out DIR]
        [--from-json DIR/multiplex.json]
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, median, parser, save
from multiplex_report import KEYS, MIXES, SCHEDULE_VARIANTS, loss_check, plot, report, schedule, summarise

LAYOUTS = {8: {"parallel.pp": 2, "parallel.tp": 2, "parallel.dp_shard": 2, "parallel.pp_schedule": "1f1b"},
           4: {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.pp_schedule": "1f1b"}}
# The demo tower is hidden 96, MLP 256, 2 layers, 4 heads, patch 8, <= 64 patches.
VISION = {"patch_size": 4, "max_patches": 256, "hidden_size": 256, "intermediate_size": 1024,
          "num_hidden_layers": 8, "num_attention_heads": 4}
QUICK_VISION = dict(VISION, num_hidden_layers=4)
GLOBAL_BATCH = 40
QUICK_GLOBAL_BATCH = 24
MICRO_BATCH_TOKENS = 1024
DEMO_SCALE = 0.25  # 500 shapes, 375 tones, 375 texts: more than the runs draw
LONG_THRESHOLD = 192


def variants(long_threshold: int) -> list[tuple[str, dict]]:
    # Pinned to the settings before issue 18 changed the defaults (hybrid weights, p2p exchanges,
    # bubble calls, chunks_per_cut=auto), so that each name means what the earlier tables in
    # docs/benchmarks.md measured.
    before = {"multiplex.encoder_weights": "replicated", "multiplex.exchange": "all_to_all",
              "multiplex.fill_bubbles": "false", "multiplex.chunks_per_cut": 1}
    colocated = {**before, "multiplex.placement": "colocated"}
    # Nodes of 4: a pipeline rank's 4 GPUs, so hybrid shard groups stay inside one (bubble calls apply).
    hybrid = {**colocated, "multiplex.chunks_per_cut": 4, "multiplex.exchange": "p2p",
              "multiplex.encoder_weights": "hybrid", "parallel.gpus_per_node": 4}
    return [("stage0", {**before, "multiplex.placement": "stage0"}),
            ("encoder_first", {**before, "multiplex.placement": "encoder_first"}),
            ("colocated", colocated),
            ("colocated+sharded", {**colocated, "multiplex.encoder_weights": "sharded"}),
            ("colocated+sp2", {**colocated, "multiplex.encoder_sp": 2, "multiplex.long_threshold": long_threshold}),
            ("colocated+grouped", {**colocated, "multiplex.chunks_per_cut": 4}),
            ("colocated+hybrid+p2p", hybrid),
            ("colocated+hybrid+p2p+bubbles", {**hybrid, "multiplex.fill_bubbles": "true"}),
            # the built-in defaults (colocated, hybrid, p2p, fill_bubbles=auto, chunks_per_cut=auto)
            ("defaults", {"multiplex.placement": "colocated", "parallel.gpus_per_node": 4})]


# ---- running -------------------------------------------------------------------------------
def launcher(world: int) -> tuple[list[str], str]:
    """The torchrun prefix up to ``train`` (as tests/parallel/test_cli_layouts.py launches it)."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    omni = shutil.which("omni", path=str(Path(sys.executable).parent))
    if omni:
        return run + ["--no-python", omni, "train"], f"torchrun --no-python {omni} train"
    return run + ["-m", "recipes.cli", "train"], "torchrun -m recipes.cli train (no omni script next to python)"


def env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1")


def ensure_data(out: Path) -> Path:
    """The demo dataset in ``out/demo`` (generated once) and one mixture file per entry of MIXES."""
    demo = out / "demo"
    if not (demo / "mixture.yaml").exists():
        cmd = [sys.executable, "-m", "recipes.cli", "data", "demo", "--out", str(demo), "--scale", str(DEMO_SCALE)]
        subprocess.run(cmd, env=env(), check=True, capture_output=True, text=True)
    for mix, weights in MIXES.items():
        lines = [f"# {mix.replace('_', '-')} mixture of the demo sources (scripts/bench/multiplex.py)", "sources:"]
        lines += [f"  - name: {name}\n    path: {name}\n    weight: {w}" for name, w in weights.items()]
        mixture_file(demo, mix).write_text("\n".join(lines + ["eval: eval", ""]))
    return demo


def mixture_file(demo: Path, mix: str) -> Path:
    return demo / f"mixture_{mix}.yaml"


def overrides(demo: Path, mix: str, run_dir: Path, steps: int, batch: int, vision: dict, layout: dict,
              extra: dict, trace: int) -> list[str]:
    o = {"data.mixture": mixture_file(demo, mix), "data.eval_dir": demo / "eval",
         "data.global_batch_size": batch, "data.micro_batch_tokens": MICRO_BATCH_TOKENS, "data.num_workers": 0,
         "trainer.run_dir": run_dir, "trainer.max_steps": steps, "trainer.progress": "false",
         "trainer.eval_at_end": "false", "checkpoint.every": 0, "checkpoint.save_at_end": "false",
         **layout, **{f"encoders.vision.params.{k}": v for k, v in vision.items()}, **extra}
    if trace:
        o["multiplex.trace_step"] = trace
    return [f"{k}={v}" for k, v in o.items()]


def run_one(prefix: list[str], args: list[str], run_dir: Path, timeout_s: float) -> dict:
    """One training run; its metrics lines, wall time, and the tail of its log on failure."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    t0, c0 = time.perf_counter(), os.times()
    try:
        p = subprocess.run(prefix + args, env=env(), cwd=run_dir, capture_output=True, text=True, timeout=timeout_s)
        rc, log = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    wall, c1 = time.perf_counter() - t0, os.times()
    # CPU seconds of the whole torchrun tree (reaped children) over the cores' wall seconds: how much
    # of the machine the run got (1.0: both cores all the time; lower: waiting, or other jobs).
    cpu = (c1.children_user + c1.children_system) - (c0.children_user + c0.children_system)
    (run_dir / "log.txt").write_text(log)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if "loss" in r and "step" in r]
    m = re.search(r"([\d.]+)M parameters", log)
    return {"rc": rc, "wall_s": wall, "cpu_share": cpu / (wall * (os.cpu_count() or 1)), "metrics": rows,
            "params_m": float(m.group(1)) if m else None, "log_tail": log[-3000:] if rc != 0 else ""}


def trace_events(trace: Path) -> list[dict] | None:
    try:
        return [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    except (OSError, ValueError, KeyError):
        return None


def micro_batches(trace: Path) -> int | None:
    """Micro-batches per data-parallel rank in one step: distinct 'stage0 forward mbN' on rank 0."""
    events = trace_events(trace) or []
    names = {e["name"] for e in events if e.get("pid") == 0}
    return len({n for n in names if re.fullmatch(r"stage0 forward mb\d+", n)}) or None


def trace_tail(trace: Path, metrics: list[dict], step: int) -> float | None:
    """Seconds per rank after the last recorded span of the traced step (mean over ranks): the
    mean per-rank step time of the timeline (busy + idle at that step) minus the mean end of each
    rank's last span. It is the un-instrumented end of the step (after the optimizer step: the
    loss all-reduce), which the timeline counts as idle."""
    events = trace_events(trace)
    m = next((m for m in metrics if m["step"] == step), None)
    ranks = sorted({e["pid"] for e in events or []})
    if m is None or not ranks:
        return None
    ends = [max(e["ts"] + e["dur"] for e in events if e["pid"] == r) / 1e6 for r in ranks]
    return sum(m.get(k, 0.0) for k in KEYS) - sum(ends) / len(ends)


def trace_spans(trace: Path, name: str) -> list[float] | None:
    """Per rank (in rank order), the summed seconds of the spans called ``name`` in the trace
    (e.g. "gradient sync"); None without a trace."""
    events = trace_events(trace)
    if events is None:
        return None
    ranks = sorted({e["pid"] for e in events})
    return [sum(e["dur"] for e in events if e["pid"] == r and e["name"] == name) / 1e6 for r in ranks]


def vision_params(vision: dict) -> float | None:
    """Parameters (millions) of the vision tower: the demo's params with the overrides on top."""
    try:
        from omegaconf import OmegaConf

        from omni.models.encoders.siglip import SiglipEncoder, SiglipEncoderConfig

        params = dict(OmegaConf.to_container(OmegaConf.load(REPO / "conf/encoders/vision/siglip_demo.yaml"))["params"])
        params.update(vision)
        return sum(p.numel() for p in SiglipEncoder(SiglipEncoderConfig(**params)).parameters()) / 1e6
    except Exception:  # noqa: BLE001 - informational only
        return None


def run_mix(mix: str, vs: list, args, prefix: list[str], demo: Path, out: Path, vision: dict, batch: int,
            layout: dict) -> dict:
    """Every variant of one mixture, ``args.repeats`` times in rotating order; the runs, and the
    traced step of each variant (first repeat) copied to ``out/trace_<mix>_<variant>.json``."""
    runs = []
    for rep in range(args.repeats):
        for i in range(len(vs)):
            name, extra = vs[(i + rep) % len(vs)]
            run_dir = out / "runs" / mix / f"{name}-r{rep}"
            trace = args.steps if rep == 0 else 0
            o = overrides(demo, mix, run_dir, args.steps, batch, vision, layout, extra, trace)
            r = run_one(prefix, o, run_dir, args.timeout)
            r.update(variant=name, repeat=rep, traced=bool(trace), run_dir=str(run_dir))
            copy = out / f"trace_{mix}_{name}.json"
            if trace and (run_dir / f"trace_step{trace}.json").exists():
                shutil.copy(run_dir / f"trace_step{trace}.json", copy)
                r["trace_tail_s"] = trace_tail(copy, r["metrics"], trace)
                r["trace_grad_sync_s"] = trace_spans(copy, "gradient sync")
            runs.append(r)
            steps = [m["step_time_s"] for m in r["metrics"] if m["step"] > args.warmup]
            print(f"  {mix} repeat {rep} {name}: rc {r['rc']}, {r['wall_s']:.0f}s wall, median step "
                  f"{median(steps):.2f}s, CPU share {r['cpu_share']:.2f}; {wait_note()}", flush=True)
    return {"weights": MIXES[mix], "runs": runs, "micro_batches": micro_batches(out / f"trace_{mix}_{vs[0][0]}.json")}


# ---- summary -------------------------------------------------------------------------------
def wait_note() -> str:
    load = os.getloadavg()
    return f"1-min load average {load[0]:.1f} on {os.cpu_count()} CPUs"


# ---- main ----------------------------------------------------------------------------------
def arguments():
    p = parser(__doc__.split("\n")[0])
    p.set_defaults(out="/tmp/omni-multiplex-bench")
    p.add_argument("--world", type=int, default=8, choices=sorted(LAYOUTS),
                   help="ranks: 8 (pp=2 x tp=2 x dp_shard=2, default) or 4 (pp=2 x dp_shard=2)")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated subset of {', '.join(MIXES)}")
    p.add_argument("--variants", default="", help="comma-separated subset of the variants (default all; the first "
                   "one given is the reference of the ratios)")
    p.add_argument("--steps", type=int, default=5, help="training steps per run (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant and mixture, rotating order (default 2)")
    p.add_argument("--long-threshold", type=int, default=LONG_THRESHOLD,
                   help=f"multiplex.long_threshold of the SP variant (default {LONG_THRESHOLD} encoder tokens)")
    p.add_argument("--plot", default=str(REPO / "docs" / "img" / "multiplex_placements.png"),
                   help="PNG of the time split (default docs/img/multiplex_placements.png; --quick: in --out)")
    p.add_argument("--schedule-plot", default=str(REPO / "docs" / "img" / "multiplex_schedule.png"),
                   help="PNG of the traced step (default docs/img/multiplex_schedule.png; --quick: in --out)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per training run before it is killed")
    p.add_argument("--from-json", default="", help="re-print the tables and redraw the plots of a saved result "
                   "(the schedule plot needs the traces next to the JSON)")
    return p, p.parse_args()


def main() -> None:
    p, args = arguments()
    plot_path, schedule_path = Path(args.plot), Path(args.schedule_plot)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        res["vision_params_m"] = vision_params(res["vision"])
        print(report(res))
        print(plot(res, plot_path))
        print(schedule(res, Path(args.from_json).resolve().parent, schedule_path))
        return
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 0, 1
        if args.plot == p.get_default("plot"):
            plot_path = out / "multiplex_placements_quick.png"
        if args.schedule_plot == p.get_default("schedule_plot"):
            schedule_path = out / "multiplex_schedule_quick.png"
    if args.steps <= args.warmup + 1:
        p.error("--steps must exceed --warmup + 1 (the last step of the first repeat is traced, not timed)")
    mixes = [m for m in args.mixes.split(",") if m]
    if not mixes or any(m not in MIXES for m in mixes):
        p.error(f"--mixes {args.mixes!r}: choose from {', '.join(MIXES)}")
    vs = variants(args.long_threshold)
    if args.quick and not args.variants:  # a smoke run: the variants the schedule plot shows
        args.variants = ",".join(SCHEDULE_VARIANTS)
    if args.variants:
        by_name, wanted = dict(vs), [v for v in args.variants.split(",") if v]
        if any(v not in by_name for v in wanted):
            p.error(f"--variants {args.variants!r}: choose from {', '.join(by_name)}")
        vs = [(v, by_name[v]) for v in wanted]
    vision = QUICK_VISION if args.quick else VISION
    batch = QUICK_GLOBAL_BATCH if args.quick else GLOBAL_BATCH
    layout = LAYOUTS[args.world]
    prefix, how = launcher(args.world)
    demo = ensure_data(out)
    load_start = os.getloadavg()
    print(f"multiplex: {len(mixes)} mixture(s) x {len(vs)} variants x {args.repeats} repeat(s) x {args.steps} steps, "
          f"{args.world} ranks ({how}); {wait_note()}; results -> {out}", flush=True)
    t0 = time.perf_counter()
    res = {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "trace_step": args.steps,
           "world": args.world, "layout": layout, "vision": vision, "vision_params_m": vision_params(vision),
           "global_batch_size": batch, "micro_batch_tokens": MICRO_BATCH_TOKENS, "long_threshold": args.long_threshold,
           "variants": [[n, {k: str(v) for k, v in e.items()}] for n, e in vs], "launcher": how,
           "command_prefix": " ".join(prefix),
           "overrides_example": overrides(demo, mixes[0], out / "runs" / "MIX" / "VARIANT", args.steps, batch,
                                          vision, layout, {}, 0),
           "machine_cpus": os.cpu_count(), "load_avg_start": load_start, "mixes": {}}
    for mix in mixes:
        t_mix = time.perf_counter()
        res["mixes"][mix] = run_mix(mix, vs, args, prefix, demo, out, vision, batch, layout)
        res["mixes"][mix]["wall_s"] = time.perf_counter() - t_mix
    runs = [r for m in res["mixes"].values() for r in m["runs"]]
    res.update(model_params_m=next((r["params_m"] for r in runs if r["params_m"]), None),
               load_avg=os.getloadavg(), wall_s=time.perf_counter() - t0)
    for mix in mixes:
        res["mixes"][mix].update(summary=summarise(res, mix), loss_check=loss_check(res, mix))
    print(report(res))
    path = save(out, "multiplex" + ("_quick" if args.quick else ""), res)
    print(plot(res, plot_path))
    print(schedule(res, out, schedule_path))
    print(f"\nwrote {path}, traces {out}/trace_*.json ({res['wall_s']:.0f}s; 1-min load average "
          f"{load_start[0]:.1f} at the start, {res['load_avg'][0]:.1f} at the end, on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    sys.exit(main())
