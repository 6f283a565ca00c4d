"""Varlen attention kernels side by side on one GPU: Omni's Triton kernels (cost-ordered
persistent schedule and the plain grid), flash-attn's varlen function and the PyTorch SDPA
path, forward + backward, on a uniform and on a long-tailed mix of document lengths with the
same number of tokens.

For each mix and backend: the median time of forward + backward over ``--repeats`` runs (CUDA
events, after warm-up), the TFLOP/s it implies (forward 4·ΣL²·H·D FLOPs, halved under the causal
mask; backward 2.5x the forward, the FlashAttention convention), and the ratios that matter:
Triton (cost) / flash-attn, and cost-ordered / plain grid. Every backend's output is checked
against flash-attn's (or the fp32 reference) before it is timed.

    python scripts/bench/kernels.py [--tokens 65536] [--heads 32] [--kv-heads 8] [--head-dim 128]
        [--repeats 20] [--out DIR] [--doc docs/benchmarks.md]
    python scripts/bench/kernels.py --smoke     # CPU, TRITON_INTERPRET=1, tiny: checks the script runs

On a GPU the table replaces the "Varlen attention kernels (GPU)" section of ``--doc``; the
smoke run writes nothing there (its times mean nothing). Without CUDA and without ``--smoke``
it says so and exits with status 1.
"""
from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before triton is imported: the interpreter needs the flag first
    os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from _common import REPO, git_state, machine, parser, save, table  # noqa: E402

SECTION = "## Varlen attention kernels (GPU)"


def mixes(tokens: int, seed: int = 0) -> dict[str, list[int]]:
    """Document lengths: uniform (equal documents of 4096 tokens, or fewer when ``tokens`` is
    small) and long-tailed (one document of a quarter of the tokens, a few of an eighth, the rest
    log-normal short ones around 300), both summing to ``tokens``."""
    import random

    rng = random.Random(seed)
    doc = min(4096, tokens // 4)
    uniform = [doc] * (tokens // doc)
    uniform[-1] += tokens - sum(uniform)
    tail = [tokens // 4] + [tokens // 8] * 2
    while sum(tail) < tokens:
        tail.append(max(1, min(tokens - sum(tail), int(rng.lognormvariate(math.log(300), 1.0)))))
    rng.shuffle(tail)
    return {"uniform": uniform, "long-tailed": tail}


def attention_flops(lengths: list[int], heads: int, head_dim: int, causal: bool) -> float:
    fwd = 4.0 * sum(n * n for n in lengths) * heads * head_dim * (0.5 if causal else 1.0)
    return 3.5 * fwd  # forward + backward (backward = 2.5 x forward)


def make_inputs(lengths, heads, kv_heads, head_dim, dtype, device):
    import torch

    t = sum(lengths)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(t, h, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    return q, k, v, cu, torch.randn(t, heads, head_dim, device=device, dtype=dtype, generator=g)


def backends(has_flash: bool) -> list[tuple[str, dict]]:
    out = [("triton (cost-ordered)", dict(backend="triton", schedule="cost")),
           ("triton (plain grid)", dict(backend="triton", schedule="grid"))]
    if has_flash:
        out.append(("flash-attn varlen", dict(backend="flash")))
    out.append(("sdpa (PyTorch)", dict(backend="sdpa")))
    return out


def time_one(fn, repeats: int, cuda: bool) -> float:
    """Median seconds of ``fn`` (forward + backward) after 3 warm-up calls."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_mix(name, lengths, args, device, dtype, has_flash) -> list[dict]:
    import torch

    from omni.kernels import varlen_attention
    from omni.kernels.reference import attention_reference

    q, k, v, cu, grad = make_inputs(lengths, args.heads, args.kv_heads, args.head_dim, dtype, device)
    longest = max(lengths)
    if has_flash:
        check = varlen_attention(q, k, v, cu, longest, backend="flash").detach().float()
    else:
        check = attention_reference(q.detach().float(), k.detach().float(), v.detach().float(), cu)
    rows = []
    for label, kw in backends(has_flash):
        def step(kw=kw):
            out = varlen_attention(q, k, v, cu, longest, causal=True, **kw)
            torch.autograd.grad(out, (q, k, v), grad)

        out = varlen_attention(q, k, v, cu, longest, causal=True, **kw).detach().float()
        err = float((out - check).norm() / check.norm())
        seconds = time_one(step, args.repeats, device.type == "cuda")
        flops = attention_flops(lengths, args.heads, args.head_dim, causal=True)
        rows.append({"mix": name, "backend": label, "seconds": seconds, "tflops": flops / seconds / 1e12,
                     "rel_err_vs_check": err})
        print(f"  {name:12s} {label:22s} {seconds * 1e3:9.2f} ms  {flops / seconds / 1e12:7.1f} TFLOP/s  "
              f"err {err:.1e}", flush=True)
    return rows


def report(res: dict) -> str:
    by = {(r["mix"], r["backend"]): r for r in res["rows"]}
    lines = []
    headers = ["mix", "backend", "fwd+bwd ms", "TFLOP/s", "vs flash-attn", "rel. err"]
    body = []
    for r in res["rows"]:
        flash = by.get((r["mix"], "flash-attn varlen"))
        ratio = f"{flash['seconds'] / r['seconds']:.2f}x" if flash else "n/a"
        body.append([r["mix"], r["backend"], f"{r['seconds'] * 1e3:.2f}", f"{r['tflops']:.1f}", ratio,
                     f"{r['rel_err_vs_check']:.1e}"])
    lines.append(table(headers, body))
    for mix in res["lengths"]:
        cost, grid = by.get((mix, "triton (cost-ordered)")), by.get((mix, "triton (plain grid)"))
        if cost and grid:
            lines.append(f"- {mix}: cost-ordered / plain grid = {grid['seconds'] / cost['seconds']:.2f}x")
    return "\n".join(lines)


def write_section(doc: Path, res: dict, text: str) -> None:
    m = res["machine"]
    body = (f"{SECTION}\n\n`scripts/bench/kernels.py` on {m.get('gpu', '?')} (commit {res['git']['commit']}, "
            f"torch {res['torch']}, triton {res['triton']}, flash-attn {res.get('flash_attn') or 'not installed'}): "
            f"{res['tokens']} tokens, {res['heads']} query heads / {res['kv_heads']} KV heads, head dim "
            f"{res['head_dim']}, {res['dtype']}, causal; median of {res['repeats']} forward + backward runs. "
            f"Documents per mix: " + "; ".join(f"{k} {len(v)} (longest {max(v)})" for k, v in res["lengths"].items())
            + f".\n\n{text}\n")
    old = doc.read_text() if doc.exists() else ""
    if SECTION in old:
        start = old.index(SECTION)
        nxt = old.find("\n## ", start + len(SECTION))
        new = old[:start] + body + (old[nxt + 1:] if nxt >= 0 else "")
    else:
        new = old.rstrip() + "\n\n" + body
    doc.write_text(new)


def main() -> None:
    p = parser("Varlen attention kernels side by side (GPU; --smoke on the CPU)")
    p.add_argument("--smoke", action="store_true", help="tiny interpreted run on the CPU (checks the script)")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--doc", default=str(REPO / "docs" / "benchmarks.md"))
    args = p.parse_args()
    import importlib.util

    import torch
    import triton

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        # An error, not a quiet exit: scripts/gpu_check.sh must record that nothing was measured.
        raise SystemExit(f"kernels: error: torch {torch.__version__} sees no CUDA device, nothing measured "
                         f"(use --smoke to check the script on the CPU)")
    if args.smoke:
        args.tokens, args.heads, args.kv_heads, args.head_dim, args.repeats = 300, 4, 2, 32, 1
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    has_flash = cuda and importlib.util.find_spec("flash_attn") is not None
    info = machine()
    if cuda:
        info["gpu"] = torch.cuda.get_device_name(device)
    res = {"tokens": args.tokens, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
           "repeats": args.repeats, "dtype": str(dtype).replace("torch.", ""), "machine": info, "git": git_state(),
           "torch": torch.__version__, "triton": triton.__version__, "smoke": args.smoke,
           "flash_attn": __import__("flash_attn").__version__ if has_flash else None,
           "lengths": mixes(args.tokens), "rows": []}
    t0 = time.perf_counter()
    for name, lengths in res["lengths"].items():
        res["rows"] += run_mix(name, lengths, args, device, dtype, has_flash)
    res["seconds"] = time.perf_counter() - t0
    text = report(res)
    print(text)
    path = save(args.out, "kernels" + ("_smoke" if args.smoke else ""), res)
    print(f"wrote {path} ({res['seconds']:.0f} s)")
    if cuda:
        write_section(Path(args.doc), res, text)
        print(f"table written to {args.doc}")


if __name__ == "__main__":
    main()
