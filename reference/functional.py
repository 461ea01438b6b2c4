"""Plain-PyTorch attention: the numerical oracle (float64) and low-precision baseline for parity.

Used with ``tests/helpers.assert_parity``: ``attention(..., upcast=True)`` is the float64 truth,
``attention(..., upcast=False)`` is what naive PyTorch achieves in the input dtype; a kernel
passes when its error is within a small multiple of the latter's.

Causal alignment is bottom-right (FlashAttention's convention, not PyTorch SDPA's top-left):
the last query row lines up with the last key column. With ``d = k_len - q_len``, query ``i``
sees key ``j`` iff ``j <= i + d``; a sliding ``window`` (Hugging Face's ``sliding_window``
convention: the ``window`` most recent keys, the query's own position included) also requires
``j > i + d - window``::

    q_len=2, k_len=5 (x = visible)      q_len=5, k_len=2
        k0 k1 k2 k3 k4                      k0 k1
    q0   x  x  x  x  .                  q0   .  .    <- sees no key: output row is 0
    q1   x  x  x  x  x                  q1   .  .
                                        q2   .  .
                                        q3   x  .
                                        q4   x  x

    q_len=5, k_len=5, window=3          q_len=2, k_len=5, window=3
        k0 k1 k2 k3 k4                      k0 k1 k2 k3 k4
    q0   x  .  .  .  .                  q0   .  x  x  x  .
    q1   x  x  .  .  .                  q1   .  .  x  x  x
    q2   x  x  x  .  .
    q3   .  x  x  x  .
    q4   .  .  x  x  x

Grouped-query attention (GQA; MQA when ``heads_kv == 1``): k and v may have fewer heads than
q, ``heads_q % heads_kv == 0``; query head ``h`` uses kv head ``h // (heads_q // heads_kv)``.

Packed variable-length batches (``attention_varlen``) use FlashAttention's layout: sequences are
concatenated along the first dimension, ``cu_seqlens`` holds the offsets, and each sequence
attends only within itself (bottom-right causal per sequence).
"""
import math
import numbers

import torch
import torch.nn.functional as F


def _check_window(window, causal=True):
    """``window`` is None or an int >= 1, and only with ``causal=True``."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window must be an int >= 1 or None; got {type(window).__name__} "
                        f"{window!r}")
    if window < 1:
        raise ValueError(f"window must be an int >= 1 or None; got {window}")
    if not causal:
        raise ValueError(f"window={window} requires causal=True (a sliding window is a causal "
                         "mask); got causal=False")


def causal_mask(q_len, k_len, device=None, window=None):
    """Bottom-right causal visibility: bool (q_len, k_len), True where query i may see key j,
    i.e. ``j <= i + (k_len - q_len)``; with an int ``window`` >= 1 also
    ``j > i + (k_len - q_len) - window`` (the ``window`` most recent keys, itself included).
    ``window >= k_len`` gives the plain causal mask."""
    _check_window(window)
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(k_len, device=device)[None, :]
    last = rows + (k_len - q_len)  # the last key query i sees
    visible = cols <= last
    if window is not None:
        visible = visible & (cols > last - window)
    return visible


def _check_heads(heads_q, heads_kv, shapes):
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(
            f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv} (grouped-query "
            f"attention: query head h uses kv head h // (heads_q // heads_kv)); got {shapes}")


def _check_dropout_p(dropout_p):
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")


def _check_inputs(q, k, v, dropout_p):
    """Shape and argument checks whose messages say expected vs got."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects 4-D (batch, heads, seq, head_dim) tensors; got {shapes}")
    if k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            "k and v must be (batch, heads_kv, k_len, .) with q's batch and the same heads_kv "
            f"and k_len; got {shapes}")
    _check_heads(q.shape[1], k.shape[1], shapes)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k head_dim differ: {q.shape[-1]} vs {k.shape[-1]}")
    _check_dropout_p(dropout_p)


def attention(q, k, v, *, causal=True, dropout_p=0.0, softmax_scale=None, window=None,
              keep_mask=None, upcast=True):
    """softmax(q k^T * scale [+ causal mask]) [* dropout] @ v, in plain PyTorch.

    Args:
        q: (batch, heads_q, q_len, head_dim).
        k: (batch, heads_kv, k_len, head_dim), ``heads_q % heads_kv == 0`` (grouped-query
            attention: query head h uses kv head ``h // (heads_q // heads_kv)``).
        v: (batch, heads_kv, k_len, head_dim_v).
        causal: bottom-right causal mask (see module docstring); rows that see no key give 0.
        dropout_p: probability of dropping an attention weight, in [0, 1).
        softmax_scale: multiplies the scores; default ``1 / sqrt(head_dim)``.
        window: None or an int >= 1 (requires ``causal``): each query sees only the ``window``
            most recent keys, itself included (``causal_mask(..., window=window)``).
            ``window >= k_len`` is plain causal.
        keep_mask: optional bool tensor broadcastable to (batch, heads_q, q_len, k_len), True =
            keep (e.g. ``reference.dropout_keep_mask``, the kernel's mask). Kept weights are
            scaled by ``1 / (1 - dropout_p)``. Without it and with ``dropout_p > 0``, torch's own
            random dropout is used.
        upcast: compute in float64 and return float64 (the oracle); if False, every
            intermediate (scores, softmax, weighted sum) stays in the input dtype (the
            low-precision baseline).

    Returns:
        (batch, heads_q, q_len, head_dim_v), float64 if ``upcast`` else q's dtype.
        Differentiable; with grouped-query heads the gradients of k and v sum over each group.
    """
    _check_inputs(q, k, v, dropout_p)
    _check_window(window, causal)
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        # (b, heads_kv, ...) -> (b, heads_q, ...); autograd sums each group's gradients back.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    q_len, k_len = q.shape[-2], k.shape[-2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])

    scores = (q @ k.transpose(-2, -1)) * softmax_scale  # (b, h, q_len, k_len)
    if causal:
        visible = causal_mask(q_len, k_len, device=q.device, window=window)
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


def _cu_seqlens(cu_seqlens, name, total=None):
    """Validated offsets of a packed batch as a list of Python ints.

    ``cu_seqlens``: 1-D integer tensor (or sequence of ints) ``(num_seqs + 1,)``, starting at 0,
    non-decreasing, ending at ``total`` (the packed tensor's row count) when given.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens)
    if (cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0 or cu_seqlens.dtype == torch.bool
            or cu_seqlens.is_floating_point() or cu_seqlens.is_complex()):
        raise ValueError(
            f"{name} must be a 1-D integer tensor of num_seqs + 1 >= 1 offsets; got shape "
            f"{tuple(cu_seqlens.shape)}, dtype {cu_seqlens.dtype}")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0] = {offsets[0]}")
    for s in range(len(offsets) - 1):
        if offsets[s + 1] < offsets[s]:
            raise ValueError(
                f"{name} must be non-decreasing (sequence lengths >= 0); got {name}[{s}] = "
                f"{offsets[s]} > {name}[{s + 1}] = {offsets[s + 1]}")
    if total is not None and offsets[-1] != total:
        raise ValueError(
            f"{name} must end at the packed tensor's row count {total}; got {name}[-1] = "
            f"{offsets[-1]}")
    return offsets


def _cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q=None, total_k=None):
    """Validated (offsets_q, offsets_k) lists with the same number of sequences."""
    cu_q = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q)
    cu_k = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total_k)
    if len(cu_q) != len(cu_k):
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must have the same length num_seqs + 1; got "
            f"{len(cu_q)} and {len(cu_k)}")
    return cu_q, cu_k


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, dropout_p=0.0,
                     softmax_scale=None, window=None, keep_masks=None, upcast=True):
    """``attention`` over a packed batch of variable-length sequences (FlashAttention's varlen
    layout), one sequence at a time.

    Sequence s is rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of q and
    ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]`` of k and v; it attends only within itself, with the
    bottom-right causal mask of its own lengths. Sequences may be empty; a query row whose
    sequence has no keys gives 0.

    Args:
        q: (total_q, heads_q, head_dim).
        k: (total_k, heads_kv, head_dim), ``heads_q % heads_kv == 0`` (grouped-query heads as
            in ``attention``).
        v: (total_k, heads_kv, head_dim_v).
        cu_seqlens_q, cu_seqlens_k: integer (num_seqs + 1,) offsets (tensors or sequences of
            ints), starting at 0, non-decreasing, ending at total_q and total_k.
        causal, dropout_p, softmax_scale, window, upcast: as in ``attention``.
        keep_masks: None or a list with one bool tensor (heads_q, len_q_s, len_k_s) per sequence,
            True = keep (e.g. ``reference.dropout_keep_mask_varlen``, the kernel's mask).

    Returns:
        (total_q, heads_q, head_dim_v), float64 if ``upcast`` else q's dtype. Differentiable.
    """
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"attention_varlen expects 3-D (total, heads, head_dim) tensors; got {shapes}")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"k and v must be (total_k, heads_kv, .) with the same total_k and heads_kv; got "
            f"{shapes}")
    _check_heads(q.shape[1], k.shape[1], shapes)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k head_dim differ: {q.shape[-1]} vs {k.shape[-1]}")
    _check_dropout_p(dropout_p)
    _check_window(window, causal)
    cu_q, cu_k = _cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    num_seqs = len(cu_q) - 1
    heads_q = q.shape[1]
    if keep_masks is not None:
        if len(keep_masks) != num_seqs:
            raise ValueError(f"keep_masks must hold one mask per sequence: expected {num_seqs}, "
                             f"got {len(keep_masks)}")
        for s, mask in enumerate(keep_masks):
            expected = (heads_q, cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s])
            if tuple(mask.shape) != expected:
                raise ValueError(f"keep_masks[{s}] must be (heads_q, len_q, len_k) = {expected}; "
                                 f"got {tuple(mask.shape)}")

    outs = []
    for s in range(num_seqs):
        def seq(t, cu):  # (rows of sequence s, heads, d) -> (1, heads, len, d)
            return t[cu[s]:cu[s + 1]].transpose(0, 1).unsqueeze(0)

        keep = keep_masks[s].unsqueeze(0) if keep_masks is not None else None
        out = attention(seq(q, cu_q), seq(k, cu_k), seq(v, cu_k), causal=causal,
                        dropout_p=dropout_p, softmax_scale=softmax_scale, window=window,
                        keep_mask=keep, upcast=upcast)
        outs.append(out[0].transpose(0, 1))  # (len_q_s, heads_q, head_dim_v)
    if not outs:  # num_seqs == 0: total_q == 0
        dtype = torch.float64 if upcast else q.dtype
        return q.new_zeros((0, heads_q, v.shape[-1]), dtype=dtype)
    return torch.cat(outs, dim=0)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=None, v=None, *, causal=True,
                           softmax_scale=None, window=None, upcast=True):
    """Attention against a preallocated KV cache, row by row (the oracle of
    ``kernels.attention_with_kvcache``).

    Args:
        q: (batch, heads_q, q_len, head_dim).
        k_cache, v_cache: (batch, heads_kv, max_len, head_dim); **written in place** when k, v
            are given, as the kernel does (pass copies to compare).
        cache_seqlens: int (batch,) tensor or list: filled positions per row.
        k, v: optional (batch, heads_kv, q_len, head_dim), appended at cache_seqlens[b] ... .
        causal, softmax_scale, window: as in ``attention``; row b attends to its first
            n_b = cache_seqlens[b] (+ q_len with k, v) positions, bottom-right causal over them.
        upcast: float64 math and result (the oracle) or the input dtype.

    Returns:
        (batch, heads_q, q_len, head_dim), float64 if ``upcast`` else q's dtype.
    """
    lens = [int(n) for n in (cache_seqlens.tolist() if torch.is_tensor(cache_seqlens)
                             else cache_seqlens)]
    if len(lens) != q.shape[0] or k_cache.shape[0] != q.shape[0]:
        raise ValueError(f"cache_seqlens, q and the caches must share the batch size, got "
                         f"{len(lens)} lengths, q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}")
    q_len, max_len = q.shape[2], k_cache.shape[2]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    new = 0 if k is None else q_len
    if any(n < 0 or n + new > max_len for n in lens):
        raise ValueError(f"cache_seqlens {lens} (+ {new} new) must lie in [0, {max_len}]")
    rows = []
    for b, n in enumerate(lens):
        if k is not None:
            k_cache[b, :, n:n + new] = k[b]
            v_cache[b, :, n:n + new] = v[b]
        rows.append(attention(q[b:b + 1], k_cache[b:b + 1, :, :n + new],
                              v_cache[b:b + 1, :, :n + new], causal=causal,
                              softmax_scale=softmax_scale, window=window, upcast=upcast))
    return torch.cat(rows)
