"""The attention modules of "Build a Large Language Model (From Scratch)" (S. Raschka), chapter 3.

They are kept faithful to the book: same constructor signatures, parameter names, parameter
creation order (so ``torch.manual_seed`` reproduces the book's printed numbers) and the same
math, including its quirks (scores are masked *before* scaling; ``keys.shape[-1] ** 0.5`` is the
scale). They serve as the readable, end-to-end oracle that the fused kernel must agree with.

Shapes: ``b`` batch, ``num_tokens`` sequence length, ``d_in`` input width, ``d_out`` output width.
"""
import torch
import torch.nn as nn


class SelfAttention_v1(nn.Module):
    """Self-attention with raw weight matrices (book section 3.4.2); no masking, no batch dim.

    ``forward(x)``: x (num_tokens, d_in) -> context vectors (num_tokens, d_out).
    """

    def __init__(self, d_in, d_out):
        super().__init__()
        # torch.rand (uniform [0, 1)), created query, key, value in this order as in the book.
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        """x (num_tokens, d_in) -> (num_tokens, d_out)."""
        keys = x @ self.W_key
        queries = x @ self.W_query
        values = x @ self.W_value
        attn_scores = queries @ keys.T  # omega
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context_vec = attn_weights @ values
        return context_vec


class SelfAttention_v2(nn.Module):
    """Self-attention with ``nn.Linear`` projections (book section 3.4.2); no mask, no batch dim.

    ``forward(x)``: x (num_tokens, d_in) -> context vectors (num_tokens, d_out).
    """

    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        """x (num_tokens, d_in) -> (num_tokens, d_out)."""
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.T
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context_vec = attn_weights @ values
        return context_vec


class CausalAttention(nn.Module):
    """Single-head causal self-attention with dropout on the weights (book section 3.5.3).

    ``forward(x)``: x (b, num_tokens, d_in) -> (b, num_tokens, d_out), num_tokens <= context_length.
    """

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        # 1 above the diagonal = future token (hidden). A buffer moves with .to(device).
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        """x (b, num_tokens, d_in) -> (b, num_tokens, d_out)."""
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)
        # In place, as in the book; slicing lets sequences shorter than context_length through.
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context_vec = attn_weights @ values
        return context_vec


class MultiHeadAttentionWrapper(nn.Module):
    """``num_heads`` independent ``CausalAttention`` heads, concatenated (book section 3.6.1).

    ``forward(x)``: x (b, num_tokens, d_in) -> (b, num_tokens, num_heads * d_out).
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
             for _ in range(num_heads)])

    def forward(self, x):
        """x (b, num_tokens, d_in) -> (b, num_tokens, num_heads * d_out)."""
        return torch.cat([head(x) for head in self.heads], dim=-1)


class MultiHeadAttention(nn.Module):
    """Multi-head causal self-attention with split heads and an output projection (book 3.6.2).

    ``forward(x)``: x (b, num_tokens, d_in) -> (b, num_tokens, d_out); each of the ``num_heads``
    heads works on ``head_dim = d_out // num_heads`` channels.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"

        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads  # reduce the projection dim to match the output dim

        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)  # combines the head outputs
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        """x (b, num_tokens, d_in) -> (b, num_tokens, d_out)."""
        b, num_tokens, d_in = x.shape

        keys = self.W_key(x)  # (b, num_tokens, d_out)
        queries = self.W_query(x)
        values = self.W_value(x)

        # Unroll the last dim into heads: (b, num_tokens, d_out) -> (b, num_tokens, h, head_dim)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim)

        # (b, num_tokens, h, head_dim) -> (b, h, num_tokens, head_dim)
        keys = keys.transpose(1, 2)
        queries = queries.transpose(1, 2)
        values = values.transpose(1, 2)

        attn_scores = queries @ keys.transpose(2, 3)  # (b, h, num_tokens, num_tokens)

        # Truncate the stored mask to the sequence length, then hide the future.
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)

        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        # (b, h, num_tokens, head_dim) -> (b, num_tokens, h, head_dim)
        context_vec = (attn_weights @ values).transpose(1, 2)

        # Merge the heads back: d_out = num_heads * head_dim
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        context_vec = self.out_proj(context_vec)
        return context_vec
