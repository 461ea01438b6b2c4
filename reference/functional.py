"""Plain-PyTorch attention: the numerical oracle (float64) and low-precision baseline for parity.

Used with ``tests/helpers.assert_parity``: ``attention(..., upcast=True)`` is the float64 truth,
``attention(..., upcast=False)`` is what naive PyTorch achieves in the input dtype; a kernel
passes when its error is within a small multiple of the latter's.

Causal alignment is bottom-right (FlashAttention's convention, not PyTorch SDPA's top-left):
the last query row lines up with the last key column. Query ``i`` sees key ``j`` iff
``j <= i + (k_len - q_len)``::

    q_len=2, k_len=5 (x = visible)      q_len=5, k_len=2
        k0 k1 k2 k3 k4                      k0 k1
    q0   x  x  x  x  .                  q0   .  .    <- sees no key: output row is 0
    q1   x  x  x  x  x                  q1   .  .
                                        q2   .  .
                                        q3   x  .
                                        q4   x  x
"""
import math

import torch
import torch.nn.functional as F


def causal_mask(q_len, k_len, device=None):
    """Bottom-right causal visibility: bool (q_len, k_len), True where query i may see key j,
    i.e. ``j <= i + (k_len - q_len)``."""
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(k_len, device=device)[None, :]
    return cols <= rows + (k_len - q_len)


def _check_inputs(q, k, v, dropout_p):
    """Shape and argument checks whose messages say expected vs got."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "attention expects 4-D (batch, heads, seq, head_dim) tensors; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            "k and v must be (batch, heads, k_len, .) with q's batch and heads; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k head_dim differ: {q.shape[-1]} vs {k.shape[-1]}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")


def attention(q, k, v, *, causal=True, dropout_p=0.0, softmax_scale=None, keep_mask=None,
              upcast=True):
    """softmax(q k^T * scale [+ causal mask]) [* dropout] @ v, in plain PyTorch.

    Args:
        q: (batch, heads, q_len, head_dim).
        k: (batch, heads, k_len, head_dim).
        v: (batch, heads, k_len, head_dim_v).
        causal: bottom-right causal mask (see module docstring); rows that see no key give 0.
        dropout_p: probability of dropping an attention weight, in [0, 1).
        softmax_scale: multiplies the scores; default ``1 / sqrt(head_dim)``.
        keep_mask: optional bool tensor broadcastable to (batch, heads, q_len, k_len), True =
            keep (e.g. ``reference.dropout_keep_mask``, the kernel's mask). Kept weights are
            scaled by ``1 / (1 - dropout_p)``. Without it and with ``dropout_p > 0``, torch's own
            random dropout is used.
        upcast: compute in float64 and return float64 (the oracle); if False, every
            intermediate (scores, softmax, weighted sum) stays in the input dtype (the
            low-precision baseline).

    Returns:
        (batch, heads, q_len, head_dim_v), float64 if ``upcast`` else q's dtype. Differentiable.
    """
    _check_inputs(q, k, v, dropout_p)
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    q_len, k_len = q.shape[-2], k.shape[-2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])

    scores = (q @ k.transpose(-2, -1)) * softmax_scale  # (b, h, q_len, k_len)
    if causal:
        visible = causal_mask(q_len, k_len, device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if causal:
        # A row with no visible key is softmax of all -inf = NaN; defining it as 0 matches the
        # kernel. masked_fill's backward also zeroes the NaN gradients of such rows.
        weights = weights.masked_fill(~visible, 0.0)

    if keep_mask is not None:
        weights = weights * keep_mask / (1.0 - dropout_p)
    elif dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)

    return weights @ v  # (b, h, q_len, head_dim_v)
