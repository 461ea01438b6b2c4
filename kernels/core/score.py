"""The score pipeline: what happens to a tile of scores between the two matmuls, written once
for the forward, dK/dV and dQ kernels.

For a tile ``qk = Q Kᵀ`` of query ``rows`` × key ``cols`` (either orientation: the dK/dV kernel
works on the transposed tile and passes its indices transposed)::

    x, x_scale = scaled_scores(qk, ...)       base-2 scores x · x_scale: the score mods
    forward:   x = mask_scores(x, ...)        -inf where invisible (masked tiles only)
               p, alpha, m_i, l_i = online_softmax(x, x_scale, m_i, l_i, SPEC, MASKED)
               ... o, lse = finish_rows(acc, m_i, l_i, ...)      the sinks join the rows here
    backward:  p = probs_from_lse(x, x_scale, lse2, ...)   exp2(x·x_scale - lse·log2 e),
                                                          0 where invisible
               ds = score_grad(p * (dp - delta), qk, ...)   chain rule of the score mods
    both:      keep = dropout_keep(drop, ...)       the same Philox bits in all three kernels

The plain score keeps the scale out of the tile (x = qk, x_scale = softmax_scale · log2 e):
the row max is taken on qk and scaled once per row, and each weight costs one fused
multiply-add, ``exp2(qk · x_scale - m)``, as in the Triton tutorial. (Scaling by a positive
number preserves the order of the scores, so max(qk) · scale is the max of the scaled scores.)
With score modifications (``SPEC.mods``: soft-capping, ALiBi, a user's mod; kernels/core/mods.py)
the tile is s = f(scale · qk) in natural units and x_scale = log2 e.

``score`` is the launch's ``ScoreArgs`` and ``SPEC`` its ``ScoreSpec`` constexpr
(kernels/core/call.py): causal, the left edge (window / chunk), the mods, the mask mod, sinks.
Visibility is ``kernels/core/tiles.visible`` and the mask mod; without a mask mod only tiles
that cross an edge of the visibility rule (MASKED) pay for the mask, with one every tile does.
The PyTorch fallback (kernels/core/fallback.py) mirrors each step in one function of its own.

Tile coordinates every mod gets: ``b`` (batch entry or packed sequence), ``h`` (query head:
a scalar, or per row with packed GQA heads), ``rows`` (query indices, broadcastable), ``cols``
(key indices, broadcastable) and ``diag`` = k_len - q_len: a mod sees the query's position on
the key axis, ``rows + diag``.
"""
import triton
import triton.language as tl

from .common import LN2, LOG2E
from .dropout import dropout_keep_tile
from .tiles import visible

_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)


@triton.jit
def _apply_mods(s, b, h, q_idx, kv_idx, score, SPEC: tl.constexpr, UPTO: tl.constexpr):
    """The first UPTO score mods of SPEC applied in order to the natural-unit scores ``s``."""
    for i in tl.static_range(UPTO):
        s = SPEC.mods[i].fn(s, b, h, q_idx, kv_idx, score.aux[i])
    return s


@triton.jit
def scaled_scores(qk, b, h, rows, cols, diag, score, SPEC: tl.constexpr):
    """(x, x_scale): the base-2 scores of the fp32 tile ``qk`` are ``x · x_scale``. For the
    plain score, ``(qk, softmax_scale · log2 e)``: the consumers fold the multiply into their
    exp2's argument. With score mods, ``(f(softmax_scale · qk), log2 e)``."""
    N_MODS: tl.constexpr = len(SPEC.mods)
    if N_MODS == 0:
        return qk, score.qk_scale
    else:
        s = _apply_mods(qk * score.softmax_scale, b, h, rows + diag, cols, score, SPEC, N_MODS)
        return s, _LOG2E


@triton.jit
def score_grad(ds, qk, b, h, rows, cols, diag, score, SPEC: tl.constexpr):
    """dS with respect to the unscaled ``qk``, up to the softmax scale that the kernels apply
    once to the finished dQ and dK: ``ds · f'(scale · qk)`` for the score mods f, applied last
    to first (each mod's ``grad`` gets its own input, recomputed from ``qk``: the compiler
    shares the recomputation with ``scaled_scores``). Mods without ``grad`` have f' = 1."""
    N_MODS: tl.constexpr = len(SPEC.mods)
    if N_MODS != 0:
        s0 = qk * score.softmax_scale
        q_idx = rows + diag
        for j in tl.static_range(N_MODS):
            if SPEC.mods[N_MODS - 1 - j].grad is not None:
                ds = SPEC.mods[N_MODS - 1 - j].grad(
                    ds, _apply_mods(s0, b, h, q_idx, cols, score, SPEC, N_MODS - 1 - j),
                    b, h, q_idx, cols, score.aux[N_MODS - 1 - j])
    return ds


@triton.jit
def mods_aux_grad(ds, qk, b, h, rows, cols, diag, score, SPEC: tl.constexpr):
    """Adds the gradients of the score mods' differentiable aux into ``score.daux`` (the
    buffers parallel to the call's ``mod_aux``), for the mods whose ``aux_grad`` SPEC carries
    (only the dQ launch's SPEC does; kernels/core/mods.py). ``ds``: the tile's gradient with
    respect to the final scores (queries, keys), chained back to each mod's output before its
    ``aux_grad`` gets it. Compiles to nothing when no mod has one."""
    N_MODS: tl.constexpr = len(SPEC.mods)
    for j in tl.static_range(N_MODS):
        if SPEC.mods[N_MODS - 1 - j].aux_grad is not None:
            s0 = qk * score.softmax_scale
            SPEC.mods[N_MODS - 1 - j].aux_grad(
                ds, _apply_mods(s0, b, h, rows + diag, cols, score, SPEC, N_MODS - 1 - j),
                b, h, rows + diag, cols, score.aux[N_MODS - 1 - j], score.daux)
        if j + 1 < N_MODS:   # only mods before one with aux_grad need the chained ds
            if SPEC.mods[N_MODS - 1 - j].grad is not None:
                ds = SPEC.mods[N_MODS - 1 - j].grad(
                    ds, _apply_mods(qk * score.softmax_scale, b, h, rows + diag, cols, score,
                                    SPEC, N_MODS - 1 - j),
                    b, h, rows + diag, cols, score.aux[N_MODS - 1 - j])


@triton.jit
def _visible(b, h, rows, cols, k_len, diag, edge, score, SPEC: tl.constexpr,
             ON_KEYS: tl.constexpr):
    """The visibility rule (kernels/core/tiles.py; ``edge``: its ``edge_bound``) and the mask
    mod, if any."""
    vis = visible(rows, cols, k_len, diag, edge, SPEC.causal, SPEC.edge, ON_KEYS)
    if SPEC.mask_mod is not None:
        vis = vis & SPEC.mask_mod(b, h, rows + diag, cols, score.mask_aux)
    return vis


@triton.jit
def mask_scores(x, b, h, rows, cols, k_len, diag, edge, score, SPEC: tl.constexpr,
                MASKED: tl.constexpr):
    """``x`` with -inf where query ``rows`` do not see key ``cols`` (MASKED tiles only; every
    tile with a mask mod). ``edge``: ``tiles.edge_bound`` of the rows' positions."""
    if MASKED or SPEC.mask_mod is not None:
        x = tl.where(_visible(b, h, rows, cols, k_len, diag, edge, score, SPEC, False), x,
                     float("-inf"))
    return x


@triton.jit
def online_softmax(x, x_scale, m_i, l_i, SPEC: tl.constexpr, MASKED: tl.constexpr):
    """One step of the online softmax over the masked score tile ``x`` (BLOCK_M rows), whose
    base-2 scores are ``x · x_scale`` (``x_scale`` > 0).

    Returns (p, alpha, m_new, l_new): the tile's unnormalised weights ``exp2(x · x_scale -
    m_new)``, the factor ``exp2(m_i - m_new)`` that rescales what was accumulated before, and
    the updated running row max (base 2) and row sum. The row sum counts every weight: dropout
    zeroes weights after it. MASKED: ``mask_scores`` masked the tile (it may hold -inf).

    -inf scores come from the mask, and from score mods too (a mod may mask by returning -inf,
    as FlexAttention's do): with any mod in SPEC every tile is guarded. The plain score's
    unmasked tiles have finite scores and compile without the guard.
    """
    MAY_HOLD_NEG_INF: tl.constexpr = MASKED or SPEC.mask_mod is not None or len(SPEC.mods) != 0
    m_new = tl.maximum(m_i, tl.max(x, 1) * x_scale)
    if MAY_HOLD_NEG_INF:
        # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead of
        # -inf avoids (-inf) - (-inf) = NaN and leaves its p at exp2(-inf) = 0.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(x * x_scale - m_sub[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def finish_rows(m_i, l_i, h, score, SINKS: tl.constexpr):
    """(o_scale, lse) at the end of the online softmax: the factor that normalises a row's
    accumulator and the row's natural-log log-sum-exp.

    With SINKS (the launch's ``SPEC.sinks``, off for split-KV partials) the head's sink logit
    joins the denominator:
    lse = log(exp(sink_h) + Σ_j exp(s_j)). Rows that saw no key (l_i = 0) get o_scale 0 and
    lse -inf -- or, with a sink, lse = sink_h (their output stays 0: the sink has no value).
    """
    if SINKS:
        sink2 = tl.load(score.sinks + h) * _LOG2E
        m_f = tl.maximum(m_i, sink2)
        m_f = tl.where(m_f == float("-inf"), 0.0, m_f)
        seen = tl.exp2(m_i - m_f)
        l_f = l_i * seen + tl.exp2(sink2 - m_f)
        empty = l_f == 0.0
        l_safe = tl.where(empty, 1.0, l_f)
        o_scale = seen / l_safe
    else:
        m_f = m_i
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        o_scale = 1.0 / l_safe
    lse = tl.where(empty, float("-inf"), (m_f + tl.log2(l_safe)) * _LN2)
    return o_scale, lse


@triton.jit
def probs_from_lse(x, x_scale, lse2, b, h, rows, cols, k_len, diag, edge, score,
                   SPEC: tl.constexpr, MASKED: tl.constexpr, ON_KEYS: tl.constexpr):
    """The forward's softmax weights, recomputed: ``exp2(x · x_scale - lse2)`` with ``lse2``
    the rows' lse × log2(e) broadcast against ``x``, 0 where invisible (MASKED tiles only;
    every tile with a mask mod). ``edge``: ``tiles.edge_bound`` of the rows' positions, or with
    ON_KEYS of the cols.

    The mask is applied after the exp (to p, not to s) so that unmasked and masked tiles share
    one fused multiply-add per score.
    """
    p = tl.math.exp2(x * x_scale - lse2)
    if MASKED or SPEC.mask_mod is not None:
        p = tl.where(_visible(b, h, rows, cols, k_len, diag, edge, score, SPEC, ON_KEYS), p,
                     0.0)
    return p


@triton.jit
def dropout_keep(drop, seed, row_base, offs_m, start_n, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr):
    """Keep mask (BLOCK_M, BLOCK_N) of query rows ``row_base + offs_m`` (row ids,
    kernels/core/dropout.py) and key columns ``start_n + arange(BLOCK_N)`` under the launch's
    ``drop`` (``DropArgs``) and its ``seed``, loaded once per program from ``drop.seed``
    (kernels/core/dropout.py ``load_seed``). DROPOUT: the launch's mode
    (``AttentionCall.dropout_mode``: 1 = columns start on a Philox group, 2 = any column
    offset)."""
    return dropout_keep_tile(seed, row_base, offs_m, start_n, drop.groups, drop.threshold,
                             BLOCK_M, BLOCK_N, drop.col0, DROPOUT == 1)
