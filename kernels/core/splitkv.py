"""Split-KV ("flash-decoding"): the kernel that merges the splits.

When a forward launch has too few (query block, head, batch) programs to fill the GPU -- one
query token against a long KV cache has one query block per head -- kernels/core/forward.py
splits each block's keys over ``num_splits`` programs (how many: ``num_splits_heuristic`` in
kernels/core/configs.py). Split s writes its normalised partial output
``o_s`` and log-sum-exp ``lse_s`` (fp32); ``_combine_splits`` then merges them row by row,
in the fixed order s = 0, 1, ... (deterministic):

    lse = log(sum_s exp(lse_s)),   o = sum_s exp(lse_s - lse) * o_s

Rows no split saw a key for keep lse = -inf and o = 0. Dropout needs nothing here: each
element's keep bit depends on its (row, column), not on which split visits it. Attention sinks
join here, once, as one more term of the merge with no output: lse gains exp(sink_h) and o is
scaled by the weight the keys keep (the splits' partials leave them out).
"""
import triton
import triton.language as tl

from .common import block_d, round_for_store, widen_bf16

# Query rows per program of the merge (memory-bound: a few loads and one store per element).
_COMBINE_BLOCK_R = 16


@triton.jit
def _combine_splits(O_PART, LSE_PART, O, LSE, SINKS, n_rows, num_splits, heads, rows_per_head,
                    stride_o,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                    HAS_SINKS: tl.constexpr, WIDEN: tl.constexpr):
    """Merge the splits of BLOCK_R rows.

    O_PART: fp32 (num_splits, n_rows, HEAD_DIM), LSE_PART: fp32 (num_splits, n_rows), row r =
    the lse offset. LSE: fp32 (n_rows,) contiguous. O: the 4-D (B, heads, rows_per_head, HEAD_DIM)
    output (packed sequences: (1, heads, total_q, HEAD_DIM)), unit stride in the last dim, its
    (batch, head, row) strides ``stride_o``; row r
    is (r // (heads * rows_per_head), (r // rows_per_head) % heads, r % rows_per_head).
    SINKS: fp32 (heads,) sink logits, read when HAS_SINKS.
    """
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < n_rows
    mask = r_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_r.to(tl.int64)

    b = rows // (heads * rows_per_head)
    h = (rows // rows_per_head) % heads
    i = rows % rows_per_head
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(SINKS + h, mask=r_ok, other=float("-inf"))
        m = sink
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(LSE_PART + s * n_rows + rows, mask=r_ok,
                                  other=float("-inf")))
    # Rows that no split saw a key for: every weight exp(-inf) = 0, and no (-inf) - (-inf).
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s in range(0, num_splits):
        part = s * n_rows + rows
        w = tl.exp(tl.load(LSE_PART + part, mask=r_ok, other=float("-inf")) - m_safe)
        o_s = tl.load(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
        acc += w[:, None] * o_s
        l_sum += w
    if HAS_SINKS:
        # The sink's term of the denominator; it adds nothing to acc.
        l_sum += tl.exp(sink - m_safe)
    empty = l_sum == 0.0
    l_safe = tl.where(empty, 1.0, l_sum)
    tl.store(LSE + rows, tl.where(empty, float("-inf"), m_safe + tl.log(l_safe)), mask=r_ok)

    o_ptrs = O + (b * stride_o[0] + h * stride_o[1] + i * stride_o[2])[:, None] + offs_d[None, :]
    o = acc / l_safe[:, None]
    tl.store(o_ptrs, round_for_store(o, WIDEN).to(O.dtype.element_ty), mask=mask)


def combine_splits(o_part, lse_part, o4, lse, sinks=None):
    """Merge split partials into ``o4`` (B, heads, rows, D) and ``lse`` (its rows in order).

    o_part: fp32 (num_splits, lse.numel(), D); lse_part: fp32 (num_splits, lse.numel());
    sinks: None or fp32 (heads,) sink logits, joined to every row's denominator.
    """
    num_splits, n_rows, head_dim = o_part.shape
    _, heads, rows_per_head, _ = o4.shape
    assert lse.is_contiguous() and lse.numel() == n_rows == o4.shape[0] * heads * rows_per_head
    _combine_splits[(triton.cdiv(n_rows, _COMBINE_BLOCK_R),)](
        O_PART=o_part, LSE_PART=lse_part, O=o4, LSE=lse,
        SINKS=lse if sinks is None else sinks, n_rows=n_rows, num_splits=num_splits,
        heads=heads, rows_per_head=rows_per_head, stride_o=o4.stride()[:3],
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_R=_COMBINE_BLOCK_R,
        HAS_SINKS=sinks is not None, WIDEN=widen_bf16(o4.dtype))
