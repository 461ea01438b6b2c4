"""Every route, every memory layout: property-based parity (hypothesis, derandomized: the same
examples on every run, so CI cannot flake), then pinned cases of the silent wrong answers and
crashes a new user found (strided inputs and NaN rows on the CPU fallback, heads = 0, the
KV-cache backward, the fallback warning's line).

Routes: the kernel (Triton's interpreter on CPU, as everywhere in the tests; the compiled kernel
on CUDA) and the PyTorch fallback (CPU tensors with the interpreter off, reached as a user
reaches it: TRITON_INTERPRET=0 at call time; both of its paths, PyTorch's CPU flash attention
and the blockwise one), each through ``kernels.attention``, ``kernels.attention_varlen``,
``kernels.attention_with_kvcache`` and the drop-in module ``FusedMultiHeadAttention``.

Drawn: lengths (1, 3, 16, 17, and 0 for packed sequences), head_dim (1, 16, 17), grouped-query
heads, causal / sliding window / none with q_len != k_len, dropout, dtypes, a NaN in one query
row, and the memory layout of every input (``LAYOUTS``). Checked:

* the parity rule against the float64 oracle (``reference``; dropout through
  ``reference.dropout_keep_mask``), with NaN exactly where the oracle has NaN: a NaN in a query
  row gives a NaN output row, on every route;
* the same call on ``.contiguous()`` copies of the inputs gives the same output and gradients:
  bit for bit on the kernel route; within the parity budget on the fallback and module routes,
  whose matmuls are PyTorch's (their summation order may follow the strides).

Pinned after them: the fallback's fast path on non-unit head_dim strides, a NaN query row with
fewer than 16 keys, heads = 0, the forward-only KV cache's backward, the fallback warning's line.
"""
import contextlib
import copy
import math
import os

import pytest
import torch
from helpers import DEVICE, GRAD_FACTOR, OUT_FACTOR, assert_parity, fa2_oracle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernels
import reference
from kernels import ops
from kernels.core import backend
from kernels.core import fallback
from kernels.core.call import AttentionCall
from reference.parity import parity_budget

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

# How a caller's tensor can sit in memory (see _make).
LAYOUTS = ("contiguous", "transposed", "last_stride", "dim_major", "expand_batch",
           "expand_heads", "offset")
PACKED_LAYOUTS = tuple(x for x in LAYOUTS if x != "expand_batch")
CACHE_LAYOUTS = ("contiguous", "transposed", "offset")   # written in place: unit head_dim stride

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# A NaN query row makes the interpreter's numpy reductions warn; the results are checked.
pytestmark = [pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _make(shape, dtype, layout, *, head_axis=1, seq_axis=2):
    """A standard-normal tensor of logical ``shape`` laid out in memory as ``layout``:

    contiguous; transposed (``head_axis`` and ``seq_axis`` swapped in memory: heads split off a
    (batch, seq, heads, dim) projection); last_stride (every other element of a wider tensor:
    head_dim stride 2); dim_major (head_dim outermost in memory); expand_batch / expand_heads
    (stride 0 over dim 0 / ``head_axis``); offset (a view at an offset into a larger storage,
    with padded rows).

    It is a view of a leaf that requires grad (or the leaf itself), so gradients can be taken
    with respect to it."""
    shape = tuple(shape)
    d = shape[-1]
    if layout == "contiguous":
        return _randn(shape, dtype).requires_grad_()
    if layout == "transposed":
        perm = list(range(len(shape)))
        perm[head_axis], perm[seq_axis] = seq_axis, head_axis
        return _randn([shape[i] for i in perm], dtype).requires_grad_().permute(perm)
    if layout == "last_stride":
        return _randn((*shape[:-1], 2 * d), dtype).requires_grad_()[..., 1::2]
    if layout == "dim_major":
        return _randn((d, *shape[:-1]), dtype).requires_grad_().movedim(0, -1)
    if layout in ("expand_batch", "expand_heads"):
        axis = 0 if layout == "expand_batch" else head_axis
        small = list(shape)
        small[axis] = min(1, shape[axis])
        return _randn(small, dtype).requires_grad_().expand(shape)
    if layout == "offset":
        rows = math.prod(shape[:-1])
        base = _randn((rows * (d + 3) + 5,), dtype).requires_grad_()
        return base[5:].view(*shape[:-1], d + 3)[..., 1:1 + d]
    raise AssertionError(layout)


def _randn(shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _contiguous(*ts):
    """Dense copies of the inputs, as fresh leaves."""
    return [None if t is None else t.detach().contiguous().requires_grad_(t.requires_grad)
            for t in ts]


def _with_nan_row(x, row, seq_axis):
    """``x`` (made by _make) with element 0 of query row ``row`` set to NaN in every batch and
    head, written in place so the layout is kept (an expanded view: into what it expands)."""
    expanded = any(s == 0 and n > 1 for s, n in zip(x.stride(), x.shape))
    target = x._base if expanded else x
    with torch.no_grad():
        target.select(seq_axis, row)[..., 0] = float("nan")
    return x


@contextlib.contextmanager
def _backend(name):
    """``kernel``: as the tests run (the interpreter on CPU); ``fallback``: the interpreter off
    for the duration (kernels read TRITON_INTERPRET at each call), as a user without it."""
    if name == "kernel":
        yield
        return
    saved_env, saved_warned = os.environ.get("TRITON_INTERPRET"), backend._warned_fallback
    os.environ["TRITON_INTERPRET"] = "0"
    backend._warned_fallback = True
    try:
        yield
    finally:
        backend._warned_fallback = saved_warned
        if saved_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved_env


def _same(got, want, name):
    """Bit for bit, NaN where ``want`` has NaN."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"{name}: not the result of the same call on "
                                             f"contiguous copies: {m}")


def _same_call(backend, got, want, ref, lowp, name, factor=OUT_FACTOR):
    """``got`` (strided inputs) vs ``want`` (the same call on contiguous copies): bit for bit on
    the kernel route, which reads every layout in place with the same arithmetic; within the
    parity budget elsewhere (the fallback's and the module's matmuls are PyTorch's, whose
    summation order may follow the strides)."""
    if backend == "kernel":
        _same(got, want, name)
        return
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{name}: NaN elsewhere than on contiguous copies"
    if got.numel() == 0 or ref.isnan().all():
        return
    ok = ~ref.isnan()
    _, budget = parity_budget(want[ok], ref[ok], lowp[ok], factor=factor)
    diff = (got[ok].double() - want[ok].double()).abs().max().item()
    assert diff <= budget, (f"{name}: differs from the same call on contiguous copies by "
                            f"{diff:.3e}, more than the parity budget {budget:.3e}")


def _check_out(out, ref, lowp, name="output", factor=OUT_FACTOR):
    """Parity with the oracle; NaN exactly where the oracle has NaN (a NaN query row)."""
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan), (
        f"{name}: NaN at {out.isnan().sum().item()} elements, expected them where the oracle "
        f"has them ({nan.sum().item()} elements: NaN in, NaN out for a row with a NaN query)")
    assert_parity(out.masked_fill(nan, 0), ref.masked_fill(nan, 0),
                  lowp.masked_fill(lowp.isnan(), 0), name=name, factor=factor)


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do.to(out.dtype))


def _check_grads(grads, ref_grads, lowp_grads, extras):
    for name, g, r, lp, e in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads, extras):
        assert_parity(g, r, lp, factor=GRAD_FACTOR, extra=e, name=name)


def _fa2_extras(q, k, v, do, out, lse, ref_grads, **kw):
    """The FA-2 allowances of helpers.fa2_oracle for one dense problem (see there)."""
    given_o, noise = fa2_oracle(q.detach(), k.detach(), v.detach(), do, out.detach(), lse,
                                **kw)
    return [((e - r).abs().max().item() if r.numel() else 0.0) + n
            for e, r, n in zip(given_o, ref_grads, noise)]


# Examples per route (kernel, fallback), and shapes kept small: on CPU the kernel route runs in
# Triton's interpreter, one grid program after another; the fallback is plain PyTorch.
EXAMPLES = {"dense": (15, 40), "varlen": (12, 30), "kvcache": (15, 30), "module": (6, 15)}
LEN = st.sampled_from([1, 3, 16, 17])
HEAD_DIM = st.sampled_from([1, 16, 17])
HEADS = st.sampled_from([(1, 1), (2, 1), (2, 2)])      # (heads_q, heads_kv)
DTYPE = st.sampled_from([F16, BF16, F32])
MASK = st.sampled_from(["none", "causal", "window"])


def _mask(mask, window):
    return mask != "none", (window if mask == "window" else None)


# ------------------------------------------------------------------------------------------
# kernels.attention
# ------------------------------------------------------------------------------------------
DENSE = dict(b=st.integers(1, 2), heads=HEADS, q_len=LEN, k_len=LEN, d=HEAD_DIM, mask=MASK,
             window=st.integers(1, 6), dropout_p=st.sampled_from([0.0, 0.0, 0.3]), dtype=DTYPE,
             layouts=st.tuples(*[st.sampled_from(LAYOUTS)] * 4), nan_row=st.booleans())


def _dense_case(backend, b, heads, q_len, k_len, d, mask, window, dropout_p, dtype, layouts,
                nan_row):
    (hq, hkv), (causal, window) = heads, _mask(mask, window)
    q = _make((b, hq, q_len, d), dtype, layouts[0])
    k, v = (_make((b, hkv, k_len, d), dtype, lay) for lay in layouts[1:3])
    do = _make((b, hq, q_len, d), dtype, layouts[3]).detach()
    if nan_row:
        q = _with_nan_row(q, q_len // 2, 2)
    seed = 1000 * q_len + k_len
    kw = dict(causal=causal, window=window, dropout_p=dropout_p)
    qc, kc, vc = _contiguous(q, k, v)
    with _backend(backend):
        out, lse = kernels.attention(q, k, v, seed=seed, return_lse=True, **kw)
        out_c = kernels.attention(qc, kc, vc, seed=seed, **kw)
        if not nan_row:   # (gradients through a NaN row are NaN wherever it reaches)
            grads = _grads(out, (q, k, v), do)
            grads_c = _grads(out_c, (qc, kc, vc), do.contiguous())

    keep = None
    if dropout_p > 0:
        keep = reference.dropout_keep_mask(seed, b, hq, q_len, k_len, dropout_p, device=DEVICE)
    leaves = _contiguous(q, k, v)
    ref = reference.attention(*leaves, upcast=True, keep_mask=keep, **kw)
    lowp = reference.attention(*leaves, upcast=False, keep_mask=keep, **kw)
    _check_out(out, ref, lowp)
    _same_call(backend, out, out_c, ref, lowp, "output")
    if nan_row:
        return
    ref_grads, lowp_grads = _grads(ref, leaves, do), _grads(lowp, leaves, do)
    extras = _fa2_extras(q, k, v, do, out, lse, ref_grads, causal=causal, window=window,
                         softmax_scale=1 / math.sqrt(d), dropout_p=dropout_p, keep_mask=keep)
    _check_grads(grads, ref_grads, lowp_grads, extras)
    for name, g, g_c, r, lp in zip(("dq", "dk", "dv"), grads, grads_c, ref_grads, lowp_grads):
        _same_call(backend, g, g_c, r, lp, name, factor=GRAD_FACTOR)


@settings(max_examples=EXAMPLES["dense"][0], **SETTINGS)
@given(**DENSE)
def test_dense_kernel(**case):
    _dense_case("kernel", **case)


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
@settings(max_examples=EXAMPLES["dense"][1], **SETTINGS)
@given(**DENSE)
def test_dense_fallback(**case):
    _dense_case("fallback", **case)


# ------------------------------------------------------------------------------------------
# kernels.attention_varlen
# ------------------------------------------------------------------------------------------
def _cu(lengths):
    return torch.tensor([0] + list(lengths), device=DEVICE).cumsum(0).to(torch.int32)


def _seq(x, cu, s):
    """Rows of sequence s of a packed (total, heads, d) tensor as (1, heads, len, d)."""
    return x[cu[s]:cu[s + 1]].transpose(0, 1).unsqueeze(0)


PACKED_LEN = st.sampled_from([0, 1, 5, 17])
VARLEN = dict(lens=st.lists(st.tuples(PACKED_LEN, PACKED_LEN), min_size=1, max_size=2),
              heads=HEADS, d=HEAD_DIM, mask=MASK, window=st.integers(1, 6),
              dropout_p=st.sampled_from([0.0, 0.3]), dtype=DTYPE,
              layouts=st.tuples(*[st.sampled_from(PACKED_LAYOUTS)] * 4), nan_row=st.booleans())


def _varlen_case(backend, lens, heads, d, mask, window, dropout_p, dtype, layouts, nan_row):
    (hq, hkv), (causal, window) = heads, _mask(mask, window)
    lens_q, lens_k = [n for n, _ in lens], [n for _, n in lens]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    total_q, total_k = sum(lens_q), sum(lens_k)
    nan_row = nan_row and total_q > 0
    packed = dict(head_axis=1, seq_axis=0)
    q = _make((total_q, hq, d), dtype, layouts[0], **packed)
    k, v = (_make((total_k, hkv, d), dtype, lay, **packed) for lay in layouts[1:3])
    do = _make((total_q, hq, d), dtype, layouts[3], **packed).detach()
    if nan_row:
        q = _with_nan_row(q, total_q // 2, 0)
    seed = 7 + total_q
    kw = dict(causal=causal, window=window, dropout_p=dropout_p)
    qc, kc, vc = _contiguous(q, k, v)
    with _backend(backend):
        out, lse = kernels.attention_varlen(q, k, v, cu_q, cu_k, seed=seed, return_lse=True,
                                            **kw)
        out_c = kernels.attention_varlen(qc, kc, vc, cu_q, cu_k, seed=seed, **kw)
        if not nan_row:
            grads = _grads(out, (q, k, v), do)
            grads_c = _grads(out_c, (qc, kc, vc), do.contiguous())

    keeps = None
    if dropout_p > 0:
        keeps = reference.dropout_keep_mask_varlen(seed, cu_q, cu_k, hq, dropout_p,
                                                   device=DEVICE)
    leaves = _contiguous(q, k, v)
    ref = reference.attention_varlen(*leaves, cu_q, cu_k, upcast=True, keep_masks=keeps, **kw)
    lowp = reference.attention_varlen(*leaves, cu_q, cu_k, upcast=False, keep_masks=keeps,
                                      **kw)
    _check_out(out, ref, lowp)
    _same_call(backend, out, out_c, ref, lowp, "output")
    if nan_row:
        return
    ref_grads, lowp_grads = _grads(ref, leaves, do), _grads(lowp, leaves, do)
    extras = [0.0, 0.0, 0.0]   # the FA-2 allowance, sequence by sequence
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for s in range(len(lens)):
        if lens_q[s] == 0 or lens_k[s] == 0:
            continue
        seq = [_seq(t.detach(), c, s) for t, c in ((q, cq), (k, ck), (v, ck))]
        seq_grads = [_seq(r, c, s) for r, c in zip(ref_grads, (cq, ck, ck))]
        e = _fa2_extras(*seq, _seq(do, cq, s), _seq(out, cq, s),
                        lse[:, cq[s]:cq[s + 1]].unsqueeze(0), seq_grads, causal=causal,
                        window=window, softmax_scale=1 / math.sqrt(d), dropout_p=dropout_p,
                        keep_mask=None if keeps is None else keeps[s][None])
        extras = [max(a, x) for a, x in zip(extras, e)]
    _check_grads(grads, ref_grads, lowp_grads, extras)
    for name, g, g_c, r, lp in zip(("dq", "dk", "dv"), grads, grads_c, ref_grads, lowp_grads):
        _same_call(backend, g, g_c, r, lp, name, factor=GRAD_FACTOR)


@settings(max_examples=EXAMPLES["varlen"][0], **SETTINGS)
@given(**VARLEN)
def test_varlen_kernel(**case):
    _varlen_case("kernel", **case)


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
@settings(max_examples=EXAMPLES["varlen"][1], **SETTINGS)
@given(**VARLEN)
def test_varlen_fallback(**case):
    _varlen_case("fallback", **case)


# ------------------------------------------------------------------------------------------
# kernels.attention_with_kvcache (forward only)
# ------------------------------------------------------------------------------------------
KVCACHE = dict(b=st.integers(1, 2), heads=HEADS, q_len=st.sampled_from([1, 2, 5]), d=HEAD_DIM,
               mask=MASK, window=st.integers(1, 6), append=st.booleans(), dtype=DTYPE,
               fill=st.lists(st.integers(0, 15), min_size=2, max_size=2),
               layouts=st.tuples(*[st.sampled_from(LAYOUTS)] * 3),
               cache_layout=st.sampled_from(CACHE_LAYOUTS), nan_row=st.booleans())


def _kvcache_case(backend, b, heads, q_len, d, mask, window, append, dtype, fill, layouts,
                  cache_layout, nan_row):
    (hq, hkv), (causal, window), max_len = heads, _mask(mask, window), 20
    lens = torch.tensor(fill[:b], dtype=torch.int32, device=DEVICE)
    q = _make((b, hq, q_len, d), dtype, layouts[0])
    if nan_row:
        q = _with_nan_row(q, q_len - 1, 2)
    q = q.detach()
    k = v = None
    if append:
        k, v = (_make((b, hkv, q_len, d), dtype, lay).detach() for lay in layouts[1:])
    k_cache, v_cache = (_make((b, hkv, max_len, d), dtype, cache_layout).detach()
                        for _ in range(2))
    before = [t.clone() for t in (k_cache, v_cache)]
    caches_c = [t.contiguous() for t in before]
    kw = dict(causal=causal, window=window)
    with _backend(backend):
        out = kernels.attention_with_kvcache(q, k_cache, v_cache, lens, k, v, **kw)
        out_c = kernels.attention_with_kvcache(*_contiguous(q), *caches_c, lens,
                                               *_contiguous(k, v), **kw)

    ref_caches, lowp_caches = ([t.clone() for t in before] for _ in range(2))
    ref = reference.attention_with_kvcache(q, *ref_caches, lens, k, v, upcast=True, **kw)
    lowp = reference.attention_with_kvcache(q, *lowp_caches, lens, k, v, upcast=False, **kw)
    _check_out(out, ref, lowp)
    _same_call(backend, out, out_c, ref, lowp, "output")
    for name, got, c, want in zip(("k_cache", "v_cache"), (k_cache, v_cache), caches_c,
                                  ref_caches):
        assert torch.equal(got, want), f"{name}: not the oracle's cache after the append"
        assert torch.equal(c, want), f"{name} (contiguous copy): not the oracle's cache"


@settings(max_examples=EXAMPLES["kvcache"][0], **SETTINGS)
@given(**KVCACHE)
def test_kvcache_kernel(**case):
    _kvcache_case("kernel", **case)


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
@settings(max_examples=EXAMPLES["kvcache"][1], **SETTINGS)
@given(**KVCACHE)
def test_kvcache_fallback(**case):
    _kvcache_case("fallback", **case)


# ------------------------------------------------------------------------------------------
# The drop-in module (its strided head split reaches kernels.attention as views)
# ------------------------------------------------------------------------------------------
def _module_math(ref, x, keep, dropout_p, upcast):
    """reference.MultiHeadAttention's forward with reference.attention as its core (so the
    kernel's dropout mask can be applied)."""
    b, n, _ = x.shape
    H, hd = ref.num_heads, ref.head_dim
    q, k, v = (lin(x).view(b, n, H, hd).transpose(1, 2)
               for lin in (ref.W_query, ref.W_key, ref.W_value))
    o = reference.attention(q, k, v, causal=True, dropout_p=dropout_p, keep_mask=keep,
                            upcast=upcast).to(q.dtype)
    return ref.out_proj(o.transpose(1, 2).reshape(b, n, ref.d_out))


MODULE = dict(b=st.integers(1, 2), n=LEN, heads=st.sampled_from([1, 2]),
              head_dim=st.sampled_from([8, 16]), dropout_p=st.sampled_from([0.0, 0.3]),
              dtype=st.sampled_from([F32, BF16]), layout=st.sampled_from(LAYOUTS))


def _module_case(backend, b, n, heads, head_dim, dropout_p, dtype, layout):
    d_in, d_out = 12, heads * head_dim
    ref = reference.MultiHeadAttention(d_in, d_out, 17, dropout_p, heads).to(DEVICE)
    fused = kernels.FusedMultiHeadAttention(d_in, d_out, 17, dropout_p, heads).to(DEVICE)
    fused.load_state_dict(ref.state_dict())
    ref, fused = ref.to(dtype).train(dropout_p > 0), fused.to(dtype).train(dropout_p > 0)
    oracle = copy.deepcopy(ref).double()
    # x (b, n, d_in): "transposed" swaps batch and tokens in memory; both expand_* expand b.
    x = _make((b, n, d_in), dtype, layout, head_axis=0, seq_axis=1)
    x_c = _contiguous(x)[0]
    cot = _randn((b, n, d_out), dtype)
    with _backend(backend):
        torch.manual_seed(5)
        out = fused(x)
        torch.manual_seed(5)
        out_c = fused(x_c)
        (dx,), (dx_c,) = _grads(out, (x,), cot), _grads(out_c, (x_c,), cot)

    keep = None
    if dropout_p > 0:
        torch.manual_seed(5)   # the seed kernels.attention(seed=None) draws after it
        seed = torch.randint(0, ops.SEED_LIMIT - 1, (), dtype=torch.int64).item()
        keep = reference.dropout_keep_mask(seed, b, heads, n, n, dropout_p, device=DEVICE)
    x64, x_lp = x.detach().double().requires_grad_(), x.detach().clone().requires_grad_()
    want = _module_math(oracle, x64, keep, dropout_p, True)
    base = _module_math(ref, x_lp, keep, dropout_p, False)
    (dx_want,), (dx_base,) = _grads(want, (x64,), cot), _grads(base, (x_lp,), cot)
    _check_out(out, want, base)
    _check_out(dx, dx_want, dx_base, name="dx", factor=GRAD_FACTOR)
    # Not bit for bit even on the kernel route: the projections are PyTorch matmuls.
    _same_call("module", out, out_c, want, base, "output")
    _same_call("module", dx, dx_c, dx_want, dx_base, "dx", factor=GRAD_FACTOR)


@settings(max_examples=EXAMPLES["module"][0], **SETTINGS)
@given(**MODULE)
def test_module_kernel(**case):
    _module_case("kernel", **case)


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
@settings(max_examples=EXAMPLES["module"][1], **SETTINGS)
@given(**MODULE)
def test_module_fallback(**case):
    _module_case("fallback", **case)


# ------------------------------------------------------------------------------------------
# Pinned cases: the silent wrong answers and crashes a new user found, route by route
# ------------------------------------------------------------------------------------------
@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
@pytest.mark.parametrize("layout", ["last_stride", "dim_major"])
@pytest.mark.parametrize("causal", [True, False])
def test_fallback_flash_path_non_unit_head_dim_stride(layout, causal):
    """The fallback's fast path (PyTorch's CPU flash attention: square, no dropout, no window)
    on q, k, v whose head_dim is not unit-stride: its output was off by 1.7 to 3.9 and its
    gradients by up to 4.4 (the aten op reads each row as a contiguous vector)."""
    q, k, v = (_make((2, 3, 20, 16), F32, layout) for _ in range(3))
    assert fallback._sdpa_applies(q, k, None, AttentionCall(causal, 1.0))
    do = _randn((2, 3, 20, 16), F32)
    qc, kc, vc = _contiguous(q, k, v)
    with _backend("fallback"):
        out = kernels.attention(q, k, v, causal=causal)
        out_c = kernels.attention(qc, kc, vc, causal=causal)
        grads, grads_c = _grads(out, (q, k, v), do), _grads(out_c, (qc, kc, vc), do)
    leaves = _contiguous(q, k, v)
    ref = reference.attention(*leaves, causal=causal)
    lowp = reference.attention(*leaves, causal=causal, upcast=False)
    _check_out(out, ref, lowp)
    _same(out, out_c, "output")
    for name, g, g_c in zip(("dq", "dk", "dv"), grads, grads_c):
        _same(g, g_c, name)


ROUTES = [("dense", "kernel"), ("dense", "fallback"), ("dense-rect", "fallback"),
          ("varlen", "kernel"), ("varlen", "fallback"), ("kvcache", "kernel"),
          ("kvcache", "fallback")]
ROUTES = [r for r in ROUTES if DEVICE == "cpu" or r[1] == "kernel"]


@pytest.mark.parametrize("route,backend", ROUTES, ids=["-".join(r) for r in ROUTES])
@pytest.mark.parametrize("k_len", [5, 16])
def test_nan_query_row_gives_nan_row(route, backend, k_len):
    """One NaN in one query row: that row of the output (and of lse) is NaN, every other row is
    the oracle's, on every route. The fallback's fast path returned a row of zeros with lse 0
    when k_len < 16 (PyTorch's CPU flash attention drops all-NaN score rows there)."""
    q_len = k_len if route != "dense-rect" else k_len + 2
    q, k, v = (_randn((2, 2, n, 16), F32) for n in (q_len, k_len, k_len))
    q[1, 0, q_len - 1, 3] = float("nan")   # the last row: it sees every key, causal or not
    kw = dict(causal=route != "dense")
    with _backend(backend):
        if route.startswith("dense"):
            if backend == "fallback":
                fast = fallback._sdpa_applies(q.nan_to_num(), k, None,
                                              AttentionCall(kw["causal"], 1.0))
                assert fast == (route == "dense")
            out, lse = kernels.attention(q, k, v, return_lse=True, **kw)
            ref = reference.attention(q, k, v, **kw)
            lowp = reference.attention(q, k, v, upcast=False, **kw)
        elif route == "varlen":
            packed = [x.transpose(1, 2).reshape(-1, 2, 16) for x in (q, k, v)]
            cu_q, cu_k = _cu([q_len, q_len]), _cu([k_len, k_len])
            out, lse = kernels.attention_varlen(*packed, cu_q, cu_k, return_lse=True, **kw)
            ref = reference.attention_varlen(*packed, cu_q, cu_k, **kw)
            lowp = reference.attention_varlen(*packed, cu_q, cu_k, upcast=False, **kw)
            out, ref, lowp = (x.view(2, q_len, 2, 16).transpose(1, 2) for x in (out, ref, lowp))
            lse = lse.view(2, 2, q_len).transpose(0, 1)
        else:
            k_cache, v_cache = (torch.cat([x, torch.zeros_like(x)], 2) for x in (k, v))
            lens = torch.full((2,), k_len, dtype=torch.int32, device=DEVICE)
            out, lse = kernels.attention_with_kvcache(q, k_cache, v_cache, lens,
                                                      return_lse=True, **kw)
            ref = reference.attention(q, k, v, **kw)
            lowp = reference.attention(q, k, v, upcast=False, **kw)
    assert out[1, 0, q_len - 1].isnan().all(), f"the NaN row came back as {out[1, 0, -1]}"
    assert lse[1, 0, q_len - 1].isnan(), f"its lse came back as {lse[1, 0, -1].item()}"
    _check_out(out, ref, lowp)


# ------------------------------------------------------------------------------------------
# heads = 0: an empty problem on every route, like batch = 0 or q_len = 0
# ------------------------------------------------------------------------------------------
BACKENDS = ["kernel", "fallback"] if DEVICE == "cpu" else ["kernel"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", [dict(), dict(causal=False), dict(dropout_p=0.2, seed=3),
                                dict(window=2)], ids=["causal", "full", "dropout", "window"])
@pytest.mark.parametrize("heads_kv", [0, 2])
def test_zero_heads_dense_and_varlen(backend, kw, heads_kv):
    """q with 0 heads gives an empty output and lse (and zero gradients for k, v, whatever
    their head count): it raised ZeroDivisionError (fallback) or AssertionError (packed)."""
    q = _randn((1, 0, 8, 16), F32).requires_grad_()
    k, v = (_randn((1, heads_kv, 8, 16), F32).requires_grad_() for _ in range(2))
    qp, kp, vp = (x.detach()[0].transpose(0, 1).requires_grad_() for x in (q, k, v))
    cu = _cu([3, 5])
    with _backend(backend):
        out, lse = kernels.attention(q, k, v, return_lse=True, **kw)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        out_p, lse_p = kernels.attention_varlen(qp, kp, vp, cu, cu, return_lse=True, **kw)
        grads_p = torch.autograd.grad(out_p.sum(), (qp, kp, vp))
    assert out.shape == (1, 0, 8, 16) and lse.shape == (1, 0, 8)
    assert out_p.shape == (8, 0, 16) and lse_p.shape == (0, 8)
    for g, x in zip(grads + grads_p, (q, k, v, qp, kp, vp)):
        assert g.shape == x.shape and not g.any(), "gradients of a 0-head call must be 0"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("append", [False, True])
def test_zero_heads_kvcache(backend, append):
    q = _randn((2, 0, 3, 16), F32)
    k_cache, v_cache = (_randn((2, 0, 10, 16), F32) for _ in range(2))
    k, v = (_randn((2, 0, 3, 16), F32) for _ in range(2)) if append else (None, None)
    lens = torch.tensor([2, 4], dtype=torch.int32, device=DEVICE)
    with _backend(backend):
        out, lse = kernels.attention_with_kvcache(q, k_cache, v_cache, lens, k, v,
                                                  return_lse=True)
    assert out.shape == (2, 0, 3, 16) and lse.shape == (2, 0, 3)


@pytest.mark.parametrize("call", ["dense", "varlen", "kvcache"])
def test_zero_kv_heads_with_query_heads_is_an_error(call):
    q, kv = _randn((1, 2, 8, 16), F32), _randn((1, 0, 8, 16), F32)
    with pytest.raises(ValueError, match=r"k and v have no heads \(heads_kv=0.*heads_q=2"):
        if call == "dense":
            kernels.attention(q, kv, kv)
        elif call == "varlen":
            kernels.attention_varlen(q[0].transpose(0, 1), kv[0].transpose(0, 1),
                                     kv[0].transpose(0, 1), _cu([8]), _cu([8]))
        else:
            kernels.attention_with_kvcache(q, kv, kv, torch.tensor([4], dtype=torch.int32,
                                                                   device=DEVICE))


# ------------------------------------------------------------------------------------------
# attention_with_kvcache is forward-only, and says so
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("needs_grad,compiled", [("q", False), ("k_cache", False),
                                                 ("k", False), ("q", True)],
                         ids=["q", "k_cache", "k", "q-compiled"])
def test_kvcache_backward_says_forward_only(needs_grad, compiled):
    """.backward() through the KV-cache call raises a RuntimeError that names the call and what
    to train with (it was PyTorch's "no autograd formula was registered"); the forward itself
    still runs with inputs that require grad, eager and under torch.compile(fullgraph=True),
    and gives the no-grad result."""
    args = dict(q=_randn((2, 4, 1, 16), F32), k_cache=_randn((2, 2, 12, 16), F32),
                v_cache=_randn((2, 2, 12, 16), F32), k=_randn((2, 2, 1, 16), F32),
                v=_randn((2, 2, 1, 16), F32))
    lens = torch.tensor([3, 7], dtype=torch.int32, device=DEVICE)

    def step(q, k_cache, v_cache, k, v):
        return kernels.attention_with_kvcache(q, k_cache, v_cache, lens, k, v)

    with torch.no_grad():
        want = step(**{name: t.clone() for name, t in args.items()})
    args[needs_grad].requires_grad_()
    if compiled:
        step = torch.compile(step, fullgraph=True,
                             backend="aot_eager" if DEVICE == "cpu" else "inductor")
    out = step(**args)
    assert out.requires_grad
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"attention_with_kvcache is forward-only.*"
                                           r"kernels\.attention.*attention_varlen"):
        out.sum().backward()


# ------------------------------------------------------------------------------------------
# The fallback's one-time warning points at the caller's line
# ------------------------------------------------------------------------------------------
@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
@pytest.mark.parametrize("via", ["attention", "module", "kvcache"])
def test_fallback_warning_points_at_the_caller(via, monkeypatch):
    """It pointed at torch/_library/custom_ops.py (it is raised inside the custom op)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", False)
    q = _randn((1, 2, 5, 8), F32)
    with pytest.warns(kernels.FallbackNotice, match="PyTorch fallback") as record:
        if via == "attention":
            kernels.attention(q, q, q)
        elif via == "module":
            kernels.FusedMultiHeadAttention(6, 8, 5, 0.0, 2)(_randn((1, 5, 6), F32))
        else:
            kernels.attention_with_kvcache(q, q.clone(), q.clone(),
                                           torch.tensor([5], dtype=torch.int32))
    assert [w.filename for w in record] == [__file__], [(w.filename, w.lineno) for w in record]
