"""The fallback's own Philox (kernels/core/dropout.py: ``philox_words`` in PyTorch and NumPy,
``dropout_mask_block``; kernels/core/native.py: the compiled ``draw_keep``) against the
independent oracle (reference/dropout.py) and the interpreted kernel, and the fallback's
worker-thread split (kernels/core/fallback.py) against the float64 oracle.

The product never imports ``reference``: the fallback computes the kernels' mask with its own
code, and these tests hold the two PyTorch implementations and the kernel to the same bits.
"""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import DEVICE, randn

import kernels
import reference
from kernels import ops
from kernels.core import dropout as drop
from kernels.core import fallback, native
from reference.dropout import dropout_keep_rows, philox4x32

REPO = Path(__file__).resolve().parents[2]
SEEDS = [0, 1, 2**32 - 1, 2**32 + 5, 2**62 + 7, 2**63 - 1]


def _counters(seed):
    """Counters around 2**31 and 2**32 (the high counter word), up to 2**63 - 1."""
    g = torch.Generator().manual_seed(seed % 1000)
    return torch.cat([
        torch.arange(0, 300), torch.arange(2**31 - 50, 2**31 + 50),
        torch.arange(2**32 - 50, 2**32 + 50), torch.arange(2**40 - 3, 2**40 + 3),
        torch.randint(0, 2**62, (2000,), generator=g), torch.tensor([2**63 - 2, 2**63 - 1]),
    ]).to(DEVICE)


@pytest.mark.parametrize("impl", ["torch", "numpy"])
@pytest.mark.parametrize("seed", SEEDS)
def test_philox_words_match_the_oracle(seed, impl):
    counter = _counters(seed)
    if impl == "numpy":
        if DEVICE != "cpu" or drop._np is None:
            pytest.skip("the NumPy twin serves CPU tensors, with NumPy installed")
        # counter as one of the work buffers' rows, as dropout_mask_block passes it
        bufs = torch.empty((6, counter.numel() + 5), dtype=torch.int64)
        bufs[4, :counter.numel()] = counter
        got = drop._philox_words_numpy(seed, bufs[4, :counter.numel()], bufs)
    else:
        got = drop._philox_words_torch(seed, counter, torch.empty(
            (6, counter.numel()), dtype=torch.int64, device=DEVICE))
    want = philox4x32(seed, counter)
    for w, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"word {w} differs at {int((a != b).sum())} counters"


def _native_or_skip():
    if DEVICE != "cpu":
        pytest.skip("the compiled mask serves CPU tensors")
    if native.keep_fn() is None:   # CI has a C compiler: there this runs
        pytest.skip("no C compiler here (or KERNELS_NATIVE=0): the compiled mask is not built")


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.999])
@pytest.mark.parametrize("seed", SEEDS)
def test_native_keep_bytes_match_the_oracle(seed, p):
    """The compiled loop: keep and drop decisions, in order and scattered to given slots, as
    bytes and as the scaled fp32 mask, for every counter count modulo its 8 lanes."""
    _native_or_skip()
    counter = _counters(seed)[:2501]
    bound = drop.dropout_threshold(p) << 8
    words = torch.stack(philox4x32(seed, counter), 1)   # (n, 4)
    for keep in (True, False):
        want = words >= bound if keep else words < bound
        out = torch.empty((counter.numel(), 4), dtype=torch.bool)
        assert native.draw_keep(seed, counter, bound, out, keep=keep)
        assert torch.equal(out, want)
        slot = torch.randperm(counter.numel() + 3)[:counter.numel()]
        scattered = torch.zeros((counter.numel() + 3, 4), dtype=torch.bool)
        assert native.draw_keep(seed, counter, bound, scattered, slot=slot, keep=keep)
        assert torch.equal(scattered[slot], want)
        assert not scattered[torch.isin(torch.arange(len(scattered)), slot, invert=True)].any()
        scaled = torch.empty((counter.numel(), 4), dtype=torch.float32)   # the scaled mask
        assert native.draw_keep(seed, counter, bound, scaled, keep=keep, value=1.25)
        assert torch.equal(scaled, want.float() * 1.25)


def test_native_build_is_cached_and_can_be_turned_off(monkeypatch, tmp_path):
    """KERNELS_CACHE_DIR gets the library (a second build finds it there); a failing compiler
    or KERNELS_NATIVE=0
    gives no compiled loop, and the mask is then the NumPy / PyTorch twin's."""
    _native_or_skip()
    import shutil
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(tmp_path))
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    path = native._build(compiler)
    assert path is not None and Path(path).parent == tmp_path
    stamp = Path(path).stat().st_mtime_ns
    assert native._build(compiler) == path and Path(path).stat().st_mtime_ns == stamp
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(tmp_path / "failed"))
    monkeypatch.setenv("CC", "false")   # a compiler that fails: no library, no error
    assert native._load() is None
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("KERNELS_NATIVE", "0")
    assert native._load() is None
    monkeypatch.setattr(native, "_STATE", {"fn": None})
    rows = _dense_rows(2, 3, 11)
    assert not native.draw_keep(5, rows, 0, torch.empty(4, dtype=torch.bool))
    want = reference.dropout_keep_mask(5, 2, 3, 11, 29, 0.3, device=DEVICE).reshape(-1, 29)
    assert torch.equal(drop.dropout_mask_block(5, rows, 0, 29, 0.3, 8), want)


def _dense_rows(batch, heads, q_len, row_offset=0, q_total=None):
    """Row ids of a dense (batch, heads, q_len) layout, in (b, h, i) order."""
    q_total = q_len if q_total is None else q_total
    bh = torch.arange(batch * heads, device=DEVICE)[:, None]
    return (bh * q_total + row_offset + torch.arange(q_len, device=DEVICE)).reshape(-1)


@pytest.fixture(params=["small-chunks", "default-chunks"])
def chunks(request, monkeypatch):
    """Small chunks: many chunks per block, and the unaligned copy path for every block."""
    if request.param == "small-chunks":
        monkeypatch.setattr(drop, "_CHUNK_COUNTERS", 7)


@pytest.fixture(params=["native", "numpy", "torch"])
def philox_impl(request, monkeypatch):
    """Which twin draws the CPU mask: the compiled loop, else NumPy, else PyTorch (on CUDA
    tensors always PyTorch's)."""
    if request.param == "native":
        _native_or_skip()
    else:
        monkeypatch.setattr(native, "_STATE", {"fn": None})
    if request.param == "torch":
        monkeypatch.setattr(drop, "_np", None)


@pytest.mark.parametrize("seed", [3, 2**33 + 5, 2**63 - 1])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.93])
def test_mask_block_is_the_dense_mask(chunks, philox_impl, seed, p):
    """Every column window, starting at any column (not only multiples of 4), is that window of
    ``reference.dropout_keep_mask``; keep=False is its complement."""
    B, H, q_len, k_len = 2, 3, 11, 29
    whole = reference.dropout_keep_mask(seed, B, H, q_len, k_len, p, device=DEVICE)
    whole = whole.reshape(B * H * q_len, k_len)
    rows = _dense_rows(B, H, q_len)
    groups = (k_len + 3) // 4
    for c0, c1 in [(0, k_len), (0, 1), (1, 2), (1, 9), (2, 7), (3, 4), (5, 29), (8, 12),
                   (13, 28), (27, 29)]:
        got = drop.dropout_mask_block(seed, rows, c0, c1, p, groups)
        assert torch.equal(got, whole[:, c0:c1]), (c0, c1)
        dropped = drop.dropout_mask_block(seed, rows, c0, c1, p, groups, keep=False)
        assert torch.equal(dropped, ~whole[:, c0:c1]), (c0, c1)


def test_mask_block_rows_in_any_order_and_counters_past_2_32(chunks, philox_impl):
    """Row ids in any order and large enough that the counter passes 2**32 (and 2**40); the
    result is written into a strided ``out``."""
    seed, p, k_len = 2**63 - 1, 0.3, 70
    groups = (k_len + 3) // 4
    rows = torch.tensor([5, 0, 2**30 + 7, 2**32 // groups + 1, 2**40 // groups, 3, 2**38],
                        device=DEVICE)
    want = dropout_keep_rows(seed, rows, k_len, p, groups=groups)
    out = torch.zeros(55, rows.numel(), dtype=torch.bool, device=DEVICE).t()  # strided
    got = drop.dropout_mask_block(seed, rows, 6, 61, p, groups, out=out)
    assert got is out and torch.equal(out, want[:, 6:61])


def test_mask_block_packed_layout(chunks):
    """Packed sequences: rows ``h * total_q + cu_q[s] + i``, stride ``ceil(total_k / 4)`` for
    every sequence: the masks of ``reference.dropout_keep_mask_varlen``."""
    seed, p, heads = 2**35 + 11, 0.25, 3
    cu_q, cu_k = [0, 5, 5, 17, 20], [0, 9, 12, 30, 31]
    want = reference.dropout_keep_mask_varlen(seed, cu_q, cu_k, heads, p, device=DEVICE)
    groups = (cu_k[-1] + 3) // 4
    for s in range(len(cu_q) - 1):
        len_q, len_k = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        rows = (torch.arange(heads, device=DEVICE)[:, None] * cu_q[-1] + cu_q[s]
                + torch.arange(len_q, device=DEVICE)).reshape(-1)
        got = drop.dropout_mask_block(seed, rows, 0, len_k, p, groups)
        assert torch.equal(got.view(heads, len_q, len_k), want[s]), s
        if len_k > 3:
            part = drop.dropout_mask_block(seed, rows, 3, len_k - 1, p, groups)
            assert torch.equal(part.view(heads, len_q, -1), want[s][:, :, 3:len_k - 1]), s


def test_mask_block_empty():
    rows = torch.arange(4, device=DEVICE)
    assert drop.dropout_mask_block(1, rows, 5, 5, 0.1, 4).shape == (4, 0)
    assert drop.dropout_mask_block(1, rows[:0], 0, 8, 0.1, 4).shape == (0, 8)


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
def test_fallback_does_not_import_reference():
    """The product stands alone: a fresh process runs the fallback with dropout (forward and
    backward) without the tests' oracle package ever being imported."""
    script = ("import sys, warnings, torch; warnings.simplefilter('ignore'); import kernels\n"
              "q = torch.randn(1, 2, 9, 8, requires_grad=True)\n"
              "kernels.attention(q, q, q, window=4, dropout_p=0.5, seed=3).sum().backward()\n"
              "assert 'reference' not in sys.modules, 'reference was imported'\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]


# ------------------------------------------------------------------------------------------
# The fallback's mask is the kernel's, bit for bit: read off the outputs
# ------------------------------------------------------------------------------------------
def _fallback_on(monkeypatch):
    """The PyTorch fallback, on its blockwise path (per-block masks, worker threads) even for
    the small problems here: the small-problem route has tests/core/test_fallback_small.py."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", True)
    monkeypatch.setattr(fallback, "_SAVED_ELEMS", 0)


def _kept(out):
    """With q = 0 (uniform weights over the visible keys) and v = identity (k_len <= head_dim),
    out[..., i, j] = weight * keep / (1 - p): nonzero exactly where key j is kept and seen."""
    return out != 0


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
@pytest.mark.parametrize("case", [
    dict(B=2, hq=4, hkv=2, q_len=19, k_len=37, causal=True, window=None),
    dict(B=1, hq=3, hkv=1, q_len=40, k_len=23, causal=True, window=9),
    dict(B=2, hq=2, hkv=2, q_len=13, k_len=30, causal=False, window=None),
], ids=["gqa-causal", "mqa-window", "full"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fallback_mask_is_the_kernels(monkeypatch, philox_impl, case, threads):
    """Dense calls: the interpreted kernel's and the fallback's kept sets are equal, and equal
    to the oracle's mask where keys are seen; with 2 threads and tiny blocks the fallback runs
    its worker-thread split."""
    B, hq, hkv, q_len, k_len = (case[x] for x in ("B", "hq", "hkv", "q_len", "k_len"))
    seed, p, D = 2**40 + 3, 0.3, 64
    q = torch.zeros(B, hq, q_len, D, device=DEVICE)
    v = torch.eye(k_len, D, device=DEVICE).expand(B, hkv, k_len, D).contiguous()
    k = randn(B, hkv, k_len, D)
    kw = dict(causal=case["causal"], window=case["window"], dropout_p=p, seed=seed)
    want = _kept(kernels.attention(q, k, v, **kw))
    _fallback_on(monkeypatch)
    monkeypatch.setattr(fallback, "_BLOCK_ELEMS", 150)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _kept(kernels.attention(q, k, v, **kw))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got, want)
    vis = fallback.block_visible(0, q_len, 0, k_len, q_len, k_len, case["causal"],
                                 case["window"], DEVICE)
    keep = reference.dropout_keep_mask(seed, B, hq, q_len, k_len, p, device=DEVICE)
    assert torch.equal(got[..., :k_len], keep & vis)


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
def test_fallback_varlen_and_block_mask_is_the_kernels(monkeypatch):
    """Packed sequences and a context-parallel block at an odd column offset."""
    seed, p, D, heads = 7, 0.4, 48, 2
    cu = torch.tensor([0, 6, 6, 20, 33], dtype=torch.int32, device=DEVICE)
    n = int(cu[-1])
    q = torch.zeros(n, heads, D, device=DEVICE)
    k = randn(n, heads, D)
    eye = torch.eye(D, device=DEVICE)
    v = torch.cat([eye[:int(cu[s + 1] - cu[s])] for s in range(len(cu) - 1)])
    v = v[:, None].expand(n, heads, D).contiguous()
    qd, kd = torch.zeros(1, heads, 12, D, device=DEVICE), randn(1, heads, 21, D)
    vd = torch.eye(21, D, device=DEVICE).expand(1, heads, 21, D).contiguous()
    layout = (40, 60, 9, 17)  # rows 9.., columns 17.. of a 40 x 60 attention

    def run():
        packed = kernels.attention_varlen(q, k, v, cu, cu, dropout_p=p, seed=seed)
        block, _ = ops.forward_with_lse(qd, kd, vd, causal=False, dropout_p=p, seed=seed,
                                        drop_layout=layout)
        return _kept(packed), _kept(block)

    want = run()
    _fallback_on(monkeypatch)
    got = run()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    keep = reference.dropout_keep_mask(seed, 1, heads, 40, 60, p, device=DEVICE)
    assert torch.equal(got[1][..., :21], keep[:, :, 9:21, 17:38])


# ------------------------------------------------------------------------------------------
# The worker-thread split: same results as one thread, gradients summed right
# ------------------------------------------------------------------------------------------
@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
@pytest.mark.parametrize("B,hq,hkv,q_len,k_len,window,p,dtype", [
    (4, 4, 2, 33, 33, None, 0.2, torch.float32),   # batch ranges
    (1, 4, 4, 45, 50, 11, 0.0, torch.float32),     # kv-head ranges
    (1, 4, 1, 47, 47, None, 0.1, torch.float32),   # one kv head: row ranges, dK/dV summed
    (1, 2, 1, 40, 40, None, 0.1, torch.bfloat16),  # ... into low-precision gradients
])
def test_worker_threads_match_one_thread(monkeypatch, B, hq, hkv, q_len, k_len, window, p,
                                         dtype):
    _fallback_on(monkeypatch)
    monkeypatch.setattr(fallback, "_BLOCK_ELEMS", 300)
    q = randn(B, hq, q_len, 16, dtype=dtype, requires_grad=True)
    k = randn(B, hkv, k_len, 16, dtype=dtype, requires_grad=True)
    v = randn(B, hkv, k_len, 16, dtype=dtype, requires_grad=True)
    do = randn(B, hq, q_len, 16, dtype=dtype)
    saved = torch.get_num_threads()
    results = {}
    try:
        # One thread: the whole problem, then one task per kv head (as for long sequences,
        # whose K and V per head pass _TASK_KV_BYTES); two threads: the worker threads.
        for threads, task_bytes in ((1, None), (1, 1), (2, None)):
            torch.set_num_threads(threads)
            if task_bytes:
                monkeypatch.setattr(fallback, "_TASK_KV_BYTES", task_bytes)
            out, lse = kernels.attention(q, k, v, window=window, dropout_p=p, seed=5,
                                         return_lse=True)
            results[threads, task_bytes] = (out, lse, *torch.autograd.grad(out, (q, k, v), do))
            assert torch.get_num_threads() == threads  # the caller's setting is kept
            monkeypatch.undo()
            _fallback_on(monkeypatch)
            monkeypatch.setattr(fallback, "_BLOCK_ELEMS", 300)
    finally:
        torch.set_num_threads(saved)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    for other in ((1, 1), (2, None)):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[1, None],
                              results[other]):
            torch.testing.assert_close(a.float(), b.float(), msg=f"{other} {name}", **tol)
    results[2] = results[2, None]
    keep = reference.dropout_keep_mask(5, B, hq, q_len, k_len, p) if p else None
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, causal=True, window=window, dropout_p=p, keep_mask=keep)
    ref_g = torch.autograd.grad(ref, leaves, do.double())
    atol = 1e-5 if dtype == torch.float32 else 0.05
    for name, got, want in zip(("out", "dq", "dk", "dv"), (results[2][0], *results[2][2:]),
                               (ref, *ref_g)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=atol, msg=name)


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
def test_worker_threads_leave_no_warning_and_no_grad_graph(monkeypatch):
    """Work done in worker threads records no autograd graph (grad mode is per thread) and
    the result still has the custom op's grad_fn."""
    _fallback_on(monkeypatch)
    monkeypatch.setattr(fallback, "_BLOCK_ELEMS", 200)
    q, k, v = (randn(2, 2, 30, 8, requires_grad=True) for _ in range(3))
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = kernels.attention(q, k, v, dropout_p=0.2, seed=1)
            out.sum().backward()
    finally:
        torch.set_num_threads(saved)
    assert out.grad_fn is not None and q.grad is not None and torch.isfinite(q.grad).all()
