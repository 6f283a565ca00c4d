"""The simulator against measured CPU runs: the placements' step times side by side, predicted
vs measured, after calibrating on one run's trace (docs/benchmarks.md, "Placements against
measured CPU runs"). A benchmark, not a test: its timings move with the machine's load, so
nothing here is asserted; tests/sim/test_validation_cpu.py checks the structure, timing-free.

Three real training runs of the CPU demo on 2 ranks (``parallel.pp=2``, 1F1B, gloo, fp32) differ
only in ``multiplex.placement`` (stage0, encoder_first, colocated); the data is image-heavy and
the vision tower bigger than the demo's (tests/sim/_runs.py, which the test shares), so that
where the encoders run changes the step time. Each run trains ``--steps`` steps; step 1
(warm-up) and the traced last step (``multiplex.trace_step``: the Chrome trace the calibration
reads) are left out of the timings. Every run draws the same samples at the same step, so
measured steps pair up across placements.

The simulator is calibrated on the colocated run's trace (``calibrate_from_trace``; the fitted
factors written as ``omni simulate --calibrate --out`` would write them), once from the ``cpu``
preset and once from a start predicting everything 2x too fast (the fit must land on the same
factors), and then replays every measured step of every placement with ``sim.calibration`` on
the same data (``data.source=mixture``: the planner draws the micro-batches training drew).

The machine's speed drifts from one run to the next, and two ranks computing at once on one CPU
socket slow each other (shared caches and memory bandwidth), which GPUs do not and the simulator
does not model. So placements are also compared at equal compute speed: a placement's
*corrected* step time is its step time over its run's compute time (the mean per-rank time in
encoder, LLM and optimizer spans), for the prediction the same (predicted step time over
predicted compute). Raw ratios are printed beside them. Each run reports the share of the
machine's CPU time other processes took while it ran: a busy machine's timings measure them too.

    python scripts/bench/sim_validation_cpu.py [--steps 8] [--out DIR]
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, git_state, machine, parser, save, table

sys.path.insert(0, str(REPO / "tests" / "sim"))
import _runs as R  # noqa: E402

CALIBRATE_ON = "colocated"  # the only placement whose trace has a gradient sync to fit comm on


def measure(root: Path, steps: int) -> dict:
    from dataloading.demo import write_demo_dataset
    from omni.sim.calibrate import calibrate_from_trace
    from omni.sim.compare import simulate
    from recipes.simulate_cmd import load_sim_config

    measured_steps = list(range(2, steps))
    t0 = time.perf_counter()
    demo = write_demo_dataset(root / "demo", seed=0, scale=0.05, progress=False)
    mixture = R.write_mixture(demo)
    runs = {}
    for p in R.PLACEMENTS:
        runs[p] = R.train(p, mixture, demo, root / "runs" / p, steps, steps)
        print(f"{p}: {runs[p].wall_s:.1f} s wall, other processes took {100 * runs[p].foreign_cpu_share:.0f}% "
              f"of the CPU", flush=True)
    t_runs = time.perf_counter()

    cfg = load_sim_config(R.sim_overrides(CALIBRATE_ON, mixture, steps, 1))
    trace = runs[CALIBRATE_ON].trace(steps)
    fit = calibrate_from_trace(cfg, str(trace))
    fit_off = calibrate_from_trace(dataclasses.replace(cfg, cluster=R.faster(cfg.cluster, 2.0)), str(trace))
    factors = root / "calibration.yaml"
    factors.write_text(fit.to_yaml())

    step_s = {p: [] for p in R.PLACEMENTS}
    compute_s = {p: [] for p in R.PLACEMENTS}
    base = load_sim_config(R.sim_overrides(CALIBRATE_ON, mixture, measured_steps[0], 1, factors))
    for step in measured_steps:
        c = dataclasses.replace(base, data=dataclasses.replace(base.data, first_step=step - 1, steps=1))
        out = simulate(c)["placements"]
        for p in R.PLACEMENTS:
            step_s[p].append(out[p]["step_time_s"])
            compute_s[p].append(statistics.mean(r["llm_s"] + r["encoder_s"] for r in out[p]["per_rank"]))
    measured = {p: r.step_times(measured_steps) for p, r in runs.items()}
    measured_compute = {p: r.compute_times(measured_steps) for p, r in runs.items()}
    return {"steps": steps, "measured_steps": measured_steps,
            "runs": {p: {"wall_s": r.wall_s, "foreign_cpu_share": r.foreign_cpu_share} for p, r in runs.items()},
            "fit": fit.to_dict(), "fit_off": fit_off.to_dict(), "fit_rows": fit.rows,
            "fit_summary": fit.summary(), "fit_off_summary": fit_off.summary(),
            "same_compute_factors_from_both_starts": all(
                abs(fit_off.factors[k] - fit.factors[k]) <= 1e-9 * abs(fit.factors[k]) for k in R.START_INDEPENDENT),
            "measured": measured, "predicted": step_s, "measured_compute": measured_compute,
            "predicted_compute": compute_s, "runs_s": t_runs - t0, "simulation_s": time.perf_counter() - t_runs}


def _per_compute(step_s: dict, compute_s: dict) -> dict:
    return {p: [t / c for t, c in zip(step_s[p], compute_s[p])] for p in step_s}


def _ratios(values: dict) -> dict:
    ref = R.median(values["stage0"])
    return {p: R.median(v) / ref for p, v in values.items()}


def report(res: dict) -> str:
    fit, off = res["fit"], res["fit_off"]
    out = [f"Runs (other processes' share of the CPU while each ran): "
           + ", ".join(f"{p} {r['wall_s']:.0f} s ({100 * r['foreign_cpu_share']:.0f}%)" for p, r in res["runs"].items()),
           "", "Calibration on the colocated trace (median per-event error):", "",
           table(["start", "before", "after"],
                 [["the cpu preset", f"{100 * fit['error_before']:.1f}%", f"{100 * fit['error_after']:.1f}%"],
                  ["a start predicting everything 2x too fast", f"{100 * off['error_before']:.1f}%",
                   f"{100 * off['error_after']:.1f}%"]]),
           "", f"Both starts land on the same compute factors: "
           f"{'yes' if res['same_compute_factors_from_both_starts'] else 'NO'}. "
           f"Over {fit['events']} events the fit scaled LLM compute x{fit['compute_scale']:.2f}, encoder compute "
           + (f"x{fit['encoder_scale']:.2f}" if fit["encoder_scale"] else "kept")
           + ", communication " + (f"x{fit['comm_scale']:.2f}" if fit["comm_scale"] else "kept") + ".", ""]
    m, p = res["measured"], res["predicted"]
    cm, cp = _per_compute(m, res["measured_compute"]), _per_compute(p, res["predicted_compute"])
    raw_m, raw_p, cor_m, cor_p = _ratios(m), _ratios(p), _ratios(cm), _ratios(cp)
    rows = []
    for pl in R.PLACEMENTS:
        rows.append([pl, f"{R.median(m[pl]):.3f}", f"{R.median(p[pl]):.3f}",
                     f"{R.median(res['measured_compute'][pl]):.3f}", f"{R.median(res['predicted_compute'][pl]):.3f}",
                     f"{raw_m[pl]:.3f} / {raw_p[pl]:.3f} ({100 * abs(raw_p[pl] - raw_m[pl]) / raw_m[pl]:.1f}%)",
                     f"{cor_m[pl]:.3f} / {cor_p[pl]:.3f} ({100 * abs(cor_p[pl] - cor_m[pl]) / cor_m[pl]:.1f}%)"])
    steps = res["measured_steps"]
    out += [f"Step time relative to stage0 (medians over steps {steps[0]}-{steps[-1]}):", "",
            table(["placement", "step s measured", "step s predicted", "compute s measured", "compute s predicted",
                   "raw ratio measured / predicted (error)", "corrected ratio measured / predicted (error)"], rows), ""]
    for a, b in itertools.combinations(R.PLACEMENTS, 2):
        diffs = [x - y for x, y in zip(cm[a], cm[b])]
        paired = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
        agree = (R.median(cm[a]) < R.median(cm[b])) == (R.median(cp[a]) < R.median(cp[b]))
        out.append(f"- {a} vs {b}: corrected, measured {R.median(cm[a]):.3f} vs {R.median(cm[b]):.3f} "
                   f"({'every step ordered the same way' if paired else 'order changes between steps'}), "
                   f"predicted {R.median(cp[a]):.3f} vs {R.median(cp[b]):.3f}: "
                   f"{'same order' if agree else 'OPPOSITE order'}")
    return "\n".join(out)


def main() -> None:
    p = parser("The simulator against measured 2-rank CPU runs of three placements (timings, not asserted)")
    p.add_argument("--steps", type=int, default=8, help="trainer steps per run: 1 warm-up, the last traced")
    p.add_argument("--work", default=None, help="folder for the demo data and the runs (default: a temp folder)")
    args = p.parse_args()
    if args.quick:
        args.steps = 4
    if args.steps < 4:
        raise SystemExit("sim_validation_cpu: error: --steps must be >= 4 (a warm-up, two timed steps, a traced one)")
    root = Path(args.work or tempfile.mkdtemp(prefix="omni_sim_validation_"))
    t0 = time.perf_counter()
    res = measure(root, args.steps)
    res.update(machine=machine(), git=git_state(), seconds=time.perf_counter() - t0)
    text = report(res)
    print(text)
    print(f"\n{res['fit_summary']}\n(2x start) {res['fit_off_summary']}")
    path = save(args.out, "sim_validation_cpu" + ("_quick" if args.quick else ""), res)
    print(f"wrote {path} ({res['seconds']:.0f} s; runs {res['runs_s']:.0f} s, simulation {res['simulation_s']:.0f} s)")


if __name__ == "__main__":
    main()
