"""Fused causal attention in Triton: functional API, drop-in modules and model rewriting.

Layout (each layer imports only the ones below it)::

    kernels/                 the public functions (ops.py) and their argument checks
    kernels/core/            Triton kernels, launchers, configs, the PyTorch CPU fallback
    kernels/integrations/    modules, fuse_attention, the book's models, SDPA, transformers,
                             ring attention: built on the public functions only

The integrations keep their short import paths (``kernels.hf``, ``kernels.sdpa``,
``kernels.distributed``, ``kernels.book``, ``kernels.modules``, ``kernels.fuse``): each is a
small module whose names are those of the integration module it is named after.

Note: the import name ``kernels`` clashes with the unrelated ``kernels`` package on PyPI; do
not install both in one environment.
"""
from .ops import attention, attention_varlen, attention_with_kvcache
from .pipeline import PlanCache, plans
from .core.backend import FallbackNotice
from .core.mods import ALIBI, SOFTCAP, MaskMod, ScoreMod
from .core.tensor_mask import TensorMask
from . import book, distributed, fuse, hf, modules, sdpa
from .integrations.fuse import fuse_attention
from .integrations.modules import (
    FusedCausalAttention,
    FusedMultiHeadAttention,
    FusedMultiHeadAttentionWrapper,
)
from . import flash_attn_interface  # FlashAttention 2's API on the functions above

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "plans", "PlanCache",
           "FallbackNotice", "ScoreMod", "MaskMod", "SOFTCAP", "ALIBI", "TensorMask",
           "FusedCausalAttention", "FusedMultiHeadAttentionWrapper",
           "FusedMultiHeadAttention", "fuse_attention", "book", "distributed", "fuse", "hf",
           "modules", "sdpa", "flash_attn_interface"]
