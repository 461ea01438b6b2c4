#!/usr/bin/env bash
# GPU check: versions, the two ceilings, the whole test suite on the GPU, then the benchmark.
#
#   PYTHONPATH=. bash benchmarks/gpu_check.sh OUTDIR
#
# Installs nothing. Every stage runs under `timeout`, and the stages together stay inside
# GPU_CHECK_BUDGET seconds (default 540, for a 10-minute device call): the benchmark gets what
# the earlier stages left, minus a margin, as its --time-budget. Writes into OUTDIR (at most 6
# files, so that a device call can bring all of them back):
#   check.log                   everything printed, stage by stage (the table is near the end)
#   junit.xml                   pytest's report
#   ceilings.json               bf16 8192^3 matmul TFLOP/s and copy GB/s (benchmarks/ceilings.py)
#   <date>-<gpu>.json / .csv    benchmark results (schema: benchmarks/README.md)
#   plots.tar                   the benchmark's PNG plots
# Environment knobs: PYTHON (default python3), GPU_CHECK_BUDGET, TESTS_TIMEOUT (default 240),
# BENCH_ARGS (extra arguments for `python -m benchmarks`, e.g. "--quick"), GPU_CHECK_STAGES
# (default "versions ceilings tests bench"; e.g. "versions tests" with TESTS_TIMEOUT=500 gives
# the compiled test suite a whole device call when compiling every test shape takes longer),
# TEST_WORKERS (default 8: pytest-xdist processes for the tests stage when xdist is importable,
# 0 = one process; the suite compiles ~500 kernel variants, ~0.5-1 s each, serially per process).
# Exit status: 0 when every stage passed, else the first failing stage's status.
set -uo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-540}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-240}
BENCH_ARGS=${BENCH_ARGS:-}
TEST_WORKERS=${TEST_WORKERS:-8}
STAGES=" ${GPU_CHECK_STAGES:-versions ceilings tests bench} "
wanted() { [[ "$STAGES" == *" $1 "* ]]; }

main() {
    local start status=0 summary=""
    start=$(date +%s)
    left() { echo $(( BUDGET - ($(date +%s) - start) )); }
    stage() {  # stage NAME LIMIT_S CMD...: run under timeout, record rc and seconds
        local name=$1 limit=$2 t0 rc
        shift 2
        echo
        echo "=== $name (limit ${limit}s, $(left)s of ${BUDGET}s left) ==="
        t0=$(date +%s)
        timeout -k 10 "$limit" "$@"
        rc=$?
        [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "=== $name: TIMED OUT after ${limit}s"
        echo "=== $name: exit $rc after $(( $(date +%s) - t0 ))s"
        summary="$summary$name: exit $rc, $(( $(date +%s) - t0 ))s"$'\n'
        [ $status -eq 0 ] && [ $rc -ne 0 ] && status=$rc
        return 0
    }

    wanted versions && stage "device and versions" 60 bash -c '
        nvidia-smi || echo "nvidia-smi failed"
        '"$PY"' -c "import sys, torch, triton; print(\"python\", sys.version.split()[0]); \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cudnn\", \
torch.backends.cudnn.version()); print(\"triton\", triton.__version__); \
print(\"device\", torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
        '"$PY"' -m pip list 2>/dev/null | grep -i -E "^(torch|triton|matplotlib|pytest|numpy)" || true
        git rev-parse --short HEAD 2>/dev/null || echo "(no git checkout)"'

    wanted ceilings && stage "ceilings" 90 "$PY" -m benchmarks.ceilings --out "$OUTDIR/ceilings.json"

    if wanted tests; then
        local reserve=10
        wanted bench && reserve=200
        local tests_limit=$(( $(left) - reserve ))
        [ $tests_limit -gt "$TESTS_TIMEOUT" ] && tests_limit=$TESTS_TIMEOUT
        [ $tests_limit -lt 30 ] && tests_limit=30
        local xdist_args=""
        if [ "$TEST_WORKERS" -gt 0 ] 2>/dev/null && "$PY" -c "import xdist" 2>/dev/null; then
            xdist_args="-n $TEST_WORKERS"
        fi
        # shellcheck disable=SC2086
        stage "tests (GPU)" "$tests_limit" "$PY" -m pytest tests -q -x -p no:cacheprovider \
            $xdist_args --durations=15 --junitxml "$OUTDIR/junit.xml"
    fi
    if ! wanted bench; then
        echo; echo "=== summary ($(( $(date +%s) - start ))s in all) ==="; printf "%s" "$summary"
        return $status
    fi

    local bench_limit=$(( $(left) - 10 ))
    local bench_budget=$(( bench_limit - 60 ))
    if [ $bench_budget -lt 60 ]; then
        echo "only ${bench_limit}s left for the benchmark: running --quick"
        BENCH_ARGS="--quick $BENCH_ARGS"
        bench_budget=$(( bench_limit * 2 / 3 ))
    fi
    # shellcheck disable=SC2086
    stage "benchmark" "$bench_limit" "$PY" -m benchmarks --out-dir "$OUTDIR" \
        --time-budget "$bench_budget" $BENCH_ARGS

    if ls "$OUTDIR"/*.png >/dev/null 2>&1; then
        (cd "$OUTDIR" && tar cf plots.tar ./*.png && rm -f ./*.png)
    fi
    echo
    echo "=== summary ($(( $(date +%s) - start ))s in all) ==="
    printf "%s" "$summary"
    ls -la "$OUTDIR"
    return $status
}

main 2>&1 | tee "$OUTDIR/check.log"
exit "${PIPESTATUS[0]}"
