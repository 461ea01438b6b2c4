"""Argument checks of the public functions (and of the integrations' entry points).

Validation happens at the public boundary only, once per call; the launchers below it assert
their invariants. Every error names the argument, what was expected and what was given.
"""
import math
import numbers

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .core.call import FP8_DTYPE   # FP8 attention (forward only) takes OCP e4m3 alone
from .core.common import MAX_HEAD_DIM, MAX_HEAD_DIM_LATENT
from .core.kvcache import v_is_k_prefix
from .core.mods import CallMods, MaskMod, ScoreMod
from .core import tensor_mask
from .core.tensor_mask import (BIAS_BOUNDS, TENSOR_BIAS, TENSOR_MASK, TensorMask, as_4d,
                               bias_aux)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OTHER_FP8 = tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz",
                                                "float8_e5m2fnuz") if hasattr(torch, n))
# What an FP8 call may return: FlashAttention-3's bf16 (the default), or fp16 on request.
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)
# Seeds are 64-bit Philox keys; keep them non-negative so they round-trip through int64.
SEED_LIMIT = 2 ** 63
# Triton's grid dimensions 1 and 2 (heads, batch) are limited to 65535 programs.
MAX_GRID_YZ = 65535
_MAX_INT32 = 2 ** 31 - 1


def check_tensor(name, t, dims, layout):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {layout}, got {t.dim()}-D tensor of shape "
                         f"{tuple(t.shape)}")
    if t.dtype not in _DTYPES and t.dtype != FP8_DTYPE:
        if t.dtype in _OTHER_FP8:
            raise TypeError(f"{name}: FP8 inputs and caches must be torch.float8_e4m3fn (OCP "
                            f"e4m3, FlashAttention-3's format), got {t.dtype}")
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float8_e4m3fn, got "
                        f"{t.dtype}")
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name} must be on a CUDA device (or the CPU for the interpreter / "
                         f"PyTorch fallback), got device {t.device}")


def as_bool(name, value):
    """``value`` as a Python bool: bool and numpy.bool_ are accepted, nothing else."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {kind.__module__}.{kind.__qualname__}"
                    if kind.__module__ != "builtins" else
                    f"{name} must be a bool, got {kind.__name__}")


def validate_attention(q, k, v, causal, dropout_p, softmax_scale, seed, window, *, dims=4,
                       layout="(batch, heads, seq_len, head_dim)", head_axis=1,
                       fp8_cache=False, max_head_dim=MAX_HEAD_DIM):
    """Checks shared by ``attention`` and ``attention_varlen``; returns causal as a bool.
    ``fp8_cache``: k and v may be an FP8 cache read by q of another dtype (``check_fp8``).
    ``max_head_dim``: q's and k's limit (the cache paths take MLA's 576; v's is 512)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dims, layout)
    if fp8_cache and k.dtype == v.dtype == FP8_DTYPE:
        pass
    elif not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, "
                         f"v {v.device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape {layout} but for head_dim (v may "
                         f"have its own), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if dims == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch (dim 0), got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim (last dim), got q "
                         f"{tuple(q.shape)} and k {tuple(k.shape)}")
    heads_q, heads_kv = q.shape[head_axis], k.shape[head_axis]
    # heads_q = 0 is an empty problem (empty results, zero gradients for k and v), like
    # batch = 0 or q_len = 0; query heads without any key/value head to read are an error.
    if heads_kv == 0 and heads_q != 0:
        raise ValueError(f"k and v have no heads (heads_kv=0, k {tuple(k.shape)}) but q has "
                         f"heads_q={heads_q} (q {tuple(q.shape)}): each query head reads one "
                         f"key/value head, so heads_kv must be >= 1 when heads_q >= 1")
    if heads_kv != 0 and heads_q % heads_kv != 0:
        raise ValueError(f"the query heads must be a multiple of the key/value heads "
                         f"(grouped-query attention), got heads_q={heads_q} (q "
                         f"{tuple(q.shape)}) and heads_kv={heads_kv} (k {tuple(k.shape)})")
    for name, head_dim, limit in (("head_dim", q.shape[-1], max_head_dim),
                                  ("v's head_dim", v.shape[-1], MAX_HEAD_DIM)):
        if head_dim < 1:
            raise ValueError(f"{name} must be >= 1, got {head_dim}")
        if head_dim > limit:
            where = "" if limit > MAX_HEAD_DIM or name != "head_dim" else (
                f" here ({MAX_HEAD_DIM_LATENT}, MLA's latent width, is taken by "
                f"attention_with_kvcache and attention_varlen over a paged cache: forward only)")
            raise NotImplementedError(f"{name} up to {limit} is supported{where}, got "
                                      f"{head_dim}")
    if heads_q > MAX_GRID_YZ or dims == 4 and q.shape[0] > MAX_GRID_YZ:
        raise NotImplementedError(f"batch and heads must each be <= {MAX_GRID_YZ} (Triton grid "
                                  f"limit), got q {tuple(q.shape)}")
    causal = as_bool("causal", causal)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not (0.0 <= dropout_p < 1.0):  # also rejects NaN
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a positive float or None, got "
                            f"{type(softmax_scale).__name__}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if seed is not None:
        check_seed(seed)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(f"window must be an int >= 1 or None, got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"window must be >= 1 (the number of most recent keys a query "
                             f"sees, itself included), got {window}")
        if not causal:
            raise ValueError("window requires causal=True (a sliding window looks back from "
                             "each query's diagonal), got causal=False")
        if window > _MAX_INT32:
            raise ValueError(f"window must be < 2**31, got {window}")
    return causal


def check_seed(seed):
    """A dropout seed given by the caller: an int in [0, 2**63)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int in [0, 2**63) or None, got "
                        f"{type(seed).__name__}")
    if not (0 <= seed < SEED_LIMIT):
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")


def _check_positive_int(name, value, meaning):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1 or None, got {type(value).__name__}")
    if not (1 <= value <= _MAX_INT32):
        raise ValueError(f"{name} must be in [1, 2**31) ({meaning}), got {value}")


def _check_head_vector(name, t, q, heads_q, shapes):
    """A float tensor of one of ``shapes`` on q's device (sinks, ALiBi slopes)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (float32 preferred), got "
                        f"{t.dtype}")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(str(x) for x in shapes)} "
                         f"(heads_q = {heads_q}), got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")


_DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def check_fp8(q_dtype, kv_dtype, descale, out_dtype, rows, heads_kv, device, dropout_p=0.0):
    """FP8 checks of a call whose q has ``q_dtype`` and k / v (or the caches) ``kv_dtype``.

    FP8 calls: q, k, v all float8_e4m3fn (FlashAttention-3's FP8 forward), or float8_e4m3fn
    k / v (an FP8 KV cache) with float16 / bfloat16 q. ``descale``: None, or (q_descale,
    k_descale, v_descale), each None (= 1) or a float32 tensor (``rows``, heads_kv) on
    ``device`` (rows: the batch, or the number of packed sequences), any strides (a per-tensor
    scale expanded to that shape is read in place); q_descale only with FP8 q. ``out_dtype``:
    None (FP8 q: bfloat16; else q's dtype), bfloat16 or float16 for FP8 q.
    Returns (descale or None, out_dtype or None)."""
    if kv_dtype != FP8_DTYPE:
        if q_dtype == FP8_DTYPE:
            raise TypeError(f"FP8 q needs FP8 (float8_e4m3fn) k and v, got q {q_dtype}, k / v "
                            f"{kv_dtype}")
        for name, t in zip(_DESCALE_NAMES, descale or ()):
            if t is not None:
                raise ValueError(f"{name} applies to FP8 (float8_e4m3fn) inputs, got q "
                                 f"{q_dtype} and k / v {kv_dtype}")
        if out_dtype is not None and out_dtype != q_dtype:
            raise ValueError(f"out_dtype applies to FP8 (float8_e4m3fn) q; for q {q_dtype} "
                             f"the output has q's dtype, got out_dtype={out_dtype}")
        return None, None
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout with FP8 inputs is not supported (FP8 attention is "
                                  f"forward-only inference, as FlashAttention-3's), got "
                                  f"dropout_p={dropout_p}")
    if q_dtype == FP8_DTYPE:
        out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
        if out_dtype not in FP8_OUT_DTYPES:
            raise ValueError(f"out_dtype of an FP8 call must be torch.bfloat16 (the default) or "
                             f"torch.float16, got {out_dtype}")
    else:
        if q_dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"an FP8 (float8_e4m3fn) KV cache takes float16 or bfloat16 q (or "
                            f"FP8 q), got q {q_dtype}")
        if out_dtype is not None and out_dtype != q_dtype:
            raise ValueError(f"with {q_dtype} q the output has q's dtype, got "
                             f"out_dtype={out_dtype}")
        out_dtype = None
        if descale is not None and descale[0] is not None:
            raise ValueError(f"q_descale applies to FP8 q; q is {q_dtype} (its FP8 cache's "
                             f"scales are k_descale / v_descale)")
    if descale is None or all(t is None for t in descale):
        return None, out_dtype
    for name, t in zip(_DESCALE_NAMES, descale):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a float32 tensor ({rows}, {heads_kv}) = "
                            f"(batch, heads_kv), got {type(t).__name__}")
        if t.dtype != torch.float32 or tuple(t.shape) != (rows, heads_kv):
            raise ValueError(f"{name} must be float32 of shape (batch, heads_kv) = "
                             f"({rows}, {heads_kv}), got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
        if t.requires_grad:
            raise ValueError(f"{name} requires grad, but FP8 attention is forward-only: pass "
                             f"it detached")
    return descale, out_dtype


def expand_scale(name, scale, descale, q, k_cache, block_table):
    """A per-tensor FP8 cache scale (``k_scale`` / ``v_scale``: a float or a one-element
    float32 tensor) as a (batch, heads_kv) view for the kernels; ``descale`` (the same scale
    per (batch, head)) must then be None. The cache's shape is checked later."""
    if scale is None:
        return descale
    if descale is not None:
        raise ValueError(f"{name} (per tensor) and {name[0]}_descale (per (batch, head)) are "
                         f"two forms of one scale: pass one of them")
    rows = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 4 else 1
    heads_kv = (k_cache.shape[2 if block_table is not None else 1]
                if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4 else 1)
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"{name} must be a float or a one-element float32 tensor, got "
                             f"{scale.dtype} {tuple(scale.shape)}")
        return scale.reshape(1, 1).expand(rows, heads_kv)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) \
            or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be a finite float > 0 or a one-element float32 tensor, "
                         f"got {scale!r}")
    return torch.full((1, 1), float(scale), device=q.device).expand(rows, heads_kv)


def check_mods(q, causal, window, softcap, sinks, chunk_size, alibi_slopes, score_mod, mask_mod,
               mod_aux, *, batch, head_axis=1):
    """Checks of the score modifications (``softcap``, ``sinks``, ``chunk_size``,
    ``alibi_slopes``, ``score_mod``, ``mask_mod``, ``mod_aux``) shared by every entry point;
    ``batch``: the batch size (dense) or the number of packed sequences (ALiBi's per-batch
    slopes). Returns the ``CallMods`` of the call (kernels/core/mods.py) and the chunk size."""
    heads_q = q.shape[head_axis]
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap must be a positive float or None, got "
                            f"{type(softcap).__name__}")
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be finite and > 0 (s = softcap * tanh(s / "
                             f"softcap)), got {softcap}")
        softcap = float(softcap)
    if chunk_size is not None:
        _check_positive_int("chunk_size", chunk_size, "positions per chunk")
        if not causal:
            raise ValueError("chunk_size requires causal=True (chunked attention is causal "
                             "within each chunk), got causal=False")
        if window is not None:
            raise ValueError(f"chunk_size and window cannot be combined (both bound what a "
                             f"query sees from the left), got chunk_size={chunk_size}, "
                             f"window={window}")
        chunk_size = int(chunk_size)
    if sinks is not None:
        _check_head_vector("sinks", sinks, q, heads_q, [(heads_q,)])
        sinks = sinks.float()
    if alibi_slopes is not None:
        _check_head_vector("alibi_slopes", alibi_slopes, q, heads_q,
                           [(heads_q,), (batch, heads_q)])
        if alibi_slopes.requires_grad:
            raise ValueError("alibi_slopes must not require grad (the kernels give no gradient "
                             "for them)")
        alibi_slopes = alibi_slopes.float().contiguous()
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise TypeError(f"score_mod must be a kernels.ScoreMod or None, got "
                        f"{type(score_mod).__name__}")
    if mask_mod is not None and not isinstance(mask_mod, MaskMod):
        raise TypeError(f"mask_mod must be a kernels.MaskMod or None, got "
                        f"{type(mask_mod).__name__}")
    if not isinstance(mod_aux, (tuple, list)):
        raise TypeError(f"mod_aux must be a tuple of tensors, got {type(mod_aux).__name__}")
    for i, t in enumerate(mod_aux):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mod_aux[{i}] must be a torch.Tensor (the mods read it through a "
                            f"pointer), got {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"mod_aux[{i}] must be on q's device {q.device}, got {t.device}")
    if mod_aux and score_mod is None and mask_mod is None:
        raise ValueError("mod_aux is given but there is no score_mod or mask_mod to read it")
    mods = CallMods(softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod,
                    mask_mod=mask_mod, sinks=sinks, aux=tuple(mod_aux))
    return mods, chunk_size


def check_attn_mask(attn_mask, q, k, score_mod, mask_mod, mod_aux):
    """``attention``'s ``attn_mask`` as the call's mods: (score_mod, mask_mod, mod_aux). A
    boolean mask (a bool tensor or a ``TensorMask``) takes the mask mod's place (TENSOR_MASK),
    an additive float one the score mod's (TENSOR_BIAS), and, without a mask mod, for calls of
    at least ``tensor_mask.BIAS_BOUNDS_MIN_PAIRS`` pairs per head, the mask mod's as well
    (BIAS_BOUNDS: the tile bounds of its entries above -inf); neither is combined with a mod
    in its place nor with ``mod_aux`` (whose indices the mods read)."""
    bias = isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point()
    taken = score_mod if bias else mask_mod
    if taken is not None or mod_aux:
        kind = "an additive float" if bias else "a boolean"
        place = "score_mod" if bias else "mask_mod"
        raise ValueError(f"attn_mask ({kind} mask, read through a {place} of its own) cannot "
                         f"be combined with {place} or mod_aux: fold it into your mod")
    if bias:
        if attn_mask.dim() not in (2, 3, 4):
            raise ValueError(f"attn_mask must have 2 to 4 dims, broadcastable to (batch, "
                             f"heads_q, q_len, k_len), got shape {tuple(attn_mask.shape)}")
        shape, device = tuple(as_4d(attn_mask).shape), attn_mask.device
    else:
        mask = attn_mask if isinstance(attn_mask, TensorMask) else TensorMask.of(attn_mask)
        shape, device = mask.shape, mask.device
    if not (isinstance(q, torch.Tensor) and q.dim() == 4 and isinstance(k, torch.Tensor)
            and k.dim() == 4):
        # validate_attention says what is wrong with q / k
        return (TENSOR_BIAS, mask_mod, ()) if bias else (score_mod, TENSOR_MASK, ())
    if device != q.device:
        raise ValueError(f"attn_mask must be on q's device {q.device}, got {device}")
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if any(m not in (1, t) for m, t in zip(shape, target)):
        raise ValueError(f"attn_mask of shape {shape} does not broadcast to (batch, heads_q, "
                         f"q_len, k_len) = {target}")
    # The other place keeps the caller's mod (one without aux: refused above); an additive
    # mask takes the free mask mod place for its tile bounds, where they can pay.
    if bias:
        bounded = mask_mod is None and target[2] * target[3] >= tensor_mask.BIAS_BOUNDS_MIN_PAIRS
        return (TENSOR_BIAS, BIAS_BOUNDS if bounded else mask_mod,
                bias_aux(attn_mask, target, bounds=bounded))
    return score_mod, TENSOR_MASK, mask.aux(*target)


def check_values_in_keys(k_cache, v_cache, offset, v, v_scales):
    """A v_cache that starts inside k_cache's first row (``offset``: its first element's byte
    offset there, >= 0): legal only as ``k_cache[..., :Dv]`` (MLA's latent cache, whose values
    are the keys' first Dv columns), which takes no new v of its own (writing k writes them)
    and no scale of its own (``v_scales``: the call's v_scale / v_descale, each None or
    given): its entries are the keys', read with k's."""
    width = v_cache.shape[-1]
    if offset > 0:
        raise ValueError(f"v_cache is a column slice of k_cache starting at column "
                         f"{offset // k_cache.element_size()}: values stored inside the keys' "
                         f"rows must be their first head_dim_v columns (v_cache = "
                         f"k_cache[..., :{width}], as MLA's latent cache), got a slice at "
                         f"columns {offset // k_cache.element_size()}..")
    if not v_is_k_prefix(k_cache, v_cache):   # (the kernels' own rule for reading V in K)
        raise ValueError(f"v_cache starts where k_cache does, so it must be k_cache's first "
                         f"head_dim_v columns, k_cache[..., :Dv] (shape "
                         f"{(*k_cache.shape[:-1], 'Dv')}, strides {k_cache.stride()}, "
                         f"{k_cache.dtype}), got {tuple(v_cache.shape)} with strides "
                         f"{v_cache.stride()}, {v_cache.dtype}")
    if v is not None:
        raise ValueError(f"v_cache is k_cache[..., :{width}] (the values are the keys' first "
                         f"{width} columns): pass the new rows as k only (v=None): writing k "
                         f"writes their values; got a v {tuple(v.shape)}")
    if any(x is not None for x in v_scales):
        raise ValueError(f"v_cache is k_cache[..., :{width}]: its entries are the keys' and "
                         f"are read with k's scale; pass k_scale / k_descale only, got a "
                         f"v_scale / v_descale")


def check_written_in_place(name, t):
    """A tensor a call writes into (caches, ``out``): any strides but a unit one in head_dim,
    which the kernels' row stores need."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in head_dim (it is written in "
                         f"place), got strides {t.stride()}")


def check_out(out, shape, dtype, device):
    """``out=``: a tensor the call writes its result into, of the result's shape, dtype and
    device, with a unit stride in head_dim (any other strides: it is written in place)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be {tuple(shape)} {dtype} on {device} (the result's "
                         f"shape, dtype and device), got {tuple(out.shape)} {out.dtype} on "
                         f"{out.device}")
    if out.numel():
        check_written_in_place("out", out)
    if out.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("out= is for forward-only calls (serving); it cannot require grad")


def check_num_splits(num_splits):
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int >= 0 (0 = heuristic), got "
                        f"{type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 = heuristic, 1 = no split), got "
                         f"{num_splits}")


def host_readable(t) -> bool:
    """Whether reading ``t``'s values on the host costs no device sync (a CPU tensor). Index
    tensors on a GPU are read only where the caller gives no bound (``check_cu_seqlens``)."""
    return t.device.type == "cpu"


# cu_seqlens tensor -> (its version counter, its values): what ``check_cu_seqlens`` read.
_HOST_VALUES = WeakIdKeyDictionary()   # by identity: tensors' == is elementwise


def _host_values(cu):
    """``cu.tolist()`` (a small device-to-host copy: a sync on a GPU), read once per tensor
    and version: the layers of a model share their mask's cu_seqlens, so a forward pass syncs
    once per mask, not once per layer. Inference tensors (made under torch.inference_mode,
    as vLLM's metadata) have no version counter and change in place unseen: read each time."""
    if cu.is_inference():
        return cu.tolist()
    hit = _HOST_VALUES.get(cu)
    if hit is not None and hit[0] == cu._version:
        return hit[1]
    values = cu.tolist()
    _HOST_VALUES[cu] = (cu._version, values)
    return values


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k,
                     trust_hints=False):
    """Checks of the packed layout; returns the (max_seqlen_q, max_seqlen_k) to launch with,
    -1 where the op must compute it (under torch.compile, where values are not read here).
    ``trust_hints``: cu_seqlens off the host with both hints given are not read (no sync:
    FlashAttention's contract, what a serving engine's step needs); on the host they are."""
    for name, cu, x in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32 (FlashAttention's convention), got "
                            f"{cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be 1-D (num_seqs + 1,), got shape "
                             f"{tuple(cu.shape)}")
        if cu.device != x.device:
            raise ValueError(f"{name} must be on the tensors' device {x.device}, got "
                             f"{cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {cu_seqlens_q.numel() - 1} and "
                         f"{cu_seqlens_k.numel() - 1}")
    if cu_seqlens_q.numel() - 1 > MAX_GRID_YZ:
        raise NotImplementedError(f"at most {MAX_GRID_YZ} packed sequences (Triton grid "
                                  f"limit), got {cu_seqlens_q.numel() - 1}")
    hints = []
    for name, hint in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if hint is not None and (isinstance(hint, bool) or not isinstance(hint, numbers.Integral)
                                 or hint < 0):
            raise TypeError(f"{name} must be a non-negative int or None, got {hint!r}")
        hints.append(-1 if hint is None else int(hint))
    if torch.compiler.is_compiling() or (
            trust_hints and min(hints) >= 0 and not (host_readable(cu_seqlens_q)
                                                     and host_readable(cu_seqlens_k))):
        # No host sync while tracing, nor for a caller who gave its bounds for tensors on a
        # GPU: the values are the caller's contract (see the docstring).
        return tuple(hints)
    maxima = []
    for name, cu, x, hint, hint_name in (
            ("cu_seqlens_q", cu_seqlens_q, q, hints[0], "max_seqlen_q"),
            ("cu_seqlens_k", cu_seqlens_k, k, hints[1], "max_seqlen_k")):
        values = _host_values(cu)
        if values[0] != 0:
            raise ValueError(f"{name} must start at 0, got {values[0]}")
        lengths = [b - a for a, b in zip(values, values[1:])]
        if any(n < 0 for n in lengths):
            raise ValueError(f"{name} must be non-decreasing, got {values}")
        if values[-1] != x.shape[0]:
            raise ValueError(f"{name}[-1] must equal the number of packed rows "
                             f"{x.shape[0]}, got {values[-1]}")
        longest = max(lengths, default=0)
        if hint >= 0 and hint < longest:
            raise ValueError(f"{hint_name}={hint} is smaller than the longest sequence of "
                             f"{name} ({longest})")
        maxima.append(max(hint, longest))
    return tuple(maxima)


_PAGED_LAYOUT = "(num_blocks, page_size, heads_kv, head_dim) (paged: block_table is given)"


def check_block_table(block_table, q, k_cache, rows=None, rows_name="batch"):
    """A paged cache's block_table: int32 (rows, max_blocks) on q's device -- one row per batch
    entry (``rows`` None: q's batch) or per packed sequence -- and caches in the paged layout;
    returns (rows, heads_kv, capacity = max_blocks * page_size, head_dim)."""
    label = "q's batch" if rows is None else rows_name
    rows = q.shape[0] if rows is None else rows
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or \
            block_table.shape[0] != rows:
        raise ValueError(f"block_table must be int32 ({rows_name}, max_blocks) with {label} "
                         f"{rows}, got {block_table.dtype} {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table must be on q's device {q.device}, got "
                         f"{block_table.device}")
    num_blocks, page_size, heads_kv, D = k_cache.shape
    if num_blocks == 0 or page_size == 0:
        raise ValueError(f"k_cache with block_table must be {_PAGED_LAYOUT} with at least one "
                         f"page of at least one row, got {tuple(k_cache.shape)}")
    heads_q = q.shape[1]
    if (heads_kv == 0 and heads_q != 0) or (heads_kv != 0 and heads_q % heads_kv != 0):
        raise ValueError(f"k_cache with block_table must be {_PAGED_LAYOUT}: q's heads "
                         f"({heads_q}, q {tuple(q.shape)}) must be a multiple of its heads_kv "
                         f"(dim 2), got k_cache {tuple(k_cache.shape)} (a dense (batch, "
                         f"heads_kv, max_len, head_dim) cache takes no block_table)")
    return rows, heads_kv, block_table.shape[1] * page_size, D


_SLOT_LAYOUT = "(num_tokens, heads_kv, head_dim) (one row per new token)"


def check_slot_write(k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None):
    """Validation of ``write_kv_cache``: paged caches (num_blocks, page_size, heads_kv, D / Dv)
    written in place (unit stride in head_dim), new rows k (num_tokens, heads_kv, D) and v
    (num_tokens, heads_kv, Dv) in the caches' dtype (or fp16 / bf16 / fp32 into an e4m3 cache:
    quantized), integer slot_mapping (num_tokens,) on their device. Slot values are the
    caller's contract on a GPU; on the CPU they are checked."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, 4, _PAGED_LAYOUT)
        check_written_in_place(name, t)
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 3, _SLOT_LAYOUT)
    if k_cache.shape[:-1] != v_cache.shape[:-1] or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must have one dtype and one shape but for "
                         f"head_dim, got {k_cache.dtype} {tuple(k_cache.shape)} and "
                         f"{v_cache.dtype} {tuple(v_cache.shape)}")
    _, _, heads_kv, _ = k_cache.shape
    want_k = (k.shape[0], heads_kv, k_cache.shape[-1])
    want_v = (k.shape[0], heads_kv, v_cache.shape[-1])
    if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
        raise ValueError(f"k and v must be {want_k} and {want_v} for caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} {_SLOT_LAYOUT}, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != v.dtype or (k.dtype != k_cache.dtype and k_cache.dtype != FP8_DTYPE):
        raise TypeError(f"k and v must have the caches' dtype {k_cache.dtype} (or fp16 / bf16 "
                        f"/ fp32 into a float8_e4m3fn cache), got {k.dtype} and {v.dtype}")
    quantizes = k_cache.dtype == FP8_DTYPE and k.dtype != FP8_DTYPE
    if not quantizes and (k_scale is not None or v_scale is not None):
        raise ValueError(f"k_scale / v_scale quantize rows into a float8_e4m3fn cache; the "
                         f"cache is {k_cache.dtype} and the rows {k.dtype}")
    devices = {t.device for t in (k_cache, v_cache, k, v)}
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping must be a torch.Tensor, got "
                        f"{type(slot_mapping).__name__}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or \
            tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(f"slot_mapping must be int32 or int64 ({k.shape[0]},) (one slot per "
                         f"new token), got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    devices.add(slot_mapping.device)
    if len(devices) != 1:
        raise ValueError(f"k_cache, v_cache, k, v and slot_mapping must be on one device, got "
                         f"{sorted(map(str, devices))}")
    if host_readable(slot_mapping) and not torch.compiler.is_compiling() and k.shape[0]:
        capacity = k_cache.shape[0] * k_cache.shape[1]
        top = int(slot_mapping.max())
        if top >= capacity:
            raise ValueError(f"slot_mapping values must be < num_blocks * page_size = "
                             f"{capacity} (or < 0 to skip a token), got {top}")


def check_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, window,
                  num_splits, block_table=None):
    """Validation of ``attention_with_kvcache``; returns causal as a bool."""
    layout = "(batch, heads, seq, head_dim)"
    paged = block_table is not None
    check_tensor("q", q, 4, layout)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, 4, _PAGED_LAYOUT if paged else layout)
    # An FP8 cache read by fp16 / bf16 q (``check_fp8`` checks the pair).
    fp8_cache = k_cache.dtype == FP8_DTYPE and q.dtype != FP8_DTYPE
    if k_cache.shape[:-1] != v_cache.shape[:-1] or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must have one shape (but for head_dim) and "
                         f"dtype, got k_cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}, v_cache "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")
    if (k is None) != (v is None):
        raise ValueError(f"k and v must be given together (new keys and values to append), "
                         f"got k {'None' if k is None else 'a tensor'} and v "
                         f"{'None' if v is None else 'a tensor'}")
    if paged:
        B, heads_kv, max_len, D = check_block_table(block_table, q, k_cache)
    else:
        B, heads_kv, max_len, D = k_cache.shape
    q_len = q.shape[2]
    if k is not None:
        for name, t, dim in (("k", k, D), ("v", v, v_cache.shape[3])):
            check_tensor(name, t, 4, layout)
            # New rows come in the cache's dtype, or, into an FP8 cache, in q's (quantized
            # into it with k_descale / v_descale).
            new_dtype = q.dtype if fp8_cache else k_cache.dtype
            if t.shape != (B, heads_kv, q_len, dim) or t.dtype != new_dtype:
                raise ValueError(f"{name} must be (batch, heads_kv, q_len, head_dim) = "
                                 f"{(B, heads_kv, q_len, dim)} in "
                                 f"{'q' if fp8_cache else 'the cache'}'s dtype "
                                 f"{new_dtype}, got {tuple(t.shape)} {t.dtype}")
    if (q.dtype != k_cache.dtype and not fp8_cache) or q.shape[0] != B or q.shape[3] != D:
        raise ValueError(f"q must match the caches' dtype (or read an FP8 cache), batch and "
                         f"head_dim: q {tuple(q.shape)} {q.dtype}, caches "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    if paged:
        # The shared checks on (batch, heads_kv, page_size, D) views of the pages.
        k_cache_pages = num_blocks, page_size = k_cache.shape[:2]
        k_cache, v_cache = (t.transpose(1, 2)[:1].expand(B, -1, -1, -1)
                            for t in (k_cache, v_cache))
    causal = validate_attention(q, k_cache, v_cache, causal, 0.0, softmax_scale, None, window,
                                fp8_cache=fp8_cache, max_head_dim=MAX_HEAD_DIM_LATENT)
    check_num_splits(num_splits)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor, got "
                        f"{type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (B,):
        raise ValueError(f"cache_seqlens must be int32 of shape (batch,) = ({B},), got "
                         f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens must be on q's device {q.device}, got "
                         f"{cache_seqlens.device}")
    check_cache_lengths(cache_seqlens, q_len if k is not None else 0, max_len, block_table,
                        *(k_cache_pages if paged else (0, 1)))
    return causal


def check_cache_lengths(cache_seqlens, new, max_len, block_table=None, num_blocks=0,
                        page_size=1):
    """The values of a KV cache's lengths (and of the pages they use) where reading them costs
    no device sync: lengths on the host; on a GPU they are the caller's contract. ``new``: the
    positions the call appends."""
    paged = block_table is not None
    if host_readable(cache_seqlens) and not torch.compiler.is_compiling():
        # Lengths on the host: check them (no device sync needed).
        lens = cache_seqlens.tolist()
        if any(n < 0 for n in lens):
            raise ValueError(f"cache_seqlens must be >= 0, got {lens}")
        if any(n + new > max_len for n in lens):
            where = (f"the pages of block_table (max_len {max_len} = max_blocks * page_size)"
                     if paged else f"the cache (max_len {max_len})")
            raise ValueError(f"cache_seqlens + {new} new positions must fit {where}, got "
                             f"cache_seqlens {lens}")
        if paged and host_readable(block_table):
            # The pages each row reads or writes must exist (the others are never read).
            for b, n in enumerate(lens):
                used = block_table[b, :-(-(n + new) // page_size)]
                if used.numel() and (used.min() < 0 or used.max() >= num_blocks):
                    raise ValueError(f"block_table[{b}] must hold page indices in [0, "
                                     f"{num_blocks}) for its {n + new} positions, got "
                                     f"{used.tolist()}")


def check_drop_layout(drop_layout, q, k, packed):
    """``drop_layout = (q_total, k_total, row_offset, col_offset)``: this dense call is the
    block [row_offset, + q_len) x [col_offset, + k_len) of a (q_total, k_total) attention, and
    its dropout mask is that block of the whole one (kernels/core/dropout.py)."""
    if drop_layout is None:
        return None
    values = list(drop_layout)
    if packed or len(values) != 4 or not all(isinstance(x, numbers.Integral) and
                                             not isinstance(x, bool) for x in values):
        raise ValueError(f"drop_layout must be 4 ints (q_total, k_total, row_offset, "
                         f"col_offset) for a dense call, got {drop_layout!r}")
    q_total, k_total, row_offset, col_offset = (int(x) for x in values)
    if (row_offset < 0 or col_offset < 0 or
            row_offset + q.shape[2] > q_total or col_offset + k.shape[2] > k_total):
        raise ValueError(f"drop_layout {tuple(values)} does not hold a block of q_len "
                         f"{q.shape[2]} x k_len {k.shape[2]} (offsets >= 0, inside the "
                         f"totals)")
    return [q_total, k_total, row_offset, col_offset]


def check_paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                       max_seqlen_q, causal, dropout_p, softmax_scale, window):
    """Validation of ``attention_varlen`` over a paged cache (``block_table`` given): packed
    q (total_q, heads_q, D), pages (num_blocks, page_size, heads_kv, D or Dv), one block-table
    row and one key count per sequence (``seqused_k``, or the differences of
    ``cu_seqlens_k``). Returns (causal as a bool, max_seqlen_q, the key counts tensor)."""
    check_tensor("q", q, 3, "(total_q, heads, head_dim) (packed sequences)")
    for name, t in (("k", k_cache), ("v", v_cache)):
        check_tensor(name, t, 4, _PAGED_LAYOUT)
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(f"k and v pages must have one shape but for head_dim, got k "
                         f"{tuple(k_cache.shape)} and v {tuple(v_cache.shape)}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout over a paged cache is not supported (forward-only "
                                  f"serving, as FlashAttention's paged attention), got "
                                  f"dropout_p={dropout_p}")
    # The dense checks on one page viewed as (page_size, heads_kv, D): dtypes, devices, heads.
    causal = validate_attention(q, k_cache[0] if len(k_cache) else k_cache.new_empty(
        k_cache.shape[1:]), v_cache[0] if len(v_cache) else v_cache.new_empty(v_cache.shape[1:]),
        causal, dropout_p, softmax_scale, None, window, dims=3, layout=_PAGED_LAYOUT,
        fp8_cache=True, max_head_dim=MAX_HEAD_DIM_LATENT)
    if not isinstance(cu_seqlens_q, torch.Tensor):
        raise TypeError(f"cu_seqlens_q must be a torch.Tensor, got "
                        f"{type(cu_seqlens_q).__name__}")
    num_seqs = cu_seqlens_q.numel() - 1
    # cu_seqlens_q checked as the packed layout checks it (against itself for the keys); a
    # given max_seqlen_q is trusted for a tensor on a GPU (no sync).
    max_q, _ = check_cu_seqlens(cu_seqlens_q, cu_seqlens_q, q, q, max_seqlen_q,
                                max_seqlen_q, trust_hints=True)
    if seqused_k is None:
        if cu_seqlens_k is None:
            raise ValueError("attention_varlen with block_table needs the key counts: "
                             "seqused_k (num_seqs,) or cu_seqlens_k (num_seqs + 1,)")
        if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dtype != torch.int32 \
                or cu_seqlens_k.shape != (num_seqs + 1,) or cu_seqlens_k.device != q.device:
            raise ValueError(f"cu_seqlens_k must be int32 ({num_seqs + 1},) on {q.device}, got "
                             f"{getattr(cu_seqlens_k, 'dtype', type(cu_seqlens_k).__name__)} "
                             f"{tuple(getattr(cu_seqlens_k, 'shape', ()))}")
        seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    elif not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32 \
            or seqused_k.shape != (num_seqs,) or seqused_k.device != q.device:
        raise ValueError(f"seqused_k must be int32 ({num_seqs},) on {q.device}, got "
                         f"{getattr(seqused_k, 'dtype', type(seqused_k).__name__)} "
                         f"{tuple(getattr(seqused_k, 'shape', ()))}")
    check_block_table(block_table, q, k_cache, num_seqs, "num_seqs")
    return causal, max_q, seqused_k
