"""Gantt chart of one traced training step per placement, from the Chrome traces that
``multiplex.trace_step`` writes (format: ``chrome_trace`` in omni/runtime/timeline.py).

One panel per trace, one row per rank, time in seconds from each rank's step start (rank clocks
are not synchronised; the timeline starts every rank at 0). Each instant is coloured by the
innermost span covering it, the rule the timeline's busy seconds use, so the coloured lengths of
a row add up to that rank's busy seconds; white is idle. Used by multiplex.py; also runs alone:

    python scripts/bench/schedule_plot.py --out docs/img/multiplex_schedule.png \\
        stage0=OUT/trace_image_heavy_stage0.json colocated=OUT/trace_image_heavy_colocated.json
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# Category -> colour; the same hues as the placements plot (encoder blue, LLM orange, comm
# green, optimizer purple), with a lighter shade for the backward of each.
COLOURS = {"encoder forward": "#4c72b0", "encoder backward": "#9bb7e0", "LLM forward": "#dd8452",
           "LLM backward": "#f2c09b", "communication": "#55a868", "clipping + optimizer step": "#8172b3",
           "other": "#999999"}


def category(event: dict) -> str:
    """The legend entry of one trace event (its kind is the event's ``cat``)."""
    kind, name = event.get("cat"), event.get("name", "")
    if kind == "encoder":  # chunk spans are F<j> / B<j>
        return "encoder backward" if name.startswith("B") else "encoder forward"
    if kind == "llm":
        return "LLM backward" if "backward" in name else "LLM forward"
    return {"comm": "communication", "optim": "clipping + optimizer step"}.get(kind, "other")


def load_trace(path: Path) -> dict[int, list[dict]]:
    """Complete ("X") events per rank, in trace order (the timeline writes them by start)."""
    per_rank: dict[int, list[dict]] = {}
    for e in json.loads(Path(path).read_text())["traceEvents"]:
        if e.get("ph") == "X":
            per_rank.setdefault(e["pid"], []).append(e)
    return dict(sorted(per_rank.items()))


def exclusive_segments(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start s, end s, category) pieces of one rank's step: every elementary interval goes to the
    innermost event covering it (latest start, then earliest end, then later in the trace), and
    neighbouring pieces of one category are merged. Quadratic, fine for a few hundred spans."""
    spans = [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, i, category(e)) for i, e in enumerate(events)]
    points = sorted({p for s, t, _, _ in spans for p in (s, t)})
    out: list[tuple[float, float, str]] = []
    for a, b in zip(points, points[1:]):
        covering = [sp for sp in spans if sp[0] <= a and sp[1] >= b]
        if not covering:
            continue
        cat = max(covering, key=lambda sp: (sp[0], -sp[1], sp[2]))[3]
        if out and out[-1][2] == cat and abs(out[-1][1] - a) < 1e-9:
            out[-1] = (out[-1][0], b, cat)
        else:
            out.append((a, b, cat))
    return out


def stage_of(events: list[dict]) -> int | None:
    """The pipeline stage a rank runs, from its LLM span names (``stage1 forward mb3``)."""
    for e in events:
        m = re.match(r"stage(\d+) (forward|backward)", e.get("name", ""))
        if m:
            return int(m.group(1))
    return None


def rank_label(rank: int, events: list[dict]) -> str:
    stage = stage_of(events)
    return f"rank {rank}" + (f" (stage {stage})" if stage is not None else "")


def draw(panels: list[tuple[str, Path]], path: Path, title: str = "") -> str:
    """One Gantt panel per (title, trace path), sharing the time axis; returns a line to print."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no schedule plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    traces = [(name, load_trace(p)) for name, p in panels]
    rows = max(len(t) for _, t in traces)
    height = 1.3 + 0.38 * rows * len(traces)
    fig, axes = plt.subplots(len(traces), 1, sharex=True, squeeze=False, figsize=(10, height))
    used: set[str] = set()
    end = 0.0
    for ax, (name, per_rank) in zip(axes[:, 0], traces):
        labels = []
        for row, (rank, events) in enumerate(per_rank.items()):
            by_cat: dict[str, list[tuple[float, float]]] = {}
            for a, b, cat in exclusive_segments(events):
                by_cat.setdefault(cat, []).append((a, b - a))
                end = max(end, b)
            for cat, bars in by_cat.items():
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLOURS[cat], edgecolor="none")
                used.add(cat)
            labels.append(rank_label(rank, events))
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylim(len(labels) - 0.5, -0.5)  # rank 0 on top
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(axis="x", color="#dddddd", lw=0.6)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlabel("seconds from each rank's step start")
    axes[-1, 0].set_xlim(0, 1.01 * end)
    handles = [Patch(color=COLOURS[c], label=c) for c in COLOURS if c in used]
    handles.append(Patch(facecolor="white", edgecolor="#888888", label="idle"))
    fig.legend(handles=handles, loc="lower center", ncol=min(7, len(handles)), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))  # room for the legend: about 0.45 inch
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"schedule plot: {path}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("panels", nargs="+", help="TITLE=TRACE.json, one per panel, top to bottom")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="")
    args = p.parse_args()
    panels = [(s.split("=", 1)[0], Path(s.split("=", 1)[1])) for s in args.panels]
    print(draw(panels, Path(args.out), args.title))


if __name__ == "__main__":
    main()
