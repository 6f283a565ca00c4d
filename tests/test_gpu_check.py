"""scripts/gpu_check.sh without a GPU: the dry run lists every part, checks the script and every
script and test it names, and runs scripts/bench/mfu.py --tiny on the CPU plus the report over
it; a path that does not exist, a syntax error, a script that does not compile or a CUDA-only
test the name filter would miss fails the dry run before anything runs; in a real run on a
machine without CUDA the parts that need it fail, are recorded, and the others still run."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
PARTS = ("setup", "env", "gpu_tests", "mfu", "demo_bf16", "kernels", "report")


def _run(script: Path, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, OUT=str(out), GPU_CHECK_PYTHON=sys.executable, GPU_CHECK_WORK=str(out / "work"), **env)
    return subprocess.run(["bash", str(script), *args], env=full, capture_output=True, text=True, timeout=400)


def test_dry_run_lists_every_part_and_runs_the_mfu_script_on_the_cpu(tmp_path):
    p = _run(SCRIPT, tmp_path, "--dry-run")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for part in PARTS:
        assert f"[{part}]" in p.stdout, part
    # The GPU-only tests it found (they skip here) and the scripts it compiled.
    assert "tests/kernels/test_varlen_attention.py: test_gpu_" in p.stdout
    for path in ("scripts/bench/mfu.py", "scripts/bench/kernels.py", "scripts/bench/gpu_check_report.py",
                 "recipes/cli.py"):
        assert path in p.stdout.split("compiled", 1)[1], path
    res = json.loads((tmp_path / "dry_run" / "mfu" / "mfu_tiny.json").read_text())
    assert res["tiny"] and res["device"] == "cpu" and res["cluster"] == "cpu"
    assert len(res["measured"]["step_s"]) == 2 and res["losses_finite"]
    assert res["flops_per_step"] > 0 and math.isfinite(res["measured"]["mfu"]) and res["measured"]["mfu"] > 0
    # The batch the simulator drew is the one that ran: its tokens are the measured step's.
    drawn = sum(sum(mb["docs"]) for mb in res["batch"]["micro_batches"])
    assert drawn == res["measured"]["tokens_per_step"]
    assert res["predicted"]["memory_gib"]["total"] > 0
    md = (tmp_path / "dry_run" / "gpu_check.md").read_text()
    assert "| MFU and memory model (1B-class) | ok |" in md and "| step time (s, median) |" in md


def test_a_missing_script_fails_the_dry_run_before_anything_runs(tmp_path):
    broken = tmp_path / "scripts" / "gpu_check.sh"
    broken.parent.mkdir()
    text = SCRIPT.read_text()
    assert "scripts/bench/kernels.py" in text
    broken.write_text(text.replace("scripts/bench/kernels.py", "scripts/bench/kernels_gone.py"))
    p = _run(broken, tmp_path / "out", "--dry-run", GPU_CHECK_REPO=str(REPO))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "gpu_check: error: script scripts/bench/kernels_gone.py: no such file" in p.stderr
    assert "nothing run" in p.stderr and not (tmp_path / "out" / "dry_run").exists()


def test_a_syntax_error_past_the_dry_run_still_fails_it(tmp_path):
    """bash parses as it goes and the dry run exits before the real run's code: only its own
    ``bash -n`` sees a mistake there."""
    broken = tmp_path / "scripts" / "gpu_check.sh"
    broken.parent.mkdir()
    broken.write_text(SCRIPT.read_text() + "\nif then fi\n")
    p = _run(broken, tmp_path / "out", "--dry-run", GPU_CHECK_REPO=str(REPO))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "bash -n found a syntax error" in p.stderr


def _repo_copy(root: Path) -> Path:
    """The files the dry run looks at, copied: the scripts, the module and the GPU test file."""
    import shutil

    shutil.copytree(REPO / "scripts", root / "scripts")
    for rel in ("recipes/cli.py", "tests/kernels/test_varlen_attention.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, root / rel)
    return root


def test_a_script_that_does_not_compile_fails_the_dry_run(tmp_path):
    repo = _repo_copy(tmp_path / "repo")
    mfu = repo / "scripts" / "bench" / "mfu.py"
    mfu.write_text(mfu.read_text() + "\ndef broken(:\n")
    p = _run(repo / "scripts" / "gpu_check.sh", tmp_path / "out", "--dry-run")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "gpu_check: error: scripts/bench/mfu.py:" in p.stderr and "does not compile" in p.stderr


def test_a_cuda_only_test_the_name_filter_would_miss_fails_the_dry_run(tmp_path):
    repo = _repo_copy(tmp_path / "repo")
    (repo / "tests" / "test_new.py").write_text(
        "import pytest, torch\n\n\n@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')\n"
        "def test_fast_path():\n    assert True\n")
    p = _run(repo / "scripts" / "gpu_check.sh", tmp_path / "out", "--dry-run")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "tests/test_new.py skips tests without CUDA but none is named" in p.stderr


def test_parts_that_need_cuda_fail_and_are_recorded_while_the_others_run(tmp_path):
    p = _run(SCRIPT, tmp_path, GPU_CHECK_PARTS="setup env kernels")
    assert p.returncode == 1, p.stdout + p.stderr
    rows = [line.split("\t") for line in (tmp_path / "parts.tsv").read_text().splitlines()]
    assert [(r[0], r[1]) for r in rows] == [("setup", "ok"), ("env", "failed"), ("kernels", "failed")]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["env"]["cuda_available"] is False
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| varlen attention kernels | failed |" in md and "sees no CUDA device" in md
    assert "did not pass: env kernels" in p.stderr


def test_report_reads_every_part(tmp_path):
    """The report over hand-made part outputs: test counts from the junit file, the demo's
    figures from its metrics, a timed-out part with its last line."""
    (tmp_path / "parts.tsv").write_text("gpu_tests\tok\t0\t12\t90\ndemo_bf16\ttimed out\t124\t150\t150\n")
    (tmp_path / "gpu_tests").mkdir()
    (tmp_path / "gpu_tests" / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="a"/><testcase classname="t" name="b">'
        '<failure message="x"/></testcase><testcase classname="t" name="c"><skipped message="no flash"/>'
        '</testcase></testsuite></testsuites>')
    (tmp_path / "demo_bf16").mkdir()
    metrics = [{"step": s, "loss": 6.0 / s, "step_time_s": 0.1 * s, "peak_mem_gib": 0.5} for s in (1, 2, 3)]
    (tmp_path / "demo_bf16" / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
    (tmp_path / "demo_bf16" / "log.txt").write_text("step 3\nstill training\n")
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "gpu_check_report.py"), "report",
                        str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| GPU-only tests | ok | 12 | 1 passed, 1 failed (t::b), 1 skipped |" in md
    assert "| bf16 demo | timed out | 150 | 3 steps, loss 6.000 -> 2.000, 0.250 s/step; still training |" in md
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["demo_bf16"]["steps"] == 3 and res["gpu_tests"]["failures"] == ["t::b"]
