"""What the twins of ``llms-from-scratch``'s attention classes share.

* :class:`BookTwin`: the base class; :meth:`BookTwin._adopt` builds a twin that holds the very
  same child modules and Parameters as a package module, in the same order (same state_dict).
* :func:`check_mask`: a mask passed in must be exactly the pattern the kernel computes, else
  ValueError (never a silently different mask).
* :func:`rope` / :func:`rope_rows`: the book's rotate-half RoPE, same formula and op order.
* :class:`GQATwin`: projections, optional QK RMSNorm, RoPE and one ``kernels.attention`` call
  with grouped-query heads read in place (no ``repeat_interleave``).

Layout: heads are split off the projections as ``(b, n, heads, hd)`` and RoPE is applied in
that layout (elementwise, so bitwise the same numbers as the book's ``(b, heads, n, hd)``); the
kernel reads the ``transpose(1, 2)`` views in place and writes its output in q's layout, so the
merge before ``out_proj`` is a free view.
"""
import weakref

import torch
import torch.nn as nn

from .. import ops as _ops
from ..core.common import MAX_HEAD_DIM
from ..model_checks import causal_mask_mismatch


class BookTwin(nn.Module):
    """Base of the fused twins of the package's attention classes."""

    #: "module.Class" of the package class(es) this twin replaces (for messages and docs).
    book_classes = ()

    @classmethod
    def _adopt(cls, module):
        """A twin of ``module`` holding its very Parameters, buffers and children, in order.

        Sharing the child modules (projections, norms, dropout) keeps the Parameter objects (an
        optimizer built before the swap keeps working), the device, dtype, state_dict keys and
        their order, and whatever the projections are (``nn.Linear`` or a LoRA wrapper).
        """
        twin = cls.__new__(cls)
        nn.Module.__init__(twin)
        for name, p in module._parameters.items():
            twin.register_parameter(name, p)
        for name, b in module._buffers.items():
            twin.register_buffer(name, b,
                                 persistent=name not in module._non_persistent_buffers_set)
        for name, child in module._modules.items():
            twin.add_module(name, child)
        twin.training = module.training
        return twin


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------

class _Memo:
    """The last mask found valid. A model builds one mask per forward and hands it to every
    layer; remembering it (same object, same version counter, same target) checks it once per
    forward, not once per layer (each check reads the mask back: one host sync)."""
    ref = None
    key = None


def _memo_key(mask, target, k_lens):
    if torch.compiler.is_compiling():
        return None
    try:
        version = mask._version
    except RuntimeError:  # inference-mode tensors have no version counter: check every time
        return None
    return (mask.data_ptr(), tuple(mask.shape), tuple(mask.stride()), mask.storage_offset(),
            mask.device, version, target, k_lens)


def check_mask(mask, batch, heads, q_len, k_lens, *, who):
    """ValueError unless ``mask`` is the pattern the fused kernel computes.

    ``mask`` is read as the book reads it, ``scores.masked_fill(mask, -inf)``: bool, True =
    masked, broadcast to ``(batch, heads, q_len, K)``. Expected: causal attention aligned
    bottom-right over each row's keys (what a KV-cache step needs), query i sees key j iff
    ``j <= i + k_len - q_len``. ``k_lens`` is one int (every row) or one int per batch row
    (ragged per-row caches, keys left-aligned: columns past a row's ``k_len`` must be masked);
    ``K = max(k_lens)``.
    """
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{who}: expected the mask as a bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(f"{who}: expected a bool mask (True = masked, as masked_fill reads it); "
                         f"got dtype {mask.dtype}")
    ragged = not isinstance(k_lens, int)
    k_lens = tuple(int(k) for k in k_lens) if ragged else int(k_lens)
    k_max = max(k_lens) if ragged else k_lens
    k_min = min(k_lens) if ragged else k_lens
    target = (batch, heads, q_len, k_max)
    try:
        fits = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, target) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{who}: expected a mask that broadcasts to (batch, heads, q_len, "
                         f"k_len) = {target}; got shape {tuple(mask.shape)}")
    if q_len > k_min:
        raise ValueError(f"{who}: {q_len} queries but only {k_min} keys: the first queries "
                         f"would see no key (the book's softmax gives NaN there)")
    key = _memo_key(mask, target, k_lens)
    if key is not None and _Memo.key == key and _Memo.ref is not None and _Memo.ref() is mask:
        return
    where = causal_mask_mismatch(mask, q_len, k_lens)
    if where is not None:
        over = "each row's k_len keys; columns past them masked" if ragged else \
            f"k_len={k_lens} keys"
        raise ValueError(
            f"{who}: the mask is not the pattern the fused kernel computes (causal, aligned "
            f"bottom-right: query i sees key j iff j <= i + k_len - q_len, over {over}); "
            f"first difference at index {where} of the mask broadcast to {target}. The fused "
            f"module implements only that pattern: use the package's class for other masks")
    if key is not None:
        _Memo.ref, _Memo.key = weakref.ref(mask), key


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------

def _rotate_half_apply(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def rope(x, cos, sin, offset=0):
    """The book's RoPE on ``x`` (b, n, heads, hd) at positions ``offset .. offset + n - 1``,
    cast back to x's dtype (``llama3`` / ``qwen3`` / ``kv_cache`` ``apply_rope``)."""
    n = x.shape[1]
    c, s = cos[offset:offset + n], sin[offset:offset + n]
    if c.shape[0] != n:
        raise ValueError(f"RoPE tables hold {cos.shape[0]} positions; positions {offset} .. "
                         f"{offset + n - 1} were asked for (context_length exceeded)")
    return _rotate_half_apply(x, c[:, None, :], s[:, None, :]).to(x.dtype)


def rope_rows(x, cos, sin, offsets):
    """Per-row RoPE of ``kv_cache_batched.qwen3``: row r at positions ``offsets[r] + 0 .. n-1``,
    clamped to the table's last position, and NOT cast back (the result has the promoted dtype
    of x and the tables, as the package's)."""
    n = x.shape[1]
    pos = torch.arange(n, device=offsets.device)[None, :] + offsets[:, None]
    pos = pos.clamp(max=cos.shape[0] - 1)                               # (b, n)
    return _rotate_half_apply(x, cos[pos][:, :, None, :], sin[pos][:, :, None, :])


# ---------------------------------------------------------------------------------------------
# Grouped-query attention
# ---------------------------------------------------------------------------------------------

def check_heads(num_heads, num_kv_groups, head_dim):
    """ValueError unless the heads group evenly and head_dim suits RoPE and the kernel."""
    if num_heads < 1 or num_kv_groups < 1 or num_heads % num_kv_groups:
        raise ValueError(f"num_heads must be a multiple of num_kv_groups: got num_heads="
                         f"{num_heads}, num_kv_groups={num_kv_groups}")
    if head_dim < 2 or head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be even (RoPE) and at most {MAX_HEAD_DIM} (the "
                         f"kernel); got {head_dim}")


class GQATwin(BookTwin):
    """Projections (+ optional ``q_norm`` / ``k_norm``) and the fused grouped-query call.

    Attributes as the package's: ``num_heads``, ``num_kv_groups``, ``group_size``, ``head_dim``,
    ``d_out``; children ``W_query``, ``W_key``, ``W_value``, ``out_proj`` (+ norms).
    """

    def _set_heads(self, num_heads, num_kv_groups, head_dim):
        check_heads(int(num_heads), int(num_kv_groups), int(head_dim))
        self.num_heads = int(num_heads)
        self.num_kv_groups = int(num_kv_groups)
        self.group_size = self.num_heads // self.num_kv_groups
        self.head_dim = int(head_dim)
        self.d_out = self.num_heads * self.head_dim

    @classmethod
    def from_module(cls, module):
        """Twin of a package GroupedQueryAttention: its very children and Parameters."""
        twin = cls._adopt(module)
        twin._set_heads(module.num_heads, module.num_kv_groups, module.head_dim)
        if "q_norm" not in twin._modules:
            twin.q_norm = getattr(module, "q_norm", None)
            twin.k_norm = getattr(module, "k_norm", None)
        return twin

    def _split(self, x):
        """x (b, n, d_in) -> q (b, n, H, hd), k, v (b, n, Hkv, hd), QK-normed if the module
        has norms (a view of each projection otherwise)."""
        b, n, _ = x.shape
        q = self.W_query(x).view(b, n, self.num_heads, self.head_dim)
        k = self.W_key(x).view(b, n, self.num_kv_groups, self.head_dim)
        v = self.W_value(x).view(b, n, self.num_kv_groups, self.head_dim)
        if getattr(self, "q_norm", None) is not None:
            q = self.q_norm(q)
        if getattr(self, "k_norm", None) is not None:
            k = self.k_norm(k)
        return q, k, v

    def _qkv(self, x, cos, sin, offset=0):
        """q (b, H, n, hd), k, v (b, Hkv, n, hd) after norms and RoPE at ``offset``."""
        q, k, v = self._split(x)
        q, k = rope(q, cos, sin, offset), rope(k, cos, sin, offset)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q, k, v):
        """One fused call, causal bottom-right over k's length; out_proj of the merged heads.

        q (b, H, n, hd), k, v (b, Hkv, K, hd) -> (b, n, out). k and v are cast to q's dtype
        for the kernel only (a no-op unless dtypes differ, e.g. under autocast)."""
        b, _, n, _ = q.shape
        o = _ops.attention(q, k.to(q.dtype), v.to(q.dtype), causal=True)   # (b, H, n, hd)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, self.d_out).to(v.dtype))

    def _forward_cached(self, x, mask, cos, sin, start_pos, cache):
        """The KV-cache variants' forward: new keys/values (after norms and RoPE at
        ``start_pos``) appended to ``cache = (keys, values)``, the mask checked to be causal
        bottom-right over all keys; returns (context, (keys, values))."""
        b, n, _ = x.shape
        q, k, v = self._qkv(x, cos, sin, start_pos)
        if cache is not None:
            prev_k, prev_v = cache
            k = torch.cat([prev_k, k], dim=2)
            v = torch.cat([prev_v, v], dim=2)
        check_mask(mask, b, self.num_heads, n, k.shape[2], who=self._mask_name())
        return self._attend(q, k, v), (k, v)

    def _mask_name(self):
        return f"{type(self).__name__} (twin of {', '.join(self.book_classes)})"

    def extra_repr(self):
        return (f"num_heads={self.num_heads}, num_kv_groups={self.num_kv_groups}, "
                f"head_dim={self.head_dim}")
