"""The ``TRITON_FUSED_MLA`` vLLM v1 attention backend: multi-head latent attention (DeepSeek
V2 / V3 MLA) on vLLM 0.32's MLA interface, over ``kernels``' public functions only.

vLLM's ``MLAAttention`` layer does the projections (the weight-absorbed ``W_UK`` before
decode, ``W_UV`` after it, ``kv_b_proj`` for prefill) and calls three methods of our impl:

- ``do_kv_cache_update``: one latent row per token, ``kv_c_normed`` (T, kv_lora_rank) then
  ``k_pe`` (T, 1, rope_dim), at vLLM's ``slot_mapping`` (-1: padding, skipped). The layer's
  cache is (num_blocks, page_size, kv_lora_rank + rope_dim); seen as our paged layout (blocks,
  page, 1 head, 576) it is written by ``kernels.write_kv_cache`` with the latent as "K" (its
  first 512 columns) and the rope key as "V" (its last 64): both parts in one call, no
  concatenated copy. FP8 caches (``fp8`` / ``fp8_e4m3``) are quantized with the layer's
  ``_k_scale`` for the whole row, as vLLM's ``concat_and_cache_mla``.
- ``forward_mqa`` (decode rows): the absorbed query (B, heads, 576) attends to the ONE latent
  head of the paged cache: ``kernels.attention_varlen(..., block_table=)`` with
  ``k_cache`` = the cache (blocks, page, 1, 576) and ``v_cache = k_cache[..., :512]`` (a
  view: the values are the latent's first kv_lora_rank columns, read in place, never copied).
  Result (B, heads, kv_lora_rank); the layer applies ``W_UV``. Rows with several queries
  (speculative decoding) are causal bottom-right in the same call.
- ``forward_mha`` (prefill rows): ``kv_b_proj`` up-projects the new tokens' latents to per-head
  keys (qk_nope + rope = 192) and values (128), and one packed
  ``kernels.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)`` runs over
  the prefill sequences (vLLM's selected MLA prefill backend is not used). With context in the
  cache (chunked prefill, prefix-cache hits: GPU platforms; vLLM's CPU platform turns both
  off for MLA unless the CPU has AMX, and only a test engine of ours keeps them there:
  docs/integrations.md), the context latents are gathered from the pages, up-projected and
  put before each sequence's new keys, and the same call's bottom-right causal mask does the
  rest (no log-sum-exp merge).
"""
import collections
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from vllm.model_executor.layers.attention.mla_attention import (MLACommonBackend,
                                                                MLACommonDecodeMetadata,
                                                                MLACommonImpl,
                                                                MLACommonMetadata,
                                                                MLACommonMetadataBuilder,
                                                                QueryLenSupport)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, MultipleOf

import kernels

from . import MLA_BACKEND_NAME
from .backend import FP8_CACHE_DTYPES, MAX_HEAD_SIZE, decode_splits, fp8_cache_refusal

# The latent row our paged kernels take: kv_lora_rank + rope_dim (DeepSeek: 512 + 64). Its
# first kv_lora_rank columns are the values, so kv_lora_rank is bounded by MAX_HEAD_SIZE.
MAX_LATENT_SIZE = 576
# Calls served in this process ("mla_decode", "mla_prefill", "mla_prefill_context",
# "mla_cache_write"): how tests (and a user) see that this backend served an engine.
CALLS = collections.Counter()


@dataclass
class TritonFusedMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata (``block_table`` (num_decodes, max_blocks), ``seq_lens``
    (num_decodes,)) plus what our varlen call takes: ``query_start_loc`` int32
    (num_decodes + 1,) of the decode rows and ``max_query_len`` (a host int: the bound that
    spares the call a host read), and the step's split-KV count."""
    query_start_loc: Optional[torch.Tensor] = None
    max_query_len: int = 1
    num_splits: int = 1


class TritonFusedMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's common MLA builder (decode / prefill split, prefill context chunks), whose decode
    part also keeps the decode rows' ``query_start_loc``: our paged call takes rows of any
    query length (causal bottom-right), hence ``QueryLenSupport.VARLEN`` (speculative decoding
    keeps its multi-token rows on the decode path)."""
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.decode_splits = decode_splits()

    def _build_decode(self, block_table_tensor, seq_lens_device, max_seq_len,
                      query_start_loc_cpu, query_start_loc_device, num_decode_tokens,
                      max_query_len, dcp_tot_seq_lens_device):
        return TritonFusedMLADecodeMetadata(
            block_table=block_table_tensor, seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device, query_start_loc=query_start_loc_device,
            max_query_len=max_query_len,
            num_splits=self.decode_splits if max_query_len <= 1 else 1)


class TritonFusedMLABackend(MLACommonBackend):
    """vLLM's view of our MLA: what it supports, declared so that vLLM's GPU selection refuses
    other configurations with its own message (``validate_configuration``)."""

    supported_dtypes: ClassVar[list] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16",
                                                 *FP8_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return MLA_BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        return TritonFusedMLAImpl

    @staticmethod
    def get_builder_cls():
        return TritonFusedMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list:
        return []   # any latent row up to MAX_LATENT_SIZE: supports_head_size

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return 0 < head_size <= MAX_LATENT_SIZE

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]   # any page size: pages are read row by row

    @classmethod
    def supports_block_size(cls, block_size: Optional[int]) -> bool:
        return block_size is None or block_size >= 1

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix, device_capability):
        return fp8_cache_refusal(MLA_BACKEND_NAME, dtype, kv_cache_dtype)


def _paged(kv_cache: torch.Tensor, fp8: bool) -> torch.Tensor:
    """The layer's latent cache (num_blocks, page_size, latent) as our paged layout (num_blocks,
    page_size, 1, latent), a view; FP8 bytes seen as e4m3."""
    cache = kv_cache.unsqueeze(2)
    if fp8 and cache.dtype != torch.float8_e4m3fn:
        cache = cache.view(torch.float8_e4m3fn)
    return cache


class TritonFusedMLAImpl(MLACommonImpl[MLACommonMetadata]):
    """Our MLA for one vLLM layer: cache writes, decode and prefill (see the module)."""

    # No log-sum-exp for decode context parallelism: DCP is refused.
    can_return_lse_for_decode: bool = False
    supports_dcp: bool = False
    supports_pcp: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[list], sliding_window: Optional[int],
                 kv_cache_dtype: str, logits_soft_cap: Optional[float], attn_type: str,
                 kv_sharing_target_layer_name: Optional[str], **mla_args) -> None:
        # vLLM's CPU platform takes CPU_MLA's class path unvalidated: refuse here, as the model
        # is built (start-up), what vLLM's GPU selection would refuse, and what MLA adds.
        reasons = TritonFusedMLABackend.validate_configuration(
            head_size=head_size, dtype=torch.get_default_dtype(),
            kv_cache_dtype=kv_cache_dtype, block_size=None, use_mla=True, has_sink=False,
            use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
            device_capability=None, attn_type=attn_type)
        kv_lora_rank = mla_args.get("kv_lora_rank", 0)
        qk_head_dim, v_head_dim = mla_args.get("qk_head_dim", 0), mla_args.get("v_head_dim", 0)
        if kv_lora_rank > MAX_HEAD_SIZE:
            reasons.append(f"kv_lora_rank {kv_lora_rank} > {MAX_HEAD_SIZE} (the values' width)")
        if max(qk_head_dim, v_head_dim) > MAX_HEAD_SIZE:
            reasons.append(f"prefill head sizes {qk_head_dim} / {v_head_dim} > {MAX_HEAD_SIZE}")
        for name, value in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                            ("logits_soft_cap", logits_soft_cap),
                            ("kv sharing", kv_sharing_target_layer_name),
                            ("an indexer (sparse MLA)", mla_args.get("indexer"))):
            if value:
                reasons.append(f"{name} not supported with MLA")
        if reasons:
            raise NotImplementedError(f"{MLA_BACKEND_NAME} cannot serve this layer: "
                                      f"{'; '.join(reasons)}")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **mla_args)
        from vllm.config import get_current_vllm_config
        parallel = get_current_vllm_config().parallel_config
        if self.dcp_world_size > 1 or parallel.prefill_context_parallel_size > 1:
            # (supports_dcp / supports_pcp are False: vLLM's GPU selection says so too)
            raise NotImplementedError(f"{MLA_BACKEND_NAME} cannot serve this layer: decode / "
                                      f"prefill context parallelism not supported")
        self.fp8 = kv_cache_dtype in FP8_CACHE_DTYPES
        # The query stays in the model's dtype with an FP8 cache: our FP8-cache kernel takes
        # fp16 / bf16 queries and dequantizes the pages it reads.
        self.supports_quant_query_input = False
        # No head padding: our kernels take any head count (FlashMLA pads to 64 / 128).
        self.q_pad_num_heads = None

    def fused_output_quant_supported(self, quant_key) -> bool:
        # Not offered: vLLM's fusion pass then leaves the output quantization unfused.
        return False

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        """Write kv_c_normed (T, kv_lora_rank) and k_pe (T, 1, rope_dim) as the latent rows of
        the layer's cache (num_blocks, page_size, kv_lora_rank + rope_dim) at
        ``slot_mapping`` (-1: a padding token, skipped)."""
        if kv_cache.numel() == 0:   # vLLM's profiling run
            return
        CALLS["mla_cache_write"] += 1
        cache = _paged(kv_cache, self.fp8)
        n = slot_mapping.shape[0]
        rank = self.kv_lora_rank
        # One latent head: "K" = the latent (its first kv_lora_rank columns), "V" = the rope
        # key (the rest); one scale for the row, as vLLM's concat_and_cache_mla.
        scales = dict(k_scale=k_scale, v_scale=k_scale) if self.fp8 else {}
        kernels.write_kv_cache(cache[..., :rank], cache[..., rank:],
                               kv_c_normed[:n].unsqueeze(1), k_pe[:n].view(n, 1, -1),
                               slot_mapping, **scales)

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: MLACommonMetadata, layer):
        """Decode rows: q (B, heads, kv_lora_rank + rope_dim), or its (absorbed nope, rope)
        halves, over the latent cache (num_blocks, page_size, kv_lora_rank + rope_dim).
        Returns ((B, heads, kv_lora_rank) in q's dtype, None: no lse)."""
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        md = attn_metadata.decode
        CALLS["mla_decode"] += 1
        cache = _paged(kv_c_and_k_pe_cache, self.fp8)
        out = torch.empty(q.shape[0], q.shape[1], self.kv_lora_rank, dtype=q.dtype,
                          device=q.device)
        descales = {}
        if self.fp8:
            # The values are the keys' own bytes (v_cache is k_cache's prefix): read back with
            # the row's one scale, given as k's only.
            rows = (md.query_start_loc.shape[0] - 1, 1)
            descales = dict(k_descale=layer._k_scale.reshape(1, 1).expand(rows))
        kernels.attention_varlen(
            q, cache, cache[..., :self.kv_lora_rank], md.query_start_loc, None,
            max_seqlen_q=md.max_query_len, block_table=md.block_table, seqused_k=md.seq_lens,
            causal=True, softmax_scale=self.scale, num_splits=md.num_splits, out=out,
            **descales)
        return out, None

    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata,
                    k_scale: torch.Tensor, output: torch.Tensor,
                    output_scale: Optional[torch.Tensor] = None) -> None:
        """Prefill rows: q (T, heads, qk_head_dim), the new tokens' kv_c_normed (T,
        kv_lora_rank) and k_pe (T, 1, rope_dim); the result (T, heads * v_head_dim) is
        written into ``output``."""
        if output_scale is not None:   # fused_output_quant_supported is False: not sent
            raise NotImplementedError(f"{MLA_BACKEND_NAME} has no fused output quantization")
        pm = attn_metadata.prefill
        k, v = self._up_project(kv_c_normed, k_pe)
        cu_q, max_q = pm.query_start_loc, pm.max_query_len
        context = pm.chunked_context
        if context is None:
            CALLS["mla_prefill"] += 1
            cu_k, max_k = cu_q, max_q
        else:
            CALLS["mla_prefill_context"] += 1
            k, v, cu_k, max_k = self._with_context(k, v, kv_c_and_k_pe_cache, pm, k_scale)
        result = kernels.attention_varlen(q, k, v, cu_q, cu_k, max_q,
                                          max_k, causal=True, softmax_scale=self.scale)
        output.view(-1, self.num_heads, self.v_head_dim).copy_(result)

    def _up_project(self, kv_c: torch.Tensor, k_pe: torch.Tensor):
        """Per-head keys (T, heads, qk_nope + rope_dim) and values (T, heads, v_head_dim, a
        view) of latents kv_c (T, kv_lora_rank) and rope keys k_pe (T, 1, rope_dim)."""
        kv_nope = self.kv_b_proj(kv_c)[0].view(-1, self.num_heads,
                                               self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv_nope.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return self._concat_k_nope_k_pe(k_nope, k_pe), v

    def _with_context(self, k_new, v_new, cache, pm, k_scale):
        """Keys and values of the prefill sequences with their cached context first: (total_k,
        heads, ...) packed per sequence as [context, new tokens], their int32 cu_seqlens_k and
        longest length. The context latents are gathered from the pages (dequantized with
        ``k_scale`` from an FP8 cache) and up-projected like the new tokens'.

        vLLM's own path gathers the context in workspace-sized chunks and merges partial
        results by their lse; here it is gathered whole (memory ~ the context's up-projected
        keys and values), which keeps one attention call per step."""
        device = k_new.device
        ctx = torch.tensor(pm.chunked_context.context_lens_list, dtype=torch.int64)
        new = pm.query_lens_cpu.to(torch.int64)
        seqs = torch.arange(ctx.numel())
        lens = ctx + new
        starts = torch.cumsum(lens, 0) - lens     # each sequence's first key row
        ctx_starts = torch.cumsum(ctx, 0) - ctx
        new_starts = torch.cumsum(new, 0) - new
        # context token i of sequence s: position i, key row starts[s] + i
        ctx_seq = torch.repeat_interleave(seqs, ctx)
        ctx_pos = torch.arange(int(ctx.sum())) - ctx_starts[ctx_seq]
        new_seq = torch.repeat_interleave(seqs, new)
        new_rows = starts[new_seq] + ctx[new_seq] + torch.arange(int(new.sum())) - \
            new_starts[new_seq]
        ctx_rows = (starts[ctx_seq] + ctx_pos).to(device)
        new_rows = new_rows.to(device)
        page = cache.shape[1]
        ctx_seq, ctx_pos = ctx_seq.to(device), ctx_pos.to(device)
        slots = pm.block_table[ctx_seq, ctx_pos // page].long() * page + ctx_pos % page
        latent = cache.reshape(-1, cache.shape[-1])[slots]
        if self.fp8:
            latent = (latent.view(torch.float8_e4m3fn).to(torch.float32)
                      * k_scale.float()).to(k_new.dtype)
        k_ctx, v_ctx = self._up_project(latent[:, :self.kv_lora_rank],
                                        latent[:, None, self.kv_lora_rank:])
        total = int(lens.sum())
        k = k_new.new_empty(total, *k_new.shape[1:])
        v = v_new.new_empty(total, *v_new.shape[1:])
        k[ctx_rows], k[new_rows] = k_ctx, k_new
        v[ctx_rows], v[new_rows] = v_ctx, v_new
        cu_k = torch.zeros(lens.numel() + 1, dtype=torch.int32)
        cu_k[1:] = torch.cumsum(lens, 0)
        return k, v, cu_k.to(device), int(lens.max())
