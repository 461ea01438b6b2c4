"""Attention masks held in a tensor (``attention(..., attn_mask=)``), SDPA's two kinds:

* boolean: read by the kernels through a mask mod (TENSOR_MASK), with tile bounds taken from
  the mask so that a causal, windowed, chunked or block-diagonal pattern visits about the
  tiles it shows (below);
* additive (float): a bias added to the scaled scores by a score mod (TENSOR_BIAS), -inf
  entries hiding their pairs, differentiable (its gradient accumulated in the dQ kernel, as
  any learned aux: kernels/core/mods.py). With ``bounds`` (``bias_aux``: calls of at least
  BIAS_BOUNDS_MIN_PAIRS score entries per head without a mask mod of their own) the pairs
  above -inf get the boolean mask's tile bounds (a mask mod of ranges only, BIAS_BOUNDS): a
  causal or padded bias, such as SDPA's boolean mask turned into 0 / -inf, skips the tiles it
  hides; else every tile is visited.

Either has any shape that broadcasts to (batch, heads_q, q_len, k_len) (2-D (q_len, k_len) for
every batch entry and head, (batch, 1, 1, k_len) key padding, (batch, 1, q_len, k_len) per
batch entry, ...), read through its strides: a broadcast (stride-0) or sliced view costs no
copy (a boolean mask is read in place; a bias not float32, or whose keys are not unit-stride,
is converted once per call).

The bias mod's ``aux`` (``bias_aux``): aux[0] the bias, float32, in its own shape made 4-D
(broadcast dims of size 1); aux[1] as the mask's below (the bounds' strides only with bounds);
with bounds aux[2], aux[3] as the mask's, of the entries above -inf. Its
gradient (``aux_grad``) adds ds at each pair's offset: a broadcast dim sums into its one entry.

The boolean mask's ``aux`` (``TensorMask.aux``):
    aux[0]  the mask as int8, broadcast to (batch, heads_q, q_len, k_len): a view, unless its
            keys are not unit-stride (a transposed mask: then copied once)
    aux[1]  (q_len, k_len, its batch, head and row strides, the bounds' two batch strides):
            int32, or int64 if the mask spans 2**31 elements or more
    aux[2]  int32 (batch or 1, cdiv(q_len, GROUP), 2): per group of GROUP query rows, the keys
            [lo, hi) any of its rows sees in any head
    aux[3]  int32 (batch or 1, cdiv(k_len, GROUP), 2): per group of GROUP keys, the query rows
            [lo, hi) that see any of them in any head
(an empty group: lo = the other axis' length, hi = 0). A tile's bound is the union over the
groups it touches (at most MAX_GROUPS, read as one vector; a wider tile gets no bound), so
only the tiles before a query block's first visible key and after its last are skipped (and
for dK / dV, the query tiles outside its keys' rows); gaps in between are visited and masked.
"""
import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from .mods import MaskMod, ScoreMod, aux_ints

_GROUP = 16          # rows (keys) per bound entry: the smallest tile of any config
_MAX_GROUPS = 32     # groups one tile's bound reads at once: tiles up to 496 rows
GROUP = tl.constexpr(_GROUP)
MAX_GROUPS = tl.constexpr(_MAX_GROUPS)


@triton.jit
def _offsets(b, h, q_idx, kv_idx, aux):
    """Offsets of the (query, key) pairs in a mask or bias aux[0] read with unit-stride keys;
    aux[1] = (q_len, k_len, batch, head and row strides (0 where broadcast), ...) in the
    offsets' dtype (int32 unless the tensor spans 2**31 elements). Clamped: mods run on whole
    tiles, whose rows and columns past the ends are masked anyway."""
    q_len = tl.load(aux[1])
    k_len = tl.load(aux[1] + 1)
    row = tl.minimum(tl.maximum(q_idx - (k_len - q_len), 0), q_len - 1)
    col = tl.minimum(tl.maximum(kv_idx, 0), k_len - 1)
    # The (batch, head) offset and a row vector, then the columns: one full-tile add.
    return (b * tl.load(aux[1] + 2) + h * tl.load(aux[1] + 3)
            + row * tl.load(aux[1] + 4)) + col


@triton.jit
def _mask_fn(b, h, q_idx, kv_idx, aux):
    return tl.load(aux[0] + _offsets(b, h, q_idx, kv_idx, aux)) != 0


@triton.jit
def _group_union(bounds, stride_b, b, lo, hi, n, other):
    """The union [first, last) of the (lo, hi) entries of ``bounds`` (int32 (., cdiv(n,
    GROUP), 2), batch stride ``stride_b``) over the groups meeting [lo, hi) of an axis of
    length ``n`` (``other``: the bounded axis' length); [0, other) if that is more than
    MAX_GROUPS groups, an empty (reversed) range if it meets none."""
    lo = tl.maximum(lo, 0)
    hi = tl.minimum(hi, n)
    g0 = lo // GROUP
    g1 = tl.cdiv(hi, GROUP)
    g = g0 + tl.arange(0, MAX_GROUPS)
    met = g < g1
    entry = bounds + b.to(tl.int64) * stride_b + 2 * g
    first = tl.min(tl.load(entry, mask=met, other=other), axis=0)
    last = tl.max(tl.load(entry + 1, mask=met, other=0), axis=0)
    wide = g1 - g0 > MAX_GROUPS
    return tl.where(wide, 0, first), tl.where(wide, other, last)


@triton.jit
def _mask_keys(b, q_lo, q_hi, aux):
    q_len = tl.load(aux[1]).to(tl.int32)
    k_len = tl.load(aux[1] + 1).to(tl.int32)
    diag = k_len - q_len
    return _group_union(aux[2], tl.load(aux[1] + 5), b, q_lo - diag, q_hi - diag, q_len, k_len)


@triton.jit
def _mask_queries(b, kv_lo, kv_hi, aux):
    q_len = tl.load(aux[1]).to(tl.int32)
    k_len = tl.load(aux[1] + 1).to(tl.int32)
    diag = k_len - q_len
    lo, hi = _group_union(aux[3], tl.load(aux[1] + 6), b, kv_lo, kv_hi, k_len, q_len)
    return lo + diag, hi + diag


def _mask_torch(b, h, q_idx, kv_idx, aux):
    q_len, k_len = aux[0].shape[2:]
    return aux[0][b, h, q_idx - (k_len - q_len), kv_idx] != 0


TENSOR_MASK = MaskMod("kernels.attn_mask", _mask_fn, _mask_torch, kv_range=_mask_keys,
                      q_range=_mask_queries)


def _groups_seen(seen, dim):
    """int8 ``seen`` (batch, q, k) reduced by max over groups of GROUP along ``dim`` (1: query
    rows, 2: keys): (batch, cdiv(q, GROUP), k) or (batch, q, cdiv(k, GROUP)), without a copy of
    the mask (a ragged last group reduced on its own)."""
    n = seen.shape[dim]
    whole = n // _GROUP * _GROUP
    parts = []
    if whole:
        parts.append(seen.narrow(dim, 0, whole).unflatten(dim, (whole // _GROUP, _GROUP))
                     .amax(dim + 1))
    if n > whole or not parts:
        parts.append(seen.narrow(dim, whole, n - whole).amax(dim, keepdim=True) if n > whole
                     else seen.narrow(dim, 0, 0))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _spans(grouped):
    """int32 (batch, groups, 2): per row of int8 ``grouped`` (batch, groups, n) the [lo, hi)
    of its nonzero entries, (n, 0) for a row without any."""
    n = grouped.shape[-1]
    if n == 0 or grouped.shape[1] == 0:
        return torch.zeros((*grouped.shape[:2], 2), dtype=torch.int32, device=grouped.device)
    first = grouped.argmax(-1)                          # argmax: the first maximum
    end = n - grouped.flip(-1).argmax(-1)
    any_seen = grouped.amax(-1) > 0
    return torch.stack((torch.where(any_seen, first, n), torch.where(any_seen, end, 0)),
                       -1).to(torch.int32).contiguous()


@triton.jit
def _bias_fn(s, b, h, q_idx, kv_idx, aux):
    return s + tl.load(aux[0] + _offsets(b, h, q_idx, kv_idx, aux))


@triton.jit
def _bias_grad(ds, s, b, h, q_idx, kv_idx, aux, daux):
    # d(bias) = ds at each pair; a broadcast dim (stride 0) sums its pairs into one entry.
    tl.atomic_add(daux[0] + _offsets(b, h, q_idx, kv_idx, aux), ds)


def _bias_torch(s, b, h, q_idx, kv_idx, aux):
    bias = aux[0]
    diag = aux[1][1] - aux[1][0]        # k_len - q_len, kept on the device (no host read)
    at = [i * int(n > 1) for i, n in zip((b, h, q_idx - diag, kv_idx), bias.shape)]
    return s + bias[at[0], at[1], at[2], at[3]].to(s.dtype)


TENSOR_BIAS = ScoreMod("kernels.attn_bias", _bias_fn, _bias_torch, aux_grad=_bias_grad,
                       grad_aux=(0,))


@triton.jit
def _everything_fn(b, h, q_idx, kv_idx, aux):
    # The bias's -inf entries hide their pairs themselves: this mod only bounds the tiles.
    return (q_idx == q_idx) & (kv_idx == kv_idx)


def _everything_torch(b, h, q_idx, kv_idx, aux):
    return (q_idx == q_idx) & (kv_idx == kv_idx)


BIAS_BOUNDS = MaskMod("kernels.attn_bias_bounds", _everything_fn, _everything_torch,
                      kv_range=_mask_keys, q_range=_mask_queries)
# An additive mask gets tile bounds (BIAS_BOUNDS) from this many (query, key) pairs per head
# on: below, the few reductions that find them cost more host time than the tiles they can
# skip save (not measured on a GPU; 512 x 512 is 16 tiles of 128 x 128).
BIAS_BOUNDS_MIN_PAIRS = 512 * 512


def as_4d(t):
    """``t`` (2 to 4 dims) viewed as 4-D, 1s prepended."""
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


def _offset_ints(t, target):
    """aux[1] of a tensor ``t`` (4-D, unit-stride keys) read as broadcast to ``target`` (batch,
    heads_q, q_len, k_len): (q_len, k_len, batch, head and row strides, 0 where broadcast),
    int32 unless the tensor spans 2**31 elements."""
    m = t.expand(*target)
    span = sum((n - 1) * st for n, st in zip(m.shape, m.stride())) + 1
    return m, (target[2], target[3], *m.stride()[:3]), (torch.int32 if span < 2 ** 31
                                                       else torch.int64)


def _read_once(t, dims):
    """``t`` with each of ``dims`` that is broadcast (size > 1, stride 0) narrowed to size 1:
    the same values, each read once (the offsets' strides broadcast them back)."""
    for d in dims:
        if t.shape[d] > 1 and t.stride(d) == 0:
            t = t.narrow(d, 0, 1)
    return t


def bias_aux(bias, target, bounds=False):
    """TENSOR_BIAS's ``mod_aux`` for a float ``bias`` broadcastable to ``target`` (batch,
    heads_q, q_len, k_len) (checked by the caller): the bias as float32 in its own (not
    broadcast) shape, keys unit-stride (copied where it is not), and its offsets; with
    ``bounds`` also the tile bounds of its entries above -inf (for BIAS_BOUNDS; computed here,
    on the device: the bias is not read on the host). A bias that requires grad gets it
    through this conversion."""
    b4 = _read_once(as_4d(bias), range(4))
    if b4.stride(-1) != 1 and b4.shape[-1] > 1 or bias.requires_grad:
        b4 = b4.contiguous()
    b4 = b4.float()
    _, ints, dtype = _offset_ints(b4, target)
    if not bounds:
        return (b4, aux_ints(ints, b4.device, dtype))
    cache = _bounds_of(bias)    # one bias shared by a model's layers: found once
    key_bounds, query_bounds = cache.get(tuple(target[2:])) or _seen(b4, cache).bounds(
        *target[2:])
    return (b4, aux_ints((*ints, *_bounds_strides(key_bounds, query_bounds)), b4.device, dtype),
            key_bounds, query_bounds)


def _seen(b4, cache):
    """The ``TensorMask`` of a bias's entries above -inf, its bounds kept in ``cache``."""
    seen = TensorMask(b4.detach() > float("-inf"))
    seen._bounds = cache
    return seen


def _bounds_strides(key_bounds, query_bounds):
    """The bounds' batch strides in aux[1] (0 where one entry serves every batch entry)."""
    return (key_bounds.stride(0) if key_bounds.shape[0] > 1 else 0,
            query_bounds.stride(0) if query_bounds.shape[0] > 1 else 0)


# mask (or bias) tensor -> (its version counter, its bounds per (q_len, k_len)): the layers of
# a model that pass one mask tensor compute its bounds once (``TensorMask.of``, ``bias_aux``).
# Only the bounds are held, never the mask, so the key stays collectable.
_BOUNDS = WeakIdKeyDictionary()


def _bounds_of(tensor) -> dict:
    """The bounds per (q_len, k_len) of ``tensor`` at its current version, shared by every
    call on it (a fresh dict while tracing under torch.compile: the graph computes them)."""
    if torch.compiler.is_compiling():
        return {}
    hit = _BOUNDS.get(tensor)
    if hit is None or hit[0] != tensor._version:
        hit = _BOUNDS[tensor] = (tensor._version, {})
    return hit[1]


class TensorMask:
    """A boolean attention mask prepared for the kernels: its tile bounds (a few reductions
    over the mask), computed once per (q_len, k_len) and kept. A bool tensor passed as
    ``attn_mask`` gets them once per tensor and version in eager calls (``of``); a
    ``TensorMask`` passed instead keeps them under torch.compile too (built outside the
    compiled function) and wherever the tensor is rebuilt per call. A float mask needs none.

    Args:
        mask: bool, broadcastable to (batch, heads_q, q_len, k_len) of the calls it serves
            (checked at each call); True = the query attends to the key.

    ``mask``: the tensor, as given; ``shape``: its shape as 4-D (1s prepended)."""

    def __init__(self, mask):
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"attn_mask must be a bool tensor (True = attend) or a floating one "
                            f"(added to the scores), got {got}")
        if not 2 <= mask.dim() <= 4:
            raise ValueError(f"attn_mask must have 2 to 4 dims, broadcastable to (batch, "
                             f"heads_q, q_len, k_len), got shape {tuple(mask.shape)}")
        self.mask = mask
        self._int8 = as_4d(mask.view(torch.int8))
        self.shape = tuple(self._int8.shape)
        self._bounds = {}

    @classmethod
    def of(cls, mask):
        """The ``TensorMask`` of a bool tensor passed as ``attn_mask``: its bounds shared with
        every earlier call on the same tensor at the same version (an in-place change makes
        new ones); while tracing under torch.compile a fresh one (the graph computes them)."""
        prepared = cls(mask)
        prepared._bounds = _bounds_of(mask)
        return prepared

    @property
    def device(self):
        return self.mask.device

    def bounds(self, q_len, k_len):
        """(key_bounds, query_bounds) for calls of q_len x k_len: int32 (batch or 1,
        cdiv(q_len, GROUP), 2) and (batch or 1, cdiv(k_len, GROUP), 2), see the module's
        docstring; the union over heads (a mod's bounds do not see the head)."""
        hit = self._bounds.get((q_len, k_len))
        if hit is None:
            seen = _read_once(self._int8, (0, 1))   # a broadcast batch or head dim
            seen = (seen.amax(1) if seen.shape[1] > 1 else seen[:, 0]).expand(
                -1, q_len, k_len)
            hit = self._bounds[(q_len, k_len)] = (
                _spans(_groups_seen(seen, 1)), _spans(_groups_seen(seen, 2).transpose(1, 2)))
        return hit

    def aux(self, batch, heads_q, q_len, k_len):
        """TENSOR_MASK's ``mod_aux`` for a call of (batch, heads_q, q_len, k_len), a shape the
        mask broadcasts to (checked by the caller)."""
        if self._int8.stride(-1) != 1 and self._int8.shape[-1] > 1:
            self._int8 = self._int8.contiguous()   # the kernels read unit-stride keys
        m, ints, dtype = _offset_ints(self._int8, (batch, heads_q, q_len, k_len))
        key_bounds, query_bounds = self.bounds(q_len, k_len)
        ints = aux_ints((*ints, *_bounds_strides(key_bounds, query_bounds)), m.device, dtype)
        return (m, ints, key_bounds, query_bounds)

    def __repr__(self):
        return f"TensorMask(shape={self.shape}, device={self.device})"
