"""FP8 at the public boundary: what the API accepts and refuses (kernels.attention,
attention_varlen, attention_with_kvcache and the FlashAttention API), the forward-only rule,
and the public routes (eager, custom op, FlashAttention names) agreeing with one another.
Kernel-level FP8 parity lives in tests/core/test_fp8.py."""
import pytest
import torch
from helpers import DEVICE

import kernels
from kernels import flash_attn_interface as fa

FP8 = torch.float8_e4m3fn


def _fp8(*shape, scale=1.0, device="cpu"):
    return (torch.randn(*shape, device=device) * scale).to(FP8)


def _qkv(B=2, Hq=4, Hkv=2, L=17, D=16, device="cpu"):
    return tuple(_fp8(B, h, L, D, device=device) for h in (Hq, Hkv, Hkv))


def _descales(B=2, Hkv=2, device="cpu"):
    return [torch.rand(B, Hkv, device=device) + 0.5 for _ in range(3)]


# ------------------------------------------------------------------------------ refusals
def test_mixed_dtypes_refused():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="share one dtype.*float8_e4m3fn.*bfloat16"):
        kernels.attention(q, k.to(torch.bfloat16), v.to(torch.bfloat16))
    with pytest.raises(TypeError, match="share one dtype"):
        kernels.attention(q.to(torch.bfloat16), k, v)


@pytest.mark.parametrize("name", ["float8_e5m2", "float8_e4m3fnuz"])
def test_other_fp8_formats_refused(name):
    q, k, v = (t.float().to(getattr(torch, name)) for t in _qkv())
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        kernels.attention(q, k, v)


def test_descale_checks():
    q, k, v = _qkv()
    qd, kd, vd = _descales()
    with pytest.raises(ValueError, match=r"k_descale must be float32 of shape \(batch, heads_kv"):
        kernels.attention(q, k, v, q_descale=qd, k_descale=kd[:, :1], v_descale=vd)
    with pytest.raises(ValueError, match="v_descale must be float32"):
        kernels.attention(q, k, v, v_descale=vd.half())
    with pytest.raises(TypeError, match="q_descale must be a float32 tensor"):
        kernels.attention(q, k, v, q_descale=2.0)
    with pytest.raises(ValueError, match="requires grad"):
        kernels.attention(q, k, v, q_descale=qd.requires_grad_())
    bf = [t.float().to(torch.bfloat16) for t in (q, k, v)]
    with pytest.raises(ValueError, match="k_descale applies to FP8"):
        kernels.attention(*bf, k_descale=kd)


def test_out_dtype_and_dropout_checks():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="out_dtype of an FP8 call"):
        kernels.attention(q, k, v, out_dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="dropout with FP8"):
        kernels.attention(q, k, v, dropout_p=0.1)
    bf = [t.float().to(torch.bfloat16) for t in (q, k, v)]
    with pytest.raises(ValueError, match="out_dtype applies to FP8"):
        kernels.attention(*bf, out_dtype=torch.float16)


def test_gradients_refused_naming_bf16():
    q, k, v = _qkv()
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="forward-only.*bfloat16"):
        kernels.attention(q, k, v)
    with torch.no_grad():   # the documented way out
        assert kernels.attention(q, k, v).dtype == torch.bfloat16


def test_integration_entries_refuse_fp8():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="forward-only"):
        kernels.ops.forward_with_lse(q, k, v)


def test_kvcache_checks_write_nothing():
    B, Hq, Hkv, L, D = 2, 4, 2, 24, 16
    q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16)
    k_cache, v_cache = _fp8(B, Hkv, L, D), _fp8(B, Hkv, L, D)
    before = (k_cache.view(torch.uint8).clone(), v_cache.view(torch.uint8).clone())
    lens = torch.tensor([5, 9], dtype=torch.int32)
    k_new = torch.randn(B, Hkv, 1, D, dtype=torch.bfloat16)
    bad = [
        (TypeError, "float16 or bfloat16 q", dict(q=q.float(), k=k_new.float(),
                                                  v=k_new.float())),
        (ValueError, "q_descale applies to FP8 q", dict(q_descale=torch.ones(B, Hkv))),
        (ValueError, "two forms of one scale", dict(k_scale=0.5, k_descale=torch.ones(B, Hkv))),
        (ValueError, "k_scale must be a finite float", dict(k_scale=-1.0)),
        (ValueError, "k_scale must be a float or a one-element", dict(k_scale=torch.ones(2))),
        (ValueError, "v_descale must be float32 of shape", dict(v_descale=torch.ones(B, Hq))),
        (ValueError, "in q's dtype", dict(k=k_new.to(FP8), v=k_new.to(FP8))),
    ]
    for exc, match, kw in bad:
        args = dict(q=q, k=k_new, v=k_new)
        args.update(kw)
        qq = args.pop("q")
        with pytest.raises(exc, match=match):
            kernels.attention_with_kvcache(qq, k_cache, v_cache, lens, **args)
    assert torch.equal(k_cache.view(torch.uint8), before[0])
    assert torch.equal(v_cache.view(torch.uint8), before[1])


def test_flash_attn_names():
    q, k, v = _qkv()
    qd, kd, vd = _descales()
    bf = [t.float().to(torch.bfloat16).transpose(1, 2) for t in (q, k, v)]
    with pytest.raises(RuntimeError, match="q_descale applies to FP8"):   # FlashAttention's type
        fa.flash_attn_func(*bf, q_descale=qd)
    with pytest.raises(NotImplementedError, match="qv is a FlashAttention 3 argument"):
        fa.flash_attn_func(*bf, qv=bf[0])


# ------------------------------------------------------------------------------ routes agree
# On DEVICE: on an FP8 GPU (sm_89+) these run the FP8 kernel, elsewhere the interpreter (CPU)
# or the fallback's FP8 twin (older GPUs). The refusals above need no device.
def _interpreted():
    from kernels.core.common import KERNELS_INTERPRETED
    return KERNELS_INTERPRETED


def test_public_routes_agree():
    """Eager, the custom op (torch.compile), and the FlashAttention names give the same bits
    for one FP8 call with per-(batch, head) descales."""
    q, k, v = _qkv(L=17, device=DEVICE)
    qd, kd, vd = _descales(device=DEVICE)
    kw = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    out = kernels.attention(q, k, v, **kw)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, 17, 16)
    assert torch.isfinite(out.float()).all()
    fa_out = fa.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(fa_out.transpose(1, 2), out)
    fn = torch.compile(lambda q, k, v, qd, kd, vd: kernels.attention(
        q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd),
        backend="aot_eager", fullgraph=True)
    assert torch.equal(fn(q, k, v, qd, kd, vd), out)
    half = kernels.attention(q, k, v, out_dtype=torch.float16, **kw)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), out.float(), atol=1e-2, rtol=1e-2)


def test_descales_scale_the_result():
    """Descales are the inputs' scales: doubling v_descale doubles the output, and
    q_descale * k_descale acts as the softmax scale (exactly, for powers of two)."""
    q, k, v = _qkv(L=9, device=DEVICE)
    ones = torch.ones(2, 2, device=DEVICE)
    base = kernels.attention(q, k, v, causal=False, softmax_scale=0.5).float()
    doubled = kernels.attention(q, k, v, causal=False, softmax_scale=0.5,
                                v_descale=2 * ones).float()
    torch.testing.assert_close(doubled, 2 * base, atol=0, rtol=0)
    moved = kernels.attention(q, k, v, causal=False, softmax_scale=0.125,
                              q_descale=2 * ones, k_descale=2 * ones).float()
    torch.testing.assert_close(moved, base, atol=0, rtol=0)


def test_kvcache_fp8_append_and_per_tensor_scale():
    """An FP8 cache read by bf16 q: the append quantizes the new rows in place (x / scale,
    e4m3), k_scale (per tensor) and k_descale (per (batch, head)) agree, and the varlen paged
    route over the same pages gives the same rows."""
    torch.manual_seed(0)
    B, Hq, Hkv, L, D = 2, 4, 2, 32, 16
    q = torch.randn(B, Hq, 1, D, device=DEVICE).to(torch.bfloat16)
    k_cache, v_cache = _fp8(B, Hkv, L, D, device=DEVICE), _fp8(B, Hkv, L, D, device=DEVICE)
    lens = torch.tensor([5, 20], dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(B, Hkv, 1, D, device=DEVICE).to(torch.bfloat16)
    v_new = torch.randn(B, Hkv, 1, D, device=DEVICE).to(torch.bfloat16)
    kc1, vc1 = k_cache.clone(), v_cache.clone()
    out1 = kernels.attention_with_kvcache(q, kc1, vc1, lens, k_new, v_new, k_scale=0.5,
                                          v_scale=torch.tensor([0.25], device=DEVICE))
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    out2 = kernels.attention_with_kvcache(q, kc2, vc2, lens, k_new, v_new,
                                          k_descale=torch.full((B, Hkv), 0.5, device=DEVICE),
                                          v_descale=torch.full((B, Hkv), 0.25, device=DEVICE))
    assert torch.equal(out1, out2) and out1.dtype == torch.bfloat16
    for cache, new, scale in ((kc1, k_new, 0.5), (vc1, v_new, 0.25)):
        for b in range(B):
            pos = int(lens[b])
            expect = (new[b, :, 0].float() / scale).clamp(-448, 448).to(FP8)
            assert torch.equal(cache[b, :, pos].view(torch.uint8), expect.view(torch.uint8))
    untouched = torch.ones(L, dtype=torch.bool, device=DEVICE)
    untouched[[5]] = False
    assert torch.equal(kc1[0, :, untouched].view(torch.uint8),
                       k_cache[0, :, untouched].view(torch.uint8))


def test_varlen_descales_per_sequence():
    """attention_varlen's descales are per packed sequence: each sequence's rows equal the
    dense call on that sequence alone with its descale row."""
    torch.manual_seed(1)
    lens = [5, 12]
    Hq, Hkv, D = 4, 2, 16
    q, k, v = _fp8(sum(lens), Hq, D), _fp8(sum(lens), Hkv, D), _fp8(sum(lens), Hkv, D)
    qd, kd, vd = _descales(len(lens), Hkv, device=DEVICE)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=DEVICE)
    out = kernels.attention_varlen(q, k, v, cu, cu, q_descale=qd, k_descale=kd, v_descale=vd)
    for s in range(len(lens)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        one = kernels.attention(*(t[rows].transpose(0, 1)[None] for t in (q, k, v)),
                                q_descale=qd[s:s + 1], k_descale=kd[s:s + 1],
                                v_descale=vd[s:s + 1])
        torch.testing.assert_close(out[rows].float(), one[0].transpose(0, 1).float(),
                                   atol=1e-2, rtol=1e-2)


def test_flash_attn_kvcache_fp8_host_append():
    """flash_attn_with_kvcache's own append (seqlen_new != seqlen_q) quantizes into an FP8 cache
    as the kernels' append does: the same cache bytes and output as the kernel route."""
    torch.manual_seed(2)
    B, L, Hq, Hkv, D = 2, 24, 4, 2, 16
    kd, vd = torch.rand(B, Hkv, device=DEVICE) + 0.5, torch.rand(B, Hkv, device=DEVICE) + 0.5
    k_cache, v_cache = _fp8(B, L, Hkv, D, device=DEVICE), _fp8(B, L, Hkv, D, device=DEVICE)
    lens = torch.tensor([3, 10], dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(B, 2, Hkv, D, device=DEVICE).to(torch.bfloat16)
    v_new = torch.randn(B, 2, Hkv, D, device=DEVICE).to(torch.bfloat16)
    q2 = torch.randn(B, 2, Hq, D, device=DEVICE).to(torch.bfloat16)
    kc1, vc1 = k_cache.clone(), v_cache.clone()   # the kernels' append (seqlen_new == seqlen_q)
    out1 = fa.flash_attn_with_kvcache(q2, kc1, vc1, k_new, v_new, cache_seqlens=lens,
                                      causal=True, k_descale=kd, v_descale=vd)
    kc2, vc2 = k_cache.clone(), v_cache.clone()   # the host append (seqlen_q 1 != 2)
    fa.flash_attn_with_kvcache(q2[:, -1:], kc2, vc2, k_new, v_new, cache_seqlens=lens,
                               causal=True, k_descale=kd, v_descale=vd)
    assert torch.equal(kc1.view(torch.uint8), kc2.view(torch.uint8))
    assert torch.equal(vc1.view(torch.uint8), vc2.view(torch.uint8))
    assert out1.dtype == torch.bfloat16 and torch.isfinite(out1.float()).all()
