"""Workload C at 9:1 in the scale simulator, every placement's step decomposed term by term
(``omni.sim.engine.DECOMPOSITION``: LLM compute, LLM communication (TP/CP/EP and exposed FSDP),
encoder compute, encoder imbalance (the slowest GPU of a call over the mean), exposed encoder
weight collectives, row exchange, cut waits, gradient sync, optimizer, bubble), and colocated's
step against its floor: the LLM compute of the real tokens plus the encoder compute, every other
second (padding, exposed communication, waits, bubble) listed as what separates the step from it.
SIMULATED. Writes ``--out``/step_decomposition.json and, with ``--doc``, the
``## Step decomposition, workload C 9:1 (simulated)`` section of that file.

``--history`` adds the two settings issue 18 compared: ``before`` (workload C as it shipped
before issue 18: one LLM token per patch, the ViT's activations kept, flat FSDP of the ViT over
all GPUs, four chunks per insertion point, all-to-all exchanges) and ``after, 1:1 tokens`` (the
current multiplexing settings on that same data and model).

    python scripts/bench/step_decomposition.py [--history] [--doc docs/benchmarks.md] [HYDRA_OVERRIDE ...]
"""
from __future__ import annotations

import sys
import time

from _common import git_state, parser, publish, save, table

from recipes.simulate_cmd import load_sim_config

SECTION = "## Step decomposition, workload C 9:1 (simulated)"
# Workload C's data and ViT before issue 18 modelled patch merging and encoder recompute.
ONE_TO_ONE = ["encoders.vision.params.spatial_merge=1", "encoders.vision.params.max_patches=1024",
              "data.image_tokens_min=256", "data.image_tokens_max=1024", "data.frame_tokens=[128,256]",
              "parallel.encoder_activation_checkpoint=none"]
BEFORE = [*ONE_TO_ONE, "multiplex.encoder_weights=sharded", "multiplex.chunks_per_cut=4",
          "multiplex.exchange=all_to_all", "multiplex.fill_bubbles=false", "sim.chunks_per_cut_search=false"]
LABELS = {"llm_compute": "LLM compute", "llm_comm": "LLM comm (TP/CP/EP, FSDP)", "encoder_compute": "encoder compute",
          "encoder_imbalance": "encoder imbalance", "encoder_weights": "encoder gather/reduce",
          "row_exchange": "row exchange", "cut_wait": "cut waits", "grad_sync": "grad sync (step end)",
          "optimizer": "optimizer", "bubble": "bubble"}


def run(overrides: list[str]) -> dict:
    from omni.sim.compare import simulate

    return simulate(load_sim_config(["workload=C", "data.image_ratio=0.9", *overrides]))["placements"]


def floor_rows(r: dict) -> list[list]:
    """One placement's step against its floor (the LLM compute of the real tokens plus the
    encoder compute). The LLM compute splits into real and padding by the padded fraction of the
    row tokens: the linear part of a token's cost is the same padded or not, and a padding
    document attends only to itself (short, so its attention share is smaller than its token
    share: the padding figure is a slight overestimate)."""
    d, step = r["decomposition_s"], r["step_time_s"]
    padding = d["llm_compute"] * r["padded_fraction"]
    floor = d["llm_compute"] - padding + d["encoder_compute"]
    rows = [["floor: LLM compute of the real tokens + encoder compute", floor],
            ["LLM compute of padding rows", padding]]
    rows += [[LABELS[t], d[t]] for t in LABELS if t not in ("llm_compute", "encoder_compute")]
    out = [[name, f"{s:.2f}", f"{100 * s / step:.1f}%"] for name, s in rows]
    out.append(["**step**", f"**{step:.2f}**", f"**{100 * sum(s for _, s in rows) / step:.0f}%**"])
    return out


def section(res: dict) -> str:
    history = ("" if "before" not in res["runs"] else
               f" `before`: `{' '.join(BEFORE)}` (the workload and its settings before issue 18); `after, 1:1 "
               f"tokens`: `{' '.join(ONE_TO_ONE)}` with the current multiplexing settings (the mechanisms alone);")
    lines = [f"**SIMULATION, not a measurement.** `scripts/bench/step_decomposition.py "
             f"{' '.join(res['argv'])}".rstrip() + f"` (commit {res['git']['commit']}, {res['time']}, "
             f"{res['seconds']:.0f} s): workload C (ViT-10B + LLaMA-70B, 256 H100) at 9:1, seconds per step, mean "
             f"over the LLM's cells (a cell: one DP group's pipeline stage) and the simulated steps; the terms add up "
             f"to the step time.{history} `after`: conf/workload/C.yaml as it is (the ViT merges 2 x 2 patches and "
             f"recomputes its layers), each placement on its own layout (`megatron`'s searched).", ""]
    after = res["runs"]["after"]
    if "colocated" in after and "decomposition_s" in after["colocated"]:
        c = after["colocated"]
        lay = c["layout"]
        lines += ["### colocated against its floor", "",
                  f"colocated on pp{lay['pp']} x tp{lay['tp']} x dp{lay['dp_shard'] * lay['dp_replicate']}, "
                  f"{100 * c['padded_fraction']:.1f}% of its LLM row tokens padding "
                  f"(`parallel.rows`: each pipeline row its own length).", "",
                  table(["term", "s", "share of the step"], floor_rows(c)), ""]
    for name, places in res["runs"].items():
        order = [p for p in places if "decomposition_s" in places[p]]
        rows = [[LABELS[t]] + [f"{places[p]['decomposition_s'][t]:.2f}" for p in order] for t in LABELS]
        rows.append(["**step**"] + [f"**{places[p]['step_time_s']:.2f}**" for p in order])
        rows.append(["memory GiB (fits)"] + [f"{places[p]['memory_gib']['total']:.0f} "
                                              f"({'yes' if places[p]['fits'] else 'NO'})" for p in order])
        lines += [f"### {name}", "", table(["term (s)", *order], rows), ""]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--doc", default=None, help="markdown file whose decomposition section is (re)written")
    p.add_argument("--history", action="store_true", help="also the two settings of issue 18 (before, 1:1 tokens)")
    args, extra = p.parse_known_args()
    t0 = time.perf_counter()
    runs = {"before": run([*BEFORE, *extra]), "after, 1:1 tokens": run([*ONE_TO_ONE, *extra])} if args.history else {}
    runs["after"] = run(extra)
    res = {"runs": runs, "overrides": extra, "seconds": time.perf_counter() - t0, "git": git_state(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:]}
    slim = {k: {p: {x: v for x, v in r.items() if x != "per_rank"} for p, r in pl.items()} for k, pl in runs.items()}
    print(save(args.out, "step_decomposition", {**res, "runs": slim}))
    body = section(res)
    publish(body, args.doc, SECTION)


if __name__ == "__main__":
    sys.exit(main())
