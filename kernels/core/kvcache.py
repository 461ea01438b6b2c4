"""Decoding against a preallocated KV cache: the in-place append kernel and the launcher.

The attention itself is the forward kernel (kernels/core/forward.py) with per-row key lengths
(SEQUSED_K), split-KV for long caches (kernels/core/splitkv.py) and packed GQA heads; only the
append is new work: new keys/values are written into each row's cache at its own offset.
"""
import torch
import triton
import triton.language as tl

from .common import block_d
from .forward import attention_forward

_APPEND_BLOCK_M = 16


@triton.jit
def _append_kv(K_CACHE, V_CACHE, K, V, SEQLENS,
               stride_cb, stride_ch, stride_cn,
               stride_vcb, stride_vch, stride_vcn,
               stride_kb, stride_kh, stride_kn,
               stride_vb, stride_vh, stride_vn,
               n_new, max_len,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """K_CACHE[b, h, SEQLENS[b] + i] = K[b, h, i] (and V) for i < n_new.

    Caches (B, H_kv, max_len, HEAD_DIM), K/V (B, H_kv, n_new, HEAD_DIM), unit last stride.
    Positions >= max_len are never written (the caller's contract says they do not occur; the
    guard keeps a broken contract from writing out of bounds). Grid: (cdiv(n_new, BLOCK_M),
    H_kv, B).
    """
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos = tl.load(SEQLENS + b) + offs_i
    mask = ((offs_i < n_new) & (pos >= 0) & (pos < max_len))[:, None] \
        & (offs_d < HEAD_DIM)[None, :]
    src = offs_i.to(tl.int64)[:, None]
    dst = pos.to(tl.int64)[:, None]
    k = tl.load(K + b * stride_kb + h * stride_kh + src * stride_kn + offs_d[None, :], mask=mask)
    v = tl.load(V + b * stride_vb + h * stride_vh + src * stride_vn + offs_d[None, :], mask=mask)
    tl.store(K_CACHE + b * stride_cb + h * stride_ch + dst * stride_cn + offs_d[None, :], k,
             mask=mask)
    tl.store(V_CACHE + b * stride_vcb + h * stride_vch + dst * stride_vcn + offs_d[None, :], v,
             mask=mask)


def append_kv(k_cache, v_cache, cache_seqlens, k, v):
    """Write k, v (B, H_kv, n_new, D) into the caches (B, H_kv, max_len, D) at positions
    cache_seqlens[b] ... cache_seqlens[b] + n_new - 1 of each row b, in place."""
    B, H, n_new, D = k.shape
    if k.numel() == 0:
        return
    _append_kv[(triton.cdiv(n_new, _APPEND_BLOCK_M), H, B)](
        k_cache, v_cache, k, v, cache_seqlens,
        *k_cache.stride()[:3], *v_cache.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        n_new, k_cache.shape[2],
        HEAD_DIM=D, BLOCK_M=_APPEND_BLOCK_M, BLOCK_D=block_d(D))


def kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, *, causal, softmax_scale, window,
                    num_splits):
    """Append (k, v) if given, then attend: (out (B, H_q, q_len, D), lse (B, H_q, q_len)).

    Row b sees its first n_b = cache_seqlens[b] (+ q_len with k, v) cache positions, bottom-right
    causal over them. Inputs validated by the caller; unit last strides.
    """
    if k is not None:
        append_kv(k_cache, v_cache, cache_seqlens, k, v)
        k_lens = (cache_seqlens + q.shape[2]).to(torch.int32)
    else:
        k_lens = cache_seqlens
    return attention_forward(q, k_cache, v_cache, causal=causal, softmax_scale=softmax_scale,
                             dropout_p=0.0, seed=0, window=window, k_lens=k_lens,
                             num_splits=num_splits)
