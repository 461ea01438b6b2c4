"""The one FLOP count used by every benchmark row (the field's convention, see FIELD_NOTES.md).

forward  = 4 * batch * heads * q_len * k_len * head_dim   (two matmuls, 2 FLOPs per multiply-add)
causal   = forward / 2                                      (convention; exact as seq -> inf)
backward = 2.5 * forward                                    (five matmuls instead of two)
fwd_bwd  = 3.5 * forward

Softmax, masking and dropout are not counted: TFLOP/s numbers are comparable with the
FlashAttention papers and the Triton tutorial, which use the same count.

Sliding window (``window < k_len``): forward = 4 * batch * heads * head_dim * (visible pairs),
the exact number of (query, key) pairs the mask keeps (:func:`visible_pairs`), since the
causal half-convention has no window analogue; a window >= k_len is plain causal (above). The
two counts differ by less than 1/seq_len (n*(n+1)/2 pairs vs n^2/2), 0.003 % at 32k.
Grouped-query heads: ``heads`` is the number of query heads (k/v heads change no FLOPs).
Packed sequences (varlen): the sum of each sequence's own count (:func:`varlen_flops`), i.e.
sum(len^2)/2-based for causal, never the padded batch's.
Decoding (one query row against a KV cache of ``k_len`` keys): it sees every key, so the
exact count is the non-causal one, ``4 * batch * heads * k_len * head_dim``; what limits it
is memory, so decode rows also report :func:`kv_read_bytes` / time (:func:`gbps`).
"""

MODE_FACTORS = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
MODES = tuple(MODE_FACTORS)


def visible_pairs(q_len, k_len, *, causal=True, window=None):
    """Exact number of (query, key) pairs the mask keeps, with the kernels' bottom-right rule:
    query i sees key j iff ``j <= i + d`` (causal) and ``j > i + d - window`` (window), with
    ``d = k_len - q_len``.

    >>> visible_pairs(4, 4), visible_pairs(4, 4, causal=False), visible_pairs(6, 6, window=3)
    (10, 16, 15)
    """
    if not causal:
        if window is not None:
            raise ValueError("a window needs causal=True")
        return q_len * k_len
    d = k_len - q_len
    total = 0
    for i in range(q_len):
        hi = min(i + d, k_len - 1)
        lo = 0 if window is None else max(0, i + d - window + 1)
        total += max(0, hi - lo + 1)
    return total


def ideal_window_speedup(q_len, k_len, window):
    """Full causal over windowed work, by visible (query, key) pairs: the speed-up a kernel
    that skips every invisible pair and pays nothing else would get (4.27 for window 4096 at
    32k)."""
    return visible_pairs(q_len, k_len) / visible_pairs(q_len, k_len, window=window)


def attention_flops(batch, heads, q_len, k_len, head_dim, *, causal=True, mode="fwd",
                    window=None):
    """FLOPs of one attention call in ``mode`` ("fwd", "bwd" or "fwd_bwd"); ``heads`` = query
    heads; ``window``: sliding window (counted by visible pairs, see the module docstring).

    >>> attention_flops(1, 1, 128, 128, 64, causal=False)
    4194304.0
    >>> attention_flops(1, 1, 128, 128, 64, causal=True, mode="fwd_bwd")
    7340032.0
    """
    if mode not in MODE_FACTORS:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if window is not None and causal and window < k_len:
        fwd = 4.0 * batch * heads * head_dim * visible_pairs(q_len, k_len, window=window)
    else:
        fwd = 4.0 * batch * heads * q_len * k_len * head_dim
        if causal:
            fwd /= 2.0
    return fwd * MODE_FACTORS[mode]


def varlen_flops(seqlens_q, seqlens_k, heads, head_dim, *, causal=True, mode="fwd",
                 window=None):
    """FLOPs of packed sequences: the sum of each sequence's own :func:`attention_flops`
    (batch 1), i.e. sum(len^2)-based, not the padded batch's max_len^2 * num_seqs."""
    return sum(attention_flops(1, heads, lq, lk, head_dim, causal=causal, mode=mode,
                               window=window)
               for lq, lk in zip(seqlens_q, seqlens_k))


def linear_flops(tokens, d_in, d_out, *, mode="fwd"):
    """FLOPs of a dense layer on ``tokens`` rows: 2*tokens*d_in*d_out forward, backward 2x that.

    (Bias additions are not counted.) fwd_bwd = 3x forward, bwd = 2x forward.
    """
    factor = {"fwd": 1.0, "bwd": 2.0, "fwd_bwd": 3.0}[mode]
    return 2.0 * tokens * d_in * d_out * factor


def mha_flops(batch, seq_len, d_in, d_out, heads, *, causal=True, mode="fwd"):
    """FLOPs of a multi-head attention module: Q, K, V and output projections + attention core."""
    tokens = batch * seq_len
    proj = 3 * linear_flops(tokens, d_in, d_out, mode=mode) + linear_flops(tokens, d_out, d_out,
                                                                          mode=mode)
    core = attention_flops(batch, heads, seq_len, seq_len, d_out // heads, causal=causal, mode=mode)
    return proj + core


def gpt_step_flops(linear_params, n_layers, batch, seq_len, emb_dim, heads, *, causal=True):
    """FLOPs of one training step (forward + backward) of a GPT model.

    ``6 * linear_params * tokens`` (every nn.Linear weight, output head included: 2 FLOPs forward
    and 4 backward per weight and token) plus ``n_layers`` attention cores in fwd_bwd mode.
    Embedding lookups, norms, activations and the optimizer are not counted.
    """
    tokens = batch * seq_len
    core = attention_flops(batch, heads, seq_len, seq_len, emb_dim // heads, causal=causal,
                           mode="fwd_bwd")
    return 6.0 * linear_params * tokens + n_layers * core


def kv_read_bytes(batch, heads_kv, cache_len, head_dim, itemsize=2):
    """Bytes of K and V one decoding step reads: ``2 * batch * heads_kv * cache_len *
    head_dim * itemsize`` (bf16: itemsize 2). Each kv head is counted once (grouped query
    heads share it); q, the output and the split partials are not counted (all << K, V).

    >>> kv_read_bytes(1, 8, 32768, 128)
    134217728
    """
    return 2 * batch * heads_kv * cache_len * head_dim * itemsize


def gbps(nbytes, ms):
    """Rate in GB/s (1e9 bytes) for ``nbytes`` moved in ``ms`` milliseconds (None when ms is
    missing/0)."""
    if not ms or ms <= 0:
        return None
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops, ms):
    """Rate in TFLOP/s for ``flops`` done in ``ms`` milliseconds (None when ms is missing/0)."""
    if not ms or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12
