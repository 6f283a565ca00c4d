"""Single-GPU MFU of a 1B-class multimodal model, and the simulator's memory model against the
measured peak, for the same config and the same batch.

Model: a Llama-3.2-1B-shaped backbone (``model=llama3_8b`` with the overrides in ``LLM_1B``:
hidden 2048, 16 layers, 32 / 8 heads, tied embedding, vocabulary 128,256; 1.24B parameters)
plus the ``encoders/vision=vit_1b`` preset (SigLIP form, 1.14B parameters, 448 px images in
14 px patches). ``--tiny``: the CPU demo's ``model=tiny`` and ``encoders/vision=siglip_demo``,
to check the script's mechanics on the CPU (its numbers mean nothing).

Batch: the simulator draws the step (``omni.sim.data.draw_steps``, the data plane's balancer
under ``data.source=lengths`` with fixed sizes: ``--sample-tokens`` tokens per sample, each
one image of ``--image-tokens`` patches and the rest text, packed into ``--micro-batch-tokens``
rows), and
this script builds exactly those micro-batches as the data plane would (random pixels through
the encoder's own processor, ``dataloading.construct.constructor.assemble``). So the measured step and
the predicted one see the same documents and images.

Measured: the training step itself (``Trainer.train_step``: autocast, encoder multiplexing,
backward, clipping, AdamW), ``--warmup`` steps then ``--steps`` timed ones with CUDA events;
the peak of ``torch.cuda.max_memory_allocated`` over the timed steps (reset after warm-up, so the
optimizer state exists). The step timeline is off (``multiplex.timeline=false``): it is
instrumentation, not training.

Counted with the project's own rules, and one correction:
- model FLOPs per step: ``ModelSpec.mfu_flops`` (what ``omni simulate`` reports MFU with), except
  the LM head: that rule counts it on every token, but the model computes logits only at the loss
  targets (``OmniModel._ce_sum`` in ``omni/models/multimodal.py`` gathers the hidden states at the
  target positions before the head), so here the head counts on the step's target tokens alone
  (``flops_by_part``);
- MFU with and without the encoders' FLOPs, each against two peaks: the cluster preset's
  datasheet ``peak_tflops`` (``conf/cluster/``, chosen from ``torch.cuda.get_device_name``;
  ``--cluster`` to force one) and the dense matmul throughput measured in the same run
  (``matmul_peak``: large matmuls in the step's dtype, timed with CUDA events);
- predicted memory and step time: ``omni.sim.compare.simulate`` on one GPU of that preset,
  placement colocated (the runtime's default), uncalibrated; its MFU here is the same FLOPs over
  its predicted step time.

    python scripts/bench/mfu.py [--steps 10] [--warmup 3] [--out DIR]
    python scripts/bench/mfu.py --tiny --device cpu --steps 2 --warmup 1   # mechanics only

``--quick``: at most 3 timed steps after 1 warm-up.
"""
from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

from _common import REPO, git_state, machine, parser, save, table

# Llama-3.2-1B's shape on the llama3_8b preset (its vocabulary, rope and norms).
LLM_1B = {"model": "llama3_8b", "model.hidden_size": 2048, "model.intermediate_size": 8192,
          "model.num_layers": 16, "model.num_heads": 32, "model.num_kv_heads": 8,
          "model.tie_word_embeddings": "true"}
VISION_1B = {"encoders": "vision_only", "encoders/vision": "vit_1b"}
TINY = {"model": "tiny", "encoders": "vision_only", "encoders/vision": "siglip_demo"}
# --tiny batch: the demo's budget, two samples per micro-batch with one 64-patch image each.
TINY_SHAPE = {"micro_batch_tokens": 512, "sample_tokens": 256, "image_tokens": 64, "global_batch": 4}


def model_overrides(tiny: bool) -> dict:
    return dict(TINY) if tiny else {**LLM_1B, **VISION_1B}


def cluster_preset(device_type: str, requested: str) -> str:
    """The conf/cluster preset whose name the device's name contains (H200 -> h200)."""
    if requested != "auto":
        return requested
    if device_type != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name().lower()
    presets = sorted(p.stem for p in (REPO / "conf" / "cluster").glob("*.yaml"))
    for p in sorted(presets, key=len, reverse=True):
        if p != "cpu" and p in name:
            return p
    raise SystemExit(f"mfu: error: no conf/cluster preset matches the GPU {name!r} (presets: "
                     f"{', '.join(presets)}); pass --cluster NAME")


def sim_overrides(args, preset: str) -> list[str]:
    o = {"workload": "none", "cluster": preset, "cluster.num_gpus": 1, **model_overrides(args.tiny),
         "data.source": "lengths", "data.global_batch_size": args.global_batch,
         "data.micro_batch_tokens": args.micro_batch_tokens, "data.sample_tokens": args.sample_tokens,
         "data.sample_tokens_sigma": 0, "data.image_ratio": args.image_tokens / args.sample_tokens,
         "data.image_tokens_min": args.image_tokens, "data.image_tokens_max": args.image_tokens,
         # Every sample alike: one image and the rest text (the simulator's default mix draws
         # text-only, multi-image and video-like samples instead).
         "data.media_mix": "{image:1,multi_image:0,video:0,audio:0}",
         "data.media_text_tokens": args.sample_tokens - args.image_tokens,
         "data.steps": 1, "sim.placements": "[colocated]", "multiplex.placement": "colocated"}
    return [f"{k}={v}" for k, v in o.items()]


def train_overrides(args, run_dir: Path, precision: str) -> list[str]:
    o = {**model_overrides(args.tiny), "trainer.device": args.device, "trainer.precision": precision,
         "trainer.run_dir": run_dir, "trainer.progress": "false", "trainer.max_steps": args.warmup + args.steps,
         "trainer.eval_at_end": "false", "trainer.seed": 0, "data.micro_batch_tokens": args.micro_batch_tokens,
         "data.global_batch_size": args.global_batch, "checkpoint.every": 0, "checkpoint.save_at_end": "false",
         "checkpoint.resume": "never", "multiplex.placement": "colocated", "multiplex.timeline": "false"}
    return [f"{k}={v}" for k, v in o.items()]


def _grid(tokens: int) -> tuple[int, int]:
    """An image grid of exactly ``tokens`` patches, as square as the count allows."""
    h = max(d for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0)
    return h, tokens // h


def synthetic_step(work, processors: dict, vocab: int, step: int, seed: int = 0):
    """The simulator's drawn step (one DP group) as the data plane's MicroBatches: per
    document random token ids, its images (random pixels through the encoder's processor)
    at its start, next-token labels on the text. Images go to documents in draw order, each
    into the document it was drawn with (a sample's images never exceed its length - 1)."""
    import numpy as np

    from dataloading.construct.batch import IGNORE_INDEX, StepBatch
    from dataloading.construct.constructor import Tokenized, assemble

    rng = np.random.default_rng(seed + step)
    (group,) = work.groups
    mbs = []
    for m, mb in enumerate(group):
        items = list(mb.media)
        samples = []
        for d, n in enumerate(mb.docs):
            mine, used = [], 0
            while items and used + items[0][2] <= n - 1:  # (modality, encoder tokens, LLM rows)
                mine.append(items.pop(0))
                used += mine[-1][2]
            ids = rng.integers(0, vocab, n, dtype=np.int64)
            labels = np.concatenate([ids[1:], [IGNORE_INDEX]]).astype(np.int64)
            media, at = [], 0
            for modality, tokens, k in mine:
                proc = processors[modality]
                gh, gw = _grid(tokens)
                p = proc.patch_size
                item = proc(rng.integers(0, 256, (gh * p, gw * p, 3), dtype=np.uint8))
                assert item.num_tokens == k, (item.num_tokens, k)
                pos = np.arange(at, at + k, dtype=np.int64)
                labels[pos] = IGNORE_INDEX
                if at > 0:
                    labels[at - 1] = IGNORE_INDEX  # no target predicts a placeholder
                media.append((modality, item, pos))
                at += k
            samples.append(Tokenized(f"synthetic/{step}/{m}/{d}", ids, labels, media))
        if items:
            raise SystemExit(f"mfu: error: {len(items)} media items of micro-batch {m} fit no document")
        mbs.append(assemble(samples))
    return StepBatch(step, mbs)


def flops_by_part(spec, docs: list[int], media, targets: int) -> dict:
    """Model FLOPs of one step by part. ``ModelSpec.mfu_flops`` counts the LM head (6 x its
    parameters per token) on all ``sum(docs)`` tokens; the model runs it on the ``targets`` loss
    positions only, so the difference comes off. A tied head multiplies by the embedding."""
    tokens = sum(docs)
    if not 0 < targets <= tokens:
        raise SystemExit(f"mfu: error: {targets} target tokens in a step of {tokens} tokens")
    head = spec.head_params or spec.embed_params
    every_token = spec.mfu_flops(docs, media)  # the rule as the simulator applies it
    llm = spec.mfu_flops(docs, []) - 6.0 * head * (tokens - targets)
    encoders = spec.mfu_flops([], media)
    return {"total": llm + encoders, "llm": llm, "encoders": encoders, "lm_head": 6.0 * head * targets,
            "lm_head_params": head, "lm_head_positions": targets, "tokens": tokens,
            "head_on_every_token": every_token}


def _elapsed(run, cuda: bool):
    """(seconds, result) of ``run()``: between CUDA events on a GPU (the device's time, waited
    for once at the end), on the host clock elsewhere."""
    import torch

    if not cuda:
        t = time.perf_counter()
        out = run()
        return time.perf_counter() - t, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3, out


def matmul_peak(device: str, dtype_name: str, n: int, repeats: int = 5, inner: int = 10) -> dict:
    """The dense matmul throughput this device reaches in this run: the best of ``repeats``
    timings of ``inner`` back-to-back n x n x n matmuls (CUDA events on a GPU), after warm-up.
    A roof measured beside the datasheet's, on the same clocks and the same software."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    g = torch.Generator(device=device).manual_seed(0)
    # [a, b, c]: c = a @ b, held in a list so that they are freed before empty_cache
    mats = [*(torch.randn(n, n, device=device, dtype=dtype, generator=g) for _ in range(2)),
            torch.empty(n, n, device=device, dtype=dtype)]
    cuda = device == "cuda"

    def run(times: int):
        for _ in range(times):
            torch.mm(mats[0], mats[1], out=mats[2])

    run(3)  # warm-up
    best = math.inf
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        dt, _ = _elapsed(lambda: run(inner), cuda)
        best = min(best, dt / inner)
    mats.clear()
    if cuda:
        torch.cuda.empty_cache()
    return {"n": n, "dtype": dtype_name, "repeats": repeats, "inner": inner, "seconds": best,
            "tflops": 2.0 * n**3 / best / 1e12}


def mfu_figures(flops: dict, seconds: float, datasheet_tflops: float, measured_tflops: float) -> dict:
    """MFU with and without the encoders' FLOPs, against the datasheet and the measured peak."""
    out = {}
    for label, f in (("", flops["total"]), ("_without_encoders", flops["llm"])):
        out[f"mfu{label}"] = f / (seconds * datasheet_tflops * 1e12)
        out[f"mfu{label}_vs_measured_matmul"] = f / (seconds * measured_tflops * 1e12)
    return out


def measure(args, work):
    """Build the model as ``omni train`` does, run warm-up + timed training steps."""
    import torch
    from omegaconf import OmegaConf

    from omni.models.build import build_model, media_processors
    from omni.runtime.parallelize import parallelize
    from omni.runtime.trainer import Trainer
    from parallel.layout import init_layout, shutdown
    from recipes.compose import compose_config
    from recipes.data_plane import cost_model

    cuda = args.device == "cuda"
    precision = args.precision if args.precision != "auto" else ("bf16" if cuda else "fp32")
    run_dir = Path(tempfile.mkdtemp(prefix="omni_mfu_"))
    cfg = OmegaConf.to_object(compose_config(train_overrides(args, run_dir, precision)))
    layout = init_layout(cfg.parallel, device=cfg.trainer.device)
    try:
        t0 = time.perf_counter()
        torch.manual_seed(cfg.trainer.seed)
        model = build_model(cfg.model, cfg.encoders, vocab_needed=0)
        processors = media_processors(model)
        params = sum(p.numel() for p in model.parameters())
        pm = parallelize(model, layout, cfg.multiplex, cost_model(cfg, model))
        trainer = Trainer(pm, None, layout, cfg.trainer, cfg.optim, cfg.checkpoint)
        build_s = time.perf_counter() - t0
        batches = [synthetic_step(work, processors, cfg.model.vocab_size, s + 1)
                   for s in range(args.warmup + args.steps)]
        times, losses, skipped = [], [], 0
        for i, batch in enumerate(batches):
            timed = i >= args.warmup
            if cuda and i == args.warmup:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            dt, stats = _elapsed(lambda: trainer.train_step(batch), cuda)
            print(f"  step {i + 1}{'' if timed else ' (warm-up)'}: {dt:.3f} s, loss {stats['loss']:.4f}", flush=True)
            if timed:
                times.append(dt)
                losses.append(stats["loss"])
                skipped += int(stats["skipped"])
        timed_batches = batches[args.warmup:]
        out = {"precision": precision, "params": params, "build_s": build_s, "step_s": times, "losses": losses,
               "skipped_steps": skipped, "tokens_per_step": batches[0].num_tokens,
               "target_tokens_per_step": statistics.mean(b.num_target_tokens for b in timed_batches)}
        if cuda:
            out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            out["gpu"] = torch.cuda.get_device_name()
        return out
    finally:
        shutdown()


MFU_ROWS = (("mfu", "MFU, LLM + encoders, datasheet peak"), ("mfu_without_encoders", "MFU, LLM only, datasheet peak"),
            ("mfu_vs_measured_matmul", "MFU, LLM + encoders, measured matmul peak"),
            ("mfu_without_encoders_vs_measured_matmul", "MFU, LLM only, measured matmul peak"))


def report(res: dict) -> str:
    m, p, f, mm = res["measured"], res["predicted"], res["flops"], res["matmul_peak"]
    rows = [["step time (s, median)", f"{m['step_s_median']:.3f}", f"{p['step_time_s']:.3f}",
             f"{p['step_time_s'] / m['step_s_median']:.2f}"]]
    rows += [[label, f"{100 * m[key]:.1f}%", f"{100 * p[key]:.1f}%", f"{p[key] / m[key]:.2f}"]
             for key, label in MFU_ROWS]
    rows.append(["tokens/s", f"{m['tokens_per_s']:,.0f}", f"{p['tokens_per_s']:,.0f}",
                 f"{p['tokens_per_s'] / m['tokens_per_s']:.2f}"])
    if m.get("peak_allocated_gib") is not None:
        rows.append(["peak memory (GiB; measured: max_memory_allocated)", f"{m['peak_allocated_gib']:.2f}",
                     f"{p['memory_gib']['total']:.2f}", f"{p['memory_gib']['total'] / m['peak_allocated_gib']:.3f}"])
    else:
        rows.append(["peak memory (GiB)", "n/a (no CUDA)", f"{p['memory_gib']['total']:.2f}", "n/a"])
    head = ["figure", "measured", "predicted (simulator, uncalibrated)", "predicted / measured"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in p["memory_gib"].items() if k != "total")
    return (table(head, rows) + f"\n\nModel FLOPs per step {f['total'] / 1e12:.4g} TFLOP: LLM {f['llm'] / 1e12:.4g} "
            f"(of which the LM head {f['lm_head'] / 1e12:.4g}, on the {f['lm_head_positions']:,.0f} target tokens of "
            f"{f['tokens']:,}; counted on every token as ModelSpec.mfu_flops does, the step would be "
            f"{f['head_on_every_token'] / 1e12:.4g}), encoders {f['encoders'] / 1e12:.4g}. Peaks: datasheet "
            f"{res['peak_tflops']:.4g} TFLOP/s ({res['cluster']} preset), measured {mm['tflops']:.4g} TFLOP/s "
            f"({mm['dtype']} {mm['n']}^3 matmuls, best of {mm['repeats']}; "
            f"{mm['tflops'] / res['peak_tflops']:.2f} of the datasheet). Predicted memory by part (GiB): {parts}.")


def main() -> None:
    p = parser("Single-GPU MFU of a 1B-class multimodal model and the memory model against the measured peak")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="the CPU demo's model (checks the mechanics)")
    p.add_argument("--cluster", default="auto", help="conf/cluster preset for the peak (auto: from the GPU name)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--sample-tokens", type=int, default=2048)
    p.add_argument("--image-tokens", type=int, default=1024, help="patches of each sample's one image")
    p.add_argument("--global-batch", type=int, default=8, help="samples per step")
    p.add_argument("--matmul-n", type=int, default=0,
                   help="size of the matmuls that measure the peak (0: 8192 on a GPU, 256 on the CPU)")
    args = p.parse_args()
    if args.quick:  # the shared --quick flag: fewer steps
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    if args.tiny:
        args.micro_batch_tokens, args.sample_tokens = TINY_SHAPE["micro_batch_tokens"], TINY_SHAPE["sample_tokens"]
        args.image_tokens, args.global_batch = TINY_SHAPE["image_tokens"], TINY_SHAPE["global_batch"]
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("mfu: error: --steps must be >= 1 and --warmup >= 0")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mfu: error: --device cuda but torch sees no CUDA device "
                         f"(torch {torch.__version__}); use --device cpu --tiny to check the script")

    from omni.sim.data import draw_steps
    from omni.sim.compare import simulate
    from omni.sim.spec import model_spec
    from recipes.simulate_cmd import load_sim_config

    preset = cluster_preset(args.device, args.cluster)
    sim_cfg = load_sim_config(sim_overrides(args, preset))
    spec = model_spec(sim_cfg.model, sim_cfg.encoders, sim_cfg.parallel.encoder_activation_checkpoint)
    (work,) = draw_steps(sim_cfg.data, spec, 1)
    predicted = simulate(sim_cfg)["placements"]["colocated"]
    peak = sim_cfg.cluster.peak_tflops
    encoders = ", ".join(f"{k} {e.params / 1e6:,.1f}M" for k, e in spec.encoders.items())
    print(f"mfu: LLM {spec.llm_params() / 1e6:,.1f}M + encoder ({encoders}) parameters; "
          f"{len(work.groups[0])} micro-batches of {[mb.tokens for mb in work.groups[0]]} tokens, "
          f"{len(work.media())} images", flush=True)
    # Before the model exists: the matmuls have the device to themselves.
    precision = args.precision if args.precision != "auto" else ("bf16" if args.device == "cuda" else "fp32")
    mm = matmul_peak(args.device, precision, args.matmul_n or (8192 if args.device == "cuda" else 256))
    print(f"mfu: measured matmul peak {mm['tflops']:.4g} TFLOP/s ({precision}, n={mm['n']}); datasheet {peak:.4g}",
          flush=True)

    m = measure(args, work)
    if m["tokens_per_step"] != sum(work.docs()):
        raise SystemExit(f"mfu: error: the step ran {m['tokens_per_step']} tokens, the simulator drew "
                         f"{sum(work.docs())}")
    flops = flops_by_part(spec, work.docs(), work.media(), m["target_tokens_per_step"])
    med = statistics.median(m["step_s"])
    m.update(step_s_median=med, tokens_per_s=m["tokens_per_step"] / med, **mfu_figures(flops, med, peak, mm["tflops"]))
    pred = {k: predicted[k] for k in ("step_time_s", "tokens_per_s", "memory_gib", "fits")}
    # The simulator's own MFU counts the head on every token; the same FLOPs as measured instead.
    pred.update(simulator_mfu=predicted["mfu"], **mfu_figures(flops, predicted["step_time_s"], peak, mm["tflops"]))
    finite = all(math.isfinite(x) for x in m["losses"])
    res = {"device": args.device, "tiny": args.tiny, "cluster": preset, "peak_tflops": peak, "matmul_peak": mm,
           "overrides": model_overrides(args.tiny), "sim_overrides": sim_overrides(args, preset),
           "batch": {"micro_batches": [{"docs": mb.docs, "media": mb.media} for mb in work.groups[0]]},
           "llm_params": spec.llm_params(), "encoder_params": {k: e.params for k, e in spec.encoders.items()},
           "flops_per_step": flops["total"], "flops": flops, "measured": m, "losses_finite": finite,
           "predicted": pred, "torch": torch.__version__, "machine": machine(), "git": git_state()}
    if m.get("peak_allocated_gib"):
        res["memory_ratio_predicted_over_measured"] = predicted["memory_gib"]["total"] / m["peak_allocated_gib"]
    text = report(res)
    print(text)
    name = "mfu_tiny" if args.tiny else "mfu"
    path = save(args.out, name, res)
    (Path(args.out) / f"{name}.md").write_text(text + "\n")
    print(f"wrote {path}")
    if not finite:
        raise SystemExit("mfu: error: a timed step's loss is not finite")


if __name__ == "__main__":
    main()
