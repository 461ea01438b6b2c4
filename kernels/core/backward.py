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

1. ``_bwd_preprocess``: the row statistics lse · log2(e) and delta, fp32, padded to whole
   tiles (``stats_layout``) so that the other two load them unmasked.
2. ``_bwd_dkdv``: one program per (key block, bh); it keeps K, V and the dK, dV accumulators
   on chip and streams the query blocks that can see its keys.
3. ``_bwd_dq``: one program per (query block, bh); it keeps Q, dO and dQ on chip and streams
   the visible key blocks. P and dP are recomputed here rather than shared with (2): sharing
   would need atomic dQ updates (FlashAttention-2's default), i.e. a non-deterministic sum.

Each kernel visits its tiles in up to three ranges (kernels/core/tiles.py): tiles that
straddle the causal diagonal, the window's edge or the k_len edge apply the mask
(``MASKED``), the others (most of them, for long sequences) skip it. Every score tile goes
through the one score pipeline (kernels/core/score.py), as in the forward. Out-of-range rows
and head-dim padding need no mask on P: their loads give zeros (and their padded lse is +inf,
so P = 0), which add nothing to any dot product.
"""
import torch
import triton
import triton.language as tl

from .call import (AttentionCall, BwdStrides, DropArgs, make_problem, packed_view,
                   score_args, score_spec, seed_tensor)
from .common import (LOG2E, block_d, dot_operand, dot_precision, interpreter_active,
                     round_for_store, widen, widen_bf16)
from .configs import (BWD_ROW_PAD, BWD_TUNE_KEY, TMA_DKDV_DROPOUT_MAX_WIDTH, autotune_enabled,
                      bwd_configs, fixed_configs, host_descriptors_enabled,
                      prune_bwd_configs, with_pre_hook)
from .dropout import load_seed
from .score import dropout_keep, mods_aux_grad, probs_from_lse, scaled_scores, score_grad
from .launch import KernelStep, launch_context
from .tma import (TMA_HOST, TMA_HOST_MODE, desc_tile, host_desc_layout, host_descs, row_tiles,
                  set_row_blocks, tma_capable, tma_rows_ok)
from .tiles import (clamp_ranges, edge_bound, key_range, mask_key_bounds, mask_query_bounds,
                    program_ids, query_range, seq_bounds)

_LOG2E = tl.constexpr(LOG2E)
# Elements per program of the (memory-bound) delta pre-pass, independent of the autotuned
# blocks: 64 rows up to head_dim 128, 32 at 256 (64 x 256 spilled on sm_100).
_PRE_BLOCK_ELEMS = 64 * 128
# Entries (fp32) per 16 bytes: every (sequence, head)'s row statistics start at a multiple of it.
_STATS_ALIGN = tl.constexpr(4)



def stats_layout(pb):
    """(shape, (batch stride, head stride, plane stride)) of the backward's padded row
    statistics: two fp32 planes, lse · log2(e) then delta (``_bwd_preprocess``).

    In each plane, each (batch or sequence, head) gets its q_len rows followed by at least
    round_up(q_len, BWD_ROW_PAD) - q_len padding rows (``_bwd_preprocess`` fills them), so a
    BLOCK_M-row tile that starts below q_len never leaves its own rows (BLOCK_M <= BWD_ROW_PAD),
    and starts at a multiple of 4 entries (16 bytes: where a tensor descriptor's tile may start,
    ``_bwd_dkdv``'s TMA). Entry (b, h, i) sits at ``stats_row0(b, h, row_start, strides) + i``:
    dense (2, B, heads, round_up(q_len, BWD_ROW_PAD)); packed sequences (2, heads, width) with
    batch stride BWD_ROW_PAD + 4, so sequence b starts at round_up(cu_q[b], 4) + b *
    (BWD_ROW_PAD + 4), at least len_b + BWD_ROW_PAD entries before sequence b + 1.
    """
    if pb.varlen:
        align = _STATS_ALIGN.value
        seq_stride = BWD_ROW_PAD + align
        width = triton.cdiv(pb.q.shape[2] + align + pb.batch * seq_stride, align) * align
        return (2, pb.heads, width), (seq_stride, width, pb.heads * width)
    width = triton.cdiv(pb.q_len, BWD_ROW_PAD) * BWD_ROW_PAD
    plane = pb.batch * pb.heads * width
    return (2, pb.batch, pb.heads, width), (pb.heads * width, width, plane)


@triton.jit
def stats_row0(b, h, q_start, stride_stats):
    """Offset of row 0 of (batch or sequence b, head h) in a plane of the row statistics
    (``stats_layout``; q_start = 0 for dense inputs), 64-bit."""
    return b.to(tl.int64) * stride_stats[0] + h.to(tl.int64) * stride_stats[1] \
        + (q_start + _STATS_ALIGN - 1) // _STATS_ALIGN * _STATS_ALIGN


@triton.jit
def _bwd_preprocess(O, DO, LSE, STATS, stride_o, stride_do, stride_lse, stride_stats, seq,
                    HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, ROW_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The row statistics the dK/dV and dQ kernels read, fp32, in the padded stats layout
    (``stats_layout``):

        lse2[b, h, i]  = lse[b, h, i] * log2(e)   (+inf where lse = -inf: a row with no key)
        delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d]

    for i < q_len, and lse2 = +inf, delta = 0 on the padding rows q_len <= i <
    round_up(q_len, ROW_PAD). The kernels then load whole tiles of them unmasked: a padding
    row's P = exp2(s - lse2) is exactly 0, and a row with no key's too (its tiles are masked
    anyway; +inf keeps exp2 from overflowing there).

    O, DO: (B, heads_q, q_len, HEAD_DIM) (the value head dim), unit stride on the last dim
    (VARLEN: packed, rows of sequence b from seq.cu_q). LSE: the forward's, in the lse layout
    (``stride_lse``); STATS: lse2 then delta, in the stats layout (``stride_stats``). Grid:
    (cdiv(round_up(q_len or max_seqlen_q, ROW_PAD), BLOCK_M), heads_q, batch or sequences).
    """
    pid_m = tl.program_id(0)
    # Heads and batch on grid axes 1 and 2 (65535 each), not one B*H axis.
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, _, _ = seq_bounds(b, seq, VARLEN, False)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + offs_m)[:, None].to(tl.int64)
    o_ptrs = O + b.to(tl.int64) * stride_o[0] + h.to(tl.int64) * stride_o[1] \
        + rows * stride_o[2] + offs_d[None, :]
    do_ptrs = DO + b.to(tl.int64) * stride_do[0] + h.to(tl.int64) * stride_do[1] \
        + rows * stride_do[2] + offs_d[None, :]
    # Casting straight to fp32 is right for bf16 under the interpreter too (what `widen` does).
    lse = tl.load(LSE + b.to(tl.int64) * stride_lse[0] + h.to(tl.int64) * stride_lse[1]
                  + q_start + offs_m, mask=row_ok, other=float("inf"))
    stats = STATS + stats_row0(b, h, q_start, stride_stats) + offs_m
    padded = offs_m < tl.cdiv(q_len, ROW_PAD) * ROW_PAD
    tl.store(stats, tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E), mask=padded)
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(stats + stride_stats[2], tl.sum(o * do, axis=1), mask=padded)


@triton.jit
def _bwd_dkdv(Q, K, V, DO, STATS, DK, DV, DESC_Q, DESC_DO, DESC_STATS, strides,
              seq, score, drop,
              BUCKETS,  # autotune key only: Problem.tune_buckets
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_DV: tl.constexpr, SPEC: tl.constexpr,
              VARLEN: tl.constexpr, DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
              WIDEN: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """dK, dV for one block of BLOCK_N keys of one (batch or packed sequence, kv head).

    Q: (B, heads_q, q_len, HEAD_DIM), DO: (B, heads_q, q_len, HEAD_DIM_V); K, DK: (B, heads_kv,
    k_len, HEAD_DIM), V, DV: (B, heads_kv, k_len, HEAD_DIM_V), with heads_q = seq.group *
    heads_kv; any strides with a unit last one; ``strides`` (``BwdStrides``): ``strides.x`` =
    x's (batch, head, row) strides, read below as ``stride_x`` (VARLEN: packed as in the
    forward). STATS: ``_bwd_preprocess``'s padded fp32 row statistics, lse2 = lse · log2 e
    (+inf for rows that see no key) and delta, ``strides.stats`` their (batch, head, plane)
    strides (``stats_layout``). ``seq``, ``score``, ``drop``, SPEC: as in the forward. TMA
    (``bwd_tma_modes``): 0 = per-thread masked loads; 1 = the streamed tiles (Q, dO and the row
    statistics here, K and V in dQ) by tensor descriptors made per program over that
    (sequence, head)'s rows (``tma.row_tiles``: zeros past the rows and the head dim, as the
    masked loads give); 3 (``TMA_HOST``, dense calls) = through host descriptors made once per
    call instead: ``DESC_Q``, ``DESC_DO`` over the whole (B, heads_q, q_len, D or Dv) Q and dO,
    block (1, 1, BLOCK_M, BLOCK_D or BLOCK_DV), and ``DESC_STATS`` over the (2, B, heads_q,
    padded rows) statistics, block (2, 1, 1, BLOCK_M) (both planes' tile in one copy; blocks
    set by each config's ``set_bwd_desc_blocks``); Q, DO and STATS are then not read (the
    plan's dummy); None (constexpr) in the other modes. Grid: (cdiv(k_len or max_seqlen_k,
    BLOCK_N), heads_kv, batch or number of sequences).

    The group of query heads that share this kv head are summed here, one after another in a
    fixed order: no atomics, so dK and dV are bit-reproducible with grouped-query heads too.
    Works in the transposed orientation (keys x queries) so that every dot takes a loaded tile
    or a freshly computed one as is: Q is loaded as Q^T, and only loaded tiles get tl.trans.
    """
    # Heads and batch on grid axes 1 and 2 (65535 each), not one B*H axis. Causal: the first
    # key blocks (seen by the most queries) are the longest and start first in each head
    # (``tiles.program_ids`` says why not every head's first, as in the forward).
    pid_n, kv_h, b = program_ids(False, True)
    stride_q, stride_k, stride_v, stride_do = strides.q, strides.k, strides.v, strides.do
    stride_dk, stride_dv, stride_stats = strides.dk, strides.dv, strides.stats
    q_start, q_len, k_start, k_len = seq_bounds(b, seq, VARLEN, False)
    start_n = pid_n * BLOCK_N
    if VARLEN:
        # The grid covers the longest sequence; shorter ones leave programs with no keys.
        if start_n >= k_len:
            return
    # 64-bit base offsets: batch * stride_b passes 2**31 for large tensors.
    off_b = b.to(tl.int64)
    q_rows = tl.cast(q_start, tl.int64)
    k_rows = tl.cast(k_start, tl.int64) + start_n
    K += off_b * stride_k[0] + kv_h.to(tl.int64) * stride_k[1] + k_rows * stride_k[2]
    V += off_b * stride_v[0] + kv_h.to(tl.int64) * stride_v[1] + k_rows * stride_v[2]
    DK += off_b * stride_dk[0] + kv_h.to(tl.int64) * stride_dk[1] + k_rows * stride_dk[2]
    DV += off_b * stride_dv[0] + kv_h.to(tl.int64) * stride_dv[1] + k_rows * stride_dv[2]

    cols = tl.arange(0, BLOCK_N)
    offs_n = start_n + cols
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    k_mask = (offs_n[:, None] < k_len) & d_ok[None, :]
    v_mask = (offs_n[:, None] < k_len) & dv_ok[None, :]
    k = widen(tl.load(K + cols[:, None] * stride_k[2] + offs_d[None, :], mask=k_mask,
                      other=0.0), WIDEN)                                    # (BLOCK_N, BLOCK_D)
    v = widen(tl.load(V + cols[:, None] * stride_v[2] + offs_dv[None, :], mask=v_mask,
                      other=0.0), WIDEN)                                    # (BLOCK_N, BLOCK_DV)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    diag = k_len - q_len
    rows0 = tl.arange(0, BLOCK_M)
    CAUSAL: tl.constexpr = SPEC.causal
    lo, full_lo, full_hi, hi = query_range(start_n, q_len, k_len, score.window, CAUSAL,
                                           SPEC.edge, BLOCK_M, BLOCK_N)
    if SPEC.mask_ranges is not None:
        # The mask mod's own bound on the query rows that see these keys (kernels/core/mods.py).
        c0, c1 = mask_query_bounds(b, start_n, diag, k_len, score, SPEC, BLOCK_M, BLOCK_N)
        lo, full_lo, full_hi, hi = clamp_ranges(lo, full_lo, full_hi, hi, c0, c1)

    # The first query tiles run before the pipelined loop: the causal diagonal, or without a
    # causal mask (no diagonal) the first unmasked tile, peeled off. A pipelined loop that
    # starts from the zeroed accumulators makes ptxas serialize this kernel's wgmma on sm_90
    # (C7515; seen with dropout, docs/gpu.md).
    if CAUSAL:
        diag_hi = full_lo
    else:
        diag_hi = tl.minimum(full_lo + BLOCK_M, full_hi)
    unmasked_lo = tl.maximum(full_lo, diag_hi)
    MASKED: tl.constexpr = (CAUSAL, False, True)
    k_edge = edge_bound(offs_n, score.window, SPEC.edge, True)[:, None] \
        if SPEC.edge != 0 else 0

    if TMA == 1:
        # The row statistics as a (2, plane) matrix, read (2, BLOCK_M) at a time: one copy
        # for lse2 and delta (two copies were 144 more instructions per 128² tile at head_dim
        # 64, per-thread cp.async 416 more; docs/gpu.md). int32 coordinates:
        # ``bwd_tma_modes`` checks the size.
        stats_desc = tl.make_tensor_descriptor(STATS, shape=[2, stride_stats[2]],
                                               strides=[stride_stats[2], 1],
                                               block_shape=[2, BLOCK_M])
    # Never software-pipelined (num_stages=1): it holds the pipelined query loops, but where
    # those fold away (q_len == 1 is specialised to a constant) it would be the innermost
    # loop, and the pipeliner cannot predicate the descriptor made in it (a compile error
    # on sm_90, seen on an H200).
    for g in tl.range(0, seq.group, num_stages=1):
        h32 = kv_h * seq.group + g             # int32: a host descriptor's head coordinate
        h = h32.to(tl.int64)
        Q_h = Q + off_b * stride_q[0] + h * stride_q[1] + q_rows * stride_q[2]
        DO_h = DO + off_b * stride_do[0] + h * stride_do[1] + q_rows * stride_do[2]
        if TMA == 1:
            # This (sequence, query head)'s rows (at least 1: a descriptor of an empty
            # sequence is never read).
            n_rows = tl.maximum(q_len, 1) if VARLEN else q_len
            q_desc = row_tiles(Q_h, n_rows, stride_q[2], HEAD_DIM, BLOCK_M, BLOCK_D)
            do_desc = row_tiles(DO_h, n_rows, stride_do[2], HEAD_DIM_V, BLOCK_M, BLOCK_DV)
        row0 = stats_row0(b, h, q_start, stride_stats)
        lse2_h = STATS + row0
        delta_h = lse2_h + stride_stats[2]
        if TMA == 1:
            stats_row = row0.to(tl.int32)      # the descriptor's (int32) column of row 0
        drop_rows = off_b * drop.row_stride_b + h * drop.row_stride_h + q_rows + drop.row0
        if DROPOUT:
            drop_seed = load_seed(drop)
        # Query tiles in up to three ranges: RANGE 0 the causal diagonal (masked; without
        # causal, the peeled first tile, unmasked), RANGE 1 the rows that see every key of the
        # block (unmasked), RANGE 2 the window's / chunk's far edge (masked; only with an edge).
        # Key columns past k_len need no mask: they only reach dK/dV rows that are not stored.
        for RANGE in tl.static_range(0, 3 if SPEC.edge != 0 else 2):
            if RANGE == 0:
                range_lo, range_hi = lo, diag_hi
            elif RANGE == 1:
                range_lo, range_hi = unmasked_lo, full_hi
            else:
                range_lo, range_hi = full_hi, hi
            for start_m in range(range_lo, range_hi, BLOCK_M):
                offs_m = start_m + rows0
                if TMA == TMA_HOST:
                    qT = tl.trans(desc_tile(DESC_Q, b, h32, start_m, BLOCK_M, BLOCK_D))
                    do = desc_tile(DESC_DO, b, h32, start_m, BLOCK_M, BLOCK_DV)
                elif TMA:
                    qT = tl.trans(q_desc.load([start_m, 0]))
                    do = do_desc.load([start_m, 0])
                else:
                    row_ok = offs_m < q_len
                    # 64-bit tile bases: seq_len * row stride can pass 2**31.
                    qT = tl.load(Q_h + tl.cast(start_m, tl.int64) * stride_q[2]
                                 + rows0[None, :] * stride_q[2] + offs_d[:, None],
                                 mask=row_ok[None, :] & d_ok[:, None], other=0.0)
                    do = tl.load(DO_h + tl.cast(start_m, tl.int64) * stride_do[2]
                                 + rows0[:, None] * stride_do[2] + offs_dv[None, :],
                                 mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
                qT = widen(qT, WIDEN)                                       # (BLOCK_D, BLOCK_M)
                do = widen(do, WIDEN)                                      # (BLOCK_M, BLOCK_DV)
                # Whole tiles, unmasked: the stats are padded (``_bwd_preprocess``).
                if TMA == TMA_HOST:
                    # One copy of both planes' tile: (2, 1, 1, BLOCK_M) -> lse2, delta.
                    lse2, delta = tl.split(tl.trans(DESC_STATS.load(
                        [0, b, h32, start_m]).reshape([2, BLOCK_M])))
                elif TMA:
                    # One copy of both planes' tile: (2, BLOCK_M) -> lse2, delta.
                    lse2, delta = tl.split(tl.trans(stats_desc.load([0, stats_row + start_m])))
                else:
                    lse2 = tl.load(lse2_h + offs_m)
                    delta = tl.load(delta_h + offs_m)

                qkT = tl.dot(k, qT, input_precision=DOT_PRECISION)          # (BLOCK_N, BLOCK_M)
                xT, x_scale = scaled_scores(qkT, b, h, offs_m[None, :], offs_n[:, None], diag,
                                            score, SPEC)
                pT = probs_from_lse(xT, x_scale, lse2[None, :], b, h, offs_m[None, :],
                                    offs_n[:, None], k_len, diag, k_edge, score, SPEC,
                                    MASKED[RANGE], True)
                dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dPd^T = V dO^T
                if DROPOUT:
                    # The forward's bits: the mask depends on (seed, row id, j), not on blocks.
                    # Generated (queries x keys) and transposed as a byte tile rather than i1:
                    # the conservative element type for a layout change through shared memory.
                    keep = dropout_keep(drop, drop_seed, drop_rows, offs_m, start_n, BLOCK_M,
                                        BLOCK_N, DROPOUT)
                    keepT = tl.trans(keep.to(tl.int8)) != 0
                    pdT = tl.where(keepT, pT * drop.scale, 0.0)
                    dpT = tl.where(keepT, dpT * drop.scale, 0.0)
                else:
                    pdT = pT
                dv = tl.dot(dot_operand(pdT, do, WIDEN), do, dv, input_precision=DOT_PRECISION)
                dsT = score_grad(pT * (dpT - delta[None, :]), qkT, b, h, offs_m[None, :],
                                 offs_n[:, None], diag, score, SPEC)
                dk = tl.dot(dot_operand(dsT, qT, WIDEN), tl.trans(qT), dk,
                            input_precision=DOT_PRECISION)

    # dK = scale * dS^T Q: the scale is applied once here instead of on every tile.
    dk = round_for_store(dk * score.softmax_scale, WIDEN)
    dv = round_for_store(dv, WIDEN)
    tl.store(DK + cols[:, None] * stride_dk[2] + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DV + cols[:, None] * stride_dv[2] + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit
def _bwd_dq(Q, K, V, DO, STATS, DQ, DESC_K, DESC_V, strides,
            seq, score, drop,
            BUCKETS,  # autotune key only: Problem.tune_buckets
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
            BLOCK_DV: tl.constexpr, SPEC: tl.constexpr,
            VARLEN: tl.constexpr, DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
            WIDEN: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """dQ for one block of BLOCK_M queries of one (batch or packed sequence, query head).

    Shapes, strides and grouped arguments as in ``_bwd_dkdv``; DQ like Q. Query head h reads
    kv head h // seq.group. K and V are loaded transposed ((BLOCK_D or BLOCK_DV), BLOCK_N) so
    S = Q K^T and dPd = dO V^T need no register transpose. TMA as in ``_bwd_dkdv``, for the K
    and V tiles: with TMA_HOST through ``DESC_K``, ``DESC_V``, host descriptors of the whole
    (B, heads_kv, k_len, D or Dv) K and V, block (1, 1, BLOCK_N, BLOCK_D or BLOCK_DV); K and V
    are then not read. Grid: (cdiv(q_len or max_seqlen_q, BLOCK_M), heads_q, batch or number
    of sequences).
    """
    # Causal: the last query blocks see the most keys; each head's are issued first, so the
    # short ones fill the tail. (Not every head's first, as the forward does: ``program_ids``'s
    # re-read indices spilled this kernel on sm_80 and sm_100.) Heads and batch on grid axes 1
    # and 2 (65535 each), not one B*H axis.
    pid_m, h, b = program_ids(False, False)
    pid_m = tl.num_programs(0) - 1 - pid_m
    stride_q, stride_k, stride_v, stride_do = strides.q, strides.k, strides.v, strides.do
    stride_dq, stride_stats = strides.dq, strides.stats
    q_start, q_len, k_start, k_len = seq_bounds(b, seq, VARLEN, False)
    start_m = pid_m * BLOCK_M
    if VARLEN:
        if start_m >= q_len:
            return
    off_b = b.to(tl.int64)
    kv_h32 = h // seq.group                    # int32: the host descriptors' head coordinate
    kv_h = kv_h32.to(tl.int64)
    q_rows = tl.cast(q_start, tl.int64)
    k_rows = tl.cast(k_start, tl.int64)
    Q += off_b * stride_q[0] + h.to(tl.int64) * stride_q[1] + q_rows * stride_q[2]
    DO += off_b * stride_do[0] + h.to(tl.int64) * stride_do[1] + q_rows * stride_do[2]
    DQ += off_b * stride_dq[0] + h.to(tl.int64) * stride_dq[1] + q_rows * stride_dq[2]
    K += off_b * stride_k[0] + kv_h * stride_k[1] + k_rows * stride_k[2]
    V += off_b * stride_v[0] + kv_h * stride_v[1] + k_rows * stride_v[2]
    lse2_h = STATS + stats_row0(b, h, q_start, stride_stats)
    drop_rows = off_b * drop.row_stride_b + h.to(tl.int64) * drop.row_stride_h + q_rows \
        + drop.row0
    if DROPOUT:
        drop_seed = load_seed(drop)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_mask = (offs_m < q_len)[:, None] & (offs_d[None, :] < HEAD_DIM)
    do_mask = (offs_m < q_len)[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    # Tile pointers built from the batch/head base: 64-bit row offsets, as in the dK/dV kernel.
    q = widen(tl.load(Q + offs_m[:, None].to(tl.int64) * stride_q[2] + offs_d[None, :],
                      mask=q_mask, other=0.0), WIDEN)                       # (BLOCK_M, BLOCK_D)
    do = widen(tl.load(DO + offs_m[:, None].to(tl.int64) * stride_do[2] + offs_dv[None, :],
                       mask=do_mask, other=0.0), WIDEN)                     # (BLOCK_M, BLOCK_DV)
    # Whole tiles, unmasked (the stats are padded). Rows that see no key have lse2 = +inf,
    # P = 0, so their dQ row is 0.
    lse2 = tl.load(lse2_h + offs_m)
    delta = tl.load(lse2_h + stride_stats[2] + offs_m)
    if TMA == 1:
        # This (sequence, kv head)'s key rows (at least 1: an empty sequence's descriptor is
        # never read).
        n_keys = tl.maximum(k_len, 1) if VARLEN else k_len
        k_desc = row_tiles(K, n_keys, stride_k[2], HEAD_DIM, BLOCK_N, BLOCK_D)
        v_desc = row_tiles(V, n_keys, stride_v[2], HEAD_DIM_V, BLOCK_N, BLOCK_DV)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    diag = k_len - q_len
    cols0 = tl.arange(0, BLOCK_N)

    # The forward's three ranges of key tiles (kernels/core/tiles.py): RANGE 0 the window's /
    # chunk's edge (masked; only with an edge), RANGE 1 unmasked, RANGE 2 the diagonal / k_len edge
    # (masked). As in the forward, the diagonal loop after the unmasked one runs unpipelined:
    # pipelined, ptxas serializes the kernel's wgmma on sm_90 (C7515; docs/gpu.md).
    lo, full_lo, full_hi, hi = key_range(start_m, start_m + BLOCK_M, q_len, k_len, score.window,
                                         SPEC.causal, SPEC.edge, BLOCK_N)
    if SPEC.mask_ranges is not None:
        c0, c1 = mask_key_bounds(b, start_m, start_m + BLOCK_M, diag, k_len, score, SPEC,
                                 BLOCK_N)
        lo, full_lo, full_hi, hi = clamp_ranges(lo, full_lo, full_hi, hi, c0, c1)
    MASKED: tl.constexpr = (True, False, True)
    q_edge = edge_bound(offs_m + diag, score.window, SPEC.edge, False)[:, None] \
        if SPEC.edge != 0 else 0
    for RANGE in tl.static_range(0 if SPEC.edge != 0 else 1, 3):
        if RANGE == 0:
            range_lo, range_hi = lo, full_lo
        elif RANGE == 1:
            range_lo, range_hi = full_lo, full_hi
        else:
            range_lo, range_hi = full_hi, hi
        for start_n in tl.range(range_lo, range_hi, BLOCK_N,
                                num_stages=1 if RANGE == 2 else None):
            offs_n = start_n + cols0
            if TMA == TMA_HOST:
                kT = tl.trans(desc_tile(DESC_K, b, kv_h32, start_n, BLOCK_N, BLOCK_D))
                vT = tl.trans(desc_tile(DESC_V, b, kv_h32, start_n, BLOCK_N, BLOCK_DV))
            elif TMA:
                kT = tl.trans(k_desc.load([start_n, 0]))
                vT = tl.trans(v_desc.load([start_n, 0]))
            else:
                k_mask = (offs_n[None, :] < k_len) & (offs_d[:, None] < HEAD_DIM)
                v_mask = (offs_n[None, :] < k_len) & (offs_dv[:, None] < HEAD_DIM_V)
                # 64-bit tile bases, 32-bit offsets inside the tile.
                kT = tl.load(K + tl.cast(start_n, tl.int64) * stride_k[2]
                             + cols0[None, :] * stride_k[2] + offs_d[:, None],
                             mask=k_mask, other=0.0)
                vT = tl.load(V + tl.cast(start_n, tl.int64) * stride_v[2]
                             + cols0[None, :] * stride_v[2] + offs_dv[:, None],
                             mask=v_mask, other=0.0)
            kT = widen(kT, WIDEN)                                           # (BLOCK_D, BLOCK_N)
            vT = widen(vT, WIDEN)                                          # (BLOCK_DV, BLOCK_N)

            qk = tl.dot(q, kT, input_precision=DOT_PRECISION)               # (BLOCK_M, BLOCK_N)
            # Unlike dK/dV, columns past k_len must be zeroed here (MASKED[2] covers the k_len
            # edge): their P = exp(-lse) is meaningless (it overflows for very negative lse)
            # and would reach every dQ row.
            x, x_scale = scaled_scores(qk, b, h, offs_m[:, None], offs_n[None, :], diag, score,
                                       SPEC)
            p = probs_from_lse(x, x_scale, lse2[:, None], b, h, offs_m[:, None],
                               offs_n[None, :], k_len, diag, q_edge, score, SPEC, MASKED[RANGE],
                               False)
            dp = tl.dot(do, vT, input_precision=DOT_PRECISION)              # dPd = dO V^T
            if DROPOUT:
                keep = dropout_keep(drop, drop_seed, drop_rows, offs_m, start_n, BLOCK_M, BLOCK_N,
                                    DROPOUT)
                dp = tl.where(keep, dp * drop.scale, 0.0)
            ds = p * (dp - delta[:, None])          # dL/d(the final scores)
            # d(mod_aux) here only: dQ visits each (query block, key tile) pair once. Nothing
            # unless the launch's SPEC carries an aux_grad (kernels/core/mods.py).
            mods_aux_grad(ds, qk, b, h, offs_m[:, None], offs_n[None, :], diag, score, SPEC)
            ds = score_grad(ds, qk, b, h, offs_m[:, None], offs_n[None, :], diag, score, SPEC)
            dq = tl.dot(dot_operand(ds, kT, WIDEN), tl.trans(kT), dq,
                        input_precision=DOT_PRECISION)

    dq = round_for_store(dq * score.softmax_scale, WIDEN)
    tl.store(DQ + offs_m[:, None].to(tl.int64) * stride_dq[2] + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


# Each kernel's host descriptor parameters (``TMA_HOST``).
_DKDV_DESCS = ("DESC_Q", "DESC_DO", "DESC_STATS")
_DQ_DESCS = ("DESC_K", "DESC_V")
# The host descriptors' blocks (``TMA_HOST``): the (rows, width) constexprs of each 4-D
# tensor's (1, 1, rows, width) block; the row statistics' is (2, 1, 1, BLOCK_M).
_DESC_BLOCKS = {"DESC_Q": ("BLOCK_M", "BLOCK_D"), "DESC_DO": ("BLOCK_M", "BLOCK_DV"),
                "DESC_K": ("BLOCK_N", "BLOCK_D"), "DESC_V": ("BLOCK_N", "BLOCK_DV")}


def set_bwd_desc_blocks(nargs):
    """A backward config's ``pre_hook`` (as ``forward.set_desc_blocks`` is the forward's):
    the host descriptors' blocks for the config's tiles (``_DESC_BLOCKS``; DESC_STATS (2, 1, 1,
    BLOCK_M): both planes of BLOCK_M rows). The autotuner calls it before timing or launching
    a config, as ``launch_first_compiling`` does; nothing to do without host descriptors."""
    set_row_blocks(nargs, _DESC_BLOCKS)
    stats = nargs.get("DESC_STATS")
    if stats is not None:
        stats.block_shape = [2, 1, 1, nargs["BLOCK_M"]]


def _with_desc_blocks(configs):
    """``configs`` as copies whose pre_hook is ``set_bwd_desc_blocks``."""
    return with_pre_hook(configs, set_bwd_desc_blocks)


# On a GPU each kernel is autotuned separately (dK/dV favours long key blocks, dQ long query
# blocks), keyed by configs.BWD_TUNE_KEY. Both kernels only store their outputs (nothing
# accumulates into them), so re-running a config while tuning is harmless: no reset_to_zero.
_bwd_dkdv_tuned = triton.autotune(configs=_with_desc_blocks(bwd_configs(kernel="dkdv")),
                                  key=BWD_TUNE_KEY,
                                  prune_configs_by={"early_config_prune": prune_bwd_configs}
                                  )(_bwd_dkdv)
_bwd_dq_tuned = triton.autotune(configs=_with_desc_blocks(bwd_configs(kernel="dq")),
                                key=BWD_TUNE_KEY,
                                prune_configs_by={"early_config_prune": prune_bwd_configs}
                                )(_bwd_dq)


def bwd_tma_modes(pb, do, dropout=False) -> tuple:
    """The TMA constexprs (``_bwd_dkdv``'s docstring) of the dK/dV and dQ launches on problem
    ``pb`` with output gradient ``do`` (4-D, as the kernels see it), where the GPU takes
    tensor descriptors (``tma_capable``: sm_90, and the interpreter) and the tiles that kernel
    streams can be read by them (``tma_rows_ok``: Q and dO for dK/dV; K and V for dQ):
    ``TMA_HOST_MODE`` (3) for dense calls whose streamed tensors ``tma.host_desc_layout``
    describes whole (descriptors made once per call on the host; not with KERNELS_TMA=kernel,
    ``configs.host_descriptors_enabled``), else 1 (made per program in the kernel; dK/dV's
    row statistics then need int32 coordinates). Else 0 (per-thread loads: strides or bases
    that are not multiples of 16 bytes, a zero row stride, head dims padded past 256, other
    GPUs; and dK/dV with dropout at padded head dims over ``TMA_DKDV_DROPOUT_MAX_WIDTH``,
    where the descriptor path spilled)."""
    if not tma_capable(pb.q.device):
        return 0, 0
    width, width_v = block_d(pb.q.shape[-1]), block_d(pb.v.shape[-1])
    host = not pb.varlen and host_descriptors_enabled()

    def mode(a, b, n_rows, in_kernel_ok=True):
        if not (tma_rows_ok(a, pb.strides(a), n_rows, width)
                and tma_rows_ok(b, pb.strides(b), n_rows, width_v)):
            return 0
        if host and host_desc_layout(a) is not None and host_desc_layout(b) is not None:
            return TMA_HOST_MODE
        return int(in_kernel_ok)

    dkdv = 0 if dropout and max(width, width_v) > TMA_DKDV_DROPOUT_MAX_WIDTH else mode(
        pb.q, do, pb.q_len, stats_layout(pb)[1][2] < 2 ** 31)
    return dkdv, mode(pb.k, pb.v, pb.k_len)


def attention_backward(do, q, k, v, o, lse, call=None, *, cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q=None, max_seqlen_k=None, config=None, tma=None,
                       daux=None, **call_fields):
    """Gradients of ``o = attention(q, k, v)`` given ``do = dL/do``.

    Args:
        do: shaped like o, any strides (made unit-stride on the last dim if it is not).
        q: (B, heads_q, q_len, D); k: (B, heads_kv, k_len, D), v: (B, heads_kv, k_len, Dv),
            heads_q % heads_kv == 0. Packed sequences (with ``cu_seqlens_q``): q (total_q,
            heads_q, D), k (total_k, heads_kv, D), v (total_k, heads_kv, Dv). fp16, bf16 or
            fp32, one dtype; any strides with a unit-stride last dim. D, Dv in 1..512.
        o: the forward's output, shaped like q with Dv (q's dtype).
        lse: the forward's fp32 contiguous natural-log row log-sum-exp of the scaled scores,
            (B, heads_q, q_len) or (heads_q, total_q); -inf for rows that see no key (with
            sinks, the lse that includes them).
        call: the forward's ``AttentionCall`` (kernels/core/call.py), or its fields as
            keywords (``causal=``, ``softmax_scale=``, ``dropout_p=``, ``seed=``, ...).
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: as given to
            ``attention_forward``.
        config: a ``triton.Config`` with BLOCK_M, BLOCK_N (tests only); default: autotuned
            on a GPU, ``bwd_configs(interpret=True)[0]`` under the interpreter.
        tma: both kernels' TMA mode to force (0 = per-thread loads; tests); default
            ``bwd_tma_modes``.
        daux: None, or a list parallel to ``call.mods.aux``: fp32 zeroed gradient buffers
            (``mods.aux_grad_buffers``) where d(aux) is wanted, None elsewhere; the dQ kernel
            adds the score mod's aux gradients into them (atomics: kernels/core/mods.py).

    Returns:
        (dq, dk, dv), each with the shape, dtype and memory layout of q, k, v
        (``torch.empty_like``). dk, dv of a kv head sum its whole group of query heads.
    """
    call = call or AttentionCall(**call_fields)
    if do.stride(-1) != 1:
        # e.g. the expanded, all-zero-stride gradient of o.sum(): one copy, then unit stride.
        do = do.contiguous()
    plan = BackwardPlan(do, q, k, v, o, lse, call, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k, config=config, tma=tma,
                        aux_grad=daux is not None)
    return plan(do, q, k, v, o, lse, call, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, daux=daux)


class BackwardPlan:
    """The three launches of the backward (preprocess, dK/dV, dQ) for one call signature,
    as ``ForwardPlan`` is the forward's: built once, called per call with that signature's
    tensors (``do`` with a unit last stride). The tensors given to ``__init__`` are not kept.
    ``aux_grad``: the dQ launch also accumulates the score mod's d(aux) (``__call__``'s
    ``daux``, required then); the plan of a call without it compiles as before."""

    def __init__(self, do, q, k, v, o, lse, call, *, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, config=None, tma=None, aux_grad=False):
        pb = make_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        head_dim, head_dim_v = q.shape[-1], v.shape[-1]
        assert v.shape[:-1] == k.shape[:-1] and k.shape[-1] == head_dim
        assert do.shape == o.shape == (*q.shape[:-1], head_dim_v)
        assert lse.shape == pb.lse_shape and lse.dtype == torch.float32 and lse.is_contiguous()
        assert q.dtype == k.dtype == v.dtype and 1 <= head_dim <= 512 and 1 <= head_dim_v <= 512
        assert 0.0 <= call.dropout_p < 1.0
        self.empty = pb.batch * pb.heads == 0 or pb.q.shape[2] == 0 or pb.k.shape[2] == 0
        if self.empty:
            return
        self.varlen, self.dropout = pb.varlen, call.dropout
        self.aux_grad = aux_grad = bool(aux_grad) and call.mods.score_mod is not None \
            and call.mods.score_mod.aux_grad is not None
        self.pb = pb._replace(q=None, k=None, v=None)
        if pb.varlen:
            do, o = packed_view(do), packed_view(o)
        BLOCK_DV = block_d(head_dim_v)
        # The row statistics, padded to whole tiles; delta in lse's row order, so the dropout
        # row ids (lse offsets) stay the tiles' own.
        self.stats_shape, stats_strides = stats_layout(pb)
        self.dummy = dummy = torch.empty(1, dtype=torch.float32, device=q.device)
        self.seq = None if pb.varlen else pb.seq_args(dummy)
        # The seed pointer: a dummy here, the call's seed tensor per call with dropout.
        self.drop = pb.drop_args(call, dummy, seed=dummy)
        self.score = None if call.mods.has_tensors else score_args(call, dummy)
        pre_block_m = min(64, _PRE_BLOCK_ELEMS // BLOCK_DV)
        pre_grid = (triton.cdiv(pb.q_len, BWD_ROW_PAD) * BWD_ROW_PAD // pre_block_m,
                    pb.heads, pb.batch)
        self.pre = KernelStep(_bwd_preprocess, lambda cfg: pre_grid, dict(
            stride_o=pb.strides(o), stride_do=pb.strides(do), stride_lse=pb.lse_strides,
            stride_stats=stats_strides, HEAD_DIM=head_dim_v, VARLEN=pb.varlen,
            ROW_PAD=BWD_ROW_PAD, BLOCK_M=pre_block_m, BLOCK_D=BLOCK_DV), configs=[None])

        # dq, dk, dv are allocated like q, k, v (``torch.empty_like``): their strides too.
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        dq4, dk4, dv4 = (packed_view(t) for t in (dq, dk, dv)) if pb.varlen else (dq, dk, dv)
        strides = BwdStrides(q=pb.strides(pb.q), k=pb.strides(pb.k), v=pb.strides(pb.v),
                             do=pb.strides(do), dq=pb.strides(dq4), dk=pb.strides(dk4),
                             dv=pb.strides(dv4), stats=stats_strides)
        common = dict(strides=strides, BUCKETS=pb.tune_buckets(),
                      HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), HEAD_DIM_V=head_dim_v,
                      # Sinks are in lse already: the backward compiles as without them.
                      BLOCK_DV=BLOCK_DV, SPEC=score_spec(call, q.dtype)._replace(sinks=False),
                      VARLEN=pb.varlen,
                      DROPOUT=call.dropout_mode, DOT_PRECISION=dot_precision(q.dtype),
                      WIDEN=widen_bf16(q.dtype))
        tma_dkdv, tma_dq = bwd_tma_modes(pb, do, call.dropout) if tma is None else (tma, tma)
        # Host descriptors (TMA_HOST): made per call from the tensors each kernel streams, passed
        # as its DESC_* parameters (KernelStep's ``descs``: kernel parameter -> (per-call
        # tensor, shape, strides)); the kernel then reads nothing through the tensors'
        # own parameters, which get the plan's dummy (a fixed pointer: nothing to look up per
        # call). dK/dV: Q, dO and the row statistics (fresh per call, ``stats_layout``: the
        # planes, batch, head strides); dQ: K and V.
        assert not (pb.varlen and TMA_HOST_MODE in (tma_dkdv, tma_dq)), \
            "host descriptors are for dense calls"

        dkdv_descs = host_descs((("DESC_Q", pb.q), ("DESC_DO", do))) \
            if tma_dkdv == TMA_HOST_MODE else {}
        if dkdv_descs:
            stride_b, stride_h, stride_plane = stats_strides
            dkdv_descs["DESC_STATS"] = ("DESC_STATS", list(self.stats_shape),
                                        [stride_plane, stride_b, stride_h, 1])
        dq_descs = host_descs((("DESC_K", pb.k), ("DESC_V", pb.v))) \
            if tma_dq == TMA_HOST_MODE else {}
        self.dkdv_params = tuple(f"DESC_{n}" if dkdv_descs else n for n in ("Q", "DO", "STATS"))
        self.dq_params = tuple(f"DESC_{n}" if dq_descs else n for n in ("K", "V"))
        dkdv_fixed = dict(common, TMA=tma_dkdv, **{n: None for n in _DKDV_DESCS
                                                   if n not in dkdv_descs},
                          **(dict(Q=dummy, DO=dummy, STATS=dummy) if dkdv_descs else {}))
        dq_fixed = dict(common, TMA=tma_dq, **{n: None for n in _DQ_DESCS if n not in dq_descs},
                        **(dict(K=dummy, V=dummy) if dq_descs else {}))
        if aux_grad:
            # The user's mod is the pipeline's last (CallMods.score_mods); only dQ's SPEC
            # carries its aux_grad, so dK/dV compiles as without it.
            mods = common["SPEC"].mods
            dq_fixed["SPEC"] = common["SPEC"]._replace(mods=mods[:-1] + (mods[-1]._replace(
                aux_grad=call.mods.score_mod.aux_grad),))

        def dkdv_grid(cfg):
            return (triton.cdiv(pb.k_len, cfg["BLOCK_N"]), pb.heads_kv, pb.batch)

        def dq_grid(cfg):
            return (triton.cdiv(pb.q_len, cfg["BLOCK_M"]), pb.heads, pb.batch)

        if config is None and not interpreter_active() and autotune_enabled():
            configs_dkdv = configs_dq = None
        elif config is not None:
            configs_dkdv = configs_dq = _with_desc_blocks([config])
        elif interpreter_active():
            # Under the interpreter autotuning would time every config in Python: one config.
            configs_dkdv = configs_dq = _with_desc_blocks(bwd_configs(interpret=True))
        else:  # KERNELS_AUTOTUNE=0: each kernel's pruned list, its first config that compiles
            tensors = dict(Q=pb.q, K=pb.k, V=pb.v, DO=do, STATS=dummy, seq=self.seq,
                           score=self.score, drop=self.drop)
            configs_dkdv = fixed_configs(_with_desc_blocks(bwd_configs(kernel="dkdv")),
                                         prune_bwd_configs,
                                         dict(dkdv_fixed, **tensors, DK=dk4, DV=dv4))
            configs_dq = fixed_configs(_with_desc_blocks(bwd_configs(kernel="dq")),
                                       prune_bwd_configs, dict(dq_fixed, **tensors, DQ=dq4))
        if aux_grad and config is None and not interpreter_active():
            # dQ then adds into d(aux): autotuning reruns would add several times. The first
            # pruned config that compiles, as with KERNELS_AUTOTUNE=0, among tiles of at most
            # 128 x 32 scores where there are some: the aux_grad's index and dS tiles live
            # across its atomics, and the 128 x 64 tile spilled with the tests' bias + slopes
            # mod at head_dim 128 (sm_90, 2026-11-26; 128 x 32 did not).
            kept = configs_dq or fixed_configs(_with_desc_blocks(bwd_configs(kernel="dq")),
                                               prune_bwd_configs, dict(
                dq_fixed, Q=pb.q, K=pb.k, V=pb.v, DO=do, STATS=dummy, seq=self.seq,
                score=self.score, drop=self.drop, DQ=dq4))
            configs_dq = [c for c in kept
                          if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 4096] or kept
        for configs in (configs_dkdv, configs_dq):
            for cfg in configs or ():     # the stats' padding covers every tile's rows
                assert BWD_ROW_PAD % cfg.kwargs["BLOCK_M"] == 0, cfg
        self.dkdv = KernelStep(_bwd_dkdv, dkdv_grid, dkdv_fixed, configs=configs_dkdv,
                               tuned=_bwd_dkdv_tuned, scratch=tma_dkdv == 1, descs=dkdv_descs)
        self.dq = KernelStep(_bwd_dq, dq_grid, dq_fixed, configs=configs_dq,
                             tuned=_bwd_dq_tuned, scratch=tma_dq == 1, descs=dq_descs)

    def __call__(self, do, q, k, v, o, lse, call, *, cu_seqlens_q=None, cu_seqlens_k=None,
                 seed=None, daux=None):
        """(dq, dk, dv) of this signature's tensors, as ``attention_backward`` returns them;
        ``call`` gives the per-call tensors (the seed, or ``seed``: its tensor on q's device;
        the mods' aux tensors). ``daux``: with ``aux_grad``, the gradient buffers
        (``attention_backward``), added into."""
        assert (daux is not None) == getattr(self, "aux_grad", daux is not None), \
            "daux is given exactly when the plan was built with aux_grad"
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if self.empty:
            return dq.zero_(), dk.zero_(), dv.zero_()
        device, dummy = q.device, self.dummy
        if self.varlen:
            q, k, v, do, o, dq4, dk4, dv4 = (packed_view(t) for t in (q, k, v, do, o, dq, dk,
                                                                       dv))
            seq = self.pb._replace(cu_q=cu_seqlens_q, cu_k=cu_seqlens_k).seq_args(dummy)
        else:
            dq4, dk4, dv4, seq = dq, dk, dv, self.seq
        try:
            stats_like = self.stats_like
        except AttributeError:
            # The first call: the statistics as ``torch.empty_like`` of a float32 scalar
            # expanded to their shape (contiguous, as ``torch.empty`` gives them), about half
            # ``torch.empty``'s host cost per call.
            with torch.inference_mode(False):
                stats_like = self.stats_like = torch.empty(
                    (), device=device, dtype=torch.float32).expand(self.stats_shape)
            assert torch.empty_like(stats_like).is_contiguous()   # the kernels' strides
        stats = torch.empty_like(stats_like)
        # The device and stream of all three launches, once they launch directly.
        ctx = launch_context() if self.dq.direct is not None else None
        self.pre(device, dict(O=o, DO=do, LSE=lse, STATS=stats, seq=seq), ctx)
        score = self.score if self.score is not None else score_args(call, dummy)
        if daux is not None:
            score = score._replace(daux=tuple(dummy if d is None else d for d in daux))
        drop = self.drop if not self.dropout else DropArgs(
            seed_tensor(call.seed, device) if seed is None else seed, *self.drop[1:])
        # Each kernel's streamed tensors under their parameters' names (``dkdv_params``,
        # ``dq_params``: DESC_* with host descriptors).
        qn, don, statsn = self.dkdv_params
        self.dkdv(device, {qn: q, "K": k, "V": v, don: do, statsn: stats, "DK": dk4, "DV": dv4,
                           "seq": seq, "score": score, "drop": drop}, ctx)
        kn, vn = self.dq_params
        self.dq(device, {"Q": q, kn: k, vn: v, "DO": do, "STATS": stats, "DQ": dq4, "seq": seq,
                         "score": score, "drop": drop}, ctx)
        return dq, dk, dv
