"""Peak memory of the Qwen2.5-VL vision tower (one training forward and backward) on images of
1024 px, now and before issue 35 moved its window attention to contiguous segments.

Before (the commit given by ``--before``, default f3eb9bc~1, run from a git worktree of it):
windows were not contiguous in merge-window order, so every window layer ran SDPA over the
whole packed call with a dense ``[T, T]`` mask. Now: the tokens are put in window order once
(as transformers' ``window_index``), each layer attends inside contiguous segments, and the
order is undone at the end.

Each point runs in a fresh process (its peak is its own) under bf16 autocast, at Qwen2.5-VL-7B's
tower width (hidden 1280, 16 heads, MLP 3420, windows of 112 px) with ``--layers`` blocks, the
last one full attention (the 7B tower has one in eight). Images are resized as Qwen2.5-VL's
processor does by default (max_pixels 12,845,056): 1024 px -> 1036 px, 74 x 74 patches, 5,476
per image. Reported: the process's peak resident memory (VmHWM) above what it held once the
tower and its inputs existed. A run that exceeds ``--limit-gib`` of address space fails to
allocate and is reported as not fitting. Measured on the CPU; nothing is asserted
(tests/models/test_encoders_qwen_vl.py holds the equality with transformers' tower).

    python scripts/bench/qwen_tower_memory.py [--images 1,2,4,8] [--before-images 1,2,4]
        [--layers 4] [--doc docs/benchmarks.md]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from _common import (before_now_cells, in_fresh_process, parser, proc_status_bytes, publish, save_measured, table,
                     worktree)

SECTION = "## Qwen2.5-VL tower memory: window attention as contiguous segments (CPU)"
GIB = 2 ** 30
SIDE = 1024
MAX_PIXELS = 12_845_056  # Qwen2.5-VL's image processor default


def child(images: int, layers: int, limit_gib: float) -> dict:
    """One forward and backward of the tower on ``images`` images of SIDE px; the peak above the
    memory held once the tower and its inputs exist, or ``fits: False``."""
    import resource

    import torch

    from omni.models.encoders.qwen_vl import QwenVisionConfig, QwenVisionEncoder
    from omni.models.encoders.qwen_vl_processor import smart_resize

    limit = int(limit_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.manual_seed(0)
    cfg = QwenVisionConfig(num_hidden_layers=layers, fullatt_block_indexes=[layers - 1])
    factor = cfg.patch_size * cfg.spatial_merge
    h, w = smart_resize(SIDE, SIDE, factor, 56 * 56, MAX_PIXELS)
    gh, gw = h // cfg.patch_size, w // cfg.patch_size
    tower = QwenVisionEncoder(cfg)
    features = torch.randn(images * gh * gw, cfg.patch_dim)
    sizes = torch.tensor([[1, gh, gw]] * images)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    base = proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = tower(features, sizes)
        out.float().square().mean().backward()
    except (RuntimeError, MemoryError) as e:  # the address-space limit: an allocation failed
        return {"fits": False, "error": str(e).splitlines()[0][:200], "tokens": images * gh * gw}
    return {"fits": True, "peak_above_inputs": proc_status_bytes("VmHWM") - base,
            "seconds": time.perf_counter() - t0, "tokens": images * gh * gw, "grid": [gh, gw]}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--images", default="1,2,4,8")
    p.add_argument("--before-images", default="1,2,4")
    p.add_argument("--before", default="f3eb9bc~1", help="the commit measured as before")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--limit-gib", type=float, default=18.0)
    p.add_argument("--doc", default=None, help="markdown file whose section is (re)written")
    args = p.parse_args()
    t0 = time.perf_counter()
    points = {}
    with worktree(args.before) as old:
        for n in sorted({int(v) for v in args.images.split(",")} | {int(v) for v in args.before_images.split(",")}):
            now = in_fresh_process("qwen_tower_memory", "child", n, args.layers, args.limit_gib) \
                if str(n) in args.images.split(",") else None
            then = in_fresh_process("qwen_tower_memory", "child", n, args.layers, args.limit_gib, repo=old) \
                if str(n) in args.before_images.split(",") else None
            points[n] = {"now": now, "before": then}
            print(n, points[n], flush=True)

    lim = args.limit_gib
    rows = [[n, (r["now"] or r["before"])["tokens"], *before_now_cells(r, lim)] for n, r in points.items()]
    head = save_measured(args.out, "qwen_tower_memory", t0, layers=args.layers, side=SIDE, before_commit=args.before,
                         points=points)
    body = (head + " One "
            f"training forward and backward of a Qwen2.5-VL tower at the 7B's width with {args.layers} blocks (the "
            f"last one full attention) under bf16 autocast, on images of {SIDE} px resized as Qwen's processor does "
            f"(74 x 74 patches each), each point in a fresh process limited to {args.limit_gib:.0f} GiB of address "
            f"space: its peak resident memory above what it held once the tower and its inputs existed. `before`: "
            f"the tower at {args.before} (window layers over the whole call with a dense mask), run from a worktree "
            f"of that commit; `now`: window order, contiguous segments.\n\n"
            + table(["images", "patches", "before: peak GiB", "now: peak GiB", "before / now", "now: seconds"], rows)
            + "\n\nWhat `before` holds beyond `now` is quadratic in the patches of the call: each window layer built a "
            "dense mask over the whole call and its attention kept a `[T, T]` bf16 bias for the backward (an "
            "allocation that fails is that bias: 2 bytes x T^2). `now` grows linearly; its own size is the "
            "blocks' saved activations without recompute (`parallel.encoder_activation_checkpoint=none`).\n")
    publish(body, args.doc, SECTION)


if __name__ == "__main__":
    sys.exit(main())
