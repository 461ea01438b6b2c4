"""Paged KV caches in attention_with_kvcache (block_table; kernels/core/paged.py).

A paged cache is a pool of pages (num_blocks, page_size, heads_kv, D) and block_table[b] lists
row b's pages. Each test builds the same cache twice: as shuffled pages and as the dense
(batch, heads_kv, max_blocks * page_size, D) cache those pages spell out. The kernels must
give bit-identical out and lse on both (the same kernel config reads the same numbers, only
through another address computation), write appended keys into the right page rows and
nothing else, and match the float64 oracle. On CPU the kernels run in Triton's interpreter.
"""
import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE, assert_parity, randn

import kernels
import reference
from kernels import MaskMod, ScoreMod

F16, F32 = torch.float16, torch.float32


def _paged(batch, heads_kv, d, dv, page_size, max_blocks, dtype, spare=3):
    """Pages in shuffled order (plus ``spare`` pages no row owns) and their block table."""
    num_blocks = batch * max_blocks + spare
    k_pages = randn(num_blocks, page_size, heads_kv, d, dtype=dtype)
    v_pages = randn(num_blocks, page_size, heads_kv, dv, dtype=dtype)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(page_size))
    table = order[:batch * max_blocks].view(batch, max_blocks).to(torch.int32).to(DEVICE)
    return k_pages, v_pages, table


def _dense(pages, table):
    """The dense (batch, heads_kv, max_blocks * page_size, D) cache the pages spell out."""
    b, max_blocks = table.shape
    page_size, heads_kv, d = pages.shape[1:]
    return pages[table.long()].reshape(b, max_blocks * page_size, heads_kv, d) \
        .transpose(1, 2).contiguous()


def _run_both(q, k_pages, v_pages, table, lens, k, v, **kw):
    """attention_with_kvcache on copies of the paged cache and on the dense cache they spell
    out: (paged out, lse, pages after), (dense out, lse, dense caches after), the caches
    before."""
    kp, vp = k_pages.clone(), v_pages.clone()
    kd, vd = _dense(k_pages, table), _dense(v_pages, table)
    before = (kd.clone(), vd.clone())
    paged = kernels.attention_with_kvcache(q, kp, vp, lens, k, v, block_table=table,
                                           return_lse=True, **kw)
    dense = kernels.attention_with_kvcache(q, kd, vd, lens, k, v, return_lse=True, **kw)
    return (*paged, kp, vp), (*dense, kd, vd), before


def _check_pages(k_pages, v_pages, kp, vp, kd, vd, table):
    """After an append: the pages spell out the dense cache after its append, and pages no
    row owns are untouched."""
    assert torch.equal(_dense(kp, table), kd) and torch.equal(_dense(vp, table), vd)
    spare = torch.ones(k_pages.shape[0], dtype=torch.bool)
    spare[table.long().flatten().cpu()] = False
    assert spare.any()
    assert torch.equal(kp[spare], k_pages[spare]) and torch.equal(vp[spare], v_pages[spare])


# page_size, max_blocks, q_len, heads q/kv, num_splits, append, cache_seqlens (3 rows):
CASES = [
    (1, 40, 1, 4, 2, 3, True, [0, 17, 39]),       # one row per page, decoding, GQA, split
    (16, 6, 3, 4, 1, 1, True, [15, 30, 0]),       # appends cross a page boundary; MQA
    (16, 6, 5, 2, 2, 3, False, [1, 96, 40]),      # no append; a row filled to capacity
    (16, 4, 20, 2, 2, 1, True, [3, 44, 17]),      # prefill-sized: 20 new keys over 2-3 pages
    (256, 1, 2, 4, 2, 3, True, [0, 130, 254]),    # one big page per row
]


@pytest.mark.parametrize("page_size,max_blocks,q_len,hq,hkv,splits,append,lens", CASES,
                         ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [F16, F32], ids=["f16", "f32"])
def test_paged_matches_dense_and_oracle(page_size, max_blocks, q_len, hq, hkv, splits, append,
                                        lens, dtype):
    B, d = 3, 16
    k_pages, v_pages, table = _paged(B, hkv, d, d, page_size, max_blocks, dtype)
    lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = randn(B, hq, q_len, d, dtype=dtype)
    k, v = (randn(B, hkv, q_len, d, dtype=dtype) for _ in range(2)) if append else (None, None)
    (out, lse, kp, vp), (want, want_lse, kd, vd), before = _run_both(
        q, k_pages, v_pages, table, lens, k, v, num_splits=splits)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), \
        f"paged vs dense: max diff {(out.float() - want.float()).abs().max().item()}"
    _check_pages(k_pages, v_pages, kp, vp, kd, vd, table)
    if append:   # the new rows landed at positions lens[b]... of the dense view
        for b, n in enumerate(lens.tolist()):
            assert torch.equal(kd[b, :, n:n + q_len], k[b])
    ref = reference.attention_with_kvcache(q, *(t.clone() for t in before), lens, k, v)
    lowp = reference.attention_with_kvcache(q, *(t.clone() for t in before), lens, k, v,
                                            upcast=False)
    assert_parity(out, ref, lowp)


# ------------------------------------------------------------------ the options, paged
@triton.jit
def _distance_bias(s, b, h, q_idx, kv_idx, aux):
    """A bias on the (logical) distance, clipped: wrong page rows would show here."""
    return s - 0.05 * tl.minimum(q_idx - kv_idx, 20).to(tl.float32) + 0.01 * h


def _distance_bias_torch(s, b, h, q_idx, kv_idx, aux):
    return s - 0.05 * (q_idx - kv_idx).clamp(max=20).to(s.dtype) + 0.01 * h


DISTANCE_BIAS = ScoreMod("tests.paged_distance_bias", _distance_bias, _distance_bias_torch)


@triton.jit
def _every_third(b, h, q_idx, kv_idx, aux):
    return (kv_idx % 3 != 1) | (kv_idx + 2 >= q_idx)


def _every_third_torch(b, h, q_idx, kv_idx, aux):
    return (kv_idx % 3 != 1) | (kv_idx + 2 >= q_idx)


EVERY_THIRD = MaskMod("tests.paged_every_third", _every_third, _every_third_torch)


@triton.jit
def _after_first(b, h, q_idx, kv_idx, aux):
    return kv_idx >= 5


@triton.jit
def _after_first_keys(b, q_lo, q_hi, aux):
    """Keys from 5 on: the range skips the first key tile's programs' work where it can."""
    return 5, 1 << 20


@triton.jit
def _after_first_queries(b, kv_lo, kv_hi, aux):
    return 0, 1 << 20


AFTER_FIRST = MaskMod("tests.paged_after_first", _after_first,
                      lambda b, h, q, kv, aux: kv >= 5, kv_range=_after_first_keys,
                      q_range=_after_first_queries)

OPTIONS = {
    "noncausal": dict(causal=False),
    "window": dict(window=9),
    "softcap_alibi": dict(softcap=3.0, alibi_slopes="heads"),
    "sinks": dict(sinks="random"),
    "chunk": dict(chunk_size=8),
    "score_mod": dict(score_mod=DISTANCE_BIAS),
    "mask_mod": dict(mask_mod=EVERY_THIRD),
    "mask_ranges": dict(mask_mod=AFTER_FIRST),
}


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_paged_options(name, splits):
    """Every option of the dense cache path, paged (page size 16, shuffled pages, GQA, an
    append across a page boundary): bit-identical to the dense cache, and the oracle."""
    B, hq, hkv, d, q_len = 2, 4, 2, 16, 3
    opts = dict(OPTIONS[name])
    if opts.get("alibi_slopes") == "heads":
        opts["alibi_slopes"] = torch.rand(hq, device=DEVICE) * 0.3
    if opts.get("sinks") == "random":
        opts["sinks"] = randn(hq)
    k_pages, v_pages, table = _paged(B, hkv, d, d, 16, 4, F32)
    lens = torch.tensor([14, 45], dtype=torch.int32, device=DEVICE)
    q = randn(B, hq, q_len, d)
    k, v = randn(B, hkv, q_len, d), randn(B, hkv, q_len, d)
    (out, lse, kp, vp), (want, want_lse, kd, vd), before = _run_both(
        q, k_pages, v_pages, table, lens, k, v, num_splits=splits, **opts)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    _check_pages(k_pages, v_pages, kp, vp, kd, vd, table)
    # The oracle takes tensors as they are and mods as their PyTorch twins.
    opts = {key: getattr(val, "torch_fn", val) for key, val in opts.items()}
    ref = reference.attention_with_kvcache(q, *(t.clone() for t in before), lens, k, v, **opts)
    lowp = reference.attention_with_kvcache(q, *(t.clone() for t in before), lens, k, v,
                                            upcast=False, **opts)
    assert_parity(out, ref, lowp)


def test_paged_value_head_dim_and_strided_table():
    """v's own head dim, and a block table that is a strided view (a wider table's columns)."""
    B, hq, hkv, d, dv = 2, 2, 1, 16, 8
    k_pages, v_pages, table = _paged(B, hkv, d, dv, 16, 3, F32)
    wide = torch.full((B, 6), -1, dtype=torch.int32, device=DEVICE)
    wide[:, ::2] = table
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    lens = torch.tensor([20, 33], dtype=torch.int32, device=DEVICE)
    q, k, v = randn(B, hq, 2, d), randn(B, hkv, 2, d), randn(B, hkv, 2, dv)
    kp, vp = k_pages.clone(), v_pages.clone()
    out = kernels.attention_with_kvcache(q, kp, vp, lens, k, v, block_table=strided)
    kd, vd = _dense(k_pages, table), _dense(v_pages, table)
    want = kernels.attention_with_kvcache(q, kd, vd, lens, k, v)
    assert out.shape == (B, hq, 2, dv) and torch.equal(out, want)
    assert torch.equal(_dense(vp, table), vd)


def test_paged_compile():
    """torch.compile(fullgraph=True) of a paged decoding step: the op declares the pages it
    writes, so the compiled step gives the eager result and keeps the append."""
    k_pages, v_pages, table = _paged(2, 2, 16, 16, 16, 3, F32)
    lens = torch.tensor([15, 2], dtype=torch.int32, device=DEVICE)
    q, k, v = randn(2, 4, 1, 16), randn(2, 2, 1, 16), randn(2, 2, 1, 16)
    kp, vp = k_pages.clone(), v_pages.clone()
    eager = kernels.attention_with_kvcache(q, k_pages, v_pages, lens, k, v, block_table=table)

    def step(q, kc, vc, k, v):
        return kernels.attention_with_kvcache(q, kc, vc, lens, k, v, block_table=table)

    compiled = torch.compile(step, fullgraph=True,
                             backend="aot_eager" if DEVICE == "cpu" else "inductor")
    assert torch.equal(compiled(q, kp, vp, k, v), eager)
    assert torch.equal(kp, k_pages) and torch.equal(vp, v_pages)


# ------------------------------------------------------------------ the PyTorch fallback
@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_fallback(monkeypatch, page_size):
    """CPU tensors without the interpreter: the same semantics (pages written in place, the
    oracle's result)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", True)
    B, hq, hkv, d, q_len = 2, 4, 2, 16, 2
    max_blocks = 48 // page_size
    k_pages, v_pages, table = _paged(B, hkv, d, d, page_size, max_blocks, F32)
    lens = torch.tensor([15, 40], dtype=torch.int32)
    q, k, v = randn(B, hq, q_len, d), randn(B, hkv, q_len, d), randn(B, hkv, q_len, d)
    (out, lse, kp, vp), (want, want_lse, kd, vd), before = _run_both(
        q, k_pages, v_pages, table, lens, k, v, window=6, softcap=2.0)
    _check_pages(k_pages, v_pages, kp, vp, kd, vd, table)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    ref = reference.attention_with_kvcache(q, *(t.clone() for t in before), lens, k, v,
                                           window=6, softcap=2.0)
    lowp = reference.attention_with_kvcache(q, *(t.clone() for t in before), lens, k, v,
                                            window=6, softcap=2.0, upcast=False)
    assert_parity(out, ref, lowp)


# ------------------------------------------------------------------ errors
def test_paged_errors():
    B, hq, hkv, d = 2, 4, 2, 16
    k_pages, v_pages, table = _paged(B, hkv, d, d, 16, 3, F32)
    lens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    q = randn(B, hq, 1, d)

    def call(**kw):
        args = dict(q=q, k_cache=k_pages, v_cache=v_pages, cache_seqlens=lens,
                    block_table=table)
        args.update(kw)
        return kernels.attention_with_kvcache(**args)

    with pytest.raises(TypeError, match="block_table must be a torch.Tensor"):
        call(block_table=table.tolist())
    with pytest.raises(ValueError, match=r"block_table must be int32 \(batch, max_blocks\) "
                                         r"with q's batch 2, got torch.int64"):
        call(block_table=table.long())
    with pytest.raises(ValueError, match=r"block_table .* got torch.int32 \(1, 3\)"):
        call(block_table=table[:1])
    with pytest.raises(ValueError, match=r"block_table .* got torch.int32 \(6,\)"):
        call(block_table=table.flatten())
    # A dense (batch, heads_kv, max_len, head_dim) cache given with a block table: its heads
    # (dim 1) sit where the paged layout has page_size.
    dense_k, dense_v = _dense(k_pages, table), _dense(v_pages, table)
    with pytest.raises(ValueError, match=r"k_cache with block_table must be \(num_blocks, "
                                         r"page_size, heads_kv, head_dim\).*got k_cache "
                                         r"\(2, 2, 48, 16\)"):
        call(k_cache=dense_k, v_cache=dense_v)
    with pytest.raises(ValueError, match=r"must be 4-D \(num_blocks, page_size, heads_kv"):
        call(k_cache=k_pages[0], v_cache=v_pages[0])
    with pytest.raises(ValueError, match=r"max_len 48 = max_blocks \* page_size"):
        call(cache_seqlens=torch.tensor([3, 49], dtype=torch.int32, device=DEVICE))
    if DEVICE == "cpu":   # page indices are checked where the table is on the host
        bad = table.clone()
        bad[1, 0] = k_pages.shape[0]
        with pytest.raises(ValueError, match=r"block_table\[1\] must hold page indices in "
                                             r"\[0, 9\)"):
            call(block_table=bad)
        # Entries past a row's filled positions are never read: any value is fine there.
        unused = table.clone()
        unused[:, 2] = -1
        call(block_table=unused)
