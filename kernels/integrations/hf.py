"""Our kernel as a Hugging Face transformers attention implementation.

::

    import kernels.hf
    kernels.hf.register()                      # once; name "triton_fused"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="triton_fused")
    # or, on an existing model: model.set_attn_implementation("triton_fused")

``register`` installs two things under one name (transformers >= 4.56; imported lazily, so
``import kernels`` never needs transformers):

* an attention function (``transformers.AttentionInterface``), called by every attention layer
  with q (batch, heads, q_len, head_dim) and k, v (batch, heads_kv, k_len, head_dim); it returns
  (batch, q_len, heads, head_dim) and ``None`` weights, like transformers' own ``sdpa`` and
  ``flash_attention_2`` functions;
* a mask hook (``transformers.masking_utils.AttentionMaskInterface``). Without one, transformers
  builds no mask for a custom name and passes ``attention_mask=None``: padding would be silently
  ignored. Ours never builds the dense (batch, 1, q_len, k_len) mask: once per forward and mask
  type it reads which pattern the model asked for (transformers' mask function) and the 2-D
  padding mask, and turns them into what the kernel needs: nothing (no padding: one dense call)
  or the packed layout of ``kernels.attention_varlen`` (row indices and int32 cu_seqlens).

Supported exactly (the same attention as ``attn_implementation="eager"``):

* causal attention, ``scaling``, ``dropout`` (what the model passes: its attention dropout in
  training, 0 in eval; the in-kernel Philox mask, seeded from PyTorch's generator so
  ``torch.manual_seed`` reproduces it), grouped-query k/v natively (never repeated);
* ``sliding_window`` (transformers' convention: key j is visible from query i iff
  ``i - window < j <= i``, the same as ``kernels.attention(window=...)``);
* padding masks, left or right (or holes, without a sliding window), through
  ``kernels.attention_varlen``; query rows at padding positions return zeros, as with
  ``flash_attention_2`` (their value is undefined in transformers: eager gives garbage there);
* KV-cache generation (q_len != k_len, dynamic, sliding-window and static caches; our causal mask
  is aligned bottom-right, where the new queries are);
* padding-free packed batches (``position_ids`` restarting inside a row, no attention mask).

Anything else raises ``NotImplementedError`` naming it, never a silently different answer: a
non-causal layer or bidirectional mask (encoders, cross-attention, ``config.is_causal=False``), a
custom 4-D mask or any mask transformers' masking utilities did not build through our hook,
extra mask functions (``or_mask_function``/``and_mask_function``, block-wise or chunked
attention), softcapping, attention sinks (``s_aux``/``sinks``), position biases, paged caches,
value head dims different from the query's, and a sliding window over a padding mask with holes.
A layer called with no mask at all (a model that does not build masks through transformers'
masking utilities) gets causal attention with its ``sliding_window``, as with
``flash_attention_2``. ``output_attentions=True`` warns and returns ``None`` weights, as ``sdpa``.
"""
import warnings

import torch

from .. import ops

NAME = "triton_fused"
_HINT = ("use attn_implementation='eager' or 'sdpa' for this model, or call kernels.attention "
         "directly")
# Keyword arguments some transformers models pass to attention functions that would change the
# result and that we cannot honour: raise when one is given (not None).
_UNSUPPORTED_KWARGS = {
    "softcap": "attention logit softcapping (softcap)",
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks (sinks)",
    "position_bias": "an additive position bias (position_bias)",
    "head_mask": "a head mask (head_mask)",
    "indices": "sparse attention indices (indices)",
    "block_indices": "block-sparse attention indices (block_indices)",
    "block_table": "a paged KV cache (block_table)",
}


def _transformers():
    try:
        import transformers  # noqa: F401
        from transformers import masking_utils
    except ImportError as e:  # pragma: no cover - exercised without the [hf] extra
        raise ImportError("kernels.hf needs Hugging Face transformers: pip install "
                          "'fused-causal-attention[hf]' (or pip install transformers)") from e
    return transformers, masking_utils


def register(name: str = NAME) -> None:
    """Register our attention function and its mask hook with transformers under ``name``.

    Afterwards ``from_pretrained(..., attn_implementation=name)``,
    ``from_config(cfg, attn_implementation=name)`` and ``model.set_attn_implementation(name)``
    select it. Idempotent. Raises ImportError without transformers.
    """
    if not isinstance(name, str) or not name or "/" in name or ":" in name:
        raise ValueError(f"name must be a plain non-empty string without '/' or ':' (those "
                         f"name Hugging Face hub kernels), got {name!r}")
    transformers, masking_utils = _transformers()
    transformers.AttentionInterface.register(name, attention_function)
    masking_utils.AttentionMaskInterface.register(name, mask_hook)


# --------------------------------------------------------------------------------------------
# The mask hook: what the model asked for, once per forward and mask type
# --------------------------------------------------------------------------------------------
class MaskInfo:
    """What our mask hook hands to every attention layer instead of a dense mask.

    ``unsupported``: None, or why the requested mask cannot be computed exactly (raised when a
    layer uses it). Otherwise the layers compute causal attention with ``window`` over their
    keys ``[0, kv_used)`` (the keys of absolute positions ``kv_offset ...``; keys past the last
    query are never visible), either densely (``dense``) or over the packed rows
    ``indices_q`` / ``indices_k`` of the flattened (batch * len) queries / keys with int32
    ``cu_seqlens_q`` / ``cu_seqlens_k``.
    """
    # Mask-like duck typing for transformers' own plumbing: generate() calls .contiguous() on
    # masks it prepares in advance (static caches) and passes them back into the model, whose
    # mask creation reads .ndim (anything but 2 is not re-interpreted as a padding mask) and
    # hands it back to our hook.
    ndim = -1

    def __init__(self, *, batch_size=None, q_length=None, kv_length=None, q_offset=None,
                 kv_offset=None, window=None, unsupported=None):
        self.unsupported = unsupported
        self.batch_size, self.q_length, self.kv_length = batch_size, q_length, kv_length
        self.q_offset, self.kv_offset, self.window = q_offset, kv_offset, window
        self.dense = True
        self.kv_used = None
        self.indices_q = self.indices_k = self.cu_seqlens_q = self.cu_seqlens_k = None
        self.max_seqlen_q = self.max_seqlen_k = None

    def contiguous(self):
        return self

    def __repr__(self):
        if self.unsupported:
            return f"MaskInfo(unsupported={self.unsupported!r})"
        layout = "dense" if self.dense else f"packed, cu_seqlens_k={self.cu_seqlens_k.tolist()}"
        return (f"MaskInfo(causal, window={self.window}, batch={self.batch_size}, "
                f"q_length={self.q_length}, kv_length={self.kv_length}, "
                f"q_offset={self.q_offset}, kv_offset={self.kv_offset}, {layout})")


def _cells(fn):
    """The closure variables of ``fn`` by name."""
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    return dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__)))


def _same_code(fn, factory, *args):
    """Whether ``fn`` is a closure made by transformers' ``factory`` (same code object)."""
    return getattr(fn, "__code__", None) is factory(*args).__code__


def _pattern(mask_function, mu, *, packed_ok=True):
    """Read transformers' mask function: (window or None, packed sequence ids or None), or a
    str saying why it is not a pattern we compute exactly. Only the closures transformers'
    own mask creation builds are recognised; anything else is refused."""
    if mask_function is mu.causal_mask_function:
        return None, None
    if _same_code(mask_function, mu.and_masks, mu.causal_mask_function):
        parts = _cells(mask_function).get("mask_functions", ())
        # sliding_window_causal_mask_function(w) = and_masks(sliding_window_overlay(w), causal)
        if (len(parts) == 2 and parts[1] is mu.causal_mask_function
                and _same_code(parts[0], mu.sliding_window_overlay, 1)):
            window = _cells(parts[0]).get("sliding_window")
            if isinstance(window, int) and not isinstance(window, bool) and window >= 1:
                return window, None
        # packed_sequence_compatibility_function: and_masks(packed ids, remapped positions)
        if (packed_ok and len(parts) == 2
                and _same_code(parts[0], mu.packed_sequence_mask_function, None)
                and _same_code(parts[1], mu.remap_positions_for_packed_sequence,
                               mu.causal_mask_function, None)):
            inner = _pattern(_cells(parts[1]).get("mask_function"), mu, packed_ok=False)
            seq_ids = _cells(parts[0]).get("packed_sequence_mask")
            if not isinstance(inner, str) and isinstance(seq_ids, torch.Tensor):
                return inner[0], seq_ids
    if mask_function is mu.bidirectional_mask_function or (
            _same_code(mask_function, mu.and_masks, mu.bidirectional_mask_function)
            and any(f is mu.bidirectional_mask_function
                    for f in _cells(mask_function).get("mask_functions", ()))):
        return "non-causal (bidirectional) attention"
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    return (f"the attention pattern {name!r} (only transformers' plain causal and "
            f"sliding-window causal masks, with padding or packed sequences, are computed by "
            f"triton_fused; extra or_mask_function/and_mask_function, block-wise, chunked or "
            f"bidirectional patterns are not)")


def _as_int(x):
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def mask_hook(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
              attention_mask=None, local_size=None, **kwargs):
    """transformers' ``AttentionMaskInterface`` entry for our name: returns a ``MaskInfo``."""
    _, mu = _transformers()
    if isinstance(attention_mask, MaskInfo):  # prepared in advance by generate(), passed back
        same = (attention_mask.unsupported is None
                and (attention_mask.batch_size, attention_mask.q_length,
                     attention_mask.kv_length, attention_mask.kv_offset)
                == (batch_size, q_length, kv_length, kv_offset)
                and attention_mask.q_offset == _as_int(q_offset))
        return attention_mask if same or attention_mask.unsupported else MaskInfo(
            unsupported="a prepared attention mask whose sizes do not match this forward")
    if mask_function is None:
        mask_function = mu.causal_mask_function
    pattern = _pattern(mask_function, mu)
    if isinstance(pattern, str):
        return MaskInfo(unsupported=pattern)
    window, seq_ids = pattern
    if local_size is not None and local_size != window:
        return MaskInfo(unsupported=f"a sliding window of {local_size} announced for a mask "
                                    f"whose pattern has window {window}")
    q_offset, kv_offset = _as_int(q_offset), int(kv_offset)
    info = MaskInfo(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                    q_offset=q_offset, kv_offset=kv_offset, window=window)
    end = q_offset + q_length  # one past the last query's absolute position
    if q_offset < kv_offset or end > kv_offset + kv_length:
        info.unsupported = (f"queries at positions [{q_offset}, {end}) outside the keys at "
                            f"[{kv_offset}, {kv_offset + kv_length}) (a cache layout "
                            f"triton_fused does not know)")
        return info
    info.kv_used = end - kv_offset  # keys after the last query are never visible (causal)
    device = kwargs.get("device")

    if seq_ids is not None:  # padding-free packed rows: one sequence per run of ids
        if attention_mask is not None or q_offset or kv_offset or q_length != kv_length or (
                tuple(seq_ids.shape) != (batch_size, q_length)):
            info.unsupported = "packed sequences combined with a padding mask or a cache"
            return info
        starts = torch.ones_like(seq_ids, dtype=torch.bool)
        starts[:, 1:] = seq_ids[:, 1:] != seq_ids[:, :-1]
        n = batch_size * q_length
        cu = torch.cat([starts.flatten().nonzero().flatten(),
                        torch.tensor([n], device=seq_ids.device)]).to(torch.int32)
        cu = cu.to(device or seq_ids.device)
        info.dense = False
        info.indices_q = info.indices_k = None  # every row is kept, in order
        info.cu_seqlens_q = info.cu_seqlens_k = cu
        info.max_seqlen_q = info.max_seqlen_k = int((cu[1:] - cu[:-1]).max().item()) if n else 0
        return info

    if attention_mask is None:
        return info  # dense: causal (+ window) over keys [0, kv_used)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
        info.unsupported = (f"an attention mask of shape {tuple(attention_mask.shape)} "
                            f"(expected a 2-D (batch, length) padding mask)")
        return info
    mask = attention_mask.to(device=device or attention_mask.device, dtype=torch.bool)
    if mask.shape[1] < kv_offset + kv_length:  # positions past the mask: not attended
        mask = torch.nn.functional.pad(mask, (0, kv_offset + kv_length - mask.shape[1]))
    valid_k = mask[:, kv_offset:kv_offset + kv_length].clone()
    valid_k[:, info.kv_used:] = False  # (batch, kv_length): indices into the layer's keys
    valid_q = mask[:, q_offset:end]
    if bool(valid_k[:, :info.kv_used].all()):
        return info  # no padding among the visible keys: dense
    if window is not None:
        # Packing keys drops the padding; a window counts positions, so packed indices must be
        # positions: the valid keys of each row must be one run (left or right padding).
        starts = valid_k.int().diff(dim=1).eq(1).sum(dim=1) + valid_k[:, 0].int()
        if bool((starts > 1).any()):
            info.unsupported = ("a sliding window over a padding mask with holes (padding "
                                "between tokens of one sequence)")
            return info
    seqlens_q = valid_q.sum(dim=1, dtype=torch.int32)
    seqlens_k = valid_k.sum(dim=1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=mask.device)
    info.dense = False
    info.indices_q = valid_q.flatten().nonzero().flatten()
    info.indices_k = valid_k.flatten().nonzero().flatten()
    info.cu_seqlens_q = torch.cat([zero, seqlens_q.cumsum(0, dtype=torch.int32)])
    info.cu_seqlens_k = torch.cat([zero, seqlens_k.cumsum(0, dtype=torch.int32)])
    info.max_seqlen_q = int(seqlens_q.max().item()) if batch_size else 0
    info.max_seqlen_k = int(seqlens_k.max().item()) if batch_size else 0
    return info


# --------------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------------
def _not_implemented(what):
    """The NotImplementedError for a feature the model asked for that we do not compute (it
    names the feature and points to the implementations that do)."""
    return NotImplementedError(f"attn_implementation='triton_fused' does not support {what}; "
                               f"{_HINT}")


def attention_function(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       sliding_window=None, is_causal=None, **kwargs):
    """transformers' ``AttentionInterface`` entry: q (batch, heads, q_len, head_dim), k, v
    (batch, heads_kv, k_len, head_dim) -> ((batch, q_len, heads, head_dim), None)."""
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise _not_implemented(what)
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise _not_implemented("a paged KV cache (continuous batching)")
    if kwargs.get("output_attentions"):
        warnings.warn("attn_implementation='triton_fused' never materialises the attention "
                      "weights: output_attentions=True returns None for them (use "
                      "attn_implementation='eager' to get them)", stacklevel=2)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise _not_implemented("non-causal attention (an encoder, cross-attention or "
                               "is_causal=False layer)")
    if value.shape[-1] != query.shape[-1]:
        raise _not_implemented(f"a value head_dim ({value.shape[-1]}) different from the query's "
                               f"({query.shape[-1]})")
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    dropout_p = float(dropout or 0.0)

    if attention_mask is None:
        # No mask from our hook (a model that does not build masks through transformers'
        # masking utilities): transformers' sdpa / flash semantics, causal with the layer's
        # window, bottom-right as flash_attention_2.
        info = MaskInfo(batch_size=batch, q_length=q_len, kv_length=k_len, window=sliding_window)
        info.kv_used = k_len
    elif isinstance(attention_mask, MaskInfo):
        info = attention_mask
        if info.unsupported:
            raise _not_implemented(info.unsupported)
        if (info.batch_size, info.q_length, info.kv_length) != (batch, q_len, k_len):
            raise _not_implemented(f"q {tuple(query.shape)}, k {tuple(key.shape)} with a mask "
                                   f"built for batch {info.batch_size}, q_len {info.q_length}, "
                                   f"k_len {info.kv_length}")
        if _effective(sliding_window, info.kv_used) != _effective(info.window, info.kv_used):
            raise _not_implemented(f"a layer with sliding_window={sliding_window} given a mask "
                                   f"with window {info.window} (transformers' implementations "
                                   f"disagree on which wins)")
    else:
        raise _not_implemented(f"an attention mask tensor of shape "
                               f"{tuple(getattr(attention_mask, 'shape', ()))} (a custom or "
                               f"pre-built mask; triton_fused reads the padding through its mask "
                               f"hook, registered by kernels.hf.register)")
    _check_flash_kwargs(kwargs, info)

    if info.dense:
        k, v = key, value
        if info.kv_used != k_len:
            k, v = key[:, :, :info.kv_used], value[:, :, :info.kv_used]
        out = ops.attention(query, k, v, causal=True, dropout_p=dropout_p,
                            softmax_scale=scaling, window=info.window)
        return out.transpose(1, 2), None

    # Packed: rows of (batch * len, heads, head_dim), the kept ones in order.
    heads_kv = key.shape[1]
    q = query.transpose(1, 2).reshape(batch * q_len, heads, head_dim)
    k = key.transpose(1, 2).reshape(batch * k_len, heads_kv, head_dim)
    v = value.transpose(1, 2).reshape(batch * k_len, heads_kv, head_dim)
    if info.indices_q is not None:
        q = q.index_select(0, info.indices_q)
        k, v = k.index_select(0, info.indices_k), v.index_select(0, info.indices_k)
    out = ops.attention_varlen(q, k, v, info.cu_seqlens_q, info.cu_seqlens_k,
                               info.max_seqlen_q, info.max_seqlen_k, causal=True,
                               dropout_p=dropout_p, softmax_scale=scaling, window=info.window)
    if info.indices_q is not None:
        full = out.new_zeros(batch * q_len, heads, head_dim)
        out = full.index_copy(0, info.indices_q, out)
    return out.view(batch, q_len, heads, head_dim), None


def _effective(window, kv_used):
    """A window that covers every visible key is no window."""
    return None if window is None or window >= kv_used else window


def _check_flash_kwargs(kwargs, info):
    """Padding-free batches can come with FlashAttention's cu_seq_lens_* kwargs; eager ignores
    them and reads the sequences from position_ids (our mask hook does the same). Refuse a
    disagreement instead of picking one."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return
    ours = None if info.dense else info.cu_seqlens_q
    for given in (cu_q, cu_k):
        if given is None:
            continue
        if (ours is None or info.indices_q is not None or given.numel() != ours.numel()
                or not torch.equal(given.to(ours.device, torch.int32), ours)):
            raise _not_implemented("cu_seq_lens_q/k that do not match the packed sequences the "
                                   "mask marks (transformers reads packed sequences from "
                                   "position_ids restarting at each one, only without an "
                                   "attention mask and without a cache: pass use_cache=False)")
