"""Fused attention forward: softmax(mask(Q Kᵀ · scale)) → dropout → @ V in one Triton kernel.

FlashAttention-2 tiling: each program owns BLOCK_M query rows of one (batch, head) and streams
over key/value tiles of BLOCK_N rows, keeping a running row max ``m_i`` and row sum ``l_i``
(online softmax, fp32, base 2 with log2(e) folded into the scale). The (q_len × k_len) score
matrix never leaves registers. Causal tiles entirely above the diagonal are never visited; tiles
entirely below it run without any masking; only the diagonal band (and the ragged last key tile)
pays for masks.

FP8 (e4m3; kernels/core/fp8.py) and V's layout. Hopper's FP8 wgmma takes both shared-memory
operands K-major only (16-bit types can be transposed by the instruction, 8-bit ones cannot).
S = Q Kᵀ is fine: K stored (keys, head_dim) is K-major for Kᵀ, a free ``memdesc_trans``. For
P @ V the reduction runs over keys, and V stored (keys, head_dim) is not K-major: Triton 3.6
loads each V tile into shared memory as stored (TMA or cp.async), reads it back into registers
and writes it again transposed (``local_load`` + ``local_alloc`` into a transposed NVMMA
layout) before the wgmma -- one extra shared-memory round trip of the tile (BLOCK_N x
head_dim bytes) and a barrier per key tile; P comes from registers. Both dots stay e4m3 wgmma
(tools/sm90_static.py: no spills, no C7515 at d64 / d128). We accept that: the alternative,
V stored transposed (head_dim, keys) as the Triton tutorial's FP8 path takes it, changes the
caller's layout (and every KV cache's), and a descriptor cannot transpose 8-bit tiles on the
way in. An FP8 KV cache read by fp16 / bf16 queries upcasts K and V tiles in registers and
stores them again to shared memory as 16-bit operands (the same kind of round trip, for K too).
"""
import math

import torch
import triton
import triton.language as tl

from .call import (AttentionCall, DropArgs, FwdStrides, KeyLayout, Precision, SchedArgs,
                   SplitArgs, make_problem, new_out, packed_view, score_args, score_spec,
                   seed_tensor)
from .common import (block_d, dot_operand, dot_precision, head_blocks, interpreter_active,
                     round_for_store, widen, widen_bf16)
from .configs import (FWD_TUNE_KEY, PACK_GQA_MAX_Q_LEN, autotune_enabled, clamp_splits,
                      fixed_configs, fwd_configs, host_descriptors_enabled, nominal_tiles,
                      num_splits_heuristic, persistent_capable, persistent_enabled,
                      persistent_programs, prune_configs, tma_capable, with_pre_hook)
from .dropout import load_seed
from .fp8 import (FP8_NONE, P_SCALE_C, descale_args, fp8_spec, load_descale, one_descale,
                  p_operand)
from .score import dropout_keep, finish_rows, mask_scores, online_softmax, scaled_scores
from .tiles import (clamp_ranges, edge_bound, key_range, mask_key_bounds, program_ids,
                    seq_bounds, tile_ids)
from .paged import page_rows, paged_problem, paged_varlen_problem
from .splitkv import combine_splits
from .launch import KernelStep, launch_context
from .tma import (TMA_HOST, TMA_HOST_MODE, desc_tile, host_desc_layout, host_descs, row_tiles,
                  set_row_blocks, tma_rows_ok)


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
def _attn_fwd(Q, K, V, O, LSE, DESC_Q, DESC_K, DESC_V, strides,
              seq, score, drop, split, sched,
              BUCKETS,  # autotune key only: Problem.tune_buckets (+ 1 when persistent)
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
              SPEC: tl.constexpr, KEYS: tl.constexpr, PACK_GQA: tl.constexpr,
              SPLIT: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
              TMA: tl.constexpr, FP8: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr):
    """One program = BLOCK_M query rows of one (batch or packed sequence, query head), against
    the keys they see (or, with SPLIT, one of ``split.num_splits`` even shares of those keys).
    Grid: (cdiv(rows, BLOCK_M) * (num_splits if SPLIT else 1), heads, batch or sequences),
    where rows = q_len (or max_seqlen_q) and heads = heads_q; with PACK_GQA, rows =
    group * q_len (the query heads that share a kv head, stacked) and heads = heads_kv,
    so every K/V tile is read once per group (decoding, where q_len is small).

    Q: (B, heads_q, q_len, HEAD_DIM); K: (B, heads_kv, k_len, HEAD_DIM); V: (B, heads_kv, k_len,
    HEAD_DIM_V); O: (B, heads_q, q_len, HEAD_DIM_V); heads_q = group * heads_kv (query head h
    reads kv head h // group); unit stride in the last dim; Q and K tiles BLOCK_D wide, or with
    HEAD_DIM > BLOCK_D (a head dim over 512: MLA's 576; ``common.head_blocks``, per-thread
    loads only) two tiles, columns [0, BLOCK_D) whole and [BLOCK_D, HEAD_DIM) padded to a
    power of two, whose two dots sum to S; with ``KEYS.v_in_k`` V is K's first HEAD_DIM_V
    (= BLOCK_D) columns and its tile is the K tile already loaded (MLA's latent cache: read
    once);
    ``strides`` (``FwdStrides``): ``strides.x`` = x's (batch, head, row) strides, read below
    as ``stride_x``. SPEC: the score pipeline's ScoreSpec (causal, window / chunk edge, score
    and mask mods, sinks). KEYS: the keys' layout (``KeyLayout``: varlen, k_lens, page_size,
    v_in_k, read below as VARLEN, SEQUSED_K, PAGED, V_IN_K). Grouped arguments
    (kernels/core/call.py): ``seq`` (SeqArgs: group, lengths; VARLEN: B = 1 with zero batch
    strides and sequence b is rows cu_q[b]:cu_q[b+1] of Q (cu_k for K, V); SEQUSED_K: batch
    entry b has k_lens[b] keys, a KV cache's filled length),
    ``score`` (ScoreArgs), ``drop`` (DropArgs: the dropout mask's row ids and columns,
    kernels/core/dropout.py), ``split`` (SplitArgs). DROPOUT: 0 off, 1 on, 2 on at a column
    offset off the 4-column Philox groups (``AttentionCall.dropout_mode``). LSE: fp32, entry (b,
    h, i) at b * stride_lse[0] + h * stride_lse[1] + row start + i; natural log, -inf for rows
    with no key. SPLIT: O and LSE are not written; split s writes its normalised partial output
    and lse to split.o_part[s, r, :HEAD_DIM_V] and split.lse_part[s, r] (r = the row's lse
    offset) for kernels/core/splitkv.py, without the sinks (the merge adds them).
    TMA (``tma_mode``): 0 = K/V/Q tiles by per-thread loads (``load_rows``: cp.async when
    pipelined); 1 = K and V tiles by tensor descriptors made here (``row_tiles``; on sm_90 one
    bulk tensor copy per tile) over this (sequence, kv head)'s k_len rows, so rows past k_len
    -- another packed sequence's, a KV cache's unfilled ones -- and columns past the head dim
    read as zeros exactly as the masked loads do; 2 = Q's tile too (not with PACK_GQA);
    3 (``TMA_HOST``) = Q, K and V tiles through ``DESC_Q``, ``DESC_K``, ``DESC_V``: host
    descriptors of the whole (B, heads, rows, D) tensors, made once per call instead of three
    per program (a dense call's bounds are its tensors': rows past them read as zeros), block
    (1, 1, BLOCK_M or BLOCK_N, BLOCK_D or BLOCK_DV) set by each config's ``set_desc_blocks``;
    None (constexpr) in the other modes.
    ``sched``: None (constexpr), or a persistent launch's ``SchedArgs`` (not with VARLEN):
    the grid is then (programs, 1, 1) and each program draws tile after tile -- the (block,
    head, batch) a grid's program would have, in the order they would start -- from the
    ``sched.tiles`` counter, which the last program to finish resets to zero.
    PAGED: 0, or the page size of a paged cache (with SEQUSED_K, TMA = 0): K and V are
    paged caches viewed (num_blocks, heads_kv, PAGED, D) (kernels/core/paged.py),
    ``stride_k[0]`` is the page stride, and key position j of batch entry b is row j % PAGED of
    page seq.block_table[b, j // PAGED]; masks, mods and dropout see the logical positions j.
    With VARLEN too (vLLM's and FlashAttention's varlen-over-pages layout), only Q and O are
    packed (cu_q); b is the packed sequence, its keys number k_lens[b] (seq.cu_k is not read).
    A constexpr (one compile per page size), so that the per-key division is a shift for
    powers of two: with a runtime page size, 128 x 128 tiles spilled on sm_90 (q_len 4, GQA).
    FP8 (``fp8.Fp8Spec``; kernels/core/fp8.py), with ``score.descale`` the descales
    (``fp8.DescaleArgs``), read at the program's (b, kv_h): mode 1, Q, K, V e4m3: S by an fp8
    dot with q_descale * k_descale folded into the score scale, P * 256 rounded to e4m3 for
    an fp8 P @ V, acc * v_descale / 256 at the end; mode 2, K, V e4m3 and Q fp16 / bf16: K, V
    tiles upcast to Q's dtype after each load, k_descale in the score scale, acc * v_descale
    at the end. l_i, lse and split partials are those of the descaled scores. No dropout with
    FP8.
    PRECISION (``call.Precision``): bf16 widened after each load (the interpreter), tl.dot's
    input precision. WARP_SPEC (a config's constexpr; its configs are offered with
    KERNELS_FWD_WARP_SPEC=1: ``configs.warp_spec_configs``): one warp-specialised key loop,
    every tile masked (``_fwd_block``), on sm_90 a TMA producer warpgroup and two consumer
    warpgroups (num_warps 4; Triton 3.6's NVGPUWarpSpecialization). Same results as without,
    bit for bit (a masked tile that every row sees whole computes what the unmasked one does).
    """
    if sched is None:
        # Causal: the longest rows (the last blocks) of every head first (``program_ids``).
        pid, pid_h, b = program_ids(SPEC.causal, False)
        _fwd_block((pid, pid_h, b), Q, K, V, O, LSE, DESC_Q, DESC_K, DESC_V, strides,
                   seq, score, drop, split, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV,
                   SPEC, KEYS, PACK_GQA, SPLIT, DROPOUT, PRECISION, TMA, FP8, BLOCK_M, BLOCK_N,
                   WARP_SPEC)
    else:
        # Persistent: each program draws tiles from the launch's counter until none is left,
        # in the order a grid's programs would start (``tiles.tile_ids``).
        tl.static_assert(not KEYS.varlen, "persistent: not with packed sequences (a tile "
                         "past a short sequence's rows returns early)")
        tl.static_assert(not WARP_SPEC, "WARP_SPEC: not persistent (a loop around its loop)")
        rows = seq.group * seq.q_len if PACK_GQA else seq.q_len
        n_blocks = tl.cdiv(rows, BLOCK_M) * (split.num_splits if SPLIT else 1)
        n_tiles = tl.cast(n_blocks, tl.int64) * sched.heads * sched.batch
        tile = tl.atomic_add(sched.tiles, 1).to(tl.int64)
        while tile < n_tiles:
            pid, pid_h, b = tile_ids(tile, n_blocks, sched.heads, sched.batch, SPEC.causal,
                                     False)
            _fwd_block((pid, pid_h, b), Q, K, V, O, LSE, DESC_Q, DESC_K, DESC_V, strides,
                       seq, score, drop, split, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                       BLOCK_DV, SPEC, KEYS, PACK_GQA, SPLIT, DROPOUT, PRECISION, TMA, FP8,
                       BLOCK_M, BLOCK_N, WARP_SPEC)
            tile = tl.atomic_add(sched.tiles, 1).to(tl.int64)
        # The last program to finish drawing resets the counter for the next launch on this
        # stream: every other program has drawn its last ticket before counting itself done.
        done = tl.atomic_add(sched.tiles + 1, 1)
        if done == tl.num_programs(0) - 1:
            tl.atomic_xchg(sched.tiles, 0)
            tl.atomic_xchg(sched.tiles + 1, 0)


@triton.jit
def _fwd_block(tile, Q, K, V, O, LSE, DESC_Q, DESC_K, DESC_V, strides,
               seq, score, drop, split,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
               SPEC: tl.constexpr, KEYS: tl.constexpr, PACK_GQA: tl.constexpr,
               SPLIT: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
               TMA: tl.constexpr, FP8: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr):
    """``_attn_fwd``'s work for one tile = (pid, pid_h, b): query block ``pid`` (with SPLIT,
    block ``pid // split.num_splits``'s key share ``pid % split.num_splits``) of head ``pid_h``
    (kv head with PACK_GQA) of batch entry or packed sequence ``b``; the arguments as there."""
    pid, pid_h, b = tile
    stride_q, stride_k, stride_v = strides.q, strides.k, strides.v
    stride_o, stride_lse = strides.o, strides.lse
    WIDEN: tl.constexpr = PRECISION.widen
    DOT_PRECISION: tl.constexpr = PRECISION.dot
    VARLEN: tl.constexpr = KEYS.varlen
    SEQUSED_K: tl.constexpr = KEYS.k_lens
    PAGED: tl.constexpr = KEYS.page_size
    if SPLIT:
        split_id = pid % split.num_splits
        pid_m = pid // split.num_splits
    else:
        pid_m = pid
    # A paged cache's keys are not packed even when the queries are (PACKED_K).
    q_start, q_len, k_start, k_len = seq_bounds(b, seq, VARLEN, SEQUSED_K, PAGED == 0)
    start_m = pid_m * BLOCK_M
    GROUP = seq.group
    if VARLEN:
        # The grid covers the longest sequence (times the group with PACK_GQA); shorter ones
        # leave programs with no rows.
        if start_m >= (GROUP * q_len if PACK_GQA else q_len):
            return
    offs_r = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # A split head dim (HEAD_DIM > BLOCK_D: common.head_blocks): the first tile's BLOCK_D
    # columns are all real (HEAD_DIM_1 of them), the second tile's HEAD_DIM_2 = HEAD_DIM -
    # BLOCK_D are padded to BLOCK_D2 (derived here: a kernel parameter less).
    BLOCK_D2: tl.constexpr = max(16, triton.next_power_of_2(HEAD_DIM - BLOCK_D)) \
        if HEAD_DIM > BLOCK_D else 0
    HEAD_DIM_1: tl.constexpr = BLOCK_D if BLOCK_D2 else HEAD_DIM
    HEAD_DIM_2: tl.constexpr = HEAD_DIM - BLOCK_D if BLOCK_D2 else 0
    EVEN_D: tl.constexpr = HEAD_DIM_1 == BLOCK_D
    EVEN_D2: tl.constexpr = HEAD_DIM_2 == BLOCK_D2
    EVEN_DV: tl.constexpr = HEAD_DIM_V == BLOCK_DV
    V_IN_K: tl.constexpr = KEYS.v_in_k
    if BLOCK_D2 or V_IN_K:
        tl.static_assert(TMA == 0 and not WARP_SPEC, "a split head dim / V in K: per-thread "
                         "loads only")
    if V_IN_K:
        tl.static_assert(HEAD_DIM_V == HEAD_DIM_1 and BLOCK_DV == BLOCK_D,
                         "V in K: V is the first K tile, whole")
    if PACK_GQA:
        # Row r is query i = r % q_len of query head kv_h * GROUP + r // q_len.
        kv_h = pid_h
        h = kv_h * GROUP + offs_r // q_len
        offs_m = offs_r % q_len
        n_rows = GROUP * q_len
        row_ok = offs_r < n_rows
        m_lo = tl.min(tl.where(row_ok, offs_m, q_len), 0)
        m_hi = tl.max(tl.where(row_ok, offs_m, 0), 0) + 1
        h_tile = h[:, None]  # the score mods' head index, per row
    else:
        h = pid_h
        kv_h = h // GROUP
        offs_m = offs_r
        n_rows = q_len
        row_ok = offs_m < n_rows
        m_lo = start_m
        m_hi = start_m + BLOCK_M
        h_tile = h
    # Offsets of each row's lse entry, dropout row id (kernels/core/dropout.py) and q / o row:
    # 64-bit, as batch * heads * seq can pass 2**31.
    row_base = b.to(tl.int64) * stride_lse[0] + h.to(tl.int64) * stride_lse[1] + q_start
    drop_rows = b.to(tl.int64) * drop.row_stride_b + h.to(tl.int64) * drop.row_stride_h \
        + q_start + drop.row0
    if DROPOUT:
        drop_seed = load_seed(drop)
    q_rows = b.to(tl.int64) * stride_q[0] + h.to(tl.int64) * stride_q[1] \
        + (q_start + offs_m).to(tl.int64) * stride_q[2]
    if PAGED:
        # Batch entry (or packed sequence) b owns no slice of K / V: its rows are found per
        # tile (page_rows), from logical position 0 (k_start = 0).
        tl.static_assert(not TMA and SEQUSED_K)
        k_base = K + kv_h.to(tl.int64) * stride_k[1]
        v_base = V + kv_h.to(tl.int64) * stride_v[1]
    else:
        k_base = K + b.to(tl.int64) * stride_k[0] + kv_h.to(tl.int64) * stride_k[1] \
            + tl.cast(k_start, tl.int64) * stride_k[2]
        v_base = V + b.to(tl.int64) * stride_v[0] + kv_h.to(tl.int64) * stride_v[1] \
            + tl.cast(k_start, tl.int64) * stride_v[2]
    if TMA == TMA_HOST:
        q = desc_tile(DESC_Q, b, h, start_m, BLOCK_M, BLOCK_D)
    elif TMA == 2:
        # Not with PACK_GQA (its rows span several heads: no box of one tensor).
        q = row_tiles(Q + b.to(tl.int64) * stride_q[0] + h.to(tl.int64) * stride_q[1]
                      + tl.cast(q_start, tl.int64) * stride_q[2], q_len, stride_q[2],
                      HEAD_DIM, BLOCK_M, BLOCK_D).load([start_m, 0])
    else:
        q = load_rows(Q + q_rows[:, None] + offs_d[None, :], offs_r, n_rows, offs_d, HEAD_DIM_1,
                      True, not EVEN_D)
    q = widen(q, WIDEN)
    if BLOCK_D2:
        offs_d2 = tl.arange(0, BLOCK_D2)
        q2 = widen(load_rows(Q + q_rows[:, None] + BLOCK_D + offs_d2[None, :], offs_r, n_rows,
                             offs_d2, HEAD_DIM_2, True, not EVEN_D2), WIDEN)
    FP8_MODE: tl.constexpr = FP8.mode
    N_MODS: tl.constexpr = len(SPEC.mods)
    if FP8_MODE != 0:
        tl.static_assert(not DROPOUT)
        # One descale per (batch entry or sequence, kv head): scalars for the whole program
        # (with PACK_GQA too: its rows share kv_h).
        ds = score.descale
        qk_descale = load_descale(ds.k, ds.k_strides, b, kv_h)
        if FP8_MODE == 1:
            qk_descale = qk_descale * load_descale(ds.q, ds.q_strides, b, kv_h)
        v_descale = load_descale(ds.v, ds.v_strides, b, kv_h)
    if TMA == 1 or TMA == 2:
        # Descriptors of this (sequence, kv head)'s K and V rows: the bounds are k_len rows
        # (at least 1: an empty sequence's descriptor is never read) and the true head dims.
        k_rows = tl.maximum(k_len, 1) if VARLEN or SEQUSED_K else k_len
        k_desc = row_tiles(k_base, k_rows, stride_k[2], HEAD_DIM, BLOCK_N, BLOCK_D)
        v_desc = row_tiles(v_base, k_rows, stride_v[2], HEAD_DIM_V, BLOCK_N, BLOCK_DV)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo, full_lo, full_hi, hi = key_range(m_lo, m_hi, q_len, k_len, score.window, SPEC.causal,
                                         SPEC.edge, BLOCK_N)
    diag = k_len - q_len
    if SPEC.mask_ranges is not None:
        # The mask mod's own bound on the keys these rows see (kernels/core/mods.py).
        c0, c1 = mask_key_bounds(b, m_lo, m_hi, diag, k_len, score, SPEC, BLOCK_N)
        lo, full_lo, full_hi, hi = clamp_ranges(lo, full_lo, full_hi, hi, c0, c1)
    if SPLIT:
        # Split s takes an even share of this block's key tiles; all bounds stay tile-aligned.
        per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), split.num_splits) * BLOCK_N
        c0 = tl.minimum(lo + split_id * per_split, hi)
        c1 = tl.minimum(c0 + per_split, hi)
        lo, full_lo, full_hi, hi = clamp_ranges(lo, full_lo, full_hi, hi, c0, c1)
    # Three ranges of key tiles (kernels/core/tiles.py), visited in order: RANGE 0, the
    # window's or chunk's left edge (masked; only with an edge); RANGE 1, the tiles every row of
    # the block
    # fully sees (the hot loop: no mask, no bounds checks); RANGE 2, the diagonal band and the
    # ragged last tile (masked). Software pipelining (the config's num_stages) for the loops
    # before the diagonal only: a pipelined loop after the unmasked one, or an unpipelined one
    # before it, makes ptxas serialize every wgmma of the kernel on sm_90 (warning C7515),
    # which forfeits Hopper's tensor-core overlap (tools/sm90_static.py reports it). The
    # diagonal loop is a few tiles long.
    offs_n0 = tl.arange(0, BLOCK_N)
    q_edge = edge_bound(offs_m + diag, score.window, SPEC.edge, False)[:, None] \
        if SPEC.edge != 0 else 0
    # WARP_SPEC: the three ranges as ONE loop over [lo, hi), every tile masked. Triton 3.6's
    # Hopper warp specialisation takes a kernel with a single loop of loads and dots: a second
    # loop before or after it (warp-specialised or not) fails in the pass (MLIR assertion
    # "aBlock && bBlock" in its insertAsyncCopy), a masked tile peeled off the loop or the
    # mask under an ``if`` in it leave the kernel unspecialised, and so does num_warps 8. It
    # also needs Q read by a descriptor (TMA 2 or TMA_HOST; a pointer load fails in the pass),
    # no early return (VARLEN's), and every op of the loop split along the rows between the
    # two consumer warpgroups: dropout's tl.join / reshape of the Philox words is not.
    if WARP_SPEC:
        tl.static_assert((TMA == 2 or TMA == TMA_HOST) and not VARLEN and not PAGED
                         and not DROPOUT, "WARP_SPEC: Q, K, V by descriptors (TMA 2 or 3); "
                         "no VARLEN, PAGED or DROPOUT")
    MASKED: tl.constexpr = (True, WARP_SPEC, True)
    for RANGE in tl.static_range(1 if WARP_SPEC or SPEC.edge == 0 else 0,
                                 2 if WARP_SPEC else 3):
        if WARP_SPEC:
            range_lo, range_hi = lo, hi
        elif RANGE == 0:
            range_lo, range_hi = lo, full_lo
        elif RANGE == 1:
            range_lo, range_hi = full_lo, full_hi
        else:
            range_lo, range_hi = full_hi, hi
        for start_n in tl.range(range_lo, range_hi, BLOCK_N,
                                num_stages=1 if RANGE == 2 else None,
                                warp_specialize=WARP_SPEC):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + offs_n0
            if PAGED:
                page, page_row = page_rows(seq.block_table, seq.bt_stride, PAGED, b,
                                           offs_n, k_len, MASKED[RANGE])
                rows_k = page.to(tl.int64) * stride_k[0] + page_row * stride_k[2]
                k_ptrs = k_base + rows_k[:, None]
                k = load_rows(k_ptrs + offs_d[None, :], offs_n, k_len, offs_d, HEAD_DIM_1,
                              MASKED[RANGE], not EVEN_D)
            elif TMA == TMA_HOST:
                k = desc_tile(DESC_K, b, kv_h, start_n, BLOCK_N, BLOCK_D)
            elif TMA:
                k = k_desc.load([start_n, 0])
            else:
                # 64-bit tile bases so huge (batch·seq·heads·dim > 2**31) tensors never wrap.
                k_ptrs = k_base + start_n.to(tl.int64) * stride_k[2] \
                    + offs_n0[:, None] * stride_k[2]
                k = load_rows(k_ptrs + offs_d[None, :], offs_n, k_len, offs_d, HEAD_DIM_1,
                              MASKED[RANGE], not EVEN_D)
            k = widen(k, WIDEN)
            if FP8_MODE == 2:
                k = k.to(q.dtype)   # e4m3 -> fp16 / bf16 (fp32 when widened): exact
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if BLOCK_D2:
                # The columns past BLOCK_D (MLA's rope key): a second, narrow dot into S.
                k2 = widen(load_rows(k_ptrs + BLOCK_D + offs_d2[None, :], offs_n, k_len, offs_d2,
                                     HEAD_DIM_2, MASKED[RANGE], not EVEN_D2), WIDEN)
                if FP8_MODE == 2:
                    k2 = k2.to(q.dtype)
                qk = tl.dot(q2, tl.trans(k2), qk, input_precision=DOT_PRECISION)
            if FP8_MODE != 0 and N_MODS != 0:
                qk = qk * qk_descale   # the mods see the true scores
            x, x_scale = scaled_scores(qk, b, h_tile, offs_m[:, None], offs_n[None, :], diag,
                                       score, SPEC)
            if FP8_MODE != 0 and N_MODS == 0:
                x_scale = x_scale * qk_descale   # folded: a scalar product per tile
            x = mask_scores(x, b, h_tile, offs_m[:, None], offs_n[None, :], k_len, diag, q_edge,
                            score, SPEC, MASKED[RANGE])
            p, alpha, m_i, l_i = online_softmax(x, x_scale, m_i, l_i, SPEC, MASKED[RANGE])
            acc = acc * alpha[:, None]
            if DROPOUT:
                keep = dropout_keep(drop, drop_seed, drop_rows, offs_m, start_n, BLOCK_M, BLOCK_N,
                                    DROPOUT)
                p = tl.where(keep, p, 0.0)
            if V_IN_K:
                v = k   # V is K's first columns: the tile just read for the scores
            elif PAGED:
                rows_v = page.to(tl.int64) * stride_v[0] + page_row * stride_v[2]
                v = load_rows(v_base + rows_v[:, None] + offs_dv[None, :], offs_n, k_len,
                              offs_dv, HEAD_DIM_V, MASKED[RANGE], not EVEN_DV)
            elif TMA == TMA_HOST:
                v = desc_tile(DESC_V, b, kv_h, start_n, BLOCK_N, BLOCK_DV)
            elif TMA:
                v = v_desc.load([start_n, 0])
            else:
                v = load_rows(v_base + start_n.to(tl.int64) * stride_v[2]
                              + offs_n0[:, None] * stride_v[2] + offs_dv[None, :],
                              offs_n, k_len, offs_dv, HEAD_DIM_V, MASKED[RANGE], not EVEN_DV)
            if FP8_MODE == 1:
                # P in e4m3 (scaled by P_SCALE into e4m3's range), fp8 x fp8 -> fp32.
                acc = tl.dot(p_operand(p, FP8.interpret), v, acc)
            else:
                v = widen(v, WIDEN)
                if FP8_MODE == 2:
                    v = v.to(q.dtype)
                acc = tl.dot(dot_operand(p, v, WIDEN), v, acc, input_precision=DOT_PRECISION)

    # Rows that saw no key (causal with q_len > k_len, empty sequences, a split without keys
    # for them) have l_i = 0: output 0, lse -inf (or the sink's logit).
    o_scale, lse = finish_rows(m_i, l_i, h, score, SPEC.sinks and not SPLIT)
    if FP8_MODE == 1:
        o_scale = o_scale * (v_descale / P_SCALE_C)
    elif FP8_MODE == 2:
        o_scale = o_scale * v_descale
    acc = acc * (drop.scale * o_scale)[:, None]
    lse_rows = row_base + offs_m
    dv_ok = offs_dv < HEAD_DIM_V
    if SPLIT:
        part_rows = split_id.to(tl.int64) * split.n_rows + lse_rows
        tl.store(split.lse_part + part_rows, lse, mask=row_ok)
        tl.store(split.o_part + part_rows[:, None] * HEAD_DIM_V + offs_dv[None, :], acc,
                 mask=row_ok[:, None] & dv_ok[None, :])
    else:
        tl.store(LSE + lse_rows, lse, mask=row_ok)
        o_rows = b.to(tl.int64) * stride_o[0] + h.to(tl.int64) * stride_o[1] \
            + (q_start + offs_m).to(tl.int64) * stride_o[2]
        o_mask = row_ok[:, None] & dv_ok[None, :]
        tl.store(O + o_rows[:, None] + offs_dv[None, :],
                 round_for_store(acc, FP8.round_out if FP8_MODE != 0 else WIDEN
                                 ).to(O.dtype.element_ty), mask=o_mask)


def tma_mode(pb, pack_gqa=False, dense=False) -> int:
    """The forward's TMA constexpr for a launch on problem ``pb`` (``_attn_fwd``'s docstring):
    descriptor loads where the GPU takes them (``tma_capable``: sm_90, and the interpreter)
    and the layout allows them; per-thread loads (0) elsewhere. ``dense``: a call without
    packed sequences, key lengths or pages, whose Q, K, V can be described whole: then host
    descriptors (``TMA_HOST``), made once per call instead of three per program, when
    ``tma.host_desc_layout`` takes all three (not with PACK_GQA). What TMA cannot do, hence
    the fallback: strides or a base address that are not multiples of 16 bytes (odd head dims
    with contiguous rows, e.g. 1, 17 or 20 fp16 elements, views at odd offsets), a zero row
    stride (rows expanded from one; a zero batch or head stride is fine for the in-kernel
    descriptors: it only enters the base), padded head dims over 256 (a box is at most 256
    elements a side: head_dim 512), GPUs without TMA (sm_80 / 86 / 89) or not yet tuned with
    it (sm_100, sm_120: ``configs.TMA_MAJORS``); Q also with PACK_GQA, whose tile mixes query
    heads (1: K and V only). Packed sequences and KV caches need no fallback: each program's
    in-kernel descriptors end at its own sequence's k_len."""
    if not tma_capable(pb.q.device):
        return 0
    width, width_v = block_d(pb.q.shape[-1]), block_d(pb.v.shape[-1])
    if not (tma_rows_ok(pb.k, pb.strides(pb.k), pb.k_len, width)
            and tma_rows_ok(pb.v, pb.strides(pb.v), pb.k_len, width_v)):
        return 0
    q_ok = not pack_gqa and tma_rows_ok(pb.q, pb.strides(pb.q), pb.q_len, width)
    if q_ok and dense and not pb.varlen and host_descriptors_enabled() and all(
            host_desc_layout(x) is not None for x in (pb.q, pb.k, pb.v)):
        return TMA_HOST_MODE
    return 2 if q_ok else 1


_TILE_COUNTERS = {}   # (device index, stream) -> int32 (2,), zero between launches


def stream_key(device):
    """(device index, current stream) of ``device``, as ``launch.launch_context`` gives them
    for direct launches; (None, 0) off CUDA (the interpreter runs one launch at a time)."""
    if device.type != "cuda":
        return None, 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, torch.cuda.current_stream(index).cuda_stream


def tile_counter(device, key):
    """The persistent forward's tile counter (``SchedArgs.tiles``) for launches on ``key``
    (``stream_key``): one per stream, since the launches of one stream run one after another
    and each leaves it zero, while two streams' launches may run at once. Made on first use
    (inside a CUDA graph capture too: the graph's launches then use the capture stream's)."""
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        counter = _TILE_COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


# The host descriptors' blocks (``TMA_HOST``): the (rows, width) constexprs of each tensor's.
_DESC_BLOCKS = {"DESC_Q": ("BLOCK_M", "BLOCK_D"), "DESC_K": ("BLOCK_N", "BLOCK_D"),
                "DESC_V": ("BLOCK_N", "BLOCK_DV")}


def set_desc_blocks(nargs):
    """A forward config's ``pre_hook``: the host descriptors' blocks (``TMA_HOST``) for the
    config's tiles, (1, 1, BLOCK_M, BLOCK_D) for Q and (1, 1, BLOCK_N, BLOCK_D or BLOCK_DV)
    for K and V. The autotuner calls it before timing or launching a config, as
    ``launch_first_compiling`` does; nothing to do without host descriptors."""
    set_row_blocks(nargs, _DESC_BLOCKS)


def _with_desc_blocks(configs):
    """``configs`` as copies whose pre_hook is ``set_desc_blocks``, WARP_SPEC off where they do
    not set it (every launch passes it: a direct launch takes each parameter's value)."""
    return with_pre_hook(configs, set_desc_blocks, WARP_SPEC=False)


_attn_fwd_tuned = triton.autotune(configs=_with_desc_blocks(fwd_configs()), key=FWD_TUNE_KEY,
                                  prune_configs_by={"early_config_prune": prune_configs}
                                  )(_attn_fwd)


def attention_forward(q, k, v, call=None, *, cu_seqlens_q=None, cu_seqlens_k=None,
                      max_seqlen_q=None, max_seqlen_k=None, k_lens=None, num_splits=1,
                      pack_gqa=None, out=None, config=None, tma=None, block_table=None,
                      persistent=None, v_in_k=False, **call_fields):
    """Launch the fused forward on validated inputs.

    Args:
        q: (B, heads_q, q_len, D); k, v: (B, heads_kv, k_len, D) with heads_q % heads_kv == 0
            (query head h reads kv head h // (heads_q // heads_kv)); v may have its own head
            dim Dv (then o has Dv). Packed sequences (with ``cu_seqlens_q``): q (total_q,
            heads_q, D), k (total_k, heads_kv, D), v (total_k, heads_kv, Dv). Same dtype and
            device, unit stride in the last dim (any other strides), 1 <= D, Dv <= 512; D up
            to 576 (``common.MAX_HEAD_DIM_LATENT``) with k_lens (the cache paths).
        call: the call's ``AttentionCall`` (kernels/core/call.py: causal, softmax_scale,
            dropout_p, seed, window, chunk_size, drop_layout, mods); or its fields as keywords
            (``causal=``,
            ``softmax_scale=``, ``dropout_p=``, ``seed=``, ...).
        cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,) row offsets of the packed sequences
            (validated by the caller); max_seqlen_q, max_seqlen_k: ints >= every sequence's
            length (the grid covers them).
        k_lens: optional int32 (B,), or (num_seqs,) with packed sequences (FlashAttention's
            seqused_k): batch entry or sequence b uses only its first k_lens[b] keys (a KV
            cache's filled length; k_len is then the cache's capacity).
        num_splits: split each query block's keys over this many programs, merged by
            kernels/core/splitkv.py (flash-decoding); 1 = no split; 0 = ``num_splits_heuristic``.
        pack_gqa: one program for all query heads of a kv group (each K/V tile read once per
            group); None = when the group is > 1 and q_len <= PACK_GQA_MAX_Q_LEN (decoding).
        out: optional tensor shaped like the output to write into (test hook / preallocated).
        config: a ``triton.Config`` with BLOCK_M, BLOCK_N to force (tests); default: autotuned
            on a GPU (or the first fitting config with KERNELS_AUTOTUNE=0), the small
            interpreter config under TRITON_INTERPRET=1.
        tma: the kernel's TMA mode to force (0 = per-thread loads; tests); default
            ``tma_mode``: tensor-descriptor loads where the GPU and the layout allow them.
        persistent: launch one program per SM or two (``configs.persistent_programs``), each
            drawing query blocks from a per-stream counter, longest first, instead of a
            program per block (not with packed sequences, whose short sequences leave
            programs without rows; on GPUs of ``configs.PERSISTENT_MAJORS`` only: sm_90);
            default ``configs.persistent_enabled()`` (off). The same results, bit for bit.
        block_table: optional int32 (B, max_blocks), unit column stride, with k_lens: k, v are
            paged caches (num_blocks, page_size, heads_kv, D or Dv) viewed by
            ``paged.paged_view``; key position j of batch entry b is row j % page_size of page
            block_table[b, j // page_size] (kernels/core/paged.py). Per-thread loads. With
            packed queries (``cu_seqlens_q``, no ``cu_seqlens_k``; not with dropout) too: one
            table row per sequence, whose key count is k_lens[s]
            (``kvcache.varlen_paged_forward`` takes the caches unviewed).
        v_in_k: v is k's first Dv columns (the same pointer and strides; MLA's latent cache):
            the kernel reads V from the K tiles (``KeyLayout.v_in_k``) where the tiles allow it
            (Dv = min(D, 512) and per-thread loads), else from v as usual. The caller's plan
            key must hold it: plans are not keyed on pointers.
        FP8 (kernels/core/fp8.py; forward only, no dropout): q, k, v torch.float8_e4m3fn, or
            k, v e4m3 with fp16 / bf16 q; their descales in ``call.mods.descale``
            (``mods.Descale(q, k, v)``, each None = 1 or fp32 (B or num_seqs, heads_kv), any
            strides), the output dtype in ``call.out_dtype``.
    Returns:
        (o, lse): o shaped like q with v's head dim, in ``call.out_dtype`` (default q's dtype;
        bf16 for e4m3 q: ``call.out_dtype_of``), with q's memory layout when
        q is dense and Dv == D;
        lse fp32 (B, heads_q, q_len), or (heads_q, total_q) for packed sequences: natural-log
        row log-sum-exp, -inf for rows that see no key.
    """
    call = call or AttentionCall(**call_fields)
    plan = ForwardPlan(q, k, v, call, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, k_lens=k_lens,
                       num_splits=num_splits, pack_gqa=pack_gqa, config=config, tma=tma,
                       block_table=block_table, out=out, persistent=persistent,
                       v_in_k=v_in_k)
    return plan(q, k, v, call, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                k_lens=k_lens, block_table=block_table, out=out)


class ForwardPlan:
    """The forward launch of one call signature (``attention_forward``'s arguments less the
    tensors' contents): grid, constexprs, strides, config and, after the first launch, the
    compiled kernel (kernels/core/launch.py). Built once and called per call with that
    signature's tensors: a call then costs two allocations, the per-call argument tuples and a
    direct launch. The tensors given to ``__init__`` are not kept."""

    def __init__(self, q, k, v, call, *, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, k_lens=None, num_splits=1,
                 pack_gqa=None, config=None, tma=None, block_table=None, out=None,
                 persistent=None, v_in_k=False):
        paged = block_table is not None
        if paged and cu_seqlens_q is not None:
            pb = paged_varlen_problem(q, k, v, cu_seqlens_q, max_seqlen_q, block_table)
            # Not defined for this layout (no Philox column layout over pages is promised).
            assert not call.dropout, "dropout over a paged cache with packed queries"
        else:
            pb = make_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            if paged:
                pb = paged_problem(pb, block_table)
        assert not paged or k_lens is not None
        assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
        D, Dv = q.shape[-1], v.shape[-1]
        self.varlen, self.paged, self.Dv = pb.varlen, paged, Dv
        self.lse_shape, self.lse_numel = pb.lse_shape, math.prod(pb.lse_shape)
        self.empty = q.numel() == 0 or pb.batch == 0 or Dv == 0
        self.dropout = call.dropout
        if self.empty:
            return
        if pack_gqa is None:
            # Decoding: a few queries per sequence, dense or packed over pages (MLA's 128 query
            # heads on one latent head fill a tile with one token each).
            pack_gqa = (pb.group > 1 and (paged or not pb.varlen)
                        and pb.q_len <= PACK_GQA_MAX_Q_LEN)
        assert not (pack_gqa and pb.varlen and not paged), \
            "packed GQA heads: dense calls or packed queries over pages (no dropout)"
        rows, heads = (pb.group * pb.q_len, pb.heads_kv) if pack_gqa else (pb.q_len, pb.heads)
        if num_splits == 0:
            # A paged cache's k_len is its capacity; max_seqlen_k, when given, is tighter.
            k_extent = min(max_seqlen_k, pb.k_len) if paged and max_seqlen_k else pb.k_len
            m_blocks, n_tiles = nominal_tiles(rows, k_extent)
            num_splits = num_splits_heuristic(q.device, pb.batch * heads * m_blocks, n_tiles)
        self.num_splits = num_splits = clamp_splits(num_splits, pb.k_len)
        # Pointers a launch never reads (dummies), and the per-call tuples that hold no
        # per-call tensor, made once. The lse strides are those of a fresh lse.
        self.dummy = dummy = torch.empty(1, dtype=torch.float32, device=q.device)
        # The output's strides are part of the compiled kernel's specialisation: every call
        # allocates it as this one does (``out``, when given, must have the same strides).
        if out is None:
            out = new_out(q, Dv, call.out_dtype)
        self.o_stride = out.stride()
        self.out_dtype = out.dtype
        fp8 = fp8_spec(q.dtype, k.dtype, out.dtype)
        # FP8 is forward only and without dropout (the public layer refuses both).
        assert not (fp8.mode != FP8_NONE and call.dropout), "dropout with FP8 inputs"
        self.fp8_mode = fp8.mode
        # The 1.0 that stands in for a descale the call does not give (FP8 only).
        self.one = one_descale(q.device) if fp8.mode else None
        o_strides = pb.strides(packed_view(out) if pb.varlen else out)
        self.pb = pb._replace(q=None, k=None, v=None)
        self.seq = None if pb.varlen or k_lens is not None else pb.seq_args(dummy)
        # The seed pointer: a dummy here, the call's seed tensor per call with dropout.
        self.drop = pb.drop_args(call, dummy, seed=dummy)
        self.score = None if call.mods.has_tensors else self.score_args(call)
        self.split = SplitArgs(o_part=dummy, lse_part=dummy, num_splits=num_splits,
                               n_rows=self.lse_numel)
        block_dk, block_d2 = head_blocks(D)
        # V read from the K tiles: only as the first K tile, whole, with per-thread loads.
        v_in_k = bool(v_in_k) and Dv == min(D, block_dk) and block_d(Dv) == block_dk
        if paged or block_d2 or v_in_k:
            # A tile's rows may lie on different pages: no descriptor box. A split head dim
            # and V inside K are per-thread loads (descriptors: one box per tensor).
            tma = 0
        elif tma is None:
            tma = tma_mode(pb, pack_gqa=bool(pack_gqa), dense=k_lens is None)
        # Host descriptors (TMA_HOST): made per call from q, k, v, passed as the DESC_*
        # parameters (KernelStep's ``descs``: kernel parameter -> (per-call tensor, shape,
        # strides)); the kernel then reads no tile through Q, K, V, which get the plan's dummy
        # (a fixed pointer: the launcher does not look three tensors up per call).
        host = tma == TMA_HOST_MODE
        self.tile_params = ("DESC_Q", "DESC_K", "DESC_V") if host else ("Q", "K", "V")
        descs = host_descs((("DESC_Q", pb.q), ("DESC_K", pb.k), ("DESC_V", pb.v))) \
            if host else {}
        # A paged view's batch stride is the page stride, with packed queries too.
        kv_strides = (lambda x: x.stride()[:3]) if paged else pb.strides
        fixed = dict(strides=FwdStrides(q=pb.strides(pb.q), k=kv_strides(pb.k),
                                        v=kv_strides(pb.v), o=o_strides, lse=pb.lse_strides),
                     BUCKETS=pb.tune_buckets(),
                     HEAD_DIM=D, BLOCK_D=block_dk, HEAD_DIM_V=Dv,
                     BLOCK_DV=block_d(Dv), SPEC=score_spec(call, q.dtype), KEYS=KeyLayout(
                         varlen=pb.varlen, k_lens=k_lens is not None,
                         page_size=k.shape[2] if paged else 0, v_in_k=v_in_k),
                     PACK_GQA=bool(pack_gqa), SPLIT=num_splits > 1, DROPOUT=call.dropout_mode,
                     PRECISION=Precision(widen=widen_bf16(q.dtype),
                                         dot=dot_precision(q.dtype)), TMA=tma,
                     FP8=fp8, **{name: None for name in ("DESC_Q", "DESC_K", "DESC_V")
                                 if name not in descs},
                     **(dict(Q=dummy, K=dummy, V=dummy) if host else {}))

        if persistent is None:
            persistent = persistent_enabled()
        # Packed sequences return early from the tiles past a short sequence's rows: a grid.
        self.persistent = persistent = (bool(persistent) and not pb.varlen
                                        and persistent_capable(q.device))
        self.scheds = {}   # persistent: (device, stream) -> SchedArgs
        self.sched_extents = (heads, pb.batch)
        if persistent:
            programs = persistent_programs(q.device)
            fixed["BUCKETS"] = (*fixed["BUCKETS"], 1)   # tuned apart from the grid launch
        else:
            fixed["sched"] = None

        def grid(cfg):
            if persistent:
                tiles = triton.cdiv(rows, cfg["BLOCK_M"]) * num_splits * heads * pb.batch
                return (min(tiles, programs), 1, 1)
            return (triton.cdiv(rows, cfg["BLOCK_M"]) * num_splits, heads, pb.batch)

        if config is None and not interpreter_active() and autotune_enabled():
            configs = None
        elif config is not None:
            configs = _with_desc_blocks([config])
        elif interpreter_active():
            # Autotuning in the interpreter would time every config in Python: one config.
            configs = _with_desc_blocks(fwd_configs(interpret=True))
        else:   # KERNELS_AUTOTUNE=0: the pruned list's first config that compiles
            configs = fixed_configs(_with_desc_blocks(fwd_configs()), prune_configs, dict(
                fixed, Q=pb.q, K=pb.k, V=pb.v, O=q, LSE=dummy, seq=self.seq, score=self.score,
                drop=self.drop, split=self.split))
        self.step = KernelStep(_attn_fwd, grid, fixed, configs=configs, tuned=_attn_fwd_tuned,
                               scratch=tma in (1, 2), descs=descs)

    def score_args(self, call):
        """The kernel's ``score`` for ``call`` (its mods' tensors), with the FP8 descales."""
        score = score_args(call, self.dummy)
        if self.one is not None:
            score = score._replace(descale=descale_args(call.mods.descale, self.one))
        return score

    def __call__(self, q, k, v, call, *, cu_seqlens_q=None, cu_seqlens_k=None, k_lens=None,
                 block_table=None, out=None, seed=None):
        """(o, lse) of this signature's tensors (as ``attention_forward`` returns them);
        ``call`` gives the per-call tensors: the seed (or ``seed``, its tensor on q's device),
        the mods' aux tensors and sinks."""
        Dv = self.Dv
        if self.empty:
            return (new_out(q, Dv, call.out_dtype) if out is None else out,
                    torch.empty(self.lse_shape, dtype=torch.float32, device=q.device))
        try:
            o_like_q, lse_like = self.alloc_like
        except AttributeError:
            # The first call: the outputs as ``torch.empty_like`` of a tensor, about half
            # ``torch.empty``'s host cost: o like q where ``new_out`` gives q's layout, the lse
            # like a float32 scalar expanded to its shape (``empty_like``: contiguous).
            o_like_q = (self.out_dtype == q.dtype and Dv == q.shape[-1]
                        and q.stride(-1) == 1)
            with torch.inference_mode(False):
                lse_like = torch.empty((), dtype=torch.float32,
                                       device=q.device).expand(self.lse_shape)
            assert torch.empty_like(lse_like).is_contiguous()   # the kernel's lse strides
            self.alloc_like = o_like_q, lse_like
        if out is not None:
            assert out.stride() == self.o_stride, (out.stride(), self.o_stride)
            o = out
        else:
            o = torch.empty_like(q) if o_like_q else new_out(q, Dv, self.out_dtype)
        lse = torch.empty_like(lse_like)
        pb = self.pb
        if self.varlen:
            q4, o4 = packed_view(q), packed_view(o)
            # Paged caches come as their (num_blocks, heads_kv, page_size, D) views already.
            k4, v4 = (k, v) if self.paged else (packed_view(k), packed_view(v))
            seq = pb._replace(cu_q=cu_seqlens_q, cu_k=cu_seqlens_k).seq_args(
                self.dummy, k_lens, block_table)
        else:
            q4, k4, v4, o4 = q, k, v, o
            seq = self.seq if self.seq is not None else pb._replace(k=k).seq_args(
                self.dummy, k_lens, block_table)
        split = self.split
        if self.num_splits > 1:
            split = split._replace(
                o_part=torch.empty((self.num_splits, self.lse_numel, Dv), dtype=torch.float32,
                                   device=q.device),
                lse_part=torch.empty((self.num_splits, self.lse_numel), dtype=torch.float32,
                                     device=q.device))
        qn, kn, vn = self.tile_params
        per_call = {
            qn: q4, kn: k4, vn: v4, "O": o4, "LSE": lse, "seq": seq,
            "score": self.score if self.score is not None else self.score_args(call),
            "drop": self.drop if not self.dropout else DropArgs(
                seed_tensor(call.seed, q.device) if seed is None else seed, *self.drop[1:]),
            "split": split}
        ctx = None
        if self.persistent:
            # The launch's stream picks its counter (launches on one stream run in order).
            ctx = launch_context() if self.step.direct is not None else None
            key = ctx if ctx is not None else stream_key(q.device)
            sched = self.scheds.get(key)
            if sched is None:
                sched = self.scheds[key] = SchedArgs(tile_counter(q.device, key),
                                                     *self.sched_extents)
            per_call["sched"] = sched
        self.step(q.device, per_call, ctx)
        if self.num_splits > 1:
            combine_splits(split.o_part, split.lse_part, o4, lse, call.mods.sinks)
        return o, lse
