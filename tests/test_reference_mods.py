"""The reference oracle's score and mask modifications: softcap, ALiBi, chunked attention, the
``score_mod`` / ``mask_mod`` callables, attention sinks, a value head_dim of its own, and lse
(``reference.attention``, ``attention_varlen``, ``attention_with_kvcache``, ``causal_mask``).

Each feature is checked against something written independently of ``reference/functional.py``:
``loop_attention`` below (Python loops over every (batch, head, query) with the visible keys
listed one by one and the softmax summed in Python floats), masks drawn as text, explicit
concatenation of a sink column, closed-form gradients, and per-sequence / per-row dense calls.
Tiny float64 CPU shapes.
"""
import math

import pytest
import torch

from reference import attention, attention_varlen, attention_with_kvcache, causal_mask

NEG_INF = float("-inf")


def rand64(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(requires_grad)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def loop_attention(q, k, v, *, scale=None, score=None, visible=None, sinks=None):
    """Attention written out one (batch, head, query) at a time, in Python floats.

    q: (batch, heads_q, q_len, d); k: (batch, heads_kv, k_len, d); v: (batch, heads_kv, k_len,
    d_v). ``score(s, b, h, p, j) -> float`` modifies the scaled score of query position
    ``p = i + k_len - q_len`` and key j; ``visible(b, h, p, j) -> bool`` (default: all keys);
    ``sinks``: a list of one logit per query head or None.

    Returns (out (batch, heads_q, q_len, d_v), lse (batch, heads_q, q_len)), float64; a row
    with no visible key and no sink has out 0 and lse -inf.
    """
    batch, heads, q_len, d = q.shape
    k_len, d_v = k.shape[2], v.shape[3]
    group = heads // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(batch, heads, q_len, d_v, dtype=torch.float64)
    lse = torch.full((batch, heads, q_len), NEG_INF, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                p = i + k_len - q_len
                logits = {}
                for j in range(k_len):
                    if visible is not None and not visible(b, h, p, j):
                        continue
                    s = scale * sum(q[b, h, i, c].item() * k[b, h // group, j, c].item()
                                    for c in range(d))
                    logits[j] = score(s, b, h, p, j) if score is not None else s
                terms = list(logits.values()) + ([sinks[h]] if sinks is not None else [])
                if not terms:
                    continue
                top = max(terms)
                row_lse = top + math.log(sum(math.exp(t - top) for t in terms))
                lse[b, h, i] = row_lse
                for j, s in logits.items():
                    out[b, h, i] += math.exp(s - row_lse) * v[b, h // group, j].double()
    return out, lse


def causal_rule(b, h, p, j):
    return j <= p


# ----------------------------------------------------------------------------------------------
# softcap, ALiBi, and their order with score_mod
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lens", [(3, 5), (5, 3)], ids=lambda t: f"q{t[0]}k{t[1]}")
@pytest.mark.parametrize("causal", [True, False])
def test_softcap_is_cap_times_tanh(lens, causal):
    q_len, k_len = lens
    q, k, v = rand64(2, 2, q_len, 4) * 3, rand64(2, 2, k_len, 4) * 3, rand64(2, 2, k_len, 3)
    cap = 1.5
    out, lse = attention(q, k, v, causal=causal, softcap=cap, return_lse=True)
    expected_out, expected_lse = loop_attention(
        q, k, v, score=lambda s, b, h, p, j: cap * math.tanh(s / cap),
        visible=causal_rule if causal else None)
    close(out, expected_out)
    close(lse, expected_lse)
    # The cap changes the result: these scores reach well past 1.5.
    assert not torch.allclose(out, attention(q, k, v, causal=causal))


def test_softcap_far_above_the_scores_changes_nothing():
    q, k, v = rand64(1, 2, 4, 8), rand64(1, 2, 6, 8), rand64(1, 2, 6, 8)
    torch.testing.assert_close(attention(q, k, v, softcap=1e6), attention(q, k, v),
                               rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("per_batch", [False, True], ids=["heads", "batch-heads"])
@pytest.mark.parametrize("lens, causal", [((3, 6), True), ((6, 3), True), ((4, 5), False)])
def test_alibi_bias_matches_explicit_loops(per_batch, lens, causal):
    q_len, k_len = lens
    batch, heads = 2, 4
    q, k, v = rand64(batch, heads, q_len, 4), rand64(batch, 2, k_len, 4), rand64(batch, 2, k_len, 5)
    slopes = torch.rand(batch, heads) if per_batch else torch.rand(heads)  # fp32, as the kernels

    def alibi(s, b, h, p, j):
        slope = (slopes[b, h] if per_batch else slopes[h]).item()
        return s - slope * abs(p - j)

    out, lse = attention(q, k, v, causal=causal, alibi_slopes=slopes, return_lse=True)
    expected_out, expected_lse = loop_attention(q, k, v, score=alibi,
                                                visible=causal_rule if causal else None)
    close(out, expected_out)
    close(lse, expected_lse)


def test_pipeline_order_softcap_then_alibi_then_score_mod():
    """Every step is nonlinear in the previous one's output here, so any other order differs."""
    q, k, v = rand64(2, 2, 4, 4) * 2, rand64(2, 2, 5, 4) * 2, rand64(2, 2, 5, 3)
    cap, slopes = 2.0, torch.tensor([0.5, 1.25])

    def square(s, b, h, q_idx, kv_idx, aux):
        return s * s.abs() * aux[0]

    def step_by_step(s, b, h, p, j):
        s = cap * math.tanh(s / cap)
        s = s - slopes[h].item() * abs(p - j)
        return s * abs(s) * 0.3

    out = attention(q, k, v, softcap=cap, alibi_slopes=slopes, score_mod=square, mod_aux=(0.3,))
    expected, _ = loop_attention(q, k, v, score=step_by_step, visible=causal_rule)
    close(out, expected)


# ----------------------------------------------------------------------------------------------
# Chunked attention
# ----------------------------------------------------------------------------------------------

def drawn(picture):
    """A mask drawn as rows of 'x' (visible) and '.' (hidden) -> bool tensor (rows, cols)."""
    rows = [line.split() for line in picture.strip().splitlines()]
    return torch.tensor([[c == "x" for c in row] for row in rows])


CHUNK_PICTURES = {
    # (q_len, k_len, chunk_size): the mask, query i at position P = i + k_len - q_len.
    (6, 6, 3): """
        x . . . . .
        x x . . . .
        x x x . . .
        . . . x . .
        . . . x x .
        . . . x x x
    """,
    (3, 6, 4): """
        x x x x . .
        . . . . x .
        . . . . x x
    """,
    (5, 3, 2): """
        . . .
        . . .
        x . .
        x x .
        . . x
    """,
    (2, 7, 10): """
        x x x x x x .
        x x x x x x x
    """,
}


@pytest.mark.parametrize("shape", list(CHUNK_PICTURES), ids=lambda t: f"q{t[0]}k{t[1]}c{t[2]}")
def test_chunk_mask_is_the_drawn_pattern(shape):
    q_len, k_len, chunk = shape
    expected = drawn(CHUNK_PICTURES[shape])
    assert torch.equal(causal_mask(q_len, k_len, chunk_size=chunk), expected)

    q, k, v = rand64(1, 2, q_len, 4), rand64(1, 2, k_len, 4), rand64(1, 2, k_len, 3)
    out, lse = attention(q, k, v, chunk_size=chunk, return_lse=True)
    expected_out, expected_lse = loop_attention(
        q, k, v, visible=lambda b, h, p, j: bool(expected[p - (k_len - q_len), j]))
    close(out, expected_out)
    close(lse, expected_lse)
    empty = ~expected.any(dim=1)  # rows that see no key: zeros and lse -inf
    assert torch.all(out[:, :, empty] == 0) and torch.all(lse[:, :, empty] == NEG_INF)


# ----------------------------------------------------------------------------------------------
# Sinks
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lens", [(4, 6), (6, 3)], ids=lambda t: f"q{t[0]}k{t[1]}")
def test_sinks_by_concatenation_and_by_lse(lens):
    q_len, k_len = lens
    q, k, v = rand64(2, 3, q_len, 4), rand64(2, 3, k_len, 4), rand64(2, 3, k_len, 5)
    sinks = torch.tensor([0.5, -1.0, 2.0])
    out, lse = attention(q, k, v, sinks=sinks, return_lse=True)

    # 1. A sink column appended to the masked scores, softmax over k_len + 1, column dropped.
    scores = (q @ k.transpose(-2, -1)) / 2.0  # scale 1 / sqrt(4)
    scores = scores.masked_fill(~causal_mask(q_len, k_len), NEG_INF)
    column = sinks.double().view(1, 3, 1, 1).expand(2, 3, q_len, 1)
    weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    close(out, weights @ v)

    # 2. lse = log(exp(sink) + sum_j exp(s_ij)) and out = sum_j exp(s_ij - lse) v_j.
    expected_lse = torch.log(torch.exp(column[..., 0]) + torch.exp(scores).sum(-1))
    close(lse, expected_lse)
    close(out, torch.exp(scores - expected_lse[..., None]) @ v)

    # 3. The loop oracle agrees, rows that see no key included (q6k3: rows 0-2).
    expected_out, loop_lse = loop_attention(q, k, v, visible=causal_rule, sinks=sinks.tolist())
    close(out, expected_out)
    close(lse, loop_lse)
    # A sink takes weight: the key weights sum to less than 1.
    assert torch.all(weights.sum(-1) < 1)


def test_sinks_rows_without_keys_give_zero_and_lse_sink():
    q, k, v = rand64(1, 2, 5, 4), rand64(1, 2, 2, 4), rand64(1, 2, 2, 4)
    sinks = torch.tensor([0.25, -3.0])
    out, lse = attention(q, k, v, sinks=sinks, return_lse=True)  # q0..q2 see no key
    assert torch.all(out[:, :, :3] == 0)
    close(lse[0, :, :3], sinks.double()[:, None].expand(2, 3))
    _, lse_plain = attention(q, k, v, return_lse=True)
    assert torch.all(lse_plain[:, :, :3] == NEG_INF)


def test_sinks_with_dropout_drop_key_weights_only():
    q, k, v = rand64(1, 2, 4, 4), rand64(1, 2, 4, 4), rand64(1, 2, 4, 3)
    sinks = torch.tensor([1.0, -0.5])
    keep = torch.rand(1, 2, 4, 4) > 0.3
    scores = ((q @ k.transpose(-2, -1)) / 2.0).masked_fill(~causal_mask(4, 4), NEG_INF)
    lse = torch.log(torch.exp(sinks.double()).view(1, 2, 1) + torch.exp(scores).sum(-1))
    weights = torch.exp(scores - lse[..., None])  # the key weights, the sink's left out
    close(attention(q, k, v, sinks=sinks), weights @ v)
    close(attention(q, k, v, sinks=sinks, dropout_p=0.3, keep_mask=keep),
          (weights * keep / 0.7) @ v)


def test_sinks_gradcheck():
    q = rand64(1, 2, 3, 2, requires_grad=True)
    k = rand64(1, 1, 4, 2, requires_grad=True)
    v = rand64(1, 1, 4, 3, requires_grad=True)
    sinks = rand64(2, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: attention(q, k, v, sinks=s, return_lse=True), (q, k, v, sinks))
    # Rows that see no key (q_len > k_len): their out is 0 whatever the sink, lse = sink.
    q5 = rand64(1, 2, 5, 2, requires_grad=True)
    k2, v2 = rand64(1, 1, 2, 2, requires_grad=True), rand64(1, 1, 2, 3, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: attention(q, k, v, sinks=s, return_lse=True), (q5, k2, v2, sinks))


def test_sinks_gradient_closed_form():
    """dL/dsink_h = -sum_i p_i (dO_i . O_i) with p_i = exp(sink_h - lse_i) the sink's weight."""
    q, k, v = rand64(2, 3, 5, 4), rand64(2, 3, 5, 4), rand64(2, 3, 5, 6)
    sinks = rand64(3, requires_grad=True)
    out, lse = attention(q, k, v, sinks=sinks, return_lse=True)
    do = torch.randn_like(out)
    (out * do).sum().backward()
    p_sink = torch.exp(sinks.detach().view(1, 3, 1) - lse.detach())
    expected = -(p_sink * (do * out.detach()).sum(-1)).sum(dim=(0, 2))
    close(sinks.grad, expected)


def test_lse_gradient_is_finite_in_rows_that_see_no_key():
    q = rand64(1, 2, 4, 4, requires_grad=True)
    k, v = rand64(1, 2, 2, 4, requires_grad=True), rand64(1, 2, 2, 4)
    out, lse = attention(q, k, v, return_lse=True)  # rows 0 and 1 see no key: lse -inf
    assert torch.all(lse[:, :, :2] == NEG_INF)
    torch.autograd.backward([out, lse], [torch.ones_like(out), torch.ones_like(lse)])
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert torch.all(q.grad[:, :, :2] == 0)


# ----------------------------------------------------------------------------------------------
# head_dim_v != head_dim
# ----------------------------------------------------------------------------------------------

def test_value_head_dim_of_its_own():
    q, k, v = rand64(2, 4, 3, 8), rand64(2, 2, 5, 8), rand64(2, 2, 5, 3)
    out, lse = attention(q, k, v, return_lse=True, softcap=3.0, sinks=torch.zeros(4))
    assert out.shape == (2, 4, 3, 3) and lse.shape == (2, 4, 3)
    expected, _ = loop_attention(q, k, v, scale=1 / math.sqrt(8), visible=causal_rule,
                                 score=lambda s, b, h, p, j: 3.0 * math.tanh(s / 3.0),
                                 sinks=[0.0] * 4)
    close(out, expected)  # the default scale is 1 / sqrt(head_dim of q and k), not of v

    cu = torch.tensor([0, 2, 5])
    packed = attention_varlen(rand64(5, 4, 8), rand64(5, 2, 8), rand64(5, 2, 7), cu, cu)
    assert packed.shape == (5, 4, 7)
    cached = attention_with_kvcache(q, rand64(2, 2, 9, 8), rand64(2, 2, 9, 3), [4, 6],
                                    k=rand64(2, 2, 3, 8), v=rand64(2, 2, 3, 3))
    assert cached.shape == (2, 4, 3, 3)


# ----------------------------------------------------------------------------------------------
# score_mod and mask_mod callables
# ----------------------------------------------------------------------------------------------

def test_mods_see_the_documented_indices():
    seen = {}

    def record(s, b, h, q_idx, kv_idx, aux):
        seen.update(s=s.shape, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx, aux=aux)
        return s

    def visible_all(b, h, q_idx, kv_idx, aux):
        seen.update(mask_aux=aux)
        return torch.ones((), dtype=torch.bool)

    aux = (torch.arange(3), 7)
    attention(rand64(2, 3, 2, 4), rand64(2, 3, 5, 4), rand64(2, 3, 5, 4), score_mod=record,
              mask_mod=visible_all, mod_aux=aux)
    assert seen["s"] == (2, 3, 2, 5)
    assert seen["b"].dtype == seen["q_idx"].dtype == torch.int64
    assert seen["b"].flatten().tolist() == [0, 1] and seen["b"].shape == (2, 1, 1, 1)
    assert seen["h"].flatten().tolist() == [0, 1, 2] and seen["h"].shape == (1, 3, 1, 1)
    assert seen["q_idx"].flatten().tolist() == [3, 4] and seen["q_idx"].shape == (1, 1, 2, 1)
    assert seen["kv_idx"].flatten().tolist() == list(range(5))
    assert seen["kv_idx"].shape == (1, 1, 1, 5)
    assert seen["aux"][0] is aux[0] and seen["aux"][1] == 7
    assert seen["mask_aux"][0] is aux[0]


def prefix_lm(b, h, q_idx, kv_idx, aux):
    """Bidirectional over the first aux[-1][b] keys, causal after them."""
    prefix = aux[-1]
    return (kv_idx <= q_idx) | (kv_idx < prefix[b])


def test_prefix_lm_mask_mod():
    q, k, v = rand64(2, 2, 6, 4), rand64(2, 2, 6, 4), rand64(2, 2, 6, 3)
    prefix = torch.tensor([3, 0])
    out, lse = attention(q, k, v, causal=False, mask_mod=prefix_lm, mod_aux=(prefix,),
                         return_lse=True)
    expected_out, expected_lse = loop_attention(
        q, k, v, visible=lambda b, h, p, j: j <= p or j < prefix[b].item())
    close(out, expected_out)
    close(lse, expected_lse)
    # Batch entry 1 has no prefix: plain causal. Entry 0's first rows see past themselves.
    close(out[1], attention(q, k, v)[1])
    assert not torch.allclose(out[0, :, :2], attention(q, k, v)[0, :, :2])
    # With causal=True the mask mod is intersected with the causal mask: the prefix is lost.
    close(attention(q, k, v, mask_mod=prefix_lm, mod_aux=(prefix,)), attention(q, k, v))


def test_mask_mod_that_hides_whole_rows():
    q, k, v = rand64(1, 2, 4, 4, requires_grad=True), rand64(1, 2, 4, 4), rand64(1, 2, 4, 4)

    def odd_rows_only(b, h, q_idx, kv_idx, aux):
        return (q_idx % 2 == 1) & (kv_idx >= 0)

    out, lse = attention(q, k, v, mask_mod=odd_rows_only, return_lse=True)
    assert torch.all(out[:, :, 0::2] == 0) and torch.all(lse[:, :, 0::2] == NEG_INF)
    close(out[:, :, 1::2], attention(q, k, v)[:, :, 1::2])
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.all(q.grad[:, :, 0::2] == 0)


def relative_bias(s, b, h, q_idx, kv_idx, aux):
    """T5-style bias: table[h, clamped q_idx - kv_idx + max_distance - 1] with
    aux = (table (heads, 2 * max_distance - 1), max_distance, ...)."""
    table, max_distance = aux[:2]
    return s + table[h, (q_idx - kv_idx).clamp(1 - max_distance, max_distance - 1)
                     + max_distance - 1]


@pytest.mark.parametrize("causal", [True, False])
def test_relative_position_bias_score_mod(causal):
    q_len, k_len, heads, max_distance = 3, 6, 2, 4
    q, k, v = rand64(2, heads, q_len, 4), rand64(2, heads, k_len, 4), rand64(2, heads, k_len, 3)
    table = torch.randn(heads, 2 * max_distance - 1)  # fp32, as a model's parameter

    def bias(s, b, h, p, j):
        rel = max(1 - max_distance, min(max_distance - 1, p - j))
        return s + table[h, rel + max_distance - 1].item()

    out, lse = attention(q, k, v, causal=causal, score_mod=relative_bias,
                         mod_aux=(table, max_distance), return_lse=True)
    expected_out, expected_lse = loop_attention(q, k, v, score=bias,
                                                visible=causal_rule if causal else None)
    close(out, expected_out)
    close(lse, expected_lse)


def test_mods_gradcheck():
    q = rand64(1, 2, 3, 2, requires_grad=True)
    k = rand64(1, 2, 4, 2, requires_grad=True)
    v = rand64(1, 2, 4, 2, requires_grad=True)
    table = torch.randn(2, 5, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, softcap=0.7, alibi_slopes=torch.tensor([0.3, 0.1]),
                                  score_mod=relative_bias, mod_aux=(table, 3, torch.tensor([2])),
                                  mask_mod=prefix_lm, causal=False,
                                  return_lse=True)[0], (q, k, v))


# ----------------------------------------------------------------------------------------------
# Packed sequences and the KV cache agree with dense calls
# ----------------------------------------------------------------------------------------------

def shifted(mod, first):
    """``mod`` for a dense call of batch 1 standing for sequence / cache row ``first``: it sees
    b + first, as the packed and cached calls pass that row's index."""
    if mod is None:
        return None

    def mod_of_row(*args):
        i = 1 if len(args) == 6 else 0  # score_mod: (s, b, ...), mask_mod: (b, ...)
        return mod(*args[:i], args[i] + first, *args[i + 1:])
    return mod_of_row


def per_row_bias(s, b, h, q_idx, kv_idx, aux):
    """A bias that differs per batch row / sequence: aux[0][b] * (q_idx - kv_idx)."""
    return s + aux[0][b] * (q_idx - kv_idx)


def test_varlen_matches_dense_per_sequence():
    lens_q, lens_k = [3, 0, 4, 2], [5, 2, 4, 0]
    heads_q, heads_kv = 4, 2
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()])
    q = rand64(sum(lens_q), heads_q, 4, requires_grad=True)
    k = rand64(sum(lens_k), heads_kv, 4, requires_grad=True)
    v = rand64(sum(lens_k), heads_kv, 6, requires_grad=True)
    slopes = torch.rand(4, heads_q)
    sinks = rand64(heads_q, requires_grad=True)
    row_scale = torch.tensor([0.1, -0.2, 0.3, 0.4], dtype=torch.float64)
    prefix = torch.tensor([2, 0, 1, 0])
    kw = dict(softcap=2.5, score_mod=per_row_bias, sinks=sinks)

    for extra in (dict(chunk_size=2), dict(mask_mod=prefix_lm, causal=False)):
        aux = (row_scale, prefix)
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, alibi_slopes=slopes, mod_aux=aux,
                                    return_lse=True, **kw, **extra)
        assert out.shape == (sum(lens_q), heads_q, 6) and lse.shape == (heads_q, sum(lens_q))
        for s in range(len(lens_q)):
            rows_q, rows_k = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
            dense = {**kw, **extra, "score_mod": shifted(per_row_bias, s),
                     "mask_mod": shifted(extra.get("mask_mod"), s)}
            o, l_ = attention(q[rows_q].transpose(0, 1)[None], k[rows_k].transpose(0, 1)[None],
                              v[rows_k].transpose(0, 1)[None], alibi_slopes=slopes[s],
                              mod_aux=aux, return_lse=True, **dense)
            close(out[rows_q], o[0].transpose(0, 1))
            close(lse[:, rows_q], l_[0])
    # The b the mods see is the sequence: sequence 2 differs when another row's scale is used.
    other = attention_varlen(q, k, v, cu_q, cu_k, score_mod=per_row_bias,
                             mod_aux=(row_scale.roll(1),))
    assert not torch.allclose(other[3:7], attention_varlen(q, k, v, cu_q, cu_k,
                                                           score_mod=per_row_bias,
                                                           mod_aux=(row_scale,))[3:7])
    # Differentiable in sinks through the packed path too.
    out.sum().backward()
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()


def test_varlen_with_no_sequences_returns_empty_lse():
    out, lse = attention_varlen(rand64(0, 2, 4), rand64(0, 2, 4), rand64(0, 2, 3), [0], [0],
                                sinks=torch.zeros(2), return_lse=True)
    assert out.shape == (0, 2, 3) and lse.shape == (2, 0)


def test_kvcache_matches_dense():
    batch, heads_q, heads_kv, q_len, max_len = 3, 4, 2, 2, 8
    lens = [3, 0, 5]
    q = rand64(batch, heads_q, q_len, 4)
    k_cache, v_cache = rand64(batch, heads_kv, max_len, 4), rand64(batch, heads_kv, max_len, 5)
    k_new, v_new = rand64(batch, heads_kv, q_len, 4), rand64(batch, heads_kv, q_len, 5)
    slopes = torch.rand(batch, heads_q)
    sinks = torch.tensor([0.0, 1.0, -1.0, 2.0])
    aux = (torch.tensor([0.2, -0.1, 0.05], dtype=torch.float64),)
    kw = dict(softcap=3.0, score_mod=per_row_bias, mod_aux=aux, sinks=sinks, chunk_size=3)

    k_after, v_after = k_cache.clone(), v_cache.clone()
    out, lse = attention_with_kvcache(q, k_after, v_after, torch.tensor(lens), k_new, v_new,
                                      alibi_slopes=slopes, return_lse=True, **kw)
    assert out.shape == (batch, heads_q, q_len, 5) and lse.shape == (batch, heads_q, q_len)
    for b, n in enumerate(lens):
        torch.testing.assert_close(k_after[b, :, n:n + q_len], k_new[b], rtol=0, atol=0)
        keys = torch.cat([k_cache[b, :, :n], k_new[b]], dim=1)[None]
        values = torch.cat([v_cache[b, :, :n], v_new[b]], dim=1)[None]
        o, l_ = attention(q[b:b + 1], keys, values, alibi_slopes=slopes[b], return_lse=True,
                          **{**kw, "score_mod": shifted(per_row_bias, b)})
        close(out[b:b + 1], o)
        close(lse[b:b + 1], l_)

    # Without new keys: row b attends to its first lens[b] positions (row 1: none -> lse = sink).
    out, lse = attention_with_kvcache(q, k_cache, v_cache, lens, return_lse=True, **kw)
    assert torch.all(out[1] == 0)
    close(lse[1], sinks.double()[:, None].expand(heads_q, q_len))


def test_lowp_baseline_keeps_the_dtype_with_mods():
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.bfloat16) for _ in range(3))
    kw = dict(softcap=2.0, alibi_slopes=torch.rand(2), sinks=torch.zeros(2), chunk_size=2,
              score_mod=relative_bias, mod_aux=(torch.randn(2, 7), 4), return_lse=True)
    out, lse = attention(q, k, v, upcast=False, **kw)
    assert out.dtype == lse.dtype == torch.bfloat16
    out64, lse64 = attention(q, k, v, **kw)
    torch.testing.assert_close(out.double(), out64, rtol=0.05, atol=0.05)
    torch.testing.assert_close(lse.double(), lse64, rtol=0.05, atol=0.05)


# ----------------------------------------------------------------------------------------------
# Argument errors
# ----------------------------------------------------------------------------------------------

def test_softcap_errors():
    q = rand64(1, 2, 3, 4)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
            attention(q, q, q, softcap=bad)
    for bad in (True, "1", torch.tensor(1.0)):
        with pytest.raises(TypeError, match="softcap must be a number"):
            attention(q, q, q, softcap=bad)


def test_sinks_errors():
    q = rand64(1, 2, 3, 4)
    for bad in (torch.zeros(3), torch.zeros(1, 2), torch.zeros(())):
        with pytest.raises(ValueError, match=r"sinks must be \(heads_q,\) = \(2,\)"):
            attention(q, q, q, sinks=bad)
    for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.bool)):
        with pytest.raises(TypeError, match="sinks must be a floating-point tensor .* got dtype"):
            attention(q, q, q, sinks=bad)
    with pytest.raises(TypeError, match="sinks must be a floating-point tensor"):
        attention(q, q, q, sinks=[0.0, 0.0])


def test_chunk_size_errors():
    q = rand64(1, 2, 4, 4)
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"chunk_size must be an int >= 1 or None; got {bad}"):
            attention(q, q, q, chunk_size=bad)
        with pytest.raises(ValueError, match="chunk_size"):
            causal_mask(4, 4, chunk_size=bad)
    for bad in (2.0, True, torch.tensor(2)):
        with pytest.raises(TypeError, match="chunk_size must be an int"):
            attention(q, q, q, chunk_size=bad)
    with pytest.raises(ValueError, match="chunk_size=2 requires causal=True"):
        attention(q, q, q, causal=False, chunk_size=2)
    with pytest.raises(ValueError, match="chunk_size=2 and window=3 cannot be combined"):
        attention(q, q, q, chunk_size=2, window=3)
    with pytest.raises(ValueError, match="chunk_size=2 and window=3 cannot be combined"):
        causal_mask(4, 4, window=3, chunk_size=2)


def test_alibi_slopes_errors():
    q = rand64(2, 3, 4, 4)
    for bad in (torch.zeros(4), torch.zeros(3, 3), torch.zeros(2, 3, 1)):
        with pytest.raises(ValueError, match=r"alibi_slopes must be \(heads_q,\) = \(3,\) or "
                                             r"\(batch, heads_q\) = \(2, 3\); got shape"):
            attention(q, q, q, alibi_slopes=bad)
    with pytest.raises(TypeError, match="alibi_slopes must be a floating-point tensor"):
        attention(q, q, q, alibi_slopes=torch.ones(3, dtype=torch.int32))
    packed, cu = rand64(5, 3, 4), [0, 2, 5]
    with pytest.raises(ValueError, match=r"\(num_seqs, heads_q\) = \(2, 3\)"):
        attention_varlen(packed, packed, packed, cu, cu, alibi_slopes=torch.zeros(3, 3))
    attention_varlen(packed, packed, packed, cu, cu, alibi_slopes=torch.zeros(2, 3))


def test_mod_callable_errors():
    q = rand64(1, 2, 3, 4)
    with pytest.raises(TypeError, match="score_mod must be a PyTorch callable"):
        attention(q, q, q, score_mod="tanh")
    with pytest.raises(TypeError, match="mask_mod must be a PyTorch callable"):
        attention(q, q, q, mask_mod=3)
    with pytest.raises(TypeError, match="mod_aux must be a tuple"):
        attention(q, q, q, mod_aux=torch.ones(2))
    with pytest.raises(ValueError, match=r"score_mod must return a tensor of the scores' shape "
                                         r"\(1, 2, 3, 3\); got \(3, 3\)"):
        attention(q, q, q, score_mod=lambda s, b, h, qi, ki, aux: s[0, 0])
    with pytest.raises(TypeError, match="mask_mod must return a bool tensor"):
        attention(q, q, q, mask_mod=lambda b, h, qi, ki, aux: (qi - ki).double())
    with pytest.raises(ValueError, match="mask_mod must return a bool tensor broadcastable"):
        attention(q, q, q, mask_mod=lambda b, h, qi, ki, aux: torch.ones(5, dtype=torch.bool))


def test_kvcache_and_varlen_check_the_mods():
    q = rand64(2, 2, 1, 4)
    cache = rand64(2, 2, 6, 4)
    with pytest.raises(ValueError, match="sinks must be"):
        attention_with_kvcache(q, cache, cache, [2, 3], sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="chunk_size=2 requires causal=True"):
        attention_with_kvcache(q, cache, cache, [2, 3], causal=False, chunk_size=2)
    with pytest.raises(ValueError, match="softcap"):
        attention_varlen(q[0], q[0], q[0], [0, 2], [0, 2], softcap=-1)
    with pytest.raises(ValueError, match="k_cache and v_cache must be"):
        attention_with_kvcache(q, cache, cache[:, :, :5], [2, 3])
    # A bad argument is reported before the cache is written.
    with pytest.raises(ValueError, match="sinks"):
        attention_with_kvcache(q, cache, cache.clone(), [2, 3], k=q[:, :, :1] * 0,
                               v=q[:, :, :1] * 0, sinks=torch.zeros(5))
    assert torch.all(cache[:, :, 2:4] != 0)
