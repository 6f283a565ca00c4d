"""Peak memory of the LM head + cross-entropy (one forward and backward), the plain
``F.cross_entropy(F.linear(hidden, weight).float())`` against Omni's chunked head
(``parallel/linear_cross_entropy.py``), at a Qwen-size vocabulary and growing target counts.

Each point runs in a fresh process (so its peak is its own) under bf16 autocast, as training
runs: the process's peak resident memory (VmHWM) above what it held once the inputs existed,
next to the size of one fp32 ``[targets, vocab]`` buffer. Measured on the CPU; nothing is
asserted (tests/parallel/test_linear_cross_entropy.py holds the equality and that nothing of
``targets x vocab`` is saved for the backward).

    python scripts/bench/loss_memory.py [--targets 2048,4096,8192] [--vocab 151936] [--hidden 1024]
        [--doc docs/benchmarks.md]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from _common import in_fresh_process, parser, proc_status_bytes, publish, save_measured, table

SECTION = "## Loss memory: the chunked LM head and cross-entropy (CPU)"
GIB = 2 ** 30


def child(kind: str, targets: int, vocab: int, hidden: int) -> dict:
    """One forward and backward of ``kind`` ("plain" or "chunked"); this process's peak above
    its memory once the inputs exist."""
    import torch
    import torch.nn.functional as F

    from parallel.linear_cross_entropy import linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(targets, hidden).requires_grad_()
    w = (torch.randn(vocab, hidden) / hidden ** 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (targets,))
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    base = proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if kind == "plain":
            loss = F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum")
        else:
            loss = linear_cross_entropy(h, w, labels)
    loss.backward()
    return {"peak_above_inputs": proc_status_bytes("VmHWM") - base, "seconds": time.perf_counter() - t0}


def measure(kind: str, targets: int, vocab: int, hidden: int) -> dict:
    return in_fresh_process("loss_memory", "child", kind, targets, vocab, hidden)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--targets", default="2048,4096,8192")
    p.add_argument("--vocab", type=int, default=151_936)  # Qwen2 / Qwen2.5's vocabulary
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--doc", default=None, help="markdown file whose section is (re)written")
    args = p.parse_args()
    targets = [int(t) for t in args.targets.split(",")]
    t0 = time.perf_counter()
    rows, results = [], []
    for n in targets:
        buffer = n * args.vocab * 4
        r = {k: measure(k, n, args.vocab, args.hidden) for k in ("plain", "chunked")}
        results.append({"targets": n, "fp32_logits_bytes": buffer, **r})
        rows.append([n, f"{buffer / GIB:.2f}", f"{r['plain']['peak_above_inputs'] / GIB:.2f}",
                     f"{r['plain']['peak_above_inputs'] / buffer:.2f}x",
                     f"{r['chunked']['peak_above_inputs'] / GIB:.2f}",
                     f"{r['chunked']['peak_above_inputs'] / buffer:.2f}x",
                     f"{r['plain']['seconds']:.1f} / {r['chunked']['seconds']:.1f}"])
        print(rows[-1], flush=True)
    head = save_measured(args.out, "loss_memory", t0, vocab=args.vocab, hidden=args.hidden, points=results)
    body = (head + " One forward and backward of "
            f"the LM head and its summed cross-entropy under bf16 autocast, vocabulary {args.vocab}, hidden "
            f"{args.hidden}, each point in a fresh process: its peak resident memory above what it held once the "
            f"inputs (hidden states, head, labels) existed, next to the size of one fp32 `[targets, vocab]` buffer. "
            f"`plain`: `F.cross_entropy(F.linear(h, w).float())` (Omni's loss before issue 38); `chunked`: "
            f"`parallel/linear_cross_entropy.py` (chunks of one 256 MiB fp32 logits buffer).\n\n"
            + table(["targets", "fp32 [targets, vocab] GiB", "plain peak GiB", "plain / buffer",
                     "chunked peak GiB", "chunked / buffer", "seconds plain / chunked"], rows) + "\n")
    publish(body, args.doc, SECTION)


if __name__ == "__main__":
    sys.exit(main())
