"""The reporting half of ``multiplex.py``: per-mixture summaries of the runs, the loss check,
the tables, the placements plot and the schedule picture (``schedule_plot.py``)."""
from __future__ import annotations

import statistics
from pathlib import Path

from _common import median, table
from schedule_plot import draw as draw_schedule

MIXES = {"image_heavy": {"shapes": 0.8, "tones": 0.1, "text": 0.1},
         "text_heavy": {"shapes": 0.1, "tones": 0.1, "text": 0.8}}
SCHEDULE_MIX, SCHEDULE_VARIANTS = "image_heavy", ("stage0", "colocated", "colocated+sharded")
KEYS = ("busy_encoder_s", "busy_llm_s", "busy_comm_s", "busy_optim_s", "idle_s")


def layout_text(layout: dict) -> str:
    """``pp=2 x tp=2 x dp_shard=2, 1f1b`` for titles and tables."""
    sizes = " x ".join(f"{k.split('.')[1]}={v}" for k, v in layout.items() if k != "parallel.pp_schedule")
    return f"{sizes}, {layout['parallel.pp_schedule']}"


def mix_text(mix: str, weights: dict) -> str:
    """``image-heavy mixture (shapes 0.8, tones 0.1, text 0.1)``."""
    return f"{mix.replace('_', '-')} mixture (" + ", ".join(f"{k} {v}" for k, v in weights.items()) + ")"


def timed_steps(run: dict, warmup: int, trace_step: int) -> list[dict]:
    return [m for m in run["metrics"] if m["step"] > warmup and not (run["traced"] and m["step"] == trace_step)]


def summarise(res: dict, mix: str) -> list[dict]:
    """Per variant of one mixture: step time statistics, mean timeline fields, peaks, losses."""
    warmup, trace_step, runs = res["warmup"], res["trace_step"], res["mixes"][mix]["runs"]
    out = []
    for name, _ in res["variants"]:
        mine = [r for r in runs if r["variant"] == name]
        ok = [r for r in mine if r["rc"] == 0 and r["metrics"]]
        timed = [m for r in ok for m in timed_steps(r, warmup, trace_step)]
        if not timed:
            out.append({"variant": name, "failed": True, "runs": len(mine), "ok_runs": len(ok)})
            continue
        mean = lambda k: statistics.fmean(m.get(k, float("nan")) for m in timed)  # noqa: E731
        times = [m["step_time_s"] for m in timed]
        out.append({
            "variant": name, "failed": False, "runs": len(mine), "ok_runs": len(ok), "timed_steps": len(timed),
            "step_s": median(times), "step_s_min": min(times), "step_s_max": max(times),
            "step_s_per_repeat": [median([m["step_time_s"] for m in timed_steps(r, warmup, trace_step)]) for r in ok],
            "bubble_fraction": mean("bubble_fraction"), "imbalance": mean("imbalance"),
            **{k: mean(k) for k in KEYS},
            "data_wait_s": mean("data_wait_s"),
            "encoder_peak_activation_mib": max(m.get("encoder_peak_activation_mib", 0.0) for m in timed),
            "encoder_long_items": mean("encoder_long_items"),
            "peak_rss_gib": max(m.get("peak_rss_gib", 0.0) for m in timed),
            "losses": [m["loss"] for m in ok[0]["metrics"]],
        })
    ref = out[0]
    for s in out:
        if not s["failed"] and not ref["failed"]:
            s["speedup"] = ref["step_s"] / s["step_s"]
    return out


def loss_check(res: dict, mix: str) -> dict:
    """Largest relative difference of any step's loss from the reference run (first variant,
    first repeat) over every successful run of one mixture; steps must match."""
    runs = [r for r in res["mixes"][mix]["runs"] if r["rc"] == 0 and r["metrics"]]
    if not runs:
        return {"max_rel": float("nan"), "equal": False, "worst": None}
    ref_name = res["variants"][0][0]
    ref = next((r for r in runs if r["variant"] == ref_name), runs[0])
    want = {m["step"]: m["loss"] for m in ref["metrics"]}
    want_gn = {m["step"]: m.get("grad_norm") for m in ref["metrics"]}
    worst, max_rel, gn_rel, missing = None, 0.0, 0.0, []
    for r in runs:
        got = {m["step"]: m["loss"] for m in r["metrics"]}
        if set(got) != set(want):
            missing.append(f"{r['variant']} r{r['repeat']}")
        for step in set(got) & set(want):
            rel = abs(got[step] - want[step]) / max(abs(want[step]), 1e-12)
            if rel > max_rel:
                max_rel, worst = rel, f"{r['variant']} repeat {r['repeat']} step {step}"
        for m in r["metrics"]:
            g, w = m.get("grad_norm"), want_gn.get(m["step"])
            if g is not None and w is not None:
                gn_rel = max(gn_rel, abs(g - w) / max(abs(w), 1e-12))
    return {"max_rel": max_rel, "equal": max_rel <= 1e-5 and not missing, "worst": worst, "step_mismatch": missing,
            "grad_norm_max_rel": gn_rel}


HEADERS = ["placement", "step s median (min-max)", "speedup vs stage0", "bubble fraction",
           "encoder s", "LLM s", "comm s", "optim s", "idle s", "imbalance", "encoder peak act. MiB",
           "long items / step", "peak RSS GiB", "final loss"]


def table_rows(s: list[dict]) -> list[list]:
    rows = []
    for x in s:
        if x["failed"]:
            rows.append([x["variant"], f"FAILED ({x['ok_runs']}/{x['runs']} runs ok)"] + [""] * (len(HEADERS) - 2))
            continue
        rows.append([x["variant"], f"{x['step_s']:.2f} ({x['step_s_min']:.2f}-{x['step_s_max']:.2f})",
                     f"{x.get('speedup', float('nan')):.2f}x", f"{100 * x['bubble_fraction']:.1f}%",
                     *(f"{x[k]:.2f}" for k in KEYS), f"{x['imbalance']:.2f}",
                     f"{x['encoder_peak_activation_mib']:.1f}", f"{x['encoder_long_items']:.1f}",
                     f"{x['peak_rss_gib']:.2f}", f"{x['losses'][-1]:.6f}"])
    return rows


def report_mix(res: dict, mix: str) -> str:
    """The table and notes of one mixture."""
    m = res["mixes"][mix]
    s, lc, runs = summarise(res, mix), loss_check(res, mix), m["runs"]
    per_rep = "; ".join(f"{x['variant']} " + " / ".join(f"{v:.2f}" for v in x["step_s_per_repeat"])
                        for x in s if not x["failed"])
    timed = s[0].get("timed_steps", 0)
    lines = [f"### {mix_text(mix, m['weights'])}", "", table(HEADERS, table_rows(s)), "",
             f"step s: rank 0's wall time per step, median over {timed} timed steps ({res['repeats']} repeat(s) x "
             f"{res['steps']} steps, first {res['warmup']} dropped, the traced step left out); the other columns are "
             f"means over those steps of the per-rank means (busy seconds are exclusive per kind), peak act. and "
             f"RSS the largest. Micro-batches per DP rank (from the trace): {m.get('micro_batches')}.",
             f"per-repeat medians (s): {per_rep}"]
    tails = {r["variant"]: r["trace_tail_s"] for r in runs if r.get("trace_tail_s") is not None}
    if tails:
        lines.append("un-instrumented end of the traced step, counted as idle (s per rank): "
                     + "; ".join(f"{k} {v:.2f}" for k, v in tails.items()))
    syncs = {r["variant"]: r["trace_grad_sync_s"] for r in runs if r.get("trace_grad_sync_s")}
    if syncs:
        lines.append("'gradient sync' span of the traced step, per rank (s): " + "; ".join(
            f"{k} " + " ".join(f"{v:.2f}" for v in vals) for k, vals in syncs.items()))
    lines.append("per run, launch included: wall s / CPU s of the whole run / CPU share = CPU s / (wall s x "
                 f"{res['machine_cpus']} cores): " + "; ".join(
                     f"{r['variant']} r{r['repeat']} {r['wall_s']:.0f} / "
                     f"{r['cpu_share'] * r['wall_s'] * res['machine_cpus']:.0f} / {r['cpu_share']:.2f}" for r in runs))
    if lc["equal"]:
        lines.append(f"losses equal across placements: yes (every step of every run; max relative difference "
                     f"{lc['max_rel']:.1e}; gradient norms {lc.get('grad_norm_max_rel', float('nan')):.1e})")
    else:
        lines.append(f"!!! LOSSES DIFFER ACROSS PLACEMENTS: max relative difference {lc['max_rel']:.3e} at {lc['worst']}"
                     + (f"; runs with other steps: {lc['step_mismatch']}" if lc.get("step_mismatch") else "") + " !!!")
    for r in runs:
        if r["rc"] != 0:
            lines.append(f"FAILED {r['variant']} repeat {r['repeat']} (rc {r['rc']}):\n{r['log_tail']}")
    return "\n".join(lines)


def report(res: dict) -> str:
    head = (f"{res['world']} ranks ({layout_text(res['layout'])}); vision tower "
            f"{res.get('vision_params_m') or float('nan'):.2f}M parameters ({res['vision']}); global batch "
            f"{res['global_batch_size']}, micro-batch budget {res['micro_batch_tokens']} tokens")
    return "\n\n".join([head] + [report_mix(res, mix) for mix in res["mixes"]])


# ---- plots ---------------------------------------------------------------------------------
def plot(res: dict, path: Path) -> str:
    """Stacked mean per-rank time split per variant, one panel per mixture, shared y axis."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"busy_encoder_s": "#4c72b0", "busy_llm_s": "#dd8452", "busy_comm_s": "#55a868",
              "busy_optim_s": "#8172b3", "idle_s": "#c8c8c8"}
    labels = {"busy_encoder_s": "encoder", "busy_llm_s": "LLM", "busy_comm_s": "communication (incl. gradient sync)",
              "busy_optim_s": "clipping + optimizer step", "idle_s": "idle"}
    mixes = list(res["mixes"])
    fig, axes = plt.subplots(1, len(mixes), figsize=(max(9.0, 5.2 * len(mixes) + 0.8), 5.0), sharey=True,
                             squeeze=False)
    top = 0.0
    for ax, mix in zip(axes[0], mixes):
        s = [x for x in summarise(res, mix) if not x["failed"]]
        bottom = [0.0] * len(s)
        for k in KEYS:
            vals = [x[k] for x in s]
            ax.bar(range(len(s)), vals, bottom=bottom, color=colors[k], label=labels[k], width=0.6)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, x in enumerate(s):
            ax.plot([i - 0.3, i + 0.3], [x["step_s"]] * 2, color="black", lw=1.5)
            ax.annotate(f"{x['step_s']:.2f} s\n{x.get('speedup', float('nan')):.2f}x",
                        (i, max(x["step_s"], bottom[i])), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 3), textcoords="offset points")
        ax.set_xticks(range(len(s)), [x["variant"].replace("+", "\n+") for x in s], fontsize=8)
        ax.set_title(f"{mix_text(mix, res['mixes'][mix]['weights'])}", fontsize=9)
        top = max([top] + bottom + [x["step_s"] for x in s])
    axes[0, 0].set_ylabel("seconds per step (mean over ranks)")
    axes[0, 0].set_ylim(0, 1.22 * top)
    axes[0, 0].plot([], [], color="black", lw=1.5, label="median step time (rank 0)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="lower center", ncol=3, frameon=False)
    fig.suptitle(f"Encoder-LLM placements, {res['world']} gloo ranks on {res['machine_cpus']} CPU cores "
                 f"({layout_text(res['layout'])})", fontsize=10)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def traced_step_time(res: dict, variant: str) -> float:
    """Rank 0's ``step_time_s`` of the traced step of ``variant`` on SCHEDULE_MIX (nan if absent)."""
    runs = [r for r in res["mixes"][SCHEDULE_MIX]["runs"] if r["variant"] == variant and r["traced"]]
    steps = [m for r in runs for m in r["metrics"] if m["step"] == res["trace_step"]]
    return steps[0]["step_time_s"] if steps else float("nan")


def schedule(res: dict, out: Path, path: Path) -> str:
    """The traced step of SCHEDULE_VARIANTS on SCHEDULE_MIX, when their traces are in ``out``."""
    traces = [(v, out / f"trace_{SCHEDULE_MIX}_{v}.json") for v in SCHEDULE_VARIANTS]
    missing = [str(p) for _, p in traces if not p.exists()]
    if SCHEDULE_MIX not in res["mixes"] or missing:
        return f"no schedule plot: traces missing ({', '.join(missing) or SCHEDULE_MIX + ' not run'})"
    step = res["trace_step"]
    panels = [(f"{v}: step {step} of the {SCHEDULE_MIX.replace('_', '-')} mixture, rank 0's step time "
               f"{traced_step_time(res, v):.2f} s", p) for v, p in traces]
    title = (f"One training step per rank, {res['world']} gloo ranks on {res['machine_cpus']} CPU cores "
             f"({layout_text(res['layout'])})")
    return draw_schedule(panels, path, title)
