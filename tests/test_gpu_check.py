"""scripts/gpu_check.sh without a GPU: the dry run lists every part, checks the script, its
budgets and every script and test it names, and runs scripts/bench/mfu.py --tiny on the CPU plus
the report over it; a path that does not exist, a syntax error, a script that does not compile or
a CUDA-only test the name filter would miss fails the dry run before anything runs. The setup
part as on the lent GPU machine: tests/test_gpu_check_setup.py. The kernel benchmark's memory plan is
checked against an 80 GB H100, and in a real run on a machine without CUDA the parts that need it
fail, are recorded, and the others still run. Every test here also passes on a GPU machine (the
one that only makes sense without CUDA skips there), and none is picked by the gpu_tests part."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
PARTS = ("setup", "env", "gpu_tests", "mfu", "demo_bf16", "kernels", "report")
# One command on the lent machine runs at most 600 s; the check must end inside it with room to spare.
COMMAND_LIMIT_S = 600


def _run(script: Path, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, OUT=str(out), GPU_CHECK_PYTHON=sys.executable, GPU_CHECK_WORK=str(out / "work"), **env)
    return subprocess.run(["bash", str(script), *args], env=full, capture_output=True, text=True, timeout=400)


def test_dry_run_lists_every_part_and_runs_the_mfu_script_on_the_cpu(tmp_path):
    p = _run(SCRIPT, tmp_path, "--dry-run")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for part in PARTS:
        assert f"[{part}]" in p.stdout, part
    # The GPU-only tests it found (they skip here), by node id, and the scripts it compiled.
    assert "tests/kernels/test_varlen_attention.py: test_gpu_" in p.stdout
    gpu_line = next(x for x in p.stdout.splitlines() if x.strip().startswith("[gpu_tests]"))
    assert "tests/kernels/test_varlen_attention.py::test_gpu_bf16_triton_against_fp32_reference" in gpu_line
    assert " -k " not in gpu_line  # -k would match the module name of this file too
    # This file writes a CUDA skip into a string: it is no GPU test file.
    assert "tests/test_gpu_check.py" not in gpu_line and "GPU-only tests in tests/test_gpu_check.py" not in p.stdout
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
    assert "| MFU, LLM only, measured matmul peak |" in md


def test_mfu_counts_the_lm_head_only_at_the_loss_targets(tmp_path):
    """The tiny model's step: 4 samples of 256 tokens, each opening with a 64-patch image; the
    model computes logits only where a label is (not on the image's placeholders, not on a
    sample's last token): 256 - 64 - 1 = 191 positions per sample, not 256."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "mfu.py"), "--tiny", "--device", "cpu",
                        "--steps", "1", "--warmup", "0", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "mfu_tiny.json").read_text())
    mbs = res["batch"]["micro_batches"]
    docs = [d for mb in mbs for d in mb["docs"]]
    images = [n for mb in mbs for _, n, _ in mb["media"]]  # (modality, encoder tokens, LLM rows)
    assert docs == [256] * 4 and images == [64] * 4
    tiny = yaml.safe_load((REPO / "conf" / "model" / "tiny.yaml").read_text())
    assert tiny["tie_word_embeddings"]  # the head is the embedding: vocab x hidden
    head = tiny["vocab_size"] * tiny["hidden_size"]
    f = res["flops"]
    assert f["lm_head_positions"] == res["measured"]["target_tokens_per_step"] == 4 * (256 - 64 - 1)
    assert f["lm_head"] == 6 * head * 4 * 191
    # ModelSpec.mfu_flops counts the head on all 1024 tokens; the step's count is that less the
    # head on the 260 positions without a target.
    assert f["total"] == pytest.approx(f["head_on_every_token"] - 6 * head * (1024 - 764), rel=1e-12)
    assert f["total"] == pytest.approx(f["llm"] + f["encoders"], rel=1e-12) and f["encoders"] > 0
    m, mm = res["measured"], res["matmul_peak"]
    seconds = m["step_s_median"]
    assert m["mfu"] == pytest.approx(f["total"] / (seconds * res["peak_tflops"] * 1e12))
    assert m["mfu_without_encoders"] == pytest.approx(f["llm"] / (seconds * res["peak_tflops"] * 1e12))
    assert mm["tflops"] > 0
    assert m["mfu_vs_measured_matmul"] == pytest.approx(f["total"] / (seconds * mm["tflops"] * 1e12))
    assert m["mfu_without_encoders_vs_measured_matmul"] < m["mfu_vs_measured_matmul"]


def _timeouts(text: str) -> dict[str, int]:
    """The parts' timeouts as the script declares them (a knob's default where one may set it)."""
    body = re.search(r"declare -A TIMEOUT=\((.*?)\)\n", text, re.S).group(1)
    out = {}
    for name, value in re.findall(r"\[(\w+)\]=(\"[^\"]*\"|\d+)", body):
        knob = re.fullmatch(r'"\$\{\w+:-(\d+)\}"', value)
        out[name] = int(knob.group(1) if knob else value)
    return out


def test_the_parts_budgets_fit_the_total_and_one_command():
    text = SCRIPT.read_text()
    timeouts = _timeouts(text)
    assert set(timeouts) == set(PARTS) - {"report"}
    reserve = int(re.search(r"^REPORT_RESERVE_S=(\d+)$", text, re.M).group(1))
    budget = int(re.search(r'^BUDGET_S="\$\{GPU_CHECK_BUDGET_S:-(\d+)\}"', text, re.M).group(1))
    assert sum(timeouts.values()) + reserve <= budget, (timeouts, reserve, budget)
    # Room in one command for starting up, bash's own checks and the files coming back.
    assert budget <= COMMAND_LIMIT_S - 60, budget


def test_a_budget_smaller_than_the_parts_fails_the_dry_run(tmp_path):
    total = sum(_timeouts(SCRIPT.read_text()).values())
    p = _run(SCRIPT, tmp_path, "--dry-run", GPU_CHECK_BUDGET_S=str(total - 1))
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"over the {total - 1}s budget (GPU_CHECK_BUDGET_S)" in p.stderr and "nothing run" in p.stderr


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
    """The files the dry run looks at, copied: the scripts, the module and the GPU test files."""
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


def test_gpu_tests_runs_exactly_the_gpu_named_tests_by_node_id(tmp_path):
    """Top-level and class-level tests named *gpu*/*cuda* in a file with a CUDA skip mark; not
    its other tests, and not a file whose skip is only text in a string."""
    repo = _repo_copy(tmp_path / "repo")
    (repo / "tests" / "test_new.py").write_text(
        "import pytest, torch\n\ncuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')\n\n\n"
        "@cuda\ndef test_gpu_top():\n    assert True\n\n\ndef test_cpu_only():\n    assert True\n\n\n"
        "class TestFast:\n    @cuda\n    def test_cuda_method(self):\n        assert True\n\n\n"
        "def test_after_the_class_cuda():\n    assert True\n")
    (repo / "tests" / "test_text.py").write_text(
        "SNIPPET = \"@pytest.mark.skipif(not torch.cuda.is_available())\"\n\n\ndef test_gpu_text():\n    pass\n")
    p = _run(repo / "scripts" / "gpu_check.sh", tmp_path / "out", "--dry-run", GPU_CHECK_PARTS="gpu_tests")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.strip().startswith("[gpu_tests]"))
    ids = [w for w in line.split() if "::" in w]
    assert sorted(i for i in ids if "test_new.py" in i) == [
        "tests/test_new.py::TestFast::test_cuda_method", "tests/test_new.py::test_after_the_class_cuda",
        "tests/test_new.py::test_gpu_top"]
    assert "test_text.py" not in line and "test_cpu_only" not in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA records")
def test_parts_that_need_cuda_fail_and_are_recorded_while_the_others_run(tmp_path):
    p = _run(SCRIPT, tmp_path, GPU_CHECK_PARTS="setup env kernels")
    assert p.returncode == 1, p.stdout + p.stderr
    rows = [line.split("\t") for line in (tmp_path / "parts.tsv").read_text().splitlines()]
    assert [(r[0], r[1]) for r in rows] == [("setup", "ok"), ("env", "failed"), ("kernels", "failed")]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["env"]["cuda_available"] is False
    assert res["setup"]["mode"] == "given" and res["setup"]["python"] == sys.executable
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


def _kernels_module():
    """scripts/bench/kernels.py by its path: ``import kernels`` may find tests/kernels (a
    namespace package) first when the whole suite runs."""
    import importlib.util

    bench = str(REPO / "scripts" / "bench")
    sys.path.insert(0, bench)  # for its own imports (_common)
    try:
        spec = importlib.util.spec_from_file_location("omni_bench_kernels", REPO / "scripts" / "bench" / "kernels.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(bench)
    return module


def test_the_kernel_benchmark_is_sized_for_an_80gb_h100():
    """The benchmark's default shapes (65,536 tokens, 32 / 8 heads, head dim 128, bf16): the plan
    adds up what is allocated and chunks the fp32 reference so the peak stays under the cap, which
    leaves an 80 GB H100 (74.5 GiB) room; unchunked, the long-tailed mix's 16k-token document
    alone needs two 32-head fp32 score matrices of 32 GiB each."""
    k = _kernels_module()
    h100_gib = 80e9 / 2**30
    t, heads, kv, d = 65536, 32, 8, 128
    mixes = k.mixes(t)
    assert max(mixes["long-tailed"]) == 16384 and all(sum(x) == t for x in mixes.values())
    for name, lengths in mixes.items():
        plan = k.memory_plan(lengths, heads, kv, d, 2, 48.0)
        assert plan["fits"] and plan["peak_gib"] <= 48.0 < h100_gib, (name, plan)
        assert kv % plan["kv_heads_per_chunk"] == 0
    tail = k.memory_plan(mixes["long-tailed"], heads, kv, d, 2, 48.0)
    two_scores_gib = 2 * heads * 16384**2 * 4 / 2**30
    assert tail["unchunked_check_peak_gib"] > two_scores_gib == 64.0  # what needed ~70 of the H200's 139 GiB
    assert tail["kv_heads_per_chunk"] == 4 and tail["check_gib"] > two_scores_gib / 2  # half the heads at a time
    # The inputs held throughout: q and its gradient [T, 32, 128] and k, v [T, 8, 128] in bf16,
    # the fp32 check [T, 32, 128].
    assert tail["held_gib"] == (2 * t * heads * d * 2 + 2 * t * kv * d * 2 + t * heads * d * 4) / 2**30
    # A cap no chunking can meet is refused, not run.
    assert not k.memory_plan(mixes["long-tailed"], heads, kv, d, 2, 8.0)["fits"]


def test_the_chunked_reference_equals_the_whole_one():
    k = _kernels_module()
    from omni.kernels.reference import attention_reference

    lengths = [7, 19, 5]
    q, kk, v, cu, _ = k.make_inputs(lengths, 4, 2, 8, torch.float32, torch.device("cpu"))
    whole = attention_reference(q.detach(), kk.detach(), v.detach(), cu)
    for chunk in (1, 2):
        assert torch.allclose(k.reference_check(q, kk, v, lengths, chunk), whole, atol=1e-6)
