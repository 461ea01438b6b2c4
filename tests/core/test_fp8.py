"""FP8 (e4m3) attention in the core: the forward kernel (q, k, v e4m3; or an e4m3 KV cache with
fp16 / bf16 queries), the cache append's quantization, and the PyTorch fallback's twin.

FlashAttention-3's rule (``helpers.assert_fp8_parity``): the oracle is float64 attention on the
FP8 inputs times their descales; ``out_pt`` the same with the kernel's FP8 intermediates (P
scaled by fp8.P_SCALE and rounded to e4m3); the kernel passes when its error is at most twice
out_pt's plus FA3's atol. Descales differ per (batch or sequence, kv head), so that a descale
read at the wrong (b, kv_h), applied twice or not at all fails. Small shapes: every kernel runs
in Triton's interpreter on CPU.
"""
import math

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE, assert_fp8_parity

import reference
from kernels.core import fallback
from kernels.core.call import AttentionCall
from kernels.core.fp8 import P_SCALE, quantize_e4m3_torch, to_e4m3
from kernels.core.forward import attention_forward
from kernels.core.kvcache import kvcache_forward, varlen_paged_forward
from kernels.core.mods import CallMods, Descale

F8 = torch.float8_e4m3fn
BF16, F16 = torch.bfloat16, torch.float16


def fp8_randn(*shape, scale=2.0):
    """Random e4m3 values (their spread covers e4m3's normal range around 1)."""
    return (torch.randn(*shape, device=DEVICE) * scale).to(F8)


def descales(n, heads_kv):
    """fp32 (n, heads_kv) descales, all different."""
    return torch.rand(n, heads_kv, device=DEVICE) * 1.5 + 0.25


def dequant(x, d, group=1):
    """float64 x (B, heads, n, D) times d[b, h // group]."""
    x = x.double()
    if d is None:
        return x
    return x * d.double().repeat_interleave(group, 1)[:, :, None, None]


def e4m3_p(p):
    """P as the FP8 kernel's P @ V operand: P * P_SCALE rounded to e4m3, scaled back."""
    return (p * P_SCALE).float().to(F8).double() / P_SCALE


def oracle(q, k, v, *, causal, scale, window=None, softcap=None, sinks=None, p_round=None):
    """Attention of float64 q (B, H, L, D), k, v (B, H_kv, S, D) (GQA: kv head h // group),
    bottom-right causal with an optional window, soft-capping and sinks (H,). ``p_round``:
    applied to P = exp(s - row max of the scores) before P @ V (the row sum stays unrounded):
    the FP8 intermediates of ``out_pt``. Returns (out, lse); rows without keys: 0, -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * (q @ k.transpose(-1, -2))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(~reference.causal_mask(q.shape[2], k.shape[2], device=q.device,
                                                 window=window), float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = m.masked_fill(m == float("-inf"), 0.0)
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sinks.double()[None, :, None, None] - m)
    if p_round is not None:
        p = p_round(p)
    out = (p @ v.double()) / torch.where(total == 0, 1.0, total)
    lse = (m + total.log()).squeeze(-1)
    return out, lse


def check(out, lse, q, k, v, ds, *, causal, scale, window=None, softcap=None, sinks=None,
          fp8_q=True, name="kernel"):
    """The FP8 rule on ``out`` and a tight check of ``lse`` (no P scale may reach it)."""
    group = q.shape[1] // k.shape[1]
    qd = dequant(q, ds.q, group) if fp8_q else q.double()
    kd, vd = dequant(k, ds.k), dequant(v, ds.v)
    kw = dict(causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks)
    ref, ref_lse = oracle(qd, kd, vd, **kw)
    # out_pt: FP8 P for e4m3 q; an FP8 cache read by fp16 / bf16 q rounds P to q's dtype.
    p_round = e4m3_p if fp8_q else (lambda p: p.to(q.dtype).double())
    pt, _ = oracle(qd, kd, vd, p_round=p_round, **kw)
    assert_fp8_parity(out, ref, pt.to(out.dtype), factor=3.0 if softcap else 2.0, name=name)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), name
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=1e-5, atol=1e-4)
    return ref, pt


def fp8_call(causal, D, ds, **kw):
    sinks = kw.pop("sinks", None)
    softcap = kw.pop("softcap", None)
    return AttentionCall(causal, 1.0 / math.sqrt(D), mods=CallMods(
        descale=ds, sinks=sinks, softcap=softcap), **kw)


# ------------------------------------------------------------------------------------------
# The interpreter's casts (the workaround in kernels/core/fp8.py)
# ------------------------------------------------------------------------------------------
@triton.jit
def _cast_kernel(X, Y, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(Y + r, to_e4m3(tl.load(X + r), True))


def test_e4m3_cast_matches_torch():
    """fp32 -> e4m3 in the kernels equals torch's cast (ties to even) on normals, subnormals,
    rounding carries into the exponent (1.97 -> 2), and saturates at +-448."""
    x = torch.cat([torch.randn(2048) * s for s in (1e-3, 0.05, 1.0, 30.0)]
                  + [torch.tensor([1.97, 1.9375, 2.0625, 0.0009765625, 2 ** -10, 500., -1e4,
                                   464., 0.0])])
    x = torch.cat([x, torch.zeros(16384 - x.numel())]).to(DEVICE)
    y = torch.empty(x.numel(), dtype=F8, device=DEVICE)
    _cast_kernel[(1,)](x, y, N=x.numel())
    assert torch.equal(y.float(), x.clamp(-448, 448).to(F8).float())


# ------------------------------------------------------------------------------------------
# q, k, v e4m3 (FlashAttention-3's FP8 forward)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,H,Hk,L,S,D,causal,window,softcap,sinks", [
    (2, 2, 2, 1, 17, 32, False, None, None, False),
    (1, 4, 2, 17, 17, 20, True, None, None, False),       # GQA, odd head dim
    (1, 2, 1, 97, 97, 32, True, 19, None, False),         # MQA, window
    (2, 4, 2, 17, 33, 16, True, None, 5.0, True),         # softcap, sinks, q_len < k_len
])
def test_fp8_forward(B, H, Hk, L, S, D, causal, window, softcap, sinks):
    q, k, v = fp8_randn(B, H, L, D), fp8_randn(B, Hk, S, D), fp8_randn(B, Hk, S, D)
    ds = Descale(descales(B, Hk), descales(B, Hk), descales(B, Hk))
    sink_t = torch.randn(H, device=DEVICE) if sinks else None
    call = fp8_call(causal, D, ds, window=window, softcap=softcap, sinks=sink_t)
    out, lse = attention_forward(q, k, v, call)
    assert out.dtype == BF16
    kw = dict(causal=causal, scale=call.softmax_scale, window=window, softcap=softcap,
              sinks=sink_t)
    ref, pt = check(out, lse, q, k, v, ds, **kw)
    # The fallback's twin: the same rule, and close to the kernel.
    out_f, lse_f = fallback.forward(q, k, v, None, None, call, None)
    assert out_f.dtype == BF16
    check(out_f, lse_f, q, k, v, ds, name="fallback", **kw)
    # Kernel and fallback apart by at most what the rule allows each against the oracle.
    r = ref.to(BF16)
    atol = 2 * (r + 0.3 - 0.3 - r).abs().max().item()
    base = (pt.to(BF16).double() - ref).abs().max().item()
    assert (out.double() - out_f.double()).abs().max().item() <= 2 * base + atol


def test_fp8_forward_out_dtype_and_split():
    """fp16 output on request; split-KV (decoding, packed GQA heads) carries the descaled
    partials: the merge needs no descale."""
    B, H, Hk, L, S, D = 2, 4, 2, 1, 97, 32
    q, k, v = fp8_randn(B, H, L, D), fp8_randn(B, Hk, S, D), fp8_randn(B, Hk, S, D)
    ds = Descale(descales(B, Hk), descales(B, Hk), descales(B, Hk))
    call = fp8_call(True, D, ds, out_dtype=F16)
    out1, lse1 = attention_forward(q, k, v, call, num_splits=1)
    out3, lse3 = attention_forward(q, k, v, call, num_splits=3)
    assert out1.dtype == out3.dtype == F16
    for out, lse in ((out1, lse1), (out3, lse3)):
        check(out, lse, q, k, v, ds, causal=True, scale=call.softmax_scale)
    torch.testing.assert_close(lse3, lse1, rtol=0, atol=1e-5)


def test_fp8_forward_packed():
    """Packed sequences (lengths 1, 17, 5 queries): descales per sequence and kv head."""
    lq, lk, H, Hk, D = [1, 17, 5], [9, 17, 30], 2, 1, 32
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)
    q, k, v = fp8_randn(sum(lq), H, D), fp8_randn(sum(lk), Hk, D), fp8_randn(sum(lk), Hk, D)
    ds = Descale(descales(3, Hk), descales(3, Hk), descales(3, Hk))
    call = fp8_call(True, D, ds)
    out, lse = attention_forward(q, k, v, call, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=17, max_seqlen_k=30)
    out_f, lse_f = fallback.forward(q, k, v, cu_q, cu_k, call, None)
    for s in range(3):
        rq, rk = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
        seq = [x[r].transpose(0, 1)[None] for x, r in ((q, rq), (k, rk), (v, rk))]
        ds_s = Descale(*(d[s:s + 1] for d in ds))
        for name, o, l in (("kernel", out, lse), ("fallback", out_f, lse_f)):
            check(o[rq].transpose(0, 1)[None], l[:, rq][None], *seq, ds_s, causal=True,
                  scale=call.softmax_scale, name=f"{name} seq {s}")


# ------------------------------------------------------------------------------------------
# FP8 KV caches: the append's quantization, fp16 / bf16 queries, paged, packed over pages
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,paged", [(BF16, False), (F16, True)])
def test_fp8_kvcache_append_and_attend(dtype, paged):
    """New fp16 / bf16 rows are quantized into the e4m3 cache (bytes equal PyTorch's
    quantization; no other byte moves); attention over the cache upcasts K / V to q's dtype."""
    B, H, Hk, L, cap, D = 2, 4, 2, 3, 48, 32
    lens = torch.tensor([5, 30], dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, H, L, D, device=DEVICE).to(dtype)
    k_new, v_new = (torch.randn(B, Hk, L, D, device=DEVICE) * 3).to(dtype), \
        (torch.randn(B, Hk, L, D, device=DEVICE) * 3).to(dtype)
    ds = Descale(None, descales(B, Hk), descales(B, Hk))
    call = fp8_call(True, D, ds)
    if paged:
        page, n_pages = 16, cap // 16
        table = torch.randperm(B * n_pages, dtype=torch.int32, device=DEVICE).view(B, n_pages)
        k_cache, v_cache = fp8_randn(B * n_pages, page, Hk, D), fp8_randn(B * n_pages, page, Hk, D)
    else:
        table = None
        k_cache, v_cache = fp8_randn(B, Hk, cap, D), fp8_randn(B, Hk, cap, D)
    k0, v0 = k_cache.clone(), v_cache.clone()
    caches = {}
    for name in ("kernel", "fallback"):
        kc, vc = k0.clone(), v0.clone()
        if name == "kernel":
            out, lse = kvcache_forward(q, kc, vc, lens, k_new, v_new, call, num_splits=2,
                                       block_table=table)
        else:
            out, lse = fallback.kvcache_forward(q, kc, vc, lens, k_new, v_new, call,
                                                torch.empty_like(q), block_table=table)
        assert out.dtype == dtype
        caches[name] = (kc, vc)
        for b in range(B):
            n = int(lens[b]) + L
            if paged:
                pos = torch.arange(n, device=DEVICE)
                pages, rows = table[b].long()[pos // 16], pos % 16
                kd = kc[pages, rows].transpose(0, 1)[None]
                vd = vc[pages, rows].transpose(0, 1)[None]
            else:
                kd, vd = kc[b:b + 1, :, :n], vc[b:b + 1, :, :n]
            check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], kd, vd,
                  Descale(None, ds.k[b:b + 1], ds.v[b:b + 1]), causal=True,
                  scale=call.softmax_scale, fp8_q=False, name=f"{name} b={b}")
    # The appended bytes: PyTorch's quantization; everything else untouched.
    expect_k, expect_v = k0.clone(), v0.clone()
    qk, qv = quantize_e4m3_torch(k_new, ds.k), quantize_e4m3_torch(v_new, ds.v)
    for b in range(B):
        pos = torch.arange(int(lens[b]), int(lens[b]) + L, device=DEVICE)
        if paged:
            pages, rows = table[b].long()[pos // 16], pos % 16
            expect_k[pages, rows] = qk[b].transpose(0, 1)
            expect_v[pages, rows] = qv[b].transpose(0, 1)
        else:
            expect_k[b, :, pos] = qk[b]
            expect_v[b, :, pos] = qv[b]
    for name, (kc, vc) in caches.items():
        assert torch.equal(kc.view(torch.uint8), expect_k.view(torch.uint8)), name
        assert torch.equal(vc.view(torch.uint8), expect_v.view(torch.uint8)), name


def test_fp8_kvcache_fp8_queries_raw_append():
    """e4m3 q with an e4m3 cache: new e4m3 rows are copied as they are (already quantized
    with the cache's scales); the FP8 forward reads the cache (packed GQA heads, split)."""
    B, H, Hk, L, cap, D = 2, 2, 1, 1, 40, 16
    lens = torch.tensor([0, 23], dtype=torch.int32, device=DEVICE)
    q, k_new, v_new = fp8_randn(B, H, L, D), fp8_randn(B, Hk, L, D), fp8_randn(B, Hk, L, D)
    k_cache, v_cache = fp8_randn(B, Hk, cap, D), fp8_randn(B, Hk, cap, D)
    ds = Descale(descales(B, Hk), descales(B, Hk), descales(B, Hk))
    call = fp8_call(True, D, ds)
    out, lse = kvcache_forward(q, k_cache, v_cache, lens, k_new, v_new, call, num_splits=0)
    for b in range(B):
        n = int(lens[b])
        assert torch.equal(k_cache[b, :, n:n + L].view(torch.uint8), k_new[b].view(torch.uint8))
        check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :, :n + L],
              v_cache[b:b + 1, :, :n + L], Descale(*(d[b:b + 1] for d in ds)), causal=True,
              scale=call.softmax_scale)


def test_fp8_varlen_paged():
    """Packed e4m3 queries over a paged e4m3 cache (decode and prefill rows mixed), kernel and
    fallback, descales per sequence."""
    lq, lk, H, Hk, D, page = [1, 7], [20, 9], 2, 2, 32, 8
    cu_q = torch.tensor([0, 1, 8], dtype=torch.int32, device=DEVICE)
    used = torch.tensor(lk, dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32, device=DEVICE)
    q = fp8_randn(sum(lq), H, D)
    k_cache, v_cache = fp8_randn(6, page, Hk, D), fp8_randn(6, page, Hk, D)
    ds = Descale(descales(2, Hk), descales(2, Hk), descales(2, Hk))
    call = fp8_call(True, D, ds)
    out, lse = varlen_paged_forward(q, k_cache, v_cache, call, cu_seqlens_q=cu_q,
                                    max_seqlen_q=7, block_table=table, seqused_k=used,
                                    num_splits=2)
    out_f, lse_f = fallback.varlen_paged_forward(q, k_cache, v_cache, cu_q, used, table, call)
    for s in range(2):
        rq = slice(int(cu_q[s]), int(cu_q[s + 1]))
        pos = torch.arange(lk[s], device=DEVICE)
        pages, rows = table[s].long()[pos // page], pos % page
        kd = k_cache[pages, rows].transpose(0, 1)[None]
        vd = v_cache[pages, rows].transpose(0, 1)[None]
        for name, o, l in (("kernel", out, lse), ("fallback", out_f, lse_f)):
            check(o[rq].transpose(0, 1)[None], l[:, rq][None], q[rq].transpose(0, 1)[None], kd,
                  vd, Descale(*(d[s:s + 1] for d in ds)), causal=True,
                  scale=call.softmax_scale, name=f"{name} seq {s}")


def test_fp8_per_tensor_descales_as_expanded_views():
    """A per-tensor scale passed as a stride-0 (B, H_kv) view, and a missing descale (= 1)."""
    B, H, Hk, L, S, D = 2, 2, 2, 5, 17, 16
    q, k, v = fp8_randn(B, H, L, D), fp8_randn(B, Hk, S, D), fp8_randn(B, Hk, S, D)
    one_q = torch.tensor(0.7, device=DEVICE).expand(B, Hk)
    ds = Descale(one_q, None, descales(B, Hk))
    call = fp8_call(False, D, ds)
    out, lse = attention_forward(q, k, v, call)
    check(out, lse, q, k, v, ds, causal=False, scale=call.softmax_scale)
    out_f, lse_f = fallback.forward(q, k, v, None, None, call, None)
    check(out_f, lse_f, q, k, v, ds, causal=False, scale=call.softmax_scale, name="fallback")
