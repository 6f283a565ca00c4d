"""MegaScale-Omni's workloads A-D in the scale simulator, every placement side by side.

One ``omni.sim.simulate.simulate(cfg)`` call per workload preset (conf/workload/A..D.yaml) and
image:text mix 1:9 ... 9:1 (``data.image_ratio`` 0.1 ... 0.9) gives all placements; stage0 is
the paper's Megatron-LM baseline. SIMULATED numbers, not measurements. The full run writes the
``## Paper workloads A–D (simulated)`` section of ``--doc`` and docs/img/paper_*.png; ``--quick``
(A and C, three mixes, one step) writes ``*_quick.*`` files and no doc unless ``--doc`` is given.

    python scripts/bench/paper_workloads.py [--quick] [--out DIR] [--doc FILE] [--out-json FILE]
        [HYDRA_OVERRIDE ...]      e.g. cluster=h200 sim.calibration=fit.yaml
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from _common import REPO, git_state, machine, parser, table
from tqdm import tqdm

from recipes.simulate_cmd import load_sim_config

SECTION = "## Paper workloads A–D (simulated)"
PLACES = ("colocated", "stage0", "encoder_first", "disaggregated")
PAPER_SPEEDUP = {"A": 1.54, "B": 3.30, "C": 7.57, "D": 1.98}  # best over Megatron-LM, MegaScale-Omni
PAPER_MFU = 0.382
FACTORS = ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "comm_efficiency", "op_overhead_us")
KEEP = lambda r: {k: v for k, v in r.items() if k != "per_rank"}  # noqa: E731  (JSON without the per-cell table)


def mix(r: float) -> str:
    return f"{round(10 * r)}:{10 - round(10 * r)}"


def run_one(overrides: list[str]) -> tuple[dict, dict]:
    """All placements of one workload x mix. If the call fails (e.g. the encoder planner finds no
    SP block for a placement), each placement runs alone; one that fails alone is retried with
    ``multiplex.encoder_sp=1`` (flagged) and, failing that, kept as an error."""
    from omni.sim.simulate import simulate

    cfg = load_sim_config(overrides)
    try:
        return cfg, {p: KEEP(r) for p, r in simulate(cfg)["placements"].items()}
    except (ValueError, RuntimeError):
        out = {}
    for p in PLACES:
        err = None
        for extra in ([], ["multiplex.encoder_sp=1"]):
            try:
                r = simulate(load_sim_config(overrides + [f"sim.placements=[{p}]"] + extra))["placements"][p]
                out[p] = KEEP(r) | ({"fallback": extra[0], "error": err} if extra else {})
                break
            except (ValueError, RuntimeError) as e:
                err = f"{type(e).__name__}: {e}"
                out[p] = {"error": err}
    return cfg, out


def speedup(res: dict, p: str) -> tuple[float | None, bool]:
    """stage0 step time / p's step time, and whether both fit in memory."""
    a, b = res.get(p, {}), res.get("stage0", {})
    if "step_time_s" not in a or "step_time_s" not in b:
        return None, False
    return b["step_time_s"] / a["step_time_s"], a["fits"] and b["fits"]


def cell(r: dict) -> str:
    if "step_time_s" not in r:
        return "error"
    fit = "fits" if r["fits"] else f"**OOM {r['memory_gib']['total']:.0f} GiB**"
    return (f"{r['step_time_s']:.2f} s · {100 * r['mfu']:.1f}% · {100 * r['bubble_fraction']:.0f}% · "
            f"{100 * r['comm_share']:.0f}% · {fit}" + (" ¹" if "fallback" in r else ""))


def sp_text(res: dict, p: str = "colocated") -> str:
    s, ok = speedup(res, p)
    if s is None or ok:
        return "error" if s is None else f"{s:.2f}x"
    return "OOM (" + ", ".join(q for q in (p, "stage0") if not res[q]["fits"]) + ")"


def best(runs: dict, p: str = "colocated") -> tuple[float | None, str]:
    ok = [(speedup(r, p)[0], m) for m, r in runs.items() if speedup(r, p)[1]]
    return max(ok) if ok else (None, "")


def peak_mfu(runs: dict, places=PLACES) -> tuple[float | None, str]:
    ok = [(r[p]["mfu"], f"{p} {m}") for m, r in runs.items() for p in places if r[p].get("fits")]
    return max(ok) if ok else (None, "")


def summary_rows(res: dict) -> list[list]:
    rows = []
    for w, runs in res["runs"].items():
        last = runs[max(runs)]
        b, bm = best(runs)
        m, mm = peak_mfu(runs, ("colocated",))
        a, am = peak_mfu(runs)
        rows.append([w, sp_text(last), f"{b:.2f}x ({bm})" if b is not None else "none fits",
                     f"{PAPER_SPEEDUP[w]:.2f}x", f"{100 * m:.1f}% ({mm})" if m is not None else "none fits",
                     f"{100 * a:.1f}% ({am})" if a is not None else "none fits", f"{100 * PAPER_MFU:.1f}%"])
    return rows


SUMMARY_HEAD = ["workload", "colocated/stage0 at 9:1", "best colocated/stage0 (both fit)", "paper best vs Megatron-LM",
                "peak MFU colocated (fits)", "peak MFU any placement (fits)", "paper peak MFU"]


def report(res: dict) -> str:
    c = res["cluster"]
    eff = ", ".join(f"{k} {c[k]:g}" for k in FACTORS)
    cal = f"calibration file `{res['calibration']}`" if res["calibration"] else "no calibration file (preset factors)"
    lines = [f"**SIMULATION, not a measurement.** `scripts/bench/paper_workloads.py{' ' if res['argv'] else ''}"
             f"{' '.join(res['argv'])}` (commit {res['git']['commit']}, {res['time']}, {res['seconds']:.0f} s) ran "
             f"`omni.sim.simulate` on cluster preset `{c['name']}` ({c['peak_tflops']:g} TFLOP/s, {c['hbm_gib']:g} GiB "
             f"HBM, {c['gpus_per_node']} GPUs/node, NVLink {c['nvlink_gbps']:g} GB/s, network {c['net_gbps']:g} GB/s "
             f"per GPU) with efficiency factors {eff}; {cal}. Extra overrides: "
             f"`{' '.join(res['overrides']) or 'none'}`. Each figure is the mean of the simulated steps "
             f"(`data.steps`; placements with the same DP size see the same steps, disaggregated draws its own "
             f"for its smaller DP size). stage0 is the paper's Megatron-LM baseline (encoder on the first pipeline stage).",
             "", "Summary (speedups only where both placements fit in memory; OOM is shown as such):", "",
             table(SUMMARY_HEAD, summary_rows(res)), "",
             "Plots: `docs/img/paper_speedup.png`, `docs/img/paper_mfu.png`, `docs/img/paper_bubble.png` "
             "(hollow markers: out of memory).", ""]
    for w, runs in res["runs"].items():
        lay = next(iter(runs.values()))["colocated"].get("layout", {})
        lines += [f"### Workload {w} (simulated; colocated layout pp{lay.get('pp')} x dp{lay.get('dp_shard')} x "
                  f"tp{lay.get('tp')}, {res['gpus'][w]} GPUs)", "",
                  "Cells: step time · MFU · bubble · exposed comm · memory verdict.", ""]
        rows = [[m] + [cell(r[p]) for p in PLACES] + [sp_text(r), sp_text(r, "disaggregated")] for m, r in runs.items()]
        lines += [table(["image:text", *PLACES, "colocated/stage0", "disaggregated/stage0"], rows), ""]
        notes = [f"{'¹' if 'fallback' in r[p] else 'error:'} {m} {p}: `{r[p]['error']}`"
                 + (f"; these figures are a rerun with `{r[p]['fallback']}`" if "fallback" in r[p] else "")
                 for m, r in runs.items() for p in PLACES if "error" in r[p]]
        lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    return "\n".join(lines).rstrip() + "\n"


def write_section(doc: Path, body: str) -> None:
    body = f"{SECTION}\n\n{body}"
    old = doc.read_text() if doc.exists() else ""
    if SECTION in old:
        start = old.index(SECTION)
        nxt = old.find("\n## ", start + len(SECTION))
        new = old[:start] + body + (old[nxt:] if nxt >= 0 else "")
    else:
        new = old.rstrip() + "\n\n" + body
    doc.write_text(new)


def plots(res: dict, out: Path, tag: str) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: E402
    cname = res["cluster"]["name"]
    paths = []

    def save(fig, name):
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    def xaxis(ax, runs):  # image:text mixes as ticks; returns the x positions
        xs = [int(m.split(":")[0]) / 10 for m in runs]
        ax.set_xticks(xs, list(runs), fontsize=8)
        ax.set_xlabel("image:text share of LLM tokens (data.image_ratio)")
        return xs

    def line(ax, xs, ys, oks, label, color, style="-", marker="o"):
        ax.plot(xs, ys, style, color=color, label=label)
        for x, y, ok in zip(xs, ys, oks):
            ax.plot([x], [y], marker, color=color, mfc=color if ok else "white", ms=7)

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (w, runs) in enumerate(res["runs"].items()):
        col, xs = f"C{i}", xaxis(ax, runs)
        for p, style in (("colocated", "-"), ("disaggregated", "--")):
            sp = [speedup(r, p) for r in runs.values()]
            line(ax, xs, [s or float("nan") for s, _ in sp], [ok for _, ok in sp], f"{w}: {p}/stage0", col, style)
        ax.axhline(PAPER_SPEEDUP[w], color=col, ls=":", lw=1)
        ax.annotate(f"paper {w} {PAPER_SPEEDUP[w]}x", (0.9, PAPER_SPEEDUP[w]), color=col, fontsize=8, ha="right", va="bottom")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.minorticks_off()
    ax.set_yticks([0.5, 0.75, 1, 1.5, 2, 3, 5, 8], ["0.5", "0.75", "1", "1.5", "2", "3", "5", "8"])
    ax.set(ylabel="speedup over stage0 (simulated, log scale)",
           title=f"Simulated speedup over stage0 (Megatron-LM placement), {cname}\nhollow: a side out of memory")
    ax.legend(fontsize=8, ncol=2)
    save(fig, f"paper_speedup{tag}.png")

    for key, fname, ylabel in (("mfu", "paper_mfu", "MFU (simulated)"), ("bubble_fraction", "paper_bubble",
                                                                         "bubble fraction (simulated)")):
        n = len(res["runs"])
        fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.8), sharey=True, squeeze=False)
        for ax, (w, runs) in zip(axes[0], res["runs"].items()):
            xs = xaxis(ax, runs)
            for j, p in enumerate(PLACES):
                rs = [r[p] for r in runs.values()]
                line(ax, xs, [100 * r.get(key, float("nan")) for r in rs], [r.get("fits", False) for r in rs], p,
                     f"C{j}")
            if key == "mfu":
                ax.axhline(100 * PAPER_MFU, color="k", ls=":", lw=1, label="paper peak MFU")
            ax.set_title(f"workload {w} (simulated)")
        axes[0][0].set_ylabel(ylabel + " %")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{ylabel} per placement, {cname}; hollow: out of memory")
        save(fig, f"{fname}{tag}.png")
    return paths


def main() -> None:
    p = parser("MegaScale-Omni's workloads A-D in the scale simulator, all placements side by side")
    p.add_argument("--doc", default=None, help="markdown file whose section to write (full run: docs/benchmarks.md)")
    p.add_argument("--out-json", default=None, help="results JSON (default: OUT/paper_workloads[_quick].json)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides passed to every simulation, e.g. cluster=h200")
    args = p.parse_args()
    workloads = ("A", "C") if args.quick else ("A", "B", "C", "D")
    ratios = (0.1, 0.5, 0.9) if args.quick else tuple(k / 10 for k in range(1, 10))
    extra = (["data.steps=1"] if args.quick else []) + args.overrides
    tag = "_quick" if args.quick else ""
    res = {"benchmark": "paper_workloads", "time": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
           "overrides": extra, "machine": machine(), "git": git_state(), "runs": {}, "gpus": {}}
    t0 = time.perf_counter()
    for w, r in tqdm([(w, r) for w in workloads for r in ratios], desc="simulating", unit="run", file=sys.stderr):
        cfg, out = run_one([f"workload={w}", f"data.image_ratio={r}"] + extra)
        res["runs"].setdefault(w, {})[mix(r)] = out
        res["gpus"][w] = cfg.cluster.num_gpus
        res["cluster"], res["calibration"] = dict(vars(cfg.cluster)), cfg.sim.calibration
    res["seconds"] = time.perf_counter() - t0
    print(f"\nSIMULATED on {res['cluster']['name']} (" + ", ".join(f"{k} {res['cluster'][k]:g}" for k in FACTORS)
          + f"; calibration: {res['calibration'] or 'none'}), {res['seconds']:.0f} s")
    for w, runs in res["runs"].items():
        print(f"{w}  colocated/stage0: " + "  ".join(f"{m} {sp_text(r)}" for m, r in runs.items()))
        print(f"{'':3}disagg./stage0:   " + "  ".join(f"{m} {sp_text(r, 'disaggregated')}" for m, r in runs.items()))
    print(table(SUMMARY_HEAD, summary_rows(res)))
    (out := Path(args.out)).mkdir(parents=True, exist_ok=True)
    jpath = Path(args.out_json or out / f"paper_workloads{tag}.json")
    jpath.write_text(json.dumps(res, separators=(",", ":")) + "\n")
    print(f"wrote {jpath}; plots " + ", ".join(map(str, plots(res, out, tag))))
    doc = args.doc or (None if args.quick else str(REPO / "docs" / "benchmarks.md"))
    if doc:
        write_section(Path(doc), report(res))
        print(f"section {SECTION!r} written to {doc}")


if __name__ == "__main__":
    main()
