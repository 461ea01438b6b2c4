"""Packed queries (varlen) over a paged KV cache: ``kernels.core.kvcache.varlen_paged_forward``
and its PyTorch twin ``kernels.core.fallback.varlen_paged_forward``.

FlashAttention 2's ``flash_attn_varlen_func(..., block_table=)`` and vLLM's unified attention:
q (total_q, heads_q, D) packed by cu_seqlens_q, the keys of sequence s its first seqused_k[s]
positions in a page pool (num_blocks, page_size, heads_kv, D) through block_table[s]. Decode
rows (one query) and prefill rows share one launch. Each test builds packed keys, scatters
them into shuffled pages (table entries past a sequence's keys hold -1: never read), and checks
the kernel over the pages is bit-identical to the same kernel over the packed keys (the same
numbers reach the same tiles through another address computation), and both against the
float64 oracle. On CPU the kernels run in Triton's interpreter: shapes stay tiny.
"""
import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE, assert_parity, randn

import reference
from kernels.core import fallback
from kernels.core.call import AttentionCall, default_softmax_scale
from kernels.core.forward import attention_forward
from kernels.core.kvcache import varlen_paged_forward
from kernels.core.mods import CallMods, ScoreMod

F16, F32 = torch.float16, torch.float32
D = 16


def _cu(lens):
    """int32 (n + 1,) offsets of sequences of lengths ``lens``."""
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return cu.to(DEVICE)


def _scatter(packed, k_lens, page_size, spare=3):
    """Pages holding packed keys (total_k, heads_kv, d) in shuffled order, the other rows
    random: (pages (num_blocks, page_size, heads_kv, d), block_table int32 (num_seqs,
    max_blocks)). Table entries past a sequence's keys (one spare column at least) are -1."""
    need = [triton.cdiv(n, page_size) for n in k_lens]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + spare
    pages = randn(num_blocks, page_size, *packed.shape[1:], dtype=packed.dtype)
    order = torch.randperm(num_blocks).tolist()
    table = torch.full((len(k_lens), max_blocks), -1, dtype=torch.int32)
    start = 0
    for s, n in enumerate(k_lens):
        for blk in range(need[s]):
            page = order.pop()
            table[s, blk] = page
            rows = packed[start + blk * page_size:start + min(n, (blk + 1) * page_size)]
            pages[page, :rows.shape[0]] = rows
        start += n
    return pages, table.to(DEVICE)


def _inputs(q_lens, k_lens, hq, hkv, page_size, dtype, dv=D):
    q = randn(sum(q_lens), hq, D, dtype=dtype)
    k = randn(sum(k_lens), hkv, D, dtype=dtype)
    v = randn(sum(k_lens), hkv, dv, dtype=dtype)
    k_pages, table = _scatter(k, k_lens, page_size)
    v_pages = randn(k_pages.shape[0], page_size, hkv, dv, dtype=dtype)
    # The same pages for v: scatter v's rows where k's went.
    for s, n in enumerate(k_lens):
        start = sum(k_lens[:s])
        pos = torch.arange(n)
        v_pages[table[s, pos // page_size].long().cpu(), pos % page_size] = v[start:start + n]
    return q, k, v, k_pages, v_pages, table


@triton.jit
def _seq_distance_bias(s, b, h, q_idx, kv_idx, aux):
    """A bias on the sequence and the logical distance: a wrong page row or sequence shows."""
    return s - 0.05 * tl.minimum(q_idx - kv_idx, 20).to(tl.float32) + 0.1 * b


def _seq_distance_bias_torch(s, b, h, q_idx, kv_idx, aux):
    return s - 0.05 * (q_idx - kv_idx).clamp(max=20).to(s.dtype) + 0.1 * b


SEQ_DISTANCE_BIAS = ScoreMod("tests.paged_varlen_seq_distance_bias", _seq_distance_bias,
                             _seq_distance_bias_torch)


def _call(hq, causal=True, window=None, chunk_size=None, softcap=None, alibi=False,
          sinks=False, score_mod=None):
    mods = CallMods(softcap=softcap,
                    alibi_slopes=torch.rand(hq, device=DEVICE) * 0.3 if alibi else None,
                    sinks=randn(hq) if sinks else None, score_mod=score_mod)
    return AttentionCall(causal=causal, softmax_scale=default_softmax_scale(D), window=window,
                         chunk_size=chunk_size, mods=mods)


def _oracle(q, k, v, cu_q, cu_k, call, upcast=True):
    mods = call.mods
    return reference.attention_varlen(
        q, k, v, cu_q.cpu().tolist(), cu_k.cpu().tolist(), causal=call.causal,
        softmax_scale=call.softmax_scale, window=call.window, chunk_size=call.chunk_size,
        softcap=mods.softcap, alibi_slopes=mods.alibi_slopes, sinks=mods.sinks,
        score_mod=None if mods.score_mod is None else mods.score_mod.torch_fn,
        upcast=upcast, return_lse=True)


def _check_oracle(out, lse, q, k, v, cu_q, cu_k, call):
    ref, ref_lse = _oracle(q, k, v, cu_q, cu_k, call)
    lowp, lowp_lse = _oracle(q, k, v, cu_q, cu_k, call, upcast=False)
    assert_parity(out, ref, lowp)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows with no visible key differ"
    assert_parity(lse[seen], ref_lse[seen], lowp_lse[seen].to(ref_lse.dtype), name="lse")


def _both(q, k, v, k_pages, v_pages, table, q_lens, k_lens, call, num_splits=1,
          lens_as="seqused_k"):
    """(paged out, lse), (packed out, lse) of the same kernel."""
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    lens = dict(seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=DEVICE)) \
        if lens_as == "seqused_k" else dict(cu_seqlens_k=cu_k)
    paged = varlen_paged_forward(q, k_pages, v_pages, call, cu_seqlens_q=cu_q,
                                 max_seqlen_q=max(q_lens), block_table=table,
                                 max_seqlen_k=max(k_lens), num_splits=num_splits, **lens)
    packed = attention_forward(q, k, v, call, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens),
                               num_splits=num_splits)
    return paged, packed, cu_q, cu_k


def _assert_identical(paged, packed):
    (out, lse), (want, want_lse) = paged, packed
    assert torch.equal(out, want), \
        f"paged vs packed: max diff {(out.float() - want.float()).abs().max().item()}"
    assert torch.equal(lse, want_lse)


# Decode rows (q_len 1) beside prefill rows; a chunk of new queries whose first position is
# mid-page and whose rows cross a page boundary (5 queries at positions 12..16 of 17 keys);
# a sequence filling pages exactly at page size 1 and 16 never (40 keys).
Q_LENS, K_LENS = [1, 5, 1, 40], [17, 17, 1, 40]


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", [F16, F32], ids=["f16", "f32"])
def test_paged_varlen_matches_packed_and_oracle(page_size, dtype):
    hq, hkv = 4, 2
    q, k, v, k_pages, v_pages, table = _inputs(Q_LENS, K_LENS, hq, hkv, page_size, dtype)
    call = _call(hq)
    paged, packed, cu_q, cu_k = _both(q, k, v, k_pages, v_pages, table, Q_LENS, K_LENS, call,
                                      lens_as="cu_seqlens_k" if page_size == 16 else "seqused_k")
    _assert_identical(paged, packed)
    _check_oracle(*paged, q, k, v, cu_q, cu_k, call)


OPTIONS = {
    "noncausal": dict(causal=False),
    "window": dict(window=9),
    "chunk": dict(chunk_size=8),
    "softcap_alibi": dict(softcap=3.0, alibi=True),
    "sinks": dict(sinks=True),
    "score_mod": dict(score_mod=SEQ_DISTANCE_BIAS),
}


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_paged_varlen_options(name, splits):
    """The options of the packed path over pages (page size 16, MQA, decode and prefill rows),
    with and without split-KV: bit-identical to the packed keys, and the oracle."""
    q_lens, k_lens = [1, 6, 1], [33, 21, 5]
    hq, hkv = 4, 1
    q, k, v, k_pages, v_pages, table = _inputs(q_lens, k_lens, hq, hkv, 16, F32)
    call = _call(hq, **OPTIONS[name])
    paged, packed, cu_q, cu_k = _both(q, k, v, k_pages, v_pages, table, q_lens, k_lens, call,
                                      num_splits=splits)
    _assert_identical(paged, packed)
    _check_oracle(*paged, q, k, v, cu_q, cu_k, call)


def test_paged_varlen_edges():
    """v's own head dim, a sequence with no queries, one with no keys (its rows: 0 and -inf),
    one whose queries outnumber its keys (the first rows see nothing), and a block table that
    is a strided view."""
    q_lens, k_lens = [2, 0, 3, 4], [9, 6, 0, 2]
    hq, hkv, dv = 2, 2, 8
    q, k, v, k_pages, v_pages, table = _inputs(q_lens, k_lens, hq, hkv, 4, F32, dv=dv)
    wide = torch.full((table.shape[0], 2 * table.shape[1]), -7, dtype=torch.int32,
                      device=DEVICE)
    wide[:, ::2] = table
    call = _call(hq)
    paged, packed, cu_q, cu_k = _both(q, k, v, k_pages, v_pages, wide[:, ::2], q_lens, k_lens,
                                      call)
    _assert_identical(paged, packed)
    out, lse = paged
    assert out.shape == (sum(q_lens), hq, dv)
    rows_no_key = slice(2, 5)   # the third sequence's rows
    assert torch.equal(out[rows_no_key], torch.zeros_like(out[rows_no_key]))
    assert torch.isinf(lse[:, rows_no_key]).all()
    _check_oracle(out, lse, q, k, v, cu_q, cu_k, call)


def test_packed_keys_with_seqused_k():
    """seqused_k without pages (the limit this launcher no longer asserts away): packed keys
    whose sequences use only their first seqused_k[s] keys equal the packed keys cut to those."""
    q_lens, k_lens, used = [1, 4, 3], [20, 9, 7], [13, 9, 0]
    hq, hkv = 4, 2
    q = randn(sum(q_lens), hq, D)
    k, v = randn(sum(k_lens), hkv, D), randn(sum(k_lens), hkv, D)
    call = _call(hq, window=5)
    out, lse = attention_forward(q, k, v, call, cu_seqlens_q=_cu(q_lens),
                                 cu_seqlens_k=_cu(k_lens), max_seqlen_q=4, max_seqlen_k=20,
                                 k_lens=torch.tensor(used, dtype=torch.int32, device=DEVICE))
    keep = torch.cat([torch.arange(start, start + n) for start, n in
                      zip(_cu(k_lens)[:-1].tolist(), used)])
    k_cut, v_cut, cu_cut = k[keep], v[keep], _cu(used)
    want = attention_forward(q, k_cut, v_cut, call, cu_seqlens_q=_cu(q_lens),
                             cu_seqlens_k=cu_cut, max_seqlen_q=4, max_seqlen_k=13)
    _assert_identical((out, lse), want)
    _check_oracle(out, lse, q, k_cut, v_cut, _cu(q_lens), cu_cut, call)


# ------------------------------------------------------------------ the PyTorch fallback
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_varlen_fallback(page_size):
    """The fallback twin (pages gathered, then the packed fallback) against the oracle, with
    GQA, a window and softcap."""
    hq, hkv = 4, 2
    q, k, v, k_pages, v_pages, table = _inputs(Q_LENS, K_LENS, hq, hkv, page_size, F32)
    call = _call(hq, window=6, softcap=2.0)
    cu_q, cu_k = _cu(Q_LENS), _cu(K_LENS)
    seqused_k = torch.tensor(K_LENS, dtype=torch.int32, device=DEVICE)
    o = torch.empty_like(q)
    out, lse = fallback.varlen_paged_forward(q, k_pages, v_pages, cu_q, seqused_k, table, call,
                                             o)
    assert out.data_ptr() == o.data_ptr()
    _check_oracle(out, lse, q, k, v, cu_q, cu_k, call)
