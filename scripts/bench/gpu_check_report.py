"""The GPU check's two helpers (scripts/gpu_check.sh), standard library only except ``env``:

    python scripts/bench/gpu_check_report.py env OUT/env.json   # torch, CUDA and the GPU; exit 1 without CUDA
    python scripts/bench/gpu_check_report.py report OUT          # OUT/gpu_check.json and OUT/gpu_check.md

``report`` reads what the parts left in OUT: ``parts.tsv`` (one line per part: name, status,
exit code, seconds, timeout), ``setup/setup.json``, ``env.json``, ``gpu_tests/junit.xml``,
``demo_bf16/metrics.jsonl``, ``mfu/mfu.json`` (or ``mfu_tiny.json``) with ``mfu/*.md``,
``kernels/kernels.json`` with ``kernels/section.md``. A part that failed or never ran is reported
as such; the report itself never fails on a missing file. The markdown is what goes under "GPU check" in
docs/benchmarks.md.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

TITLES = {"setup": "interpreter and packages", "env": "torch and the GPU", "gpu_tests": "GPU-only tests",
          "mfu": "MFU and memory model (1B-class)", "demo_bf16": "bf16 demo", "kernels": "varlen attention kernels"}


def env_probe(path: str) -> int:
    import platform

    import torch

    info = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "python": platform.python_version(), "executable": sys.executable}
    if info["cuda_available"]:
        info.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(),
                    memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30,
                    bf16=torch.cuda.is_bf16_supported())
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import flash_attn

        info["flash_attn"] = flash_attn.__version__
    except ImportError:
        info["flash_attn"] = None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    if not info["cuda_available"]:
        print(f"gpu_check: error: torch {info['torch']} sees no CUDA device (CUDA build: {info['cuda_build']}); "
              f"install a CUDA build of torch into the venv", file=sys.stderr)
        return 1
    return 0


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def parts(out: Path) -> list[dict]:
    rows = []
    try:
        lines = (out / "parts.tsv").read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        f = line.split("\t")
        if len(f) >= 5:
            rows.append({"part": f[0], "status": f[1], "rc": int(f[2]) if f[2].lstrip("-").isdigit() else None,
                         "seconds": float(f[3]), "timeout_s": float(f[4])})
    return rows


def gpu_tests(out: Path) -> dict | None:
    try:
        root = ET.parse(out / "gpu_tests" / "junit.xml").getroot()
    except (OSError, ET.ParseError):
        return None
    res = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skips": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            res["failed"] += 1
            res["failures"].append(name)
        elif case.find("skipped") is not None:
            res["skipped"] += 1
            res["skips"].append(f"{name}: {case.find('skipped').get('message', '')}")
        else:
            res["passed"] += 1
    return res


def demo(out: Path) -> dict | None:
    try:
        rows = [json.loads(x) for x in (out / "demo_bf16" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return None
    steps = [r for r in rows if "loss" in r and "step" in r]
    if not steps:
        return None
    ev = [r for r in rows if r.get("event") == "eval"]
    times = [r["step_time_s"] for r in steps[1:] if "step_time_s" in r] or [steps[0].get("step_time_s", 0.0)]
    return {"steps": steps[-1]["step"], "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
            "step_time_s_median": statistics.median(times),
            "skipped_steps": steps[-1].get("skipped_steps", 0),
            "peak_mem_gib": max((r.get("peak_mem_gib", 0.0) for r in steps), default=None),
            "eval_accuracy": ev[-1]["accuracy"] if ev else None}


def mfu(out: Path) -> dict | None:
    for name in ("mfu", "mfu_tiny"):
        res = _load(out / "mfu" / f"{name}.json")
        if res is not None:
            res["table"] = (out / "mfu" / f"{name}.md").read_text() if (out / "mfu" / f"{name}.md").exists() else ""
            return res
    return None


def kernels(out: Path) -> dict | None:
    res = _load(out / "kernels" / "kernels.json")
    if res is None:
        return None
    section = out / "kernels" / "section.md"
    res["section"] = section.read_text() if section.exists() else ""
    return res


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _result(part: str, data: dict) -> str:
    """One line of figures per part for the summary table."""
    su, env, tests, d, m, k = (data.get(x) for x in ("setup", "env", "gpu_tests", "demo_bf16", "mfu", "kernels"))
    if part == "env" and env:
        return (f"torch {env['torch']} (CUDA {env.get('cuda_build')}), {env.get('gpu', 'no GPU')}, "
                f"triton {env.get('triton')}, flash-attn {env.get('flash_attn') or 'not installed'}")
    if part == "gpu_tests" and tests:
        fails = f" ({', '.join(tests['failures'])})" if tests["failures"] else ""
        return f"{tests['passed']} passed, {tests['failed']} failed{fails}, {tests['skipped']} skipped"
    if part == "demo_bf16" and d:
        acc = f", held-out accuracy {d['eval_accuracy']:.3f}" if d["eval_accuracy"] is not None else ""
        return (f"{d['steps']} steps, loss {d['first_loss']:.3f} -> {d['last_loss']:.3f}, "
                f"{d['step_time_s_median']:.3f} s/step{acc}")
    if part == "setup" and su:
        mods = su.get("modules", {})
        wheels = ", ".join(f"{n} {mods[n]['version']}" for n in ("hydra", "omegaconf", "webdataset", "wids")
                           if mods.get(n, {}).get("version"))
        return (f"{su['mode']}: {su['python']} (Python {su['python_version']}), torch "
                f"{mods.get('torch', {}).get('version')}" + (f"; {wheels}" if wheels else ""))
    if part == "mfu" and m:
        me, pr, mm = m["measured"], m["predicted"], m.get("matmul_peak") or {}
        mem = ""
        if me.get("peak_allocated_gib"):
            mem = (f"; memory predicted {pr['memory_gib']['total']:.1f} GiB / measured "
                   f"{me['peak_allocated_gib']:.1f} GiB = {m['memory_ratio_predicted_over_measured']:.3f}")
        return (f"MFU {_pct(me.get('mfu'))} with encoders, {_pct(me.get('mfu_without_encoders'))} LLM only "
                f"(datasheet {m['peak_tflops']:.4g} TFLOP/s); {_pct(me.get('mfu_vs_measured_matmul'))} / "
                f"{_pct(me.get('mfu_without_encoders_vs_measured_matmul'))} of the measured matmul peak "
                f"{mm.get('tflops', float('nan')):.4g} TFLOP/s; {me['step_s_median']:.3f} s/step (predicted "
                f"{pr['step_time_s']:.3f}){mem}")
    if part == "kernels" and k:
        mem = "; ".join(f"{mix} {p['peak_gib']:.1f} GiB planned" + (f", {p['measured_peak_gib']:.1f} measured"
                                                                    if "measured_peak_gib" in p else "")
                        for mix, p in (k.get("memory") or {}).items())
        return (f"{len(k.get('rows', []))} kernel timings ({k.get('tokens')} tokens, {k.get('dtype')})"
                + (f"; memory: {mem}" if mem else ""))
    return ""


def last_line(out: Path, part: str) -> str:
    """The last line a part printed (its error, when it failed), fit for a table cell."""
    try:
        lines = [x.strip() for x in (out / part / "log.txt").read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    text = lines[-1] if lines else ""
    return (text[:200] + " ...") if len(text) > 200 else text


def commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parents[2],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def report(out: str) -> int:
    out = Path(out)
    data = {"setup": _load(out / "setup" / "setup.json"), "env": _load(out / "env.json"), "gpu_tests": gpu_tests(out),
            "demo_bf16": demo(out), "mfu": mfu(out), "kernels": kernels(out)}
    ps = parts(out)
    res = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "total_s": sum(p["seconds"] for p in ps), "parts": ps,
           **{k: ({kk: vv for kk, vv in v.items() if kk not in ("table", "section")} if isinstance(v, dict) else v)
              for k, v in data.items()}}
    env = data["env"] or {}
    res["commit"] = commit()
    lines = [f"`bash scripts/gpu_check.sh` on {env.get('gpu', 'no GPU')} ({res['time']}, commit {res['commit']}, "
             f"{res['total_s']:.0f} s in all).", "",
             "| part | status | seconds | result |", "|---|---|---|---|"]
    for p in ps:
        result = _result(p["part"], data)
        if p["status"] != "ok":
            p["last_line"] = last_line(out, p["part"])
            result = "; ".join(x for x in (result, p["last_line"]) if x)
        lines.append(f"| {TITLES.get(p['part'], p['part'])} | {p['status']} | {p['seconds']:.0f} | "
                     f"{result.replace('|', '/')} |")
    if data["mfu"] and data["mfu"].get("table"):
        lines += ["", "**MFU and memory model**" + (" (`--tiny` on the CPU: mechanics only, numbers mean nothing)"
                                                     if data["mfu"].get("tiny") else ""), "", data["mfu"]["table"].strip()]
    if data["kernels"] and data["kernels"].get("section"):
        body = data["kernels"]["section"].strip().split("\n", 1)[-1].strip()  # without its "## " heading
        lines += ["", "**Varlen attention kernels**", "", body]
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "env":
        return env_probe(argv[1])
    if len(argv) == 2 and argv[0] == "report":
        return report(argv[1])
    print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
