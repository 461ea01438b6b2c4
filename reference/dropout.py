"""The fused kernel's dropout mask, recomputed in plain PyTorch, bit for bit.

Definition (shared with ``kernels/_dropout.py``; change both or neither). For element
(bh = b * heads + h, query row i, key column j):

* ``groups = ceil(k_len / 4)``; Philox counter ``c = (bh * q_len + i) * groups + j // 4``
  (64-bit), i.e. one Philox call feeds four adjacent key columns;
* words = Philox-4x32-10 on counter (c mod 2**32, c >> 32, 0, 0) with key
  (seed mod 2**32, (seed >> 32) mod 2**32), as ``tl.randint4x(seed, c)`` computes it;
* take word ``j % 4``; keep iff ``word >> 8 >= round(p * 2**24)``.

Philox here runs on int64 tensors holding uint32 values (masked to 32 bits after every
operation), so it runs on any device with ordinary integer ops. The high half of a
32x32-bit product is formed from 16-bit halves so no intermediate overflows int64.
"""
import torch

_MASK32 = 0xFFFFFFFF
# Philox-4x32 constants (Salmon et al. 2011), as in triton/language/random.py.
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_N_ROUNDS = 10

# Mirrors kernels/_dropout.py (DROPOUT_BITS, dropout_threshold); the reference deliberately
# does not import the kernels package, so an error there cannot hide here.
_DROPOUT_BITS = 24

# Counters per Philox batch in dropout_keep_mask: ~a dozen live int64 temporaries of this size.
_CHUNK = 1 << 20


def _dropout_threshold(dropout_p):
    """Keep iff the 24-bit draw >= this. Same formula as kernels/_dropout.dropout_threshold."""
    return int(round(dropout_p * (1 << _DROPOUT_BITS)))


def _mulhilo32(a, const):
    """(high, low) 32-bit halves of ``a * const`` for int64 tensor ``a`` in [0, 2**32) and a
    Python int constant in [0, 2**32). The constant is split into 16-bit halves so every
    partial product stays below 2**48."""
    c_hi, c_lo = const >> 16, const & 0xFFFF
    p_hi = a * c_hi                      # a * c = p_hi * 2**16 + p_lo
    p_lo = a * c_lo
    hi = (p_hi + (p_lo >> 16)) >> 16     # p_lo's low 16 bits cannot carry into bit 32
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return hi, lo


def philox4x32(seed, counter):
    """Philox-4x32-10 words of ``tl.randint4x(seed, counter)``.

    Args:
        seed: Python int in [0, 2**63) (its low and high 32 bits are the Philox key).
        counter: int64 tensor of any shape; its low and high 32 bits are the first two counter
            words (the last two are 0), as ``tl.randint4x`` does for an int64 offset.

    Returns:
        Four int64 tensors of ``counter``'s shape holding uint32 values in [0, 2**32).
    """
    counter = torch.as_tensor(counter, dtype=torch.int64)
    c0 = counter & _MASK32
    c1 = (counter >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    for _ in range(_N_ROUNDS):
        hi_b, lo_b = _mulhilo32(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _mulhilo32(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        # Bump the key (Weyl sequence), wrapping at 2**32 like uint32 addition.
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def _check_args(seed, dropout_p):
    if not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed must be an int in [0, 2**63); got {seed}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")


def dropout_keep_rows(seed, rows, k_len, dropout_p):
    """The kernel's keep mask for selected rows only (for shapes too big to build whole).

    Args:
        seed: Python int in [0, 2**63), the seed given to the kernel.
        rows: int64 tensor (n,) of flattened row ids ``bh * q_len + i`` (bh = b * heads + h).
        k_len: number of key columns.
        dropout_p: drop probability in [0, 1).

    Returns:
        bool tensor (n, k_len) on ``rows``' device, True = keep.
    """
    _check_args(seed, dropout_p)
    groups = (k_len + 3) // 4
    group_ids = torch.arange(groups, dtype=torch.int64, device=rows.device)
    counter = rows.to(torch.int64)[:, None] * groups + group_ids[None, :]  # (n, groups)
    words = torch.stack(philox4x32(seed, counter), dim=-1)  # (n, groups, 4)
    # Word w of group g is column 4 * g + w; the last group may overhang k_len.
    words = words.reshape(rows.numel(), groups * 4)[:, :k_len]
    return (words >> (32 - _DROPOUT_BITS)) >= _dropout_threshold(dropout_p)


def dropout_keep_mask(seed, batch, heads, q_len, k_len, dropout_p, device=None):
    """The fused kernel's dropout keep mask (see module docstring for the definition).

    Args:
        seed: Python int in [0, 2**63), the seed given to the kernel.
        batch, heads, q_len, k_len: attention shape.
        dropout_p: drop probability in [0, 1).
        device: where to build the mask.

    Returns:
        bool tensor (batch, heads, q_len, k_len), True = keep. Use it as ``keep_mask`` of
        ``reference.attention`` to reproduce the kernel's dropout exactly.
    """
    _check_args(seed, dropout_p)
    n_rows = batch * heads * q_len  # row r = bh * q_len + i
    keep = torch.empty(n_rows, k_len, dtype=torch.bool, device=device)
    # Rows are independent: do them in chunks to bound the Philox temporaries' memory.
    rows_per_chunk = max(1, _CHUNK // max((k_len + 3) // 4, 1))
    for start in range(0, n_rows, rows_per_chunk):
        rows = torch.arange(start, min(start + rows_per_chunk, n_rows), dtype=torch.int64,
                            device=device)
        keep[start:start + rows.numel()] = dropout_keep_rows(seed, rows, k_len, dropout_p)
    return keep.view(batch, heads, q_len, k_len)
