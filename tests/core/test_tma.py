"""The tensor-descriptor (TMA) loads against the per-thread loads, forward and backward.

On sm_90 the forward reads K, V (and Q) tiles through tensor descriptors made per
program (``kernels.core.tma.row_tiles``; the TMA constexpr picked by ``tma_mode``), the
backward the tiles each kernel streams (Q and dO in dK/dV, K and V in dQ: ``bwd_tma_modes``);
Triton's
interpreter emulates descriptor loads, elements outside the descriptor's bounds included, so on
CPU the same code path runs here. Both paths must give the same bits: the descriptor's bounds
(a sequence's k_len rows, the true head dim) read as zeros exactly where the masked loads do, so
neither another packed sequence's keys nor a KV cache's unfilled rows (NaN here) can leak in.
"""
import pytest
import torch
from helpers import DEVICE, randn

from kernels.core import configs, tma
from kernels.core.backward import attention_backward, bwd_tma_modes
from kernels.core.call import make_problem
from kernels.core.forward import attention_forward, tma_mode

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _both(q, k, v, **kw):
    """(descriptor path, per-thread path) outputs and lse of one call."""
    kw.setdefault("causal", False)
    kw.setdefault("softmax_scale", 0.3)
    got = attention_forward(q, k, v, **kw)
    want = attention_forward(q, k, v, tma=0, **kw)
    return got, want


def _same(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("q_len,k_len,d,dv,hq,hkv,causal,window,dtype", [
    (37, 45, 24, 24, 2, 2, True, None, F16),     # padded head dim (24 -> 32), ragged tiles
    (20, 33, 32, 16, 4, 2, False, None, BF16),   # Dv != D, GQA, bf16 (widened)
    (30, 30, 16, 16, 2, 1, True, 7, F32),        # a sliding window's masked left edge
], ids=lambda x: str(x).replace("torch.", ""))
def test_dense_same_bits(q_len, k_len, d, dv, hq, hkv, causal, window, dtype):
    q, k, v = randn(2, hq, q_len, d, dtype=dtype), randn(2, hkv, k_len, d, dtype=dtype), \
        randn(2, hkv, k_len, dv, dtype=dtype)
    assert tma_mode(make_problem(q, k, v)) == 2
    _same(*_both(q, k, v, causal=causal, window=window))


def test_packed_sequences_do_not_leak():
    """Sequence 1 of a packed batch holds NaN keys and values: sequences 0 and 2 (whose last
    key tiles overlap its rows) stay finite, and both paths agree bit for bit."""
    lens_q, lens_k = [9, 5, 12], [13, 6, 21]
    cu_q = torch.tensor([0, 9, 14, 26], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 13, 19, 40], dtype=torch.int32, device=DEVICE)
    q, k, v = randn(26, 4, 16, dtype=F16), randn(40, 2, 16, dtype=F16), randn(40, 2, 16,
                                                                               dtype=F16)
    k[13:19] = float("nan")
    v[13:19] = float("inf")
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
              max_seqlen_k=max(lens_k))
    assert tma_mode(make_problem(q, k, v, **kw)) == 2
    for causal in (False, True):
        got, want = _both(q, k, v, causal=causal, **kw)
        _same(got, want)
        assert torch.isfinite(got[0][:9]).all() and torch.isfinite(got[0][14:]).all()


def test_kv_cache_unfilled_rows_do_not_leak():
    """A KV cache's rows past k_lens are NaN: decoding (packed GQA heads, Q by per-thread loads,
    K/V by descriptors) with and without splits reads none of them."""
    q = randn(3, 8, 2, 32, dtype=BF16)
    k_cache, v_cache = randn(3, 2, 70, 32, dtype=BF16), randn(3, 2, 70, 32, dtype=BF16)
    k_lens = torch.tensor([70, 33, 1], dtype=torch.int32, device=DEVICE)
    for b, n in enumerate(k_lens.tolist()):
        k_cache[b, :, n:] = float("nan")
        v_cache[b, :, n:] = float("nan")
    assert tma_mode(make_problem(q, k_cache, v_cache), pack_gqa=True) == 1
    for splits in (1, 3):
        got, want = _both(q, k_cache, v_cache, k_lens=k_lens, num_splits=splits)
        _same(got, want)
        assert torch.isfinite(got[0]).all()


def _view(shape, dtype, layout):
    if layout == "transposed":          # heads split off a (batch, seq, heads, dim) projection
        return randn(shape[0], shape[2], shape[1], shape[3], dtype=dtype).transpose(1, 2)
    if layout == "expand_heads":        # stride 0 over heads
        return randn(shape[0], 1, *shape[2:], dtype=dtype).expand(shape)
    if layout == "expand_rows":         # stride 0 over rows
        return randn(*shape[:2], 1, shape[3], dtype=dtype).expand(shape)
    if layout == "offset":              # a view one element into its storage
        return randn(shape[0] * shape[1] * shape[2] * shape[3] + 1, dtype=dtype)[1:].view(shape)
    return randn(*shape, dtype=dtype)


@pytest.mark.parametrize("layout,d,dtype,mode", [
    ("contiguous", 64, F16, 2),
    ("contiguous", 24, F16, 2),        # rows of 48 bytes: aligned; the tile is padded to 32
    ("contiguous", 20, F16, 0),        # rows of 40 bytes: not a multiple of 16
    ("contiguous", 17, F32, 0),
    ("contiguous", 4, F32, 2),         # rows of 16 bytes (tile padded to 16 elements)
    ("contiguous", 384, BF16, 0),      # padded to 512: over TMA's 256 elements per box side
    ("transposed", 32, BF16, 2),
    ("expand_heads", 32, F16, 2),      # a zero head stride only enters the base address
    ("expand_rows", 32, F16, 0),       # a zero row stride is no TMA stride
    ("offset", 32, F16, 0),            # base address 2 bytes off 16
], ids=lambda x: str(x).replace("torch.", ""))
def test_tma_mode_layouts(layout, d, dtype, mode):
    k = _view((2, 2, 9, d), dtype, layout)
    q = randn(2, 4, 5, d, dtype=dtype)
    assert tma_mode(make_problem(q, k, k)) == mode
    if mode:
        assert tma_mode(make_problem(q, k, k), pack_gqa=True) == 1   # Q's rows span heads
    if d <= 64:
        _same(*_both(q, k, k, causal=True))


@pytest.mark.parametrize("capability,on", [((8, 0), False), ((8, 6), False), ((8, 9), False),
                                           ((9, 0), True), ((10, 0), False), ((12, 0), False)])
def test_tma_only_on_tma_gpus(monkeypatch, capability, on):
    """Compiled (not interpreted), the descriptor path is taken on sm_90 only (sm_100 / sm_120:
    not until their config tables are re-checked with it, kernels/core/configs.TMA_MAJORS)."""
    monkeypatch.setattr(configs, "interpreter_active", lambda: False)
    monkeypatch.setattr(configs, "gpu_of", lambda device=None: configs.Gpu(capability, 99 << 10))
    q = randn(1, 2, 8, 64, dtype=F16)
    assert tma_mode(make_problem(q, q, q)) == (2 if on else 0)


def test_scratch_allocator_is_scoped(monkeypatch):
    """Descriptors made in the kernel need Triton's global-scratch allocator: installed for the
    launch only, the caller's (here: none) restored after."""
    from triton.runtime import _allocation
    before = _allocation._allocator.get()
    monkeypatch.setattr(tma, "interpreter_active", lambda: False)
    with tma.tma_scratch(torch.device("cpu"), 2):
        buf = _allocation._allocator.get()(384, 128, None)
        assert buf.numel() == 384 and buf.dtype == torch.int8
    assert _allocation._allocator.get() is before
    with tma.tma_scratch(torch.device("cpu"), 0):
        assert _allocation._allocator.get() is before


def _both_backward(q, k, v, do, **kw):
    """(descriptor path, per-thread path) gradients of one call."""
    o, lse = attention_forward(q, k, v, tma=0, **kw)
    return (attention_backward(do, q, k, v, o, lse, **kw),
            attention_backward(do, q, k, v, o, lse, tma=0, **kw))


@pytest.mark.parametrize("q_len,k_len,d,dv,hq,hkv,causal,window,dropout_p,dtype", [
    (37, 45, 24, 24, 2, 2, True, None, 0.0, F16),    # padded head dim, ragged tiles
    (20, 33, 32, 16, 4, 2, False, None, 0.3, BF16),  # Dv != D, GQA (group loop), dropout
    (30, 30, 16, 16, 2, 1, True, 7, 0.0, F32),       # a sliding window's masked edges
], ids=lambda x: str(x).replace("torch.", ""))
def test_backward_same_bits(q_len, k_len, d, dv, hq, hkv, causal, window, dropout_p, dtype):
    q, k, v = randn(2, hq, q_len, d, dtype=dtype), randn(2, hkv, k_len, d, dtype=dtype), \
        randn(2, hkv, k_len, dv, dtype=dtype)
    do = randn(2, hq, q_len, dv, dtype=dtype)
    assert bwd_tma_modes(make_problem(q, k, v), do) == (tma.TMA_HOST_MODE,) * 2
    kw = dict(causal=causal, window=window, softmax_scale=0.3, dropout_p=dropout_p, seed=11)
    got, want = _both_backward(q, k, v, do, **kw)
    _same(got, want)
    o, lse = attention_forward(q, k, v, tma=0, **kw)
    _same(attention_backward(do, q, k, v, o, lse, tma=1, **kw), want)   # per program


def test_backward_packed_sequences_do_not_leak():
    """Sequence 1 of a packed batch has NaN queries, output gradients, keys and values: the
    gradients of sequences 0 and 2 (whose last query / key tiles overlap its rows in dK/dV and
    dQ) stay finite, and both paths agree bit for bit."""
    cu_q = torch.tensor([0, 9, 14, 26], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 13, 19, 40], dtype=torch.int32, device=DEVICE)
    q, k, v = randn(26, 4, 16, dtype=F16), randn(40, 2, 16, dtype=F16), randn(40, 2, 16,
                                                                               dtype=F16)
    do = randn(26, 4, 16, dtype=F16)
    q[9:14], do[9:14] = float("nan"), float("nan")
    k[13:19], v[13:19] = float("nan"), float("inf")
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=12, max_seqlen_k=21)
    assert bwd_tma_modes(make_problem(q, k, v, **kw), do[None].transpose(1, 2)) == (1, 1)
    for causal in (False, True):
        got, want = _both_backward(q, k, v, do, causal=causal, softmax_scale=0.3, **kw)
        _same(got, want)
        dq, dk, dv = got
        for g, own in ((dq, slice(9, 14)), (dk, slice(13, 19)), (dv, slice(13, 19))):
            rest = torch.ones(g.shape[0], dtype=torch.bool)
            rest[own] = False
            assert torch.isfinite(g[rest]).all()


@pytest.mark.parametrize("layout,d,dtype,modes", [
    ("contiguous", 64, F16, (3, 3)),
    ("contiguous", 20, F16, (0, 0)),   # rows of 40 bytes
    ("transposed", 32, BF16, (3, 3)),
    ("offset", 32, F16, (3, 0)),       # k, v 2 bytes off 16: dQ's descriptors cannot read them
    ("expand_heads", 32, F16, (3, 1)),  # a zero head stride: per-program descriptors only
    ("contiguous", 384, BF16, (0, 0)),  # padded to 512 > 256 elements a box side
], ids=lambda x: str(x).replace("torch.", ""))
def test_backward_tma_modes_layouts(layout, d, dtype, modes):
    k = _view((2, 2, 9, d), dtype, layout)
    q, do = randn(2, 4, 5, d, dtype=dtype), randn(2, 4, 5, d, dtype=dtype)
    assert bwd_tma_modes(make_problem(q, k, k), do) == modes


def test_backward_dropout_keeps_per_thread_loads_at_wide_heads():
    """dK/dV with dropout takes descriptors up to padded head dim 64 only (wider, its default
    tile spilled with them on sm_90: configs.TMA_DKDV_DROPOUT_MAX_WIDTH); dQ is unaffected."""
    for d, want in ((64, (3, 3)), (128, (0, 3)), (96, (0, 3))):
        q = randn(1, 2, 8, d, dtype=F16)
        assert bwd_tma_modes(make_problem(q, q, q), q, dropout=True) == want
        assert bwd_tma_modes(make_problem(q, q, q), q, dropout=False) == (3, 3)


def test_kernels_tma_0_turns_descriptors_off(monkeypatch):
    """KERNELS_TMA=0 (A/B timings, a way around a TMA problem): per-thread loads in the forward
    and both backward kernels, with the same results as the descriptor path."""
    q = randn(1, 2, 8, 64, dtype=F16)
    pb = make_problem(q, q, q)
    assert tma_mode(pb) == 2 and bwd_tma_modes(pb, q) == (3, 3)
    monkeypatch.setenv("KERNELS_TMA", "0")
    assert tma_mode(pb) == 0 and bwd_tma_modes(pb, q) == (0, 0)
    monkeypatch.setenv("KERNELS_TMA", "1")
    assert tma_mode(pb) == 2


def _sliced(shape, dtype, layout):
    """A (B, H, rows, D) view for the host-descriptor tests: ``tail`` is the first rows of a
    longer buffer whose other rows are NaN (a descriptor must stop at the view's rows)."""
    if layout == "tail":
        buf = randn(shape[0], shape[1], shape[2] + 7, shape[3], dtype=dtype)
        buf[:, :, shape[2]:] = float("nan")
        return buf[:, :, :shape[2]]
    return _view(shape, dtype, layout)


@pytest.mark.parametrize("layout,batch,heads,d,dtype,causal", [
    ("contiguous", 2, 2, 64, F16, True),
    ("transposed", 2, 3, 32, BF16, False),   # (batch, seq, heads, dim) projections' layout
    ("contiguous", 1, 1, 24, F16, True),     # size-1 batch and head (their strides replaced),
                                             # head dim padded 24 -> 32
    ("tail", 2, 2, 16, F32, False),          # rows past the view's are NaN in its storage
], ids=lambda x: str(x).replace("torch.", ""))
def test_host_descriptors_same_bits(layout, batch, heads, d, dtype, causal):
    """Dense calls read Q, K, V through descriptors made once per call on the host
    (``tma.TMA_HOST_MODE``, 4-D (batch, head, row, dim) boxes): the same bits as the
    per-thread loads and the per-program descriptors, rows past each tensor's zeros."""
    q = _sliced((batch, heads, 19, d), dtype, layout)
    k, v = _sliced((batch, heads, 37, d), dtype, layout), _sliced((batch, heads, 37, d), dtype,
                                                                  layout)
    pb = make_problem(q, k, v)
    assert tma_mode(pb, dense=True) == tma.TMA_HOST_MODE and tma_mode(pb) == 2
    kw = dict(causal=causal, softmax_scale=0.3)
    host = attention_forward(q, k, v, **kw)
    _same(host, attention_forward(q, k, v, tma=0, **kw))
    _same(host, attention_forward(q, k, v, tma=2, **kw))
    assert torch.isfinite(host[0]).all()


def test_host_descriptors_only_where_they_describe_the_call(monkeypatch):
    """No host descriptors for packed sequences, KV caches (k_lens: rows past a batch entry's
    length must read as zeros), packed GQA heads, a zero stride over more than one batch entry
    or head, or with KERNELS_TMA=kernel; the plan passes them only in that mode."""
    from kernels.core.call import AttentionCall
    from kernels.core.forward import ForwardPlan
    q = randn(2, 4, 8, 32, dtype=F16)
    k = randn(2, 2, 8, 32, dtype=F16)
    assert tma_mode(make_problem(q, k, k), dense=True) == tma.TMA_HOST_MODE
    assert tma_mode(make_problem(q, k, k), pack_gqa=True, dense=True) == 1
    shared = randn(1, 2, 8, 32, dtype=F16).expand(2, 2, 8, 32)   # one cache for both entries
    assert tma.host_desc_layout(shared) is None
    assert tma_mode(make_problem(q, shared, shared), dense=True) == 2
    call = AttentionCall(causal=True, softmax_scale=0.3)
    # (At this q_len grouped heads are packed by default: k's heads for q.)
    assert set(ForwardPlan(k, k, k, call).step.descs) == {"DESC_Q", "DESC_K", "DESC_V"}
    assert ForwardPlan(q, k, k, call).step.descs == {}
    lens = torch.tensor([8, 3], dtype=torch.int32, device=DEVICE)
    assert ForwardPlan(k, k, k, call, k_lens=lens).step.descs == {}
    monkeypatch.setenv("KERNELS_TMA", "kernel")
    assert tma_mode(make_problem(q, k, k), dense=True) == 2
    assert ForwardPlan(k, k, k, call).step.descs == {}


def test_host_desc_layout_strides():
    """(shape, strides) of the 4-D descriptor: a size-1 dimension's stride replaced by a
    contiguous one (TMA wants every stride positive and 16-byte aligned), the others kept."""
    x = randn(1, 6, 3, 8, dtype=F16).transpose(1, 2)       # (1, 3, 6, 8), strides (144, 8, 24, 1)
    assert tma.host_desc_layout(x) == ([1, 3, 6, 8], [24, 8, 24, 1])
    assert tma.host_desc_layout(randn(2, 1, 5, 8, dtype=F16)) == ([2, 1, 5, 8], [40, 40, 8, 1])
    assert tma.host_desc_layout(randn(2, 2, 5, 4, dtype=F16)) is None   # 8-byte rows


@pytest.mark.parametrize("layout,batch,hq,hkv,d,dtype,causal,dropout_p", [
    ("contiguous", 2, 2, 2, 64, F16, True, 0.0),
    ("transposed", 2, 4, 2, 32, F16, False, 0.0),   # (B, S, H, D) projections; GQA group 2
    ("contiguous", 1, 1, 1, 40, F16, True, 0.0),    # size-1 batch and head; D 40 -> BLOCK_D 64
    ("tail", 2, 2, 1, 16, F32, False, 0.3),         # rows past the views NaN; group 2; dropout
], ids=lambda x: str(x).replace("torch.", ""))
def test_backward_host_descriptors_same_bits(layout, batch, hq, hkv, d, dtype, causal,
                                             dropout_p):
    """Dense backward calls read dK/dV's Q, dO and row statistics and dQ's K and V through
    descriptors made once per call on the host (``tma.TMA_HOST_MODE``): dq, dk, dv bit for bit
    those of the per-program descriptors (TMA 1) and of the per-thread loads (0), rows past
    each tensor's zeros (``tail``: NaN in its storage there)."""
    q, do = (_sliced((batch, hq, 19, d), dtype, layout) for _ in range(2))
    k, v = (_sliced((batch, hkv, 37, d), dtype, layout) for _ in range(2))
    assert bwd_tma_modes(make_problem(q, k, v), do, dropout=bool(dropout_p)) == (3, 3)
    kw = dict(causal=causal, softmax_scale=0.3, dropout_p=dropout_p, seed=7)
    o, lse = attention_forward(q, k, v, tma=0, **kw)
    host = attention_backward(do, q, k, v, o, lse, **kw)
    _same(host, attention_backward(do, q, k, v, o, lse, tma=1, **kw))
    _same(host, attention_backward(do, q, k, v, o, lse, tma=0, **kw))
    assert all(torch.isfinite(g).all() for g in host)


def test_backward_host_descriptors_only_where_they_apply(monkeypatch):
    """Host descriptors for dense calls only: packed sequences keep the per-program ones, and
    so does KERNELS_TMA=kernel; in host mode each kernel's streamed tensors are passed as its
    DESC_* parameters and their own parameters get the plan's dummy."""
    from kernels.core.backward import BackwardPlan
    from kernels.core.call import AttentionCall
    call = AttentionCall(causal=True, softmax_scale=0.3)
    q, k = randn(2, 4, 8, 32, dtype=F16), randn(2, 2, 8, 32, dtype=F16)
    lse = torch.zeros(2, 4, 8, device=DEVICE)
    plan = BackwardPlan(q, q, k, k, q, lse, call)
    assert set(plan.dkdv.descs) == {"DESC_Q", "DESC_DO", "DESC_STATS"}
    assert set(plan.dq.descs) == {"DESC_K", "DESC_V"}
    assert all(plan.dkdv.fixed[n] is plan.dummy for n in ("Q", "DO", "STATS"))
    assert all(plan.dq.fixed[n] is plan.dummy for n in ("K", "V"))
    assert not plan.dkdv.scratch and not plan.dq.scratch   # no in-kernel descriptors
    assert plan.dkdv.descs["DESC_STATS"][1:] == ([2, 2, 4, 128], [1024, 512, 128, 1])
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    qp, kp = randn(8, 4, 32, dtype=F16), randn(8, 2, 32, dtype=F16)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    assert bwd_tma_modes(make_problem(qp, kp, kp, **kw), qp[None].transpose(1, 2)) == (1, 1)
    packed = BackwardPlan(qp, qp, kp, kp, qp, torch.zeros(4, 8, device=DEVICE), call, **kw)
    assert packed.dkdv.descs == {} and packed.dq.descs == {}
    monkeypatch.setenv("KERNELS_TMA", "kernel")
    assert bwd_tma_modes(make_problem(q, k, k), q) == (1, 1)
    plan = BackwardPlan(q, q, k, k, q, lse, call)
    assert plan.dkdv.descs == {} and plan.dq.descs == {}
    assert plan.dkdv.fixed["DESC_Q"] is None and plan.dq.fixed["DESC_K"] is None
