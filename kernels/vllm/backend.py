"""The ``TRITON_FUSED`` vLLM v1 attention backend (vLLM 0.32's interface): backend class,
metadata, metadata builder and impl, on ``kernels``' public functions only.

- KV cache: one tensor per layer, vLLM's logical (num_blocks, heads_kv, page_size,
  2 * head_size) with K in the first head_size channels and V in the last, laid out
  token-major inside a block (``supported_kv_cache_layouts``: LBNHC, BLNHC), so that
  ``kv_cache.transpose(1, 2)`` split in two is our paged kernels' (num_blocks, page_size,
  heads_kv, head_size) K and V, read and written in place.
- Cache writes: ``kernels.write_kv_cache`` through vLLM's ``slot_mapping`` (slots < 0 skipped),
  FP8 caches (``fp8`` / ``fp8_e4m3``) quantized with the layer's ``_k_scale`` / ``_v_scale``
  as vLLM's own backends do.
- Forward: one ``kernels.attention_varlen(..., block_table=)`` over the whole batch (mixed
  prefill and decode rows, chunked prefill, prefix-cache hits: each sequence's queries are its
  last positions, causal bottom-right), written into vLLM's output buffer; decode-only batches
  take the split-KV path (the heuristic, or ``KERNELS_VLLM_DECODE_SPLITS``).
"""
import collections
import os
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                       AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata, MultipleOf)
from vllm.v1.kv_cache_layout import KVCacheLayout

import kernels

from . import BACKEND_NAME

# Head sizes our kernels take (kernels.core.common.MAX_HEAD_DIM, read through the public
# layer's bound: integrations do not import the core).
MAX_HEAD_SIZE = 512
# vLLM's FP8 cache dtypes our FP8-cache kernel reads: OCP e4m3 (float8_e4m3fn).
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
# Split count for decode-only batches: 0 = kernels' heuristic (splits batches too small to
# fill the GPU; none on the CPU). Tests set it to force the split-KV kernels.
ENV_DECODE_SPLITS = "KERNELS_VLLM_DECODE_SPLITS"
# Calls served in this process ("forward", "cache_write", "split_forward"): how tests (and a
# user) see that this backend, not another, served an engine.
CALLS = collections.Counter()


@dataclass
class TritonFusedMetadata:
    """One step's attention metadata (every layer of a KV-cache group shares it).

    ``query_start_loc`` int32 (num_reqs + 1,), ``seq_lens`` int32 (num_reqs,) keys per
    request (computed + new), ``block_table`` int32 (num_reqs, max_blocks), ``slot_mapping``
    (num_tokens,): vLLM's tensors, read in place. ``max_query_len`` is vLLM's host value: the
    bound that spares our call a host read of ``query_start_loc``. ``num_splits``: the
    split-KV count of the step (0 heuristic / n for decode-only batches, 1 otherwise)."""
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_splits: int


def decode_splits() -> int:
    """The split-KV count of decode-only batches (``KERNELS_VLLM_DECODE_SPLITS``, default 0:
    the kernels' heuristic)."""
    value = os.environ.get(ENV_DECODE_SPLITS, "0")
    try:
        splits = int(value)
    except ValueError:
        splits = -1
    if splits < 0:
        raise ValueError(f"{ENV_DECODE_SPLITS} must be an int >= 0 (0 = the heuristic), got "
                         f"{value!r}")
    return splits


class TritonFusedMetadataBuilder(AttentionMetadataBuilder[TritonFusedMetadata]):
    """Builds ``TritonFusedMetadata`` from vLLM's ``CommonAttentionMetadata``: views of its
    tensors, no copy and no host read (the host values vLLM gives are used as they are).

    CUDA graphs: full graphs of decode-only batches (``UNIFORM_SINGLE_TOKEN_DECODE``). A
    decode step reads no device value on the host and its launch (grid, split count) depends
    only on shapes; mixed batches are not captured, since their grid follows the longest query
    sequence of the step."""
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    reorder_batch_threshold: Optional[int] = None   # one launch takes any order of rows

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.decode_splits = decode_splits()

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TritonFusedMetadata:
        cm = common_attn_metadata
        if not isinstance(cm.causal, bool) or not cm.causal:
            # supports_non_causal() is False: vLLM does not send these; never a wrong answer.
            raise NotImplementedError(f"{BACKEND_NAME} serves causal decoder attention only, "
                                      f"got causal={cm.causal!r}")
        decode_only = cm.max_query_len <= 1
        return TritonFusedMetadata(
            num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc, max_seq_len=cm.max_seq_len,
            seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            num_splits=self.decode_splits if decode_only else 1)


class TritonFusedBackend(AttentionBackend):
    """vLLM's view of our kernels: what they support, declared so that vLLM refuses other
    configurations at start-up with its own message (``validate_configuration``)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16",
                                                 *FP8_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        return TritonFusedImpl

    @staticmethod
    def get_builder_cls():
        return TritonFusedMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]   # any page size: pages are read row by row

    @classmethod
    def supported_kv_cache_layouts(cls):
        # Token-major blocks ([..., N, H, C]): K and V halves are (blocks, page, heads, D).
        return (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return 0 < head_size <= MAX_HEAD_SIZE

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix, device_capability):
        return fp8_cache_refusal(BACKEND_NAME, dtype, kv_cache_dtype)


def fp8_cache_refusal(name: str, dtype: torch.dtype, kv_cache_dtype: str) -> Optional[str]:
    """Why backend ``name`` cannot serve an FP8 ``kv_cache_dtype`` for a ``dtype`` model on
    this platform, or None (also for caches that are not FP8): the FP8-cache kernel reads
    float8_e4m3fn with fp16 / bf16 queries. Both our backends' ``supports_combination``."""
    if kv_cache_dtype in FP8_CACHE_DTYPES:
        if dtype not in (torch.float16, torch.bfloat16):
            return (f"an FP8 KV cache needs a float16 or bfloat16 model with {name} (its "
                    f"FP8-cache kernel), got {dtype}")
        from vllm.platforms import current_platform
        if current_platform.fp8_dtype() != torch.float8_e4m3fn:
            return (f"{name}'s FP8 caches are float8_e4m3fn; this platform's fp8 is "
                    f"{current_platform.fp8_dtype()}")
    return None


def _cache_halves(kv_cache: torch.Tensor, head_size: int, fp8: bool):
    """(k_cache, v_cache): views (num_blocks, page_size, heads_kv, head_size) of vLLM's layer
    cache (num_blocks, heads_kv, page_size, 2 * head_size); FP8 bytes seen as e4m3."""
    kv = kv_cache.transpose(1, 2)
    k_cache, v_cache = kv[..., :head_size], kv[..., head_size:]
    if fp8 and k_cache.dtype != torch.float8_e4m3fn:
        k_cache, v_cache = (c.view(torch.float8_e4m3fn) for c in (k_cache, v_cache))
    return k_cache, v_cache


class TritonFusedImpl(AttentionImpl):
    """Our attention for one vLLM layer: cache writes and the forward (see the module)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[list] = None, sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None) -> None:
        # vLLM's GPU platforms refuse a configuration at selection (validate_configuration);
        # its CPU platform takes CPU_ATTN's class path unvalidated: the same reasons here, at
        # the model's construction (start-up), whichever platform selected us. The layer is
        # built under the model's dtype as the default dtype.
        reasons = TritonFusedBackend.validate_configuration(
            head_size=head_size, dtype=torch.get_default_dtype(),
            kv_cache_dtype=kv_cache_dtype, block_size=None, use_mla=False,
            has_sink=sinks is not None, use_sparse=False, use_mm_prefix=False,
            use_per_head_quant_scales=False, device_capability=None, attn_type=attn_type)
        if reasons:
            raise NotImplementedError(f"{BACKEND_NAME} cannot serve this layer: "
                                      f"{'; '.join(reasons)}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = (None if alibi_slopes is None
                             else torch.tensor(alibi_slopes, dtype=torch.float32))
        # vLLM's sliding_window is the number of keys a query sees, itself included: our
        # ``window``.
        self.window = sliding_window
        self.softcap = logits_soft_cap if logits_soft_cap else None   # 0 / None: none
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = kv_cache_dtype in FP8_CACHE_DTYPES
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.sinks = sinks
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be ({num_heads},) (one per query head of the layer), "
                             f"got {tuple(sinks.shape)}")

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's keys and values (num_tokens, heads_kv, head_size) into the layer's
        cache at ``slot_mapping`` (-1: a padding token, skipped)."""
        CALLS["cache_write"] += 1
        k_cache, v_cache = _cache_halves(kv_cache, self.head_size, self.fp8)
        n = slot_mapping.shape[0]
        scales = dict(k_scale=layer._k_scale, v_scale=layer._v_scale) if self.fp8 else {}
        kernels.write_kv_cache(k_cache, v_cache, key[:n], value[:n], slot_mapping, **scales)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[TritonFusedMetadata],
                output: torch.Tensor, output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query (num_tokens, num_heads, head_size); the result is written into ``output``
        (num_tokens, num_heads, head_size) and returned."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME} has no fused output quantization")
        if attn_metadata is None:   # vLLM's profiling run: no cache yet
            return output.fill_(0)
        md = attn_metadata
        CALLS["forward" if md.num_splits == 1 else "decode_forward"] += 1
        n = md.num_actual_tokens
        k_cache, v_cache = _cache_halves(kv_cache, self.head_size, self.fp8)
        if self.alibi_slopes is not None and self.alibi_slopes.device != query.device:
            self.alibi_slopes = self.alibi_slopes.to(query.device)   # once, at the first step
        descales = {}
        if self.fp8:
            rows = (md.query_start_loc.shape[0] - 1, self.num_kv_heads)
            descales = dict(k_descale=layer._k_scale.reshape(1, 1).expand(rows),
                            v_descale=layer._v_scale.reshape(1, 1).expand(rows))
        kernels.attention_varlen(
            query[:n], k_cache, v_cache, md.query_start_loc, None,
            max_seqlen_q=md.max_query_len, block_table=md.block_table, seqused_k=md.seq_lens,
            causal=True, softmax_scale=self.scale, window=self.window, softcap=self.softcap,
            sinks=self.sinks, alibi_slopes=self.alibi_slopes, num_splits=md.num_splits,
            out=output[:n], **descales)
        return output
