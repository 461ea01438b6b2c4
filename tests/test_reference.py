"""The reference package against the book's printed numbers and against PyTorch.

Book values are from "Build a Large Language Model (From Scratch)" (S. Raschka), chapters 3-4,
printed there to 4 decimals; the functional oracle is checked against
``torch.nn.functional.scaled_dot_product_attention`` and the book's MultiHeadAttention with the
project's parity rule (tests/helpers.py).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import DEVICE, DTYPES, assert_parity, randn
from reference import (
    GELU,
    GPT_CONFIG_124M,
    CausalAttention,
    GPTModel,
    LayerNorm,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    TransformerBlock,
    attention,
    causal_mask,
    generate_text_simple,
)

# "Your journey starts with one step": one 3-d embedding per word (book section 3.3.1).
INPUTS = torch.tensor([
    [0.43, 0.15, 0.89],  # Your     (x^1)
    [0.55, 0.87, 0.66],  # journey  (x^2)
    [0.57, 0.85, 0.64],  # starts   (x^3)
    [0.22, 0.58, 0.33],  # with     (x^4)
    [0.77, 0.25, 0.10],  # one      (x^5)
    [0.05, 0.80, 0.55],  # step     (x^6)
])
BATCH = torch.stack((INPUTS, INPUTS))  # (2, 6, 3), as in section 3.5.3


def assert_book(actual, expected):
    """``actual`` equals the book's value as printed to 4 decimals (half a unit in the last
    printed place, plus float32 slack for values that sit on a rounding boundary)."""
    expected = torch.as_tensor(expected, dtype=torch.float64)
    actual = actual.detach().double()
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item()
    assert err <= 0.5e-4 + 1e-6, f"differs from the book by {err:.2e}:\n{actual}\nvs\n{expected}"


# ----------------------------------------------------------------------------------------------
# Chapter 3: the book's printed numbers
# ----------------------------------------------------------------------------------------------

def test_section_3_3_simplified_self_attention():
    query = INPUTS[1]  # "journey"
    attn_scores_2 = torch.stack([torch.dot(x_i, query) for x_i in INPUTS])
    assert_book(attn_scores_2, [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])

    attn_weights_2 = torch.softmax(attn_scores_2, dim=0)
    assert_book(attn_weights_2, [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])
    assert_book(attn_weights_2.sum(), 1.0)

    context_vec_2 = attn_weights_2 @ INPUTS
    assert_book(context_vec_2, [0.4419, 0.6515, 0.5683])

    all_context_vecs = torch.softmax(INPUTS @ INPUTS.T, dim=-1) @ INPUTS
    assert_book(all_context_vecs, [[0.4421, 0.5931, 0.5790],
                                   [0.4419, 0.6515, 0.5683],
                                   [0.4431, 0.6496, 0.5671],
                                   [0.4304, 0.6298, 0.5510],
                                   [0.4671, 0.5910, 0.5266],
                                   [0.4177, 0.6503, 0.5645]])


def test_section_3_4_1_trainable_weights_step_by_step():
    x_2 = INPUTS[1]
    torch.manual_seed(123)
    W_query = torch.nn.Parameter(torch.rand(3, 2), requires_grad=False)
    W_key = torch.nn.Parameter(torch.rand(3, 2), requires_grad=False)
    W_value = torch.nn.Parameter(torch.rand(3, 2), requires_grad=False)

    query_2 = x_2 @ W_query
    assert_book(query_2, [0.4306, 1.4551])
    keys = INPUTS @ W_key
    values = INPUTS @ W_value
    assert_book(query_2.dot(keys[1]), 1.8524)
    attn_scores_2 = query_2 @ keys.T
    assert_book(attn_scores_2, [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440])
    attn_weights_2 = torch.softmax(attn_scores_2 / keys.shape[-1] ** 0.5, dim=-1)
    assert_book(attn_weights_2, [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820])
    assert_book(attn_weights_2 @ values, [0.3061, 0.8210])


def test_self_attention_v1():
    torch.manual_seed(123)
    sa_v1 = SelfAttention_v1(3, 2)
    assert_book(sa_v1(INPUTS), [[0.2996, 0.8053],
                                [0.3061, 0.8210],
                                [0.3058, 0.8203],
                                [0.2948, 0.7939],
                                [0.2927, 0.7891],
                                [0.2990, 0.8040]])


def test_self_attention_v2():
    torch.manual_seed(789)
    sa_v2 = SelfAttention_v2(3, 2)
    assert_book(sa_v2(INPUTS), [[-0.0739, 0.0713],
                                [-0.0748, 0.0703],
                                [-0.0749, 0.0702],
                                [-0.0760, 0.0685],
                                [-0.0763, 0.0679],
                                [-0.0754, 0.0693]])
    torch.manual_seed(123)
    assert_book(SelfAttention_v2(3, 2)(INPUTS)[0], [-0.5337, -0.1051])


def test_section_3_5_1_causal_mask_weights():
    torch.manual_seed(789)
    sa_v2 = SelfAttention_v2(3, 2)
    queries = sa_v2.W_query(INPUTS)
    keys = sa_v2.W_key(INPUTS)
    attn_weights = torch.softmax(queries @ keys.T / keys.shape[-1] ** 0.5, dim=-1)
    assert_book(attn_weights, [[0.1921, 0.1646, 0.1652, 0.1550, 0.1721, 0.1510],
                               [0.2041, 0.1659, 0.1662, 0.1496, 0.1665, 0.1477],
                               [0.2036, 0.1659, 0.1662, 0.1498, 0.1664, 0.1480],
                               [0.1869, 0.1667, 0.1668, 0.1571, 0.1661, 0.1564],
                               [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0.1585],
                               [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529]])
    expected = [[1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
                [0.5517, 0.4483, 0.0000, 0.0000, 0.0000, 0.0000],
                [0.3800, 0.3097, 0.3103, 0.0000, 0.0000, 0.0000],
                [0.2758, 0.2460, 0.2462, 0.2319, 0.0000, 0.0000],
                [0.2175, 0.1983, 0.1984, 0.1888, 0.1971, 0.0000],
                [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529]]

    # First way: zero the future, then renormalise the rows.
    masked_simple = attn_weights * torch.tril(torch.ones(6, 6))
    assert_book(masked_simple / masked_simple.sum(dim=-1, keepdim=True), expected)

    # Second way (the one the modules use): -inf above the diagonal before the softmax.
    attn_scores = queries @ keys.T
    masked = attn_scores.masked_fill(torch.triu(torch.ones(6, 6), diagonal=1).bool(), -torch.inf)
    assert_book(torch.softmax(masked / keys.shape[-1] ** 0.5, dim=1), expected)


CAUSAL_TABLE = [[-0.4519, 0.2216],
                [-0.5874, 0.0058],
                [-0.6300, -0.0632],
                [-0.5675, -0.0843],
                [-0.5526, -0.0981],
                [-0.5299, -0.1081]]


def test_causal_attention():
    torch.manual_seed(123)
    ca = CausalAttention(3, 2, BATCH.shape[1], 0.0)
    context_vecs = ca(BATCH)
    assert context_vecs.shape == (2, 6, 2)
    assert_book(context_vecs, [CAUSAL_TABLE, CAUSAL_TABLE])


def test_causal_attention_shorter_sequence_than_context():
    # The mask buffer is sliced to num_tokens: a 4-token input through a 6-token module sees
    # exactly what the first 4 rows of the 6-token run saw.
    torch.manual_seed(123)
    ca = CausalAttention(3, 2, 6, 0.0)
    assert_book(ca(BATCH[:, :4]), [CAUSAL_TABLE[:4], CAUSAL_TABLE[:4]])


def test_multi_head_attention_wrapper():
    torch.manual_seed(123)
    mha = MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    context_vecs = mha(BATCH)
    assert context_vecs.shape == (2, 6, 4)
    table = [[-0.4519, 0.2216, 0.4772, 0.1063],
             [-0.5874, 0.0058, 0.5891, 0.3257],
             [-0.6300, -0.0632, 0.6202, 0.3860],
             [-0.5675, -0.0843, 0.5478, 0.3589],
             [-0.5526, -0.0981, 0.5321, 0.3428],
             [-0.5299, -0.1081, 0.5077, 0.3493]]
    assert_book(context_vecs, [table, table])


def test_multi_head_attention():
    torch.manual_seed(123)
    mha = MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    assert (mha.d_out, mha.num_heads, mha.head_dim) == (2, 2, 1)
    context_vecs = mha(BATCH)
    assert context_vecs.shape == (2, 6, 2)
    table = [[0.3190, 0.4858],
             [0.2943, 0.3897],
             [0.2856, 0.3593],
             [0.2693, 0.3873],
             [0.2639, 0.3928],
             [0.2575, 0.4028]]
    assert_book(context_vecs, [table, table])


def test_multi_head_attention_rejects_indivisible_d_out():
    with pytest.raises(AssertionError, match="divisible"):
        MultiHeadAttention(3, 5, 6, 0.0, num_heads=2)


# ----------------------------------------------------------------------------------------------
# Chapter 4: GPT model
# ----------------------------------------------------------------------------------------------

def test_gpt_124m_parameter_count():
    with torch.device("meta"):  # shapes only: no 650 MB of weights, no init time
        model = GPTModel(GPT_CONFIG_124M)
        block = TransformerBlock(GPT_CONFIG_124M)
    total = sum(p.numel() for p in model.parameters())
    assert total == 163_009_536
    # The book's follow-ups: without the untied output head it is GPT-2's 124M ...
    assert total - model.out_head.weight.numel() == 124_412_160
    # ... and exercise 4.1's split of one block.
    assert sum(p.numel() for p in block.ff.parameters()) == 4_722_432
    assert sum(p.numel() for p in block.att.parameters()) == 2_360_064


def test_layer_norm_book_example_and_torch():
    torch.manual_seed(123)
    batch_example = torch.randn(2, 5)
    out_ln = LayerNorm(emb_dim=5)(batch_example)
    assert_book(out_ln.mean(dim=-1), [0.0, 0.0])
    assert_book(out_ln.var(dim=-1, unbiased=False), [1.0, 1.0])

    x = randn(3, 7, 16)
    ln = LayerNorm(16).to(DEVICE)
    assert_parity(ln(x), LayerNorm(16).to(DEVICE, torch.float64)(x.double()),
                  F.layer_norm(x, (16,), eps=1e-5), name="LayerNorm")


def test_gelu_is_the_tanh_approximation():
    x = torch.linspace(-3, 3, 101)
    assert_parity(GELU()(x), GELU()(x.double()), F.gelu(x, approximate="tanh"), name="GELU")


def test_generate_text_simple_book_output():
    # Section 4.7: "Hello, I am" (GPT-2 token ids 15496, 11, 314, 716) through the untrained
    # 124M model built under seed 123, 6 greedy tokens. ~3 s, mostly weight init.
    torch.manual_seed(123)
    model = GPTModel(GPT_CONFIG_124M)
    model.eval()  # disable dropout
    encoded = torch.tensor([[15496, 11, 314, 716]])
    out = generate_text_simple(model, encoded, max_new_tokens=6,
                               context_size=GPT_CONFIG_124M["context_length"])
    assert out.tolist() == [[15496, 11, 314, 716, 27018, 24086, 47843, 30961, 42348, 7267]]


# ----------------------------------------------------------------------------------------------
# reference.attention: the functional oracle
# ----------------------------------------------------------------------------------------------

def test_causal_mask_is_bottom_right():
    assert causal_mask(2, 5).tolist() == [[True, True, True, True, False],
                                          [True, True, True, True, True]]
    assert causal_mask(5, 2).tolist() == [[False, False],
                                          [False, False],
                                          [False, False],
                                          [True, False],
                                          [True, True]]
    assert torch.equal(causal_mask(4, 4), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_sdpa_causal(dtype):
    q, k, v = (randn(2, 3, 33, 16, dtype=dtype) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_parity(out, attention(q, k, v), attention(q, k, v, upcast=False))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_sdpa_noncausal_different_lengths(dtype):
    q = randn(2, 3, 9, 24, dtype=dtype)
    k, v = randn(2, 3, 21, 24, dtype=dtype), randn(2, 3, 21, 24, dtype=dtype)
    out = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    kwargs = dict(causal=False, softmax_scale=0.3)
    assert_parity(out, attention(q, k, v, **kwargs), attention(q, k, v, upcast=False, **kwargs))


def test_bottom_right_causal_matches_sdpa_with_explicit_mask():
    # SDPA's is_causal is top-left when q_len != k_len; hand it our mask instead.
    q = randn(2, 2, 7, 16)
    k, v = randn(2, 2, 19, 16), randn(2, 2, 19, 16)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(7, 19, device=DEVICE))
    assert_parity(out, attention(q, k, v), attention(q, k, v, upcast=False))


def test_matches_book_multi_head_attention():
    mha = MultiHeadAttention(d_in=8, d_out=12, context_length=10, dropout=0.0,
                             num_heads=3).to(DEVICE)
    x = randn(2, 7, 8)
    b, n, _ = x.shape

    def heads(t):  # (b, n, d_out) -> (b, h, n, head_dim), the module's own split
        return t.view(b, n, mha.num_heads, mha.head_dim).transpose(1, 2)

    q, k, v = heads(mha.W_query(x)), heads(mha.W_key(x)), heads(mha.W_value(x))

    def finish(ctx):  # merge heads and apply out_proj in ctx's dtype
        ctx = ctx.transpose(1, 2).reshape(b, n, mha.d_out)
        return F.linear(ctx, mha.out_proj.weight.to(ctx.dtype), mha.out_proj.bias.to(ctx.dtype))

    with torch.no_grad():
        assert_parity(mha(x), finish(attention(q, k, v)), finish(attention(q, k, v, upcast=False)))


def test_rows_without_visible_keys_are_zero():
    q = randn(1, 2, 6, 8, requires_grad=True)
    k = randn(1, 2, 3, 8, requires_grad=True)
    v = randn(1, 2, 3, 8, requires_grad=True)
    for upcast in (True, False):
        out = attention(q, k, v, upcast=upcast)
        assert not torch.isnan(out).any()
        # q_len 6, k_len 3: rows 0..2 see nothing, row 3 sees key 0, ..., row 5 sees all keys.
        assert torch.all(out[:, :, :3] == 0)
        assert torch.all(out[:, :, 3:].abs().sum(-1) > 0)
        out.sum().backward()
        for t in (q, k, v):
            assert not torch.isnan(t.grad).any()
        assert torch.all(q.grad[:, :, :3] == 0)
        q.grad = k.grad = v.grad = None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_upcast_controls_the_output_dtype(dtype):
    q, k, v = (randn(1, 2, 5, 8, dtype=dtype) for _ in range(3))
    assert attention(q, k, v).dtype == torch.float64
    assert attention(q, k, v, upcast=False).dtype == dtype


def test_keep_mask_scales_kept_weights():
    q, k, v = randn(2, 2, 6, 8), randn(2, 2, 10, 8), randn(2, 2, 10, 8)
    keep = torch.rand(2, 2, 6, 10, device=DEVICE) > 0.3
    p = 0.3
    qd, kd, vd = q.double(), k.double(), v.double()
    scores = (qd @ kd.transpose(-2, -1)) / math.sqrt(8)
    scores = scores.masked_fill(~causal_mask(6, 10, device=DEVICE), float("-inf"))
    expected = (torch.softmax(scores, dim=-1) * keep / (1 - p)) @ vd
    out = attention(q, k, v, dropout_p=p, keep_mask=keep)
    assert_parity(out, expected, attention(q, k, v, dropout_p=p, keep_mask=keep, upcast=False))
    # An all-True mask is the no-dropout result scaled by 1 / (1 - p).
    all_kept = attention(q, k, v, dropout_p=p,
                         keep_mask=torch.ones(6, 10, dtype=torch.bool, device=DEVICE))
    assert_parity(all_kept * (1 - p), attention(q, k, v), attention(q, k, v, upcast=False))


def test_random_dropout_is_torch_dropout():
    q, k, v = (randn(2, 2, 8, 8) for _ in range(3))
    torch.manual_seed(7)
    out = attention(q, k, v, dropout_p=0.4)
    # F.dropout on a same-shaped float64 tensor draws the same Bernoulli numbers.
    torch.manual_seed(7)
    keep = F.dropout(torch.ones(2, 2, 8, 8, dtype=torch.float64, device=DEVICE), p=0.4) != 0
    assert torch.equal(out, attention(q, k, v, dropout_p=0.4, keep_mask=keep))
    assert not torch.equal(out, attention(q, k, v))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gradients_float64(causal):
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 7, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 7, 3, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(1, 2, 5, 7) > 0.2
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, causal=causal, dropout_p=0.2, keep_mask=keep),
        (q, k, v))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients_low_precision(dtype):
    q, k, v = (randn(1, 2, 9, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, upcast=False)
    out.backward(torch.ones_like(out))
    for t in (q, k, v):
        assert t.grad is not None and t.grad.dtype == dtype
        assert torch.isfinite(t.grad).all()


def test_argument_errors_say_what_is_wrong():
    q = randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="4-D"):
        attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="head_dim"):
        attention(q, randn(1, 2, 4, 6), randn(1, 2, 4, 6))
    with pytest.raises(ValueError, match="dropout_p"):
        attention(q, q, q, dropout_p=1.0)
