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

Chunked attention (``chunk_size``, Llama 4's local layers; causal only, not with a window): the
key axis is cut into chunks of ``chunk_size`` positions and the query at position
``P = i + d`` sees key ``j`` iff ``j <= P`` and ``j // chunk_size == P // chunk_size``::

    q_len=6, k_len=6, chunk_size=3      q_len=3, k_len=6, chunk_size=4
        k0 k1 k2 k3 k4 k5                   k0 k1 k2 k3 k4 k5
    q0   x  .  .  .  .  .               q0   x  x  x  x  .  .    (P = 3)
    q1   x  x  .  .  .  .               q1   .  .  .  .  x  .    (P = 4)
    q2   x  x  x  .  .  .               q2   .  .  .  .  x  x    (P = 5)
    q3   .  .  .  x  .  .
    q4   .  .  .  x  x  .
    q5   .  .  .  x  x  x

The score pipeline, per (query i, key j) pair of batch entry b and query head h::

    s = softmax_scale * q_i . k_j                     (1) scaled score
    s = softcap * tanh(s / softcap)                   (2) softcap (Gemma 2, Grok)
    s = s - slope[b, h] * |P - j|                     (3) ALiBi bias, P = i + d
    s = score_mod(s, b, h, P, j, mod_aux)             (4) any score modification
    s = -inf unless visible(i, j)                     (5) causal / window / chunk mask,
                                                          intersected with mask_mod
    w = softmax over j (and the head's sink, if any)  (6) rows seeing no key: w = 0
    out_i = sum_j dropout(w_ij) v_j                   (7)

``score_mod`` and ``mask_mod`` are plain PyTorch callables (the twins of the kernels' Triton
mods) that see whole tensors: ``s`` of shape (batch, heads_q, q_len, k_len) and int64
positions broadcastable against it, ``b`` (batch, 1, 1, 1), ``h`` (1, heads_q, 1, 1),
``q_idx`` (1, 1, q_len, 1) holding ``P = i + d`` (so ``q_idx == kv_idx`` is the causal
diagonal whatever the lengths) and ``kv_idx`` (1, 1, 1, k_len). With packed sequences
(``attention_varlen``) they are called once per sequence, ``b`` being the sequence index as a
(1, 1, 1, 1) tensor and positions counting from the sequence's start; with a KV cache
(``attention_with_kvcache``) once per batch row, with that row's filled length as k_len.

Attention sinks (gpt-oss): a per-head logit ``sinks[h]`` joins every row's softmax denominator
without contributing a value, ``w_ij = exp(s_ij) / (exp(sinks[h]) + sum_j exp(s_ij))``, so a
row's weights sum to less than 1; a row that sees no key returns 0 and its lse is ``sinks[h]``.

Grouped-query attention (GQA; MQA when ``heads_kv == 1``): k and v may have fewer heads than
q, ``heads_q % heads_kv == 0``; query head ``h`` uses kv head ``h // (heads_q // heads_kv)``.
The value head dim ``head_dim_v`` may differ from q and k's ``head_dim``; the output has
``head_dim_v`` and the default scale stays ``1 / sqrt(head_dim)``.

Packed variable-length batches (``attention_varlen``) use FlashAttention's layout: sequences are
concatenated along the first dimension, ``cu_seqlens`` holds the offsets, and each sequence
attends only within itself (bottom-right causal per sequence).

Nothing here imports ``kernels``: the oracle must not share the code it checks.
"""
import math
import numbers

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------

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


def _check_chunk_size(chunk_size, causal=True, window=None):
    """``chunk_size`` is None or an int >= 1, only with ``causal=True`` and without a window."""
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be an int >= 1 or None; got "
                        f"{type(chunk_size).__name__} {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1 or None; got {chunk_size}")
    if not causal:
        raise ValueError(f"chunk_size={chunk_size} requires causal=True (chunked attention is a "
                         "causal mask); got causal=False")
    if window is not None:
        raise ValueError(f"chunk_size={chunk_size} and window={window} cannot be combined: "
                         "each is the left edge of a causal mask; pass one of them")


def causal_mask(q_len, k_len, device=None, window=None, chunk_size=None):
    """Bottom-right causal visibility: bool (q_len, k_len), True where query i may see key j,
    i.e. ``j <= P`` with ``P = i + (k_len - q_len)``; with an int ``window`` >= 1 also
    ``j > P - window`` (the ``window`` most recent keys, itself included); with an int
    ``chunk_size`` >= 1 (not with ``window``) also ``j // chunk_size == P // chunk_size``.
    ``window >= k_len`` gives the plain causal mask."""
    _check_window(window)
    _check_chunk_size(chunk_size, True, window)
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(k_len, device=device)[None, :]
    last = rows + (k_len - q_len)  # the last key query i sees: its position P
    visible = cols <= last
    if window is not None:
        visible = visible & (cols > last - window)
    if chunk_size is not None:
        # Only pairs with 0 <= j <= P survive, so floor division of negatives never matters.
        visible = visible & (cols // chunk_size == last // chunk_size)
    return visible


def flash_attn_mask(causal, window_size, leftpad=0, chunk=0):
    """FlashAttention's visibility rule as a ``mask_mod`` for ``attention(causal=False, ...)``
    (positions on the key axis, as the mods see them): the query at position P sees key j iff
    ``P - left <= j <= P + right`` for ``window_size = (left, right)`` (-1: unbounded;
    ``causal`` sets right to 0), ``j >= leftpad`` (a left-padded KV cache row) and, with
    FlashAttention 3's ``attention_chunk`` ``chunk`` > 0, ``C * floor(P / C) <= j <
    C * floor(P / C) + C``."""
    left, right = window_size
    if causal:
        right = 0

    def visible(b, h, q_idx, kv_idx, aux):
        vis = kv_idx >= leftpad
        if left >= 0:
            vis = vis & (kv_idx >= q_idx - left)
        if right >= 0:
            vis = vis & (kv_idx <= q_idx + right)
        if chunk:
            first = torch.div(q_idx, chunk, rounding_mode="floor") * chunk
            vis = vis & (kv_idx >= first) & (kv_idx < first + chunk)
        return vis

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


def _check_float_tensor(name, t, expected):
    """``t`` is a real floating-point tensor (TypeError naming ``name`` otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a floating-point tensor {expected} or None; got "
                        f"{type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor {expected} (fp32 for the "
                        f"kernels); got dtype {t.dtype}")


def _check_softcap(softcap):
    """``softcap`` is None or a finite real number > 0."""
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a number > 0 or None; got {type(softcap).__name__} "
                        f"{softcap!r}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite number > 0 or None; got {softcap}")


def _check_mods(heads_q, batch, batch_name, softcap, alibi_slopes, score_mod, mask_mod,
                mod_aux, sinks):
    """Checks the score/mask modifications of a call with ``heads_q`` query heads and
    ``batch`` batch entries (``batch_name``: what the alibi_slopes' first dim is called).
    Returns ``mod_aux`` as a tuple."""
    _check_softcap(softcap)
    if alibi_slopes is not None:
        expected = f"(heads_q,) = ({heads_q},) or ({batch_name}, heads_q) = ({batch}, {heads_q})"
        _check_float_tensor("alibi_slopes", alibi_slopes, expected)
        if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
            raise ValueError(f"alibi_slopes must be {expected}; got shape "
                             f"{tuple(alibi_slopes.shape)}")
    if sinks is not None:
        _check_float_tensor("sinks", sinks, f"(heads_q,) = ({heads_q},)")
        if tuple(sinks.shape) != (heads_q,):
            raise ValueError(f"sinks must be (heads_q,) = ({heads_q},), one logit per query "
                             f"head; got shape {tuple(sinks.shape)}")
    for name, fn, contract in (
            ("score_mod", score_mod, "(s, b, h, q_idx, kv_idx, aux) -> s'"),
            ("mask_mod", mask_mod, "(b, h, q_idx, kv_idx, aux) -> bool tensor")):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a PyTorch callable {contract} or None (for a "
                            f"kernels mod, pass its torch_fn); got {type(fn).__name__}")
    if not isinstance(mod_aux, (tuple, list)):
        raise TypeError(f"mod_aux must be a tuple (passed as aux to score_mod and mask_mod); "
                        f"got {type(mod_aux).__name__}")
    return tuple(mod_aux)


# ----------------------------------------------------------------------------------------------
# The dense computation
# ----------------------------------------------------------------------------------------------

def _positions(batch, heads, q_len, k_len, first_batch, device):
    """The int64 indices the mods see, broadcastable against scores (batch, heads, q_len, k_len):
    b (batch, 1, 1, 1) counting from ``first_batch``, h (1, heads, 1, 1), q_idx (1, 1, q_len, 1)
    holding each query's position ``i + k_len - q_len`` on the key axis, kv_idx (1, 1, 1, k_len).
    """
    def index(n, dim, start=0):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return (torch.arange(n, device=device) + start).view(shape)

    return (index(batch, 0, first_batch), index(heads, 1), index(q_len, 2, k_len - q_len),
            index(k_len, 3))


def _modified_scores(scores, pos, softcap, alibi_slopes, score_mod, mod_aux):
    """Steps (2)-(4) of the pipeline: softcap, ALiBi, score_mod, in that order.

    scores: (batch, heads_q, q_len, k_len). alibi_slopes: None, (heads_q,) or
    (batch, heads_q) (the rows of this call's batch). Returns a tensor of the same shape.
    """
    b, h, q_idx, kv_idx = pos
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype)
        slopes = slopes.view(1, -1, 1, 1) if slopes.dim() == 1 else slopes[:, :, None, None]
        scores = scores - slopes * (q_idx - kv_idx).abs().to(scores.dtype)
    if score_mod is not None:
        modified = score_mod(scores, b, h, q_idx, kv_idx, mod_aux)
        if not isinstance(modified, torch.Tensor) or modified.shape != scores.shape:
            got = (tuple(modified.shape) if isinstance(modified, torch.Tensor)
                   else type(modified).__name__)
            raise ValueError(f"score_mod must return a tensor of the scores' shape "
                             f"{tuple(scores.shape)}; got {got}")
        scores = modified.to(scores.dtype)
    return scores


def _visibility(shape, pos, causal, window, chunk_size, mask_mod, mod_aux, device):
    """Step (5)'s mask: None (every key visible) or a bool tensor broadcastable to ``shape``
    (batch, heads_q, q_len, k_len), True = visible: the causal / window / chunk mask
    intersected with ``mask_mod``."""
    q_len, k_len = shape[-2:]
    visible = causal_mask(q_len, k_len, device, window, chunk_size) if causal else None
    if mask_mod is not None:
        b, h, q_idx, kv_idx = pos
        mask = mask_mod(b, h, q_idx, kv_idx, mod_aux)
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"mask_mod must return a bool tensor (True = visible); got {got}")
        try:
            mask = torch.broadcast_to(mask, shape)
        except RuntimeError:
            raise ValueError(f"mask_mod must return a bool tensor broadcastable to the scores' "
                             f"shape {tuple(shape)}; got {tuple(mask.shape)}") from None
        visible = mask if visible is None else visible & mask
    return visible


def _attention(q, k, v, *, causal, dropout_p, softmax_scale, window, chunk_size, keep_mask,
               upcast, softcap, alibi_slopes, score_mod, mask_mod, mod_aux, sinks, need_lse,
               first_batch=0):
    """The dense pipeline without argument checks (the public functions check first).

    q: (batch, heads_q, q_len, head_dim); k: (batch, heads_kv, k_len, head_dim);
    v: (batch, heads_kv, k_len, head_dim_v). ``first_batch``: the index the mods see as b for
    batch entry 0 (the sequence or cache row when called one at a time).

    Returns (out (batch, heads_q, q_len, head_dim_v), lse (batch, heads_q, q_len) or None),
    in float64 if ``upcast`` else q's dtype.
    """
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        # (b, heads_kv, ...) -> (b, heads_q, ...); autograd sums each group's gradients back.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    batch, heads, q_len, k_len = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])

    scores = (q @ k.transpose(-2, -1)) * softmax_scale  # (b, h, q_len, k_len)
    pos = _positions(batch, heads, q_len, k_len, first_batch, q.device)
    scores = _modified_scores(scores, pos, softcap, alibi_slopes, score_mod, mod_aux)
    visible = _visibility(scores.shape, pos, causal, window, chunk_size, mask_mod, mod_aux,
                          q.device)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))

    lse = None
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
        if need_lse:
            # -inf for a row that sees no key; its NaN gradients land on masked scores only,
            # which the masked_fill above zeroes in the backward.
            lse = torch.logsumexp(scores, dim=-1)
    else:
        # The sink is one more column of the softmax, with no value: dropped after normalising.
        sink_column = sinks.to(dtype).view(1, heads, 1, 1).expand(batch, heads, q_len, 1)
        with_sink = torch.cat([scores, sink_column], dim=-1)  # (b, h, q_len, k_len + 1)
        weights = torch.softmax(with_sink, dim=-1)[..., :k_len]
        if need_lse:
            lse = torch.logsumexp(with_sink, dim=-1)
    if visible is not None:
        # A row with no visible key is softmax of all -inf = NaN; defining it as 0 matches the
        # kernel. masked_fill's backward also zeroes the NaN gradients of such rows.
        weights = weights.masked_fill(~visible, 0.0)

    if keep_mask is not None:
        weights = weights * keep_mask / (1.0 - dropout_p)
    elif dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)

    return weights @ v, lse  # (b, h, q_len, head_dim_v), (b, h, q_len)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------

def attention(q, k, v, *, causal=True, dropout_p=0.0, softmax_scale=None, window=None,
              keep_mask=None, upcast=True, chunk_size=None, softcap=None, alibi_slopes=None,
              score_mod=None, mask_mod=None, mod_aux=(), sinks=None, return_lse=False):
    """softmax(mods(q k^T * scale) [+ mask]) [* dropout] @ v, in plain PyTorch (the score
    pipeline is in the module docstring).

    Args:
        q: (batch, heads_q, q_len, head_dim).
        k: (batch, heads_kv, k_len, head_dim), ``heads_q % heads_kv == 0`` (grouped-query
            attention: query head h uses kv head ``h // (heads_q // heads_kv)``).
        v: (batch, heads_kv, k_len, head_dim_v); head_dim_v may differ from head_dim.
        causal: bottom-right causal mask (see module docstring); rows that see no key give 0.
        dropout_p: probability of dropping an attention weight, in [0, 1).
        softmax_scale: multiplies the scores; default ``1 / sqrt(head_dim)``.
        window: None or an int >= 1 (requires ``causal``): each query sees only the ``window``
            most recent keys, itself included (``causal_mask(..., window=window)``).
            ``window >= k_len`` is plain causal.
        keep_mask: optional bool tensor broadcastable to (batch, heads_q, q_len, k_len), True =
            keep (e.g. ``reference.dropout_keep_mask``, the kernel's mask). Kept weights are
            scaled by ``1 / (1 - dropout_p)``. Without it and with ``dropout_p > 0``, torch's own
            random dropout is used. Dropout acts on the key weights only, never on a sink.
        upcast: compute in float64 and return float64 (the oracle); if False, every
            intermediate (scores, softmax, weighted sum) stays in the input dtype (the
            low-precision baseline).
        chunk_size: None or an int >= 1 (requires ``causal``, not with ``window``): the query
            at position P = i + k_len - q_len sees key j iff j <= P and
            j // chunk_size == P // chunk_size (module docstring).
        softcap: None or a finite number > 0: the scaled scores s become
            ``softcap * tanh(s / softcap)`` (before ALiBi, score_mod and masking).
        alibi_slopes: None or a floating tensor (heads_q,) or (batch, heads_q): adds
            ``-slope[b, h] * |i + k_len - q_len - j|`` to the soft-capped score.
        score_mod: None or a callable ``(s, b, h, q_idx, kv_idx, aux) -> s'`` applied after
            softcap and ALiBi, before masking: s is the (batch, heads_q, q_len, k_len) score
            tensor and the indices are int64 tensors broadcastable against it (module
            docstring); it must return s's shape and be differentiable in s.
        mask_mod: None or a callable ``(b, h, q_idx, kv_idx, aux) -> bool tensor`` broadcastable
            to the scores, True = visible; intersected with the causal / window / chunk mask
            (with ``causal=False`` it is the only mask).
        mod_aux: tuple passed as ``aux`` to score_mod and mask_mod.
        sinks: None or a floating tensor (heads_q,): each head's sink logit joins every row's
            softmax denominator without a value (module docstring). Differentiable.
        return_lse: also return each row's log-sum-exp of the modified scores over its visible
            keys, ``log(sum_j exp(s_ij) [+ exp(sinks[h])])``: -inf for a row that sees no key
            (``sinks[h]`` with sinks). Differentiable (0 gradient in rows that see no key).

    Returns:
        out: (batch, heads_q, q_len, head_dim_v), float64 if ``upcast`` else q's dtype.
            Differentiable; with grouped-query heads the gradients of k and v sum over each
            group.
        lse (only with ``return_lse``): (batch, heads_q, q_len), out's dtype.
    """
    _check_inputs(q, k, v, dropout_p)
    _check_window(window, causal)
    _check_chunk_size(chunk_size, causal, window)
    mod_aux = _check_mods(q.shape[1], q.shape[0], "batch", softcap, alibi_slopes, score_mod,
                          mask_mod, mod_aux, sinks)
    out, lse = _attention(q, k, v, causal=causal, dropout_p=dropout_p,
                          softmax_scale=softmax_scale, window=window, chunk_size=chunk_size,
                          keep_mask=keep_mask, upcast=upcast, softcap=softcap,
                          alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod,
                          mod_aux=mod_aux, sinks=sinks, need_lse=return_lse)
    return (out, lse) if return_lse else out




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


def _row_slopes(alibi_slopes, row):
    """The slopes one row of a per-row call sees: (1, heads_q) of a (rows, heads_q) tensor, a
    (heads_q,) tensor as it is."""
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return alibi_slopes
    return alibi_slopes[row:row + 1]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, dropout_p=0.0,
                     softmax_scale=None, window=None, keep_masks=None, upcast=True,
                     chunk_size=None, softcap=None, alibi_slopes=None, score_mod=None,
                     mask_mod=None, mod_aux=(), sinks=None, return_lse=False):
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
        chunk_size, softcap, score_mod, mask_mod, mod_aux, sinks, return_lse: as in
            ``attention``, per sequence: the mods see b = s as a (1, 1, 1, 1) tensor and
            positions counted from the sequence's start.
        alibi_slopes: None or a floating tensor (heads_q,) or (num_seqs, heads_q).

    Returns:
        out: (total_q, heads_q, head_dim_v), float64 if ``upcast`` else q's dtype.
            Differentiable.
        lse (only with ``return_lse``): (heads_q, total_q) (the kernels' packed layout), out's
            dtype.
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
    _check_chunk_size(chunk_size, causal, window)
    cu_q, cu_k = _cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    num_seqs = len(cu_q) - 1
    heads_q = q.shape[1]
    mod_aux = _check_mods(heads_q, num_seqs, "num_seqs", softcap, alibi_slopes, score_mod,
                          mask_mod, mod_aux, sinks)
    if keep_masks is not None:
        if len(keep_masks) != num_seqs:
            raise ValueError(f"keep_masks must hold one mask per sequence: expected {num_seqs}, "
                             f"got {len(keep_masks)}")
        for s, mask in enumerate(keep_masks):
            expected = (heads_q, cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s])
            if tuple(mask.shape) != expected:
                raise ValueError(f"keep_masks[{s}] must be (heads_q, len_q, len_k) = {expected}; "
                                 f"got {tuple(mask.shape)}")

    outs, lses = [], []
    for s in range(num_seqs):
        def seq(t, cu):  # (rows of sequence s, heads, d) -> (1, heads, len, d)
            return t[cu[s]:cu[s + 1]].transpose(0, 1).unsqueeze(0)

        keep = keep_masks[s].unsqueeze(0) if keep_masks is not None else None
        out, lse = _attention(seq(q, cu_q), seq(k, cu_k), seq(v, cu_k), causal=causal,
                              dropout_p=dropout_p, softmax_scale=softmax_scale, window=window,
                              chunk_size=chunk_size, keep_mask=keep, upcast=upcast,
                              softcap=softcap, alibi_slopes=_row_slopes(alibi_slopes, s),
                              score_mod=score_mod, mask_mod=mask_mod, mod_aux=mod_aux,
                              sinks=sinks, need_lse=return_lse, first_batch=s)
        outs.append(out[0].transpose(0, 1))  # (len_q_s, heads_q, head_dim_v)
        if return_lse:
            lses.append(lse[0])  # (heads_q, len_q_s)
    if not outs:  # num_seqs == 0: total_q == 0
        dtype = torch.float64 if upcast else q.dtype
        out = q.new_zeros((0, heads_q, v.shape[-1]), dtype=dtype)
        return (out, q.new_zeros((heads_q, 0), dtype=dtype)) if return_lse else out
    out = torch.cat(outs, dim=0)
    return (out, torch.cat(lses, dim=1)) if return_lse else out




def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=None, v=None, *, causal=True,
                           softmax_scale=None, window=None, upcast=True, chunk_size=None,
                           softcap=None, alibi_slopes=None, score_mod=None, mask_mod=None,
                           mod_aux=(), sinks=None, return_lse=False):
    """Attention against a preallocated KV cache, row by row (the oracle of
    ``kernels.attention_with_kvcache``).

    Args:
        q: (batch, heads_q, q_len, head_dim).
        k_cache: (batch, heads_kv, max_len, head_dim); v_cache: (batch, heads_kv, max_len,
            head_dim_v). **Written in place** when k, v are given, as the kernel does (pass
            copies to compare).
        cache_seqlens: int (batch,) tensor or list: filled positions per row.
        k, v: optional (batch, heads_kv, q_len, head_dim) and (batch, heads_kv, q_len,
            head_dim_v), appended at cache_seqlens[b] ... .
        causal, softmax_scale, window: as in ``attention``; row b attends to its first
            n_b = cache_seqlens[b] (+ q_len with k, v) positions, bottom-right causal over them.
        upcast: float64 math and result (the oracle) or the input dtype.
        chunk_size, softcap, alibi_slopes, score_mod, mask_mod, mod_aux, sinks, return_lse: as
            in ``attention``, per row: the mods see b = the row as a (1, 1, 1, 1) tensor and
            k_len = n_b (so q_idx = i + n_b - q_len).

    Returns:
        out: (batch, heads_q, q_len, head_dim_v), float64 if ``upcast`` else q's dtype.
        lse (only with ``return_lse``): (batch, heads_q, q_len), out's dtype.
    """
    shapes = (f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
              f"{tuple(v_cache.shape)}")
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"attention_with_kvcache expects 4-D (batch, heads, seq, head_dim) q "
                         f"and caches; got {shapes}")
    lens = [int(n) for n in (cache_seqlens.tolist() if torch.is_tensor(cache_seqlens)
                             else cache_seqlens)]
    if len(lens) != q.shape[0] or k_cache.shape[0] != q.shape[0]:
        raise ValueError(f"cache_seqlens, q and the caches must share the batch size, got "
                         f"{len(lens)} lengths, q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must be (batch, heads_kv, max_len, .) with the "
                         f"same batch, heads_kv and max_len; got {shapes}")
    _check_heads(q.shape[1], k_cache.shape[1], shapes)
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k_cache head_dim differ: {q.shape[-1]} vs {k_cache.shape[-1]}")
    batch, heads_kv, max_len = k_cache.shape[:3]
    q_len = q.shape[2]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        expected_k = (batch, heads_kv, q_len, k_cache.shape[-1])
        expected_v = (batch, heads_kv, q_len, v_cache.shape[-1])
        if tuple(k.shape) != expected_k or tuple(v.shape) != expected_v:
            raise ValueError(f"k and v must be (batch, heads_kv, q_len, head_dim) = {expected_k} "
                             f"and (..., head_dim_v) = {expected_v}; got k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}")
    new = 0 if k is None else q_len
    if any(n < 0 or n + new > max_len for n in lens):
        raise ValueError(f"cache_seqlens {lens} (+ {new} new) must lie in [0, {max_len}]")
    _check_window(window, causal)
    _check_chunk_size(chunk_size, causal, window)
    mod_aux = _check_mods(q.shape[1], batch, "batch", softcap, alibi_slopes, score_mod,
                          mask_mod, mod_aux, sinks)

    outs, lses = [], []
    for b, n in enumerate(lens):
        if k is not None:
            k_cache[b, :, n:n + new] = k[b]
            v_cache[b, :, n:n + new] = v[b]
        out, lse = _attention(q[b:b + 1], k_cache[b:b + 1, :, :n + new],
                              v_cache[b:b + 1, :, :n + new], causal=causal, dropout_p=0.0,
                              softmax_scale=softmax_scale, window=window, chunk_size=chunk_size,
                              keep_mask=None, upcast=upcast, softcap=softcap,
                              alibi_slopes=_row_slopes(alibi_slopes, b), score_mod=score_mod,
                              mask_mod=mask_mod, mod_aux=mod_aux, sinks=sinks,
                              need_lse=return_lse, first_batch=b)
        outs.append(out)
        lses.append(lse)
    if not outs:  # batch == 0
        dtype = torch.float64 if upcast else q.dtype
        out = q.new_zeros((0, q.shape[1], q_len, v_cache.shape[-1]), dtype=dtype)
        return (out, q.new_zeros((0, q.shape[1], q_len), dtype=dtype)) if return_lse else out
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_lse else out
