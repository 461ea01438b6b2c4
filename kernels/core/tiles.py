"""Which tiles a program visits and which of their elements it sees, for every kernel.

One definition of the visibility rule, shared by the forward, dK/dV and dQ kernels. With
``diag = k_len - q_len`` (bottom-right alignment) query ``i`` sees key ``j`` iff

* causal: ``j <= i + diag``;
* sliding window (causal only, EDGE_WINDOW): also ``j > i + diag - window`` (the ``window``
  most recent keys, itself included);
* chunked attention (causal only, EDGE_CHUNK, ``window`` = the chunk size C): also
  ``j // C == (i + diag) // C`` (only keys of the query's own chunk of positions);
* a user mask mod (kernels/core/mods.py), applied by the score pipeline on top of these;
* always ``j < k_len``.

Both edges bound each query from the left by a non-decreasing function of its position
P = i + diag (``first_key``), and each key from below by a non-decreasing last position that
sees it (``last_query``): the tile ranges below need nothing else.

Loops are split so that only tiles crossing one of these edges pay for the mask; tiles that no
row of the program sees are never visited, so a windowed call costs O(q_len · window).

Packed variable-length batches (VARLEN) reuse everything: ``seq_bounds`` turns the batch index
into a sequence's row offsets and lengths, read from ``cu_seqlens`` (only the queries' when the
keys are in a paged cache: PACKED_K off, kernels/core/paged.py). The PyTorch fallback
(kernels/core/fallback.py) applies the same rule to whole blocks of rows.
"""
import triton
import triton.language as tl


@triton.jit
def program_ids(LONGEST_FIRST: tl.constexpr, FIRST_IS_LONGEST: tl.constexpr):
    """(block, head, batch) indices of this program on a (blocks, heads, batch) grid.

    The GPU starts programs in linear grid order (axis 0 fastest), in practice. With
    LONGEST_FIRST (causal: a block's work grows or shrinks with its index) the linear index is
    re-read with the block axis slowest and its most expensive end first, so that every head's
    and sequence's longest block starts before any shorter one: the short blocks fill the tail
    instead of one head's long blocks starting last. FIRST_IS_LONGEST: block 0 is the longest
    (as dK/dV's first keys would be); else the last block is (the forward's last queries).
    Used by the forward only. The backward kernels keep each head's longest blocks first:
    there the re-read indices (the batch and head indices no longer in uniform registers)
    spilled tight kernels, dK/dV with dropout at head_dim 128 on sm_90 (32-36 B), dQ with
    dropout at 128 on sm_80 (16 B) and on sm_100 (4-16 B). A scheduling
    model puts the causal forward's makespan at 1.26 -> 1.02 of ideal for 16 heads x 4096 on an
    H100 (a list-scheduling model, docs/performance.md); a GPU run must confirm it.
    """
    if LONGEST_FIRST:
        n_blocks = tl.num_programs(0)
        n_heads = tl.num_programs(1)
        lin = tl.program_id(0) + n_blocks * (tl.program_id(1).to(tl.int64)
                                             + n_heads * tl.program_id(2).to(tl.int64))
        return tile_ids(lin, n_blocks, n_heads, tl.num_programs(2), True, FIRST_IS_LONGEST)
    else:
        return tl.program_id(0), tl.program_id(1), tl.program_id(2)


@triton.jit
def tile_ids(lin, n_blocks, n_heads, n_batch, LONGEST_FIRST: tl.constexpr,
             FIRST_IS_LONGEST: tl.constexpr):
    """(block, head, batch) of tile ``lin`` (int64) of a (n_blocks, n_heads, n_batch) problem,
    in the order ``program_ids`` gives a grid's programs: ``lin`` is the position in start
    order, so a persistent program that takes tiles 0, 1, 2, ... in turn (the forward's
    ``SCHED``) visits them as a grid's programs start. LONGEST_FIRST: the block axis slowest,
    its most expensive end first (``program_ids``); else the block axis fastest."""
    if LONGEST_FIRST:
        others = tl.cast(n_heads, tl.int64) * n_batch
        rank = (lin // others).to(tl.int32)         # 0 = started first
        rest = lin % others
        block = rank if FIRST_IS_LONGEST else n_blocks - 1 - rank
        return block, (rest % n_heads).to(tl.int32), (rest // n_heads).to(tl.int32)
    else:
        rest = lin // n_blocks
        return ((lin % n_blocks).to(tl.int32), (rest % n_heads).to(tl.int32),
                (rest // n_heads).to(tl.int32))


@triton.jit
def seq_bounds(pid_b, seq, VARLEN: tl.constexpr, SEQUSED_K: tl.constexpr,
               PACKED_K: tl.constexpr = True):
    """(q_start, q_len, k_start, k_len) of batch entry ``pid_b`` under the launch's ``seq``
    (``SeqArgs``, kernels/core/call.py).

    Dense batches: rows start at 0 and the lengths are ``seq``'s. Packed batches (VARLEN):
    sequence ``pid_b`` is rows ``cu[pid_b]:cu[pid_b + 1]`` of the packed q and k/v (int32
    ``seq.cu_q``, ``seq.cu_k``); without PACKED_K only q is packed: the keys live in a paged
    cache (kernels/core/paged.py) that ``seq.block_table`` locates, so they start at 0 and
    number ``seq.k_len`` (the cache's capacity) before SEQUSED_K. SEQUSED_K (a KV cache):
    batch entry ``pid_b`` uses only its first ``seq.k_lens[pid_b]`` keys.
    """
    q_len = seq.q_len
    k_len = seq.k_len
    if VARLEN:
        q_start = tl.load(seq.cu_q + pid_b)
        q_len = tl.load(seq.cu_q + pid_b + 1) - q_start
        if PACKED_K:
            k_start = tl.load(seq.cu_k + pid_b)
            k_len = tl.load(seq.cu_k + pid_b + 1) - k_start
        else:
            k_start = 0
    else:
        q_start = 0
        k_start = 0
    if SEQUSED_K:
        # Never past the cache's capacity (k_len), even if a length breaks the contract.
        k_len = tl.minimum(tl.load(seq.k_lens + pid_b), k_len)
    return q_start, q_len, k_start, k_len


@triton.jit
def first_key(pos, window, EDGE: tl.constexpr):
    """The first key a query at position ``pos`` (>= 0 for any query that sees a key) may see
    under the left edge: the window's ``pos - window + 1``, or its chunk's start."""
    if EDGE == 2:
        return (tl.maximum(pos, 0) // window) * window
    else:
        return pos - window + 1


@triton.jit
def last_query(key, window, EDGE: tl.constexpr):
    """The last position that sees key ``key`` (>= 0) under the left edge: ``key + window -
    1``, or the end of the key's chunk."""
    if EDGE == 2:
        return (key // window) * window + window - 1
    else:
        return key + window - 1


@triton.jit
def edge_bound(idx, window, EDGE: tl.constexpr, ON_KEYS: tl.constexpr):
    """What ``visible`` compares against for the left edge, computed once per program for the
    indices it keeps fixed (so a chunk's integer division never runs inside a tile loop): for
    query positions ``idx``, ``first_key(idx)``; for keys ``idx`` (ON_KEYS), ``last_query(idx)``.
    0 without an edge."""
    if EDGE == 0:
        return 0
    elif ON_KEYS:
        return last_query(idx, window, EDGE)
    else:
        return first_key(idx, window, EDGE)


@triton.jit
def visible(rows, cols, k_len, diag, edge, CAUSAL: tl.constexpr, EDGE: tl.constexpr,
            ON_KEYS: tl.constexpr):
    """Boolean visibility of (query ``rows``, key ``cols``), both broadcastable int tensors:
    inside k_len, and inside the causal band / window / chunk when those are on. ``edge``: the
    ``edge_bound`` of the rows' positions, or with ON_KEYS of the cols, broadcast like them
    (j >= first_key(P) and P <= last_query(j) say the same for j <= P)."""
    vis = cols < k_len
    if CAUSAL:
        vis = vis & (cols <= rows + diag)
        if EDGE != 0:
            if ON_KEYS:
                vis = vis & (rows + diag <= edge)
            else:
                vis = vis & (cols >= edge)
    return vis


@triton.jit
def key_range(m_lo, m_hi, q_len, k_len, window, CAUSAL: tl.constexpr, EDGE: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Key tiles of a block of query rows with indices in [m_lo, m_hi):
    (lo, full_lo, full_hi, hi).

    [lo, full_lo): the window's or chunk's left edge (masked; empty without EDGE);
    [full_lo, full_hi): every row of the block sees every key (unmasked fast path);
    [full_hi, hi): the causal diagonal and the ragged k_len edge (masked).
    Keys outside [lo, hi) are invisible to every row. All bounds but ``hi`` are multiples of
    BLOCK_N; lo <= full_lo <= full_hi <= hi.
    """
    if CAUSAL:
        diag = k_len - q_len
        # The block's last row sees keys up to m_hi - 1 + diag; its first row (hence every
        # row) up to m_lo + diag.
        hi = tl.minimum(tl.maximum(m_hi + diag, 0), k_len)
        full_hi = (tl.minimum(tl.maximum(m_lo + 1 + diag, 0), k_len) // BLOCK_N) * BLOCK_N
        if EDGE != 0:
            # The first row sees keys from first_key(m_lo + diag) on; the last row (hence
            # every row, the edge being non-decreasing) from first_key(m_hi - 1 + diag) on.
            lo = (tl.maximum(first_key(m_lo + diag, window, EDGE), 0) // BLOCK_N) * BLOCK_N
            full_lo = tl.cdiv(tl.maximum(first_key(m_hi - 1 + diag, window, EDGE), 0),
                              BLOCK_N) * BLOCK_N
            # A window narrower than the block (or a chunk boundary inside it) leaves fewer
            # tiles, or none, that every row sees.
            full_lo = tl.minimum(full_lo, full_hi)
        else:
            lo = 0
            full_lo = 0
    else:
        lo = 0
        full_lo = 0
        hi = k_len
        full_hi = (k_len // BLOCK_N) * BLOCK_N
    return lo, full_lo, full_hi, hi


@triton.jit
def query_range(start_n, q_len, k_len, window, CAUSAL: tl.constexpr, EDGE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks that see the key block [start_n, start_n + BLOCK_N): (lo, full_lo, full_hi,
    hi), the transpose of ``key_range``.

    [lo, full_lo): the causal diagonal (masked); [full_lo, full_hi): every row sees every key of
    the block (unmasked); [full_hi, hi): the window's / chunk's far edge (masked; empty without
    EDGE).
    Rows outside [lo, hi) see none of these keys. Bounds are multiples of BLOCK_M or q_len.
    Rows past q_len need no mask: their loads give lse = +inf, hence P = 0.
    """
    if CAUSAL:
        diag = k_len - q_len
        # Key j is seen from row j - diag on: the first row that sees any key of the block is
        # start_n - diag, the first that sees all of them start_n + BLOCK_N - 1 - diag.
        lo = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M)
                             * BLOCK_M, q_len)
        if EDGE != 0:
            # Key j is seen up to row last_query(j) - diag: the last row that sees any key of
            # the block is last_query(start_n + BLOCK_N - 1) - diag, the last that sees all of
            # them last_query(start_n) - diag (non-decreasing in j).
            hi = tl.minimum(tl.maximum(
                last_query(start_n + BLOCK_N - 1, window, EDGE) - diag + 1, 0), q_len)
            full_hi = tl.minimum((tl.maximum(last_query(start_n, window, EDGE) - diag + 1, 0)
                                  // BLOCK_M) * BLOCK_M, q_len)
            full_hi = tl.maximum(full_hi, full_lo)
        else:
            full_hi = q_len
            hi = q_len
    else:
        lo = 0
        full_lo = 0
        full_hi = q_len
        hi = q_len
    return lo, full_lo, full_hi, hi


@triton.jit
def clamp_ranges(lo, full_lo, full_hi, hi, c0, c1):
    """The ranges (lo, full_lo, full_hi, hi) of ``key_range`` / ``query_range`` cut to [c0, c1)
    (c0 a multiple of the tile size; c1 too, or >= hi): still ordered, each range a subset of
    its own, so an unmasked range stays inside the original unmasked one."""
    lo = tl.maximum(lo, c0)
    full_lo = tl.minimum(tl.maximum(full_lo, c0), c1)
    full_hi = tl.minimum(tl.maximum(full_hi, c0), c1)
    hi = tl.minimum(hi, c1)
    return lo, full_lo, full_hi, hi


@triton.jit
def mask_key_bounds(b, m_lo, m_hi, diag, k_len, score, SPEC: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """[c0, c1) tile-aligned: the keys a mask mod's ``kv_range`` lets query rows [m_lo, m_hi)
    see (kernels/core/mods.py); call only when ``SPEC.mask_ranges`` is set.

    The mod's bounds are clamped to the keys [0, k_len) before any arithmetic: the contract
    allows any superset (0, 2**31 - 1 included), and rounding such a bound up to a tile would
    wrap int32 (then every tile was skipped: zeros). A reversed range is empty."""
    kv_lo, kv_hi = SPEC.mask_ranges[0](b, m_lo + diag, m_hi + diag, score.mask_aux)
    kv_lo = tl.minimum(tl.maximum(kv_lo, 0), k_len).to(tl.int32)
    kv_hi = tl.minimum(tl.maximum(kv_hi, kv_lo), k_len).to(tl.int32)
    c0 = (kv_lo // BLOCK_N) * BLOCK_N
    c1 = tl.cdiv(kv_hi, BLOCK_N) * BLOCK_N
    return c0, c1


@triton.jit
def mask_query_bounds(b, start_n, diag, k_len, score, SPEC: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[c0, c1) multiples of BLOCK_M: the query rows a mask mod's ``q_range`` says can see keys
    [start_n, start_n + BLOCK_N); call only when ``SPEC.mask_ranges`` is set.

    The mod's positions are clamped to the queries' [diag, k_len) (rows [0, q_len)) before
    any arithmetic, as in ``mask_key_bounds``: int32-max or int32-min bounds cannot wrap."""
    p_lo, p_hi = SPEC.mask_ranges[1](b, start_n, start_n + BLOCK_N, score.mask_aux)
    p_lo = tl.minimum(tl.maximum(p_lo, diag), k_len).to(tl.int32)
    p_hi = tl.minimum(tl.maximum(p_hi, p_lo), k_len).to(tl.int32)
    c0 = ((p_lo - diag) // BLOCK_M) * BLOCK_M
    c1 = tl.cdiv(p_hi - diag, BLOCK_M) * BLOCK_M
    return c0, c1
