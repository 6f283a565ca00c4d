"""Loader memory: per-rank replicated multi-source loading vs Omni's central-state design.

R simulated data-parallel ranks (each a fresh Python process, like torchrun's) read a mixture
of S sources of webdataset shards (default 64 ranks x 300 sources; 4 shards x 50 samples per
source, each sample a short text and a small PNG). Designs, side by side:

- ``replicated``: every rank opens every source the way a per-rank webdataset pipeline does:
  per source ``wds.WebDataset(shards, resampled=True)`` -> decode (the same PIL decode as
  Omni) -> ``shuffle(100)`` (a buffer of 100 decoded samples), all sources mixed with
  ``wds.RandomMix``; the rank builds its micro-batches from the mixed stream with the same
  tokenizer, image processor and packing as Omni.
- ``central``: one planner process holds a ``Planner`` over all sources (loads the indices,
  plans every step for every rank) and hands each rank its unit ids; each rank process runs a
  ``SampleConstructor`` (built by the planner process and sent pickled: its per-source readers
  carry the key -> (shard, position) maps) that opens only the shards its samples live in.
- ``disaggregated`` (the layout of Omni's Ray backend, simulated with plain processes): the
  planner process as above; ``--loaders`` source-loader processes (default one per 8 ranks)
  each hold the readers (open shards, key maps) of a slice of the sources and send the raw
  fields of the planned samples; each rank process only decodes, tokenizes and packs (its
  constructor holds no shards and no key maps). The raw fields travel through files, one
  pickle per step, so a rank holds one step of them at a time, as with Ray's object store.
- ``inline`` (Omni's ``build_loader(backend="inline", num_workers=0)`` as shipped today): every
  rank process loads all indices and runs its own copy of the planner next to its constructor.

By default (full mode) 16 evenly spaced ranks of the 64 are run and measured and the rank sum
is their mean x 64 (``--sample 0`` runs and measures all 64: about 3x longer; on this 2-core
machine a replicated rank takes ~15 s of CPU just to fill its 300 shuffle buffers); the
per-rank spread is printed so the extrapolation can be judged.

Every rank hands out the same number of samples (``--steps`` x global batch / ranks), enough
that a replicated rank has drawn from (nearly) every source, so every design is measured in
its steady state; each process measures itself (psutil ``memory_full_info``: RSS, USS, PSS;
and the anonymous part from /proc/self/smaps_rollup) after its last step while it still holds
everything it built. USS includes the touched pages of memory-mapped shards (file-backed,
reclaimable, shared by ranks that map the same shard at the same time): the anonymous column
shows the rest. Processes run a few at a time (``--parallel``), so PSS (which splits shared
pages among the processes alive at that moment) is saved but not comparable across designs;
USS (private pages) is the headline. Nothing is subtracted; an idle interpreter with the same
imports is measured too, so the fixed per-process part can be judged. Not counted: DataLoader
worker processes (there are none here: one process per rank in every design; real per-rank
pipelines usually run several workers, each with its own copy of the replicated state), Ray's
object store (the disaggregated design passes raw samples through files), the page cache
outside the processes' own mappings, and the driver.

    python scripts/bench/loader_memory.py [--quick] [--out docs/img] [--ranks 64 --sources 300]
        [--sample 16] [--image-side 32] [--designs replicated,central,disaggregated,inline]
"""
from __future__ import annotations

import io
import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, median, parser, save, table

SHARDS_PER_SOURCE = 4
SAMPLES_PER_SHARD = 50
IMAGE_SIDE = 32
SHUFFLE = 100
PATCH = 16
BUDGET = 1024
PER_RANK = 8  # samples per rank per step
DESIGNS = ("replicated", "central", "disaggregated", "inline")


# ---- data ---------------------------------------------------------------------------------
def _pngs(side: int, k: int = 64) -> list[bytes]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(k):
        base = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8).repeat(side // 4, 0).repeat(side // 4, 1)
        noise = rng.integers(0, 24, base.shape, dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(base + noise).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def ensure_data(root: Path, sources: int, side: int = IMAGE_SIDE) -> Path:
    """S sources of shards + their indices + mixture.yaml, written once (a .complete marker).

    Captions have random lengths, so samples differ in cost (equal costs would let the
    balancer deal each source's samples to the same ranks step after step)."""
    import numpy as np

    from dataloading.index import build_index
    from dataloading.shards import write_shards

    data = root / (f"memory-s{sources}-v2" + ("" if side == IMAGE_SIDE else f"-px{side}"))
    if (data / ".complete").exists():
        return data
    t0 = time.perf_counter()
    pngs = _pngs(side)
    words = ("red", "green", "blue", "square", "stripe", "dot", "left", "right", "top", "bottom", "small", "large")
    n = SHARDS_PER_SOURCE * SAMPLES_PER_SHARD
    for s in range(sources):
        name = f"src{s:03d}"
        rng = np.random.default_rng(s)

        def caption(i):
            return f"pattern {(s * 7 + i) % len(pngs)}: " + " ".join(rng.choice(words, int(rng.integers(2, 40))))

        samples = ({"__key__": f"{name}-{i:05d}", "txt": "<image>\nDescribe the image.",
                    "png": pngs[(s * 7 + i) % len(pngs)], "response.txt": caption(i)} for i in range(n))
        write_shards(samples, data / name, name, SAMPLES_PER_SHARD)
        build_index(data / name, workers=1, progress=False)
    lines = ["sources:"] + [f"  - {{name: src{s:03d}, path: src{s:03d}, weight: 1.0}}" for s in range(sources)]
    (data / "mixture.yaml").write_text("\n".join(lines) + "\n")
    (data / ".complete").write_text("ok\n")
    print(f"wrote {sources} sources x {n} samples to {data} in {time.perf_counter() - t0:.0f}s", flush=True)
    return data


# ---- what every process imports (so the idle baseline is comparable) -----------------------
def _imports():
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import psutil  # noqa: F401
    import torch  # noqa: F401
    import webdataset  # noqa: F401
    import wids  # noqa: F401

    import dataloading.constructor  # noqa: F401
    import dataloading.index  # noqa: F401
    import dataloading.loader  # noqa: F401
    import dataloading.planner  # noqa: F401


class PatchProcessor:
    """A fixed patchifier: resize to multiples of 16 px, 16x16x3 patches, one token per patch."""

    modality = "image"

    def _grid(self, h: int, w: int) -> tuple[int, int]:
        return max(1, round(h / PATCH)), max(1, round(w / PATCH))

    def num_tokens_from_meta(self, meta: dict) -> int:
        gh, gw = self._grid(meta["height"], meta["width"])
        return gh * gw

    def __call__(self, raw):
        import numpy as np
        import torch
        from PIL import Image

        from dataloading.media import MediaItem

        gh, gw = self._grid(*raw.shape[:2])
        if raw.shape[:2] != (gh * PATCH, gw * PATCH):
            raw = np.asarray(Image.fromarray(raw).resize((gw * PATCH, gh * PATCH)))
        x = raw.astype(np.float32) / 255.0
        patches = x.reshape(gh, PATCH, gw, PATCH, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, -1)
        return MediaItem(torch.from_numpy(np.ascontiguousarray(patches)), (gh, gw), gh * gw)


def _open_shards(readers) -> int:
    """Shards held open by these SourceReaders (their own LRU, or a pool they share)."""
    pools, n = {}, 0
    for r in readers:
        pool = getattr(r, "pool", None)
        pool = getattr(r, "_own", None) if pool is None else pool
        if pool is not None:
            pools[id(pool)] = len(pool)
        elif hasattr(r, "_open"):
            n += len(r._open)
    return n + sum(pools.values())


def _memory() -> dict:
    """RSS, USS, PSS (psutil) and, from /proc/self/smaps_rollup, the anonymous part (heap and
    buffers; the rest of USS is file-backed pages such as memory-mapped shards)."""
    import psutil

    m = psutil.Process().memory_full_info()
    out = {"rss": m.rss, "uss": m.uss, "pss": getattr(m, "pss", 0), "anon": 0}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    out["anon"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


# ---- the per-process roles ------------------------------------------------------------------
def role_idle(args) -> dict:
    return _memory()


def role_replicated(args) -> dict:
    import random

    import numpy as np
    import webdataset as wds

    from dataloading.constructor import SampleConstructor, assemble, pack
    from dataloading.sample import decode_sample
    from dataloading.shards import list_shards
    from dataloading.tokenizer import ByteTokenizer

    random.seed(1000 + args.rank)
    data = Path(args.data)
    names = sorted(p.name for p in data.iterdir() if p.is_dir())[: args.sources]

    def decode(sample):
        fields = {k: v for k, v in sample.items() if not k.startswith("__")}
        src = Path(sample["__url__"]).parent.name
        return decode_sample(f"{src}/{sample['__key__']}", fields)

    pipes = []
    for name in names:
        urls = [str(p) for p in list_shards(data / name)]
        pipes.append(wds.WebDataset(urls, resampled=True, shardshuffle=False, nodesplitter=None, seed=args.rank)
                     .map(decode).shuffle(SHUFFLE, initial=SHUFFLE))
    mixed = iter(wds.RandomMix(pipes, [1.0] * len(pipes)))
    # Only the tokenize/pack half of the constructor: no readers, samples come from the stream.
    builder = SampleConstructor({}, ByteTokenizer(), {"image": PatchProcessor()}, BUDGET)
    seen = set()
    batch = None
    for _ in range(args.steps):
        done = [builder.tokenize(next(mixed)) for _ in range(args.per_rank)]
        seen.update(t.sample_id.split("/", 1)[0] for t in done)
        batch = [assemble(g) for g in pack(done, BUDGET)]
    mem = _memory()  # while the pipelines, their buffers and the last step are alive
    return {**mem, "sources_touched": len(seen), "tokens_last_step": int(np.sum([mb.num_tokens for mb in batch]))}


def _central_constructor(planner, indices):
    from dataloading.constructor import SampleConstructor
    from dataloading.errors import ProblemCounter
    from dataloading.tokenizer import ByteTokenizer

    return SampleConstructor({n: ix.reader(n) for n, ix in indices.items()}, ByteTokenizer(),
                             {"image": PatchProcessor()}, BUDGET, ProblemCounter("stop"))


def role_planner(args) -> dict:
    """Loads the indices, plans every step for every rank, writes each rank's unit ids."""
    from dataloading.index import load_index
    from dataloading.planner import Planner
    from dataloading.tokenizer import ByteTokenizer

    data = Path(args.data)
    names = sorted(p.name for p in data.iterdir() if p.is_dir())[: args.sources]
    t0 = time.perf_counter()
    indices = {n: load_index(data / n, progress=False) for n in names}
    planner = Planner(indices, {n: 1.0 for n in names}, 0, args.per_rank * args.ranks, args.ranks,
                      tokenizer=ByteTokenizer(), processors={"image": PatchProcessor()}, budget=BUDGET)
    per_rank = [[] for _ in range(args.ranks)]
    for _ in range(args.steps):
        plan = planner.plan()
        planner.advance()
        for r in range(args.ranks):
            per_rank[r].append(plan.rank(r))
    plan_s = time.perf_counter() - t0
    out = Path(args.plans)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "constructor.pkl", "wb") as f:
        pickle.dump(_central_constructor(planner, indices), f)
    for r, steps in enumerate(per_rank):
        (out / f"rank{r:04d}.json").write_text(json.dumps(steps))
    del per_rank
    mem = _memory()  # while the planner and the indices are alive
    return {**mem, "plan_s": plan_s, "state_dict_bytes": len(json.dumps(planner.state_dict()))}


def role_central(args) -> dict:
    out = Path(args.plans)
    with open(out / "constructor.pkl", "rb") as f:
        constructor = pickle.load(f)
    steps = json.loads((out / f"rank{args.rank:04d}.json").read_text())
    batch, samples = None, 0
    for micro_batches in steps:
        batch, _ = constructor.build_planned(micro_batches)
        samples += sum(len(mb) for mb in micro_batches)
    shards = _open_shards(constructor.readers.values())
    mem = _memory()  # while the constructor (open shards, key maps) and the last step are alive
    return {**mem, "samples": samples, "open_shards": shards, "tokens_last_step": sum(mb.num_tokens for mb in batch)}


def _plan_of(args, rank: int) -> list:
    return json.loads((Path(args.plans) / f"rank{rank:04d}.json").read_text())


def role_loader(args) -> dict:
    """A source-loader process (the Ray backend's SourceLoaderActor, without Ray): holds the
    readers (open shards, key maps) of every ``loaders``-th source and serves the raw fields
    of the planned samples of those sources to every measured rank, one pickle per step."""
    from dataloading.index import load_index

    data = Path(args.data)
    names = sorted(p.name for p in data.iterdir() if p.is_dir())[: args.sources][args.rank::args.loaders]
    readers = {n: load_index(data / n, progress=False).reader(n) for n in names}
    served = 0
    for r in args.measured:
        with open(Path(args.plans) / f"raw-l{args.rank:03d}-r{r:04d}.pkl", "wb") as f:
            for micro_batches in _plan_of(args, r):
                fields = {}
                for uid in (u for mb in micro_batches for u in mb):
                    src, _, key = uid.partition("/")
                    if src in readers:
                        fields[uid] = readers[src].get(key)
                served += len(fields)
                pickle.dump(fields, f, protocol=pickle.HIGHEST_PROTOCOL)
    mem = _memory()  # while its readers (open shards, key maps) are alive
    return {**mem, "served": served, "open_shards": _open_shards(readers.values())}


class _StepFields:
    """A reader of one source for a rank of the disaggregated design: the raw fields the
    source loaders sent for the current step (no shards, no key maps here)."""

    def __init__(self, name: str, current: dict):
        self.name, self.current = name, current

    def get(self, key: str) -> dict:
        return self.current[f"{self.name}/{key}"]


def role_disaggregated(args) -> dict:
    from dataloading.constructor import SampleConstructor
    from dataloading.errors import ProblemCounter
    from dataloading.tokenizer import ByteTokenizer

    data = Path(args.data)
    names = sorted(p.name for p in data.iterdir() if p.is_dir())[: args.sources]
    current: dict = {}
    constructor = SampleConstructor({n: _StepFields(n, current) for n in names}, ByteTokenizer(),
                                    {"image": PatchProcessor()}, BUDGET, ProblemCounter("stop"))
    feeds = [open(Path(args.plans) / f"raw-l{k:03d}-r{args.rank:04d}.pkl", "rb") for k in range(args.loaders)]
    batch, samples = None, 0
    for micro_batches in _plan_of(args, args.rank):
        current.clear()
        for f in feeds:
            current.update(pickle.load(f))  # this step's raw samples, from every source loader
        batch, _ = constructor.build_planned(micro_batches)
        samples += sum(len(mb) for mb in micro_batches)
    for f in feeds:
        f.close()
    mem = _memory()  # while the constructor, the last step's raw fields and its batch are alive
    return {**mem, "samples": samples, "open_shards": 0, "tokens_last_step": sum(mb.num_tokens for mb in batch)}


def role_inline(args) -> dict:
    from dataloading.loader import build_loader
    from dataloading.tokenizer import ByteTokenizer

    loader = build_loader(Path(args.data) / "mixture.yaml", ByteTokenizer(), {"image": PatchProcessor()}, seed=0,
                          global_batch_size=args.per_rank * args.ranks, dp_size=args.ranks, dp_rank=args.rank,
                          micro_batch_tokens=BUDGET, num_workers=0, progress=False)
    batch, samples = None, 0
    for _ in range(args.steps):
        batch = next(loader)
        samples += sum(len(mb.sample_ids) for mb in batch.micro_batches)
    shards = _open_shards(loader.constructor.readers.values())
    mem = _memory()  # while the loader (planner, indices, constructor) and the last step are alive
    return {**mem, "samples": samples, "open_shards": shards}


ROLES = {"idle": role_idle, "replicated": role_replicated, "planner": role_planner, "central": role_central,
         "loader": role_loader, "disaggregated": role_disaggregated, "inline": role_inline}


def worker_main(args) -> None:
    t0 = time.perf_counter()
    _imports()
    import_s = time.perf_counter() - t0
    info = ROLES[args.role](args)
    info.update(role=args.role, rank=args.rank, import_s=import_s, wall_s=time.perf_counter() - t0)
    print("RESULT " + json.dumps(info), flush=True)


# ---- the driver -------------------------------------------------------------------------------
def spawn(role: str, args, ranks, parallel: int) -> list[dict]:
    """Run one process per rank (a fresh interpreter each), ``parallel`` at a time."""
    base = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--data", str(args.data),
            "--sources", str(args.sources), "--ranks", str(args.ranks), "--steps", str(args.steps),
            "--per-rank", str(args.per_rank), "--plans", str(args.plans), "--loaders", str(args.loaders),
            "--measured", ",".join(map(str, args.measured))]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    todo, running, results = list(ranks), [], []
    while todo or running:
        while todo and len(running) < parallel:
            r = todo.pop(0)
            running.append((r, subprocess.Popen(base + ["--rank", str(r)], stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True, env=env)))
        r, p = running.pop(0)
        out, err = p.communicate()
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"{role} rank {r} failed (exit {p.returncode}):\n{err[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def measured_ranks(ranks: int, sample: int) -> list[int]:
    """``sample`` ranks spread evenly over ``ranks`` (all of them when sample >= ranks)."""
    if sample <= 0 or sample >= ranks:
        return list(range(ranks))
    return sorted({round(i * ranks / sample) for i in range(sample)})


def totals(procs: list[dict], ranks: int) -> dict:
    """Summed memory of the design's processes: the non-rank processes (the planner) once, the
    rank processes summed; when only some ranks were measured, their mean times ``ranks``."""
    rank = [p for p in procs if p["process"] == "rank"]
    other = [p for p in procs if p["process"] != "rank"]
    out = {}
    for k in ("rss", "uss", "pss", "anon"):
        out[k] = sum(p[k] for p in other) + sum(p[k] for p in rank) * ranks / len(rank)
    out["processes"] = len(other) + ranks
    out["estimated"] = len(rank) < ranks
    return out


def run(args) -> dict:
    from dataloading.demo import cache_root

    root = Path(args.data_root) if args.data_root else cache_root() / "bench"
    t0 = time.perf_counter()
    args.data = ensure_data(root, args.sources, args.image_side)
    data_s = time.perf_counter() - t0
    args.plans = Path(args.out) / ".loader_memory_plans"
    res = {"config": {"ranks": args.ranks, "sources": args.sources, "shards_per_source": SHARDS_PER_SOURCE,
                      "samples_per_shard": SAMPLES_PER_SHARD, "image_side": args.image_side, "shuffle_buffer": SHUFFLE,
                      "steps": args.steps, "samples_per_rank_per_step": args.per_rank, "parallel": args.parallel,
                      "micro_batch_tokens": BUDGET, "data": str(args.data), "data_s": data_s},
           "designs": {}}
    idle = spawn("idle", args, range(3), args.parallel)
    res["idle"] = {k: median([x[k] for x in idle]) for k in ("rss", "uss", "pss", "anon")}
    print(f"idle interpreter (median of 3): RSS {res['idle']['rss'] / 2**20:.0f} MiB, "
          f"USS {res['idle']['uss'] / 2**20:.0f} MiB", flush=True)
    ranks = args.measured = measured_ranks(args.ranks, args.sample)
    res["config"]["measured_ranks"] = ranks
    res["config"]["source_loaders"] = args.loaders
    for design in args.designs:
        t1 = time.perf_counter()
        procs = []
        if design in ("central", "disaggregated"):
            procs += [dict(x, process="planner") for x in spawn("planner", args, [0], 1)]
        if design == "disaggregated":
            procs += [dict(x, process="loader") for x in spawn("loader", args, range(args.loaders), args.parallel)]
        procs += [dict(x, process="rank") for x in spawn(design, args, ranks, args.parallel)]
        res["designs"][design] = {"processes": procs, "wall_s": time.perf_counter() - t1}
        res["designs"][design]["total"] = tot = totals(procs, args.ranks)
        print(f"[{design}] {len(procs)} processes measured, {args.ranks} ranks: USS {tot['uss'] / 2**30:.2f} GiB, "
              f"RSS {tot['rss'] / 2**30:.2f} GiB ({time.perf_counter() - t1:.0f}s)", flush=True)
    for f in Path(args.plans).glob("*"):
        f.unlink()
    Path(args.plans).rmdir()
    return res


def report(res: dict) -> str:
    gib = 2 ** 30
    mib = 2 ** 20
    idle = res["idle"]
    c = res["config"]
    rows = []
    base = res["designs"].get("replicated", {}).get("total")
    base_extra = base["uss"] - base["processes"] * idle["uss"] if base else None
    base_anon = base["anon"] - base["processes"] * idle["anon"] if base else None
    for design, d in res["designs"].items():
        ranks = [p for p in d["processes"] if p["process"] == "rank"]
        tot = d["total"]
        extra = tot["uss"] - tot["processes"] * idle["uss"]
        anon = tot["anon"] - tot["processes"] * idle["anon"]
        per = [p["uss"] / mib for p in ranks]
        rows.append([design, tot["processes"], f"{tot['uss'] / gib:.2f}", f"{tot['rss'] / gib:.2f}",
                     f"{median(per):.0f} ({min(per):.0f}-{max(per):.0f})", f"{extra / gib:.2f}", f"{anon / gib:.2f}",
                     f"**{base['uss'] / tot['uss']:.2f}x**" if base else "",
                     f"{base['rss'] / tot['rss']:.2f}x" if base else "",
                     f"{base_extra / max(extra, 1):.1f}x" if base else "",
                     f"{base_anon / max(anon, 1):.1f}x" if base else ""])
    measured = len(c.get("measured_ranks", range(c["ranks"])))
    how = ("every rank measured" if measured >= c["ranks"] else
           f"{measured} of {c['ranks']} ranks measured (evenly spaced), rank sums = mean x {c['ranks']}")
    lines = [f"{c['ranks']} ranks x {c['sources']} sources ({c['shards_per_source']} shards x {c['samples_per_shard']} "
             f"samples each, {c['image_side']}x{c['image_side']} PNG + text), {c['steps']} steps x "
             f"{c['samples_per_rank_per_step']} samples per rank, {how}; idle interpreter with the same imports: "
             f"USS {idle['uss'] / mib:.0f} MiB, RSS {idle['rss'] / mib:.0f} MiB, anonymous {idle['anon'] / mib:.0f} MiB "
             f"per process. Ratios are replicated / design (higher = the design uses less).\n",
             table(["design", "processes", "sum USS GiB", "sum RSS GiB", "USS per rank MiB (median, min-max)",
                    "USS above idle GiB", "anonymous above idle GiB", "ratio USS", "ratio RSS",
                    "ratio USS above idle", "ratio anonymous above idle"], rows)]
    notes = []
    for design, d in res["designs"].items():
        ranks = [p for p in d["processes"] if p["process"] == "rank"]
        if design == "replicated":
            notes.append(f"replicated: sources touched per rank (median) "
                         f"{median([p['sources_touched'] for p in ranks]):.0f} of {c['sources']}")
        elif design != "disaggregated":
            notes.append(f"{design}: shards open per rank (median) {median([p['open_shards'] for p in ranks]):.0f} of "
                         f"{c['sources'] * c['shards_per_source']}")
        loaders = [p for p in d["processes"] if p["process"] == "loader"]
        if loaders:
            notes.append(f"{design}: {len(loaders)} source-loader processes, USS {median([p['uss'] for p in loaders]) / mib:.0f}"
                         f" MiB each (median), {median([p['open_shards'] for p in loaders]):.0f} shards open each")
        planner = [p for p in d["processes"] if p["process"] == "planner"]
        if planner:
            notes.append(f"{design}: planner process: USS {planner[0]['uss'] / mib:.0f} MiB, RSS {planner[0]['rss'] / mib:.0f}"
                         f" MiB; planned {c['steps']} steps for {c['ranks']} ranks in {planner[0]['plan_s']:.1f}s "
                         f"(index load included); its state_dict is {planner[0]['state_dict_bytes']} bytes of JSON")
        notes.append(f"{design}: wall time per rank process (median) "
                     f"{median([p['wall_s'] for p in ranks]):.1f}s, of which imports {median([p['import_s'] for p in ranks]):.1f}s")
    return "\n".join(lines + [""] + ["- " + n for n in notes])


def plot(res: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2 ** 30
    designs = list(res["designs"])
    idle = res["idle"]
    c = res["config"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    base = res["designs"].get("replicated", {}).get("total")
    for ax, above in zip(axes, (False, True)):
        top = 0.0
        for i, d in enumerate(designs):
            tot = res["designs"][d]["total"]
            n = tot["processes"]
            fixed = 0.0 if above else n * idle["uss"] / gib
            anon = max(tot["anon"] - n * idle["anon"], 0) / gib
            files = max(tot["uss"] - n * idle["uss"], 0) / gib - anon
            if not above:
                ax.bar(i, fixed, color="#c8c8c8", label="idle interpreter x processes" if i == 0 else None)
            ax.bar(i, anon, bottom=fixed, color="C0", label="anonymous above idle" if i == 0 else None)
            ax.bar(i, max(files, 0), bottom=fixed + anon, color="#9ecae1",
                   label="file-backed above idle (mapped shards)" if i == 0 else None)
            h = fixed + anon + max(files, 0)
            top = max(top, h)
            if above:
                extra = tot["uss"] - n * idle["uss"]
                text = f"{extra / gib:.2f} GiB"
                base_extra = base["uss"] - base["processes"] * idle["uss"] if base else 0
                if base and d != "replicated":
                    text += (f"\n{base_extra / max(extra, 1):.1f}x less" if extra < base_extra
                             else f"\n{extra / max(base_extra, 1):.1f}x more")
            else:
                text = f"{tot['uss'] / gib:.1f} GiB" + (f"\n{base['uss'] / tot['uss']:.2f}x" if base and d != "replicated"
                                                       else "")
            ax.text(i, h, text, ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, top * 1.25)
        ax.set_xticks(range(len(designs)), designs, fontsize=9)
        ax.set_ylabel("GiB, summed over all processes")
        ax.set_title("USS above an idle interpreter" if above else "USS (private memory), nothing subtracted",
                     fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"Loader memory: {c['ranks']} ranks x {c['sources']} sources, {c['image_side']} px images", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--role", choices=sorted(ROLES), help=argparse_hidden())
    p.add_argument("--rank", type=int, default=0, help=argparse_hidden())
    p.add_argument("--plans", default="", help=argparse_hidden())
    p.add_argument("--data", default="", help=argparse_hidden())
    p.add_argument("--data-root", default="", help="where the shards are written (default $OMNI_CACHE/bench)")
    p.add_argument("--ranks", type=int, default=None)
    p.add_argument("--sources", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="steps handed out per rank")
    p.add_argument("--per-rank", type=int, default=PER_RANK, help="samples per rank per step")
    p.add_argument("--parallel", type=int, default=2, help="rank processes alive at once")
    p.add_argument("--designs", default=",".join(DESIGNS))
    p.add_argument("--sample", type=int, default=None,
                   help="measure this many evenly spaced ranks and scale their mean to --ranks "
                        "(default: 16 of 64 in full mode, all in --quick; 0 = all)")
    p.add_argument("--loaders", type=int, default=None,
                   help="source-loader processes of the disaggregated design (default: ranks / 8, one per node of 8)")
    p.add_argument("--measured", type=lambda t: [int(x) for x in t.split(",") if x], default=[],
                   help=argparse_hidden())
    p.add_argument("--image-side", type=int, default=IMAGE_SIDE, help="PNG side in pixels (multiple of 4)")
    p.add_argument("--from-json", default="", help="re-print the table and re-draw the plot of a saved result")
    args = p.parse_args()
    if args.role:
        worker_main(args)
        return
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        for d in res["designs"].values():
            d["total"] = totals(d["processes"], res["config"]["ranks"])
        print(report(res))
        plot(res, Path(args.from_json).with_suffix(".png"))
        return
    args.ranks = args.ranks or (4 if args.quick else 64)
    args.sources = args.sources or (20 if args.quick else 300)
    args.sample = (0 if args.quick else 16) if args.sample is None else args.sample
    args.loaders = args.loaders or max(1, args.ranks // 8)
    # Enough samples that a replicated rank draws from (nearly) every source: ~ S ln S * 1.4.
    args.steps = args.steps or max(4, math.ceil(1.4 * args.sources * math.log(args.sources) / args.per_rank))
    args.designs = [d for d in args.designs.split(",") if d]
    t0 = time.perf_counter()
    res = run(args)
    res["wall_s"] = time.perf_counter() - t0
    print(report(res))
    name = "loader_memory" + ("_quick" if args.quick else "") + ("" if args.image_side == IMAGE_SIDE else
                                                                 f"_px{args.image_side}")
    path = save(args.out, name, res)
    png = path.with_suffix(".png")
    plot(res, png)
    print(f"\nwrote {path} and {png} ({res['wall_s']:.0f}s)")


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
