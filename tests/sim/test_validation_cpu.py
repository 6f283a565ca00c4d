"""The simulator against a real CPU run, timing-free: what the calibration reads from a trace and
what the simulator does with its inputs. The timings themselves (predicted vs measured step
times of three placements, which move with the machine's load) are a benchmark:
scripts/bench/sim_validation_cpu.py, its table in docs/benchmarks.md.

One real training run (tests/sim/_runs.py: 2 ranks, ``parallel.pp=2``, 1F1B, colocated, the
image-heavy mixture and the bigger vision tower the benchmark uses) writes the Chrome trace of
its last step. Asserted:
(a) the calibration matches every LLM stage span, every encoder chunk span and every gradient
    sync of that trace to a simulated event (the simulator replays the same micro-batches and
    chunks as training ran), and fits finite, positive factors; from a start predicting
    everything 2x too fast it lands on the same compute factors (the fit is a ratio of sums);
(b) on the same trace with its durations replaced by the simulator's own predictions times
    known factors, the fit returns exactly those factors, and the fitted file replays the LLM
    and encoder events at those durations;
(c) the simulator follows its inputs: encoder time scales with 1 / encoder_efficiency, stage0
    keeps all of it on the first stage, and costlier encoders slow stage0 more than the
    placements that spread them over both ranks.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

import _runs as R

STEPS = 1  # trainer steps: the trace is of the last (the first step: nothing here is timed)
K = {"llm": 1.7, "encoder": 1.3, "comm": 2.5}  # known factors of the synthetic trace


@pytest.fixture(scope="module")
def traced(demo_root, tmp_path_factory):
    from recipes.simulate_cmd import load_sim_config

    root = tmp_path_factory.mktemp("traced")
    mixture = R.write_mixture(demo_root, folder=root)
    run = R.train("colocated", mixture, demo_root, root / "colocated", STEPS, STEPS)
    cfg = load_sim_config(R.sim_overrides("colocated", mixture, STEPS, 1))
    return {"mixture": mixture, "trace": run.trace(STEPS), "cfg": cfg}


def _spans(trace) -> dict[str, list[dict]]:
    """The trace's events the calibration compares, by kind."""
    from omni.sim.calibrate import _ENC, _LLM, read_trace

    events = read_trace(str(trace))
    return {"llm": [e for e in events if e.get("cat") == "llm" and _LLM.match(e["name"])],
            "encoder": [e for e in events if e.get("cat") == "encoder" and _ENC.match(e["name"])],
            "comm": [e for e in events if e.get("cat") == "comm" and e["name"] == "gradient sync"]}


def test_calibration_matches_every_span_of_a_real_trace(traced):
    from omni.sim.calibrate import calibrate_from_trace

    spans = _spans(traced["trace"])
    fit = calibrate_from_trace(traced["cfg"], str(traced["trace"]))
    got = {kind: sorted((r["rank"], r["name"]) for r in fit.rows if r["kind"] == kind) for kind in K}
    for kind, events in spans.items():
        want = sorted((int(e["pid"]), e["name"]) for e in events)
        assert got[kind] == want, (kind, got[kind], want)
    # Both ranks' stage spans, both ranks' encoder chunks (colocated), both ranks' gradient syncs.
    for kind in K:
        assert {rank for rank, _ in got[kind]} == {0, 1}, (kind, got[kind])
    assert fit.events == sum(len(v) for v in spans.values()) >= 10
    for name, value in [*fit.factors.items(), ("compute_scale", fit.compute_scale),
                        ("encoder_scale", fit.encoder_scale), ("comm_scale", fit.comm_scale)]:
        assert value is not None and math.isfinite(value) and value > 0, (name, value)
    off = calibrate_from_trace(dataclasses.replace(traced["cfg"], cluster=R.faster(traced["cfg"].cluster, 2.0)),
                               str(traced["trace"]))
    for k in R.START_INDEPENDENT:
        assert off.factors[k] == pytest.approx(fit.factors[k], rel=1e-9), k
    assert off.compute_scale == pytest.approx(2 * fit.compute_scale, rel=1e-9)
    assert off.encoder_scale == pytest.approx(2 * fit.encoder_scale, rel=1e-9)


def test_calibration_recovers_known_factors_and_replays_them(traced, tmp_path):
    from omni.sim.calibrate import calibrate_from_trace
    from recipes.simulate_cmd import load_sim_config

    cfg, trace = traced["cfg"], traced["trace"]
    first = calibrate_from_trace(cfg, str(trace))
    predicted = {(r["kind"], r["rank"], r["name"]): r["predicted_s"] for r in first.rows}
    data = json.loads(trace.read_text())
    for e in data["traceEvents"]:
        key = (e.get("cat"), int(e.get("pid", -1)), e.get("name"))
        if e.get("ph") == "X" and key in predicted:
            e["dur"] = predicted[key] * K[key[0]] * 1e6
    synthetic = tmp_path / "trace_synthetic.json"
    synthetic.write_text(json.dumps(data))

    fit = calibrate_from_trace(cfg, str(synthetic))
    assert fit.compute_scale == pytest.approx(K["llm"], rel=1e-9)
    assert fit.encoder_scale == pytest.approx(K["encoder"], rel=1e-9)
    assert fit.comm_scale == pytest.approx(K["comm"], rel=1e-9)
    assert fit.error_after == pytest.approx(0.0, abs=1e-9) and fit.error_before > 0.2
    # The fitted file, read as `omni simulate sim.calibration=...` reads it, predicts the
    # synthetic durations of the LLM and encoder events. (Not the gradient sync: its latency
    # does not scale with comm_efficiency, and only its part past the last backward is exposed.)
    factors = tmp_path / "calibration.yaml"
    factors.write_text(fit.to_yaml())
    replay = calibrate_from_trace(load_sim_config(R.sim_overrides("colocated", traced["mixture"], STEPS, 1, factors)),
                                  str(synthetic))
    rows = [r for r in replay.rows if r["kind"] in ("llm", "encoder")]
    assert len(rows) == sum(1 for r in fit.rows if r["kind"] in ("llm", "encoder"))
    for r in rows:
        assert r["predicted_s"] == pytest.approx(r["measured_s"], rel=1e-9), r


def test_placements_follow_the_encoder_cost(traced):
    """Encoders 4x costlier (encoder_efficiency / 4): every rank's encoder time grows exactly 4x;
    stage0 keeps all of it on the first stage (rank 0), the other placements spread it over both
    ranks; so stage0's step time grows more than theirs, and it ends the slowest."""
    from omni.sim.compare import simulate

    cfg = traced["cfg"]
    cheap, costly = (simulate(dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, encoder_efficiency=cfg.cluster.encoder_efficiency * f)))["placements"] for f in (1.0, 0.25))
    for p in R.PLACEMENTS:
        for a, b in zip(cheap[p]["per_rank"], costly[p]["per_rank"]):
            assert b["encoder_s"] == pytest.approx(4 * a["encoder_s"], rel=1e-6), (p, a, b)
            assert b["llm_s"] == pytest.approx(a["llm_s"], rel=1e-9), p
    encoder_s = {p: [r["encoder_s"] for r in sorted(cheap[p]["per_rank"], key=lambda r: r["stage"])]
                 for p in R.PLACEMENTS}
    assert encoder_s["stage0"][0] > 0 and encoder_s["stage0"][1] == 0, encoder_s
    for p in ("encoder_first", "colocated"):
        assert min(encoder_s[p]) > 0, (p, encoder_s)
    growth = {p: costly[p]["step_time_s"] - cheap[p]["step_time_s"] for p in R.PLACEMENTS}
    assert growth["stage0"] > growth["encoder_first"] > 0 and growth["stage0"] > growth["colocated"] > 0, growth
    assert costly["stage0"]["step_time_s"] > max(costly[p]["step_time_s"] for p in ("encoder_first", "colocated"))
