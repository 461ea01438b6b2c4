"""Split-KV ("flash-decoding"): how many splits, and the kernel that merges them.

When a forward launch has too few (query block, head, batch) programs to fill the GPU -- one
query token against a long KV cache has one query block per head -- kernels/core/forward.py splits
each block's keys over ``num_splits`` programs. Split s writes its normalised partial output
``o_s`` and log-sum-exp ``lse_s`` (fp32); ``_combine_splits`` then merges them row by row,
in the fixed order s = 0, 1, ... (deterministic):

    lse = log(sum_s exp(lse_s)),   o = sum_s exp(lse_s - lse) * o_s

Rows no split saw a key for keep lse = -inf and o = 0. Dropout needs nothing here: each
element's keep bit depends on its (row, column), not on which split visits it.
"""
import math

import torch
import triton
import triton.language as tl

from .common import block_d, interpreter_active, round_for_store, widen_bf16

# Query rows per program of the merge (memory-bound: a few loads and one store per element).
_COMBINE_BLOCK_R = 16
# At most this many splits (each costs a partial output of the launch's size in fp32).
MAX_SPLITS = 128
# Pack the query heads of a kv group into one program when q_len is at most this (decoding and
# speculative decoding): the group's K/V tiles are then read once instead of once per head.
PACK_GQA_MAX_Q_LEN = 16
# The tile sizes the heuristic counts with (the launch's own tiles are autotuned later).
_NOMINAL_BLOCK_M = 64
_NOMINAL_BLOCK_N = 64
_MIN_BLOCK_N = 16


def num_splits_heuristic(device, n_programs, n_key_tiles, sm_count=None):
    """Splits for a launch of ``n_programs`` (query blocks x heads x batch, counted with
    64-row blocks) over ``n_key_tiles`` 64-key tiles, on a device with ``sm_count`` SMs
    (default: the device's; CPU and Triton's interpreter: none, so 1).

    FlashAttention-2's rule: no split when the programs already fill 80% of the SMs; else the
    smallest split count whose wave efficiency (programs / SMs, over its ceiling) reaches 85%
    of the best over 1..min(MAX_SPLITS, SMs, key tiles). A pure function of the shapes and SMs.
    """
    if sm_count is None:
        if device.type != "cuda" or interpreter_active():
            return 1
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    if n_programs >= 0.8 * sm_count or n_key_tiles <= 1:
        return 1
    max_splits = min(MAX_SPLITS, sm_count, n_key_tiles)

    def eligible(s):  # a split count whose tiles per split differ from the next smaller one's
        return s == 1 or math.ceil(n_key_tiles / s) != math.ceil(n_key_tiles / (s - 1))

    def efficiency(s):
        waves = n_programs * s / sm_count
        return waves / math.ceil(waves)

    effs = {s: efficiency(s) for s in range(1, max_splits + 1) if eligible(s)}
    best = max(effs.values())
    return min(s for s, e in effs.items() if e >= 0.85 * best)


def clamp_splits(num_splits, k_len):
    """A requested split count clamped to [1, MAX_SPLITS] and to the number of key tiles of the
    smallest tile size (16 keys): more splits than that would only add empty programs."""
    return max(1, min(num_splits, MAX_SPLITS, triton.cdiv(max(k_len, 1), _MIN_BLOCK_N)))


def nominal_tiles(rows, k_len):
    """(query blocks, key tiles) counted with the heuristic's nominal 64 x 64 tiles."""
    return triton.cdiv(rows, _NOMINAL_BLOCK_M), triton.cdiv(k_len, _NOMINAL_BLOCK_N)


@triton.jit
def _combine_splits(O_PART, LSE_PART, O, LSE, n_rows, num_splits, heads, rows_per_head,
                    stride_ob, stride_oh, stride_om,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                    WIDEN: tl.constexpr):
    """Merge the splits of BLOCK_R rows.

    O_PART: fp32 (num_splits, n_rows, HEAD_DIM), LSE_PART: fp32 (num_splits, n_rows), row r =
    the lse offset. LSE: fp32 (n_rows,) contiguous. O: the 4-D (B, heads, rows_per_head, HEAD_DIM)
    output (packed sequences: (1, heads, total_q, HEAD_DIM)), unit stride in the last dim; row r
    is (r // (heads * rows_per_head), (r // rows_per_head) % heads, r % rows_per_head).
    """
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < n_rows
    mask = r_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_r.to(tl.int64)

    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
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
    empty = l_sum == 0.0
    l_safe = tl.where(empty, 1.0, l_sum)
    tl.store(LSE + rows, tl.where(empty, float("-inf"), m_safe + tl.log(l_safe)), mask=r_ok)

    b = rows // (heads * rows_per_head)
    h = (rows // rows_per_head) % heads
    i = rows % rows_per_head
    o_ptrs = O + (b * stride_ob + h * stride_oh + i * stride_om)[:, None] + offs_d[None, :]
    o = acc / l_safe[:, None]
    tl.store(o_ptrs, round_for_store(o, WIDEN).to(O.dtype.element_ty), mask=mask)


def combine_splits(o_part, lse_part, o4, lse):
    """Merge split partials into ``o4`` (B, heads, rows, D) and ``lse`` (its rows in order).

    o_part: fp32 (num_splits, lse.numel(), D); lse_part: fp32 (num_splits, lse.numel()).
    """
    num_splits, n_rows, head_dim = o_part.shape
    _, heads, rows_per_head, _ = o4.shape
    assert lse.is_contiguous() and lse.numel() == n_rows == o4.shape[0] * heads * rows_per_head
    _combine_splits[(triton.cdiv(n_rows, _COMBINE_BLOCK_R),)](
        o_part, lse_part, o4, lse, n_rows, num_splits, heads, rows_per_head,
        o4.stride(0), o4.stride(1), o4.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_R=_COMBINE_BLOCK_R,
        WIDEN=widen_bf16(o4.dtype))
