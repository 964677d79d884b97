#!/usr/bin/env bash
# The one prepared GPU check (bench/README.md): CUDA parity tests, the whole benchmark suite, the
# report. For a fresh machine with torch + triton preinstalled and no network.
#
#   bash bench/device_check.sh [OUT_DIR]        (default: $OUT, else ./device_check_out)
#
# Writes at most 7 files to OUT_DIR: env.json, parity.log, bench.json, bench.jsonl, bench.log,
# BENCHMARKS.md, charts.png; prints a short table last. Exit 1 if a parity test failed (or the
# parity run hit its time limit), 2 if a benchmark failed, else 0. Safe to run twice.
# Time limits (seconds, env): WIOLA_CHECK_SECONDS total (420), WIOLA_PARITY_SECONDS (200).
# WIOLA_PARITY_TESTS: what the parity stage runs (default "tests/ --ignore=tests/test_compile.py": the
# ahead-of-time builds need no GPU and CI runs them; GPU minutes go to parity); WIOLA_COMMIT: recorded commit;
# WIOLA_SKIP_INSTALL=1: do not pip-install (a machine where the package is installed already).
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 3
ROOT=$PWD
OUT_DIR=${1:-${OUT:-$ROOT/device_check_out}}
mkdir -p "$OUT_DIR" || exit 3
OUT_DIR=$(cd "$OUT_DIR" && pwd)
rm -f "$OUT_DIR"/{env.json,parity.log,bench.json,bench.jsonl,bench.log,BENCHMARKS.md,charts.png}

START=$(date +%s)
TOTAL=${WIOLA_CHECK_SECONDS:-420}
PARITY_SECONDS=${WIOLA_PARITY_SECONDS:-200}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
left() { echo $((START + TOTAL - $(date +%s))); }

# -- install: carried wheels (optional), then the project itself (no network, no dependencies)
{
  echo "== install ($(date -u +%FT%TZ))"
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/wiola_site .whl/*.whl \
      && export PYTHONPATH=/tmp/wiola_site${PYTHONPATH:+:$PYTHONPATH} && echo "carried wheels: $(ls .whl)"
  fi
  if [ -n "${WIOLA_SKIP_INSTALL:-}" ]; then
    echo "install skipped (WIOLA_SKIP_INSTALL)"
  elif timeout 90 "$PY" -m pip install -q --no-deps --no-build-isolation -e . ; then
    echo "installed editable"
  else
    echo "pip install -e . failed: using PYTHONPATH=$ROOT"
  fi
} >"$OUT_DIR/parity.log" 2>&1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

"$PY" -m bench.device_check env "$OUT_DIR/env.json" >>"$OUT_DIR/parity.log" 2>&1

have() { "$PY" -c "import $1" >/dev/null 2>&1; }
EXTRA=()
have pytest_timeout && EXTRA+=(--timeout=150)

# -- parity: the test suite on the GPU (kernel tests run bf16, fp16 and fp32 on CUDA)
PARITY=()
have xdist && PARITY+=(-n 8)
budget=$(( PARITY_SECONDS < $(left) - 120 ? PARITY_SECONDS : $(left) - 120 ))
echo "== parity: pytest ${WIOLA_PARITY_TESTS:-tests/ --ignore=tests/test_compile.py} -m 'not slow' (limit ${budget}s)" | tee -a "$OUT_DIR/parity.log"
# shellcheck disable=SC2086
timeout -s INT -k 20 "$budget" "$PY" -m pytest ${WIOLA_PARITY_TESTS:-tests/ --ignore=tests/test_compile.py} -m "not slow" -q -rfE -p no:cacheprovider \
  "${PARITY[@]}" "${EXTRA[@]}" >>"$OUT_DIR/parity.log" 2>&1
PARITY_RC=$?
tail -n 1 "$OUT_DIR/parity.log"

# -- benchmarks: everything in bench/ on the GPU (CPU benchmarks skipped unless WIOLA_BENCH_SKIP_CPU=0),
#    time-boxed; each result is also appended to bench.jsonl as it finishes
budget=$(( $(left) - 30 ))
export WIOLA_BENCH_JSONL=$OUT_DIR/bench.jsonl WIOLA_BENCH_SKIP_CPU=${WIOLA_BENCH_SKIP_CPU:-1}
export WIOLA_BENCH_DEADLINE=$(( $(date +%s) + budget - 45 ))
BENCH=(--benchmark-only "--benchmark-json=$OUT_DIR/bench.json")
have pytest_benchmark || BENCH=()
echo "== benchmarks: pytest bench/ (limit ${budget}s)" | tee "$OUT_DIR/bench.log"
timeout -s INT -k 20 "$budget" "$PY" -m pytest bench/ -q -rfEs -p no:cacheprovider "${BENCH[@]}" "${EXTRA[@]}" \
  >>"$OUT_DIR/bench.log" 2>&1
BENCH_RC=$?
tail -n 1 "$OUT_DIR/bench.log"

# -- report: BENCHMARKS.md and one chart from whatever results exist
RESULTS=$OUT_DIR/bench.json
[ -s "$RESULTS" ] || RESULTS=$OUT_DIR/bench.jsonl
if [ -s "$RESULTS" ]; then
  timeout 60 "$PY" -m bench.report "$RESULTS" --out "$OUT_DIR/BENCHMARKS.md" --combined-chart "$OUT_DIR/charts.png" \
    >>"$OUT_DIR/bench.log" 2>&1 || echo "report failed (see bench.log)"
fi

"$PY" -m bench.device_check summary "$OUT_DIR" "$PARITY_RC" "$BENCH_RC"
RC=$?
echo "device check: $(( $(date +%s) - START ))s, exit $RC"
exit $RC
