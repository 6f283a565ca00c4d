"""``omni simulate --calibrate TRACE``: fit the cluster's efficiency factors to a measured run.

The trace is the Chrome trace ``omni train`` writes for one step (``multiplex.trace_step=N``;
trainer step N draws the planner's step N - 1). The simulator replays that very step — the data plane is a pure function of (seed, state,
step, layout), so ``data.source=mixture`` with the run's mixture and seed draws the same
micro-batches — and compares, event by event, what it predicts with what was measured:

- LLM compute: every LLM stage forward/backward span; k = sum(measured) / sum(predicted)
  divides the compute efficiencies (GEMM, attention, memory) and multiplies the per-op
  overhead, since all of them scale compute time;
- encoder compute: every encoder chunk span (the rank's own work); its own factor k_enc sets
  ``encoder_efficiency`` (encoders run smaller, differently shaped kernels than the backbone,
  and one factor for both mis-scales one of them);
- communication: the ``gradient sync`` spans against the predicted exposed gradient sync; k_comm
  divides ``comm_efficiency`` (kept when the run has none to compare).

The fit's median relative error per event, before and after, is part of the result.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from omni.errors import ConfigError
from omni.sim.config import ClusterConfig, SimConfig

FACTORS = ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "comm_efficiency", "op_overhead_us",
           "encoder_efficiency")
_LLM = re.compile(r"^(?:stage(\d+) )?(forward|backward) mb(\d+)$")
_ENC = re.compile(r"^([FB])(\d+)(?:-\d+)?$")  # a call's first chunk (and last, for a cut group)


@dataclass
class CalibrationFit:
    cluster: str
    factors: dict[str, float]
    compute_scale: float
    encoder_scale: float | None
    comm_scale: float | None
    events: int
    error_before: float  # median |predicted - measured| / measured over the events
    error_after: float
    step: int
    rows: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "rows"}

    def to_yaml(self) -> str:
        head = (f"# omni simulate --calibrate: fitted on step {self.step}, {self.events} events; median error "
                f"{100 * self.error_before:.1f}% before, {100 * self.error_after:.1f}% after\n")
        return head + yaml.safe_dump({"cluster": self.cluster, "factors": self.factors}, sort_keys=False)

    def summary(self) -> str:
        comm = f"{self.comm_scale:.3f}" if self.comm_scale is not None else "kept (no gradient sync measured)"
        fs = ", ".join(f"{k}={v:.4g}" for k, v in self.factors.items())
        enc = f"{self.encoder_scale:.3f}" if self.encoder_scale is not None else "kept"
        return (f"calibrated on step {self.step}: {self.events} events, LLM compute x{self.compute_scale:.3f}, "
                f"encoder compute {enc}, comm {comm}; "
                f"median per-event error {100 * self.error_before:.1f}% -> {100 * self.error_after:.1f}%\n  {fs}")


def apply_calibration(cluster: ClusterConfig, path: str) -> ClusterConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"sim.calibration={path}: no such file; write one with `omni simulate --calibrate TRACE "
                          f"--out {path}`")
    data = yaml.safe_load(p.read_text()) or {}
    factors = data.get("factors")
    if not isinstance(factors, dict) or not set(factors) <= set(FACTORS):
        raise ConfigError(f"sim.calibration={path}: expected `factors:` with keys among {', '.join(FACTORS)}")
    return dataclasses.replace(cluster, **{k: float(v) for k, v in factors.items()})


def read_trace(path: str) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--calibrate {path}: no such trace; train with multiplex.trace_step=N to write "
                          f"<run_dir>/trace_stepN.json")
    try:
        events = json.loads(p.read_text())["traceEvents"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"--calibrate {path}: not a Chrome trace of `omni train` (no traceEvents)") from None
    return [e for e in events if e.get("ph") == "X"]


def calibrate_from_trace(cfg: SimConfig, path: str) -> CalibrationFit:
    from omni.sim.one_step import one_step_for_calibration

    events = read_trace(path)
    if not events:
        raise ConfigError(f"--calibrate {path}: the trace has no timed events")
    steps = {e.get("args", {}).get("step") for e in events}
    if len(steps) != 1 or None in steps:
        raise ConfigError(f"--calibrate {path}: expected one traced step, found {sorted(map(str, steps))}")
    step = int(steps.pop())
    if cfg.data.source != "mixture":
        raise ConfigError("calibration replays the traced step's own data: set data.source=mixture and "
                          "data.mixture (and data.seed) to the run's")
    ranks = sorted({int(e["pid"]) for e in events})
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, num_gpus=len(ranks)),
                              data=dataclasses.replace(cfg.data, first_step=step - 1, steps=1))
    run, sizes = one_step_for_calibration(cfg)
    member_index = {r: i for i, r in enumerate(run.members)}
    rows = []
    for e in events:
        rank, name, kind = int(e["pid"]), e["name"], e.get("cat")
        c = sizes.coords(rank)
        g = sizes.dp_group(rank)
        measured = float(e["dur"]) * 1e-6
        predicted = None
        m = _LLM.match(name)
        if kind == "llm" and m:
            stage = int(m.group(1)) if m.group(1) else c["pp"]
            w = run.work.get((g, stage, int(m.group(3))))
            if w is not None:
                predicted = w.forward_s if m.group(2) == "forward" else w.backward_s
                if predicted and measured > 0:
                    rows.append({"kind": "llm", "name": name, "rank": rank, "measured_s": measured,
                                 "predicted_s": predicted})
                predicted = None
        m = _ENC.match(name)
        call = next((c for c in run.chunks if c.chunks and c.chunks[0] == int(m.group(2))), None) if m else None
        if kind == "encoder" and call is not None and rank in member_index:
            ch = call
            per = ch.gpu_forward_s if m.group(1) == "F" else ch.gpu_backward_s
            predicted = per[member_index[rank]]
        if predicted is not None and predicted > 0 and measured > 0:
            rows.append({"kind": "encoder", "name": name, "rank": rank, "measured_s": measured,
                         "predicted_s": predicted})
        if kind == "comm" and name == "gradient sync":
            p = run.tail_comm.get((g, c["pp"]), 0.0)
            if p > 0:
                rows.append({"kind": "comm", "name": name, "rank": rank, "measured_s": measured, "predicted_s": p})
    llm = [r for r in rows if r["kind"] == "llm"]
    if not llm:
        raise ConfigError(f"--calibrate {path}: no LLM span of the trace matches the simulated step; pass the "
                          f"run's own overrides (model, encoders, parallel, multiplex, data)")

    def ratio(kind: str) -> float | None:
        rs = [r for r in rows if r["kind"] == kind]
        return sum(r["measured_s"] for r in rs) / sum(r["predicted_s"] for r in rs) if rs else None

    k, k_enc, k_comm = ratio("llm"), ratio("encoder"), ratio("comm")
    cl = cfg.cluster
    factors = {"gemm_efficiency": cl.gemm_efficiency / k, "attention_efficiency": cl.attention_efficiency / k,
               "memory_efficiency": cl.memory_efficiency / k, "op_overhead_us": cl.op_overhead_us * k,
               "comm_efficiency": cl.comm_efficiency / k_comm if k_comm else cl.comm_efficiency,
               # encoder times scale with 1 / (efficiency x encoder_efficiency): after the LLM's k,
               # what is left of the encoders' own factor
               "encoder_efficiency": cl.encoder_efficiency * k / k_enc if k_enc else cl.encoder_efficiency}
    scale = {"llm": k, "encoder": k_enc or k, "comm": k_comm or 1.0}

    def err(rs, fitted: bool) -> float:
        if not rs:
            return 0.0
        return float(np.median([abs(r["predicted_s"] * (scale[r["kind"]] if fitted else 1.0) - r["measured_s"])
                                / r["measured_s"] for r in rs]))

    return CalibrationFit(cl.name, factors, k, k_enc, k_comm, len(rows), err(rows, False), err(rows, True), step, rows)
