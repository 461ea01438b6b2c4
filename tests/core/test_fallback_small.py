"""The fallback's small-problem route with dropout (kernels/core/fallback.py ``_small_forward``):
whole score matrices, the kernels' Philox mask drawn once; on the eager autograd path its ops
are recorded by autograd (``forward_recorded``), which differentiates them.

* its results against the float64 oracle given the kernels' mask (``reference.dropout_keep_mask``,
  itself held to the interpreted kernel in test_fallback_philox.py) and against the blockwise
  path;
* the recorded backward (the eager autograd path) equal, to fp32 rounding, to the
  blockwise one that ``kernels.ops.forward_with_lse`` / ``backward`` run (they keep nothing,
  and ``backward`` takes the (out, lse) it is given);
* what takes the route: problems above ``_SAVED_ELEMS`` scores keep nothing (O(seq) memory),
  and NaN inputs, rows without keys, windows and packed sequences go blockwise.
"""
import pytest
import torch
from helpers import DEVICE, randn

import kernels
import reference
from kernels import ops
from kernels.core import dropout, fallback, native
from kernels.core.call import AttentionCall

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")

SEED, P = 2**40 + 3, 0.3
# (batch, query heads, kv heads, q_len, k_len, causal, v head_dim)
CASES = [
    (2, 4, 2, 19, 37, True, 16),    # grouped-query heads, q_len < k_len (bottom-right)
    (1, 3, 1, 24, 24, True, 24),    # one kv head, v's head_dim of its own
    (2, 2, 2, 13, 30, False, 16),
]
IDS = ["gqa-causal-rect", "mqa-square-dv", "full"]


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", True)


def _inputs(B, hq, hkv, q_len, k_len, dv, dtype=torch.float32):
    q = randn(B, hq, q_len, 16, dtype=dtype, requires_grad=True)
    k = randn(B, hkv, k_len, 16, dtype=dtype, requires_grad=True)
    v = randn(B, hkv, k_len, dv, dtype=dtype, requires_grad=True)
    return q, k, v, randn(B, hq, q_len, dv, dtype=dtype)


def _eager(q, k, v, do, causal):
    """(out, lse, dq, dk, dv) through ``kernels.attention``'s autograd (the eager plan)."""
    out, lse = kernels.attention(q, k, v, causal=causal, dropout_p=P, seed=SEED,
                                 return_lse=True)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), do))


@pytest.mark.parametrize("B,hq,hkv,q_len,k_len,causal,dv", CASES, ids=IDS)
def test_small_route_is_the_oracle_with_the_kernels_mask(B, hq, hkv, q_len, k_len, causal, dv):
    q, k, v, do = _inputs(B, hq, hkv, q_len, k_len, dv)
    assert fallback._small_applies(q, k, v, None, AttentionCall(causal, 0.25, P))
    out, lse, *grads = _eager(q, k, v, do, causal)
    keep = reference.dropout_keep_mask(SEED, B, hq, q_len, k_len, P, device=DEVICE)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, causal=causal, dropout_p=P, keep_mask=keep)
    ref_g = torch.autograd.grad(ref, leaves, do.double())
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_g)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5, msg=name)
    # The mask alone: with q = 0 (uniform weights) and v = identity, out != 0 exactly where a
    # seen key is kept.
    qz = torch.zeros(B, hq, q_len, k_len)
    eye = torch.eye(k_len).expand(B, hkv, k_len, k_len).contiguous()
    kept = kernels.attention(qz, randn(B, hkv, k_len, k_len), eye, causal=causal, dropout_p=P,
                             seed=SEED) != 0
    vis = fallback.block_visible(0, q_len, 0, k_len, q_len, k_len, causal, None, DEVICE)
    assert torch.equal(kept, keep & vis)


@pytest.mark.parametrize("B,hq,hkv,q_len,k_len,causal,dv", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_route_matches_the_blockwise_path(monkeypatch, B, hq, hkv, q_len, k_len, causal,
                                                dv, dtype):
    q, k, v, do = _inputs(B, hq, hkv, q_len, k_len, dv, dtype)
    small = _eager(q, k, v, do, causal)
    monkeypatch.setattr(fallback, "_SAVED_ELEMS", 0)
    blockwise = _eager(q, k, v, do, causal)
    tol = dict(rtol=0, atol=2e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), small, blockwise):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), msg=name, **tol)


def _recorded(out):
    """Whether autograd recorded the fallback's aten ops for ``out`` (``forward_recorded``),
    rather than the eager path's autograd.Function around the blockwise path."""
    return type(out.grad_fn).__name__ != "_PlannedAttentionBackward"


@pytest.mark.parametrize("B,hq,hkv,q_len,k_len,causal,dv", CASES, ids=IDS)
def test_kept_weights_backward_is_the_blockwise_one(B, hq, hkv, q_len, k_len, causal, dv):
    """The eager autograd path records the small route's ops (autograd keeps P · keep);
    ``ops.forward_with_lse`` gives the same bits, and ``ops.backward`` (which keeps nothing
    and must take the (out, lse) it is given: ring attention passes merged ones) the same
    gradients through the blockwise path, to fp32 rounding (v's head_dim that of q:
    ``ops.backward`` takes no other)."""
    q, k, v, do = _inputs(B, hq, hkv, q_len, k_len, 16)
    out, lse = kernels.attention(q, k, v, causal=causal, dropout_p=P, seed=SEED,
                                 return_lse=True)
    assert _recorded(out)
    kept = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out2, lse2 = ops.forward_with_lse(qd, kd, vd, causal=causal, dropout_p=P, seed=SEED)
    recomputed = ops.backward(do, qd, kd, vd, out2, lse2, causal=causal, dropout_p=P,
                              seed=SEED)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    for name, a, b in zip(("dq", "dk", "dv"), kept, recomputed):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5, msg=name)


def test_big_problems_keep_nothing(monkeypatch):
    """Above ``_SAVED_ELEMS`` score elements (batch * heads * q_len * k_len) nothing is kept
    for the backward: the blockwise path, O(seq) memory; at or below, the weights are."""
    q, k, v, do = _inputs(1, 2, 2, 16, 16, 16)   # 512 score elements
    monkeypatch.setattr(fallback, "_SAVED_ELEMS", 511)
    call = AttentionCall(True, 0.25, P, SEED)
    assert not fallback._small_applies(q, k, v, None, call)
    assert fallback.forward_recorded(q, k, v, call) is None
    out = kernels.attention(q, k, v, dropout_p=P, seed=SEED)
    assert not _recorded(out)   # the blockwise path, through the autograd.Function
    big = torch.autograd.grad(out, (q, k, v), do)
    monkeypatch.setattr(fallback, "_SAVED_ELEMS", 512)
    out = kernels.attention(q, k, v, dropout_p=P, seed=SEED)
    assert _recorded(out)
    small = torch.autograd.grad(out, (q, k, v), do)
    for name, a, b in zip(("dq", "dk", "dv"), small, big):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5, msg=name)


def test_what_takes_the_small_route():
    q, k, v, _ = _inputs(1, 2, 2, 16, 16, 16)
    q, k, v = (t.detach() for t in (q, k, v))
    drop = AttentionCall(True, 0.25, P)
    assert fallback._small_applies(q, k, v, None, drop)
    assert not fallback._small_applies(q, k, v, None, AttentionCall(True, 0.25))  # no dropout
    assert not fallback._small_applies(q, k, v, None, AttentionCall(True, 0.25, P, window=4))
    # A row that sees no key (causal, q_len > k_len): zeros and lse -inf, the blockwise path's.
    assert not fallback._small_applies(q, k[:, :, :8], v[:, :, :8], None, drop)
    # NaN or infinity in, anywhere in q, k or v: the output is not finite, and the call takes
    # the blockwise path, whose NaN rules are the kernels'.
    seeded = AttentionCall(True, 0.25, P, SEED)
    assert fallback._small_forward(q, k, v, seeded, None) is not None
    for i in range(3):
        for bad in (float("nan"), float("inf"), -float("inf")):
            qkv = [q, k, v]
            qkv[i] = qkv[i].clone()
            qkv[i][0, 1, 15 if i else 3, 1] = bad   # the last key: seen by the last row only
            assert fallback._small_forward(*qkv, seeded, None) is None
            assert fallback.forward_recorded(*qkv, seeded) is None
    cu = torch.tensor([0, 16], dtype=torch.int32)
    assert not fallback._small_applies(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                       v[0].transpose(0, 1), cu, drop)


def test_cached_causal_mask_index_gives_the_same_bits():
    """``_causal_keep`` caches which Philox counters a small causal block draws (by layout):
    the cached and the fresh draw are equal, and the kernels' mask (the oracle's) where keys are
    seen (unseen columns of a partly seen 4-column group carry their drawn bits)."""
    B, H, q_len, k_len = 2, 3, 10, 14
    bases, groups = torch.arange(B * H) * q_len, (k_len + 3) // 4
    fallback._COUNTERS.clear()
    masks = []
    for _ in range(2):
        out = torch.empty(B * H * q_len, k_len, dtype=torch.bool)
        masks.append(fallback._causal_keep(SEED, bases, 0, q_len, k_len - q_len, 0, k_len, 0, P,
                                           groups, out))
        assert len(fallback._COUNTERS) == 1
    vis = fallback.block_visible(0, q_len, 0, k_len, q_len, k_len, True, None, DEVICE)
    keep = reference.dropout_keep_mask(SEED, B, H, q_len, k_len, P, device=DEVICE)
    assert torch.equal(masks[0], masks[1])
    got = masks[0].view(B, H, q_len, k_len) & vis
    assert torch.equal(got, keep & vis)


@pytest.mark.parametrize("B,hq,hkv,q_len,k_len,causal,dv", CASES, ids=IDS)
def test_small_route_without_the_compiled_mask(monkeypatch, B, hq, hkv, q_len, k_len, causal,
                                               dv):
    """Where the compiled mask loop is not built (no C compiler), the NumPy or PyTorch twin
    draws the same scaled mask: the same bits out and in every gradient."""
    q, k, v, do = _inputs(B, hq, hkv, q_len, k_len, dv)
    compiled = _eager(q, k, v, do, causal)
    monkeypatch.setattr(native, "_STATE", {"fn": None})
    for impl in ("numpy", "torch"):
        if impl == "torch":
            monkeypatch.setattr(dropout, "_np", None)
        twin = _eager(q, k, v, do, causal)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), twin, compiled):
            assert torch.equal(a, b), (impl, name)
