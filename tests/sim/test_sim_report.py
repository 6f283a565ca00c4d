"""What `omni simulate` and `omni plan` tell the user beyond the figures: the header states the
workload assumed (global batch, row length, sample lengths, media items and sizes); a layout
check's warning is said once with a count, after the progress bar, not once per layout; and
``--plot FILE.png`` draws the step decomposed per placement (simulate) or per ranked layout
beside their throughput (plan)."""
from __future__ import annotations

import io
import json

import matplotlib.image
import numpy as np
import pytest

from omni.errors import ConfigError
from recipes.simulate_cmd import plan_main, simulate_main

SMALL = ["workload=none", "cluster=h100", "cluster.num_gpus=8", "parallel.pp=2", "parallel.tp=2",
         "data.global_batch_size=32", "data.micro_batch_tokens=1024", "data.sample_tokens=256",
         "data.image_tokens_min=16", "data.image_tokens_max=64", "data.steps=2"]
# Nodes of 2 GPUs: every layout with tp x cp = 4 or more crosses them (a warning of the layout checks).
PLAN = ["workload=none", "cluster=cpu", "cluster.num_gpus=4", "cluster.gpus_per_node=2", "data.global_batch_size=8",
        "data.micro_batch_tokens=1024", "data.sample_tokens=1024", "data.steps=1"]


def _run(fn, *args, **kw) -> str:
    out = io.StringIO()
    assert fn(*args, out=out, **kw) == 0
    return out.getvalue()


def test_the_header_states_the_workload_assumed():
    text = _run(simulate_main, SMALL)
    head = text.split("placement ")[0]
    assert ("workload: global batch 32 samples in rows of 1024 tokens; text-only samples ~256 tokens (sigma 0.5), "
            "~256 text tokens around media; image ratio 0.5") in head
    assert "media: " in head and " items each; " in head and "; image " in head and "encoder tokens -> " in head
    w = json.loads(_run(simulate_main, SMALL, as_json=True))["workload"]
    assert (w["global_batch_size"], w["micro_batch_tokens"], w["sample_tokens"]) == (32, 1024, 256)
    assert w["samples"] == 32 and 0 < w["media_samples"] < 32 and w["items_per_media_sample"] >= 1
    lo, mean, hi = w["media"]["image"]["tokens"]
    # images of 16-64 patches, video frames of 144-256 (data's default frame_tokens); no merge: a row a token
    assert 16 <= lo <= mean <= hi <= 256 and w["media"]["image"]["rows"] == w["media"]["image"]["tokens"]
    assert 0.3 < w["media_share"] < 0.7 and w["tokens_per_step"] > 32 * 100


def _png(path) -> np.ndarray:
    assert path.is_file() and path.stat().st_size > 10_000
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 300 and img.shape[1] > 800  # a figure, not an empty canvas
    assert len(np.unique(img.reshape(-1, img.shape[-1])[:, :3], axis=0)) > 20  # bars in several colours
    return img


def test_simulate_plot_and_a_warning_once_per_run(tmp_path, capsys):
    """tp x cp = 4 on nodes of 2 GPUs: one warning for the run (it used to come once per
    placement and chunk count); the plot has a bar per placement. The tuned megatron runs the
    layout its search found, not this one: five placements run it."""
    over = [*SMALL, "cluster.gpus_per_node=2", "parallel.cp=2", "parallel.pp=1"]
    _run(simulate_main, over, plot=str(tmp_path / "sim.png"))
    err = capsys.readouterr().err
    spans = [line for line in err.splitlines() if "spans nodes" in line]
    assert spans == ["omni: warning: tp x cp = 4 spans nodes of 2 ranks; context-parallel traffic will cross the "
                     "network (5 placements)"]
    _png(tmp_path / "sim.png")
    with pytest.raises(ConfigError, match=r"^--plot .*missing/sim.png: cannot write it"):
        simulate_main(SMALL, plot=str(tmp_path / "missing" / "sim.png"), out=io.StringIO())


def test_plan_says_a_warning_once_with_its_count_after_the_bar_and_plots(tmp_path, capsys):
    text = _run(plan_main, PLAN, top=3, plot=str(tmp_path / "plan.png"))
    err = capsys.readouterr().err.replace("\r", "\n")
    spans = [line for line in err.splitlines() if "spans nodes" in line]
    assert len(spans) == 1, spans
    searched = int(text.split(" layouts searched")[0].split()[-1])
    counted = int(spans[0].split("(")[-1].split(" of the ")[0])
    assert spans[0].startswith("omni: warning: tp x cp = 4 spans nodes of 2 ranks")
    assert spans[0].endswith(f"of the {searched} layouts searched)") and 1 < counted < searched
    assert err.rindex("spans nodes") > err.rindex("simulating layouts")  # after the bar, not inside it
    assert "workload: global batch 8 samples in rows of 1024 tokens" in text
    _png(tmp_path / "plan.png")
