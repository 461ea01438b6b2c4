"""Fused causal attention in Triton: functional API, drop-in modules and model rewriting.

Layout (each layer imports only the ones below it)::

    kernels/core/            Triton kernels, launchers, configs, the PyTorch CPU fallback
    kernels/ops.py, pipeline.py, validation.py
                             the public functions, their call pipeline and argument checks
    the integrations         built on the public functions only, one module each under the
                             name users import: kernels.modules, kernels.fuse, kernels.book
                             (a package), kernels.sdpa, kernels.hf, kernels.distributed,
                             kernels.flash_attn_interface, kernels.flash_mla_interface,
                             kernels.vllm (a package);
                             model_checks.py holds the checks modules, fuse and book share

Note: the import name ``kernels`` clashes with the unrelated ``kernels`` package on PyPI; do
not install both in one environment.
"""
from .ops import attention, attention_varlen, attention_with_kvcache, write_kv_cache
from .pipeline import PlanCache, plans
from .core.backend import FallbackNotice
from .core.mods import ALIBI, SOFTCAP, MaskMod, ScoreMod
from .core.tensor_mask import TensorMask
from . import book, distributed, fuse, hf, modules, sdpa
from .fuse import fuse_attention
from .modules import (
    FusedCausalAttention,
    FusedMultiHeadAttention,
    FusedMultiHeadAttentionWrapper,
)
from . import flash_attn_interface  # FlashAttention 2's API on the functions above
from . import flash_mla_interface  # FlashMLA's decode API (DeepSeek's MLA) on them too

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "write_kv_cache", "plans",
           "PlanCache",
           "FallbackNotice", "ScoreMod", "MaskMod", "SOFTCAP", "ALIBI", "TensorMask",
           "FusedCausalAttention", "FusedMultiHeadAttentionWrapper",
           "FusedMultiHeadAttention", "fuse_attention", "book", "distributed", "fuse", "hf",
           "modules", "sdpa", "flash_attn_interface", "flash_mla_interface"]
