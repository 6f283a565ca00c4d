"""Start-up of a from-scratch Qwen2.5-VL vision tower (Qwen2.5-VL-7B's width) built on the meta
device and then materialised on the host with seeded initial weights, as a training run starts
(``omni.models.materialize``): with ``RMSNorm.reset_parameters`` (now) and without it (before
issue 38: every norm gain had the whole tower built afresh on the host to read its value from).
Each variant runs in a fresh process; wall time of the materialisation alone.

    python scripts/bench/startup_init.py [--layers 8] [--doc docs/benchmarks.md]
"""
from __future__ import annotations

import sys
import time

from _common import in_fresh_process, parser, publish, run_record, save, table

SECTION = "## Start-up: materialising a from-scratch Qwen2.5-VL tower (CPU)"


def child(layers: int, old: bool) -> dict:
    import torch

    from omni.models.encoders.qwen_vl import QwenVisionConfig, QwenVisionEncoder
    from omni.models.llm.layers import RMSNorm
    from omni.models.materialize import SeededInit, materialize

    if old:  # the tower as it was before issue 38: its norms had no reset_parameters
        del RMSNorm.reset_parameters
    cfg = QwenVisionConfig(num_hidden_layers=layers, fullatt_block_indexes=[layers - 1])
    with torch.device("meta"):
        tower = QwenVisionEncoder(cfg)
    params = sum(p.numel() for p in tower.parameters())
    t0 = time.perf_counter()
    materialize([tower], SeededInit(0), "cpu")
    return {"seconds": time.perf_counter() - t0, "params": params}


def measure(layers: int, old: bool) -> dict:
    return in_fresh_process("startup_init", "child", layers, old)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--layers", default="8", help="tower depths, comma-separated (Qwen2.5-VL-7B's tower: 32)")
    p.add_argument("--doc", default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    rows, points = [], []
    for n in [int(x) for x in args.layers.split(",")]:
        before, after = measure(n, old=True), measure(n, old=False)
        points.append({"layers": n, "before": before, "after": after})
        rows.append([n, f"{after['params'] / 1e6:.0f}M", f"{before['seconds']:.1f}", f"{after['seconds']:.1f}",
                     f"{before['seconds'] / after['seconds']:.1f}x"])
        print(rows[-1], flush=True)
    res = run_record(t0, points=points)
    print(save(args.out, "startup_init", res))
    body = (f"**Measured** on this machine's CPU: `scripts/bench/startup_init.py --layers {args.layers}` (commit "
            f"{res['git']['commit']}, {res['time']}, {res['seconds']:.0f} s). A Qwen2.5-VL vision tower at "
            f"Qwen2.5-VL-7B's width (1280 hidden, 3420 MLP) built on the meta device and materialised on the host "
            f"with seeded initial weights (`omni.models.materialize`), each variant in a fresh process: `before`, "
            f"its RMSNorm without `reset_parameters` (every norm gain had the whole tower built afresh on the host); "
            f"`after`, as shipped.\n\n"
            + table(["layers", "parameters", "before s", "after s", "before / after"], rows) + "\n")
    publish(body, args.doc, SECTION)


if __name__ == "__main__":
    sys.exit(main())
