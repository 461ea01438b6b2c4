"""The library never relies on torch's defaults: under another default device
(``torch.device(...)``, ``torch.set_default_device``) or default dtype
(``torch.set_default_dtype``) every public entry point gives the same bits, dtypes and
devices as without it. A default device of "meta" makes any tensor the library creates
without a device unusable, so a missed ``device=`` fails here (it crashed the fallback's
dropout: a meta buffer handed to its native mask drawer); float64 catches a missed
``dtype=``."""
import contextlib

import pytest
import torch

import kernels
from kernels import flash_attn_interface as fa

F32 = torch.float32


def _calls(device="cpu"):
    """(name, a function of fresh leaves on ``device`` -> the tensors to compare, the leaves'
    shapes)."""
    B, H, HKV, L, D = 2, 4, 2, 19, 16
    cu = torch.tensor([0, 7, 19], dtype=torch.int32, device=device)

    def dense(**kw):
        def call(q, k, v):
            out = kernels.attention(q, k, v, **kw)
            return out if isinstance(out, tuple) else (out,)
        return call

    def varlen(q, k, v):
        return (kernels.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                         v[0].transpose(0, 1), cu, cu, dropout_p=0.2, seed=4),)

    def kvcache(q, k, v):
        k_cache = torch.zeros(B, HKV, 32, D, dtype=F32, device=device)
        v_cache = torch.zeros(B, HKV, 32, D, dtype=F32, device=device)
        lens = torch.tensor([3, 11], dtype=torch.int32, device=device)
        with torch.no_grad():
            out = kernels.attention_with_kvcache(q[:, :, :2].detach(), k_cache, v_cache, lens,
                                                 k[:, :, :2].detach(), v[:, :, :2].detach(),
                                                 num_splits=2, return_lse=True)
        return (*out, k_cache, v_cache)

    def flash(q, k, v):
        return (fa.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   dropout_p=0.1, causal=True),)

    qkv = ((B, H, L, D), (B, HKV, L, D), (B, HKV, L, D))
    return [
        ("plain", dense(), qkv),
        ("dropout", dense(dropout_p=0.3, seed=5), qkv),
        ("window+softcap+lse", dense(window=6, softcap=2.0, return_lse=True), qkv),
        ("non-causal dropout", dense(causal=False, dropout_p=0.2, seed=3), qkv),
        ("sinks+alibi", lambda q, k, v: (kernels.attention(
            q, k, v, sinks=torch.linspace(-1, 1, H, dtype=F32, device=device),
            alibi_slopes=torch.full((H,), 0.25, dtype=F32, device=device)),), qkv),
        ("varlen dropout", varlen, ((1, H, L, D), (1, HKV, L, D), (1, HKV, L, D))),
        ("kv cache append, split-KV", kvcache, qkv),
        ("FlashAttention API, drawn seed", flash, qkv),
    ]


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


DEFAULTS = {"meta device": lambda: torch.device("meta"),
            "float64 dtype": lambda: _default_dtype(torch.float64)}


def _run(fn, shapes, seed, device, default=None):
    torch.manual_seed(seed)   # the same leaves, and the same drawn dropout seed
    leaves = [torch.randn(*s, dtype=F32, device=device, requires_grad=True) for s in shapes]
    with DEFAULTS[default]() if default else contextlib.nullcontext():
        outs = fn(*leaves)
        grads = ()
        if outs[0].requires_grad:
            grads = torch.autograd.grad(outs[0].float().square().sum(), leaves)
    return outs + tuple(grads)


@pytest.mark.parametrize("default", list(DEFAULTS))
@pytest.mark.parametrize("case", range(len(_calls())), ids=[c[0] for c in _calls()])
def test_same_bits_under_other_defaults(case, default, route):
    name, fn, shapes = _calls(route.device)[case]
    expected = _run(fn, shapes, case, route.device)
    got = _run(fn, shapes, case, route.device, default=default)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert (g.device, g.dtype) == (e.device, e.dtype), (
            f"{name}: output {i} is {g.dtype} on {g.device} under a default {default}, "
            f"expected {e.dtype} on {e.device}")
        assert torch.equal(g, e), f"{name}: output {i} differs under a default {default}"
