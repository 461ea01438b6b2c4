"""Decoding against a preallocated KV cache: the in-place append kernel and the launcher.

The attention itself is the forward kernel (kernels/core/forward.py) with per-row key lengths
(SEQUSED_K), split-KV for long caches (kernels/core/splitkv.py) and packed GQA heads; only the
append is new work: new keys/values are written into each row's cache at its own offset.
Paged caches (kernels/core/paged.py) go through the same two kernels with PAGED: the append
writes each new row into its page, the forward reads K/V tiles page by page.
"""
import torch
import triton
import triton.language as tl

from .call import FP8_DTYPE
from .common import block_d, interpreter_active
from .fp8 import descale_args, load_descale, one_descale, quantize_e4m3
from .forward import ForwardPlan
from .launch import KernelStep
from .paged import page_rows, paged_view

_APPEND_BLOCK_M = 16


def v_is_k_prefix(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``v_cache`` is ``k_cache[..., :Dv]``: the same first element and strides, the
    same shape but a head dim no wider (MLA's latent cache, whose values are the first 512 of
    its 576 columns). The forward then reads V from the K tiles (``KeyLayout.v_in_k``)."""
    return (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.dtype == k_cache.dtype
            and v_cache.stride() == k_cache.stride()
            and v_cache.shape[:-1] == k_cache.shape[:-1] and v_cache.shape[-1] <= k_cache.shape[-1])


@triton.jit
def _append_kv(K_CACHE, V_CACHE, K, V, SEQLENS, stride_kc, stride_vc, stride_k, stride_v,
               n_new, max_len, BLOCK_TABLE, bt_stride, page_size, descale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, PAGED: tl.constexpr,
               QUANT: tl.constexpr, INTERPRET: tl.constexpr):
    """K_CACHE[b, h, SEQLENS[b] + i] = K[b, h, i] (and V) for i < n_new.

    K_CACHE (B, H_kv, max_len, HEAD_DIM), K (B, H_kv, n_new, HEAD_DIM); V_CACHE, V the same
    with HEAD_DIM_V; unit last stride;
    ``stride_x``: x's (batch, head, row) strides. Positions >= max_len are never written (the
    caller's contract says they do not occur; the guard keeps a broken contract from writing
    out of bounds). Grid: (cdiv(n_new, BLOCK_M), H_kv, B).
    PAGED: the caches are paged (num_blocks, H_kv, page_size, D) views, ``stride_kc[0]`` the
    page stride, BLOCK_TABLE int32 (B, max_blocks) with row stride ``bt_stride`` and unit
    column stride (kernels/core/paged.py), ``max_len`` the logical capacity max_blocks *
    page_size; position pos of row b is row pos % page_size of page
    block_table[b, pos // page_size].
    QUANT: the caches are e4m3 and K, V fp16 / bf16: each row is stored quantized,
    ``x / descale[b, h]`` clamped to +-448 and rounded to e4m3 (``descale``: the
    ``fp8.DescaleArgs`` of the call; kernels/core/fp8.py), INTERPRET as ``fp8.to_e4m3``.
    """
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    pos = tl.load(SEQLENS + b) + offs_i
    in_range = (offs_i < n_new) & (pos >= 0) & (pos < max_len)
    row_ok = in_range[:, None]
    mask = row_ok & (offs_d < HEAD_DIM)[None, :]
    mask_v = row_ok & (offs_dv < HEAD_DIM_V)[None, :]
    src = offs_i.to(tl.int64)[:, None]
    dst = pos.to(tl.int64)[:, None]
    k = tl.load(K + b * stride_k[0] + h * stride_k[1] + src * stride_k[2] + offs_d[None, :],
                mask=mask)
    v = tl.load(V + b * stride_v[0] + h * stride_v[1] + src * stride_v[2] + offs_dv[None, :],
                mask=mask_v)
    if QUANT:
        k = quantize_e4m3(k, load_descale(descale.k, descale.k_strides, b, h), INTERPRET)
        v = quantize_e4m3(v, load_descale(descale.v, descale.v_strides, b, h), INTERPRET)
    if PAGED:
        # Rows outside [0, max_len) read no page and are never stored (row_ok).
        page, page_row = page_rows(BLOCK_TABLE, bt_stride, page_size, b,
                                   tl.where(in_range, pos, max_len), max_len, True)
        page, page_row = page.to(tl.int64)[:, None], page_row.to(tl.int64)[:, None]
        dst_k = page * stride_kc[0] + page_row * stride_kc[2]
        dst_v = page * stride_vc[0] + page_row * stride_vc[2]
    else:
        dst_k = b * stride_kc[0] + dst * stride_kc[2]
        dst_v = b * stride_vc[0] + dst * stride_vc[2]
    tl.store(K_CACHE + dst_k + h * stride_kc[1] + offs_d[None, :], k, mask=mask)
    tl.store(V_CACHE + dst_v + h * stride_vc[1] + offs_dv[None, :], v, mask=mask_v)


def append_kv(k_cache, v_cache, cache_seqlens, k, v, block_table=None, descale=None):
    """Write k (B, H_kv, n_new, D), v (B, H_kv, n_new, Dv) into the caches (B, H_kv,
    max_len, D or Dv) at positions
    cache_seqlens[b] ... cache_seqlens[b] + n_new - 1 of each row b, in place. With
    ``block_table`` (int32 (B, max_blocks), unit column stride) the caches are the paged ones
    (num_blocks, page_size, H_kv, D or Dv) and max_len = max_blocks * page_size.
    e4m3 caches with fp16 / bf16 k, v: the rows are quantized with ``descale`` (a
    ``mods.Descale``, its k and v (B, H_kv) or None = 1; ``_quantizes``); rows already in the
    cache's dtype are copied as they are."""
    step = _append_step(k_cache, v_cache, k, v, block_table)
    if step is not None:
        _run_append(step, k_cache, v_cache, cache_seqlens, k, v, block_table, descale,
                    _append_one(k_cache, k))


class SlotWritePlan:
    """Writes of new rows at given slots of a paged cache (vLLM's ``reshape_and_cache``):
    token t's k, v go to row slot[t] % page_size of page slot[t] // page_size; slots < 0
    (padding) are skipped. The append kernel with one batch row per token whose "cache length"
    is its slot and whose block table is the identity over all pages (one arange row seen
    through a stride-0 view): the kernel's own position -> (page, row) split places each row,
    and a negative slot lies outside [0, capacity), where it stores nothing. Built once per
    signature; a call is one launch, no per-call tensor op and no host read."""

    def __init__(self, k_cache, v_cache, k, v):
        num_blocks = k_cache.shape[0]
        self.one = _append_one(k_cache, k)
        self.table = torch.arange(num_blocks, dtype=torch.int32, device=k.device)[None, :] \
            .expand(k.shape[0], num_blocks)
        self.step = _append_step(k_cache, v_cache, k.unsqueeze(2), v.unsqueeze(2), self.table)

    def __call__(self, k_cache, v_cache, k, v, slot_mapping, descale=None):
        """``descale``: a ``mods.Descale`` whose k, v are (tokens, heads_kv) (None = 1)."""
        if self.step is not None:
            _run_append(self.step, k_cache, v_cache, slot_mapping, k.unsqueeze(2),
                        v.unsqueeze(2), self.table, descale, self.one)


def _quantizes(cache, new) -> bool:
    """Whether the append quantizes: an e4m3 cache given rows of another dtype (FP8 rows come
    quantized already, with the cache's scales, and are copied raw)."""
    return cache.dtype == FP8_DTYPE and new.dtype != FP8_DTYPE


def _append_step(k_cache, v_cache, k, v, block_table):
    """The append's ``KernelStep`` for these layouts (None when there is nothing to append)."""
    B, H, n_new, D = k.shape
    Dv = v.shape[-1]
    if k.numel() == 0:
        return None
    if block_table is None:
        max_len, bt_stride, page_size = k_cache.shape[2], 0, 1
    else:
        k_cache, v_cache = paged_view(k_cache), paged_view(v_cache)
        page_size = k_cache.shape[2]
        max_len, bt_stride = block_table.shape[1] * page_size, block_table.stride(0)
    grid = (triton.cdiv(n_new, _APPEND_BLOCK_M), H, B)
    return KernelStep(_append_kv, lambda cfg: grid, dict(
        stride_kc=k_cache.stride()[:3], stride_vc=v_cache.stride()[:3], stride_k=k.stride()[:3],
        stride_v=v.stride()[:3], n_new=n_new, max_len=max_len, bt_stride=bt_stride,
        page_size=page_size, HEAD_DIM=D, BLOCK_D=block_d(D), HEAD_DIM_V=Dv,
        BLOCK_DV=block_d(Dv), BLOCK_M=_APPEND_BLOCK_M, PAGED=block_table is not None,
        QUANT=_quantizes(k_cache, k), INTERPRET=interpreter_active()),
        configs=[None])


def _append_one(k_cache, k):
    """The 1.0 a quantizing append reads for a missing descale (``fp8.one_descale``), or None
    when the append does not quantize."""
    return one_descale(k.device) if _quantizes(k_cache, k) else None


def _run_append(step, k_cache, v_cache, cache_seqlens, k, v, block_table, descale=None,
                one=None):
    """One append launch; ``one``: ``_append_one``'s tensor (a plan's, made once)."""
    if block_table is not None:
        k_cache, v_cache = paged_view(k_cache), paged_view(v_cache)
    # The descales' pointers (1.0 for a missing one; never read without QUANT).
    ds = descale_args(descale, cache_seqlens if one is None else one)
    step(k.device, dict(K_CACHE=k_cache, V_CACHE=v_cache, K=k, V=v, SEQLENS=cache_seqlens,
                        BLOCK_TABLE=cache_seqlens if block_table is None else block_table,
                        descale=ds))


def kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, call, *, num_splits,
                    block_table=None):
    """Append (k, v) if given, then attend: (out (B, H_q, q_len, Dv), lse (B, H_q, q_len)).

    FP8 caches (e4m3, kernels/core/fp8.py): ``call.mods.descale`` (``mods.Descale``) holds
    k / v descales (B, H_kv) (None = 1), and q's for e4m3 q; out in ``call.out_dtype``
    (``call.new_out``). New rows of another dtype than the cache's are quantized into it.

    Row b sees its first n_b = cache_seqlens[b] (+ q_len with k, v) cache positions, bottom-right
    causal over them, as ``call`` (an ``AttentionCall`` without dropout) says. Inputs validated
    by the caller; unit last strides. With ``block_table`` (int32 (B, max_blocks)) the caches
    are paged, (num_blocks, page_size, H_kv, D or Dv) (kernels/core/paged.py): read and
    written in place, page by page, never gathered.
    """
    if block_table is not None:
        block_table = block_table.contiguous()  # (B, max_blocks) ints: a copy only if strided
    plan = KVCachePlan(q, k_cache, v_cache, cache_seqlens, k, v, call, num_splits=num_splits,
                       block_table=block_table)
    return plan(q, k_cache, v_cache, cache_seqlens, k, v, call, block_table=block_table)


def _unit_columns(block_table):
    """``block_table`` (or None) with a unit column stride, as the kernels read it: a copy of a
    strided view only (e.g. every other column of a wider table)."""
    if block_table is None or block_table.stride(-1) == 1:
        return block_table
    return block_table.contiguous()


class KVCachePlan:
    """The launches of one ``kvcache_forward`` signature (append, then the forward's plan),
    built once and called per call with that signature's tensors, as ``ForwardPlan`` is for
    the forward. A ``block_table`` with a strided column axis is copied (``_unit_columns``) at
    both, so the append's and the forward's row strides are those of the table they read."""

    def __init__(self, q, k_cache, v_cache, cache_seqlens, k, v, call, *, num_splits,
                 block_table=None):
        block_table = _unit_columns(block_table)
        self.append = None if k is None else _append_step(k_cache, v_cache, k, v, block_table)
        self.one = None if k is None else _append_one(k_cache, k)
        self.new = 0 if k is None else q.shape[2]
        k_lens = cache_seqlens if k is None else cache_seqlens + self.new
        v_in_k = v_is_k_prefix(k_cache, v_cache)
        if block_table is not None:
            k_cache, v_cache = paged_view(k_cache), paged_view(v_cache)
        self.fwd = ForwardPlan(q, k_cache, v_cache, call, k_lens=k_lens, num_splits=num_splits,
                               block_table=block_table, v_in_k=v_in_k)

    def __call__(self, q, k_cache, v_cache, cache_seqlens, k, v, call, *, block_table=None):
        block_table = _unit_columns(block_table)
        if self.append is not None:
            _run_append(self.append, k_cache, v_cache, cache_seqlens, k, v, block_table,
                        call.mods.descale, self.one)
        k_lens = cache_seqlens if not self.new else (cache_seqlens + self.new)
        if block_table is not None:
            k_cache, v_cache = paged_view(k_cache), paged_view(v_cache)
        return self.fwd(q, k_cache, v_cache, call, k_lens=k_lens, block_table=block_table)


def varlen_paged_forward(q, k_cache, v_cache, call, *, cu_seqlens_q, max_seqlen_q, block_table,
                         seqused_k=None, cu_seqlens_k=None, max_seqlen_k=None, num_splits=1,
                         out=None, config=None):
    """Packed queries against a paged KV cache, in one launch (FlashAttention 2's
    ``flash_attn_varlen_func(..., block_table=)``, vLLM's unified attention): decode rows
    (one query) and prefill rows (many) mixed.

    Args:
        q: (total_q, heads_q, D), sequence s is rows cu_seqlens_q[s]:cu_seqlens_q[s + 1].
        k_cache, v_cache: (num_blocks, page_size, heads_kv, D or Dv), heads_q % heads_kv == 0;
            unit last stride.
        call: the ``AttentionCall`` (no dropout): causal is bottom-right per sequence (its
            queries are its last q_len_s key positions), windows, chunks, mods and sinks as
            in ``attention_forward``; the mods see b = s and positions from the sequence start.
        cu_seqlens_q: int32 (num_seqs + 1,); max_seqlen_q: >= every sequence's query count.
        block_table: int32 (num_seqs, max_blocks): key position j of sequence s is row
            j % page_size of page block_table[s, j // page_size] (made contiguous if its
            column stride is not 1).
        seqused_k: int32 (num_seqs,) key counts, each <= max_blocks * page_size; or None and
            ``cu_seqlens_k`` int32 (num_seqs + 1,), whose differences are the key counts.
        max_seqlen_k: optional bound on the key counts (only sharpens ``num_splits=0``).
        num_splits: split-KV as in ``attention_forward`` (1: none; 0: the heuristic); the
            splits of a sequence's keys are merged per row by kernels/core/splitkv.py.
        out: optional (total_q, heads_q, Dv) to write into (``new_out``'s strides).
        config: a ``triton.Config`` to force (tests).
    FP8 caches (e4m3) as in ``kvcache_forward``: descales (num_seqs, heads_kv) in
    ``call.mods.descale``, the output dtype ``call.out_dtype``.
    Returns:
        (out (total_q, heads_q, Dv) in call.out_dtype, lse fp32 (heads_q, total_q)): natural-log
        row log-sum-exp, -inf for rows that see no key.
    Inputs are validated by the caller (kernels/validation.py for the public functions).
    """
    if seqused_k is None:
        seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    plan = VarlenPagedPlan(q, k_cache, v_cache, call, cu_seqlens_q=cu_seqlens_q,
                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                           seqused_k=seqused_k, block_table=block_table, num_splits=num_splits,
                           out=out, config=config)
    return plan(q, k_cache, v_cache, call, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                block_table=block_table, out=out)


class VarlenPagedPlan:
    """The forward's launch plan of one ``varlen_paged_forward`` signature (its arguments
    less the tensors' contents), built once and called per call with that signature's tensors,
    as ``KVCachePlan`` is for a dense batch's cache."""

    def __init__(self, q, k_cache, v_cache, call, *, cu_seqlens_q, max_seqlen_q, seqused_k,
                 block_table, max_seqlen_k=None, num_splits=1, out=None, config=None):
        self.fwd = ForwardPlan(q, paged_view(k_cache), paged_view(v_cache), call,
                               cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, k_lens=seqused_k,
                               block_table=_unit_columns(block_table), num_splits=num_splits,
                               out=out, config=config, v_in_k=v_is_k_prefix(k_cache, v_cache))

    def __call__(self, q, k_cache, v_cache, call, *, cu_seqlens_q, seqused_k, block_table,
                 out=None):
        return self.fwd(q, paged_view(k_cache), paged_view(v_cache), call,
                        cu_seqlens_q=cu_seqlens_q, k_lens=seqused_k,
                        block_table=_unit_columns(block_table), out=out)
