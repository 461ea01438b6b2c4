#!/usr/bin/env bash
# GPU check: versions, the two ceilings, the whole test suite on the GPU, then the benchmark.
#
#   PYTHONPATH=. bash benchmarks/gpu_check.sh OUTDIR
#
# Installs nothing. Every stage runs under `timeout`, and the stages together stay inside
# GPU_CHECK_BUDGET seconds (default 540, for a 10-minute device call): the benchmark gets what
# the earlier stages left, minus a margin, as its --time-budget. Writes into OUTDIR (at most 8
# files, so that a device call can bring all of them back):
#   check.log                   everything printed, stage by stage (the table is near the end)
#   junit.xml                   pytest's report (written only when pytest ends by itself)
#   outcomes.txt, failures.txt  every test's outcome and each failure's traceback, written as
#                               the tests end (benchmarks/failure_log.py): there even when the
#                               stage's timeout cut pytest off
#   ceilings.json               bf16 8192^3 matmul TFLOP/s and copy GB/s (benchmarks/ceilings.py)
#   <date>-<gpu>.json / .csv    benchmark results (schema: benchmarks/README.md)
#   plots.tar                   the benchmark's PNG plots
#   book/<date>-<gpu>.json/.csv the book-model rows (stage "book", not in the default stages)
# Stage "book" (issue 11; `GPU_CHECK_STAGES="versions book"`, a device call of its own):
# `python -m benchmarks --book-models`, llms-from-scratch's Qwen 3 / Llama 3 / GPT-2 KV /
# batched Qwen 3 original vs fused (generation tokens/s at batch 1 and 8, prompt 512, 256 new
# tokens; a bf16 training step at seq 2048), saved after each family. It needs
# llms-from-scratch (pure Python, and tiktoken for Llama 3): where it is not installed, put its
# wheel's contents on PYTHONPATH (`pip install --no-deps --target DIR <wheel>`), else the rows
# say "skipped: llms-from-scratch not installed".
# GPU time, ESTIMATED (not measured yet): ~2-3 min of first calls (compiling and autotuning our
# kernel's ~10 forward and ~4 backward keys: prefill, decode, varlen and training shapes at
# head_dim 128 and 64) + ~3 min of timed calls (a generation call is host-bound, ~1-2 s for
# GPT-2 and Llama, ~4-5 s for the 28-layer Qwen 3, 3 calls per row) = ~5-7 min, inside one
# 10-minute call (BOOK_TIMEOUT, default 540 s). BOOK_ARGS="--book-layers 8" roughly halves the
# generation part (recorded on the rows); a run cut by the timeout keeps the families saved.
# Stage "tma_ab" (`GPU_CHECK_STAGES="versions tma_ab"`, ~5-6 min): the sweep's ours, SDPA flash
# and cuDNN rows (bf16, head_dim 128, causal, seq 128 / 1024 / 4096 / 16384, fwd / bwd /
# fwd_bwd) twice, with tensor-descriptor loads (KERNELS_TMA=1) into OUTDIR/tma1/ and without
# (KERNELS_TMA=0) into OUTDIR/tma0/. Why: the first H200 run (2026-11-26) timed ours at seq 128
# (batch 128 x 16 heads, d128) at 30 TFLOP/s forward vs cuDNN's 116, and fwd_bwd at 2.44 ms vs
# fwd 0.28 + bwd 0.76; descriptors made in the kernel (one per program and tensor) are the
# suspect for short sequences. Stage "probe" (~1 min): benchmarks/hf_grad_probe.py, the
# per-parameter gradient errors of a tiny transformers Gemma 2 (soft-cap 1, window 4) against
# the float64 oracle, with and without TMA (its training-gradient test failed on the H200).
# Stage "profile" (~1 min): benchmarks/profile_call.py, torch.profiler's GPU kernel and host
# times of ours and SDPA flash in fwd / bwd / fwd_bwd at that seq-128 shape, with and without
# TMA (OUTDIR/profile_tma1.json, profile_tma0.json).
# Environment knobs: PYTHON (default python3), GPU_CHECK_BUDGET, TESTS_TIMEOUT (default 240),
# BENCH_ARGS (extra arguments for `python -m benchmarks`, e.g. "--quick"), BOOK_TIMEOUT and
# BOOK_ARGS (the same for stage "book", e.g. "--book-models qwen3"), GPU_CHECK_STAGES
# (default "versions ceilings tests bench"; e.g. "versions tests" with TESTS_TIMEOUT=500 gives
# the compiled test suite a whole device call when compiling every test shape takes longer),
# TEST_WORKERS (default 8: pytest-xdist processes for the tests stage when xdist is importable,
# 0 = one process; the suite compiles ~500 kernel variants, ~0.5-1 s each, serially per process),
# TEST_ARGS (extra pytest arguments, default none: every failure is reported; e.g. "-x" to stop
# at the first, "--timeout 300" to cut a hung test; a per-test timeout under ~90 s fails tests
# that compile many kernels while 8-16 workers compete for the CPU: seen on an H200 host).
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
BOOK_TIMEOUT=${BOOK_TIMEOUT:-540}
BOOK_ARGS=${BOOK_ARGS:-}
TEST_WORKERS=${TEST_WORKERS:-8}
TEST_ARGS=${TEST_ARGS:-}
STAGES=" ${GPU_CHECK_STAGES:-versions ceilings tests bench} "
wanted() { [[ "$STAGES" == *" $1 "* ]]; }

main() {
    local start status=0 summary=""
    start=$(date +%s)
    left() { echo $(( BUDGET - ($(date +%s) - start) )); }
    # Seconds a stage before the benchmark may take: what is left, less the benchmark's
    # reserve (200 s when it is to run, else 10), capped at CAP and at least FLOOR.
    limit_before_bench() {  # CAP FLOOR
        local reserve=10 limit
        wanted bench && reserve=200
        limit=$(( $(left) - reserve ))
        [ "$limit" -gt "$1" ] && limit=$1
        [ "$limit" -lt "$2" ] && limit=$2
        echo "$limit"
    }
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
        local tests_limit
        tests_limit=$(limit_before_bench "$TESTS_TIMEOUT" 30)
        local xdist_args=""
        if [ "$TEST_WORKERS" -gt 0 ] 2>/dev/null && "$PY" -c "import xdist" 2>/dev/null; then
            xdist_args="-n $TEST_WORKERS"
        fi
        # shellcheck disable=SC2086
        TEST_LOG_DIR="$OUTDIR" stage "tests (GPU)" "$tests_limit" "$PY" -m pytest tests -q \
            $TEST_ARGS -p no:cacheprovider -p benchmarks.failure_log -rfE $xdist_args \
            --durations=15 --junitxml "$OUTDIR/junit.xml"
    fi
    if wanted book; then
        local book_limit
        book_limit=$(limit_before_bench "$BOOK_TIMEOUT" 60)
        # --book-models last, so that BOOK_ARGS may name families (--book-models qwen3).
        # shellcheck disable=SC2086
        stage "book models" "$book_limit" "$PY" -m benchmarks --out-dir "$OUTDIR/book" \
            --no-plots --skip-parity --no-modules --no-sweep --no-features \
            --time-budget $(( book_limit - 30 )) --book-models $BOOK_ARGS
    fi
    if wanted tma_ab; then
        local tma
        for tma in 1 0; do
            KERNELS_TMA=$tma stage "tma_ab KERNELS_TMA=$tma" 180 "$PY" -m benchmarks \
                --out-dir "$OUTDIR/tma$tma" --no-plots --skip-parity --no-modules --no-features \
                --providers kernels sdpa_flash sdpa_cudnn --dtypes bfloat16 --head-dims 128 \
                --dropout 0.0 --seq-lens 128 1024 4096 16384 --time-budget 140
        done
    fi
    if wanted probe; then
        local tma
        for tma in 1 0; do
            KERNELS_TMA=$tma stage "probe KERNELS_TMA=$tma" 120 "$PY" -m benchmarks.hf_grad_probe
        done
    fi
    if wanted profile; then
        local tma
        for tma in 1 0; do
            KERNELS_TMA=$tma stage "profile KERNELS_TMA=$tma" 120 "$PY" -m \
                benchmarks.profile_call --json "$OUTDIR/profile_tma$tma.json"
        done
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
