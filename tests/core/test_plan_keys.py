"""Plan-cache keys as a property: for every option and every tensor property
in a plan's signature (``_signature``, ``_opt_sig``, ``_options_key``, ``_fp8_key`` and the
keys of ``attention_plan``, ``kvcache_runner``, ``paged_varlen``, ``_op_plan`` in
kernels/pipeline.py), a cache hit gives the same bits as a cache miss.

Each test calls every variant of a base call on an empty cache (``kernels.plans.clear()``,
a miss), then all of them in one cache, in order and reversed (each variant after a neighbour
that differs from it in one property: a key missing that property is a hit on the neighbour's
plan), and compares outputs, lse and gradients bit for bit. The varlen cases hold a batch with
the same token and sequence counts whose longest sequence crosses a 128-row tile: a key
without max_seqlen would reuse a grid too small for it (on a GPU: uninitialised rows).
"""
import pytest
import torch
import triton
import triton.language as tl

import kernels
from kernels import MaskMod, ScoreMod
from kernels.ops import forward_with_lse
from tests.helpers import DEVICE, interpreter_unusable_reason

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and interpreter_unusable_reason() is not None,
                                reason=str(interpreter_unusable_reason()))

B, H, S, D = 1, 2, 24, 16
SHORT, CROSSING = (66, 66), (2, 130)   # same tokens and sequences; max 66 vs 130 > 128
WINDOW = 8   # packed calls: a causal window keeps the interpreter's work per row small


@triton.jit
def _head_bias(s, b, h, q_idx, kv_idx, aux):
    return s + tl.load(aux[0] + h)


def _head_bias_torch(s, b, h, q_idx, kv_idx, aux):
    return s + aux[0].reshape(-1)[h].to(s.dtype)


@triton.jit
def _even_keys(b, h, q_idx, kv_idx, aux):
    return kv_idx % 2 == 0


def _even_keys_torch(b, h, q_idx, kv_idx, aux):
    return kv_idx % 2 == 0


HEAD_BIAS = ScoreMod("tests.plan_keys.head_bias", _head_bias, _head_bias_torch)
EVEN_KEYS = MaskMod("tests.plan_keys.even_keys", _even_keys, _even_keys_torch)


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _misaligned(t):
    """``t``'s values at a data pointer 4 bytes past a 16-byte boundary (fp32)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=DEVICE)[1:]
    return buf.view(t.shape).copy_(t)


def _strided(t):
    """``t``'s values with other strides (seq and heads swapped in memory)."""
    return t.transpose(-3, -2).contiguous().transpose(-3, -2)


def _results(outs, leaves):
    """Outputs (and, with ``leaves``, their gradients for one fixed do) as a flat list."""
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    res = [o.detach().clone() for o in outs]
    if leaves:
        gen = torch.Generator(DEVICE).manual_seed(0)
        loss = (outs[0] * torch.randn(outs[0].shape, generator=gen, device=DEVICE,
                                      dtype=outs[0].dtype)).sum()
        res += torch.autograd.grad(loss, leaves)
    return res


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _check_property(variants):
    """Every variant on an empty cache, then all in one cache (in order and reversed):
    bit-equal results. Returns the fresh results."""
    fresh = {}
    for name, fn in variants.items():
        kernels.plans.clear()
        fresh[name] = fn()
    for order in (list(variants), list(variants)[::-1]):
        kernels.plans.clear()
        for name in order:
            got = variants[name]()
            assert len(got) == len(fresh[name])
            for i, (g, w) in enumerate(zip(got, fresh[name])):
                assert g.shape == w.shape and torch.equal(g, w), (
                    f"{name}: result {i} from a cached plan differs from a fresh plan's "
                    f"(max diff {(g.double() - w.double()).abs().max().item():.3g}): the "
                    f"plan key misses a property that {name} changes")
    return fresh


# ------------------------------------------------------------------ dense
def _dense_variants():
    q, k, v = _randn(B, H, S, D), _randn(B, H, S, D), _randn(B, H, S, D)
    k_long, v_long, v_wide = _randn(B, H, 40, D), _randn(B, H, 40, D), _randn(B, H, S, 32)
    sinks, alibi = _randn(H), torch.rand(H, device=DEVICE)
    bias = _randn(H)

    def call(q=q, k=k, v=v, grad=False, **kw):
        # (gradients on a few variants: the backward's plans hang off the forward's key)
        leaves = _leaves(q, k, v) if grad else [q, k, v]
        return _results(kernels.attention(*leaves, return_lse=True, **kw), grad and leaves)

    return {
        "base": lambda: call(causal=True, grad=True),
        "causal": lambda: call(causal=False),
        "dropout_p": lambda: call(dropout_p=0.3, seed=7),
        "softmax_scale": lambda: call(softmax_scale=0.5),
        "window": lambda: call(window=4, grad=True),
        "num_splits": lambda: call(num_splits=1),
        "softcap": lambda: call(softcap=2.0),
        "chunk_size": lambda: call(chunk_size=8),
        "score_mod": lambda: call(score_mod=HEAD_BIAS, mod_aux=(bias,)),
        "mod_aux dtype": lambda: call(score_mod=HEAD_BIAS, mod_aux=(bias.half(),)),
        "mask_mod": lambda: call(mask_mod=EVEN_KEYS),
        "sinks": lambda: call(sinks=sinks),
        "sinks dtype": lambda: call(sinks=sinks.half()),
        "alibi_slopes": lambda: call(alibi_slopes=alibi),
        "alibi_slopes per batch": lambda: call(alibi_slopes=alibi.expand(B, H).contiguous()),
        "k_len": lambda: call(k=k_long, v=v_long),
        "q dtype": lambda: call(q=q.half(), k=k.half(), v=v.half()),
        "q strides": lambda: call(q=_strided(q)),
        "k strides": lambda: call(k=_strided(k)),
        "v strides": lambda: call(v=_strided(v), grad=True),
        "v head_dim": lambda: call(v=v_wide),
        "q alignment": lambda: call(q=_misaligned(q)),
        "v alignment": lambda: call(v=_misaligned(v)),
        "drop_layout": lambda: _results(forward_with_lse(
            q, k, v, dropout_p=0.3, seed=7, drop_layout=(S + 8, S + 8, 8, 8)), None),
    }


def test_dense_plan_keys():
    fresh = _check_property(_dense_variants())
    assert not torch.equal(fresh["window"][0], fresh["base"][0])   # (the variants differ)


def _fp8_variants():
    f8 = torch.float8_e4m3fn
    q, k, v = (_randn(B, H, S, D).to(f8) for _ in range(3))
    descale = torch.rand(B, H, device=DEVICE) + 0.5

    def call(**kw):
        return _results(kernels.attention(q, k, v, return_lse=True, **kw), None)

    return {
        "fp8": lambda: call(),
        "k_descale": lambda: call(k_descale=descale),
        "v_descale": lambda: call(v_descale=descale),
        "out_dtype": lambda: call(out_dtype=torch.float16),
        "window": lambda: call(window=4),
    }


def test_fp8_plan_keys():
    _check_property(_fp8_variants())


# ------------------------------------------------------------------ packed (varlen)
def _cu(lens):
    return torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32, device=DEVICE)


def _varlen_variants(compiled=False):
    n = sum(SHORT)
    q, k, v = _randn(n, 1, D), _randn(n, 1, D), _randn(n, 1, D)

    def run(q, k, v, cu, max_len, window):
        return kernels.attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=True,
                                        window=window, return_lse=True)

    # (automatic dynamic: window and max_len seen with two values turn symbolic on the next
    # compile; the spec string guards them back to constants, core/call.py)
    fn = torch.compile(run, fullgraph=True, backend="aot_eager") if compiled else run

    def call(lens, window=WINDOW, v=v):
        leaves = _leaves(q, k, v) if not compiled else [q, k, v]   # (compiling: forward only)
        return _results(fn(*leaves, _cu(lens), max(lens), window), not compiled and leaves)

    return {
        "short": lambda: call(SHORT),
        "crossing": lambda: call(CROSSING),
        "window": lambda: call(CROSSING, window=2 * WINDOW),
        "v strides": lambda: call(CROSSING, v=_strided(v)),
    }


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_varlen_plan_keys(compiled):
    torch._dynamo.reset()
    fresh = _check_property(_varlen_variants(compiled))
    # The rows past 128 of the long sequence are computed (the grid did grow).
    assert fresh["crossing"][0][CROSSING[0] + 128:].abs().sum() > 0


# ------------------------------------------------------------------ KV cache, paged
def _kvcache_variants():
    k_cache, v_cache = _randn(2, H, 48, D), _randn(2, H, 48, D)
    q, k, v = _randn(2, H, 1, D), _randn(2, H, 1, D), _randn(2, H, 1, D)
    lens = torch.tensor([5, 30], dtype=torch.int32, device=DEVICE)
    pages = torch.randperm(12, device=DEVICE).to(torch.int32).view(2, 6)
    sinks = _randn(H)

    def call(max_len=32, paged=False, **kw):
        kc, vc = k_cache[:, :, :max_len].clone(), v_cache[:, :, :max_len].clone()
        extra = {}
        if paged:   # 12 pages of 8 rows: each sequence's rows in its block-table order
            kc = kc.transpose(1, 2).reshape(-1, 8, H, D)[:12].contiguous()
            vc = vc.transpose(1, 2).reshape(-1, 8, H, D)[:12].contiguous()
            extra = dict(block_table=pages)
        out = kernels.attention_with_kvcache(q, kc, vc, lens, k, v, return_lse=True, **extra,
                                             **kw)
        return _results(out, None) + [kc, vc]

    return {
        "base": lambda: call(),
        "window": lambda: call(window=4),
        "causal": lambda: call(causal=False),
        "num_splits": lambda: call(num_splits=3),
        "max_len": lambda: call(max_len=48),
        "paged": lambda: call(max_len=48, paged=True),
        "sinks": lambda: call(sinks=sinks),
    }


def test_kvcache_plan_keys():
    _check_property(_kvcache_variants())


def _paged_varlen_variants(compiled=False):
    n = sum(SHORT)
    q = _randn(n, 1, D)
    kp, vp = _randn(2 * 10, 16, 1, D), _randn(2 * 10, 16, 1, D)
    table = torch.randperm(20, device=DEVICE).to(torch.int32).view(2, 10)
    used = torch.tensor([150, 160], dtype=torch.int32, device=DEVICE)

    def run(q, cu, max_len, window):
        return kernels.attention_varlen(q, kp, vp, cu, None, max_len, block_table=table,
                                        seqused_k=used, causal=True, window=window,
                                        return_lse=True)

    # (automatic dynamic: window and max_len seen with two values turn symbolic on the next
    # compile; the spec string guards them back to constants, core/call.py)
    fn = torch.compile(run, fullgraph=True, backend="aot_eager") if compiled else run
    return {
        "short": lambda: _results(fn(q, _cu(SHORT), max(SHORT), WINDOW), None),
        "crossing": lambda: _results(fn(q, _cu(CROSSING), max(CROSSING), WINDOW), None),
        "window": lambda: _results(fn(q, _cu(CROSSING), max(CROSSING), 2 * WINDOW), None),
    }


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_paged_varlen_plan_keys(compiled):
    torch._dynamo.reset()
    _check_property(_paged_varlen_variants(compiled))
