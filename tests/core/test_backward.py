"""Gradient parity of kernels.core.backward.attention_backward against the float64 oracle.

The forward's outputs (o, lse) come from a float64 PyTorch computation here, so these tests
check the backward kernels alone. Reference gradients are autograd through
``reference.attention``: ``upcast=True`` is the truth, ``upcast=False`` (the input dtype) sets
the error budget (FlashAttention's rule, ``reference.parity`` with GRAD_FACTOR), plus the
error any FlashAttention-style backward inherits from the forward's rounded o (helpers.fa2_oracle).
On CPU every case runs the real kernels in Triton's interpreter (see conftest.py).
"""
import math

import pytest
import torch
import triton
from helpers import DEVICE, GRAD_FACTOR, assert_parity, fa2_oracle, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from kernels.core.backward import attention_backward


def make_inputs(b, h, q_len, k_len, d, dtype, strided=False):
    """q, k, v, do of logical shape (b, h, len, d). ``strided``: q, k, v are heads split off a
    (b, s, h, d) projection by transpose, and do has a non-unit last-dim stride."""
    if strided:
        q, k, v = (randn(b, n, h, d, dtype=dtype).transpose(1, 2) for n in (q_len, k_len, k_len))
        do = randn(b, h, d, q_len, dtype=dtype).transpose(2, 3)
    else:
        q = randn(b, h, q_len, d, dtype=dtype)
        k, v = randn(b, h, k_len, d, dtype=dtype), randn(b, h, k_len, d, dtype=dtype)
        do = randn(b, h, q_len, d, dtype=dtype)
    return q, k, v, do


def forward64(q, k, v, *, causal, softmax_scale, dropout_p=0.0, keep=None):
    """What the forward kernel hands the backward: o in q's dtype and lse fp32 (b, h, q_len)
    contiguous, natural log, -inf for rows that see no key. Computed in float64."""
    s = softmax_scale * (q.double() @ k.double().transpose(-1, -2))
    if causal:
        s = s.masked_fill(~reference.causal_mask(q.shape[2], k.shape[2], device=q.device),
                          float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                            dropout_p=dropout_p, keep_mask=keep, upcast=True)
    return o.to(q.dtype), lse.float().contiguous()


def reference_grads(q, k, v, do, *, upcast, **kw):
    """(dq, dk, dv) by autograd through reference.attention (float64 if upcast)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = reference.attention(*leaves, upcast=upcast, **kw)
    return torch.autograd.grad(o, leaves, do.to(o.dtype))


def check_grads(q, k, v, do, *, causal, dropout_p=0.0, seed=0, softmax_scale=None,
                config=None):
    """Run the kernel and assert parity of dq, dk, dv; returns the kernel's gradients."""
    b, h, q_len, d = q.shape
    k_len = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    keep = None
    if dropout_p > 0:
        keep = reference.dropout_keep_mask(seed, b, h, q_len, k_len, dropout_p, device=q.device)
    kw = dict(causal=causal, softmax_scale=scale, dropout_p=dropout_p, keep_mask=keep)
    o, lse = forward64(q, k, v, causal=causal, softmax_scale=scale, dropout_p=dropout_p,
                       keep=keep)

    grads = attention_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=scale,
                               dropout_p=dropout_p, seed=seed, config=config)
    ref = reference_grads(q, k, v, do, upcast=True, **kw)
    lowp = reference_grads(q, k, v, do, upcast=False, **kw)
    given_o, noise = fa2_oracle(q, k, v, do, o, lse, **kw)
    for name, g, x, r, lp, e, n in zip(("dq", "dk", "dv"), grads, (q, k, v), ref, lowp,
                                       given_o, noise):
        assert g.dtype == x.dtype and g.stride() == x.stride(), f"{name}: layout of its input"
        inherited = (e - r).abs().max().item() if r.numel() else 0.0
        assert_parity(g, r, lp, factor=GRAD_FACTOR, extra=inherited + n, name=name)
    return grads


# A sampled grid over (batch, heads, q_len, k_len, head_dim, causal, dtype): every length in
# {1, 17, 64, 97, 128}, q_len > k_len and < k_len with and without causal, head dims
# {1, 8, 16, 40, 64, 128, 256}, every dtype several times.
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
GRID = [
    (1, 2, 1, 1, 16, True, F32),
    (2, 2, 17, 17, 40, True, F16),
    (1, 3, 64, 64, 64, True, BF16),
    (1, 2, 128, 128, 128, True, F16),
    (1, 2, 97, 64, 40, True, BF16),      # q_len > k_len: rows 0..32 see no key
    (1, 2, 17, 128, 64, True, F32),      # q_len < k_len: the band starts at key 111
    (1, 2, 97, 128, 16, False, F16),
    (2, 1, 128, 17, 128, False, BF16),
    (1, 2, 64, 97, 8, True, F32),        # tiny head dim, padded to 16
    (1, 2, 17, 64, 1, False, F16),       # head dim 1
    (1, 1, 17, 33, 256, True, BF16),     # largest head dim
    (1, 2, 1, 97, 64, True, F16),        # one query row sees every key
    (1, 2, 97, 1, 40, True, F32),        # one key: only the last row sees it
    (1, 2, 64, 17, 64, False, F32),
]


def _grid_id(case):
    b, h, q_len, k_len, d, causal, dtype = case
    return f"{b}x{h}-q{q_len}-k{k_len}-d{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_backward_parity(case):
    b, h, q_len, k_len, d, causal, dtype = case
    q, k, v, do = make_inputs(b, h, q_len, k_len, d, dtype)
    check_grads(q, k, v, do, causal=causal)


@pytest.mark.parametrize("b,h,q_len,k_len,d,causal,dtype", [
    (2, 2, 97, 97, 40, True, BF16),
    (1, 2, 64, 128, 64, False, F16),
    (1, 2, 128, 64, 16, True, F32),
], ids=["bf16-causal", "f16-full", "f32-causal-q>k"])
def test_strided_inputs(b, h, q_len, k_len, d, causal, dtype):
    """(b, s, h, d)-transposed q/k/v and a do whose last dim is not unit-stride; gradients
    come back in the inputs' layout."""
    q, k, v, do = make_inputs(b, h, q_len, k_len, d, dtype, strided=True)
    assert not q.is_contiguous() and do.stride(-1) != 1
    check_grads(q, k, v, do, causal=causal)


@pytest.mark.parametrize("q_len,k_len,causal,dtype,seed", [
    (64, 97, True, F16, 1234),
    (97, 64, False, BF16, 2**40 + 7),    # a seed whose high 32 bits matter
    (128, 128, True, F32, 99),
    (97, 33, True, BF16, 5),             # rows without keys, with dropout
], ids=["f16-causal", "bf16-full-bigseed", "f32-causal", "bf16-causal-q>k"])
def test_dropout_parity(q_len, k_len, causal, dtype, seed):
    """The backward regenerates the forward's Philox mask (reference.dropout_keep_mask)."""
    q, k, v, do = make_inputs(1, 2, q_len, k_len, 40, dtype)
    check_grads(q, k, v, do, causal=causal, dropout_p=0.2, seed=seed)


def _config(block_m, block_n):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=1, num_stages=1)


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32), (64, 32)])
@pytest.mark.parametrize("q_len,k_len", [(97, 64), (64, 97)])
def test_other_block_sizes(block_m, block_n, q_len, k_len):
    """Unequal blocks move the causal band across several blocks (the GPU configs do that);
    dropout checks the mask does not depend on the blocking."""
    q, k, v, do = make_inputs(1, 2, q_len, k_len, 32, F16)
    check_grads(q, k, v, do, causal=True, dropout_p=0.2, seed=77,
                config=_config(block_m, block_n))


def test_softmax_scale():
    q, k, v, do = make_inputs(1, 2, 64, 64, 32, F32)
    check_grads(q, k, v, do, causal=True, softmax_scale=0.37)


def test_deterministic():
    """No atomics: two runs are bit-identical (dropout included)."""
    q, k, v, do = make_inputs(2, 2, 97, 64, 40, F16)
    scale = 1.0 / math.sqrt(40)
    o, lse = forward64(q, k, v, causal=True, softmax_scale=scale)
    kw = dict(causal=True, softmax_scale=scale, dropout_p=0.2, seed=3)
    first = attention_backward(do, q, k, v, o, lse, **kw)
    second = attention_backward(do, q, k, v, o, lse, **kw)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=str)
def test_rows_without_keys_get_zero_dq(dtype):
    """Causal with q_len > k_len: rows i < q_len - k_len see no key (lse = -inf); their dq is
    exactly 0 and nothing is NaN."""
    q_len, k_len = 70, 20
    q, k, v, do = make_inputs(1, 2, q_len, k_len, 16, dtype)
    o, lse = forward64(q, k, v, causal=True, softmax_scale=0.25)
    assert torch.isneginf(lse[:, :, :q_len - k_len]).all()
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, causal=True, softmax_scale=0.25)
    assert (dq[:, :, :q_len - k_len] == 0).all()
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()


def test_zero_stride_grad():
    """The gradient of o.sum() arrives expanded (all strides 0)."""
    q, k, v, _ = make_inputs(1, 2, 33, 33, 16, F32)
    do = torch.ones((), device=DEVICE).expand(q.shape)
    o, lse = forward64(q, k, v, causal=True, softmax_scale=0.25)
    got = attention_backward(do, q, k, v, o, lse, causal=True, softmax_scale=0.25)
    want = attention_backward(do.contiguous(), q, k, v, o, lse, causal=True, softmax_scale=0.25)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("b,h,q_len,k_len", [(0, 2, 5, 5), (1, 0, 5, 5), (1, 2, 0, 5),
                                             (1, 2, 5, 0)])
def test_empty(b, h, q_len, k_len):
    q, k, v, do = make_inputs(b, h, q_len, k_len, 16, F32)
    lse = torch.full((b, h, q_len), float("-inf"), device=DEVICE)
    dq, dk, dv = attention_backward(do, q, k, v, torch.zeros_like(q), lse, causal=True,
                                    softmax_scale=0.25)
    for g, x in zip((dq, dk, dv), (q, k, v)):
        assert g.shape == x.shape and (g == 0).all()


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(b=st.integers(1, 2), h=st.integers(1, 2), q_len=st.integers(1, 80),
       k_len=st.integers(1, 80), d=st.sampled_from([1, 3, 16, 24, 40, 64]),
       causal=st.booleans(), dtype=st.sampled_from([F16, BF16, F32]),
       strided=st.booleans(), dropout_p=st.sampled_from([0.0, 0.3]),
       blocks=st.sampled_from([(16, 16), (32, 16), (16, 32)]))
def test_fuzz(b, h, q_len, k_len, d, causal, dtype, strided, dropout_p, blocks):
    """Random shapes (any lengths, odd head dims), layouts, dropout and block sizes; the same
    25 examples every run (derandomized) so CI cannot flake."""
    q, k, v, do = make_inputs(b, h, q_len, k_len, d, dtype, strided=strided)
    check_grads(q, k, v, do, causal=causal, dropout_p=dropout_p, seed=q_len * 1000 + k_len,
                config=_config(*blocks))


@pytest.mark.gpu
@pytest.mark.parametrize("b,h,q_len,k_len,d,causal,dropout_p,dtype", [
    (2, 4, 1024, 1024, 128, True, 0.0, BF16),
    (1, 2, 1000, 777, 256, True, 0.0, F16),
    (1, 4, 513, 2048, 64, False, 0.1, BF16),
    (2, 2, 300, 300, 72, True, 0.0, F32),
])
def test_autotuned_gpu(b, h, q_len, k_len, d, causal, dropout_p, dtype, monkeypatch):
    """GPU only: the autotuned path (every config of autotune.bwd_configs that survives
    pruning) at realistic sizes, including head_dim 256. conftest.py turns autotuning off for
    the rest of the GPU suite; it is switched back on here."""
    monkeypatch.setenv("KERNELS_AUTOTUNE", "1")
    q, k, v, do = make_inputs(b, h, q_len, k_len, d, dtype, strided=True)
    check_grads(q, k, v, do, causal=causal, dropout_p=dropout_p, seed=11)
