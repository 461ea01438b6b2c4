"""Pure-PyTorch reference oracles for the fused causal-attention kernel.

* ``modules``: the attention classes of "Build a Large Language Model (From Scratch)", ch. 3.
* ``gpt``: the book's GPT-2 (124M) model, ch. 4.
* ``functional``: ``attention`` (float64 oracle / low-precision baseline; grouped-query heads,
  a value head_dim of its own, sliding window, chunked attention, softcap, ALiBi, PyTorch
  score_mod / mask_mod callables, attention sinks, optional lse), ``attention_varlen``
  (FlashAttention's packed variable-length layout), ``attention_with_kvcache`` (a KV cache, row
  by row), ``causal_mask`` (bottom-right, optional window or chunks) and ``flash_attn_mask``
  (FlashAttention's two-sided windows and FA3's chunks, as a mask_mod).
* ``dropout``: the kernel's Philox dropout mask, bit for bit (``dropout_keep_mask`` dense,
  ``dropout_keep_mask_varlen`` packed, ``dropout_keep_rows`` selected rows).
* ``mla``: DeepSeek's multi-head latent attention, non-absorbed (``mla_attention``, the
  oracle of the absorbed latent-cache calls) and the absorbed form's helpers (``latent_rows``,
  ``absorb_query``, ``expand_output``, ``split_kv_b_proj``).

Nothing here imports ``kernels``: the reference must not share the code it checks.
"""
from .dropout import dropout_keep_mask, dropout_keep_mask_varlen, dropout_keep_rows, philox4x32
from .functional import (
    attention,
    attention_varlen,
    attention_with_kvcache,
    causal_mask,
    flash_attn_mask,
)
from .gpt import (
    GELU,
    GPT_CONFIG_124M,
    FeedForward,
    GPTModel,
    LayerNorm,
    TransformerBlock,
    generate_text_simple,
)
from .mla import absorb_query, expand_output, latent_rows, mla_attention, split_kv_b_proj
from .modules import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)

__all__ = [
    "SelfAttention_v1",
    "SelfAttention_v2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
    "GPT_CONFIG_124M",
    "LayerNorm",
    "GELU",
    "FeedForward",
    "TransformerBlock",
    "GPTModel",
    "generate_text_simple",
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "causal_mask",
    "flash_attn_mask",
    "dropout_keep_mask",
    "dropout_keep_mask_varlen",
    "dropout_keep_rows",
    "philox4x32",
    "mla_attention",
    "latent_rows",
    "absorb_query",
    "expand_output",
    "split_kv_b_proj",
]
