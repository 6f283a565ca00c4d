"""The picture in docs/data.md: per-rank cost of one step, plain order vs. Omni's arrangement.

A skewed two-source mixture (60% long-tailed text, 40% images of varied size) at dp 16 with the
tiny demo model's FLOP cost model; the same samples both times, only the arrangement differs.

    python scripts/bench/balance_example.py [--out docs/img]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dataloading.index.source_index import SampleMeta, SourceIndex
from dataloading.plan.cost import CostModel
from dataloading.plan.packing import Packing
from dataloading.plan.planner import Planner


class PatchCount:
    """Image tokens = 8x8-pixel patches, at most 64 (the demo SigLIP's budget)."""

    modality = "image"

    def num_tokens_from_meta(self, meta):
        return min(64, max(1, round(meta["height"] / 8)) * max(1, round(meta["width"] / 8)))


def sources(seed: int = 0) -> dict[str, SourceIndex]:
    rng = np.random.default_rng(seed)
    text = np.minimum(30 + (rng.pareto(1.2, 4000) * 80).astype(int), 1500)
    sizes = rng.integers(8, 129, size=(2000, 2))
    return {
        "text": SourceIndex("text", [SampleMeta(f"t{i}", "x.tar", i, int(n), None, []) for i, n in enumerate(text)]),
        "images": SourceIndex("images", [SampleMeta(f"i{i}", "x.tar", i, 40, int(rng.integers(10, 300)),
                                                    [("image", {"height": int(h), "width": int(w)})])
                                         for i, (h, w) in enumerate(sizes)]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    # The tiny demo LLM (4 layers, 4 heads of 32, ~0.95M active params) and its SigLIP tower.
    cost = CostModel(alpha=2 * 4 * 4 * 32, beta=2 * 0.95e6, encoders={"image": (4 * 2 * 96, 2.6e5)})
    planners = {m: Planner(sources(), {"text": 0.6, "images": 0.4}, 0, 256, 16, processors={"image": PatchCount()},
                           cost_model=cost, packing=Packing(budget=4096, balance=m)) for m in ("none", "sorted_greedy", "balanced")}
    ratios = {m: [] for m in planners}
    first = {}
    for step in range(args.steps):
        for m, p in planners.items():
            plan = p.plan()
            p.advance()
            ratios[m].append(plan.stats["max_over_mean"])
            if step == 0:
                first[m] = np.array(plan.rank_cost)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {m: {"mean": float(np.mean(r)), "worst": float(np.max(r))} for m, r in ratios.items()}
    (out / "balance_example.json").write_text(json.dumps(summary, indent=1))
    for m, s in summary.items():
        print(f"{m:>14}: max/mean over {args.steps} steps: mean {s['mean']:.3f}, worst {s['worst']:.3f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    mean = first["none"].mean()
    x = np.arange(16)
    for off, (m, color) in zip((-0.27, 0, 0.27), (("none", "#bbbbbb"), ("sorted_greedy", "#88aacc"),
                                                   ("balanced", "#225588"))):
        ax1.bar(x + off, first[m] / mean, width=0.27, label=m, color=color)
    ax1.axhline(1.0, color="k", lw=0.8, ls="--")
    ax1.set_xlabel("DP rank")
    ax1.set_ylabel("cost / mean")
    ax1.set_title("step 0: the same 256 samples, three arrangements")
    ax1.legend(fontsize=8)
    for m, color in (("none", "#999999"), ("sorted_greedy", "#88aacc"), ("balanced", "#225588")):
        ax2.plot(ratios[m], marker="o", ms=3, label=m, color=color)
    ax2.axhline(1.05, color="r", lw=0.8, ls=":", label="1.05 target")
    ax2.set_xlabel("step")
    ax2.set_ylabel("max / mean rank cost")
    ax2.set_title("every step waits for the slowest rank")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "balance_example.png", dpi=110)
    print(f"wrote {out / 'balance_example.png'}")


if __name__ == "__main__":
    main()
