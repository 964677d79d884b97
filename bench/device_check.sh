#!/usr/bin/env bash
# The one prepared GPU check (bench/README.md), staged by value: each stage has its own time
# budget and writes what it measured before the next one starts.
#
#   bash bench/device_check.sh [OUT_DIR]        (default: $OUT, else ./device_check_out)
#
# Stages, in order:
#   setup      editable install (WIOLA_SKIP_INSTALL=1: none), env.json, plan.txt (the CPU plan)
#   headline   pytest -m headline: train step (MFU; eager, and a CUDA graph at B 32), decode B1/B8, attention vs SDPA; compile-heavy
#              baselines off; every result appended to bench.jsonl before its baselines run;
#              the headline table is printed as soon as the stage ends
#   parity     the kernel and fast-model tests on CUDA (bench.device_check.PARITY_TESTS, no
#              torch.compile tests), 8 xdist workers sharing one TRITON_CACHE_DIR, one autotune
#              config per key (bench/parity_plugin.py; WIOLA_PARITY_ONE_CONFIG=0: all); without
#              CUDA a small selection under the Triton interpreter (PARITY_TESTS_CPU)
#   split      (WIOLA_CHECK_SPLIT=0: off) python -m bench.decode_split: a CUDA-graph
#              generate call split into the prompt's prefill, the replayed steps and idle time
#   extra      (WIOLA_CHECK_EXTRA=0: off) every benchmark with torch.compile / FlexAttention
#              baselines, then the torch.compile parity tests, in the time left
#   sanitizer  (WIOLA_CHECK_SANITIZER=0: off) compute-sanitizer memcheck on one train step and a
#              short generate; skipped with the reason where the tool is missing or cannot attach
#   report     BENCHMARKS.md + charts.png from bench.jsonl
# Without CUDA (CI's dry run) the CUDA stages skip with their reasons and the exit code is 0.
#
# Files in OUT_DIR: env.json plan.txt stages.tsv setup.log headline.log parity.log split.log split.jsonl extra.log
# sanitizer.log report.log bench.jsonl BENCHMARKS.md charts.png. Exit code (summary):
# 1 a parity test failed or parity could not finish, 2 a headline benchmark failed, 3 memcheck
# found errors, 4 another benchmark failed, else 0. Safe to run twice.
# Env: WIOLA_CHECK_SECONDS total (420); budgets per stage: bench/plan.py BUDGETS;
# PYTHON (python3); WIOLA_COMMIT (recorded commit); WIOLA_SKIP_INSTALL=1;
# TRITON_CACHE_DIR (default /tmp/wiola_triton_cache, shared by every stage).
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 3
ROOT=$PWD
OUT_DIR=${1:-${OUT:-$ROOT/device_check_out}}
mkdir -p "$OUT_DIR" || exit 3
OUT_DIR=$(cd "$OUT_DIR" && pwd)
rm -f "$OUT_DIR"/{env.json,plan.txt,stages.tsv,setup.log,headline.log,parity.log,split.log,split.jsonl,extra.log,sanitizer.log,report.log,bench.jsonl,BENCHMARKS.md,charts.png}

START=$(date +%s)
TOTAL=${WIOLA_CHECK_SECONDS:-420}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/wiola_triton_cache} TRITON_PRINT_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
now() { date +%s; }
left() { echo $((START + TOTAL - $(now))); }
min() { echo $(($1 < $2 ? $1 : $2)); }
# skipped NAME SWITCH MIN_SECONDS [MISSING]: when an optional CUDA stage does not run (no CUDA, $SWITCH=0,
# MISSING says what it lacks, or $budget under MIN_SECONDS), record why and succeed; else fail
skipped() {
  local why="" budget_noted=0
  if [ "$HAVE_CUDA" != 1 ]; then why="no CUDA device"
  elif [ "${!2:-1}" = 0 ]; then why="switched off ($2=0)"
  elif [ -n "${4:-}" ]; then why=$4
  elif [ "$budget" -lt "$3" ]; then why="no time left"; budget_noted=$budget
  fi
  [ -n "$why" ] && stage_done "$1" - "$t0" "$budget_noted" "$why"
}
# stage_done NAME RC(or -) STARTED BUDGET NOTE: one line of stages.tsv, one line on the terminal
stage_done() {
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$(($(now) - $3))" "$4" "${5:-}" >>"$OUT_DIR/stages.tsv"
  echo "== $1: exit $2 after $(($(now) - $3))s of ${4}s ${5:+($5)}"
}

# -- setup: carried wheels (optional), the project itself (no network, no dependencies), env.json
t0=$(now)
{
  echo "== setup ($(date -u +%FT%TZ))"
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/wiola_site .whl/*.whl \
      && export PYTHONPATH=/tmp/wiola_site${PYTHONPATH:+:$PYTHONPATH} && echo "carried wheels: $(ls .whl)"
  fi
  # Never repoint an install made elsewhere (a shared environment): PYTHONPATH=$ROOT wins anyway.
  where=$(cd / && env -u PYTHONPATH "$PY" -c "import os, wiola; print(os.path.dirname(os.path.dirname(os.path.abspath(wiola.__file__))))" 2>/dev/null)
  if [ -n "${WIOLA_SKIP_INSTALL:-}" ]; then
    echo "install skipped (WIOLA_SKIP_INSTALL): using PYTHONPATH=$ROOT"
  elif [ -n "$where" ] && [ "$where" != "$ROOT" ]; then
    echo "install skipped: wiola is installed from $where (not this checkout); using PYTHONPATH=$ROOT"
  elif timeout 90 "$PY" -m pip install -q --no-deps --no-build-isolation -e . ; then
    echo "installed editable: $("$PY" -m pip show wiola-slm 2>/dev/null | grep -i '^editable project location' || true)"
  else
    echo "pip install -e . failed: using PYTHONPATH=$ROOT"
  fi
} >"$OUT_DIR/setup.log" 2>&1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
"$PY" -m bench.device_check env "$OUT_DIR/env.json" >>"$OUT_DIR/setup.log" 2>&1
SETUP_RC=$?
eval "$("$PY" -m bench.device_check budgets)"  # setup= headline= parity= split= sanitizer= report= parity_workers=
HAVE_CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>>"$OUT_DIR/setup.log" || echo 0)
timeout 60 "$PY" -m bench.device_check plan --budget "$TOTAL" >"$OUT_DIR/plan.txt" 2>&1 \
  || echo "plan: exit $? (see plan.txt)" >>"$OUT_DIR/setup.log"
have() { "$PY" -c "import $1" >/dev/null 2>&1; }
TIMEOUT_OK=0; have pytest_timeout && TIMEOUT_OK=1
per_test() { [ "$TIMEOUT_OK" = 1 ] && echo "--timeout=$1"; }
BENCH_FLAGS=(); have pytest_benchmark && BENCH_FLAGS=(--benchmark-only)
XDIST=(); have xdist && XDIST=(-n "$parity_workers")
SETUP_NOTE=$([ "$HAVE_CUDA" = 1 ] && echo "CUDA device found" || echo "no CUDA device: CUDA stages skip")
stage_done setup "$SETUP_RC" "$t0" "$setup" "$SETUP_NOTE"

# Shared by the benchmark stages: results appended to bench.jsonl as they are measured, CPU
# benchmarks skipped (GPU minutes are for GPU work).
export WIOLA_BENCH_JSONL=$OUT_DIR/bench.jsonl WIOLA_BENCH_SKIP_CPU=${WIOLA_BENCH_SKIP_CPU:-1}

# -- headline: our numbers first, compile-heavy baselines off; later required stages keep their time
t0=$(now)
budget=$(min "$headline" $(( $(left) - parity - report )))
read -r -a FILES <<<"$("$PY" -m bench.device_check tests headline)"
echo "== headline: pytest ${FILES[*]} -m headline (limit ${budget}s)" | tee "$OUT_DIR/headline.log"
WIOLA_BENCH_STAGE=headline WIOLA_BENCH_COMPILED=0 TRITON_CACHE_AUTOTUNING=${WIOLA_AUTOTUNE_CACHE:-1} \
  WIOLA_BENCH_DEADLINE=$(( $(now) + budget - 25 )) \
  timeout -s INT -k 20 "$budget" "$PY" -m pytest "${FILES[@]}" -m headline -q -rfEs -p no:cacheprovider \
  "${BENCH_FLAGS[@]}" $(per_test 120) >>"$OUT_DIR/headline.log" 2>&1
HEADLINE_RC=$?
stage_done headline "$HEADLINE_RC" "$t0" "$budget" "$([ "$HAVE_CUDA" = 1 ] || echo "no CUDA device: every benchmark skipped")"
"$PY" -m bench.device_check headline "$OUT_DIR" | tee -a "$OUT_DIR/headline.log"

# -- parity: the kernel and fast-model tests on the GPU (a small interpreter selection without one)
t0=$(now)
budget=$(min "$parity" $(( $(left) - report )))
if [ "$HAVE_CUDA" = 1 ]; then
  read -r -a FILES <<<"$("$PY" -m bench.device_check tests parity)"
  SEL=(-k "not torch_compile" "${XDIST[@]}" -p bench.parity_plugin)
  export WIOLA_PARITY_ONE_CONFIG=${WIOLA_PARITY_ONE_CONFIG:-1}  # one autotune config per key (0: all)
  NOTE="CUDA: ${#FILES[@]} test files, one autotune config per key: $WIOLA_PARITY_ONE_CONFIG"
else
  read -r -a FILES <<<"$("$PY" -m bench.device_check tests parity-cpu)"
  SEL=()
  NOTE="no CUDA device: ${FILES[*]} under the Triton interpreter only"
fi
echo "== parity: pytest ${FILES[*]} ${SEL[*]} -m 'not slow' (limit ${budget}s)" | tee "$OUT_DIR/parity.log"
timeout -s INT -k 20 "$budget" "$PY" -m pytest "${FILES[@]}" "${SEL[@]}" -m "not slow" -q -rfE -p no:cacheprovider \
  $(per_test 60) >>"$OUT_DIR/parity.log" 2>&1
PARITY_RC=$?
stage_done parity "$PARITY_RC" "$t0" "$budget" "$NOTE"

# -- sanitizer first decides its reserve: compute-sanitizer present?
SANITIZER=""
if [ "$HAVE_CUDA" = 1 ] && [ "${WIOLA_CHECK_SANITIZER:-1}" != 0 ]; then
  SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1 || true)
fi
reserve=$report; [ -n "$SANITIZER" ] && reserve=$((report + sanitizer))

# -- split: where a CUDA-graph generate call's time goes (bench/decode_split.py: the prompt's
#    prefill and the host's time to issue it, the replayed steps, the kernels' own time)
t0=$(now)
budget=$(min "$split" $(( $(left) - reserve )))
if ! skipped split WIOLA_CHECK_SPLIT 30; then
  echo "== split: python -m bench.decode_split (limit ${budget}s)" | tee "$OUT_DIR/split.log"
  timeout -s INT -k 10 "$budget" "$PY" -m bench.decode_split --out "$OUT_DIR/split.jsonl" >>"$OUT_DIR/split.log" 2>&1
  stage_done split $? "$t0" "$budget"
fi

# -- extra: compile-heavy baselines and the rest of bench/, then the torch.compile parity tests
t0=$(now)
budget=$(( $(left) - reserve ))
if ! skipped extra WIOLA_CHECK_EXTRA 30; then
  read -r -a FILES <<<"$("$PY" -m bench.device_check tests bench)"
  echo "== extra: pytest ${FILES[*]} with compile-heavy baselines (limit ${budget}s)" | tee "$OUT_DIR/extra.log"
  WIOLA_BENCH_STAGE=extra WIOLA_BENCH_COMPILED=1 TRITON_CACHE_AUTOTUNING=${WIOLA_AUTOTUNE_CACHE:-1} \
    WIOLA_BENCH_DEADLINE=$(( $(now) + budget - 30 )) \
    timeout -s INT -k 20 "$budget" "$PY" -m pytest "${FILES[@]}" -q -rfEs -p no:cacheprovider \
    "${BENCH_FLAGS[@]}" $(per_test 150) >>"$OUT_DIR/extra.log" 2>&1
  EXTRA_RC=$?
  stage_done extra "$EXTRA_RC" "$t0" "$budget"
  t0=$(now)
  budget=$(( $(left) - reserve ))
  if [ "$budget" -ge 45 ]; then
    read -r -a FILES <<<"$("$PY" -m bench.device_check tests parity)"
    echo "== parity-compile: pytest ${FILES[*]} -k torch_compile (limit ${budget}s)" | tee -a "$OUT_DIR/extra.log"
    timeout -s INT -k 20 "$budget" "$PY" -m pytest "${FILES[@]}" -k torch_compile -q -rfE -p no:cacheprovider \
      $(per_test 120) >>"$OUT_DIR/extra.log" 2>&1
    stage_done parity-compile $? "$t0" "$budget"
  else
    stage_done parity-compile - "$t0" "$budget" "no time left"
  fi
fi

# -- sanitizer: memcheck over one train step and a short generate (PyTorch's caching allocator
#    off, so each tensor is its own allocation and an overrun is seen)
t0=$(now)
budget=$(min "$sanitizer" $(( $(left) - report )))
missing=""; [ -z "$SANITIZER" ] && missing="compute-sanitizer not found (PATH, /usr/local/cuda*/bin)"
if ! skipped sanitizer WIOLA_CHECK_SANITIZER 20 "$missing"; then
  echo "== sanitizer: $SANITIZER --tool memcheck (limit ${budget}s)" | tee "$OUT_DIR/sanitizer.log"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 TRITON_CACHE_AUTOTUNING=${WIOLA_AUTOTUNE_CACHE:-1} timeout -s INT -k 10 "$budget" \
    "$SANITIZER" --tool memcheck --error-exitcode 86 "$PY" -m bench.device_check sanitize-target \
    >>"$OUT_DIR/sanitizer.log" 2>&1
  rc=$?
  line=$(grep -a "ERROR SUMMARY" "$OUT_DIR/sanitizer.log" | tail -n 1)
  if [ "$rc" = 0 ] || [ "$rc" = 86 ] || [ "$rc" = 124 ]; then
    stage_done sanitizer "$rc" "$t0" "$budget" "${line:-no ERROR SUMMARY line}"
  else  # the tool could not attach or the target did not start under it: skipped, with its last words
    stage_done sanitizer - "$t0" "$budget" "could not run under compute-sanitizer (exit $rc): $(grep -av '^\s*$' "$OUT_DIR/sanitizer.log" | tail -n 1 | cut -c1-200)"
  fi
fi

# -- report: BENCHMARKS.md and one chart from whatever results exist
t0=$(now)
if [ -s "$OUT_DIR/bench.jsonl" ]; then
  timeout "$report" "$PY" -m bench.report "$OUT_DIR/bench.jsonl" --out "$OUT_DIR/BENCHMARKS.md" \
    --combined-chart "$OUT_DIR/charts.png" >"$OUT_DIR/report.log" 2>&1
  stage_done report $? "$t0" "$report"
else
  stage_done report - "$t0" "$report" "no benchmark results"
fi

"$PY" -m bench.device_check summary "$OUT_DIR"
RC=$?
echo "device check: $(( $(now) - START ))s, exit $RC"
exit $RC
