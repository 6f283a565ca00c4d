"""Loader memory: per-rank replicated multi-source loading vs Omni's central-state designs.

R simulated data-parallel ranks (each a fresh Python process, like torchrun's) read a mixture
of S sources of webdataset shards (default 64 ranks x 300 sources; 4 shards x 50 samples per
source, each sample a short text and a small PNG), each rank with ``--workers`` W DataLoader
worker processes (default: 1, 4 and 8, one run each). Designs, side by side:

- ``replicated``: what a per-rank webdataset pipeline does: every worker opens every source,
  per source ``wds.WebDataset(shards, resampled=True)`` -> decode (the same PIL decode as
  Omni) -> ``shuffle(100)`` (a buffer of 100 decoded samples), all sources mixed with
  ``wds.RandomMix``, in a ``torch.utils.data.DataLoader`` with W workers (each worker builds
  whole steps with the same tokenizer, image processor and packing as Omni).
- ``central``: one planner process holds the run's ``Planner`` over all sources
  (``build_planner`` as shipped) and plans every step for every rank; each rank process holds
  a ``SampleConstructor`` built as ``build_loader`` builds it (shipped defaults: shard cap
  ``DataConfig.max_open_shards``) and sent to it pickled, and builds its planned steps in W
  DataLoader workers with the inline loader's own ``BuildSteps``.
- ``inline``: ``build_loader`` with ``data.backend=inline data.num_workers=W`` as shipped: every rank process
  loads all indices and runs its own copy of the planner; its W DataLoader workers (forked)
  build the steps.
- ``ray`` (not run by default): ``build_loader`` with ``data.backend=ray`` as shipped: the first measured
  rank starts a local Ray (no address: loopback, as shipped) and the others join it (see
  ``_join_ray``); the run's actors (one planner, the source loaders: by default one per source
  or a little more, one constructor per rank) and Ray's own processes (gcs_server, raylet,
  agents, monitors, idle workers) are measured with the ranks. W does not apply (one
  constructor actor per rank).
- ``disaggregated`` (not run by default): the Ray backend's layout simulated with plain
  processes and no Ray: the planner process; ``--loaders`` source-loader processes that hold
  the shards; rank processes that only decode, tokenize and pack (raw fields through files).

Each worker process hands out ``--steps`` steps of ``--per-rank`` samples (so a rank hands out
steps x W), enough that every replicated worker has drawn from (nearly) every source: every
design is measured in its steady state. Then each rank process stops and waits while the
driver reads /proc/<pid>/smaps_rollup of it and of every process under it (its DataLoader
workers): RSS, USS (private pages), PSS (shared pages split among the processes that map
them: forked workers share their parent's pages copy-on-write) and PSS of anonymous memory
(heap; shared only within a process tree, so its sum counts every page once whatever else
runs). The Ray ranks run all at once and are measured in one snapshot with every Ray process.

By default (full mode) 4 evenly spaced ranks of the 64 are run and measured and the per-rank
part is their sum x 64 / 4 (``--sample 0``: all of them; the ranks of a design differ by under
1%, and the per-rank spread is printed); processes shared by the ranks (the
planner, the source loaders, Ray's processes and actors other than the constructors) are
counted once. An idle interpreter with the same imports, with W idle DataLoader workers, is
measured too, so the fixed part can be judged. Nothing is subtracted. Not counted: the page
cache outside the processes' own mappings and the driver.

    python scripts/bench/loader_memory.py [--quick] [--out docs/img] [--ranks 64 --sources 300]
        [--sample 4] [--workers 1,4,8] [--image-side 32] [--designs replicated,central,inline,ray]
        [--name NAME] [--from-json FILE]
"""
from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from _common import REPO, git_state, median, parser, save_and_plot, table

SHARDS_PER_SOURCE = 4
SAMPLES_PER_SHARD = 50
IMAGE_SIDE = 32
SHUFFLE = 100
PATCH = 16
BUDGET = 1024
PER_RANK = 8  # samples per rank per step
DESIGNS = ("replicated", "central", "inline", "ray", "disaggregated")
DEFAULT_DESIGNS = ("replicated", "central", "inline")
NO_WORKERS = ("ray", "disaggregated")  # designs W does not apply to: run once
MEM_KEYS = ("rss", "uss", "pss", "anon", "pss_anon", "pss_file", "pss_shmem")


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

    from dataloading.index.shards import write_shards
    from dataloading.index.source_index import build_index

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

    import dataloading.construct.constructor  # noqa: F401
    import dataloading.index.source_index  # noqa: F401
    import dataloading.serve.loader  # noqa: F401
    import dataloading.plan.planner  # noqa: F401


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

        from dataloading.formats.media import MediaItem

        gh, gw = self._grid(*raw.shape[:2])
        if raw.shape[:2] != (gh * PATCH, gw * PATCH):
            raw = np.asarray(Image.fromarray(raw).resize((gw * PATCH, gh * PATCH)))
        x = raw.astype(np.float32) / 255.0
        patches = x.reshape(gh, PATCH, gw, PATCH, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, -1)
        return MediaItem(torch.from_numpy(np.ascontiguousarray(patches)), (gh, gw), gh * gw)


# ---- measuring a process (the driver reads it from outside) ---------------------------------
def proc_memory(pid="self") -> dict:
    """RSS, USS (Private_Clean + Private_Dirty), PSS and its anonymous / file / shmem parts and
    the anonymous total of one process, from /proc/<pid>/smaps_rollup (bytes)."""
    f = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                f[key] = int(parts[0]) * 1024
    return {"rss": f.get("Rss", 0), "uss": f.get("Private_Clean", 0) + f.get("Private_Dirty", 0),
            "pss": f.get("Pss", 0), "anon": f.get("Anonymous", 0), "pss_anon": f.get("Pss_Anon", 0),
            "pss_file": f.get("Pss_File", 0), "pss_shmem": f.get("Pss_Shmem", 0)}


def _open_tars(pid) -> int:
    """Distinct shard files (*.tar) a process holds open."""
    paths = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.endswith(".tar"):
                paths.add(target)
    except OSError:
        pass
    return len(paths)


def _name(proc) -> str:
    """A process's name as ps shows it (Ray workers retitle themselves ``ray::<Actor>``)."""
    try:
        cmd = proc.cmdline()
    except Exception:
        return "?"
    if not cmd:
        return proc.name()
    head = cmd[0]
    if head.startswith("ray::"):
        return head.split()[0]
    if "python" in Path(head).name and len(cmd) > 1:
        script = next((c for c in cmd[1:] if not c.startswith("-")), cmd[1])
        return Path(script).name
    return Path(head).name


def _has_torch(pid) -> bool:
    """Whether the process has torch's library mapped (imported torch)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libtorch_cpu" in line for line in f)
    except OSError:
        return False


def measure_tree(pid: int) -> list[dict]:
    """Memory of a process and of every process under it (DataLoader workers), read at once."""
    import psutil

    root = psutil.Process(pid)
    procs = [root] + root.children(recursive=True)
    out = []
    for i, p in enumerate(procs):
        try:
            out.append({**proc_memory(p.pid), "pid": p.pid, "name": _name(p), "tree": "root" if i == 0 else "child",
                        "open_shards": _open_tars(p.pid), "torch": _has_torch(p.pid)})
        except (OSError, psutil.Error):
            pass  # ended meanwhile
    return out


# ---- the per-process roles (each returns (info, what to keep alive while measured)) -----------
def _steps_total(args) -> int:
    """Steps a rank hands out: ``--steps`` per worker process."""
    return args.steps * max(1, args.workers)


def role_idle(args):
    """The fixed part: an interpreter with the same imports and W idle DataLoader workers."""
    if not args.workers:
        return {}, None
    import torch.utils.data as tud

    from dataloading.processes import worker_context

    class Idle(tud.IterableDataset):
        def __iter__(self):
            while True:
                yield 0

    it = iter(tud.DataLoader(Idle(), batch_size=None, num_workers=args.workers, prefetch_factor=2,
                             multiprocessing_context=worker_context()))
    for _ in range(2 * args.workers):
        next(it)
    return {}, it


def _replicated_stream(args, seed: int):
    """One per-rank webdataset pipeline (in the rank, or in one DataLoader worker): steps and
    how many sources it has drawn from so far."""
    import random

    import webdataset as wds

    from dataloading.construct.constructor import SampleConstructor, assemble, pack
    from dataloading.formats.sample import decode_sample
    from dataloading.formats.tokenizer import ByteTokenizer
    from dataloading.index.shards import list_shards

    random.seed(1000 + seed)
    data = Path(args.data)
    names = sorted(p.name for p in data.iterdir() if p.is_dir())[: args.sources]

    def decode(sample):
        fields = {k: v for k, v in sample.items() if not k.startswith("__")}
        src = Path(sample["__url__"]).parent.name
        return decode_sample(f"{src}/{sample['__key__']}", fields)

    pipes = []
    for name in names:
        urls = [str(p) for p in list_shards(data / name)]
        pipes.append(wds.WebDataset(urls, resampled=True, shardshuffle=False, nodesplitter=None, seed=seed)
                     .map(decode).shuffle(SHUFFLE, initial=SHUFFLE))
    mixed = iter(wds.RandomMix(pipes, [1.0] * len(pipes)))
    # Only the tokenize/pack half of the constructor: no readers, samples come from the stream.
    builder = SampleConstructor({}, ByteTokenizer(), {"image": PatchProcessor()}, BUDGET)
    seen = set()
    while True:
        done = [builder.tokenize(next(mixed)) for _ in range(args.per_rank)]
        seen.update(t.sample_id.split("/", 1)[0] for t in done)
        yield [assemble(g) for g in pack(done, BUDGET)], len(seen)


def role_replicated(args):
    import torch.utils.data as tud

    from dataloading.serve.loader import _identity

    if not args.workers:
        stream = _replicated_stream(args, args.rank)
        for _ in range(args.steps):
            batch, touched = next(stream)
        keep = (stream, batch)
        return {"sources_touched": touched, "tokens_last_step": sum(mb.num_tokens for mb in batch)}, keep

    class Steps(tud.IterableDataset):  # each worker runs its own pipeline over every source
        def __iter__(self):
            wid = tud.get_worker_info().id
            for batch, touched in _replicated_stream(args, args.rank * 100 + wid):
                yield batch, touched, wid

    it = iter(tud.DataLoader(Steps(), batch_size=None, collate_fn=_identity, num_workers=args.workers,
                             prefetch_factor=2, persistent_workers=False))
    touched = {}
    for _ in range(_steps_total(args)):
        batch, n, wid = next(it)
        touched[wid] = n
    return {"sources_touched": min(touched.values()), "tokens_last_step": sum(mb.num_tokens for mb in batch)}, \
        (it, batch)


def _shipped():
    """The shipped data defaults (conf: the ``data`` group's DataConfig)."""
    from dataloading.config import DataConfig

    return DataConfig()


def role_planner(args):
    """The central state: builds the run's Planner as ``build_loader`` does, plans every step for
    every rank and writes the measured ranks' micro-batches (one JSON line per step) and the
    SampleConstructor ``build_loader`` would build (pickled, as DataLoader workers get it)."""
    from dataloading.construct.constructor import SampleConstructor
    from dataloading.errors import ProblemCounter
    from dataloading.formats.tokenizer import ByteTokenizer
    from dataloading.serve.loader import build_planner

    d = _shipped()
    t0 = time.perf_counter()
    data = replace(d, mixture=str(Path(args.data) / "mixture.yaml"), global_batch_size=args.per_rank * args.ranks,
                   micro_batch_tokens=BUDGET)
    planner, indices = build_planner(data, ByteTokenizer(), {"image": PatchProcessor()}, seed=0, dp_size=args.ranks,
                                     progress=False)
    out = Path(args.plans)
    out.mkdir(parents=True, exist_ok=True)
    files = {r: open(out / f"rank{r:04d}.jsonl", "w") for r in args.measured}
    for _ in range(_steps_total(args)):
        plan = planner.plan()
        planner.advance()
        for r, f in files.items():
            f.write(json.dumps(plan.rank(r)) + "\n")
    for f in files.values():
        f.close()
    plan_s = time.perf_counter() - t0
    constructor = SampleConstructor({n: ix.reader(n) for n, ix in indices.items()}, ByteTokenizer(),
                                    {"image": PatchProcessor()}, BUDGET, ProblemCounter(d.on_error, d.max_skip_fraction),
                                    options={n: t.options for n, t in planner.tables.items()},
                                    over_budget=d.over_budget, max_open_shards=d.max_open_shards)
    with open(out / "constructor.pkl", "wb") as f:
        pickle.dump(constructor, f)
    del constructor
    return {"plan_s": plan_s, "steps_planned": _steps_total(args),
            "state_dict_bytes": len(json.dumps(planner.state_dict()))}, (planner, indices)


class _PlannedJobs:
    """A rank's planned steps as the inline loader's jobs, read one line (step) at a time."""

    def __init__(self, path: Path):
        self.path = path

    def __iter__(self):
        stats = {"balance_max_over_mean": 1.0, "balance_lower_bound": 1.0, "utilisation": 1.0}
        with open(self.path) as f:
            for step, line in enumerate(f):
                yield step, json.loads(line), {}, stats, None


def role_central(args):
    import torch.utils.data as tud

    from dataloading.construct.step_jobs import BuildSteps
    from dataloading.processes import worker_context
    from dataloading.serve.loader import _identity

    out = Path(args.plans)
    with open(out / "constructor.pkl", "rb") as f:
        constructor = pickle.load(f)
    jobs = _PlannedJobs(out / f"rank{args.rank:04d}.jsonl")
    build = BuildSteps(constructor, None)
    if args.workers:
        it = iter(tud.DataLoader(build, sampler=jobs, batch_size=None, collate_fn=_identity,
                                 num_workers=args.workers, prefetch_factor=2,
                                 multiprocessing_context=worker_context(), persistent_workers=False))
    else:
        it = (build[job] for job in jobs)
    samples = 0
    for _ in range(_steps_total(args)):
        batch, _ = next(it)
        samples += sum(len(mb.sample_ids) for mb in batch.micro_batches)
    return {"samples": samples, "max_open_shards": constructor.shard_pool.max_open}, (it, constructor, batch)


def _plan_of(args, rank: int):
    with open(Path(args.plans) / f"rank{rank:04d}.jsonl") as f:
        for line in f:
            yield json.loads(line)


def role_loader(args):
    """A source-loader process (the Ray backend's SourceLoaderActor, without Ray): holds the
    readers (open shards, key maps) of every ``loaders``-th source and serves the raw fields
    of the planned samples of those sources to every measured rank, one pickle per step."""
    from dataloading.index.source_index import load_index

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
    return {"served": served}, readers


class _StepFields:
    """A reader of one source for a rank of the disaggregated design: the raw fields the
    source loaders sent for the current step (no shards, no key maps here)."""

    def __init__(self, name: str, current: dict):
        self.name, self.current = name, current

    def get(self, key: str) -> dict:
        return self.current[f"{self.name}/{key}"]


def role_disaggregated(args):
    from dataloading.construct.constructor import SampleConstructor
    from dataloading.errors import ProblemCounter
    from dataloading.formats.tokenizer import ByteTokenizer

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
    return {"samples": samples, "tokens_last_step": sum(mb.num_tokens for mb in batch)}, (constructor, current, batch)


def _shipped_loader(args, **kw):
    """``kw``: the data knobs that differ from the shipped ones (``DataConfig`` fields)."""
    from dataloading.formats.tokenizer import ByteTokenizer
    from dataloading.serve.loader import build_loader

    data = replace(_shipped(), mixture=str(Path(args.data) / "mixture.yaml"),
                   global_batch_size=args.per_rank * args.ranks, micro_batch_tokens=BUDGET, **kw)
    return build_loader(data, ByteTokenizer(), {"image": PatchProcessor()}, seed=0, dp_size=args.ranks,
                        dp_rank=args.rank, progress=False)


def role_inline(args):
    loader = _shipped_loader(args, num_workers=args.workers)  # every other knob as shipped
    samples, batch = 0, None
    for _ in range(_steps_total(args)):
        batch = next(loader)
        samples += sum(len(mb.sample_ids) for mb in batch.micro_batches)
    return {"samples": samples, "max_open_shards": loader.constructor.shard_pool.max_open}, (loader, batch)


def role_ray(args):
    if args.ray_address:
        _join_ray(*args.ray_address.split(","))
    loader = _shipped_loader(args, backend="ray")  # every other knob as shipped
    samples, batch = 0, None
    for i in range(args.steps):
        batch = next(loader)
        samples += sum(len(mb.sample_ids) for mb in batch.micro_batches)
        if i == 0 and not args.ray_address:  # the first rank started Ray: tell the driver where
            import ray

            mode = os.environ.get("RAY_AUTH_MODE", "disabled")  # a new local Ray turns token auth on
            print(f"RAYADDR {ray.get_runtime_context().gcs_address} {mode}", flush=True)
    return {"samples": samples}, (loader, batch)


ROLES = {"idle": role_idle, "replicated": role_replicated, "planner": role_planner, "central": role_central,
         "loader": role_loader, "disaggregated": role_disaggregated, "inline": role_inline, "ray": role_ray}


def worker_main(args) -> None:
    """Run a role, report, then wait (everything it built alive) until the driver has measured
    this process and its workers and writes a line to stdin."""
    t0 = time.perf_counter()
    _imports()
    import_s = time.perf_counter() - t0
    info, keep = ROLES[args.role](args)
    info.update(role=args.role, rank=args.rank, import_s=import_s, wall_s=time.perf_counter() - t0)
    print("RESULT " + json.dumps(info), flush=True)
    print("READY", flush=True)
    sys.stdin.readline()
    if hasattr(keep, "close"):
        keep.close()
    elif isinstance(keep, tuple) and keep and hasattr(keep[0], "close"):
        keep[0].close()  # a loader: stop its workers; a Ray loader detaches (the last kills the actors)
    del keep


# ---- the driver -------------------------------------------------------------------------------
class _Proc:
    """A role process started by the driver: waits at READY until measured."""

    def __init__(self, role: str, rank: int, args, workers: int):
        base = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--data", str(args.data),
                "--sources", str(args.sources), "--ranks", str(args.ranks), "--steps", str(args.steps),
                "--per-rank", str(args.per_rank), "--plans", str(args.plans), "--loaders", str(args.loaders),
                "--workers", str(workers), "--ray-address", args.ray_address or "",
                "--measured", ",".join(map(str, args.measured)), "--rank", str(rank)]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": "1", "OMNI_RUN_ID": f"loader-memory-{os.getpid()}"}
        self.role, self.rank = role, rank
        self.err_path = Path(args.plans) / f"stderr-{role}-{rank}-{time.monotonic_ns()}.txt"
        self.err = open(self.err_path, "w")
        self.p = subprocess.Popen(base, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                  env=env)
        self.info: dict | None = None

    def _fail(self, why: str):
        self.err.flush()
        tail = self.err_path.read_text()[-3000:]
        raise RuntimeError(f"{self.role} rank {self.rank} {why}:\n{tail}")

    def wait_line(self, prefix: str) -> str:
        for line in self.p.stdout:
            if line.startswith(prefix):
                return line.strip()
        self.p.wait()
        self._fail(f"failed (exit {self.p.returncode})")

    def wait_ready(self) -> dict:
        for line in self.p.stdout:
            if line.startswith("RESULT "):
                self.info = json.loads(line[len("RESULT "):])
            elif line.strip() == "READY":
                return self.info
        self.p.wait()
        self._fail(f"failed (exit {self.p.returncode})")

    def release(self) -> None:
        try:
            self.p.stdin.write("\n")
            self.p.stdin.flush()
        except OSError:
            pass

    def finish(self, timeout: float = 120) -> None:
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.err.close()
        self.err_path.unlink(missing_ok=True)


def _record(proc: _Proc, group: str) -> list[dict]:
    """The process tree of a role process, measured now, with its report on the root."""
    tree = measure_tree(proc.p.pid)
    for t in tree:
        t.update(process=proc.role if t["tree"] == "root" else "dataloader worker", group=group, rank=proc.rank)
    tree[0].update({k: v for k, v in proc.info.items() if k not in ("rank",)})
    return tree


def spawn(role: str, args, ranks, parallel: int, workers: int, group: str) -> list[dict]:
    """Run one process per rank (a fresh interpreter each), ``parallel`` at a time; measure each
    process tree when it reports READY (while it still holds everything it built)."""
    todo, running, out = list(ranks), [], []
    while todo or running:
        while todo and len(running) < parallel:
            running.append(_Proc(role, todo.pop(0), args, workers))
        proc = running.pop(0)
        proc.wait_ready()
        out += _record(proc, group)
        proc.release()
        proc.finish()
    return out


# ---- Ray: the first rank starts it as shipped, the others join it -----------------------------
def _join_ray(address: str, auth_mode: str = "disabled") -> None:
    """Join the loopback Ray the first rank started. ``build_loader`` with ``data.ray_address`` cannot:
    Ray rewrites a loopback address to the host's (192.0.2.2 here) and the join times out, so
    join the way ``dataloading.serve.ray_local`` starts one (single-machine mode, loopback node IP),
    with the import path ``RayStepLoader`` would give the actors; the loader then uses it."""
    os.environ["RAY_AUTH_MODE"] = auth_mode  # before Ray loads its config; the token is in ~/.ray/auth_token
    import ray

    from dataloading.serve.ray_local import _single_machine_mode

    env = {"env_vars": {"PYTHONPATH": os.pathsep.join([str(REPO), *(p or os.getcwd() for p in sys.path)])}}
    with _single_machine_mode():
        ray.init(address=address, _node_ip_address="127.0.0.1", log_to_driver=False, runtime_env=env)


def run_ray(args, ranks) -> list[dict]:
    """All measured ranks at once on one Ray: the first starts it (``build_loader`` with ``data.backend=ray``
    without an address, as shipped: a local Ray on loopback, its processes under the rank's),
    the others join it. One snapshot of the ranks and of every Ray process. Per rank: its
    process and its ConstructorActor; shared: Ray's own processes and the other actors."""
    import psutil

    args.ray_address = ""
    first = _Proc("ray", ranks[0], args, 0)
    procs = [first]
    ray_procs = {}  # psutil handles: a kill checks it is still the same process
    try:
        args.ray_address = ",".join(first.wait_line("RAYADDR ").split()[1:])
        ray_procs.update((c.pid, c) for c in psutil.Process(first.p.pid).children(recursive=True))
        procs += [_Proc("ray", r, args, 0) for r in ranks[1:]]
        for p in procs:
            p.wait_ready()
        time.sleep(2)  # idle Ray workers settle
        out = []
        for p in procs:
            info = {k: v for k, v in p.info.items() if k != "rank"}
            out.append({**proc_memory(p.p.pid), **info, "pid": p.p.pid, "name": "rank (Ray driver)", "tree": "root",
                        "process": "ray", "group": "rank", "rank": p.rank, "open_shards": _open_tars(p.p.pid),
                        "torch": _has_torch(p.p.pid)})
        for rp in psutil.Process(first.p.pid).children(recursive=True):
            try:
                m = {**proc_memory(rp.pid), "pid": rp.pid, "name": _name(rp), "open_shards": _open_tars(rp.pid),
                     "torch": _has_torch(rp.pid)}
            except (OSError, psutil.Error):
                continue
            ray_procs.setdefault(rp.pid, rp)
            per_rank = m["name"] == "ray::ConstructorActor"
            out.append({**m, "tree": "root", "process": m["name"], "group": "rank" if per_rank else "shared",
                        "rank": None})
        for p in procs[1:]:
            p.release()
        for p in procs[1:]:
            p.finish()
        first.release()
        first.finish()
    finally:
        args.ray_address = ""
        for p in procs:
            if p.p.poll() is None:
                p.p.kill()
        time.sleep(1)
        for rp in ray_procs.values():  # what the first rank's Ray left behind (agents outlive it)
            try:
                rp.kill()
            except psutil.Error:
                pass
    return out


def measured_ranks(ranks: int, sample: int) -> list[int]:
    """``sample`` ranks spread evenly over ``ranks`` (all of them when sample >= ranks)."""
    if sample <= 0 or sample >= ranks:
        return list(range(ranks))
    return sorted({round(i * ranks / sample) for i in range(sample)})


def _group(p: dict) -> str:
    if "group" in p:
        return p["group"]
    return "rank" if p.get("process") == "rank" else "shared"  # results written before the --workers runs


def totals(procs: list[dict], ranks: int, measured: int | None = None) -> dict:
    """Summed memory of the design's processes: the shared processes (planner, source loaders,
    Ray's) once, the per-rank ones (rank process, its DataLoader workers, its Ray constructor)
    summed; when only some ranks were measured, their sum x ranks / measured."""
    rank = [p for p in procs if _group(p) == "rank"]
    other = [p for p in procs if _group(p) != "rank"]
    if measured is None:
        measured = len({p["rank"] for p in rank if p.get("rank") is not None})
    scale = ranks / max(1, measured)
    out = {k: sum(p.get(k) or 0 for p in other) + sum(p.get(k) or 0 for p in rank) * scale for k in MEM_KEYS}
    out["processes"] = round(len(other) + len(rank) * scale)
    out["estimated"] = measured < ranks
    return out


def _trees(procs: list[dict]) -> dict:
    """Per measured rank: the summed memory of its process and the processes under it; per-rank
    processes not under it (Ray's ConstructorActors, one per rank) are shared out evenly."""
    out, loose = {}, [p for p in procs if _group(p) == "rank" and p.get("rank") is None]
    for p in procs:
        if _group(p) == "rank" and p.get("rank") is not None:
            t = out.setdefault(p["rank"], dict.fromkeys(MEM_KEYS, 0))
            for k in MEM_KEYS:
                t[k] += p.get(k) or 0
    for t in out.values():
        for k in MEM_KEYS:
            t[k] += sum(p.get(k) or 0 for p in loose) / len(out)
    return out


def run(args) -> dict:
    from dataloading.index.sources import cache_root

    root = Path(args.data_root) if args.data_root else cache_root() / "bench"
    t0 = time.perf_counter()
    args.data = ensure_data(root, args.sources, args.image_side)
    data_s = time.perf_counter() - t0
    args.plans = Path(args.out) / f".loader_memory_plans-{os.getpid()}"
    args.plans.mkdir(parents=True, exist_ok=True)
    args.ray_address = ""
    ranks = args.measured = measured_ranks(args.ranks, args.sample)
    d = _shipped()
    res = {"config": {"ranks": args.ranks, "sources": args.sources, "shards_per_source": SHARDS_PER_SOURCE,
                      "samples_per_shard": SAMPLES_PER_SHARD, "image_side": args.image_side, "shuffle_buffer": SHUFFLE,
                      "steps_per_worker": args.steps, "samples_per_rank_per_step": args.per_rank,
                      "parallel": args.parallel, "micro_batch_tokens": BUDGET, "data": str(args.data), "data_s": data_s,
                      "measured_ranks": ranks, "source_loaders": args.loaders, "workers": args.workers,
                      "shipped": {"max_open_shards": d.max_open_shards, "num_workers": d.num_workers,
                                  "prefetch": d.prefetch, "balance": d.balance},
                      "cpu_affinity": sorted(os.sched_getaffinity(0)), "git_at_start": git_state()},
           "runs": {}}
    try:
        for w in args.workers:
            if not any(x not in NO_WORKERS for x in args.designs):
                break
            run_w = res["runs"][str(w)] = {"workers": w, "designs": {}}
            idle = spawn("idle", args, range(3), 1, w, "rank")
            trees = list(_trees(idle).values())
            run_w["idle"] = {k: median([t[k] for t in trees]) for k in MEM_KEYS}
            run_w["idle_processes"] = idle
            print(f"[workers={w}] idle interpreter + {w} idle DataLoader workers (median of 3): "
                  f"USS {run_w['idle']['uss'] / 2**20:.0f} MiB, PSS {run_w['idle']['pss'] / 2**20:.0f} MiB", flush=True)
            for design in args.designs:
                if design in NO_WORKERS:
                    continue
                run_w["designs"][design] = _run_design(args, design, w, ranks)
                _partial(args, res)
        once = [x for x in args.designs if x in NO_WORKERS]
        if once:
            run_0 = res["runs"]["-"] = {"workers": None, "designs": {}}
            idle = spawn("idle", args, range(3), 1, 0, "rank")
            run_0["idle"] = {k: median([p[k] for p in idle]) for k in MEM_KEYS}
            for design in once:
                run_0["designs"][design] = _run_design(args, design, 0, ranks)
                _partial(args, res)
    finally:
        shutil.rmtree(args.plans, ignore_errors=True)
    return res


def _partial(args, res: dict) -> None:
    """What has been measured so far (a long run that stops keeps it; --from-json reads it)."""
    Path(args.out, f"{args.result_name}.partial.json").write_text(json.dumps(res, default=float) + "\n")


def _run_design(args, design: str, w: int, ranks) -> dict:
    t1 = time.perf_counter()
    procs = []
    if design in ("central", "disaggregated"):
        procs += spawn("planner", args, [0], 1, w, "shared")
    if design == "disaggregated":
        procs += spawn("loader", args, range(args.loaders), args.parallel, 0, "shared")
    if design == "ray":
        procs += run_ray(args, ranks)
    else:
        procs += spawn(design, args, ranks, args.parallel, w, "rank")
    for f in Path(args.plans).glob("*.pkl"):
        f.unlink()
    for f in Path(args.plans).glob("*.jsonl"):
        f.unlink()
    out = {"processes": procs, "wall_s": time.perf_counter() - t1}
    tot = out["total"] = totals(procs, args.ranks, len(ranks))
    print(f"[workers={w if design not in NO_WORKERS else '-'}] [{design}] {len(procs)} processes measured, "
          f"{args.ranks} ranks: USS {tot['uss'] / 2**30:.2f} GiB, PSS {tot['pss'] / 2**30:.2f} GiB, "
          f"RSS {tot['rss'] / 2**30:.2f} GiB ({out['wall_s']:.0f}s)", flush=True)
    return out


# ---- the report -------------------------------------------------------------------------------
def _upgrade(res: dict) -> dict:
    """Results written before the --workers runs (one process per rank): one run, W=0."""
    if "runs" not in res:
        res["runs"] = {"0": {"workers": 0, "designs": res.pop("designs", {}), "idle": res.get("idle", {})}}
        res["config"].setdefault("steps_per_worker", res["config"].get("steps"))
    return res


def _retotal(res: dict) -> None:
    ranks = res["config"]["ranks"]
    measured = len(res["config"].get("measured_ranks", [])) or None
    for run in res["runs"].values():
        for d in run["designs"].values():
            d["total"] = totals(d["processes"], ranks, measured)


def _rows(res: dict):
    """(run key, workers label, design, its run) for every table row: each worker count's
    designs, then the designs W does not apply to (listed under every worker count)."""
    runs = res["runs"]
    once = runs.get("-")
    for key, run in runs.items():
        if key == "-":
            continue
        rows = [(design, run) for design in run["designs"]]
        if once:
            rows += [(design, once) for design in once["designs"]]
        yield key, run["workers"], rows
    if once and len(runs) == 1:
        yield "-", None, [(design, once) for design in once["designs"]]


def _above(d: dict, run: dict, ranks: int) -> float:
    """PSS above R idle training processes (an interpreter with the same imports and the same
    W idle DataLoader workers): what the data plane adds to the rank processes it runs in."""
    idle = run.get("idle") or {}
    return d["total"]["pss"] - ranks * idle.get("pss", 0)


def report(res: dict) -> str:
    gib, mib = 2 ** 30, 2 ** 20
    c = res["config"]
    ranks = c["ranks"]
    measured = len(c.get("measured_ranks", range(ranks)))
    how = ("every rank measured" if measured >= ranks else
           f"{measured} of {ranks} ranks measured (evenly spaced), per-rank sums = their sum x {ranks}/{measured}")
    shipped = c.get("shipped", {})
    lines = [f"{ranks} ranks x {c['sources']} sources ({c['shards_per_source']} shards x {c['samples_per_shard']} samples "
             f"each, {c['image_side']}x{c['image_side']} PNG + text), {c.get('steps_per_worker')} steps x "
             f"{c['samples_per_rank_per_step']} samples per worker process, {how}"
             + (f"; shipped data defaults: max_open_shards={shipped.get('max_open_shards')}, "
                f"prefetch={shipped.get('prefetch')}, balance={shipped.get('balance')}" if shipped else "") + ".",
             "PSS per rank: the rank process and its DataLoader workers (Ray: the rank process and its "
             "ConstructorActor). PSS above idle: the sum less R idle ranks (same imports, same number of idle "
             "workers). Ratios: the named design's sum over this design's (higher = this design uses less).\n"]
    out = []
    idle_lines = []
    for key, workers, rows in _rows(res):
        base = {}
        for design, run in rows:
            if design in ("replicated", "inline"):
                base[design] = (run["designs"][design]["total"], _above(run["designs"][design], run, ranks))
        idle = res["runs"][key].get("idle") or {}
        idle_lines.append(f"{'no' if not workers else workers} DataLoader worker{'' if workers == 1 else 's'}: "
                          f"USS {idle.get('uss', 0) / mib:.0f} MiB, PSS {idle.get('pss', 0) / mib:.0f} MiB")
        for design, run in rows:
            d = run["designs"][design]
            tot = d["total"]
            pss = [t["pss"] / mib for t in _trees(d["processes"]).values()]
            above = _above(d, run, ranks)

            def ratio(name, key, bold=False):
                if name not in base:
                    return ""
                b = base[name][0][key] if key != "above" else base[name][1]
                v = tot[key] if key != "above" else above
                text = f"{b / v:.2f}x" if v > 0 else ""
                return f"**{text}**" if bold and text else text

            wl = "-" if design in NO_WORKERS else str(workers)
            out.append([wl, design, tot["processes"], f"{tot['uss'] / gib:.2f}", f"{tot['pss'] / gib:.2f}",
                        f"{above / gib:.2f}", f"{median(pss):.0f} ({min(pss):.0f}-{max(pss):.0f})",
                        ratio("replicated", "uss"), ratio("replicated", "pss", True), ratio("replicated", "above"),
                        ratio("inline", "pss")])
    lines.append(table(["workers per rank", "design", "processes", "sum USS GiB", "sum PSS GiB", "PSS above idle GiB",
                        "PSS per rank MiB (median, min-max)", "replicated / design USS", "replicated / design PSS",
                        "replicated / design PSS above idle", "inline / design PSS"], out))
    lines.append("\nidle rank (interpreter with the same imports, idle workers): " + "; ".join(idle_lines))
    lines.append("")
    lines += ["- " + n for n in _notes(res)]
    return "\n".join(lines)


def _notes(res: dict) -> list[str]:
    mib = 2 ** 20
    c = res["config"]
    notes = []
    for key, run in res["runs"].items():
        w = run["workers"]
        tag = f"W={w}" if key != "-" else "no W"
        for design, d in run["designs"].items():
            procs = d["processes"]
            roots = [p for p in procs if _group(p) == "rank" and p.get("tree", "root") == "root" and p.get("role")]
            kids = [p for p in procs if p.get("tree") == "child"]
            if design == "replicated" and roots:
                notes.append(f"{tag} replicated: sources drawn from per worker (min over workers, median over ranks) "
                             f"{median([p['sources_touched'] for p in roots]):.0f} of {c['sources']}")
            if kids and any("open_shards" in p for p in kids):
                notes.append(f"{tag} {design}: {len(kids) / max(1, len(roots)):.0f} process(es) under each rank process; "
                             f"shard files open per worker (median) {median([p['open_shards'] for p in kids]):.0f}, "
                             f"worker USS {median([p['uss'] for p in kids]) / mib:.0f} MiB, "
                             f"PSS {median([p['pss'] for p in kids]) / mib:.0f} MiB (median); rank process USS "
                             f"{median([p['uss'] for p in roots]) / mib:.0f} MiB, "
                             f"PSS {median([p['pss'] for p in roots]) / mib:.0f} MiB")
            planner = [p for p in procs if p.get("role") == "planner"]
            if planner:
                p = planner[0]
                notes.append(f"{tag} {design}: planner process USS {p['uss'] / mib:.0f} MiB, "
                             f"PSS {p['pss'] / mib:.0f} MiB; "
                             f"planned {p.get('steps_planned', c.get('steps_per_worker'))} steps for {c['ranks']} ranks "
                             f"in {p['plan_s']:.1f}s (index load included); "
                             f"state_dict {p['state_dict_bytes']} bytes of JSON")
            if design == "ray":
                kinds = {}
                for p in procs:
                    k = "rank process (Ray driver)" if p.get("role") == "ray" else p.get("name", "?")
                    kinds.setdefault(k, []).append(p)
                parts = [f"{k}: {len(v)} x {median([p['uss'] for p in v]) / mib:.0f} MiB USS / "
                         f"{median([p['pss'] for p in v]) / mib:.0f} MiB PSS (median)" for k, v in sorted(kinds.items())]
                notes.append("ray processes measured: " + "; ".join(parts))
            if roots:
                notes.append(f"{tag} {design}: wall time per rank process (median) "
                             f"{median([p['wall_s'] for p in roots]):.1f}s, of which imports "
                             f"{median([p['import_s'] for p in roots]):.1f}s; design total {d.get('wall_s', 0):.0f}s")
    return notes


def plot(res: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2 ** 30
    c = res["config"]
    ranks = c["ranks"]
    groups = [(key, run) for key, run in res["runs"].items()]
    colors = {"replicated": "C3", "central": "C0", "inline": "C2", "ray": "C4", "disaggregated": "C1"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key_mem in zip(axes, ("uss", "pss")):
        x, ticks, labels, top = 0, [], [], 0.0
        for key, run in groups:
            designs = list(run["designs"])
            idle = (run.get("idle") or {}).get(key_mem, 0) * ranks / gib
            start = x
            for d in designs:
                tot = run["designs"][d]["total"][key_mem] / gib
                ax.bar(x, min(idle, tot), color="#c8c8c8")
                ax.bar(x, max(tot - idle, 0), bottom=min(idle, tot), color=colors.get(d, "C7"),
                       label=d if d not in ax.get_legend_handles_labels()[1] else None)
                ax.text(x, tot, f"{tot:.1f}", ha="center", va="bottom", fontsize=7)
                top = max(top, tot)
                x += 1
            ticks.append((start + x - 1) / 2)
            if key == "-":
                labels.append("\n".join(designs) + "\n(W n/a)")
            else:
                w = run["workers"]
                labels.append(f"{w} worker{'s' if w != 1 else ''}" if w else "no workers")
            x += 1
        ax.set_xticks(ticks, labels, fontsize=9)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel(f"GiB, summed over all processes ({ranks} ranks)")
        ax.set_title("USS (private pages)" if key_mem == "uss" else "PSS (shared pages split among their users)",
                     fontsize=10)
    handles, names = axes[1].get_legend_handles_labels()
    from matplotlib.patches import Patch

    handles.append(Patch(color="#c8c8c8"))
    names.append(f"{ranks} idle ranks (same imports, same idle workers)")
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8)
    fig.suptitle(f"Loader memory: {ranks} ranks x {c['sources']} sources, {c['image_side']} px images, "
                 f"by DataLoader workers per rank", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--role", choices=sorted(ROLES), help=argparse_hidden())
    p.add_argument("--rank", type=int, default=0, help=argparse_hidden())
    p.add_argument("--plans", default="", help=argparse_hidden())
    p.add_argument("--data", default="", help=argparse_hidden())
    p.add_argument("--ray-address", default="", help=argparse_hidden())
    p.add_argument("--data-root", default="", help="where the shards are written (default $OMNI_CACHE/bench)")
    p.add_argument("--ranks", type=int, default=None)
    p.add_argument("--sources", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="steps handed out per worker process")
    p.add_argument("--per-rank", type=int, default=PER_RANK, help="samples per rank per step")
    p.add_argument("--parallel", type=int, default=1, help="rank process trees alive at once (not Ray's)")
    p.add_argument("--designs", default=",".join(DEFAULT_DESIGNS),
                   help=f"comma list of {', '.join(DESIGNS)} (default: {','.join(DEFAULT_DESIGNS)})")
    p.add_argument("--workers", default=None,
                   help="DataLoader workers per rank, a comma list, one run each (default 1,4,8; --quick 1,2; "
                        "0 = steps built in the rank process)")
    p.add_argument("--sample", type=int, default=None,
                   help="measure this many evenly spaced ranks and scale their sum to --ranks "
                        "(default: 4 of 64 in full mode, all in --quick; 0 = all)")
    p.add_argument("--loaders", type=int, default=None,
                   help="source-loader processes of the disaggregated design (default: ranks / 8, one per node of 8)")
    p.add_argument("--measured", type=lambda t: [int(x) for x in t.split(",") if x], default=[],
                   help=argparse_hidden())
    p.add_argument("--image-side", type=int, default=IMAGE_SIDE, help="PNG side in pixels (multiple of 4)")
    p.add_argument("--name", default="", help="result file name (default loader_memory[_quick][_px<side>])")
    p.add_argument("--from-json", default="", help="re-print the table and re-draw the plot of a saved result")
    args = p.parse_args()
    if args.role:
        args.workers = int(args.workers or 0)
        worker_main(args)
        return
    if args.from_json:
        res = _upgrade(json.loads(Path(args.from_json).read_text()))
        _retotal(res)
        print(report(res))
        plot(res, Path(args.from_json).with_suffix(".png"))
        return
    args.ranks = args.ranks or (4 if args.quick else 64)
    args.sources = args.sources or (20 if args.quick else 300)
    args.sample = (0 if args.quick else 4) if args.sample is None else args.sample
    args.loaders = args.loaders or max(1, args.ranks // 8)
    args.workers = [int(x) for x in (args.workers or ("1,2" if args.quick else "1,4,8")).split(",") if x != ""]
    # Enough samples that a replicated worker draws from (nearly) every source: ~ S ln S * 1.4.
    args.steps = args.steps or max(4, math.ceil(1.4 * args.sources * math.log(args.sources) / args.per_rank))
    args.designs = [d for d in args.designs.split(",") if d]
    unknown = [d for d in args.designs if d not in DESIGNS]
    if unknown:
        p.error(f"unknown designs {unknown}; use {', '.join(DESIGNS)}")
    name = args.result_name = args.name or ("loader_memory" + ("_quick" if args.quick else "") +
                                            ("" if args.image_side == IMAGE_SIDE else f"_px{args.image_side}"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = run(args)
    res["wall_s"] = time.perf_counter() - t0
    print(report(res))
    save_and_plot(args.out, name, res, plot)
    Path(args.out, f"{name}.partial.json").unlink(missing_ok=True)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
