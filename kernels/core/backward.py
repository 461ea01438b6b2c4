"""FlashAttention-2 backward: dQ, dK, dV of causal/non-causal attention with in-kernel dropout.

Notation (per batch*head ``bh``; i = query row, j = key column; FlashAttention-2, Alg. 2)::

    S = softmax_scale * Q K^T                  (q_len, k_len), masked entries = -inf
    P = exp(S - lse[:, None])                  softmax, recomputed from the forward's lse
    Pd = P * keep / (1 - p)                    dropout (keep = the forward's Philox mask)
    O = Pd V
    delta_i = sum_d dO[i, d] * O[i, d]         (= rowsum(dPd * Pd): valid with dropout too)
    dV = Pd^T dO
    dPd = dO V^T,  dP = dPd * keep / (1 - p)
    dS = P * (dP - delta[:, None])
    dQ = softmax_scale * dS K,   dK = softmax_scale * dS^T Q

Causal alignment is bottom-right: query i sees key j iff ``j <= i + (k_len - q_len)``::

    q_len=3, k_len=5        q_len=5, k_len=3
        k0 k1 k2 k3 k4          k0 k1 k2
    q0   x  x  x  .  .      q0   .  .  .     <- sees no key: lse = -inf, dq row = 0
    q1   x  x  x  x  .      q1   .  .  .
    q2   x  x  x  x  x      q2   x  .  .
                            q3   x  x  .
                            q4   x  x  x

Three launches, none with atomics, so the result is bit-reproducible:

1. ``_bwd_preprocess``: delta (B, H, q_len) fp32.
2. ``_bwd_dkdv``: one program per (key block, bh); it keeps K, V and the dK, dV accumulators
   on chip and streams the query blocks that can see its keys.
3. ``_bwd_dq``: one program per (query block, bh); it keeps Q, dO and dQ on chip and streams
   the visible key blocks. P and dP are recomputed here rather than shared with (2): sharing
   would need atomic dQ updates (FlashAttention-2's default), i.e. a non-deterministic sum.

Each inner loop is split in two: tiles that straddle the causal diagonal or the k_len edge
apply a mask (``MASK=True``), the others (most of them, for long sequences) skip it.
Out-of-range rows and head-dim padding need no mask on P: their loads give zeros (and
lse = +inf, so P = 0), which add nothing to any dot product.
"""
import torch
import triton
import triton.language as tl

from .common import (LOG2E, block_d, dot_operand, dot_precision, interpreter_active,
                      round_for_store, widen, widen_bf16)
from .dropout import dropout_keep_tile, dropout_threshold
from .layout import dense_problem, packed_view, varlen_problem
from .tiles import key_range, query_range, seq_bounds, visible
from .configs import autotune_enabled, bwd_configs, fixed_config, prune_bwd_configs

_LOG2E = tl.constexpr(LOG2E)
# Rows per program of the (memory-bound) delta pre-pass; independent of the autotuned blocks.
_PRE_BLOCK_M = 64


@triton.jit
def _bwd_preprocess(O, DO, Delta, CU_Q,
                    stride_ob, stride_oh, stride_om,
                    stride_dob, stride_doh, stride_dom,
                    stride_lb, stride_lh, q_len,
                    HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] in fp32.

    O, DO: (B, heads_q, q_len, HEAD_DIM), unit stride on the last dim (VARLEN: packed, rows of
    sequence b from CU_Q). Delta: fp32 in the lse layout (b * stride_lb + h * stride_lh + row).
    Grid: (cdiv(q_len or max_seqlen_q, BLOCK_M), heads_q, batch or number of sequences).
    """
    pid_m = tl.program_id(0)
    # Heads and batch on grid axes 1 and 2 (65535 each), not one B*H axis.
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, _, _ = seq_bounds(b, q_len, q_len, CU_Q, CU_Q, CU_Q, VARLEN, False)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + offs_m)[:, None].to(tl.int64)
    o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh \
        + rows * stride_om + offs_d[None, :]
    do_ptrs = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh \
        + rows * stride_dom + offs_d[None, :]
    # Casting straight to fp32 is right for bf16 under the interpreter too (what `widen` does).
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    row_base = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
    tl.store(Delta + row_base + offs_m, delta, mask=offs_m < q_len)


@triton.jit
def _load_row_stats(LSE, Delta, offs_m, q_len):
    """lse and delta of rows ``offs_m`` (pointers already at the head's row 0).

    Out-of-range rows get lse = +inf, so their P is exactly 0 without a mask. Rows that see no
    key (lse = -inf) only occur in masked tiles, which zero their P anyway; mapping -inf to +inf
    (one op per row) keeps exp2 from producing inf there in the first place.
    """
    row_ok = offs_m < q_len
    lse = tl.load(LSE + offs_m, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(Delta + offs_m, mask=row_ok, other=0.0)
    return lse, delta


@triton.jit
def _bwd_dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta,
                   start_m, start_n, offs_n, offs_d,
                   stride_qm, stride_dom,
                   drop_base, drop_col, q_len, k_len, window, qk_scale,
                   seed, drop_groups, dropout_threshold, dropout_scale,
                   HEAD_DIM: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                   WINDOW: tl.constexpr, DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Add one query block's contribution to dk, dv (both (BLOCK_N, BLOCK_D) fp32).

    Works in the transposed orientation (keys x queries) so that every dot takes a loaded tile
    or a freshly computed one as is: Q is loaded as Q^T, and only loaded tiles get tl.trans.
    Q, DO, LSE, Delta point at row 0 of the query head's sequence.
    """
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    # 64-bit tile bases: seq_len * row stride can pass 2**31 (e.g. 1M tokens x 16 heads x 128).
    Q += tl.cast(start_m, tl.int64) * stride_qm
    DO += tl.cast(start_m, tl.int64) * stride_dom
    qT = tl.load(Q + rows[None, :] * stride_qm + offs_d[:, None],
                 mask=row_ok[None, :] & d_ok[:, None], other=0.0)           # (BLOCK_D, BLOCK_M)
    qT = widen(qT, WIDEN)
    do = tl.load(DO + rows[:, None] * stride_dom + offs_d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)           # (BLOCK_M, BLOCK_D)
    do = widen(do, WIDEN)
    lse, delta = _load_row_stats(LSE, Delta, offs_m, q_len)

    sT = tl.dot(k, qT, input_precision=DOT_PRECISION)                       # (BLOCK_N, BLOCK_M)
    pT = tl.math.exp2(sT * qk_scale - lse[None, :] * _LOG2E)
    if MASK:
        # Only tiles on the causal diagonal, the window's edge or the k_len edge pay for this.
        pT = tl.where(visible(offs_m[None, :], offs_n[:, None], k_len, k_len - q_len, window,
                              CAUSAL, WINDOW), pT, 0.0)

    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)            # dPd^T = V dO^T
    if DROPOUT:
        # Same bits as the forward: the mask depends only on (seed, row id, j), not on blocks.
        # It is generated (queries x keys) and transposed as a byte tile rather than i1: the
        # conservative element type for a layout change through shared memory.
        keep = dropout_keep_tile(seed, drop_base, offs_m, start_n, drop_groups,
                                 dropout_threshold, BLOCK_M, BLOCK_N, drop_col)
        keepT = tl.trans(keep.to(tl.int8)) != 0
        pdT = tl.where(keepT, pT * dropout_scale, 0.0)
        dpT = tl.where(keepT, dpT * dropout_scale, 0.0)
    else:
        pdT = pT
    dv = tl.dot(dot_operand(pdT, do, WIDEN), do, dv, input_precision=DOT_PRECISION)
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dot_operand(dsT, qT, WIDEN), tl.trans(qT), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, CU_Q, CU_K,
              stride_qb, stride_qh, stride_qm,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_dob, stride_doh, stride_dom,
              stride_dkb, stride_dkh, stride_dkn,
              stride_dvb, stride_dvh, stride_dvn,
              stride_lb, stride_lh,
              GROUP, q_len, k_len, window, softmax_scale,
              seed, dropout_threshold, dropout_scale, drop_groups,
              stride_db, stride_dh, drop_row, drop_col,
              Q_BUCKET, K_BUCKET,  # autotune key only (power-of-two buckets of q_len/k_len)
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
              VARLEN: tl.constexpr, DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
              WIDEN: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV for one block of BLOCK_N keys of one (batch or packed sequence, kv head).

    Q, DO: (B, heads_q, q_len, HEAD_DIM); K, V, DK, DV: (B, heads_kv, k_len, HEAD_DIM), with
    heads_q = GROUP * heads_kv; any strides with a unit last one (VARLEN: packed as in the
    forward). LSE (natural log, -inf for rows that see no key) and Delta: fp32 in the lse layout.
    Grid: (cdiv(k_len or max_seqlen_k, BLOCK_N), heads_kv, batch or number of sequences).

    The GROUP query heads that share this kv head are summed here, one after another in a fixed
    order: no atomics, so dK and dV are bit-reproducible with grouped-query heads too.
    """
    pid_n = tl.program_id(0)
    # Heads and batch on grid axes 1 and 2 (65535 each), not one B*H axis.
    kv_h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, q_len, k_len, CU_Q, CU_K, CU_K, VARLEN,
                                                False)
    start_n = pid_n * BLOCK_N
    if VARLEN:
        # The grid covers the longest sequence; shorter ones leave programs with no keys.
        if start_n >= k_len:
            return
    # 64-bit base offsets: batch * stride_b passes 2**31 for large tensors.
    off_b = b.to(tl.int64)
    q_rows = tl.cast(q_start, tl.int64)
    k_rows = tl.cast(k_start, tl.int64) + start_n
    K += off_b * stride_kb + kv_h.to(tl.int64) * stride_kh + k_rows * stride_kn
    V += off_b * stride_vb + kv_h.to(tl.int64) * stride_vh + k_rows * stride_vn
    DK += off_b * stride_dkb + kv_h.to(tl.int64) * stride_dkh + k_rows * stride_dkn
    DV += off_b * stride_dvb + kv_h.to(tl.int64) * stride_dvh + k_rows * stride_dvn

    cols = tl.arange(0, BLOCK_N)
    offs_n = start_n + cols
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < k_len) & (offs_d[None, :] < HEAD_DIM)
    k = widen(tl.load(K + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0),
              WIDEN)                                                        # (BLOCK_N, BLOCK_D)
    v = widen(tl.load(V + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0),
              WIDEN)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # exp(x) = exp2(x * log2 e): fold log2 e into the scale once.
    qk_scale = softmax_scale * _LOG2E
    lo, full_lo, full_hi, hi = query_range(start_n, q_len, k_len, window, CAUSAL, WINDOW,
                                           BLOCK_M, BLOCK_N)

    # The first query tiles run before the pipelined loop: the causal diagonal, or without a
    # causal mask (no diagonal) the first unmasked tile, peeled off. A pipelined loop that
    # starts from the zeroed accumulators makes ptxas serialize this kernel's wgmma on sm_90
    # (C7515; seen with dropout, benchmarks/NOTES.md).
    if CAUSAL:
        diag_hi = full_lo
        diag_mask: tl.constexpr = True
    else:
        diag_hi = tl.minimum(full_lo + BLOCK_M, full_hi)
        diag_mask: tl.constexpr = False
    unmasked_lo = tl.maximum(full_lo, diag_hi)

    for g in range(0, GROUP):
        h = kv_h * GROUP + g
        Q_h = Q + off_b * stride_qb + h.to(tl.int64) * stride_qh + q_rows * stride_qm
        DO_h = DO + off_b * stride_dob + h.to(tl.int64) * stride_doh + q_rows * stride_dom
        row_base = off_b * stride_lb + h.to(tl.int64) * stride_lh + q_rows
        drop_base = off_b * stride_db + h.to(tl.int64) * stride_dh + q_rows + drop_row
        LSE_h = LSE + row_base
        Delta_h = Delta + row_base
        for start_m in range(lo, diag_hi, BLOCK_M):
            dk, dv = _bwd_dkdv_step(dk, dv, k, v, Q_h, DO_h, LSE_h, Delta_h, start_m, start_n,
                                    offs_n, offs_d, stride_qm, stride_dom, drop_base, drop_col,
                                    q_len, k_len, window, qk_scale, seed, drop_groups,
                                    dropout_threshold, dropout_scale, HEAD_DIM, diag_mask,
                                    CAUSAL, WINDOW, DROPOUT, DOT_PRECISION, WIDEN, BLOCK_M,
                                    BLOCK_N)
        # Key columns past k_len need no mask here: they only reach dK/dV rows that are not
        # stored.
        for start_m in range(unmasked_lo, full_hi, BLOCK_M):
            dk, dv = _bwd_dkdv_step(dk, dv, k, v, Q_h, DO_h, LSE_h, Delta_h, start_m, start_n,
                                    offs_n, offs_d, stride_qm, stride_dom, drop_base, drop_col,
                                    q_len, k_len, window, qk_scale, seed, drop_groups,
                                    dropout_threshold, dropout_scale, HEAD_DIM, False, CAUSAL,
                                    WINDOW, DROPOUT, DOT_PRECISION, WIDEN, BLOCK_M, BLOCK_N)
        if WINDOW:
            for start_m in range(full_hi, hi, BLOCK_M):
                dk, dv = _bwd_dkdv_step(dk, dv, k, v, Q_h, DO_h, LSE_h, Delta_h, start_m,
                                        start_n, offs_n, offs_d, stride_qm, stride_dom,
                                        drop_base, drop_col, q_len, k_len, window, qk_scale,
                                        seed, drop_groups, dropout_threshold, dropout_scale,
                                        HEAD_DIM, True, CAUSAL, WINDOW, DROPOUT,
                                        DOT_PRECISION, WIDEN, BLOCK_M, BLOCK_N)

    # dK = scale * dS^T Q: the scale is applied once here instead of on every tile.
    dk = round_for_store(dk * softmax_scale, WIDEN)
    dv = round_for_store(dv, WIDEN)
    tl.store(DK + cols[:, None] * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + cols[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_step(dq, q, do, lse, delta, K, V,
                 start_m, start_n, offs_m, offs_d,
                 stride_kn, stride_vn,
                 drop_base, drop_col, q_len, k_len, window, qk_scale,
                 seed, drop_groups, dropout_threshold, dropout_scale,
                 HEAD_DIM: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                 WINDOW: tl.constexpr, DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Add one key block's contribution to dq ((BLOCK_M, BLOCK_D) fp32).

    K and V are loaded transposed (BLOCK_D, BLOCK_N) so S = Q K^T and dPd = dO V^T need no
    register transpose. K, V point at row 0 of the kv head's sequence.
    """
    cols = tl.arange(0, BLOCK_N)
    offs_n = start_n + cols
    kv_mask = (offs_n[None, :] < k_len) & (offs_d[:, None] < HEAD_DIM)
    # 64-bit tile bases, 32-bit offsets inside the tile (see _bwd_dkdv_step).
    K += tl.cast(start_n, tl.int64) * stride_kn
    V += tl.cast(start_n, tl.int64) * stride_vn
    kT = widen(tl.load(K + cols[None, :] * stride_kn + offs_d[:, None], mask=kv_mask,
                       other=0.0), WIDEN)                                   # (BLOCK_D, BLOCK_N)
    vT = widen(tl.load(V + cols[None, :] * stride_vn + offs_d[:, None], mask=kv_mask,
                       other=0.0), WIDEN)

    s = tl.dot(q, kT, input_precision=DOT_PRECISION)                        # (BLOCK_M, BLOCK_N)
    p = tl.math.exp2(s * qk_scale - lse[:, None] * _LOG2E)
    if MASK:
        # Unlike dK/dV, columns past k_len must be zeroed here: their P = exp(-lse) is
        # meaningless (it overflows for very negative lse) and would reach every dQ row.
        p = tl.where(visible(offs_m[:, None], offs_n[None, :], k_len, k_len - q_len, window,
                             CAUSAL, WINDOW), p, 0.0)

    dp = tl.dot(do, vT, input_precision=DOT_PRECISION)                      # dPd = dO V^T
    if DROPOUT:
        keep = dropout_keep_tile(seed, drop_base, offs_m, start_n, drop_groups,
                                 dropout_threshold, BLOCK_M, BLOCK_N, drop_col)
        dp = tl.where(keep, dp * dropout_scale, 0.0)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(dot_operand(ds, kT, WIDEN), tl.trans(kT), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE, Delta, DQ, CU_Q, CU_K,
            stride_qb, stride_qh, stride_qm,
            stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn,
            stride_dob, stride_doh, stride_dom,
            stride_dqb, stride_dqh, stride_dqm,
            stride_lb, stride_lh,
            GROUP, q_len, k_len, window, softmax_scale,
            seed, dropout_threshold, dropout_scale, drop_groups,
            stride_db, stride_dh, drop_row, drop_col,
            Q_BUCKET, K_BUCKET,  # autotune key only (power-of-two buckets of q_len/k_len)
            HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
            VARLEN: tl.constexpr, DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
            WIDEN: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ for one block of BLOCK_M queries of one (batch or packed sequence, query head).

    Shapes and strides as in ``_bwd_dkdv``; DQ like Q. Query head h reads kv head h // GROUP.
    Grid: (cdiv(q_len or max_seqlen_q, BLOCK_M), heads_q, batch or number of sequences).
    """
    # Causal: the last query blocks see the most keys. Blocks are issued in reverse so the
    # longest programs start first and the short ones fill the tail (less load imbalance).
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    # Heads and batch on grid axes 1 and 2 (65535 each), not one B*H axis.
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, q_len, k_len, CU_Q, CU_K, CU_K, VARLEN,
                                                False)
    start_m = pid_m * BLOCK_M
    if VARLEN:
        if start_m >= q_len:
            return
    off_b = b.to(tl.int64)
    kv_h = (h // GROUP).to(tl.int64)
    q_rows = tl.cast(q_start, tl.int64)
    k_rows = tl.cast(k_start, tl.int64)
    Q += off_b * stride_qb + h.to(tl.int64) * stride_qh + q_rows * stride_qm
    DO += off_b * stride_dob + h.to(tl.int64) * stride_doh + q_rows * stride_dom
    DQ += off_b * stride_dqb + h.to(tl.int64) * stride_dqh + q_rows * stride_dqm
    K += off_b * stride_kb + kv_h * stride_kh + k_rows * stride_kn
    V += off_b * stride_vb + kv_h * stride_vh + k_rows * stride_vn
    row_base = off_b * stride_lb + h.to(tl.int64) * stride_lh + q_rows
    drop_base = off_b * stride_db + h.to(tl.int64) * stride_dh + q_rows + drop_row

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m < q_len)[:, None] & (offs_d[None, :] < HEAD_DIM)
    # Tile pointers built from the batch/head base: 64-bit row offsets, as in the dK/dV kernel.
    q = widen(tl.load(Q + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                      mask=q_mask, other=0.0), WIDEN)                       # (BLOCK_M, BLOCK_D)
    do = widen(tl.load(DO + offs_m[:, None].to(tl.int64) * stride_dom + offs_d[None, :],
                       mask=q_mask, other=0.0), WIDEN)
    # Rows that see no key get lse = +inf, P = 0, so their dQ row is 0.
    lse, delta = _load_row_stats(LSE + row_base, Delta + row_base, offs_m, q_len)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    qk_scale = softmax_scale * _LOG2E

    # The same tile split as the forward (kernels/core/tiles.py): [lo, full_lo) the window's edge,
    # [full_lo, full_hi) unmasked, [full_hi, hi) the diagonal / k_len edge.
    lo, full_lo, full_hi, hi = key_range(start_m, start_m + BLOCK_M, q_len, k_len, window,
                                         CAUSAL, WINDOW, BLOCK_N)
    # As in the forward, the diagonal loop after the unmasked one runs unpipelined: pipelined,
    # ptxas serializes the kernel's wgmma on sm_90 (C7515; benchmarks/NOTES.md).
    if WINDOW:
        for start_n in range(lo, full_lo, BLOCK_N):
            dq = _bwd_dq_step(dq, q, do, lse, delta, K, V, start_m, start_n, offs_m, offs_d,
                              stride_kn, stride_vn, drop_base, drop_col, q_len, k_len, window,
                              qk_scale, seed, drop_groups, dropout_threshold, dropout_scale,
                              HEAD_DIM, True, CAUSAL, WINDOW, DROPOUT, DOT_PRECISION, WIDEN,
                              BLOCK_M, BLOCK_N)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        dq = _bwd_dq_step(dq, q, do, lse, delta, K, V, start_m, start_n, offs_m, offs_d,
                          stride_kn, stride_vn, drop_base, drop_col, q_len, k_len, window,
                          qk_scale, seed, drop_groups, dropout_threshold, dropout_scale,
                          HEAD_DIM, False, CAUSAL, WINDOW, DROPOUT, DOT_PRECISION, WIDEN,
                          BLOCK_M, BLOCK_N)
    for start_n in tl.range(full_hi, hi, BLOCK_N, num_stages=1):
        dq = _bwd_dq_step(dq, q, do, lse, delta, K, V, start_m, start_n, offs_m, offs_d,
                          stride_kn, stride_vn, drop_base, drop_col, q_len, k_len, window,
                          qk_scale, seed, drop_groups, dropout_threshold, dropout_scale,
                          HEAD_DIM, True, CAUSAL, WINDOW, DROPOUT, DOT_PRECISION, WIDEN,
                          BLOCK_M, BLOCK_N)

    dq = round_for_store(dq * softmax_scale, WIDEN)
    tl.store(DQ + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


# On a GPU each kernel is autotuned separately (dK/dV favours long key blocks, dQ long query
# blocks). Sequence lengths enter the key as power-of-two buckets (as in the forward), so a new
# length re-tunes only when it changes bucket; triton's Autotuner appends every tensor
# argument's dtype to the key itself. Both kernels only store their outputs (nothing
# accumulates into them), so re-running a config while tuning is harmless: no reset_to_zero.
_TUNE_KEY = ["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL", "WINDOW", "VARLEN", "DROPOUT",
             "DOT_PRECISION"]
_bwd_dkdv_tuned = triton.autotune(configs=bwd_configs(kernel="dkdv"), key=_TUNE_KEY,
                                  prune_configs_by={"early_config_prune": prune_bwd_configs}
                                  )(_bwd_dkdv)
_bwd_dq_tuned = triton.autotune(configs=bwd_configs(kernel="dq"), key=_TUNE_KEY,
                                prune_configs_by={"early_config_prune": prune_bwd_configs}
                                )(_bwd_dq)


def attention_backward(do, q, k, v, o, lse, *, causal, softmax_scale, dropout_p=0.0, seed=0,
                       window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, drop_layout=None, config=None):
    """Gradients of ``o = attention(q, k, v)`` given ``do = dL/do``.

    Args:
        do: shaped like q, any strides (made unit-stride on the last dim if it is not).
        q: (B, heads_q, q_len, D); k, v: (B, heads_kv, k_len, D), heads_q % heads_kv == 0.
            Packed sequences (with ``cu_seqlens_q``): q (total_q, heads_q, D), k, v
            (total_k, heads_kv, D). fp16, bf16 or fp32, one dtype; any strides with a
            unit-stride last dim. D in 1..256.
        o: the forward's output, shaped like q (q's dtype).
        lse: the forward's fp32 contiguous natural-log row log-sum-exp of the scaled scores,
            (B, heads_q, q_len) or (heads_q, total_q); -inf for rows that see no key.
        causal: bottom-right causal mask (query i sees key j iff j <= i + k_len - q_len).
        softmax_scale: the scale the forward applied to q k^T.
        dropout_p: the forward's dropout probability in [0, 1); 0 compiles dropout out.
        seed: the forward's dropout seed, a Python int in [0, 2**63).
        window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, drop_layout: as given
            to ``attention_forward``.
        config: a ``triton.Config`` with BLOCK_M, BLOCK_N (tests only); default: autotuned
            on a GPU, ``bwd_configs(interpret=True)[0]`` under the interpreter.

    Returns:
        (dq, dk, dv), each with the shape, dtype and memory layout of q, k, v
        (``torch.empty_like``). dk, dv of a kv head sum its whole group of query heads.
    """
    if cu_seqlens_q is None:
        pb = dense_problem(q, k, v)
    else:
        pb = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    head_dim = q.shape[-1]
    assert v.shape == k.shape and do.shape == q.shape and o.shape == q.shape
    assert lse.shape == pb.lse_shape and lse.dtype == torch.float32 and lse.is_contiguous()
    assert q.dtype == k.dtype == v.dtype and 1 <= head_dim <= 256
    assert 0.0 <= dropout_p < 1.0

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if pb.batch * pb.heads == 0 or pb.q.shape[2] == 0 or pb.k.shape[2] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if do.stride(-1) != 1:
        # e.g. the expanded, all-zero-stride gradient of o.sum(): one copy, then unit stride.
        do = do.contiguous()
    if pb.varlen:
        do, o, dq4, dk4, dv4 = (packed_view(t) for t in (do, o, dq, dk, dv))
    else:
        dq4, dk4, dv4 = dq, dk, dv

    BLOCK_D = block_d(head_dim)
    dropout = dropout_p > 0.0
    consts = dict(HEAD_DIM=head_dim, CAUSAL=bool(causal), WINDOW=window is not None,
                  VARLEN=pb.varlen, DROPOUT=dropout, DOT_PRECISION=dot_precision(q.dtype),
                  WIDEN=widen_bf16(q.dtype), BLOCK_D=BLOCK_D)
    drop_args = (int(seed), dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p)) if dropout \
        else (0, 0, 1.0)

    # delta lives in lse's layout, so both share one offset (and the dropout row id).
    delta = torch.empty_like(lse)
    cu_q, cu_k = pb.cu_args(lse)
    _bwd_preprocess[(triton.cdiv(pb.q_len, _PRE_BLOCK_M), pb.heads, pb.batch)](
        o, do, delta, cu_q, *pb.strides(o), *pb.strides(do), *pb.lse_strides, pb.q_len,
        HEAD_DIM=head_dim, VARLEN=pb.varlen, BLOCK_M=_PRE_BLOCK_M, BLOCK_D=BLOCK_D)

    common = (*pb.strides(pb.q), *pb.strides(pb.k), *pb.strides(pb.v), *pb.strides(do))
    tail = (*pb.lse_strides, pb.group, pb.q_len, pb.k_len, window or 0, float(softmax_scale),
            *drop_args, *pb.dropout_args(drop_layout),
            triton.next_power_of_2(pb.q_len), triton.next_power_of_2(pb.k_len))
    dkdv_args = (pb.q, pb.k, pb.v, do, lse, delta, dk4, dv4, cu_q, cu_k, *common,
                 *pb.strides(dk4), *pb.strides(dv4), *tail)
    dq_args = (pb.q, pb.k, pb.v, do, lse, delta, dq4, cu_q, cu_k, *common, *pb.strides(dq4),
               *tail)
    heads_kv = pb.heads // pb.group

    if config is None and not interpreter_active() and autotune_enabled():
        _bwd_dkdv_tuned[lambda meta: (triton.cdiv(pb.k_len, meta["BLOCK_N"]), heads_kv,
                                      pb.batch)](*dkdv_args, **consts)
        _bwd_dq_tuned[lambda meta: (triton.cdiv(pb.q_len, meta["BLOCK_M"]), pb.heads,
                                    pb.batch)](*dq_args, **consts)
        return dq, dk, dv

    if config is not None:
        config_dkdv = config_dq = config
    elif interpreter_active():
        # Under the interpreter autotuning would time every config in Python: one fixed config.
        config_dkdv = config_dq = bwd_configs(interpret=True)[0]
    else:  # KERNELS_AUTOTUNE=0: the first config each kernel's pruning keeps
        config_dkdv = fixed_config(bwd_configs(kernel="dkdv"), prune_bwd_configs,
                                   {"Q": q, "DK": dk}, **consts)
        config_dq = fixed_config(bwd_configs(kernel="dq"), prune_bwd_configs,
                                 {"Q": q, "DQ": dq}, **consts)

    def launch(kernel, cfg, n_rows, block, heads, args):
        kernel[(triton.cdiv(n_rows, cfg.kwargs[block]), heads, pb.batch)](
            *args, **consts, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    launch(_bwd_dkdv, config_dkdv, pb.k_len, "BLOCK_N", heads_kv, dkdv_args)
    launch(_bwd_dq, config_dq, pb.q_len, "BLOCK_M", pb.heads, dq_args)
    return dq, dk, dv
