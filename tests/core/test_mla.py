"""DeepSeek MLA (multi-head latent attention) through the KV-cache paths, head_dim 576.

The absorbed decode (docs/features.md, "MLA"): every query head attends to the one latent head
of rows ``[c_kv (512), k_pe (64)]``, values the rows' first 512 columns (``v_cache =
k_cache[..., :512]``, a view: V is never copied; new rows are appended through ``k`` alone).
Each test maps the kernels' latent output back through W_UV and compares it with the
**non-absorbed** float64 oracle (``reference.mla_attention``: k and v up-projected per head),
by FlashAttention's budget rule; the low-precision baseline is the absorbed math done by
PyTorch in the inputs' dtype from the same rounded q_lat and cache rows (mapped back in
float64 like the kernels' output). lse is checked the same way (it is the same in both forms).

Pages are shuffled; pages no row owns and rows past each length are NaN (never read: a NaN
that leaks in fails). Small heads: the kernels run in Triton's interpreter on CPU.
"""
import re

import pytest
import torch
from helpers import assert_fp8_parity, assert_parity

import kernels
import reference

NOPE, ROPE, RANK, V_DIM = 128, 64, 512, 128      # DeepSeek V2 / V3
D = RANK + ROPE                                   # 576: the latent row
SCALE = (NOPE + ROPE) ** -0.5                     # the model's scale, not 1 / sqrt(576)
BF16, F16, F8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


# ------------------------------------------------------------------------------ the problem
class MLA:
    """Random MLA weights (float64) and per-row inputs: q_nope, q_pe (heads, q_len, .) and the
    latent rows c_kv, k_pe (total_len, .) of each batch row, rounded to ``dtype`` (what a model
    stores), and the absorbed q_lat (heads, q_len, 576) rounded to ``dtype``."""

    def __init__(self, heads, q_lens, totals, dtype, device):
        self.heads, self.dtype, self.device = heads, dtype, device
        self.w_uk = torch.randn(heads, NOPE, RANK, dtype=torch.float64) / NOPE ** 0.5
        self.w_uv = torch.randn(heads, RANK, V_DIM, dtype=torch.float64) / RANK ** 0.5
        rnd = lambda *s: torch.randn(*s).to(dtype).to(device)  # noqa: E731
        self.q_nope = [rnd(heads, n, NOPE) for n in q_lens]
        self.q_pe = [rnd(heads, n, ROPE) for n in q_lens]
        self.c_kv = [rnd(n, RANK) for n in totals]
        self.k_pe = [rnd(n, ROPE) for n in totals]
        self.q_lat = [reference.absorb_query(qn.cpu(), qp.cpu(), self.w_uk).to(dtype).to(device)
                      for qn, qp in zip(self.q_nope, self.q_pe)]

    def rows(self, s):
        """Sequence s's latent rows (total_len, 576) in the cache's dtype."""
        return reference.latent_rows(self.c_kv[s], self.k_pe[s])

    def oracle(self, s, c_kv=None, k_pe=None):
        """Non-absorbed float64 MLA of sequence s: (out (heads, q_len, 128), lse)."""
        c_kv = self.c_kv[s] if c_kv is None else c_kv
        k_pe = self.k_pe[s] if k_pe is None else k_pe
        return reference.mla_attention(self.q_nope[s].cpu(), self.q_pe[s].cpu(), c_kv.cpu(),
                                       k_pe.cpu(), self.w_uk, self.w_uv, softmax_scale=SCALE,
                                       return_lse=True)

    def lowp(self, s):
        """The absorbed math by PyTorch in the inputs' dtype (the budget's baseline), mapped
        back in float64."""
        rows = self.rows(s).cpu()[None, None]
        out, lse = reference.attention(self.q_lat[s].cpu()[None], rows, rows[..., :RANK],
                                       softmax_scale=SCALE, upcast=False, return_lse=True)
        return reference.expand_output(out[0], self.w_uv), lse[0]

    def expand(self, out_lat):
        return reference.expand_output(out_lat.cpu(), self.w_uv)


def check(mla, outs, lses, name="", lowp=None):
    """Every sequence's kernel output (heads, q_len, 512) and lse (heads, q_len) against the
    oracle, by the budget rule over all sequences at once."""
    got, ref, low, got_lse, ref_lse, low_lse = [], [], [], [], [], []
    for s, (out, lse) in enumerate(zip(outs, lses)):
        assert out.shape == (mla.heads, mla.q_lat[s].shape[1], RANK), out.shape
        assert out.dtype == mla.dtype and lse.dtype == torch.float32
        r, rl = mla.oracle(s)
        lo, ll = mla.lowp(s) if lowp is None else lowp(s)
        got.append(mla.expand(out).flatten())
        ref.append(r.flatten())
        low.append(lo.flatten())
        got_lse.append(lse.cpu().flatten())
        ref_lse.append(rl.flatten())
        low_lse.append(ll.flatten())
    out = torch.cat(got).to(mla.dtype)
    assert_parity(out, torch.cat(ref), torch.cat(low).to(mla.dtype), name=f"{name} out")
    lse, rl, ll = torch.cat(got_lse), torch.cat(ref_lse), torch.cat(low_lse)
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), finite), f"{name} lse: -inf rows differ"
    assert_parity(lse[finite], rl[finite].float(), ll[finite].float(), name=f"{name} lse")


def bits(t):
    """A cache's bytes (NaN-safe equality)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def paged_cache(mla, totals, page, filled, dtype, spare=2):
    """A shuffled page pool (num_blocks, page, 1, 576) holding rows [0, filled[b]) of each
    sequence (NaN elsewhere, spare pages included) and its int32 block table."""
    n_pages = [-(-n // page) for n in totals]
    width = max(n_pages)
    pool = len(totals) * width + spare
    cache = torch.full((pool, page, 1, D), float("nan")).to(dtype).to(mla.device)
    order = torch.randperm(pool)
    table = order[:len(totals) * width].view(len(totals), width).to(torch.int32)
    for s, n in enumerate(filled):
        pos = torch.arange(n)
        cache[table[s].long()[pos // page], pos % page, 0] = mla.rows(s)[:n].to(dtype)
    return cache, table.to(mla.device)


def page_rows(cache, table, s, n):
    """Rows [0, n) of sequence s read back from a paged cache: (n, 576)."""
    pos = torch.arange(n, device=cache.device)
    page = cache.shape[1]
    return cache[table[s].long()[pos // page], pos % page, 0]


# ------------------------------------------------------------------------------ the oracle
def test_oracle_absorbed_equals_non_absorbed():
    """The oracle's own identity, in float64: absorbed (q_lat over the latent rows, mapped back)
    equals non-absorbed; and ``split_kv_b_proj`` reads DeepSeek's kv_b_proj layout."""
    heads = 3
    weight = torch.randn(heads * (NOPE + V_DIM), RANK, dtype=torch.float64) / RANK ** 0.5
    w_uk, w_uv = reference.split_kv_b_proj(weight, heads)
    assert w_uk.shape == (heads, NOPE, RANK) and w_uv.shape == (heads, RANK, V_DIM)
    c_kv = torch.randn(9, RANK, dtype=torch.float64)
    kv = (c_kv @ weight.T).view(9, heads, NOPE + V_DIM)    # DeepSeek's kv_b_proj(c_kv)
    assert torch.allclose(kv[..., :NOPE].transpose(0, 1), c_kv @ w_uk.transpose(1, 2))
    assert torch.allclose(kv[..., NOPE:].transpose(0, 1), c_kv @ w_uv)
    q_nope, q_pe = torch.randn(heads, 4, NOPE, dtype=torch.float64), \
        torch.randn(heads, 4, ROPE, dtype=torch.float64)
    k_pe = torch.randn(9, ROPE, dtype=torch.float64)
    want, want_lse = reference.mla_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv,
                                             softmax_scale=SCALE, return_lse=True)
    rows = reference.latent_rows(c_kv, k_pe)[None, None]
    out, lse = reference.attention(reference.absorb_query(q_nope, q_pe, w_uk)[None], rows,
                                   rows[..., :RANK], softmax_scale=SCALE, return_lse=True)
    torch.testing.assert_close(reference.expand_output(out[0], w_uv), want, rtol=1e-10,
                               atol=1e-10)
    torch.testing.assert_close(lse[0], want_lse, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ decode
# page (None: a dense cache), total lengths per row, q_len, heads, num_splits, append, dtype
CASES = {
    "page64-decode": (64, [1, 17, 97], 1, 16, 0, True, BF16),
    "page13-mtp4-split": (13, [17, 97, 4], 4, 8, 3, True, F16),
    "dense-8q-no-append": (None, [1, 40], 8, 4, 3, False, BF16),
    "page64-1000": (64, [1000], 2, 4, 3, True, BF16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kvcache_matches_the_non_absorbed_oracle(route, case):
    """attention_with_kvcache over a latent cache (v_cache = k_cache[..., :512]): out (mapped
    back) and lse against the oracle; q tokens bottom-right causal (a row shorter than q_len:
    its first queries see no key, out 0, lse -inf); appended rows land in the right page rows
    (v sees them: the same storage); nothing else in the cache moves."""
    page, totals, q_len, heads, splits, append, dtype = CASES[case]
    mla = MLA(heads, [q_len] * len(totals), totals, dtype, route.device)
    filled = [n - q_len for n in totals] if append else totals
    B = len(totals)
    q = torch.stack(mla.q_lat)                                   # (B, heads, q_len, 576)
    lens = torch.tensor(filled, dtype=torch.int32, device=route.device)
    new = torch.stack([mla.rows(s)[filled[s]:][None] for s in range(B)]) if append else None
    if page is None:
        cap = max(totals) + 3
        cache = torch.full((B, 1, cap, D), float("nan")).to(dtype).to(route.device)
        for s, n in enumerate(filled):
            cache[s, 0, :n] = mla.rows(s)[:n]
        table = None
    else:
        cache, table = paged_cache(mla, totals, page, filled, dtype)
    before = cache.clone()
    out, lse = kernels.attention_with_kvcache(q, cache, cache[..., :RANK], lens, k=new,
                                              causal=True, softmax_scale=SCALE,
                                              num_splits=splits, return_lse=True,
                                              block_table=table)
    assert out.shape == (B, heads, q_len, RANK) and lse.shape == (B, heads, q_len)
    check(mla, list(out), list(lse), case)
    # The cache: the appended rows, bit for bit; every other byte unchanged (NaNs included).
    expect = before.clone()
    for s in range(B):
        if append:
            pos = torch.arange(filled[s], totals[s], device=route.device)
            if page is None:
                expect[s, 0, pos] = mla.rows(s)[filled[s]:]
            else:
                expect[table[s].long()[pos // page], pos % page, 0] = mla.rows(s)[filled[s]:]
        got = cache[s, 0, :totals[s]] if page is None else page_rows(cache, table, s, totals[s])
        assert torch.equal(bits(got), bits(mla.rows(s))), f"row {s}: cache rows"
    assert torch.equal(bits(cache), bits(expect)), "bytes outside the appended rows moved"


def test_varlen_mixed_decode_and_prefill_rows(route):
    """attention_varlen over the paged latent cache: packed q (total_q, heads, 576), decode rows
    (1 query) and multi-token rows (5, 8 queries) in one call, split-KV forced, lse
    (heads, total_q)."""
    q_lens, totals, heads, page = [1, 5, 1, 8], [17, 97, 1, 40], 8, 16
    mla = MLA(heads, q_lens, totals, BF16, route.device)
    cache, table = paged_cache(mla, totals, page, totals, BF16)
    q = torch.cat([ql.transpose(0, 1) for ql in mla.q_lat])      # (total_q, heads, 576)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=route.device)
    used = torch.tensor(totals, dtype=torch.int32, device=route.device)
    before = cache.clone()
    out, lse = kernels.attention_varlen(q, cache, cache[..., :RANK], cu_q, None, max(q_lens),
                                        block_table=table, seqused_k=used, causal=True,
                                        softmax_scale=SCALE, num_splits=3, return_lse=True)
    assert out.shape == (sum(q_lens), heads, RANK) and lse.shape == (heads, sum(q_lens))
    cu = cu_q.tolist()
    check(mla, [out[cu[s]:cu[s + 1]].transpose(0, 1) for s in range(len(q_lens))],
          [lse[:, cu[s]:cu[s + 1]] for s in range(len(q_lens))], "varlen")
    assert torch.equal(bits(cache), bits(before))


# ------------------------------------------------------------------------------ FP8 cache
def absorbed64(q_lat, keys, values, p_round=None):
    """Float64 absorbed attention of one sequence on exactly the given inputs: q_lat (heads,
    q_len, 576), keys (k_len, 576), values (k_len, 512), bottom-right causal; ``p_round``
    rounds the weights before P @ V (the kernel's intermediates). (out_lat, lse)."""
    q, keys, values = q_lat.cpu().double(), keys.cpu().double(), values.cpu().double()
    scores = SCALE * (q @ keys.T)
    scores = scores.masked_fill(~reference.causal_mask(q.shape[1], keys.shape[0]),
                                float("-inf"))
    p = torch.softmax(scores, -1)
    if p_round is not None:
        p = p_round(p)
    return p @ values, torch.logsumexp(scores, -1)


def test_fp8_latent_cache(route):
    """An e4m3 latent cache with a per-tensor k_scale (the values are the keys' entries, read
    with k's scale: no v_scale), bf16 q_lat, new bf16 rows appended through k= (stored as
    x / k_scale): FlashAttention 3's FP8 rule (ref: float64 on the kernel's inputs, the e4m3
    rows times their scales; out_pt: the same with P rounded to bf16), mapped back through
    W_UV; lse tight."""
    page, totals, q_len, heads = 13, [30, 4], 2, 8
    mla = MLA(heads, [q_len] * len(totals), totals, BF16, route.device)
    k_scale = 0.02
    filled = [n - q_len for n in totals]
    B = len(totals)
    pool, table = paged_cache(mla, totals, page, filled, BF16)
    cache = (pool.float() / k_scale).clamp(-448, 448).to(F8)     # NaN stays NaN in e4m3
    new = torch.stack([mla.rows(s)[filled[s]:][None] for s in range(B)])
    lens = torch.tensor(filled, dtype=torch.int32, device=route.device)
    before = cache.clone()
    out, lse = kernels.attention_with_kvcache(
        torch.stack(mla.q_lat), cache, cache[..., :RANK], lens, k=new, softmax_scale=SCALE,
        num_splits=3, return_lse=True, block_table=table, k_scale=k_scale)
    assert out.dtype == BF16 and out.shape == (B, heads, q_len, RANK)
    expect = before.clone()
    for s in range(B):
        pos = torch.arange(filled[s], totals[s], device=route.device)
        quantized = (new[s, 0].float() / k_scale).clamp(-448, 448).to(F8)
        expect[table[s].long()[pos // page], pos % page, 0] = quantized
    assert torch.equal(bits(cache), bits(expect)), "the appended e4m3 bytes"
    for s in range(B):
        rows = page_rows(cache, table, s, totals[s]).double()
        args = (mla.q_lat[s], rows * k_scale, rows[:, :RANK] * k_scale)
        ref, ref_lse = absorbed64(*args)
        pt, _ = absorbed64(*args, p_round=lambda p: p.to(BF16).double())
        assert_fp8_parity(mla.expand(out[s]).to(BF16), mla.expand(ref), mla.expand(pt),
                          name=f"fp8 row {s}")
        torch.testing.assert_close(lse[s].cpu().double(), ref_lse, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------ prefill
def test_prefill_non_absorbed_varlen(route):
    """The prefill side: q / k head 192 (128 up-projected + 64 rope), v head 128, packed and not
    paged, through attention_varlen (chunked prefill too: more keys than queries), against the
    same oracle."""
    q_lens, k_lens, heads = [17, 5, 1], [17, 40, 1], 4
    mla = MLA(heads, q_lens, k_lens, BF16, route.device)
    qs, ks, vs = [], [], []
    for s in range(len(q_lens)):
        c_kv = mla.c_kv[s].cpu().double()
        k_nope = torch.einsum("lr,hnr->lhn", c_kv, mla.w_uk)
        k_pe = mla.k_pe[s].cpu().double()[:, None].expand(-1, heads, -1)
        ks.append(torch.cat([k_nope, k_pe], -1).to(BF16))        # what a model's prefill has
        vs.append(torch.einsum("lr,hrv->lhv", c_kv, mla.w_uv).to(BF16))
        qs.append(torch.cat([mla.q_nope[s], mla.q_pe[s]], -1).transpose(0, 1).cpu())
    q, k, v = (torch.cat(t).to(route.device) for t in (qs, ks, vs))
    cu = lambda n: torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()],  # noqa: E731
                                dtype=torch.int32, device=route.device)
    out, lse = kernels.attention_varlen(q, k, v, cu(q_lens), cu(k_lens), causal=True,
                                        softmax_scale=SCALE, return_lse=True)
    assert out.shape == (sum(q_lens), heads, V_DIM)
    low, low_lse = reference.attention_varlen(q.cpu(), k.cpu(), v.cpu(), cu(q_lens).cpu(),
                                              cu(k_lens).cpu(), softmax_scale=SCALE,
                                              upcast=False, return_lse=True)
    refs = [mla.oracle(s) for s in range(len(q_lens))]
    ref = torch.cat([r.transpose(0, 1) for r, _ in refs])
    ref_lse = torch.cat([rl for _, rl in refs], dim=1)
    assert_parity(out.cpu(), ref, low, name="prefill out")
    assert_parity(lse.cpu(), ref_lse.float(), low_lse.float(), name="prefill lse")


# ------------------------------------------------------------------------------ errors
def test_bad_latent_caches_raise_and_write_nothing():
    """ValueError saying expected vs given (NotImplementedError above head_dim 576), and not
    one byte of the cache written (each call carries a new row through k=)."""
    heads, page = 4, 64
    mla = MLA(heads, [1, 1], [20, 7], BF16, "cpu")
    cache, table = paged_cache(mla, [20, 7], page, [19, 6], BF16)
    before = cache.clone()
    lens = torch.tensor([19, 6], dtype=torch.int32)
    q = torch.stack(mla.q_lat)
    new = torch.stack([mla.rows(s)[-1:][None] for s in range(2)])

    def call(q=q, k_cache=cache, v_cache=cache[..., :RANK], k=new, v=None, **kw):
        return kernels.attention_with_kvcache(q, k_cache, v_cache, lens, k=k, v=v,
                                              softmax_scale=SCALE, block_table=table, **kw)

    wide = torch.zeros(cache.shape[0], page, 1, 640, dtype=BF16)
    fp8 = cache.to(F8)
    fp8_before = fp8.clone()
    halved = re.escape(f"({cache.shape[0]}, {page}, 1") + ".*" + re.escape(
        f"{(cache.shape[0] * 2, page // 2, 1, RANK)}")          # expected vs given
    bad = [
        ("v_cache", dict(v_cache=cache[..., ROPE:])),        # overlaps k, not its prefix
        (r"\bv\b", dict(v=new[..., :RANK])),                # v with a prefix v_cache
        (halved, dict(v_cache=torch.zeros(cache.shape[0] * 2, page // 2, 1, RANK,
                                          dtype=BF16))),     # page sizes differ ...
        (halved, dict(v_cache=cache.view(cache.shape[0] * 2, page // 2, 1, D)[..., :RANK])),
        ("v_scale", dict(k_cache=fp8, v_cache=fp8[..., :RANK], k_scale=0.5,
                         v_scale=0.5)),                      # the values have k's scale
    ]
    # Wider than 576: valid, not supported (the head_dim limit's NotImplementedError).
    too_wide = ("up to 576.*640", dict(q=torch.zeros(2, heads, 1, 640, dtype=BF16),
                                       k_cache=wide, v_cache=wide[..., :RANK],
                                       k=torch.zeros(2, 1, 1, 640, dtype=BF16)))
    for words, kw in [*bad, too_wide]:
        with pytest.raises(ValueError if kw is not too_wide[1] else NotImplementedError,
                           match=words):
            call(**kw)
        assert torch.equal(bits(cache), bits(before)), f"{words}: the failed call wrote"
        assert torch.equal(bits(fp8), bits(fp8_before)), f"{words}: the failed call wrote"
    assert not wide.any()
