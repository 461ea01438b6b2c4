"""Fused causal attention in Triton: functional API, drop-in modules and model rewriting.

Note: the import name ``kernels`` clashes with the unrelated ``kernels`` package on PyPI; do
not install both in one environment.
"""
from .ops import attention, attention_varlen

__all__ = ["attention", "attention_varlen"]
from .fuse import fuse_attention  # noqa: E402
from .modules import (  # noqa: E402
    FusedCausalAttention,
    FusedMultiHeadAttention,
    FusedMultiHeadAttentionWrapper,
)

__all__ += ["FusedCausalAttention", "FusedMultiHeadAttentionWrapper", "FusedMultiHeadAttention",
            "fuse_attention"]
