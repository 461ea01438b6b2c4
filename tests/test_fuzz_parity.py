"""tools/fuzz_parity.py in CI: a few of its random cases per route at a fixed seed, on the
kernels (Triton's interpreter; the tool makes CPU tensors) and on the PyTorch fallback, and
proof that its checks fail on a wrong answer (a wrong mask, a wrong gradient, a wrong cache).
Long runs are the tool's job (its docstring); a case it finds failing is pinned here by
(seed, index)."""
import pytest
import torch
from helpers import interpreter_unusable_reason

import kernels
from tools import fuzz_parity as fz

SEED = 20261129
KERNEL_CASES = 4      # per route; each a fraction of a second to a few seconds in the interpreter
FALLBACK_CASES = 12


def _kernel_skip():
    if torch.cuda.is_available():
        return "the tool runs the kernels on CPU tensors in Triton's interpreter, which a " \
               "CUDA machine's test session has not enabled"
    return interpreter_unusable_reason()


@pytest.mark.parametrize("route", fz.ROUTES)
def test_random_cases_kernel(route):
    if _kernel_skip():
        pytest.skip(_kernel_skip())
    for i in range(KERNEL_CASES):
        ratio, _ = fz.run_case(fz.draw_case(SEED, i, (route,)), "kernel")
        assert ratio <= 1.0


@pytest.mark.parametrize("route", fz.ROUTES)
def test_random_cases_fallback(route):
    for i in range(FALLBACK_CASES):
        ratio, _ = fz.run_case(fz.draw_case(SEED, i, (route,)), "fallback")
        assert ratio <= 1.0


def test_cases_are_replayable_and_cover_the_matrix():
    cases = [fz.draw_case(SEED, i) for i in range(400)]
    assert cases[17] == fz.draw_case(SEED, 17)
    assert cases[17] != fz.draw_case(SEED + 1, 17)
    seen = {key for c in cases for key, value in c.items() if value not in (None, False, 0, 0.0)}
    assert {"window", "chunk", "softcap", "alibi", "sinks", "scale", "transposed", "dropout",
            "grad", "append", "page_size", "window_size", "attention_chunk"} <= seen
    assert {c["route"] for c in cases} == set(fz.ROUTES)
    assert {c["dtype"] for c in cases} == set(fz.DTYPES)


def test_random_cases_compiled():
    """Two cases per route under torch.compile(fullgraph=True, backend="aot_eager")."""
    if _kernel_skip():
        pytest.skip(_kernel_skip())
    for route in fz.ROUTES:
        for i in range(2):
            ratio, _ = fz.run_case(fz.draw_case(SEED, i, (route,)), "compiled")
            assert ratio <= 1.0


def _dense_case(**over):
    c = dict(fz.draw_case(SEED, 0, ("dense",)))
    c.update(dict(dtype="fp32", batch=1, heads_kv=1, group=2, d=16, dv=16, causal=True,
                  window=None, chunk=None, softcap=None, alibi=None, sinks=False, scale=None,
                  transposed=False, dropout=0.0, grad=True, q_len=19, k_len=23), **over)
    return c


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times 1.01 backward: a 1% wrong backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1.01


def test_the_checks_can_fail(monkeypatch):
    """Right answers pass; a mask off by one, a 1% wrong gradient and a wrong appended cache
    each fail (on the fallback: the same checks, no interpreter needed)."""
    fz.run_case(_dense_case(), "fallback")
    attention = kernels.attention

    def wrong_window(q, k, v, **kw):
        return attention(q, k, v, **dict(kw, window=kw["window"] + 1))
    monkeypatch.setattr(kernels, "attention", wrong_window)
    with pytest.raises(fz.Mismatch, match="out"):
        fz.run_case(_dense_case(window=5), "fallback")

    def wrong_grad(q, k, v, **kw):
        out, lse = attention(q, k, v, **kw)
        return _ScaleGrad.apply(out), lse
    monkeypatch.setattr(kernels, "attention", wrong_grad)
    with pytest.raises(fz.Mismatch, match="^d[qkv]"):
        fz.run_case(_dense_case(), "fallback")
    monkeypatch.setattr(kernels, "attention", attention)

    kvcache = kernels.attention_with_kvcache

    def wrong_cache(q, k_cache, v_cache, seqlens, k=None, v=None, **kw):
        result = kvcache(q, k_cache, v_cache, seqlens, k, v, **kw)
        k_cache[0, 0, int(seqlens[0])] += 1.0        # the first appended key, corrupted after
        return result
    monkeypatch.setattr(kernels, "attention_with_kvcache", wrong_cache)
    c = dict(fz.draw_case(SEED, 0, ("kvcache",)), append=True, q_len=2, cache_len=9,
             seqlens=[3] * 3, batch=3)
    with pytest.raises(fz.Mismatch, match="cache"):
        fz.run_case(c, "fallback")


def test_device_plumbing_moves_and_copies_back():
    """``--device`` moves the call's tensors and copies written caches back (here to the CPU
    under another name, which runs the same wrapper as ``cuda``)."""
    if _kernel_skip():
        pytest.skip(_kernel_skip())
    cache = dict(fz.draw_case(SEED, 0, ("kvcache",)), append=True, q_len=2, cache_len=9,
                 seqlens=[3, 5], batch=2)
    dense = _dense_case(q_len=5, k_len=7)
    for c in (cache, dense):
        ratio, _ = fz.run_case(c, "kernel", device="cpu:0")
        assert ratio <= 1.0
