"""Feature rows: grouped-query heads, a sliding window, chunked attention, packed sequences
(also over a paged cache), a value head dim of its own (MLA), split-KV decoding, a boolean
``attn_mask`` (``mask``: a sliding window given as a mask tensor), DeepSeek's absorbed MLA
decode over a paged 576-wide latent cache (``mla_decode``: bf16 q, forward only) and a
transformers model (``hf``), each against what it should at least match; ``--features`` /
``--no-features``; run right after the sweep's primary config. Modes ``fwd`` and ``fwd_bwd``
(decode, paged: ``fwd``), causal, the sweep's first dtype, measured like every row (measure.py);
the providers and extra columns are in docs/performance.md. ``target_met`` is None on CPU.
"""
import importlib.util
import random
import time

import torch

from .flops import (attention_flops, gbps, ideal_chunk_speedup, ideal_window_speedup,
                    kv_read_bytes, tflops, varlen_flops)
from .measure import (MEASURE_KEYS, classify_failure, describe, free_memory, measure,
                      mode_maker)
from .providers import Case, SdpaProvider
from .sweep import add_speedups, new_row

FEATURES = ("gqa", "window", "chunk", "varlen", "mla", "decode", "fp8", "mask", "mla_decode",
            "hf")
# On CPU ``hf`` is left out of the default (~8 s of interpreted attention; --features hf).
DEFAULT_FEATURES = {"cuda": FEATURES, "cpu": tuple(f for f in FEATURES if f != "hf")}
FEATURE_MODES = ("fwd", "fwd_bwd")
CPU_REPS = 1  # timed calls per row on CPU (after the warm-up call)

# Shapes per device type. GPU: the points of the targets; CPU: tiny versions
# of the same code paths (the kernel runs in Triton's interpreter, 16x16 tiles).
SHAPES = {
    "cuda": dict(
        gqa=dict(batch=4, heads=32, heads_kv=8, seq_len=4096, head_dim=128),
        window=dict(batch=1, heads=16, seq_len=32768, head_dim=128, window=4096),
        chunk=dict(batch=1, heads=16, seq_len=32768, head_dim=128, chunk_size=8192),
        varlen=dict(total=16384, lo=128, hi=4096, heads=16, head_dim=128, seed=0),
        # DeepSeek V3's q/k and v head dims (128 no-RoPE + 64 RoPE; 128) at the sweep's 16384
        # tokens and the other features' 16 heads.
        mla=dict(batch=4, heads=16, seq_len=4096, head_dim=192, head_dim_v=128),
        decode=dict(batches=(1, 8), heads=32, heads_kv=8, head_dim=128, num_splits=0,
                    cache_lens=tuple(1024 << i for i in range(8))),  # 1k ... 128k
        # The FP8 targets' points: causal prefill at 4k, d128; decode at 32k keys.
        fp8=dict(batch=4, heads=16, seq_len=4096, head_dim=128, decode_batch=8,
                 decode_heads=32, heads_kv=8, cache_len=32768),
        # A window of 1024 at 8k as an (8192, 8192) bool mask (64 MiB; SDPA's efficient
        # backend makes it a 128 MiB additive bias).
        mask=dict(batch=2, heads=16, seq_len=8192, head_dim=128, window=1024),
        # DeepSeek V3's per-GPU query heads with TP8 (16) and without TP (128) on its one
        # latent head, page 64 (vLLM's and FlashMLA's), split count by the heuristic; then one
        # MTP point (2 query tokens) beside its one-token twin. 9 points x 3 rows, fwd.
        mla_decode=dict(heads=(16, 128), batches=(8, 64), cache_lens=(4096, 32768),
                        mtp=((128, 64, 4096),), mtp_q_len=2, page_size=64, num_splits=0)),
    # CPU: a handful of 16x16 tiles per call (each interpreted call still takes 0.1-1 s).
    "cpu": dict(
        gqa=dict(batch=1, heads=2, heads_kv=1, seq_len=32, head_dim=32),
        window=dict(batch=1, heads=1, seq_len=64, head_dim=32, window=16),
        chunk=dict(batch=1, heads=1, seq_len=64, head_dim=32, chunk_size=16),
        varlen=dict(total=64, lo=8, hi=32, heads=1, head_dim=32, seed=0),
        # The GPU's head dims (their padding to the kernel's tile widths is the code path to
        # exercise), 32 tokens: ~0.3 s per interpreted fwd_bwd call.
        mla=dict(batch=1, heads=2, seq_len=32, head_dim=192, head_dim_v=128),
        # num_splits forced to 4 (4 tiles of 16 keys at cache 64): the heuristic gives 1 in
        # the interpreter, and the split + merge path is the one to exercise.
        decode=dict(batches=(1, 2), heads=4, heads_kv=1, head_dim=16, num_splits=4,
                    cache_lens=(64, 128)),
        fp8=dict(batch=1, heads=2, seq_len=32, head_dim=32, decode_batch=2, decode_heads=2,
                 heads_kv=1, cache_len=64),
        mask=dict(batch=1, heads=1, seq_len=64, head_dim=32, window=16),
        # The GPU's head dims and layout, 4 and 8 pages of 16 rows a sequence, split forced to
        # 4 as decode's: 3 points, 0.1-0.8 s per interpreted call, ~12 s in all.
        mla_decode=dict(heads=(4,), batches=(2,), cache_lens=(64, 128), mtp=((4, 2, 128),),
                        mtp_q_len=2, page_size=16, num_splits=4)),
}
GQA_SDPA = {"cuda": ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn"),
            "cpu": ("sdpa_math", "sdpa_flash")}  # also the mla rows' SDPA backends
DECODE_SDPA = ("sdpa_flash", "sdpa_efficient")  # on CPU efficient is "unsupported: CUDA-only"
MASK_SDPA = {"cuda": ("sdpa_efficient", "sdpa_cudnn"),   # the backends that take a mask
             "cpu": ("sdpa_math",)}
TARGETS = {"gqa": ("speedup_vs_mha", 1.0, "GQA at least as fast as MHA with the same query "
                                          "heads (speedup_vs_mha >= 1)"),
           "window": ("speedup_vs_full", 3.5, "window at least 3.5x faster than full causal "
                                              "(speedup_vs_full >= 3.5)"),
           # 0.8 x the ideal 4.0 at chunk 8192 / 32k, the share of its ideal the window's
           # target asks (3.5 of 4.27); a kernel visiting every causal tile would stay near 1x.
           "chunk": ("speedup_vs_full", 3.2, "chunked at least 3.2x faster than full causal "
                                             "(speedup_vs_full >= 3.2: 0.8 x the ideal 4.0 of "
                                             "chunk 8192 at 32k)"),
           # The native call's matmul work is a subset of the padded call's (v's 128 columns
           # against 192): it should not be slower.
           "mla": ("speedup_vs_padded", 1.0, "MLA (v head dim 128) at least as fast as v "
                                             "zero-padded to q's 192 (speedup_vs_padded >= 1)"),
           "varlen": ("tflops_vs_dense_each", 0.9, "varlen TFLOP/s within 10% of the dense "
                                                  "kernel's at the same lengths "
                                                  "(tflops_vs_dense_each >= 0.9)"),
           # (the decode row's own target: FP8_CACHE_TARGET)
           "fp8": ("speedup_vs_bf16", 1.5, "FP8 forward at least 1.5x our bf16 forward "
                                           "(speedup_vs_bf16 >= 1.5)"),
           # The mask is read per visited tile (int8, 1/8 of a bf16 K tile at d128 per row of
           # it) and bounds the tiles only per 16 rows: some cost over the native window, not
           # its double.
           "mask": ("speedup_vs_native", 0.7, "a window given as attn_mask at least 0.7x the "
                                              "native window's speed (speedup_vs_native >= "
                                              "0.7)")}
# (ours, baseline): the rows whose ms give a feature's speed-up (varlen: TFLOP/s, in _compare).
BASELINES = {"gqa": ("kernels", "kernels_mha"), "window": ("kernels", "kernels_causal"),
             "chunk": ("kernels", "kernels_causal"), "mla": ("kernels", "kernels_padded"),
             "fp8": ("kernels_fp8", "kernels"), "mask": ("kernels", "kernels_window")}
# The row field that picks a row's FLOP count in the feature's table (else: by mode alone).
FLOPS_BY = {"window": "window", "chunk": "chunk_size", "fp8": "fp8_case", "mask": "window"}
FP8_CACHE_TARGET = (1.6, "an FP8 cache at least 1.6x the bf16 cache's tokens/s "
                         "(speedup_vs_bf16 >= 1.6)")


def mixed_lengths(total, lo, hi, seed):
    """A fixed, seeded list of sequence lengths in [lo, hi] summing to ``total`` (hi >= 2*lo;
    the last one is whatever is left, also in [lo, hi])."""
    if hi < 2 * lo:
        raise ValueError(f"need hi >= 2 * lo, got lo={lo}, hi={hi}")
    rng = random.Random(seed)
    out, left = [], total
    while left > 0:
        if left <= hi:
            n = left
        else:
            n = rng.randint(lo, hi)
            if left - n < lo:
                n = left - lo
        out.append(n)
        left -= n
    return out


def _randn(g, shape, device, dtype):
    return torch.randn(shape, generator=g, device=device).to(dtype)


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _torch_varlen_reason(device):
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:
        return "torch.nn.attention.varlen missing in this torch"
    if torch.device(device).type != "cuda":
        return "CUDA-only (PyTorch's packed flash attention)"
    return None


def _torch_varlen_refused(exc, caught_warnings):
    """PyTorch's varlen_attn is a young API (its arguments and supported cases vary by
    version and GPU): its refusal of a case is that peer's limitation, not an error of ours."""
    if isinstance(exc, (RuntimeError, TypeError, ValueError, NotImplementedError)):
        return f"varlen_attn: {describe(exc)}"[:200]
    return None


def _torch_varlen(q, k, v, cu, max_len, window):
    from torch.nn.attention.varlen import varlen_attn

    left = -1 if window is None else window - 1
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(left, 0))


class _Spec:
    """One provider of a feature: ``build()`` -> (forward returning a list of outputs, leaf
    inputs); ``douts`` the outputs' upstream gradients; ``static`` why it cannot run at all;
    ``unsupported(exc, warnings)`` which first-call errors mean "unsupported"; ``extra``
    fields of its rows."""

    def __init__(self, provider, build, douts, static=None, unsupported=None, extra=None):
        self.provider, self.build, self.douts, self.static = provider, build, douts, static
        self.unsupported, self.extra = unsupported, extra or {}


def _ours(q, k, v, **kw):
    """A _Spec's ``build``: ``kernels.attention(causal=True, **kw)`` on leaf copies of q, k, v."""
    def build():
        import kernels

        leaves = tuple(_leaf(x) for x in (q, k, v))
        return (lambda: [kernels.attention(*leaves, causal=True, **kw)]), leaves
    return build


def _sdpa_spec(name, case, inputs, douts, extra, **sdpa_kwargs):
    """The _Spec of SDPA backend ``name`` on leaf copies of ``inputs`` (q, k, v)."""
    prov = SdpaProvider(name)

    def build():
        f = prov.function(**sdpa_kwargs)
        leaves = tuple(_leaf(x) for x in inputs)
        return (lambda: [f(*leaves)]), leaves
    return _Spec(name, build, douts, static=prov.static_reason(case),
                 unsupported=prov.unsupported_reason, extra=extra)


def _gqa_specs(sh, device, dtype, sdpa_names):
    B, H, Hkv, L, D = sh["batch"], sh["heads"], sh["heads_kv"], sh["seq_len"], sh["head_dim"]
    g = torch.Generator(device=device).manual_seed(L)
    q, k, v = (_randn(g, (B, h, L, D), device, dtype) for h in (H, Hkv, Hkv))
    do = _randn(g, (B, H, L, D), device, dtype)
    case = Case(batch=B, heads=H, seq_len=L, head_dim=D, dtype=dtype, dropout_p=0.0,
                device=device)
    k_mha, v_mha = (x.repeat_interleave(H // Hkv, 1) for x in (k, v))
    specs = [_Spec("kernels", _ours(q, k, v), [do], extra=dict(heads_kv=Hkv)),
             _Spec("kernels_mha", _ours(q, k_mha, v_mha), [do], extra=dict(heads_kv=H))]
    specs += [_sdpa_spec(n, case, (q, k, v), [do], dict(heads_kv=Hkv), is_causal=True,
                         enable_gqa=True) for n in sdpa_names]
    flops = {m: attention_flops(B, H, L, L, D, causal=True, mode=m) for m in FEATURE_MODES}
    return case, specs, flops


def _window_specs(sh, device, dtype):
    B, H, L, D, W = sh["batch"], sh["heads"], sh["seq_len"], sh["head_dim"], sh["window"]
    g = torch.Generator(device=device).manual_seed(L)
    q, k, v, do = (_randn(g, (B, H, L, D), device, dtype) for _ in range(4))
    case = Case(batch=B, heads=H, seq_len=L, head_dim=D, dtype=dtype, dropout_p=0.0,
                device=device)

    def varlen_build():
        # One packed sequence per batch entry: (B*L, H, D) views of the same values.
        qq, kk, vv = (_leaf(x.transpose(1, 2).reshape(B * L, H, D)) for x in (q, k, v))
        cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=device)
        return (lambda: [_torch_varlen(qq, kk, vv, cu, L, W).view(B, L, H, D).transpose(1, 2)]
                ), (qq, kk, vv)

    specs = [_Spec("kernels", _ours(q, k, v, window=W), [do], extra=dict(heads_kv=H, window=W)),
             _Spec("kernels_causal", _ours(q, k, v), [do], extra=dict(heads_kv=H, window=None)),
             _Spec("torch_varlen", varlen_build, [do], static=_torch_varlen_reason(device),
                   unsupported=_torch_varlen_refused, extra=dict(heads_kv=H, window=W))]
    flops = {(m, w): attention_flops(B, H, L, L, D, causal=True, mode=m, window=w)
             for m in FEATURE_MODES for w in (W, None)}
    return case, specs, flops


def _chunk_specs(sh, device, dtype):
    """Chunked attention (chunk_size C) vs full causal on the same inputs, and the same pairs
    computed as separate causal sequences of C (ours batched; PyTorch's varlen_attn packed)."""
    B, H, L, D, C = sh["batch"], sh["heads"], sh["seq_len"], sh["head_dim"], sh["chunk_size"]
    g = torch.Generator(device=device).manual_seed(L)
    q, k, v, do = (_randn(g, (B, H, L, D), device, dtype) for _ in range(4))
    case = Case(batch=B, heads=H, seq_len=L, head_dim=D, dtype=dtype, dropout_p=0.0,
                device=device)
    # At q_len = k_len chunk c holds positions [c*C, (c+1)*C): whole chunks only when C | L.
    split = None if L % C == 0 else f"seq_len {L} is not a multiple of chunk_size {C}"
    n = L // C

    def as_batch(x):
        # (B, H, L, D) -> (B * n, H, C, D): chunk c of batch entry b is sequence b * n + c.
        return x.view(B, H, n, C, D).transpose(1, 2).reshape(B * n, H, C, D).contiguous()

    def batched_build():
        import kernels

        qq, kk, vv = (_leaf(as_batch(x)) for x in (q, k, v))
        return (lambda: [kernels.attention(qq, kk, vv, causal=True)]), (qq, kk, vv)

    def varlen_build():
        # The B * L tokens packed (B*L, H, D); a sequence boundary every C tokens.
        qq, kk, vv = (_leaf(x.transpose(1, 2).reshape(B * L, H, D)) for x in (q, k, v))
        cu = torch.arange(0, B * L + 1, C, dtype=torch.int32, device=device)
        return (lambda: [_torch_varlen(qq, kk, vv, cu, C, None)]), (qq, kk, vv)

    extra = dict(heads_kv=H, chunk_size=C)
    varlen_static = split or _torch_varlen_reason(device)
    specs = [_Spec("kernels", _ours(q, k, v, chunk_size=C), [do], extra=extra),
             _Spec("kernels_causal", _ours(q, k, v), [do], extra=dict(extra, chunk_size=None)),
             _Spec("kernels_chunks_batched", batched_build,
                   [as_batch(do)] if split is None else [], static=split, extra=extra),
             _Spec("torch_varlen", varlen_build,
                   [do.transpose(1, 2).reshape(B * L, H, D)], static=varlen_static,
                   unsupported=_torch_varlen_refused, extra=extra)]
    flops = {(m, c): attention_flops(B, H, L, L, D, causal=True, mode=m, chunk_size=c)
             for m in FEATURE_MODES for c in (C, None)}
    return case, specs, flops


VARLEN_PAGE_SIZE = 16   # the paged varlen row's page size (FlashAttention's smallest usual)


def _varlen_specs(sh, device, dtype):
    lens = mixed_lengths(sh["total"], sh["lo"], sh["hi"], sh["seed"])
    H, D, total, n, longest = sh["heads"], sh["head_dim"], sh["total"], len(lens), max(lens)
    g = torch.Generator(device=device).manual_seed(total)
    q, k, v, do = (_randn(g, (total, H, D), device, dtype) for _ in range(4))
    bounds = [0]
    for s in lens:
        bounds.append(bounds[-1] + s)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    case = Case(batch=n, heads=H, seq_len=longest, head_dim=D, dtype=dtype, dropout_p=0.0,
                device=device)
    spans = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def varlen_build():
        import kernels

        qq, kk, vv = _leaf(q), _leaf(k), _leaf(v)
        return (lambda: [kernels.attention_varlen(qq, kk, vv, cu, cu, longest, longest,
                                                  causal=True)]), (qq, kk, vv)

    def dense_each_build():
        import kernels

        qq, kk, vv = _leaf(q), _leaf(k), _leaf(v)

        def fwd():
            # (1, H, len, D) views of the packed tokens; the kernel reads strided views in place.
            return [kernels.attention(*(x[r].transpose(0, 1).unsqueeze(0) for x in (qq, kk, vv)),
                                      causal=True) for r in spans]
        return fwd, (qq, kk, vv)

    def padded(x, width=longest):
        out = x.new_zeros(n, H, width, D)
        for i, r in enumerate(spans):
            out[i, :, :lens[i]] = x[r].transpose(0, 1)
        return out

    def dense_padded_build():
        import kernels

        qq, kk, vv = (_leaf(padded(x)) for x in (q, k, v))
        return (lambda: [kernels.attention(qq, kk, vv, causal=True)]), (qq, kk, vv)

    def torch_varlen_build():
        qq, kk, vv = _leaf(q), _leaf(k), _leaf(v)
        return (lambda: [_torch_varlen(qq, kk, vv, cu, longest, None)]), (qq, kk, vv)

    def paged_build():
        # The same keys in shuffled pages (a serving cache), read in place through a block
        # table: forward only, as FlashAttention's paged attention.
        import kernels

        width = -(-longest // VARLEN_PAGE_SIZE) * VARLEN_PAGE_SIZE
        kp, vp, table = _paged_copy(*(padded(x, width) for x in (k, v)), VARLEN_PAGE_SIZE)
        used_k, qq = torch.tensor(lens, dtype=torch.int32, device=device), _leaf(q)
        return (lambda: [kernels.attention_varlen(qq, kp, vp, cu, None, longest, causal=True,
                                                  block_table=table, seqused_k=used_k)]), (qq,)

    extra = dict(heads_kv=H, window=None, total_tokens=total, seqlens=list(lens))
    do_each = [do[r].transpose(0, 1).unsqueeze(0) for r in spans]
    specs = [_Spec("kernels_varlen", varlen_build, [do], extra=extra),
             _Spec("kernels_varlen_paged", paged_build, [do], extra=dict(
                 extra, page_size=VARLEN_PAGE_SIZE), unsupported=lambda exc, _: (
                 "forward only (paged KV cache)" if "forward-only" in str(exc) else None)),
             _Spec("kernels_dense_each", dense_each_build, do_each, extra=extra),
             _Spec("kernels_dense_padded", dense_padded_build, [padded(do)], extra=extra),
             _Spec("torch_varlen", torch_varlen_build, [do], static=_torch_varlen_reason(device),
                   unsupported=_torch_varlen_refused, extra=extra)]
    flops = {m: varlen_flops(lens, lens, H, D, causal=True, mode=m) for m in FEATURE_MODES}
    return case, specs, flops


def _fp8_specs(sh, device, dtype):
    """FP8 (e4m3, descales 1) against our bf16 at the same inputs, forward only (the fwd_bwd
    rows say "forward only"): causal prefill (``kernels`` / ``kernels_fp8``) and one decode
    step against a filled cache (``kernels_cache`` / ``kernels_cache_fp8``: half the bytes)."""
    B, H, L, D = sh["batch"], sh["heads"], sh["seq_len"], sh["head_dim"]
    Bd, Hd, Hkv, C = sh["decode_batch"], sh["decode_heads"], sh["heads_kv"], sh["cache_len"]
    bf16, f8 = torch.bfloat16, torch.float8_e4m3fn
    g = torch.Generator(device=device).manual_seed(L)
    q, k, v, do = (_randn(g, (B, H, L, D), device, bf16) for _ in range(4))
    qd, do_d = (_randn(g, (Bd, Hd, 1, D), device, bf16) for _ in range(2))
    kc, vc = (_randn(g, (Bd, Hkv, C, D), device, bf16) for _ in range(2))
    lens = torch.full((Bd,), C, dtype=torch.int32, device=device)
    case = Case(batch=B, heads=H, seq_len=L, head_dim=D, dtype=bf16, dropout_p=0.0,
                device=device)

    def decode(dt):
        def build():
            import kernels
            cache, qq = [x.to(dt) for x in (kc, vc)], _leaf(qd)
            return (lambda: [kernels.attention_with_kvcache(qq, *cache, lens, causal=True)]), (
                qq,)
        return build

    def fwd_only(exc, _):
        return "forward only" if "forward-only" in str(exc) else None
    pre = dict(fp8_case="prefill", heads_kv=H)
    dec = dict(fp8_case="decode", batch=Bd, heads=Hd, heads_kv=Hkv, q_len=1, cache_len=C,
               kv_bytes=kv_read_bytes(Bd, Hkv, C, D, 2))
    specs = [_Spec("kernels", _ours(q, k, v), [do], extra=pre),
             _Spec("kernels_fp8", _ours(*(x.to(f8) for x in (q, k, v))), [do],
                   unsupported=fwd_only, extra=pre),
             _Spec("kernels_cache", decode(bf16), [do_d], unsupported=fwd_only, extra=dec),
             _Spec("kernels_cache_fp8", decode(f8), [do_d], unsupported=fwd_only,
                   extra=dict(dec, kv_bytes=dec["kv_bytes"] // 2))]
    flops = {(m, "prefill"): attention_flops(B, H, L, L, D, causal=True, mode=m)
             for m in FEATURE_MODES}
    flops.update({(m, "decode"): attention_flops(Bd, Hd, 1, C, D, causal=False)
                  for m in FEATURE_MODES})
    return case, specs, flops


def _mla_specs(sh, device, dtype, sdpa_names):
    """A value head dim of its own (DeepSeek's MLA: q, k of ``head_dim``, v of ``head_dim_v``):
    ours native vs ours with v zero-padded to ``head_dim``, and SDPA's backends."""
    B, H, L, D, Dv = (sh["batch"], sh["heads"], sh["seq_len"], sh["head_dim"],
                      sh["head_dim_v"])
    g = torch.Generator(device=device).manual_seed(L)
    q, k = (_randn(g, (B, H, L, D), device, dtype) for _ in range(2))
    v, do = (_randn(g, (B, H, L, Dv), device, dtype) for _ in range(2))
    case = Case(batch=B, heads=H, seq_len=L, head_dim=D, dtype=dtype, dropout_p=0.0,
                device=device)
    extra = dict(heads_kv=H, head_dim_v=Dv)

    def pad(x):
        return torch.nn.functional.pad(x, (0, D - Dv))

    specs = [_Spec("kernels", _ours(q, k, v), [do], extra=extra),
             _Spec("kernels_padded", _ours(q, k, pad(v)), [pad(do)], extra=extra)]
    specs += [_sdpa_spec(n, case, (q, k, v), [do], extra, is_causal=True) for n in sdpa_names]
    flops = {m: attention_flops(B, H, L, L, D, causal=True, mode=m, head_dim_v=Dv)
             for m in FEATURE_MODES}
    return case, specs, flops


def _mask_specs(sh, device, dtype, sdpa_names):
    """A sliding window given as a boolean ``attn_mask`` (L, L) to a non-causal call (the
    tensor mask's tile bounds decide which tiles run), the same as an additive 0 / -inf mask
    (``kernels_bias``: what SDPA hands its efficient op, ours under kernels.sdpa; bounds from
    its -inf entries at this size), vs the same window native, and SDPA's backends that take
    a mask."""
    B, H, L, D, W = sh["batch"], sh["heads"], sh["seq_len"], sh["head_dim"], sh["window"]
    g = torch.Generator(device=device).manual_seed(L)
    q, k, v, do = (_randn(g, (B, H, L, D), device, dtype) for _ in range(4))
    case = Case(batch=B, heads=H, seq_len=L, head_dim=D, dtype=dtype, dropout_p=0.0,
                device=device, causal=False)
    pos = torch.arange(L, device=device)
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - W)

    def masked_build():
        import kernels

        leaves = tuple(_leaf(x) for x in (q, k, v))
        return (lambda: [kernels.attention(*leaves, causal=False, attn_mask=band)]), leaves

    bias = torch.zeros(L, L, device=device, dtype=dtype).masked_fill(~band, float("-inf"))

    def bias_build():
        import kernels

        leaves = tuple(_leaf(x) for x in (q, k, v))
        return (lambda: [kernels.attention(*leaves, causal=False, attn_mask=bias)]), leaves

    extra = dict(heads_kv=H, window=W)
    specs = [_Spec("kernels", masked_build, [do], extra=extra),
             _Spec("kernels_bias", bias_build, [do], extra=extra),
             _Spec("kernels_window", _ours(q, k, v, window=W), [do],
                   extra=dict(extra, causal=True))]
    specs += [_sdpa_spec(n, case, (q, k, v), [do], extra, attn_mask=band) for n in sdpa_names]
    flops = {(m, W): attention_flops(B, H, L, L, D, causal=True, mode=m, window=W)
             for m in FEATURE_MODES}
    return case, specs, flops


def _measure_spec(spec, mode, device, opts):
    try:
        forward, grads = spec.build()
    except Exception as exc:
        return dict(dict.fromkeys(MEASURE_KEYS),
                    status=classify_failure(exc, (), spec.unsupported))
    grads = grads if mode != "fwd" else ()  # fwd: under no_grad, nothing written to .grad
    return measure(mode_maker(forward, mode, spec.douts, grads), device, grads=grads,
                   unsupported_reason=spec.unsupported, **opts)


def feature_rows(device, dtype, features=FEATURES, opts=None, deadline=float("inf"),
                 progress=None, quick=False, sdpa_names=None, copy_gbps=None):
    """Rows of the ``features`` (a subset of FEATURES), in that order; see the module
    docstring. ``sdpa_names`` restricts the SDPA backends of the GQA and decode rows (None =
    the profile's). ``copy_gbps``: the device's copy bandwidth for the decode rows'
    ``bw_fraction`` (None: measured once by ceilings.copy_gbps on a GPU, none on CPU)."""
    opts = dict(opts or dict(warmup_ms=10.0, rep_ms=50.0, cpu_reps=3, cpu_max_s=1.0))
    prof = torch.device(device).type
    if prof != "cuda":
        # The CPU rows exercise the code paths (their interpreted timings mean nothing): one
        # warm-up and one timed call each, so they add little to the default run.
        opts["cpu_reps"] = min(opts["cpu_reps"], CPU_REPS)
    shapes = SHAPES[prof]
    sdpa = GQA_SDPA["cuda" if prof == "cuda" else "cpu"]
    decode_sdpa = DECODE_SDPA
    mask_sdpa = MASK_SDPA["cuda" if prof == "cuda" else "cpu"]
    if sdpa_names is not None:
        sdpa = tuple(s for s in sdpa if s in sdpa_names)
        decode_sdpa = tuple(s for s in decode_sdpa if s in sdpa_names)
        mask_sdpa = tuple(s for s in mask_sdpa if s in sdpa_names)
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; choose from {FEATURES}")
    build = {"gqa": lambda sh: _gqa_specs(sh, device, dtype, sdpa),
             "window": lambda sh: _window_specs(sh, device, dtype),
             "chunk": lambda sh: _chunk_specs(sh, device, dtype),
             "varlen": lambda sh: _varlen_specs(sh, device, dtype),
             "mla": lambda sh: _mla_specs(sh, device, dtype, sdpa),
             "fp8": lambda sh: _fp8_specs(sh, device, dtype),
             "mask": lambda sh: _mask_specs(sh, device, dtype, mask_sdpa)}
    rows = []
    for feature in features:
        sh = shapes.get(feature)
        if feature == "decode":  # many points, inputs built per point: its own loop
            rows += decode_rows(sh, device, dtype, decode_sdpa, opts, deadline, progress,
                                copy_gbps)
            continue
        if feature == "mla_decode":  # its own loop too; the decode rows' copy rate if known
            copy_gbps = copy_gbps or next((r["copy_gbps"] for r in rows if r.get("copy_gbps")),
                                          None)
            rows += mla_decode_rows(sh, device, opts, deadline, progress, copy_gbps)
            continue
        if feature == "hf":  # its own loop too
            rows += hf_rows(HF_SHAPES[prof], device, dtype, opts, deadline, progress)
            continue
        try:
            case, specs, flops = build[feature](sh)
            setup_error = None
        except Exception as exc:  # e.g. no memory for the inputs
            setup_error, specs, case = classify_failure(exc), None, None
        if setup_error:
            rows.append(_failed_row(feature, sh, dtype, setup_error))
            continue
        frows = []
        for spec in specs:
            for mode in FEATURE_MODES:
                row = new_row(spec.provider, mode, case, bench=feature)
                row.update(heads_kv=None, window=None)
                row.update(spec.extra)
                if progress:
                    progress(None, None, f"{feature} {spec.provider} {mode}")
                if spec.static:
                    row["status"] = f"unsupported: {spec.static}"
                elif time.monotonic() > deadline:
                    row["status"] = "skipped: time budget"
                else:
                    row.update(_measure_spec(spec, mode, device, opts))
                    if row["status"] == "ok":
                        # window, chunk and fp8 rows: a FLOP count per mask / case
                        key = (mode, row[FLOPS_BY[feature]]) if feature in FLOPS_BY else mode
                        row["tflops"] = tflops(flops[key], row["ms"])
                rows.append(row)
                frows.append(row)
        free_memory(device)
        _compare(feature, frows, device, sh)
    return rows


def _failed_row(feature, sh, dtype, status):
    case = Case(batch=sh.get("batch", 1), heads=sh["heads"], seq_len=sh.get("seq_len", sh.get(
        "hi", 1)), head_dim=sh["head_dim"], dtype=dtype, dropout_p=0.0, device="cpu")
    row = new_row("kernels", "fwd", case, bench=feature)
    row.update(heads_kv=sh.get("heads_kv", sh["heads"]), window=sh.get("window"), status=status)
    row.update({key: sh[key] for key in ("chunk_size", "head_dim_v") if key in sh})
    return row


def _compare(feature, rows, device, sh):
    """The comparison fields and the target on ours' rows of one feature (in place)."""
    by = {(r["provider"], r["mode"]): r for r in rows}
    field, threshold, text = TARGETS[feature]
    gpu = torch.device(device).type == "cuda"
    for mode in FEATURE_MODES:
        if feature in BASELINES:
            mine, other = (by.get((name, mode)) for name in BASELINES[feature])
            value = ratio(other, mine, "ms")
        if feature == "window" and mine is not None:
            mine["ideal_speedup"] = ideal_window_speedup(sh["seq_len"], sh["seq_len"],
                                                         sh["window"])
        elif feature == "chunk" and mine is not None:
            mine["ideal_speedup"] = ideal_chunk_speedup(sh["seq_len"], sh["seq_len"],
                                                        sh["chunk_size"])
            mine["speedup_vs_batched"] = ratio(by.get(("kernels_chunks_batched", mode)), mine,
                                               "ms")
        elif feature == "mask":
            bias = by.get(("kernels_bias", mode))
            if bias is not None:   # the additive form of the same mask, same comparison
                bias["speedup_vs_native"] = ratio(by.get(("kernels_window", mode)), bias, "ms")
        elif feature == "fp8":
            cache = by.get(("kernels_cache_fp8", mode))
            if cache is not None:   # its own target (FP8_CACHE_TARGET)
                speedup = cache["speedup_vs_bf16"] = ratio(by.get(("kernels_cache", mode)),
                                                           cache, "ms")
                cache["target"] = FP8_CACHE_TARGET[1]
                cache["target_met"] = (speedup >= FP8_CACHE_TARGET[0]
                                       if gpu and speedup is not None else None)
        elif feature == "varlen":
            mine = by.get(("kernels_varlen", mode))
            other = by.get(("kernels_dense_each", mode))
            value = ratio(mine, other, "tflops")
            if mine is not None:
                mine["tflops_vs_dense_padded"] = ratio(
                    mine, by.get(("kernels_dense_padded", mode)), "tflops")
            paged = by.get(("kernels_varlen_paged", mode))
            if paged is not None:   # the same call over shuffled pages: >= 0.9 is the aim
                paged["tflops_paged_over_varlen"] = ratio(paged, mine, "tflops")
        if mine is None:
            continue
        mine[field] = value
        mine["target"] = text
        mine["target_met"] = (value >= threshold) if (gpu and value is not None) else None
    if feature in ("gqa", "mla", "mask"):
        add_speedups(rows)


def ratio(a, b, key):
    """a[key] / b[key] when both rows are ok, else None."""
    if not a or not b or a["status"] != "ok" or b["status"] != "ok" or not b[key]:
        return None
    return a[key] / b[key]


# --------------------------------------------------------------------------------------------
# Decode rows
# --------------------------------------------------------------------------------------------
DECODE_OURS = ("kernels", "kernels_unsplit", "kernels_dense", "kernels_paged")
# Rows per page of the paged-cache decode row (FlashAttention's and vLLM's usual size; the
# whole cache when it is shorter).
DECODE_PAGE_SIZE = 256


def decode_targets(batch, cache_len):
    """[(field, threshold)] the targets of a decode point on a GPU (empty: none):
    batch 1: ``bw_fraction`` >= 0.7 at cache >= 32k and >= 0.5 at 8k; ``speedup_vs_unsplit``
    >= 5 at 32k."""
    out = []
    if batch == 1 and cache_len >= 32768:
        out.append(("bw_fraction", 0.7))
    if batch == 1 and cache_len == 8192:
        out.append(("bw_fraction", 0.5))
    if batch == 1 and cache_len == 32768:
        out.append(("speedup_vs_unsplit", 5.0))
    return out


def splits_used(device, batch, heads, heads_kv, q_len, cache_len, num_splits, sm_count=None):
    """(split count, how) of a decode launch with ``num_splits`` passed, as
    kernels/core/forward.py computes it: 0 = ``num_splits_heuristic`` over the launch's nominal
    64 x 64 tiles (one program per kv group when query heads are packed: grouped heads and
    q_len <= PACK_GQA_MAX_Q_LEN), then ``clamp_splits``. ``how``: "heuristic", "none"
    (num_splits=1) or "forced". ``sm_count``: the heuristic's SM count (None: the device's;
    CPU / interpreter: no split), e.g. 132 for what an H100 SXM would choose."""
    from kernels.core.configs import (PACK_GQA_MAX_Q_LEN, clamp_splits, nominal_tiles,
                                 num_splits_heuristic)

    if num_splits == 0:
        group = heads // heads_kv
        pack = group > 1 and q_len <= PACK_GQA_MAX_Q_LEN
        rows, prog_heads = (group * q_len, heads_kv) if pack else (q_len, heads)
        m_blocks, n_tiles = nominal_tiles(rows, cache_len)
        n = num_splits_heuristic(torch.device(device), batch * prog_heads * m_blocks, n_tiles,
                                 sm_count=sm_count)
        how = "heuristic"
    else:
        n, how = num_splits, ("none" if num_splits == 1 else "forced")
    return clamp_splits(n, cache_len), how


def measure_copy_gbps(device):
    """The device's copy bandwidth in GB/s (ceilings.copy_gbps: 1 GiB device-to-device, bytes
    read + written, median), or None (CPU, or the measurement failed)."""
    if torch.device(device).type != "cuda":
        return None
    from .ceilings import copy_gbps

    try:
        return float(copy_gbps()[0])
    except Exception:  # e.g. no memory for the 2 GiB of buffers: bw_fraction stays None
        return None
    finally:
        free_memory(device)


def _decode_inputs(batch, heads, heads_kv, cache_len, head_dim, device, dtype):
    """q (batch, heads, 1, D); caches (batch, heads_kv, cache_len, D), filled; lengths int32."""
    g = torch.Generator(device=device).manual_seed(cache_len + batch)
    q = _randn(g, (batch, heads, 1, head_dim), device, dtype)
    kc, vc = (_randn(g, (batch, heads_kv, cache_len, head_dim), device, dtype)
              for _ in range(2))
    lens = torch.full((batch,), cache_len, dtype=torch.int32, device=device)
    return q, kc, vc, lens


def _paged_copy(kc, vc, page_size=DECODE_PAGE_SIZE):
    """The dense caches (B, H_kv, L, D) as paged ones (B * L / page, page, H_kv, D) with the
    pages in a shuffled order (a serving cache's pages are scattered) and their block table
    int32 (B, L / page): the same keys, read page by page."""
    B, Hkv, L, D = kc.shape
    page = min(page_size, L)
    assert L % page == 0, (L, page)
    n = B * (L // page)
    g = torch.Generator(device="cpu").manual_seed(L)
    table = torch.randperm(n, generator=g).to(device=kc.device, dtype=torch.int32)

    def pages(c):
        out = c.new_empty((n, page, Hkv, c.shape[-1]))
        out[table.long()] = c.view(B, Hkv, L // page, page, -1).permute(0, 2, 3, 1, 4).reshape(
            n, page, Hkv, -1)
        return out
    return pages(kc), pages(vc), table.view(B, L // page)


def _decode_spec(name, inputs, num_splits):
    """The _Spec of one decode provider on ``inputs`` (fwd only: no leaves, no gradients)."""
    def build():
        import kernels

        q, kc, vc, lens = inputs
        if name in ("kernels", "kernels_unsplit"):
            n = 1 if name == "kernels_unsplit" else num_splits
            return (lambda: [kernels.attention_with_kvcache(q, kc, vc, lens, causal=True,
                                                            num_splits=n)]), ()
        if name == "kernels_dense":
            return (lambda: [kernels.attention(q, kc, vc, causal=True,
                                               num_splits=num_splits)]), ()
        if name == "kernels_paged":
            kp, vp, table = _paged_copy(kc, vc)
            return (lambda: [kernels.attention_with_kvcache(q, kp, vp, lens, causal=True,
                                                            num_splits=num_splits,
                                                            block_table=table)]), ()
        n_keys = int(lens.max())  # the filled slice (the whole cache here)
        k, v = kc[:, :, :n_keys], vc[:, :, :n_keys]
        # One query row sees every key: is_causal=False is ours' bottom-right causal.
        f = SdpaProvider(name).function(is_causal=False, enable_gqa=True)
        return (lambda: [f(q, k, v)]), ()
    unsupported = SdpaProvider(name).unsupported_reason if name.startswith("sdpa_") else None
    return _Spec(name, build, [], unsupported=unsupported)


def decode_rows(sh, device, dtype, sdpa_names, opts, deadline, progress, copy_gbps):
    """Decode rows of one profile's shape ``sh``: for each batch, each cache length (in that
    order: batch 1 first), ours split / unsplit / dense / paged and the SDPA backends.
    ``copy_gbps`` None: measured once, before the first row that runs."""
    gpu = torch.device(device).type == "cuda"
    H, Hkv, D, ns = sh["heads"], sh["heads_kv"], sh["head_dim"], sh["num_splits"]
    names = DECODE_OURS + tuple(sdpa_names)
    itemsize = torch.empty((), dtype=dtype).element_size()
    copy = dict(gbps=copy_gbps, known=copy_gbps is not None or not gpu)
    rows = []
    for B in sh["batches"]:
        for L in sh["cache_lens"]:
            case = Case(batch=B, heads=H, seq_len=L, head_dim=D, dtype=dtype, dropout_p=0.0,
                        device=device)
            inputs, point = None, []
            for name in names:
                row = new_row(name, "fwd", case, bench="decode")
                row.update(heads_kv=Hkv, window=None, q_len=1,
                           kv_bytes=kv_read_bytes(B, Hkv, L, D, itemsize), gbps=None,
                           copy_gbps=None, bw_fraction=None)
                if name in DECODE_OURS:
                    arg = 1 if name == "kernels_unsplit" else ns
                    n, how = splits_used(device, B, H, Hkv, 1, L, arg)
                    row.update(num_splits=n, num_splits_arg=arg, num_splits_how=how)
                static = SdpaProvider(name).static_reason(case) if name.startswith(
                    "sdpa_") else None
                if progress:
                    progress(None, None, f"decode {name} batch {B} cache {L}")
                if static:
                    row["status"] = f"unsupported: {static}"
                elif time.monotonic() > deadline:
                    row["status"] = "skipped: time budget"
                else:
                    if not copy["known"]:
                        copy.update(gbps=measure_copy_gbps(device), known=True)
                    if inputs is None:
                        try:
                            inputs = _decode_inputs(B, H, Hkv, L, D, device, dtype)
                        except Exception as exc:  # e.g. no memory for the caches
                            inputs = classify_failure(exc)
                    if isinstance(inputs, str):
                        row["status"] = inputs
                    else:
                        row.update(_measure_spec(_decode_spec(name, inputs, ns), "fwd", device,
                                                 opts))
                        if row["status"] == "ok":
                            row["tflops"] = tflops(attention_flops(B, H, 1, L, D, causal=False),
                                                   row["ms"])
                point.append(row)
            inputs = None
            free_memory(device)
            rows += decode_compare(point, gpu, copy["gbps"])
    return rows


def decode_compare(rows, gpu, copy_gbps):
    """Bandwidth fields on every row of one decode point, and the comparisons and the target
    on the kernels row (in place; returns ``rows``): ``gbps`` = kv_bytes / ms,
    ``bw_fraction`` = gbps / copy_gbps, ``speedup_vs_unsplit``, ``best_sdpa_ms_over_ours``,
    ``target``, ``target_met`` (None off a GPU or when a value is missing)."""
    for r in rows:
        r["copy_gbps"] = copy_gbps
        if r["status"] == "ok":
            r["gbps"] = gbps(r["kv_bytes"], r["ms"])
            r["bw_fraction"] = r["gbps"] / copy_gbps if copy_gbps else None
    by = {r["provider"]: r for r in rows}
    mine = by.get("kernels")
    if mine is None:
        return rows
    mine["speedup_vs_unsplit"] = ratio(by.get("kernels_unsplit"), mine, "ms")
    if by.get("kernels_paged") is not None:   # the paged cache's cost: paged / dense GB/s
        by["kernels_paged"]["paged_vs_dense"] = ratio(mine, by["kernels_paged"], "ms")
    add_speedups(rows)
    targets = decode_targets(mine["batch"], mine["seq_len"])
    mine["target"] = " and ".join(f"{field} >= {t:g}" for field, t in targets) or None
    values = [mine.get(field) for field, _ in targets]
    mine["target_met"] = (all(v >= t for v, (_, t) in zip(values, targets))
                          if gpu and targets and None not in values else None)
    return rows


# --------------------------------------------------------------------------------------------
# mla_decode: DeepSeek V3's absorbed MLA decode (docs/features.md, "MLA") as vLLM's
# TRITON_FUSED_MLA backend calls it: kernels.attention_varlen, packed queries (B * q_len,
# heads, 576) over a paged latent cache (num_blocks, page, 1, 576) whose values are its rows'
# first 512 columns, every row's cache full, pages shuffled, bf16 q, forward only.
# --------------------------------------------------------------------------------------------
MLA_HEAD_DIM, MLA_HEAD_DIM_V = 576, 512   # [c_kv (kv_lora_rank 512), k_pe (64)]; v = c_kv
MLA_SCALE = 192 ** -0.5   # the model's 1 / sqrt(qk_nope 128 + qk_rope 64), not 1 / sqrt(576)
# kernels: v_cache = k_cache[..., :512] (V read from K's tiles: one read of the latent);
# kernels_v_copy: v_cache a contiguous copy of those columns (V read as a tensor of its own:
# 576 + 512 columns a key); kernels_fp8: the latent in float8_e4m3fn, read with a per-tensor
# k_descale as vLLM passes it (no v_descale: the values are the keys' bytes), V inside K.
MLA_DECODE_OURS = ("kernels", "kernels_v_copy", "kernels_fp8")
MLA_DECODE_TARGET = (1.0, "V read inside the latent's rows at least as fast as V as a copy "
                          "of its own (speedup_vs_v_copy >= 1)")


def mla_decode_points(sh):
    """[(heads, batch, cache_len, q_len)] of an mla_decode shape in run order: every heads x
    batch x cache length with one query token, then the ``mtp`` points with ``mtp_q_len``
    (multi-token prediction: the draft token checked in the same step)."""
    points = [(H, B, L, 1) for H in sh["heads"] for B in sh["batches"]
              for L in sh["cache_lens"]]
    return points + [(H, B, L, sh["mtp_q_len"]) for H, B, L in sh["mtp"]]


def mla_read_bytes(batch, cache_len, itemsize=2, v_copy=False):
    """Bytes of the cache one MLA decode call reads: ``batch * cache_len * 576 * itemsize``
    (keys and values in one read of the latent), plus ``batch * cache_len * 512 * itemsize``
    when V is a copy of its own. q, the output and the split partials are not counted.

    >>> mla_read_bytes(64, 4096), mla_read_bytes(64, 4096, v_copy=True)
    (301989888, 570425344)
    """
    return batch * cache_len * (MLA_HEAD_DIM + (MLA_HEAD_DIM_V if v_copy else 0)) * itemsize


def _forward_only(exc, _):
    return "forward only" if "forward-only" in str(exc) else None


def _mla_decode_inputs(heads, batch, cache_len, q_len, page_size, device):
    """q packed (batch * q_len, heads, 576) and the bf16 latent cache (batch * cache_len /
    page_size, page_size, 1, 576) with its pages in a shuffled order, the block table int32
    (batch, cache_len / page_size), cu_seqlens_q and seqused_k int32 (every cache full)."""
    if cache_len % page_size:
        raise ValueError(f"cache_len {cache_len} is not a multiple of page_size {page_size}")
    bf16, i32 = torch.bfloat16, torch.int32
    g = torch.Generator(device=device).manual_seed(cache_len + batch + heads)
    n = batch * (cache_len // page_size)
    table = torch.randperm(n, generator=torch.Generator(device="cpu").manual_seed(n))
    return dict(q=_randn(g, (batch * q_len, heads, MLA_HEAD_DIM), device, bf16),
                cache=_randn(g, (n, page_size, 1, MLA_HEAD_DIM), device, bf16),
                table=table.to(device=device, dtype=i32).view(batch, -1),
                cu=torch.arange(0, batch * q_len + 1, q_len, dtype=i32, device=device),
                used=torch.full((batch,), cache_len, dtype=i32, device=device), q_len=q_len)


def _mla_decode_spec(name, inputs, num_splits, douts):
    """The _Spec of one mla_decode provider (MLA_DECODE_OURS) on ``inputs``; the leaf q lets a
    fwd_bwd row say what the call says about a backward."""
    def build():
        import kernels

        cache, kw = inputs["cache"], {}
        if name == "kernels_fp8":
            cache = cache.to(torch.float8_e4m3fn)
            kw["k_descale"] = torch.ones(1, 1, dtype=torch.float32, device=cache.device).expand(
                inputs["used"].shape[0], 1)
        v = cache[..., :MLA_HEAD_DIM_V]
        if name == "kernels_v_copy":
            v = v.contiguous()
        q = _leaf(inputs["q"])
        return (lambda: [kernels.attention_varlen(
            q, cache, v, inputs["cu"], None, inputs["q_len"], block_table=inputs["table"],
            seqused_k=inputs["used"], causal=True, softmax_scale=MLA_SCALE,
            num_splits=num_splits, **kw)]), (q,)
    return _Spec(name, build, douts, unsupported=_forward_only)


def mla_decode_rows(sh, device, opts, deadline=float("inf"), progress=None, copy_gbps=None):
    """The mla_decode rows of shape ``sh``: per point (mla_decode_points) ours with V inside
    the latent's rows, with V as a copy and over an FP8 latent, ``fwd``; the first point also
    ``fwd_bwd`` (each says "unsupported: forward only", the library's refusal). bf16 q
    whatever the sweep's dtype. ``copy_gbps`` None: measured once before the first row that
    runs (GPU only)."""
    gpu = torch.device(device).type == "cuda"
    bf16, f8 = torch.bfloat16, torch.float8_e4m3fn
    ns, page = sh["num_splits"], sh["page_size"]
    copy = dict(gbps=copy_gbps, known=copy_gbps is not None or not gpu)
    rows = []
    for i, (H, B, L, q_len) in enumerate(mla_decode_points(sh)):
        case = Case(batch=B, heads=H, seq_len=L, head_dim=MLA_HEAD_DIM, dtype=bf16,
                    dropout_p=0.0, device=device)
        n, how = splits_used(device, B, H, 1, q_len, L, ns)
        modes = FEATURE_MODES if i == 0 else ("fwd",)
        inputs, point = None, []
        for name in MLA_DECODE_OURS:
            cache_dtype = f8 if name == "kernels_fp8" else bf16
            for mode in modes:
                row = new_row(name, mode, case, bench="mla_decode")
                row.update(heads_kv=1, window=None, q_len=q_len, head_dim_v=MLA_HEAD_DIM_V,
                           page_size=page, cache_dtype=str(cache_dtype).replace("torch.", ""),
                           v_in_k=name != "kernels_v_copy",
                           kv_bytes=mla_read_bytes(B, L, cache_dtype.itemsize,
                                                   v_copy=name == "kernels_v_copy"),
                           gbps=None, copy_gbps=None, bw_fraction=None, num_splits=n,
                           num_splits_arg=ns, num_splits_how=how)
                if progress:
                    progress(None, None, f"mla_decode {name} {mode} heads {H} batch {B} "
                                         f"cache {L} q {q_len}")
                if time.monotonic() > deadline:
                    row["status"] = "skipped: time budget"
                else:
                    if not copy["known"]:
                        copy.update(gbps=measure_copy_gbps(device), known=True)
                    if inputs is None:
                        try:
                            inputs = _mla_decode_inputs(H, B, L, q_len, page, device)
                        except Exception as exc:  # e.g. no memory for the cache
                            inputs = classify_failure(exc)
                    if isinstance(inputs, str):
                        row["status"] = inputs
                    else:
                        douts = [torch.ones(B * q_len, H, MLA_HEAD_DIM_V, dtype=bf16,
                                            device=device)] if mode != "fwd" else []
                        row.update(_measure_spec(_mla_decode_spec(name, inputs, ns, douts),
                                                 mode, device, opts))
                        if row["status"] == "ok":
                            row["tflops"] = tflops(attention_flops(
                                B, H, q_len, L, MLA_HEAD_DIM, causal=False,
                                head_dim_v=MLA_HEAD_DIM_V), row["ms"])
                point.append(row)
        inputs = None
        free_memory(device)
        rows += mla_decode_compare(point, gpu, copy["gbps"])
    return mla_decode_mtp(rows)


def mla_decode_compare(rows, gpu, copy_gbps):
    """Bandwidth fields on every row of one mla_decode point (``gbps`` = kv_bytes / ms,
    ``copy_gbps``, ``bw_fraction``) and, on its fwd rows, ``speedup_vs_v_copy`` with the
    target on ``kernels`` and ``speedup_vs_bf16`` on ``kernels_fp8`` (in place; returns
    ``rows``; ``target_met`` None off a GPU or when a value is missing)."""
    for r in rows:
        r["copy_gbps"] = copy_gbps
        if r["status"] == "ok":
            r["gbps"] = gbps(r["kv_bytes"], r["ms"])
            r["bw_fraction"] = r["gbps"] / copy_gbps if copy_gbps else None
    by = {r["provider"]: r for r in rows if r["mode"] == "fwd"}
    mine, fp8 = by.get("kernels"), by.get("kernels_fp8")
    if fp8 is not None:
        fp8["speedup_vs_bf16"] = ratio(mine, fp8, "ms")
    if mine is not None:
        value = mine["speedup_vs_v_copy"] = ratio(by.get("kernels_v_copy"), mine, "ms")
        mine["target"] = MLA_DECODE_TARGET[1]
        mine["target_met"] = (value >= MLA_DECODE_TARGET[0]
                              if gpu and value is not None else None)
    return rows


def mla_decode_mtp(rows):
    """``ms_over_q_len_1`` on each fwd row of more than one query token: its ms / the same
    provider's at one token and the same heads, batch and cache (1 = the draft token came
    free; q_len = it cost a step of its own). In place; returns ``rows``."""
    one = {(r["provider"], r["heads"], r["batch"], r["seq_len"]): r for r in rows
           if r["mode"] == "fwd" and r["q_len"] == 1}
    for r in rows:
        if r["mode"] == "fwd" and r["q_len"] > 1:
            r["ms_over_q_len_1"] = ratio(r, one.get((r["provider"], r["heads"], r["batch"],
                                                     r["seq_len"])), "ms")
    return rows


MLA_DECODE_SHORT = {"kernels": "in_k", "kernels_v_copy": "v_copy", "kernels_fp8": "fp8"}


def format_mla_decode(rows, metric="gbps"):
    """The mla_decode rows' table: a line per point, a cell per provider (GB/s of the cache
    read, or ``metric="ms"``), then ours' TFLOP/s, %copy, x v_copy, fp8's x bf16, MTP's ms
    over one token, the split count and the target; "" without such rows."""
    from .report import _cell

    sel = [r for r in rows if r["bench"] == "mla_decode" and r["mode"] == "fwd"]
    if not sel:
        return ""
    copy = next((r["copy_gbps"] for r in sel if r.get("copy_gbps")), None)
    unit = "GB/s of the cache read" if metric == "gbps" else "ms (median)"
    providers = list(dict.fromkeys(r["provider"] for r in sel))
    out = [f"\nmla_decode: DeepSeek MLA absorbed decode, paged latent (page "
           f"{sel[0]['page_size']}, 1 kv head, q/k {MLA_HEAD_DIM}, v {MLA_HEAD_DIM_V}), bf16 q  "
           f"[{unit}; copy " + (f"{copy:.0f} GB/s measured in this run]" if copy else
                                "GB/s not measured]"),
           f"{'heads':>5} {'batch':>5} {'cache':>6} {'q':>2} {'splits':>9} "
           + " ".join(f"{MLA_DECODE_SHORT.get(n, n):>7}" for n in providers)
           + f" {'TFLOP/s':>7} {'%copy':>5} {'x vcopy':>7} {'fp8 x':>6} {'x q1':>5}  target"]
    for key in dict.fromkeys((r["heads"], r["batch"], r["seq_len"], r["q_len"]) for r in sel):
        cells = {r["provider"]: r for r in sel
                 if (r["heads"], r["batch"], r["seq_len"], r["q_len"]) == key}
        mine, fp8 = cells.get("kernels", {}), cells.get("kernels_fp8", {})
        splits = (f"{mine['num_splits']} {mine['num_splits_how'][:5]}"
                  if mine.get("num_splits") is not None else "")

        def num(value, fmt):
            return fmt.format(value) if value is not None else ""
        line = (f"{key[0]:>5} {key[1]:>5} {key[2]:>6} {key[3]:>2} {splits:>9} "
                + " ".join(f"{_cell(cells[n], metric) if n in cells else '':>7}"
                           for n in providers)
                + f" {num(mine.get('tflops'), '{:.3g}'):>7}"
                + f" {num(mine.get('bw_fraction') and 100 * mine['bw_fraction'], '{:.0f}%'):>5}"
                + f" {num(mine.get('speedup_vs_v_copy'), '{:.3g}x'):>7}"
                + f" {num(fp8.get('speedup_vs_bf16'), '{:.3g}x'):>6}"
                + f" {num(mine.get('ms_over_q_len_1'), '{:.3g}'):>5}")
        if mine.get("target"):
            met = mine.get("target_met")
            line += "  " + ("met" if met else "MISSED" if met is False else "not judged")
        out.append(line)
    out.append("in_k = v_cache = k_cache[..., :512] (the latent read once), v_copy = V as a "
               "contiguous copy, fp8 = an e4m3 latent; TFLOP/s, %copy (of in_k's GB/s), "
               "x vcopy = v_copy ms / in_k ms, fp8 x = in_k ms / fp8 ms, x q1 = in_k's ms / its "
               f"ms at one query token (MTP); target: {MLA_DECODE_TARGET[1]}")
    return "\n".join(out)


def main(argv=None):
    """``python -m benchmarks.features PATH...``: print the mla_decode table of results files
    (a directory: its *.json), which the command's own terminal tables leave out."""
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m benchmarks.features", description=main.__doc__)
    p.add_argument("paths", nargs="+", help="results JSON files or directories holding them")
    p.add_argument("--metric", choices=["gbps", "ms"], default="gbps")
    args = p.parse_args(argv)
    status = 0
    for path in map(Path, args.paths):
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        for f in files:
            try:
                rows = json.loads(f.read_text())["rows"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                print(f"{f}: not a results file ({type(exc).__name__}: {exc})")
                status = 1
                continue
            print(f"{f}:" + (format_mla_decode(rows, args.metric) or " no mla_decode rows"))
        if not files:
            print(f"{path}: no results files")
            status = 1
    return status


# --------------------------------------------------------------------------------------------
# hf: a Llama-shaped transformers model from a config (random weights, no download),
# attn_implementation "sdpa" vs ours ("triton_fused"), the same weights (switched with
# set_attn_implementation): one training forward + backward of the LM loss (``fwd_bwd``) and
# greedy generation (``generate``). ``speedup_vs_sdpa`` = sdpa ms / ours ms on ours' rows.
# --------------------------------------------------------------------------------------------
HF_SHAPES = {
    # Llama 3.2 1B's shapes (tied embeddings): ~1.2B parameters.
    "cuda": dict(hidden=2048, layers=16, heads=32, heads_kv=8, intermediate=8192,
                 vocab=128256, batch=1, seq_len=4096, prompt=128, new_tokens=64,
                 dropouts=(0.0, 0.1)),
    "cpu": dict(hidden=64, layers=1, heads=4, heads_kv=2, intermediate=128, vocab=256,
                batch=1, seq_len=32, prompt=8, new_tokens=4, dropouts=(0.0, 0.1)),
}
HF_PROVIDERS = ("hf_sdpa", "hf_triton_fused")
INTEGRATION_TARGETS = {False: "not slower than sdpa (speedup_vs_sdpa >= 1)",
                       True: "faster than sdpa with dropout (speedup_vs_sdpa > 1)"}


def hf_reason():
    """Why the hf rows cannot run here (None: they can)."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers not installed (pip install .[hf])"
    return None


def _integration_compare(rows, gpu, key):
    """``speedup_vs_sdpa``, ``target``, ``target_met`` on ours' rows (the second provider of
    each point ``key(row)``), in place."""
    points = {}
    for r in rows:
        points.setdefault(key(r), []).append(r)
    for point in points.values():
        base, mine = point[0], point[-1]
        value = ratio(base, mine, "ms")
        dropout = mine["dropout_p"] > 0
        mine["speedup_vs_sdpa"] = value
        mine["target"] = INTEGRATION_TARGETS[dropout]
        mine["target_met"] = ((value > 1.0 if dropout else value >= 1.0)
                              if gpu and value is not None else None)
    return rows


def integration_row(bench, provider, mode, case, extra, static, deadline):
    row = new_row(provider, mode, case, bench=bench)
    row.update(heads_kv=None, window=None)
    row.update(extra)
    if static:
        row["status"] = f"skipped: {static}"
    elif time.monotonic() > deadline:
        row["status"] = "skipped: time budget"
    return row


def hf_rows(sh, device, dtype, opts, deadline=float("inf"), progress=None):
    """The hf rows (the comment above HF_SHAPES)."""
    gpu = torch.device(device).type == "cuda"
    static = hf_reason()
    D = sh["hidden"] // sh["heads"]
    extra = dict(heads_kv=sh["heads_kv"], layers=sh["layers"], hidden=sh["hidden"],
                 intermediate=sh["intermediate"], vocab=sh["vocab"], tokens_per_s=None)
    points = [("fwd_bwd", p) for p in sh["dropouts"]] + [("generate", 0.0)]
    rows, model, ids = [], None, None
    for mode, p in points:
        L = sh["seq_len"] if mode == "fwd_bwd" else sh["prompt"]
        case = Case(batch=sh["batch"], heads=sh["heads"], seq_len=L, head_dim=D, dtype=dtype,
                    dropout_p=p, device=device)
        for name in HF_PROVIDERS:
            row = integration_row("hf", name, mode, case, extra, static, deadline)
            if mode == "generate":
                row.update(prompt=sh["prompt"], new_tokens=sh["new_tokens"])
            rows.append(row)
            if row["status"] is not None:
                continue
            if progress:
                progress(None, None, f"hf {name} {mode} p{p}")
            if model is None:
                try:
                    model = _hf_model(sh, device, dtype)
                    g = torch.Generator(device="cpu").manual_seed(0)
                    ids = torch.randint(0, sh["vocab"], (sh["batch"], sh["seq_len"]),
                                        generator=g).to(device)
                except Exception as exc:
                    model = classify_failure(exc)
            if isinstance(model, str):
                row["status"] = model
                continue
            model.set_attn_implementation(name[len("hf_"):])
            for m in model.modules():
                if hasattr(m, "attention_dropout"):
                    m.attention_dropout = p
            row.update(_hf_measure(model, ids, mode, sh, device, opts))
            if row["status"] == "ok" and mode == "generate":
                row["tokens_per_s"] = sh["batch"] * sh["new_tokens"] / (row["ms"] * 1e-3)
    model = ids = None
    free_memory(device)
    return _integration_compare(rows, gpu, lambda r: (r["mode"], r["dropout_p"]))


def _hf_model(sh, device, dtype):
    import transformers

    import kernels.hf

    kernels.hf.register()
    cfg = transformers.LlamaConfig(
        hidden_size=sh["hidden"], num_hidden_layers=sh["layers"],
        num_attention_heads=sh["heads"], num_key_value_heads=sh["heads_kv"],
        intermediate_size=sh["intermediate"], vocab_size=sh["vocab"],
        max_position_embeddings=max(sh["seq_len"], sh["prompt"] + sh["new_tokens"]),
        tie_word_embeddings=True, attention_dropout=0.0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation="sdpa", dtype=dtype)
    return model


def _hf_measure(model, ids, mode, sh, device, opts):
    params = [t for t in model.parameters() if t.requires_grad]
    if mode == "fwd_bwd":
        model.train()

        def make():
            return lambda: model(input_ids=ids, labels=ids).loss.backward()
    else:
        model.eval()
        prompt = ids[:, :sh["prompt"]]
        n = sh["new_tokens"]

        def make():
            return lambda: model.generate(prompt, max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False)
    try:
        return measure(make, device, grads=params if mode == "fwd_bwd" else (), **opts)
    finally:
        for t in params:
            t.grad = None


if __name__ == "__main__":
    raise SystemExit(main())
