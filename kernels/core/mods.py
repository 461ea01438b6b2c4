"""Score and mask modifications: the one extension point of the score pipeline.

A modification is a pair of functions, one for the Triton kernels and its PyTorch twin for the
CPU fallback (and for anyone checking the kernels against plain PyTorch), in the spirit of
FlexAttention's ``score_mod`` / ``mask_mod`` but passed to the kernels as ``@triton.jit``
functions: no ``torch.compile`` is involved, new shapes do not recompile (a new *function*
compiles once, as any new constexpr does), and dropout and the deterministic backward work
with them.

The contract
------------
``ScoreMod(name, fn, torch_fn, grad=None)`` changes the scaled score ``s = softmax_scale · q·k``
of every (query, key) pair before masking and the softmax::

    fn(s, b, h, q_idx, kv_idx, aux) -> s'          (@triton.jit)
    grad(ds, s, b, h, q_idx, kv_idx, aux) -> ds · ∂s'/∂s     (@triton.jit; None: ∂s'/∂s = 1)
    torch_fn(s, b, h, q_idx, kv_idx, aux) -> s'    (PyTorch, differentiable in s)

* ``s``: an fp32 tile of scores (the kernels' orientation: (queries, keys) in the forward and
  dQ kernels, (keys, queries) in the dK/dV kernel -- write the function elementwise, with
  broadcasting, and it works in both).
* ``b``: the batch entry (or packed sequence) index, a scalar. ``h``: the query head, a scalar
  or a tensor broadcastable against ``s``. ``q_idx``: the query's position on the key axis,
  ``i + k_len - q_len`` (bottom-right alignment, so ``q_idx == kv_idx`` is the causal diagonal
  whatever the lengths), ``kv_idx``: the key's index; int32 tensors broadcastable against ``s``.
  With packed sequences both count from the start of the sequence.
* ``aux``: the call's ``mod_aux`` tuple (tensors, received as pointers in Triton), the same
  for every mod of the call; a mod may read it (``tl.load``) and must not write it.
* ``grad`` gets the mod's *input* ``s`` and the gradient ``ds`` of its output and returns the
  gradient of its input: the chain rule of the backward (kernels/core/score.py). A mod whose
  derivative is 1 (an additive bias) leaves it None. Gradients flow into ``aux`` only
  through ``aux_grad`` (below).
* ``torch_fn`` gets PyTorch tensors: ``s`` of shape (batch, heads, rows, keys) (or a block of
  it), ``b``, ``h``, ``q_idx``, ``kv_idx`` int64 tensors broadcastable against it. The
  fallback differentiates it with autograd (in ``s``, and in the ``grad_aux`` entries).

Differentiable aux (a learned bias table, per-head slopes; FlexAttention's captured buffers):
``ScoreMod(..., aux_grad=fn, grad_aux=(i, ...))`` declares the entries ``aux[i]`` that get a
gradient and a @triton.jit function that accumulates it::

    aux_grad(ds, s, b, h, q_idx, kv_idx, aux, daux)  -> None

* ``ds``: fp32 (BLOCK_M, BLOCK_N), the gradient of the loss with respect to the mod's *output*
  s' (already chained back through any mod that comes after it -- none today: the user's mod
  is the pipeline's last); ``s``: the mod's input, as ``grad`` gets it. Always (queries, keys)
  orientation, ``h`` a scalar: it runs in the dQ kernel only, whose programs visit each
  (query block, key tile) pair exactly once.
* ``daux``: a tuple parallel to ``aux``: for each ``grad_aux`` entry an fp32 gradient buffer
  with that entry's shape and strides (zeros on entry; a scratch one when that entry needs no
  gradient in the call), other entries a 1-element dummy.
  The function adds ``Σ ds · ∂s'/∂aux[i]`` into it, typically with ``tl.atomic_add`` at the
  addresses ``fn`` reads (reduce within the tile first where many scores share one entry,
  e.g. ``tl.sum`` for a per-head slope). ``ds`` is 0 at invisible pairs and padding rows and
  columns, but the function runs on the whole tile: its addresses must stay in bounds there,
  as ``fn``'s loads must.
* Atomics make the order of the summation, hence the last bits of ``d(aux)``, vary from run to
  run (as FlexAttention's); dQ, dK, dV stay bit-reproducible. The kernels compile this in only
  when an entry of ``grad_aux`` requires grad in the call: the plain backward is unchanged.
* Differentiable entries must be float32, contiguous, on q's device (checked per call).

``MaskMod(name, fn, torch_fn, kv_range=None, q_range=None)`` hides (query, key) pairs on top of
the built-in rules (causal, window, chunk): ``fn(b, h, q_idx, kv_idx, aux) -> bool`` (True =
visible), same arguments as above. Rows that a mask leaves without any key give zeros (lse
-inf), as always. A call with a mask mod has no unmasked fast path: every tile a kernel visits
applies it.

Which tiles a mask mod skips: the kernels always skip the tiles the built-in rules hide. A mask
mod may also bound its own pattern with two @triton.jit functions, given together:

    kv_range(b, q_lo, q_hi, aux) -> (kv_lo, kv_hi)   queries at positions [q_lo, q_hi) see keys
                                                      in [kv_lo, kv_hi) only
    q_range(b, kv_lo, kv_hi, aux) -> (q_lo, q_hi)     keys [kv_lo, kv_hi) are seen by query
                                                      positions in [q_lo, q_hi) only

(int32 scalars; positions on the key axis as ``q_idx``; any superset is correct, a range that
leaves out a visible pair is a wrong answer). The forward and dQ kernels then visit only the key
tiles in [kv_lo, kv_hi) of each query block and the dK/dV kernel only the query tiles in
[q_lo, q_hi) of each key block: a document mask or a prefix-LM pattern costs what it sees. The
PyTorch fallback applies the mask to whole blocks and does not use the bounds.

Built-in mods (``SOFTCAP``, ``ALIBI``) are ScoreMods written against the same contract, each
with its own ``aux`` (the cap and 2 log2(e) / cap; the slopes and their batch stride) instead of
the call's ``mod_aux``: ``CallMods.score_mods`` lists a call's mods in their fixed order --
soft-capping, then ALiBi's bias, then the user's mod.

Every mod has a unique ``name``: the custom ops (kernels/ops.py) carry mods by name, so
``torch.compile`` sees a string, not a function. Creating a second mod with a name already
taken by another object is an error.
"""
import functools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .common import LOG2E

_LOG2E = tl.constexpr(LOG2E)
_REGISTRY: dict = {}


def _register(mod):
    other = _REGISTRY.get(mod.name)
    if other is not None and other is not mod:
        raise ValueError(f"a modification named {mod.name!r} already exists ({other!r}); "
                         f"give each ScoreMod / MaskMod its own name")
    _REGISTRY[mod.name] = mod


# What ``@triton.jit`` returns: a JITFunction, or under TRITON_INTERPRET=1 an InterpretedFunction.
def _jit_types():
    from triton.runtime import interpreter, jit
    return tuple(t for t in (getattr(jit, "JITFunction", None),
                             getattr(interpreter, "InterpretedFunction", None)) if t is not None)


_JIT_TYPES = _jit_types()


def _check_jit(what, fn, optional=False):
    if fn is None and optional:
        return
    if not isinstance(fn, _JIT_TYPES):
        raise TypeError(f"{what} must be a @triton.jit function, got {type(fn).__name__}")


@dataclass(frozen=True, eq=False)
class ScoreMod:
    """A score modification (see the module docstring for the contract)."""
    name: str
    fn: object                      # @triton.jit (s, b, h, q_idx, kv_idx, aux) -> s'
    torch_fn: Callable              # PyTorch twin, differentiable in s
    grad: Optional[object] = None   # @triton.jit (ds, s, b, h, q_idx, kv_idx, aux); None: 1
    # @triton.jit (ds, s, b, h, q_idx, kv_idx, aux, daux): accumulates d(aux[i]) into daux[i]
    aux_grad: Optional[object] = None
    grad_aux: tuple = ()            # indices of the aux entries that aux_grad differentiates

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"ScoreMod name must be a non-empty str, got {self.name!r}")
        _check_jit("ScoreMod.fn", self.fn)
        _check_jit("ScoreMod.grad", self.grad, optional=True)
        _check_jit("ScoreMod.aux_grad", self.aux_grad, optional=True)
        if not isinstance(self.grad_aux, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0
                for i in self.grad_aux) or len(set(self.grad_aux)) != len(self.grad_aux):
            raise TypeError(f"ScoreMod.grad_aux must be a tuple of distinct indices >= 0 into "
                            f"mod_aux, got {self.grad_aux!r}")
        if (self.aux_grad is None) != (not self.grad_aux):
            raise ValueError("ScoreMod.aux_grad and grad_aux come together: the function that "
                             "accumulates the gradients and the aux entries it differentiates "
                             f"(got aux_grad={self.aux_grad!r}, grad_aux={self.grad_aux!r})")
        if not callable(self.torch_fn):
            raise TypeError(f"ScoreMod.torch_fn must be callable, got {self.torch_fn!r}")
        _register(self)


@dataclass(frozen=True, eq=False)
class MaskMod:
    """A mask modification (see the module docstring for the contract)."""
    name: str
    fn: object                      # @triton.jit (b, h, q_idx, kv_idx, aux) -> bool
    torch_fn: Callable              # PyTorch twin -> bool tensor
    kv_range: Optional[object] = None   # @triton.jit (b, q_lo, q_hi, aux) -> (kv_lo, kv_hi)
    q_range: Optional[object] = None    # @triton.jit (b, kv_lo, kv_hi, aux) -> (q_lo, q_hi)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"MaskMod name must be a non-empty str, got {self.name!r}")
        _check_jit("MaskMod.fn", self.fn)
        _check_jit("MaskMod.kv_range", self.kv_range, optional=True)
        _check_jit("MaskMod.q_range", self.q_range, optional=True)
        if (self.kv_range is None) != (self.q_range is None):
            raise ValueError("MaskMod.kv_range and q_range bound the same pattern from both "
                             "sides (forward / dQ and dK/dV kernels): give both or neither")
        if not callable(self.torch_fn):
            raise TypeError(f"MaskMod.torch_fn must be callable, got {self.torch_fn!r}")
        _register(self)


def aux_ints(values, device, dtype=torch.int32):
    """A mod's int aux tensor (int32, or ``dtype``) holding ``values`` (a tuple of ints: a
    window's reach, a mask's sizes) on ``device``: made once per values and device in eager
    calls (no host-to-device copy per call; the kernels only read it), a constant of the graph
    under torch.compile."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    return _cached_ints(tuple(values), device, dtype)


@functools.lru_cache(maxsize=64)
def _cached_ints(values, device, dtype):
    return torch.tensor(values, dtype=dtype, device=device)


def lookup(name: str, kind):
    """The registered ScoreMod / MaskMod called ``name`` ("" -> None)."""
    if not name:
        return None
    mod = _REGISTRY.get(name)
    if not isinstance(mod, kind):
        raise ValueError(f"no {kind.__name__} named {name!r} exists in this process")
    return mod


# ------------------------------------------------------------------------- built-in: softcap
# cap · tanh(s / cap) = cap - 2 cap / (exp(2 s / cap) + 1): one MUFU.EX2 and one MUFU.RCP per
# score, with the constants folded on the host (aux = (cap, 2 log2(e) / cap)) and an
# approximate division (div.full.f32, 2 ulp: no IEEE range fix-ups). Exact at +-inf scores
# (exp2 -> inf or 0). A first version, 1 - 2 / (exp2(2 x log2 e) + 1) with IEEE divisions,
# cost ~13 instructions per score (docs/gpu.md, "Per-tile cost of the score mods").
@triton.jit
def _softcap_recip(s, aux):
    """1 / (exp(2 s / cap) + 1)."""
    return tl.fdiv(1.0, tl.exp2(s * aux[1]) + 1.0, ieee_rounding=False)


@triton.jit
def _softcap_fn(s, b, h, q_idx, kv_idx, aux):
    cap = aux[0]
    return cap - 2.0 * cap * _softcap_recip(s, aux)


@triton.jit
def _softcap_grad(ds, s, b, h, q_idx, kv_idx, aux):
    # d/ds cap · tanh(s / cap) = 1 - tanh², tanh = 1 - 2 r.
    t = 1.0 - 2.0 * _softcap_recip(s, aux)
    return ds * (1.0 - t * t)


def _softcap_torch(s, b, h, q_idx, kv_idx, aux):
    return aux[0] * torch.tanh(s / aux[0])


def softcap_aux(cap: float) -> tuple:
    """The built-in soft-capping mod's aux: (cap, 2 log2(e) / cap)."""
    return (float(cap), 2.0 * LOG2E / float(cap))


SOFTCAP = ScoreMod("softcap", _softcap_fn, _softcap_torch, _softcap_grad)


# fp32 inputs with IEEE dots (``call.score_spec``): the form above loses cap x eps absolutely
# (1 - 2 r cancels near s = 0), which PyTorch's cap * tanh(s / cap) does not: at cap 50 the
# output missed the fp32 parity budget by 2x, lse by up to 27x (cap 20). Here tanh keeps a
# few ulps of relative accuracy: its odd Taylor series up to x^17 below |x| = 1/2 (truncation
# 1e-9 relative there), 1 - 2 / (exp(2x) + 1) with an IEEE division above (no cancellation
# left: tanh > 0.46). About 15 more instructions per score than SOFTCAP, beside the 2 x
# head_dim FMAs of an fp32 IEEE dot per score.
_TANH_SERIES_MAX = tl.constexpr(0.5)
_T3, _T5, _T7 = (tl.constexpr(c) for c in (-1.0 / 3.0, 2.0 / 15.0, -17.0 / 315.0))
_T9, _T11, _T13 = (tl.constexpr(c) for c in (62.0 / 2835.0, -1382.0 / 155925.0,
                                             21844.0 / 6081075.0))
_T15, _T17 = (tl.constexpr(c) for c in (-929569.0 / 638512875.0, 6404582.0 / 10854718875.0))


@triton.jit
def _tanh_exact(x):
    x2 = x * x
    p = _T15 + x2 * _T17
    p = _T13 + x2 * p
    p = _T11 + x2 * p
    p = _T9 + x2 * p
    p = _T7 + x2 * p
    p = _T5 + x2 * p
    p = _T3 + x2 * p
    series = x + x * (x2 * p)
    formula = 1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)
    return tl.where(tl.abs(x) < _TANH_SERIES_MAX, series, formula)


@triton.jit
def _softcap_exact_fn(s, b, h, q_idx, kv_idx, aux):
    return aux[0] * _tanh_exact(s / aux[0])


@triton.jit
def _softcap_exact_grad(ds, s, b, h, q_idx, kv_idx, aux):
    t = _tanh_exact(s / aux[0])
    return ds * (1.0 - t * t)


# --------------------------------------------------------------------------- built-in: ALiBi
@triton.jit
def _alibi_fn(s, b, h, q_idx, kv_idx, aux):
    # aux = (slopes, batch stride): slope of (b, h) at slopes[b * stride + h].
    slope = tl.load(aux[0] + b * aux[1] + h)
    dist = q_idx - kv_idx
    return s - slope * tl.where(dist < 0, -dist, dist).to(tl.float32)


def _alibi_torch(s, b, h, q_idx, kv_idx, aux):
    slopes, stride_b = aux
    slope = slopes.reshape(-1)[b * stride_b + h].to(s.dtype)
    return s - slope * (q_idx - kv_idx).abs().to(s.dtype)


ALIBI = ScoreMod("alibi", _alibi_fn, _alibi_torch)


# --------------------------------------------------------------------------- a call's mods
class Descale(NamedTuple):
    """FP8 descales of one call (FlashAttention-3's ``q_descale`` / ``k_descale`` /
    ``v_descale``): each None (= 1) or an fp32 tensor of shape (B, heads_kv) -- B the batch, or
    the number of packed sequences -- with any strides (a per-tensor scale is a stride-0
    expanded view). The true value of an FP8 element of q (or k, v) of batch entry b and kv
    head kv_h (query head h reads kv_h = h // group) is ``x * descale[b, kv_h]``. An FP8 KV
    cache with fp16 / bf16 queries has q None (kernels/core/fp8.py)."""
    q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None


class ModFns(NamedTuple):
    """The kernels' view of one score mod (part of the ``ScoreSpec`` constexpr)."""
    fn: object
    grad: object
    aux_grad: object = None   # set only in the dQ launch of a backward that needs d(aux)


SOFTCAP_EXACT = ModFns(_softcap_exact_fn, _softcap_exact_grad)   # SOFTCAP's fp32 twin


@dataclass(frozen=True)
class CallMods:
    """The modifications of one call: soft-capping, ALiBi slopes, a user score mod and mask
    mod, sinks, and the user's aux tensors. Tensors live here, not in ``AttentionCall``."""
    softcap: Optional[float] = None
    alibi_slopes: Optional[torch.Tensor] = None   # fp32 (heads_q,) or (batch, heads_q)
    score_mod: Optional[ScoreMod] = None
    mask_mod: Optional[MaskMod] = None
    sinks: Optional[torch.Tensor] = None          # fp32 (heads_q,)
    aux: tuple = field(default=())
    descale: Optional[Descale] = None             # FP8 descales (forward only)

    @property
    def any(self) -> bool:
        return any(x is not None for x in (self.softcap, self.alibi_slopes, self.score_mod,
                                           self.mask_mod, self.sinks))

    @property
    def has_tensors(self) -> bool:
        """Whether the call carries tensors (ALiBi slopes, sinks, aux) that a launch plan
        must take per call rather than once."""
        return (self.alibi_slopes is not None or self.sinks is not None or bool(self.aux)
                or self.descale is not None)

    def score_mods(self):
        """[(ScoreMod, its aux)] in the pipeline's order: softcap, ALiBi, the user's."""
        mods = []
        if self.softcap is not None:
            mods.append((SOFTCAP, softcap_aux(self.softcap)))
        if self.alibi_slopes is not None:
            a = self.alibi_slopes
            mods.append((ALIBI, (a, a.stride(0) if a.dim() == 2 else 0)))
        if self.score_mod is not None:
            mods.append((self.score_mod, tuple(self.aux)))
        return mods


NO_MODS = CallMods()


def aux_grad_mask(score_mod, aux) -> tuple:
    """One bool per ``mod_aux`` entry: whether this call computes its gradient (the score mod
    declares it in ``grad_aux`` and it requires grad). Checks those entries (float32,
    contiguous: the gradient buffer shares the entry's indexing) and refuses an entry that
    requires grad without a declared gradient (it would silently get none)."""
    declared = () if score_mod is None else score_mod.grad_aux
    mask = []
    for i, t in enumerate(aux):
        wanted = isinstance(t, torch.Tensor) and t.requires_grad
        if wanted and i not in declared:
            name = "no score mod" if score_mod is None else f"ScoreMod {score_mod.name!r}"
            raise ValueError(f"mod_aux[{i}] requires grad but {name} declares no gradient for "
                             f"it (grad_aux={declared}): declare it with ScoreMod(..., "
                             f"aux_grad=..., grad_aux=({i},)) or pass it detached")
        if wanted and (t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"mod_aux[{i}] is differentiable: expected a contiguous float32 "
                             f"tensor, got {t.dtype}"
                             f"{'' if t.is_contiguous() else ', not contiguous'}")
        mask.append(wanted)
    return tuple(mask)


def aux_grad_buffers(score_mod, aux) -> list:
    """fp32 zero buffers (each entry's shape and strides) for every ``grad_aux`` entry of
    ``score_mod``, None for the others: ``aux_grad`` writes every declared entry's buffer, so
    one that needs no gradient in this call still gets one (discarded afterwards)."""
    return [torch.zeros_like(t, dtype=torch.float32) if i in score_mod.grad_aux else None
            for i, t in enumerate(aux)]


def sinks_grad(sinks, lse, do, o, packed):
    """dL/d(sinks), fp32 (heads_q,), for every path (kernels and fallback alike).

    A sink is one more softmax column with no value, so its weight in row i is
    ``exp(sink_h - lse_i)`` and its gradient ``-exp(sink_h - lse_i) · delta_i`` with
    ``delta_i = Σ_d dO_id · O_id`` (the same delta as the kernels' backward; with dropout too).
    sinks (heads_q,); lse (B, heads_q, q_len) dense or (heads_q, total_q) packed; do, o shaped
    like the output: (B, heads_q, q_len, Dv) or (total_q, heads_q, Dv). Summed in a fixed
    order by PyTorch's reductions: deterministic.
    """
    delta = (do.float() * o.float()).sum(-1)
    if packed:
        delta = delta.transpose(0, 1)                  # (heads_q, total_q), lse's layout
        weight = torch.exp(sinks.float()[:, None] - lse)
        return -(weight * delta).sum(1)
    weight = torch.exp(sinks.float()[None, :, None] - lse)
    return -(weight * delta).sum((0, 2))
