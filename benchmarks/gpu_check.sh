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
#                               the tests end (tools/failure_log.py): there even when the
#                               stage's timeout cut pytest off
#   ceilings.json               bf16 8192^3 matmul TFLOP/s and copy GB/s (benchmarks/ceilings.py)
#   <date>-<gpu>.json / .csv    benchmark results (columns: docs/performance.md)
#   plots.tar                   the benchmark's PNG plots
#   book/<date>-<gpu>.json/.csv the book-model rows (stage "book", not in the default stages)
# Stage "book" (`GPU_CHECK_STAGES="versions book"`, a device call of its own):
# `python -m benchmarks --book-models`, llms-from-scratch's Qwen 3 / Llama 3 / GPT-2 KV /
# batched Qwen 3 original vs fused (generation tokens/s at batch 1 and 8, prompt 512, 256 new
# tokens; a bf16 training step at seq 2048), saved after each family. It needs
# llms-from-scratch (pure Python, and tiktoken for Llama 3): where it is not installed, put its
# wheel's contents on PYTHONPATH (`pip install --no-deps --target DIR <wheel>`), else the rows
# say "skipped: llms-from-scratch not installed". ~5-7 min (estimated, not measured yet):
# BOOK_TIMEOUT (default 540 s); BOOK_ARGS="--book-layers 8" roughly halves the generation part.
# Stage "mla_decode" (`GPU_CHECK_STAGES="versions mla_decode"`, a device call of its own, in no
# list): `python -m benchmarks --features mla_decode` into WORK/mla_decode/, DeepSeek V3's
# absorbed MLA decode over a paged 576-wide latent cache (page 64, bf16 q, heads 16 / 128,
# batch 8 / 64, 4k / 32k keys, one 2-token MTP point): V read inside the latent's rows
# (kernels), V as its own copy (kernels_v_copy) and an e4m3 latent (kernels_fp8), GB/s of the
# cache read and TFLOP/s, then its table (`python -m benchmarks.features DIR`, which the
# command's own tables leave out). ~3-5 min (estimated, not measured yet: 9 points x 3 rows,
# ~15 autotune keys compiled at head_dim 576 on first use, nothing precompiled): MLA_TIMEOUT
# (default 420 s); the time budget marks the points it does not reach "skipped: time budget".
# Stage "tma_ab" (`GPU_CHECK_STAGES="versions precompile tma_ab"` alone, ~2-3 min; last in the
# "speed" list): ours and SDPA flash (the drift check), bf16, head_dim 128 and 64, causal, seq
# 128 / 512 / 1024 / 4096, fwd / bwd / fwd_bwd, with tensor-descriptor loads (KERNELS_TMA=1:
# host descriptors for dense calls, forward and backward) into WORK/tma1/, with the
# descriptors made in the kernel per program (KERNELS_TMA=kernel) into WORK/tmakernel/ and
# without TMA (KERNELS_TMA=0) into WORK/tma0/: at short lengths the per-program fixed cost
# weighs most, at 4096 the backward's per-tile cost of the host descriptors' coordinates
# (docs/gpu.md; the 4096 rows come last and are not precompiled: they run as time allows).
# Stage list "variants" (`GPU_CHECK_STAGES=variants`, one device call of ~8 min): versions,
# precompile (ours only, dropout 0, with the persistent forward and the warp-specialised
# configs: PRECOMPILE_ARGS), then stage "persistent_ab": ours and SDPA flash (the drift
# check), causal bf16 forward, d128 and d64, seq 512 ... 16384, with the persistent forward
# (KERNELS_FWD_PERSISTENT=1) into WORK/persistent1/ and with the grid launch (=0) into
# WORK/persistent0/, and stage "warpspec_ab": the same with the warp-specialised configs
# offered to the autotuner (KERNELS_FWD_WARP_SPEC=1) into WORK/warpspec1/ (persistent0/ is its
# baseline), then the test files of both variants on the GPU (tests/core/test_persistent.py,
# test_warp_spec.py with KERNELS_FWD_WARP_SPEC=1). A variant becomes the default only where it
# wins here (kernels/core/configs.py: ``persistent_enabled``, ``warp_spec_enabled``).
# Environment knobs: PYTHON (default python3), GPU_CHECK_BUDGET, TESTS_TIMEOUT (default 240),
# BENCH_ARGS (extra arguments for `python -m benchmarks`, e.g. "--quick"), BOOK_TIMEOUT and
# BOOK_ARGS (the same for stage "book", e.g. "--book-models qwen3"), MLA_TIMEOUT (stage
# "mla_decode"), GPU_CHECK_STAGES
# (default "versions ceilings tests bench"; e.g. "versions tests" with TESTS_TIMEOUT=500 gives
# the compiled test suite a whole device call when compiling every test shape takes longer),
# TEST_WORKERS (default 8: pytest-xdist processes for the tests stage when xdist is importable,
# 0 = one process; the suite compiles ~500 kernel variants, ~0.5-1 s each, serially per process),
# TEST_ARGS (extra pytest arguments, default none: every failure is reported; e.g. "-x" to stop
# at the first, "--timeout 300" to cut a hung test; a per-test timeout under ~90 s fails tests
# that compile many kernels while 8-16 workers compete for the CPU: seen on an H200 host),
# TUTORIAL (the Triton tutorial's 06-fused-attention.py, not in this repository: the sweep's
# and precompile's triton_tutorial rows; unset, those rows say "not given").
#
# Stage "fuzz" (`GPU_CHECK_STAGES="versions fuzz"`, ~3 min): tools/fuzz_parity.py on the GPU,
# random calls (dense, packed, KV cache, paged, FlashAttention's API; windows, chunks, mods,
# sinks, dropout, GQA, odd head dims) eager and under torch.compile against the float64
# oracle, with one fitting config per launch (KERNELS_AUTOTUNE=0); the cases go to check.log.
# Stage list "speed" (`GPU_CHECK_STAGES=speed`, one 9-minute device call): in this order, each
# stage saving as it ends,
#   precompile  tools/precompile.py: every kept config of every launch below compiled on
#               all cores but two into TRITON_CACHE_DIR (and Flex's graphs into inductor's
#               cache) before anything is timed; precompile.json
#   sweep       fwd / bwd / fwd_bwd, seq 128 ... 16384, head_dim 128 and 64, causal bf16,
#               16k tokens: ours, cuDNN, SDPA flash (FA2), Flex, the Triton tutorial; sweep/
#   dropout     the same with dropout 0.1: ours and the SDPA backends; dropout/
#   modules     the module and GPT-124M step rows, dropout 0 and 0.1; modules/
#   host        benchmarks/host.py: the host's time per call through the public API (ours vs
#               SDPA and the book's module, a tiny shape), ~40 s; host/
#   fp8         FP8 (e4m3) vs our bf16: causal prefill 4k d128, decode at 32k keys; fp8/
#   tma_ab      last, when >= 60 s are left: ours and flash at seq 128 / 512 / 1k / 4k, d128
#               and d64, with host (tma1/), per-program (tmakernel/) and no (tma0/) descriptors
# Each stage's limit is what is left less a reserve for the stages after it (STAGE_RESERVE).
# Stage list "suite": versions, then the compiled test suite (its limit: GPU_CHECK_BUDGET - 15 s,
# or TESTS_TIMEOUT_SUITE).
# GPU_CHECK_WORK=DIR: the stages of these lists write under DIR (default OUTDIR) and, with
# GPU_CHECK_PACK=1, DIR is packed into OUTDIR/results.tar after every stage (a device call
# brings back at most 8 files); TRITON_CACHE_DIR defaults to GPU_CHECK_CACHE (/tmp/gpu_check_cache)
# so that precompile and the timed stages share it.
# DRY_RUN=1: the whole script on a CPU machine, every python command replaced by
# `python -m tools.device_plan MODULE ARGS...` (the same arguments through the module's own
# parser, and what it would run), so that a typo fails there and not on the device
# (tests/test_device_script.py runs it).
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
MLA_TIMEOUT=${MLA_TIMEOUT:-420}
TEST_WORKERS=${TEST_WORKERS:-8}
TEST_ARGS=${TEST_ARGS:-}
DRY_RUN=${DRY_RUN:-0}
STAGES=" ${GPU_CHECK_STAGES:-versions ceilings tests bench} "
STAGES=${STAGES/ speed / versions precompile sweep dropout modules host fp8 tma_ab }
if [[ "$STAGES" == *" variants "* ]]; then
    STAGES=${STAGES/ variants / versions precompile persistent_ab warpspec_ab }
    PRECOMPILE_ARGS=${PRECOMPILE_ARGS:-"--kinds ours --dropout 0.0 --tma-off-max-seq 0 --seq-lens 512 1024 2048 4096 8192 16384 --persistent --warp-spec"}
fi
if [[ "$STAGES" == *" suite "* ]]; then
    STAGES=${STAGES/ suite / versions tests }
    TESTS_TIMEOUT=${TESTS_TIMEOUT_SUITE:-$(( BUDGET - 15 ))}
fi
wanted() { [[ "$STAGES" == *" $1 "* ]]; }
WORK=${GPU_CHECK_WORK:-$OUTDIR}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
PACK=${GPU_CHECK_PACK:-0}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${GPU_CHECK_CACHE:-/tmp/gpu_check_cache}/triton}
mkdir -p "$TRITON_CACHE_DIR"
# The python commands: `$PY -m MODULE ARGS`, or in a dry run their validation.
if [ "$DRY_RUN" = 1 ]; then
    PYM=("$PY" -m tools.device_plan)
else
    PYM=("$PY" -m)
fi
PRECOMPILE_JOBS=${PRECOMPILE_JOBS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
SEQS=(128 512 1024 2048 4096 8192 16384)
SPEED_COMMON=(--no-plots --skip-parity --no-features --dtypes bf16 --head-dims 128 64
              --seq-lens "${SEQS[@]}" --modes fwd bwd fwd_bwd)
TUTORIAL_ARGS=()
[ -n "${TUTORIAL:-}" ] && TUTORIAL_ARGS=(--tutorial "$TUTORIAL")

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

    # Seconds a stage of the speed list may take: what is left less the reserves of the stages
    # after it (each reserve: what that stage needs at least to say something), capped at CAP.
    limit_reserving() {  # CAP RESERVE_S
        local limit=$(( $(left) - $2 ))
        [ "$limit" -gt "$1" ] && limit=$1
        [ "$limit" -lt 20 ] && limit=20
        echo "$limit"
    }
    pack() {  # OUTDIR/results.tar from WORK, replaced whole after every stage
        [ "$PACK" = 1 ] || return 0
        tar cf "$OUTDIR/results.tar.tmp" -C "$WORK" . 2>/dev/null \
            && mv "$OUTDIR/results.tar.tmp" "$OUTDIR/results.tar"
    }

    wanted versions && stage "device and versions" 60 bash -c '
        nvidia-smi || echo "nvidia-smi failed"
        '"$PY"' -c "import sys, torch, triton; print(\"python\", sys.version.split()[0]); \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cudnn\", \
torch.backends.cudnn.version()); print(\"triton\", triton.__version__); \
print(\"device\", torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
        '"$PY"' -m pip list 2>/dev/null | grep -i -E "^(torch|triton|matplotlib|pytest|numpy)" || true
        git rev-parse --short HEAD 2>/dev/null || echo "(no git checkout)"
        echo "cores $(nproc); ncu $(command -v ncu || echo missing); TRITON_CACHE_DIR $TRITON_CACHE_DIR"'

    wanted ceilings && stage "ceilings" 90 "${PYM[@]}" benchmarks.ceilings --out "$OUTDIR/ceilings.json"

    if wanted tests; then
        local tests_limit
        tests_limit=$(limit_before_bench "$TESTS_TIMEOUT" 30)
        local xdist_args=""
        if [ "$TEST_WORKERS" -gt 0 ] 2>/dev/null && "$PY" -c "import xdist" 2>/dev/null; then
            xdist_args="-n $TEST_WORKERS"
        fi
        # shellcheck disable=SC2086
        TEST_LOG_DIR="$WORK" stage "tests (GPU)" "$tests_limit" "${PYM[@]}" pytest tests -q \
            $TEST_ARGS -p no:cacheprovider -p tools.failure_log -rfE $xdist_args \
            --durations=15 --junitxml "$WORK/junit.xml"
        pack
    fi
    if wanted fuzz; then
        # Random calls across routes and features against the float64 oracle, the kernels
        # compiled for this GPU, eager and under torch.compile (tools/fuzz_parity.py); one
        # line per case in check.log, failures replayable by seed and index.
        local fuzz_limit
        fuzz_limit=$(limit_reserving 180 10)
        stage "fuzz (random calls vs the float64 oracle)" "$fuzz_limit" "${PYM[@]}" \
            tools.fuzz_parity --device cuda --backends kernel,compiled --cases 100000 \
            --budget $(( fuzz_limit - 30 ))
        pack
    fi
    if wanted book; then
        local book_limit
        book_limit=$(limit_before_bench "$BOOK_TIMEOUT" 60)
        # --book-models last, so that BOOK_ARGS may name families (--book-models qwen3).
        # shellcheck disable=SC2086
        stage "book models" "$book_limit" "${PYM[@]}" benchmarks --out-dir "$OUTDIR/book" \
            --no-plots --skip-parity --no-modules --no-sweep --no-features \
            --time-budget $(( book_limit - 30 )) --book-models $BOOK_ARGS
    fi
    if wanted precompile; then
        local pc_limit
        pc_limit=$(limit_reserving 150 300)
        # shellcheck disable=SC2086
        stage "precompile (${PRECOMPILE_JOBS} processes)" "$pc_limit" \
            "${PYM[@]}" tools.precompile --jobs "$PRECOMPILE_JOBS" "${TUTORIAL_ARGS[@]}" \
            --time-limit $(( pc_limit - 10 )) --json "$WORK/precompile.json" ${PRECOMPILE_ARGS:-}
        pack
    fi
    if wanted sweep; then
        # Reserve: dropout 60 s, modules 45 s, host 20 s.
        local sweep_limit
        sweep_limit=$(limit_reserving 270 125)
        stage "sweep (bf16, d128 + d64, dropout 0)" "$sweep_limit" "${PYM[@]}" benchmarks \
            --out-dir "$WORK/sweep" "${SPEED_COMMON[@]}" --no-modules --dropout 0.0 \
            --providers kernels sdpa_cudnn sdpa_flash flex triton_tutorial "${TUTORIAL_ARGS[@]}" \
            --time-budget $(( sweep_limit - 30 ))
        pack
    fi
    if wanted dropout; then
        # The backends that take dropout (Flex and the tutorial do not); sdpa_math stores
        # seq^2 scores: up to 4k here.
        local dropout_limit
        dropout_limit=$(limit_reserving 150 105)
        stage "sweep with dropout 0.1" "$dropout_limit" "${PYM[@]}" benchmarks \
            --out-dir "$WORK/dropout" "${SPEED_COMMON[@]}" --no-modules --dropout 0.1 \
            --providers kernels sdpa_cudnn sdpa_flash sdpa_efficient sdpa_math \
            --quadratic-max-seq 4096 --time-budget $(( dropout_limit - 25 ))
        pack
    fi
    if wanted modules; then
        # FusedMultiHeadAttention vs the book's module (8 x 1024, 12 x 64) and the
        # GPT-124M training step; their attention launches are the sweep's d64 seq-1024 ones.
        local modules_limit
        modules_limit=$(limit_reserving 90 60)
        stage "module and GPT-124M rows" "$modules_limit" "${PYM[@]}" benchmarks \
            --out-dir "$WORK/modules" --no-plots --skip-parity --no-sweep --no-features \
            --dtypes bf16 --dropout 0.0 0.1 --time-budget $(( modules_limit - 20 ))
        pack
    fi
    if wanted host; then
        # The host's time per call through the public API: ours vs SDPA and the
        # book's module at a tiny shape, where the GPU waits on the host (benchmarks/host.py).
        stage "host cost per call" "$(limit_reserving 60 20)" "${PYM[@]}" benchmarks.host \
            --device cuda --budget 20 --out-dir "$WORK/host"
        pack
    fi
    if wanted fp8; then
        # FP8 forward and an FP8 KV cache against our bf16 (benchmarks/features.py, "fp8").
        local fp8_limit
        fp8_limit=$(limit_reserving 90 10)
        stage "fp8 vs bf16" "$fp8_limit" "${PYM[@]}" benchmarks --out-dir "$WORK/fp8" \
            --no-plots --skip-parity --no-sweep --no-modules --features fp8 \
            --time-budget $(( fp8_limit - 15 ))
        pack
    fi
    if wanted mla_decode; then
        # MLA's absorbed decode (benchmarks/features.py, "mla_decode"; the header above), then
        # its table from the results file.
        local mla_limit
        mla_limit=$(limit_before_bench "$MLA_TIMEOUT" 60)
        stage "MLA decode (latent cache)" "$mla_limit" "${PYM[@]}" benchmarks \
            --out-dir "$WORK/mla_decode" --no-plots --skip-parity --no-sweep --no-modules \
            --features mla_decode --time-budget $(( mla_limit - 30 ))
        timeout 60 "${PYM[@]}" benchmarks.features "$WORK/mla_decode" || true
        pack
    fi
    if wanted tma_ab; then
        # Ours with and without tensor descriptors at the short lengths where the per-program
        # fixed cost weighs most (docs/performance.md), SDPA flash as the drift check.
        # In the speed list only when a minute is left (the suite call can take it instead).
        local tma tma_limit
        for tma in 1 kernel 0; do
            tma_limit=$(( $(left) - 5 ))
            [ $tma_limit -gt 120 ] && tma_limit=120
            if [ $tma_limit -lt 30 ]; then
                echo "=== tma_ab KERNELS_TMA=$tma: skipped, ${tma_limit}s left"
                continue
            fi
            KERNELS_TMA=$tma stage "tma_ab KERNELS_TMA=$tma" "$tma_limit" "${PYM[@]}" \
                benchmarks --out-dir "$WORK/tma$tma" --no-plots --skip-parity --no-modules \
                --no-features --providers kernels sdpa_flash --dtypes bf16 --head-dims 128 64 \
                --dropout 0.0 --seq-lens 128 512 1024 4096 --modes fwd bwd fwd_bwd \
                --time-budget $(( tma_limit - 15 ))
        done
        pack
    fi
    if wanted persistent_ab; then
        # The persistent forward against the grid launch (one program per query block), at
        # the lengths where the grid has several waves; SDPA flash as the drift check.
        local persist persist_limit
        for persist in 1 0; do
            persist_limit=$(( $(left) - 5 ))
            [ $persist_limit -gt 110 ] && persist_limit=110
            if [ $persist_limit -lt 30 ]; then
                echo "=== persistent_ab KERNELS_FWD_PERSISTENT=$persist: skipped, ${persist_limit}s left"
                continue
            fi
            KERNELS_FWD_PERSISTENT=$persist stage "persistent_ab KERNELS_FWD_PERSISTENT=$persist" \
                "$persist_limit" "${PYM[@]}" benchmarks --out-dir "$WORK/persistent$persist" \
                --no-plots --skip-parity --no-modules --no-features \
                --providers kernels sdpa_flash --dtypes bf16 --head-dims 128 64 \
                --dropout 0.0 --seq-lens 512 1024 2048 4096 8192 16384 --modes fwd \
                --time-budget $(( persist_limit - 15 ))
        done
        pack
    fi
    if wanted warpspec_ab; then
        # The warp-specialised configs offered to the autotuner (it times them with the rest),
        # the variants' own tests on the GPU, then the same sweep as persistent_ab's.
        local ws_limit
        ws_limit=$(limit_reserving 60 100)
        KERNELS_FWD_WARP_SPEC=1 stage "variant tests (GPU)" "$ws_limit" "${PYM[@]}" pytest \
            tests/core/test_warp_spec.py tests/core/test_persistent.py -q -p no:cacheprovider \
            -rfE
        ws_limit=$(( $(left) - 5 ))
        [ $ws_limit -gt 110 ] && ws_limit=110
        if [ $ws_limit -lt 30 ]; then
            echo "=== warpspec_ab KERNELS_FWD_WARP_SPEC=1: skipped, ${ws_limit}s left"
        else
            KERNELS_FWD_WARP_SPEC=1 stage "warpspec_ab KERNELS_FWD_WARP_SPEC=1" "$ws_limit" \
                "${PYM[@]}" benchmarks --out-dir "$WORK/warpspec1" \
                --no-plots --skip-parity --no-modules --no-features \
                --providers kernels sdpa_flash --dtypes bf16 --head-dims 128 64 \
                --dropout 0.0 --seq-lens 512 1024 2048 4096 8192 16384 --modes fwd \
                --time-budget $(( ws_limit - 15 ))
        fi
        pack
    fi
    if ! wanted bench; then
        pack
        echo; echo "=== summary ($(( $(date +%s) - start ))s in all) ==="; printf "%s" "$summary"
        [ "$PACK" = 1 ] && tar tvf "$OUTDIR/results.tar" 2>/dev/null | awk '{print $3, $6}'
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
    stage "benchmark" "$bench_limit" "${PYM[@]}" benchmarks --out-dir "$OUTDIR" \
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
