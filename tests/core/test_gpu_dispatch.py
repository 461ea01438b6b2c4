"""GPU-only tests of the eager dispatch (kernels/core/launch.py, kernels/ops.py launch plans):
no host sync on the default paths, CUDA graphs with and without dropout, direct launches equal
to Triton's own.

Skipped with the reason on machines without CUDA (conftest.py). Each test warms its calls up
first: a signature's first call compiles and autotunes (which may sync); the checks are about
the calls after it.
"""
import pytest
import torch
import torch.nn.functional as F
from helpers import randn

import kernels
from kernels import sdpa
from kernels.core import launch

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _qkv(b=2, h=4, h_kv=4, n=256, d=64, requires_grad=True):
    q = randn(b, h, n, d, dtype=BF16).requires_grad_(requires_grad)
    k = randn(b, h_kv, n, d, dtype=BF16).requires_grad_(requires_grad)
    v = randn(b, h_kv, n, d, dtype=BF16).requires_grad_(requires_grad)
    return q, k, v


def _no_sync(fn, warmups=2):
    """Run ``fn`` (warm) under torch.cuda.set_sync_debug_mode("error"): any device sync
    (.item(), .tolist(), a host copy of device data) raises."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_dense_forward_backward_does_not_sync(dropout_p):
    q, k, v = _qkv()
    do = torch.randn_like(q)
    _no_sync(lambda: torch.autograd.grad(kernels.attention(q, k, v, dropout_p=dropout_p),
                                         (q, k, v), do))


def test_kvcache_decode_does_not_sync():
    B, H, H_kv, D, L = 2, 8, 2, 64, 1024
    k_cache, v_cache = (randn(B, H_kv, L, D, dtype=BF16) for _ in range(2))
    lens = torch.tensor([300, 700], dtype=torch.int32, device="cuda")
    q = randn(B, H, 1, D, dtype=BF16)
    k_new, v_new = (randn(B, H_kv, 1, D, dtype=BF16) for _ in range(2))
    _no_sync(lambda: kernels.attention_with_kvcache(q, k_cache, v_cache, lens, k_new, v_new))


def test_module_forward_backward_does_not_sync():
    torch.manual_seed(0)
    mha = kernels.FusedMultiHeadAttention(256, 256, 512, 0.1, num_heads=4).cuda().to(BF16)
    x = randn(2, 512, 256, dtype=BF16)
    _no_sync(lambda: mha(x).sum().backward())


def test_sdpa_backend_does_not_sync():
    from torch.nn import attention as nna
    if not hasattr(nna, "register_flash_attention_impl"):
        pytest.skip("this torch has no flash-attention implementation registry")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = _qkv()
    do = torch.randn_like(q)
    sdpa.register()
    nna.activate_flash_attention_impl(sdpa.NAME)
    try:
        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
            torch.autograd.grad(out, (q, k, v), do)
        _no_sync(run)
    finally:
        nna.restore_flash_attention_impl()


def _graphed_step(q, k, v, do, dropout_p):
    """A forward + backward captured in a CUDA graph (after a warm-up on a side stream, as
    torch.cuda.graph's documentation asks): returns (replay, out, grads) with static outputs."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            out = kernels.attention(q, k, v, dropout_p=dropout_p)
            torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.attention(q, k, v, dropout_p=dropout_p)
        grads = torch.autograd.grad(out, (q, k, v), do)
    return graph.replay, out, grads


def test_cuda_graph_replays_match_eager():
    q, k, v = _qkv()
    do = torch.randn_like(q)
    replay, out, grads = _graphed_step(q, k, v, do, 0.0)
    with torch.no_grad():   # new inputs in the captured buffers
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
    replay()
    torch.cuda.synchronize()
    want = kernels.attention(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v), do)
    assert torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


def test_cuda_graph_dropout_draws_a_new_mask_per_replay():
    """The seed is drawn on the device inside the graph (kernels/pipeline.py ``seed_tensor``), so
    each replay has its own mask; forward and backward of one replay share it (dV = P_dropᵀ dO,
    with dO = 1, sums what the forward's rows kept)."""
    q, k, v = _qkv(n=128)
    do = torch.ones_like(q)
    replay, out, grads = _graphed_step(q, k, v, do, 0.5)
    outs, dvs = [], []
    for _ in range(3):
        replay()
        torch.cuda.synchronize()
        outs.append(out.clone())
        dvs.append(grads[2].clone())
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    for o, dv in zip(outs, dvs):
        assert torch.isfinite(o).all() and torch.isfinite(dv).all()
        # Column sums of the kept, rescaled weights: what dV's rows add up to with dO = 1
        # equals the forward's total weight mass per (batch, head): q_len rows ~ 1 each.
        mass = dv.float().sum(dim=(2, 3)) / dv.shape[-1]
        assert torch.allclose(mass, torch.full_like(mass, q.shape[2]), rtol=0.1)
    # Different replays of the same inputs differ only by the mask: without dropout they agree.
    replay0, out0, _ = _graphed_step(q, k, v, do, 0.0)
    replay0()
    first = out0.clone()
    replay0()
    assert torch.equal(first, out0)


def test_direct_launch_equals_tritons_own(monkeypatch):
    """A plan's second call launches the compiled kernel directly; with a launch hook installed
    every call goes through Triton's own path. Both give the same bits."""
    q, k, v = _qkv(requires_grad=False)
    first = kernels.attention(q, k, v)
    direct = kernels.attention(q, k, v)
    assert any(p.fwd is not None and p.fwd.step.direct is not None
               for p in kernels.plans.values() if hasattr(p, "fwd")), \
        "no plan kept its compiled kernel"
    monkeypatch.setattr(launch, "_hooks_installed", lambda: True)
    through_triton = kernels.attention(q, k, v)
    assert torch.equal(first, direct) and torch.equal(direct, through_triton)
