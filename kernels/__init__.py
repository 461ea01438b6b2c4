"""Fused causal attention in Triton: functional API, drop-in modules and model rewriting.

Note: the import name ``kernels`` clashes with the unrelated ``kernels`` package on PyPI; do
not install both in one environment.
"""
from .ops import attention, attention_varlen, attention_with_kvcache

__all__ = ["attention", "attention_varlen", "attention_with_kvcache"]
from .fuse import fuse_attention  # noqa: E402
from .modules import (  # noqa: E402
    FusedCausalAttention,
    FusedMultiHeadAttention,
    FusedMultiHeadAttentionWrapper,
)

# Twins of llms-from-scratch's classes (the package itself is imported only when needed), and
# context-parallel ring attention (torch.distributed, which ``import torch`` loads already).
from . import book, distributed  # noqa: E402

__all__ += ["FusedCausalAttention", "FusedMultiHeadAttentionWrapper", "FusedMultiHeadAttention",
            "fuse_attention", "book", "distributed"]
