"""FlashAttention 2.x's Python API on our kernels: ``from kernels.flash_attn_interface import
flash_attn_func`` is the one change a FlashAttention user makes.

Every function here has FlashAttention 2's signature and semantics (flash_attn 2.x,
``flash_attn/flash_attn_interface.py``) and is built only on the public functions
``kernels.attention``, ``kernels.attention_varlen`` and ``kernels.attention_with_kvcache``:

* FlashAttention's layout is (batch, seqlen, heads, head_dim) (packed: (total, heads,
  head_dim)); ours is (batch, heads, seqlen, head_dim). Our functions read any strides in
  place, so q, k, v are passed as ``.transpose(1, 2)`` views (no copy) and the output comes
  back as the transposed view of ours, (batch, seqlen, heads, head_dim), contiguous when q was.
* ``causal`` is bottom-right aligned in both. ``window_size=(left, right)``: query i at position
  P = i + seqlen_k - seqlen_q sees keys j with P - left <= j <= P + right (-1: unbounded). With
  ``causal`` (FlashAttention then ignores ``right``) it is our causal sliding window
  ``window = left + 1``; non-causal and two-sided windows are a mask mod (``WINDOW_MASK``)
  whose kv_range / q_range let the kernels skip the tiles outside the band.
* ``softcap`` (0: off), ``alibi_slopes`` (FlashAttention's convention, ours too: the bias
  ``-slope * |i + seqlen_k - seqlen_q - j|``), ``dropout_p`` map one to one. ``deterministic``
  is accepted and changes nothing: our backward is always deterministic.
* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)`` as FlashAttention does:
  lse (batch, heads, seqlen_q) (varlen: (heads, total_q)), and ``S_dmask``: with
  ``dropout_p == 0`` FlashAttention's empty tensor (shape (0,), q's dtype and device; nothing
  is computed); with dropout the attention probabilities (batch, heads, seqlen_q, seqlen_k)
  (varlen: (batch, heads, max_seqlen_q, max_seqlen_k), zero outside each sequence), negative
  where dropout dropped the weight, as FlashAttention encodes it. Those are computed by a
  **slow path meant for tests**: the same kernel run again with v = the identity (512 keys at
  a time), so masks, mods and the dropout mask are exactly those of ``out``; FlashAttention
  pads the last two dims to multiples of 128, we do not.
* ``flash_attn_with_kvcache``: dense caches (batch_cache, seqlen_cache, heads_k, head_dim) or,
  with ``block_table``, paged ones (num_blocks, page_block_size, heads_k, head_dim) (any page
  size; needs an ``attention_with_kvcache`` that takes ``block_table=``); new ``k`` / ``v``
  (any number of new tokens) are written into the cache at ``cache_seqlens`` in place and
  ``cache_seqlens`` is not advanced; rotary embeddings (``rotary_cos`` / ``rotary_sin``,
  interleaved or GPT-NeoX style) are applied to q and the new k in PyTorch before the kernel;
  ``cache_batch_idx`` selects cache rows (natively through the paged path when available, else
  by a gathered copy of the selected rows).

``cache_leftpad`` hides each row's keys before it (a mask mod; positions, rotary included,
stay absolute, as in FlashAttention).

FlashAttention 3's ``attention_chunk`` (Llama 4's chunked attention) and learnable sinks
(gpt-oss; ``s_aux`` in vLLM's FlashAttention 3, ``learnable_sink`` in ``flash_attn.cute``) are
keyword arguments of the dense, varlen and KV-cache functions. A chunk C keeps query i (position
P = i + seqlen_k - seqlen_q) to keys in [C * floor(P / C), C * floor(P / C) + C), on top of its
causal mask or window: with ``causal`` it is our built-in ``chunk_size`` (a window then stays a
mask mod), without it a mask mod (``CHUNK_MASK``) whose tile ranges skip other chunks' tiles.
The sinks are our ``sinks``: a (heads,) logit in every row's softmax denominator. Both are
differentiable (FlashAttention 3's backward does not take a chunk).

``unpad_input`` / ``pad_input``: ``flash_attn.bert_padding``'s helpers (2.7+ signatures and
return values) in plain PyTorch, to pack a padded batch for the varlen functions and back.

The index tensors (``cu_seqlens_*``, ``cache_seqlens``, ``cache_batch_idx``,
``cache_leftpad``, ``block_table``) are checked as FlashAttention checks them, by one helper:
int32, on q's device, of the expected shape, else ``RuntimeError`` naming the argument
(``cache_seqlens`` may also be an int; a list instead of a tensor: ``RuntimeError`` too). A
paged cache whose ``cache_seqlens`` (+ the new keys) overflow the pages of ``block_table``
raises ``RuntimeError`` naming ``block_table``, as FlashAttention's guard does (a
device-to-host read of the lengths on a GPU, as there).

FP8: FlashAttention 3's ``q_descale``, ``k_descale``, ``v_descale`` (float32 (batch,
heads_k)) with ``torch.float8_e4m3fn`` q, k, v in ``flash_attn_func`` and
``flash_attn_varlen_func`` (forward only; output bf16), and an FP8 cache (with fp16 / bf16 or
FP8 q) in ``flash_attn_with_kvcache``: ``kernels.attention``'s FP8 path (docs/features.md).
FlashAttention 3's paged varlen call: ``page_table`` (its name for ``block_table``, also in
``flash_attn_with_kvcache``) with ``seqused_k`` (key counts) in place of ``cu_seqlens_k``;
without pages, ``seqused_k`` counts the keys each packed sequence uses (differentiable).
FlashAttention 3's scheduling hints (``scheduler_metadata``, ``sm_margin``, ``pack_gqa``,
``num_splits``) are accepted and change nothing. Not supported (``NotImplementedError`` naming
the argument): FlashAttention 3's other arguments (``qv``, ``seqused_q``, ...).

Errors: one exception type, FlashAttention's ``RuntimeError`` (its TORCH_CHECKs), for every
bad argument, with our message (expected vs given): this module's own checks (a dtype other
than fp16 / bf16 -- fp32 is accepted here --, an FP8 format other than float8_e4m3fn, q, k,
v dtypes or head dims that differ, heads_q not a multiple of heads_k -- the message names the
shapes and the layout (batch, seqlen, heads, head_dim), as a q in SDPA's layout is the usual
cause --, wrong ranks, the index tensors) and those of ``kernels.attention`` & co. underneath, whose
``TypeError`` / ``ValueError`` (the native API's convention) come out as ``RuntimeError`` with
the same message (``_flash_attn_errors``). ``NotImplementedError`` (FlashAttention 3's
arguments we lack) is a ``RuntimeError``; an unknown keyword argument is Python's
``TypeError``, as for any function. Where FlashAttention is stricter than our
kernels (head_dim > 256, softcap with dropout, batch 0, any paged block size), we accept.
A row that sees no key has lse -inf here (FlashAttention writes +inf); docs/flash_attn.md
lists every difference.
"""
import functools
import inspect
import numbers

import torch
import triton
import triton.language as tl

from .core.mods import MaskMod, aux_ints
from .ops import attention, attention_varlen, attention_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "unpad_input",
           "pad_input", "WINDOW_MASK"]

# FlashAttention 3's arguments that FlashAttention 2's API does not have and we cannot honour.
_FA3_ONLY = ("qv", "sink_token_length", "rotary_seqlens", "seqused_q", "cu_seqlens_k_new",
             "max_seqlen_q", "cu_seqlens_q")
# FlashAttention 3's scheduling hints: they change how its kernels split the work, never the
# result, so they are accepted and ignored (our kernels choose their own schedule), as
# ``deterministic`` is.
_FA3_HINTS = ("scheduler_metadata", "sm_margin", "pack_gqa", "num_splits")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
_FP8 = torch.float8_e4m3fn
# Keys per identity slice of the probabilities' slow path (our head_dim_v limit).
_PROBS_KEYS = 512
# Window edges beyond this are unbounded (and keep kv_range / q_range arithmetic in int32).
_WINDOW_CAP = 1 << 30


# ---------------------------------------------------------------------------- error convention
# One exception type per API: kernels' own functions raise Python's TypeError / ValueError for
# a bad argument; FlashAttention raises RuntimeError (its TORCH_CHECKs), and so does this
# module, for its own checks and for those the native functions make underneath. The native
# functions are called only through these wrappers, so no TypeError / ValueError of theirs
# reaches a FlashAttention caller, whatever check raised it. NotImplementedError (what we do
# not support) is a RuntimeError already and passes as it is.
def _flash_attn_errors(fn):
    """``fn`` (a public function of kernels) with its TypeError / ValueError raised as
    RuntimeError with the same message (the original chained as its cause)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError) as err:
            raise RuntimeError(str(err)) from err
    return call


_attention = _flash_attn_errors(attention)
_attention_varlen = _flash_attn_errors(attention_varlen)
_attention_with_kvcache = _flash_attn_errors(attention_with_kvcache)


# ---------------------------------------------------------------------------- window mask mods
@triton.jit
def _window_fn(b, h, q_idx, kv_idx, aux):
    """FlashAttention's local window: q_idx - left <= kv_idx <= q_idx + right; aux[0] = int32
    (left, right), each capped at 2**30 (= unbounded)."""
    left = tl.load(aux[0])
    right = tl.load(aux[0] + 1)
    return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)


@triton.jit
def _window_keys(b, q_lo, q_hi, aux):
    return q_lo - tl.load(aux[0]), q_hi + tl.load(aux[0] + 1)


@triton.jit
def _window_queries(b, kv_lo, kv_hi, aux):
    return kv_lo - tl.load(aux[0] + 1), kv_hi + tl.load(aux[0])


def _window_torch(b, h, q_idx, kv_idx, aux):
    left, right = aux[0].reshape(-1).tolist()[:2]
    return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)


WINDOW_MASK = MaskMod("flash_attn.window", _window_fn, _window_torch, kv_range=_window_keys,
                      q_range=_window_queries)


# A left-padded KV cache (``cache_leftpad``): FlashAttention hides row b's keys before
# leftpad[b] and keeps every other rule in absolute positions (causal alignment, window,
# ALiBi distance, rotary positions), so the padding is one more mask: the window's and
# kv_idx >= aux[1][b].
@triton.jit
def _leftpad_fn(b, h, q_idx, kv_idx, aux):
    return _window_fn(b, h, q_idx, kv_idx, aux) & (kv_idx >= tl.load(aux[1] + b))


@triton.jit
def _leftpad_keys(b, q_lo, q_hi, aux):
    return tl.maximum(q_lo - tl.load(aux[0]), tl.load(aux[1] + b)), q_hi + tl.load(aux[0] + 1)


@triton.jit
def _leftpad_queries(b, kv_lo, kv_hi, aux):
    q_lo = kv_lo - tl.load(aux[0] + 1)
    # Keys entirely inside the padding are seen by no query: an empty range.
    return q_lo, tl.where(kv_hi <= tl.load(aux[1] + b), q_lo, kv_hi + tl.load(aux[0]))


def _leftpad_torch(b, h, q_idx, kv_idx, aux):
    return _window_torch(b, h, q_idx, kv_idx, aux) & (kv_idx >= aux[1].long()[b])


LEFTPAD_MASK = MaskMod("flash_attn.leftpad", _leftpad_fn, _leftpad_torch,
                       kv_range=_leftpad_keys, q_range=_leftpad_queries)


# FlashAttention 3's ``attention_chunk`` C without ``causal``: query position P sees the keys
# of its own chunk of positions, [C * floor(P / C), C * floor(P / C) + C), inside its window
# (FlashAttention 3's local mask: the chunk narrows both window edges). aux[0] = int32
# (left, right, C). With ``causal`` the chunk is our built-in ``chunk_size`` instead (its tiles
# are skipped by the kernels' own chunk edge) and the window, if any, WINDOW_MASK.
@triton.jit
def _chunk_start(pos, chunk):
    """The first position of ``pos``'s chunk: the multiple of ``chunk`` at or below ``pos``.
    ``pos`` may be negative (queries before the first key when seqlen_q > seqlen_k): the
    remainder is made non-negative first, since integer ``%`` truncates on the GPU."""
    return pos - ((pos % chunk) + chunk) % chunk


@triton.jit
def _chunk_fn(b, h, q_idx, kv_idx, aux):
    chunk = tl.load(aux[0] + 2)
    start = _chunk_start(q_idx, chunk)
    return _window_fn(b, h, q_idx, kv_idx, aux) & (kv_idx >= start) & (kv_idx < start + chunk)


@triton.jit
def _chunk_keys(b, q_lo, q_hi, aux):
    chunk = tl.load(aux[0] + 2)
    kv_lo, kv_hi = _window_keys(b, q_lo, q_hi, aux)
    return (tl.maximum(kv_lo, _chunk_start(q_lo, chunk)),
            tl.minimum(kv_hi, _chunk_start(q_hi - 1, chunk) + chunk))


@triton.jit
def _chunk_queries(b, kv_lo, kv_hi, aux):
    # A key is seen only by the positions of its own chunk, as a query sees only its own.
    chunk = tl.load(aux[0] + 2)
    q_lo, q_hi = _window_queries(b, kv_lo, kv_hi, aux)
    return (tl.maximum(q_lo, _chunk_start(kv_lo, chunk)),
            tl.minimum(q_hi, _chunk_start(kv_hi - 1, chunk) + chunk))


def _chunk_torch(b, h, q_idx, kv_idx, aux):
    chunk = int(aux[0].reshape(-1)[2])
    start = torch.div(q_idx, chunk, rounding_mode="floor") * chunk
    return _window_torch(b, h, q_idx, kv_idx, aux) & (kv_idx >= start) & (kv_idx < start + chunk)


CHUNK_MASK = MaskMod("flash_attn.chunk", _chunk_fn, _chunk_torch, kv_range=_chunk_keys,
                     q_range=_chunk_queries)


# The same with a left-padded KV cache: aux[1] = int32 (batch,) leftpad, as LEFTPAD_MASK.
@triton.jit
def _leftpad_chunk_fn(b, h, q_idx, kv_idx, aux):
    return _chunk_fn(b, h, q_idx, kv_idx, aux) & (kv_idx >= tl.load(aux[1] + b))


@triton.jit
def _leftpad_chunk_keys(b, q_lo, q_hi, aux):
    kv_lo, kv_hi = _chunk_keys(b, q_lo, q_hi, aux)
    return tl.maximum(kv_lo, tl.load(aux[1] + b)), kv_hi


@triton.jit
def _leftpad_chunk_queries(b, kv_lo, kv_hi, aux):
    q_lo, q_hi = _chunk_queries(b, kv_lo, kv_hi, aux)
    return q_lo, tl.where(kv_hi <= tl.load(aux[1] + b), q_lo, q_hi)


def _leftpad_chunk_torch(b, h, q_idx, kv_idx, aux):
    return _chunk_torch(b, h, q_idx, kv_idx, aux) & (kv_idx >= aux[1].long()[b])


LEFTPAD_CHUNK_MASK = MaskMod("flash_attn.leftpad_chunk", _leftpad_chunk_fn,
                             _leftpad_chunk_torch, kv_range=_leftpad_chunk_keys,
                             q_range=_leftpad_chunk_queries)


def _mask_kw(window_size, causal, device, leftpad=None, chunk=0):
    """Our visibility keywords (causal, window, chunk_size, mask_mod, mod_aux) for
    FlashAttention's ``window_size`` and ``causal``, FlashAttention 3's ``attention_chunk``
    (``chunk``, 0: off; validated by ``_fa3_kw``) and (KV cache) ``cache_leftpad``."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise RuntimeError(f"window_size must be a pair (left, right) of ints (-1: unbounded), "
                           f"got {window_size!r}") from None
    left = _WINDOW_CAP if left < 0 else min(left, _WINDOW_CAP)
    right = _WINDOW_CAP if right < 0 else min(right, _WINDOW_CAP)
    kw = dict(causal=False)
    if causal or right == 0:
        # FlashAttention ignores ``right`` when causal; (left, 0) is causal with a window.
        # The built-in rules do causal and the chunk; the window too when there is no chunk
        # (ours and a chunk do not combine: then the mask mod keeps the window's left edge).
        kw["causal"] = True
        right = _WINDOW_CAP
        if chunk:
            kw["chunk_size"] = chunk
        elif left < _WINDOW_CAP:
            kw["window"], left = left + 1, _WINDOW_CAP
        chunk = 0
    if leftpad is None and left >= _WINDOW_CAP and right >= _WINDOW_CAP and not chunk:
        return kw
    bounds = aux_ints((left, right, chunk) if chunk else (left, right), device)
    if leftpad is None:
        kw.update(mask_mod=CHUNK_MASK if chunk else WINDOW_MASK, mod_aux=(bounds,))
    else:
        kw.update(mask_mod=LEFTPAD_CHUNK_MASK if chunk else LEFTPAD_MASK,
                  mod_aux=(bounds, leftpad.to(device=device, dtype=torch.int32)))
    return kw


# ---------------------------------------------------------------------------- validation
def _reject_fa3(kwargs):
    """FlashAttention 3's scheduling hints: ignored; its other arguments: NotImplementedError;
    anything else: TypeError."""
    kwargs = {name: value for name, value in kwargs.items() if name not in _FA3_HINTS}
    for name in kwargs:
        if name in _FA3_ONLY:
            raise NotImplementedError(f"{name} is a FlashAttention 3 argument; "
                                      f"kernels.flash_attn_interface implements FlashAttention "
                                      f"2's API and does not support it")
    if kwargs:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(kwargs))}")


def _fa3_kw(attention_chunk, s_aux, learnable_sink):
    """FlashAttention 3's ``attention_chunk`` (an int >= 0, 0: off) and learnable sinks: a
    (heads,) logit per query head in every row's softmax denominator, named ``s_aux`` in
    vLLM's FlashAttention 3 and ``learnable_sink`` in ``flash_attn.cute``; they are our
    ``sinks``. Returns (chunk, sinks)."""
    if (isinstance(attention_chunk, bool) or not isinstance(attention_chunk, numbers.Integral)
            or attention_chunk < 0):
        raise RuntimeError(f"attention_chunk must be an int >= 0 (0: off), got "
                           f"{attention_chunk!r}")
    if s_aux is not None and learnable_sink is not None:
        raise RuntimeError("s_aux and learnable_sink are two names for the same sinks: pass one")
    return int(attention_chunk), s_aux if s_aux is not None else learnable_sink


def _page_table(block_table, page_table):
    """FlashAttention 2's ``block_table`` or FlashAttention 3's ``page_table`` (the same
    paged-cache index; one or the other)."""
    if block_table is not None and page_table is not None:
        raise RuntimeError("block_table and page_table are two names for the same paged-cache "
                           "index: pass one")
    return page_table if page_table is not None else block_table


def _check(q, k, v, dims, layout, fp8_cache=False, names=("q", "k", "v")):
    """FlashAttention's checks, its exception type (RuntimeError), our messages.
    ``fp8_cache``: k, v may be an FP8 cache read by q of another dtype. ``names``: the three
    arguments' names in the caller's signature (the messages name them)."""
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise RuntimeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise RuntimeError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
        if str(t.dtype).startswith("torch.float8") and t.dtype != _FP8:
            # Another FP8 format (e5m2, the fnuz ones): say which one FP8 takes, not that
            # the dtypes differ.
            raise RuntimeError(f"{name}: FP8 inputs and caches must be torch.float8_e4m3fn "
                               f"(OCP e4m3, FlashAttention-3's format), got {t.dtype}")
    if q.dtype not in _DTYPES:
        raise RuntimeError(f"{names[0]} must be float16 or bfloat16 (float32 and float8_e4m3fn "
                           f"are accepted too), got {q.dtype}")
    shapes = (f"got {names[0]} {tuple(q.shape)}, {names[1]} {tuple(k.shape)}, {names[2]} "
              f"{tuple(v.shape)}")
    for name, t in zip(names[1:], (k, v)):
        if t.dtype != q.dtype and not (fp8_cache and t.dtype == _FP8):
            raise RuntimeError(f"{names[0]} and {name} must have the same dtype, got "
                               f"{q.dtype} and {t.dtype}")
        if t.shape[-1] != q.shape[-1]:
            raise RuntimeError(f"{names[0]} and {name} must have the same head dim (last dim "
                               f"of {layout}), {shapes}")
    if k.shape[-2] != v.shape[-2]:
        raise RuntimeError(f"{names[1]} and {names[2]} must have the same number of heads "
                           f"(dim -2 of {layout}), {shapes}")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2] != 0:
        # The likeliest cause: tensors in SDPA's layout (batch, heads, seqlen, head_dim).
        hint = (" (a tensor in SDPA's layout (batch, heads, seqlen, head_dim) takes "
                ".transpose(1, 2))" if dims == 4 else "")
        raise RuntimeError(f"the number of query heads must be a multiple of the number of "
                           f"key/value heads (dim -2 of {layout}: {q.shape[-2]} and "
                           f"{k.shape[-2]}), {shapes}{hint}")


def _index_tensor(name, t, device, shape, kind="an int32 tensor"):
    """FlashAttention's checks of an index argument (cu_seqlens, cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table): a torch.Tensor of dtype int32 on ``device`` whose shape is
    ``shape`` (None: any size there); else RuntimeError, as its TORCH_CHECKs raise (also for
    something that is no tensor: one exception type for every argument check)."""
    if not isinstance(t, torch.Tensor):
        raise RuntimeError(f"{name} must be {kind}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise RuntimeError(f"{name} must have dtype int32, got {t.dtype}")
    if t.device != device:
        raise RuntimeError(f"{name} must be on q's device {device}, got {t.device}")
    if t.dim() != len(shape) or any(n is not None and n != m for n, m in zip(shape, t.shape)):
        expected = ", ".join("any" if n is None else str(n) for n in shape)
        raise RuntimeError(f"{name} must have shape ({expected}{',' if len(shape) == 1 else ''}"
                           f"), got {tuple(t.shape)}")
    return t


def _softcap(softcap):
    return None if softcap is None or softcap == 0 else float(softcap)


def _seed(dropout_p, return_attn_probs):
    """An explicit dropout seed when the probabilities are wanted too (the slow path must draw
    the same mask); else None: ours draws one from PyTorch's default generator."""
    if dropout_p > 0 and return_attn_probs:
        return int(torch.randint(0, 2 ** 62, ()).item())
    return None


# ---------------------------------------------------------------------------- probabilities
def _identity_slice(n_keys, c0, c1, dtype, device):
    """(n_keys, c1 - c0): key j -> one-hot column j - c0 (zero rows outside [c0, c1))."""
    cols = torch.arange(c0, c1, device=device)
    return (torch.arange(n_keys, device=device)[:, None] == cols[None, :]).to(dtype)


def _s_dmask(q, dropout_p, probs):
    """FlashAttention's S_dmask: materialised only with dropout (``probs()``, the slow path);
    without, the empty tensor it returns then: shape (0,), q's dtype and device."""
    if dropout_p > 0:
        return probs()
    return q.new_empty((0,))


def _encode_dropped(probs, dropped_probs):
    """FlashAttention's S_dmask: the probabilities, negated where dropout dropped them."""
    return torch.where((dropped_probs == 0) & (probs != 0), -probs, probs)


def _probs_dense(q, k, dropout_p, seed, kw):
    """(batch, heads, seqlen_q, seqlen_k) attention probabilities of ``attention(q, k, ., **kw)``
    in our layout: the kernel run on v = identity slices (the slow path)."""
    B, Hq, Lq, _ = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    probs = q.new_zeros((B, Hq, Lq, Lk))
    for c0 in range(0, Lk, _PROBS_KEYS):
        c1 = min(Lk, c0 + _PROBS_KEYS)
        v = _identity_slice(Lk, c0, c1, q.dtype, q.device).expand(B, Hk, Lk, c1 - c0)
        with torch.no_grad():
            p = _attention(q, k, v, dropout_p=0.0, **kw)
            if dropout_p > 0:
                p = _encode_dropped(p, _attention(q, k, v, dropout_p=dropout_p, seed=seed,
                                                  **kw))
        probs[..., c0:c1] = p
    return probs


def _longest(cu_seqlens, given):
    """``given`` (max_seqlen_q / max_seqlen_k) as an int, or the longest sequence of
    ``cu_seqlens`` when it is None (a device-to-host read: the slow path's)."""
    if given is not None:
        return int(given)
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def _probs_varlen(q, k, cu_q, cu_k, max_q, max_k, dropout_p, seed, kw):
    """(batch, heads, max_seqlen_q, max_seqlen_k) probabilities of ``attention_varlen``, zero
    outside each sequence (the slow path, as ``_probs_dense``)."""
    n_seq = cu_q.numel() - 1
    lens_q, lens_k = ((cu[1:] - cu[:-1]).long() for cu in (cu_q, cu_k))
    seq_q = torch.repeat_interleave(torch.arange(n_seq, device=q.device), lens_q)
    seq_k = torch.repeat_interleave(torch.arange(n_seq, device=q.device), lens_k)
    row_q = torch.arange(q.shape[0], device=q.device) - cu_q.long()[seq_q]
    row_k = torch.arange(k.shape[0], device=q.device) - cu_k.long()[seq_k]
    probs = q.new_zeros((n_seq, q.shape[1], max_q, max_k))
    for c0 in range(0, max_k, _PROBS_KEYS):
        c1 = min(max_k, c0 + _PROBS_KEYS)
        v = (row_k[:, None] == torch.arange(c0, c1, device=q.device)[None, :]).to(q.dtype)
        v = v[:, None, :].expand(k.shape[0], k.shape[1], c1 - c0)
        args = (q, k, v, cu_q, cu_k, max_q, max_k)
        with torch.no_grad():
            p = _attention_varlen(*args, dropout_p=0.0, **kw)
            if dropout_p > 0:
                p = _encode_dropped(p, _attention_varlen(*args, dropout_p=dropout_p, seed=seed,
                                                         **kw))
        probs[seq_q, :, row_q, c0:c1] = p
    return probs


# ---------------------------------------------------------------------------- dense
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, q_descale=None, k_descale=None,
                    v_descale=None, attention_chunk=0, s_aux=None, learnable_sink=None,
                    **fa3_kwargs):
    """FlashAttention 2's ``flash_attn_func`` on our kernels (differentiable).

    Args:
        q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_k, head_dim),
            heads % heads_k == 0 (query head h reads kv head h // (heads / heads_k)).
            float16 / bfloat16 (float32 too), read in place (any strides).
        dropout_p: dropout probability (0.0 in evaluation).
        softmax_scale: scale of q kᵀ; default 1 / sqrt(head_dim).
        causal: bottom-right aligned causal mask.
        window_size: (left, right), -1 = unbounded: query i sees keys
            [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right].
        softcap: > 0: ``softcap * tanh(s / softcap)`` on the scaled scores; 0 = off.
        alibi_slopes: fp32 (heads,) or (batch, heads): bias ``-slope * |i + seqlen_k -
            seqlen_q - j|``.
        deterministic: accepted; our backward is always deterministic.
        return_attn_probs: also return softmax_lse and S_dmask (module docstring: the
            probabilities with dropout, by a slow path for tests; else an empty tensor).
        q_descale, k_descale, v_descale: FlashAttention 3's FP8 descales, float32 (batch,
            heads_k), with float8_e4m3fn q, k, v (forward only, output bfloat16).
        attention_chunk: FlashAttention 3's chunked attention (Llama 4), 0 = off: query i
            (position P = i + seqlen_k - seqlen_q) sees only keys of its own chunk
            [C * floor(P / C), C * floor(P / C) + C), inside its causal mask or window.
        s_aux, learnable_sink: FlashAttention 3's learnable sinks (gpt-oss), one name or the
            other: (heads,) logits in every row's softmax denominator (differentiable).

    Returns:
        out (batch, seqlen_q, heads, head_dim); with ``return_attn_probs``: (out, softmax_lse
        fp32 (batch, heads, seqlen_q), S_dmask (batch, heads, seqlen_q, seqlen_k) with
        dropout, else shape (0,)).
    """
    _reject_fa3(fa3_kwargs)
    _check(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    chunk, sinks = _fa3_kw(attention_chunk, s_aux, learnable_sink)
    kw = dict(softmax_scale=softmax_scale, softcap=_softcap(softcap), alibi_slopes=alibi_slopes,
              sinks=sinks, **_mask_kw(window_size, causal, q.device, chunk=chunk),
              **_fp8_kw(q, q_descale, k_descale, v_descale))
    return _dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p,
                  return_attn_probs, kw)


def _fp8_kw(q, q_descale, k_descale, v_descale):
    """The FP8 descales as ``kernels.attention`` keywords (none for other dtypes: their
    validation then says a descale applies to FP8 only)."""
    if q_descale is None and k_descale is None and v_descale is None:
        return {}
    return dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def _dense(q, k, v, dropout_p, return_attn_probs, kw):
    """The dense functions in our layout (batch, heads, seq, head_dim); ``kw``: the call's
    ``kernels.attention`` keywords other than dropout."""
    seed = _seed(dropout_p, return_attn_probs)
    out, lse = _attention(q, k, v, dropout_p=dropout_p, seed=seed, return_lse=True, **kw)
    if not return_attn_probs:
        return out.transpose(1, 2)
    return out.transpose(1, 2), lse, _s_dmask(q, dropout_p, lambda: _probs_dense(
        q, k, dropout_p, seed, kw))


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, **fa3_kwargs):
    """``flash_attn_func`` with qkv (batch, seqlen, 3, heads, head_dim) stacked (views of it
    are passed on: the gradient lands in qkv's slices)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise RuntimeError(f"qkv must be (batch, seqlen, 3, heads, head_dim), got "
                           f"{tuple(getattr(qkv, 'shape', ()))}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, **fa3_kwargs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, **fa3_kwargs):
    """``flash_attn_func`` with kv (batch, seqlen_k, 2, heads_k, head_dim) stacked."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise RuntimeError(f"kv must be (batch, seqlen_k, 2, heads_k, head_dim), got "
                           f"{tuple(getattr(kv, 'shape', ()))}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                           **fa3_kwargs)


# ---------------------------------------------------------------------------- varlen
def _used_keys(q, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """FlashAttention 3's packed keys with per-sequence counts (sequence s uses rows
    cu_seqlens_k[s] : cu_seqlens_k[s] + seqused_k[s]) as a plain packed call: each sequence's
    unused tail becomes a sequence of its own with no query rows, so k and v are read in place
    (no copy) and nothing attends to the tails (their dK / dV are zeros). Returns (cu_seqlens_q,
    cu_seqlens_k) of the 2 x num_seqs sequences (s at 2s, its tail at 2s + 1; ``_per_tail``
    gives per-sequence tensors their rows). Checks, outside torch.compile tracing, that
    each count is within its sequence (a larger one would read the next sequence's keys).
    The three tensors' dtypes and shapes are the caller's checks."""
    if cu_seqlens_k is None:
        raise RuntimeError("seqused_k without a paged cache needs cu_seqlens_k (where each "
                           "sequence's keys start)")
    lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    if not torch.compiler.is_compiling():
        if bool((seqused_k < 0).any()) or bool((seqused_k > lens).any()):
            raise RuntimeError(f"seqused_k must be within each sequence's keys (0 <= "
                               f"seqused_k[s] <= cu_seqlens_k[s + 1] - cu_seqlens_k[s]), got "
                               f"{seqused_k.tolist()} for lengths {lens.tolist()}")
    starts_k = cu_seqlens_k[:-1]
    cu_k = torch.cat([torch.stack([starts_k, starts_k + seqused_k], 1).flatten(),
                      cu_seqlens_k[-1:]]).to(torch.int32)
    cu_q = torch.cat([cu_seqlens_q[:-1].repeat_interleave(2) + torch.stack(
        [torch.zeros_like(lens), cu_seqlens_q[1:] - cu_seqlens_q[:-1]], 1).flatten(),
        cu_seqlens_q[-1:]]).to(torch.int32)
    return cu_q, cu_k


def _per_tail(t):
    """A per-sequence (num_seqs, heads) tensor (ALiBi slopes, FP8 descales) for ``_used_keys``'
    sequences: each row twice (the tail's is never used); other values as they are."""
    return t.repeat_interleave(2, dim=0) if isinstance(t, torch.Tensor) and t.dim() == 2 else t


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           q_descale=None, k_descale=None, v_descale=None, attention_chunk=0,
                           s_aux=None, learnable_sink=None, seqused_k=None, page_table=None,
                           **fa3_kwargs):
    """FlashAttention 2's ``flash_attn_varlen_func`` on ``kernels.attention_varlen``.

    Args:
        q: (total_q, heads, head_dim); k, v: (total_k, heads_k, head_dim): packed sequences
            (the layout is ours too: passed as they are).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) cumulative lengths (cu_seqlens_k may
            be None with a paged cache and ``seqused_k``).
        max_seqlen_q, max_seqlen_k: the longest sequences (optional: computed from the
            lengths when None, a device-to-host read).
        block_table: optional int32 (batch, max_blocks_per_seq): k, v are then paged,
            (num_blocks, page_block_size, heads_k, head_dim) (any page size), sequence s's
            keys its first cu_seqlens_k[s + 1] - cu_seqlens_k[s] positions, position j being
            row j % page_block_size of page block_table[s, j // page_block_size]; forward only,
            without dropout (``attention_varlen(..., block_table=)``); its pages may be FP8
            (float8_e4m3fn) under fp16 / bf16 q, with k_descale / v_descale.
        page_table: FlashAttention 3's name for ``block_table`` (one or the other).
        seqused_k: int32 (batch,): the key count of each sequence. With a paged cache
            (FlashAttention 3's and vLLM's paged call) cu_seqlens_k is then not needed;
            without one (FlashAttention 3's packed keys with counts), sequence s uses rows
            cu_seqlens_k[s] : cu_seqlens_k[s] + seqused_k[s] of k and v, read in place (one
            packed call in which each sequence's unused tail is a sequence without queries),
            causal aligned by the used count (as FlashAttention 3); differentiable (the
            unused rows' dk, dv are zeros); no dropout.
        q_descale, k_descale, v_descale: FP8 descales, float32 (batch, heads_k), as in
            ``flash_attn_func``.
        attention_chunk, s_aux, learnable_sink: as in ``flash_attn_func`` (positions are
            each sequence's own).
        Others: as in ``flash_attn_func``; alibi_slopes may be (batch, heads).

    Returns:
        out (total_q, heads, head_dim); with ``return_attn_probs``: (out, softmax_lse fp32
        (heads, total_q), S_dmask (batch, heads, max_seqlen_q, max_seqlen_k) with dropout,
        else shape (0,)).
    """
    _reject_fa3(fa3_kwargs)
    block_table = _page_table(block_table, page_table)
    paged = block_table is not None
    if cu_seqlens_k is None and seqused_k is None:
        raise RuntimeError("cu_seqlens_k is required (it may be None only with a paged cache "
                           "and seqused_k)")
    if paged:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise RuntimeError(f"{name} must be 4-D (num_blocks, page_block_size, heads_k, "
                                   f"head_dim) with block_table (paged), got "
                                   f"{tuple(getattr(t, 'shape', ()))}")
        _check(q, k.flatten(0, 1), v.flatten(0, 1), 3, "(total, heads, head_dim)",
               fp8_cache=True)
    else:
        _check(q, k, v, 3, "(total, heads, head_dim)")
    _index_tensor("cu_seqlens_q", cu_seqlens_q, q.device, (None,))
    if cu_seqlens_k is not None:
        _index_tensor("cu_seqlens_k", cu_seqlens_k, q.device, (cu_seqlens_q.numel(),))
    if seqused_k is not None:
        _index_tensor("seqused_k", seqused_k, q.device, (cu_seqlens_q.numel() - 1,))
    if seqused_k is not None and not paged:
        # FlashAttention 3's packed keys with per-sequence counts: one packed call whose
        # sequences are the used keys and, between them, the unused tails (no query rows).
        if dropout_p:
            raise RuntimeError("dropout is not supported with seqused_k (FlashAttention 3 has "
                               "none)")
        cu_seqlens_q, cu_seqlens_k = _used_keys(q, cu_seqlens_q, cu_seqlens_k, seqused_k)
        alibi_slopes, q_descale, k_descale, v_descale = (
            _per_tail(t) for t in (alibi_slopes, q_descale, k_descale, v_descale))
        seqused_k = None
    chunk, sinks = _fa3_kw(attention_chunk, s_aux, learnable_sink)
    kw = dict(softmax_scale=softmax_scale, softcap=_softcap(softcap), alibi_slopes=alibi_slopes,
              sinks=sinks, **_mask_kw(window_size, causal, q.device, chunk=chunk),
              **_fp8_kw(q, q_descale, k_descale, v_descale))
    if paged:
        _index_tensor("block_table", block_table, q.device, (cu_seqlens_q.numel() - 1, None))
        if dropout_p:
            raise RuntimeError("dropout is not supported with a paged KV cache (block_table)")
        if not torch.compiler.is_compiling():   # FlashAttention's guard, as in the kvcache call
            lens = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
            capacity = block_table.shape[1] * k.shape[1]
            longest = int(lens.max()) if lens.numel() else 0
            if longest > capacity:
                raise RuntimeError(f"paged KV cache: the longest key sequence ({longest}) "
                                   f"exceeds the {capacity} positions block_table addresses")
        out, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, block_table=block_table, seqused_k=seqused_k,
                                     return_lse=True, **kw)
        return (out, lse, q.new_empty(0)) if return_attn_probs else out
    seed = _seed(dropout_p, return_attn_probs)
    out, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, dropout_p=dropout_p, seed=seed, return_lse=True,
                                 **kw)
    if not return_attn_probs:
        return out
    return out, lse, _s_dmask(q, dropout_p, lambda: _probs_varlen(
        q, k, cu_seqlens_q, cu_seqlens_k, _longest(cu_seqlens_q, max_seqlen_q),
        _longest(cu_seqlens_k, max_seqlen_k), dropout_p, seed,
        kw))


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, **fa3_kwargs):
    """``flash_attn_varlen_func`` with qkv (total, 3, heads, head_dim) stacked."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise RuntimeError(f"qkv must be (total, 3, heads, head_dim), got "
                           f"{tuple(getattr(qkv, 'shape', ()))}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
                                  max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, **fa3_kwargs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, **fa3_kwargs):
    """``flash_attn_varlen_func`` with kv (total_k, 2, heads_k, head_dim) stacked."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise RuntimeError(f"kv must be (total_k, 2, heads_k, head_dim), got "
                           f"{tuple(getattr(kv, 'shape', ()))}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, **fa3_kwargs)


# ---------------------------------------------------------------------------- KV cache
def _paged_supported():
    """Whether ``attention_with_kvcache`` takes ``block_table=`` (paged caches)."""
    return "block_table" in inspect.signature(attention_with_kvcache).parameters


def _rotate(x, cos, sin, interleaved):
    """Rotary embedding of x (batch, seqlen, heads, head_dim) with per-token cos, sin (batch,
    seqlen, rotary_dim / 2), in fp32, on the first rotary_dim dims (FlashAttention's
    ``apply_rotary_emb``: pairs (0, 1), (2, 3), ... when interleaved, else (i, i + rd / 2))."""
    rd = 2 * cos.shape[-1]
    xr = x[..., :rd].float()
    cos, sin = cos[:, :, None].float(), sin[:, :, None].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, q_descale=None, k_descale=None,
                            v_descale=None, attention_chunk=0, s_aux=None, learnable_sink=None,
                            page_table=None, **fa3_kwargs):
    """FlashAttention 2's ``flash_attn_with_kvcache`` on ``kernels.attention_with_kvcache``
    (forward only, as FlashAttention's).

    Args:
        q: (batch, seqlen_q, heads, head_dim).
        k_cache, v_cache: (batch_cache, seqlen_cache, heads_k, head_dim), or with
            ``block_table`` paged: (num_blocks, page_block_size, heads_k, head_dim).
        k, v: optional (batch, seqlen_new, heads_k, head_dim): written into the caches **in
            place** at positions cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1 (any
            seqlen_new); attention then covers cache_seqlens[b] + seqlen_new keys.
            ``cache_seqlens`` is not advanced (the caller does it).
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2) (with k, v): the new k is
            rotated at positions cache_seqlens[b] + j; q at cache_seqlens[b] + i when causal or
            windowed, else every query at cache_seqlens[b].
        cache_seqlens: int or int32 (batch,): filled length of each cache row; None = the
            whole cache (not with k, v). With ``block_table``, cache_seqlens + seqlen_new must
            fit its pages (max_blocks_per_seq * page_block_size; else RuntimeError).
        cache_batch_idx: optional int32 (batch,): row b uses cache row cache_batch_idx[b].
        cache_leftpad: optional int32 (batch,): row b's keys start at cache_leftpad[b] (the
            positions before it are hidden; every other rule keeps absolute positions).
        block_table: optional int32 (batch, max_blocks_per_seq): page indices of each row
            (needs ``attention_with_kvcache(block_table=...)``; else NotImplementedError).
        rotary_interleaved: True: rotate dims (0, 1), (2, 3), ...; False: GPT-NeoX halves.
        num_splits: split-KV (0: heuristic, 1: none).
        return_softmax_lse: also return lse fp32 (batch, heads, seqlen_q).
        q_descale, k_descale, v_descale: FlashAttention 3's FP8 descales, float32 (batch,
            heads_k): an FP8 (float8_e4m3fn) cache read by fp16 / bf16 q (new k, v in q's
            dtype, quantized into the cache as x / descale), or FP8 q too (new k, v in FP8).
        attention_chunk, s_aux, learnable_sink: as in ``flash_attn_func``.
        page_table: FlashAttention 3's name for ``block_table`` (one or the other).
        Others: as in ``flash_attn_func``.

    Returns:
        out (batch, seqlen_q, heads, head_dim) [, softmax_lse].
    """
    _reject_fa3(fa3_kwargs)
    chunk, sinks = _fa3_kw(attention_chunk, s_aux, learnable_sink)
    block_table = _page_table(block_table, page_table)
    paged = block_table is not None
    if paged and cache_leftpad is not None:
        raise RuntimeError("cache_leftpad cannot be combined with block_table (paged caches)")
    if paged and not _paged_supported():
        raise NotImplementedError("block_table (paged KV caches) needs kernels."
                                  "attention_with_kvcache(block_table=...), which this version "
                                  "does not have")
    if paged and cache_batch_idx is not None:
        raise RuntimeError("cache_batch_idx cannot be combined with block_table (a paged "
                           "cache's rows are chosen by the block table)")
    _check(q, k_cache, v_cache, 4, "(batch, seqlen, heads, head_dim)", fp8_cache=True,
           names=("q", "k_cache", "v_cache"))
    if (k is None) != (v is None):
        raise RuntimeError("k and v (new keys and values) must be given together")
    if k is not None:
        _check(q, k, v, 4, "(batch, seqlen_new, heads_k, head_dim)")
        if cache_seqlens is None:
            raise RuntimeError("appending k, v needs cache_seqlens (where to write them)")
    if (rotary_cos is None) != (rotary_sin is None):
        raise RuntimeError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None and k is None:
        raise RuntimeError("rotary_cos / rotary_sin rotate the new keys: pass k and v too")
    B = q.shape[0]
    if paged:
        _index_tensor("block_table", block_table, q.device, (B, None))
    if cache_batch_idx is not None:
        _index_tensor("cache_batch_idx", cache_batch_idx, q.device, (B,))
    capacity = (block_table.shape[1] * k_cache.shape[1]) if paged else k_cache.shape[1]
    if rotary_cos is not None:
        if rotary_cos.shape != rotary_sin.shape or rotary_cos.dim() != 2:
            raise RuntimeError(f"rotary_cos and rotary_sin must both be (seqlen_ro, "
                               f"rotary_dim / 2), got {tuple(rotary_cos.shape)} and "
                               f"{tuple(rotary_sin.shape)}")
        if 2 * rotary_cos.shape[1] > q.shape[-1]:
            raise RuntimeError(f"rotary_dim (2 * rotary_cos.shape[1] = "
                               f"{2 * rotary_cos.shape[1]}) must be <= head_dim {q.shape[-1]}")
        if rotary_cos.shape[0] < capacity:
            raise RuntimeError(f"rotary_cos / rotary_sin must cover every cache position: "
                               f"{rotary_cos.shape[0]} rows for a cache of {capacity}")
    if cache_seqlens is None:
        lens = torch.full((B,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        lens = torch.full((B,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    else:
        lens = _index_tensor("cache_seqlens", cache_seqlens, q.device, (B,),
                             kind="an int or an int32 tensor")
    if paged and not torch.compiler.is_compiling():
        # FlashAttention's guard (a device-to-host read, as there): a row longer than its
        # block_table row addresses would send the kernels past the table's end.
        n_new = 0 if k is None else k.shape[1]
        longest = int(lens.max()) + n_new if B else 0
        if longest > capacity:
            raise RuntimeError(
                f"paged KV cache: max(cache_seqlens){' + seqlen_new' if n_new else ''} = "
                f"{longest} exceeds the {capacity} positions block_table addresses "
                f"(max_blocks_per_seq {block_table.shape[1]} * page_block_size "
                f"{k_cache.shape[1]}): give block_table more columns")
    if cache_leftpad is not None:
        _index_tensor("cache_leftpad", cache_leftpad, q.device, (B,))
    # FlashAttention rotates each query at its own position when causal or local (a window
    # or, in FlashAttention 3, a chunk).
    local = bool(causal) or tuple(window_size) != (-1, -1) or chunk > 0
    mask_kw = _mask_kw(window_size, causal, q.device, cache_leftpad, chunk)

    if rotary_cos is not None:
        pos_k = lens.long()[:, None] + torch.arange(k.shape[1], device=q.device)
        k = _rotate(k, rotary_cos[pos_k], rotary_sin[pos_k], rotary_interleaved)
        if local:
            pos_q = lens.long()[:, None] + torch.arange(q.shape[1], device=q.device)
        else:
            pos_q = lens.long()[:, None].expand(B, q.shape[1])
        q = _rotate(q, rotary_cos[pos_q], rotary_sin[pos_q], rotary_interleaved)

    if cache_batch_idx is not None and _paged_supported():
        # A dense cache is a paged one whose pages are whole rows: row b's only page is
        # cache_batch_idx[b] -- read and written in place, no gathered copy.
        block_table = cache_batch_idx.view(B, 1)
        paged, cache_batch_idx = True, None
    if not paged and cache_batch_idx is None and k_cache.shape[0] > B:
        # FlashAttention takes a cache with more rows than the batch: rows 0 .. batch - 1.
        k_cache, v_cache = k_cache[:B], v_cache[:B]
    kc, vc = (k_cache, v_cache) if paged else (k_cache.transpose(1, 2), v_cache.transpose(1, 2))
    extra = dict(block_table=block_table) if paged else {}
    new_k = new_v = None
    if k is not None:
        if k.shape[1] == q.shape[1] and cache_batch_idx is None:
            new_k, new_v = k.transpose(1, 2), v.transpose(1, 2)   # our kernel appends them
        else:
            _append(k_cache, v_cache, k, v, lens, cache_batch_idx, block_table, k_descale,
                    v_descale)
            lens = lens + k.shape[1]
    if cache_batch_idx is not None:
        # No paged path: the selected rows are gathered (a copy; the appends went in above).
        idx = cache_batch_idx.to(device=q.device, dtype=torch.long)
        kc, vc = kc[idx], vc[idx]
    out, lse = _attention_with_kvcache(q.transpose(1, 2), kc, vc, lens, new_k, new_v,
                                       softmax_scale=softmax_scale, num_splits=num_splits,
                                       return_lse=True, softcap=_softcap(softcap),
                                       alibi_slopes=alibi_slopes, sinks=sinks, **mask_kw,
                                       **_fp8_kw(q, q_descale, k_descale, v_descale), **extra)
    out = out.transpose(1, 2)
    return (out, lse) if return_softmax_lse else out


def _quantized(x, cache, descale):
    """``x`` (batch, n_new, heads_k, head_dim) as the cache stores it: into an FP8 cache from
    another dtype, x / descale[b, h] clamped to e4m3's range (the kernels' append rule)."""
    if cache.dtype != _FP8 or x.dtype == _FP8:
        return x.to(cache.dtype)
    x = x.float()
    if descale is not None:
        x = x / descale[:, None, :, None]
    return x.clamp(-448.0, 448.0).to(_FP8)


def _append(k_cache, v_cache, k, v, lens, cache_batch_idx, block_table, k_descale=None,
            v_descale=None):
    """Write k, v (batch, n_new, heads_k, head_dim) into the caches in place at positions
    lens[b] ... lens[b] + n_new - 1 of row b (cache row cache_batch_idx[b], or the pages of
    block_table[b]); quantized into an FP8 cache (``_quantized``)."""
    B, n_new = k.shape[:2]
    pos = lens.long()[:, None] + torch.arange(n_new, device=k.device)     # (B, n_new)
    if block_table is not None:
        page_size = k_cache.shape[1]
        rows = block_table.long().gather(1, pos // page_size)
        pos = pos % page_size
    elif cache_batch_idx is not None:
        rows = cache_batch_idx.long()[:, None].expand(B, n_new)
    else:
        rows = torch.arange(B, device=k.device)[:, None].expand(B, n_new)
    k_cache[rows, pos] = _quantized(k, k_cache, k_descale)
    v_cache[rows, pos] = _quantized(v, v_cache, v_descale)


# ---------------------------------------------------------------------------- padding helpers
def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """``flash_attn.bert_padding.unpad_input`` (FlashAttention 2.7+): the tokens of a padded
    batch packed for the varlen functions.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen), bool or int, nonzero = a token.
        unused_mask: optional (batch, seqlen), nonzero = a slot allocated but unused: packed
            too (counted in cu_seqlens and max_seqlen_in_batch), not in used_seqlens.

    Returns:
        (hidden_states (total, ...) the selected tokens in batch-major order, indices int64
        (total,) their flat positions b * seqlen + s, cu_seqlens int32 (batch + 1,),
        max_seqlen_in_batch int, used_seqlens_in_batch int32 (batch,)).
        Differentiable in hidden_states (``pad_input`` undoes it).
    """
    masks = attention_mask if unused_mask is None else (attention_mask.bool()
                                                        | unused_mask.bool())
    seqlens = masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32),
                                         (1, 0))
    # Integer indices, not the bool mask: a bool index over (batch * seqlen, ...) would be
    # expanded to the full size before its nonzero.
    return hidden_states.flatten(0, 1)[indices], indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states, indices, batch, seqlen):
    """``flash_attn.bert_padding.pad_input``: packed tokens (total, ...) back to (batch,
    seqlen, ...) at the flat positions ``indices`` (from ``unpad_input``), zeros elsewhere.
    Differentiable in hidden_states."""
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    return out.index_put((indices,), hidden_states).view(batch, seqlen,
                                                          *hidden_states.shape[1:])
