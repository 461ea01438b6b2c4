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

from ._common import (LOG2E, block_d, dot_operand, dot_precision, interpreter_active,
                      round_for_store, widen, widen_bf16)
from ._dropout import dropout_keep_tile, dropout_threshold
from .autotune import autotune_enabled, bwd_configs, fixed_config, prune_bwd_configs

_LOG2E = tl.constexpr(LOG2E)
# Rows per program of the (memory-bound) delta pre-pass; independent of the autotuned blocks.
_PRE_BLOCK_M = 64


@triton.jit
def _bwd_preprocess(O, DO, Delta,
                    stride_ob, stride_oh, stride_om,
                    stride_dob, stride_doh, stride_dom,
                    H, q_len,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta[bh, i] = sum_d dO[bh, i, d] * O[bh, i, d] in fp32.

    O, DO: (B, H, q_len, HEAD_DIM), unit stride on the last dim. Delta: (B, H, q_len) fp32,
    contiguous. Grid: (cdiv(q_len, BLOCK_M), H, B).
    """
    pid_m = tl.program_id(0)
    # Heads and batch on grid axes 1 and 2 (65535 each), not one B*H axis.
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    bh = tl.program_id(2) * H + tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)

    o_ptrs = O + off_b * stride_ob + off_h * stride_oh \
        + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    do_ptrs = DO + off_b * stride_dob + off_h * stride_doh \
        + offs_m[:, None].to(tl.int64) * stride_dom + offs_d[None, :]
    # Casting straight to fp32 is right for bf16 under the interpreter too (what `widen` does).
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    tl.store(Delta + bh.to(tl.int64) * q_len + offs_m, delta, mask=offs_m < q_len)


@triton.jit
def _bwd_dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta,
                   start_m, start_n, offs_n, offs_d,
                   stride_qm, stride_dom,
                   bh, q_len, k_len, qk_scale,
                   seed, dropout_threshold, dropout_scale,
                   HEAD_DIM: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                   DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Add one query block's contribution to dk, dv (both (BLOCK_N, BLOCK_D) fp32).

    Works in the transposed orientation (keys x queries) so that every dot takes a loaded tile
    or a freshly computed one as is: Q is loaded as Q^T, and only loaded tiles get tl.trans.
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
    # Out-of-range rows get lse = +inf, so their P is exactly 0 without a mask. Rows that see no
    # key (lse = -inf) only occur in masked tiles, which zero their P anyway; mapping -inf to
    # +inf (one op per row) keeps exp2 from producing inf there in the first place.
    lse = tl.load(LSE + offs_m, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(Delta + offs_m, mask=row_ok, other=0.0)

    sT = tl.dot(k, qT, input_precision=DOT_PRECISION)                       # (BLOCK_N, BLOCK_M)
    pT = tl.math.exp2(sT * qk_scale - lse[None, :] * _LOG2E)
    if MASK:
        # Only tiles on the causal diagonal / k_len edge pay for this compare.
        visible = offs_n[:, None] < k_len
        if CAUSAL:
            visible = visible & (offs_n[:, None] <= offs_m[None, :] + (k_len - q_len))
        pT = tl.where(visible, pT, 0.0)

    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)            # dPd^T = V dO^T
    if DROPOUT:
        # Same bits as the forward: the mask depends only on (seed, bh, i, j), not on blocks.
        # It is generated (queries x keys) and transposed as a byte tile rather than i1: the
        # conservative element type for a layout change through shared memory.
        keep = dropout_keep_tile(seed, bh, offs_m, start_n, q_len, k_len, dropout_threshold,
                                 BLOCK_M, BLOCK_N)
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
def _bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV,
              stride_qb, stride_qh, stride_qm,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_dob, stride_doh, stride_dom,
              stride_dkb, stride_dkh, stride_dkn,
              stride_dvb, stride_dvh, stride_dvn,
              H, q_len, k_len, softmax_scale,
              seed, dropout_threshold, dropout_scale,
              Q_BUCKET, K_BUCKET,  # autotune key only (power-of-two buckets of q_len/k_len)
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
              DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV for one block of BLOCK_N keys of one (batch, head).

    Q, DO: (B, H, q_len, HEAD_DIM); K, V, DK, DV: (B, H, k_len, HEAD_DIM); any strides with a
    unit last one. LSE (natural log, -inf for rows that see no key) and Delta: (B, H, q_len)
    fp32 contiguous. Grid: (cdiv(k_len, BLOCK_N), H, B).
    """
    pid_n = tl.program_id(0)
    # 64-bit base offsets: batch * stride_b passes 2**31 for large tensors. Heads and batch
    # sit on grid axes 1 and 2 (65535 each), not one B*H axis.
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    bh = tl.program_id(2) * H + tl.program_id(1)
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_h * stride_kh
    V += off_b * stride_vb + off_h * stride_vh
    DO += off_b * stride_dob + off_h * stride_doh
    DK += off_b * stride_dkb + off_h * stride_dkh
    DV += off_b * stride_dvb + off_h * stride_dvh
    LSE += bh.to(tl.int64) * q_len
    Delta += bh.to(tl.int64) * q_len

    start_n = pid_n * BLOCK_N
    cols = tl.arange(0, BLOCK_N)
    offs_n = start_n + cols
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < k_len) & (offs_d[None, :] < HEAD_DIM)
    # This program's key block, as 64-bit tile bases (see _bwd_dkdv_step).
    K += tl.cast(start_n, tl.int64) * stride_kn
    V += tl.cast(start_n, tl.int64) * stride_vn
    DK += tl.cast(start_n, tl.int64) * stride_dkn
    DV += tl.cast(start_n, tl.int64) * stride_dvn
    k = widen(tl.load(K + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0),
              WIDEN)                                                        # (BLOCK_N, BLOCK_D)
    v = widen(tl.load(V + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0),
              WIDEN)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # exp(x) = exp2(x * log2 e): fold log2 e into the scale once.
    qk_scale = softmax_scale * _LOG2E

    if CAUSAL:
        # Query rows below start_n - (k_len - q_len) see none of these keys: start at the block
        # holding the first one that does. From row start_n + BLOCK_N - 1 - (k_len - q_len) on,
        # a row sees every key of the block, so only [lo, mid) straddles the diagonal.
        diag = k_len - q_len
        lo = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
        mid = tl.minimum(mid, q_len)
    else:
        lo = 0
        mid = 0
    for start_m in range(lo, mid, BLOCK_M):
        dk, dv = _bwd_dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta, start_m, start_n, offs_n,
                                offs_d, stride_qm, stride_dom, bh, q_len, k_len, qk_scale,
                                seed, dropout_threshold, dropout_scale,
                                HEAD_DIM, True, CAUSAL, DROPOUT, DOT_PRECISION, WIDEN,
                                BLOCK_M, BLOCK_N)
    # Key columns past k_len need no mask here: they only reach dK/dV rows that are not stored.
    for start_m in range(mid, q_len, BLOCK_M):
        dk, dv = _bwd_dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta, start_m, start_n, offs_n,
                                offs_d, stride_qm, stride_dom, bh, q_len, k_len, qk_scale,
                                seed, dropout_threshold, dropout_scale,
                                HEAD_DIM, False, CAUSAL, DROPOUT, DOT_PRECISION, WIDEN,
                                BLOCK_M, BLOCK_N)

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
                 bh, q_len, k_len, qk_scale,
                 seed, dropout_threshold, dropout_scale,
                 HEAD_DIM: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                 DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Add one key block's contribution to dq ((BLOCK_M, BLOCK_D) fp32).

    K and V are loaded transposed (BLOCK_D, BLOCK_N) so S = Q K^T and dPd = dO V^T need no
    register transpose.
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
        visible = offs_n[None, :] < k_len
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + (k_len - q_len))
        p = tl.where(visible, p, 0.0)

    dp = tl.dot(do, vT, input_precision=DOT_PRECISION)                      # dPd = dO V^T
    if DROPOUT:
        keep = dropout_keep_tile(seed, bh, offs_m, start_n, q_len, k_len, dropout_threshold,
                                 BLOCK_M, BLOCK_N)
        dp = tl.where(keep, dp * dropout_scale, 0.0)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(dot_operand(ds, kT, WIDEN), tl.trans(kT), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE, Delta, DQ,
            stride_qb, stride_qh, stride_qm,
            stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn,
            stride_dob, stride_doh, stride_dom,
            stride_dqb, stride_dqh, stride_dqm,
            H, q_len, k_len, softmax_scale,
            seed, dropout_threshold, dropout_scale,
            Q_BUCKET, K_BUCKET,  # autotune key only (power-of-two buckets of q_len/k_len)
            HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
            DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ for one block of BLOCK_M queries of one (batch, head).

    Shapes and strides as in ``_bwd_dkdv``; DQ: (B, H, q_len, HEAD_DIM).
    Grid: (cdiv(q_len, BLOCK_M), H, B).
    """
    # Causal: the last query blocks see the most keys. Blocks are issued in reverse so the
    # longest programs start first and the short ones fill the tail (less load imbalance).
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    # Heads and batch on grid axes 1 and 2 (65535 each), not one B*H axis.
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    bh = tl.program_id(2) * H + tl.program_id(1)
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_h * stride_kh
    V += off_b * stride_vb + off_h * stride_vh
    DO += off_b * stride_dob + off_h * stride_doh
    DQ += off_b * stride_dqb + off_h * stride_dqh
    LSE += bh.to(tl.int64) * q_len
    Delta += bh.to(tl.int64) * q_len

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    # Tile pointers built from the batch/head base: 64-bit row offsets, as in the dK/dV kernel.
    q = widen(tl.load(Q + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                      mask=q_mask, other=0.0), WIDEN)                       # (BLOCK_M, BLOCK_D)
    do = widen(tl.load(DO + offs_m[:, None].to(tl.int64) * stride_dom + offs_d[None, :],
                       mask=q_mask, other=0.0), WIDEN)
    # lse = +inf for out-of-range rows and for rows that see no key (-inf): their P is 0 (the
    # latter only occur in masked tiles, which would zero it too), so their dQ row is 0.
    lse = tl.load(LSE + offs_m, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(Delta + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    qk_scale = softmax_scale * _LOG2E

    # Key blocks [0, mid) are fully visible to every row of this block and inside k_len;
    # [mid, hi) straddle the causal diagonal or the k_len edge; keys >= hi are invisible.
    full = (k_len // BLOCK_N) * BLOCK_N
    if CAUSAL:
        diag = k_len - q_len
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + diag, 0), k_len)
        mid = (tl.maximum(start_m + diag + 1, 0) // BLOCK_N) * BLOCK_N
        mid = tl.minimum(mid, full)
    else:
        hi = k_len
        mid = full
    for start_n in range(0, mid, BLOCK_N):
        dq = _bwd_dq_step(dq, q, do, lse, delta, K, V, start_m, start_n, offs_m, offs_d,
                          stride_kn, stride_vn, bh, q_len, k_len, qk_scale,
                          seed, dropout_threshold, dropout_scale,
                          HEAD_DIM, False, CAUSAL, DROPOUT, DOT_PRECISION, WIDEN,
                          BLOCK_M, BLOCK_N)
    for start_n in range(mid, hi, BLOCK_N):
        dq = _bwd_dq_step(dq, q, do, lse, delta, K, V, start_m, start_n, offs_m, offs_d,
                          stride_kn, stride_vn, bh, q_len, k_len, qk_scale,
                          seed, dropout_threshold, dropout_scale,
                          HEAD_DIM, True, CAUSAL, DROPOUT, DOT_PRECISION, WIDEN,
                          BLOCK_M, BLOCK_N)

    dq = round_for_store(dq * softmax_scale, WIDEN)
    tl.store(DQ + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


# On a GPU each kernel is autotuned separately (dK/dV favours long key blocks, dQ long query
# blocks). Sequence lengths enter the key as power-of-two buckets (as in the forward), so a new
# length re-tunes only when it changes bucket; triton's Autotuner appends every tensor
# argument's dtype to the key itself. Both kernels only store their outputs (nothing
# accumulates into them), so re-running a config while tuning is harmless: no reset_to_zero.
_TUNE_KEY = ["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL", "DROPOUT", "DOT_PRECISION"]
_bwd_dkdv_tuned = triton.autotune(configs=bwd_configs(), key=_TUNE_KEY,
                                  prune_configs_by={"early_config_prune": prune_bwd_configs}
                                  )(_bwd_dkdv)
_bwd_dq_tuned = triton.autotune(configs=bwd_configs(), key=_TUNE_KEY,
                                prune_configs_by={"early_config_prune": prune_bwd_configs}
                                )(_bwd_dq)


def _strides(x):
    """(batch, head, seq) strides of a (B, H, seq, D) tensor; the last dim must be unit-stride."""
    assert x.stride(-1) == 1 or x.shape[-1] == 1, "head_dim must have unit stride"
    return x.stride(0), x.stride(1), x.stride(2)


def attention_backward(do, q, k, v, o, lse, *, causal, softmax_scale, dropout_p=0.0, seed=0,
                       config=None):
    """Gradients of ``o = attention(q, k, v)`` given ``do = dL/do``.

    Args:
        do: (B, H, q_len, D), any strides (made unit-stride on the last dim if it is not).
        q: (B, H, q_len, D); k, v: (B, H, k_len, D). fp16, bf16 or fp32, one dtype; any strides
            with a unit-stride last dim. D in 1..256.
        o: (B, H, q_len, D), the forward's output (q's dtype).
        lse: (B, H, q_len) fp32 contiguous, the forward's natural-log row log-sum-exp of the
            scaled scores; -inf for rows that see no key.
        causal: bottom-right causal mask (query i sees key j iff j <= i + k_len - q_len).
        softmax_scale: the scale the forward applied to q k^T.
        dropout_p: the forward's dropout probability in [0, 1); 0 compiles dropout out.
        seed: the forward's dropout seed, a Python int in [0, 2**63).
        config: a ``triton.Config`` with BLOCK_M, BLOCK_N (tests only); default: autotuned
            on a GPU, ``bwd_configs(interpret=True)[0]`` under the interpreter.

    Returns:
        (dq, dk, dv), each with the shape, dtype and memory layout of q, k, v
        (``torch.empty_like``).
    """
    B, H, q_len, head_dim = q.shape
    k_len = k.shape[2]
    assert k.shape == (B, H, k_len, head_dim) and v.shape == k.shape
    assert do.shape == q.shape and o.shape == q.shape
    assert lse.shape == (B, H, q_len) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert q.dtype == k.dtype == v.dtype and 1 <= head_dim <= 256
    assert 0.0 <= dropout_p < 1.0

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if B * H == 0 or q_len == 0 or k_len == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if do.stride(-1) != 1:
        # e.g. the expanded, all-zero-stride gradient of o.sum(): one copy, then unit stride.
        do = do.contiguous()

    BLOCK_D = block_d(head_dim)
    dropout = dropout_p > 0.0
    consts = dict(HEAD_DIM=head_dim, CAUSAL=bool(causal), DROPOUT=dropout,
                  DOT_PRECISION=dot_precision(q.dtype), WIDEN=widen_bf16(q.dtype),
                  BLOCK_D=BLOCK_D)
    drop_args = (int(seed), dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p)) if dropout \
        else (0, 0, 1.0)

    delta = torch.empty((B, H, q_len), dtype=torch.float32, device=q.device)
    _bwd_preprocess[(triton.cdiv(q_len, _PRE_BLOCK_M), H, B)](
        o, do, delta, *_strides(o), *_strides(do), H, q_len,
        HEAD_DIM=head_dim, BLOCK_M=_PRE_BLOCK_M, BLOCK_D=BLOCK_D)

    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))
    tail = (H, q_len, k_len, float(softmax_scale), *drop_args,
            triton.next_power_of_2(q_len), triton.next_power_of_2(k_len))
    dkdv_args = (q, k, v, do, lse, delta, dk, dv, *common, *_strides(dk), *_strides(dv), *tail)
    dq_args = (q, k, v, do, lse, delta, dq, *common, *_strides(dq), *tail)

    if config is None and not interpreter_active() and autotune_enabled():
        _bwd_dkdv_tuned[lambda meta: (triton.cdiv(k_len, meta["BLOCK_N"]), H, B)](
            *dkdv_args, **consts)
        _bwd_dq_tuned[lambda meta: (triton.cdiv(q_len, meta["BLOCK_M"]), H, B)](
            *dq_args, **consts)
        return dq, dk, dv

    if config is not None:
        config_dkdv = config_dq = config
    elif interpreter_active():
        # Under the interpreter autotuning would time every config in Python: one fixed config.
        config_dkdv = config_dq = bwd_configs(interpret=True)[0]
    else:  # KERNELS_AUTOTUNE=0: the first config each kernel's pruning keeps
        config_dkdv = fixed_config(bwd_configs(), prune_bwd_configs, {"Q": q, "DK": dk},
                                   **consts)
        config_dq = fixed_config(bwd_configs(), prune_bwd_configs, {"Q": q, "DQ": dq}, **consts)

    def launch(kernel, cfg, n_rows, block, args):
        kernel[(triton.cdiv(n_rows, cfg.kwargs[block]), H, B)](
            *args, **consts, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    launch(_bwd_dkdv, config_dkdv, k_len, "BLOCK_N", dkdv_args)
    launch(_bwd_dq, config_dq, q_len, "BLOCK_M", dq_args)
    return dq, dk, dv
