"""Paged KV caches (FlashAttention 2's and vLLM's layout), read and written in place.

A paged cache is a pool of ``num_blocks`` pages of ``page_size`` key rows each: k_cache
(num_blocks, page_size, heads_kv, D), v_cache (num_blocks, page_size, heads_kv, Dv). Batch row b
owns the pages listed in ``block_table[b]`` (int32 (B, max_blocks)): its logical cache position
j is row ``j % page_size`` of page ``block_table[b, j // page_size]``. Its capacity is
max_blocks * page_size positions; entries of block_table past the filled length are never read.

The kernels see the pool through a (num_blocks, heads_kv, page_size, D) view (``paged_view``:
no copy), so that a K/V "batch" stride is the page stride and the head and row strides keep
their meaning; the forward kernel (PAGED) and the append kernel turn each tile's logical key
positions into (page, row) with ``page_rows`` and gather those rows with per-thread loads
(never TMA: a tile's rows may lie on different pages).

Packed queries (varlen) over a paged cache work the same way: only q and the output are packed
(cu_seqlens_q), the block table has one row per sequence and each sequence's key count comes
from ``seqused_k`` (the kernels' k_lens); ``paged_varlen_problem`` describes such a launch.
"""
import torch
import triton
import triton.language as tl

from .call import Problem, lse_shape, packed_view


@triton.jit
def page_rows(block_table, bt_stride, page_size, b, offs_n, k_len, CHECK: tl.constexpr):
    """(page, row) of logical key positions ``offs_n`` of batch row ``b`` (block_table int32
    with row stride ``bt_stride`` and unit column stride): page = block_table[b, offs_n //
    page_size], row = offs_n % page_size, both int32 (fewer registers live between a K tile's
    load and its V tile's; the caller widens them to 64 bits at each use, as a page offset can
    pass 2**31 elements). CHECK: positions >= k_len may lie past the table's row; they read
    page 0, whose rows the caller's masked loads never dereference."""
    slot = b.to(tl.int64) * bt_stride + offs_n // page_size
    if CHECK:
        page = tl.load(block_table + slot, mask=offs_n < k_len, other=0)
    else:
        page = tl.load(block_table + slot)
    return page, offs_n % page_size


def paged_view(cache: torch.Tensor) -> torch.Tensor:
    """A (num_blocks, page_size, heads_kv, D) paged cache as the kernels' (num_blocks,
    heads_kv, page_size, D) view (no copy)."""
    return cache.transpose(1, 2)


def paged_varlen_problem(q, k, v, cu_seqlens_q, max_seqlen_q, block_table):
    """The ``Problem`` of packed queries over a paged cache (FlashAttention's
    ``flash_attn_varlen_func(..., block_table=)``, vLLM's unified attention): q (total_q,
    heads_q, D) packed by int32 ``cu_seqlens_q`` (num_seqs + 1,), as in
    ``call.varlen_problem``; k, v the ``paged_view`` of the caches, (num_blocks, heads_kv,
    page_size, D or Dv), not packed (cu_k None): sequence s's key position j is row
    j % page_size of page block_table[s, j // page_size], its key count the kernels' k_lens[s].
    k_len is the capacity max_blocks * page_size (the Philox column count too)."""
    total_q, heads, _ = q.shape
    heads_kv = k.shape[1]
    assert heads_kv > 0 and heads % heads_kv == 0 and cu_seqlens_q.dtype == torch.int32
    assert block_table.shape[0] == cu_seqlens_q.numel() - 1
    k_len = block_table.shape[1] * k.shape[2]
    return Problem(packed_view(q), k, v, cu_seqlens_q.numel() - 1, heads, heads // heads_kv,
                   max_seqlen_q, k_len, cu_seqlens_q, None, lse_shape(q, True), (0, total_q),
                   triton.cdiv(k_len, 4))


def paged_problem(pb, block_table: torch.Tensor):
    """``pb`` (a dense ``Problem`` built on q and the ``paged_view`` of the caches) with the
    logical key length: the capacity max_blocks * page_size of each batch row."""
    k_len = block_table.shape[1] * pb.k.shape[2]
    return pb._replace(k_len=k_len, drop_groups=triton.cdiv(k_len, 4))
