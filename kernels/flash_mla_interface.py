"""FlashMLA's decoding API (deepseek-ai/FlashMLA, ``flash_mla/flash_mla_interface.py``, the
2026 interface) on our kernels: ``from kernels.flash_mla_interface import get_mla_metadata,
flash_mla_with_kvcache`` is the one change a FlashMLA user makes for DeepSeek's absorbed MLA
decode (docs/features.md, "MLA").

Built only on the public ``kernels.attention_with_kvcache``:

* ``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
  tile_scheduler_metadata, num_splits=None, softmax_scale=None, causal=False,
  is_fp8_kvcache=False, indices=None, attn_sink=None, extra_k_cache=None,
  extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None)`` -> ``(out,
  softmax_lse)``: q (batch, seq_len_q, heads_q, head_dim), k_cache (num_blocks,
  page_block_size, heads_k, head_dim) (DeepSeek V2 / V3: head_dim 576 = 512 latent + 64 rope,
  heads_k 1), block_table int32 (batch, max_blocks), cache_seqlens int32 (batch,) (the keys
  each row attends to, the current tokens' included: FlashMLA appends nothing), head_dim_v
  (512): the values are k_cache's first head_dim_v columns, read in place as
  ``k_cache[..., :head_dim_v]`` (never copied). Returns out (batch, seq_len_q, heads_q,
  head_dim_v) in q's dtype and softmax_lse float32 (batch, heads_q, seq_len_q), natural log.
  ``causal`` is bottom-right (query i sees keys j <= i + cache_seqlens - seq_len_q), as
  FlashMLA's; the default scale is ``1 / sqrt(head_dim)`` as there (DeepSeek passes its own,
  ``1 / sqrt(192)`` times its YaRN factor).
* ``get_mla_metadata(*args, **kwargs)`` -> ``(FlashMLASchedMeta(), None)``, as FlashMLA's
  current one: the schedule is our kernels' own business, so the object only records the
  first call's configuration, and a later call with the same object but another batch,
  seq_len_q, heads, page size, causal or FP8 flag raises, as FlashMLA's does (it would reuse a
  wrong schedule there). The pre-2026 API's tensors (``tile_scheduler_metadata``,
  ``num_splits`` as returned by its ``get_mla_metadata(cache_seqlens, ...)``) are accepted in
  their places and ignored.

Where we differ from FlashMLA (docs/features.md lists it too):

* Wider support: any page_block_size (FlashMLA: 64), heads_k dividing heads_q, fp32 as well as
  fp16 / bf16, any GPU Triton runs on and the CPU; head_dim up to 576 and any head_dim_v up to
  head_dim (FlashMLA: 576 or 512, and 512).
* A row that sees no key (cache_seqlens 0, or causal queries before the first key) gives out 0
  and lse -inf (FlashMLA writes +inf).
* Not supported (``NotImplementedError``, a RuntimeError): sparse attention (``indices``,
  ``topk_length``, ``extra_k_cache``, ``extra_indices_in_kvcache``, ``extra_topk_length``,
  ``attn_sink``: FlashMLA's DeepSeek V3.2 mode) and ``is_fp8_kvcache=True``: FlashMLA's FP8
  cache is its packed 656-byte-per-token layout (512 e4m3 values, four float32 scales, one per
  128 columns, then 64 bf16 rope values), which our kernels cannot read; they read an e4m3
  latent cache with one per-tensor scale through ``kernels.attention_with_kvcache(q,
  k_cache, k_cache[..., :512], lens, k_scale=s)``.

Errors: as ``kernels.flash_attn_interface`` (FlashAttention's convention, which FlashMLA's
TORCH_CHECKs share): ``RuntimeError`` for every bad argument, this module's checks (named in
FlashMLA's layout) and the native ones underneath (same message), ``NotImplementedError`` for
what is valid there but not supported here. FlashMLA's own Python checks are asserts
(``AssertionError``); ours are RuntimeErrors with a message.
"""
import dataclasses
from typing import Optional

import torch

from .flash_attn_interface import _flash_attn_errors
from .ops import attention_with_kvcache

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache"]

_attention_with_kvcache = _flash_attn_errors(attention_with_kvcache)
_LAYOUT = "(num_blocks, page_block_size, num_heads_k, head_dim)"
# FlashMLA's sparse-attention (DeepSeek V3.2) arguments.
_SPARSE = ("indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length",
           "extra_topk_length")


@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's scheduling metadata object (same fields). Ours holds the first call's
    configuration only: ``tile_scheduler_metadata`` and ``num_splits`` stay None (our kernels
    plan their own split-KV)."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int

        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]

        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None


def get_mla_metadata(*args, **kwargs):
    """FlashMLA's ``get_mla_metadata``: takes any arguments (the old interface's
    ``cache_seqlens, num_q_tokens_per_head_k, num_heads_k, ...`` included) and returns
    ``(FlashMLASchedMeta(), None)``; only the first element is used."""
    return FlashMLASchedMeta(), None


def _check_sched_meta(meta, config):
    """Record ``config`` on first use of ``meta``; afterwards it must not change."""
    if not meta.have_initialized:
        meta.have_initialized, meta.config = True, config
        return
    for field in dataclasses.fields(config):
        was, now = getattr(meta.config, field.name), getattr(config, field.name)
        if was != now:
            raise RuntimeError(f"tile_scheduler_metadata was first used with {field.name}="
                               f"{was!r}, this call has {field.name}={now!r}: one "
                               f"FlashMLASchedMeta serves calls of one configuration (batch, "
                               f"seq_len_q, heads, page size, causal, FP8); get a new one from "
                               f"get_mla_metadata() for another")


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                           tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                           causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                           extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None):
    """FlashMLA's dense MLA decode (module docstring): attention of q over the paged latent
    cache, values ``k_cache[..., :head_dim_v]``. Returns ``(out (batch, seq_len_q, heads_q,
    head_dim_v), softmax_lse float32 (batch, heads_q, seq_len_q))``."""
    sparse = dict(zip(_SPARSE, (indices, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                                topk_length, extra_topk_length)))
    given = [name for name, value in sparse.items() if value is not None]
    if given:
        raise NotImplementedError(f"FlashMLA's sparse attention ({', '.join(given)}) is not "
                                  f"supported by kernels.flash_mla_interface: dense decoding "
                                  f"only (block_table and cache_seqlens)")
    meta = tile_scheduler_metadata
    if not isinstance(meta, (FlashMLASchedMeta, torch.Tensor, type(None))):
        raise RuntimeError(f"tile_scheduler_metadata must be the FlashMLASchedMeta of "
                           f"get_mla_metadata() (or the old interface's tensor), got "
                           f"{type(meta).__name__}")
    if not isinstance(num_splits, (torch.Tensor, type(None))):
        raise RuntimeError(f"num_splits must be None (or the old interface's tensor from "
                           f"get_mla_metadata), got {type(num_splits).__name__}")
    if is_fp8_kvcache:
        raise NotImplementedError(
            "is_fp8_kvcache=True: FlashMLA's FP8 cache (656 bytes per token: 512 e4m3 values, "
            "4 float32 scales per 128 columns, 64 bf16 rope values) is not supported; an e4m3 "
            "latent cache with one per-tensor scale is: kernels.attention_with_kvcache(q, "
            "k_cache, k_cache[..., :512], cache_seqlens, block_table=..., k_scale=scale)")
    for name, t in (("q", q), ("k_cache", k_cache)):
        if not isinstance(t, torch.Tensor):
            raise RuntimeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k_cache.dim() != 4:
        raise RuntimeError(f"q must be 4-D (batch, seq_len_q, num_heads_q, head_dim) and "
                           f"k_cache 4-D {_LAYOUT}, got q {tuple(q.shape)}, k_cache "
                           f"{tuple(k_cache.shape)}")
    if block_table is None or cache_seqlens is None:
        raise RuntimeError("block_table and cache_seqlens must be provided (dense decoding)")
    if k_cache.dtype != q.dtype:
        fp8 = " (FlashMLA's FP8 cache is not supported: see is_fp8_kvcache)" \
            if k_cache.element_size() == 1 else ""
        raise RuntimeError(f"q and k_cache must have the same dtype, got {q.dtype} and "
                           f"{k_cache.dtype}{fp8}")
    head_dim = q.shape[-1]
    if k_cache.shape[-1] != head_dim:
        raise RuntimeError(f"q and k_cache must have the same head_dim (last dim), got q "
                           f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if (isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int)
            or not 1 <= head_dim_v <= head_dim):
        raise RuntimeError(f"head_dim_v must be an int in [1, head_dim = {head_dim}] (the values "
                           f"are k_cache's first head_dim_v columns; DeepSeek: 512), got "
                           f"{head_dim_v!r}")
    heads_q, heads_k = q.shape[2], k_cache.shape[2]
    if heads_k == 0 or heads_q % heads_k:
        raise RuntimeError(f"num_heads_q must be a multiple of num_heads_k, got q "
                           f"{tuple(q.shape)} (batch, seq_len_q, num_heads_q, head_dim) and "
                           f"k_cache {tuple(k_cache.shape)} {_LAYOUT}")
    if isinstance(meta, FlashMLASchedMeta):
        _check_sched_meta(meta, FlashMLASchedMeta.Config(
            q.shape[0], q.shape[1], heads_q, k_cache.shape[1], heads_k, bool(causal),
            bool(is_fp8_kvcache), None, None, None))
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    out, lse = _attention_with_kvcache(q.transpose(1, 2), k_cache, k_cache[..., :head_dim_v],
                                       cache_seqlens, causal=bool(causal),
                                       softmax_scale=softmax_scale, block_table=block_table,
                                       return_lse=True)
    # Ours keeps q's memory layout: FlashMLA's usual contiguous q gives a contiguous out
    # (batch, seq_len_q, heads_q, head_dim_v) as it is; another q's gets one copy, as FlashMLA
    # always returns a contiguous out.
    return out.transpose(1, 2).contiguous(), lse
