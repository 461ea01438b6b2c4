"""Fused attention forward: softmax(mask(Q Kᵀ · scale)) → dropout → @ V in one Triton kernel.

FlashAttention-2 tiling: each program owns BLOCK_M query rows of one (batch, head) and streams
over key/value tiles of BLOCK_N rows, keeping a running row max ``m_i`` and row sum ``l_i``
(online softmax, fp32, base 2 with log2(e) folded into the scale). The (q_len × k_len) score
matrix never leaves registers. Causal tiles entirely above the diagonal are never visited; tiles
entirely below it run without any masking; only the diagonal band (and the ragged last key tile)
pays for masks.
"""
import torch
import triton
import triton.language as tl

from .common import (LN2, LOG2E, block_d, dot_operand, dot_precision, interpreter_active,
                      round_for_store, widen, widen_bf16)
from .dropout import dropout_keep_tile, dropout_threshold
from .layout import dense_problem, packed_view, varlen_problem
from .tiles import key_range, seq_bounds, visible
from .configs import autotune_enabled, fixed_config, fwd_configs, prune_configs
from .splitkv import (PACK_GQA_MAX_Q_LEN, clamp_splits, combine_splits, nominal_tiles,
                      num_splits_heuristic)

# Compiled kernels may only read globals that are tl.constexpr (the interpreter reads any).
_LN2 = tl.constexpr(LN2)


@triton.jit
def load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr,
              CHECK_ROWS: tl.constexpr, CHECK_D: tl.constexpr):
    """Load a (rows × BLOCK_D) tile, masking rows >= n_rows and head-dim padding only when the
    corresponding CHECK_* flag says the tile can reach them (the fast paths load unmasked)."""
    if CHECK_ROWS:
        if CHECK_D:
            mask = (rows < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
        else:
            mask = (rows < n_rows)[:, None]
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        if CHECK_D:
            return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                    offs_m, offs_d, lo, hi, q_len, k_len, window, qk_scale,
                    seed, drop_base, drop_col, drop_groups, drop_threshold,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                    DROPOUT: tl.constexpr, EVEN_D: tl.constexpr, WIDEN: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, PIPELINED: tl.constexpr):
    """Stream key tiles [lo, hi) into the running (acc, l_i, m_i) of one query block.

    MASKED=False is the hot loop over tiles every row of the block fully sees: no causal,
    window or bounds masks. MASKED=True handles the diagonal band, the window's edge and the
    ragged last tile (kernels/core/tiles.py says which tiles are which). PIPELINED=False runs the
    loop without software pipelining (num_stages=1).
    """
    offs_n0 = tl.arange(0, BLOCK_N)
    diag = k_len - q_len
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=None if PIPELINED else 1):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        # 64-bit tile base so huge (batch·seq·heads·dim > 2**31) tensors never wrap.
        k_tile = k_base + start_n.to(tl.int64) * stride_kn
        k = load_rows(k_tile + offs_n0[:, None] * stride_kn + offs_d[None, :], offs_n, k_len,
                      offs_d, HEAD_DIM, MASKED, not EVEN_D)
        k = widen(k, WIDEN)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            s = tl.where(visible(offs_m[:, None], offs_n[None, :], k_len, diag, window,
                                 CAUSAL, WINDOW), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead of
            # -inf avoids (-inf) - (-inf) = NaN and leaves its p at exp2(-inf) = 0.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        # The softmax denominator counts every weight; dropout zeroes weights after it.
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            keep = dropout_keep_tile(seed, drop_base, offs_m, start_n, drop_groups,
                                     drop_threshold, BLOCK_M, BLOCK_N, drop_col)
            p = tl.where(keep, p, 0.0)
        v_tile = v_base + start_n.to(tl.int64) * stride_vn
        v = load_rows(v_tile + offs_n0[:, None] * stride_vn + offs_d[None, :], offs_n, k_len,
                      offs_d, HEAD_DIM, MASKED, not EVEN_D)
        v = widen(v, WIDEN)
        acc = tl.dot(dot_operand(p, v, WIDEN), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, CU_Q, CU_K, K_LENS, O_PART, LSE_PART,
              stride_qb, stride_qh, stride_qm,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_ob, stride_oh, stride_om,
              stride_lb, stride_lh,
              GROUP, q_len, k_len, window, qk_scale,
              seed, drop_threshold, drop_scale, drop_groups,
              stride_db, stride_dh, drop_row, drop_col,
              num_splits, n_lse_rows,
              Q_BUCKET, K_BUCKET,  # autotune key only (power-of-two buckets of q_len/k_len)
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
              SEQUSED_K: tl.constexpr, PACK_GQA: tl.constexpr, SPLIT: tl.constexpr,
              DROPOUT: tl.constexpr, WIDEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program = BLOCK_M query rows of one (batch or packed sequence, query head), against
    the keys they see (or, with SPLIT, one of ``num_splits`` even shares of those keys).
    Grid: (cdiv(rows, BLOCK_M) * (num_splits if SPLIT else 1), heads, batch or sequences),
    where rows = q_len (or max_seqlen_q) and heads = heads_q; with PACK_GQA, rows =
    GROUP * q_len (the GROUP query heads that share a kv head, stacked) and heads = heads_kv,
    so every K/V tile is read once per group (decoding, where q_len is small).

    Q, O: (B, heads_q, q_len, HEAD_DIM); K, V: (B, heads_kv, k_len, HEAD_DIM) with
    heads_q = GROUP * heads_kv (query head h reads kv head h // GROUP); unit stride in the last
    dim. VARLEN: B = 1 with zero batch strides, and the program's sequence is rows
    CU_Q[b]:CU_Q[b+1] of Q (CU_K for K, V). SEQUSED_K: batch entry b has K_LENS[b] keys (a KV
    cache's filled length). LSE: fp32, entry (b, h, i) at b * stride_lb + h * stride_lh + row
    start + i; natural log, -inf for rows with no key. SPLIT: O and LSE are not written; split s
    writes its normalised partial output and lse to O_PART[s, r, :HEAD_DIM] and LSE_PART[s, r]
    (fp32, r = the row's lse offset, n_lse_rows rows per split) for kernels/core/splitkv.py.
    ``qk_scale`` = softmax_scale · log2(e); ``window`` is read only when WINDOW. Dropout row ids
    (kernels/core/dropout.py): b * stride_db + h * stride_dh + row start + drop_row + i, columns
    shifted by drop_col.
    """
    pid = tl.program_id(0)
    if SPLIT:
        split = pid % num_splits
        pid_m = pid // num_splits
        n_blocks = tl.num_programs(0) // num_splits
    else:
        pid_m = pid
        n_blocks = tl.num_programs(0)
    if CAUSAL:
        # Longest rows first: the GPU starts the most expensive causal blocks early, so the
        # short ones fill the tail instead of leaving SMs idle at the end.
        pid_m = n_blocks - 1 - pid_m
    pid_h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, q_len, k_len, CU_Q, CU_K, K_LENS, VARLEN,
                                                SEQUSED_K)
    start_m = pid_m * BLOCK_M
    if VARLEN:
        # The grid covers the longest sequence; shorter ones leave programs with no rows.
        if start_m >= q_len:
            return
    offs_r = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    if PACK_GQA:
        # Row r is query i = r % q_len of query head kv_h * GROUP + r // q_len.
        kv_h = pid_h
        h = kv_h * GROUP + offs_r // q_len
        offs_m = offs_r % q_len
        n_rows = GROUP * q_len
        row_ok = offs_r < n_rows
        m_lo = tl.min(tl.where(row_ok, offs_m, q_len), 0)
        m_hi = tl.max(tl.where(row_ok, offs_m, 0), 0) + 1
    else:
        h = pid_h
        kv_h = h // GROUP
        offs_m = offs_r
        n_rows = q_len
        row_ok = offs_m < n_rows
        m_lo = start_m
        m_hi = start_m + BLOCK_M
    # Offsets of each row's lse entry, dropout row id (kernels/core/dropout.py) and q / o row:
    # 64-bit, as batch * heads * seq can pass 2**31.
    row_base = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
    drop_base = b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + q_start + drop_row
    q_rows = b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh \
        + (q_start + offs_m).to(tl.int64) * stride_qm
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh \
        + tl.cast(k_start, tl.int64) * stride_kn
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh \
        + tl.cast(k_start, tl.int64) * stride_vn
    q = load_rows(Q + q_rows[:, None] + offs_d[None, :], offs_r, n_rows, offs_d, HEAD_DIM, True,
                  not EVEN_D)
    q = widen(q, WIDEN)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = key_range(m_lo, m_hi, q_len, k_len, window, CAUSAL, WINDOW,
                                         BLOCK_N)
    if SPLIT:
        # Split s takes an even share of this block's key tiles; all bounds stay tile-aligned.
        per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
        c0 = tl.minimum(lo + split * per_split, hi)
        c1 = tl.minimum(c0 + per_split, hi)
        lo = tl.maximum(lo, c0)
        full_lo = tl.minimum(tl.maximum(full_lo, c0), c1)
        full_hi = tl.minimum(tl.maximum(full_hi, c0), c1)
        hi = c1
    # Software pipelining (the config's num_stages) for the loops before the diagonal only:
    # a pipelined loop after the unmasked one, or an unpipelined one before it, makes ptxas
    # serialize every wgmma of the kernel on sm_90 (warning C7515), which forfeits Hopper's
    # tensor-core overlap (benchmarks/NOTES.md). The diagonal loop is a few tiles long.
    if WINDOW:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                        offs_m, offs_d, lo, full_lo, q_len, k_len, window,
                                        qk_scale, seed, drop_base, drop_col, drop_groups,
                                        drop_threshold, HEAD_DIM, BLOCK_M, BLOCK_N, True,
                                        CAUSAL, WINDOW, DROPOUT, EVEN_D, WIDEN, DOT_PRECISION,
                                        True)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                    offs_m, offs_d, full_lo, full_hi, q_len, k_len, window,
                                    qk_scale, seed, drop_base, drop_col, drop_groups,
                                    drop_threshold, HEAD_DIM, BLOCK_M, BLOCK_N, False, CAUSAL,
                                    WINDOW, DROPOUT, EVEN_D, WIDEN, DOT_PRECISION, True)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                    offs_m, offs_d, full_hi, hi, q_len, k_len, window,
                                    qk_scale, seed, drop_base, drop_col, drop_groups,
                                    drop_threshold, HEAD_DIM, BLOCK_M, BLOCK_N, True, CAUSAL,
                                    WINDOW, DROPOUT, EVEN_D, WIDEN, DOT_PRECISION, False)

    # Rows that saw no key (causal with q_len > k_len, empty sequences, a split without keys
    # for them) have l_i = 0: output 0, lse -inf.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc * (drop_scale / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * _LN2)
    lse_rows = row_base + offs_m
    if SPLIT:
        part_rows = split.to(tl.int64) * n_lse_rows + lse_rows
        tl.store(LSE_PART + part_rows, lse, mask=row_ok)
        tl.store(O_PART + part_rows[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    else:
        tl.store(LSE + lse_rows, lse, mask=row_ok)
        o_rows = b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh \
            + (q_start + offs_m).to(tl.int64) * stride_om
        o_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        tl.store(O + o_rows[:, None] + offs_d[None, :],
                 round_for_store(acc, WIDEN).to(O.dtype.element_ty), mask=o_mask)


_attn_fwd_tuned = triton.autotune(
    configs=fwd_configs(),
    key=["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL", "WINDOW", "VARLEN", "SEQUSED_K",
         "PACK_GQA", "SPLIT", "DROPOUT", "DOT_PRECISION"],
    prune_configs_by={"early_config_prune": prune_configs},
)(_attn_fwd)


def attention_forward(q, k, v, *, causal, softmax_scale, dropout_p, seed, window=None,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                      max_seqlen_k=None, k_lens=None, num_splits=1, pack_gqa=None,
                      drop_layout=None, out=None, config=None):
    """Launch the fused forward on validated inputs.

    Args:
        q: (B, heads_q, q_len, D); k, v: (B, heads_kv, k_len, D) with heads_q % heads_kv == 0
            (query head h reads kv head h // (heads_q // heads_kv)). Packed sequences (with
            ``cu_seqlens_q``): q (total_q, heads_q, D), k, v (total_k, heads_kv, D). Same dtype
            and device, unit stride in the last dim (any other strides), 1 <= D <= 256.
        causal: bottom-right causal mask. softmax_scale: float > 0.
        dropout_p: 0 <= p < 1; seed: int in [0, 2**63) for the in-kernel Philox mask.
        window: None, or int >= 1 with causal: query i sees only keys
            i + (k_len - q_len) - window < j <= i + (k_len - q_len).
        cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,) row offsets of the packed sequences
            (validated by the caller); max_seqlen_q, max_seqlen_k: ints >= every sequence's
            length (the grid covers them).
        k_lens: optional int32 (B,) (dense only): batch entry b uses only its first k_lens[b]
            keys (a KV cache's filled length; k_len is then the cache's capacity).
        num_splits: split each query block's keys over this many programs, merged by
            kernels/core/splitkv.py (flash-decoding); 1 = no split; 0 = ``num_splits_heuristic``.
        pack_gqa: one program for all query heads of a kv group (each K/V tile read once per
            group); None = when the group is > 1 and q_len <= PACK_GQA_MAX_Q_LEN (decoding).
        drop_layout: (q_total, k_total, row_offset, col_offset) when this dense call is a block
            of a longer sequence (context parallelism): the dropout mask is then that block of
            the whole sequence's mask (col_offset a multiple of 4). None: the call's own.
        out: optional tensor shaped like q to write into (test hook / preallocated output).
        config: a ``triton.Config`` with BLOCK_M, BLOCK_N to force (tests); default: autotuned
            on a GPU (or the first fitting config with KERNELS_AUTOTUNE=0), the small
            interpreter config under TRITON_INTERPRET=1.
    Returns:
        (o, lse): o shaped like q, in q's dtype, with q's memory layout when q is dense;
        lse fp32 (B, heads_q, q_len), or (heads_q, total_q) for packed sequences: natural-log
        row log-sum-exp, -inf for rows that see no key.
    """
    if cu_seqlens_q is None:
        pb = dense_problem(q, k, v)
    else:
        pb = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_lens is None or not pb.varlen
    o = torch.empty_like(q) if out is None else out
    lse = torch.empty(pb.lse_shape, dtype=torch.float32, device=q.device)
    if o.numel() == 0 or pb.batch == 0:
        return o, lse
    o4 = packed_view(o) if pb.varlen else o
    D = q.shape[-1]
    dropout = dropout_p > 0.0
    if pack_gqa is None:
        pack_gqa = pb.group > 1 and not pb.varlen and pb.q_len <= PACK_GQA_MAX_Q_LEN
    assert not (pack_gqa and pb.varlen), "packed GQA heads are for dense (decoding) calls"
    rows, heads = (pb.group * pb.q_len, pb.heads // pb.group) if pack_gqa else (pb.q_len,
                                                                                  pb.heads)
    if num_splits == 0:
        m_blocks, n_tiles = nominal_tiles(rows, pb.k_len)
        num_splits = num_splits_heuristic(q.device, pb.batch * heads * m_blocks, n_tiles)
    num_splits = clamp_splits(num_splits, pb.k_len)
    split = num_splits > 1
    o_part = lse_part = lse
    if split:
        o_part = torch.empty((num_splits, lse.numel(), D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((num_splits, lse.numel()), dtype=torch.float32, device=q.device)
    k_lens_arg = lse if k_lens is None else k_lens
    args = (pb.q, pb.k, pb.v, o4, lse, *pb.cu_args(lse), k_lens_arg, o_part, lse_part,
            *pb.strides(pb.q), *pb.strides(pb.k), *pb.strides(pb.v), *pb.strides(o4),
            *pb.lse_strides,
            pb.group, pb.q_len, pb.k_len, window or 0, softmax_scale * LOG2E,
            seed if dropout else 0, dropout_threshold(dropout_p) if dropout else 0,
            1.0 / (1.0 - dropout_p), *pb.dropout_args(drop_layout), num_splits, lse.numel(),
            triton.next_power_of_2(pb.q_len), triton.next_power_of_2(pb.k_len))
    meta = dict(HEAD_DIM=D, BLOCK_D=block_d(D), CAUSAL=causal, WINDOW=window is not None,
                VARLEN=pb.varlen, SEQUSED_K=k_lens is not None, PACK_GQA=bool(pack_gqa),
                SPLIT=split, DROPOUT=dropout, WIDEN=widen_bf16(q.dtype),
                DOT_PRECISION=dot_precision(q.dtype))

    def grid(cfg):
        return (triton.cdiv(rows, cfg["BLOCK_M"]) * num_splits, heads, pb.batch)

    if config is None and not interpreter_active() and autotune_enabled():
        _attn_fwd_tuned[grid](*args, **meta)
    else:
        if config is None and interpreter_active():
            # Autotuning in the interpreter would time every config in Python: one config.
            config = fwd_configs(interpret=True)[0]
        elif config is None:
            config = fixed_config(fwd_configs(), prune_configs, {"Q": q}, **meta)
        _attn_fwd[grid(config.kwargs)](*args, **meta, **config.kwargs,
                                       num_warps=config.num_warps,
                                       num_stages=config.num_stages)
    if split:
        combine_splits(o_part, lse_part, o4, lse)
    return o, lse
