"""pytest-benchmark matrix of the same providers: ``pytest benchmarks/ --benchmark-only``.

Not part of the default test run (pyproject's testpaths is ``tests``). On a GPU: bf16,
(batch, heads, seq_len, head_dim) = (4, 16, 1024, 64); on CPU: a tiny shape, the kernel in
Triton's interpreter (timings then say nothing about GPU speed). The timed function
synchronises the device, so each round is the full work of one call. A provider that cannot
run the case is skipped with the reason. ``extra_info`` carries FLOPs and TFLOP/s (from the
median, with the project's one FLOP count, benchmarks/flops.py).
"""
import warnings

import pytest

pytest.importorskip("pytest_benchmark")

import torch  # noqa: E402

from benchmarks.flops import attention_flops  # noqa: E402
from benchmarks.measure import classify_failure, mode_maker  # noqa: E402
from benchmarks.providers import COMPILED, PROVIDERS, Case, get_provider  # noqa: E402
from benchmarks.timing import free_memory, synchronize  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BATCH, HEADS, SEQ, HEAD_DIM = (4, 16, 1024, 64) if CUDA else (1, 2, 64, 32)
ROUNDS, WARMUP_ROUNDS = (30, 3) if CUDA else (3, 1)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_attention(benchmark, provider, mode, dropout_p):
    """Time one provider in one mode on the fixed shape."""
    if not CUDA and provider in COMPILED:
        pytest.skip("torch.compile providers are not benchmarked on CPU (compile time)")
    if dropout_p and provider not in ("kernels", "sdpa_flash", "sdpa_efficient"):
        pytest.skip("dropout column kept to the fused providers to keep the matrix small")
    case = Case(batch=BATCH, heads=HEADS, seq_len=SEQ, head_dim=HEAD_DIM,
                dtype=torch.bfloat16, dropout_p=dropout_p, device=DEVICE)
    prov = get_provider(provider)
    reason = prov.static_reason(case)
    if reason:
        pytest.skip(f"unsupported: {reason}")
    q, k, v, do = case.make_inputs()
    forward = prov.forward(case)
    make = mode_maker(lambda: forward(q, k, v), mode, do, (q, k, v))
    with warnings.catch_warnings(record=True) as caught:  # SDPA says why in warnings
        warnings.simplefilter("always")
        try:  # probe (also the compile / autotune warm-up)
            fn = make()
            fn()
            synchronize(DEVICE)
            status = None
        except Exception as exc:
            status = classify_failure(exc, caught, prov.unsupported_reason)
    if status:
        fn = None
        free_memory(DEVICE)
        if status.startswith("error"):
            pytest.fail(f"{provider} {mode}: {status}")
        pytest.skip(status)

    def timed():
        q.grad = k.grad = v.grad = None
        fn()
        synchronize(DEVICE)

    benchmark.pedantic(timed, rounds=ROUNDS, iterations=1, warmup_rounds=WARMUP_ROUNDS)
    flops = attention_flops(BATCH, HEADS, SEQ, SEQ, HEAD_DIM, causal=True, mode=mode)
    benchmark.extra_info.update(flops=flops, device=DEVICE, dtype="bfloat16",
                                shape=[BATCH, HEADS, SEQ, HEAD_DIM])
    median = benchmark.stats.stats.median if benchmark.stats else None
    if median:
        benchmark.extra_info["tflops"] = flops / median / 1e12
