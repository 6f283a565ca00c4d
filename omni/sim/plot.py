"""``omni simulate --plot FILE.png`` and ``omni plan --plot FILE.png``: the simulated step drawn
with matplotlib (the Agg backend: no display needed).

Each bar is one step decomposed (``engine.DECOMPOSITION``, seconds, mean over the LLM's GPU
groups): compute in blues, the encoders in greens, communication in oranges, waiting (the
pipeline's bubble, cuts waiting for their encoder rows) in greys; ``omni simulate`` draws one
bar per placement, ``omni plan`` one per ranked layout beside their tokens/s."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omni.errors import ConfigError
from omni.sim.engine import DECOMPOSITION
from omni.sim.report import describe_layout

# term -> (family, colour): the families the issue asks to tell apart, shades within each.
TERMS = {
    "llm_compute": ("compute", "#1f77b4"), "optimizer": ("compute", "#9ecae1"),
    "encoder_compute": ("encoder", "#2ca02c"), "encoder_imbalance": ("encoder", "#a1d99b"),
    "llm_comm": ("communication", "#ff7f0e"), "grad_sync": ("communication", "#fdae6b"),
    "row_exchange": ("communication", "#e6550d"), "encoder_weights": ("communication", "#fdd0a2"),
    "cut_wait": ("bubbles", "#969696"), "bubble": ("bubbles", "#d9d9d9"),
}
assert set(TERMS) == set(DECOMPOSITION), "a decomposition term without a colour"


def plot_simulation(result: dict[str, Any], path: str) -> None:
    """One stacked bar per placement."""
    places = result["placements"]
    labels = list(places)
    fig, ax = _figure(len(labels))
    _stacked(ax, labels, [places[p]["decomposition_s"] for p in labels])
    ax.set_title(f"{result.get('name', 'simulate')}: the step per placement "
                 f"({describe_layout(result['layout'])})", fontsize=10)
    _save(fig, path)


def plot_plan(result: dict[str, Any], path: str, name: str) -> None:
    """The ranked layouts: each one's step decomposed, and its tokens/s."""
    ranked = result["ranked"]
    labels = [f"#{i} {describe_layout(r['layout'])}, sp{r['layout']['encoder_sp']}, "
              f"{r['layout']['activation_checkpoint']}, {r['layout']['micro_batch_tokens']} tok"
              for i, r in enumerate(ranked, 1)]
    fig, (ax, speed) = _figure(len(labels), panels=2)
    _stacked(ax, labels, [r["decomposition_s"] for r in ranked])
    ax.set_title(f"{name}: the best {len(ranked)} of {result['searched']} layouts ({result['placement']})",
                 fontsize=10)
    speed.barh(range(len(ranked)), [r["tokens_per_s"] for r in ranked], color="#1f77b4")
    speed.set_yticks(range(len(ranked)), [""] * len(ranked))
    speed.invert_yaxis()
    speed.set_xlabel("tokens/s")
    speed.set_title("throughput", fontsize=10)
    _save(fig, path)


def _figure(rows: int, panels: int = 1):
    import matplotlib

    matplotlib.use("Agg")  # files only: never a window, also without a display
    import matplotlib.pyplot as plt

    widths = [3, 1] if panels == 2 else [1]
    fig, axes = plt.subplots(1, panels, figsize=(11 if panels == 1 else 14, 1.4 + 0.5 * max(rows, 1)),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    return fig, (axes[0][0] if panels == 1 else tuple(axes[0]))


def _stacked(ax, labels: list[str], parts: list[dict[str, float]]) -> None:
    left = [0.0] * len(labels)
    for term in DECOMPOSITION:
        family, colour = TERMS[term]
        widths = [p.get(term, 0.0) for p in parts]
        ax.barh(range(len(labels)), widths, left=left, color=colour, label=f"{family}: {term}")
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()  # the first placement (or the best layout) on top
    ax.set_xlabel("seconds per step (mean over the LLM's GPU groups)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / (len(labels) + 2)), ncol=5,
              frameon=False)


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    try:
        fig.savefig(Path(path), dpi=110, bbox_inches="tight")  # the legend below the axes included
    except (OSError, ValueError) as exc:  # no such folder, or a format matplotlib does not write
        why = getattr(exc, "strerror", None) or str(exc).splitlines()[0]
        raise ConfigError(f"--plot {path}: cannot write it ({why}); give a .png path in an existing folder") from None
    finally:
        plt.close(fig)
