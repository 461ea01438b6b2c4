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
def load_seed(drop):
    """The launch's Philox seed, read once per program from ``drop.seed``: a 0-d int64 tensor
    on the launch's device, not an int argument, so that a new seed per call never compiles a
    new kernel variant (Triton specialises int arguments) and a CUDA graph replays the seed
    that a captured ``torch.randint`` on the device draws anew on each replay."""
    return tl.load(drop.seed)


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


# --------------------------------------------------------------------------------------------
# The same mask in PyTorch, for the CPU fallback (kernels/core/fallback.py)
# --------------------------------------------------------------------------------------------
import torch  # noqa: E402  (only the PyTorch twin below needs it)

from .native import draw_keep  # noqa: E402  (the compiled twin, for CPU tensors)

# Philox-4x32-10 as tl.randint4x computes it (triton/language/random.py): key (seed_lo,
# seed_hi) bumped by these Weyl increments after each round, round multipliers A and B.
_U32 = 0xFFFFFFFF
_KEY_BUMP = (0x9E3779B9, 0xBB67AE85)
_MUL_A = 0xD2511F53
_MUL_B = 0xCD9E8D57
_ROUNDS = 10
# Philox counters per chunk of dropout_mask_block: its six int64 work buffers are 3 MiB.
# Each PyTorch op costs a few microseconds however small: 8k counters per chunk ran at
# ~90 ns per counter, 64k at ~45, 256k at ~38 (one thread).
_CHUNK_COUNTERS = 1 << 16


try:  # optional (setup.py's extras): NumPy's elementwise ops cost about a third of PyTorch's
    import numpy as _np   # on small CPU arrays (PyTorch's per-op dispatch; see philox_words)
except ImportError:       # pragma: no cover - torch runs without NumPy
    _np = None


def philox_words(seed, counter, bufs=None):
    """The four words of ``tl.randint4x(seed, counter)`` (Philox-4x32-10), bit for bit.

    Args:
        seed: int in [0, 2**63); its low and high 32 bits are the key.
        counter: 1-D int64 tensor of counters in [0, 2**63); its low and high 32 bits are the
            first two counter words (the last two are 0), as for an int64 ``tl.randint4x``
            offset.
        bufs: optional int64 tensor (6, >= len(counter)) of work space; ``counter`` may be
            one of its rows but the first two.

    Returns:
        Four int64 tensors of ``counter``'s length (views of ``bufs``) holding the uint32
        words in [0, 2**32).

    The state is kept in int64. A uint32 times a 32-bit constant is below 2**64, so int64
    multiplication (which wraps) keeps all 64 bits of the product: ``p >> 32`` masked to 32
    bits is the high word, ``p`` itself the low word for as long as it only feeds an xor whose
    result is masked. Only the two words that are multiplied next are masked: 9 tensor ops a
    round, all in place.
    """
    n = counter.numel()
    if bufs is None:
        bufs = torch.empty((6, n), dtype=torch.int64, device=counter.device)
    if _np is not None and counter.device.type == "cpu":
        return _philox_words_numpy(seed, counter, bufs)
    return _philox_words_torch(seed, counter, bufs)


def _philox_words_torch(seed, counter, bufs):
    """``philox_words`` in PyTorch ops (any device)."""
    n = counter.numel()
    c0, c1, c2, c3, pa, pb = (b[:n] for b in bufs)
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    torch.bitwise_and(counter, _U32, out=c0)
    torch.bitwise_right_shift(counter, 32, out=c1)  # < 2**31 for counter >= 0
    # Round 1, with c2 = c3 = 0: c0' = c1 ^ k0, c1' = 0, c2' = hi(A c0) ^ k1, c3' = lo(A c0).
    torch.mul(c0, _MUL_A, out=pa)
    torch.bitwise_right_shift(pa, 32, out=c2).bitwise_xor_(k1).bitwise_and_(_U32)
    c0, c1, c3, pa = c1.bitwise_xor_(k0), c0, pa, c3  # c1 is 0: its buffer is spare
    c1_zero = True
    for _ in range(_ROUNDS - 1):
        k0, k1 = (k0 + _KEY_BUMP[0]) & _U32, (k1 + _KEY_BUMP[1]) & _U32
        torch.mul(c2, _MUL_B, out=pb)
        torch.mul(c0, _MUL_A, out=pa)
        # c0' = hi(B c2) ^ c1 ^ k0 into c2's buffer, c2' = hi(A c0) ^ c3 ^ k1 into c0's
        # (masked: they are multiplied next round); c1' = lo(B c2), c3' = lo(A c0) unmasked.
        t0 = torch.bitwise_right_shift(pb, 32, out=c2)
        if not c1_zero:
            t0.bitwise_xor_(c1)
        t0.bitwise_xor_(k0).bitwise_and_(_U32)
        t2 = torch.bitwise_right_shift(pa, 32, out=c0).bitwise_xor_(c3).bitwise_xor_(k1)
        t2.bitwise_and_(_U32)
        c0, c1, c2, c3, pb, pa = t0, pb, t2, pa, c1, c3
        c1_zero = False
    return c0, c1.bitwise_and_(_U32), c2, c3.bitwise_and_(_U32)


def _philox_words_numpy(seed, counter, bufs):
    """``philox_words`` for CPU tensors in NumPy ops on uint64 views of the same memory (the
    words come back as views of ``bufs``, as the PyTorch version's): the same arithmetic, all
    in place. At 8k counters (the causal mask of 8 x 2 heads x 64 x 64) 170 us against 620,
    at 64k 1.2 ms against 2.4 (one thread): an op on 8k elements costs ~2 us in NumPy and ~5-10
    in PyTorch. uint64 multiplication wraps like int64's, so the same hi / lo rule holds."""
    n = counter.numel()
    u64, u32, s32 = _np.uint64, _np.uint64(_U32), _np.uint64(32)
    words = bufs[:, :n]
    arrays = list(words.numpy().view(u64))   # ufuncs return their ``out=`` array itself
    c0, c1, c2, c3, pa, pb = arrays
    cnt = counter.numpy().view(u64)
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    xor, shr = _np.bitwise_xor, _np.right_shift
    _np.bitwise_and(cnt, u32, out=c0)
    shr(cnt, s32, out=c1)   # counter >= 0: c1 < 2**31
    # Round 1, with c2 = c3 = 0 (as the PyTorch version): c3' = lo(A c0) stays unmasked in pa.
    _np.multiply(c0, u64(_MUL_A), out=pa)
    xor(shr(pa, s32, out=c2), u64(k1), out=c2)
    c0, c1, c3, pa = xor(c1, u64(k0), out=c1), c0, pa, c3
    c1_zero = True
    for _ in range(_ROUNDS - 1):
        k0, k1 = (k0 + _KEY_BUMP[0]) & _U32, (k1 + _KEY_BUMP[1]) & _U32
        _np.multiply(c2, u64(_MUL_B), out=pb)
        _np.multiply(c0, u64(_MUL_A), out=pa)
        # The words multiplied next are masked to 32 bits; lo words stay unmasked until used.
        t0 = shr(pb, s32, out=c2)
        if not c1_zero:
            xor(t0, c1, out=t0)
        _np.bitwise_and(xor(t0, u64(k0), out=t0), u32, out=t0)
        t2 = xor(shr(pa, s32, out=c0), c3, out=c0)
        _np.bitwise_and(xor(t2, u64(k1), out=t2), u32, out=t2)
        c0, c1, c2, c3, pb, pa = t0, pb, t2, pa, c1, c3
        c1_zero = False
    _np.bitwise_and(c1, u32, out=c1)
    _np.bitwise_and(c3, u32, out=c3)
    # Back to the tensors: the row of ``bufs`` each word ended in.
    row = {id(a): i for i, a in enumerate(arrays)}
    return tuple(words[row[id(a)]] for a in (c0, c1, c2, c3))


def draw_groups(seed, counter, bound, out, slot=None, keep=True, value=None, bufs=None):
    """The decisions of the Philox words of ``counter`` in groups of 4: element w of group
    ``slot[i]`` (``i`` without ``slot``) of ``out`` is word w of counter i kept (``keep=True``,
    word >= ``bound``) or dropped, as a bool, or with ``value`` as fp32 ``value`` / 0 (the
    mask already scaled). The compiled loop for CPU tensors where it is built
    (kernels/core/native.py), else ``philox_words`` and compares: the same bits.

    counter: contiguous int64 (n,); bound: ``dropout_threshold(p) << 8``; out: contiguous,
    bool (or fp32 with ``value``), at least 4 * (n or max(slot) + 1) elements; slot: optional
    contiguous int64 (n,); bufs: ``philox_words``' optional work space.
    """
    if counter.device.type == "cpu" and draw_keep(seed, counter, bound, out, slot, keep,
                                                  value):
        return out
    n = counter.numel()
    dest = out.view(-1, 4)
    direct = slot is None and value is None
    drawn = dest[:n] if direct else torch.empty((n, 4), dtype=torch.bool, device=out.device)
    words = philox_words(seed, counter, bufs)
    compare = torch.ge if keep else torch.lt
    for w in range(4):  # word w of a group is its column w
        compare(words[w], bound, out=drawn[:, w])
    if value is not None:
        drawn = torch.mul(drawn.view(torch.uint8), value, out=torch.empty(
            drawn.shape, dtype=torch.float32, device=out.device))
    if slot is not None:
        dest.index_copy_(0, slot, drawn)
    elif not direct:
        dest[:n].copy_(drawn)
    return out


def dropout_mask_block(seed, rows, col_start, col_end, dropout_p, groups, keep=True,
                       out=None):
    """The kernels' dropout mask (module docstring) in PyTorch, for the rows with ids ``rows``
    and the key columns [``col_start``, ``col_end``).

    Args:
        seed: int in [0, 2**63), the seed given to the kernel.
        rows: 1-D integer tensor of row ids (dense: ``(b * heads_q + h) * q_len + i``; packed:
            ``h * total_q + cu_seqlens_q[s] + i``; plus ``row_offset`` for a block).
        col_start, col_end: key columns (plus ``col_offset`` for a block); any ``col_start``,
            not only a multiple of 4: column j takes word ``j % 4`` of its group's Philox call.
        dropout_p: drop probability in [0, 1).
        groups: Philox counters per row id (``ceil(k_len / 4)`` dense, ``ceil(total_k / 4)``
            packed).
        keep: True: True = kept; False: True = dropped.
        out: optional bool tensor (len(rows), col_end - col_start) to write (any strides).

    Returns:
        bool tensor (len(rows), col_end - col_start) on ``rows``' device.

    Only the Philox calls of the asked columns are made, in chunks of about
    ``_CHUNK_COUNTERS`` calls whose work space (~6 MiB) is reused: memory does not grow with
    the block.
    """
    n_rows, n_cols = rows.numel(), col_end - col_start
    device = rows.device
    if out is None:
        out = torch.empty((n_rows, max(n_cols, 0)), dtype=torch.bool, device=device)
    if n_rows == 0 or n_cols <= 0:
        return out
    g0, g1 = col_start // 4, (col_end + 3) // 4
    n_groups, skip = g1 - g0, col_start - 4 * g0
    # Kept iff word >> 8 >= threshold, i.e. iff word >= threshold << 8 (words are unsigned).
    bound = dropout_threshold(dropout_p) << (32 - DROPOUT_BITS)
    chunk = max(1, _CHUNK_COUNTERS // n_groups)
    size = min(chunk, n_rows) * n_groups
    bufs = torch.empty((6, size), dtype=torch.int64, device=device)
    bits = torch.empty(size * 4, dtype=torch.bool, device=device)
    group_ids = torch.arange(g0, g1, dtype=torch.int64, device=device)
    row_ids = rows.to(torch.int64) * groups
    for r0 in range(0, n_rows, chunk):
        r1 = min(r0 + chunk, n_rows)
        counter = bufs[4, :(r1 - r0) * n_groups]
        torch.add(row_ids[r0:r1, None], group_ids, out=counter.view(r1 - r0, n_groups))
        aligned = skip == 0 and n_cols == 4 * n_groups and out[r0:r1].is_contiguous()
        # word w of group g is column 4 g + w
        dest = draw_groups(seed, counter, bound,
                           out[r0:r1] if aligned else bits[:counter.numel() * 4],
                           keep=keep, bufs=bufs)
        if not aligned:
            out[r0:r1] = dest.view(r1 - r0, 4 * n_groups)[:, skip:skip + n_cols]
    return out
