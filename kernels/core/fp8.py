"""FP8 attention (forward only): the modes, the descale arguments and the in-kernel casts.

Two modes, chosen from the dtypes (``fp8_mode``; the forward kernel's FP8 constexpr):

1. q, k, v all e4m3 (FlashAttention-3's FP8 forward): S = Q Kᵀ by an fp8 x fp8 ``tl.dot``
   (fp32 accumulate), ``q_descale * k_descale`` of the program's (b, kv_h) folded into the
   score scale; P (fp32, in [0, 1] after the running max) is multiplied by P_SCALE = 2**8 and
   rounded to e4m3 for the P @ V dot, whose accumulator gets ``v_descale / P_SCALE`` once at
   the end. The row sum l_i (hence lse and the normalisation) is taken on the fp32 P, before
   the rounding: the scale never reaches it. P_SCALE is FlashAttention-3's "Max_offset": P's
   largest weight becomes 256, inside e4m3's range (448), so the small weights keep 8 more
   binary orders of magnitude above e4m3's smallest subnormal (2**-9) than P in [0, 1] would.
2. k, v e4m3 (an FP8 KV cache, dense or paged) with fp16 / bf16 q (no q descale): each K / V
   tile is upcast to q's dtype right after its load (exact: every e4m3 value is an fp16 and a
   bf16 value), ``k_descale`` folds into the score scale, ``v_descale`` multiplies the
   accumulator at the end. The append (kernels/core/kvcache.py) quantizes new fp16 / bf16
   rows into the cache: ``x / descale[b, kv_h]``, clamped to +-448, rounded to e4m3.

Descales (``mods.Descale``): fp32 (B, heads_kv) with any strides, or None (= 1); the kernels
read ``descale[b * stride0 + kv_h * stride1]``, once per program. Split-KV partials carry the
descaled values, so the merge (kernels/core/splitkv.py) needs nothing.

Triton's interpreter casts fp32 to e4m3 wrongly (with triton 3.9: a rounding that carries into
the exponent halves the value, e.g. 1.97 -> 1.0, and subnormals truncate): under the
interpreter (``Fp8Spec.interpret``) ``to_e4m3`` first rounds in fp32 (``round_e4m3``: ties to
even, saturating at +-448, as the GPU's ``cvt.rn.satfinite``), after which the cast is exact.
Its fp8 loads and fp8 x fp8 dots are right.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .call import FP8_DTYPE
from .common import interpreter_active

FP8_MAX = 448.0          # the largest finite e4m3 value
P_SCALE = 256.0          # P's scale before its e4m3 rounding (mode 1)
_FP8_MAX = tl.constexpr(FP8_MAX)
P_SCALE_C = tl.constexpr(P_SCALE)

FP8_NONE, FP8_ALL, FP8_KV = 0, 1, 2


def fp8_mode(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """FP8_ALL when q (hence k, v) is e4m3, FP8_KV for an e4m3 K / V with fp16 / bf16 q,
    FP8_NONE otherwise."""
    if q_dtype == FP8_DTYPE:
        assert kv_dtype == FP8_DTYPE, "FP8 q needs FP8 k and v"
        return FP8_ALL
    return FP8_KV if kv_dtype == FP8_DTYPE else FP8_NONE


class Fp8Spec(NamedTuple):
    """The forward's FP8 constexpr. mode: FP8_NONE / FP8_ALL / FP8_KV; interpret: casts to
    e4m3 round first (``to_e4m3``); round_out: the bf16 output is rounded before the store
    (the interpreter truncates fp32 -> bf16: ``common.round_for_store``), set where q's own
    dtype does not already say so (FP8 q with a bf16 output)."""
    mode: int = FP8_NONE
    interpret: bool = False
    round_out: bool = False


def fp8_spec(q_dtype, kv_dtype, out_dtype) -> Fp8Spec:
    mode = fp8_mode(q_dtype, kv_dtype)
    interp = interpreter_active()
    return Fp8Spec(mode=mode, interpret=interp and mode != FP8_NONE,
                   round_out=interp and mode == FP8_ALL and out_dtype == torch.bfloat16)


class DescaleArgs(NamedTuple):
    """The forward's ``fp8`` argument: the three descale pointers and their (batch, kv head)
    strides; a missing descale is a 1.0 with strides (0, 0)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_strides: tuple
    k_strides: tuple
    v_strides: tuple


def one_descale(device) -> torch.Tensor:
    """The 1.0 that stands in for a missing descale (read with strides (0, 0))."""
    return torch.ones(1, dtype=torch.float32, device=device)


def descale_args(descale, one) -> DescaleArgs:
    """``DescaleArgs`` of a ``mods.Descale`` (or None); ``one``: ``one_descale``'s tensor."""
    ptrs, strides = [], []
    for d in (descale or (None, None, None)):
        if d is None:
            ptrs.append(one)
            strides.append((0, 0))
        else:
            assert d.dtype == torch.float32 and d.dim() == 2, (d.dtype, d.shape)
            ptrs.append(d)
            strides.append((d.stride(0), d.stride(1)))
    return DescaleArgs(*ptrs, *strides)


@triton.jit
def load_descale(ptr, strides, b, kv_h):
    """descale[b, kv_h] (fp32 scalar)."""
    return tl.load(ptr + b.to(tl.int64) * strides[0] + kv_h.to(tl.int64) * strides[1])


@triton.jit
def round_e4m3(x):
    """fp32 ``x`` rounded to the nearest e4m3 value (ties to even), saturating at +-448, kept
    fp32. Normals (|x| >= 2**-6): 3 mantissa bits by integer rounding of the fp32 pattern;
    subnormals: multiples of 2**-9 by the 1.5 * 2**23 trick."""
    x = tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    sub = ((x * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def to_e4m3(x, INTERPRET: tl.constexpr):
    """fp32 ``x`` cast to e4m3 (round to nearest even, saturating); see the module docstring
    for INTERPRET."""
    if INTERPRET:
        x = round_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_e4m3(x, descale, INTERPRET: tl.constexpr):
    """``x / descale`` (IEEE-rounded division, as PyTorch's), clamped to +-448, as e4m3: the
    FP8 cache's quantization of fp16 / bf16 rows."""
    y = tl.div_rn(x.to(tl.float32), descale)
    y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
    return to_e4m3(y, INTERPRET)


@triton.jit
def p_operand(p, INTERPRET: tl.constexpr):
    """P (fp32, in [0, 1]) as the P @ V operand of mode FP8_ALL: P * P_SCALE in e4m3."""
    return to_e4m3(p * P_SCALE_C, INTERPRET)


def quantize_e4m3_torch(x: torch.Tensor, descale) -> torch.Tensor:
    """PyTorch twin of the append's quantization: x (B, H_kv, n, D) fp16 / bf16 -> e4m3
    ``x / descale[b, kv_h]`` clamped to +-448 (descale None: 1)."""
    y = x.float()
    if descale is not None:
        y = y / descale.float()[:, :, None, None]
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
