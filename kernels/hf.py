"""Our kernel as a Hugging Face transformers attention implementation.

::

    import kernels.hf
    kernels.hf.register()                      # once; name "triton_fused"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="triton_fused")
    # or, on an existing model: model.set_attn_implementation("triton_fused")

``register`` installs two things under one name (transformers >= 5.4, whose mask interface
passes ``q_length`` / ``q_offset``; imported lazily, so ``import kernels`` never needs
transformers):

* an attention function (``transformers.AttentionInterface``), called by every attention layer
  with q (batch, heads, q_len, head_dim) and k, v (batch, heads_kv, k_len, head_dim / v_dim); it
  returns (batch, q_len, heads, v_dim) and ``None`` weights, like transformers' own ``sdpa`` and
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
  ``i - window < j <= i``, the same as ``kernels.attention(window=...)``), e.g. Gemma 2/3/4,
  gpt-oss and Qwen2 sliding layers;
* chunked attention (Llama 4's ``chunked_attention`` layers, ``config.attention_chunk_size``):
  transformers' chunked mask, whose chunks start at each row's first token (after its left
  padding), as ``kernels.attention(chunk_size=...)`` over keys starting at a chunk boundary;
* attention logit soft-capping (the ``softcap`` keyword, Gemma 2's ``attn_logit_softcapping``:
  ``softcap * tanh(scaling * q·k / softcap)`` before the mask, as eager);
* attention sinks (the ``s_aux`` / ``sinks`` keyword: one learned logit per query head in every
  softmax denominator, no value, as gpt-oss' eager; differentiable);
* a value head_dim different from the query's (DeepSeek V2/V3 multi-head latent attention),
  head_dim up to 512 (Gemma 4's global layers);
* padding masks, left or right (or holes, without a sliding window or chunks), through
  ``kernels.attention_varlen``; query rows at padding positions return zeros, as with
  ``flash_attention_2`` (their value is undefined in transformers: eager gives garbage there);
* KV-cache generation (q_len != k_len, dynamic, sliding-window and static caches; our causal mask
  is aligned bottom-right, where the new queries are), and the query rows a model keeps of a
  mask (``mask[:, :, -n:, :]``, Gemma 4's KV-shared layers under ``generate``);
* non-causal layers (encoders such as BERT, encoder-decoder cross-attention, a decoder made
  bidirectional by ``is_causal=False``), whose masks transformers builds with
  ``create_bidirectional_mask``: every query sees every key the 2-D padding mask keeps, every
  query row computed (padding positions too, as eager), padding anywhere (holes too) through
  packed keys; a row whose keys are all padding gives zeros; and bidirectional sliding
  windows (``create_bidirectional_sliding_window_mask``, ModernBERT's local layers:
  ``|i - j| <= w``) with left or right padding;
* padding-free packed batches (``position_ids`` restarting inside a row, no attention mask),
  as each transformers version builds their mask (up to 5.22 over the tokens' indices in the
  row, from 5.23 over their position ids: the same attention but for chunks, which follow the
  version's own rule).

Any other pattern transformers' masking builds over a 2-D padding mask (extra mask functions:
image tokens, block-wise attention; windows or chunks over padding with holes; a chunked layer
whose cache dropped keys of the queries' chunk; cache layouts the fast paths do not know) goes
through transformers' whole boolean mask, read by the kernels as ``attn_mask`` (each query
tile visiting the key tiles from its first visible key to its last): exact, and said once per
kind in a ``UserWarning``. What raises ``NotImplementedError`` naming it, never a silently
different answer: a layer whose ``is_causal`` or ``sliding_window`` disagrees with
its mask, a custom 4-D mask or any mask transformers' masking utilities did not build through
our hook, sinks that are not one logit per query head, paged caches. T5's position bias
(``position_bias``) is an additive ``attn_mask``: on the native call without padding, added to
transformers' boolean mask over padding (sdpa's way); differentiable. A
layer called with no mask at all (a model that does not build masks through transformers'
masking utilities) gets causal attention with its ``sliding_window``, as with
``flash_attention_2``. ``output_attentions=True`` warns and returns ``None`` weights, as ``sdpa``.

Under ``torch.compile`` the hook reads nothing on the host while tracing (``_traced_padding``,
``_whole_mask``), so ``fullgraph=True`` compiles: plain causal or bidirectional masks with
padding become one dense call with a (batch, 1, 1, k_len) key-padding ``attn_mask`` (tile
bounds skip the padding at either end); any other pattern, and static
caches, transformers' own boolean mask read by the kernels (exact for any pattern, at sdpa's
cost of a (batch, q_len, k_len) mask).
"""
import inspect
import warnings
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import ops
from .core.mods import MaskMod, aux_ints
from .core.tensor_mask import TensorMask

NAME = "triton_fused"
_HINT = ("use attn_implementation='eager' or 'sdpa' for this model, or call kernels.attention "
         "directly")
# Keyword arguments some transformers models pass to attention functions that would change the
# result and that we cannot honour: raise when one is given (not None).
_UNSUPPORTED_KWARGS = {
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
    select it. Idempotent. Raises ImportError without transformers, or with a transformers
    older than 5.4 (its mask functions take ``cache_position``, which our hook does not read).
    """
    if not isinstance(name, str) or not name or "/" in name or ":" in name:
        raise ValueError(f"name must be a plain non-empty string without '/' or ':' (those "
                         f"name Hugging Face hub kernels), got {name!r}")
    transformers, masking_utils = _transformers()
    if "q_length" not in inspect.signature(masking_utils.sdpa_mask).parameters:
        raise ImportError(f"kernels.hf needs transformers >= 5.4 (mask functions called with "
                          f"q_length and q_offset); this is transformers "
                          f"{getattr(transformers, '__version__', '?')}, whose mask functions "
                          f"take cache_position: pip install 'transformers>=5.4'")
    transformers.AttentionInterface.register(name, attention_function)
    masking_utils.AttentionMaskInterface.register(name, mask_hook)


# --------------------------------------------------------------------------------------------
# The mask hook: what the model asked for, once per forward and mask type
# --------------------------------------------------------------------------------------------
class MaskInfo:
    """What our mask hook hands to every attention layer instead of a dense mask.

    ``unsupported``: None, or why the requested mask cannot be computed exactly (raised when a
    layer uses it). Otherwise the layers compute causal attention with ``window`` or
    ``chunk_size`` over their keys ``[kv_start, kv_used)`` (the keys of absolute positions
    ``kv_offset ...``; keys past the last query are never visible, keys before ``kv_start``
    are padding or before the queries' chunk), either densely (``dense``) or over the packed
    rows ``indices_q`` / ``indices_k`` of the flattened (batch * len) queries / keys with int32
    ``cu_seqlens_q`` / ``cu_seqlens_k``. ``valid_q`` (batch, q_length), packed layouts only:
    which query rows are kept (to re-derive the layout when a model keeps only the last query
    rows, see ``__getitem__``). ``cu_sequences``, padding-free packed sequences only: their own
    int32 cu_seqlens (``cu_seqlens_q`` may cut them further at a chunked layer's chunks), what
    FlashAttention's ``cu_seq_lens_q/k`` keywords must match.
    """
    # Mask-like duck typing for transformers' own plumbing: generate() calls .contiguous() on
    # masks it prepares in advance (static caches) and passes them back into the model, whose
    # mask creation reads .ndim (anything but 2 is not re-interpreted as a padding mask) and
    # hands it back to our hook.
    ndim = -1

    def __init__(self, *, batch_size=None, q_length=None, kv_length=None, q_offset=None,
                 kv_offset=None, window=None, chunk_size=None, unsupported=None, causal=True):
        self.unsupported = unsupported
        self.causal = causal
        self.batch_size, self.q_length, self.kv_length = batch_size, q_length, kv_length
        self.q_offset, self.kv_offset = q_offset, kv_offset
        self.window, self.chunk_size = window, chunk_size
        self.dense = True
        self.kv_start, self.kv_used = 0, None
        self.indices_q = self.indices_k = self.cu_seqlens_q = self.cu_seqlens_k = None
        self.max_seqlen_q = self.max_seqlen_k = None
        self.valid_q = None
        self.cu_sequences = None
        self.shift = None   # bidirectional windows: int32 (batch,), see _local_shift
        self.key_padding = None   # under torch.compile, a kernels.TensorMask: _traced_padding
        self.dense_mask = None    # transformers' whole mask, a kernels.TensorMask: _whole_mask
        self.whole_args = None    # _whole_mask's arguments (the hook's), for whole_mask()
        self.kept_from = None     # (parent MaskInfo, rows dropped): mask[:, :, -n:, :]
        self._whole = None        # whole_mask(), once computed
        self._biased = None       # (position bias, its additive mask): biased()

    def contiguous(self):
        return self

    def whole_mask(self):
        """transformers' boolean mask of this pattern, (batch or 1, 1, q_length, kv_length):
        the whole-mask path's, or built once from the hook's arguments (``_whole_mask``) for
        a layer that needs it (a position bias over padding)."""
        if self.dense_mask is not None:
            return self.dense_mask.mask
        if self._whole is None and self.kept_from is not None:   # the parent's last rows
            parent, drop = self.kept_from
            self._whole = parent.whole_mask()[:, :, drop:]
        if self._whole is None:
            if self.whole_args is None:
                raise _not_implemented("this layer's mask as a tensor (the mask was not built "
                                       "by our hook from a padding mask)")
            self._whole = _whole_mask(**self.whole_args).dense_mask.mask
        return self._whole

    def biased(self, position_bias, mask):
        """``_biased(position_bias, mask)``, built once per position bias tensor: T5 passes one
        to every layer, which then share one additive mask (and its tile bounds)."""
        if self._biased is None or self._biased[0] is not position_bias:
            self._biased = (position_bias, _biased(position_bias, mask))
        return self._biased[1]

    def __getitem__(self, key):
        """``mask[:, :, -n:, :]``: the mask of the last ``n`` query rows only (Gemma 4 keeps the
        last ``logits_to_keep`` rows of its masks for its KV-shared layers under ``generate``).
        The keys and the bottom-right alignment are unchanged: the last query stays where it
        was. Any other index gives a MaskInfo that raises when a layer uses it."""
        rows = _kept_query_rows(key, self.q_length)
        if self.unsupported or rows == self.q_length:
            return self
        if self.shift is not None:
            return MaskInfo(unsupported="keeping only some query rows of a bidirectional "
                                        "sliding window")
        if rows is None:
            return MaskInfo(unsupported=f"an attention mask indexed with {key!r} (only the last "
                                        f"query rows, mask[:, :, -n:, :], are understood)")
        if not self.dense and self.indices_q is None:
            return MaskInfo(unsupported="keeping only some query rows of packed sequences")
        drop = self.q_length - rows
        out = MaskInfo(batch_size=self.batch_size, q_length=rows, kv_length=self.kv_length,
                       q_offset=None if self.q_offset is None else self.q_offset + drop,
                       kv_offset=self.kv_offset, window=self.window,
                       chunk_size=self.chunk_size, causal=self.causal)
        out.dense, out.kv_start, out.kv_used = self.dense, self.kv_start, self.kv_used
        if self.dense_mask is not None:   # the rows read in place, with bounds of their own
            out.dense_mask = TensorMask(self.dense_mask.mask[:, :, drop:])
        out.kept_from = (self, drop)
        if self.key_padding is not None:
            out.key_padding = self.key_padding
            out.valid_q = None if self.valid_q is None else self.valid_q[:, drop:]
        if not self.dense:
            out.indices_k, out.cu_seqlens_k = self.indices_k, self.cu_seqlens_k
            out.max_seqlen_k = self.max_seqlen_k
            out.valid_q = self.valid_q[:, drop:]
            out.indices_q, out.cu_seqlens_q, out.max_seqlen_q = _packed_rows(out.valid_q)
        return out

    def __repr__(self):
        if self.unsupported:
            return f"MaskInfo(unsupported={self.unsupported!r})"
        layout = ("dense" if self.dense
                  else f"packed, cu_seqlens_k={self.cu_seqlens_k.tolist()}")
        return (f"MaskInfo({'causal' if self.causal else 'bidirectional'}, "
                f"window={self.window}, chunk_size={self.chunk_size}, "
                f"batch={self.batch_size}, q_length={self.q_length}, "
                f"kv_length={self.kv_length}, q_offset={self.q_offset}, "
                f"kv_offset={self.kv_offset}, kv_start={self.kv_start}, {layout})")


def _kept_query_rows(key, q_length):
    """How many query rows ``mask[key]`` keeps when ``key`` selects the last rows of a
    (batch, 1, q_length, kv_length) mask and nothing else; None for any other index."""
    full = slice(None)
    if not (isinstance(key, tuple) and len(key) == 4 and key[0] == full and key[1] == full
            and key[3] == full and isinstance(key[2], slice) and key[2].step in (None, 1)):
        return None
    kept = range(q_length)[key[2]]
    if len(kept) == 0 or kept.stop != q_length:
        return None
    return len(kept)


def _cells(fn):
    """The closure variables of ``fn`` by name."""
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    return dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__)))


def _same_code(fn, factory, *args):
    """Whether ``fn`` is a closure made by transformers' ``factory`` (same code object); False
    when this transformers has no such factory."""
    if factory is None:
        return False
    return getattr(fn, "__code__", None) is factory(*args).__code__


def _positive_int(x):
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


class _Pattern(NamedTuple):
    """A mask pattern the kernels compute: causal, with at most one of ``window`` and
    ``chunk_size``, or (``causal`` False) bidirectional: every key. ``left_padding``
    (chunked): transformers' count of padding tokens before each row's first token, where its
    chunks start. ``seq_ids`` / ``positions``: padding-free packed sequences (their ids, and
    the position ids transformers remaps the pattern to, or None where it applies the pattern
    to the tokens' indices in the row: transformers <= 5.22)."""
    window: Optional[int] = None
    chunk_size: Optional[int] = None
    left_padding: Optional[torch.Tensor] = None
    seq_ids: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    causal: bool = True


def _pattern(mask_function, mu, *, packed_ok=True):
    """Read transformers' mask function: a ``_Pattern``, or a str saying why it is not a
    pattern we compute exactly. Only the closures transformers' own mask creation builds are
    recognised; anything else is refused."""
    if mask_function is mu.causal_mask_function:
        return _Pattern()
    if mask_function is mu.bidirectional_mask_function:
        return _Pattern(causal=False)
    if _same_code(mask_function, mu.and_masks, mu.bidirectional_mask_function):
        # sliding_window_bidirectional_mask_function(w) = and_masks(overlay(w), bidirectional):
        # |q - kv| <= w (ModernBERT's local layers), kept as the window w + 1 of the
        # layers' sliding_window keyword (FlashAttention's window_size (w, w)).
        parts = _cells(mask_function).get("mask_functions", ())
        overlay = getattr(mu, "sliding_window_bidirectional_overlay", None)
        if (len(parts) == 2 and parts[1] is mu.bidirectional_mask_function
                and _same_code(parts[0], overlay, 1)):
            w = _cells(parts[0]).get("sliding_window")
            if isinstance(w, int) and not isinstance(w, bool) and w >= 0:
                return _Pattern(causal=False, window=w + 1)
    if _same_code(mask_function, mu.and_masks, mu.causal_mask_function):
        parts = _cells(mask_function).get("mask_functions", ())
        if len(parts) == 2 and parts[1] is mu.causal_mask_function:
            overlay, cells = parts[0], _cells(parts[0])
            # sliding_window_causal_mask_function(w) = and_masks(sliding_window_overlay(w), causal)
            if _same_code(overlay, mu.sliding_window_overlay, 1):
                if _positive_int(cells.get("sliding_window")):
                    return _Pattern(window=cells["sliding_window"])
            # chunked_causal_mask_function(c, left_padding) = and_masks(chunked_overlay, causal)
            if _same_code(overlay, getattr(mu, "chunked_overlay", None), 1, None):
                left_padding = cells.get("left_padding")
                if (_positive_int(cells.get("chunk_size"))
                        and isinstance(left_padding, torch.Tensor) and left_padding.dim() == 1):
                    return _Pattern(chunk_size=cells["chunk_size"], left_padding=left_padding)
        if packed_ok and len(parts) == 2:
            packed = _packed_pattern(parts, mu)
            if packed is not None:
                return packed
    if (_same_code(mask_function, mu.and_masks, mu.bidirectional_mask_function)
            and any(f is mu.bidirectional_mask_function
                    for f in _cells(mask_function).get("mask_functions", ()))):
        return ("a bidirectional mask combined with another mask function "
                "(and_mask_function: a bidirectional sliding window, image tokens, ...)")
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    return (f"the attention pattern {name!r} (only transformers' plain causal, sliding-window "
            f"causal and chunked causal masks, with padding or packed sequences, and its plain "
            f"bidirectional mask with padding are computed by triton_fused; extra "
            f"or_mask_function/and_mask_function and block-wise patterns are not)")


def _packed_pattern(parts, mu):
    """The ``_Pattern`` of transformers' padding-free packed-sequence mask, ``and_masks(*parts)``
    with one part ``packed_sequence_mask_function(ids)``; None if ``parts`` is not one.

    transformers builds it three ways, all recognised (the order of ``and_masks`` does not
    matter): up to 5.22 ``and_masks(pattern, packed ids)``, the pattern over the tokens' indices
    in the row; 5.23 ``packed_sequence_compatibility_function``, ``and_masks(packed ids,
    remap_positions_for_packed_sequence(pattern, position_ids))``; 5.24
    ``and_masks(remap_positions_for_packed_sequence(pattern, position_ids), packed ids)``, the
    pattern over the tokens' position ids. ``positions`` is None for the first (row indices)."""
    packed_fn = getattr(mu, "packed_sequence_mask_function", None)
    if _same_code(parts[1], packed_fn, None):
        other, ids_fn = parts
    elif _same_code(parts[0], packed_fn, None):
        ids_fn, other = parts
    else:
        return None
    seq_ids, positions = _cells(ids_fn).get("packed_sequence_mask"), None
    if _same_code(other, getattr(mu, "remap_positions_for_packed_sequence", None),
                  mu.causal_mask_function, None):
        remap = _cells(other)
        other, positions = remap.get("mask_function"), remap.get("position_ids")
        if not isinstance(positions, torch.Tensor):
            return None
    inner = _pattern(other, mu, packed_ok=False)
    if isinstance(inner, str) or not isinstance(seq_ids, torch.Tensor):
        return None
    return inner._replace(seq_ids=seq_ids, positions=positions)


def _as_int(x):
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _packed_rows(valid):
    """The packed layout of the True entries of ``valid`` (batch, len): their indices in the
    flattened (batch * len) rows, int32 cu_seqlens (one sequence per batch row) and the
    longest sequence."""
    lengths = valid.sum(dim=1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=valid.device)
    cu = torch.cat([zero, lengths.cumsum(0, dtype=torch.int32)])
    longest = int(lengths.max().item()) if valid.shape[0] else 0
    return valid.flatten().nonzero().flatten(), cu, longest


def _runs(valid):
    """(batch,) the number of runs of consecutive True entries in each row of ``valid``."""
    if valid.shape[1] == 0:
        return valid.new_zeros(valid.shape[0], dtype=torch.long)
    return valid.int().diff(dim=1).eq(1).sum(dim=1) + valid[:, 0].int()


def mask_hook(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
              attention_mask=None, local_size=None, **kwargs):
    """transformers' ``AttentionMaskInterface`` entry for our name: returns a ``MaskInfo``.

    The patterns ``_layout_of`` computes take the fast layouts (dense, or packed rows with
    tile skipping); any other pattern transformers' masking builds over a 2-D padding mask
    (extra mask functions such as image tokens, block-wise attention, windows or chunks over
    padding with holes, cache layouts the fast ones do not know) goes through its whole mask
    (``_whole_mask``), said once per kind in a ``UserWarning``; under torch.compile so does
    every pattern whose reading would break the graph."""
    _, mu = _transformers()
    if isinstance(attention_mask, MaskInfo):
        return _layout_of(mu, batch_size, q_length, kv_length, q_offset, kv_offset,
                          mask_function, attention_mask, local_size, kwargs)
    whole = dict(mu=mu, batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                 q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                 attention_mask=attention_mask, local_size=local_size,
                 device=kwargs.get("device"))
    if torch.compiler.is_compiling() and (
            isinstance(q_offset, torch.Tensor) or mask_function not in (
                None, mu.causal_mask_function, mu.bidirectional_mask_function)):
        return _whole_mask(**whole)
    info = _layout_of(mu, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                      attention_mask, local_size, kwargs)
    if info.unsupported and (attention_mask is None or (
            attention_mask.dim() == 2 and attention_mask.shape[0] == batch_size)):
        reason = info.unsupported
        if reason not in _WHOLE_MASK_SAID:
            _WHOLE_MASK_SAID.add(reason)
            warnings.warn(f"attn_implementation='triton_fused' computes {reason} through "
                          f"transformers' whole boolean mask: exact, the mask at sdpa's cost "
                          f"(bool (batch, q_len, k_len)), each query tile visiting the key "
                          f"tiles from its first visible key to its last. Said once.",
                          UserWarning, stacklevel=3)
        return _whole_mask(**whole)
    info.whole_args = whole     # for a layer that needs the mask itself (a position bias)
    return info


# The kinds of pattern already said to go through the whole mask (one warning each).
_WHOLE_MASK_SAID = set()


def _layout_of(mu, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
               attention_mask, local_size, kwargs):
    """The fast layout of a mask request (``MaskInfo``, its ``unsupported`` set where the
    pattern is not one of ours)."""
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
    if not pattern.causal:
        return _bidirectional(batch_size, q_length, kv_length, _as_int(q_offset),
                              int(kv_offset), attention_mask, kwargs.get("device"),
                              pattern.window, local_size)
    window, chunk = pattern.window, pattern.chunk_size
    extent = window if window is not None else chunk
    if local_size is not None and local_size != extent:
        what = "chunk size" if chunk is not None else "window"
        return MaskInfo(unsupported=f"a local size of {local_size} announced for a mask whose "
                                    f"pattern has {what} {extent}")
    q_offset, kv_offset = _as_int(q_offset), int(kv_offset)
    info = MaskInfo(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                    q_offset=q_offset, kv_offset=kv_offset, window=window, chunk_size=chunk)
    end = q_offset + q_length  # one past the last query's absolute position
    if q_offset < kv_offset or end > kv_offset + kv_length:
        info.unsupported = (f"queries at positions [{q_offset}, {end}) outside the keys at "
                            f"[{kv_offset}, {kv_offset + kv_length}) (a cache layout "
                            f"triton_fused does not know)")
        return info
    info.kv_used = end - kv_offset  # keys after the last query are never visible (causal)
    device = kwargs.get("device")

    if pattern.seq_ids is not None:
        return _packed_sequences(info, pattern, attention_mask, device)

    if attention_mask is None:
        if chunk is None:
            return info  # dense: causal (+ window) over keys [0, kv_used)
        dev = device or pattern.left_padding.device
        valid_q = torch.ones(batch_size, q_length, dtype=torch.bool, device=dev)
        valid_k = torch.ones(batch_size, kv_length, dtype=torch.bool, device=dev)
        valid_k[:, info.kv_used:] = False
    else:
        mask = _padding_mask(info, attention_mask, device)
        if mask is None:
            return info
        if chunk is None and torch.compiler.is_compiling():
            return _traced_padding(info, mask[:, kv_offset:kv_offset + kv_length],
                                   mask[:, q_offset:end])
        valid_k = mask[:, kv_offset:kv_offset + kv_length].clone()
        valid_k[:, info.kv_used:] = False  # (batch, kv_length): indices into the layer's keys
        valid_q = mask[:, q_offset:end]
    if chunk is not None:
        valid_k = _keys_of_chunks(info, pattern.left_padding, valid_q, valid_k)
        if info.unsupported:
            return info
    elif window is not None and bool((_runs(valid_k) > 1).any()):
        # Packing keys drops the padding; a window counts positions, so packed indices must be
        # positions: the valid keys of each row must be one run (left or right padding).
        info.unsupported = ("a sliding window over a padding mask with holes (padding "
                            "between tokens of one sequence)")
        return info
    return _layout(info, valid_q, valid_k)


def _whole_mask(mu, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                attention_mask, local_size, device):
    """transformers' own boolean mask (``sdpa_mask``, traced as sdpa's is), read by the
    kernels as a ``TensorMask`` (``attention(attn_mask=)``) in one dense call: for a pattern
    the fast layouts do not compute, and under torch.compile for one whose reading (a window,
    chunks, packed sequences, extra mask functions: closures Dynamo does not trace) or a query
    offset held in a tensor (static caches) would break the graph. Exact for any pattern
    transformers builds (query rows at padding are computed as eager computes them). Costs
    sdpa's bool (batch, q_length, kv_length) mask, read in place, and the key tiles each query
    tile's rows see from the first visible key to the last (the mask's tile bounds, computed
    once per mask; gaps in between are visited and masked)."""
    mask = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                        attention_mask=attention_mask, local_size=local_size,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                        device=device)
    info = MaskInfo(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                    q_offset=None, kv_offset=int(kv_offset), causal=None)
    info.kv_used = kv_length
    info.dense_mask = TensorMask(mask.expand(batch_size, 1, q_length, kv_length))
    return info


def _traced_padding(info, valid_k, valid_q):
    """Under torch.compile, where the packed layout's host read of the mask would break the
    graph (``fullgraph=True``: an error): one dense call over the keys [0, kv_used), the key
    padding a bool ``attn_mask`` (batch, 1, 1, kv_used) read in place (its tile bounds, a few
    reductions once per forward, skip the key tiles before a row's first kept key and after its
    last), and the query rows at padding zeroed after it (causal layers; ``valid_q`` None:
    every row kept), as the packed path returns them. More work than packing a padded batch
    (holes inside a row are visited); no host read."""
    info.key_padding = TensorMask(valid_k[:, None, None, :info.kv_used])
    info.valid_q = valid_q
    return info


def _padding_mask(info, attention_mask, device):
    """The 2-D padding mask as bool (batch, >= kv_offset + kv_length) on ``device`` (positions
    past its end: not attended), or None with ``info.unsupported`` set for any other mask."""
    if attention_mask.dim() != 2 or attention_mask.shape[0] != info.batch_size:
        info.unsupported = (f"an attention mask of shape {tuple(attention_mask.shape)} "
                            f"(expected a 2-D (batch, length) padding mask)")
        return None
    mask = attention_mask.to(device=device or attention_mask.device, dtype=torch.bool)
    end = info.kv_offset + info.kv_length
    if mask.shape[1] < end:
        mask = torch.nn.functional.pad(mask, (0, end - mask.shape[1]))
    return mask


def _bidirectional(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask,
                   device, window=None, local_size=None):
    """Non-causal layers (encoders, cross-attention; transformers' ``bidirectional_mask``):
    every query sees every key the 2-D padding mask keeps; the mask marks keys only, so every
    query row is computed, padding positions included, as eager and sdpa compute them. No
    position enters the pattern, so padding anywhere (holes too) packs exactly.

    ``window`` (a bidirectional sliding window, ``|q - kv| < window``): positions matter, so
    the queries must be the keys (self-attention, no cache) and each row's kept keys one run
    (left or right padding); ``info.shift`` then places the packed keys (``_local_shift``)."""
    info = MaskInfo(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                    q_offset=q_offset, kv_offset=kv_offset, causal=False, window=window)
    info.kv_used = kv_length
    if window is not None:
        if local_size is not None and local_size + 1 != window:
            info.unsupported = (f"a local size of {local_size} announced for a bidirectional "
                                f"window of {window - 1} positions each side")
            return info
        if q_offset or kv_offset or q_length != kv_length:
            info.unsupported = ("a bidirectional sliding window over a cache or between "
                                "different query and key sequences")
            return info
    mask = None if attention_mask is None else _padding_mask(info, attention_mask, device)
    if mask is not None and window is None and torch.compiler.is_compiling():
        return _traced_padding(info, mask[:, kv_offset:kv_offset + kv_length], None)
    if mask is None:
        if window is not None and not info.unsupported:
            info.shift = torch.zeros(batch_size, dtype=torch.int32,
                                     device=device or torch.get_default_device())
        return info
    valid_k = mask[:, kv_offset:kv_offset + kv_length]
    if window is not None and bool((_runs(valid_k) > 1).any()):
        info.unsupported = ("a bidirectional sliding window over a padding mask with holes "
                            "(padding between tokens of one sequence)")
        return info
    valid_q = torch.ones(batch_size, q_length, dtype=torch.bool, device=mask.device)
    info = _layout(info, valid_q, valid_k)
    if window is not None:
        info.shift = _local_shift(info, valid_k)
    return info


def _local_shift(info, valid_k):
    """int32 (batch,): how far each row's packed keys sit from its queries' positions.

    Row b's queries are all its q_length rows (query i at position i); its keys are the run of
    n_b kept positions starting at a_b (dense: the keys [kv_start, kv_used) of every row).
    The kernels see query i at i + n_b - q_length (bottom-right) and key t at t, so query i
    at position i sees the key at a_b + t iff |(q_idx + shift_b) - t| < window with
    shift_b = q_length - n_b - a_b."""
    if info.dense:
        n = info.kv_used - info.kv_start
        return torch.full((info.batch_size,), info.q_length - n - info.kv_start,
                          dtype=torch.int32, device=valid_k.device)
    n = valid_k.sum(dim=1)
    first = valid_k.int().argmax(dim=1)
    return (info.q_length - n - first).to(torch.int32)


def _keys_of_chunks(info, left_padding, valid_q, valid_k):
    """Chunked layers: ``valid_k`` without the keys before each row's first chunk that one of
    its queries is in (sets ``info.unsupported`` where that cannot be computed exactly).

    transformers counts chunks from each row's first token (after its ``left_padding``); the
    kernel counts them from the first key it is given (``j // chunk_size``, with the queries
    at the last positions). So every row must start its keys at one of its chunk boundaries:
    the start of its first query's chunk (keys before it are invisible to all its queries),
    and its kept keys must be one run of consecutive positions from there."""
    size, batch, dev = info.chunk_size, info.batch_size, valid_k.device
    left_padding = left_padding.to(device=dev, dtype=torch.long)
    if tuple(left_padding.shape) != (batch,):
        info.unsupported = (f"a chunked mask with left padding of shape "
                            f"{tuple(left_padding.shape)} for a batch of {batch}")
        return valid_k
    has_q = valid_q.any(dim=1)
    first_q = info.q_offset + valid_q.int().argmax(dim=1)  # absolute position of the first query
    start = left_padding + torch.div(first_q - left_padding, size, rounding_mode="floor") * size
    if bool((has_q & (start < info.kv_offset)).any()):
        info.unsupported = (f"a chunked layer whose cache no longer holds the first keys of the "
                            f"queries' chunk (keys from position {info.kv_offset}, chunks of "
                            f"{size})")
        return valid_k
    positions = info.kv_offset + torch.arange(info.kv_length, device=dev)
    valid_k = valid_k & (positions >= start[:, None]) & has_q[:, None]
    first_k = info.kv_offset + valid_k.int().argmax(dim=1)
    if bool(((_runs(valid_k) > 1) | (valid_k.any(dim=1) & (first_k != start))).any()):
        info.unsupported = ("chunked attention over a padding mask with holes (padding "
                            "between tokens of one sequence)")
    return valid_k


def _layout(info, valid_q, valid_k):
    """Dense or packed, given the kept queries (batch, q_length) and keys (batch, kv_length)."""
    kept = valid_k[:, :info.kv_used]
    row = kept[0]
    if bool(row.any()):
        first = int(row.int().argmax().item())
        # Dense when every row keeps the same run of keys up to the last query and every query:
        # one call over keys [first, kv_used), the causal diagonal bottom-right.
        if bool(row[first:].all()) and bool((kept == row).all()) and bool(valid_q.all()):
            info.kv_start = first
            return info
    info.dense = False
    info.valid_q = valid_q
    info.indices_q, info.cu_seqlens_q, info.max_seqlen_q = _packed_rows(valid_q)
    info.indices_k, info.cu_seqlens_k, info.max_seqlen_k = _packed_rows(valid_k)
    return info


def _packed_sequences(info, pattern, attention_mask, device):
    """Padding-free packed rows: one sequence per run of ids, every row kept in order.

    Chunked layers: transformers puts a token in chunk ``(c - left_padding) // chunk_size`` of
    its row, ``c`` its position id (``pattern.positions``) or its index in the row (transformers
    <= 5.22). Inside one sequence ``c`` goes up by one per token (a new sequence starts wherever
    the position ids do not), so cutting the sequences where a chunk starts leaves segments that
    each hold one chunk of one sequence, no longer than ``chunk_size``: causal attention within
    each segment is exactly transformers' mask, wherever the sequences start."""
    seq_ids, batch_size, q_length = pattern.seq_ids, info.batch_size, info.q_length
    if attention_mask is not None or info.q_offset or info.kv_offset or (
            q_length != info.kv_length or tuple(seq_ids.shape) != (batch_size, q_length)):
        info.unsupported = "packed sequences combined with a padding mask or a cache"
        return info
    starts = torch.ones_like(seq_ids, dtype=torch.bool)
    starts[:, 1:] = seq_ids[:, 1:] != seq_ids[:, :-1]
    n = batch_size * q_length
    cu_sequences = _starts_to_cu(starts, device)
    if pattern.chunk_size is not None:
        coords = pattern.positions
        if coords is None:
            coords = torch.arange(q_length, device=seq_ids.device)[None]
        left_padding = pattern.left_padding
        if (coords.dim() != 2 or coords.shape[0] not in (1, batch_size)
                or coords.shape[1] != q_length or tuple(left_padding.shape) != (batch_size,)):
            info.unsupported = (f"chunked attention over packed sequences with position ids of "
                                f"shape {tuple(coords.shape)} and left padding of shape "
                                f"{tuple(left_padding.shape)} for a batch of {batch_size} rows "
                                f"of {q_length}")
            return info
        coords = coords.to(seq_ids.device) - left_padding.to(seq_ids.device)[:, None]
        starts = starts | torch.remainder(coords, pattern.chunk_size).eq(0)
    cu = _starts_to_cu(starts, device)
    info.dense = False
    info.indices_q = info.indices_k = None  # every row is kept, in order
    info.cu_seqlens_q = info.cu_seqlens_k = cu
    info.cu_sequences = cu_sequences
    info.max_seqlen_q = info.max_seqlen_k = int((cu[1:] - cu[:-1]).max().item()) if n else 0
    return info


def _starts_to_cu(starts, device):
    """int32 cu_seqlens of the flattened (batch, len) rows cut before every True of ``starts``
    (each row's first entry is True)."""
    n = starts.numel()
    cu = torch.cat([starts.flatten().nonzero().flatten(),
                    torch.tensor([n], device=starts.device)]).to(torch.int32)
    return cu.to(device or starts.device)


# --------------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------------
# A bidirectional sliding window over packed or sliced keys: query q_idx (the kernels'
# bottom-right position) sits at q_idx + shift[b] among its row's keys, and sees the keys at
# most aux[0][0] positions away on either side (``_local_shift``).
@triton.jit
def _local_fn(b, h, q_idx, kv_idx, aux):
    reach = tl.load(aux[0])
    pos = q_idx + tl.load(aux[1] + b)
    return (kv_idx >= pos - reach) & (kv_idx <= pos + reach)


@triton.jit
def _local_keys(b, q_lo, q_hi, aux):
    reach = tl.load(aux[0])
    shift = tl.load(aux[1] + b)
    return q_lo + shift - reach, q_hi + shift + reach


@triton.jit
def _local_queries(b, kv_lo, kv_hi, aux):
    reach = tl.load(aux[0])
    shift = tl.load(aux[1] + b)
    return kv_lo - shift - reach, kv_hi - shift + reach


def _local_torch(b, h, q_idx, kv_idx, aux):
    reach = aux[0].reshape(-1)[0]
    pos = q_idx + aux[1].reshape(-1)[b]
    return (kv_idx >= pos - reach) & (kv_idx <= pos + reach)


LOCAL_WINDOW = MaskMod("hf.bidirectional_window", _local_fn, _local_torch,
                       kv_range=_local_keys, q_range=_local_queries)


def _biased(position_bias, mask):
    """A position bias (batch or 1, heads, q_len, k_len) as an additive mask over the boolean
    ``mask`` (batch or 1, 1, q_len, k_len): -inf where the mask hides (sdpa's
    ``create_position_bias_mask``, with -inf for its dtype's min); differentiable in the bias."""
    return position_bias.masked_fill(~mask, float("-inf"))


def _not_implemented(what):
    """The NotImplementedError for a feature the model asked for that we do not compute (it
    names the feature and points to the implementations that do)."""
    return NotImplementedError(f"attn_implementation='triton_fused' does not support {what}; "
                               f"{_HINT}")


def _sinks_of(s_aux, sinks, heads):
    """The per-head sink logits a layer passes (gpt-oss and its kin pass ``s_aux``, others
    ``sinks``), or None. Only one logit per query head is the kernels' (and gpt-oss eager's)
    sink; other shapes mean something else and are refused."""
    given = [t for t in (s_aux, sinks) if t is not None]
    if not given:
        return None
    if len(given) == 2 and given[0] is not given[1]:
        raise _not_implemented("two different attention sinks (both s_aux and sinks)")
    t = given[0]
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (heads,):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise _not_implemented(f"attention sinks of shape {shape} (only one sink logit per "
                               f"query head, shape ({heads},), is computed)")
    return t


def attention_function(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       sliding_window=None, is_causal=None, softcap=None, s_aux=None,
                       sinks=None, **kwargs):
    """transformers' ``AttentionInterface`` entry: q (batch, heads, q_len, head_dim), k
    (batch, heads_kv, k_len, head_dim), v (batch, heads_kv, k_len, v_dim) ->
    ((batch, q_len, heads, v_dim), None)."""
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise _not_implemented(what)
    position_bias = kwargs.get("position_bias")   # T5's relative bias, added to the scores
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise _not_implemented("a paged KV cache (continuous batching)")
    if kwargs.get("output_attentions"):
        warnings.warn("attn_implementation='triton_fused' never materialises the attention "
                      "weights: output_attentions=True returns None for them (use "
                      "attn_implementation='eager' to get them)", stacklevel=2)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    batch, heads, q_len, head_dim = query.shape
    k_len, v_dim = key.shape[2], value.shape[-1]
    sinks = _sinks_of(s_aux, sinks, heads)
    dropout_p = float(dropout or 0.0)

    if attention_mask is None:
        # No mask from our hook (a model that does not build masks through transformers'
        # masking utilities, or cross-attention without an encoder mask): transformers' sdpa /
        # flash semantics, causal with the layer's window, bottom-right as flash_attention_2,
        # or every key for a non-causal layer.
        info = MaskInfo(batch_size=batch, q_length=q_len, kv_length=k_len, causal=causal,
                        window=sliding_window)
        info.kv_used = k_len
        if not causal and sliding_window is not None:
            if q_len != k_len:
                raise _not_implemented(f"a sliding window ({sliding_window}) on a non-causal "
                                       f"layer whose queries are not its keys")
            info.shift = torch.zeros(batch, dtype=torch.int32, device=query.device)
    elif isinstance(attention_mask, MaskInfo):
        info = attention_mask
        if info.unsupported:
            raise _not_implemented(info.unsupported)
        if info.dense_mask is not None:   # the whole mask decides (``_whole_mask``)
            if info.dense_mask.shape != (batch, 1, q_len, k_len):
                raise _not_implemented(f"q {tuple(query.shape)}, k {tuple(key.shape)} with a "
                                       f"mask of shape {info.dense_mask.shape}")
            if info.dense_mask.device != query.device:
                info.dense_mask = TensorMask(info.dense_mask.mask.to(query.device))
            mask = info.dense_mask if position_bias is None else info.biased(
                position_bias, info.dense_mask.mask)
            out = ops.attention(query, key, value, causal=False, dropout_p=dropout_p,
                                softmax_scale=scaling, softcap=softcap, sinks=sinks,
                                attn_mask=mask)
            return out.transpose(1, 2), None
        if (info.batch_size, info.q_length, info.kv_length) != (batch, q_len, k_len):
            raise _not_implemented(f"q {tuple(query.shape)}, k {tuple(key.shape)} with a mask "
                                   f"built for batch {info.batch_size}, q_len {info.q_length}, "
                                   f"k_len {info.kv_length}")
        if info.causal != bool(causal):
            layer, mask = ("causal", "bidirectional") if causal else ("non-causal", "causal")
            raise _not_implemented(f"a {layer} layer given a {mask} mask (is_causal "
                                   f"disagrees with the mask the model built)")
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
    # A non-causal layer's window is two-sided: the LOCAL_WINDOW mask mod, not ours.
    options = dict(causal=info.causal, dropout_p=dropout_p, softmax_scale=scaling,
                   window=info.window if info.causal else None, chunk_size=info.chunk_size,
                   softcap=softcap, sinks=sinks)
    if not info.causal and _effective(info.window, info.kv_used) is not None:
        options.update(mask_mod=LOCAL_WINDOW, mod_aux=(
            aux_ints((info.window - 1,), query.device), info.shift.to(query.device)))

    if position_bias is not None and not (info.dense and info.key_padding is None
                                          and "mask_mod" not in options):
        # A bias over padding or a two-sided window: one dense call over transformers'
        # boolean mask with the bias (sdpa's way), its -inf entries hiding what it hides.
        mask = info.whole_mask().to(query.device)
        options.update(causal=False, window=None, chunk_size=None, mask_mod=None, mod_aux=())
        out = ops.attention(query, key, value, attn_mask=info.biased(position_bias, mask),
                            **options)
        return out.transpose(1, 2), None

    if info.dense:
        k, v = key, value
        if (info.kv_start, info.kv_used) != (0, k_len):
            k = key[:, :, info.kv_start:info.kv_used]
            v = value[:, :, info.kv_start:info.kv_used]
        if info.key_padding is not None:
            options["attn_mask"] = info.key_padding
        if position_bias is not None:    # the bias as an additive mask, the rest native
            options["attn_mask"] = position_bias[..., info.kv_start:info.kv_used]
        out = ops.attention(query, k, v, **options).transpose(1, 2)
        if info.key_padding is not None and info.valid_q is not None:
            out = torch.where(info.valid_q[:, :, None, None], out, out.new_zeros(()))
        return out, None

    # Packed: rows of (batch * len, heads, head_dim), the kept ones in order.
    heads_kv = key.shape[1]
    q = query.transpose(1, 2).reshape(batch * q_len, heads, head_dim)
    k = key.transpose(1, 2).reshape(batch * k_len, heads_kv, head_dim)
    v = value.transpose(1, 2).reshape(batch * k_len, heads_kv, v_dim)
    # Every query row kept (bidirectional layers): they are all the rows, in order.
    select_q = info.indices_q is not None and info.indices_q.numel() != batch * q_len
    if select_q:
        q = q.index_select(0, info.indices_q)
    if info.indices_k is not None:
        k, v = k.index_select(0, info.indices_k), v.index_select(0, info.indices_k)
    out = ops.attention_varlen(q, k, v, info.cu_seqlens_q, info.cu_seqlens_k,
                               info.max_seqlen_q, info.max_seqlen_k, **options)
    if select_q:
        full = out.new_zeros(batch * q_len, heads, v_dim)
        out = full.index_copy(0, info.indices_q, out)
    return out.view(batch, q_len, heads, v_dim), None


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
    # The packed sequences themselves (a chunked layer cuts them further at its chunks).
    ours = None if info.dense else (
        info.cu_sequences if info.cu_sequences is not None else info.cu_seqlens_q)
    for given in (cu_q, cu_k):
        if given is None:
            continue
        if (ours is None or info.indices_q is not None or given.numel() != ours.numel()
                or not torch.equal(given.to(ours.device, torch.int32), ours)):
            raise _not_implemented("cu_seq_lens_q/k that do not match the packed sequences the "
                                   "mask marks (transformers reads packed sequences from "
                                   "position_ids restarting at each one, only without an "
                                   "attention mask and without a cache: pass use_cache=False)")
