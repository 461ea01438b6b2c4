"""PyTorch fallback for CPU tensors when Triton's interpreter is off: the kernels' semantics
(bottom-right causal, sliding window, chunked attention, grouped-query heads, packed sequences,
score and mask modifications, sinks, a value head_dim of its own, rows without keys -> zeros /
lse -inf, and the same Philox dropout mask) in O(seq) memory.

* Where PyTorch's own CPU flash attention computes exactly the same thing (no dropout, no
  window or chunks, no modification or sinks, v's head_dim that of q and k, dense, non-causal
  or causal with q_len == k_len, where top-left and bottom-right alignment agree), its aten
  ops do the work: they return the lse too, and are PyTorch's speed. They run in fp32 only:
  fp16 / bf16 inputs are upcast and the results cast back (``_sdpa_forward``: in fp16 / bf16
  their backward is 3-4x less accurate than the blockwise path). Two things those ops assume
  are made true here: a unit stride in head_dim (they read each row as a contiguous vector;
  any other last-dim stride gave wrong output and gradients, so such a tensor is copied
  first, as the kernels' launchers do), and finite q and k (with
  fewer than 16 keys, a row whose scores are all NaN came back as zeros with lse 0 instead of
  NaN; inputs with a NaN or an infinity take the blockwise path below, where NaN in gives NaN
  out for every row it reaches, as in the kernels and the oracle).
* Everything else (our dropout mask, windows, chunks, q_len != k_len causal, packed
  sequences, modifications, sinks) is computed block by block over query rows, each block
  against only the keys it can see, so memory stays O(block · k_len) instead of
  O(q_len · k_len) (and work O(q_len · window) or O(q_len · chunk_size)); with more than one
  PyTorch thread, by worker threads over independent parts (see "Worker threads" below).

The score pipeline of a block (kernels/core/score.py, kernels/core/mods.py) is the kernels':
s = scale · q·kᵀ in fp32, each score mod's PyTorch twin in order (``CallMods.score_mods``),
then -inf where the built-in rules (causal, window, chunk) or the mask mod hide the pair, then
the softmax, whose denominator holds exp(sink) too when the call has sinks. The backward
recomputes the same scores and chains dS back through the mods with autograd (their twins are
differentiable in s); the sinks' own gradient is not the fallback's (kernels/ops.py).

The visibility rule and the dropout row ids mirror kernels/core/tiles.py and
kernels/core/dropout.py; the dropout bits come from ``dropout_mask_block`` there (the kernels'
Philox counter in PyTorch; ``reference.dropout`` is the tests' independent oracle of it).

FP8 inputs (e4m3; kernels/core/fp8.py) take ``_fp8_forward``: the inputs upcast to fp32 and
multiplied by their descales (per batch entry or sequence and kv head), then the blockwise
path, whose weights are rounded as the kernel's P operand when q is e4m3 too (P scaled by
``fp8.P_SCALE``, rounded to e4m3, scaled back; the row sums stay those of the unrounded
weights); the output in the call's ``out_dtype``. An FP8 cache's append quantizes fp16 / bf16
rows as the kernel does (``fp8.quantize_e4m3_torch``).
"""
import dataclasses
import contextlib
import functools
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .call import (FP8_DTYPE, NO_DOUBLE_BACKWARD, lse_shape, make_problem, new_like,
                   new_out)
from .fp8 import P_SCALE, quantize_e4m3_torch
from .dropout import DROPOUT_BITS, draw_groups, dropout_mask_block, dropout_threshold

# Score elements per block of query rows: two fp32 buffers of this size (4 MiB each) and one
# bool mask are the blockwise path's temporaries, allocated once per task and reused by every
# block (with several worker threads, each gets _BLOCK_ELEMS / threads: the same total).
_BLOCK_ELEMS = 1 << 20
# fp32 K and V bytes per task of a large problem (see _split): about what a core's share of
# the L3 cache holds next to the block's own buffers.
_TASK_KV_BYTES = 4 << 20
# Rows per block of a chunked call: at most max(chunk_size, this). A block of r rows visits the
# keys from its first row's chunk start to its last row, about r + chunk_size of them, while
# each row sees chunk_size / 2 on average: without a cap, r grows to ~sqrt(_BLOCK_ELEMS) and
# the work to O(q_len · 1000) instead of O(q_len · chunk_size). The floor keeps the number of
# blocks (each costs a few dozen PyTorch calls) in check for tiny chunks.
_CHUNK_MIN_ROWS = 64
# ln of the smallest normal fp32: exp of anything below is a denormal or 0. PyTorch's CPU exp
# takes a slow path there (measured: 20x slower per element for inputs near -95, 7x near
# -1000; ALiBi at seq 2048: exp 350 -> 120 ms of a 950 ms forward + backward), and score mods
# put many scores there (ALiBi's bias grows with the distance), so with mods such inputs
# become -inf first. No result moves: each row's largest weight is 1 (the exp is taken after
# subtracting the row max or the lse), and 1e-38 of it is far below fp32's resolution.
_EXP_FLOOR = math.log(torch.finfo(torch.float32).tiny)


def _key_span(i0, i1, q_len, k_len, causal, window, chunk_size=None):
    """[k0, k1): the keys any of the query rows [i0, i1) can see (kernels/core/tiles.key_range).
    Row i sits at position P = i + k_len - q_len on the key axis; with ``chunk_size`` it sees
    keys from the start of its chunk, (P // chunk_size) * chunk_size, on."""
    if not causal:
        return 0, k_len
    diag = k_len - q_len
    k1 = min(max(i1 + diag, 0), k_len)
    if window is not None:
        k0 = min(max(i0 + diag - window + 1, 0), k1)
    elif chunk_size is not None:
        # Python's // floors, so a row before the first key (P < 0) gives a start <= 0.
        k0 = min(max((i0 + diag) // chunk_size * chunk_size, 0), k1)
    else:
        k0 = 0
    return k0, k1


def _row_blocks(rows_cost, q_len, k_span, elems, max_rows=None):
    """[start, end) query-row blocks whose ``rows_cost`` (batch * heads) x rows x visible keys
    fit ``elems`` (at least one row per block, at most ``max_rows`` when given).
    ``k_span(i0, i1)`` = the keys rows [i0, i1) see: causal blocks near the top and windowed
    blocks see few keys, so they take more rows."""
    def fits(i0, rows):
        k0, k1 = k_span(i0, i0 + rows)
        return rows_cost * rows * max(k1 - k0, 1) <= elems

    blocks, i0 = [], 0
    while i0 < q_len:
        # lo fits (or is the 1-row minimum); find the largest that fits
        lo, hi = 1, q_len - i0 if max_rows is None else min(q_len - i0, max_rows)
        if not fits(i0, hi):
            while lo * 2 < hi and fits(i0, lo * 2):
                lo *= 2
            hi = min(hi, lo * 2)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(i0, mid) else (lo, mid)
        else:
            lo = hi
        blocks.append((i0, i0 + lo))
        i0 += lo
    return blocks


def _partial_columns(i0, i1, k0, k1, q_len, k_len, causal, window, chunk_size=None):
    """[c0, c1) column ranges of keys [k0, k1) that some but not all of the rows [i0, i1) see
    (kernels/core/tiles.visible): only those need a mask, the columns between are seen by
    every row of the block. (The ranges may overlap: masking a column twice is harmless.)"""
    if not causal:
        return []
    diag = k_len - q_len
    spans = [(max(k0, i0 + diag + 1), k1)]  # the diagonal: row i sees keys <= i + diag
    if window is not None:  # the window's edge: row i sees keys > i + diag - window
        spans.append((k0, min(k1, i1 + diag - window)))
    elif chunk_size is not None:
        # The chunk's edge: the last row's chunk starts at (P_last // chunk_size) * chunk_size;
        # the rows of earlier chunks do not see from there on (beyond their diagonal, covered
        # above), and the last row does not see what lies before it.
        spans.append((k0, min(k1, (i1 - 1 + diag) // chunk_size * chunk_size)))
    return [(c0, c1) for c0, c1 in spans if c0 < c1]


def block_visible(i0, i1, k0, k1, q_len, k_len, causal, window, device, *, chunk_size=None):
    """Bool (i1 - i0, k1 - k0): query i sees key j (kernels/core/tiles.visible, in PyTorch).
    Causal: j <= P with P = i + k_len - q_len; with ``window`` also j > P - window; with
    ``chunk_size`` also j // chunk_size == P // chunk_size."""
    rows = torch.arange(i0, i1, device=device)[:, None]
    cols = torch.arange(k0, k1, device=device)[None, :]
    diag = k_len - q_len
    vis = torch.ones((i1 - i0, k1 - k0), dtype=torch.bool, device=device)
    if causal:
        pos = rows + diag
        vis = cols <= pos
        if window is not None:
            vis = vis & (cols > pos - window)
        if chunk_size is not None:
            # Floor division: a position before the first key (P < 0) is in chunk -1 or below,
            # never key 0's (it sees nothing anyway: j <= P fails).
            vis = vis & (torch.div(cols, chunk_size, rounding_mode="floor")
                         == torch.div(pos, chunk_size, rounding_mode="floor"))
    return vis


class _Dense:
    """One dense problem: q (B, H, q_len, D), k (B, H_kv, k_len, D), v (B, H_kv, k_len, Dv), fp32
    math; dropout rows ``row_base[b, h] + i`` with ``groups`` counters per row
    (kernels/core/dropout.py). ``b0``, ``h0``: the batch entry (or packed sequence) and the
    query head that this problem's first ones are in the call, as the mods see them.

    Grouped-query heads are computed per kv head with the group's query heads stacked as rows
    (B, H_kv, group * rows, D): k and v are read as they are (never expanded), and dK / dV
    come out summed over the group by the matmuls themselves. Every block-sized tensor below
    has that layout, (B, H_kv, group * rows, keys): row ``g * rows + r`` is query head
    ``h0 + kv_head * group + g``, query row ``i0 + r``."""

    def __init__(self, q, k, v, call, row_base, groups, col_offset=0, b0=0, h0=0,
                 p_fp8=False):
        self.B, self.H, self.q_len, self.D = q.shape
        # The weights are rounded as the FP8 kernel's P @ V operand (``_fp8_forward``).
        self.p_fp8 = p_fp8
        self.H_kv, self.k_len = k.shape[1], k.shape[2]
        self.group = self.H // self.H_kv if self.H_kv else 1
        self.q, self.k, self.v = q.detach(), k.detach(), v.detach()
        self.call = call
        self.causal, self.window, self.scale = call.causal, call.window, call.softmax_scale
        self.chunk = call.chunk_size
        # An int: the PyTorch Philox works on Python ints (a seed tensor on a GPU syncs here,
        # the fallback path of GPUs the kernels do not serve).
        self.dropout_p, self.seed = call.dropout_p, int(call.seed)
        self.drop_scale = call.drop_scale  # 1 / (1 - p), as the kernels scale kept weights
        self.row_base, self.groups, self.col_offset = row_base, groups, col_offset
        self.b0, self.h0 = b0, h0
        mods = call.mods
        self.score_mods, self.mask_mod, self.mask_aux = (mods.score_mods(), mods.mask_mod,
                                                         tuple(mods.aux))
        self.sinks = None if mods.sinks is None else mods.sinks.detach()
        self.elems = _BLOCK_ELEMS
        # The backward's d(mod_aux) accumulators of this task (``_backward_dense``): a list
        # parallel to mods.aux, fp32 where wanted, else None; None without any.
        self.daux = None

    def sub(self, bs, hs):
        """The sub-problem of the batches ``bs`` and kv heads ``hs`` (slices with a start), with
        their query heads, and its index into (q-side, kv-side) tensors."""
        g = slice(hs.start * self.group, hs.stop * self.group)
        sub = _Dense(self.q[bs, g], self.k[bs, hs], self.v[bs, hs], self.call,
                     self.row_base[bs, g], self.groups, self.col_offset,
                     self.b0 + bs.start, self.h0 + g.start, self.p_fp8)
        return sub, (bs, g), (bs, hs)

    def work(self, blocks=None):
        """Score elements (B * H * visible keys) of ``blocks`` (default: all rows), per block."""
        blocks = [(0, self.q_len)] if blocks is None else blocks
        return [self.B * self.H * (i1 - i0) * (k1 - k0)
                for i0, i1 in blocks for k0, k1 in [self.keys(i0, i1)]]

    def blocks(self):
        max_rows = (max(self.chunk, _CHUNK_MIN_ROWS)
                    if self.causal and self.chunk is not None else None)
        return _row_blocks(self.B * self.H, self.q_len, self.keys, self.elems, max_rows)

    def keys(self, i0, i1):
        """[k0, k1): the only keys rows [i0, i1) see (causal, window and chunk bound the work)."""
        return _key_span(i0, i1, self.q_len, self.k_len, self.causal, self.window, self.chunk)

    def scratch(self, blocks, n):
        """``n`` fp32 buffers and one bool buffer, each the size of the largest block's
        (B, H, rows, keys) scores."""
        size = max(self.work(blocks) + [0])
        return ([torch.empty(size, dtype=torch.float32, device=self.k.device)
                 for _ in range(n)], torch.empty(size, dtype=torch.bool, device=self.k.device))

    def rows(self, x, i0, i1):
        """Rows [i0, i1) of ``x`` (B, H, len, D) as fp32 (B, H_kv, group * rows, D),
        contiguous (a view of ``x`` where it already is one: read only)."""
        x = x[:, :, i0:i1].float().unflatten(1, (self.H_kv, self.group))
        return x.reshape(self.B, self.H_kv, -1, x.shape[-1]).contiguous()

    def put_rows(self, x, i0, i1, value):
        """Write ``value`` (B, H_kv, group * rows, ...) into rows [i0, i1) of ``x`` (B, H, len,
        ...)."""
        value = value.view(self.B, self.H_kv, self.group, i1 - i0, *value.shape[3:])
        x[:, :, i0:i1] = value.flatten(1, 2)

    def head_rows(self, x, i0, i1):
        """A per-query-head value ``x`` (H,) (this problem's heads) as (1, H_kv, group * rows,
        1): each row gets its head's."""
        x = x.view(1, self.H_kv, self.group, 1, 1).expand(-1, -1, -1, i1 - i0, -1)
        return x.reshape(1, self.H_kv, -1, 1)

    @property
    def needs_index(self):
        """Whether a block needs the mods' index tensors (``index``)."""
        return bool(self.score_mods) or self.mask_mod is not None

    def index(self, i0, i1, k0, k1):
        """The mods' (b, h, q_idx, kv_idx) of the block rows [i0, i1) x keys [k0, k1): int64
        (B, 1, 1, 1), (1, H_kv, group * rows, 1), (1, 1, group * rows, 1) and (1, 1, 1,
        k1 - k0), broadcastable against its scores. q_idx is the row's position on the key
        axis, i + k_len - q_len (kernels/core/mods.py)."""
        dev = self.k.device
        b = (self.b0 + torch.arange(self.B, device=dev)).view(-1, 1, 1, 1)
        h = self.head_rows(self.h0 + torch.arange(self.H, device=dev), i0, i1)
        q_idx = (torch.arange(i0, i1, device=dev) + (self.k_len - self.q_len)).repeat(
            self.group).view(1, 1, -1, 1)
        kv_idx = torch.arange(k0, k1, device=dev).view(1, 1, 1, -1)
        return b, h, q_idx, kv_idx

    def raw_scores(self, q_s, k0, k1, buf):
        """s = (scale q) kᵀ of the scaled query rows ``q_s`` (B, H_kv, group * rows, D) x keys
        [k0, k1), in ``buf``: (B, H_kv, group * rows, k1 - k0)."""
        n = k1 - k0
        s = buf[:q_s.shape[2] * n * self.B * self.H_kv].view(self.B, self.H_kv, -1, n)
        return torch.matmul(q_s, self.k[:, :, k0:k1].float().transpose(-2, -1), out=s)

    def modded(self, s, idx, user_aux=None):
        """The score mods' PyTorch twins applied to ``s`` in the pipeline's order (``s`` itself
        without any; else a new tensor, or ``s`` if the mods return it). Differentiable in
        ``s``: the backward chains dS through this. ``user_aux``: the user's score mod reads
        it instead of mods.aux (the backward's leaves for d(mod_aux))."""
        user = self.call.mods.score_mod
        for mod, aux in self.score_mods:
            s = mod.torch_fn(s, *idx, aux if user_aux is None or mod is not user else user_aux)
        return s.contiguous()

    def mask(self, s, i0, i1, k0, k1, idx):
        """-inf into ``s`` (B, H_kv, group * rows, k1 - k0), in place, where query i does not
        see key j: the built-in rules (causal, window, chunk) in the columns where they hide
        something from some row, the mask mod (which can hide anything) everywhere."""
        n = k1 - k0
        spans = _partial_columns(i0, i1, k0, k1, self.q_len, self.k_len, self.causal,
                                 self.window, self.chunk)
        if spans:
            per_row = s.view(self.B, self.H_kv, self.group, i1 - i0, n)
            for c0, c1 in spans:
                hidden = ~block_visible(i0, i1, c0, c1, self.q_len, self.k_len, self.causal,
                                        self.window, s.device, chunk_size=self.chunk)
                per_row[..., c0 - k0:c1 - k0].masked_fill_(hidden, float("-inf"))
        if self.mask_mod is not None:
            vis = self.mask_mod.torch_fn(*idx, self.mask_aux)
            s.masked_fill_(~vis, float("-inf"))
        return s

    def scores(self, q_s, i0, i1, k0, k1, buf):
        """The forward's scores of the scaled query rows ``q_s`` (B, H_kv, group * rows, D) x
        keys [k0, k1): raw, modded, -inf where invisible; (B, H_kv, group * rows, k1 - k0), in
        ``buf`` unless a mod made a new tensor."""
        idx = self.index(i0, i1, k0, k1) if self.needs_index else None
        s = self.modded(self.raw_scores(q_s, k0, k1, buf), idx)
        return self.mask(s, i0, i1, k0, k1, idx)

    def sink_rows(self, i0, i1):
        """The sink logit of each row's head, fp32 (1, H_kv, group * rows, 1); None without
        sinks."""
        if self.sinks is None:
            return None
        return self.head_rows(self.sinks[self.h0:self.h0 + self.H].float(), i0, i1)

    def kept(self, i0, i1, k0, k1, buf, scaled=False):
        """Bool (B, H_kv, group * rows, k1 - k0) in ``buf``: True where dropout keeps the
        weight (the kernels' Philox mask, kernels/core/dropout.py); None without dropout.
        ``scaled``: fp32 in an fp32 ``buf`` instead, 1 / (1 - p) where kept and 0 where
        dropped (the mask that multiplies the weights)."""
        if self.dropout_p == 0:
            return None
        if scaled and not self.causal:   # one pass to scale the bool mask
            mask = self.kept(i0, i1, k0, k1, torch.empty(buf.numel(), dtype=torch.bool,
                                                         device=buf.device))
            return torch.mul(mask.view(torch.uint8), self.drop_scale,
                             out=buf[:mask.numel()].view(mask.shape))
        n = k1 - k0
        bases = self.row_base.reshape(-1)  # (B * H_kv * group): the block's row sets in order
        out = buf[:bases.numel() * (i1 - i0) * n].view(bases.numel() * (i1 - i0), n)
        c = self.col_offset
        if self.causal:
            _causal_keep(self.seed, bases, i0, i1, self.k_len - self.q_len, k0, k1, c,
                         self.dropout_p, self.groups, out,
                         self.drop_scale if scaled else None)
        else:
            rows = (bases[:, None] + torch.arange(i0, i1, device=self.k.device)).reshape(-1)
            dropout_mask_block(self.seed, rows, c + k0, c + k1, self.dropout_p, self.groups,
                               out=out)
        return out.view(self.B, self.H_kv, -1, n)


# The seed-independent part of small causal masks (which Philox counters a block draws and
# where their words go), by layout: a training loop calls the same shapes again and again, and
# at 8 x 2 heads x 64 x 64 these ~10 index ops cost ~0.1 ms (the PyTorch-ops mask there took
# ~0.5 ms; the compiled one takes 0.08).
_COUNTERS = {}
_MAX_COUNTERS = 16
_COUNTERS_CACHED = 1 << 16   # at most this many counters per cached entry (512 KiB)


def _causal_counters(bases, i0, i1, diag, k1, c, groups, g0, g1):
    """(counter, slot) of ``_causal_keep``: int64 (S * F,) the Philox counters of the F
    4-column groups of [g0, g1) that some row of [i0, i1) sees, for each of the S row sets
    ``bases``, and int64 (S * F,) each counter's group in the (S, rows * groups) grid (read
    only: cached for small blocks)."""
    key = None
    if bases.numel() * (i1 - i0) * (g1 - g0) <= _COUNTERS_CACHED:
        key = (tuple(bases.tolist()), i0, i1, diag, k1, c, groups, g0, g1, bases.device)
        hit = _COUNTERS.get(key)
        if hit is not None:
            return hit
    dev = bases.device
    # The last group each row needs: its last visible key's (or below g0: none).
    last = torch.div(torch.arange(i0, i1, device=dev).add_(diag).clamp_(max=k1 - 1).add_(c), 4,
                     rounding_mode="floor")
    flat = (torch.arange(g0, g1, device=dev) <= last[:, None]).view(-1).nonzero().squeeze(1)
    row_of, group_of = torch.div(flat, g1 - g0, rounding_mode="floor"), flat % (g1 - g0) + g0
    counter = ((bases.to(torch.int64)[:, None] + (row_of + i0)) * groups + group_of).view(-1)
    S = bases.numel()
    slot = (torch.arange(S, device=dev)[:, None] * ((i1 - i0) * (g1 - g0)) + flat).view(-1)
    if key is not None:
        if len(_COUNTERS) >= _MAX_COUNTERS:
            _COUNTERS.clear()
        _COUNTERS[key] = counter, slot
    return counter, slot


def _causal_keep(seed, bases, i0, i1, diag, k0, k1, col_offset, dropout_p, groups, out,
                 value=None):
    """The kernels' keep mask (kernels/core/dropout.py) of a causal block, drawing only the
    Philox words of the 4-column groups that hold a key some row can see (about half of them
    for a square block): the rest of ``out`` is False (dropped), which changes nothing, as
    those weights are 0 already: half the Philox calls (``draw_groups``: the compiled loop,
    else ~100 tensor ops per call).

    bases: int64 (S,) row ids of row 0 of each of the block's S row sets; the block's rows are
        i0..i1-1 of each (row id ``bases[s] + i``); ``diag`` = k_len - q_len (row i sees keys
        j <= i + diag).
    k0, k1: the block's keys; ``col_offset`` the columns' global offset (a context-parallel
        block); ``groups`` the Philox counters per row id.
    out: bool (S * (i1 - i0), k1 - k0), written; or fp32 with ``value``: ``value`` where
        kept, 0 where dropped (the scaled mask, in the compiled loop's one pass).
    """
    dev, rows, n = out.device, i1 - i0, k1 - k0
    c = col_offset
    g0, g1 = (c + k0) // 4, (c + k1 + 3) // 4
    ng, skip = g1 - g0, c + k0 - 4 * (g0)
    S = bases.numel()
    counter, slot = _causal_counters(bases, i0, i1, diag, k1, c, groups, g0, g1)
    aligned = skip == 0 and n == 4 * ng and out.is_contiguous()
    full = (out.view(S, rows * ng, 4) if aligned
            else torch.empty((S, rows * ng, 4), dtype=out.dtype, device=dev))
    full.zero_()
    # Kept iff word >> 8 >= threshold, i.e. iff word >= threshold << 8 (words unsigned).
    bound = dropout_threshold(dropout_p) << (32 - DROPOUT_BITS)
    if counter.numel():   # word w of group g is column 4 g + w
        draw_groups(seed, counter, bound, full, slot, value=value)
    if not aligned:
        out.view(S, rows, n).copy_(full.view(S, rows, 4 * ng)[:, :, skip:skip + n])
    return out


def _sdpa_applies(q, k, cu_q, call, v=None):
    """Whether PyTorch's CPU flash attention computes exactly our result (see the docstring):
    the forward and the backward of one call decide alike (same q, k, v and arguments). ``v``:
    when given, its head_dim must be q's (the aten ops assume it)."""
    return (q.device.type == "cpu" and cu_q is None and call.window is None and not call.dropout
            and call.chunk_size is None and not call.mods.any
            and (v is None or v.shape[-1] == q.shape[-1])
            and (not call.causal or q.shape[2] == k.shape[2]) and min(q.shape[2], k.shape[2]) > 0
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
            and _all_finite(q, k))


def _all_finite(*xs):
    """Whether every element of ``xs`` is finite, from one fp32 sum per tensor: a NaN or an
    infinity anywhere makes the sum NaN or infinite. Finite elements whose sum overflows fp32
    (beyond 3.4e38) make it infinite too: those calls take the blockwise path, exact as well. (At
    8 x 4 x 64 x 32, ``isfinite(x).all()`` on q and k in the forward and again in the backward
    cost ~0.25 ms, a fifth of the aten ops' own time.)"""
    return all(math.isfinite(x.sum(dtype=torch.float32).item()) for x in xs)


def _unit_last(x):
    """``x`` itself when head_dim is unit-stride (any other strides are fine for the aten ops),
    else a copy with a unit stride there: the aten CPU flash ops read each row as a contiguous
    vector. (``.contiguous()`` alone keeps the stride of a size-1 head_dim.)"""
    if x.stride(-1) == 1:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _expand_kv(q, *kv):
    group = q.shape[1] // kv[0].shape[1]
    return [x.repeat_interleave(group, dim=1) if group > 1 else x for x in kv]


def _fp32(x):
    """``x`` as the aten CPU flash ops' input: fp32 (a copy of an fp16 / bf16 tensor, see
    ``_sdpa_forward``), with a unit stride in head_dim (``_unit_last``)."""
    return _unit_last(x if x.dtype == torch.float32 else x.float())


# The aten CPU flash ops in fp16 / bf16 fail FlashAttention's parity rule (error <= 2x that of
# the same math in the input dtype): at 4 x 9 heads x 384, causal, bf16, their dV error was
# 0.047-0.0625 against an allowance of 0.031 (the blockwise path: 0.016; these ops in fp32 on
# upcast inputs: 0.002-0.016, the final rounding). Upcast, they stay the fastest exact route:
# bf16 forward + backward at 2 x 4 heads x 384 x 64, causal, one thread (CPU time, medians),
# 20 ms against 13-20 ms for the bf16 ops and 50 ms blockwise; at 4 x 4 heads x 128 x 64,
# 5 ms against 12 ms for the bf16 ops.
def _sdpa_forward(q, k, v, causal, softmax_scale, o):
    """The aten CPU flash forward in fp32 (inputs of another dtype upcast, ``out`` cast back).
    ``o`` None: the aten op's own output is returned when it has the layout ``o`` would
    have had (``_result``; the op writes (B, q_len, H, D) memory, the layout of heads split from
    a (b, n, H * d) projection, as the book's modules do), saving a copy; an fp16 / bf16 result
    keeps that layout (``.to`` preserves the strides)."""
    q32, k32, v32 = (_fp32(x) for x in (q, k, v))
    k32, v32 = _expand_kv(q32, k32, v32)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q32, k32, v32, 0.0, causal, scale=softmax_scale)
    if out.grad_fn is not None:   # recorded (``forward_recorded``): a second derivative says ours
        out.grad_fn.register_hook(_no_double_backward)
    if o is None and out.dtype != q.dtype:
        out = out.to(q.dtype)
    return _result(o, out, q), lse.float().contiguous()




class _NoDoubleBackward(torch.autograd.Function):
    """The first-order gradients passed through, with a backward that raises
    ``NO_DOUBLE_BACKWARD``: without it, a second derivative through the aten CPU flash op gives
    PyTorch's "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not
    implemented", which names neither our function nor what to use instead."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(NO_DOUBLE_BACKWARD)


def _no_double_backward(grad_inputs, grad_outputs):
    """Hook of the recorded aten CPU flash op's autograd node: with create_graph=True (grad
    mode on in the backward) its gradients go through ``_NoDoubleBackward``; else unchanged."""
    if not torch.is_grad_enabled():
        return None
    present = [g for g in grad_inputs if g is not None]
    guarded = iter(_NoDoubleBackward.apply(*present))
    return tuple(None if g is None else next(guarded) for g in grad_inputs)


def _result(o, out, q):
    """A route's own output buffer ``out`` as the forward's output: copied into ``o``; with
    ``o`` None, ``out`` itself when it has q's dtype, shape and strides (``new_out``'s layout:
    those of a dense q), else a copy in ``new_out``'s layout."""
    if o is None:
        if out.dtype == q.dtype and out.shape == q.shape and out.stride() == q.stride():
            return out
        o = new_out(q, out.shape[-1])
    return o.copy_(out)


def _sdpa_backward(do, q, k, v, o, lse, causal, softmax_scale, dq, dk, dv):
    """The aten CPU flash backward in fp32, as ``_sdpa_forward`` (gradients cast back to the
    inputs' dtypes). ``dq``, ``dk``, ``dv`` None: the aten op's own gradients are returned (the
    eager path, where only autograd reads them)."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, o = (_fp32(x) for x in (q, k, v, o))
    k_e, v_e = _expand_kv(q, k, v)
    # grad_out in any layout: the op reads it by strides (SDPA's autograd passes it as is).
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _fp32(do), q, k_e, v_e, o, lse, 0.0, causal, scale=softmax_scale)
    group = q.shape[1] // k.shape[1]
    results = []
    for out, g, dtype in zip((dq, dk, dv), grads, dtypes):
        if results and group > 1:  # kv heads: sum over each group of query heads
            B, H, n, D = g.shape
            g = g.view(B, H // group, group, n, D).sum(2)
        if out is not None:
            g = out.copy_(g)
        elif g.dtype != dtype:
            g = g.to(dtype)
        results.append(g)
    return tuple(results)


# --------------------------------------------------------------------------------------------
# Small problems with dropout: whole score matrices, recorded by autograd.
# The blockwise path pays a few dozen PyTorch calls per block and draws the Philox mask twice
# (forward and backward), and its exp meets -inf at every hidden score (PyTorch's CPU exp takes
# a slow path there: 1M scores, half -inf, 2.6 ms against 0.9 for finite ones). Below
# _SAVED_ELEMS score elements (batch * heads * q_len * k_len) a dense call with dropout is
# instead a few big aten ops, as the book's module computes it: s = bias + scale q·kᵀ (bias
# 0 / -inf: the causal rule, added by the matmul itself), P = softmax(s) (aten's softmax takes
# -inf at full speed), the kernels' keep mask once, out = (P · keep) v / (1 - p). On the eager
# path (``forward_recorded``) autograd records these ops and differentiates them: the mask is
# drawn once, and the backward is aten's (softmax's own backward, four bmms). Without autograd
# (the custom ops under torch.compile, ``kernels.ops.backward``) the backward is the blockwise
# one, which takes the (o, lse) it is given: ring attention passes the merged result of several
# key blocks.
# Memory: what autograd keeps of these ops, P, P · Z and the scaled mask Z, all fp32, at most
# 12 · _SAVED_ELEMS bytes (48 MiB) per call, and fp32 copies of q, k, v; above _SAVED_ELEMS the
# blockwise path's O(seq) memory holds.
# (Without dropout PyTorch's CPU flash ops stay faster: at 4 x 4 heads x 256 x 64, forward +
# backward 33 ms against this route's 40.)
# --------------------------------------------------------------------------------------------
_SAVED_ELEMS = 1 << 22
_BIASES = {}      # (q_len, k_len, group) -> the causal bias (group * q_len, k_len), fp32
_MAX_BIASES = 16


def _small_applies(q, k, v, cu_q, call):
    """Whether a call takes the small-problem route above: CPU, dense, dropout, no window,
    chunks, mods or sinks, at most _SAVED_ELEMS scores, every row seeing a key (causal:
    q_len <= k_len, bottom-right). Its output must be finite too, which ``_small_forward``
    checks: a NaN or an infinity anywhere in q, k or v makes some output NaN there (every row
    sees a key; a NaN score or weight reaches its row's sum), and takes the blockwise path,
    whose NaN rules are the kernels'."""
    B, H, q_len = q.shape[:3]
    k_len = k.shape[2]
    return (q.device.type == "cpu" and cu_q is None and call.dropout and call.window is None
            and call.chunk_size is None and not call.mods.any and 0 < q_len
            and (q_len <= k_len if call.causal else 0 < k_len)
            and B * H * q_len * k_len <= _SAVED_ELEMS)


def _causal_bias(q_len, k_len, group):
    """fp32 (group * q_len, k_len): 0 where row i (of each of the group's heads) sees key j
    (j <= i + k_len - q_len), -inf elsewhere."""
    key = (q_len, k_len, group)
    bias = _BIASES.get(key)
    if bias is None:
        hidden = ~block_visible(0, q_len, 0, k_len, q_len, k_len, True, None, "cpu")
        bias = torch.zeros((q_len, k_len), device="cpu").masked_fill_(
            hidden, float("-inf")).repeat(group, 1)
        if len(_BIASES) >= _MAX_BIASES:
            _BIASES.clear()
        _BIASES[key] = bias
    return bias


def _small_inputs(pb, q, k, v):
    """q, k, v (the dense problem ``pb``'s, not detached: autograd may record this) as fp32
    contiguous (B * H_kv, rows, head_dim), q's rows being ``group * q_len`` in ``_Dense``'s
    order (copies where the layout differs; the bmms read them)."""
    B = pb.B * pb.H_kv
    q = pb.rows(q, 0, pb.q_len).view(B, pb.group * pb.q_len, pb.D)
    return q, k.float().reshape(B, pb.k_len, pb.D), v.float().reshape(B, pb.k_len, -1)


def _small_weights(pb, q, k, need_lse=True):
    """(P · Z, lse) of the dense problem ``pb`` with ``q``, ``k`` from ``_small_inputs``:
    P the softmax weights and Z the kernels' dropout mask scaled, 1 / (1 - p) where it keeps
    and 0 where it drops, fp32 (B * H_kv, group * q_len, k_len); lse fp32 (B * H_kv,
    group * q_len), not differentiable (None unless ``need_lse``)."""
    if pb.causal:
        s = torch.baddbmm(_causal_bias(pb.q_len, pb.k_len, pb.group), q, k.transpose(1, 2),
                          alpha=pb.scale)
    else:  # beta 0: the input is not read, only the scale applied
        s = torch.baddbmm(q.new_empty(()), q, k.transpose(1, 2), beta=0, alpha=pb.scale)
    p = torch.softmax(s, -1)
    with torch.no_grad():
        # P's row max is exp(0) / sum = 1 / sum (every row sees a key): lse = max + log(sum).
        lse = s.amax(-1).sub_(p.amax(-1).log_()) if need_lse else None
        # Z as fp32, the scale folded in (as nn.Dropout's mask), drawn as such: the output's
        # bmm and its backward then need no scaling of their own (autograd's would be two more
        # passes over the weights, ~0.25 ms of a 4 ms module step at 8 x 2 x 64 x 64).
        z = pb.kept(0, pb.q_len, 0, pb.k_len,
                    torch.empty(s.numel(), dtype=torch.float32, device=s.device), scaled=True)
    return p * z.view(p.shape), lse


def _small_forward(q, k, v, call, o, need_lse=True):
    """(o, lse) of a call ``_small_applies`` to, in differentiable ops (``forward_recorded``:
    autograd records them; ``o`` None: a new output, see ``_result``; lse None unless
    ``need_lse``), or None when the output is not finite (NaN or infinity in: the blockwise
    path's rules, see ``_small_applies``)."""
    pb = _problems(q, k, v, None, None, call)[0][0]
    q3, k3, v3 = _small_inputs(pb, q, k, v)
    kept, lse = _small_weights(pb, q3, k3, need_lse)
    # (B * H_kv, group * q_len, ...) is (B, H, q_len, ...) in memory: query head
    # kv_head * group + g is row block g of its kv head.
    out = torch.bmm(kept, v3)
    if not _all_finite(out):
        return None
    return (_result(o, out.view(*q.shape[:3], v.shape[-1]), q),
            None if lse is None else lse.view(q.shape[:3]))


# --------------------------------------------------------------------------------------------
# Worker threads. With PyTorch on T > 1 intra-op threads every elementwise op of a block ends
# at a thread barrier; on a machine with other work running, a descheduled worker stalls each
# of those thousands of barriers (measured: seq 4096, 8 heads, dropout, forward + backward
# 15-27 s on 2 threads against 4-6 s on 1, with load ~5 on 2 cores). Instead, the work is cut
# into independent tasks (ranges of batches or kv heads, or row ranges of those: _split) run by
# T Python threads, each with one intra-op thread: no barrier but the final join, and PyTorch
# releases the GIL inside every op. On one thread the same tasks run one after another.
# --------------------------------------------------------------------------------------------
_POOL = None
_POOL_LOCK = threading.Lock()


def _pool(n):
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers != n:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(n, thread_name_prefix="kernels-fallback")
        return _POOL


def _one_thread(task):
    """Run ``task`` on this worker thread with one intra-op thread and no autograd recording
    (grad mode and intra-op threads are per thread)."""
    def run():
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        with torch.no_grad():
            task()
    return run


def _run_tasks(tasks):
    """Run the callables ``tasks`` (independent of each other) on min(T, len(tasks)) worker
    threads, T = torch.get_num_threads(); in the calling thread when that is 1."""
    threads = torch.get_num_threads()
    if threads == 1 or len(tasks) == 1:
        with torch.no_grad():
            for task in tasks:
                task()
        return
    try:
        futures = [_pool(threads).submit(_one_thread(t)) for t in tasks]
        for f in futures:
            f.result()
    finally:
        # torch.set_num_threads in a worker also sets the default that threads created later
        # start with: put the caller's value back.
        torch.set_num_threads(threads)


def _even(n, parts):
    """range(n) cut into min(parts, n) slices of near-equal length."""
    parts = max(1, min(parts, n))
    return [slice(n * j // parts, n * (j + 1) // parts) for j in range(parts)]


def _cut(blocks, work, parts):
    """``blocks`` cut into at most ``parts`` runs of consecutive blocks of about equal work."""
    total, runs, start, acc = sum(work), [], 0, 0
    for j, w in enumerate(work):
        acc += w
        if len(runs) < parts - 1 and acc * parts >= total * (len(runs) + 1):
            runs.append(blocks[start:j + 1])
            start = j + 1
    return [r for r in runs + [blocks[start:]] if r]


def _split(pb):
    """[(sub-problem, its q-side index, its kv-side index, its row blocks)]: the tasks of one
    dense problem. Work within one block (or not on CPU): the whole problem. Else ranges of
    batches, or of kv heads within a batch, whose K and V fit _TASK_KV_BYTES: a block's
    matmuls then read K and V from cache (with all 8 heads of seq 8192 in every block, 16 rows
    each, forward + backward with dropout took 11.7 s on one thread; one head per task, 128
    rows per block, 9.9 s). With T > 1 threads, at least 2 T tasks (so that a thread the OS
    holds back is made up for by the others): when there are fewer ranges, row ranges of each
    (their dK / dV are summed at the end)."""
    threads = torch.get_num_threads()
    if pb.k.device.type != "cpu" or sum(pb.work()) <= _BLOCK_ELEMS:
        return [(pb, (slice(None),) * 2, (slice(None),) * 2, pb.blocks())]
    kv_bytes = pb.k_len * (pb.k.shape[-1] + pb.v.shape[-1]) * 4  # one kv head, fp32
    heads = max(1, _TASK_KV_BYTES // max(kv_bytes, 1))
    if heads >= pb.H_kv:
        rects = [(bs, slice(0, pb.H_kv)) for bs in _even(pb.B, -(-pb.B * pb.H_kv // heads))]
    else:
        rects = [(slice(b, b + 1), hs) for b in range(pb.B)
                 for hs in _even(pb.H_kv, -(-pb.H_kv // heads))]
    n = 2 * threads if threads > 1 else 1
    if len(rects) == 1 and n == 1:
        return [(pb, (slice(None),) * 2, (slice(None),) * 2, pb.blocks())]
    parts = -(-n // len(rects))
    tasks = []
    for bs, hs in rects:
        sub, qi, ki = pb.sub(bs, hs)
        sub.elems = max(1, _BLOCK_ELEMS // threads)
        blocks = sub.blocks()
        tasks += [(sub, qi, ki, run) for run in _cut(blocks, sub.work(blocks), parts)]
    return tasks


def _exp_(x, flush):
    """exp of ``x`` in place; with ``flush``, results below the smallest normal fp32 are 0
    (see _EXP_FLOOR). NaN stays NaN (NaN < floor is False)."""
    if flush:
        x.masked_fill_(x < _EXP_FLOOR, float("-inf"))
    return x.exp_()


# How far the lse given to a backward may be from the one its block recomputes (fp32 ulps
# of |lse|) and still be taken for the same: the forward's own lse, rounded as it was.
_LSE_ULPS = 8


def _exp_rows_(s, sink, flush):
    """exp(s - m) in place over each row of the masked scores ``s``, m the row's max (the
    sink's logit included, so that no exp overflows; 0 in rows that see no key). Returns
    (the scores' own max, m, the row sums with exp(sink - m) in them). The forward and the
    backward (``_weights_``) both make P with it."""
    m_s = m = s.amax(-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink)  # NaN stays NaN: torch.maximum propagates it
    m = _finite_or_zero(m)
    _exp_(s.sub_(m), flush=flush)
    total = s.sum(-1, keepdim=True)
    if sink is not None:
        total.add_((sink - m).exp_())
    return m_s, m, total


def _weights_(s, lse, sink, flush):
    """The softmax weights P, in place, from the masked scores ``s`` (B, H_kv, rows, keys) of
    rows that see all their keys here, given the forward's ``lse`` (rows, 1; -inf replaced by
    0) and sink logits (or None). Returns bool (rows, 1): where the block is the row's whole
    softmax (its max + log(sum) is the given lse to within ``_LSE_ULPS`` of its rounding).

    There P = exp(s - max) / sum, as the forward made it; elsewhere (an lse merged from other
    key blocks: ring attention) exp(s - max) * exp(max - lse). (exp(s - lse) alone has the
    relative error eps * |lse| of lse's fp32 rounding: at scores ~100, 50x that of eager's
    softmax.)"""
    _, m, total = _exp_rows_(s, sink, flush)
    own = (m + total.log() - lse).abs() <= (
        _LSE_ULPS * torch.finfo(torch.float32).eps * lse.abs().clamp(min=1.0))
    scale = torch.where(own, total.reciprocal(), (m - lse).exp())
    s.mul_(scale.masked_fill_(total == 0, 0.0))
    return own


def _finite_or_zero(x):
    """``x`` with -inf (rows that see no key) replaced by 0, so exp(-inf - x) = 0."""
    return x.masked_fill(x == float("-inf"), 0.0)


def _forward_blocks(pb, o, lse, blocks):
    """Per block: scores, row max, exp in place, row sums; lse = max + log(sum); the weights
    divided by sum * (1 - p) and zeroed in place by the dropout mask; out = weights @ v (rows
    that see no key: zeros and lse -inf). With sinks, exp(sink - max) joins each row's sum (and
    the max takes the sink into account, so that the exp cannot overflow) but no value: a row
    that sees no key gets zeros and lse = its sink."""
    (buf,), mask_buf = pb.scratch(blocks, 1)
    keep_scale = pb.drop_scale
    for i0, i1 in blocks:
        k0, k1 = pb.keys(i0, i1)
        sink = pb.sink_rows(i0, i1)
        if k0 == k1:  # no row of the block sees a key: zeros, lse = the sink (-inf without)
            empty = torch.full((pb.B, pb.H_kv, pb.group * (i1 - i0)), float("-inf"),
                               device=lse.device)
            if sink is not None:
                empty.copy_(sink.squeeze(-1))  # the same for every batch entry
            pb.put_rows(lse, i0, i1, empty)
            o[:, :, i0:i1] = 0.0
            continue
        q_s = pb.rows(pb.q, i0, i1) * pb.scale
        s = pb.scores(q_s, i0, i1, k0, k1, buf)
        m_s, m, total = _exp_rows_(s, sink, flush=bool(pb.score_mods))
        if pb.p_fp8:
            # The kernel rounds exp(x - max of the scores seen) * P_SCALE (the sinks join only
            # at the end) to e4m3: the same here, with the row's max of the scores.
            c = (m - _finite_or_zero(m_s)).exp_().masked_fill_(m_s == float("-inf"), 1.0)
            c.mul_(P_SCALE)
            s.mul_(c)
            s.copy_(s.to(FP8_DTYPE))
            s.div_(c)
        pb.put_rows(lse, i0, i1, (m + total.log()).squeeze(-1))
        # The weights normalised before P @ V, as eager's softmax is: the block holds every
        # key of its rows (dividing the product instead rounds o differently from eager, by
        # up to 1.2x its fp32 error, which a model's gradients then carry).
        s.mul_((keep_scale / total).masked_fill_(total == 0, 0.0))
        keep = pb.kept(i0, i1, k0, k1, mask_buf)
        if keep is not None:
            # x * keep: NaN only comes whole rows at a time here (a row's max and sum are NaN
            # with any of its scores), so it equals the kernels' where(keep, x, 0); 2x faster.
            # As uint8: aten's mul by a bool tensor is not vectorised (1M weights: 0.86 ms
            # against 0.23).
            s.mul_(keep.view(torch.uint8))
        pb.put_rows(o, i0, i1, torch.matmul(s, pb.v[:, :, k0:k1].float()))


def _forward_dense(pb, o, lse):
    if o.numel() == 0 and lse.numel() == 0:
        return
    tasks = [functools.partial(_forward_blocks, sub, o[qi], lse[qi], blocks)
             for sub, qi, _, blocks in _split(pb)]
    _run_tasks(tasks)


def _backward_blocks(pb, do, o, lse, dq, dk_acc, dv_acc, blocks):
    """Per block, with Z = keep / (1 - p) the dropout factor and P the recomputed weights:
    dS = P * (Z * (dO V^T) - delta); dQ = dS K scale, dK += dS^T Q scale, dV += (P * Z)^T dO.

    Where the block is the rows' whole softmax (its lse is the given one: ``_weights_``), P is
    exp(s - max) / sum and delta = rowsum(P * Z * (dO V^T)), as eager's softmax backward takes
    them; elsewhere (ring attention's merged lse) P = exp(s - lse), delta = rowsum(dO * O).
    (Measured 2026-11-29, head_dim 512, scale 1, scores of std ~22, packed causal rows of 9
    and 6: dV's error against the float64 oracle was up to 13x fp32 eager's with exp(s - lse)
    and rowsum(dO * O); it is eager's own, 0.99-1.00x, now.)

    The 1 / (1 - p) is taken out of the block-sized work: with
    ``ds' = P * (keep * (dO V^T) - delta * (1 - p))``, dS = ds' / (1 - p). With score mods, P
    comes from the modded scores and dS (with respect to them) is chained back to the raw
    score s = scale q·kᵀ through the mods' twins by autograd before the matmuls. Sinks change
    nothing here: they are in the forward's lse already. ``dk_acc``, ``dv_acc``: fp32
    (B * H_kv, k_len, D) and (B * H_kv, k_len, Dv) accumulators. With ``pb.daux``, the same
    autograd call gives d(mod_aux) of the block (the user's twin reads leaf copies of the
    wanted entries), added into ``pb.daux``."""
    # With mods, the raw scores must outlive P and dS (autograd reads them, and perhaps the
    # mods saved them), so they get a buffer of their own.
    bufs, mask_buf = pb.scratch(blocks, 3 if pb.score_mods else 2)
    p_buf, ds_buf = bufs[:2]
    keep_scale = pb.drop_scale
    user_aux = leaves = None
    if pb.daux is not None:
        user_aux = [a.detach().requires_grad_() if d is not None else a
                    for a, d in zip(pb.call.mods.aux, pb.daux)]
        leaves = [a for a, d in zip(user_aux, pb.daux) if d is not None]
    for i0, i1 in blocks:
        k0, k1 = pb.keys(i0, i1)
        if k0 == k1:  # no row of the block sees a key: dQ stays 0
            dq[:, :, i0:i1] = 0.0
            continue
        q_s = pb.rows(pb.q, i0, i1) * pb.scale
        do_b = pb.rows(do, i0, i1)
        delta = (do_b * pb.rows(o, i0, i1)).sum(-1, keepdim=True)  # right with dropout too
        lse_b = _finite_or_zero(pb.rows(lse[..., None], i0, i1))
        idx = pb.index(i0, i1, k0, k1) if pb.needs_index else None
        if pb.score_mods:
            s_raw = pb.raw_scores(q_s, k0, k1, bufs[2]).detach().requires_grad_()
            with _recording():  # the worker threads run under no_grad
                s_mod = pb.modded(s_raw, idx, user_aux)
            # A copy: autograd may have saved s_mod (tanh saves its output).
            p = p_buf[:s_mod.numel()].view(s_mod.shape).copy_(s_mod.detach())
        else:
            p = pb.raw_scores(q_s, k0, k1, p_buf)
        own = _weights_(pb.mask(p, i0, i1, k0, k1, idx), lse_b, pb.sink_rows(i0, i1),
                        flush=bool(pb.score_mods))
        ds = ds_buf[:p.numel()].view(p.shape)
        torch.matmul(do_b, pb.v[:, :, k0:k1].float().transpose(-2, -1), out=ds)
        keep = pb.kept(i0, i1, k0, k1, mask_buf)
        if keep is not None:  # dO V^T can hold NaN in single columns (a NaN in v): where
            torch.where(keep, ds, ds.new_zeros(()), out=ds)
        # delta = rowsum(dO * O) = sum_j P_ij dP_ij. Where the block is the whole softmax
        # (``own``), the sum over its P and dP, as eager's softmax backward takes it: dS then
        # vanishes where it should (one dominant key: dP_ij ~ delta_i) instead of keeping the
        # rounding of the stored O. (vecdot: no block-sized temporary; P (dP - delta) rather
        # than P dP - P delta, which rounds both products: 1.4x eager's error on dQ / dK.)
        d_own = torch.linalg.vecdot(ds, p).unsqueeze(-1)
        delta = torch.where(own, d_own, delta.div_(keep_scale))
        ds.sub_(delta).mul_(p)
        if pb.score_mods:
            # ds' · ∂s_mod/∂s_raw (the 1 / (1 - p) factor commutes with the chain rule). A mod
            # that ignores s altogether leaves nothing to differentiate: dS = 0.
            if not s_mod.requires_grad:
                ds = torch.zeros_like(ds)
            elif leaves is None:
                ds = torch.autograd.grad(s_mod, s_raw, ds)[0].contiguous()
            else:
                g_s, *g_aux = torch.autograd.grad(s_mod, [s_raw, *leaves], ds,
                                                  allow_unused=True)
                ds = torch.zeros_like(ds) if g_s is None else g_s.contiguous()
                for acc, g in zip((d for d in pb.daux if d is not None), g_aux):
                    if g is not None:
                        acc.add_(g, alpha=keep_scale)
        pb.put_rows(dq, i0, i1, torch.matmul(ds, pb.k[:, :, k0:k1].float()).mul_(
            pb.scale * keep_scale))
        n, rows = k1 - k0, p.shape[2]
        # dK += dS^T (Q scale): q_s holds the scale already.
        dk_acc[:, k0:k1].baddbmm_(ds.view(-1, rows, n).transpose(1, 2),
                                  q_s.view(-1, rows, pb.D), alpha=keep_scale)
        if keep is not None:
            p.mul_(keep.view(torch.uint8))  # NaN comes whole rows at a time, as in the forward
        dv_acc[:, k0:k1].baddbmm_(p.view(-1, rows, n).transpose(1, 2),
                                  do_b.view(-1, rows, do_b.shape[-1]), alpha=keep_scale)


@contextlib.contextmanager
def _recording():
    """Autograd records in this thread: grad mode on, and autograd's dispatch keys back in
    where a custom op's implementation (kernels/ops.py, the torch.compile path) runs with them
    excluded -- there ``enable_grad`` alone records nothing and the mods' twins would give no
    gradient. (Worker threads start without the exclusion.)"""
    with torch._C._PreserveDispatchKeyGuard():
        torch._C._dispatch_tls_set_dispatch_key_excluded(
            torch._C.DispatchKey.AutogradFunctionality, False)
        torch._C._dispatch_tls_set_dispatch_key_included(torch._C.DispatchKey.ADInplaceOrView,
                                                         False)
        with torch.enable_grad():
            yield


def _grad_acc(x, shape, fresh=False):
    """A contiguous fp32 ``shape`` accumulator for gradient ``x`` (zeros): ``x`` itself when
    it is one and not ``fresh``."""
    if not fresh and x.dtype == torch.float32 and x.is_contiguous():
        return x.view(shape)
    return torch.zeros(shape, dtype=torch.float32, device=x.device)


def _backward_dense(pb, do, o, lse, dq, dk, dv, daux=None):
    """dq, dk, dv (zeros on entry) of one dense problem. Each task sums dK / dV into an fp32
    accumulator: the gradient itself where it is fp32 and contiguous and the first task of its
    heads, else a zeroed one added in at the end (row ranges of the same heads, other
    dtypes). ``daux`` (``backward``): each task gets its own d(mod_aux) accumulators, added
    into ``daux`` in task order at the end (deterministic)."""
    if pb.B * pb.H * pb.q_len == 0:
        return  # nothing to compute: dk and dv stay zero
    tasks, sums, task_daux = [], {}, []
    for sub, qi, ki, blocks in _split(pb):
        if daux is not None:
            sub.daux = [None if d is None else torch.zeros_like(d) for d in daux]
            task_daux.append(sub.daux)
        dk_u, dv_u = dk[ki], dv[ki]
        key = tuple((s.start, s.stop) for s in ki)
        first = key not in sums
        accs = [_grad_acc(x, (sub.B * sub.H_kv, sub.k_len, x.shape[-1]), fresh=not first)
                for x in (dk_u, dv_u)]
        if first:
            sums[key] = (dk_u, dv_u, accs)
        else:
            sums[key][2].extend(accs)
        tasks.append(functools.partial(_backward_blocks, sub, do[qi], o[qi], lse[qi], dq[qi],
                                       *accs, blocks))
    _run_tasks(tasks)
    for accs in task_daux:
        for d, acc in zip(daux, accs):
            if d is not None:
                d += acc
    for dk_u, dv_u, accs in sums.values():
        for j, out in enumerate((dk_u, dv_u)):
            total = accs[j]
            for extra in accs[j + 2::2]:
                total += extra
            if total.data_ptr() != out.data_ptr():
                out.copy_(total.view(out.shape))


# Dense layouts' (row_base, groups, col0) for ``_problems``: a training loop repeats its shapes,
# and building them (the problem, its drop arguments, two aranges) cost ~40 us a call.
_ROW_BASES = {}
_MAX_ROW_BASES = 16


def _problems(q, k, v, cu_q, cu_k, call, batch0=0, p_fp8=False):
    """(dense problem, q-row slice, k-row slice) per batch or packed sequence. Dense: one
    problem for the whole batch, whose first entry is the call's batch entry ``batch0`` (the
    mods' b); packed: one per sequence on (1, H, len, D) views, b the sequence. The dropout
    row ids and Philox strides are the kernels' (``Problem.drop_args``, kernels/core/call.py),
    including a context-parallel block's ``call.drop_layout``."""
    packed = cu_q is not None
    if not packed:
        layout = call.drop_layout
        key = (q.shape, k.shape, None if layout is None else tuple(layout), q.device)
        rows = _ROW_BASES.get(key)
        if rows is None:   # read only, and the same for every call of the layout: kept
            drop = make_problem(q, k, v, None, None, 0, 0).drop_args(call, q)
            B, H = q.shape[:2]
            rows = ((torch.arange(B, device=q.device)[:, None] * drop.row_stride_b
                     + torch.arange(H, device=q.device) * drop.row_stride_h + drop.row0),
                    drop.groups, drop.col0)
            if len(_ROW_BASES) >= _MAX_ROW_BASES:
                _ROW_BASES.clear()
            _ROW_BASES[key] = rows
        return [(_Dense(q, k, v, call, *rows, b0=batch0, p_fp8=p_fp8), slice(None),
                 slice(None))]
    drop = make_problem(q, k, v, cu_q, cu_k, 0, 0).drop_args(call, q)
    H = q.shape[1]
    head_rows = torch.arange(H, device=q.device) * drop.row_stride_h + drop.row0
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    out = []
    for s in range(len(bounds_q) - 1):
        rq = slice(bounds_q[s], bounds_q[s + 1])
        rk = slice(bounds_k[s], bounds_k[s + 1])
        row_base = (head_rows + bounds_q[s]).view(1, H)
        views = [x[r].transpose(0, 1).unsqueeze(0) for x, r in ((q, rq), (k, rk), (v, rk))]
        out.append((_Dense(*views, call, row_base, drop.groups, b0=s, p_fp8=p_fp8), rq, rk))
    return out


def _view(x, r, packed):
    """The 4-D view of output ``x`` that matches a problem's rows ``r``."""
    return x[r].transpose(0, 1).unsqueeze(0) if packed else x


def forward(q, k, v, cu_q, cu_k, call, o):
    """(o, lse) as the forward kernel returns them for ``call`` (an ``AttentionCall``,
    kernels/core/call.py); ``o`` (q's layout with v's head_dim) is written in place."""
    if k.dtype == FP8_DTYPE:
        return _fp8_forward(q, k, v, cu_q, cu_k, call, o)
    if _small_applies(q, k, v, cu_q, call):
        result = _small_forward(q, k, v, call, o)
        if result is not None:
            return result
    return _forward(q, k, v, cu_q, cu_k, call, o)


def forward_recorded(q, k, v, call, need_lse=True):
    """(out, lse) of ``forward`` (dense, out in ``new_out``'s layout) for the calls that a few
    aten ops compute, made of differentiable ops whose backward autograd records: PyTorch's CPU
    flash attention (no dropout, ``_sdpa_applies``) and small problems with dropout
    (``_small_applies``). Their backward then runs in PyTorch's engine with no Python of ours
    (the eager path's: at 8 x 2 heads x 64 x 64 x 64, forward + backward, 1.45 ms through an
    autograd.Function around ``forward`` / ``backward``, 1.08 ms for the same aten ops
    recorded; a second derivative of the small route is autograd's, the flash ops' is
    PyTorch's error). None when neither route applies: the caller runs ``forward`` and
    ``backward`` (the blockwise path) in an autograd.Function. lse may be None unless
    ``need_lse``."""
    if _small_applies(q, k, v, None, call):
        return _small_forward(q, k, v, call, None, need_lse)
    if _sdpa_applies(q, k, None, call, v):
        return _sdpa_forward(q, k, v, call.causal, call.softmax_scale, None)
    return None


def _forward(q, k, v, cu_q, cu_k, call, o, batch0=0, p_fp8=False):
    """``forward``, the dense batch being entries ``batch0``... of the call (the mods' b);
    ``p_fp8``: the weights rounded as the FP8 kernel's (``_fp8_forward``)."""
    if k.dtype == FP8_DTYPE:
        return _fp8_forward(q, k, v, cu_q, cu_k, call, o, batch0)
    if not p_fp8 and _sdpa_applies(q, k, cu_q, call, v):
        return _sdpa_forward(q, k, v, call.causal, call.softmax_scale, o)
    if o is None:
        o = new_out(q, v.shape[-1])
    packed = cu_q is not None
    lse = torch.empty(lse_shape(q, packed), dtype=torch.float32, device=q.device)
    for pb, rq, _ in _problems(q, k, v, cu_q, cu_k, call, batch0, p_fp8):
        lse_v = lse[:, rq].unsqueeze(0) if packed else lse
        _forward_dense(pb, _view(o, rq, packed), lse_v)
    return o, lse


def _dequantize(x, descale, cu, group, batch0):
    """fp32 ``x`` times its descale: x dense (B, heads, n, D) or packed (total, heads, D) with
    row offsets ``cu``; descale None or (num_batch or sequences, H_kv), entry (batch0 + b,
    h // group) for head h of batch entry (or sequence) b."""
    x = x.float()
    if descale is None:
        return x
    d = descale.to(device=x.device, dtype=torch.float32)
    if cu is None:
        d = d[batch0:batch0 + x.shape[0]].repeat_interleave(group, 1)
        return x * d[:, :, None, None]
    lens = (cu[1:] - cu[:-1]).long().to(x.device)
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=x.device), lens)
    d = d[seq].repeat_interleave(group, 1)                        # (total, heads)
    return x * d[:, :, None]


def _fp8_forward(q, k, v, cu_q, cu_k, call, o, batch0=0):
    """``forward`` of FP8 inputs (kernels/core/fp8.py): q, k, v e4m3 (FlashAttention-3's FP8
    forward), or k, v e4m3 with fp16 / bf16 q (an FP8 KV cache); descales from
    ``call.mods.descale``; ``o`` None or an output in ``call.out_dtype``. See the module
    docstring."""
    descale = call.mods.descale
    descale = (None, None, None) if descale is None else descale
    hq, hk = (q.shape[1], k.shape[1])
    group = hq // hk if hk else 1
    q32 = _dequantize(q, descale[0], cu_q, group, batch0) if q.dtype == FP8_DTYPE else q.float()
    k32 = _dequantize(k, descale[1], cu_k, 1, batch0)
    v32 = _dequantize(v, descale[2], cu_k, 1, batch0)
    plain = dataclasses.replace(call, mods=dataclasses.replace(call.mods, descale=None))
    if o is None:
        o = new_out(q, v.shape[-1], call.out_dtype)
    o32, lse = _forward(q32, k32, v32, cu_q, cu_k, plain, None, batch0,
                        p_fp8=q.dtype == FP8_DTYPE)
    return o.copy_(o32), lse


def backward(do, q, k, v, o, lse, cu_q, cu_k, call, dq, dk, dv, daux=None):
    """(dq, dk, dv) as the backward kernels return them for ``call``, written into the given
    tensors (do, o and dv with v's head_dim), or, given None for all three (the eager path),
    into new ones in any layout. ``daux``: as ``attention_backward``'s (fp32 zeroed buffers
    parallel to ``call.mods.aux``, None where not wanted), added into.
    A small call with dropout takes the blockwise path here, which uses the (o, lse) it is
    given: ``kernels.ops.backward`` may be given another call's -- ring attention's merged
    result of several key blocks -- which a recomputed softmax would ignore."""
    if _sdpa_applies(q, k, cu_q, call, v):
        return _sdpa_backward(do, q, k, v, o, lse, call.causal, call.softmax_scale, dq, dk, dv)
    if dq is None:
        dq, dk, dv = new_like(q), new_like(k), new_like(v)
    packed = cu_q is not None
    dq.zero_()  # rows of no sequence (none when cu_seqlens are valid) stay 0
    dk.zero_()
    dv.zero_()
    for pb, rq, rk in _problems(q, k, v, cu_q, cu_k, call):
        lse_v = lse[:, rq].unsqueeze(0) if packed else lse
        _backward_dense(pb, _view(do, rq, packed), _view(o, rq, packed), lse_v,
                        _view(dq, rq, packed), _view(dk, rk, packed), _view(dv, rk, packed),
                        daux)
    return dq, dk, dv


def kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, call, o, block_table=None):
    """``attention_with_kvcache`` row by row: append (k, v) in place, then each row b attends
    to its first n_b cache positions as ``call`` says (its queries at positions n_b - q_len...
    on the key axis, for the causal rules and the mods' q_idx). Returns (o, lse (B, H_q,
    q_len)); o and v_cache have v's head_dim. With ``block_table``: paged caches
    (``paged_kvcache_forward``)."""
    if block_table is not None:
        return paged_kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, call, o,
                                     block_table)
    B, H, q_len, _ = q.shape
    lens = cache_seqlens.tolist()
    k, v = _cache_rows(k_cache, k, v, call)
    if k is not None:
        for b, n in enumerate(lens):
            k_cache[b, :, n:n + q_len] = k[b]
            v_cache[b, :, n:n + q_len] = v[b]
    lse = torch.empty((B, H, q_len), dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        n = n + (q_len if k is not None else 0)
        o_b, lse_b = _forward(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                              None, None, call, o[b:b + 1], batch0=b)
        lse[b:b + 1] = lse_b
    return o, lse


def _cache_rows(cache, k, v, call):
    """The new rows (k, v) as the cache stores them: quantized into an e4m3 cache from another
    dtype (``fp8.quantize_e4m3_torch`` with the call's k / v descales), else as given."""
    if k is None or cache.dtype != FP8_DTYPE or k.dtype == FP8_DTYPE:
        return k, v
    descale = call.mods.descale or (None, None, None)
    return quantize_e4m3_torch(k, descale[1]), quantize_e4m3_torch(v, descale[2])


def write_slots(k_cache, v_cache, k, v, slot_mapping, descale=None):
    """``kvcache.SlotWritePlan`` for CPU tensors: token t's rows k[t], v[t] (heads_kv, D) go
    to row slot % page_size of page slot // page_size of the paged caches, quantized into an
    e4m3 cache as the kernel does (``descale``: a ``mods.Descale`` with (tokens, heads_kv) k,
    v or None); slots < 0 are skipped (selected with a boolean index: a sync on a GPU)."""
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    pages, rows = slots // page_size, slots % page_size
    for cache, new, scale in ((k_cache, k, None if descale is None else descale.k),
                              (v_cache, v, None if descale is None else descale.v)):
        if cache.dtype == FP8_DTYPE and new.dtype != FP8_DTYPE:
            new = quantize_e4m3_torch(new.unsqueeze(2), scale).squeeze(2)
        cache[pages, rows] = new[keep]


def paged_kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, call, o, block_table):
    """``kvcache_forward`` on paged caches (num_blocks, page_size, H_kv, D or Dv) with
    block_table int32 (B, max_blocks) (kernels/core/paged.py): the new rows are written into
    their pages in place, then each row's filled positions are gathered (this path's
    simplicity over the kernels' page-by-page reads) and attended to as ``kvcache_forward``
    does."""
    B, H, q_len, _ = q.shape
    page_size = k_cache.shape[1]
    lens = cache_seqlens.tolist()
    table = block_table.long()
    new = q_len if k is not None else 0
    k, v = _cache_rows(k_cache, k, v, call)
    lse = torch.empty((B, H, q_len), dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        pos = torch.arange(n + new, device=q.device)
        pages, rows = table[b, pos // page_size], pos % page_size
        if k is not None:
            k_cache[pages[n:], rows[n:]] = k[b].transpose(0, 1)
            v_cache[pages[n:], rows[n:]] = v[b].transpose(0, 1)
        kd = k_cache[pages, rows].transpose(0, 1).unsqueeze(0)  # (1, H_kv, n + new, D)
        vd = v_cache[pages, rows].transpose(0, 1).unsqueeze(0)
        _, lse_b = _forward(q[b:b + 1], kd, vd, None, None, call, o[b:b + 1], batch0=b)
        lse[b:b + 1] = lse_b
    return o, lse


def varlen_paged_forward(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, call,
                         o=None):
    """``kvcache.varlen_paged_forward`` for CPU tensors: packed queries q (total_q, heads_q,
    D) with int32 cu_seqlens_q (num_seqs + 1,) against paged caches (num_blocks, page_size,
    heads_kv, D or Dv); sequence s's keys are its first seqused_k[s] positions, position j
    being row j % page_size of page block_table[s, j // page_size]. Each sequence's pages are
    gathered into packed K/V (total_k, heads_kv, D) and the packed ``forward`` runs on them.
    Returns (o (total_q, heads_q, Dv), written in place when given, lse (heads_q, total_q))."""
    page_size = k_cache.shape[1]
    lens = seqused_k.to(device=q.device, dtype=torch.int64)
    seq_of_key = torch.repeat_interleave(torch.arange(lens.numel(), device=q.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(seq_of_key.numel(), device=q.device) - starts[seq_of_key]
    pages = block_table.long()[seq_of_key, pos // page_size]
    rows = pos % page_size
    cu_k = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=q.device)
    cu_k[1:] = torch.cumsum(lens, 0)
    return forward(q, k_cache[pages, rows], v_cache[pages, rows], cu_seqlens_q, cu_k, call, o)
