"""The simulator against measured CPU runs: the placements' step times and the calibration.

Three real training runs of the CPU demo on 2 ranks (``parallel.pp=2``, 1F1B, gloo, fp32) differ
only in ``multiplex.placement`` (stage0, encoder_first, colocated); the data is image-heavy and
the vision tower bigger than the demo's (tests/sim/_runs.py), so that where the encoders run
changes the step time. Each run trains STEPS steps; step 1 (warm-up) and the traced last step
(``multiplex.trace_step``: the Chrome trace the calibration reads) are left out of the timings.
Every run draws the same samples at the same step, so measured steps pair up across placements.

The simulator is calibrated on the colocated run's trace (``calibrate_from_trace``; the fitted
factors written as the ``--calibrate --out`` file would be) and then replays every measured step
of every placement with ``sim.calibration`` on the same data (``data.source=mixture``: the
planner draws the micro-batches training drew).

The machine's speed drifts from one run to the next: the same steps of encoder_first took
1.21-1.41 s (median) over eight runs on the 2-core CI machine, with no other process running,
while the step time per second of compute (step time over the mean per-rank time in encoder,
LLM and optimizer spans) stayed within +-2% (stage0 1.66-1.69, encoder_first 1.43-1.48,
colocated 1.48-1.51). And on one CPU socket two ranks computing at once slow each other (shared
caches and memory bandwidth: a step's spans took 6% longer under encoder_first and 10% longer
under colocated than under stage0, where rank 1 mostly waits; geometric means over six runs,
single runs -7% to +18%), which GPUs do not and the simulator does not model. So placements are compared at equal compute speed: a placement's *corrected* step time is
its step time over its run's compute time, for the prediction the same (predicted step time over
predicted compute). Raw ratios are printed beside them.

Asserted (run with ``-s`` for the tables):
(a) calibration: fitted from the cpu preset and from a start 2x too fast, the fit lands on the
    same compute factors, cuts the 2x start's median per-event error, and ends below
    CALIBRATION_BOUND from both;
(b) ratios: every placement's corrected step time relative to stage0 (medians over the measured
    steps), predicted vs measured, within RATIO_BOUND relative error (the raw ratios are printed,
    not asserted: between the three runs the compute time per step alone differed by up to 18%);
(c) ordering: two placements whose corrected step times are ordered the same way at every
    measured step (a sign test: by chance with probability 2 / 2**len(MEASURED)) are ordered the
    same way by the prediction, and at least one pair is.

A run during which other processes took much of the machine measures them as much as Omni:
above BUSY_MACHINE the tests skip and say so.
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

import pytest

import _runs as R

pytestmark = pytest.mark.slow  # three 2-rank training runs, ~60 s on 2 cores

STEPS = 8  # trainer steps per run: 1 warm-up, 2..7 timed, 8 traced
MEASURED = list(range(2, STEPS))
CALIBRATE_ON = "colocated"  # the only placement whose trace has a gradient sync to fit comm on
# Before the fit, LLM stage spans run ~1.35-1.8x their prediction and encoder chunk spans
# ~1.0-1.25x (medians): one compute factor cannot fit both and leaves each ~15-20% off.
CALIBRATION_BOUND = 0.25
# Corrected ratios: over six quiet runs the prediction put encoder_first and colocated 6-10%
# too low against stage0, and the measured corrected ratios moved by ~2-3% from run to run.
# The cause is the calibration's one compute factor: fitted to LLM and encoder spans together
# it over-scales the encoder, and stage0 (all encoder work on rank 0) most. With one factor for
# LLM spans and one for encoder spans the same runs agree within 0.1-3%.
RATIO_BOUND = 0.15
# Other processes' share of the machine's CPU time above which a run's timings measure them: a
# colocated run during which they took 26% ran 25% slower, also per second of compute (its
# ranks wait for each other at every encoder chunk); quiet runs see 0-2%.
BUSY_MACHINE = 0.1


@pytest.fixture(scope="module")
def validation(tmp_path_factory):
    from dataloading.demo import write_demo_dataset
    from omni.sim.calibrate import calibrate_from_trace
    from omni.sim.simulate import simulate
    from recipes.simulate_cmd import load_sim_config

    t0 = time.perf_counter()
    root = tmp_path_factory.mktemp("validation")
    demo = write_demo_dataset(root / "demo", seed=0, scale=0.05, progress=False)
    mixture = R.write_mixture(demo)
    runs = {p: R.train(p, mixture, demo, root / "runs" / p, STEPS, STEPS) for p in R.PLACEMENTS}
    t_runs = time.perf_counter()
    print()
    for p, r in runs.items():
        print(f"{p}: {r.wall_s:.1f}s wall, other processes took {100 * r.foreign_cpu_share:.0f}% of the CPU")
    busy = {p: round(r.foreign_cpu_share, 2) for p, r in runs.items() if r.foreign_cpu_share > BUSY_MACHINE}
    if busy:
        pytest.skip(f"other processes took more than {BUSY_MACHINE:.0%} of the machine's CPU during {busy}: "
                    f"the step times would measure them; rerun on a quiet machine")

    # Calibrate on one placement's traced step.
    cfg = load_sim_config(R.sim_overrides(CALIBRATE_ON, mixture, STEPS, 1))
    trace = runs[CALIBRATE_ON].trace(STEPS)
    fit = calibrate_from_trace(cfg, str(trace))
    c = cfg.cluster
    fast = dataclasses.replace(c, gemm_efficiency=2 * c.gemm_efficiency, attention_efficiency=2 * c.attention_efficiency,
                               memory_efficiency=2 * c.memory_efficiency, op_overhead_us=c.op_overhead_us / 2,
                               comm_efficiency=2 * c.comm_efficiency)
    fit_off = calibrate_from_trace(dataclasses.replace(cfg, cluster=fast), str(trace))
    factors = root / "calibration.yaml"
    factors.write_text(fit.to_yaml())

    # Every measured step of every placement, simulated with the fitted factors.
    step_s = {p: [] for p in R.PLACEMENTS}
    compute_s = {p: [] for p in R.PLACEMENTS}
    base = load_sim_config(R.sim_overrides(CALIBRATE_ON, mixture, MEASURED[0], 1, factors))
    for step in MEASURED:
        c = dataclasses.replace(base, data=dataclasses.replace(base.data, first_step=step - 1, steps=1))
        out = simulate(c)["placements"]
        for p in R.PLACEMENTS:
            step_s[p].append(out[p]["step_time_s"])
            compute_s[p].append(statistics.mean(r["llm_s"] + r["encoder_s"] for r in out[p]["per_rank"]))
    print(f"runs {t_runs - t0:.1f}s, calibration and simulation {time.perf_counter() - t_runs:.1f}s")
    measured = {p: r.step_times(MEASURED) for p, r in runs.items()}
    measured_compute = {p: r.compute_times(MEASURED) for p, r in runs.items()}
    return {"runs": runs, "fit": fit, "fit_off": fit_off, "measured": measured, "predicted": step_s,
            "measured_corrected": _per_compute(measured, measured_compute),
            "predicted_corrected": _per_compute(step_s, compute_s),
            "measured_compute": measured_compute, "predicted_compute": compute_s}


def _per_compute(step_s: dict, compute_s: dict) -> dict:
    return {p: [t / c for t, c in zip(step_s[p], compute_s[p])] for p in step_s}


def _ratios(values: dict) -> dict:
    ref = R.median(values["stage0"])
    return {p: R.median(v) / ref for p, v in values.items()}


def test_calibration_reduces_per_event_error(validation):
    """The fit from the cpu preset (the factors every prediction here uses) and from a start
    whose compute and communication are predicted 2x too fast: the factors it lands on do not
    depend on the start, from the 2x start it cuts the error, and from either it ends below
    CALIBRATION_BOUND. (From the preset itself the error need not fall: the preset is already
    close, and a sum-ratio scale does not minimise the median per-event error.)"""
    fit, off = validation["fit"], validation["fit_off"]
    print(f"\nfrom the cpu preset: {fit.summary()}")
    print(f"from the preset 2x too fast: {off.summary()}")
    print(f"{'rank':>4} {'event':24} {'measured ms':>11} {'predicted ms':>12} {'fitted ms':>10} {'meas/fitted':>11}")
    scale = {"llm": fit.compute_scale, "encoder": fit.encoder_scale or fit.compute_scale,
             "comm": fit.comm_scale or 1.0}
    for r in fit.rows:
        f = r["predicted_s"] * scale[r["kind"]]
        print(f"{r['rank']:>4} {r['name']:24} {1e3 * r['measured_s']:11.1f} {1e3 * r['predicted_s']:12.1f} "
              f"{1e3 * f:10.1f} {r['measured_s'] / f:11.2f}")
    for kind in ("LLM", "encoder"):
        ratios = [r["measured_s"] / r["predicted_s"] for r in fit.rows if r["kind"] == kind.lower()]
        print(f"{kind} spans: measured / preset prediction median {R.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}, {len(ratios)} spans)")
    print(f"median per-event error: preset {100 * fit.error_before:.1f}% -> {100 * fit.error_after:.1f}%, "
          f"2x start {100 * off.error_before:.1f}% -> {100 * off.error_after:.1f}% (bound {100 * CALIBRATION_BOUND:.0f}%)")
    # Every rank's LLM stage spans and both ranks' encoder chunks, plus the gradient syncs.
    assert fit.events >= 20, fit.events
    assert fit.comm_scale is not None, "the colocated trace has no gradient sync to fit communication on"
    assert fit.encoder_scale is not None, "the colocated trace has no encoder chunk spans"
    for k in ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "op_overhead_us", "encoder_efficiency"):
        assert off.factors[k] == pytest.approx(fit.factors[k], rel=1e-9), k
    assert off.error_after < off.error_before, (off.error_before, off.error_after)
    assert fit.error_after < CALIBRATION_BOUND, fit.error_after
    assert off.error_after < CALIBRATION_BOUND, off.error_after


def test_predicted_ratios_match_measured(validation):
    v = validation
    raw_m, raw_p = _ratios(v["measured"]), _ratios(v["predicted"])
    cor_m, cor_p = _ratios(v["measured_corrected"]), _ratios(v["predicted_corrected"])
    print(f"\n{'placement':14} {'step s meas':>11} {'pred':>6} {'compute s meas':>14} {'pred':>6} "
          f"{'raw ratio meas':>14} {'pred':>6} {'err':>6} {'corrected meas':>14} {'pred':>6} {'err':>6}")
    raw_err, cor_err = {}, {}
    for p in R.PLACEMENTS:
        raw_err[p] = abs(raw_p[p] - raw_m[p]) / raw_m[p]
        cor_err[p] = abs(cor_p[p] - cor_m[p]) / cor_m[p]
        print(f"{p:14} {R.median(v['measured'][p]):11.3f} {R.median(v['predicted'][p]):6.3f} "
              f"{R.median(v['measured_compute'][p]):14.3f} {R.median(v['predicted_compute'][p]):6.3f} "
              f"{raw_m[p]:14.3f} {raw_p[p]:6.3f} {100 * raw_err[p]:5.1f}% "
              f"{cor_m[p]:14.3f} {cor_p[p]:6.3f} {100 * cor_err[p]:5.1f}%")
    for p in R.PLACEMENTS:
        print(f"{p:14} per step: measured {[round(x, 3) for x in v['measured'][p]]}, "
              f"predicted {[round(x, 3) for x in v['predicted'][p]]}")
    print(f"bound on the corrected ratios {100 * RATIO_BOUND:.0f}%")
    for p in R.PLACEMENTS:
        assert cor_err[p] <= RATIO_BOUND, (p, cor_m, cor_p)


def test_predicted_ordering_matches_measured(validation):
    measured, predicted = validation["measured_corrected"], validation["predicted_corrected"]
    raw = validation["measured"]
    checked = 0
    print()
    for a, b in itertools.combinations(R.PLACEMENTS, 2):
        ma, mb = R.median(measured[a]), R.median(measured[b])
        pa, pb = R.median(predicted[a]), R.median(predicted[b])
        diffs = [x - y for x, y in zip(measured[a], measured[b])]
        paired = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
        # The brief's looser criterion on the raw step times, for the record: the medians further
        # apart than the larger max - min of the two placements' steps.
        spread = max(max(raw[a]) - min(raw[a]), max(raw[b]) - min(raw[b]))
        apart = abs(R.median(raw[a]) - R.median(raw[b])) > spread
        print(f"{a} vs {b}: corrected measured {ma:.3f} vs {mb:.3f} (per step {[round(d, 3) for d in diffs]}: "
              f"{'every step agrees' if paired else 'mixed'}), predicted {pa:.3f} vs {pb:.3f}; raw medians "
              f"{R.median(raw[a]):.3f} vs {R.median(raw[b]):.3f}, {'beyond' if apart else 'within'} the spread "
              f"{spread:.3f}")
        if paired:
            checked += 1
            assert (ma < mb) == (pa < pb), (a, b, ma, mb, pa, pb)
    print(f"{checked} pair(s) ordered the same way at every measured step")
    # The workload was chosen so that placements differ; if none does, nothing was validated.
    assert checked >= 1, measured
