"""Llama 3 twins: grouped-query attention with RoPE, plain, SDPA-style and with a KV cache.

* :class:`FusedLlama3GroupedQueryAttention` <- ``llms_from_scratch.llama3.GroupedQueryAttention``
* :class:`FusedLlama3GroupedQueryAttentionFast` <- ``GroupedQueryAttentionFast`` of
  ``llms_from_scratch.llama3`` and ``llms_from_scratch.kv_cache.llama3`` (the same class twice)
* :class:`FusedLlama3GroupedQueryAttentionKV` <-
  ``llms_from_scratch.kv_cache.llama3.GroupedQueryAttention``

Constructor ``(d_in, d_out, num_heads, num_kv_groups, dtype=None)``, children ``W_key``,
``W_value``, ``W_query``, ``out_proj`` (created and registered in the package's order: the same
seed gives the same weights and the same state_dict), attributes ``d_out``, ``num_heads``,
``head_dim``, ``num_kv_groups``, ``group_size``. The kv heads are read in place by the kernel
(query head h reads kv head h // group_size, the package's ``repeat_interleave`` rule).
"""
import torch
import torch.nn as nn

from ..model_checks import check_head_split
from .base import GQATwin, check_mask


class _Llama3Init(GQATwin):
    def __init__(self, d_in, d_out, num_heads, num_kv_groups, dtype=None):
        super().__init__()
        self._set_heads(num_heads, num_kv_groups, check_head_split(d_out, num_heads))
        self.d_out = d_out
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_query = nn.Linear(d_in, d_out, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(d_out, d_out, bias=False, dtype=dtype)


class FusedLlama3GroupedQueryAttention(_Llama3Init):
    """``forward(x, mask, cos, sin) -> context``: RoPE from position 0; ``mask[:n, :n]`` must be
    the causal mask (True above the diagonal), else ValueError."""

    book_classes = ("llms_from_scratch.llama3.GroupedQueryAttention",)

    def forward(self, x, mask, cos, sin):
        b, n, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"{self._mask_name()}: expected the mask as a bool tensor, got "
                             f"{type(mask).__name__}")
        # The package reads mask[:num_tokens, :num_tokens] (a larger causal mask works too).
        check_mask(mask[:n, :n], b, self.num_heads, n, n, who=self._mask_name())
        return self._attend(q, k, v)


class FusedLlama3GroupedQueryAttentionFast(_Llama3Init):
    """``forward(x, cos, sin) -> context``: causal (the package's SDPA ``is_causal=True``)."""

    book_classes = ("llms_from_scratch.llama3.GroupedQueryAttentionFast",
                    "llms_from_scratch.kv_cache.llama3.GroupedQueryAttentionFast")

    def forward(self, x, cos, sin):
        q, k, v = self._qkv(x, cos, sin)
        return self._attend(q, k, v)


class FusedLlama3GroupedQueryAttentionKV(_Llama3Init):
    """``forward(x, mask, cos, sin, start_pos=0, cache=None) -> (context, (keys, values))``.

    RoPE at positions ``start_pos ..``; the new keys (after RoPE) and values,
    (b, num_kv_groups, n, hd), are appended to ``cache = (keys, values)`` when one is given,
    and the full keys/values are returned as the next cache (the package's contract). ``mask``
    must be the causal mask aligned bottom-right over the cached + new keys (the package's
    ``triu(ones(end, end), 1)[start:end, :end]``), else ValueError.
    """

    book_classes = ("llms_from_scratch.kv_cache.llama3.GroupedQueryAttention",)

    def forward(self, x, mask, cos, sin, start_pos=0, cache=None):
        return self._forward_cached(x, mask, cos, sin, start_pos, cache)
