"""Drop-in fused replacements for the book's causal attention modules (reference/modules.py).

Each class has the reference's constructor signature, parameter names and shapes, parameter
creation order (so ``torch.manual_seed`` gives the same initial weights) and ``state_dict`` keys,
so checkpoints load both ways with ``strict=True``. What changes is the middle of ``forward``:
scores, causal mask, softmax, dropout and the weighted sum of values run as ONE call of the fused
kernel (``kernels.attention``), which never materialises the (num_tokens, num_tokens) weights.

* :class:`FusedCausalAttention`: one head (book 3.5.3).
* :class:`FusedMultiHeadAttentionWrapper`: ``num_heads`` independent heads, concatenated
  (book 3.6.1); all heads run in one kernel launch.
* :class:`FusedMultiHeadAttention`: split heads + output projection (book 3.6.2, the GPT one).

The causal mask is not stored: the reference's ``mask`` buffer costs
``4 * context_length**2`` bytes (64 GiB at 131072 tokens) and the kernel computes causality from
indices. For checkpoint compatibility ``state_dict()`` still emits a ``mask`` entry, built on the
CPU at save time, and ``load_state_dict`` accepts one, checks it is the causal pattern and drops
it (see :class:`_StatelessCausalMask`).

Projections may be any module, not only ``nn.Linear`` (e.g. the book's appendix-E
``LinearWithLoRA``, applied before or after the swap): the fused modules call ``W_query``,
``W_key``, ``W_value`` and ``out_proj`` as the book does (keys, queries, values, in that order),
so whatever those modules compute, and their gradients, take part. The input width ``d_in`` is
kept from construction, never read back from a projection.

Shapes: ``b`` batch, ``n`` tokens (``n <= context_length``), ``d_in`` input width, ``d_out``
output width, ``H`` heads, ``hd`` head width.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops as _ops
from .model_checks import (
    causal_mask_mismatch,
    causal_masked,
    check_head_split,
    context_length_of,
    input_width,
    is_plain_linear,
    projection_features,
)

__all__ = [
    "FusedCausalAttention",
    "FusedMultiHeadAttentionWrapper",
    "FusedMultiHeadAttention",
]


# ---------------------------------------------------------------------------------------------
# Validation helpers: every error says what was expected and what was given.
# ---------------------------------------------------------------------------------------------

def _check_input(module, x, d_in, context_length):
    """Validate x (b, n, d_in) with n <= context_length; return (b, n).

    ``d_in`` None (a projection of unknown input width): the width is left to the projection.
    """
    name = type(module).__name__
    if x.dim() != 3:
        raise ValueError(
            f"{name} expected a 3-d input (batch, num_tokens, d_in={d_in}); "
            f"got a {x.dim()}-d tensor of shape {tuple(x.shape)}")
    b, n, features = x.shape
    if d_in is not None and features != d_in:
        raise ValueError(
            f"{name} expected d_in={d_in} features in the last dimension; "
            f"got {features} (input shape {tuple(x.shape)})")
    if n > context_length:
        raise ValueError(
            f"{name} got {n} tokens but its context_length is {context_length}: "
            f"crop the input to the last {context_length} tokens")
    return b, n


def _check_causal_mask(mask, context_length, name="mask"):
    """ValueError unless ``mask`` is the book's causal mask for ``context_length``.

    The book masks where ``mask.bool()`` is True, so any non-zero value above the diagonal and
    zeros elsewhere is the same pattern (float 0/1 as saved by the reference, or bool).
    """
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(mask).__name__}")
    expected = (context_length, context_length)
    if tuple(mask.shape) != expected:
        raise ValueError(
            f"{name}: expected the causal mask of shape {expected} (context_length="
            f"{context_length}); got shape {tuple(mask.shape)}")
    if mask.is_meta:  # no values to check (e.g. a checkpoint loaded on the meta device)
        return
    where = causal_mask_mismatch(mask, context_length, context_length)
    if where is not None:
        raise ValueError(
            f"{name}: not the causal pattern triu(ones({context_length}, {context_length}), "
            f"diagonal=1) (first difference at index {where}); the fused modules only "
            f"implement causal attention")


def _twin_sizes(module):
    """(context_length, d_in, d_out) of a chapter-3 attention ``module`` about to be fused;
    d_in None where no projection declares it. Raises ValueError if ``module.mask`` is not the
    causal mask or d_out is unknown (no ``d_out`` attribute, no ``out_features`` on W_query)."""
    ctx = context_length_of(module)
    if hasattr(module, "mask"):
        _check_causal_mask(module.mask, ctx, name=f"{type(module).__name__}.mask")
    d_out = getattr(module, "d_out", None)
    if d_out is None:
        d_out = projection_features(module.W_query)[1]
    if d_out is None:
        raise ValueError(f"{type(module).__name__}: unknown d_out (no d_out attribute and "
                         f"W_query has no out_features)")
    return ctx, input_width(module), d_out


def _qkv_in_book_order(project):
    """q, k, v from ``project(name)`` for "W_key", "W_query", "W_value", called in the book's
    order (keys, queries, values); k and v in q's dtype (they may differ under autocast or with
    mixed parameter dtypes; the kernel needs one, and it is a no-op in the usual case)."""
    k = project("W_key")
    q = project("W_query")
    v = project("W_value")
    return q, k.to(q.dtype), v.to(q.dtype)


def _project_qkv(module, x):
    """q, k, v (b, n, width) from ``module``'s own projection modules (any modules)."""
    return _qkv_in_book_order(lambda name: getattr(module, name)(x))


def _attend_heads(q, k, v, shape, dropout_p):
    """q, k, v (b, n, H * hd) -> (b, n, H * hd), ``shape = (b, n, H, hd)``: all heads in one
    causal kernel call.

    Zero-copy head split: (b, n, H * hd) -> (b, n, H, hd) -> (b, H, n, hd) strided views that
    the kernel reads in place (the book's transposes, minus any copy). The kernel writes its
    output in q's memory layout, (b, n, H, hd), so merging the heads back is a free view where
    the book needs ``.contiguous()`` (a copy).
    """
    b, n, H, hd = shape
    q, k, v = (t.view(b, n, H, hd).transpose(1, 2) for t in (q, k, v))
    o = _ops.attention(q, k, v, causal=True, dropout_p=dropout_p)    # (b, H, n, hd)
    return o.transpose(1, 2).reshape(b, n, H * hd)


def _copied_dropout(dropout):
    """A new nn.Dropout with ``dropout``'s rate and train/eval mode."""
    new = nn.Dropout(float(dropout.p))
    new.train(dropout.training)
    return new


# ---------------------------------------------------------------------------------------------
# The state_dict shim for the mask the fused modules do not store.
# ---------------------------------------------------------------------------------------------

class _StatelessCausalMask(nn.Module):
    """Base class: state_dict() emits the reference's ``mask`` entry, load_state_dict eats it.

    It overrides ``_save_to_state_dict`` / ``_load_from_state_dict``, the per-module methods
    ``nn.Module.state_dict`` / ``load_state_dict`` call on every submodule (present with these
    signatures in all torch 2.x; BatchNorm overrides the latter the same way). Unlike the hook
    APIs they keep the reference's key order: a module's own entries come before its children's.

    Subclasses set ``self.context_length`` and have a ``W_query`` projection module (its first
    floating-point parameter gives the dtype).
    """

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Built only now, on the CPU, so no O(ctx^2) memory is held between saves. Its dtype is
        # the parameters', as the reference's buffer follows module.to(dtype) / .half().
        # Any projection module (a LoRA wrapper has no ``weight`` of its own): its first
        # floating-point parameter, e.g. the wrapped Linear's weight.
        weight = next((p for p in self.W_query.parameters() if p.is_floating_point()), None)
        dtype = weight.dtype if weight is not None else torch.get_default_dtype()
        destination[prefix + "mask"] = causal_masked(self.context_length,
                                                     self.context_length).to(dtype)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # ``state_dict`` is load_state_dict's private copy, so popping is safe; a ``mask`` left
        # in it would be reported as an unexpected key.
        key = prefix + "mask"
        if key in state_dict:
            _check_causal_mask(state_dict.pop(key), self.context_length, name=key)
        elif strict:
            # Same contract as the reference, whose buffer is a required key.
            missing_keys.append(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


class _CausalTwin(_StatelessCausalMask):
    """What :class:`FusedCausalAttention` and :class:`FusedMultiHeadAttention` share: their
    attributes and children, set in the reference's order, the twin of a reference module, and
    the dropout rate of a call. Subclasses name their projections in ``_projections``."""

    #: The projection children, in the reference's order (``dropout`` follows them).
    _projections = ("W_query", "W_key", "W_value")

    def _setup(self, projections, dropout, context_length, num_heads, d_in, d_out):
        """``projections``: name -> module, as ``_projections``; registered in that order,
        then ``dropout`` (the reference's children and state_dict order)."""
        # d_in / d_out are kept, not read from the projections: they may be replaced later
        # (LoRA after fusing) by modules without ``in_features``. d_in None: unknown.
        d_out = int(d_out)
        check_head_split(d_out, num_heads)
        self.d_in = None if d_in is None else int(d_in)
        self.d_out = d_out
        self.num_heads = int(num_heads)
        self.head_dim = d_out // self.num_heads
        self.context_length = int(context_length)
        for name in self._projections:
            setattr(self, name, projections[name])
        self.dropout = dropout

    @classmethod
    def _num_heads_of(cls, module):
        return 1

    @classmethod
    def _twin_of(cls, module):
        """A twin holding ``module``'s very projection modules, with a copy of its dropout
        (rate and train/eval mode), in its train/eval mode."""
        ctx, d_in, d_out = _twin_sizes(module)
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused._setup({name: getattr(module, name) for name in cls._projections},
                     _copied_dropout(module.dropout), ctx, cls._num_heads_of(module), d_in,
                     d_out)
        fused.training = module.training
        return fused

    def _dropout_p(self):
        """Dropout rate for this call: the module's in training mode, 0 in eval mode."""
        return float(self.dropout.p) if self.training else 0.0


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------

class FusedCausalAttention(_CausalTwin):
    """Single-head causal self-attention (book 3.5.3) running as one fused kernel call.

    Same constructor, parameters (``W_query``, ``W_key``, ``W_value``: Linear(d_in, d_out)),
    ``dropout`` (nn.Dropout) and state_dict keys (including ``mask``) as
    ``reference.CausalAttention``. Scale ``1 / sqrt(d_out)``, as the book's ``keys.shape[-1]``.

    ``forward(x)``: x (b, n, d_in) -> (b, n, d_out), n <= context_length.
    """

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        # Creation order as in the reference: the same seed gives the same initial weights.
        self._setup({name: nn.Linear(d_in, d_out, bias=qkv_bias) for name in self._projections},
                    nn.Dropout(dropout), context_length, 1, d_in, d_out)

    @classmethod
    def from_module(cls, module):
        """Fused twin of a ``reference.CausalAttention`` (or look-alike) ``module``.

        The twin holds the very same projection modules, hence the same Parameter objects (an
        optimizer over ``module.parameters()`` keeps working), device and dtype, and copies the
        dropout rate and train/eval mode. Raises ValueError if ``module.mask`` is not causal.
        """
        return cls._twin_of(module)

    def _attend(self, q, k, v):
        """One head: q, k, v (b, n, d) -> (b, n, d), one kernel call on (b, 1, n, d) views."""
        o = _ops.attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), causal=True,
                           dropout_p=self._dropout_p())     # (b, 1, n, d)
        return o.squeeze(1)

    def forward(self, x):
        """x (b, n, d_in) -> context vectors (b, n, d_out)."""
        _check_input(self, x, self.d_in, self.context_length)
        return self._attend(*_project_qkv(self, x))

    def extra_repr(self):
        return f"context_length={self.context_length}"


class FusedMultiHeadAttentionWrapper(nn.Module):
    """``num_heads`` independent causal heads, concatenated (book 3.6.1), in ONE kernel launch.

    Same constructor and state_dict keys (``heads.{i}.W_query.weight``, ``heads.{i}.mask``, ...)
    as ``reference.MultiHeadAttentionWrapper``: ``heads`` is a ModuleList of
    :class:`FusedCausalAttention` (each still usable alone). ``forward`` stacks the heads'
    weights into one (num_heads * d_out, d_in) projection per q/k/v and runs all heads as the H
    axis of a single ``kernels.attention`` call (the reference runs one head after another).
    Projections that are not plain ``nn.Linear`` (LoRA wrappers, any module) are called head by
    head instead, their outputs concatenated for the same single call; heads that cannot share
    one call (different dropout rates or modes, or output widths) run one by one.

    Attributes: ``num_heads``; ``head_dim`` (= the per-head ``d_out`` argument); ``d_out``
    (= num_heads * head_dim, the output width); ``context_length``.

    ``forward(x)``: x (b, n, d_in) -> (b, n, num_heads * d_out), n <= context_length.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1; got {num_heads}")
        self._setup(nn.ModuleList(
            [FusedCausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
             for _ in range(num_heads)]))

    def _setup(self, heads):
        self.heads = heads
        self.num_heads = len(heads)
        self.head_dim = heads[0].d_out
        self.d_out = self.num_heads * self.head_dim
        self.context_length = heads[0].context_length

    @classmethod
    def from_module(cls, module):
        """Fused twin of a ``reference.MultiHeadAttentionWrapper`` (or look-alike): each head
        via :meth:`FusedCausalAttention.from_module` (same Parameter objects, device, dtype,
        dropout rate, mode)."""
        heads = list(module.heads)
        if not heads:
            raise ValueError(f"{type(module).__name__} has no heads")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused._setup(nn.ModuleList([FusedCausalAttention.from_module(h) for h in heads]))
        fused.training = module.training
        return fused

    def _same_launch(self):
        """Whether all heads can share one kernel launch: same dropout rate/mode and context."""
        first = self.heads[0]
        return all(h._dropout_p() == first._dropout_p()
                   and h.context_length == first.context_length for h in self.heads)

    def _plain_linears(self):
        """Whether every head's q/k/v projection is a plain nn.Linear of the same layout (their
        weights can be stacked into one GEMM per projection)."""
        first = self.heads[0]
        for h in self.heads:
            for name in ("W_key", "W_query", "W_value"):
                lin, ref = getattr(h, name), getattr(first, name)
                if not is_plain_linear(lin):
                    return False
                if (lin.bias is None) != (ref.bias is None) or lin.weight.shape != ref.weight.shape:
                    return False
        return True

    def _stacked_linear(self, x, name):
        """x (b, n, d_in) -> (b, n, H * d_out): head i's projection ``name`` in columns
        [i * d_out, (i + 1) * d_out), i.e. what torch.cat of the per-head outputs would give."""
        linears = [getattr(h, name) for h in self.heads]
        # A (H * d_out, d_in) copy of small weights buys one GEMM instead of H; autograd routes
        # each slice's gradient back to its head's Parameter.
        weight = torch.cat([lin.weight for lin in linears], dim=0)
        bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
        return F.linear(x, weight, bias)

    def forward(self, x):
        """x (b, n, d_in) -> (b, n, num_heads * d_out): head i's output in columns
        [i * d_out, (i + 1) * d_out), as the reference's torch.cat."""
        heads = list(self.heads)
        if not self._same_launch():
            # Heads changed after construction (different rates or modes): one by one.
            return torch.cat([head(x) for head in heads], dim=-1)
        first = heads[0]
        b, n = _check_input(self, x, first.d_in, self.context_length)
        H = self.num_heads
        if self._plain_linears():
            q, k, v = _qkv_in_book_order(lambda name: self._stacked_linear(x, name))
            hd = self.head_dim                                  # q, k, v: (b, n, H * hd)
        else:
            # Any projection modules (LoRA wrappers, ...): each head's own, called as the
            # reference does (head by head: keys, queries, values).
            qkv = [_project_qkv(h, x) for h in heads]
            shapes = {t.shape for head in qkv for t in head}
            dtypes = {head[0].dtype for head in qkv}
            if len(shapes) != 1 or len(dtypes) != 1 or next(iter(shapes))[:2] != (b, n) \
                    or len(next(iter(shapes))) != 3:
                # Heads of different widths or dtypes cannot share one launch.
                return torch.cat([h._attend(*t) for h, t in zip(heads, qkv)], dim=-1)
            hd = next(iter(shapes))[-1]
            q, k, v = (torch.cat([head[i] for head in qkv], dim=-1) for i in range(3))
        return _attend_heads(q, k, v, (b, n, H, hd), first._dropout_p())

    def extra_repr(self):
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}"


class FusedMultiHeadAttention(_CausalTwin):
    """Multi-head causal self-attention (book 3.6.2, GPT's) with the fused kernel in the middle.

    Same constructor, parameters (``W_query``, ``W_key``, ``W_value``: Linear(d_in, d_out);
    ``out_proj``: Linear(d_out, d_out)), attributes (``d_out``, ``num_heads``, ``head_dim``,
    ``dropout``) and state_dict keys (including ``mask``) as ``reference.MultiHeadAttention``,
    plus ``context_length``. Raises ValueError if ``d_out % num_heads != 0``.

    ``forward(x)``: x (b, n, d_in) -> (b, n, d_out), n <= context_length.
    """

    _projections = ("W_query", "W_key", "W_value", "out_proj")

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        check_head_split(d_out, num_heads)
        # Creation order as in the reference: the same seed gives the same initial weights.
        projections = {name: nn.Linear(d_in, d_out, bias=qkv_bias)
                       for name in ("W_query", "W_key", "W_value")}
        projections["out_proj"] = nn.Linear(d_out, d_out)
        self._setup(projections, nn.Dropout(dropout), context_length, num_heads, d_in, d_out)

    @classmethod
    def _num_heads_of(cls, module):
        return module.num_heads

    @classmethod
    def from_module(cls, module):
        """Fused twin of a ``reference.MultiHeadAttention`` (or look-alike) ``module``.

        The twin holds the very same projection modules (``W_query``, ``W_key``, ``W_value``,
        ``out_proj``), hence the same Parameter objects (an optimizer over
        ``module.parameters()`` keeps working), device and dtype, and copies the dropout rate
        and train/eval mode. Raises ValueError if ``module.mask`` is not causal or the heads do
        not split ``d_out``.
        """
        return cls._twin_of(module)

    def forward(self, x):
        """x (b, n, d_in) -> (b, n, d_out)."""
        b, n = _check_input(self, x, self.d_in, self.context_length)
        H, hd = self.num_heads, self.head_dim
        q, k, v = _project_qkv(self, x)                      # (b, n, d_out) each
        o = _attend_heads(q, k, v, (b, n, H, hd), self._dropout_p())   # (b, n, d_out)
        return self.out_proj(o)

    def extra_repr(self):
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"context_length={self.context_length}")
