"""One exception convention per API (docs/features.md, docs/flash_attn.md).

The native functions (``kernels.attention``, ``attention_varlen``, ``attention_with_kvcache``)
raise Python's TypeError (a wrong type or dtype) / ValueError (a wrong value, shape or device);
``kernels.flash_attn_interface`` raises FlashAttention's RuntimeError for every bad argument,
the native checks underneath included, with the same message. Every test asserts the type and
the key words of the message, for both APIs where both apply. Shapes are tiny: every call
here fails in its argument checks, before any kernel runs, except the double-backward and
vmap tests.
"""
import pytest
import torch

import kernels
from kernels.core import fallback
from kernels.flash_attn_interface import (flash_attn_func, flash_attn_varlen_func,
                                          flash_attn_with_kvcache)
from tests.helpers import DEVICE, randn

I32 = dict(dtype=torch.int32, device=DEVICE)
BF16 = torch.bfloat16
OTHER_FP8 = [getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n)]


def _raises(exc, call, *words):
    """``call()`` raises exactly ``exc`` (not a subclass of it that is another API's type:
    NotImplementedError is a RuntimeError, and would hide a wrong type) whose message holds
    each of ``words`` (plain text, not regexes). Returns the exception."""
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"
    return info.value


# ------------------------------------------------------------------------------ FP8 formats
@pytest.mark.parametrize("fp8", OTHER_FP8, ids=str)
def test_other_fp8_cache_says_e4m3fn(fp8):
    """bf16 q over a cache in another FP8 format: both APIs say FP8 caches must be
    float8_e4m3fn (expected vs given), not that q and the cache differ in dtype."""
    q = randn(1, 2, 1, 16, dtype=BF16)                  # (batch, heads, q_len, head_dim)
    cache = randn(1, 2, 8, 16).to(fp8)                  # (batch, heads_kv, seq, head_dim)
    lens = torch.tensor([4], **I32)
    words = ("k_cache", "FP8 inputs and caches must be torch.float8_e4m3fn", str(fp8))
    _raises(TypeError, lambda: kernels.attention_with_kvcache(q, cache, cache, lens), *words)
    _raises(RuntimeError, lambda: flash_attn_with_kvcache(
        q.transpose(1, 2), cache.transpose(1, 2), cache.transpose(1, 2), cache_seqlens=lens),
        *words)


@pytest.mark.parametrize("fp8", OTHER_FP8, ids=str)
def test_other_fp8_inputs_say_e4m3fn(fp8):
    q, k, v = (randn(1, 2, 4, 16).to(fp8) for _ in range(3))
    words = ("FP8 inputs and caches must be torch.float8_e4m3fn", str(fp8))
    _raises(TypeError, lambda: kernels.attention(q, k, v), *words)
    _raises(RuntimeError, lambda: flash_attn_func(q, k, v), *words)


# ------------------------------------------------------------------------------ one type per API
def _dense(hq=4, hk=2, dtype=torch.float32):
    """q, k, v in our layout (batch, heads, seq, head_dim)."""
    return randn(1, hq, 5, 16, dtype=dtype), randn(1, hk, 5, 16, dtype=dtype), \
        randn(1, hk, 5, 16, dtype=dtype)


def _fa(q, k, v):
    """The same tensors in FlashAttention's layout (batch, seq, heads, head_dim)."""
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _cache():
    """q, k_cache, v_cache in our layout (batch, heads, seq, head_dim)."""
    return randn(1, 4, 1, 16), randn(1, 2, 8, 16), randn(1, 2, 8, 16)


def _lens():
    return torch.tensor([3], **I32)


# (id, native call, its type, FlashAttention call, key words of both messages). The bad
# arguments the FlashAttention functions hand to the native ones unchanged: the FlashAttention
# function must raise RuntimeError with the native message, word for word.
PASSED_THROUGH = [
    ("dropout_p", lambda: kernels.attention(*_dense(), dropout_p=1.5), ValueError,
     lambda: flash_attn_func(*_fa(*_dense()), dropout_p=1.5), ("dropout_p", "[0, 1)", "1.5")),
    ("softmax_scale", lambda: kernels.attention(*_dense(), softmax_scale=-1.0), ValueError,
     lambda: flash_attn_func(*_fa(*_dense()), softmax_scale=-1.0),
     ("softmax_scale", "> 0", "-1.0")),
    ("descale-not-fp8", lambda: kernels.attention(*_dense(), q_descale=torch.ones(1)),
     ValueError, lambda: flash_attn_func(*_fa(*_dense()), q_descale=torch.ones(1)),
     ("q_descale applies to FP8",)),
    ("sinks-shape", lambda: kernels.attention(*_dense(), sinks=torch.zeros(3)), ValueError,
     lambda: flash_attn_func(*_fa(*_dense()), s_aux=torch.zeros(3)),
     ("sinks must have shape (4,)", "got (3,)")),
    ("alibi-shape", lambda: kernels.attention(*_dense(), alibi_slopes=torch.ones(3)),
     ValueError, lambda: flash_attn_func(*_fa(*_dense()), alibi_slopes=torch.ones(3)),
     ("alibi_slopes must have shape", "got (3,)")),
    ("alibi-int", lambda: kernels.attention(*_dense(), alibi_slopes=torch.ones(4, dtype=int)),
     TypeError, lambda: flash_attn_func(*_fa(*_dense()),
                                        alibi_slopes=torch.ones(4, dtype=int)),
     ("alibi_slopes must be a floating-point tensor", "torch.int64")),
    ("kvcache-num_splits",
     lambda: kernels.attention_with_kvcache(*_cache(), _lens(), num_splits=-2), ValueError,
     lambda: flash_attn_with_kvcache(*_fa(*_cache()), cache_seqlens=_lens(), num_splits=-2),
     ("num_splits must be >= 0", "-2")),
]


@pytest.mark.parametrize("case", PASSED_THROUGH, ids=[c[0] for c in PASSED_THROUGH])
def test_native_errors_become_runtime_errors_with_the_same_message(case):
    _, native, native_type, fa_call, words = case
    ours = _raises(native_type, native, *words)
    theirs = _raises(RuntimeError, fa_call, *words)
    assert str(theirs) == str(ours)
    assert type(theirs.__cause__) is native_type   # the native error stays in the traceback


# The same bad argument, checked by each API in its own words: each its own type.
BOTH_CHECK = [
    ("cache_seqlens-int64",
     lambda: kernels.attention_with_kvcache(*_cache(), torch.tensor([3], device=DEVICE)),
     ValueError, ("cache_seqlens must be int32", "torch.int64"),
     lambda: flash_attn_with_kvcache(*_fa(*_cache()),
                                     cache_seqlens=torch.tensor([3], device=DEVICE)),
     ("cache_seqlens must have dtype int32", "torch.int64")),
    ("cache_seqlens-list", lambda: kernels.attention_with_kvcache(*_cache(), [3]), TypeError,
     ("cache_seqlens must be a torch.Tensor", "list"),
     lambda: flash_attn_with_kvcache(*_fa(*_cache()), cache_seqlens=[3]),
     ("cache_seqlens must be an int or an int32 tensor", "list")),
    ("cu_seqlens-int64",
     lambda: kernels.attention_varlen(*(t[0].transpose(0, 1) for t in _dense()),
                                      torch.tensor([0, 5], device=DEVICE),
                                      torch.tensor([0, 5], device=DEVICE), 5, 5),
     TypeError, ("cu_seqlens_q must be int32", "torch.int64"),
     lambda: flash_attn_varlen_func(*(t[0].transpose(0, 1) for t in _dense()),
                                    torch.tensor([0, 5], device=DEVICE),
                                    torch.tensor([0, 5], device=DEVICE), 5, 5),
     ("cu_seqlens_q must have dtype int32", "torch.int64")),
    ("q-not-a-tensor", lambda: kernels.attention([1.0], *_dense()[1:]), TypeError,
     ("q must be a torch.Tensor", "list"),
     lambda: flash_attn_func([1.0], *_fa(*_dense())[1:]), ("q must be a torch.Tensor", "list")),
    ("dtypes-differ", lambda: kernels.attention(*_dense()[:2], _dense(dtype=BF16)[2]),
     TypeError, ("dtype", "torch.float32", "torch.bfloat16"),
     lambda: flash_attn_func(*_fa(*_dense()[:2], _dense(dtype=BF16)[2])),
     ("same dtype", "torch.float32", "torch.bfloat16")),
    ("rank", lambda: kernels.attention(*(t[0] for t in _dense())), ValueError,
     ("must be 4-D",), lambda: flash_attn_func(*(t[0] for t in _fa(*_dense()))),
     ("must be 4-D", "(batch, seqlen, heads, head_dim)")),
    ("window", lambda: kernels.attention(*_dense(), causal=True, window=0), ValueError,
     ("window must be >= 1",), lambda: flash_attn_func(*_fa(*_dense()), window_size=3),
     ("window_size must be a pair (left, right) of ints", "got 3")),
]


@pytest.mark.parametrize("case", BOTH_CHECK, ids=[c[0] for c in BOTH_CHECK])
def test_each_api_its_own_type(case):
    _, native, native_type, native_words, fa_call, fa_words = case
    _raises(native_type, native, *native_words)
    _raises(RuntimeError, fa_call, *fa_words)


def test_flash_attn_signature_errors_stay_python_s():
    """What Python raises for any function (an unknown keyword) stays TypeError; what we lack
    of FlashAttention 3 is NotImplementedError, a RuntimeError too."""
    _raises(TypeError, lambda: flash_attn_func(*_fa(*_dense()), bogus=1), "bogus")
    err = _raises(NotImplementedError, lambda: flash_attn_func(*_fa(*_dense()),
                                                               qv=torch.ones(1)), "qv")
    assert isinstance(err, RuntimeError)


# ------------------------------------------------------------------------------ layouts
def test_sdpa_layout_q_names_shapes_and_layout():
    """A decoding q in SDPA's layout (batch, heads, 1, head_dim) over a FlashAttention-layout
    cache reads as 1 query head over 2: the message names the shapes, the expected layout and
    the fix, not just "got 1 and 2"."""
    q = randn(1, 4, 1, 16)                          # SDPA's layout: 4 heads, one query
    cache = randn(1, 8, 2, 16)                      # FlashAttention's: 8 positions, 2 heads
    _raises(RuntimeError, lambda: flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3),
            "multiple of the number of key/value heads", "(batch, seqlen, heads, head_dim)",
            "q (1, 4, 1, 16)", "k_cache (1, 8, 2, 16)", "SDPA's layout",
            "(batch, heads, seqlen, head_dim)", ".transpose(1, 2)")
    k = randn(1, 5, 2, 16)
    _raises(RuntimeError, lambda: flash_attn_func(randn(1, 3, 5, 16), k, k),
            "(batch, seqlen, heads, head_dim)", "q (1, 3, 5, 16)", "k (1, 5, 2, 16)",
            "SDPA's layout")


def test_head_dims_and_heads_name_the_shapes():
    q, k, v = randn(1, 5, 4, 16), randn(1, 5, 2, 32), randn(1, 5, 2, 32)
    _raises(RuntimeError, lambda: flash_attn_func(q, k, v), "same head dim",
            "q (1, 5, 4, 16)", "k (1, 5, 2, 32)")
    _raises(RuntimeError, lambda: flash_attn_func(q, randn(1, 5, 2, 16), randn(1, 5, 1, 16)),
            "same number of heads", "k (1, 5, 2, 16)", "v (1, 5, 1, 16)")


# ------------------------------------------------------------------------------ double backward
def test_double_backward_same_error_on_every_route(route):
    """A second derivative raises our message on the kernels' route and on the CPU fallback's
    route through PyTorch's CPU flash op (fp32, no dropout, square causal: ``_sdpa_applies``),
    whose own message would be "derivative for aten::_scaled_dot_product_flash_attention_for_
    cpu_backward is not implemented"; the first-order gradients with create_graph=True are the
    plain ones."""
    q, k, v = (randn(1, 2, 9, 16, device=route.device, requires_grad=True) for _ in range(3))
    dq, dk = torch.autograd.grad(kernels.attention(q, k, v, causal=True).sum(), (q, k),
                                 create_graph=True)
    plain = torch.autograd.grad(kernels.attention(q, k, v, causal=True).sum(), (q, k))
    assert torch.equal(dq, plain[0]) and torch.equal(dk, plain[1])
    err = _raises(RuntimeError, lambda: torch.autograd.grad((dq.sum() + dk.sum()), v),
                  "double backward", "kernels.attention is not supported", "reference.attention")
    # Word for word the message of every route (one constant, kernels/core/call.py).
    assert str(err) == fallback.NO_DOUBLE_BACKWARD


def test_fallback_double_backward_mixed_dtype_and_gqa(monkeypatch):
    """bf16 inputs (upcast around the aten op) and grouped-query heads: still ours."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", True)
    q = randn(1, 4, 9, 16, dtype=BF16, device="cpu", requires_grad=True)
    k, v = (randn(1, 2, 9, 16, dtype=BF16, device="cpu", requires_grad=True) for _ in range(2))
    dv, = torch.autograd.grad(kernels.attention(q, k, v).sum(), v, create_graph=True)
    err = _raises(RuntimeError, lambda: torch.autograd.grad(dv.sum(), q), "double backward")
    assert str(err) == fallback.NO_DOUBLE_BACKWARD


# ------------------------------------------------------------------------------ vmap and dropout
def test_vmap_with_a_fixed_seed_is_one_batched_call(monkeypatch):
    """docs/features.md: with dropout and a fixed seed, vmap draws the masks of one call on
    the samples concatenated along the batch (mapped dim in front), not those of a loop of
    calls with that seed (which repeats one mask). On the fallback route (CPU, fast)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", True)
    n, b = 3, 2
    q, k, v = (randn(n, b, 2, 8, 16, device="cpu") for _ in range(3))

    def call(q, k, v):
        return kernels.attention(q, k, v, dropout_p=0.3, seed=7)

    mapped = torch.func.vmap(call)(q, k, v)
    batched = call(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)).view(mapped.shape)
    looped = torch.stack([call(q[i], k[i], v[i]) for i in range(n)])
    assert torch.equal(mapped, batched)
    assert not torch.equal(mapped, looped)
