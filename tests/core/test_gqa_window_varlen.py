"""Grouped-query heads, sliding windows and packed variable-length sequences, end to end.

Forward and gradients of ``kernels.attention`` / ``kernels.attention_varlen`` against the
float64 oracle (``reference.attention`` / ``reference.attention_varlen``) with FlashAttention's
budget rule (helpers.assert_parity) plus the FA-2 allowance derived in float64
(helpers.fa2_oracle). On CPU every case runs the real kernels in Triton's interpreter.
"""
import math
import warnings

import pytest
import torch
from helpers import (DEVICE, GRAD_FACTOR, assert_parity, check_dense, fa2_oracle, grads_of,
                     randn)

import kernels
import reference

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


# ------------------------------------------------------------------------------------------
# Grouped-query / multi-query heads
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hq,hkv,q_len,k_len,dtype", [
    (4, 4, 17, 17, F16),        # ratio 1 (plain multi-head)
    (4, 2, 97, 64, BF16),       # ratio 2, q_len > k_len: rows without keys
    (4, 1, 17, 97, F32),        # multi-query, q_len < k_len
    (8, 2, 64, 64, F16),        # ratio 4
    (6, 3, 1, 33, BF16),        # one query row (decoding)
], ids=lambda x: str(x).replace("torch.", ""))
def test_gqa_parity(hq, hkv, q_len, k_len, dtype):
    check_dense(2, hq, hkv, q_len, k_len, 40, dtype)


def test_gqa_dropout_is_repeated_kv_bit_for_bit():
    """Query head h of a GQA call uses the dense rule's mask of head b * heads_q + h: the output
    equals the kernel on repeat_interleave'd k, v bit for bit (same mask, same arithmetic), and
    the gradients match the oracle under reference.dropout_keep_mask."""
    b, hq, hkv, q_len, k_len, d = 2, 4, 2, 33, 40, 16
    q = randn(b, hq, q_len, d, dtype=F16)
    k, v = randn(b, hkv, k_len, d, dtype=F16), randn(b, hkv, k_len, d, dtype=F16)
    gqa = kernels.attention(q, k, v, dropout_p=0.3, seed=2024)
    rep = kernels.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                            dropout_p=0.3, seed=2024)
    assert torch.equal(gqa, rep)
    check_dense(b, hq, hkv, q_len, k_len, d, F16, dropout_p=0.3, seed=2024)


def test_gqa_backward_bit_identical_reruns():
    """dK/dV of a kv head sum its query heads in a fixed order (no atomics)."""
    q = randn(1, 8, 45, 32, dtype=BF16, requires_grad=True)
    k = randn(1, 2, 45, 32, dtype=BF16, requires_grad=True)
    v = randn(1, 2, 45, 32, dtype=BF16, requires_grad=True)
    do = randn(1, 8, 45, 32, dtype=BF16)
    runs = [grads_of(kernels.attention(q, k, v, dropout_p=0.2, seed=7, window=20), (q, k, v), do)
            for _ in range(2)]
    for first, second in zip(*runs):
        assert torch.equal(first, second)


# ------------------------------------------------------------------------------------------
# Sliding window
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window,hq,hkv,q_len,k_len,dtype", [
    (1, 2, 2, 40, 40, F32),       # each row sees only itself
    (3, 4, 2, 64, 97, F16),       # q_len < k_len, GQA
    (16, 2, 1, 97, 64, BF16),     # q_len > k_len (rows without keys), MQA
    (16, 2, 2, 200, 200, F16),    # many tiles: left-edge, unmasked and diagonal loops
    (150, 2, 2, 17, 97, F32),     # window > q_len but < k_len
    (500, 2, 1, 33, 64, BF16),    # window > k_len: plain causal
], ids=lambda x: str(x).replace("torch.", ""))
def test_window_parity(window, hq, hkv, q_len, k_len, dtype):
    check_dense(1, hq, hkv, q_len, k_len, 32, dtype, window=window)


def test_window_with_dropout():
    check_dense(1, 4, 2, 70, 90, 16, F16, window=9, dropout_p=0.25, seed=99)


@pytest.mark.parametrize("q_len,k_len", [(64, 64), (37, 80), (80, 37)])
def test_window_at_least_k_len_is_causal(q_len, k_len):
    q, k, v = (randn(1, 2, n, 16) for n in (q_len, k_len, k_len))
    causal = kernels.attention(q, k, v)
    for window in (k_len, k_len + 5, 10 ** 6):
        assert torch.equal(kernels.attention(q, k, v, window=window), causal)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")  # the poisoned rows' row max
def test_window_skips_tiles_outside_the_band():
    """Keys far outside the band are NaN in k and v: a kernel that visits their tiles, even
    masked, spreads NaN (0 * NaN in the P @ V and dS products). Rows and keys at least two of
    the largest GPU tiles (2 x 128) from the poison stay finite and match the oracle; rows
    whose band reaches the poison legitimately see it."""
    n, window, d = 1024, 16, 16
    p0, p1 = 384, 400                                   # poisoned keys [p0, p1)
    q = randn(1, 2, n, d, requires_grad=True)
    k_clean, v_clean = randn(1, 1, n, d), randn(1, 1, n, d)
    k, v = k_clean.clone(), v_clean.clone()
    k[:, :, p0:p1] = float("nan")
    v[:, :, p0:p1] = float("nan")
    k.requires_grad_()
    v.requires_grad_()
    do = randn(1, 2, n, d)
    out = kernels.attention(q, k, v, window=window)
    dq, dk, dv = grads_of(out, (q, k, v), do)

    far = 2 * 128
    # Rows i >= p1 + window - 1 no longer see the poison; keys j < p0 - window + 1 are seen only
    # by rows before the poison's own rows.
    row_ok = slice(p1 + window - 1 + far, n)
    key_ok = slice(0, p0 - window + 1 - far)
    # The oracle gets the clean keys: far rows and keys must not depend on the poison at all.
    leaves = [t.detach().requires_grad_() for t in (q, k_clean, v_clean)]
    ref = reference.attention(*leaves, window=window)
    assert torch.isnan(out[:, :, p0:p1]).all()        # the poison is real
    assert torch.isfinite(out[:, :, row_ok]).all()
    assert torch.isfinite(dq[:, :, row_ok]).all()
    assert torch.isfinite(dk[:, :, key_ok]).all() and torch.isfinite(dv[:, :, key_ok]).all()
    torch.testing.assert_close(out[:, :, row_ok].double(), ref[:, :, row_ok], rtol=0, atol=1e-5)
    ref_dq, ref_dk, ref_dv = grads_of(ref, leaves, do)
    for got, want, sl in ((dq, ref_dq, row_ok), (dk, ref_dk, key_ok), (dv, ref_dv, key_ok)):
        torch.testing.assert_close(got[:, :, sl].double(), want[:, :, sl].double(), rtol=0,
                                   atol=1e-5)


# ------------------------------------------------------------------------------------------
# Packed variable-length sequences
# ------------------------------------------------------------------------------------------
LENS_Q = [1, 17, 64, 0, 5, 97]
LENS_K_SAME = LENS_Q
LENS_K_OTHER = [3, 17, 30, 4, 0, 97]   # q_len > k_len, < k_len, a sequence without keys


def _cu(lengths):
    return torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)


def _packed(lens_q, lens_k, hq, hkv, d, dtype):
    q = randn(sum(lens_q), hq, d, dtype=dtype, requires_grad=True)
    k = randn(sum(lens_k), hkv, d, dtype=dtype, requires_grad=True)
    v = randn(sum(lens_k), hkv, d, dtype=dtype, requires_grad=True)
    do = randn(sum(lens_q), hq, d, dtype=dtype)
    return q, k, v, do


def _seq(x, cu, s):
    """Rows of sequence s of a packed (total, heads, d) tensor as (1, heads, len, d)."""
    return x[cu[s]:cu[s + 1]].transpose(0, 1).unsqueeze(0)


def check_varlen(lens_q, lens_k, hq, hkv, d, dtype, *, causal=True, window=None, dropout_p=0.0,
                 seed=None):
    q, k, v, do = _packed(lens_q, lens_k, hq, hkv, d, dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse = kernels.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window,
                                        dropout_p=dropout_p, seed=seed, return_lse=True)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0]) and lse.dtype == F32
    grads = grads_of(out, (q, k, v), do)
    keeps = None
    if dropout_p > 0:
        keeps = reference.dropout_keep_mask_varlen(seed, cu_q, cu_k, hq, dropout_p,
                                                   device=DEVICE)
    kw = dict(causal=causal, window=window, dropout_p=dropout_p, keep_masks=keeps)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = reference.attention_varlen(*leaves, cu_q, cu_k, upcast=True, **kw)
    ref_grads = grads_of(ref, leaves, do)
    lowp = reference.attention_varlen(*leaves, cu_q, cu_k, upcast=False, **kw)
    lowp_grads = grads_of(lowp, leaves, do)
    assert_parity(out, ref, lowp)

    # The FA-2 allowance, sequence by sequence, each gradient's worst case.
    extra = [0.0, 0.0, 0.0]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for s in range(len(lens_q)):
        if lens_q[s] == 0 or lens_k[s] == 0:
            continue
        seq = [_seq(t.detach(), c, s) for t, c in ((q, cq), (k, ck), (v, ck), (do, cq),
                                                    (out, cq))]
        lse_s = lse[:, cq[s]:cq[s + 1]].unsqueeze(0)
        given_o, noise = fa2_oracle(*seq, lse_s, causal=causal, softmax_scale=1 / math.sqrt(d),
                                    dropout_p=dropout_p, window=window,
                                    keep_mask=None if keeps is None else keeps[s][None])
        for i, (r, c) in enumerate(((ref_grads[0], cq), (ref_grads[1], ck), (ref_grads[2], ck))):
            inherited = (given_o[i] - _seq(r, c, s)).abs().max().item()
            extra[i] = max(extra[i], inherited + noise[i])
    for name, g, r, lp, e in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads, extra):
        assert_parity(g, r, lp, factor=GRAD_FACTOR, extra=e, name=name)
    return (q, k, v, do), out, lse, grads


@pytest.mark.parametrize("lens_k,causal,hq,hkv,window,dtype", [
    (LENS_K_SAME, True, 2, 2, None, F16),
    (LENS_K_OTHER, True, 4, 2, None, BF16),
    (LENS_K_OTHER, False, 2, 1, None, F32),
    (LENS_K_SAME, True, 4, 1, 8, F16),
    (LENS_K_OTHER, True, 2, 2, 3, F32),
], ids=["same-causal", "other-causal-gqa", "other-full-mqa", "same-window-mqa",
        "other-window"])
def test_varlen_parity(lens_k, causal, hq, hkv, window, dtype):
    check_varlen(LENS_Q, lens_k, hq, hkv, 16, dtype, causal=causal, window=window)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 5)])
def test_varlen_sequence_equals_dense_alone(causal, window):
    """Without dropout, every packed sequence's output, lse and gradients are bit-identical to
    the dense kernel run on that sequence alone (same tiles, same arithmetic)."""
    q, k, v, do = _packed(LENS_Q, LENS_K_OTHER, 4, 2, 24, F16)
    out, lse = kernels.attention_varlen(q, k, v, _cu(LENS_Q), _cu(LENS_K_OTHER), causal=causal,
                                        window=window, return_lse=True)
    grads = grads_of(out, (q, k, v), do)
    cq, ck = _cu(LENS_Q).tolist(), _cu(LENS_K_OTHER).tolist()
    for s in range(len(LENS_Q)):
        seq = [_seq(t.detach(), c, s).requires_grad_() for t, c in ((q, cq), (k, ck), (v, ck))]
        o_s, lse_s = kernels.attention(*seq, causal=causal, window=window, return_lse=True)
        assert torch.equal(_seq(out, cq, s), o_s)
        assert torch.equal(lse[:, cq[s]:cq[s + 1]], lse_s[0])
        if o_s.numel():
            g_s = grads_of(o_s, seq, _seq(do, cq, s))
            for g, c, gs in zip(grads, (cq, ck, ck), g_s):
                assert torch.equal(_seq(g, c, s), gs)


def test_varlen_backward_tiles_past_a_sequence_end_ignore_the_next():
    """The backward loads its row statistics (lse, delta) in whole tiles without a mask: a
    tile that runs past a sequence's last row must read that sequence's padding (P = 0), never
    the next sequence's rows. The next sequence here has lse ~ -400, so any of its rows read as
    a padding row of sequence 0 would make P = exp(0 + 400) overflow and turn the gradients of
    sequence 0 into NaN; they must instead equal sequence 0's run alone, bit for bit."""
    lens = [17, 40, 5]
    q, k, v, do = (t.detach().float() for t in _packed(lens, lens, 2, 2, 16, F32))
    u = torch.nn.functional.normalize(randn(16), dim=0)
    rows = slice(17, 57)
    q[rows] = 40 * u + 0.01 * q[rows]
    k[rows] = -40 * u + 0.01 * k[rows]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = _cu(lens)
    out, lse = kernels.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    assert lse[:, rows].max() < -350
    grads = grads_of(out, (q, k, v), do)
    assert all(torch.isfinite(g).all() for g in grads)
    cq = cu.tolist()
    seq = [_seq(t.detach(), cq, 0).requires_grad_() for t in (q, k, v)]
    o_0 = kernels.attention(*seq, causal=True)
    for g, g_0 in zip(grads, grads_of(o_0, seq, _seq(do, cq, 0))):
        assert torch.equal(_seq(g, cq, 0), g_0)


def test_varlen_dropout():
    """Each (sequence, head, row, column) has its own Philox word: the kernel's mask is
    reference.dropout_keep_mask_varlen's, checked through the oracle (forward and gradients),
    and reruns with the seed are bit-identical."""
    _, out, _, grads = check_varlen(LENS_Q, LENS_K_OTHER, 4, 2, 16, F16, dropout_p=0.3,
                                    seed=2 ** 40 + 3, window=40)
    assert torch.isfinite(out).all()


def test_varlen_single_sequence_mask_is_dense_batch_one():
    """One packed sequence reproduces the dense call with batch 1, dropout mask included."""
    q, k, v = randn(33, 2, 16), randn(50, 2, 16), randn(50, 2, 16)
    packed = kernels.attention_varlen(q, k, v, _cu([33]), _cu([50]), dropout_p=0.4, seed=5)
    dense = kernels.attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), dropout_p=0.4,
                              seed=5)
    assert torch.equal(packed, dense[0].transpose(0, 1))


def test_varlen_empty_sequences_give_zeros():
    lens_q, lens_k = [0, 4, 3], [2, 0, 3]
    q, k, v = randn(7, 2, 16), randn(5, 2, 16), randn(5, 2, 16)
    out, lse = kernels.attention_varlen(q, k, v, _cu(lens_q), _cu(lens_k), causal=False,
                                        return_lse=True)
    assert (out[0:4] == 0).all() and torch.isneginf(lse[:, 0:4]).all()
    assert torch.isfinite(out[4:]).all() and torch.isfinite(lse[:, 4:]).all()


def test_varlen_max_seqlen_hints():
    q, k, v = randn(30, 2, 16), randn(30, 2, 16), randn(30, 2, 16)
    cu = _cu([10, 20])
    want = kernels.attention_varlen(q, k, v, cu, cu)
    assert torch.equal(kernels.attention_varlen(q, k, v, cu, cu, 20, 20), want)
    assert torch.equal(kernels.attention_varlen(q, k, v, cu, cu, 64, 100), want)  # generous
    with pytest.raises(ValueError, match="max_seqlen_q=19 is smaller than the longest"):
        kernels.attention_varlen(q, k, v, cu, cu, 19, 20)
    with pytest.raises(ValueError, match="max_seqlen_k=5"):
        kernels.attention_varlen(q, k, v, cu, cu, None, 5)


def test_varlen_compiles_fullgraph():
    """A custom op: torch.compile(fullgraph=True) traces attention_varlen (aot_eager on CPU;
    the kernel runs at execution time) and matches eager forward and backward."""
    q, k, v, do = _packed([5, 0, 12], [7, 3, 12], 4, 2, 16, F32)
    cu_q, cu_k = _cu([5, 0, 12]), _cu([7, 3, 12])

    def f(q, k, v):
        return kernels.attention_varlen(q, k, v, cu_q, cu_k, 12, 12, window=4)

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if DEVICE == "cpu"
                             else "inductor")(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for a, b in zip(grads_of(compiled, (q, k, v), do), grads_of(eager, (q, k, v), do)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# PyTorch fallback (CPU tensors without the interpreter): the same semantics
# ------------------------------------------------------------------------------------------
def test_fallback_gqa_window_varlen(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("the fallback serves CPU tensors")
    q, k, v, do = _packed(LENS_Q, LENS_K_OTHER, 4, 2, 16, F32)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K_OTHER)
    qd, kd, vd = randn(2, 4, 37, 16), randn(2, 2, 50, 16), randn(2, 2, 50, 16)
    calls = [
        lambda: kernels.attention_varlen(q, k, v, cu_q, cu_k, window=6, dropout_p=0.3, seed=3),
        lambda: kernels.attention(qd, kd, vd, window=7, dropout_p=0.2, seed=8),
    ]
    for call in calls:
        expected = call()
        exp_grads = grads_of(expected, (q, k, v), do) if expected.dim() == 3 else None
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setattr("kernels.core.backend._warned_fallback", True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = call()
            got_grads = grads_of(got, (q, k, v), do) if got.dim() == 3 else None
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        if exp_grads is not None:
            for a, b in zip(got_grads, exp_grads):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Bad input: every case names the argument, what was expected and what was given
# ------------------------------------------------------------------------------------------
def _dense(hq=4, hkv=2, n=8):
    return randn(1, hq, n, 16), randn(1, hkv, n, 16), randn(1, hkv, n, 16)


@pytest.mark.parametrize("make,kw,err,match", [
    (lambda: _dense(4, 3), {}, ValueError, r"multiple of the key/value heads.*heads_q=4.*"
                                           r"heads_kv=3"),
    (lambda: (_dense()[0], _dense()[1], randn(1, 4, 8, 16)), {}, ValueError,
     "k and v must have the same shape"),
    (_dense, {"window": 4, "causal": False}, ValueError, "window requires causal=True"),
    (_dense, {"window": 0}, ValueError, "window must be >= 1"),
    (_dense, {"window": -3}, ValueError, "window must be >= 1"),
    (_dense, {"window": 2.0}, TypeError, "window must be an int"),
    (_dense, {"window": True}, TypeError, "window must be an int"),
], ids=["heads-not-multiple", "k-v-heads-differ", "window-not-causal", "window-0",
        "window-negative", "window-float", "window-bool"])
def test_dense_bad_input(make, kw, err, match):
    with pytest.raises(err, match=match):
        kernels.attention(*make(), **kw)


def _varlen_args(**over):
    args = dict(q=randn(10, 4, 16), k=randn(12, 2, 16), v=randn(12, 2, 16),
                cu_seqlens_q=_cu([4, 6]), cu_seqlens_k=_cu([5, 7]))
    args.update(over)
    return args


I64 = torch.int64


@pytest.mark.parametrize("over,err,match", [
    ({"cu_seqlens_q": _cu([4, 6]).to(I64)}, TypeError, "cu_seqlens_q must be int32"),
    ({"cu_seqlens_k": _cu([5, 7])[None]}, ValueError, r"cu_seqlens_k must be 1-D"),
    ({"cu_seqlens_q": [0, 4, 10]}, TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ({"cu_seqlens_q": None, "cu_seqlens_k": None}, TypeError,
     "cu_seqlens_q must be a torch.Tensor, got NoneType"),
    ({"cu_seqlens_q": torch.tensor([1, 4, 10], dtype=torch.int32, device=DEVICE)},
     ValueError, "cu_seqlens_q must start at 0, got 1"),
    ({"cu_seqlens_k": torch.tensor([0, 8, 5, 12], dtype=torch.int32, device=DEVICE),
      "cu_seqlens_q": _cu([4, 3, 3])}, ValueError, "cu_seqlens_k must be non-decreasing"),
    ({"cu_seqlens_q": _cu([4, 5])}, ValueError,
     r"cu_seqlens_q\[-1\] must equal the number of packed rows 10, got 9"),
    ({"cu_seqlens_k": _cu([12])}, ValueError, "same number of sequences, got 2 and 1"),
    ({"q": randn(1, 10, 4, 16)}, ValueError, r"q must be 3-D \(total_rows, heads, head_dim\)"),
    ({"k": randn(12, 3, 16), "v": randn(12, 3, 16)}, ValueError, "heads_q=4.*heads_kv=3"),
], ids=["cu-int64", "cu-2d", "cu-list", "cu-none", "cu-not-0", "cu-decreasing", "cu-last-total",
        "cu-count", "q-4d", "heads"])
def test_varlen_bad_input(over, err, match):
    with pytest.raises(err, match=match):
        kernels.attention_varlen(**_varlen_args(**over))


def test_varlen_cu_on_another_device():
    if DEVICE == "cpu":
        pytest.skip("needs a second device type (CUDA) to mix")
    with pytest.raises(ValueError, match="cu_seqlens_q must be on the tensors' device"):
        kernels.attention_varlen(**_varlen_args(cu_seqlens_q=_cu([4, 6]).cpu()))


# ------------------------------------------------------------------------------------------
# GPU: realistic sizes and the autotuned path
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,n,d,window,dtype", [
    (32, 8, 1024, 128, None, BF16),
    (16, 1, 777, 64, None, F16),
    (8, 2, 2048, 128, 256, BF16),
    (4, 4, 1500, 64, 1, F16),
])
def test_gqa_window_gpu(hq, hkv, n, d, window, dtype):
    check_dense(2, hq, hkv, n, n, d, dtype, window=window)


@pytest.mark.gpu
def test_varlen_gpu():
    lens = [1, 700, 1024, 0, 33, 2048, 129]
    check_varlen(lens, lens, 16, 4, 128, BF16, window=512, dropout_p=0.1, seed=12)
    check_varlen(lens, [n + 5 for n in lens], 8, 8, 64, F16, causal=False)


def test_varlen_cu_seqlens_made_in_inference_mode():
    """cu_seqlens made under torch.inference_mode (vLLM's metadata) have no version counter:
    the packed call reads them each time instead of caching their values by version (it raised
    "Inference tensors do not track version counter"), and an in-place change of their
    values between calls is seen."""
    total = 12
    q, k, v = (randn(total, 2, 16, dtype=F32) for _ in range(3))
    with torch.inference_mode():
        cu = torch.tensor([0, 5, total], dtype=torch.int32, device=DEVICE)
    for split in (5, 9):
        with torch.inference_mode():
            cu[1] = split
            out = kernels.attention_varlen(q, k, v, cu, cu)
        for lo, hi in ((0, split), (split, total)):
            ref = reference.attention(*(t[lo:hi].transpose(0, 1)[None] for t in (q, k, v)))
            torch.testing.assert_close(out[lo:hi], ref[0].transpose(0, 1).to(out.dtype),
                                       atol=1e-5, rtol=1e-5)
