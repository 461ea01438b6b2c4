"""The public functions: ``attention``, ``attention_varlen``, ``attention_with_kvcache``, the
integrations' entry points (``forward_with_lse``, ``backward``) and ``visible_mask``.

Each is one line of the pipeline (kernels/pipeline.py): resolve the call (validated once per
signature) → its cached plan → run it. The plan cache is ``kernels.plans``
(``kernels.plans.stats()``, ``kernels.plans.clear()``); docs/layout.md draws the layers.
"""
import torch

from .core import fallback
from .core.call import default_softmax_scale  # noqa: F401  (re-exported for integrations)
from .core.backend import _use_fallback  # noqa: F401  (the backend decision; tools patch it)
from .pipeline import (SEED_LIMIT, attention_plan, check_arguments, check_attn_mask,  # noqa: F401
                       check_grad_shapes,
                       integration_backward, integration_forward, integration_plan,
                       public_descales, kvcache_descales, kvcache_runner, latent_values,
                       paged_varlen, plans,
                       run_attention, run_kvcache, _packed)
from .pipeline import write_kv_cache as write_kv_slots


def attention(q, k, v, *, causal=True, dropout_p=0.0, softmax_scale=None, seed=None,
              window=None, num_splits=0, return_lse=False, softcap=None, sinks=None,
              chunk_size=None, alibi_slopes=None, score_mod=None, mask_mod=None, mod_aux=(),
              q_descale=None, k_descale=None, v_descale=None, out_dtype=None, attn_mask=None):
    """Fused scaled-dot-product attention: softmax(mask(q kᵀ · scale)) → dropout → @ v.

    Never materialises the (q_len × k_len) matrix; differentiable (FlashAttention-2-style
    backward that recomputes the weights); usable inside ``torch.compile(fullgraph=True)``.

    Args:
        q: (batch, heads_q, q_len, head_dim) float16 / bfloat16 / float32.
        k: (batch, heads_kv, k_len, head_dim), v: (batch, heads_kv, k_len, head_dim_v), q's
            dtype and device; v may have its own head dim (DeepSeek's MLA: 192 / 128), the
            output has it and the default scale stays 1 / sqrt(head_dim). heads_q must be a
            multiple of heads_kv: query head h reads kv head h // (heads_q // heads_kv)
            (grouped-query attention; heads_kv = 1 is multi-query), the rule of
            ``repeat_interleave`` and of SDPA's ``enable_gqa=True``. k and v are never copied
            or expanded. Any strides: views such as ``x.view(b, s, h, d).transpose(1, 2)`` are
            read in place (a copy is made only when the last dim is not unit-stride, on every
            path, the CPU fallback included). 1 <= head_dim, head_dim_v <= 512. heads_q = 0 is
            an empty
            problem (empty out and lse, zero gradients for k and v), like batch = 0;
            heads_kv = 0 with heads_q >= 1 is a ValueError.
        causal: mask keys in the future, aligned bottom-right when q_len != k_len::

                q_len=2, k_len=5 (KV-cache decoding)     q_len=5, k_len=2
                      k0 k1 k2 k3 k4                           k0 k1
                  q0   1  1  1  1  0                       q0   0  0   <- sees no key: zeros
                  q1   1  1  1  1  1                       q1   0  0
                                                           q2   0  0
                query i sees key j iff                     q3   1  0
                j <= i + (k_len - q_len)                   q4   1  1

        dropout_p: probability of zeroing each attention weight (after softmax); kept weights
            are scaled by 1 / (1 - dropout_p). 0 <= dropout_p < 1.
        softmax_scale: multiplies q kᵀ before the softmax; default 1 / sqrt(head_dim).
        seed: int in [0, 2**63) for the in-kernel Philox dropout mask; None draws one from
            PyTorch's default generator (so ``torch.manual_seed`` makes runs reproducible). The
            same (seed, shapes) give the same mask on every device; ``reference.dropout_keep_mask``
            recomputes it (query head h of batch b is row block b * heads_q + h).
        window: None, or a sliding window (requires causal): query i sees only the ``window``
            most recent keys, itself included, ``i + d - window < j <= i + d`` with
            d = k_len - q_len (Hugging Face's ``sliding_window``)::

                q_len = k_len = 5, window = 3
                      k0 k1 k2 k3 k4
                  q0   1  0  0  0  0
                  q1   1  1  0  0  0
                  q2   1  1  1  0  0
                  q3   0  1  1  1  0
                  q4   0  0  1  1  1

            ``window >= k_len`` is plain causal attention. Work is O(q_len · window): key tiles
            outside the band are never visited.
        num_splits: split-KV for launches too small to fill the GPU (decoding: few query rows,
            many keys): each query block's keys are shared among ``num_splits`` programs whose
            partial results are merged by their log-sum-exp (kernels/core/splitkv.py). 0 (default)
            lets ``kernels.core.configs.num_splits_heuristic`` choose from the shapes and the
            device's SM count (1 on CPU); 1 never splits; a larger value forces that many
            (splits left without keys cost an empty program). Forward only; results stay
            within the parity rule and deterministic.
        return_lse: also return the row log-sum-exp of the scaled scores.
        softcap: None, or > 0: Gemma 2's logit soft-capping of the scaled scores,
            ``s = softcap * tanh(s / softcap)``, before masking.
        sinks: None, or a float tensor (heads_q,) (float32; q's dtype accepted): gpt-oss's
            per-head sink logit, one more term of every row's softmax denominator with no
            value: ``w_ij = exp(s_ij) / (exp(sinks[h]) + sum_j exp(s_ij))``. Differentiable
            (``sinks.grad``). Dropout drops key weights only (the same mask as without sinks);
            lse includes the sink; a row that sees no key gives 0 (and lse = sinks[h]).
        chunk_size: None, or chunked attention (Llama 4; requires causal, not with window):
            query i at position P = i + k_len - q_len sees key j iff j <= P and
            j // chunk_size == P // chunk_size::

                q_len = k_len = 6, chunk_size = 3
                      k0 k1 k2 k3 k4 k5
                  q0   1  0  0  0  0  0
                  q1   1  1  0  0  0  0
                  q2   1  1  1  0  0  0
                  q3   0  0  0  1  0  0
                  q4   0  0  0  1  1  0
                  q5   0  0  0  1  1  1

            Key tiles outside a query block's chunk are never visited: O(q_len * chunk_size).
        alibi_slopes: None, or float32 (heads_q,) or (batch, heads_q): ALiBi (FlashAttention's
            convention), the bias ``-slope * |i + k_len - q_len - j|`` added to the (soft-capped)
            score before masking. Not differentiable.
        q_descale, k_descale, v_descale, out_dtype: FP8 attention (FlashAttention-3's forward):
            q, k, v all ``torch.float8_e4m3fn`` (no other FP8 format), each standing for its
            values times its descale, a float32 (batch, heads_kv) tensor (None = 1) applied in
            the kernel (q·k's in the softmax scale, v's on the output); the weights P are
            rounded to e4m3 (scaled by 2**8) for the P @ V product. out_dtype: torch.bfloat16
            (default) or torch.float16. Forward only (gradients raise: train in bf16), no
            dropout. GPUs with FP8 tensor cores (sm_89 and later) run the FP8 kernel; others,
            and the CPU, the same quantized math in PyTorch (warned once). docs/features.md.
        score_mod, mask_mod, mod_aux: a user's ``kernels.ScoreMod`` / ``kernels.MaskMod``
            (@triton.jit functions with PyTorch twins; contract in kernels/core/mods.py) and
            the tuple of tensors they read. The score mod applies after softcap and ALiBi, the
            mask mod on top of causal / window / chunk.
        attn_mask: None, or SDPA's ``attn_mask``, broadcastable to (batch, heads_q, q_len,
            k_len), read through its strides (broadcast or sliced views cost no copy), on top
            of causal / window / chunk (pass ``causal=False`` for the mask alone); a row left
            without keys gives zeros where SDPA gives NaN. Either
            - bool: True where the query attends to the key. Tiles before a query block's
              first visible key and after its last are skipped (per 16 rows;
              ``kernels.core.tensor_mask``): a causal, windowed, chunked or block-diagonal
              mask costs about what it shows. The bounds (a few reductions over the mask) are
              computed once per mask tensor and version, so the layers of a model sharing one
              mask pay them once; under torch.compile, pass a ``kernels.TensorMask(mask)``
              built outside for the same. Takes the mask mod's place (not with mask_mod /
              mod_aux); or
            - float: added to the scaled scores (-inf hides a pair), after softcap and ALiBi;
              differentiable (``attn_mask.grad``, summed over its broadcast dims; atomics:
              its last bits vary run to run). Converted to float32 once per call if it is not.
              Takes the score mod's place (not with score_mod / mod_aux). Without a mask_mod,
              from 512 x 512 pairs per head on, it also gets the boolean mask's tile bounds
              from its entries above -inf (a few reductions over the bias, once per bias
              tensor and version, as a bool mask's), so a causal or padded bias skips the
              tiles it hides; else every tile is visited.

    Returns:
        out: (batch, heads_q, q_len, head_dim_v) in q's dtype. It has q's memory layout when q
            is dense (and head_dim_v == head_dim), so a head split by ``view().transpose(1, 2)``
            merges back with a free
            ``out.transpose(1, 2).reshape(batch, q_len, heads * head_dim)``.
        lse (only with ``return_lse``): float32 (batch, heads_q, q_len), natural log, -inf for a
            row that sees no key. Not differentiable.
        A NaN in a query row that sees a key gives NaN in that row of out and lse on every
        path, as in ``reference.attention`` (tests/core/test_layouts_property.py).
    """
    descale = public_descales(q_descale, k_descale, v_descale)
    if attn_mask is not None:
        score_mod, mask_mod, mod_aux = check_attn_mask(attn_mask, q, k, score_mod, mask_mod,
                                                       mod_aux)
    plan, mods = attention_plan(q, k, v, (causal, dropout_p, softmax_scale, window, num_splits,
                                          softcap, chunk_size, score_mod, mask_mod, None),
                                sinks, alibi_slopes, mod_aux, descale=descale,
                                out_dtype=out_dtype)
    out, lse = run_attention(plan, mods, q, k, v, seed, sinks, alibi_slopes, mod_aux,
                             need_lse=return_lse, descale=descale)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     *, causal=True, dropout_p=0.0, softmax_scale=None, seed=None, window=None,
                     return_lse=False, softcap=None, sinks=None, chunk_size=None,
                     alibi_slopes=None, score_mod=None, mask_mod=None, mod_aux=(),
                     block_table=None, seqused_k=None, q_descale=None, k_descale=None,
                     v_descale=None, out_dtype=None, num_splits=0, out=None):
    """Attention over packed sequences of different lengths (FlashAttention's varlen layout).

    Sequence s is rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of q and
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` of k and v; it attends only within itself, with the
    causal mask aligned bottom-right per sequence and everything else as in ``attention``::

            cu_seqlens_q = cu_seqlens_k = [0, 2, 5]       (x = visible, causal)
                   k0 k1 | k2 k3 k4
              q0    x  . |  .  .  .      sequence 0: rows 0-1
              q1    x  x |  .  .  .
              -----------+---------
              q2    .  . |  x  .  .      sequence 1: rows 2-4
              q3    .  . |  x  x  .
              q4    .  . |  x  x  x

    Args:
        q: (total_q, heads_q, head_dim); k: (total_k, heads_kv, head_dim), v: (total_k,
            heads_kv, head_dim_v) with
            heads_q % heads_kv == 0 (grouped-query heads as in ``attention``; heads_q = 0 gives
            empty results). fp16 / bf16 / fp32, one dtype and device, any strides.
        cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,) on q's device, starting at 0,
            non-decreasing, ending at total_q / total_k. Zero-length sequences are allowed (a
            query row whose sequence has no keys gives zeros and lse -inf).
        max_seqlen_q, max_seqlen_k: optional ints, the longest sequence of each (sizes the
            grid). Outside ``torch.compile`` tracing, cu_seqlens are read once on the host
            (one small sync) and every check above runs, including that a hint is not smaller
            than a real length (ValueError). Inside a compiled graph nothing is read while
            tracing: the caller guarantees valid cu_seqlens and hints >= the real lengths (a
            missing hint is computed in the op, at run time).
        causal, dropout_p, softmax_scale, seed, window: as in ``attention``. The dropout mask
            gives every (sequence, query head, row, key column) its own Philox word;
            ``reference.dropout_keep_mask_varlen`` recomputes it.
        return_lse: also return the row log-sum-exp.
        softcap, sinks, chunk_size, alibi_slopes, score_mod, mask_mod, mod_aux: as in
            ``attention``, per sequence (positions and ``b`` count within each sequence);
            alibi_slopes may be (num_seqs, heads_q).

        block_table, seqused_k: packed queries over a **paged** KV cache (FlashAttention 2's
            ``flash_attn_varlen_func(..., block_table=)``, vLLM's unified attention; forward
            only, no dropout). k: (num_blocks, page_size, heads_kv, head_dim), v:
            (num_blocks, page_size, heads_kv, head_dim_v), a pool of pages; block_table: int32
            (num_seqs, max_blocks): key position j of sequence s is row j % page_size of page
            block_table[s, j // page_size]; the key counts are ``seqused_k`` (int32
            (num_seqs,)) or else the differences of ``cu_seqlens_k``. Each sequence's queries
            are its last positions (causal bottom-right), so decode rows (one query) and
            prefill rows mix in one launch. Pages are read in place (never gathered), any
            page_size >= 1; counts and page indices are checked when on the CPU, the caller's
            contract on the GPU. ``.backward()`` through it raises a clear RuntimeError.
            With tensors on a GPU, a given ``max_seqlen_q`` is trusted (no host read, no sync:
            a serving engine's step, CUDA-graph capture); calls whose longest query sequence
            rounds up to the same power of two share one cached plan.
        num_splits: paged calls only: split-KV as in ``attention_with_kvcache`` (0: the
            heuristic, which splits decode batches too small to fill the GPU; 1: no split).
        out: paged calls only: an optional (total_q, heads_q, head_dim_v) tensor in the
            output dtype, unit stride in head_dim, that the result is written into (a
            serving engine's output buffer) and returned.

    Returns:
        out: (total_q, heads_q, head_dim_v) in q's dtype.
        lse (only with ``return_lse``): float32 (heads_q, total_q), natural log, -inf for rows
            that see no key. Not differentiable.
    """
    if block_table is not None:
        latent, _, (v_descale,) = latent_values(k, v, None, None, (k_descale,), (v_descale,))
        out, lse = paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                                max_seqlen_q, (causal, dropout_p, softmax_scale, window,
                                               num_splits, softcap, chunk_size, score_mod,
                                               mask_mod, None),
                                sinks, alibi_slopes, mod_aux,
                                public_descales(q_descale, k_descale, v_descale), out_dtype,
                                out, latent)
        return (out, lse) if return_lse else out
    descale = public_descales(q_descale, k_descale, v_descale)
    for name, value, default in (("seqused_k", seqused_k, None), ("out", out, None),
                                 ("num_splits", num_splits, 0)):
        if (value is not None) if default is None else (value != default):
            raise ValueError(f"{name} goes with block_table (a paged cache: serving); packed "
                             f"k, v without pages take {name}={default}, got {value!r}")
    packed = _packed(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)
    options = (causal, dropout_p, softmax_scale, window, 0, softcap, chunk_size, score_mod,
               mask_mod, None)
    plan, mods = attention_plan(q, k, v, options, sinks, alibi_slopes, mod_aux, packed,
                                descale=descale, out_dtype=out_dtype)
    out, lse = run_attention(plan, mods, q, k, v, seed, sinks, alibi_slopes, mod_aux, packed,
                             descale=descale)
    return (out, lse) if return_lse else out


def write_kv_cache(k_cache, v_cache, k, v, slot_mapping, *, k_scale=None, v_scale=None):
    """Write new keys and values into a paged KV cache at given slots, in place (vLLM's
    ``reshape_and_cache_flash``; the serving engines' way of filling the cache that
    ``attention_varlen(..., block_table=)`` reads).

    Token t's rows go to slot ``s = slot_mapping[t]``: row ``s % page_size`` of page
    ``s // page_size``; tokens with ``s < 0`` (padding) are skipped. Runs the KV-cache append
    kernel (one launch, no host read of the slots) where the kernels run, the PyTorch fallback
    elsewhere.

    Args:
        k_cache, v_cache: (num_blocks, page_size, heads_kv, D) and (..., Dv), any strides with
            a unit one in head_dim (e.g. the two halves of one cache tensor), written in place.
        k, v: (num_tokens, heads_kv, D) and (num_tokens, heads_kv, Dv) in the caches' dtype,
            or fp16 / bf16 / fp32 into a float8_e4m3fn cache: stored as ``x / k_scale``
            clamped to +-448 and rounded to e4m3 (as vLLM's FP8 caches), the values
            ``attention_varlen``'s FP8-cache path reads back with ``k_descale = k_scale``.
        slot_mapping: int32 or int64 (num_tokens,) on the caches' device; checked against the
            cache's capacity when on the CPU, the caller's contract on a GPU.
        k_scale, v_scale: FP8 caches only: per-tensor scales (a float or a one-element float32
            tensor; None = 1).
    """
    write_kv_slots(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=None, v=None, *, causal=True,
                           softmax_scale=None, window=None, num_splits=0, return_lse=False,
                           softcap=None, sinks=None, chunk_size=None, alibi_slopes=None,
                           score_mod=None, mask_mod=None, mod_aux=(), block_table=None,
                           q_descale=None, k_descale=None, v_descale=None, k_scale=None,
                           v_scale=None, out_dtype=None):
    """Attention of new query tokens against a preallocated KV cache (generation), optionally
    appending their keys and values first; FlashAttention's serving API in our layout.

    Args:
        q: (batch, heads_q, q_len, head_dim): 1 token when decoding, a few for speculative
            decoding (any q_len works).
        k_cache: (batch, heads_kv, max_len, head_dim), v_cache: (batch, heads_kv, max_len,
            head_dim_v), q's dtype and device, heads_q % heads_kv == 0 (grouped-query heads
            read natively).
        cache_seqlens: int32 (batch,): how many positions of each row's cache are filled
            (rows may differ). Not modified: the caller advances it.
        k, v: optional (batch, heads_kv, q_len, head_dim or head_dim_v): written into the
            caches **in
            place** at positions cache_seqlens[b] ... cache_seqlens[b] + q_len - 1 before
            attending. Lengths on the CPU are checked (negative, or past max_len: ValueError);
            lengths on the GPU are the caller's contract (not read, to avoid a sync), and the
            kernels never write or read past max_len even if it is broken.
        causal: with n = cache_seqlens[b] (+ q_len with k, v), query i of row b sees cache
            positions j < n with j <= i + n - q_len (bottom-right over the filled length);
            False: every j < n.
        softmax_scale, window: as in ``attention``.
        num_splits: split-KV as in ``attention`` (0: heuristic; long caches at small batch get
            split across the GPU's SMs).
        return_lse: also return lse fp32 (batch, heads_q, q_len).
        softcap, sinks, chunk_size, alibi_slopes, score_mod, mask_mod, mod_aux: as in
            ``attention`` (positions count over the filled cache). Forward only here, so
            ``sinks`` gets no gradient.
        block_table: optional int32 (batch, max_blocks): a **paged** cache (FlashAttention
            2's and vLLM's layout). k_cache is then (num_blocks, page_size, heads_kv,
            head_dim) and v_cache (num_blocks, page_size, heads_kv, head_dim_v), a pool of
            pages shared by the batch; cache position j of row b is row j % page_size of page
            block_table[b, j // page_size], so max_len = max_blocks * page_size (any
            page_size >= 1). Only the entries covering a row's filled (and appended)
            positions are read (page indices in [0, num_blocks): checked when the table is
            on the CPU, the caller's contract on the GPU, like the lengths); k, v keep the
            (batch, heads_kv, q_len, .) layout and are written into their pages. The kernels
            read and write the pages in place (no gathered copy), with split-KV,
            grouped-query heads and every option above; one compile per page size.
        k_descale, v_descale / k_scale, v_scale: an **FP8 cache** (k_cache, v_cache
            ``torch.float8_e4m3fn``) read by float16 / bfloat16 q: its entries stand for their
            values times these scales, per (batch, heads_kv) (FlashAttention-3's
            ``k_descale`` / ``v_descale``: float32 (batch, heads_kv)) or per tensor (vLLM's
            ``k_scale`` / ``v_scale``: a float or a one-element float32 tensor); None = 1.
            New k, v come in q's dtype and are quantized into the cache in the kernel
            (x / scale, clamped to e4m3's +-448). With FP8 q too (``q_descale``,
            ``out_dtype`` as in ``attention``), new k, v come in FP8, already quantized.

    Returns:
        out (batch, heads_q, q_len, head_dim_v) in q's dtype [, lse]. heads = 0 (q of shape
        (batch, 0, q_len, head_dim), caches with 0 heads) gives an empty out and lse. Forward
        only: ``.backward()`` through it raises a RuntimeError that says so (train with
        ``attention`` or ``attention_varlen``); works under ``torch.inference_mode()`` and
        ``torch.compile(fullgraph=True)`` (a custom op that declares it mutates the caches).
    """
    latent, v, (v_scale, v_descale) = latent_values(k_cache, v_cache, k, v, (k_scale, k_descale),
                                                    (v_scale, v_descale))
    descale = kvcache_descales(q, k_cache, block_table, q_descale, k_descale, v_descale,
                               k_scale, v_scale)
    runner, mods = kvcache_runner(q, k_cache, v_cache, cache_seqlens, k, v, block_table, (
        causal, softmax_scale, window, num_splits, softcap, chunk_size, score_mod, mask_mod),
        sinks, alibi_slopes, mod_aux, descale, out_dtype, latent)
    out, lse = run_kvcache(runner, mods, q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                           sinks, alibi_slopes, mod_aux, descale)
    return (out, lse) if return_lse else out


def forward_with_lse(q, k, v, *, causal=True, dropout_p=0.0, softmax_scale=None, seed=0,
                     window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                     max_seqlen_k=None, drop_layout=None, attn_mask=None):
    """(out, lse) of ``attention`` (dense) or ``attention_varlen`` (with cu_seqlens), same
    arguments and validation, but as a plain forward: for integrations that register their own
    backward (kernels.sdpa, kernels.distributed), which pass the same arguments to
    ``backward``. ``seed``: an int, or a 0-d int64 tensor on q's device (read by the
    kernels, never by the host: no sync), the dropout mask's Philox key; ignored without
    dropout. ``attn_mask``: ``attention``'s (bool or additive float; dense calls only).
    ``drop_layout``: see ``check_drop_layout`` (context parallelism's blocks)."""
    c = integration_plan(q, k, v, causal, dropout_p, softmax_scale, window, cu_seqlens_q,
                         cu_seqlens_k, max_seqlen_q, max_seqlen_k, drop_layout, seed, attn_mask)
    return integration_forward(c, q, k, v)


def backward(do, q, k, v, out, lse, *, causal=True, dropout_p=0.0, softmax_scale=None, seed=0,
             window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, drop_layout=None, attn_mask=None, attn_mask_grad=False):
    """(dq, dk, dv) for ``do`` = dL/d(out), given the (out, lse) of ``forward_with_lse`` with
    the same arguments; shapes and layouts of q, k, v. Deterministic. With another call's
    (out, lse) -- the merged result of several key blocks -- it gives this block's share of the
    gradients (FlashAttention-2's backward only needs the final out and lse).

    ``attn_mask_grad`` (an additive float ``attn_mask``): returns (dq, dk, dv, d_attn_mask),
    the last in attn_mask's shape and dtype, the gradient of each of its elements as given (a
    broadcast (stride-0) view's elements each get their own; its size-1 dims sum over what
    they broadcast to). Not deterministic in its last bits (atomics)."""
    if attn_mask_grad:
        if not (isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point()):
            raise ValueError(f"attn_mask_grad=True needs an additive (floating) attn_mask, got "
                             f"{_describe(attn_mask)}")
        # Each element its own gradient: one fp32 copy of the mask in its own shape (the
        # kernels' gradient buffer shares its indexing).
        mask_in = attn_mask
        attn_mask = attn_mask.contiguous()
    c = integration_plan(q, k, v, causal, dropout_p, softmax_scale, window, cu_seqlens_q,
                         cu_seqlens_k, max_seqlen_q, max_seqlen_k, drop_layout, seed, attn_mask)
    check_grad_shapes(do, q, out, lse, c.packed is not None)
    grads = integration_backward(c, do, q, k, v, out, lse, aux_grad=attn_mask_grad)
    if not attn_mask_grad:
        return grads
    return (*grads[:3], grads[3].reshape(mask_in.shape).to(mask_in.dtype))


def _describe(t):
    return f"{t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__


def visible_mask(q_len, k_len, *, causal=True, window=None, chunk_size=None, device=None):
    """bool (q_len, k_len): True where query i sees key j under the kernels' rule (bottom-right
    causal ``j <= P`` with P = i + k_len - q_len; with ``window`` also ``j > P - window``; with
    ``chunk_size`` also ``j // chunk_size == P // chunk_size``; everything without causal). For
    integrations that must check that a model's own mask is the pattern the kernels compute;
    never used to compute attention."""
    return fallback.block_visible(0, q_len, 0, k_len, q_len, k_len, causal, window, device,
                                  chunk_size=chunk_size)
