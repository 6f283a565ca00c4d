"""Issue 18's multiplexing mechanisms measured on CPU ranks and predicted by the simulator, as
ratios side by side: one encoder call per cut group vs one per chunk (multiplex.chunks_per_cut
4 vs 1), p2p vs all_to_all exchanges, hybrid vs flat sharded encoder weights, and bubble calls
(multiplex.fill_bubbles). A benchmark,
not a test: timings move with the machine's load, nothing is asserted.

Each world size has a base run (colocated, the demo with an image-heavy mixture and the bigger
vision tower of tests/sim/_runs.py, ``parallel.pp=2``, 1F1B, gloo, fp32) and one run per
mechanism that changes one knob of it. The simulator is calibrated on the base run's trace
(``calibrate_from_trace``) and replays every measured step of every run with the run's own
data (``data.source=mixture``) and knobs. On 4 ranks the layout is ``pp=2 x dp_shard=2`` with
``parallel.gpus_per_node=2``, so that hybrid weights have two shard groups; all ranks share one
host, so the simulated "nodes" get the host's links on both levels (``cluster.nics_per_node=2``,
``cluster.net_gbps`` = ``cluster.nvlink_gbps``, same latency). Ratios are reported raw (step
time) and corrected for each run's compute speed (step time over the mean per-rank compute
time, as scripts/bench/sim_validation_cpu.py does: two ranks computing at once on one socket
slow each other, which the simulator does not model).

Noise: each world size also runs the base twice (``base (again)``, an A/A run): how far that
ratio is from 1 is what run-to-run noise alone does here. Every measured ratio is reported with
its spread over the timed steps (the lowest and highest of a step's time over the base run's
median), and a mechanism whose effect is no larger than the A/A run's deviation, or whose spread
includes 1, is marked "within noise".

    python scripts/bench/mechanisms_cpu.py [--steps 10] [--worlds 2,4] [--doc docs/benchmarks.md]
"""
from __future__ import annotations

import dataclasses
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, git_state, machine, parser, save, table, write_doc_section

sys.path.insert(0, str(REPO / "tests" / "sim"))
import _runs as R  # noqa: E402

SECTION = "## Multiplexing mechanisms, measured on CPU ranks and predicted"
BASE = {2: {"multiplex.chunks_per_cut": 1, "multiplex.exchange": "all_to_all", "multiplex.encoder_weights": "replicated",
            "multiplex.fill_bubbles": "false"},
        4: {"parallel.dp_shard": 2, "parallel.gpus_per_node": 2, "multiplex.chunks_per_cut": 1,
            "multiplex.exchange": "all_to_all", "multiplex.encoder_weights": "sharded", "multiplex.fill_bubbles": "false"}}
MECHANISMS = {2: {"one call per cut (4 chunks)": {"multiplex.chunks_per_cut": 4}, "p2p": {"multiplex.exchange": "p2p"},
                  "bubble calls (p2p)": {"multiplex.exchange": "p2p", "multiplex.fill_bubbles": "true"}},
              4: {"hybrid (2 groups of 2)": {"multiplex.encoder_weights": "hybrid"},
                  "one call per cut (4 chunks)": {"multiplex.chunks_per_cut": 4}, "p2p": {"multiplex.exchange": "p2p"},
                  "bubble calls (hybrid, p2p)": {"multiplex.encoder_weights": "hybrid", "multiplex.exchange": "p2p",
                                                 "multiplex.fill_bubbles": "true"}}}


def sim_cluster(world: int) -> dict:
    """The cpu preset, with fake 2-rank nodes on 4 ranks whose links are the host's."""
    if world == 2:
        return {}
    from recipes.simulate_cmd import load_sim_config

    c = load_sim_config(["cluster=cpu"]).cluster
    return {"cluster.gpus_per_node": 2, "cluster.nics_per_node": 2, "cluster.net_gbps": c.nvlink_gbps,
            "cluster.net_latency_us": c.nvlink_latency_us}


def measure(root: Path, steps: int, worlds: list[int]) -> dict:
    from dataloading.demo import write_demo_dataset
    from omni.sim.calibrate import calibrate_from_trace
    from omni.sim.compare import simulate
    from recipes.simulate_cmd import load_sim_config

    demo = write_demo_dataset(root / "demo", seed=0, scale=0.05, progress=False)
    mixture = R.write_mixture(demo)
    timed = list(range(2, steps))  # step 1 warms up, the last is traced
    out = {}
    for world in worlds:
        variants = {"base": BASE[world], AGAIN: BASE[world],
                    **{k: {**BASE[world], **v} for k, v in MECHANISMS[world].items()}}
        runs = {}
        for name, over in variants.items():
            runs[name] = R.train("colocated", mixture, demo, root / f"w{world}" / re.sub(r"[^a-z0-9]+", "_", name), steps, steps,
                                 world=world, extra=over)
            print(f"{world} ranks, {name}: {runs[name].wall_s:.0f} s, other processes "
                  f"{100 * runs[name].foreign_cpu_share:.0f}% of the CPU", flush=True)
        cluster = sim_cluster(world)
        cfg = load_sim_config(R.sim_overrides("colocated", mixture, steps, 1, world=world,
                                              extra={**BASE[world], **cluster}))
        fit = calibrate_from_trace(cfg, str(runs["base"].trace(steps)))
        factors = root / f"calibration_w{world}.yaml"
        factors.write_text(fit.to_yaml())
        res = {"fit": fit.to_dict(), "runs": {}}
        for name, over in variants.items():
            base = load_sim_config(R.sim_overrides("colocated", mixture, timed[0], 1, factors, world=world,
                                                   extra={**over, **cluster, "sim.placements": "[colocated]"}))
            pred, pred_compute = [], []
            for step in timed:
                c = dataclasses.replace(base, data=dataclasses.replace(base.data, first_step=step - 1, steps=1))
                p = simulate(c)["placements"]["colocated"]
                pred.append(p["step_time_s"])
                pred_compute.append(statistics.mean(r["llm_s"] + r["encoder_s"] for r in p["per_rank"]))
            res["runs"][name] = {"measured": runs[name].step_times(timed), "measured_compute": runs[name].compute_times(timed),
                                 "predicted": pred, "predicted_compute": pred_compute,
                                 "wall_s": runs[name].wall_s, "foreign_cpu_share": runs[name].foreign_cpu_share}
        out[str(world)] = res
    return {"steps": steps, "timed_steps": timed, "worlds": out}


AGAIN = "base (again)"  # the A/A run: the base's knobs, run a second time


def ratios(run: dict, base: dict) -> dict[str, float]:
    med = statistics.median
    raw_m = med(run["measured"]) / med(base["measured"])
    steps = [t / med(base["measured"]) for t in run["measured"]]  # each timed step over the base's median
    raw_p = med(run["predicted"]) / med(base["predicted"])
    per = lambda r, k: med([t / c for t, c in zip(r[k], r[f"{k}_compute"])])  # noqa: E731
    cor_m = per(run, "measured") / per(base, "measured")
    cor_p = per(run, "predicted") / per(base, "predicted")
    return {"raw_measured": raw_m, "raw_predicted": raw_p, "corrected_measured": cor_m, "corrected_predicted": cor_p,
            "low": min(steps), "high": max(steps)}


def verdict(r: dict, noise: float) -> str:
    """Whether a measured effect stands out of the noise: larger than the A/A run's deviation
    from 1 and with a spread that does not include 1."""
    effect = abs(1.0 - r["raw_measured"])
    if effect <= noise or r["low"] <= 1.0 <= r["high"]:
        return f"within noise ({100 * effect:.1f}% vs A/A {100 * noise:.1f}%)"
    return f"{'faster' if r['raw_measured'] < 1 else 'slower'} by {100 * effect:.1f}% (A/A {100 * noise:.1f}%)"


def report(res: dict) -> str:
    lines = [f"**Measured** on this machine's CPU ranks (gloo, fp32) and **predicted** by `omni simulate` "
             f"calibrated on each world size's base run; `scripts/bench/mechanisms_cpu.py` (commit "
             f"{res['git']['commit']}, {res['time']}, {res['seconds']:.0f} s). Ratios are a mechanism's step time "
             f"over the base run's (below 1: the mechanism is faster), medians over steps "
             f"{res['timed_steps'][0]}-{res['timed_steps'][-1]}, with the spread of the steps (lowest-highest step "
             f"time over the base's median); error = |predicted - measured| / measured. `{AGAIN}` is the base run "
             f"repeated (an A/A run): its distance from 1 is the run-to-run noise, and an effect no larger than it "
             f"(or whose spread includes 1) is marked within noise.", ""]
    for world, w in res["worlds"].items():
        base = w["runs"]["base"]
        again = w["runs"].get(AGAIN)
        noise = abs(1.0 - ratios(again, base)["raw_measured"]) if again else 0.0
        rows = []
        for name, run in w["runs"].items():
            if name == "base":
                continue
            r = ratios(run, base)
            err = lambda a, b: f"{100 * abs(r[b] - r[a]) / r[a]:.1f}%"  # noqa: E731
            rows.append([name, f"{r['raw_measured']:.3f} ({r['low']:.3f}-{r['high']:.3f})", f"{r['raw_predicted']:.3f}",
                         err("raw_measured", "raw_predicted"),
                         f"{r['corrected_measured']:.3f}", f"{r['corrected_predicted']:.3f}",
                         err("corrected_measured", "corrected_predicted"),
                         "(the noise itself)" if name == AGAIN else verdict(r, noise),
                         f"{100 * run['foreign_cpu_share']:.0f}%"])
        desc = ", ".join(f"`{k}={v}`" for k, v in BASE[int(world)].items())
        lines += [f"### {world} ranks (base: colocated, pp=2, {desc})", "",
                  table(["mechanism", "measured (spread)", "predicted", "error", "corrected measured",
                         "corrected predicted", "error", "effect", "CPU taken by others"], rows), ""]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="trainer steps per run: 1 warm-up, the last traced")
    p.add_argument("--worlds", default="2,4", help="rank counts, comma-separated (2 and/or 4)")
    p.add_argument("--work", default=None, help="folder for the demo data and the runs (default: a temp folder)")
    p.add_argument("--doc", default=None, help="markdown file whose section is (re)written")
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.steps < 4 or any(w not in BASE for w in worlds):
        raise SystemExit("mechanisms_cpu: error: --steps must be >= 4 and --worlds a list of 2 and 4")
    root = Path(args.work or tempfile.mkdtemp(prefix="omni_mechanisms_"))
    t0 = time.perf_counter()
    res = measure(root, args.steps, worlds)
    res.update(machine=machine(), git=git_state(), seconds=time.perf_counter() - t0, time=time.strftime("%Y-%m-%d %H:%M:%S"))
    text = report(res)
    print(text)
    print(save(args.out, "mechanisms_cpu", res))
    if args.doc:
        write_doc_section(Path(args.doc), SECTION, text)


if __name__ == "__main__":
    sys.exit(main())
