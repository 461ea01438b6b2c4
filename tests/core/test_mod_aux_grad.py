"""Gradients into ``mod_aux``: a score mod that declares differentiable aux entries
(``ScoreMod(..., aux_grad=, grad_aux=)``, kernels/core/mods.py) gives them their gradient on
every route -- the eager fast path, torch.compile (the custom ops), packed sequences and the
PyTorch fallback -- against the float64 oracle (``reference.attention`` differentiates the
twin in the aux tensors) with the parity rule. The example is a relative-position bias table
(heads, 2R + 1) and learned per-head ALiBi slopes in one mod."""
import pytest
import torch
import triton
import triton.language as tl

import kernels
import reference
from kernels import ScoreMod
from tests.helpers import DEVICE, GRAD_FACTOR, assert_parity, randn

R = 4                  # distances clipped to [-R, R]
WIDTH = 2 * R + 1


@triton.jit
def _rel_alibi(s, b, h, q_idx, kv_idx, aux):
    """s + bias[h, clamp(kv - q, -R, R) + R] - slope[h] * |q - kv|."""
    d = tl.minimum(tl.maximum(kv_idx - q_idx, -4), 4) + 4
    dist = tl.abs(q_idx - kv_idx).to(tl.float32)
    return s + tl.load(aux[0] + h * 9 + d) - tl.load(aux[1] + h) * dist


@triton.jit
def _rel_alibi_aux_grad(ds, s, b, h, q_idx, kv_idx, aux, daux):
    # d/d bias[h, d] = Σ ds over the pairs at that clipped distance: one atomic per score.
    d = tl.minimum(tl.maximum(kv_idx - q_idx, -4), 4) + 4
    tl.atomic_add(daux[0] + h * 9 + d, ds)
    # d/d slope[h] = -Σ ds · |q - kv|: the tile's sum first, then one atomic.
    dist = tl.abs(q_idx - kv_idx).to(tl.float32)
    tl.atomic_add(daux[1] + h, -tl.sum(tl.sum(ds * dist, 1), 0))


def _rel_alibi_torch(s, b, h, q_idx, kv_idx, aux):
    d = (kv_idx - q_idx).clamp(-R, R) + R
    bias = aux[0].reshape(-1)[h * WIDTH + d]
    slope = aux[1].reshape(-1)[h]
    return s + bias.to(s.dtype) - slope.to(s.dtype) * (q_idx - kv_idx).abs().to(s.dtype)


REL_ALIBI = ScoreMod("tests.rel_alibi_learned", _rel_alibi, _rel_alibi_torch,
                     aux_grad=_rel_alibi_aux_grad, grad_aux=(0, 1))


def _aux(hq):
    bias = (randn(hq, WIDTH) * 0.5).requires_grad_()
    slopes = (torch.rand(hq, device=DEVICE) * 0.3).requires_grad_()
    return bias, slopes


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do, allow_unused=True)


def _oracle(fn, inputs, do):
    """(float64 grads, fp32 grads) of ``fn(*inputs)`` (the parity rule's two references)."""
    refs = []
    for upcast in (True, False):
        ins = [t.detach().double() if upcast else t.detach().clone() for t in inputs]
        ins = [t.requires_grad_() for t in ins]
        o = fn(*ins, upcast=upcast)
        refs.append(_grads(o, ins, do.to(o.dtype)))
    return refs


def _check_grads(grads, refs, names):
    rg, lg = refs
    for name, g, r, l in zip(names, grads, rg, lg):
        if name is None:
            continue
        assert g is not None, f"{name}: no gradient"
        assert_parity(g, r.float(), l, factor=GRAD_FACTOR, name=name)


def _dense_case(b=2, hq=4, hkv=2, q_len=19, k_len=23, d=16, causal=True, dropout_p=0.0,
                seed=None, fn=None):
    """kernels.attention (or ``fn``) with REL_ALIBI vs the oracle: dq, dk, dv, dbias, dslopes."""
    q = randn(b, hq, q_len, d, requires_grad=True)
    k = randn(b, hkv, k_len, d, requires_grad=True)
    v = randn(b, hkv, k_len, d, requires_grad=True)
    bias, slopes = _aux(hq)
    inputs = (q, k, v, bias, slopes)
    keep = (reference.dropout_keep_mask(seed, b, hq, q_len, k_len, dropout_p, device=DEVICE)
            if dropout_p else None)

    def ours(q, k, v, bias, slopes):
        return kernels.attention(q, k, v, causal=causal, dropout_p=dropout_p, seed=seed,
                                 score_mod=REL_ALIBI, mod_aux=(bias, slopes))

    out = (fn or ours)(*inputs)
    do = randn(*out.shape)
    grads = _grads(out, inputs, do)

    def oracle(q, k, v, bias, slopes, upcast):
        return reference.attention(q, k, v, causal=causal, dropout_p=dropout_p, keep_mask=keep,
                                   upcast=upcast, score_mod=_rel_alibi_torch,
                                   mod_aux=(bias, slopes))

    refs = _oracle(oracle, inputs, do)
    _check_grads(grads, refs, ("dq", "dk", "dv", "dbias", "dslopes"))
    return grads


@pytest.mark.parametrize("causal", [True, False])
def test_bias_and_slopes_grads(causal):
    """Eager fast path, grouped-query heads (4 query heads on 2 kv heads)."""
    _dense_case(causal=causal)


def test_grads_with_dropout():
    """Dropout: dS of the dropped pairs still reaches the bias (the softmax's coupling)."""
    _dense_case(causal=True, dropout_p=0.3, seed=123, q_len=17, k_len=17)


def test_qkv_grads_stay_bit_reproducible():
    """Only d(aux) sums by atomics: dq, dk, dv of two identical backward passes are equal bit
    for bit, and equal to those of the same call with the aux frozen (no aux_grad compiled)."""
    q, k, v = (randn(1, 2, 21, 16, requires_grad=True) for _ in range(3))
    bias, slopes = _aux(2)
    do = randn(1, 2, 21, 16)
    runs = []
    for aux in ((bias, slopes), (bias, slopes), (bias.detach(), slopes.detach())):
        out = kernels.attention(q, k, v, score_mod=REL_ALIBI, mod_aux=aux)
        runs.append(_grads(out, (q, k, v), do))
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0], runs[2]):
        assert torch.equal(a, b)


def test_only_one_entry_requires_grad():
    """slopes detached: bias gets its gradient, the slopes none (their buffer is scratch)."""
    q, k, v = (randn(1, 2, 13, 16, requires_grad=True) for _ in range(3))
    bias, slopes = _aux(2)
    slopes = slopes.detach()
    out = kernels.attention(q, k, v, score_mod=REL_ALIBI, mod_aux=(bias, slopes))
    do = randn(*out.shape)
    (dbias,) = _grads(out, (bias,), do)
    rb = bias.detach().double().requires_grad_()
    ro = reference.attention(q.detach().double(), k.detach().double(), v.detach().double(),
                             score_mod=_rel_alibi_torch, mod_aux=(rb, slopes.double()))
    (r,) = _grads(ro, (rb,), do.double())
    lb = bias.detach().clone().requires_grad_()
    lo = reference.attention(q.detach(), k.detach(), v.detach(), upcast=False,
                             score_mod=_rel_alibi_torch, mod_aux=(lb, slopes))
    (low,) = _grads(lo, (lb,), do)
    assert_parity(dbias, r.float(), low, factor=GRAD_FACTOR, name="dbias")


def test_aux_only_requires_grad():
    """Gradients flow into the aux alone (q, k, v frozen): the autograd path still runs."""
    q, k, v = (randn(1, 2, 13, 16) for _ in range(3))
    bias, slopes = _aux(2)
    out = kernels.attention(q, k, v, score_mod=REL_ALIBI, mod_aux=(bias, slopes))
    out.sum().backward()
    assert bias.grad is not None and slopes.grad is not None
    assert bias.grad.abs().sum() > 0


def test_varlen():
    """Packed sequences: positions count within each sequence, the table is shared."""
    cu = torch.tensor([0, 7, 20, 26], dtype=torch.int32, device=DEVICE)
    q, k, v = (randn(26, 2, 16, requires_grad=True) for _ in range(3))
    bias, slopes = _aux(2)
    inputs = (q, k, v, bias, slopes)
    out = kernels.attention_varlen(q, k, v, cu, cu, causal=True, score_mod=REL_ALIBI,
                                   mod_aux=(bias, slopes))
    do = randn(*out.shape)
    grads = _grads(out, inputs, do)

    def oracle(q, k, v, bias, slopes, upcast):
        return reference.attention_varlen(q, k, v, cu, cu, causal=True, upcast=upcast,
                                          score_mod=_rel_alibi_torch, mod_aux=(bias, slopes))

    _check_grads(grads, _oracle(oracle, inputs, do),
                 ("dq", "dk", "dv", "dbias", "dslopes"))


def test_compiled_fullgraph():
    """torch.compile(fullgraph=True) (the custom ops; aot_eager on CPU) gives them too."""
    def f(q, k, v, bias, slopes):
        return kernels.attention(q, k, v, causal=True, score_mod=REL_ALIBI,
                                 mod_aux=(bias, slopes))

    backend = "aot_eager" if DEVICE == "cpu" else "inductor"
    _dense_case(b=1, hq=2, hkv=1, q_len=13, k_len=13,
                fn=torch.compile(f, fullgraph=True, backend=backend))


def _fallback(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", True)


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_fallback(monkeypatch, dropout_p):
    """The PyTorch fallback (interpreter off at call time), eager: the twin differentiated in
    the aux entries."""
    _fallback(monkeypatch)
    _dense_case(causal=True, dropout_p=dropout_p, seed=7)


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
def test_fallback_compiled(monkeypatch):
    """The fallback run from inside the custom op (torch.compile), where autograd's dispatch
    keys are excluded: dq, dk and the aux gradients still right."""
    _fallback(monkeypatch)

    def f(q, k, v, bias, slopes):
        return kernels.attention(q, k, v, causal=False, score_mod=REL_ALIBI,
                                 mod_aux=(bias, slopes))

    _dense_case(b=1, hq=2, hkv=1, q_len=13, k_len=11, causal=False,
                fn=torch.compile(f, fullgraph=True, backend="aot_eager"))


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
def test_fallback_varlen(monkeypatch):
    _fallback(monkeypatch)
    test_varlen()


def test_errors():
    q, k, v = (randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    bias, slopes = _aux(2)
    with pytest.raises(ValueError, match=r"mod_aux\[0\] is differentiable: expected a "
                                         r"contiguous float32 tensor, got torch.float64"):
        kernels.attention(q, k, v, score_mod=REL_ALIBI,
                          mod_aux=(bias.detach().double().requires_grad_(), slopes))
    with pytest.raises(ValueError, match="not contiguous"):
        kernels.attention(q, k, v, score_mod=REL_ALIBI,
                          mod_aux=(randn(WIDTH, 2, requires_grad=True).t(), slopes))
    # A mod without declared gradients: an aux that requires grad is refused, not ignored.
    plain = ScoreMod("tests.rel_alibi_frozen", _rel_alibi, _rel_alibi_torch)
    with pytest.raises(ValueError, match=r"mod_aux\[1\] requires grad but ScoreMod "
                                         r"'tests.rel_alibi_frozen' declares no gradient"):
        kernels.attention(q, k, v, score_mod=plain, mod_aux=(bias.detach(), slopes))
    with pytest.raises(ValueError, match="aux_grad and grad_aux come together"):
        ScoreMod("tests.bad1", _rel_alibi, _rel_alibi_torch, grad_aux=(0,))
    with pytest.raises(TypeError, match="grad_aux must be a tuple of distinct indices"):
        ScoreMod("tests.bad2", _rel_alibi, _rel_alibi_torch, aux_grad=_rel_alibi_aux_grad,
                 grad_aux=(0, 0))
