"""In-kernel dropout: the keep mask of one (BLOCK_M, BLOCK_N) tile of attention weights.

The mask is a pure function of (seed, batch*heads index, query row, key column), never of the
block sizes, so the forward, both backward kernels and the PyTorch oracle
(`reference.dropout_keep_mask`) all see the same bits on every device.

Definition (shared with ``reference/dropout.py``; change both or neither):

* ``groups = ceil(k_len / 4)``; the Philox counter of element (bh, i, j) is the 64-bit integer
  ``(bh * q_len + i) * groups + j // 4`` and it selects word ``j % 4`` of
  ``tl.randint4x(seed, counter)`` (Philox-4x32-10, key = the seed's two 32-bit halves).
  One Philox call thus feeds four adjacent key columns.
* The word's top 24 bits ``r >> 8`` (uniform on [0, 2**24)) keep the element iff
  ``r >> 8 >= threshold`` with ``threshold = round(p * 2**24)``; kept weights are scaled by
  ``1 / (1 - p)`` by the caller.
"""
import triton
import triton.language as tl

# Dropout decisions use the top 24 bits of each Philox word: an integer compare, no float
# conversion, and a threshold that fits int32 for every p in [0, 1).
DROPOUT_BITS = 24
_DROPOUT_SHIFT = tl.constexpr(32 - DROPOUT_BITS)


def dropout_threshold(dropout_p: float) -> int:
    """Integer threshold for ``dropout_p``: an element is kept iff its 24-bit draw >= this."""
    return int(round(dropout_p * (1 << DROPOUT_BITS)))


@triton.jit
def dropout_keep_tile(seed, bh, offs_m, start_n, q_len, k_len, threshold,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Boolean keep mask of shape (BLOCK_M, BLOCK_N) for rows ``offs_m`` and key columns
    ``start_n + arange(BLOCK_N)`` of head ``bh`` (= batch * heads + head).

    ``start_n`` must be a multiple of 4 (it is a multiple of BLOCK_N >= 16 in every caller).
    Rows or columns past q_len/k_len get well-defined but meaningless bits: callers mask them.
    """
    groups = (k_len + 3) // 4
    offs_g = start_n // 4 + tl.arange(0, BLOCK_N // 4)
    # 64-bit counter: batch*heads*q_len*k_len passes 2**31 at realistic sizes.
    row = bh.to(tl.int64) * q_len + offs_m.to(tl.int64)
    counter = row[:, None] * groups + offs_g[None, :].to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, counter)
    # tl.join appends a minor axis; joining (r0, r2) and (r1, r3) this way and flattening puts
    # word w of group g at column 4 * g + w.
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_M, BLOCK_N))
    return (r >> _DROPOUT_SHIFT).to(tl.int32) >= threshold
