"""Measured CPU training runs and the simulator's replay of them, for the benchmark
scripts/bench/sim_validation_cpu.py (the timings) and tests/sim/test_validation_cpu.py (the
structure, timing-free).

A run is the user path: ``torchrun --standalone --nproc-per-node 2 --no-python omni train ...``
(``-m recipes.cli train`` without the console script), ``OMP_NUM_THREADS=1``, gloo, fp32, on the
demo data with an image-heavy mixture and a bigger vision tower, so that where the encoders run
matters. The simulator gets the same model, encoders, parallel and multiplex overrides, the
``cpu`` cluster preset and the run's own data (``data.source=mixture``: the planner draws the
very micro-batches training drew).

Steps: training counts from 1, the data planner from 0 (``omni train``'s step s is
``planner.plan(s - 1)``), so trainer step s is simulated with ``data.first_step=s - 1``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PLACEMENTS = ("stage0", "encoder_first", "colocated")
# The bench's encoder-heavy tower (scripts/bench/multiplex.py VISION), 4 layers instead of 8
# to keep three runs inside the test's time: patch 4 makes the demo's 32-64 px images 64-256
# patches, hidden 256 / MLP 1024 makes each patch cost more than an LLM token.
VISION = {"patch_size": 4, "max_patches": 256, "hidden_size": 256, "intermediate_size": 1024,
          "num_hidden_layers": 4, "num_attention_heads": 4}
IMAGE_HEAVY = {"shapes": 0.8, "tones": 0.1, "text": 0.1}
GLOBAL_BATCH = 16
MICRO_BATCH_TOKENS = 1024  # conf/data/demo.yaml's
SEED = 0  # trainer.seed (conf/trainer/default.yaml)
LAYOUT = {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}


def model_overrides(placement: str) -> dict:
    """The overrides the training run and the simulator share."""
    return {**LAYOUT, "multiplex.placement": placement,
            **{f"encoders.vision.params.{k}": v for k, v in VISION.items()}}


def write_mixture(demo: Path, weights: dict = IMAGE_HEAVY, folder: Path | None = None) -> Path:
    """The mixture file, in ``folder`` (default: the demo's own), naming the demo's sources by
    absolute path (the test's demo folder is shared with other tests: it writes elsewhere)."""
    path = Path(folder or demo) / "mixture_validation.yaml"
    lines = ["# image-heavy mixture of the demo sources (tests/sim/_runs.py)", "sources:"]
    lines += [f"  - name: {n}\n    path: {Path(demo, n).resolve()}\n    weight: {w}" for n, w in weights.items()]
    path.write_text("\n".join(lines + [f"eval: {Path(demo, 'eval').resolve()}", ""]))
    return path


@dataclass
class Run:
    placement: str
    run_dir: Path
    wall_s: float
    metrics: list[dict] = field(default_factory=list)
    # Of the machine's CPU time during the run, the share other processes (and the hypervisor's
    # steal) took (0: the run had the cores to itself); timings of a contended run are noisy.
    foreign_cpu_share: float = 0.0

    def step_times(self, steps: list[int]) -> list[float]:
        by_step = {m["step"]: m["step_time_s"] for m in self.metrics}
        return [by_step[s] for s in steps]

    def compute_times(self, steps: list[int]) -> list[float]:
        """Per step, the mean over ranks of the time in encoder, LLM and optimizer spans."""
        by_step = {m["step"]: m["busy_encoder_s"] + m["busy_llm_s"] + m["busy_optim_s"] for m in self.metrics}
        return [by_step[s] for s in steps]

    def trace(self, step: int) -> Path:
        return self.run_dir / f"trace_step{step}.json"


def _launcher(world: int = 2) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    omni = shutil.which("omni", path=str(Path(sys.executable).parent))
    return run + (["--no-python", omni, "train"] if omni else ["-m", "recipes.cli", "train"])


def train(placement: str, mixture: Path, demo: Path, run_dir: Path, steps: int, trace_step: int,
          world: int = 2, extra: dict | None = None) -> Run:
    """One measured run; ``extra``: overrides on top of the shared ones (a layout, a mechanism)."""
    o = {"data.mixture": mixture, "data.eval_dir": demo / "eval", "data.global_batch_size": GLOBAL_BATCH,
         "data.micro_batch_tokens": MICRO_BATCH_TOKENS, "data.num_workers": 0, "trainer.seed": SEED,
         "trainer.run_dir": run_dir, "trainer.max_steps": steps, "trainer.progress": "false",
         "trainer.eval_at_end": "false", "checkpoint.every": 0, "checkpoint.save_at_end": "false",
         "multiplex.trace_step": trace_step, "multiplex.timeline_every": 1,  # every step's times, replayed
         **model_overrides(placement), **(extra or {})}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    run_dir.mkdir(parents=True, exist_ok=True)
    t0, c0, b0 = time.perf_counter(), os.times(), _machine_busy_s()
    p = subprocess.run(_launcher(world) + [f"{k}={v}" for k, v in o.items()], env=env, cwd=run_dir,
                       capture_output=True, text=True, timeout=600)
    wall, c1, b1 = time.perf_counter() - t0, os.times(), _machine_busy_s()
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    ours = (c1.children_user + c1.children_system) - (c0.children_user + c0.children_system)
    foreign = max(0.0, (b1 - b0) - ours) / (wall * (os.cpu_count() or 1)) if b0 is not None and b1 is not None else 0.0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Run(placement, run_dir, wall, [r for r in rows if "step_time_s" in r], foreign)


def _machine_busy_s() -> float | None:
    """CPU seconds all processes of the machine spent so far (/proc/stat; None elsewhere)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def sim_overrides(placement: str, mixture: Path, first_trainer_step: int, steps: int,
                  calibration: Path | None = None, world: int = 2, extra: dict | None = None) -> list[str]:
    o = {"workload": "none", "cluster": "cpu", "cluster.num_gpus": world, "data.source": "mixture",
         "data.mixture": mixture, "data.global_batch_size": GLOBAL_BATCH,
         "data.micro_batch_tokens": MICRO_BATCH_TOKENS, "data.seed": SEED,
         # The planner's step of trainer step s is s - 1 (see the module docstring).
         "data.first_step": first_trainer_step - 1, "data.steps": steps,
         # A lengths-source knob that data.source=mixture does not use, but check_data still
         # validates against data.micro_batch_tokens (default 2048 > 1024).
         "data.sample_tokens": MICRO_BATCH_TOKENS, "sim.placements": "[" + ",".join(PLACEMENTS) + "]",
         **model_overrides(placement), **(extra or {})}
    if calibration is not None:
        o["sim.calibration"] = calibration
    return [f"{k}={v}" for k, v in o.items()]


# The calibrated factors that do not depend on where the fit starts: compute times scale with
# every efficiency and the per-op overhead, so a start k times too fast ends on the same ones.
# Not comm_efficiency: the gradient sync's latency and its overlap with the last backward do not
# scale with it.
START_INDEPENDENT = ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "op_overhead_us",
                     "encoder_efficiency")


def faster(cluster, k: float):
    """The cluster preset predicting every compute and communication time ``k`` times too fast
    (efficiencies x k, per-op overhead / k; the encoders' relative factor kept)."""
    c = cluster
    return dataclasses.replace(c, gemm_efficiency=k * c.gemm_efficiency, attention_efficiency=k * c.attention_efficiency,
                               memory_efficiency=k * c.memory_efficiency, op_overhead_us=c.op_overhead_us / k,
                               comm_efficiency=k * c.comm_efficiency)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))
