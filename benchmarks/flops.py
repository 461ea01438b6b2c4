"""The one FLOP count used by every benchmark row (the field's convention, see FIELD_NOTES.md).

forward  = 4 * batch * heads * q_len * k_len * head_dim   (two matmuls, 2 FLOPs per multiply-add)
causal   = forward / 2                                      (convention; exact as seq -> inf)
backward = 2.5 * forward                                    (five matmuls instead of two)
fwd_bwd  = 3.5 * forward

Softmax, masking and dropout are not counted: TFLOP/s numbers are comparable with the
FlashAttention papers and the Triton tutorial, which use the same count.
"""

MODE_FACTORS = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
MODES = tuple(MODE_FACTORS)


def attention_flops(batch, heads, q_len, k_len, head_dim, *, causal=True, mode="fwd"):
    """FLOPs of one attention call in ``mode`` ("fwd", "bwd" or "fwd_bwd").

    >>> attention_flops(1, 1, 128, 128, 64, causal=False)
    4194304.0
    >>> attention_flops(1, 1, 128, 128, 64, causal=True, mode="fwd_bwd")
    7340032.0
    """
    if mode not in MODE_FACTORS:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    fwd = 4.0 * batch * heads * q_len * k_len * head_dim
    if causal:
        fwd /= 2.0
    return fwd * MODE_FACTORS[mode]


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


def tflops(flops, ms):
    """Rate in TFLOP/s for ``flops`` done in ``ms`` milliseconds (None when ms is missing/0)."""
    if not ms or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12
