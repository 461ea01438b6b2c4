"""Public functional API: validation → custom ops (+ autograd) → host launchers.

Layers, each with one job:

* ``attention`` (public): checks arguments and says what was expected when they are wrong,
  resolves defaults (scale, seed), then calls the custom op.
* ``fused_attention::fwd`` / ``fused_attention::bwd``: PyTorch custom ops with fake (meta)
  implementations and a registered autograd formula, so ``torch.compile(fullgraph=True)`` sees
  one opaque node instead of breaking the graph at a Triton launch.
* ``attention_forward`` / ``attention_backward`` (kernels/forward.py, kernels/backward.py): the
  Triton launchers. On CPU tensors they run in Triton's interpreter when TRITON_INTERPRET=1;
  otherwise CPU tensors take a PyTorch fallback with the same semantics and dropout mask.
"""
import math
import numbers
import warnings

import torch

from ._common import MAX_HEAD_DIM, interpreter_active
from .backward import attention_backward
from .forward import attention_forward

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Seeds are 64-bit Philox keys; keep them non-negative so they round-trip through int64.
SEED_LIMIT = 2 ** 63
# Triton's grid dimensions 1 and 2 (heads, batch) are limited to 65535 programs.
MAX_GRID_YZ = 65535
# The seed of every call without dropout: one shared CPU tensor (the ops never write it). Under
# torch.compile it enters the graph as an input, so Inductor emits no CPU C++ kernel to build it.
with torch.inference_mode(False):  # a normal tensor even if first imported in inference mode
    _NO_SEED = torch.zeros((), dtype=torch.int64, device="cpu")


# --------------------------------------------------------------------------------------------
# Validation (public boundary only)
# --------------------------------------------------------------------------------------------
def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D (batch, heads, seq_len, head_dim), "
                         f"got {t.dim()}-D tensor of shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name} must be on a CUDA device (or the CPU for the interpreter / "
                         f"PyTorch fallback), got device {t.device}")


def _validate(q, k, v, causal, dropout_p, softmax_scale, seed):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, "
                         f"v {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (batch, heads, k_len, head_dim), "
                         f"got k {tuple(k.shape)} and v {tuple(v.shape)}")
    for i, what in ((0, "batch"), (1, "heads"), (3, "head_dim")):
        if q.shape[i] != k.shape[i]:
            raise ValueError(f"q and k must have the same {what} (dim {i}), got q "
                             f"{tuple(q.shape)} and k {tuple(k.shape)}")
    head_dim = q.shape[3]
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(f"head_dim up to {MAX_HEAD_DIM} is supported, got {head_dim}")
    if q.shape[0] > MAX_GRID_YZ or q.shape[1] > MAX_GRID_YZ:
        raise NotImplementedError(f"batch and heads must each be <= {MAX_GRID_YZ} (Triton grid "
                                  f"limit), got batch {q.shape[0]}, heads {q.shape[1]}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not (0.0 <= dropout_p < 1.0):  # also rejects NaN
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a positive float or None, got "
                            f"{type(softmax_scale).__name__}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int in [0, 2**63) or None, got "
                            f"{type(seed).__name__}")
        if not (0 <= seed < SEED_LIMIT):
            raise ValueError(f"seed must be in [0, 2**63), got {seed}")


# --------------------------------------------------------------------------------------------
# Implementations behind the custom ops
# --------------------------------------------------------------------------------------------
_warned_fallback = False


def _use_fallback(t):
    """CPU tensors without Triton's interpreter take the PyTorch fallback (warned once)."""
    global _warned_fallback
    if t.device.type == "cpu" and not interpreter_active():
        if not _warned_fallback:
            warnings.warn("kernels.attention: CPU tensors run a PyTorch fallback with the same "
                          "semantics; the fused Triton kernel needs CUDA (or TRITON_INTERPRET=1 "
                          "to run it in Triton's interpreter)", RuntimeWarning, stacklevel=3)
            _warned_fallback = True
        return True
    return False


def _unit_last(t):
    """Kernels need a unit stride in the last dim; any other layout is read in place."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _like(t):
    """Empty tensor with the layout the real ops give their outputs (fake and real agree)."""
    return torch.empty_like(t) if t.stride(-1) == 1 else torch.empty(t.shape, dtype=t.dtype,
                                                                      device=t.device)


def _fallback_weights(q, k, lse, causal, dropout_p, softmax_scale, seed):
    """(P, drop, lse): softmax weights P (fp32, zero where masked), the dropout factor
    keep / (1 - p) (1.0 without dropout) and the row log-sum-exp (computed when None)."""
    from reference.dropout import dropout_keep_mask
    from reference.functional import causal_mask
    B, H, q_len, _ = q.shape
    k_len = k.shape[2]
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * softmax_scale
    if causal:
        s = s.masked_fill(~causal_mask(q_len, k_len, device=q.device), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    # Rows with no visible key have lse = -inf and all-masked scores: P = exp(-inf) = 0.
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    drop = 1.0
    if dropout_p > 0:
        keep = dropout_keep_mask(seed, B, H, q_len, k_len, dropout_p, device=q.device)
        drop = keep / (1.0 - dropout_p)
    return p, drop, lse


def _fallback_forward(q, k, v, causal, dropout_p, softmax_scale, seed):
    """PyTorch math with the kernel's semantics and dropout mask: (o, lse), fp32 inside."""
    p, drop, lse = _fallback_weights(q, k, None, causal, dropout_p, softmax_scale, seed)
    o = _like(q)
    o.copy_(torch.matmul(p * drop, v.float()))
    return o, lse


def _fallback_backward(do, q, k, v, o, lse, causal, dropout_p, softmax_scale, seed):
    """The backward kernels' formulas in PyTorch (custom-op bodies run without autograd)."""
    p, drop, _ = _fallback_weights(q, k, lse, causal, dropout_p, softmax_scale, seed)
    p_drop = p * drop
    do, v = do.float(), v.float()
    delta = (do * o.float()).sum(-1, keepdim=True)  # rowsum(dO * O), right with dropout too
    dp = torch.matmul(do, v.transpose(-2, -1)) * drop
    ds = p * (dp - delta)
    grads = (torch.matmul(ds, k.float()) * softmax_scale,
             torch.matmul(ds.transpose(-2, -1), q.float()) * softmax_scale,
             torch.matmul(p_drop.transpose(-2, -1), do))
    outs = tuple(_like(t) for t in (q, k, v))
    for out, g in zip(outs, grads):
        out.copy_(g)
    return outs


@torch.library.custom_op("fused_attention::fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout_p: float,
            softmax_scale: float, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    seed_int = int(seed.item())
    if _use_fallback(q):
        return _fallback_forward(q, k, v, causal, dropout_p, softmax_scale, seed_int)
    o = _like(q)
    return attention_forward(_unit_last(q), _unit_last(k), _unit_last(v), causal=causal,
                             softmax_scale=softmax_scale, dropout_p=dropout_p, seed=seed_int,
                             out=o)


@_fwd_op.register_fake
def _(q, k, v, causal, dropout_p, softmax_scale, seed):
    B, H, q_len, _ = q.shape
    return _like(q), q.new_empty((B, H, q_len), dtype=torch.float32)


@torch.library.custom_op("fused_attention::bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            o: torch.Tensor, lse: torch.Tensor, causal: bool, dropout_p: float,
            softmax_scale: float, seed: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seed_int = int(seed.item())
    if _use_fallback(q):
        return _fallback_backward(do, q, k, v, o, lse, causal, dropout_p, softmax_scale,
                                  seed_int)
    return attention_backward(_unit_last(do), _unit_last(q), _unit_last(k), _unit_last(v),
                              _unit_last(o), lse, causal=causal, softmax_scale=softmax_scale,
                              dropout_p=dropout_p, seed=seed_int)


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, dropout_p, softmax_scale, seed):
    return _like(q), _like(k), _like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, dropout_p, softmax_scale, seed = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, seed)
    ctx.mark_non_differentiable(lse)
    ctx.causal, ctx.dropout_p, ctx.softmax_scale = causal, dropout_p, softmax_scale


def _backward(ctx, do, dlse):
    q, k, v, o, lse, seed = ctx.saved_tensors
    dq, dk, dv = _bwd_op(do, q, k, v, o, lse, ctx.causal, ctx.dropout_p, ctx.softmax_scale, seed)
    return dq, dk, dv, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def attention(q, k, v, *, causal=True, dropout_p=0.0, softmax_scale=None, seed=None,
              return_lse=False):
    """Fused scaled-dot-product attention: softmax(mask(q kᵀ · scale)) → dropout → @ v.

    Never materialises the (q_len × k_len) matrix; differentiable (FlashAttention-2-style
    backward that recomputes the weights); usable inside ``torch.compile(fullgraph=True)``.

    Args:
        q: (batch, heads, q_len, head_dim) float16 / bfloat16 / float32.
        k, v: (batch, heads, k_len, head_dim), q's dtype and device. Any strides: views such as
            ``x.view(b, s, h, d).transpose(1, 2)`` are read in place (a copy is made only when
            the last dim is not unit-stride). 1 <= head_dim <= 256.
        causal: mask keys in the future, aligned bottom-right when q_len != k_len::

                q_len=2, k_len=5 (KV-cache decoding)     q_len=5, k_len=2
                      k0 k1 k2 k3 k4                           k0 k1
                  q0   1  1  1  1  0                       q0   0  0   <- sees no key: zeros
                  q1   1  1  1  1  1                       q1   0  0
                                                           q2   0  0
                query i sees key j iff                     q3   1  0
                j <= i + (k_len - q_len)                   q4   1  1

        dropout_p: probability of zeroing each attention weight (after softmax); kept weights
            are scaled by 1 / (1 - dropout_p). 0 <= dropout_p < 1.
        softmax_scale: multiplies q kᵀ before the softmax; default 1 / sqrt(head_dim).
        seed: int in [0, 2**63) for the in-kernel Philox dropout mask; None draws one from
            PyTorch's default generator (so ``torch.manual_seed`` makes runs reproducible). The
            same (seed, shapes) give the same mask on every device; ``reference.dropout_keep_mask``
            recomputes it.
        return_lse: also return the row log-sum-exp of the scaled scores.

    Returns:
        out: (batch, heads, q_len, head_dim) in q's dtype. It has q's memory layout when q is
            dense, so a head split by ``view().transpose(1, 2)`` merges back with a free
            ``out.transpose(1, 2).reshape(batch, q_len, heads * head_dim)``.
        lse (only with ``return_lse``): float32 (batch, heads, q_len), natural log, -inf for a
            row that sees no key. Not differentiable.
    """
    _validate(q, k, v, causal, dropout_p, softmax_scale, seed)
    dropout_p = float(dropout_p)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if dropout_p == 0.0:
        seed_t = _NO_SEED
    elif seed is None:
        seed_t = torch.randint(0, SEED_LIMIT - 1, (), dtype=torch.int64)
    else:
        seed_t = torch.tensor(int(seed), dtype=torch.int64)
    out, lse = _fwd_op(q, k, v, causal, dropout_p, float(softmax_scale), seed_t)
    return (out, lse) if return_lse else out
