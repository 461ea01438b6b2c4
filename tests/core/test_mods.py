"""Soft-capping, sinks, chunked attention, ALiBi, a value head dim of its own and user score /
mask mods, through the Triton kernels (the interpreter on CPU) against the float64 oracle
(``reference.attention``) with the parity rule: forward, lse and gradients (``sinks.grad``
included), alone and combined with GQA, windows, packed sequences, the KV cache, split-KV and
dropout; the tiles a chunk hides are never read; bad values are clear errors."""
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kernels
import reference
from kernels import MaskMod, ScoreMod
from tests.helpers import (DEVICE, GRAD_FACTOR, assert_parity, check_call, grads_with_unused,
                           oracle_kwargs, randn)

SCALE_OF = {16: 0.25, 24: 24 ** -0.5, 32: 32 ** -0.5}


# ------------------------------------------------------------------ two user-written mods
@triton.jit
def _rel_bias(s, b, h, q_idx, kv_idx, aux):
    """A learned relative-position bias: table (heads, 2 * 8 - 1), distances clipped to 7."""
    d = tl.minimum(tl.maximum(q_idx - kv_idx, -7), 7) + 7
    return s + tl.load(aux[0] + h * 15 + d)


def _rel_bias_torch(s, b, h, q_idx, kv_idx, aux):
    d = (q_idx - kv_idx).clamp(-7, 7) + 7
    return s + aux[0].reshape(-1)[h * 15 + d].to(s.dtype)


REL_BIAS = ScoreMod("tests.rel_bias", _rel_bias, _rel_bias_torch)


@triton.jit
def _prefix_lm(b, h, q_idx, kv_idx, aux):
    """Prefix-LM: the first aux[1][b] keys are seen by every query (bidirectional prefix)."""
    return kv_idx < tl.load(aux[1] + b)


def _prefix_lm_torch(b, h, q_idx, kv_idx, aux):
    return kv_idx < aux[1].reshape(-1)[b]


PREFIX_LM = MaskMod("tests.prefix_lm", _prefix_lm, _prefix_lm_torch)


@triton.jit
def _cube(s, b, h, q_idx, kv_idx, aux):
    return s * s * s * 0.1


@triton.jit
def _cube_grad(ds, s, b, h, q_idx, kv_idx, aux):
    return ds * s * s * 0.3


CUBE = ScoreMod("tests.cube", _cube, lambda s, b, h, q, k, aux: s * s * s * 0.1, _cube_grad)


def _prefix_or_causal(b, h, q_idx, kv_idx, aux):
    """The prefix-LM pattern the kernels' causal=False + PREFIX_LM + a causal mask mod give."""
    return (kv_idx <= q_idx) | _prefix_lm_torch(b, h, q_idx, kv_idx, aux)


@triton.jit
def _causal_or_prefix(b, h, q_idx, kv_idx, aux):
    return (kv_idx <= q_idx) | (kv_idx < tl.load(aux[1] + b))


PREFIX_OR_CAUSAL = MaskMod("tests.prefix_or_causal", _causal_or_prefix, _prefix_or_causal)


@triton.jit
def _same_doc(b, h, q_idx, kv_idx, aux):
    """Documents of aux[1][0] positions each: a query sees its own document only."""
    size = tl.load(aux[1])
    return (q_idx // size) == (kv_idx // size)


@triton.jit
def _doc_keys(b, q_lo, q_hi, aux):
    size = tl.load(aux[1])
    return (q_lo // size) * size, ((q_hi - 1) // size + 1) * size


@triton.jit
def _doc_queries(b, kv_lo, kv_hi, aux):
    size = tl.load(aux[1])
    return (kv_lo // size) * size, ((kv_hi - 1) // size + 1) * size


def _same_doc_torch(b, h, q_idx, kv_idx, aux):
    size = aux[1].reshape(-1)[0]
    return (q_idx // size) == (kv_idx // size)


DOCUMENTS = MaskMod("tests.documents", _same_doc, _same_doc_torch, kv_range=_doc_keys,
                    q_range=_doc_queries)
DOCUMENTS_UNBOUNDED = MaskMod("tests.documents_unbounded", _same_doc, _same_doc_torch)


# ------------------------------------------------------------------ helpers
_oracle_kwargs, _grads, _check = oracle_kwargs, grads_with_unused, check_call


CASES = {
    "softcap": dict(causal=True, softcap=2.0),
    "softcap_noncausal": dict(causal=False, softcap=0.7),
    # Gemma 2's cap and Grok's order of magnitude, where scores are small against the cap: an
    # fp32 tanh computed as 1 - 2 / (exp(2x) + 1) lost cap x eps there (mods.SOFTCAP_EXACT).
    "softcap_50": dict(causal=True, softcap=50.0),
    "softcap_20_noncausal": dict(causal=False, softcap=20.0),
    "alibi": dict(causal=True, alibi_slopes="heads"),
    "alibi_per_batch": dict(causal=False, alibi_slopes="batch"),
    "sinks": dict(causal=True, sinks="random"),
    "sinks_window": dict(causal=True, window=5, sinks="random"),
    "chunk": dict(causal=True, chunk_size=5),
    "chunk_wide": dict(causal=True, chunk_size=16),
    "gemma2": dict(causal=True, window=7, softcap=5.0),
    "everything": dict(causal=True, window=6, softcap=3.0, alibi_slopes="heads",
                       sinks="random"),
    "chunk_sinks_softcap": dict(causal=True, chunk_size=8, softcap=4.0, sinks="random"),
    "score_mod": dict(causal=True, score_mod=REL_BIAS, mod_aux="table"),
    "score_mod_grad": dict(causal=False, score_mod=CUBE),
    "prefix_lm": dict(causal=False, mask_mod=PREFIX_OR_CAUSAL, mod_aux="table"),
    "mods_and_builtins": dict(causal=True, softcap=3.0, score_mod=REL_BIAS,
                              mask_mod=PREFIX_LM, mod_aux="table", sinks="random"),
}


def _materialise(case, b, hq):
    case = dict(case)
    if case.get("alibi_slopes") == "heads":
        case["alibi_slopes"] = torch.rand(hq, device=DEVICE)
    elif case.get("alibi_slopes") == "batch":
        case["alibi_slopes"] = torch.rand(b, hq, device=DEVICE)
    if case.get("mod_aux") == "table":
        case["mod_aux"] = (randn(hq, 15), torch.tensor([3, 0], dtype=torch.int32,
                                                        device=DEVICE)[:b])
    return case


@pytest.mark.parametrize("name", sorted(CASES))
def test_feature_parity(name):
    _check(_materialise(CASES[name], 2, 4))


@pytest.mark.parametrize("q_len,k_len", [(1, 17), (17, 1), (30, 13), (8, 40)])
def test_lengths_chunk_sinks(q_len, k_len):
    _check(dict(causal=True, chunk_size=6, sinks="random", softcap=3.0), q_len=q_len,
           k_len=k_len)


@pytest.mark.parametrize("d,dv", [(24, 16), (16, 32), (32, 8)])
def test_value_head_dim(d, dv):
    _check(dict(causal=True, sinks="random"), d=d, dv=dv)
    _check(dict(causal=False), d=d, dv=dv, hkv=4)


def test_fp16_everything():
    _check(_materialise(CASES["everything"], 2, 4), dtype=torch.float16)


def test_dropout_with_sinks_uses_the_same_mask():
    """Dropout drops key weights only: the oracle given the kernels' Philox mask matches, and
    the sinks change no bit of the mask (same seed: the kept pattern of out is the same)."""
    _check(dict(causal=True, sinks="random", softcap=2.0), seed=1234, dropout_p=0.3)


# ------------------------------------------------------------------ packed, cache, split
def test_varlen_features():
    cu = torch.tensor([0, 5, 5, 17, 30], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 12, 12, 33], dtype=torch.int32, device=DEVICE)
    hq, hkv = 4, 2
    q = randn(30, hq, 16, requires_grad=True)
    k = randn(33, hkv, 16, requires_grad=True)
    v = randn(33, hkv, 24, requires_grad=True)
    sinks = randn(hq, requires_grad=True)
    slopes = torch.rand(4, hq, device=DEVICE)
    kw = dict(causal=True, chunk_size=4, softcap=2.5, alibi_slopes=slopes)
    out, lse = kernels.attention_varlen(q, k, v, cu, cu_k, sinks=sinks, return_lse=True, **kw)
    do = randn(*out.shape)
    grads = _grads(out, (q, k, v, sinks), do)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    low_in = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    ro, rl = reference.attention_varlen(*ref_in[:3], cu, cu_k, sinks=ref_in[3],
                                        return_lse=True, **kw)
    lo, ll = reference.attention_varlen(*low_in[:3], cu, cu_k, sinks=low_in[3], upcast=False,
                                        return_lse=True, **kw)
    assert_parity(out, ro, lo)
    assert_parity(lse, rl.float(), ll.float(), name="lse")
    for name, g, r, l in zip(("dq", "dk", "dv", "dsinks"), grads, _grads(ro, ref_in, do.double()),
                             _grads(lo, low_in, do)):
        assert_parity(g, r, l, factor=GRAD_FACTOR, name=name)


def test_varlen_user_mods():
    """User mods on packed sequences: ``b`` is the sequence index (a per-sequence prefix length
    read from aux), positions count within each sequence."""
    cu = torch.tensor([0, 7, 20, 26], dtype=torch.int32, device=DEVICE)
    q, k, v = (randn(26, 2, 16, requires_grad=True) for _ in range(3))
    aux = (randn(2, 15), torch.tensor([3, 0, 5], dtype=torch.int32, device=DEVICE))
    kw = dict(causal=False, score_mod=REL_BIAS, mask_mod=PREFIX_OR_CAUSAL, mod_aux=aux)
    out = kernels.attention_varlen(q, k, v, cu, cu, **kw)
    do = randn(*out.shape)
    grads = _grads(out, (q, k, v), do)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    low_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ro = reference.attention_varlen(*ref_in, cu, cu, **_oracle_kwargs(kw))
    lo = reference.attention_varlen(*low_in, cu, cu, upcast=False, **_oracle_kwargs(kw))
    assert_parity(out, ro, lo)
    for name, g, r, l in zip(("dq", "dk", "dv"), grads, _grads(ro, ref_in, do.double()),
                             _grads(lo, low_in, do)):
        assert_parity(g, r, l, factor=GRAD_FACTOR, name=name)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_features(num_splits):
    b, hq, hkv, max_len, q_len = 2, 4, 2, 40, 3
    k_cache, v_cache = randn(b, hkv, max_len, 16), randn(b, hkv, max_len, 8)
    q, k, v = randn(b, hq, q_len, 16), randn(b, hkv, q_len, 16), randn(b, hkv, q_len, 8)
    lens = torch.tensor([20, 33], dtype=torch.int32, device=DEVICE)
    sinks = randn(hq)
    kw = dict(causal=True, chunk_size=8, softcap=3.0, sinks=sinks,
              alibi_slopes=torch.rand(b, hq, device=DEVICE))
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = kernels.attention_with_kvcache(q, kc, vc, lens, k, v, num_splits=num_splits,
                                              return_lse=True, **kw)
    ro, rl = reference.attention_with_kvcache(q.double(), k_cache.double(), v_cache.double(),
                                              lens, k.double(), v.double(), return_lse=True,
                                              **kw)
    lo, ll = reference.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), lens, k, v,
                                              upcast=False, return_lse=True, **kw)
    assert out.shape == (b, hq, q_len, 8)
    assert_parity(out, ro, lo)
    assert_parity(lse, rl.float(), ll.float(), name="lse")


def test_split_kv_sinks_matches_unsplit():
    q, k, v = randn(1, 4, 2, 16), randn(1, 2, 70, 16), randn(1, 2, 70, 16)
    sinks = randn(4) * 3
    kw = dict(causal=True, sinks=sinks, softcap=2.0, return_lse=True)
    o1, l1 = kernels.attention(q, k, v, num_splits=1, **kw)
    o3, l3 = kernels.attention(q, k, v, num_splits=3, **kw)
    torch.testing.assert_close(o3, o1, rtol=0, atol=2e-6)
    torch.testing.assert_close(l3, l1, rtol=0, atol=2e-6)


# ------------------------------------------------------------------ edge cases
# The widest key / query tile of any launch config (kernels/core/configs.py: 128 on the GPU, 16
# in the interpreter). The tests that poison a hidden region make it whole tiles of every width
# up to this: a hidden key sharing a tile with a visible one is loaded (masked to P = 0, but
# P = 0 x V = NaN is NaN), which is not what they are about.
WIDEST_TILE = 128


def test_chunk_never_reads_hidden_keys():
    """Queries at positions 256..263 with chunk 128 see keys 256..263 only: NaN keys and values
    in positions 0..255 (whole key tiles of every width up to 128) are never loaded. The chunk
    skips them, so the interpreter visits one 16-key tile per row block: cheap."""
    hidden = 2 * WIDEST_TILE
    q, k, v = randn(1, 2, 8, 16), randn(1, 2, hidden + 8, 16), randn(1, 2, hidden + 8, 16)
    clean = kernels.attention(q, k, v, causal=True, chunk_size=WIDEST_TILE)
    k[:, :, :hidden], v[:, :, :hidden] = float("nan"), float("nan")
    poisoned = kernels.attention(q, k, v, causal=True, chunk_size=WIDEST_TILE)
    assert torch.equal(poisoned, clean)
    ref = reference.attention(q.double(), k[:, :, hidden:].double(), v[:, :, hidden:].double(),
                              causal=True)
    assert_parity(clean, ref, reference.attention(q, k[:, :, hidden:], v[:, :, hidden:],
                                                  causal=True, upcast=False))


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("mod", [DOCUMENTS, DOCUMENTS_UNBOUNDED], ids=["bounded", "unbounded"])
def test_mask_mod_ranges_skip_tiles(mod):
    """A document mask with kv_range / q_range: parity (documents of 16 positions, so on the
    GPU its tiles mix documents), and the tiles of other documents are never read -- with
    documents of 128 positions (whole tiles of every width up to 128) over 144 positions, NaN
    values of keys 0..127 leave the second document's rows untouched, NaN queries 0..127
    leave its keys' dK / dV untouched. Without the ranges the same mask visits those tiles
    (NaN reaches them)."""
    def kwargs(size):
        aux = (torch.zeros(1, device=DEVICE),
               torch.tensor([size], dtype=torch.int32, device=DEVICE))
        return dict(causal=False, mask_mod=mod, mod_aux=aux)

    _check(kwargs(16), hq=2, hkv=2, q_len=48, k_len=48)
    doc = WIDEST_TILE
    kw = kwargs(doc)
    q, k, v = (randn(1, 1, doc + 16, 16, requires_grad=True) for _ in range(3))
    pv, pq = v.detach().clone(), q.detach().clone()
    pv[:, :, :doc], pq[:, :, :doc] = float("nan"), float("nan")
    poisoned = kernels.attention(q.detach(), k.detach(), pv, **kw)
    if mod is DOCUMENTS_UNBOUNDED:
        assert torch.isnan(poisoned[:, :, doc:]).any()
        return
    out = kernels.attention(q, k, v, **kw)
    dq, dk, dv = _grads(out, (q, k, v), torch.ones_like(out))
    pq.requires_grad_(), k.requires_grad_()
    out_q = kernels.attention(pq, k, v, **kw)
    _, dk_q, dv_q = _grads(out_q, (pq, k, v), torch.ones_like(out_q))
    assert torch.equal(poisoned[:, :, doc:], out[:, :, doc:].detach())
    assert torch.equal(dk_q[:, :, doc:], dk[:, :, doc:])
    assert torch.equal(dv_q[:, :, doc:], dv[:, :, doc:])


def test_mask_ranges_come_in_pairs():
    with pytest.raises(ValueError, match="give both or neither"):
        MaskMod("tests.half_bounded", _same_doc, _same_doc_torch, kv_range=_doc_keys)


# tanh's exp2 overflows to +inf on purpose (tanh = 1 there); numpy says so in the interpreter.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
def test_softcap_keeps_huge_logits_finite():
    q, k, v = randn(1, 2, 9, 16) * 1e4, randn(1, 2, 9, 16) * 1e4, randn(1, 2, 9, 16)
    out, lse = kernels.attention(q, k, v, softcap=30.0, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert lse.max() <= 30.0 + torch.log(torch.tensor(9.0)) + 1e-4
    assert_parity(out, reference.attention(q.double(), k.double(), v.double(), softcap=30.0),
                  reference.attention(q, k, v, softcap=30.0, upcast=False))


def test_row_without_keys_with_sinks():
    """q_len > k_len causal: the first rows see no key; with sinks they give 0 and lse = sink."""
    q, k, v = randn(1, 2, 6, 16), randn(1, 2, 3, 16), randn(1, 2, 3, 16)
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    out, lse = kernels.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    torch.testing.assert_close(lse[0, :, :3], sinks[:, None].expand(2, 3))


def test_backward_bit_identical():
    q, k, v = (randn(2, 4, 21, 16, requires_grad=True) for _ in range(3))
    sinks = randn(4, requires_grad=True)
    kw = dict(causal=True, window=9, softcap=2.0, sinks=sinks, dropout_p=0.2, seed=7)
    runs = []
    for _ in range(2):
        out = kernels.attention(q, k, v, **kw)
        runs.append((out,) + _grads(out, (q, k, v, sinks), torch.ones_like(out)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_user_mod_twin_contract():
    """A ScoreMod's name is its identity across the custom op; a second one by that name is an
    error, and fn must be a @triton.jit function."""
    with pytest.raises(ValueError, match="already exists"):
        ScoreMod("tests.rel_bias", _rel_bias, _rel_bias_torch)
    with pytest.raises(TypeError, match=r"@triton.jit"):
        ScoreMod("tests.not_jit", _rel_bias_torch, _rel_bias_torch)


BAD = [
    (dict(softcap=0.0), ValueError, "softcap must be finite and > 0"),
    (dict(softcap=float("nan")), ValueError, "softcap must be finite and > 0"),
    (dict(softcap="1"), TypeError, "softcap must be a positive float"),
    (dict(sinks=torch.zeros(3, device=DEVICE)), ValueError, r"sinks must have shape \(4,\)"),
    (dict(sinks=torch.zeros(4, dtype=torch.int64, device=DEVICE)), TypeError,
     "sinks must be a floating"),
    (dict(chunk_size=0), ValueError, "chunk_size must be in"),
    (dict(chunk_size=4, causal=False), ValueError, "chunk_size requires causal=True"),
    (dict(chunk_size=4, window=3), ValueError, "chunk_size and window cannot be combined"),
    (dict(alibi_slopes=torch.zeros(2, 3, device=DEVICE)), ValueError,
     "alibi_slopes must have shape"),
    (dict(score_mod=_rel_bias), TypeError, "score_mod must be a kernels.ScoreMod"),
    (dict(mod_aux=(torch.zeros(1, device=DEVICE),)), ValueError, "no score_mod or mask_mod"),
    (dict(score_mod=REL_BIAS, mod_aux=(1.0,)), TypeError, r"mod_aux\[0\] must be a torch"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD)
def test_bad_values(kwargs, exc, match):
    q, k, v = randn(2, 4, 5, 16), randn(2, 2, 5, 16), randn(2, 2, 5, 16)
    with pytest.raises(exc, match=match):
        kernels.attention(q, k, v, **kwargs)


def test_compiles_fullgraph_with_mods_and_sinks():
    """The custom op carries the new options (mods by name, sinks differentiable): one graph
    under torch.compile(fullgraph=True) (aot_eager on CPU), equal to eager, gradients too:
    the kernels' results (out, dQ, dK, dV) bit for bit, sinks.grad to a few fp32 ulps."""
    q, k, v = (randn(1, 4, 13, 16, requires_grad=True) for _ in range(3))
    sinks = randn(4, requires_grad=True)
    table = randn(4, 15)
    kw = dict(causal=True, softcap=3.0, chunk_size=5, score_mod=REL_BIAS, mod_aux=(table,))

    def f(q, k, v, sinks):
        return kernels.attention(q, k, v, sinks=sinks, **kw)

    eager = f(q, k, v, sinks)
    compiled = torch.compile(f, fullgraph=True,
                             backend="aot_eager" if DEVICE == "cpu" else "inductor")(q, k, v,
                                                                                     sinks)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    do = torch.ones_like(eager)
    (*g_compiled, ds_compiled), (*g_eager, ds_eager) = (
        _grads(out, (q, k, v, sinks), do) for out in (compiled, eager))
    for a, b in zip(g_compiled, g_eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # sinks.grad is no kernel's result: kernels.core.mods.sinks_grad computes it in PyTorch from
    # out and lse, -sum_i w_i delta_i with w_i = exp(sink - lse_i), delta_i = sum_d dO_id O_id,
    # and inductor (the GPU's backend here) compiles those ops into fused kernels of its own:
    # another exp and other summation orders than eager's (an H200: up to 4.8e-7, 1.3e-7 rel).
    # Allowed: a few fp32 ulps of the first-order rounding of those ops -- w_i's relative
    # error ~eps * (1 + |sink - lse_i|) (the rounding of exp's argument), the sums' reordering
    # ~eps * sum_i w_i sum_d |dO_id O_id| (the absolute terms: delta and the sum over rows may
    # cancel). CPU inductor differs by at most 0.35 of this scale; a wrong gradient by O(1).
    with torch.no_grad():
        _, lse = kernels.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
        arg = sinks[None, :, None] - lse
        scale = (torch.exp(arg) * (1 + arg.abs()) * (do * eager).abs().sum(-1)).sum((0, 2))
    allowed = 4 * torch.finfo(torch.float32).eps * scale
    err = (ds_compiled - ds_eager).abs()
    assert (err <= allowed).all(), f"sinks.grad: compiled vs eager {err} > allowed {allowed}"


# ------------------------------------------------------------------ extreme mod values, bounds
# A score mod may mask by returning -inf (FlexAttention's mods do): a row that sees
# only -inf gives 0 and lse -inf, and a tile of -inf before any finite score must not poison
# the running max ((-inf) - (-inf) = NaN). The oracle takes the same pattern as a mask (its
# softmax of an all -inf row is NaN, the kernels' contract is 0).
def _neg_inf_hidden(q_idx, kv_idx):
    """Keys more than 3 positions back are hidden, and every key of positions 2 mod 5: rows
    past the first key tile start with whole tiles of -inf, some rows see nothing."""
    return (kv_idx < q_idx - 3) | ((q_idx >= 0) & (q_idx % 5 == 2))


@triton.jit
def _neg_inf_mod(s, b, h, q_idx, kv_idx, aux):
    # Positions below 0 (q_len > k_len) stay out of %: Triton's and PyTorch's differ there.
    hidden = (kv_idx < q_idx - 3) | ((q_idx >= 0) & (q_idx % 5 == 2))
    return tl.where(hidden, float("-inf"), s)


NEG_INF = ScoreMod("tests.neg_inf", _neg_inf_mod,
                   lambda s, b, h, q, kv, aux: s.masked_fill(_neg_inf_hidden(q, kv),
                                                             float("-inf")))


def _neg_inf_as_mask(b, h, q_idx, kv_idx, aux):
    """NEG_INF's pattern as the oracle's mask (a PyTorch mask function)."""
    return ~_neg_inf_hidden(q_idx, kv_idx)


@triton.jit
def _huge_mod(s, b, h, q_idx, kv_idx, aux):
    """Large finite values added (derivative 1) to some keys: -1e30, and -3e38, whose base-2
    score overflows fp32 to -inf in the kernels. Key 0 keeps its score: no row's max moves."""
    s = tl.where(kv_idx % 3 == 1, s - 1e30, s)
    return tl.where(kv_idx % 7 == 2, s - 3e38, s)


def _huge_torch(s, b, h, q_idx, kv_idx, aux):
    s = torch.where(kv_idx % 3 == 1, s - 1e30, s)
    return torch.where(kv_idx % 7 == 2, s - 3e38, s)


HUGE = ScoreMod("tests.huge", _huge_mod, _huge_torch)


@triton.jit
def _huge_rows_mod(s, b, h, q_idx, kv_idx, aux):
    """Rows whose largest scores are ±1e30: some keys of rows 0 mod 4 win everything, rows
    5 mod 6 are all -1e30 (uniform weights)."""
    s = tl.where((q_idx >= 0) & (q_idx % 4 == 0) & (kv_idx % 5 == 0), s + 1e30, s)
    return tl.where((q_idx >= 0) & (q_idx % 6 == 5), s - 1e30, s)


def _huge_rows_torch(s, b, h, q_idx, kv_idx, aux):
    s = torch.where((q_idx >= 0) & (q_idx % 4 == 0) & (kv_idx % 5 == 0), s + 1e30, s)
    return torch.where((q_idx >= 0) & (q_idx % 6 == 5), s - 1e30, s)


HUGE_ROWS = ScoreMod("tests.huge_rows", _huge_rows_mod, _huge_rows_torch)


@pytest.mark.parametrize("causal,q_len,k_len", [(False, 40, 40), (True, 19, 37),
                                                (False, 33, 17)])
def test_score_mod_neg_inf_rows(causal, q_len, k_len):
    """Forward, lse (-inf exactly on the rows the mod hides) and dq / dk / dv: no NaN."""
    _check(dict(causal=causal, score_mod=NEG_INF), b=1, hq=2, hkv=1, q_len=q_len, k_len=k_len,
           oracle_case=dict(causal=causal, mask_mod=_neg_inf_as_mask))


def test_score_mod_neg_inf_with_builtins_and_sinks():
    common = dict(causal=True, softcap=3.0, alibi_slopes=torch.rand(4, device=DEVICE), window=9)
    _check(dict(common, sinks="random", score_mod=NEG_INF), q_len=23, k_len=23,
           oracle_case=dict(common, mask_mod=_neg_inf_as_mask))


@pytest.mark.parametrize("num_splits", [3, 4])
def test_score_mod_neg_inf_split_kv(num_splits):
    """Split-KV: splits whose keys are all -inf for a row give partials of lse -inf; the merge
    of only such partials is 0 / -inf."""
    _check(dict(causal=False, score_mod=NEG_INF), b=1, hq=2, hkv=1, q_len=7, k_len=40,
           num_splits=num_splits, oracle_case=dict(causal=False, mask_mod=_neg_inf_as_mask))


# -3e38 times log2(e) overflows to -inf on purpose; numpy says so in the interpreter.
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("causal", [False, True])
def test_score_mod_huge_finite(causal):
    _check(dict(causal=causal, score_mod=HUGE), b=1, hq=2, hkv=2, q_len=21, k_len=30)


def test_score_mod_huge_row_max():
    """Rows whose max score is ±1e30: out and lse match the oracle; the gradients are finite.
    Their values are not checked: the backward recomputes P = exp(s - lse) from the fp32 lse,
    which cannot hold log(sum) next to 1e30 (an ulp of 1e30 in fp32 is 7.6e22), as in
    FlashAttention's and FlexAttention's backward."""
    q, k, v = (randn(1, 2, 21, 16, requires_grad=True) for _ in range(3))
    out, lse = kernels.attention(q, k, v, causal=False, score_mod=HUGE_ROWS, return_lse=True)
    kw = dict(causal=False, score_mod=_huge_rows_torch, return_lse=True)
    ro, rl = reference.attention(q.detach().double(), k.detach().double(), v.detach().double(),
                                 **kw)
    lo, ll = reference.attention(q.detach(), k.detach(), v.detach(), upcast=False, **kw)
    assert_parity(out, ro, lo)
    assert_parity(lse, rl.float(), ll.float(), name="lse")
    for name, g in zip(("dq", "dk", "dv"), _grads(out, (q, k, v), randn(*out.shape))):
        assert torch.isfinite(g).all(), name


def test_score_mod_neg_inf_varlen():
    cu = torch.tensor([0, 1, 18, 18, 40], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 26, 30, 36], dtype=torch.int32, device=DEVICE)
    q = randn(40, 2, 16, requires_grad=True)
    k, v = (randn(36, 1, 16, requires_grad=True) for _ in range(2))
    out, lse = kernels.attention_varlen(q, k, v, cu, cu_k, causal=False, score_mod=NEG_INF,
                                        return_lse=True)
    do = randn(*out.shape)
    grads = _grads(out, (q, k, v), do)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    low_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kw = dict(causal=False, mask_mod=_neg_inf_as_mask, return_lse=True)
    ro, rl = reference.attention_varlen(*ref_in, cu, cu_k, **kw)
    lo, ll = reference.attention_varlen(*low_in, cu, cu_k, upcast=False, **kw)
    assert_parity(out, ro, lo)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))
    for name, g, r, l in zip(("dq", "dk", "dv"), grads, _grads(ro, ref_in, do.double()),
                             _grads(lo, low_in, do)):
        assert_parity(g, r, l, factor=GRAD_FACTOR, name=name)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_score_mod_neg_inf_kvcache(num_splits):
    b, hq, hkv, max_len, q_len = 2, 2, 1, 40, 3
    k_cache, v_cache = randn(b, hkv, max_len, 16), randn(b, hkv, max_len, 16)
    q, k, v = randn(b, hq, q_len, 16), randn(b, hkv, q_len, 16), randn(b, hkv, q_len, 16)
    lens = torch.tensor([20, 34], dtype=torch.int32, device=DEVICE)
    out, lse = kernels.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), lens, k, v,
                                              causal=True, num_splits=num_splits,
                                              score_mod=NEG_INF, return_lse=True)
    kw = dict(causal=True, mask_mod=_neg_inf_as_mask, return_lse=True)
    ro, rl = reference.attention_with_kvcache(q.double(), k_cache.double(), v_cache.double(),
                                              lens, k.double(), v.double(), **kw)
    lo, ll = reference.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), lens, k, v,
                                              upcast=False, **kw)
    assert_parity(out, ro, lo)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))
    assert_parity(lse[torch.isfinite(rl)], rl[torch.isfinite(rl)].float(),
                  ll[torch.isfinite(rl)].float(), name="lse")


def _fallback_neg_inf(monkeypatch):
    """NEG_INF through the PyTorch fallback (the interpreter off at call time, as a user
    without it): (out, lse, grads) and the oracle's."""
    q, k, v = (randn(1, 2, 17, 16, requires_grad=True) for _ in range(3))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", True)
    out, lse = kernels.attention(q, k, v, causal=False, score_mod=NEG_INF, return_lse=True)
    do = randn(*out.shape)
    grads = _grads(out, (q, k, v), do)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    low_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kw = dict(causal=False, mask_mod=_neg_inf_as_mask)
    ro, rl = reference.attention(*ref_in, return_lse=True, **kw)
    lo = reference.attention(*low_in, upcast=False, **kw)
    return (out, lse, grads), (ro, rl, _grads(ro, ref_in, do.double())), (lo, _grads(lo, low_in,
                                                                                      do))


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
def test_score_mod_neg_inf_fallback(monkeypatch):
    """The PyTorch fallback gives the same 0 rows and -inf lse."""
    (out, lse, grads), (ro, rl, _), (lo, _) = _fallback_neg_inf(monkeypatch)
    assert_parity(out, ro, lo)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert not torch.isnan(g).any(), name


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
def test_score_mod_neg_inf_fallback_grads(monkeypatch):
    """The fallback's backward differentiates the score mods' twins: from the eager path's
    autograd.Function (kernels/ops.py ``_PlannedAttention``) and from inside the custom op (the
    torch.compile path), where autograd is off at the dispatch level until the fallback turns
    it back on (fallback.py ``_recording``; without it dq, dk came out wrong for every score
    mod)."""
    (_, _, grads), (_, _, rg), (_, lg) = _fallback_neg_inf(monkeypatch)
    for name, g, r, l in zip(("dq", "dk", "dv"), grads, rg, lg):
        assert_parity(g, r, l, factor=GRAD_FACTOR, name=name)


# A mask mod whose pattern *is* its bounds: query positions [aux[0][2], aux[0][3]) see keys
# [aux[0][0], aux[0][1]); kv_range / q_range return them as given, so any int32 values are
# exact (tight) bounds, however far outside the sequence.
@triton.jit
def _box(b, h, q_idx, kv_idx, aux):
    return ((kv_idx >= tl.load(aux[0])) & (kv_idx < tl.load(aux[0] + 1))
            & (q_idx >= tl.load(aux[0] + 2)) & (q_idx < tl.load(aux[0] + 3)))


@triton.jit
def _box_keys(b, q_lo, q_hi, aux):
    return tl.load(aux[0]), tl.load(aux[0] + 1)


@triton.jit
def _box_queries(b, kv_lo, kv_hi, aux):
    return tl.load(aux[0] + 2), tl.load(aux[0] + 3)


def _box_torch(b, h, q_idx, kv_idx, aux):
    lo, hi, q_lo, q_hi = (int(x) for x in aux[0].reshape(-1).tolist())
    return (kv_idx >= lo) & (kv_idx < hi) & (q_idx >= q_lo) & (q_idx < q_hi)


BOX = MaskMod("tests.box", _box, _box_torch, kv_range=_box_keys, q_range=_box_queries)
I32_MIN, I32_MAX = -2 ** 31, 2 ** 31 - 1


def _box_case(bounds):
    return dict(causal=False, mask_mod=BOX,
                mod_aux=(torch.tensor(bounds, dtype=torch.int32, device=DEVICE),))


BOUNDS = [
    (0, I32_MAX, 0, I32_MAX),                 # the issue's: everything, int32-max ends
    (I32_MIN, I32_MAX, I32_MIN, I32_MAX),     # both ends extreme
    (-5, 2 ** 30, -100, 2 ** 30 + 7),         # negative starts, huge ends
    (5, I32_MAX, I32_MIN, 13),                # a box inside, reaching out on two sides
    (0, 0, 0, I32_MAX),                       # an empty key range: every row 0, lse -inf
    (-9, -1, I32_MIN, I32_MAX),               # keys before the sequence: empty
    (3, 11, 30, I32_MAX),                     # rows past the sequence: empty
    (I32_MAX, I32_MIN, 0, I32_MAX),           # reversed: empty
]


@pytest.mark.parametrize("bounds", BOUNDS)
def test_mask_ranges_extreme_bounds(bounds):
    """Output, lse and gradients with range functions returning 0, negative, huge and int32
    extremes (forward and dQ use kv_range, dK/dV q_range); q_len != k_len both ways."""
    _check(_box_case(bounds), b=1, hq=2, hkv=1, q_len=19, k_len=26)
    _check(_box_case(bounds), b=1, hq=1, hkv=1, q_len=26, k_len=9)


@pytest.mark.parametrize("bounds", [BOUNDS[0], BOUNDS[3]])
def test_mask_ranges_extreme_bounds_split_kv(bounds):
    _check(_box_case(bounds), b=1, hq=2, hkv=1, q_len=5, k_len=40, num_splits=4)


def test_mask_ranges_extreme_bounds_varlen():
    cu = torch.tensor([0, 13, 13, 33], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 21, 25, 31], dtype=torch.int32, device=DEVICE)
    for bounds in (BOUNDS[1], BOUNDS[3]):
        kw = _box_case(bounds)
        q = randn(33, 2, 16, requires_grad=True)
        k, v = (randn(31, 2, 16, requires_grad=True) for _ in range(2))
        out = kernels.attention_varlen(q, k, v, cu, cu_k, **kw)
        do = randn(*out.shape)
        grads = _grads(out, (q, k, v), do)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        low_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ro = reference.attention_varlen(*ref_in, cu, cu_k, **_oracle_kwargs(kw))
        lo = reference.attention_varlen(*low_in, cu, cu_k, upcast=False, **_oracle_kwargs(kw))
        assert_parity(out, ro, lo)
        for name, g, r, l in zip(("dq", "dk", "dv"), grads, _grads(ro, ref_in, do.double()),
                                 _grads(lo, low_in, do)):
            assert_parity(g, r, l, factor=GRAD_FACTOR, name=name)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mask_ranges_extreme_bounds_kvcache(num_splits):
    b, hq, hkv, max_len, q_len = 2, 2, 1, 40, 2
    k_cache, v_cache = randn(b, hkv, max_len, 16), randn(b, hkv, max_len, 16)
    q = randn(b, hq, q_len, 16)
    lens = torch.tensor([17, 38], dtype=torch.int32, device=DEVICE)
    kw = {**_box_case(BOUNDS[0]), "causal": True}
    out = kernels.attention_with_kvcache(q, k_cache, v_cache, lens, num_splits=num_splits, **kw)
    ref = reference.attention_with_kvcache(q.double(), k_cache.double(), v_cache.double(), lens,
                                           **_oracle_kwargs(kw))
    low = reference.attention_with_kvcache(q, k_cache, v_cache, lens, upcast=False,
                                           **_oracle_kwargs(kw))
    assert_parity(out, ref, low)


# Ordered so that hypothesis's first examples (it starts from the first values) are extremes.
_EXTREMES = st.sampled_from([0, I32_MAX, I32_MIN, -1, 2 ** 30, 7, 16, 25, -17, 1])


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@example(bounds=(0, I32_MAX, 0, I32_MAX), causal=False, mod=NEG_INF)     # the two
@example(bounds=(I32_MIN, I32_MAX, I32_MIN, I32_MAX), causal=True, mod=None)
@given(bounds=st.tuples(_EXTREMES, _EXTREMES, _EXTREMES, _EXTREMES), causal=st.booleans(),
       mod=st.sampled_from([NEG_INF, None]))
def test_property_extreme_values_and_bounds(bounds, causal, mod):
    """Property: any int32 bounds from the extremes, with or without a score mod of -inf
    values, causal or not: parity of out, lse and gradients (derandomized: the same
    examples every run)."""
    case = {**_box_case(bounds), "causal": causal}
    oracle = dict(case)
    if mod is not None:
        case["score_mod"] = mod
        # Both patterns as one mask in the oracle.
        oracle["mask_mod"] = lambda b, h, q, kv, aux: (_box_torch(b, h, q, kv, aux)
                                                       & _neg_inf_as_mask(b, h, q, kv, aux))
    _check(case, b=1, hq=2, hkv=1, q_len=17, k_len=25, oracle_case=oracle)
