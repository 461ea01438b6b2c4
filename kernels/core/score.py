"""The score pipeline: what happens to a tile of scores between the two matmuls, written once
for the forward, dK/dV and dQ kernels.

For a tile ``qk = Q Kᵀ`` of query ``rows`` × key ``cols`` (either orientation: the dK/dV kernel
works on the transposed tile and passes its indices transposed)::

    x, x_scale = scaled_scores(qk, score)     base-2 scores x · x_scale -- the one place for
                                              score modifications
    forward:   x = mask_scores(x, ...)        -inf where invisible (MASKED tiles only)
               p, alpha, m_i, l_i = online_softmax(x, x_scale, m_i, l_i)
    backward:  p = probs_from_lse(x, x_scale, lse2, ...)   exp2(x·x_scale - lse·log2 e),
                                                          0 where invisible
               ds = score_grad(p * (dp - delta), qk, score)   chain rule of the score mods
    both:      keep = dropout_keep(drop, ...)       the same Philox bits in all three kernels

The plain score keeps the scale out of the tile (x = qk, x_scale = softmax_scale · log2 e):
the row max is taken on qk and scaled once per row, and each weight costs one fused
multiply-add, ``exp2(qk · x_scale - m)``, as in the Triton tutorial. (Scaling by a positive
number preserves the order of the scores, so max(qk) · scale is the max of the scaled scores.)

``score`` is the launch's ``ScoreArgs`` (kernels/core/call.py): ``qk_scale`` = softmax scale
× log2(e), ``window``. Visibility is ``kernels/core/tiles.visible``; only tiles that cross an
edge of it (MASKED) pay for the mask. The PyTorch fallback (kernels/core/fallback.py) mirrors
each step in one function of its own.

Adding a score modification s = f(scale · qk) means editing ``scaled_scores`` (return
(f(scale · qk) · log2 e, 1.0)) and ``score_grad`` (multiply dS by f'), plus their PyTorch twins
in the fallback and the oracle.
"""
import triton
import triton.language as tl

from .dropout import dropout_keep_tile
from .tiles import visible


@triton.jit
def scaled_scores(qk, score):
    """(x, x_scale): the base-2 scores of the fp32 tile ``qk`` are ``x · x_scale``. For the
    plain score, ``(qk, softmax_scale · log2 e)``: the consumers fold the multiply into their
    exp2's argument."""
    return qk, score.qk_scale


@triton.jit
def score_grad(ds, qk, score):
    """dS with respect to the unscaled ``qk``, up to the softmax scale that the kernels apply
    once to the finished dQ and dK: ``ds · f'(scale · qk)`` for a score modification f. The
    plain score has f' = 1."""
    return ds


@triton.jit
def mask_scores(x, rows, cols, k_len, diag, score, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``x`` with -inf where query ``rows`` do not see key ``cols`` (MASKED tiles only)."""
    if MASKED:
        x = tl.where(visible(rows, cols, k_len, diag, score.window, CAUSAL, WINDOW), x,
                     float("-inf"))
    return x


@triton.jit
def online_softmax(x, x_scale, m_i, l_i, MASKED: tl.constexpr):
    """One step of the online softmax over the masked score tile ``x`` (BLOCK_M rows), whose
    base-2 scores are ``x · x_scale`` (``x_scale`` > 0).

    Returns (p, alpha, m_new, l_new): the tile's unnormalised weights ``exp2(x · x_scale -
    m_new)``, the factor ``exp2(m_i - m_new)`` that rescales what was accumulated before, and
    the updated running row max (base 2) and row sum. The row sum counts every weight: dropout
    zeroes weights after it.
    """
    m_new = tl.maximum(m_i, tl.max(x, 1) * x_scale)
    if MASKED:
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
def probs_from_lse(x, x_scale, lse2, rows, cols, k_len, diag, score, MASKED: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """The forward's softmax weights, recomputed: ``exp2(x · x_scale - lse2)`` with ``lse2``
    the rows' lse × log2(e) broadcast against ``x``, 0 where invisible (MASKED tiles only).

    The mask is applied after the exp (to p, not to s) so that unmasked and masked tiles share
    one fused multiply-add per score.
    """
    p = tl.math.exp2(x * x_scale - lse2)
    if MASKED:
        p = tl.where(visible(rows, cols, k_len, diag, score.window, CAUSAL, WINDOW), p, 0.0)
    return p


@triton.jit
def dropout_keep(drop, row_base, offs_m, start_n, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr):
    """Keep mask (BLOCK_M, BLOCK_N) of query rows ``row_base + offs_m`` (row ids,
    kernels/core/dropout.py) and key columns ``start_n + arange(BLOCK_N)`` under the launch's
    ``drop`` (``DropArgs``). DROPOUT: the launch's mode (``AttentionCall.dropout_mode``: 1 =
    columns start on a Philox group, 2 = any column offset)."""
    return dropout_keep_tile(drop.seed, row_base, offs_m, start_n, drop.groups, drop.threshold,
                             BLOCK_M, BLOCK_N, drop.col0, DROPOUT == 1)
