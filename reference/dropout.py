"""The fused kernel's dropout mask, recomputed in plain PyTorch, bit for bit.

Definition (shared with ``kernels/core/dropout.py``; change both or neither). The mask is a pure
function of (seed, row id, key column), never of the kernel's block sizes.

* Each query row has a **row id** ``r`` (the index of its entry in the lse tensor) and a
  Philox stride ``groups`` (counters per row id), by layout:

  - dense, q (batch, heads, q_len, .), lse (batch, heads, q_len):
    ``r = (b * heads + h) * q_len + i`` and ``groups = ceil(k_len / 4)``;
  - packed (varlen), q (total_q, heads, .), lse (heads, total_q), sequence s being rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]``: ``r = h * total_q + cu_seqlens_q[s] + i`` (i the
    row inside the sequence, total_q = cu_seqlens_q[-1]) and ``groups = ceil(total_k / 4)``
    (total_k = cu_seqlens_k[-1]).

  ``heads`` is the number of *query* heads (grouped-query attention changes nothing), and
  ``j`` is the key column inside the sequence (``0 <= j < len_k_s`` when packed). The packed
  stride uses the *total* key count, so it does not depend on ``max_seqlen`` hints and no two
  (sequence, head, row, column) share a Philox word; one packed sequence is the dense mask of
  batch 1.
* Philox counter ``c = r * groups + j // 4`` (64-bit), i.e. one Philox call feeds four adjacent
  key columns;
* words = Philox-4x32-10 on counter (c mod 2**32, c >> 32, 0, 0) with key
  (seed mod 2**32, (seed >> 32) mod 2**32), as ``tl.randint4x(seed, c)`` computes it;
* take word ``j % 4``; keep iff ``word >> 8 >= round(p * 2**24)``.

Philox here runs on int64 tensors holding uint32 values (masked to 32 bits after every
operation), so it runs on any device with ordinary integer ops. The high half of a
32x32-bit product is formed from 16-bit halves so no intermediate overflows int64.
"""
import torch

from .functional import _cu_seqlens_pair

_MASK32 = 0xFFFFFFFF
# Philox-4x32 constants (Salmon et al. 2011), as in triton/language/random.py.
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_N_ROUNDS = 10

# Mirrors kernels/core/dropout.py (DROPOUT_BITS, dropout_threshold); the reference deliberately
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


def dropout_keep_rows(seed, rows, k_len, dropout_p, groups=None):
    """The kernel's keep mask for selected rows only (for shapes too big to build whole, and the
    building block of both layouts; see the module docstring).

    Args:
        seed: Python int in [0, 2**63), the seed given to the kernel.
        rows: int64 tensor (n,) of row ids ``r``: dense ``bh * q_len + i`` (bh = b * heads + h),
            packed ``h * total_q + cu_seqlens_q[s] + i``.
        k_len: number of key columns (of the sequence, when packed).
        dropout_p: drop probability in [0, 1).
        groups: Philox counters per row id, >= ``ceil(k_len / 4)``; default ``ceil(k_len / 4)``
            (the dense layout); ``ceil(total_k / 4)`` for the packed layout.

    Returns:
        bool tensor (n, k_len) on ``rows``' device, True = keep.
    """
    _check_args(seed, dropout_p)
    n_groups = (k_len + 3) // 4  # groups a row of k_len columns uses
    if groups is None:
        groups = n_groups
    elif groups < n_groups:
        raise ValueError(f"groups must be >= ceil(k_len / 4) = {n_groups} (k_len={k_len}); got "
                         f"{groups}")
    group_ids = torch.arange(n_groups, dtype=torch.int64, device=rows.device)
    counter = rows.to(torch.int64)[:, None] * groups + group_ids[None, :]  # (n, n_groups)
    words = torch.stack(philox4x32(seed, counter), dim=-1)  # (n, n_groups, 4)
    # Word w of group g is column 4 * g + w; the last group may overhang k_len.
    words = words.reshape(rows.numel(), n_groups * 4)[:, :k_len]
    return (words >> (32 - _DROPOUT_BITS)) >= _dropout_threshold(dropout_p)


def _keep_rows_chunked(seed, n_rows, row_ids, k_len, dropout_p, groups, device):
    """bool (n_rows, k_len): row f of the result is ``dropout_keep_rows`` of row id
    ``row_ids(f)`` (``row_ids`` maps an int64 tensor of f's to row ids). Rows are independent:
    they are done in chunks to bound the Philox temporaries' memory."""
    keep = torch.empty(n_rows, k_len, dtype=torch.bool, device=device)
    rows_per_chunk = max(1, _CHUNK // max((k_len + 3) // 4, 1))
    for start in range(0, n_rows, rows_per_chunk):
        flat = torch.arange(start, min(start + rows_per_chunk, n_rows), dtype=torch.int64,
                            device=device)
        keep[start:start + flat.numel()] = dropout_keep_rows(seed, row_ids(flat), k_len,
                                                             dropout_p, groups)
    return keep


def dropout_keep_mask(seed, batch, heads, q_len, k_len, dropout_p, device=None):
    """The fused kernel's dropout keep mask, dense layout (see module docstring).

    Args:
        seed: Python int in [0, 2**63), the seed given to the kernel.
        batch, heads, q_len, k_len: attention shape (heads = query heads).
        dropout_p: drop probability in [0, 1).
        device: where to build the mask.

    Returns:
        bool tensor (batch, heads, q_len, k_len), True = keep. Use it as ``keep_mask`` of
        ``reference.attention`` to reproduce the kernel's dropout exactly.
    """
    _check_args(seed, dropout_p)
    n_rows = batch * heads * q_len  # row r = bh * q_len + i
    keep = _keep_rows_chunked(seed, n_rows, lambda f: f, k_len, dropout_p, (k_len + 3) // 4,
                              device)
    return keep.view(batch, heads, q_len, k_len)


def dropout_keep_mask_varlen(seed, cu_seqlens_q, cu_seqlens_k, heads, dropout_p, device=None):
    """The fused kernel's dropout keep masks of a packed variable-length batch (packed layout,
    see module docstring).

    Args:
        seed: Python int in [0, 2**63), the seed given to the kernel.
        cu_seqlens_q, cu_seqlens_k: integer (num_seqs + 1,) offsets (tensors or sequences of
            ints) starting at 0, non-decreasing; total_q = cu_seqlens_q[-1],
            total_k = cu_seqlens_k[-1].
        heads: number of query heads.
        dropout_p: drop probability in [0, 1).
        device: where to build the masks; default cu_seqlens_q's device if it is a tensor,
            else torch's default.

    Returns:
        list with one bool tensor (heads, len_q_s, len_k_s) per sequence, True = keep. Use it as
        ``keep_masks`` of ``reference.attention_varlen`` to reproduce the kernel's dropout.
    """
    _check_args(seed, dropout_p)
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 0:
        raise ValueError(f"heads must be an int >= 0 (the number of query heads); got {heads!r}")
    if device is None and isinstance(cu_seqlens_q, torch.Tensor):
        device = cu_seqlens_q.device
    cu_q, cu_k = _cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k)
    total_q, total_k = cu_q[-1], cu_k[-1]
    groups = (total_k + 3) // 4  # one stride for all sequences: no two share a Philox word
    masks = []
    for s in range(len(cu_q) - 1):
        len_q, len_k = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]

        def row_ids(f, start=cu_q[s], len_q=len_q):  # f = h * len_q + i
            return (f // len_q) * total_q + start + f % len_q

        keep = _keep_rows_chunked(seed, heads * len_q, row_ids, len_k, dropout_p, groups,
                                  device)
        masks.append(keep.view(heads, len_q, len_k))
    return masks
