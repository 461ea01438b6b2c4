"""One description of an attention call, built once and passed down to every launcher.

* ``AttentionCall``: what the call computes -- causal or not, the softmax scale, the sliding
  window, dropout (probability, seed, and the block of a longer sequence this call is, for
  context parallelism). The dropout threshold and scale, the base-2 score scale and the default
  softmax scale are derived here and nowhere else.
* ``Problem``: the tensors' geometry -- batch, heads, group, lengths, packed or dense -- and the
  lse layout, whose entry offsets double as the dropout mask's row ids
  (kernels/core/dropout.py).
* The kernels' grouped arguments (``SeqArgs``, ``ScoreArgs``, ``DropArgs``, ``SplitArgs``):
  small named tuples that Triton passes as one argument each and the kernels read by field
  (``score.qk_scale``), so no launch lists long positional arguments in a kernel's order.

Both layouts reach the kernels as 4-D (batch, heads, seq, head_dim) views:

* dense: q (B, heads_q, q_len, D), k/v (B, heads_kv, k_len, D) as given; lse (B, heads_q, q_len).
* packed (varlen): q (total_q, heads_q, D) is viewed as (1, heads_q, total_q, D) and the
  kernels' batch axis runs over the sequences, whose row offsets come from ``cu_seqlens``
  (the batch stride is 0); lse (heads_q, total_q).

In both, the lse entry of (batch or sequence b, head h, row i) sits at
``b * lse_strides[0] + h * lse_strides[1] + row_start + i``.
"""
import ast
import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
from torch.fx.experimental.symbolic_shapes import guard_scalar

from .common import LOG2E, dot_precision
from .dropout import dropout_threshold
from .mods import NO_MODS, SOFTCAP, SOFTCAP_EXACT, CallMods, MaskMod, ModFns, ScoreMod, lookup

# The left edge of what a causal query sees (the kernels' EDGE constexpr, kernels/core/tiles.py):
# none, a sliding window of ``window`` keys, or the query's chunk of ``chunk_size`` positions.
EDGE_NONE, EDGE_WINDOW, EDGE_CHUNK = 0, 1, 2


def seed_tensor(seed, device) -> torch.Tensor:
    """The Philox seed as the kernels read it: a 0-d int64 tensor on ``device``. A tensor
    already there is used as is (the default path: no copy, no sync); an int, or a tensor on
    another device, costs one host-to-device copy (an explicit ``seed=``)."""
    if isinstance(seed, torch.Tensor):
        return seed if seed.device == device else seed.to(device)
    return torch.tensor(int(seed), dtype=torch.int64, device=device)


def new_like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor like ``t`` in the layout the ops give their outputs: ``t``'s strides
    when its last dim is unit-stride (``torch.empty_like``), else contiguous. Fake and real
    tensors agree (the custom ops' fakes use it too)."""
    return torch.empty_like(t) if t.stride(-1) == 1 else torch.empty(t.shape, dtype=t.dtype,
                                                                      device=t.device)


FP8_DTYPE = torch.float8_e4m3fn   # the one FP8 format the kernels take (Triton's float8e4nv)


def out_dtype_of(q_dtype: torch.dtype, out_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The output dtype of a call on ``q_dtype`` inputs: ``out_dtype`` when given, else q's
    dtype, except FP8 q -> bfloat16 (as FlashAttention-3's FP8 forward)."""
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if q_dtype == FP8_DTYPE else q_dtype


def new_out(q: torch.Tensor, head_dim_v: int, dtype: Optional[torch.dtype] = None
            ) -> torch.Tensor:
    """The attention output for ``q`` with v's head dim, in ``out_dtype_of(q.dtype, dtype)``:
    q's shape and layout (``new_like``) when the head dims agree, else contiguous."""
    dtype = out_dtype_of(q.dtype, dtype)
    if head_dim_v == q.shape[-1]:
        if dtype == q.dtype:
            return new_like(q)
        return (torch.empty_like(q, dtype=dtype) if q.stride(-1) == 1
                else torch.empty(q.shape, dtype=dtype, device=q.device))
    return q.new_empty((*q.shape[:-1], head_dim_v), dtype=dtype)


def default_softmax_scale(head_dim: int) -> float:
    """The scale every entry point uses when none is given: 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


def lse_shape(q: torch.Tensor, packed: bool) -> tuple:
    """Shape of the row log-sum-exp of ``q``: (B, heads_q, q_len) for a dense q
    (B, heads_q, q_len, D), (heads_q, total_q) for a packed q (total_q, heads_q, D)."""
    return (q.shape[1], q.shape[0]) if packed else tuple(q.shape[:3])


@dataclass(frozen=True)
class AttentionCall:
    """What one attention call computes (the tensors aside).

    causal: bottom-right causal mask. softmax_scale: > 0. window: None, or the sliding window
    (causal only). chunk_size: None, or chunked attention (causal only, not with a window):
    query position P sees key j iff j <= P and j // chunk_size == P // chunk_size.
    dropout_p in [0, 1) with its Philox ``seed`` (ignored without dropout): an int in
    [0, 2**63), or a 0-d int64 tensor holding one (the public API draws it on the inputs'
    device, so that no call copies or syncs it: ``seed_tensor``).
    drop_layout: None, or (q_total, k_total, row_offset, col_offset) when this dense call is a
    block of a longer sequence and its dropout mask is that block of the whole one.
    mods: the call's score/mask modifications and sinks (kernels/core/mods.py); with FP8
    inputs also their descales (``mods.descale``, kernels/core/fp8.py).
    out_dtype: None, or the output's dtype (None: q's, bfloat16 for FP8 q: ``out_dtype_of``).
    """
    causal: bool
    softmax_scale: float
    dropout_p: float = 0.0
    seed: "int | torch.Tensor" = 0
    window: Optional[int] = None
    drop_layout: Optional[tuple] = None
    chunk_size: Optional[int] = None
    mods: CallMods = NO_MODS
    out_dtype: Optional[torch.dtype] = None

    def with_seed(self, seed) -> "AttentionCall":
        """This call with its dropout ``seed`` (an int, or a 0-d int64 tensor)."""
        return dataclasses.replace(self, seed=seed)

    @property
    def edge(self) -> int:
        """The kernels' EDGE constexpr: EDGE_NONE, EDGE_WINDOW or EDGE_CHUNK."""
        if self.window is not None:
            return EDGE_WINDOW
        return EDGE_CHUNK if self.chunk_size is not None else EDGE_NONE

    @property
    def edge_size(self) -> int:
        """The window or the chunk size (0 without either): the kernels' ``score.window``."""
        return self.window or self.chunk_size or 0

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0

    @property
    def qk_scale(self) -> float:
        """The softmax scale in base 2 (the kernels' exp2 works on scores times this)."""
        return self.softmax_scale * LOG2E

    @property
    def dropout_mode(self) -> int:
        """The kernels' DROPOUT constexpr: 0 off; 1 on, the key columns starting on a 4-column
        Philox group (every call but a context-parallel block at an odd column offset); 2 on,
        at any column offset (kernels/core/dropout.py)."""
        if not self.dropout:
            return 0
        return 1 if self.drop_layout is None or self.drop_layout[3] % 4 == 0 else 2

    @property
    def drop_scale(self) -> float:
        """What kept weights are multiplied by: 1 / (1 - dropout_p)."""
        return 1.0 / (1.0 - self.dropout_p)

    @property
    def drop_threshold(self) -> int:
        """The 24-bit Philox draw keeps an element iff it is >= this (kernels/core/dropout.py)."""
        return dropout_threshold(self.dropout_p) if self.dropout else 0


# The one double-backward error of every route (the pipeline's autograd routes and the CPU
# fallback's hook on PyTorch's flash op): the backward is a fused kernel without a derivative.
NO_DOUBLE_BACKWARD = (
    "double backward (a gradient of a gradient) of kernels.attention is not supported: its "
    "backward is a fused kernel with no derivative of its own. Use reference.attention (plain "
    "PyTorch) or torch.nn.functional.scaled_dot_product_attention where second derivatives are "
    "needed.")


def call_spec(call: AttentionCall, num_splits: int = 0) -> str:
    """The one string that carries ``call``'s non-tensor fields (mods by name) and
    ``num_splits`` through the custom ops (kernels/pipeline.py): op arguments generated from
    the call's fields and read back by ``parse_spec``, not kept in parallel by hand. The seed
    and the mods' tensors travel as tensor arguments."""
    mods = call.mods
    fields = (call.causal, call.softmax_scale, call.dropout_p, call.window, call.drop_layout,
              call.chunk_size, mods.softcap)
    if torch.compiler.is_compiling():
        # A number that changes between compiled calls (window=4, then 5) becomes symbolic
        # (Dynamo's automatic dynamic); the kernels specialise on it anyway, so it is made a
        # constant again, guarded (a new value recompiles, as a first value compiles).
        fields = tuple(_static(f) for f in fields)
    return repr((*fields,
                 mods.score_mod.name if mods.score_mod is not None else "",
                 mods.mask_mod.name if mods.mask_mod is not None else "", int(num_splits),
                 "" if call.out_dtype is None else str(call.out_dtype).replace("torch.", "")))


def _static(x):
    """``x`` (a number, None, or a tuple of them) with symbolic numbers guarded to constants."""
    if isinstance(x, tuple):
        return tuple(_static(y) for y in x)
    return x if x is None else guard_scalar(x)


_SPECS = {}   # spec -> (call without tensors, num_splits): parsed once per spec
_MAX_SPECS = 1024


def parse_spec(spec: str):
    """(``AttentionCall`` without tensors or seed, num_splits) of a ``call_spec`` string."""
    hit = _SPECS.get(spec)
    if hit is None:
        (causal, scale, dropout_p, window, drop_layout, chunk_size, softcap, score_mod,
         mask_mod, num_splits, out_dtype) = ast.literal_eval(spec)
        mods = CallMods(softcap=softcap, score_mod=lookup(score_mod, ScoreMod),
                        mask_mod=lookup(mask_mod, MaskMod))
        if len(_SPECS) >= _MAX_SPECS:
            _SPECS.clear()
        hit = _SPECS[spec] = (AttentionCall(causal, scale, dropout_p, 0, window, drop_layout,
                                            chunk_size, mods,
                                            getattr(torch, out_dtype) if out_dtype else None),
                              num_splits)
    return hit


def without_tensors(call: AttentionCall) -> AttentionCall:
    """``call`` less its per-call tensors (seed, ALiBi slopes, sinks, aux, FP8 descales): what
    a plan keeps."""
    mods = call.mods
    if mods.has_tensors:
        mods = dataclasses.replace(mods, alibi_slopes=None, sinks=None, aux=(), descale=None)
    return dataclasses.replace(call, seed=0, mods=mods)


def with_tensors(call: AttentionCall, sinks, alibi_slopes, aux, descale=None) -> AttentionCall:
    """A plan's ``call`` with this call's mods' tensors (sinks fp32, slopes fp32 contiguous,
    as ``validation.check_mods`` converts them: no-ops on converted ones) and FP8 ``descale``
    (a ``mods.Descale``; None, or one whose three entries are None: no descales)."""
    if descale is not None and all(d is None for d in descale):
        descale = None
    if sinks is None and alibi_slopes is None and not aux and descale is None:
        return call
    return dataclasses.replace(call, mods=dataclasses.replace(
        call.mods, sinks=None if sinks is None else sinks.float(), aux=tuple(aux),
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.float().contiguous(),
        descale=descale))


# ------------------------------------------------------------------ the kernels' grouped args
class SeqArgs(NamedTuple):
    """Lengths of a launch (the kernels' ``seq``): dense lengths, or with packed sequences the
    longest ones (grid extents) and the cu_seqlens pointers; ``k_lens``: per-row key counts
    (a KV cache's filled length). Pointers a variant does not read are any valid tensor.
    A paged KV cache (kernels/core/paged.py): logical key position j of batch entry b is row
    j % page_size of page block_table[b, j // page_size], page_size being the forward's PAGED
    constexpr."""
    group: int        # query heads per kv head
    q_len: int
    k_len: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    k_lens: torch.Tensor
    block_table: torch.Tensor   # int32 (B, max_blocks) page indices (read only when PAGED)
    bt_stride: int              # block_table's row stride (its column stride is 1)


class KeyLayout(NamedTuple):
    """How the forward finds a row's keys (its KEYS constexpr; part of the autotune key):
    ``varlen`` packed sequences (cu_seqlens), ``k_lens`` per-row key counts (a KV cache's
    filled length, ``SeqArgs.k_lens``), ``page_size`` 0, or the page size of a paged cache
    (kernels/core/paged.py; one compile per page size), ``v_in_k``: V is K's first
    HEAD_DIM_V columns, read once as part of the K tile (MLA's latent cache, whose values are
    its keys' first 512 columns: ``ForwardPlan``'s ``v_in_k``)."""
    varlen: bool
    k_lens: bool
    page_size: int
    v_in_k: bool = False


class ScoreArgs(NamedTuple):
    """The score pipeline's runtime parameters (the kernels' ``score``; kernels/core/score.py)."""
    qk_scale: float       # softmax_scale * log2(e)
    softmax_scale: float
    window: int           # the window or chunk size (read only when EDGE)
    aux: tuple            # per score mod (ScoreSpec.mods), its aux tuple
    mask_aux: tuple       # the mask mod's aux tuple
    sinks: torch.Tensor   # fp32 (heads_q,) sink logits (read only when ScoreSpec.sinks)
    # fp32 gradient buffers parallel to the call's mod_aux (a dummy where none is wanted),
    # written only by the dQ launch of a backward that computes d(aux) (kernels/core/mods.py)
    daux: tuple = ()
    # the forward's FP8 descales (kernels/core/fp8.py ``DescaleArgs``; read only with FP8)
    descale: tuple = ()


class ScoreSpec(NamedTuple):
    """The score pipeline's compile-time description (the kernels' SPEC constexpr): which
    masks and modifications a launch compiles in. Hashable: part of the autotune key."""
    causal: bool
    edge: int             # EDGE_NONE / EDGE_WINDOW / EDGE_CHUNK (causal only)
    mods: tuple           # ModFns of each score mod, in the pipeline's order
    mask_mod: object      # the mask mod's @triton.jit fn, or None
    sinks: bool
    mask_ranges: object = None   # (kv_range, q_range) of the mask mod, or None


class DropArgs(NamedTuple):
    """The dropout mask's Philox key and counter layout (the kernels' ``drop``;
    kernels/core/dropout.py): row id = b * row_stride_b + h * row_stride_h + row start +
    row0 + i, column = col0 + j, ``groups`` counters per row id."""
    seed: int
    threshold: int
    scale: float
    groups: int
    row_stride_b: int
    row_stride_h: int
    row0: int
    col0: int


class SplitArgs(NamedTuple):
    """Split-KV partial outputs of the forward (the kernels' ``split``; kernels/core/splitkv.py):
    fp32 (num_splits, n_rows, D) and (num_splits, n_rows), row = the lse offset."""
    o_part: torch.Tensor
    lse_part: torch.Tensor
    num_splits: int
    n_rows: int


class Precision(NamedTuple):
    """How the forward computes in its inputs' dtype (its PRECISION constexpr): ``widen``,
    bf16 tiles widened to fp32 after each load (``common.widen_bf16``: the interpreter's bf16),
    ``dot``, tl.dot's input precision (``common.dot_precision``)."""
    widen: bool
    dot: str


class SchedArgs(NamedTuple):
    """A persistent forward's tile schedule (the kernel's ``sched``): ``tiles`` an int32 (2,)
    counter, zero between launches (the next tile to hand out, the programs done; the last
    program resets both), shared by the launches of one stream (``forward.tile_counter``);
    the grid's heads and batch extents, whose query blocks the kernel counts itself."""
    tiles: torch.Tensor
    heads: int
    batch: int


class FwdStrides(NamedTuple):
    """The forward's (batch, head, row) strides of q, k, v, o and its lse's (batch, head) ones
    (the kernel's ``strides``; a paged cache's k, v: (page, head, row))."""
    q: tuple
    k: tuple
    v: tuple
    o: tuple
    lse: tuple


class BwdStrides(NamedTuple):
    """The backward kernels' (batch, head, row) strides of q, k, v, do and of the gradients
    dq, dk, dv, and the row statistics' (batch, head, plane) ones (``backward.stats_layout``;
    the kernels' ``strides``)."""
    q: tuple
    k: tuple
    v: tuple
    do: tuple
    dq: tuple
    dk: tuple
    dv: tuple
    stats: tuple


class Problem(NamedTuple):
    q: torch.Tensor               # (B or 1, heads_q, q_len or total_q, D)
    k: torch.Tensor               # (B or 1, heads_kv, k_len or total_k, D)
    v: torch.Tensor
    batch: int                    # B, or the number of packed sequences
    heads: int                    # query heads
    group: int                    # query heads per kv head
    q_len: int                    # dense length, or the longest packed sequence (grid extent)
    k_len: int
    cu_q: Optional[torch.Tensor]  # int32 (batch + 1,) for packed sequences, else None
    cu_k: Optional[torch.Tensor]  # None also for packed queries over a paged cache
    lse_shape: tuple
    lse_strides: tuple            # (batch stride, head stride) of lse
    drop_groups: int              # Philox counters per row id (kernels/core/dropout.py)

    @property
    def varlen(self) -> bool:
        return self.cu_q is not None

    @property
    def heads_kv(self) -> int:
        return self.heads // self.group

    def strides(self, x):
        """(batch, head, seq) strides of a 4-D view; the batch stride is 0 for packed
        sequences, whose offsets come from cu_seqlens instead."""
        return (0 if self.varlen else x.stride(0)), x.stride(1), x.stride(2)

    def seq_args(self, dummy, k_lens=None, block_table=None) -> SeqArgs:
        """The kernels' ``seq``; ``dummy`` stands in for pointers this launch never reads.
        ``block_table``: int32 (B or num_seqs, max_blocks) with unit column stride, for a
        paged cache whose k, v are viewed (num_blocks, heads_kv, page_size, D)
        (``paged.paged_problem``, ``paged.paged_varlen_problem``)."""
        cu_q, cu_k = (self.cu_q, self.cu_k) if self.varlen else (dummy, dummy)
        if cu_k is None:   # packed queries over a paged cache (paged.paged_varlen_problem)
            cu_k = dummy
        # Constant stand-ins when not paged: no new specialization of the unpaged kernels.
        bt_stride = 0
        if block_table is None:
            block_table = dummy
        else:
            assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
            bt_stride = block_table.stride(0)
        return SeqArgs(group=self.group, q_len=self.q_len, k_len=self.k_len, cu_q=cu_q,
                       cu_k=cu_k, k_lens=dummy if k_lens is None else k_lens,
                       block_table=block_table, bt_stride=bt_stride)

    def drop_args(self, call: AttentionCall, dummy: torch.Tensor, seed=None) -> DropArgs:
        """The kernels' ``drop``: the lse layout's row ids by default; with the call's
        ``drop_layout`` (dense only) those of the longer sequence this call is a block of.
        ``dummy`` (a tensor on the launch's device) stands in for the seed without dropout;
        ``seed``: the seed pointer to use instead of the call's (a launch plan's template)."""
        if seed is None:
            seed = seed_tensor(call.seed, dummy.device) if call.dropout else dummy
        key = dict(seed=seed,
                   threshold=call.drop_threshold, scale=call.drop_scale)
        if call.drop_layout is None:
            return DropArgs(**key, groups=self.drop_groups, row_stride_b=self.lse_strides[0],
                            row_stride_h=self.lse_strides[1], row0=0, col0=0)
        q_total, k_total, row_offset, col_offset = call.drop_layout
        assert not self.varlen
        assert row_offset + self.q_len <= q_total and col_offset + self.k_len <= k_total
        return DropArgs(**key, groups=triton.cdiv(k_total, 4), row_stride_b=self.heads * q_total,
                        row_stride_h=q_total, row0=row_offset, col0=col_offset)

    def tune_buckets(self) -> tuple:
        """The kernels' BUCKETS, part of the autotune key: (q_len, k_len) rounded up to powers
        of two, so a new length re-tunes only when it changes bucket, and whether query heads
        are grouped (GQA / MQA: 1, else 0), which the backward's pruning reads (a dK/dV tile
        tuned on an ungrouped call spilled when reused by a grouped one)."""
        return (triton.next_power_of_2(self.q_len), triton.next_power_of_2(self.k_len),
                int(self.group > 1))


def score_args(call: AttentionCall, dummy: torch.Tensor) -> ScoreArgs:
    """The kernels' ``score``; ``dummy`` stands in for the sinks pointer when there are none."""
    mods = call.mods
    return ScoreArgs(qk_scale=call.qk_scale, softmax_scale=call.softmax_scale,
                     window=call.edge_size, aux=tuple(aux for _, aux in mods.score_mods()),
                     mask_aux=tuple(mods.aux) if mods.mask_mod is not None else (),
                     sinks=dummy if mods.sinks is None else mods.sinks)


def score_spec(call: AttentionCall, dtype: torch.dtype) -> ScoreSpec:
    """The kernels' SPEC constexpr for inputs of ``dtype``: fp32 with IEEE dots takes the
    exact soft-capping (``mods.SOFTCAP_EXACT``), whose error is PyTorch's."""
    mods = call.mods
    exact = dtype == torch.float32 and dot_precision(dtype) == "ieee"
    return ScoreSpec(causal=call.causal, edge=call.edge,
                     mods=tuple(SOFTCAP_EXACT if exact and m is SOFTCAP else ModFns(m.fn, m.grad)
                                for m, _ in mods.score_mods()),
                     mask_mod=None if mods.mask_mod is None else mods.mask_mod.fn,
                     sinks=mods.sinks is not None,
                     mask_ranges=None if mods.mask_mod is None or mods.mask_mod.kv_range is None
                     else (mods.mask_mod.kv_range, mods.mask_mod.q_range))


def packed_view(x):
    """(total, heads, D) packed tensor as a (1, heads, total, D) view (no copy)."""
    return x.transpose(0, 1).unsqueeze(0)


def dense_problem(q, k, v) -> Problem:
    """q (B, heads_q, q_len, D); k, v (B, heads_kv, k_len, D)."""
    B, H, q_len, _ = q.shape
    H_kv, k_len = k.shape[1], k.shape[2]
    assert H_kv > 0 and H % H_kv == 0 or H == H_kv == 0
    return Problem(q, k, v, B, H, H // H_kv if H_kv else 1, q_len, k_len, None, None,
                   lse_shape(q, False), (H * q_len, q_len), triton.cdiv(k_len, 4))


def varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k) -> Problem:
    """q (total_q, heads_q, D); k, v (total_k, heads_kv, D); cu_q, cu_k int32 (n + 1,);
    max_q, max_k: the longest sequence lengths (grid extents; >= the real ones)."""
    total_q, H, _ = q.shape
    total_k, H_kv, _ = k.shape
    assert H_kv > 0 and H % H_kv == 0
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    return Problem(packed_view(q), packed_view(k), packed_view(v), cu_q.numel() - 1, H,
                   H // H_kv, max_q, max_k, cu_q, cu_k, lse_shape(q, True), (0, total_q),
                   triton.cdiv(total_k, 4))


def make_problem(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None) -> Problem:
    """The dense problem, or the packed one when ``cu_seqlens_q`` is given."""
    if cu_seqlens_q is None:
        return dense_problem(q, k, v)
    return varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
