"""The PyTorch fallback's chunked attention, score / mask modifications, sinks and value head_dim
(kernels/core/fallback.py) against a float64 oracle written here in plain PyTorch.

The fallback functions are called directly with an ``AttentionCall`` (tests/conftest.py turns
Triton's interpreter on when there is no GPU, which would route ``kernels.attention`` to the
interpreted kernels instead). The oracle builds the whole (batch, heads, q_len, k_len) score
tensor in the natural layout and applies each rule by its definition: it shares no code with
the fallback (the built-in soft-capping and ALiBi are written out again; the test's own
mods are called with the oracle's index tensors, not the fallback's), and the dropout mask is
reference/dropout.py's.
"""
import pytest
import torch
import triton
import triton.language as tl

from kernels.core import fallback
from kernels.core.call import AttentionCall
from kernels.core.mods import CallMods, MaskMod, ScoreMod
from reference.dropout import dropout_keep_mask, dropout_keep_mask_varlen

# fp32 fallback against the float64 oracle at these sizes (head_dim <= 24, <= 31 keys): the
# largest error measured over all cases is 6e-7 of the result's largest magnitude; the bound
# leaves 50x room and still fails on any wrong weight, mask bit or missing term.
RTOL = 3e-5


# --------------------------------------------------------------------- the test's own mods
@triton.jit
def _gain_bias_fn(s, b, h, q_idx, kv_idx, aux):
    return s * tl.load(aux[0] + h) + tl.load(aux[1] + b) * (q_idx - kv_idx).to(tl.float32)


@triton.jit
def _gain_bias_grad(ds, s, b, h, q_idx, kv_idx, aux):
    return ds * tl.load(aux[0] + h)


def _gain_bias_torch(s, b, h, q_idx, kv_idx, aux):
    """s * gain[h] + bias[b] * (q_idx - kv_idx): a derivative that depends on the head, and a
    bias that depends on the batch entry and both positions, so a wrong b, h, q_idx or kv_idx
    changes the result."""
    gain, bias = aux
    return s * gain[h].to(s.dtype) + bias[b].to(s.dtype) * (q_idx - kv_idx).to(s.dtype)


GAIN_BIAS = ScoreMod("test_fallback_mods.gain_bias", _gain_bias_fn, _gain_bias_torch,
                     _gain_bias_grad)


@triton.jit
def _stripes_fn(b, h, q_idx, kv_idx, aux):
    return ((q_idx + kv_idx + h) % 3 != 0) & ((q_idx % 7 != 3) | (b != 1))


def _stripes_torch(b, h, q_idx, kv_idx, aux):
    """Hides a head-dependent third of the pairs, and every key of the rows at positions
    3 mod 7 in batch entry 1 (rows left without any key)."""
    return ((q_idx + kv_idx + h) % 3 != 0) & ((q_idx % 7 != 3) | (b != 1))


STRIPES = MaskMod("test_fallback_mods.stripes", _stripes_fn, _stripes_torch)


# ------------------------------------------------------------------------------ the oracle
def oracle(q, k, v, call, b_index, keep=None):
    """float64 (out, lse) of one dense problem, differentiable in q, k, v.

    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) float64; ``b_index`` int64 (B,):
    the batch entry (or packed sequence) of each, as the mods see it; ``keep``: bool (B, Hq,
    Lq, Lk) dropout mask (with ``call.dropout_p``). Returns out (B, Hq, Lq, Dv), lse (B, Hq,
    Lq) with -inf for rows that see no key and have no sink."""
    B, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    group = Hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mods = call.mods
    s = call.softmax_scale * (q @ k.transpose(-1, -2))
    b = b_index.view(-1, 1, 1, 1)
    h = torch.arange(Hq).view(1, -1, 1, 1)
    pos = (torch.arange(Lq) + Lk - Lq).view(1, 1, -1, 1)  # bottom-right aligned
    j = torch.arange(Lk).view(1, 1, 1, -1)
    if mods.softcap is not None:
        s = mods.softcap * torch.tanh(s / mods.softcap)
    if mods.alibi_slopes is not None:
        a = mods.alibi_slopes.double()
        slope = a[b_index] if a.dim() == 2 else a.expand(B, -1)
        s = s - slope.view(B, Hq, 1, 1) * (pos - j).abs()
    if mods.score_mod is not None:
        s = mods.score_mod.torch_fn(s, b, h, pos, j, mods.aux)
    vis = torch.ones(B, Hq, Lq, Lk, dtype=torch.bool)
    if call.causal:
        vis = vis & (j <= pos)
        if call.window is not None:
            vis = vis & (j > pos - call.window)
        if call.chunk_size is not None:
            c = call.chunk_size
            vis = vis & (torch.div(j, c, rounding_mode="floor")
                         == torch.div(pos, c, rounding_mode="floor"))
    if mods.mask_mod is not None:
        vis = vis & mods.mask_mod.torch_fn(b, h, pos, j, mods.aux)
    # Rows without any visible key (and no sink) are given finite scores before the logsumexp
    # and zero weights after it: no -inf - -inf anywhere, so autograd stays NaN-free.
    empty = ~vis.any(-1, keepdim=True)
    if mods.sinks is not None:
        empty = torch.zeros_like(empty)
    s = s.masked_fill(~vis, float("-inf")).masked_fill(empty, 0.0)
    logits = s
    if mods.sinks is not None:
        sink = mods.sinks.double().view(1, Hq, 1, 1).expand(B, -1, Lq, 1)
        logits = torch.cat([s, sink], -1)
    lse = torch.logsumexp(logits, -1)
    p = torch.exp(s - lse[..., None]) * vis
    if keep is not None:
        p = p * keep / (1.0 - call.dropout_p)
    return p @ v, lse.masked_fill(empty[..., 0], float("-inf"))


# --------------------------------------------------------------------------- comparisons
def _inputs(B, Hq, Hkv, Lq, Lk, D, Dv, packed_lens=None):
    """fp32 q, k, v, do: dense (B, H, L, D) or, with ``packed_lens`` [(lq, lk)], packed
    (total, H, D)."""
    if packed_lens is None:
        shapes = [(B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv), (B, Hq, Lq, Dv)]
    else:
        tq, tk = sum(a for a, _ in packed_lens), sum(c for _, c in packed_lens)
        shapes = [(tq, Hq, D), (tk, Hkv, D), (tk, Hkv, Dv), (tq, Hq, Dv)]
    return [torch.randn(*s) for s in shapes]


def _close(name, got, want):
    """``got`` (fp32) within RTOL of the largest magnitude of ``want`` (float64), and -inf
    exactly where ``want`` is."""
    assert got.shape == want.shape, f"{name}: {tuple(got.shape)} != {tuple(want.shape)}"
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf), f"{name}: infinities differ"
    assert torch.equal(got[inf], want[inf].float()), f"{name}: infinities differ in sign"
    assert not torch.isnan(got).any(), f"{name}: NaN"
    scale = max(1.0, want[~inf].abs().max().item() if (~inf).any() else 0.0)
    err = (got.double() - want)[~inf].abs().max().item() if (~inf).any() else 0.0
    assert err <= RTOL * scale, f"{name}: max error {err:.3e} > {RTOL * scale:.3e}"


def _run_fallback(q, k, v, do, call, cu=None):
    """Fallback forward then backward (with the forward's o and lse, as kernels/ops.py does)."""
    cu_q, cu_k = cu if cu is not None else (None, None)
    o = torch.empty(*q.shape[:-1], v.shape[-1])
    o, lse = fallback.forward(q, k, v, cu_q, cu_k, call, o)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    fallback.backward(do, q, k, v, o, lse, cu_q, cu_k, call, *grads)
    return o, lse, grads


def _run_oracle(q, k, v, do, call, b_index, keep=None):
    """The oracle's (out, lse, (dq, dk, dv)) in float64 (autograd through it)."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = oracle(*leaves, call, b_index, keep)
    return out.detach(), lse.detach(), torch.autograd.grad(out, leaves, do.double())


def check_dense(B, Hq, Hkv, Lq, Lk, D, Dv, call):
    """Fallback forward and backward of a dense problem against the oracle; returns the lse."""
    q, k, v, do = _inputs(B, Hq, Hkv, Lq, Lk, D, Dv)
    o, lse, grads = _run_fallback(q, k, v, do, call)
    keep = (dropout_keep_mask(call.seed, B, Hq, Lq, Lk, call.dropout_p) if call.dropout
            else None)
    out, ref_lse, ref_grads = _run_oracle(q, k, v, do, call, torch.arange(B), keep)
    _close("out", o, out)
    _close("lse", lse, ref_lse)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(name, g, r)
    return lse


def _mods(B, Hq, softcap=None, alibi=None, gain_bias=False, mask=False, sinks=False):
    """CallMods with the named features (alibi: "heads" (Hq,) or "batch" (B, Hq) slopes)."""
    slopes = None
    if alibi == "heads":
        slopes = torch.rand(Hq) * 0.5 + 0.1
    elif alibi == "batch":
        slopes = torch.rand(B, Hq) * 0.5 + 0.1
    aux = (torch.rand(Hq) + 0.5, torch.randn(B) * 0.2) if gain_bias else ()
    return CallMods(softcap=softcap, alibi_slopes=slopes,
                    score_mod=GAIN_BIAS if gain_bias else None,
                    mask_mod=STRIPES if mask else None,
                    sinks=torch.randn(Hq) * 2 if sinks else None, aux=aux)


# ------------------------------------------------------------------------------- the cases
# (B, Hq, Hkv, Lq, Lk, D, Dv, causal, window, chunk, mods kwargs). Square dense shapes
# without dropout are the aten fast path's territory: each feature alone there fails unless
# the fallback keeps it off that path.
CASES = {
    "chunk-square": (2, 2, 2, 24, 24, 16, 16, True, None, 5, {}),
    "chunk-rect-gqa": (2, 4, 2, 13, 29, 16, 16, True, None, 5, {}),
    "chunk-q-longer": (1, 2, 1, 20, 12, 8, 8, True, None, 4, {}),   # rows before key 0
    "softcap": (2, 2, 2, 24, 24, 16, 16, True, None, None, dict(softcap=0.7)),
    "alibi-heads": (2, 4, 2, 24, 24, 16, 16, True, None, None, dict(alibi="heads")),
    "alibi-batch": (2, 4, 2, 17, 24, 16, 16, False, None, None, dict(alibi="batch")),
    "score-mod": (2, 4, 2, 24, 24, 16, 16, True, None, None, dict(gain_bias=True)),
    "mask-mod": (2, 4, 2, 24, 24, 16, 16, True, None, None, dict(mask=True)),
    "sinks": (2, 4, 2, 24, 24, 16, 16, True, None, None, dict(sinks=True)),
    "sinks-empty-rows": (2, 2, 2, 20, 12, 16, 16, True, None, None, dict(sinks=True)),
    "sinks-no-keys": (2, 4, 2, 5, 0, 16, 8, False, None, None, dict(sinks=True)),
    "dv": (2, 4, 2, 24, 24, 16, 8, True, None, None, {}),
    "softcap-alibi-sinks-window": (2, 4, 2, 19, 31, 16, 16, True, 6, None,
                                   dict(softcap=0.8, alibi="heads", sinks=True)),
    "everything-chunk": (2, 4, 1, 18, 27, 16, 12, True, None, 4,
                         dict(softcap=1.5, alibi="batch", gain_bias=True, mask=True,
                              sinks=True)),
    "mask-no-sinks-noncausal": (2, 2, 1, 15, 21, 8, 24, False, None, None,
                                dict(gain_bias=True, mask=True)),
}


@pytest.fixture(params=["one-block", "many-tasks"])
def blocks(request, monkeypatch):
    """One block per problem, or tiny blocks split into per-(batch, kv head) sub-problems on 2
    worker threads (the mods' b and h offsets of a sub-problem, blocks that see no key, and
    partial columns of every kind)."""
    if request.param == "many-tasks":
        monkeypatch.setattr(fallback, "_BLOCK_ELEMS", 96)
        monkeypatch.setattr(fallback, "_TASK_KV_BYTES", 1)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        yield
        torch.set_num_threads(threads)
    else:
        yield


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_dense(blocks, case):
    B, Hq, Hkv, Lq, Lk, D, Dv, causal, window, chunk, kw = CASES[case]
    call = AttentionCall(causal, 0.3, window=window, chunk_size=chunk, mods=_mods(B, Hq, **kw))
    lse = check_dense(B, Hq, Hkv, Lq, Lk, D, Dv, call)
    if case.startswith("sinks-"):  # rows before key 0 / no keys: lse is their head's sink
        empty = Lq - Lk
        torch.testing.assert_close(lse[:, :, :empty], call.mods.sinks.view(1, -1, 1).expand(
            B, -1, empty), rtol=0, atol=0)


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_dropout(blocks, sinks):
    """The reference's keep mask (reference/dropout.py), with sinks as without: the sink
    joins the denominator only, and each kept weight is scaled by 1 / (1 - p)."""
    B, Hq, Hkv, Lq, Lk = 2, 4, 2, 21, 30
    call = AttentionCall(True, 0.25, dropout_p=0.3, seed=1234, chunk_size=8,
                         mods=_mods(B, Hq, softcap=1.0, alibi="heads", sinks=sinks))
    check_dense(B, Hq, Hkv, Lq, Lk, 16, 8, call)


def test_packed(blocks):
    """Packed sequences: the mods' b is the sequence and q_idx / kv_idx count from its start;
    dropout rows are the packed layout's."""
    lens = [(7, 15), (12, 12), (0, 5), (9, 4)]
    Hq, Hkv, D, Dv = 4, 2, 16, 8
    q, k, v, do = _inputs(0, Hq, Hkv, 0, 0, D, Dv, packed_lens=lens)
    cu_q = torch.tensor([0] + [a for a, _ in lens], dtype=torch.int32).cumsum(0).int()
    cu_k = torch.tensor([0] + [c for _, c in lens], dtype=torch.int32).cumsum(0).int()
    call = AttentionCall(True, 0.3, dropout_p=0.2, seed=99, chunk_size=5,
                         mods=_mods(len(lens), Hq, softcap=2.0, alibi="batch", gain_bias=True,
                                    mask=True, sinks=True))
    o, lse, grads = _run_fallback(q, k, v, do, call, (cu_q, cu_k))
    keeps = dropout_keep_mask_varlen(call.seed, cu_q, cu_k, Hq, call.dropout_p)
    want_o, want_lse, want_g = torch.zeros_like(o, dtype=torch.float64), [], [
        torch.zeros_like(x, dtype=torch.float64) for x in (q, k, v)]
    for s, (rq0, rq1, rk0, rk1) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(),
                                                cu_k[:-1].tolist(), cu_k[1:].tolist())):
        dense = [x[r0:r1].transpose(0, 1).unsqueeze(0)
                 for x, (r0, r1) in ((q, (rq0, rq1)), (k, (rk0, rk1)), (v, (rk0, rk1)),
                                     (do, (rq0, rq1)))]
        out, l, g = _run_oracle(*dense, call, torch.tensor([s]), keeps[s][None])
        want_o[rq0:rq1] = out[0].transpose(0, 1)
        want_lse.append(l[0])
        for acc, gi, (r0, r1) in zip(want_g, g, ((rq0, rq1), (rk0, rk1), (rk0, rk1))):
            acc[r0:r1] = gi[0].transpose(0, 1)
    _close("out", o, want_o)
    _close("lse", lse, torch.cat(want_lse, -1))
    for name, g, r in zip(("dq", "dk", "dv"), grads, want_g):
        _close(name, g, r)


@pytest.mark.parametrize("append", [True, False], ids=["append", "no-append"])
def test_kvcache(blocks, append):
    """kvcache_forward: each row b sees its own cache length (none at all: lse = the sink),
    and the mods get the row's real batch index b (per-batch ALiBi slopes, the test mod's
    per-batch bias)."""
    B, Hq, Hkv, Lq, D, Dv, cap = 3, 4, 2, 3, 16, 8, 20
    lens = torch.tensor([5, 0, 11], dtype=torch.int32)
    q, k_new, v_new = (torch.randn(B, h, Lq, d) for h, d in ((Hq, D), (Hkv, D), (Hkv, Dv)))
    k_cache, v_cache = torch.randn(B, Hkv, cap, D), torch.randn(B, Hkv, cap, Dv)
    call = AttentionCall(True, 0.3, chunk_size=4,
                         mods=_mods(B, Hq, softcap=1.2, alibi="batch", gain_bias=True,
                                    mask=True, sinks=True))
    o, lse = fallback.kvcache_forward(q, k_cache, v_cache, lens, k_new if append else None,
                                      v_new if append else None, call,
                                      torch.empty(B, Hq, Lq, Dv))
    for b, n in enumerate(lens.tolist()):
        if append:
            n += Lq
            torch.testing.assert_close(k_cache[b, :, n - Lq:n], k_new[b], rtol=0, atol=0)
        out, ref_lse = oracle(q[b:b + 1].double(), k_cache[b:b + 1, :, :n].double(),
                              v_cache[b:b + 1, :, :n].double(), call, torch.tensor([b]))
        _close(f"out[{b}]", o[b:b + 1], out)
        _close(f"lse[{b}]", lse[b:b + 1], ref_lse)


# ------------------------------------------------------------------- visibility and work
@pytest.mark.parametrize("Lq,Lk,chunk", [(16, 16, 4), (9, 23, 5), (20, 6, 3), (7, 7, 1)])
def test_block_visible_chunk(Lq, Lk, chunk):
    """block_visible's chunk rule, whole and in every sub-rectangle, against the definition;
    _key_span / _partial_columns bound exactly the columns that hold a visible / a hidden key
    of some row."""
    pos = (torch.arange(Lq) + Lk - Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    want = (j <= pos) & (j // chunk == torch.div(pos, chunk, rounding_mode="floor"))
    got = fallback.block_visible(0, Lq, 0, Lk, Lq, Lk, True, None, None, chunk_size=chunk)
    assert torch.equal(got, want)
    for i0 in range(Lq):
        for i1 in range(i0 + 1, Lq + 1):
            k0, k1 = fallback._key_span(i0, i1, Lq, Lk, True, None, chunk)
            seen = want[i0:i1].any(0).nonzero().flatten()
            if seen.numel():
                assert (k0, k1) == (seen.min().item(), seen.max().item() + 1)
            else:
                assert k0 == k1
            partial = torch.zeros(Lk, dtype=torch.bool)
            for c0, c1 in fallback._partial_columns(i0, i1, k0, k1, Lq, Lk, True, None, chunk):
                partial[c0:c1] = True
            mixed = want[i0:i1, k0:k1].any(0) & ~want[i0:i1, k0:k1].all(0)
            assert not (mixed & ~partial[k0:k1]).any(), "a mixed column left unmasked"


@pytest.mark.parametrize("chunk", [8, 64, 300])
def test_chunk_work_is_linear(chunk):
    """A chunked call's blocks visit O(q_len · chunk_size) scores, not O(q_len · k_len): each
    row sees P % chunk + 1 keys, and a block of at most max(chunk, _CHUNK_MIN_ROWS) rows visits
    at most that many plus a chunk's."""
    L = 4096
    x = torch.empty(1, 1, L, 8)
    pb = fallback._Dense(x, x, x, AttentionCall(True, 1.0, chunk_size=chunk),
                         torch.zeros(1, 1, dtype=torch.int64), 1)
    work = sum(pb.work(pb.blocks()))
    seen = sum(p % chunk + 1 for p in range(L))
    assert seen <= work <= L * (max(chunk, fallback._CHUNK_MIN_ROWS) + chunk), (work, seen)


@pytest.mark.parametrize("what", ["chunk", "softcap", "alibi", "score-mod", "mask", "sinks",
                                  "dv"])
def test_aten_path_is_not_taken(what):
    """Square, dense, causal, no dropout: the aten flash path's shape, refused with any of the
    features it does not compute."""
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    plain = AttentionCall(True, 1.0)
    assert fallback._sdpa_applies(q, k, None, plain, v)
    if what == "dv":
        assert not fallback._sdpa_applies(q, k, None, plain, torch.randn(1, 2, 8, 6))
        return
    mods = {"softcap": CallMods(softcap=1.0), "alibi": CallMods(alibi_slopes=torch.ones(2)),
            "score-mod": CallMods(score_mod=GAIN_BIAS, aux=(torch.ones(2), torch.zeros(1))),
            "mask": CallMods(mask_mod=STRIPES),
            "sinks": CallMods(sinks=torch.zeros(2))}.get(what, CallMods())
    call = AttentionCall(True, 1.0, chunk_size=4 if what == "chunk" else None, mods=mods)
    assert not fallback._sdpa_applies(q, k, None, call, v)
