"""kernels.flash_attn_interface: FlashAttention 2's functions on our kernels, each against the
float64 oracle (reference/) with the parity rule of tests/helpers.py, in FlashAttention's
(batch, seqlen, heads, head_dim) layout.

The oracle's masks for FlashAttention's ``window_size`` are written here from FlashAttention's
documented rule (query i sees keys [i + sk - sq - left, i + sk - sq + right]), FlashAttention
3's ``attention_chunk`` C from its mask (also only keys of the query's own chunk of positions,
[C * floor(P / C), C * floor(P / C) + C) for P = i + sk - sq), the rotary
embedding from its documented pairing, and the KV-cache appends by plain indexing: none of it
is the module's code. Shapes are tiny (the kernels run in Triton's CPU interpreter).
"""
import inspect
import math

import pytest
import torch

import kernels
import reference
from kernels import flash_attn_interface as fa
from kernels.flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func,
                                          flash_attn_qkvpacked_func, flash_attn_varlen_func,
                                          flash_attn_varlen_kvpacked_func,
                                          flash_attn_varlen_qkvpacked_func,
                                          flash_attn_with_kvcache, pad_input, unpad_input)
from tests.helpers import DEVICE, GRAD_FACTOR, assert_parity, randn

PAGED = "block_table" in inspect.signature(kernels.attention_with_kvcache).parameters


# ------------------------------------------------------------------------------ the oracle
# FlashAttention's visibility rule: reference.flash_attn_mask.
def _ours(t):
    """(batch, seq, heads, dim) -> (batch, heads, seq, dim), detached leaf copies for the
    oracle: float64 and the input dtype."""
    return (t.detach().transpose(1, 2).double().requires_grad_(),
            t.detach().transpose(1, 2).clone().requires_grad_())


def _oracle(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
            softmax_scale=None, keep=None, dropout_p=0.0, leftpad=0, attention_chunk=0,
            s_aux=None):
    """(ref, lowp) pairs (out in FA layout, lse, grad leaves) of the oracle in float64 and in
    the input dtype; ``s_aux``: the sinks (its grad leaf follows q, k, v's)."""
    results = []
    for i in range(2):
        leaves = [_ours(t)[i] for t in (q, k, v)]
        sinks = None
        if s_aux is not None:
            sinks = s_aux.detach().double() if i == 0 else s_aux.detach().clone()
            leaves.append(sinks.requires_grad_())
        mask = reference.flash_attn_mask(causal, window_size, leftpad, attention_chunk)
        o, lse = reference.attention(*leaves[:3], causal=False, sinks=sinks, mask_mod=mask,
                                     softcap=softcap or None, alibi_slopes=alibi_slopes,
                                     softmax_scale=softmax_scale, keep_mask=keep,
                                     dropout_p=dropout_p, upcast=i == 0, return_lse=True)
        results.append((o.transpose(1, 2), lse, leaves))
    return results


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do)


def _assert_grads(got, ref, lowp, do, names=("dq", "dk", "dv")):
    (ro, _, r_in), (lo, _, l_in) = ref, lowp
    # q, k, v's gradients back to FlashAttention's layout (the sinks' is (heads,))
    rg = [g.transpose(1, 2) if g.dim() == 4 else g for g in _grads(ro, r_in, do.double())]
    lg = [g.transpose(1, 2) if g.dim() == 4 else g for g in _grads(lo, l_in, do)]
    for name, g, r, l in zip(names, got, rg, lg):
        assert_parity(g, r, l, factor=GRAD_FACTOR, name=name)


def _qkv(b, sq, sk, hq, hk, d, dtype=torch.float32):
    return (randn(b, sq, hq, d, dtype=dtype, requires_grad=True),
            randn(b, sk, hk, d, dtype=dtype, requires_grad=True),
            randn(b, sk, hk, d, dtype=dtype, requires_grad=True))


# ------------------------------------------------------------------------------ dense
DENSE = {
    "full": dict(),
    "causal": dict(causal=True),
    "causal_window": dict(causal=True, window_size=(4, -1)),
    "causal_ignores_right": dict(causal=True, window_size=(3, 5)),
    "two_sided": dict(window_size=(3, 2)),
    "right_only": dict(window_size=(-1, 2)),
    "left_only": dict(window_size=(5, -1)),
    "left_zero_right": dict(window_size=(2, 0)),
    "softcap_alibi": dict(causal=True, softcap=2.0, alibi_slopes="heads"),
    "alibi_batch_window": dict(window_size=(6, 1), alibi_slopes="batch"),
    "scale": dict(softmax_scale=0.7),
    # FlashAttention 3's chunked attention (Llama 4) and learnable sinks (gpt-oss)
    "chunk_causal": dict(causal=True, attention_chunk=5),
    "chunk_causal_window": dict(causal=True, window_size=(3, -1), attention_chunk=6),
    "chunk_bidirectional": dict(attention_chunk=4),
    "chunk_two_sided_sinks": dict(window_size=(2, 1), attention_chunk=5, s_aux="heads"),
    "sinks_causal": dict(causal=True, s_aux="heads"),
}


def _materialise(kw, b, hq):
    kw = dict(kw)
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = torch.rand(hq, device=DEVICE)
    elif kw.get("alibi_slopes") == "batch":
        kw["alibi_slopes"] = torch.rand(b, hq, device=DEVICE)
    if kw.get("s_aux") == "heads":
        kw["s_aux"] = randn(hq)
    return kw


@pytest.mark.parametrize("name", sorted(DENSE))
@pytest.mark.parametrize("sq,sk", [(17, 23), (19, 9)])
def test_flash_attn_func(name, sq, sk):
    b, hq, hk = 2, 4, 2
    kw = _materialise(DENSE[name], b, hq)
    q, k, v = _qkv(b, sq, sk, hq, hk, 16)
    out = flash_attn_func(q, k, v, **kw)
    assert out.shape == (b, sq, hq, 16) and out.is_contiguous()
    do = randn(*out.shape)
    ref, lowp = _oracle(q, k, v, **kw)
    assert_parity(out, ref[0], lowp[0])
    _assert_grads(_grads(out, (q, k, v), do), ref, lowp, do)


def test_flash_attn_func_fp16_deterministic():
    q, k, v = _qkv(1, 13, 13, 2, 1, 32, dtype=torch.float16)
    kw = dict(causal=True, window_size=(5, -1), deterministic=True)
    runs = []
    for _ in range(2):
        out = flash_attn_func(q, k, v, **kw)
        runs.append((out,) + _grads(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    ref, lowp = _oracle(q, k, v, causal=True, window_size=(5, -1))
    assert_parity(runs[0][0], ref[0], lowp[0])


@pytest.mark.parametrize("name", ["s_aux", "learnable_sink"])
def test_learnable_sinks_gradient(name):
    """FlashAttention 3's learnable sinks under either name (vLLM's ``s_aux``,
    ``flash_attn.cute``'s ``learnable_sink``), in bf16 as models keep them: the sinks' gradient
    against the oracle's, with q, k, v's."""
    q, k, v = _qkv(2, 11, 11, 4, 2, 16)
    sinks = randn(4, dtype=torch.bfloat16, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True, window_size=(4, -1), **{name: sinks})
    do = randn(*out.shape)
    ref, lowp = _oracle(q, k, v, causal=True, window_size=(4, -1), s_aux=sinks.float())
    assert_parity(out, ref[0], lowp[0])
    _assert_grads(_grads(out, (q, k, v, sinks), do), ref, lowp, do,
                  names=("dq", "dk", "dv", "dsinks"))


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_chunk_without_causal_skips_other_chunks():
    """``attention_chunk`` without ``causal`` (bidirectional chunks, a mask mod with tile
    ranges): with chunks of 128 positions (whole tiles of every width up to 128) over 144,
    NaN values and queries in the first chunk leave the second chunk's outputs and its keys'
    dK / dV untouched: the first chunk's tiles are never visited by the second's rows."""
    chunk = 128
    q, k, v = _qkv(1, chunk + 16, chunk + 16, 1, 1, 16)
    out = flash_attn_func(q, k, v, attention_chunk=chunk)
    dq, dk, dv = _grads(out, (q, k, v), torch.ones_like(out))
    pq, pv = q.detach().clone(), v.detach().clone()
    pq[:, :chunk], pv[:, :chunk] = float("nan"), float("nan")
    poisoned = flash_attn_func(q.detach(), k.detach(), pv, attention_chunk=chunk)
    assert torch.equal(poisoned[:, chunk:], out[:, chunk:].detach())
    pq.requires_grad_()
    out_q = flash_attn_func(pq, k, v, attention_chunk=chunk)
    _, dk_q, dv_q = _grads(out_q, (pq, k, v), torch.ones_like(out_q))
    assert torch.equal(dk_q[:, chunk:], dk[:, chunk:])
    assert torch.equal(dv_q[:, chunk:], dv[:, chunk:])
    ref, lowp = _oracle(q[:, chunk:], k[:, chunk:], v[:, chunk:])
    assert_parity(out[:, chunk:], ref[0], lowp[0])


def test_packed_dense():
    """qkv / kv stacked: the gradient lands in the stacked tensor."""
    b, s, h, d = 2, 11, 2, 16
    qkv = randn(b, s, 3, h, d, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True, window_size=(3, -1))
    do = randn(*out.shape)
    (dqkv,) = _grads(out, (qkv,), do)
    q, k, v = (qkv[:, :, i] for i in range(3))
    ref, lowp = _oracle(q, k, v, causal=True, window_size=(3, -1))
    assert_parity(out, ref[0], lowp[0])
    _assert_grads(dqkv.unbind(2), ref, lowp, do)

    q = randn(b, 7, 4, d, requires_grad=True)
    kv = randn(b, s, 2, 2, d, requires_grad=True)
    out = flash_attn_kvpacked_func(q, kv, window_size=(2, 3), softcap=1.5)
    do = randn(*out.shape)
    dq, dkv = _grads(out, (q, kv), do)
    ref, lowp = _oracle(q, kv[:, :, 0], kv[:, :, 1], window_size=(2, 3), softcap=1.5)
    assert_parity(out, ref[0], lowp[0])
    _assert_grads((dq, *dkv.unbind(2)), ref, lowp, do)


def _no_probs(*args, **kwargs):
    raise AssertionError("the probabilities were computed without dropout")


@pytest.mark.parametrize("fn", ["dense", "qkvpacked", "varlen"])
def test_attn_probs_empty_without_dropout(monkeypatch, fn):
    """dropout_p = 0: S_dmask is FlashAttention's empty tensor (shape (0,), q's dtype and
    device) and nothing computes the probabilities; lse is still returned, in FA's layout."""
    monkeypatch.setattr(fa, "_probs_dense", _no_probs)
    monkeypatch.setattr(fa, "_probs_varlen", _no_probs)
    q, k, v = _qkv(2, 9, 9, 2, 2, 16, dtype=torch.float16)
    if fn == "dense":
        out, lse, s_dmask = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    elif fn == "qkvpacked":
        out, lse, s_dmask = flash_attn_qkvpacked_func(torch.stack((q, k, v), 2), causal=True,
                                                      return_attn_probs=True)
    else:
        cu = _cu([9, 9])
        out, lse, s_dmask = flash_attn_varlen_func(*(t.flatten(0, 1) for t in (q, k, v)), cu,
                                                   cu, 9, 9, causal=True,
                                                   return_attn_probs=True)
        out, lse = out.view(2, 9, 2, 16), lse.view(2, 2, 9).transpose(0, 1)  # (h, total)
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype and s_dmask.device == q.device
    ref, lowp = _oracle(q, k, v, causal=True)
    assert_parity(out, ref[0], lowp[0])
    assert_parity(lse, ref[1], lowp[1].float(), name="lse")


def test_return_attn_probs(monkeypatch):
    """(out, lse, S_dmask) with dropout: lse in FA's (batch, heads, seqlen_q) and |S_dmask|
    the probabilities, both against the oracle, negative exactly where the kernel's Philox
    mask dropped a visible weight; rows that see no key: lse -inf, probabilities 0."""
    fa_seed, p = 4321, 0.25
    monkeypatch.setattr(fa, "_seed", lambda p, probs: fa_seed if p > 0 else None)
    q, k, v = _qkv(2, 9, 6, 2, 1, 16)
    out, lse, probs = flash_attn_func(q, k, v, dropout_p=p, causal=True, window_size=(2, -1),
                                      return_attn_probs=True)
    keep = reference.dropout_keep_mask(fa_seed, 2, 2, 9, 6, p, device=DEVICE)
    ref, lowp = _oracle(q, k, v, causal=True, window_size=(2, -1), keep=keep, dropout_p=p)
    assert_parity(out, ref[0], lowp[0])
    assert lse.shape == (2, 2, 9) and probs.shape == (2, 2, 9, 6)
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), finite)
    assert_parity(lse[finite], ref[1][finite], lowp[1][finite].float(), name="lse")
    qr, kr = (t.detach().transpose(1, 2).double() for t in (q, k))
    kr = kr.repeat_interleave(2, dim=1)
    p_ref = torch.exp(qr @ kr.transpose(-1, -2) / 4.0 - ref[1][..., None])
    p_ref = p_ref.nan_to_num(0.0) * reference.causal_mask(9, 6, window=3)
    torch.testing.assert_close(probs.abs().double(), p_ref, rtol=0, atol=1e-6)
    assert torch.equal(probs < 0, (p_ref > 0) & ~keep)


def test_return_attn_probs_dropout(monkeypatch):
    """With dropout, S_dmask is negative exactly where the kernel's Philox mask dropped
    (reference.dropout_keep_mask of the call's seed), and out is the oracle given that mask."""
    monkeypatch.setattr(fa, "_seed", lambda p, probs: 1234 if p > 0 else None)
    b, sq, sk, h = 1, 10, 12, 2
    q, k, v = _qkv(b, sq, sk, h, h, 16)
    p = 0.3
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=p, causal=True,
                                        return_attn_probs=True)
    keep = reference.dropout_keep_mask(1234, b, h, sq, sk, p, device=DEVICE)
    visible = reference.causal_mask(sq, sk)
    assert torch.equal((s_dmask >= 0) | ~visible, keep | ~visible)
    ref, lowp = _oracle(q, k, v, causal=True, keep=keep, dropout_p=p)
    assert_parity(out, ref[0], lowp[0])
    do = randn(*out.shape)
    _assert_grads(_grads(out, (q, k, v), do), ref, lowp, do)


# ------------------------------------------------------------------------------ varlen
def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                        device=DEVICE)


def _varlen_oracle(q, k, v, cu_q, cu_k, kw, upcast):
    """reference.attention_varlen with FlashAttention's mask: (out, lse), differentiable in
    q, k, v (float64 with ``upcast``, else the input dtype)."""
    kw = dict(kw)
    mask = reference.flash_attn_mask(kw.pop("causal", False), kw.pop("window_size", (-1, -1)),
                                     chunk=kw.pop("attention_chunk", 0))
    kw["sinks"] = kw.pop("s_aux", None)
    kw["softcap"] = kw.get("softcap") or None
    return reference.attention_varlen(q, k, v, cu_q, cu_k, causal=False, mask_mod=mask,
                                      upcast=upcast, return_lse=True, **kw)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(2, 3)),
                                dict(causal=True, window_size=(3, -1), softcap=2.0,
                                     alibi_slopes="batch"),
                                dict(window_size=(3, 2), attention_chunk=4, s_aux="heads")],
                         ids=["causal", "two_sided", "window_softcap_alibi", "chunk_sinks"])
def test_flash_attn_varlen_func(kw):
    lens_q, lens_k = [5, 1, 0, 12], [7, 3, 4, 9]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    kw = _materialise(kw, 4, 4)
    q = randn(sum(lens_q), 4, 16, requires_grad=True)
    k, v = (randn(sum(lens_k), 2, 16, requires_grad=True) for _ in range(2))
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                             return_attn_probs=True, **kw)
    r_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    l_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    (ro, rl), (lo, _) = (_varlen_oracle(*r_in, cu_q, cu_k, kw, True),
                         _varlen_oracle(*l_in, cu_q, cu_k, kw, False))
    assert_parity(out, ro, lo)
    assert lse.shape == (4, sum(lens_q)) and probs.shape == (0,)   # no dropout: FA's empty
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), finite)
    do = randn(*out.shape)
    for name, g, r, l in zip(("dq", "dk", "dv"), _grads(out, (q, k, v), do),
                             _grads(ro, r_in, do.double()), _grads(lo, l_in, do)):
        assert_parity(g, r, l, factor=GRAD_FACTOR, name=name)


def test_varlen_attn_probs_dropout(monkeypatch):
    """Packed sequences with dropout: |S_dmask| rows sum to 1 where the row sees a key and are
    0 outside each sequence; negative exactly where the kernel's varlen mask dropped."""
    fa_seed, p = 99, 0.2
    monkeypatch.setattr(fa, "_seed", lambda p, probs: fa_seed if p > 0 else None)
    lens_q, lens_k = [5, 0, 8], [7, 4, 6]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q = randn(sum(lens_q), 2, 16)
    k, v = (randn(sum(lens_k), 1, 16) for _ in range(2))
    kw = dict(causal=True, window_size=(3, -1))
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                             dropout_p=p, return_attn_probs=True, **kw)
    assert probs.shape == (3, 2, 8, 7)
    keeps = reference.dropout_keep_mask_varlen(fa_seed, cu_q, cu_k, 2, p)
    _, rl = _varlen_oracle(q.double(), k.double(), v.double(), cu_q, cu_k, kw, True)
    for s, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        rows = torch.isfinite(rl[:, int(cu_q[s]):int(cu_q[s + 1])])
        torch.testing.assert_close(probs[s, :, :nq].abs().sum(-1), rows.float(), rtol=0,
                                   atol=1e-5)
        assert probs[s, :, nq:].abs().sum() == 0 and probs[s, :, :, nk:].abs().sum() == 0
        mine = probs[s, :, :nq, :nk]
        assert torch.equal(mine < 0, (mine != 0) & ~keeps[s])


def test_varlen_packed():
    lens = [6, 11, 2]
    cu = _cu(lens)
    qkv = randn(sum(lens), 3, 2, 16, requires_grad=True)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    q, k, v = qkv.detach().unbind(1)
    ro, _ = _varlen_oracle(q.double(), k.double(), v.double(), cu, cu, dict(causal=True), True)
    lo, _ = _varlen_oracle(q, k, v, cu, cu, dict(causal=True), False)
    assert_parity(out, ro, lo)
    (dqkv,) = _grads(out, (qkv,), torch.ones_like(out))
    assert dqkv.shape == qkv.shape and torch.isfinite(dqkv).all()

    q = randn(sum(lens), 4, 16)
    kv = randn(sum(lens), 2, 2, 16)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max(lens), max(lens),
                                          window_size=(1, 1))
    kw = dict(window_size=(1, 1))
    ro, _ = _varlen_oracle(q.double(), kv[:, 0].double(), kv[:, 1].double(), cu, cu, kw, True)
    lo, _ = _varlen_oracle(q, kv[:, 0], kv[:, 1], cu, cu, kw, False)
    assert_parity(out, ro, lo)


# ------------------------------------------------------------------------------ padding
def _padding_mask(lens, seqlen):
    return torch.arange(seqlen, device=DEVICE)[None, :] < torch.tensor(lens, device=DEVICE)[:, None]


def test_unpad_pad_round_trip():
    """unpad_input packs the tokens in batch-major order with FlashAttention 2.7+'s five
    results; pad_input puts them back, zeros at the padding; both carry gradients."""
    lens, S = [3, 0, 6, 1], 6
    x = randn(4, S, 2, 5, requires_grad=True)
    mask = _padding_mask(lens, S)
    packed, indices, cu, max_len, used = unpad_input(x, mask.int())
    flat = [b * S + s for b, n in enumerate(lens) for s in range(n)]
    assert indices.tolist() == flat and indices.dtype == torch.int64
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 9, 10]
    assert max_len == 6 and isinstance(max_len, int)
    assert used.dtype == torch.int32 and used.tolist() == lens
    assert torch.equal(packed, x.detach().flatten(0, 1)[flat])
    back = pad_input(packed, indices, 4, S)
    assert torch.equal(back, x.detach() * mask[..., None, None])
    (grad,) = torch.autograd.grad(back, x, torch.ones_like(back))
    assert torch.equal(grad, mask[..., None, None].expand_as(x).float())


def test_unpad_unused_mask():
    """unused_mask: slots packed and counted in cu_seqlens / max_seqlen, not in the used
    lengths (FlashAttention 2.7+)."""
    x = randn(2, 5, 3)
    mask, unused = _padding_mask([2, 4], 5), _padding_mask([3, 5], 5) & ~_padding_mask([2, 4], 5)
    packed, indices, cu, max_len, used = unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 5, 6, 7, 8, 9]
    assert cu.tolist() == [0, 3, 8] and max_len == 5 and used.tolist() == [2, 4]
    assert torch.equal(packed, x.flatten(0, 1)[indices])


@pytest.mark.parametrize("causal", [False, True])
def test_unpad_varlen_equals_padded_dense(causal):
    """A padded batch, unpadded into flash_attn_varlen_func and padded back: the dense
    oracle with the padded keys hidden on the valid rows, zeros on the padding."""
    lens, S, h, d = [7, 2, 5], 7, 2, 16
    mask = _padding_mask(lens, S)
    q, k, v = (randn(3, S, h, d, requires_grad=True) for _ in range(3))
    (qu, idx, cu, max_len, _), (ku, *_), (vu, *_) = (unpad_input(t, mask) for t in (q, k, v))
    out = pad_input(flash_attn_varlen_func(qu, ku, vu, cu, cu, max_len, max_len,
                                           causal=causal), idx, 3, S)
    n = torch.tensor(lens, device=DEVICE)
    seen = [t.detach().transpose(1, 2) for t in (q, k, v)]

    def visible(b, hh, qi, ki, aux):
        # Row b's sequence is its first lens[b] tokens (q_len = k_len: causal is ki <= qi).
        return (ki < n[b]) & (ki <= qi) if causal else ki < n[b]

    def oracle(upcast):
        return reference.attention(*seen, causal=False, upcast=upcast, mask_mod=visible)
    ref, lowp = (oracle(u).transpose(1, 2) * mask[..., None, None] for u in (True, False))
    assert_parity(out, ref, lowp)
    assert out[~mask].abs().sum() == 0
    do = randn(*out.shape)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    for g in (dq, dk, dv):
        assert g[~mask].abs().sum() == 0 and torch.isfinite(g).all()


# ------------------------------------------------------------------------------ KV cache
def _rotary_oracle(x, cos, sin, interleaved):
    """The rotary embedding by its definition, as complex multiplication: pairs (2i, 2i + 1)
    (interleaved) or (i, i + rd / 2) of the first rd dims rotated by angle theta with
    cos(theta), sin(theta) given per (batch, token)."""
    rd = 2 * cos.shape[-1]
    xr = x[..., :rd].double()
    if interleaved:
        pairs = torch.view_as_complex(xr.reshape(*xr.shape[:-1], rd // 2, 2).contiguous())
    else:
        pairs = torch.complex(xr[..., :rd // 2], xr[..., rd // 2:])
    turned = pairs * torch.complex(cos.double(), sin.double())[:, :, None]
    if interleaved:
        rot = torch.view_as_real(turned).flatten(-2)
    else:
        rot = torch.cat((turned.real, turned.imag), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def _kvcache_oracle(q, k_cache, v_cache, lens, k=None, v=None, cache_batch_idx=None,
                    rotary=None, causal=False, window_size=(-1, -1), cache_leftpad=None, **kw):
    """(ref, lowp) outputs (FA layout) and the expected caches, row by row."""
    kw.pop("num_splits", None)   # the kernel's split-KV: no difference to the oracle
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    B, n_new = q.shape[0], 0 if k is None else k.shape[1]
    rows = list(range(B)) if cache_batch_idx is None else cache_batch_idx.tolist()
    if rotary is not None:
        cos, sin, interleaved = rotary
        pos_k = torch.tensor(lens)[:, None] + torch.arange(n_new)
        k = _rotary_oracle(k, cos[pos_k], sin[pos_k], interleaved)
        local = causal or window_size != (-1, -1)
        pos_q = torch.tensor(lens)[:, None] + (torch.arange(q.shape[1]) if local
                                               else torch.zeros(q.shape[1], dtype=torch.long))
        q = _rotary_oracle(q, cos[pos_q], sin[pos_q], interleaved)
    outs = ([], [])
    for b, row in enumerate(rows):
        n = lens[b]
        if k is not None:
            k_cache[row, n:n + n_new], v_cache[row, n:n + n_new] = k[b], v[b]
        ref, lowp = _oracle(q[b:b + 1], k_cache[row:row + 1, :n + n_new],
                            v_cache[row:row + 1, :n + n_new], causal=causal,
                            window_size=window_size,
                            leftpad=0 if cache_leftpad is None else int(cache_leftpad[b]), **kw)
        outs[0].append(ref[0])
        outs[1].append(lowp[0])
    return torch.cat(outs[0]), torch.cat(outs[1]), k_cache, v_cache


KVCACHE = {
    "decode": dict(sq=1, n_new=1, causal=True),
    "append_as_many": dict(sq=3, n_new=3, causal=True, window_size=(4, -1), num_splits=3),
    "fewer_new_than_queries": dict(sq=4, n_new=1, causal=True),
    "more_new_than_queries": dict(sq=2, n_new=5, causal=True, softcap=3.0),
    "no_append": dict(sq=3, n_new=0, window_size=(2, 2), alibi_slopes="heads"),
    "int_seqlens": dict(sq=2, n_new=2, causal=True, int_lens=True),
    "chunk_sinks": dict(sq=3, n_new=3, causal=True, attention_chunk=4, s_aux="heads",
                        num_splits=2),
}


@pytest.mark.parametrize("name", sorted(KVCACHE))
def test_flash_attn_with_kvcache(name):
    case = dict(KVCACHE[name])
    sq, n_new = case.pop("sq"), case.pop("n_new")
    int_lens = case.pop("int_lens", False)
    B, hq, hk, cap, d = 2, 4, 2, 24, 16
    case = _materialise(case, B, hq)
    q = randn(B, sq, hq, d)
    k_cache, v_cache = randn(B, cap, hk, d), randn(B, cap, hk, d)
    lens = [11, 11] if int_lens else [7, 15]
    seqlens = 11 if int_lens else torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    k, v = (randn(B, n_new, hk, d), randn(B, n_new, hk, d)) if n_new else (None, None)
    ro, lo, k_exp, v_exp = _kvcache_oracle(q, k_cache, v_cache, lens, k, v, **case)
    before = None if int_lens else seqlens.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                       return_softmax_lse=True, **case)
    assert out.shape == (B, sq, hq, d) and lse.shape == (B, hq, sq)
    assert_parity(out, ro, lo)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
    if before is not None:
        assert torch.equal(seqlens, before)  # not advanced


def test_kvcache_whole_cache_without_seqlens():
    q, k_cache, v_cache = randn(1, 2, 2, 16), randn(1, 9, 1, 16), randn(1, 9, 1, 16)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)
    ref, lowp = _oracle(q, k_cache, v_cache, causal=True)
    assert_parity(out, ref[0], lowp[0])


def test_kvcache_more_cache_rows_than_batch():
    """Without cache_batch_idx, a cache with more rows than the batch: rows 0 .. batch - 1
    are read and appended to, the others untouched."""
    q, k, v = randn(2, 2, 2, 16), randn(2, 2, 1, 16), randn(2, 2, 1, 16)
    k_cache, v_cache = randn(4, 12, 1, 16), randn(4, 12, 1, 16)
    lens = [3, 8]
    ro, lo, k_exp, v_exp = _kvcache_oracle(q, k_cache, v_cache, lens, k, v, causal=True)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, causal=True,
                                  cache_seqlens=torch.tensor(lens, dtype=torch.int32,
                                                             device=DEVICE))
    assert_parity(out, ro, lo)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


@pytest.mark.parametrize("n_new", [0, 2, 3])
def test_kvcache_batch_idx(n_new):
    """cache_batch_idx: row b reads (and appends into) cache row idx[b]; other rows untouched."""
    B, cap, hk, d = 3, 20, 1, 16
    q = randn(B, 3, 2, d)
    k_cache, v_cache = randn(5, cap, hk, d), randn(5, cap, hk, d)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    lens = [6, 13, 9]
    k, v = (randn(B, n_new, hk, d), randn(B, n_new, hk, d)) if n_new else (None, None)
    ro, lo, k_exp, v_exp = _kvcache_oracle(q, k_cache, v_cache, lens, k, v,
                                           cache_batch_idx=idx, causal=True)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_batch_idx=idx,
                                  cache_seqlens=torch.tensor(lens, dtype=torch.int32,
                                                             device=DEVICE), causal=True)
    assert_parity(out, ro, lo)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


def test_kvcache_batch_idx_without_paged_kernels(monkeypatch):
    """Before paged caches landed: the gathered-copy path, same results."""
    monkeypatch.setattr(fa, "_paged_supported", lambda: False)
    test_kvcache_batch_idx(2)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(3, 1)), dict(),
                                dict(causal=True, alibi_slopes="heads", num_splits=2),
                                dict(causal=True, attention_chunk=4),
                                dict(window_size=(5, 1), attention_chunk=3)],
                         ids=["causal", "two_sided", "full", "alibi_split", "chunk_causal",
                              "chunk_two_sided"])
def test_kvcache_leftpad(kw):
    """cache_leftpad: row b's keys before leftpad[b] are hidden, everything else (causal
    alignment, window, ALiBi distance, the append position) in absolute positions."""
    B, sq, hq, hk, cap, d = 3, 2, 2, 1, 20, 16
    kw = _materialise(kw, B, hq)
    q = randn(B, sq, hq, d)
    k_cache, v_cache = randn(B, cap, hk, d), randn(B, cap, hk, d)
    k, v = randn(B, sq, hk, d), randn(B, sq, hk, d)
    lens, pad = [9, 14, 3], torch.tensor([4, 0, 3], dtype=torch.int32, device=DEVICE)
    ro, lo, k_exp, _ = _kvcache_oracle(q, k_cache, v_cache, lens, k, v, cache_leftpad=pad,
                                       **kw)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_leftpad=pad,
                                  cache_seqlens=torch.tensor(lens, dtype=torch.int32,
                                                             device=DEVICE), **kw)
    assert_parity(out, ro, lo)
    assert torch.equal(k_cache, k_exp)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal,rd", [(True, 16), (False, 8)])
def test_kvcache_rotary(interleaved, causal, rd):
    """q and the new k rotated at their positions (causal: each query at its own; else all at
    cache_seqlens); rotary_dim below head_dim leaves the other dims alone."""
    B, sq, hq, hk, cap, d = 2, 3, 2, 1, 20, 16
    q = randn(B, sq, hq, d)
    k_cache, v_cache = randn(B, cap, hk, d), randn(B, cap, hk, d)
    k, v = randn(B, sq, hk, d), randn(B, sq, hk, d)
    lens = [4, 12]
    theta = torch.arange(cap, device=DEVICE)[:, None] * torch.rand(rd // 2, device=DEVICE)
    cos, sin = theta.cos(), theta.sin()
    ro, lo, k_exp, v_exp = _kvcache_oracle(q, k_cache, v_cache, lens, k, v,
                                           rotary=(cos, sin, interleaved), causal=causal)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=torch.tensor(lens, dtype=torch.int32,
                                                             device=DEVICE),
                                  causal=causal, rotary_interleaved=interleaved)
    assert_parity(out, ro, lo)
    torch.testing.assert_close(k_cache, k_exp, rtol=0, atol=1e-6)   # rotated in fp32
    assert torch.equal(v_cache, v_exp)


@pytest.mark.skipif(not PAGED, reason="attention_with_kvcache has no block_table yet")
@pytest.mark.parametrize("page_size,n_new", [(1, 1), (4, 3), (16, 2)])
def test_kvcache_paged(page_size, n_new):
    """Pages in shuffled order: the same as a dense cache holding the rows in order."""
    B, sq, hq, hk, d, blocks_per_row = 2, 3, 2, 1, 16, 24 // page_size + 1
    n_blocks = B * blocks_per_row
    perm = torch.randperm(n_blocks, device=DEVICE).to(torch.int32)
    table = perm.view(B, blocks_per_row)
    k_pages, v_pages = randn(n_blocks, page_size, hk, d), randn(n_blocks, page_size, hk, d)
    dense = [t[table.long()].reshape(B, -1, hk, d) for t in (k_pages, v_pages)]
    q = randn(B, sq, hq, d)
    k, v = randn(B, n_new, hk, d), randn(B, n_new, hk, d)
    lens = [5, 17]
    ro, lo, k_exp, _ = _kvcache_oracle(q, *dense, lens, k, v, causal=True)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, k_pages, v_pages, k, v, block_table=table,
                                  cache_seqlens=seqlens, causal=True)
    assert_parity(out, ro, lo)
    assert torch.equal(k_pages[table.long()].reshape(B, -1, hk, d), k_exp)
    # FlashAttention 3's name for the table: the same call (the new keys already written)
    again = flash_attn_with_kvcache(q, k_pages, v_pages, page_table=table,
                                    cache_seqlens=seqlens + n_new, causal=True)
    assert torch.equal(again, out)


def test_kvcache_block_table_until_paged(monkeypatch):
    monkeypatch.setattr(fa, "_paged_supported", lambda: False)
    q, kc = randn(1, 1, 2, 16), randn(4, 8, 1, 16)
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=3,
                                block_table=torch.zeros(1, 2, dtype=torch.int32, device=DEVICE))


# ------------------------------------------------------------------------------ errors
def _dense_inputs(dtype=torch.float16, hq=4, hk=2, dk=16):
    return randn(1, 5, hq, 16, dtype=dtype), randn(1, 5, hk, dk, dtype=dtype), \
        randn(1, 5, hk, dk, dtype=dtype)


ERRORS = [
    (lambda: flash_attn_func(*(t.double() for t in _dense_inputs())), RuntimeError,
     "float16 or bfloat16"),
    (lambda: flash_attn_func(*(t.long() for t in _dense_inputs())), RuntimeError,
     "float16 or bfloat16"),
    (lambda: (lambda q, k, v: flash_attn_func(q, k.float(), v))(*_dense_inputs()),
     RuntimeError, "same dtype"),
    (lambda: flash_attn_func(*_dense_inputs(dk=32)), RuntimeError, "same head dim"),
    (lambda: flash_attn_func(*_dense_inputs(hq=3)), RuntimeError, "multiple of the number"),
    (lambda: flash_attn_func(*(t[0] for t in _dense_inputs())), RuntimeError, "4-D"),
    (lambda: flash_attn_func(*_dense_inputs(), q_descale=torch.ones(1)), RuntimeError,
     "q_descale applies to FP8"),
    (lambda: flash_attn_func(*_dense_inputs(), qv=torch.ones(1)), NotImplementedError, "qv"),
    (lambda: flash_attn_func(*_dense_inputs(), bogus=1), TypeError, "bogus"),
    (lambda: flash_attn_func(*_dense_inputs(), attention_chunk=-1), RuntimeError,
     "attention_chunk must be an int >= 0"),
    (lambda: flash_attn_func(*_dense_inputs(), attention_chunk=2.5), RuntimeError,
     "attention_chunk must be an int >= 0"),
    (lambda: flash_attn_func(*_dense_inputs(), s_aux=torch.zeros(2),
                             learnable_sink=torch.zeros(2)), RuntimeError, "pass one"),
    (lambda: flash_attn_func(*_dense_inputs(), s_aux=torch.zeros(3)), RuntimeError, "sinks"),
    (lambda: flash_attn_with_kvcache(*_dense_inputs(), cache_seqlens=2,
                                     cache_leftpad=torch.zeros(1, dtype=torch.int32),
                                     block_table=torch.zeros(1, 1, dtype=torch.int32)),
     (RuntimeError, NotImplementedError), "block_table"),
    (lambda: flash_attn_with_kvcache(*_dense_inputs(), cache_seqlens=2,
                                     cache_leftpad=torch.zeros(2, dtype=torch.int32)),
     RuntimeError, "cache_leftpad"),
    (lambda: flash_attn_with_kvcache(*_dense_inputs(), rotary_seqlens=torch.ones(1)),
     NotImplementedError, "rotary_seqlens"),
    (lambda: flash_attn_with_kvcache(*_dense_inputs(), cache_batch_idx=torch.zeros(
        1, dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32)),
     (RuntimeError, NotImplementedError), "block_table"),
    (lambda: flash_attn_with_kvcache(*_dense_inputs(), *_dense_inputs()[1:]), RuntimeError,
     "cache_seqlens"),
    (lambda: flash_attn_with_kvcache(*_dense_inputs(), *_dense_inputs()[1:], cache_seqlens=0,
                                     rotary_cos=torch.ones(4, 4), rotary_sin=torch.ones(4, 4)),
     RuntimeError, "cover every cache position"),
    (lambda: flash_attn_with_kvcache(*_dense_inputs(), *_dense_inputs()[1:], cache_seqlens=0,
                                     rotary_cos=torch.ones(9, 9), rotary_sin=torch.ones(9, 9)),
     RuntimeError, "rotary_dim"),
    (lambda: flash_attn_varlen_func(*(t[0] for t in _dense_inputs()), _cu([5]), _cu([5]), 5, 5,
                                    block_table=torch.zeros(1, 1, dtype=torch.int32)),
     RuntimeError, "paged"),
]

# The index arguments, checked by one rule as FlashAttention checks them: int32, on q's device,
# of the right shape, else RuntimeError naming the argument, also for a list where a tensor
# belongs (the module's one exception type for argument checks). The meta device stands for
# "another device" on any machine.
_I32 = dict(dtype=torch.int32, device=DEVICE)


def _varlen(cu_q=None, cu_k=None):
    q, k, v = (t[0] for t in _dense_inputs())
    return flash_attn_varlen_func(q, k, v, _cu([5]) if cu_q is None else cu_q,
                                  _cu([5]) if cu_k is None else cu_k, 5, 5)


def _kvcache(**kw):
    q, k, v = _dense_inputs()
    return flash_attn_with_kvcache(q, k, v, **kw)


INDEX_ERRORS = [
    (lambda: _kvcache(cache_seqlens=[3]), RuntimeError,
     "cache_seqlens must be an int or an int32 tensor, got list"),
    (lambda: _kvcache(cache_seqlens=torch.tensor([3], device=DEVICE)), RuntimeError,
     "cache_seqlens must have dtype int32, got torch.int64"),
    (lambda: _kvcache(cache_seqlens=torch.tensor([3, 4], **_I32)), RuntimeError,
     r"cache_seqlens must have shape \(1,\), got \(2,\)"),
    (lambda: _kvcache(cache_seqlens=torch.tensor([3], dtype=torch.int32, device="meta")),
     RuntimeError, "cache_seqlens must be on q's device"),
    (lambda: _varlen(cu_q=_cu([5]).long()), RuntimeError,
     "cu_seqlens_q must have dtype int32, got torch.int64"),
    (lambda: _varlen(cu_k=[0, 5]), RuntimeError, "cu_seqlens_k must be an int32 tensor, got list"),
    (lambda: _varlen(cu_k=torch.tensor([0, 2, 5], **_I32)), RuntimeError,
     r"cu_seqlens_k must have shape \(2,\)"),
    (lambda: _varlen(cu_q=_cu([5]).to("meta")), RuntimeError,
     "cu_seqlens_q must be on q's device"),
    (lambda: _kvcache(cache_seqlens=2, cache_batch_idx=torch.zeros(1, dtype=torch.long,
                                                                   device=DEVICE)),
     RuntimeError, "cache_batch_idx must have dtype int32"),
    (lambda: _kvcache(cache_seqlens=2, cache_leftpad=[0]), RuntimeError, "cache_leftpad"),
    (lambda: _kvcache(cache_seqlens=2, cache_leftpad=torch.zeros(1, dtype=torch.long,
                                                                 device=DEVICE)),
     RuntimeError, "cache_leftpad must have dtype int32"),
]


@pytest.mark.parametrize("i", range(len(INDEX_ERRORS)))
def test_index_argument_errors(i):
    call, exc, match = INDEX_ERRORS[i]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.skipif(not PAGED, reason="attention_with_kvcache has no block_table yet")
def test_block_table_dtype_error():
    q, kc = randn(1, 1, 2, 16), randn(4, 8, 1, 16)
    with pytest.raises(RuntimeError, match="block_table must have dtype int32"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=3,
                                block_table=torch.zeros(1, 2, dtype=torch.long, device=DEVICE))


@pytest.mark.skipif(not PAGED, reason="attention_with_kvcache has no block_table yet")
@pytest.mark.parametrize("n_new", [0, 1])
def test_kvcache_paged_overflow_names_block_table(n_new):
    """A paged cache's lengths (+ the new keys) past the positions block_table addresses
    (max_blocks_per_seq * page_block_size): RuntimeError naming block_table, as FlashAttention's
    guard raises, and a ValueError naming it from our own API; exactly full still runs."""
    page, d = 4, 16
    k_pages, v_pages = randn(3, page, 1, d), randn(3, page, 1, d)
    table = torch.tensor([[2]], **_I32)           # one page: 4 positions
    q = randn(1, 1, 1, d)
    new = dict(k=randn(1, n_new, 1, d), v=randn(1, n_new, 1, d)) if n_new else {}
    over = torch.tensor([page + 1 - n_new], **_I32)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=over, block_table=table,
                                **new)
    if DEVICE == "cpu":   # our API reads lengths only on the host (on a GPU: no sync)
        with pytest.raises(ValueError, match="block_table"):
            kernels.attention_with_kvcache(q.transpose(1, 2), k_pages, v_pages, over,
                                           *(t.transpose(1, 2) for t in new.values()),
                                           block_table=table)
    full = torch.tensor([page], **_I32)
    out = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=full, block_table=table)
    ref, lowp = _oracle(q, k_pages[2:], v_pages[2:])
    assert_parity(out, ref[0], lowp[0])


@pytest.mark.parametrize("i", range(len(ERRORS)))
def test_errors(i):
    call, exc, match = ERRORS[i]
    with pytest.raises(exc, match=match):
        call()


def test_fa3_scheduling_hints_change_nothing():
    """FlashAttention 3's scheduling hints are accepted and the result is the same bits."""
    q, k, v = _qkv(1, 9, 9, 2, 1, 16)
    hints = dict(scheduler_metadata=torch.zeros(4, dtype=torch.int32, device=DEVICE),
                 sm_margin=4, pack_gqa=True, num_splits=3)
    assert torch.equal(flash_attn_func(q, k, v, causal=True, **hints),
                       flash_attn_func(q, k, v, causal=True))
    cu = _cu([4, 5])
    packed = [t.detach()[0] for t in (q, k, v)]
    assert torch.equal(flash_attn_varlen_func(*packed, cu, cu, 5, 5, **hints),
                       flash_attn_varlen_func(*packed, cu, cu, 5, 5))


def test_one_line_switch():
    """The documented switch: the import path and kernels.flash_attn_interface are the module;
    its outputs are read in FlashAttention's layout without copies of the inputs."""
    from kernels.flash_attn_interface import flash_attn_func as f
    assert f is kernels.flash_attn_interface.flash_attn_func
    q = randn(2, 6, 2, 16)
    out = f(q, q, q, causal=True)
    ref, lowp = _oracle(q, q, q, causal=True)
    assert_parity(out, ref[0], lowp[0])
    assert math.isclose(float(out.stride(1)), 2 * 16)    # (batch, seqlen, heads, dim) dense


def test_compiles_fullgraph():
    """Under torch.compile(fullgraph=True) (aot_eager on CPU), a two-sided window and a
    bidirectional chunk (the mask mod path) with learnable sinks give eager's output and
    gradients bit for bit."""
    q, k, v = _qkv(1, 9, 9, 2, 1, 16)
    sinks = randn(2, requires_grad=True)

    def f(q, k, v, sinks):
        return flash_attn_func(q, k, v, window_size=(3, 2), softcap=2.0, attention_chunk=4,
                               s_aux=sinks)

    eager = f(q, k, v, sinks)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if DEVICE == "cpu"
                             else "inductor")(q, k, v, sinks)
    assert torch.equal(compiled, eager)
    do = torch.ones_like(eager)
    leaves = (q, k, v, sinks)
    for a, b in zip(_grads(compiled, leaves, do), _grads(eager, leaves, do)):
        assert torch.equal(a, b)


def test_varlen_block_table():
    """``flash_attn_varlen_func(..., block_table=)``: packed queries over shuffled pages give
    the packed call's bits; a sequence longer than its pages raises RuntimeError naming
    block_table, as FlashAttention's guard does."""
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_k, page, hk = [1, 4], [6, 9], 4, 2
    q = torch.randn(sum(lens_q), 4, 16, generator=gen).to(DEVICE)
    pool = torch.randn(2, 7, page, hk, 16, generator=gen).to(DEVICE)   # k and v pages
    table = torch.tensor([[5, 2, 0], [1, 6, 3]], dtype=torch.int32, device=DEVICE)
    packed = [torch.cat([p[table[s].long()].reshape(-1, hk, 16)[:n] for s, n in
                         enumerate(lens_k)]) for p in pool]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    want = flash_attn_varlen_func(q, *packed, cu_q, cu_k, 4, 9, causal=True)
    got = flash_attn_varlen_func(q, pool[0], pool[1], cu_q, cu_k, 4, 9, causal=True,
                                 block_table=table)
    assert torch.equal(got, want)
    # FlashAttention 3's / vLLM's paged call by keyword: page_table and per-sequence key
    # counts (seqused_k) instead of cu_seqlens_k, max_seqlen_k left to us
    seqused = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    fa3 = flash_attn_varlen_func(q, pool[0], pool[1], cu_seqlens_q=cu_q, max_seqlen_q=4,
                                 seqused_k=seqused, page_table=table, causal=True)
    assert torch.equal(fa3, want)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_varlen_func(q, pool[0], pool[1], cu_q, _cu([6, 13]), 4, 13,
                               block_table=table)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_varlen_func(q, pool[0], pool[1], cu_q, seqused_k=seqused + 4, page_table=table)
    with pytest.raises(RuntimeError, match="pass one"):
        flash_attn_varlen_func(q, pool[0], pool[1], cu_q, cu_k, block_table=table,
                               page_table=table)
    with pytest.raises(RuntimeError, match="cu_seqlens_k is required"):
        flash_attn_varlen_func(q, *packed, cu_q)


def test_varlen_seqused_k_without_pages():
    """FlashAttention 3's packed keys with per-sequence counts: sequence s uses rows
    cu_seqlens_k[s] : cu_seqlens_k[s] + seqused_k[s] (an empty count too), causal aligned by
    the count; out and every gradient bit for bit the packed call's over just those keys (per
    sequence ALiBi slopes too), zero dk / dv on the unused rows. Counts past a sequence, and
    dropout, raise RuntimeError."""
    gen = torch.Generator().manual_seed(6)
    lens_q, lens_k, used = [1, 4, 3], [6, 9, 5], [4, 9, 0]
    q = torch.randn(sum(lens_q), 4, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(sum(lens_k), 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    slopes = torch.rand(3, 4, generator=gen).to(DEVICE)
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip([0, 6, 15], used)]).to(DEVICE)
    seqused = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    for causal, alibi in ((False, None), (True, slopes)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        got = flash_attn_varlen_func(*leaves, _cu(lens_q), _cu(lens_k), 4, 9, causal=causal,
                                     alibi_slopes=alibi, seqused_k=seqused)
        grads = torch.autograd.grad(got, leaves, do)
        kept = [t.clone().requires_grad_() for t in (q, k[rows], v[rows])]
        want = flash_attn_varlen_func(*kept, _cu(lens_q), _cu(used), 4, 9, causal=causal,
                                      alibi_slopes=alibi)
        want_grads = torch.autograd.grad(want, kept, do)
        assert torch.equal(got, want), causal
        assert torch.equal(grads[0], want_grads[0]), "dq"
        for name, g, w in zip(("dk", "dv"), grads[1:], want_grads[1:]):
            full = torch.zeros_like(g).index_copy(0, rows, w)
            assert torch.equal(g, full), name
    with pytest.raises(RuntimeError, match="within each sequence"):
        flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), seqused_k=seqused + 1)
    with pytest.raises(RuntimeError, match="needs cu_seqlens_k"):
        flash_attn_varlen_func(q, k, v, _cu(lens_q), seqused_k=seqused)
    with pytest.raises(RuntimeError, match="dropout is not supported with seqused_k"):
        flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), dropout_p=0.1,
                               seqused_k=seqused)


def test_varlen_seqused_k_compiles():
    """The tails' cu_seqlens are built from tensors (no host read): fullgraph compiles and
    gives the eager out and gradients."""
    lens_q, lens_k = [1, 4, 3], [6, 9, 5]
    q = randn(sum(lens_q), 4, 16, requires_grad=True)
    k, v = (randn(sum(lens_k), 2, 16, requires_grad=True) for _ in range(2))
    seqused = torch.tensor([4, 9, 0], dtype=torch.int32, device=DEVICE)

    def f(q, k, v, cu_q, cu_k, used):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 9, causal=True, seqused_k=used)

    args = (q, k, v, _cu(lens_q), _cu(lens_k), seqused)
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(eager, compiled)
    for a, b in zip(torch.autograd.grad(eager.sum(), (q, k, v)),
                    torch.autograd.grad(compiled.sum(), (q, k, v))):
        assert torch.equal(a, b)
