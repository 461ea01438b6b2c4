"""kernels.sdpa: our kernel as PyTorch SDPA's flash implementation (and its efficient one).

On CPU the registered implementation functions are called directly (the kernels run in Triton's
interpreter), or through ``torch.ops.aten`` with a CPU registration of ours (the efficient
op's autograd and compiled contracts), and compared with SDPA's math and the float64 oracle; the registry cycle is
checked through PyTorch's own API. On a GPU (marked tests) F.scaled_dot_product_attention is
shown to run our kernel once the implementation is active.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, GRAD_FACTOR, assert_parity, randn

import reference
from kernels import sdpa

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
needs_registry = pytest.mark.skipif(
    sdpa._torch_version() < sdpa.MIN_TORCH,
    reason=f"torch {torch.__version__} has no flash-attention registry (needs >= 2.10)")


def _qkv(b, h, hkv, lq, lk, d, dtype, requires_grad=False):
    return (randn(b, h, lq, d, dtype=dtype, requires_grad=requires_grad),
            randn(b, hkv, lk, d, dtype=dtype, requires_grad=requires_grad),
            randn(b, hkv, lk, d, dtype=dtype, requires_grad=requires_grad))


def _oracle(q, k, v, do, **kw):
    """(out, grads) of the float64 oracle and of PyTorch in the input dtype."""
    res = []
    for upcast in (True, False):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = reference.attention(*leaves, upcast=upcast, **kw)
        res.append((out, torch.autograd.grad(out, leaves, do.to(out.dtype))))
    return res


def _check(out, grads, q, k, v, do, **kw):
    (ref, ref_g), (lowp, lowp_g) = _oracle(q, k, v, do, **kw)
    assert_parity(out, ref, lowp)
    for name, g, r, lp in zip(("dq", "dk", "dv"), grads, ref_g, lowp_g):
        assert g.shape == r.shape
        assert_parity(g, r, lp, factor=GRAD_FACTOR, name=name,
                      extra=4 * torch.finfo(g.dtype).eps * r.abs().max().item())


@pytest.mark.parametrize("hkv,lq,lk,causal,scale,dtype", [
    (4, 33, 33, True, None, F16),
    (2, 40, 40, True, 0.3, BF16),        # enable_gqa: k/v with fewer heads
    (1, 17, 50, False, None, F32),
    (4, 50, 17, True, None, F16),        # non-square causal: bottom-right, as the aten op
], ids=["causal", "gqa-scale", "mqa-full", "causal-q>k"])
def test_sdpa_op_forward_backward(hkv, lq, lk, causal, scale, dtype):
    q, k, v = _qkv(2, 4, hkv, lq, lk, 32, dtype)
    do = randn(*q.shape, dtype=dtype)
    res = sdpa.sdpa_flash_forward(q, k, v, 0.0, causal, False, scale=scale)
    out, lse, _, _, max_q, max_k, rng_state, unused, _ = res
    assert (max_q, max_k) == (lq, lk) and lse.shape == (2, 4, lq) and lse.dtype == F32
    assert rng_state.dtype == torch.uint64 and rng_state.shape == (2,)
    grads = sdpa.sdpa_flash_backward(do, q, k, v, out, lse, None, None, lq, lk, 0.0, causal,
                                     rng_state, unused, scale=scale)
    _check(out, grads, q, k, v, do, causal=causal, softmax_scale=scale)
    if causal and lq == lk or not causal:
        # Where SDPA's own is_causal (top-left) agrees, its math matches too.
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                              is_causal=causal, scale=scale, enable_gqa=True)
        torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-2)


def test_sdpa_op_dropout_rng_contract():
    """The forward's rng_state reproduces its mask in the backward; torch.manual_seed makes the
    draw reproducible; the mask is reference.dropout_keep_mask of the seed in rng_state."""
    q, k, v = _qkv(1, 2, 2, 37, 37, 16, F16)
    do = randn(*q.shape, dtype=F16)
    torch.manual_seed(123)
    first = sdpa.sdpa_flash_forward(q, k, v, 0.25, True, False)
    torch.manual_seed(123)
    again = sdpa.sdpa_flash_forward(q, k, v, 0.25, True, False)
    assert torch.equal(first[0], again[0]) and torch.equal(first[6], again[6])
    other = sdpa.sdpa_flash_forward(q, k, v, 0.25, True, False)
    assert not torch.equal(first[0], other[0])
    out, lse, *_ = first
    rng_state, unused = first[6], first[7]
    seed = int(rng_state[0].item())
    grads = sdpa.sdpa_flash_backward(do, q, k, v, out, lse, None, None, 37, 37, 0.25, True,
                                     rng_state, unused)
    keep = reference.dropout_keep_mask(seed, 1, 2, 37, 37, 0.25, device=q.device)
    _check(out, grads, q, k, v, do, causal=True, dropout_p=0.25, keep_mask=keep)


@pytest.mark.parametrize("left,right,is_causal,window,causal", [
    (None, None, True, None, True),
    (-1, -1, False, None, False),
    (5, 0, False, 6, True),          # FA2's causal local window: our window = left + 1
    (7, None, True, 8, True),
], ids=["causal", "full", "local-left5", "causal-left7"])
def test_flash_op_dense_windows(left, right, is_causal, window, causal):
    """aten::_flash_attention_forward/backward in (batch, seq, heads, dim), non-square."""
    q, k, v = _qkv(2, 4, 2, 20, 29, 16, F32)
    do = randn(*q.shape)
    qs, ks, vs, dos = (t.transpose(1, 2) for t in (q, k, v, do))   # (B, S, H, D) views
    out, lse, rng_state, unused, _ = sdpa.flash_forward(
        qs, ks, vs, None, None, 20, 29, 0.0, is_causal, False, window_size_left=left,
        window_size_right=right)
    assert out.shape == qs.shape and lse.shape == (2, 4, 20)
    grads = sdpa.flash_backward(dos, qs, ks, vs, out, lse, None, None, 20, 29, 0.0, is_causal,
                                rng_state, unused, window_size_left=left,
                                window_size_right=right)
    _check(out.transpose(1, 2), [g.transpose(1, 2) for g in grads], q, k, v, do,
           causal=causal, window=window)


def test_flash_op_packed():
    """aten::_flash_attention_forward/backward with cum_seq_q/k: our packed layout, with
    dropout through the returned rng_state."""
    lens_q, lens_k = [5, 0, 12], [7, 3, 12]
    cu_q = torch.tensor([0, 5, 5, 17], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 7, 10, 22], dtype=torch.int32, device=DEVICE)
    q, k, v = randn(17, 4, 16), randn(22, 2, 16), randn(22, 2, 16)
    do = randn(17, 4, 16)
    out, lse, rng_state, unused, _ = sdpa.flash_forward(q, k, v, cu_q, cu_k, 12, 12, 0.2, True,
                                                        False)
    assert lse.shape == (4, 17)
    grads = sdpa.flash_backward(do, q, k, v, out, lse, cu_q, cu_k, 12, 12, 0.2, True, rng_state,
                                unused)
    seed = int(rng_state[0].item())
    keeps = reference.dropout_keep_mask_varlen(seed, cu_q, cu_k, 4, 0.2, device=DEVICE)
    res = []
    for upcast in (True, False):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = reference.attention_varlen(*leaves, cu_q, cu_k, dropout_p=0.2, keep_masks=keeps,
                                       upcast=upcast)
        res.append((o, torch.autograd.grad(o, leaves, do.to(o.dtype))))
    (ref, ref_g), (lowp, lowp_g) = res
    assert_parity(out, ref, lowp)
    for g, r, lp in zip(grads, ref_g, lowp_g):
        assert_parity(g, r, lp, factor=GRAD_FACTOR, extra=4 * 1.2e-7 * r.abs().max().item())
    assert sum(lens_q) == 17 and sum(lens_k) == 22


@pytest.mark.parametrize("kwargs,match", [
    (dict(return_debug_mask=True), "return_debug_mask"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    (dict(window_size_left=4, window_size_right=2), "window_size_right=2"),
    (dict(window_size_left=4, window_size_right=-1), "window_size_left=4"),
    (dict(num_splits=4), "num_splits=4"),
    (dict(seqused_k=torch.ones(2, dtype=torch.int32)), "seqused_k"),
], ids=["debug-mask", "alibi", "look-ahead", "bidirectional", "splits", "seqused_k"])
def test_flash_op_unsupported_raises(kwargs, match):
    q, k, v = (randn(2, 8, 4, 16) for _ in range(3))
    kw = dict(return_debug_mask=False, is_causal=False)
    kw.update(kwargs)
    with pytest.raises(RuntimeError, match=f"{sdpa.NAME}.*{match}.*not supported"):
        sdpa.flash_forward(q, k, v, None, None, 8, 8, 0.0, kw.pop("is_causal"),
                           kw.pop("return_debug_mask"), **kw)


# ------------------------------------------------------------------------------------------
# SDPA's memory-efficient op (the calls with an attn_mask): through aten and its autograd
# ------------------------------------------------------------------------------------------
_EFFICIENT = "_scaled_dot_product_efficient_attention"


@pytest.fixture
def efficient_impl():
    """Our efficient-op implementations registered for this test's device (on CPU, where
    PyTorch has no kernel of its own for these ops; SDPA's CPU path never calls them), so that
    ``torch.ops.aten`` calls, their autograd formula (derivatives.yaml: the broadcast bias's
    gradient summed by autograd) and torch.compile (Inductor asserts the meta functions'
    sizes and strides) run them as they would on a GPU once activated."""
    key = "CUDA" if DEVICE == "cuda" else "CPU"
    lib = torch.library.Library("aten", "IMPL", key)
    lib.impl(_EFFICIENT, sdpa.sdpa_efficient_forward, key)
    lib.impl(_EFFICIENT + "_backward", sdpa.sdpa_efficient_backward, key)
    yield getattr(torch.ops.aten, _EFFICIENT)
    lib._destroy()


def _bias_case(kind, b, h, lq, lk, dtype):
    """(bias or None as SDPA would pass it to the op, the leaf whose gradient is checked, the
    SDPA attn_mask the oracle takes)."""
    if kind == "broadcast":        # one (lq, lk) bias, expanded as SDPA's preprocess_mask does
        leaf = randn(1, 1, lq, lk, dtype=dtype, requires_grad=True)
        return leaf.expand(b, h, lq, lk), leaf, leaf
    if kind == "per-head":         # (b, h, lq, lk) with a padded last dim (SDPA's alignment)
        store = randn(b, h, lq, lk + 3, dtype=dtype)
        leaf = store[..., :lk].detach().requires_grad_()
        return leaf, leaf, leaf
    if kind == "bool":             # a key-padding bool mask, turned into 0 / -inf by SDPA
        keep = torch.ones(b, 1, 1, lk, dtype=torch.bool, device=DEVICE)
        keep[0, ..., lk - 5:] = False
        bias = torch.zeros(keep.shape, dtype=dtype, device=DEVICE).masked_fill(~keep,
                                                                             float("-inf"))
        return bias.expand(b, h, lq, lk), None, keep
    return None, None, None


def _check_against_sdpa_math(out, grads, leaves, do, mask_of):
    """The parity rule on ``out`` and ``grads`` (of ``leaves``: q, k, v[, a bias]) against SDPA's
    math in float64 and in the input dtype, its attn_mask ``mask_of(oracle's leaf copies)``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    refs = []
    for upcast in (True, False):
        ins = [(t.detach().double() if upcast else t.detach()).requires_grad_() for t in leaves]
        with sdpa_kernel(SDPBackend.MATH):
            o = F.scaled_dot_product_attention(*ins[:3], attn_mask=mask_of(ins))
        refs.append((o, torch.autograd.grad(o, ins, do.to(o.dtype))))
    (ref, ref_g), (low, low_g) = refs
    assert_parity(out, ref, low)
    for name, g, r, lp in zip(("dq", "dk", "dv", "dbias"), grads, ref_g, low_g):
        assert g.shape == r.shape
        assert_parity(g, r, lp, factor=GRAD_FACTOR, name=name,
                      extra=4 * torch.finfo(g.dtype).eps * r.abs().max().item())


@pytest.mark.parametrize("kind,lq,lk,causal,dtype", [
    ("broadcast", 40, 40, False, F32),
    ("per-head", 17, 33, False, BF16),
    ("bool", 33, 33, True, F16),         # SDPA never sends mask + is_causal; the op takes both
    ("none", 17, 40, True, F32),         # non-square is_causal: top-left in this op
    ("none", 40, 17, True, BF16),
], ids=["bias-broadcast", "bias-per-head", "bool-causal", "top-left-q<k", "top-left-q>k"])
def test_efficient_op_through_aten_autograd(efficient_impl, kind, lq, lk, causal, dtype):
    """out and every gradient (the bias's too) against SDPA's math in float64 and in the
    input dtype (the parity rule); the op's own shapes (lse padded to 32)."""
    b, h, d = 2, 3, 16
    q, k, v = _qkv(b, h, h, lq, lk, d, dtype, requires_grad=True)
    bias, leaf, mask = _bias_case(kind, b, h, lq, lk, dtype)
    out, lse, _, _ = efficient_impl(q, k, v, bias, True, 0.0, causal)
    assert lse.shape == (b, h, -(-lq // 32) * 32) and lse.dtype == F32
    assert out.transpose(1, 2).is_contiguous(), "(B, L, H, D) in memory, as the meta says"
    do = randn(*out.shape, dtype=dtype)
    leaves = (q, k, v) + ((leaf,) if leaf is not None else ())
    grads = torch.autograd.grad(out, leaves, do)
    tril = torch.ones(lq, lk, dtype=torch.bool, device=DEVICE).tril()   # top-left causal

    def mask_of(ins):
        m = ins[3] if leaf is not None else mask
        if causal:
            m = tril if m is None else m & tril
        return m

    _check_against_sdpa_math(out, grads, leaves, do, mask_of)


def test_efficient_op_compiled(efficient_impl):
    """Under torch.compile (fullgraph) Inductor checks the op's outputs against its meta
    functions (sizes and strides, the backward's too) and gets the eager results."""
    q, k, v = _qkv(2, 3, 3, 20, 20, 16, F32, requires_grad=True)
    leaf = randn(1, 1, 20, 20, requires_grad=True)

    def f(q, k, v, leaf):
        out = efficient_impl(q, k, v, leaf.expand(2, 3, 20, 20), True, 0.0, False)[0]
        return (out.transpose(1, 2).reshape(2, 20, 48) * 2).sum()

    eager = torch.autograd.grad(f(q, k, v, leaf), (q, k, v, leaf))
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v, leaf),
                                   (q, k, v, leaf))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_efficient_op_dropout_and_lse_contract(efficient_impl):
    """The returned philox seed reproduces the forward's dropout mask in the backward
    (reference.dropout_keep_mask of that seed); torch.manual_seed makes it reproducible;
    without compute_log_sumexp the lse is (B, H, 0)."""
    q, k, v = _qkv(1, 2, 2, 37, 37, 16, F16)
    do = randn(*q.shape, dtype=F16)
    torch.manual_seed(7)
    out, lse, seed, offset = sdpa.sdpa_efficient_forward(q, k, v, None, True, 0.25, True)
    torch.manual_seed(7)
    assert torch.equal(out, sdpa.sdpa_efficient_forward(q, k, v, None, True, 0.25, True)[0])
    assert seed.shape == offset.shape == () and seed.dtype == torch.int64
    grads = sdpa.sdpa_efficient_backward(do, q, k, v, None, out, lse, seed, offset, 0.25,
                                         [True, True, True, False], True)
    assert grads[3] is None
    keep = reference.dropout_keep_mask(int(seed), 1, 2, 37, 37, 0.25, device=q.device)
    _check(out, grads[:3], q, k, v, do, causal=True, dropout_p=0.25, keep_mask=keep)
    assert sdpa.sdpa_efficient_forward(q, k, v, None, False, 0.0, True)[1].shape == (1, 2, 0)


def test_efficient_op_refuses_what_it_cannot_honour():
    q, k, v = _qkv(1, 2, 2, 8, 12, 16, F32)
    with pytest.raises(RuntimeError, match=f"{sdpa.NAME}.*q_len 8 != k_len 12.*attn_bias"):
        sdpa.sdpa_efficient_forward(q, k, v, randn(8, 12), False, 0.0, True)


@needs_registry
def test_registry_cycle():
    """register() adds the name and activates nothing; activation gives the flash ops a CUDA
    kernel (ours), restore puts back what was there. What was there depends on the build, not
    on the machine: a CPU build of torch has no CUDA kernels of its own, a CUDA build has
    PyTorch's flash kernels registered even on a machine without a GPU (the build a plain
    ``pip install torch`` gives on a CPU-only Linux machine)."""
    from torch.nn import attention as nna
    before = sdpa.overridden_ops()
    present = [op for op in sdpa._OPS if hasattr(torch.ops.aten, op)]
    if torch.backends.cuda.is_built():
        assert before == present, f"a CUDA build registers PyTorch's own flash kernels: " \
                                  f"expected {present}, got {before}"
    else:
        assert before == [], f"a CPU build has no CUDA kernels of its own, got {before}"
    sdpa.register()
    assert sdpa.NAME in nna.list_flash_attention_impls()
    assert nna.current_flash_attention_impl() is None and sdpa.overridden_ops() == before
    try:
        nna.activate_flash_attention_impl(sdpa.NAME)
        assert nna.current_flash_attention_impl() == sdpa.NAME
        assert set(sdpa.overridden_ops()) == {op for op in sdpa._OPS
                                              if hasattr(torch.ops.aten, op)}
    finally:
        nna.restore_flash_attention_impl()
    assert nna.current_flash_attention_impl() is None
    assert sdpa.overridden_ops() == before


def test_register_on_old_torch_names_the_version(monkeypatch):
    import torch.nn.attention as nna
    monkeypatch.delattr(nna, "register_flash_attention_impl", raising=False)
    with pytest.raises(RuntimeError, match=r"torch >= 2\.10"):
        sdpa.register()


# ------------------------------------------------------------------------------------------
# GPU: F.scaled_dot_product_attention runs our kernel once the impl is active
# ------------------------------------------------------------------------------------------
@pytest.fixture
def active_impl():
    from torch.nn import attention as nna
    sdpa.register()
    nna.activate_flash_attention_impl(sdpa.NAME)
    yield
    nna.restore_flash_attention_impl()


def _ran_our_kernel(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    return result, any("_attn_fwd" in n for n in names), any("_bwd_dkdv" in n for n in names)


@pytest.mark.gpu
@needs_registry
@pytest.mark.parametrize("dropout_p,compiled", [(0.0, False), (0.1, False), (0.0, True)])
def test_sdpa_runs_our_kernel_gpu(active_impl, dropout_p, compiled):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = _qkv(2, 8, 2, 512, 512, 64, BF16, requires_grad=True)
    do = randn(*q.shape, dtype=BF16)

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            f = F.scaled_dot_product_attention
            if compiled:
                f = torch.compile(f, fullgraph=True)
            out = f(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=True)
            return out, torch.autograd.grad(out, (q, k, v), do)

    torch.manual_seed(0)
    (out, grads), fwd_ours, bwd_ours = _ran_our_kernel(run)
    assert fwd_ours and bwd_ours
    if dropout_p == 0.0:
        _check(out, grads, q, k, v, do, causal=True)
    else:
        torch.manual_seed(0)
        (again, grads2), _, _ = _ran_our_kernel(run)
        assert torch.equal(out, again) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    assert math.isfinite(out.float().sum().item())


@pytest.mark.gpu
@needs_registry
def test_sdpa_with_a_mask_runs_our_kernel_gpu(active_impl):
    """A masked SDPA call goes to the efficient op, which is ours once active: a bool
    key-padding mask (SDPA turns it into an additive bias) and a float bias with a gradient."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = _qkv(2, 8, 8, 300, 300, 64, BF16, requires_grad=True)
    keep = torch.ones(2, 1, 1, 300, dtype=torch.bool, device=DEVICE)
    keep[1, ..., 250:] = False
    leaf = randn(1, 8, 300, 300, dtype=BF16, requires_grad=True)
    do = randn(*q.shape, dtype=BF16)
    for mask in (keep, leaf):
        def run():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                leaves = (q, k, v) + ((leaf,) if mask is leaf else ())
                return out, torch.autograd.grad(out, leaves, do)

        (out, grads), fwd_ours, bwd_ours = _ran_our_kernel(run)
        assert fwd_ours and bwd_ours
        _check_against_sdpa_math(out, grads, (q, k, v) + ((leaf,) if mask is leaf else ()), do,
                                 lambda ins: ins[3] if mask is leaf else keep)
