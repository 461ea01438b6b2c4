"""Swap the book's causal attention modules inside any model for their fused twins, in place.

    model, count = fuse_attention(GPTModel(cfg))   # every TransformerBlock.att is now fused

Recognised (by class or by duck typing, so user copies of the book's classes work too):

* MultiHeadAttention-like: ``W_query``, ``W_key``, ``W_value`` and ``out_proj`` are nn.Linear,
  has ``num_heads``, ``head_dim``, ``d_out``, ``dropout`` (with ``.p``) and a causal ``mask``
  -> :class:`~kernels.modules.FusedMultiHeadAttention`;
* CausalAttention-like: the same without ``out_proj``
  -> :class:`~kernels.modules.FusedCausalAttention`;
* MultiHeadAttentionWrapper-like: only a ModuleList ``heads`` of CausalAttention-like modules
  -> :class:`~kernels.modules.FusedMultiHeadAttentionWrapper`;
* the attention classes of ``llms-from-scratch`` (the book's companion package: KV-cache GPT-2,
  Llama 3, Qwen 3 and their KV-cache variants), recognised by class, never by structure, and
  only when their ``forward`` is the package's -> their twins in :mod:`kernels.book`.

Left alone: ``SelfAttention_v1/v2`` (no mask: not causal), modules whose ``mask`` is not the
causal pattern, and already fused modules. Duck typing checks structure, not ``forward``: a
look-alike whose forward computes something else (another scale, rotary embeddings) must not
be passed through this function.
"""
import torch
import torch.nn as nn

from .modules import (
    FusedCausalAttention,
    FusedMultiHeadAttention,
    FusedMultiHeadAttentionWrapper,
    _context_length_of,
)
from .book import BookTwin, book_twin

__all__ = ["fuse_attention"]


def _has_causal_mask(module):
    """True if ``module.mask`` is the book's (ctx, ctx) causal mask (triu ones, diagonal=1)."""
    mask = getattr(module, "mask", None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        return False
    if mask.is_meta:
        return True  # no values to check; the shape is right
    ctx = _context_length_of(module)
    if mask.shape[0] != ctx:
        return False
    expected = torch.ones(ctx, ctx, dtype=torch.bool, device=mask.device).triu_(1)
    return torch.equal(mask.bool(), expected)


def _has_qkv(module):
    return all(isinstance(getattr(module, name, None), nn.Linear)
               for name in ("W_query", "W_key", "W_value"))


def _has_dropout(module):
    return isinstance(getattr(module, "dropout", None), nn.Module) and \
        hasattr(module.dropout, "p")


def _is_causal_attention(module):
    """reference.CausalAttention or a look-alike (no out_proj)."""
    return (_has_qkv(module) and not hasattr(module, "out_proj") and _has_dropout(module)
            and _has_causal_mask(module))


def _is_multi_head_attention(module):
    """reference.MultiHeadAttention or a look-alike (out_proj + head bookkeeping)."""
    if not (_has_qkv(module) and isinstance(getattr(module, "out_proj", None), nn.Linear)
            and _has_dropout(module) and _has_causal_mask(module)):
        return False
    try:
        num_heads, head_dim, d_out = int(module.num_heads), int(module.head_dim), int(module.d_out)
    except (AttributeError, TypeError, ValueError):
        return False
    return num_heads >= 1 and num_heads * head_dim == d_out == module.W_query.out_features


def _is_wrapper(module):
    """reference.MultiHeadAttentionWrapper or a look-alike: nothing but ``heads``, all causal."""
    heads = getattr(module, "heads", None)
    if not isinstance(heads, nn.ModuleList) or len(heads) == 0:
        return False
    # Any other child or parameter would take part in a forward we do not reproduce.
    if [name for name, _ in module.named_children()] != ["heads"]:
        return False
    if any(True for _ in module.named_parameters(recurse=False)):
        return False
    return all(_is_causal_attention(h) for h in heads)


def _fused_twin(module):
    """The fused replacement of ``module``, or None if it is not a recognised attention."""
    if isinstance(module, (FusedCausalAttention, FusedMultiHeadAttention,
                           FusedMultiHeadAttentionWrapper, BookTwin)):
        return None
    twin = book_twin(module)
    if twin is not None:
        return twin
    if _is_multi_head_attention(module):
        return FusedMultiHeadAttention.from_module(module)
    if _is_causal_attention(module):
        return FusedCausalAttention.from_module(module)
    if _is_wrapper(module):
        return FusedMultiHeadAttentionWrapper.from_module(module)
    return None


def fuse_attention(model):
    """Replace, in place, every causal attention module of ``model`` by its fused twin.

    The twins are built with ``from_module``: they hold the very same Parameter objects (an
    optimizer created before the swap keeps updating the model), on the same device and dtype,
    in the same train/eval mode; the reference's O(context_length^2) mask buffers are dropped.
    State dict keys are unchanged, so checkpoints load before and after fusing.

    Args:
        model: any nn.Module (a GPTModel, a single attention module, ...). Tensor shapes are
            unchanged by the swap: each attention still maps (b, n, d_in) -> (b, n, d_out).

    Returns:
        (model, count): the model (a new module if ``model`` itself was an attention module,
        else the same object) and the number of modules swapped (a wrapper counts once).
    """
    root = _fused_twin(model)
    if root is not None:
        return root, 1
    return model, _fuse_children(model, {})


def _fuse_children(module, twins):
    """Swap recognised children of ``module`` (recursively); returns the number newly swapped.

    ``twins`` maps id(original) -> (original, twin), so a module shared by several parents gets
    one twin and stays shared (holding the original keeps its id from being reused).
    """
    count = 0
    # Not named_children(): it yields a module shared under two names only once.
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        twin = twins.get(id(child), (None, None))[1]
        if twin is None:
            twin = _fused_twin(child)
            if twin is not None:
                twins[id(child)] = (child, twin)
                count += 1
        if twin is not None:
            # setattr re-registers the child under the same name (works for ModuleList and
            # Sequential too, whose children are named "0", "1", ...).
            setattr(module, name, twin)
        else:
            count += _fuse_children(child, twins)
    return count
