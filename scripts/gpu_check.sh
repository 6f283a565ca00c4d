#!/usr/bin/env bash
# The GPU check (docs/benchmarks.md, "GPU check"): on one CUDA GPU, from a fresh checkout, in at
# most GPU_CHECK_BUDGET_S seconds (default 470: under 8 minutes with the report, inside one
# 600 s command of the lent machine):
#   setup      chooses the interpreter every later part runs (written to $GPU_CHECK_WORK/setup.env),
#              the first of: GPU_CHECK_PYTHON; offline if GPU_CHECK_OFFLINE=1; a .venv that
#              imports omni; offline if python3 has a CUDA torch; `pip install -e ".[dev]"` into
#              .venv (a download: outside the budget). Offline: python3 itself, the wheels in
#              .whl/ (GPU_CHECK_WHEELS) installed into $GPU_CHECK_WORK/site, Omni imported from
#              the checkout (both on PYTHONPATH; nothing installed into python3, no network)
#              (besides ../shared/gpu-wheels: `pip download liger-kernel --no-deps -d .whl`, pure
#              Python, lets the fused-loss CUDA test run; `pip download torchao --no-deps -d .whl`
#              for the FP8 one; without them those tests skip)
#   env        torch, CUDA and the GPU (fails, and says so, when torch sees no CUDA device)
#   gpu_tests  the tests that skip without CUDA (files with skipif(not torch.cuda.is_available()),
#              their tests named test_*gpu* / test_*cuda*), with compiled Triton kernels
#   mfu        scripts/bench/mfu.py: MFU of a 1B-class multimodal model on one GPU, and the memory
#              model's predicted peak against torch.cuda.max_memory_allocated
#   demo_bf16  `omni train` with bf16 autocast on the GPU, GPU_CHECK_DEMO_STEPS steps, fresh run dir
#   kernels    scripts/bench/kernels.py: the varlen attention kernels side by side
# Every part has its own timeout (cut to what is left of the budget) and its log; a failure is
# recorded and the next part runs; the exit status is 1 if any part did not pass. Results: $OUT
# (else runs/gpu_check/): gpu_check.json (every number) and gpu_check.md (the table for
# docs/benchmarks.md), plus each part's folder and log.
#
#   bash scripts/gpu_check.sh             # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run   # anywhere: list the commands, check this script's syntax,
#                                         # its budgets and every script and test it names, then
#                                         # run mfu.py --tiny on the CPU and the report
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"  # absolute: run again from $REPO
REPO="${GPU_CHECK_REPO:-$(cd "$(dirname "$SCRIPT")/.." && pwd)}"
OUT_DIR="${OUT:-$REPO/runs/gpu_check}"
WORK="${GPU_CHECK_WORK:-$REPO/runs/gpu_check_work}"  # scratch (site dir, demo run dir), not results
WHEELS="${GPU_CHECK_WHEELS:-$REPO/.whl}"
ENV_FILE="$WORK/setup.env"  # the setup part's choice, read by every later run of this script
PY="${GPU_CHECK_PYTHON:-$REPO/.venv/bin/python}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"
DEMO_STEPS="${GPU_CHECK_DEMO_STEPS:-400}"
INSTALL_S="${GPU_CHECK_INSTALL_S:-900}"  # setup's timeout when it downloads (`pip install`)
REPORT_RESERVE_S=10
ALL_PARTS=(setup env gpu_tests mfu demo_bf16 kernels)
read -r -a PARTS <<<"${GPU_CHECK_PARTS:-${ALL_PARTS[*]}}"  # a subset, e.g. GPU_CHECK_PARTS="env mfu"
# Seconds per part, before the budget cuts them; with the report's reserve they add up to the
# default budget (the dry run checks that). Guesses for one H200 with 16 cores, none measured yet.
declare -A TIMEOUT=([setup]="${GPU_CHECK_SETUP_S:-50}" [env]=25 [gpu_tests]=80 [mfu]=130 [demo_bf16]=80
                    [kernels]=95)
# What setup checks that the chosen interpreter imports: Omni's runtime dependencies
# (pyproject.toml), pytest, and Omni's own packages.
SETUP_MODULES=(torch transformers safetensors hydra omegaconf numpy PIL soundfile webdataset wids braceexpand
               tqdm yaml pytest omni dataloading parallel recipes)

DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  --setup) ;;  # the setup part's own command (below), run by this script under its timeout
  "") ;;
  -h|--help) usage; exit 0 ;;
  *) echo "gpu_check: error: unknown argument '$1'; use --dry-run, --help or nothing" >&2; exit 2 ;;
esac
cd "$REPO" || { echo "gpu_check: error: no repository at $REPO" >&2; exit 2; }

# setup_mode: how setup will get an interpreter (given | offline | reuse | online); probed once.
SETUP_MODE=""
setup_mode() {
  [[ -n $SETUP_MODE ]] && return
  if [[ -n ${GPU_CHECK_PYTHON:-} ]]; then SETUP_MODE=given
  elif [[ ${GPU_CHECK_OFFLINE:-0} == 1 ]]; then SETUP_MODE=offline
  elif [[ -x .venv/bin/python ]] && .venv/bin/python -c "import omni, pytest" 2>/dev/null; then SETUP_MODE=reuse
  # A lent GPU machine reaches no package registry, and its python3 (itself a virtual
  # environment) already has a CUDA torch: a venv made from it would see the base interpreter's
  # packages, without torch, so that python3 is used as it is.
  elif timeout 120 python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    SETUP_MODE=offline
  else SETUP_MODE=online; fi
}

# The setup part itself (bash gpu_check.sh --setup MODE): make or pick the interpreter, check it
# imports what the parts need and runs the CLI, then write the choice to $ENV_FILE.
do_setup() {
  local mode="$1" py pypath="" whl
  rm -f "$ENV_FILE"
  mkdir -p "$WORK" "$OUT_DIR/setup"
  export PIP_DISABLE_PIP_VERSION_CHECK=1  # pip would ask the (unreachable) index for its own version
  case "$mode" in
    given) py="$GPU_CHECK_PYTHON" ;;
    reuse) py="$REPO/.venv/bin/python"; echo "reusing .venv (it imports omni and pytest)" ;;
    online)
      python3 -m venv .venv && .venv/bin/pip install -q -e ".[dev]" || return 1
      py="$REPO/.venv/bin/python" ;;
    offline)
      # sys.executable, not a resolved path: a venv's python is a link to its base interpreter,
      # and only the link's own path finds the venv's packages.
      py="$(python3 -c 'import sys; print(sys.executable)')" || { echo "gpu_check: error: no python3" >&2; return 1; }
      local wheels=()
      [[ -d $WHEELS ]] && mapfile -t wheels < <(find "$WHEELS" -maxdepth 1 -name '*.whl' | sort)
      if [[ ${#wheels[@]} -gt 0 ]]; then
        rm -rf "$WORK/site"
        if "$py" -m pip --version >/dev/null 2>&1; then
          echo "installing ${#wheels[@]} wheels from $WHEELS into $WORK/site with pip (no index, no dependencies)"
          "$py" -m pip install -q --no-index --no-deps --target "$WORK/site" "${wheels[@]}" || {
            echo "gpu_check: error: pip could not install the wheels in $WHEELS for $py" >&2; return 1; }
        else
          # An environment made without pip (uv makes them so): a wheel is a zip of its files
          # as installed, so unpacking it is its install; of its *.data/ folder, purelib and
          # platlib go to the same place and the rest (scripts, headers) is not imported.
          echo "unpacking ${#wheels[@]} wheels from $WHEELS into $WORK/site ($py has no pip)"
          "$py" - "$WORK/site" "${wheels[@]}" <<'EOF' || return 1
import os, shutil, sys, zipfile

site, left_out = sys.argv[1], []
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data") and len(parts) > 2:
                if parts[1] not in ("purelib", "platlib"):
                    left_out.append(info.filename)
                    continue
                parts = parts[2:]
            if info.is_dir() or not parts[-1]:
                continue
            if info.filename.startswith("/") or ".." in parts:
                sys.exit(f"gpu_check: error: {wheel} names a file outside its folder: {info.filename}")
            dest = os.path.join(site, *parts)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
if left_out:
    print(f"left out (not importable): {' '.join(left_out)}")
EOF
        fi
        pypath="$WORK/site:"
      else
        echo "no wheels in $WHEELS: $py must already have every dependency"
      fi
      pypath="$pypath$REPO${PYTHONPATH:+:$PYTHONPATH}" ;;
    *) echo "gpu_check: error: no setup mode named '$mode' (given, offline, reuse, online)" >&2; return 2 ;;
  esac
  [[ -n $pypath ]] && export PYTHONPATH="$pypath"
  GPU_CHECK_SETUP_JSON="$OUT_DIR/setup/setup.json" GPU_CHECK_SETUP_MODE="$mode" \
    "$py" - "${SETUP_MODULES[@]}" <<'EOF' || return 1
import importlib, importlib.metadata, json, os, platform, sys

bad, found = [], {}
for name in sys.argv[1:]:
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # a wheel's own import error (a missing C library) says more than its name
        bad.append(f"{name} ({type(e).__name__}: {e})")
        continue
    found[name] = {"version": getattr(mod, "__version__", None), "file": getattr(mod, "__file__", None)}
for name, dist in (("hydra", "hydra-core"), ("webdataset", "webdataset"), ("wids", "wids"), ("omegaconf", "omegaconf")):
    try:  # the installed distribution's version (not every module has __version__)
        found[name]["version"] = importlib.metadata.version(dist)
    except (KeyError, importlib.metadata.PackageNotFoundError):
        pass
info = {"mode": os.environ["GPU_CHECK_SETUP_MODE"], "python": sys.executable,
        "python_version": platform.python_version(), "pythonpath": os.environ.get("PYTHONPATH", ""),
        "modules": found, "missing": bad}
with open(os.environ["GPU_CHECK_SETUP_JSON"], "w") as f:
    json.dump(info, f, indent=1)
for name, m in found.items():
    print(f"  {name} {m['version'] or ''} {m['file'] or ''}")
if bad:
    sys.exit(f"gpu_check: error: {sys.executable} cannot import " + "; ".join(bad)
             + ": copy the wheels of what is missing into .whl/ (docs/benchmarks.md, \"GPU check\")")
EOF
  "$py" -m recipes.cli plugins >/dev/null || {
    echo "gpu_check: error: '$py -m recipes.cli plugins' failed (the CLI from the checkout)" >&2; return 1; }
  {
    printf 'PY=%q\n' "$py"
    [[ -n $pypath ]] && printf 'export PYTHONPATH=%q\n' "$pypath"
    printf 'SETUP_MODE=%q\n' "$mode"
  } >"$ENV_FILE.tmp" && mv "$ENV_FILE.tmp" "$ENV_FILE"
  echo "setup ($mode): $py${pypath:+ with PYTHONPATH=$pypath}; written to $ENV_FILE"
}

if [[ ${1:-} == --setup ]]; then
  do_setup "${2:-}"
  exit $?
fi

# A setup that ran before (this run's, or an earlier command's on the same machine) chose the
# interpreter and the path; GPU_CHECK_PYTHON overrides it.
load_setup() {
  if [[ -z ${GPU_CHECK_PYTHON:-} && -f $ENV_FILE ]]; then
    # shellcheck disable=SC1090
    source "$ENV_FILE"
  fi
}
load_setup

# Test files whose tests skip without CUDA (a skipif decorator, or a mark assigned to a name, at
# the start of a line: not the same text inside a string).
SKIP_RE='^\s*(@pytest\.mark\.skipif|[A-Za-z_][A-Za-z0-9_]*\s*=\s*pytest\.mark\.skipif)\(\s*not torch\.cuda\.is_available\(\)'
mapfile -t GPU_TEST_FILES < <(grep -rlE "$SKIP_RE" tests --include='*.py' | sort)

# The node ids of a file's GPU tests: test functions named test_*gpu*/test_*cuda*, top level or
# in a top-level class. Ids, not `pytest -k`: -k also matches module names (test_gpu_check.py).
gpu_test_ids() {
  awk -v f="$1" '
    /^class[ \t]+[A-Za-z_]/ { c = $0; sub(/^class[ \t]+/, "", c); sub(/[^A-Za-z0-9_].*/, "", c); next }
    /^[^ \t#]/ { c = "" }  # any other top-level line ends the class
    /^[ \t]*(async[ \t]+)?def[ \t]+test_[A-Za-z0-9_]*(gpu|cuda)[A-Za-z0-9_]*[ \t]*\(/ {
      n = $0; sub(/^[ \t]*(async[ \t]+)?def[ \t]+/, "", n); sub(/[ \t]*\(.*/, "", n)
      if ($0 ~ /^[ \t]/) { if (c != "") print f "::" c "::" n } else print f "::" n
    }' "$1"
}
GPU_TEST_IDS=()
for f in "${GPU_TEST_FILES[@]}"; do
  mapfile -t -O "${#GPU_TEST_IDS[@]}" GPU_TEST_IDS < <(gpu_test_ids "$f")
done

# CMD: the command of part $1 (run from the repository root).
command_for() {
  case "$1" in
    setup) setup_mode; CMD=(bash "$SCRIPT" --setup "$SETUP_MODE") ;;
    env) CMD=("$PY" scripts/bench/gpu_check_report.py env "$OUT_DIR/env.json") ;;
    gpu_tests)
      if [[ ${#GPU_TEST_IDS[@]} -eq 0 ]]; then  # else pytest would collect the whole suite
        CMD=(bash -c 'echo "gpu_check: error: no test under tests/ skips without CUDA" >&2; exit 1')
      else
        CMD=(env TRITON_INTERPRET=0 "$PY" -m pytest -q -rs -p no:cacheprovider
             --junitxml "$OUT_DIR/gpu_tests/junit.xml" "${GPU_TEST_IDS[@]}")
      fi ;;
    mfu) CMD=("$PY" scripts/bench/mfu.py --device cuda --steps 10 --warmup 3 --out "$OUT_DIR/mfu") ;;
    demo_bf16) CMD=("$PY" -m recipes.cli train trainer.precision=bf16 trainer.device=cuda
                    "trainer.max_steps=$DEMO_STEPS" "trainer.run_dir=$WORK/demo_bf16" trainer.progress=false
                    checkpoint.every=0 checkpoint.save_at_end=false checkpoint.resume=never) ;;
    kernels) CMD=("$PY" scripts/bench/kernels.py --repeats 10 --out "$OUT_DIR/kernels"
                  --doc "$OUT_DIR/kernels/section.md") ;;
    # The report needs only the standard library: python3 when setup chose no interpreter.
    report) if [[ -x $PY ]]; then CMD=("$PY" scripts/bench/gpu_check_report.py report "$OUT_DIR")
            else CMD=(python3 scripts/bench/gpu_check_report.py report "$OUT_DIR"); fi ;;
    *) echo "gpu_check: error: no part named $1" >&2; return 1 ;;
  esac
}

before_part() {  # what a part needs beforehand
  case "$1" in
    demo_bf16) rm -rf "$WORK/demo_bf16" ;;  # a fresh run: nothing to resume from
  esac
}

after_part() {  # what a part leaves for the report, and what it chose for the next ones
  case "$1" in
    setup) load_setup ;;
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
      file="${w%%::*}"; name="${w##*::}"; name="${name%%[*}"
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
  local part total=0
  echo "gpu_check --dry-run: repository $REPO, results to $OUT_DIR, python $PY, budget ${BUDGET_S}s"
  bash -n "$SCRIPT" || problem "$SCRIPT: bash -n found a syntax error"
  COMPILE=()
  for part in "${PARTS[@]}" report; do
    command_for "$part" 2>/dev/null || { problem "no part named '$part' (parts: ${ALL_PARTS[*]})"; continue; }
    printf '  [%s] timeout %ss: %s\n' "$part" "${TIMEOUT[$part]:-$REPORT_RESERVE_S}" "$(printf '%q ' "${CMD[@]}")"
    total=$((total + ${TIMEOUT[$part]:-$REPORT_RESERVE_S}))
    check_command_paths "${CMD[@]}"
  done
  [[ -n $SETUP_MODE ]] && echo "  setup would use: $SETUP_MODE"
  echo "  parts' timeouts and the report's reserve: ${total}s of the ${BUDGET_S}s budget"
  if ((total > BUDGET_S)); then
    problem "the parts' timeouts and the report's reserve add up to ${total}s, over the ${BUDGET_S}s budget (GPU_CHECK_BUDGET_S): the last parts would be cut"
  fi
  if [[ ${#GPU_TEST_FILES[@]} -eq 0 ]]; then
    problem "no test under tests/ skips without CUDA (skipif(not torch.cuda.is_available())): part gpu_tests has nothing to run"
  fi
  local f ids
  for f in "${GPU_TEST_FILES[@]}"; do
    COMPILE+=("$f")
    ids="$(gpu_test_ids "$f" | sed 's/^.*:://' | tr '\n' ' ')"
    if [[ -z $ids ]]; then
      problem "$f skips tests without CUDA but none is named test_*gpu*/test_*cuda*: part gpu_tests selects them by name"
    fi
    echo "  GPU-only tests in $f: $ids"
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
    echo "gpu_check --dry-run: checks passed; mfu.py --tiny not run: no python at $PY (run the setup part or set GPU_CHECK_PYTHON)"
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
  "$PY" scripts/bench/gpu_check_report.py report "$dry" || { problem "the report failed on $dry"; return 1; }
  echo "gpu_check --dry-run: ok"
}

record() {  # part status rc seconds timeout
  printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$OUT_DIR/parts.tsv"
}

run_part() {
  local name="$1" left t log t0 rc status install=0
  command_for "$name"
  left=$((BUDGET_S - (SECONDS - START) - REPORT_RESERVE_S))
  t="${TIMEOUT[$name]}"
  # A download happens only where there is a network, so not on the lent machine and its 600 s
  # commands: it gets its own timeout, and the budget starts after it.
  if [[ $name == setup && $SETUP_MODE == online ]]; then install=1; t=$INSTALL_S; left=$t; fi
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
  if [[ $name != setup && ! -x $PY ]]; then
    echo "gpu_check: error: no python at $PY: run the setup part first (GPU_CHECK_PARTS=setup) or set GPU_CHECK_PYTHON" >"$log"
    rc=1
  else
    timeout -k 10 "$t" "${CMD[@]}" >"$log" 2>&1
    rc=$?
  fi
  case $rc in
    0) status=ok ;;
    124|137) status="timed out" ;;
    *) status=failed ;;
  esac
  after_part "$name"
  record "$name" "$status" "$rc" "$((SECONDS - t0))" "$t"
  echo "gpu_check: [$name] $status after $((SECONDS - t0))s (exit $rc; log $log)"
  [[ $status == ok ]] || { FAILED+=("$name"); tail -n 5 "$log" | sed 's/^/    /'; }
  ((install)) && START=$SECONDS
  return 0
}

if [[ $DRY_RUN -eq 1 ]]; then
  mkdir -p "$OUT_DIR"
  dry_run
  exit $?
fi

START=$SECONDS
FAILED=()
for part in "${PARTS[@]}"; do
  [[ -v "TIMEOUT[$part]" ]] || { echo "gpu_check: error: no part named '$part' (parts: ${ALL_PARTS[*]})" >&2; exit 2; }
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
