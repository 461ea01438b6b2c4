"""Qwen 3 twins: grouped-query attention with optional QK RMSNorm and RoPE, plain, with a KV
cache and with per-row (batched) KV caches.

* :class:`FusedQwen3GroupedQueryAttention` <- ``llms_from_scratch.qwen3.GroupedQueryAttention``
* :class:`FusedQwen3GroupedQueryAttentionKV` <-
  ``llms_from_scratch.kv_cache.qwen3.GroupedQueryAttention``
* :class:`FusedQwen3GroupedQueryAttentionBatchedKV` <-
  ``llms_from_scratch.kv_cache_batched.qwen3.GroupedQueryAttention``

Constructor ``(d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False, dtype=None)``,
children ``W_query``, ``W_key``, ``W_value``, ``out_proj`` and, with ``qk_norm``, ``q_norm`` /
``k_norm`` (:class:`RMSNorm`, the package's parameters ``scale`` / ``shift``), created in the
package's order (same seed, same weights, same state_dict). ``out_proj`` maps
``num_heads * head_dim`` back to ``d_in``.
"""
import torch
import torch.nn as nn

from .. import ops as _ops
from ..model_checks import check_head_split
from .base import GQATwin, check_mask, rope_rows


class RMSNorm(nn.Module):
    """The package's Qwen 3 RMSNorm (same parameters ``scale``, ``shift``; same math): computed
    in float32 when ``qwen3_compatible``, returned in the input dtype."""

    def __init__(self, emb_dim, eps=1e-6, bias=False, qwen3_compatible=True):
        super().__init__()
        self.eps = eps
        self.qwen3_compatible = qwen3_compatible
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim)) if bias else None

    def forward(self, x):
        input_dtype = x.dtype
        if self.qwen3_compatible:
            x = x.to(torch.float32)
        norm_x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.scale
        if self.shift is not None:
            norm_x = norm_x + self.shift
        return norm_x.to(input_dtype)


class _Qwen3Init(GQATwin):
    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False,
                 dtype=None):
        super().__init__()
        if head_dim is None:
            head_dim = check_head_split(d_in, num_heads, name="d_in",
                                        when=" when head_dim is not set")
        self._set_heads(num_heads, num_kv_groups, head_dim)
        self.W_query = nn.Linear(d_in, self.d_out, bias=False, dtype=dtype)
        self.W_key = nn.Linear(d_in, num_kv_groups * head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * head_dim, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=False, dtype=dtype)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=1e-6)
            self.k_norm = RMSNorm(head_dim, eps=1e-6)
        else:
            self.q_norm = self.k_norm = None


class FusedQwen3GroupedQueryAttention(_Qwen3Init):
    """``forward(x, mask, cos, sin) -> context``: RoPE from position 0; ``mask`` must be the
    (n, n) causal mask (True above the diagonal, any broadcastable shape), else ValueError."""

    book_classes = ("llms_from_scratch.qwen3.GroupedQueryAttention",)

    def forward(self, x, mask, cos, sin):
        b, n, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        check_mask(mask, b, self.num_heads, n, n, who=self._mask_name())
        return self._attend(q, k, v)


class FusedQwen3GroupedQueryAttentionKV(_Qwen3Init):
    """``forward(x, mask, cos, sin, start_pos=0, cache=None) -> (context, (keys, values))``:
    as :class:`~kernels.book.llama3.FusedLlama3GroupedQueryAttentionKV`, with QK-norm before
    RoPE; the cached keys are normed and rotated."""

    book_classes = ("llms_from_scratch.kv_cache.qwen3.GroupedQueryAttention",)

    def forward(self, x, mask, cos, sin, start_pos=0, cache=None):
        return self._forward_cached(x, mask, cos, sin, start_pos, cache)


class FusedQwen3GroupedQueryAttentionBatchedKV(_Qwen3Init):
    """``forward(x, mask, cos, sin, start_pos=0, cache=None) -> (context, next_cache)`` with one
    cache per batch row, as ``kv_cache_batched.qwen3``.

    * ``start_pos``: (b,) int tensor, row r's RoPE starts at ``start_pos[r]`` (positions past
      the tables are clamped to the last one, as the package does); an int means every row.
    * ``cache``: a list of b entries, each None or ``(keys, values)`` of shape
      (1, num_kv_groups, L_r, hd); ``next_cache`` is that list with this step's keys/values
      appended. Keys are stored as the package stores them: after QK-norm and RoPE, in the
      dtype RoPE promotes to (float32 for a bfloat16 model with float32 tables).
    * ``mask``: broadcasts to (b, heads, n, K), K = max_r(L_r + n), and must be the causal
      mask aligned bottom-right over each row's L_r + n keys; else ValueError.

    Rows whose caches have equal lengths (everything the package's model and generate
    functions produce) run as one dense kernel call. Rows of different lengths (the package's
    ``torch.cat`` of the row caches fails there) run as one packed ``attention_varlen`` call:
    row r's keys are left-aligned in the mask, columns past L_r + n must be masked.
    """

    book_classes = ("llms_from_scratch.kv_cache_batched.qwen3.GroupedQueryAttention",)

    def forward(self, x, mask, cos, sin, start_pos=0, cache=None):
        b, n, _ = x.shape
        offsets = torch.as_tensor(start_pos, device=x.device).long().reshape(-1)
        if offsets.numel() == 1:
            offsets = offsets.expand(b)
        elif offsets.numel() != b:
            raise ValueError(f"start_pos: expected one position per batch row ({b}); got "
                             f"shape {tuple(offsets.shape)}")
        q, k, v = self._split(x)
        q, k = rope_rows(q, cos, sin, offsets), rope_rows(k, cos, sin, offsets)
        k, v = k.transpose(1, 2), v.transpose(1, 2)              # (b, Hkv, n, hd)
        next_cache = []
        for r in range(b):
            prev = cache[r] if cache else None
            k_r, v_r = k[r:r + 1], v[r:r + 1]
            if prev is not None:
                k_r = torch.cat([prev[0], k_r], dim=2)
                v_r = torch.cat([prev[1], v_r], dim=2)
            next_cache.append((k_r, v_r))
        k_lens = [k_r.shape[2] for k_r, _ in next_cache]
        dtype = q.dtype                              # the kernel's: RoPE's promoted dtype
        if len(set(k_lens)) == 1:
            check_mask(mask, b, self.num_heads, n, k_lens[0], who=self._mask_name())
            keys = torch.cat([k_r for k_r, _ in next_cache], dim=0) if b > 1 else next_cache[0][0]
            values = torch.cat([v_r for _, v_r in next_cache], dim=0) if b > 1 \
                else next_cache[0][1]
            o = _ops.attention(q.transpose(1, 2), keys.to(dtype), values.to(dtype), causal=True)
            o = o.transpose(1, 2).reshape(b, n, self.d_out)
        else:
            check_mask(mask, b, self.num_heads, n, k_lens, who=self._mask_name())
            o = self._ragged(q, next_cache, k_lens).view(b, n, self.d_out)
        return self.out_proj(o.to(v.dtype)), next_cache

    def _ragged(self, q, next_cache, k_lens):
        """Rows with different cache lengths as packed sequences: q (b, n, H, hd) ->
        (b * n, H, hd); row r's keys (1, Hkv, L_r, hd) -> rows of (sum L_r, Hkv, hd)."""
        b, n = q.shape[:2]
        dev = q.device
        keys = torch.cat([k_r[0].transpose(0, 1) for k_r, _ in next_cache]).to(q.dtype)
        values = torch.cat([v_r[0].transpose(0, 1) for _, v_r in next_cache]).to(q.dtype)
        cu_q = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0] + k_lens, dtype=torch.int64, device="cpu").cumsum(0).to(
            dev, torch.int32)
        return _ops.attention_varlen(q.reshape(b * n, self.num_heads, self.head_dim), keys,
                                     values, cu_q, cu_k, max_seqlen_q=n,
                                     max_seqlen_k=max(k_lens), causal=True)
