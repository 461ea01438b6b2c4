"""The reference oracle's grouped-query heads, sliding window and packed variable-length
batches (``reference.attention``, ``reference.attention_varlen``, ``reference.causal_mask``),
and the packed layout of the kernel's dropout mask (``reference.dropout_keep_mask_varlen``).

Each feature is checked against something built independently: ``repeat_interleave``'d k/v and
SDPA's ``enable_gqa``, brute-force loops of the mask rule, per-sequence ``attention`` calls and
the Philox definition written out. Small CPU shapes, float64 where exactness is asserted.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from reference import (
    attention,
    attention_varlen,
    causal_mask,
    dropout_keep_mask,
    dropout_keep_mask_varlen,
    dropout_keep_rows,
    philox4x32,
)


def rand64(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(requires_grad)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Grouped-query attention
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads_kv", [8, 4, 2, 1], ids=lambda h: f"ratio{8 // h}")
@pytest.mark.parametrize("lens", [(9, 9), (5, 13), (13, 5)], ids=lambda t: f"q{t[0]}k{t[1]}")
def test_gqa_equals_repeated_kv(heads_kv, lens):
    q_len, k_len = lens
    group = 8 // heads_kv
    q = rand64(2, 8, q_len, 16, requires_grad=True)
    k = rand64(2, heads_kv, k_len, 16, requires_grad=True)
    v = rand64(2, heads_kv, k_len, 12, requires_grad=True)
    keep = torch.rand(2, 8, q_len, k_len) > 0.25
    kw = dict(dropout_p=0.25, keep_mask=keep, window=4)

    out = attention(q, k, v, **kw)
    assert out.shape == (2, 8, q_len, 12)
    k_big = k.detach().repeat_interleave(group, dim=1).requires_grad_()
    v_big = v.detach().repeat_interleave(group, dim=1).requires_grad_()
    q_big = q.detach().clone().requires_grad_()
    expected = attention(q_big, k_big, v_big, **kw)
    assert torch.equal(out, expected)

    do = torch.randn_like(out)
    out.backward(do)
    expected.backward(do)
    assert k.grad.shape == k.shape and v.grad.shape == v.shape
    close(q.grad, q_big.grad)
    # Each kv head's gradient is the sum over the query heads of its group.
    close(k.grad, k_big.grad.view(2, heads_kv, group, k_len, 16).sum(2))
    close(v.grad, v_big.grad.view(2, heads_kv, group, k_len, 12).sum(2))


@pytest.mark.parametrize("heads_kv", [6, 3, 2, 1])
def test_gqa_matches_sdpa_enable_gqa(heads_kv):
    q = rand64(2, 6, 17, 8)
    k, v = rand64(2, heads_kv, 17, 8), rand64(2, heads_kv, 17, 8)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    close(attention(q, k, v), expected)


def test_gqa_low_precision_keeps_dtype():
    q = torch.randn(1, 4, 6, 8, dtype=torch.bfloat16)
    k, v = torch.randn(1, 2, 6, 8, dtype=torch.bfloat16), torch.randn(1, 2, 6, 8,
                                                                      dtype=torch.bfloat16)
    assert attention(q, k, v, upcast=False).dtype == torch.bfloat16


def test_gqa_gradcheck():
    q = rand64(1, 4, 5, 3, requires_grad=True)
    k = rand64(1, 2, 6, 3, requires_grad=True)
    v = rand64(1, 2, 6, 2, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, window=3), (q, k, v))


def test_gqa_uses_the_dense_dropout_mask_of_query_heads():
    # Nothing new for GQA dropout: the mask is (batch, heads_q, q_len, k_len), bh = b*heads_q+h.
    q, k, v = rand64(2, 4, 7, 8), rand64(2, 1, 9, 8), rand64(2, 1, 9, 8)
    keep = dropout_keep_mask(3, 2, 4, 7, 9, 0.3)
    expected = attention(q, k.expand(2, 4, 9, 8), v.expand(2, 4, 9, 8), dropout_p=0.3,
                         keep_mask=keep)
    close(attention(q, k, v, dropout_p=0.3, keep_mask=keep), expected)


# ----------------------------------------------------------------------------------------------
# Sliding window
# ----------------------------------------------------------------------------------------------

def brute_force_mask(q_len, k_len, window=None):
    d = k_len - q_len
    mask = torch.zeros(q_len, k_len, dtype=torch.bool)
    for i in range(q_len):
        for j in range(k_len):
            mask[i, j] = j <= i + d and (window is None or j > i + d - window)
    return mask


LENS = [(7, 7), (5, 19), (19, 5), (1, 9), (9, 1), (0, 4), (4, 0)]


@pytest.mark.parametrize("window", [None, 1, 3, 16, 19, 100])
@pytest.mark.parametrize("lens", LENS, ids=lambda t: f"q{t[0]}k{t[1]}")
def test_causal_mask_window_brute_force(lens, window):
    assert torch.equal(causal_mask(*lens, window=window), brute_force_mask(*lens, window))


def test_causal_mask_window_drawing():
    # The module docstring's q_len=5, k_len=5, window=3 and q_len=2, k_len=5, window=3.
    assert causal_mask(5, 5, window=3).int().tolist() == [[1, 0, 0, 0, 0],
                                                          [1, 1, 0, 0, 0],
                                                          [1, 1, 1, 0, 0],
                                                          [0, 1, 1, 1, 0],
                                                          [0, 0, 1, 1, 1]]
    assert causal_mask(2, 5, window=3).int().tolist() == [[0, 1, 1, 1, 0],
                                                          [0, 0, 1, 1, 1]]


@pytest.mark.parametrize("window", [1, 3, 16])
@pytest.mark.parametrize("lens", [(12, 12), (6, 20), (20, 6)], ids=lambda t: f"q{t[0]}k{t[1]}")
def test_window_attention_matches_sdpa_with_brute_force_mask(lens, window):
    q_len, k_len = lens
    q, k, v = rand64(2, 3, q_len, 8), rand64(2, 3, k_len, 8), rand64(2, 3, k_len, 8)
    mask = brute_force_mask(q_len, k_len, window)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # SDPA gives NaN for rows that see no key (q_len > k_len); the oracle defines them as 0.
    empty = ~mask.any(-1)
    expected = expected.masked_fill(empty[:, None], 0.0)
    out = attention(q, k, v, window=window)
    close(out, expected)
    assert torch.all(out[:, :, empty] == 0)


@pytest.mark.parametrize("lens", [(8, 8), (5, 11), (11, 5)], ids=lambda t: f"q{t[0]}k{t[1]}")
def test_window_at_least_k_len_is_plain_causal(lens):
    q_len, k_len = lens
    q, k, v = rand64(1, 2, q_len, 8), rand64(1, 2, k_len, 8), rand64(1, 2, k_len, 8)
    for window in (k_len, k_len + 1, 10**6):
        assert torch.equal(causal_mask(q_len, k_len, window=window), causal_mask(q_len, k_len))
        assert torch.equal(attention(q, k, v, window=window), attention(q, k, v))


def test_window_one_is_the_diagonal_value():
    # window=1: each row sees only its own key, so the output is that key's value.
    q, k, v = rand64(1, 2, 6, 4), rand64(1, 2, 6, 4), rand64(1, 2, 6, 5)
    assert torch.equal(attention(q, k, v, window=1), v)


def test_window_gradcheck():
    q = rand64(1, 2, 6, 3, requires_grad=True)
    k = rand64(1, 2, 8, 3, requires_grad=True)
    v = rand64(1, 2, 8, 3, requires_grad=True)
    keep = torch.rand(1, 2, 6, 8) > 0.2
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, window=2, dropout_p=0.2, keep_mask=keep), (q, k, v))


# ----------------------------------------------------------------------------------------------
# Packed variable-length batches
# ----------------------------------------------------------------------------------------------

Q_LENS = [1, 17, 64, 0, 5, 97]
K_LENS = {
    "k_equal": Q_LENS,
    "k_differ": [3, 17, 40, 6, 0, 120],
}


def cu(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def packed(lens_q, lens_k, heads_q=4, heads_kv=2, d=8, d_v=6, requires_grad=False):
    q = rand64(sum(lens_q), heads_q, d, requires_grad=requires_grad)
    k = rand64(sum(lens_k), heads_kv, d, requires_grad=requires_grad)
    v = rand64(sum(lens_k), heads_kv, d_v, requires_grad=requires_grad)
    return q, k, v, cu(lens_q), cu(lens_k)


def per_sequence(q, k, v, cu_q, cu_k, keep_masks=None, **kw):
    """The expected packed output: ``attention`` on each sequence alone, written out."""
    outs = []
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].permute(1, 0, 2)[None]
        ks = k[cu_k[s]:cu_k[s + 1]].permute(1, 0, 2)[None]
        vs = v[cu_k[s]:cu_k[s + 1]].permute(1, 0, 2)[None]
        keep = None if keep_masks is None else keep_masks[s][None]
        outs.append(attention(qs, ks, vs, keep_mask=keep, **kw)[0].permute(1, 0, 2))
    return torch.cat(outs)


@pytest.mark.parametrize("causal, window", [(True, None), (True, 5), (False, None)],
                         ids=["causal", "window5", "full"])
@pytest.mark.parametrize("k_lens", K_LENS, ids=str)
def test_varlen_equals_attention_per_sequence(k_lens, causal, window):
    q, k, v, cu_q, cu_k = packed(Q_LENS, K_LENS[k_lens])
    out = attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window,
                           softmax_scale=0.4)
    assert out.shape == (sum(Q_LENS), 4, 6) and out.dtype == torch.float64
    assert torch.equal(out, per_sequence(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=causal,
                                         window=window, softmax_scale=0.4))


def test_varlen_sequences_do_not_see_each_other():
    # Changing one sequence's keys and values leaves every other sequence's output unchanged.
    q, k, v, cu_q, cu_k = packed(Q_LENS, K_LENS["k_differ"])
    out = attention_varlen(q, k, v, cu_q, cu_k)
    k2, v2 = k.clone(), v.clone()
    k2[cu_k[2]:cu_k[3]] += 1.0
    v2[cu_k[2]:cu_k[3]] -= 2.0
    out2 = attention_varlen(q, k2, v2, cu_q, cu_k)
    rows = torch.ones(q.shape[0], dtype=torch.bool)
    rows[cu_q[2]:cu_q[3]] = False
    assert torch.equal(out[rows], out2[rows])
    assert not torch.equal(out[~rows], out2[~rows])


def test_varlen_one_sequence_is_dense_attention():
    q, k, v = rand64(1, 4, 9, 8), rand64(1, 2, 13, 8), rand64(1, 2, 13, 8)
    out = attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                           [0, 9], [0, 13], window=4)
    assert torch.equal(out, attention(q, k, v, window=4)[0].transpose(0, 1))


def test_varlen_zero_length_sequences():
    # Sequence 1 has queries but no keys (its rows are 0), sequence 2 keys but no queries,
    # sequence 3 nothing; and a batch with no sequences at all.
    lens_q, lens_k = [3, 4, 0, 0, 2], [3, 0, 5, 0, 6]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, requires_grad=True)
    for causal in (True, False):
        out = attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
        assert out.shape == (9, 4, 6) and not torch.isnan(out).any()
        assert torch.all(out[3:7] == 0)
        assert torch.all(out[:3].abs().sum(-1) > 0) and torch.all(out[7:].abs().sum(-1) > 0)
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
        assert torch.all(q.grad[3:7] == 0)
        q.grad = k.grad = v.grad = None
    empty = attention_varlen(rand64(0, 4, 8), rand64(0, 2, 8), rand64(0, 2, 6), [0], [0])
    assert empty.shape == (0, 4, 6) and empty.dtype == torch.float64
    assert attention_varlen(rand64(0, 4, 8).float(), rand64(0, 2, 8).float(),
                            rand64(0, 2, 6).float(), [0], [0], upcast=False).dtype == torch.float32


@pytest.mark.parametrize("k_lens", K_LENS, ids=str)
def test_varlen_gradients_match_per_sequence(k_lens):
    q, k, v, cu_q, cu_k = packed(Q_LENS, K_LENS[k_lens], requires_grad=True)
    keep = dropout_keep_mask_varlen(9, cu_q, cu_k, 4, 0.2)
    kw = dict(dropout_p=0.2, window=7)
    out = attention_varlen(q, k, v, cu_q, cu_k, keep_masks=keep, **kw)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    expected = per_sequence(q, k, v, cu_q.tolist(), cu_k.tolist(), keep_masks=keep, **kw)
    expected_grads = torch.autograd.grad(expected, (q, k, v), do)
    for g, e in zip(grads, expected_grads):
        close(g, e)


def test_varlen_gradcheck():
    lens_q, lens_k = [2, 0, 3], [3, 2, 3]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, heads_q=2, heads_kv=1, d=3, d_v=2,
                                 requires_grad=True)
    keep = [torch.rand(2, lq, lk) > 0.3 for lq, lk in zip(lens_q, lens_k)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention_varlen(q, k, v, cu_q, cu_k, dropout_p=0.3, keep_masks=keep),
        (q, k, v))


def test_varlen_keep_masks_are_applied():
    lens_q, lens_k = [4, 6], [5, 6]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k)
    p = 0.4
    keep = [torch.rand(4, lq, lk) > p for lq, lk in zip(lens_q, lens_k)]
    out = attention_varlen(q, k, v, cu_q, cu_k, dropout_p=p, keep_masks=keep)
    # Built independently: masked softmax, weights * keep / (1 - p), per sequence.
    for s, (a, b, c, e) in enumerate([(0, 4, 0, 5), (4, 10, 5, 11)]):
        qs, ks, vs = (t.transpose(0, 1) for t in (q[a:b], k[c:e], v[c:e]))
        ks, vs = ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0)
        scores = qs @ ks.transpose(-1, -2) / math.sqrt(8)
        scores = scores.masked_fill(~brute_force_mask(b - a, e - c), float("-inf"))
        expected = (torch.softmax(scores, -1) * keep[s] / (1 - p)) @ vs
        close(out[a:b], expected.transpose(0, 1))
    assert not torch.equal(out, attention_varlen(q, k, v, cu_q, cu_k))
    # All-kept masks are the no-dropout result scaled by 1 / (1 - p).
    ones = [torch.ones(4, lq, lk, dtype=torch.bool) for lq, lk in zip(lens_q, lens_k)]
    close(attention_varlen(q, k, v, cu_q, cu_k, dropout_p=p, keep_masks=ones) * (1 - p),
          attention_varlen(q, k, v, cu_q, cu_k))


def test_varlen_low_precision_dtype():
    q, k, v, cu_q, cu_k = packed([3, 5], [4, 5])
    q, k, v = q.half(), k.half(), v.half()
    assert attention_varlen(q, k, v, cu_q, cu_k, upcast=False).dtype == torch.float16
    assert attention_varlen(q, k, v, cu_q, cu_k).dtype == torch.float64


# ----------------------------------------------------------------------------------------------
# Dropout mask, packed layout
# ----------------------------------------------------------------------------------------------

def test_varlen_dropout_one_sequence_is_the_dense_mask():
    for seed, heads, q_len, k_len, p in [(0, 3, 17, 17, 0.3), (2**40 + 5, 2, 9, 30, 0.5),
                                         (123, 1, 31, 6, 0.1)]:
        packed_mask = dropout_keep_mask_varlen(seed, [0, q_len], [0, k_len], heads, p)
        assert len(packed_mask) == 1
        assert torch.equal(packed_mask[0], dropout_keep_mask(seed, 1, heads, q_len, k_len, p)[0])


def definition_counters(lens_q, lens_k, heads):
    """(counter, word, sequence, head, row, column) of every element, from the definition."""
    total_q, total_k = sum(lens_q), sum(lens_k)
    groups = math.ceil(total_k / 4)
    start = [sum(lens_q[:s]) for s in range(len(lens_q))]
    for s, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        for h in range(heads):
            for i in range(lq):
                r = h * total_q + start[s] + i
                for j in range(lk):
                    yield r * groups + j // 4, j % 4, s, h, i, j


@pytest.mark.parametrize("lens_k", [[1, 17, 0, 5], [6, 3, 9, 0]], ids=["k_equal", "k_differ"])
def test_varlen_dropout_follows_the_definition_and_words_are_unique(lens_k):
    lens_q, heads, seed, p = [1, 17, 0, 5], 3, 2024, 0.35
    masks = dropout_keep_mask_varlen(seed, cu(lens_q), cu(lens_k), heads, p)
    assert [tuple(m.shape) for m in masks] == [(heads, lq, lk) for lq, lk in zip(lens_q, lens_k)]
    assert all(m.dtype == torch.bool for m in masks)
    elems = list(definition_counters(lens_q, lens_k, heads))
    assert len({(c, w) for c, w, *_ in elems}) == len(elems)  # no two share a Philox word
    counters = torch.tensor([c for c, *_ in elems], dtype=torch.int64)
    words = torch.stack(philox4x32(seed, counters), dim=-1)  # (n, 4)
    word = words[torch.arange(len(elems)), torch.tensor([w for _, w, *_ in elems])]
    expected = (word >> 8) >= round(p * 2**24)
    got = torch.stack([masks[s][h, i, j] for _, _, s, h, i, j in elems])
    assert torch.equal(got, expected)


def test_varlen_dropout_matches_keep_rows_with_the_packed_stride():
    lens_q, lens_k, heads = [5, 0, 7], [9, 4, 2], 2
    masks = dropout_keep_mask_varlen(17, cu(lens_q), cu(lens_k), heads, 0.5)
    total_q, groups = sum(lens_q), math.ceil(sum(lens_k) / 4)
    rows = torch.arange(heads)[:, None] * total_q + 5 + torch.arange(7)[None, :]  # sequence 2
    assert torch.equal(masks[2].reshape(-1, 2),
                       dropout_keep_rows(17, rows.reshape(-1), 2, 0.5, groups=groups))
    # The default stride is the dense one.
    rows = torch.arange(6)
    assert torch.equal(dropout_keep_rows(17, rows, 9, 0.5),
                       dropout_keep_rows(17, rows, 9, 0.5, groups=3))
    assert not torch.equal(dropout_keep_rows(17, rows, 9, 0.5),
                           dropout_keep_rows(17, rows, 9, 0.5, groups=4))


def test_varlen_dropout_kept_fraction_and_reproducibility(monkeypatch):
    import reference.dropout as rd

    lens_q, lens_k = [100, 37, 0, 150], [120, 37, 3, 90]
    for p in (0.1, 0.5, 0.9):
        masks = dropout_keep_mask_varlen(5, cu(lens_q), cu(lens_k), 4, p)
        n = sum(m.numel() for m in masks)
        kept = sum(m.sum().item() for m in masks) / n
        assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), (p, kept)
    assert all(m.all() for m in dropout_keep_mask_varlen(5, cu(lens_q), cu(lens_k), 4, 0.0))
    whole = dropout_keep_mask_varlen(5, cu(lens_q), cu(lens_k), 4, 0.5)
    monkeypatch.setattr(rd, "_CHUNK", 7)  # chunks that split sequences and heads
    for a, b in zip(whole, dropout_keep_mask_varlen(5, cu(lens_q), cu(lens_k), 4, 0.5)):
        assert torch.equal(a, b)
    other = dropout_keep_mask_varlen(6, cu(lens_q), cu(lens_k), 4, 0.5)
    assert not all(torch.equal(a, b) for a, b in zip(whole, other))


# ----------------------------------------------------------------------------------------------
# Argument errors
# ----------------------------------------------------------------------------------------------

def test_gqa_errors():
    q = rand64(1, 6, 4, 8)
    with pytest.raises(ValueError, match=r"heads_q=6 must be a multiple of heads_kv=4"):
        attention(q, rand64(1, 4, 4, 8), rand64(1, 4, 4, 8))
    with pytest.raises(ValueError, match=r"heads_kv"):
        attention(q, rand64(1, 2, 4, 8), rand64(1, 3, 4, 8))
    with pytest.raises(ValueError, match=r"batch"):
        attention(q, rand64(2, 2, 4, 8), rand64(2, 2, 4, 8))
    with pytest.raises(ValueError, match=r"heads_q=4 must be a multiple of heads_kv=3"):
        attention_varlen(rand64(5, 4, 8), rand64(5, 3, 8), rand64(5, 3, 8), [0, 5], [0, 5])


def test_window_errors():
    q = rand64(1, 2, 4, 8)
    for bad in (0, -3):
        with pytest.raises(ValueError, match=rf"window must be an int >= 1 or None; got {bad}"):
            attention(q, q, q, window=bad)
        with pytest.raises(ValueError, match="window"):
            causal_mask(4, 4, window=bad)
    for bad in (2.0, True, "3", torch.tensor(3)):
        with pytest.raises(TypeError, match="window must be an int"):
            attention(q, q, q, window=bad)
        with pytest.raises(TypeError, match="window"):
            causal_mask(4, 4, window=bad)
    with pytest.raises(ValueError, match="window=3 requires causal=True"):
        attention(q, q, q, causal=False, window=3)
    with pytest.raises(ValueError, match="window=3 requires causal=True"):
        attention_varlen(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1),
                         [0, 4], [0, 4], causal=False, window=3)


def test_varlen_errors():
    q, k, v, cu_q, cu_k = packed([3, 4], [2, 5])
    with pytest.raises(ValueError, match="3-D"):
        attention_varlen(q[None], k[None], v[None], cu_q, cu_k)
    with pytest.raises(ValueError, match="head_dim differ"):
        attention_varlen(q, k[..., :4], v, cu_q, cu_k)
    with pytest.raises(ValueError, match="k and v"):
        attention_varlen(q, k, v[:-1], cu_q, cu_k)
    with pytest.raises(ValueError, match="dropout_p"):
        attention_varlen(q, k, v, cu_q, cu_k, dropout_p=1.0)
    with pytest.raises(ValueError, match=r"cu_seqlens_q and cu_seqlens_k must have the same "
                                         r"length num_seqs \+ 1; got 3 and 4"):
        attention_varlen(q, k, v, cu_q, [0, 2, 5, 7])
    with pytest.raises(ValueError, match=r"cu_seqlens_k must start at 0; got cu_seqlens_k\[0\]"):
        attention_varlen(q, k, v, cu_q, [1, 2, 7])
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing .*got "
                                         r"cu_seqlens_q\[0\] = 0 > cu_seqlens_q\[1\] = -1"):
        attention_varlen(q, k, v, [0, -1, 7], cu_k)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must end at the packed tensor's row "
                                         r"count 7; got cu_seqlens_q\[-1\] = 6"):
        attention_varlen(q, k, v, [0, 3, 6], cu_k)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must end at .* 7; got .* = 8"):
        attention_varlen(q, k, v, cu_q, [0, 2, 8])
    for bad in ([], [[0, 3, 7]], [0.0, 3.0, 7.0], torch.tensor([False, True])):
        with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D integer tensor"):
            attention_varlen(q, k, v, bad, cu_k)
    with pytest.raises(ValueError, match="keep_masks must hold one mask per sequence: "
                                         "expected 2, got 1"):
        attention_varlen(q, k, v, cu_q, cu_k, keep_masks=[torch.ones(4, 3, 2, dtype=bool)])
    good = [torch.ones(4, 3, 2, dtype=bool), torch.ones(4, 4, 5, dtype=bool)]
    attention_varlen(q, k, v, cu_q, cu_k, keep_masks=good)
    with pytest.raises(ValueError, match=r"keep_masks\[1\] must be \(heads_q, len_q, len_k\) = "
                                         r"\(4, 4, 5\); got \(4, 5, 4\)"):
        attention_varlen(q, k, v, cu_q, cu_k, keep_masks=[good[0], torch.ones(4, 5, 4)])


def test_dropout_varlen_errors():
    with pytest.raises(ValueError, match="seed"):
        dropout_keep_mask_varlen(-1, [0, 2], [0, 2], 1, 0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_keep_mask_varlen(0, [0, 2], [0, 2], 1, 1.0)
    with pytest.raises(ValueError, match="heads"):
        dropout_keep_mask_varlen(0, [0, 2], [0, 2], -1, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k"):
        dropout_keep_mask_varlen(0, [0, 2], [0, 2, 3], 1, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        dropout_keep_mask_varlen(0, [0, 2, 3], [0, 2, 1], 1, 0.1)
    with pytest.raises(ValueError, match=r"groups must be >= ceil\(k_len / 4\) = 3 "
                                         r"\(k_len=9\); got 2"):
        dropout_keep_rows(0, torch.arange(3), 9, 0.1, groups=2)
