"""Forward parity of kernels.attention against the float64 oracle (reference.attention).

On CPU every case runs the real Triton kernel in Triton's interpreter (see conftest.py).
"""
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_parity, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
import reference
from kernels.core.forward import attention_forward


def make_qkv(b, h, q_len, k_len, d, dtype, layout="bhsd"):
    """Random q, k, v of logical shape (b, h, len, d) in a chosen memory layout.

    ``bhsd``: contiguous; ``bshd``: heads split off a (b, s, h, d) projection by transpose
    (the modules' zero-copy layout); ``strided_d``: last dim not unit-stride (forces a copy);
    ``sliced``: a slice of a wider tensor (non-dense rows).
    """
    if layout == "bhsd":
        return (randn(b, h, q_len, d, dtype=dtype), randn(b, h, k_len, d, dtype=dtype),
                randn(b, h, k_len, d, dtype=dtype))
    if layout == "bshd":
        return tuple(randn(b, n, h, d, dtype=dtype).transpose(1, 2)
                     for n in (q_len, k_len, k_len))
    if layout == "strided_d":
        return tuple(randn(b, h, n, d, 2, dtype=dtype)[..., 0] for n in (q_len, k_len, k_len))
    if layout == "sliced":
        return tuple(randn(b, h, n, d + 3, dtype=dtype)[..., 1:d + 1]
                     for n in (q_len, k_len, k_len))
    raise ValueError(layout)


def check_parity(q, k, v, *, causal, softmax_scale=None, dropout_p=0.0, seed=None):
    out = kernels.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                            dropout_p=dropout_p, seed=seed)
    keep = None
    if dropout_p > 0:
        b, h, q_len, k_len = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        keep = reference.dropout_keep_mask(seed, b, h, q_len, k_len, dropout_p, device=q.device)
    kw = dict(causal=causal, softmax_scale=softmax_scale, dropout_p=dropout_p, keep_mask=keep)
    ref = reference.attention(q, k, v, upcast=True, **kw)
    lowp = reference.attention(q, k, v, upcast=False, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_parity(out, ref, lowp)
    return out


# A sampled grid over (batch, heads, q_len, k_len, head_dim, causal): every length in
# {1, 2, 17, 64, 97, 128, 200}, q_len > k_len and < k_len, every head_dim of the issue.
GRID = [
    (1, 1, 1, 1, 16, True),
    (2, 3, 17, 17, 32, True),
    (1, 2, 64, 64, 64, True),
    (3, 1, 97, 97, 40, False),
    (1, 2, 2, 128, 80, True),
    (2, 1, 128, 2, 128, True),
    (1, 1, 200, 97, 64, True),
    (1, 1, 97, 200, 16, False),
    (2, 2, 17, 64, 128, False),
    (1, 3, 64, 17, 40, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,h,q_len,k_len,d,causal", GRID)
def test_forward_parity(b, h, q_len, k_len, d, causal, dtype):
    check_parity(*make_qkv(b, h, q_len, k_len, d, dtype), causal=causal)


@pytest.mark.parametrize("layout", ["bshd", "strided_d", "sliced"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs(layout, dtype):
    q, k, v = make_qkv(2, 3, 33, 45, 24, dtype, layout=layout)
    out = check_parity(q, k, v, causal=True)
    if layout == "bshd":
        # Output keeps q's memory layout: the head merge for out_proj is a free view.
        assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("d", [1, 3, 8, 16, 33, 64, 100, 128, 160, 256])
def test_every_head_dim(d):
    check_parity(*make_qkv(1, 2, 19, 23, d, torch.float16), causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_scale(dtype):
    check_parity(*make_qkv(1, 2, 30, 30, 32, dtype), causal=True, softmax_scale=0.37)


def test_poisoned_output_fully_written():
    """Every element of a NaN-filled output buffer is overwritten (incl. no-key rows)."""
    q, k, v = make_qkv(2, 2, 37, 21, 40, torch.float32)
    out = torch.full_like(q, float("nan"))
    o, lse = attention_forward(q, k, v, causal=True, softmax_scale=0.2, dropout_p=0.0, seed=0,
                               out=out)
    assert o is out and not torch.isnan(out).any()
    assert not torch.isnan(lse).any()


def test_rows_without_keys_are_zero():
    q, k, v = make_qkv(1, 2, 20, 6, 16, torch.float32)  # rows 0..13 see no key
    out, lse = kernels.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :, :14], torch.zeros_like(out[:, :, :14]))
    assert torch.isneginf(lse[:, :, :14]).all()
    assert torch.isfinite(lse[:, :, 14:]).all()


def test_lse_matches_logsumexp():
    q, k, v = make_qkv(2, 2, 33, 47, 32, torch.float32)
    _, lse = kernels.attention(q, k, v, causal=True, return_lse=True)
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(32)
    s = s.masked_fill(~reference.causal_mask(33, 47, device=q.device), float("-inf"))
    assert lse.dtype == torch.float32 and lse.shape == (2, 2, 33)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=0, atol=1e-5)


def test_empty_inputs():
    q, k, v = make_qkv(0, 2, 5, 5, 16, torch.float16)
    assert kernels.attention(q, k, v).shape == (0, 2, 5, 16)
    q, k, v = make_qkv(1, 2, 0, 5, 16, torch.float16)
    assert kernels.attention(q, k, v).shape == (1, 2, 0, 16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_large_logits_stay_finite(dtype):
    q, k, v = make_qkv(1, 2, 40, 40, 32, dtype)
    q = (q.float() * 300).to(dtype)  # scores of order ±1e4
    k = (k.float() * 2).to(dtype)
    out = kernels.attention(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    check_parity(q, k, v, causal=True)


def test_fp32_follows_matmul_precision():
    q, k, v = make_qkv(1, 1, 40, 40, 64, torch.float32)
    ref = reference.attention(q, k, v)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        err = (kernels.attention(q, k, v).double() - ref).abs().max().item()
        assert err < 1e-5  # IEEE fp32 dot
        torch.set_float32_matmul_precision("high")
        out = kernels.attention(q, k, v)  # tf32 on GPU; the interpreter computes in fp32
        assert (out.double() - ref).abs().max().item() < 1e-2
    finally:
        torch.set_float32_matmul_precision(old)


# ------------------------------------------------------------------------------------------
# Dropout
# ------------------------------------------------------------------------------------------
def kernel_keep_mask(seed, p, b=2, h=2, n=64, causal=False, dtype=torch.float32):
    """Read the kernel's dropout mask back: with v = identity (k_len = head_dim), out[i, j] is
    weight(i, j) * keep(i, j) / (1 - p), and every weight is > 0, so keep = out != 0."""
    q, k, _ = make_qkv(b, h, n, n, n, dtype)
    v = torch.eye(n, dtype=dtype, device=DEVICE).expand(b, h, n, n)
    out = kernels.attention(q, k, v, causal=causal, dropout_p=p, seed=seed)
    return out != 0


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_is_reference_mask(p):
    keep = kernel_keep_mask(1234, p)
    expected = reference.dropout_keep_mask(1234, 2, 2, 64, 64, p, device=DEVICE)
    assert torch.equal(keep, expected)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.8])
def test_dropout_kept_fraction(p):
    keep = kernel_keep_mask(99, p)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02


def test_dropout_seeds():
    a = kernel_keep_mask(7, 0.5)
    assert torch.equal(a, kernel_keep_mask(7, 0.5))
    assert not torch.equal(a, kernel_keep_mask(8, 0.5))
    big = 2 ** 62 + 12345  # uses both 32-bit halves of the Philox key
    assert not torch.equal(kernel_keep_mask(big, 0.5), kernel_keep_mask(big - 2 ** 40, 0.5))


def test_dropout_seed_none_follows_torch_generator():
    q, k, v = make_qkv(1, 2, 20, 20, 16, torch.float32)
    torch.manual_seed(5)
    a = kernels.attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(5)
    b = kernels.attention(q, k, v, dropout_p=0.3)
    c = kernels.attention(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_dropout_never_unmasks_the_future():
    keep = kernel_keep_mask(3, 0.2, causal=True)
    future = ~reference.causal_mask(64, 64, device=DEVICE)
    assert not keep[..., future].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("q_len,k_len,causal", [(17, 17, True), (33, 70, True), (50, 9, False)])
def test_dropout_parity(q_len, k_len, causal, dtype):
    check_parity(*make_qkv(2, 2, q_len, k_len, 32, dtype), causal=causal, dropout_p=0.25,
                 seed=2024)


def test_dropout_mean_over_seeds_approaches_expectation():
    """E[dropout output] = the no-dropout output; check the sample mean against a bound of
    6 standard errors computed from the exact per-element variance."""
    p, n_seeds = 0.5, 200
    q, k, v = make_qkv(1, 1, 16, 16, 16, torch.float32)
    mean = sum(kernels.attention(q, k, v, dropout_p=p, seed=s).double()
               for s in range(n_seeds)) / n_seeds
    w = torch.softmax(((q.double() @ k.double().transpose(-2, -1)) / 4).masked_fill(
        ~reference.causal_mask(16, 16, device=DEVICE), float("-inf")), -1)
    expected = w @ v.double()
    var = (w ** 2) @ (v.double() ** 2) * p / (1 - p)  # Var of sum_j w_ij z_j v_j / (1-p)
    assert ((mean - expected).abs() <= 6 * (var / n_seeds).sqrt() + 1e-6).all()


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------
def _ok():
    return make_qkv(1, 2, 8, 8, 16, torch.float32)


BAD = [
    (lambda q, k, v: (q[0], k, v), {}, ValueError, "q must be 4-D"),
    (lambda q, k, v: (q[:, :1], k, v), {}, ValueError, "multiple of the key/value heads"),
    (lambda q, k, v: (q[:, :, :, :1].expand(2, 2, 8, 16), k, v), {}, ValueError, "same batch"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), {}, ValueError, "same head_dim"),
    (lambda q, k, v: (q, k, v[:, :, :4]), {}, ValueError, "k and v must have the same shape"),
    (lambda q, k, v: (q, k.half(), v.half()), {}, TypeError, "share one dtype"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), {}, TypeError, "float16, bfloat16"),
    (lambda q, k, v: (q.tolist(), k, v), {}, TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: (q, k, v), {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\)"),
    (lambda q, k, v: (q, k, v), {"dropout_p": -0.1}, ValueError, "dropout_p"),
    (lambda q, k, v: (q, k, v), {"dropout_p": float("nan")}, ValueError, "dropout_p"),
    (lambda q, k, v: (q, k, v), {"softmax_scale": 0.0}, ValueError, "softmax_scale"),
    (lambda q, k, v: (q, k, v), {"softmax_scale": float("inf")}, ValueError, "softmax_scale"),
    (lambda q, k, v: (q, k, v), {"seed": -1, "dropout_p": 0.1}, ValueError, "seed"),
    (lambda q, k, v: (q, k, v), {"seed": 1.5}, TypeError, "seed"),
    (lambda q, k, v: (q, k, v), {"causal": 1}, TypeError, "causal must be a bool, got int"),
]


def test_numpy_bool_causal():
    """numpy bools are bools (as numpy floats are floats for dropout_p)."""
    np = pytest.importorskip("numpy")
    q, k, v = make_qkv(1, 2, 9, 12, 16, torch.float32)
    assert torch.equal(kernels.attention(q, k, v, causal=np.bool_(False)),
                       kernels.attention(q, k, v, causal=False))
    with pytest.raises(TypeError, match="causal must be a bool, got numpy.int64"):
        kernels.attention(q, k, v, causal=np.int64(1))


@pytest.mark.parametrize("mutate,kwargs,exc,match", BAD)
def test_bad_input(mutate, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kernels.attention(*mutate(*_ok()), **kwargs)


def test_head_dim_over_limit():
    q, k, v = make_qkv(1, 1, 4, 4, 520, torch.float16)
    # (the message names the cache calls that take MLA's 576)
    with pytest.raises(NotImplementedError, match="head_dim up to 512 is supported here .*576"
                                                  ".*got 520"):
        kernels.attention(q, k, v)
    q, k, v = make_qkv(1, 1, 4, 4, 64, torch.float16)
    v = randn(1, 1, 4, 513, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="v's head_dim up to 512 is supported, got 513"):
        kernels.attention(q, k, v)


def test_mixed_devices_rejected():
    q, k, v = _ok()
    if DEVICE == "cpu":
        pytest.skip("needs a second device type (CUDA) to mix")
    with pytest.raises(ValueError, match="one device"):
        kernels.attention(q, k.cpu(), v.cpu())


# ------------------------------------------------------------------------------------------
# PyTorch fallback (CPU tensors without Triton's interpreter) and fuzzing
# ------------------------------------------------------------------------------------------
def test_cpu_fallback_same_semantics(monkeypatch):
    q, k, v = (t.cpu() for t in make_qkv(2, 2, 21, 30, 16, torch.float32))
    expected = kernels.attention(q, k, v, dropout_p=0.3, seed=11)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = kernels.attention(q, k, v, dropout_p=0.3, seed=11)
    assert any("fallback" in str(w.message) for w in caught)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_len,k_len,causal,p", [(21, 13, True, 0.0), (13, 21, True, 0.3),
                                                  (9, 9, False, 0.2)])
def test_cpu_fallback_gradients(monkeypatch, q_len, k_len, causal, p):
    """The fallback's backward (explicit formulas: custom-op bodies run without autograd)
    matches float64 autograd through the oracle with the same dropout mask."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", True)
    q, k, v = (t.cpu().requires_grad_() for t in make_qkv(2, 3, q_len, k_len, 8, torch.float32))
    out = kernels.attention(q, k, v, causal=causal, dropout_p=p, seed=5)
    grad = torch.randn_like(out)
    out.backward(grad)
    keep = reference.dropout_keep_mask(5, 2, 3, q_len, k_len, p) if p else None
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q64, k64, v64, causal=causal, dropout_p=p, keep_mask=keep)
    ref.backward(grad.double())
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(b=st.integers(1, 2), h=st.integers(1, 2), q_len=st.integers(1, 40),
       k_len=st.integers(1, 40), d=st.sampled_from([4, 16, 24, 32, 48]),
       causal=st.booleans(), dtype=st.sampled_from(DTYPES),
       layout=st.sampled_from(["bhsd", "bshd", "strided_d", "sliced"]),
       dropout=st.sampled_from([0.0, 0.2]))
def test_fuzz(b, h, q_len, k_len, d, causal, dtype, layout, dropout):
    check_parity(*make_qkv(b, h, q_len, k_len, d, dtype, layout=layout), causal=causal,
                 dropout_p=dropout, seed=77 if dropout else None)


def test_interpreter_set_after_import_says_what_to_do():
    """TRITON_INTERPRET set after `import kernels`: a clear error, not Triton's "0 active
    drivers". A fresh interpreter, since this process imported kernels interpreted."""
    script = ("import os, torch, kernels\n"
              "os.environ['TRITON_INTERPRET'] = '1'\n"
              "q = torch.randn(1, 1, 4, 16)\n"
              "kernels.attention(q, q, q)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert "before the first `import kernels`" in run.stderr, run.stderr[-2000:]


def test_double_backward_says_unsupported():
    """A gradient of a gradient raises an error naming kernels.attention and the way out,
    instead of PyTorch's message for library authors; first-order gradients with
    create_graph=True are still right."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 9, 9, 16, torch.float32))
    out = kernels.attention(q, k, v)
    dq, = torch.autograd.grad(out.sum(), q, create_graph=True)
    plain, = torch.autograd.grad(kernels.attention(q, k, v).sum(), q)
    assert torch.equal(dq, plain)
    with pytest.raises(RuntimeError, match="double backward .* of kernels.attention is not "
                                           "supported"):
        torch.autograd.grad(dq.sum(), (q, k))
