"""Balance quality and planning time of the arrangement methods, side by side.

For three synthetic mixtures (image-text like LLaVA; video / long-image heavy; long-tailed
text + audio) and DP sizes 8, 64 and 512 this draws the steps of a 4096-sample global batch
with Omni's ``Planner`` (built from in-memory ``SourceIndex`` objects: no shards) and
arranges each step with every method of ``dataloading.plan.balance.METHODS``. Reported per method:
mean and worst max/mean rank cost over the steps, against the lower bound
max(mean, largest sample)/mean, and the wall time of ``arrange()`` (median over steps).
Also: the wall time of the whole ``Planner.plan()`` (draw + cost lookup + arrange) and a
``balance_group`` sweep at dp 512.

Costs come from ``dataloading.plan.cost.CostModel`` with FLOP-style coefficients: a 7B-class LLM
(alpha = 2*layers*hidden per token pair, beta = 2*params per token) and a ViT-L / Whisper-
medium-class encoder (alpha_e = 4*L*d, beta_e = L*(8 d^2 + 4 d ffn), L=24, d=1024, ffn=4096).

All methods see the same samples in the same (randomly interleaved) order: that order is
what a per-rank loader reading its own slice of the mixture would get, i.e. ``none`` is that
baseline. ``none (planner order)`` is ``none`` on the planner's draw order as it comes.

    python scripts/bench/balance_quality.py [--quick] [--out docs/img]
"""
from __future__ import annotations

import math
import time

import numpy as np

from _common import REPO, median, parser, save_and_plot, table  # noqa: F401  (REPO: sys.path set-up)

from dataloading.index.source_index import SampleMeta, SourceIndex
from dataloading.plan.balance import METHODS, arrange
from dataloading.plan.cost import CostModel
from dataloading.plan.packing import Packing
from dataloading.plan.planner import Planner

GLOBAL_BATCH = 4096
BUDGET = 32768
DPS = (8, 64, 512)
GROUPS = (0, 64, 8)  # balance_group sweep at dp 512 (0 = all ranks in one group)
PATCH = 14  # ViT patch: an image of h x w pixels is (h/14)*(w/14) tokens
AUDIO_TOKENS_PER_S = 50
RATE = 16000
IMAGE_PH = len("<image>")
AUDIO_PH = len("<audio>")

# 7B-class LLM and a ViT-L / Whisper-medium-class encoder, in FLOPs.
LLM_LAYERS, LLM_HIDDEN, LLM_PARAMS = 32, 4096, 7e9
ENC_L, ENC_D, ENC_FFN = 24, 1024, 4096
ENC = (4.0 * ENC_L * ENC_D, ENC_L * (8.0 * ENC_D ** 2 + 4.0 * ENC_D * ENC_FFN))
COST = CostModel(alpha=2.0 * LLM_LAYERS * LLM_HIDDEN, beta=2.0 * LLM_PARAMS,
                 encoders={"image": ENC, "audio": ENC})


class ImageTokens:
    """Planning-only image processor: (h/14)*(w/14) tokens."""

    modality = "image"

    def num_tokens_from_meta(self, meta):
        return (meta["height"] // PATCH) * (meta["width"] // PATCH)

    def __call__(self, raw):  # pragma: no cover - planning never decodes
        raise NotImplementedError


class AudioTokens:
    """Planning-only audio processor: 50 tokens per second (Whisper after 2x pooling)."""

    modality = "audio"

    def num_tokens_from_meta(self, meta):
        return max(1, round(meta["num_samples"] / meta["sample_rate"] * AUDIO_TOKENS_PER_S))

    def __call__(self, raw):  # pragma: no cover
        raise NotImplementedError


PROCESSORS = {"image": ImageTokens(), "audio": AudioTokens()}


# ---- synthetic mixtures -------------------------------------------------------------------
def _lognormal(rng, median_, sigma, lo, hi):
    return int(np.clip(round(rng.lognormal(math.log(median_), sigma)), lo, hi))


def _image(tokens_h: int, tokens_w: int) -> tuple[str, dict]:
    return ("image", {"height": tokens_h * PATCH, "width": tokens_w * PATCH})


def _sample(i: int, text_tokens: int, media: list[tuple[str, dict]]) -> SampleMeta:
    """A sample whose packed length is 2 (BOS/EOS) + text_tokens + its media tokens."""
    ph = sum(IMAGE_PH if m == "image" else AUDIO_PH for m, _ in media)
    room = BUDGET - 2 - sum(_tokens(m) for m in media)
    return SampleMeta(f"{i:07d}", "x.tar", i, min(text_tokens, room) + ph, None, media)


def _tokens(item) -> int:
    return PROCESSORS[item[0]].num_tokens_from_meta(item[1])


def _anyres(rng) -> tuple[str, dict]:
    """LLaVA-NeXT-style: a 336x336 base (576 tokens) plus 0-4 more 576-token tiles."""
    k = int(rng.choice([1, 2, 3, 4, 5], p=[0.5, 0.15, 0.15, 0.1, 0.1]))
    return _image(24, 24 * k)


def llava(rng, n):
    """(a) image-text like LLaVA: short captions + one 576-2880-token image, some multi-image."""
    caption = [_sample(i, _lognormal(rng, 40, 0.5, 5, 300), [_anyres(rng)]) for i in range(n)]
    instruct = [_sample(i, _lognormal(rng, 250, 0.8, 20, 4000), [_anyres(rng)]) for i in range(n)]
    multi = [_sample(i, _lognormal(rng, 200, 0.8, 20, 2000), [_anyres(rng) for _ in range(int(rng.integers(2, 5)))])
             for i in range(n // 4)]
    text = [_sample(i, _lognormal(rng, 600, 0.9, 20, 8000), []) for i in range(n)]
    return {"caption": (0.55, caption), "instruct": (0.30, instruct), "multi_image": (0.05, multi),
            "text": (0.10, text)}


def video(rng, n):
    """(b) video / long-image heavy: few very long samples (4k-32k tokens, heavy tail)."""
    def long_total(alpha, hi):
        return int(min(hi, 4096 * (1 + rng.pareto(alpha))))

    short = [_sample(i, _lognormal(rng, 60, 0.6, 5, 500), [_image(24, 24)]) for i in range(n)]
    images = []
    for i in range(n // 2):
        side = int(math.sqrt(long_total(1.5, 16384)))
        images.append(_sample(i, _lognormal(rng, 200, 0.8, 10, 2000), [_image(side, side)]))
    clips = []
    for i in range(n // 4):  # frames of 224x224 (256 tokens), encoded frame by frame
        frames = max(16, long_total(1.2, BUDGET - 800) // 256)
        clips.append(_sample(i, _lognormal(rng, 100, 0.8, 10, 500), [_image(16, 16)] * frames))
    return {"image_text": (0.85, short), "long_image": (0.10, images), "video": (0.05, clips)}


def text_audio(rng, n):
    """(c) long-tailed text (Pareto 64-32k tokens) + audio clips of 1-30 s (50-1500 tokens)."""
    text = [_sample(i, int(min(BUDGET - 2, 64 * (1 + rng.pareto(1.0)))), []) for i in range(n)]
    audio = []
    for i in range(n):
        seconds = float(rng.uniform(1.0, 30.0))
        audio.append(_sample(i, _lognormal(rng, 30, 0.8, 5, 500),
                             [("audio", {"num_samples": int(seconds * RATE), "sample_rate": RATE})]))
    return {"text": (0.6, text), "audio": (0.4, audio)}


MIXTURES = {"a_llava": llava, "b_video": video, "c_text_audio": text_audio}
LABELS = {"a_llava": "(a) image-text (LLaVA-like)", "b_video": "(b) video / long-image",
          "c_text_audio": "(c) long-tail text + audio"}


def build_planner(name: str, n: int, seed: int = 0) -> Planner:
    rng = np.random.default_rng(seed)
    sources = MIXTURES[name](rng, n)
    indices = {s: SourceIndex(s, samples) for s, (_, samples) in sources.items()}
    weights = {s: w for s, (w, _) in sources.items()}
    return Planner(indices, weights, seed, GLOBAL_BATCH, DPS[0], processors=PROCESSORS, cost_model=COST,
                   packing=Packing(budget=BUDGET, balance="balanced"))


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


# ---- the benchmark ------------------------------------------------------------------------
def run(quick: bool) -> dict:
    steps = 2 if quick else 6
    repeat = 1 if quick else 3  # timings of `balanced` and plan(): median of repeat x steps
    n = 3000 if quick else 12000
    dps = (8, 64) if quick else DPS
    methods = list(METHODS)
    res: dict = {"config": {"global_batch": GLOBAL_BATCH, "budget": BUDGET, "steps": steps, "dps": list(dps),
                            "cost_model": COST.to_dict(), "samples_per_source": n, "quick": quick},
                 "mixtures": {}}
    for mix in MIXTURES:
        t0 = time.perf_counter()
        planner = build_planner(mix, n)
        build_s = time.perf_counter() - t0
        rng = np.random.default_rng(1)
        per = {dp: {m: {"mm": [], "ms": [], "mb": []} for m in methods + ["none_planner_order"]} for dp in dps}
        lb = {dp: [] for dp in dps}
        plan_ms = {dp: [] for dp in dps}
        groups = {g: {"mm": [], "ms": []} for g in GROUPS} if 512 in dps else {}
        lengths = []
        for _ in range(steps):
            for dp in dps:
                for _r in range(repeat):
                    plan, dt = timed(planner.plan, dp_size=dp)
                    plan_ms[dp].append(dt * 1e3)
                ids = plan.samples
                costs = np.array([plan.unit_cost[u] for u in ids])
                tokens = np.array([plan.unit_tokens[u] for u in ids], dtype=np.int64)
                if dp == dps[0]:
                    lengths.extend(tokens.tolist())
                a = arrange(costs, tokens, dp, BUDGET, "none")  # the planner's own draw order
                per[dp]["none_planner_order"]["mm"].append(a.stats(costs)["max_over_mean"])
                order = rng.permutation(len(ids))  # a random interleaving of the sources
                c, t = costs[order], tokens[order]
                for m in methods:
                    for _r in range(repeat if m == "balanced" else 1):
                        a, dt = timed(arrange, c, t, dp, BUDGET, m)
                        per[dp][m]["ms"].append(dt * 1e3)
                    s = a.stats(c)
                    per[dp][m]["mm"].append(s["max_over_mean"])
                    per[dp][m]["mb"].append(s["micro_batches"])
                lb[dp].append(a.stats(c)["lower_bound"])
                if dp == 512:
                    for g in GROUPS:
                        a, dt = timed(arrange, c, t, dp, BUDGET, "balanced", g)
                        groups[g]["mm"].append(a.stats(c)["max_over_mean"])
                        groups[g]["ms"].append(dt * 1e3)
            planner.advance()
        out = {"build_planner_s": build_s, "lengths": {"mean": float(np.mean(lengths)),
                                                       "p50": float(np.percentile(lengths, 50)),
                                                       "p99": float(np.percentile(lengths, 99)),
                                                       "max": int(np.max(lengths))}, "dp": {}}
        for dp in dps:
            d = {"lower_bound_mean": float(np.mean(lb[dp])), "lower_bound_worst": float(np.max(lb[dp])),
                 "plan_ms_median": median(plan_ms[dp]), "methods": {}}
            for m, v in per[dp].items():
                d["methods"][m] = {"max_over_mean_mean": float(np.mean(v["mm"])),
                                   "max_over_mean_worst": float(np.max(v["mm"])),
                                   "arrange_ms_median": median(v["ms"]) if v["ms"] else None,
                                   "micro_batches": int(np.max(v["mb"])) if v["mb"] else None}
            out["dp"][dp] = d
        if groups:
            out["groups_dp512"] = {g: {"max_over_mean_mean": float(np.mean(v["mm"])),
                                       "max_over_mean_worst": float(np.max(v["mm"])),
                                       "arrange_ms_median": median(v["ms"])} for g, v in groups.items()}
        res["mixtures"][mix] = out
        print(f"[{mix}] done in {time.perf_counter() - t0:.1f}s", flush=True)
    return res


def report(res: dict) -> str:
    dps = res["config"]["dps"]
    methods = list(METHODS)
    lines = [f"Summary: max/mean rank cost, mean over {res['config']['steps']} steps (worst step in parentheses); "
             f"`none` on a random interleaving of the sources:\n"]
    rows = []
    for mix, r in res["mixtures"].items():
        for dp in dps:
            d = r["dp"][dp] if dp in r["dp"] else r["dp"][str(dp)]
            rows.append([LABELS[mix] if dp == dps[0] else "", dp] +
                        [f"{d['methods'][m]['max_over_mean_mean']:.3f} ({d['methods'][m]['max_over_mean_worst']:.3f})"
                         for m in methods] +
                        [f"{d['lower_bound_mean']:.3f} ({d['lower_bound_worst']:.3f})",
                         f"{d['methods']['none']['max_over_mean_mean'] / d['methods']['balanced']['max_over_mean_mean']:.2f}x"])
    lines.append(table(["mixture", "dp"] + [m.replace("_", " ") for m in methods] + ["lower bound", "none / balanced"],
                       rows))
    lines.append("")
    for dp in dps:
        rows = []
        for mix, r in res["mixtures"].items():
            d = r["dp"][dp] if dp in r["dp"] else r["dp"][str(dp)]
            bal = d["methods"]["balanced"]["max_over_mean_mean"]
            for m in methods + ["none_planner_order"]:
                v = d["methods"][m]
                ms = v["arrange_ms_median"]
                rows.append([LABELS[mix] if m == methods[0] else "", m.replace("_", " ") if m != "none_planner_order"
                             else "none (planner order)",
                             f"{v['max_over_mean_mean']:.3f}", f"{v['max_over_mean_worst']:.3f}",
                             f"{v['max_over_mean_mean'] / bal:.2f}x", "" if ms is None else f"{ms:.1f}",
                             f"{d['lower_bound_mean']:.3f}" if m == methods[0] else ""])
        lines.append(f"**dp {dp}** ({4096 // dp} samples per rank), max/mean rank cost over "
                     f"{res['config']['steps']} steps:\n")
        lines.append(table(["mixture", "method", "max/mean (mean)", "max/mean (worst)", "vs balanced",
                            "arrange ms (median)", "lower bound"], rows))
        lines.append("")
    rows = []
    for mix, r in res["mixtures"].items():
        for dp in dps:
            d = r["dp"][dp] if dp in r["dp"] else r["dp"][str(dp)]
            rows.append([LABELS[mix], dp, f"{d['methods']['balanced']['arrange_ms_median']:.1f}",
                         f"{d['plan_ms_median']:.1f}"])
    lines.append("Planning time per step (4096 samples, `balanced`), median; target <= 50 ms:\n")
    lines.append(table(["mixture", "dp", "arrange() ms", "Planner.plan() ms (draw + arrange)"], rows))
    lines.append("")
    if any("groups_dp512" in r for r in res["mixtures"].values()):
        rows = []
        for mix, r in res["mixtures"].items():
            g = r.get("groups_dp512", {})
            for k, v in g.items():
                rows.append([LABELS[mix], "all (0)" if int(k) == 0 else k, f"{v['max_over_mean_mean']:.3f}",
                             f"{v['max_over_mean_worst']:.3f}", f"{v['arrange_ms_median']:.1f}"])
        lines.append("`balance_group` sweep at dp 512 (`balanced`):\n")
        lines.append(table(["mixture", "group size", "max/mean (mean)", "max/mean (worst)", "arrange ms"], rows))
        lines.append("")
    rows = [[LABELS[m], f"{r['lengths']['mean']:.0f}", f"{r['lengths']['p50']:.0f}", f"{r['lengths']['p99']:.0f}",
             r["lengths"]["max"]] for m, r in res["mixtures"].items()]
    lines.append("Sample lengths (tokens, drawn samples):\n")
    lines.append(table(["mixture", "mean", "p50", "p99", "max"], rows))
    return "\n".join(lines)


def plot(res: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker.FuncFormatter)

    dps = res["config"]["dps"]
    methods = list(METHODS)
    mixes = list(res["mixtures"])
    fig, axes = plt.subplots(1, len(dps), figsize=(5.2 * len(dps), 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / len(methods)
    for ax, dp in zip(axes[0], dps):
        for j, m in enumerate(methods):
            vals = [res["mixtures"][x]["dp"][dp]["methods"][m]["max_over_mean_mean"] for x in mixes]
            ax.bar(np.arange(len(mixes)) + (j - (len(methods) - 1) / 2) * width, vals, width, label=m,
                   color=colors[j % len(colors)])
        for i, x in enumerate(mixes):
            lbv = res["mixtures"][x]["dp"][dp]["lower_bound_mean"]
            ax.hlines(lbv, i - 0.45, i + 0.45, colors="k", linestyles="--", label="lower bound" if i == 0 else None)
        ax.axhline(1.05, color="grey", lw=0.8, ls=":", label="target 1.05" if dp == 64 else None)
        ax.set_yscale("log")
        top = max(res["mixtures"][x]["dp"][dp]["methods"][m]["max_over_mean_mean"] for x in mixes for m in methods)
        ax.set_ylim(0.97, top * 1.15)
        fmt = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.3g}")
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(fmt)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xticks(range(len(mixes)), [LABELS[x].split(" ", 1)[1] for x in mixes], fontsize=8)
        ax.set_title(f"dp {dp} ({4096 // dp} samples / rank)")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("max / mean rank cost (log; mean over steps)")
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h), labels.append(lab)
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load(path: str) -> dict:
    import json

    res = json.loads(open(path).read())
    res["config"]["dps"] = [int(d) for d in res["config"]["dps"]]
    for r in res["mixtures"].values():
        r["dp"] = {int(k): v for k, v in r["dp"].items()}
    return res


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--from-json", default="", help="re-print the tables and re-draw the plot of a saved result")
    args = p.parse_args()
    if args.from_json:
        res = _load(args.from_json)
        print(report(res))
        plot(res, args.from_json[: -len(".json")] + ".png")
        return
    t0 = time.perf_counter()
    res = run(args.quick)
    res["wall_s"] = time.perf_counter() - t0
    text = report(res)
    print(text)
    save_and_plot(args.out, "balance_quality" + ("_quick" if args.quick else ""), res, plot)


if __name__ == "__main__":
    main()
