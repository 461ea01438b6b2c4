"""Fused twins of every attention class of ``llms-from-scratch`` (the book's companion package).

Each twin has its package class's constructor signature, parameter names, state_dict keys (in
the same order) and ``forward`` signature and return values (caches included); the attention
itself is one ``kernels.attention`` call (``attention_varlen`` for ragged per-row caches) with
grouped-query heads read in place. ``kernels.fuse_attention(model)`` swaps them in place.

=====================================================  ===========================================
package class (``llms_from_scratch.`` ...)             twin (``kernels.book.`` ...)
=====================================================  ===========================================
``kv_cache.gpt2.MultiHeadAttention``                   ``FusedMultiHeadAttentionKV``
``ch03.PyTorchMultiHeadAttention``                     ``FusedPyTorchMultiHeadAttention``
``llama3.GroupedQueryAttention``                       ``FusedLlama3GroupedQueryAttention``
``llama3`` / ``kv_cache.llama3`` ``.GroupedQueryAttentionFast``
                                                       ``FusedLlama3GroupedQueryAttentionFast``
``kv_cache.llama3.GroupedQueryAttention``              ``FusedLlama3GroupedQueryAttentionKV``
``qwen3.GroupedQueryAttention``                        ``FusedQwen3GroupedQueryAttention``
``kv_cache.qwen3.GroupedQueryAttention``               ``FusedQwen3GroupedQueryAttentionKV``
``kv_cache_batched.qwen3.GroupedQueryAttention``       ``FusedQwen3GroupedQueryAttentionBatchedKV``
=====================================================  ===========================================

The chapter-3 classes of the package (``ch03.CausalAttention``, ``MultiHeadAttention``,
``MultiHeadAttentionWrapper``) are the book's own, swapped by ``fuse_attention`` for
``kernels.modules``' twins.

The package is never imported here: a package class is recognised by its module and name among
the classes of the module object it came from (so it is already imported), and only when its
``forward`` is the package's own (a subclass overriding ``forward`` is left alone).
"""
import sys

from .base import BookTwin, check_mask
from .gpt2 import FusedMultiHeadAttentionKV, FusedPyTorchMultiHeadAttention
from .llama3 import (
    FusedLlama3GroupedQueryAttention,
    FusedLlama3GroupedQueryAttentionFast,
    FusedLlama3GroupedQueryAttentionKV,
)
from .qwen3 import (
    FusedQwen3GroupedQueryAttention,
    FusedQwen3GroupedQueryAttentionBatchedKV,
    FusedQwen3GroupedQueryAttentionKV,
    RMSNorm,
)

__all__ = [
    "BookTwin",
    "FusedMultiHeadAttentionKV",
    "FusedPyTorchMultiHeadAttention",
    "FusedLlama3GroupedQueryAttention",
    "FusedLlama3GroupedQueryAttentionFast",
    "FusedLlama3GroupedQueryAttentionKV",
    "FusedQwen3GroupedQueryAttention",
    "FusedQwen3GroupedQueryAttentionKV",
    "FusedQwen3GroupedQueryAttentionBatchedKV",
    "RMSNorm",
    "TWINS",
    "book_twin",
    "check_mask",
]

#: "module.Class" of each package attention class -> its twin.
TWINS = {name: twin
         for twin in (FusedMultiHeadAttentionKV, FusedPyTorchMultiHeadAttention,
                      FusedLlama3GroupedQueryAttention, FusedLlama3GroupedQueryAttentionFast,
                      FusedLlama3GroupedQueryAttentionKV, FusedQwen3GroupedQueryAttention,
                      FusedQwen3GroupedQueryAttentionKV,
                      FusedQwen3GroupedQueryAttentionBatchedKV)
         for name in twin.book_classes}


def _book_class(module):
    """(package class, twin) for the first package class in type(module)'s MRO, else None."""
    for cls in type(module).__mro__:
        twin = TWINS.get(f"{cls.__module__}.{cls.__qualname__}")
        # The very class of that name in the loaded package module, not a namesake.
        if twin is not None and getattr(sys.modules.get(cls.__module__), cls.__qualname__,
                                        None) is cls:
            return cls, twin
    return None


def book_twin(module):
    """The fused twin of a ``llms-from-scratch`` attention module, or None.

    None when ``module`` is not (a subclass of) one of the package's attention classes, or when
    its class overrides the package's ``forward`` (it may compute something else), or when its
    head layout is one the twin cannot run (odd head_dim, over the kernel's limit): such modules
    are left alone, never swapped half-right.
    """
    found = _book_class(module)
    if found is None:
        return None
    cls, twin = found
    if type(module).forward is not cls.forward:
        return None
    try:
        return twin.from_module(module)
    except (AttributeError, ValueError):
        return None
