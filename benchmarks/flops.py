"""The one FLOP count used by every benchmark row: forward = 4 * batch * heads * q_len * k_len *
head_dim, halved for causal; backward 2.5x, forward + backward 3.5x (softmax, masking and
dropout not counted: the FlashAttention papers' and the Triton tutorial's count). A window,
chunks, a value head dim of its own and packed sequences count their visible pairs exactly;
decoding is memory-bound and also reports bytes read per second. docs/performance.md gives
every formula.
"""

MODE_FACTORS = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
MODES = tuple(MODE_FACTORS)


def visible_pairs(q_len, k_len, *, causal=True, window=None, chunk_size=None):
    """Exact number of (query, key) pairs the mask keeps, with the kernels' bottom-right rule:
    query i, at position ``P = i + d`` on the key axis (``d = k_len - q_len``), sees key j iff
    ``j <= P`` (causal) and ``j > P - window`` (window) or ``j // chunk_size == P //
    chunk_size`` (chunked attention).

    Chunked (c = chunk_size): a query at P >= 0 sees ``P % c + 1`` keys; summed over P in
    [0, n) that is ``(n // c) * c * (c + 1) / 2 + (n % c) * (n % c + 1) / 2`` (whole chunks are
    causal triangles), taken between ``max(d, 0)`` and ``k_len``.

    >>> visible_pairs(4, 4), visible_pairs(4, 4, causal=False), visible_pairs(6, 6, window=3)
    (10, 16, 15)
    >>> visible_pairs(6, 6, chunk_size=3), visible_pairs(7, 7, chunk_size=3)  # 2 * 6; + 1
    (12, 13)
    >>> visible_pairs(32768, 32768, chunk_size=8192) == 4 * 8192 * 8193 // 2
    True
    """
    if window is not None and chunk_size is not None:
        raise ValueError("window and chunk_size cannot be combined")
    if not causal:
        if window is not None or chunk_size is not None:
            raise ValueError("a window or chunk_size needs causal=True")
        return q_len * k_len
    d = k_len - q_len
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return _chunk_prefix_pairs(k_len, chunk_size) - _chunk_prefix_pairs(max(d, 0),
                                                                             chunk_size)
    total = 0
    for i in range(q_len):
        hi = min(i + d, k_len - 1)
        lo = 0 if window is None else max(0, i + d - window + 1)
        total += max(0, hi - lo + 1)
    return total


def _chunk_prefix_pairs(n, chunk_size):
    """Pairs seen by the queries at positions 0 .. n-1 under chunked causal attention:
    ``sum(P % chunk_size + 1 for P in range(n))`` in closed form."""
    whole, rest = divmod(n, chunk_size)
    return whole * chunk_size * (chunk_size + 1) // 2 + rest * (rest + 1) // 2


def ideal_window_speedup(q_len, k_len, window):
    """Full causal over windowed work, by visible (query, key) pairs: the speed-up a kernel
    that skips every invisible pair and pays nothing else would get (4.27 for window 4096 at
    32k)."""
    return visible_pairs(q_len, k_len) / visible_pairs(q_len, k_len, window=window)


def ideal_chunk_speedup(q_len, k_len, chunk_size):
    """Full causal over chunked work, by visible (query, key) pairs, as
    :func:`ideal_window_speedup`: 32769 / 8193 = 4.00 for chunk 8192 at 32k (four chunks, each
    a causal triangle a quarter as long, so a sixteenth of the pairs each).

    >>> round(ideal_chunk_speedup(32768, 32768, 8192), 4)
    3.9996
    """
    return visible_pairs(q_len, k_len) / visible_pairs(q_len, k_len, chunk_size=chunk_size)


def attention_flops(batch, heads, q_len, k_len, head_dim, *, causal=True, mode="fwd",
                    window=None, chunk_size=None, head_dim_v=None):
    """FLOPs of one attention call in ``mode`` ("fwd", "bwd" or "fwd_bwd"); ``heads`` = query
    heads; ``window`` (sliding window) or ``chunk_size`` (chunked attention): counted by visible
    pairs; ``head_dim_v``: v's head dim when it is not ``head_dim`` (see the module docstring).

    >>> attention_flops(1, 1, 128, 128, 64, causal=False)
    4194304.0
    >>> attention_flops(1, 1, 128, 128, 64, causal=True, mode="fwd_bwd")
    7340032.0
    >>> attention_flops(1, 1, 6, 6, 64, chunk_size=3)  # 12 pairs
    3072.0
    >>> attention_flops(1, 1, 8, 8, 192, causal=False, head_dim_v=128, mode="bwd")  # 64 pairs
    106496.0
    >>> 2 * 64 * (3 * 192 + 2 * 128)
    106496
    """
    if mode not in MODE_FACTORS:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if window is not None and causal and window < k_len:
        fwd = 4.0 * batch * heads * head_dim * visible_pairs(q_len, k_len, window=window)
    elif chunk_size is not None and causal and chunk_size < k_len:
        fwd = 4.0 * batch * heads * head_dim * visible_pairs(q_len, k_len,
                                                             chunk_size=chunk_size)
    else:
        fwd = 4.0 * batch * heads * q_len * k_len * head_dim
        if causal:
            fwd /= 2.0
    if head_dim_v is None or head_dim_v == head_dim:
        return fwd * MODE_FACTORS[mode]
    # fwd / head_dim = 4 * batch * heads * pairs: the per-matmul weights of _DV_FACTORS.
    qk, pv = _DV_FACTORS[mode]
    return fwd / (4.0 * head_dim) * 2.0 * (qk * head_dim + pv * head_dim_v)


# Matmuls per mode with head_dim (q @ k^T, dS @ k, dS^T @ q) and with head_dim_v (p @ v,
# dO @ v^T, p^T @ dO): forward 1 + 1, backward 3 + 2 (FlashAttention-2's backward recomputes
# q @ k^T), fwd_bwd 4 + 3; equal head dims give MODE_FACTORS' 1, 2.5, 3.5 x 2 matmuls.
_DV_FACTORS = {"fwd": (1, 1), "bwd": (3, 2), "fwd_bwd": (4, 3)}


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
