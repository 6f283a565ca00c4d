"""Loader throughput: Omni's loader vs plain webdataset + torch DataLoader, side by side.

Both read the demo dataset (three sources: PNG + caption, WAV + transcript, text; mixed
0.6 / 0.2 / 0.2) and do the same work per sample: PIL decode of the image to uint8 RGB
(soundfile for the audio: ``dataloading.formats.sample.decode_sample``), the demo's SigLIP-style
image processor (64 px, 8 px patches) and Whisper-style log-mel processor, byte-level
tokenization with ``ByteTokenizer``, packing into 1024-token micro-batches (first-fit
decreasing) and assembling the packed tensors. Each step is a global batch of 64 samples on
one data-parallel rank.

- ``omni``: ``dataloading.serve.loader.build_loader`` (``data.backend=inline``): planner in the calling
  process, steps built in ``num_workers`` DataLoader workers by random access (wids) to the
  planned samples.
- ``webdataset``: per source ``wds.WebDataset(shards, resampled=True)`` -> ``shuffle(100)``
  on the raw samples -> decode, mixed by ``wds.RandomMix`` with the same weights, in a
  ``torch.utils.data.DataLoader`` with the same number of workers; each worker builds whole
  steps (64 samples -> micro-batches) with the same tokenizer, processors and packing.

Throughput = samples handed out / wall time over ``--steps`` steps after ``--warmup`` steps
(worker start-up and buffer fill excluded); every setting is run ``--repeat`` times,
interleaved, and the median is reported.

    python scripts/bench/loader_throughput.py [--quick] [--out docs/img]
"""
from __future__ import annotations

import time

import torch.utils.data as tud

from _common import median, parser, save_and_plot, table

GLOBAL_BATCH = 64
BUDGET = 1024
SHUFFLE = 100


def processors():
    """The demo's encoders' processors (conf/encoders/{vision,audio}/*_demo.yaml)."""
    from omni.models.encoders.siglip import SiglipEncoder, SiglipEncoderConfig
    from omni.models.encoders.whisper import WhisperEncoder, WhisperEncoderConfig

    vision = SiglipEncoderConfig(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=64, patch_size=8, max_patches=64)
    audio = WhisperEncoderConfig(num_mel_bins=40, d_model=96, encoder_layers=2, encoder_attention_heads=4,
                                 encoder_ffn_dim=256, max_source_positions=64)
    return {"image": SiglipEncoder.processor(vision), "audio": WhisperEncoder.processor(audio)}


# ---- the webdataset baseline ---------------------------------------------------------------
def _decode(sample):
    from dataloading.formats.sample import decode_sample

    fields = {k: v for k, v in sample.items() if not k.startswith("__")}
    return decode_sample(sample["__key__"], fields)


class WdsSteps(tud.IterableDataset):
    """An IterableDataset of steps: the standard webdataset mixture, then Omni's tokenize/pack."""

    def __init__(self, mixture, procs, seed: int = 0):
        from dataloading.plan.mixture import load_mixture

        self.mix = load_mixture(mixture)
        self.procs = procs
        self.seed = seed

    def __iter__(self):
        import random

        import webdataset as wds

        from dataloading.construct.constructor import SampleConstructor, assemble, pack
        from dataloading.formats.tokenizer import ByteTokenizer
        from dataloading.index.shards import list_shards

        info = tud.get_worker_info()
        wid = info.id if info else 0
        random.seed(self.seed * 1000 + wid)
        pipes, weights = [], []
        for s in self.mix.sources:
            urls = [str(p) for p in list_shards(s.path)]
            pipes.append(wds.WebDataset(urls, resampled=True, shardshuffle=False, nodesplitter=None,
                                        seed=self.seed * 1000 + wid).shuffle(SHUFFLE).map(_decode))
            weights.append(float(s.weight))
        stream = iter(wds.RandomMix(pipes, weights))
        builder = SampleConstructor({}, ByteTokenizer(), self.procs, BUDGET)  # tokenize/pack only
        while True:
            done = [builder.tokenize(next(stream)) for _ in range(GLOBAL_BATCH)]
            yield [assemble(g) for g in pack(done, BUDGET)]


def _wds_loader(mixture, procs, workers: int):
    from dataloading.serve.loader import _identity

    return iter(tud.DataLoader(WdsSteps(mixture, procs), batch_size=None, collate_fn=_identity, num_workers=workers,
                               prefetch_factor=2 if workers else None, persistent_workers=False))


# ---- Omni ---------------------------------------------------------------------------------
def _omni_loader(mixture, procs, workers: int):
    from dataloading.config import DataConfig
    from dataloading.formats.tokenizer import ByteTokenizer
    from dataloading.serve.loader import build_loader

    data = DataConfig(mixture=str(mixture), global_batch_size=GLOBAL_BATCH, micro_batch_tokens=BUDGET,
                      num_workers=workers, backend="inline")
    return build_loader(data, ByteTokenizer(), procs, seed=0, dp_size=1, dp_rank=0, progress=False)


def _samples(step) -> int:
    mbs = step.micro_batches if hasattr(step, "micro_batches") else step
    return sum(len(mb.sample_ids) for mb in mbs)


def measure(kind: str, mixture, procs, workers: int, warmup: int, steps: int) -> dict:
    t0 = time.perf_counter()
    it = _omni_loader(mixture, procs, workers) if kind == "omni" else _wds_loader(mixture, procs, workers)
    for _ in range(warmup):
        next(it)
    t1 = time.perf_counter()
    n = 0
    for _ in range(steps):
        n += _samples(next(it))
    dt = time.perf_counter() - t1
    if kind == "omni":
        it.close()
    else:
        it._shutdown_workers()
    return {"samples": n, "seconds": dt, "samples_per_s": n / dt, "startup_s": t1 - t0}


def run(args) -> dict:
    from dataloading.demo import ensure_demo_dataset

    scale = 0.2 if args.quick else 1.0
    data = ensure_demo_dataset(scale=scale, progress=False)
    mixture = data / "mixture.yaml"
    procs = processors()
    workers = (1, 2)
    repeat = args.repeat or (1 if args.quick else 3)
    warmup = 3 if args.quick else 5
    steps = args.steps or (8 if args.quick else 80)
    runs: dict[str, list[dict]] = {}
    for r in range(repeat):
        for w in workers:
            for kind in ("omni", "webdataset"):
                m = measure(kind, mixture, procs, w, warmup, steps)
                runs.setdefault(f"{kind}/{w}", []).append(m)
                print(f"  rep {r + 1}/{repeat} {kind:10s} workers={w}: {m['samples_per_s']:.0f} samples/s "
                      f"(start-up + warm-up {m['startup_s']:.1f}s)", flush=True)
    out = {"config": {"data": str(data), "scale": scale, "global_batch": GLOBAL_BATCH, "micro_batch_tokens": BUDGET,
                      "warmup_steps": warmup, "steps": steps, "repeat": repeat, "workers": list(workers),
                      "shuffle_buffer": SHUFFLE},
           "runs": runs, "median": {k: median([m["samples_per_s"] for m in v]) for k, v in runs.items()}}
    return out


def report(res: dict) -> str:
    rows = []
    med = res["median"]
    for w in res["config"]["workers"]:
        o, b = med[f"omni/{w}"], med[f"webdataset/{w}"]
        spread = {k: (min(m["samples_per_s"] for m in res["runs"][f"{k}/{w}"]),
                      max(m["samples_per_s"] for m in res["runs"][f"{k}/{w}"])) for k in ("omni", "webdataset")}
        rows.append([w, f"{o:.0f} ({spread['omni'][0]:.0f}-{spread['omni'][1]:.0f})",
                     f"{b:.0f} ({spread['webdataset'][0]:.0f}-{spread['webdataset'][1]:.0f})", f"{o / b:.2f}x"])
    c = res["config"]
    head = (f"Demo data (scale {c['scale']:g}), {c['global_batch']} samples per step, {c['steps']} steps timed after "
            f"{c['warmup_steps']} warm-up steps, median of {c['repeat']} (min-max):\n")
    return head + "\n" + table(["workers", "Omni samples/s", "webdataset + DataLoader samples/s",
                                "Omni / webdataset"], rows)


def plot(res: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ws = res["config"]["workers"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    x = np.arange(len(ws))
    for j, kind in enumerate(("omni", "webdataset")):
        vals = [res["median"][f"{kind}/{w}"] for w in ws]
        lo = [v - min(m["samples_per_s"] for m in res["runs"][f"{kind}/{w}"]) for v, w in zip(vals, ws)]
        hi = [max(m["samples_per_s"] for m in res["runs"][f"{kind}/{w}"]) - v for v, w in zip(vals, ws)]
        ax.bar(x + (j - 0.5) * 0.38, vals, 0.38, yerr=[lo, hi], capsize=3,
               label="Omni (build_loader, inline)" if kind == "omni" else "webdataset + DataLoader")
    for i, w in enumerate(ws):
        ratio = res["median"][f"omni/{w}"] / res["median"][f"webdataset/{w}"]
        top = max(res["median"][f"omni/{w}"], res["median"][f"webdataset/{w}"])
        ax.text(i, top * 1.08, f"{ratio:.2f}x", ha="center")
    ax.set_xticks(x, [f"{w} worker{'s' if w > 1 else ''}" for w in ws])
    ax.set_ylabel("samples / s (median, min-max)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    ax.set_title("Loader throughput on the demo data")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="timed steps per run")
    p.add_argument("--repeat", type=int, default=None, help="runs per setting (median reported)")
    args = p.parse_args()
    t0 = time.perf_counter()
    res = run(args)
    res["wall_s"] = time.perf_counter() - t0
    print(report(res))
    save_and_plot(args.out, "loader_throughput" + ("_quick" if args.quick else ""), res, plot)


if __name__ == "__main__":
    main()
