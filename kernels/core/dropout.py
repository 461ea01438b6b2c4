"""In-kernel dropout: the keep mask of one (BLOCK_M, BLOCK_N) tile of attention weights.

The mask is a pure function of (seed, query row id, key column), never of the block sizes, so
the forward, both backward kernels and the PyTorch oracle (``reference.dropout_keep_mask`` and
``reference.dropout_keep_mask_varlen``) all see the same bits on every device.

Definition (shared with ``reference/dropout.py``; change both or neither):

* Each query row has a **row id** ``r``, the index of its entry in the lse tensor:

  - dense (batch, heads_q, q_len): ``r = (b * heads_q + h) * q_len + i``, and
    ``groups = ceil(k_len / 4)``;
  - packed sequences, lse (heads_q, total_q): ``r = h * total_q + cu_seqlens_q[s] + i`` (i the
    row inside sequence s), and ``groups = ceil(total_k / 4)``: one stride for every sequence,
    so no two (sequence, head, row, column) share a Philox word, and the mask does not depend
    on the ``max_seqlen`` hints. One packed sequence gives the dense mask of batch 1.

  Grouped-query heads change nothing: ``h`` is the query head. A block of a longer dense
  sequence (context parallelism: its queries start at global row ``row_offset``, its keys at
  global column ``col_offset``) uses the global sequence's row ids and
  ``groups`` with ``i + row_offset`` and ``j + col_offset``, so the blocks' masks are pieces of
  the one mask of the whole sequence (any offsets).
* The Philox counter of element (r, j) (j the key column inside its sequence) is the 64-bit
  integer ``r * groups + j // 4``; it selects word ``j % 4`` of ``tl.randint4x(seed, counter)``
  (Philox-4x32-10, key = the seed's two 32-bit halves). One Philox call feeds four adjacent key
  columns.
* The word's top 24 bits ``w >> 8`` (uniform on [0, 2**24)) keep the element iff
  ``w >> 8 >= threshold`` with ``threshold = round(p * 2**24)``; kept weights are scaled by
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
def dropout_keep_tile(seed, row_base, offs_m, start_n, groups, threshold,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, col_offset=0,
                      ALIGNED: tl.constexpr = True):
    """Boolean keep mask of shape (BLOCK_M, BLOCK_N) for the rows with ids ``row_base + offs_m``
    and key columns ``start_n + arange(BLOCK_N)`` (see the module docstring: ``row_base`` is the
    lse offset of the program's (batch or sequence, head), ``groups`` the Philox counters per
    row).

    ``start_n`` must be a multiple of 4 (it is a multiple of BLOCK_N >= 16 in every caller).
    ``col_offset`` shifts the columns: a block of a longer sequence whose keys start at global
    column ``col_offset`` (context parallelism). ALIGNED (``col_offset`` a multiple of 4, always
    so outside context parallelism): one Philox call per 4 columns, its words spread over them.
    Otherwise a tile's columns straddle the 4-column groups, so every column draws its own
    group and picks its word (4x the Philox work, the same bits). Rows or columns past the
    sequence get well-defined but meaningless bits: callers mask them.
    """
    # 64-bit counter: heads*rows*columns passes 2**31 at realistic sizes.
    row = row_base.to(tl.int64) + offs_m.to(tl.int64)
    if ALIGNED:
        offs_g = (col_offset + start_n) // 4 + tl.arange(0, BLOCK_N // 4)
        counter = row[:, None] * groups + offs_g[None, :].to(tl.int64)
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        # tl.join appends a minor axis; joining (r0, r2) and (r1, r3) this way and flattening
        # puts word w of group g at column 4 * g + w.
        r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_M, BLOCK_N))
    else:
        cols = col_offset + start_n + tl.arange(0, BLOCK_N)
        counter = row[:, None] * groups + (cols // 4)[None, :].to(tl.int64)
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        word = (cols % 4)[None, :]
        r = tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3)))
    return (r >> _DROPOUT_SHIFT).to(tl.int32) >= threshold
