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
def _append_kv(K_CACHE, V_CACHE, K, V, SEQLENS, stride_kc, stride_vc, stride_k, stride_v,
               n_new, max_len,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """K_CACHE[b, h, SEQLENS[b] + i] = K[b, h, i] (and V) for i < n_new.

    K_CACHE (B, H_kv, max_len, HEAD_DIM), K (B, H_kv, n_new, HEAD_DIM); V_CACHE, V the same
    with HEAD_DIM_V; unit last stride;
    ``stride_x``: x's (batch, head, row) strides. Positions >= max_len are never written (the
    caller's contract says they do not occur; the guard keeps a broken contract from writing
    out of bounds). Grid: (cdiv(n_new, BLOCK_M), H_kv, B).
    """
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    pos = tl.load(SEQLENS + b) + offs_i
    row_ok = ((offs_i < n_new) & (pos >= 0) & (pos < max_len))[:, None]
    mask = row_ok & (offs_d < HEAD_DIM)[None, :]
    mask_v = row_ok & (offs_dv < HEAD_DIM_V)[None, :]
    src = offs_i.to(tl.int64)[:, None]
    dst = pos.to(tl.int64)[:, None]
    k = tl.load(K + b * stride_k[0] + h * stride_k[1] + src * stride_k[2] + offs_d[None, :],
                mask=mask)
    v = tl.load(V + b * stride_v[0] + h * stride_v[1] + src * stride_v[2] + offs_dv[None, :],
                mask=mask_v)
    tl.store(K_CACHE + b * stride_kc[0] + h * stride_kc[1] + dst * stride_kc[2]
             + offs_d[None, :], k, mask=mask)
    tl.store(V_CACHE + b * stride_vc[0] + h * stride_vc[1] + dst * stride_vc[2]
             + offs_dv[None, :], v, mask=mask_v)


def append_kv(k_cache, v_cache, cache_seqlens, k, v):
    """Write k (B, H_kv, n_new, D), v (B, H_kv, n_new, Dv) into the caches (B, H_kv,
    max_len, D or Dv) at positions
    cache_seqlens[b] ... cache_seqlens[b] + n_new - 1 of each row b, in place."""
    B, H, n_new, D = k.shape
    Dv = v.shape[-1]
    if k.numel() == 0:
        return
    _append_kv[(triton.cdiv(n_new, _APPEND_BLOCK_M), H, B)](
        K_CACHE=k_cache, V_CACHE=v_cache, K=k, V=v, SEQLENS=cache_seqlens,
        stride_kc=k_cache.stride()[:3], stride_vc=v_cache.stride()[:3], stride_k=k.stride()[:3],
        stride_v=v.stride()[:3], n_new=n_new, max_len=k_cache.shape[2],
        HEAD_DIM=D, BLOCK_D=block_d(D), HEAD_DIM_V=Dv, BLOCK_DV=block_d(Dv),
        BLOCK_M=_APPEND_BLOCK_M)


def kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, call, *, num_splits):
    """Append (k, v) if given, then attend: (out (B, H_q, q_len, Dv), lse (B, H_q, q_len)).

    Row b sees its first n_b = cache_seqlens[b] (+ q_len with k, v) cache positions, bottom-right
    causal over them, as ``call`` (an ``AttentionCall`` without dropout) says. Inputs validated
    by the caller; unit last strides.
    """
    if k is not None:
        append_kv(k_cache, v_cache, cache_seqlens, k, v)
        k_lens = (cache_seqlens + q.shape[2]).to(torch.int32)
    else:
        k_lens = cache_seqlens
    return attention_forward(q, k_cache, v_cache, call, k_lens=k_lens, num_splits=num_splits)
