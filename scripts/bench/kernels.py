"""Varlen attention kernels side by side on one GPU: Omni's Triton kernels (cost-ordered
persistent schedule and the plain grid), flash-attn's varlen function and the PyTorch SDPA
path, forward + backward, on a uniform and on a long-tailed mix of document lengths with the
same number of tokens.

For each mix and backend: the median time of forward + backward over ``--repeats`` runs (CUDA
events, after warm-up), the TFLOP/s it implies (forward 4·ΣL²·H·D FLOPs, halved under the causal
mask; backward 2.5x the forward, the FlashAttention convention), and the ratios that matter:
Triton (cost) / flash-attn, and cost-ordered / plain grid. Every backend's output is checked
against flash-attn's (or the fp32 reference) before it is timed.

Memory: sized to fit an 80 GB H100, not only the 139 GiB H200. ``memory_plan`` adds up, from the
shapes, what the run holds at its peak and picks how many KV heads the fp32 reference takes at a
time: unchunked, its score matrices for the long-tailed mix's 16k-token document would be 64 GiB
(32 heads x 16384^2 x 4 bytes, twice). The plan must stay under ``--memory-cap-gib`` (default 48);
on a GPU the measured ``max_memory_allocated`` of each mix is reported beside it.

    python scripts/bench/kernels.py [--tokens 65536] [--heads 32] [--kv-heads 8] [--head-dim 128]
        [--repeats 20] [--memory-cap-gib 48] [--out DIR] [--doc docs/benchmarks.md]
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


GIB = 2**30
# A backend's forward + backward, in [T, H_q, D] tensors of the input dtype: the SDPA path is the
# largest (k and v repeated to the query heads: 2; the bucketed gathers of q, k, v, padded by up
# to 4/3: 4; the per-bucket outputs and the scattered output: 2; in the backward, the gradients of
# the gathers and of the outputs: 5; the output's and dq: 2), 15 counted, rounded up. Estimated,
# not measured: on a GPU the script reports the measured peak beside the plan.
RUN_COPIES = 16


def memory_plan(lengths: list[int], heads: int, kv_heads: int, head_dim: int, elem_bytes: int,
                cap_gib: float) -> dict:
    """Bytes at the peak of one mix, from the shapes ``make_inputs``, ``reference_check`` and a
    backend's run allocate, and the KV heads per reference chunk (the most that fit ``cap_gib``).

    Held throughout: q and the upstream gradient [T, H, D], k and v [T, H_kv, D] (input dtype),
    the fp32 check [T, H, D]. Then either the check being computed (the longest document L, c KV
    heads and their g = H / H_kv query heads at a time, in fp32: the q, k, v slices, k and v
    repeated to c*g heads, the output; two [c*g, L, L] score matrices alive at once in
    ``attention_reference`` and three L x L boolean masks), or a backend's run (``RUN_COPIES``
    [T, H, D] tensors, dk and dv, fp32 statistics per head and token; then the error's two fp32
    copies of the output)."""
    t, longest, group = sum(lengths), max(lengths), heads // kv_heads
    full = t * heads * head_dim  # elements of one [T, H, D] tensor
    held = (2 * full + 2 * t * kv_heads * head_dim) * elem_bytes + 4 * full
    run = max(RUN_COPIES * full * elem_bytes + 2 * t * kv_heads * head_dim * elem_bytes + 4 * heads * t * 4,
              2 * full * 4 + full * elem_bytes)

    def check(c: int) -> int:
        rows = longest * head_dim * 4
        return rows * (c * group * 4 + 2 * c) + 2 * c * group * longest * longest * 4 + 3 * longest * longest

    fits = [c for c in range(1, kv_heads + 1) if kv_heads % c == 0 and held + max(check(c), run) <= cap_gib * GIB]
    c = max(fits) if fits else 1
    peak = held + max(check(c), run)
    return {"kv_heads_per_chunk": c, "fits": bool(fits), "cap_gib": cap_gib, "peak_gib": peak / GIB,
            "held_gib": held / GIB, "check_gib": check(c) / GIB, "run_gib": run / GIB,
            "unchunked_check_peak_gib": (held + check(kv_heads)) / GIB}


def reference_check(q, k, v, lengths: list[int], kv_per_chunk: int):
    """The fp32 reference output, one document and ``kv_per_chunk`` KV heads (with their query
    heads) at a time, written into one [T, H, D] tensor (``memory_plan`` sizes the chunks)."""
    import torch

    from omni.kernels.reference import attention_reference

    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for n in lengths:
        cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        rows = slice(start, start + n)
        for h in range(0, k.shape[1], kv_per_chunk):
            qh, kh = slice(h * group, (h + kv_per_chunk) * group), slice(h, h + kv_per_chunk)
            out[rows, qh] = attention_reference(q[rows, qh].detach().float(), k[rows, kh].detach().float(),
                                                v[rows, kh].detach().float(), cu)
        start += n
    return out


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


def run_mix(name, lengths, args, device, dtype, has_flash, plan: dict) -> list[dict]:
    import torch

    from omni.kernels import varlen_attention

    q, k, v, cu, grad = make_inputs(lengths, args.heads, args.kv_heads, args.head_dim, dtype, device)
    longest = max(lengths)
    if has_flash:
        check = varlen_attention(q, k, v, cu, longest, backend="flash").detach().float()
    else:
        check = reference_check(q, k, v, lengths, plan["kv_heads_per_chunk"])
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
    for mix, plan in res.get("memory", {}).items():
        measured = f", measured {plan['measured_peak_gib']:.1f} GiB" if "measured_peak_gib" in plan else ""
        lines.append(f"- {mix}: memory planned {plan['peak_gib']:.1f} GiB (cap {plan['cap_gib']:g} GiB; fp32 "
                     f"reference {plan['kv_heads_per_chunk']} KV heads at a time){measured}")
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
    p.add_argument("--memory-cap-gib", type=float, default=48.0,
                   help="the most the run may hold (planned from the shapes); 48 leaves an 80 GB H100 room")
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
    elem = torch.finfo(dtype).bits // 8
    res["memory"] = {name: memory_plan(lengths, args.heads, args.kv_heads, args.head_dim, elem, args.memory_cap_gib)
                     for name, lengths in res["lengths"].items()}
    for name, plan in res["memory"].items():
        if not plan["fits"]:
            raise SystemExit(f"kernels: error: the {name} mix needs {plan['peak_gib']:.1f} GiB even one KV head at a "
                             f"time, over --memory-cap-gib {args.memory_cap_gib:g}; lower --tokens or --heads")
    t0 = time.perf_counter()
    for name, lengths in res["lengths"].items():
        plan = res["memory"][name]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        res["rows"] += run_mix(name, lengths, args, device, dtype, has_flash, plan)
        if cuda:
            plan["measured_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            torch.cuda.empty_cache()
        print(f"  {name}: planned peak {plan['peak_gib']:.1f} GiB (cap {plan['cap_gib']:g}; reference "
              f"{plan['kv_heads_per_chunk']} KV heads at a time)"
              + (f", measured {plan['measured_peak_gib']:.1f} GiB" if "measured_peak_gib" in plan else ""),
              flush=True)
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
