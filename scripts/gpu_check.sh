#!/usr/bin/env bash
# The GPU check (docs/benchmarks.md, "GPU check"): on one CUDA GPU, from a fresh checkout, in at
# most GPU_CHECK_BUDGET_S seconds (default 470: under 8 minutes with the report):
#   setup      the venv (.venv): on a machine whose python3 has a CUDA torch, over its packages
#              (plus wheels in .whl/, if any) with Omni installed alone, no network needed; else
#              `pip install -e ".[dev]"`; unless GPU_CHECK_PYTHON names an interpreter to use
#   env        torch, CUDA and the GPU (fails, and says so, when torch sees no CUDA device)
#   gpu_tests  the tests that skip without CUDA (files with skipif(not torch.cuda.is_available()),
#              tests named *gpu* / *cuda*), with compiled Triton kernels (TRITON_INTERPRET=0)
#   mfu        scripts/bench/mfu.py: MFU of a 1B-class multimodal model on one GPU, and the memory
#              model's predicted peak against torch.cuda.max_memory_allocated
#   demo_bf16  `omni train` with bf16 autocast on the GPU, GPU_CHECK_DEMO_STEPS steps, fresh run dir
#   kernels    scripts/bench/kernels.py: the varlen attention kernels side by side
# Every part has its own timeout (cut to what is left of the budget) and its log; a failure is
# recorded and the next part runs; the exit status is 1 if any part did not pass. Results: $OUT (else runs/gpu_check/): gpu_check.json (every
# number) and gpu_check.md (the table for docs/benchmarks.md), plus each part's folder and log.
#
#   bash scripts/gpu_check.sh             # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run   # anywhere: list the commands, check this script's syntax
#                                         # and every script and test it names, then run mfu.py
#                                         # --tiny on the CPU and the report (needs the venv)
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

SCRIPT="${BASH_SOURCE[0]}"
REPO="${GPU_CHECK_REPO:-$(cd "$(dirname "$SCRIPT")/.." && pwd)}"
OUT_DIR="${OUT:-$REPO/runs/gpu_check}"
WORK="${GPU_CHECK_WORK:-$REPO/runs/gpu_check_work}"  # scratch (the demo's run dir), not part of the results
PY="${GPU_CHECK_PYTHON:-$REPO/.venv/bin/python}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"
DEMO_STEPS="${GPU_CHECK_DEMO_STEPS:-400}"
REPORT_RESERVE_S=10
ALL_PARTS=(setup env gpu_tests mfu demo_bf16 kernels)
read -r -a PARTS <<<"${GPU_CHECK_PARTS:-${ALL_PARTS[*]}}"  # a subset, e.g. GPU_CHECK_PARTS="env mfu"
# Seconds per part, before the budget cuts them (guesses for one H200 with 16 cores; the
# install dominates setup).
declare -A TIMEOUT=([setup]="${GPU_CHECK_SETUP_S:-200}" [env]=60 [gpu_tests]=90 [mfu]=150 [demo_bf16]=150
                    [kernels]=120)

DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  -h|--help) usage; exit 0 ;;
  *) echo "gpu_check: error: unknown argument '$1'; use --dry-run, --help or nothing" >&2; exit 2 ;;
esac
cd "$REPO" || { echo "gpu_check: error: no repository at $REPO" >&2; exit 2; }

# Test files with a test that skips without CUDA; their GPU tests are the ones named *gpu*/*cuda*.
mapfile -t GPU_TEST_FILES < <(grep -rlE 'skipif\(\s*not torch\.cuda\.is_available\(\)' tests --include='*.py' | sort)

# CMD: the command of part $1 (run from the repository root).
command_for() {
  case "$1" in
    setup)
      if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
        CMD=("$PY" -c "import omni, pytest")
      else
        # A lent GPU machine reaches no package registry: where its own python3 already has a
        # CUDA torch, the venv sees its packages and installs Omni alone, without the network;
        # wheels of what it lacks can travel in .whl/ (the device tool's notes). Elsewhere a
        # plain install, as the README's.
        CMD=(bash -c 'if [ -x .venv/bin/python ] && .venv/bin/python -c "import omni, pytest" 2>/dev/null; then echo "reusing .venv";
elif python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  python3 -m venv --system-site-packages .venv &&
  { [ ! -d .whl ] || .venv/bin/pip install -q --no-index --no-deps .whl/*.whl; } &&
  .venv/bin/pip install -q --no-deps --no-build-isolation -e . && .venv/bin/python -c "import omni, pytest, hydra, transformers, webdataset"
else python3 -m venv .venv && .venv/bin/pip install -q -e ".[dev]"; fi')
      fi ;;
    env) CMD=("$PY" scripts/bench/gpu_check_report.py env "$OUT_DIR/env.json") ;;
    gpu_tests)
      if [[ ${#GPU_TEST_FILES[@]} -eq 0 ]]; then  # else pytest would collect the whole suite
        CMD=(bash -c 'echo "gpu_check: error: no test under tests/ skips without CUDA" >&2; exit 1')
      else
        CMD=(env TRITON_INTERPRET=0 "$PY" -m pytest -q -rs -p no:cacheprovider -k "gpu or cuda"
             --junitxml "$OUT_DIR/gpu_tests/junit.xml" "${GPU_TEST_FILES[@]}")
      fi ;;
    mfu) CMD=("$PY" scripts/bench/mfu.py --device cuda --steps 10 --warmup 3 --out "$OUT_DIR/mfu") ;;
    demo_bf16) CMD=("$PY" -m recipes.cli train trainer.precision=bf16 trainer.device=cuda
                    "trainer.max_steps=$DEMO_STEPS" "trainer.run_dir=$WORK/demo_bf16" trainer.progress=false
                    checkpoint.every=0 checkpoint.save_at_end=false checkpoint.resume=never) ;;
    kernels) CMD=("$PY" scripts/bench/kernels.py --repeats 10 --out "$OUT_DIR/kernels"
                  --doc "$OUT_DIR/kernels/section.md") ;;
    report) CMD=(python3 scripts/bench/gpu_check_report.py report "$OUT_DIR") ;;
    *) echo "gpu_check: error: no part named $1" >&2; return 1 ;;
  esac
}

before_part() {  # what a part needs beforehand
  case "$1" in
    demo_bf16) rm -rf "$WORK/demo_bf16" ;;  # a fresh run: nothing to resume from
  esac
}

after_part() {  # what a part leaves for the report
  case "$1" in
    demo_bf16) [[ -f "$WORK/demo_bf16/metrics.jsonl" ]] && cp "$WORK/demo_bf16/metrics.jsonl" "$OUT_DIR/demo_bf16/" ;;
  esac
  return 0
}

ERRORS=0
problem() { echo "gpu_check: error: $*" >&2; ERRORS=$((ERRORS + 1)); }

# The paths a command names: scripts (*.py), modules (-m NAME) and test node ids (FILE::TEST).
check_command_paths() {
  local prev="" w file name
  for w in "$@"; do
    if [[ "$prev" == "-m" && "$w" != pytest ]]; then
      file="${w//.//}.py"
      [[ -f "$file" ]] || problem "module $w: no file $file"
      [[ -f "$file" ]] && COMPILE+=("$file")
    elif [[ "$w" == *.py::* ]]; then
      file="${w%%::*}"; name="${w#*::}"; name="${name%%[*}"
      if [[ ! -f "$file" ]]; then problem "test $w: no file $file"
      elif ! grep -qE "def ${name}\(" "$file"; then problem "test $w: no test $name in $file"
      else COMPILE+=("$file"); fi
    elif [[ "$w" == *.py && "$w" != */* ]]; then
      :
    elif [[ "$w" == *.py ]]; then
      if [[ -f "$w" ]]; then COMPILE+=("$w"); else problem "script $w: no such file (in $REPO)"; fi
    fi
    prev="$w"
  done
}

dry_run() {
  local part
  echo "gpu_check --dry-run: repository $REPO, results to $OUT_DIR, python $PY, budget ${BUDGET_S}s"
  bash -n "$SCRIPT" || problem "$SCRIPT: bash -n found a syntax error"
  COMPILE=()
  for part in "${PARTS[@]}" report; do
    command_for "$part" 2>/dev/null || { problem "no part named '$part' (parts: ${ALL_PARTS[*]})"; continue; }
    printf '  [%s] timeout %ss: %s\n' "$part" "${TIMEOUT[$part]:-$REPORT_RESERVE_S}" "$(printf '%q ' "${CMD[@]}")"
    check_command_paths "${CMD[@]}"
  done
  if [[ ${#GPU_TEST_FILES[@]} -eq 0 ]]; then
    problem "no test under tests/ skips without CUDA (skipif(not torch.cuda.is_available())): part gpu_tests has nothing to run"
  fi
  local f
  for f in "${GPU_TEST_FILES[@]}"; do
    COMPILE+=("$f")
    if ! grep -qE '^\s*def test_\w*(gpu|cuda)\w*\(' "$f"; then
      problem "$f skips tests without CUDA but none is named test_*gpu*/test_*cuda*: part gpu_tests selects them by name"
    fi
    echo "  GPU-only tests in $f: $(grep -oE '^\s*def test_\w*(gpu|cuda)\w*' "$f" | sed 's/^\s*def //' | tr '\n' ' ')"
  done
  if [[ ${#COMPILE[@]} -gt 0 ]]; then
    python3 - "${COMPILE[@]}" <<'EOF' || problem "a script or test above does not compile"
import sys
for path in sys.argv[1:]:
    try:
        compile(open(path, encoding="utf-8").read(), path, "exec")
    except SyntaxError as e:
        print(f"gpu_check: error: {path}:{e.lineno}: {e.msg}", file=sys.stderr)
        sys.exit(1)
files = sorted(set(sys.argv[1:]))
print(f"  compiled {len(files)} files: {' '.join(files)}")
EOF
  fi
  if [[ $ERRORS -gt 0 ]]; then
    echo "gpu_check --dry-run: $ERRORS problem(s); nothing run" >&2
    return 1
  fi
  # The mechanics: mfu.py on the CPU (numbers meaningless) and the report over its output.
  if [[ ! -x "$PY" ]]; then
    echo "gpu_check --dry-run: checks passed; mfu.py --tiny not run: no python at $PY (create .venv or set GPU_CHECK_PYTHON)"
    return 0
  fi
  local dry="$OUT_DIR/dry_run" t0=$SECONDS rc
  rm -rf "$dry" && mkdir -p "$dry/mfu"
  echo "  [mfu --tiny] $PY scripts/bench/mfu.py --tiny --device cpu --steps 2 --warmup 1 --out $dry/mfu"
  # One thread: the tiny model gains nothing from more, and on a shared machine more threads than
  # free cores made its steps 30-80x slower.
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" timeout -k 10 300 \
    "$PY" scripts/bench/mfu.py --tiny --device cpu --steps 2 --warmup 1 --out "$dry/mfu" >"$dry/mfu/log.txt" 2>&1
  rc=$?
  printf 'mfu\t%s\t%s\t%s\t%s\n' "$([[ $rc -eq 0 ]] && echo ok || echo failed)" "$rc" "$((SECONDS - t0))" 300 \
    >"$dry/parts.tsv"
  if [[ $rc -ne 0 ]]; then
    tail -n 20 "$dry/mfu/log.txt" >&2
    problem "mfu.py --tiny --device cpu failed (exit $rc; log $dry/mfu/log.txt)"
    return 1
  fi
  python3 scripts/bench/gpu_check_report.py report "$dry" || { problem "the report failed on $dry"; return 1; }
  echo "gpu_check --dry-run: ok"
}

record() {  # part status rc seconds timeout
  printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$OUT_DIR/parts.tsv"
}

run_part() {
  local name="$1" left t log t0 rc status
  command_for "$name"
  left=$((BUDGET_S - (SECONDS - START) - REPORT_RESERVE_S))
  t="${TIMEOUT[$name]}"
  ((t > left)) && t=$left
  mkdir -p "$OUT_DIR/$name"
  log="$OUT_DIR/$name/log.txt"
  if ((t < 15)); then
    echo "gpu_check: [$name] skipped: ${left}s of the ${BUDGET_S}s budget left"
    record "$name" "skipped (out of time)" "" 0 0
    return
  fi
  echo "gpu_check: [$name] (timeout ${t}s) $(printf '%q ' "${CMD[@]}")"
  before_part "$name"
  t0=$SECONDS
  timeout -k 10 "$t" "${CMD[@]}" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="timed out" ;;
    *) status=failed ;;
  esac
  after_part "$name"
  record "$name" "$status" "$rc" "$((SECONDS - t0))" "$t"
  echo "gpu_check: [$name] $status after $((SECONDS - t0))s (exit $rc; log $log)"
  [[ $status == ok ]] || { FAILED+=("$name"); tail -n 5 "$log" | sed 's/^/    /'; }
}

if [[ $DRY_RUN -eq 1 ]]; then
  mkdir -p "$OUT_DIR"
  dry_run
  exit $?
fi

START=$SECONDS
FAILED=()
for part in "${PARTS[@]}"; do
  command_for "$part" 2>/dev/null || { echo "gpu_check: error: no part named '$part' (parts: ${ALL_PARTS[*]})" >&2; exit 2; }
done
mkdir -p "$OUT_DIR" "$WORK"
rm -f "$OUT_DIR/parts.tsv"
for part in "${PARTS[@]}"; do
  run_part "$part"
done
command_for report
"${CMD[@]}" || FAILED+=(report)
echo "gpu_check: done in $((SECONDS - START))s; paste $OUT_DIR/gpu_check.md under \"GPU check\" in docs/benchmarks.md"
if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "gpu_check: did not pass: ${FAILED[*]} (their logs are in $OUT_DIR/<part>/log.txt)" >&2
  exit 1
fi
