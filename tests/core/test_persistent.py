"""The persistent forward (``attention_forward(persistent=True)``, ``KERNELS_FWD_PERSISTENT=1``)
against the grid launch: the same bits, the tile counter back at zero after every launch.

A persistent launch runs a few programs (one or two per SM on a GPU, three in the
interpreter), each drawing tiles from a per-stream counter in the grid's start order
(``tiles.tile_ids``, tests/core/test_program_order.py) until none is left; the last to finish
resets the counter. Each tile is the work of the grid program it stands for, so outputs and lse
must match bit for bit. In the interpreter programs run one after another (the first draws every
tile); on a GPU they draw concurrently.
"""
import pytest
import torch
from helpers import DEVICE, assert_parity, randn

import reference
from kernels.core import forward
from kernels.core.configs import persistent_capable
from kernels.core.forward import ForwardPlan, attention_forward

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

pytestmark = pytest.mark.skipif(
    not persistent_capable(torch.device(DEVICE)),
    reason="this GPU launches the forward as a grid only (configs.PERSISTENT_MAJORS)")


def _counter_is_zero(device):
    key = forward.stream_key(torch.device(device))
    counter = forward._TILE_COUNTERS.get(key)
    assert counter is not None, "the persistent launch made no counter for its stream"
    assert counter.tolist() == [0, 0], f"tile counter left at {counter.tolist()}"


def _same(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("b,hq,hkv,q_len,k_len,d,causal,kw,dtype", [
    (2, 2, 2, 37, 37, 16, True, {}, F16),                  # ragged last block, causal
    (1, 4, 2, 17, 45, 24, False, {}, BF16),                # GQA, padded head dim, q < k
    (2, 2, 1, 45, 30, 16, True, dict(window=9), F32),      # q > k: rows with no key; window
    (1, 2, 2, 33, 33, 16, True, dict(dropout_p=0.3, seed=5), F16),
    (1, 2, 2, 20, 70, 16, False, dict(num_splits=3), F32),   # split-KV partials and merge
    (2, 4, 2, 1, 40, 16, True, dict(pack_gqa=True), F16),    # decoding: packed GQA heads
], ids=["causal", "gqa", "window", "dropout", "splits", "pack_gqa"])
def test_same_bits_as_the_grid(b, hq, hkv, q_len, k_len, d, causal, kw, dtype):
    q = randn(b, hq, q_len, d, dtype=dtype)
    k, v = randn(b, hkv, k_len, d, dtype=dtype), randn(b, hkv, k_len, d, dtype=dtype)
    kw = dict(causal=causal, softmax_scale=d ** -0.5, **kw)
    for _ in range(2):   # a second launch finds the counter reset by the first
        got = attention_forward(q, k, v, persistent=True, **kw)
        _counter_is_zero(DEVICE)
        _same(got, attention_forward(q, k, v, persistent=False, **kw))


def test_parity_with_the_oracle():
    """Not only equal to the grid launch: right (float64 oracle, FlashAttention's budget)."""
    q, k, v = (randn(2, 3, 50, 16, dtype=F16) for _ in range(3))
    o, _ = attention_forward(q, k, v, causal=True, softmax_scale=0.25, persistent=True)
    kw = dict(causal=True, softmax_scale=0.25)
    assert_parity(o, reference.attention(q, k, v, upcast=True, **kw),
                  reference.attention(q, k, v, upcast=False, **kw))


def test_k_lens_and_transposed_layout():
    """A KV cache's filled lengths (rows past them NaN) and (B, S, H, D) views."""
    q = randn(2, 9, 2, 16, dtype=F16).transpose(1, 2)
    k, v = (randn(2, 40, 2, 16, dtype=F16).transpose(1, 2) for _ in range(2))
    k_lens = torch.tensor([13, 40], dtype=torch.int32, device=DEVICE)
    k[0, :, 13:], v[0, :, 13:] = float("nan"), float("nan")
    kw = dict(causal=True, softmax_scale=0.25, k_lens=k_lens)
    got = attention_forward(q, k, v, persistent=True, **kw)
    assert not got[0].isnan().any()
    _same(got, attention_forward(q, k, v, persistent=False, **kw))


def test_when_the_plan_is_persistent(monkeypatch):
    """The switch (argument, else KERNELS_FWD_PERSISTENT); packed sequences stay on the grid
    (a short sequence's tiles return early); a persistent launch is tuned apart from the grid
    one (its autotune key's BUCKETS)."""
    q = randn(1, 2, 20, 16, dtype=F16)
    assert not ForwardPlan(q, q, q, _call()).persistent
    monkeypatch.setenv("KERNELS_FWD_PERSISTENT", "1")
    plan = ForwardPlan(q, q, q, _call())
    assert plan.persistent and plan.step.fixed["BUCKETS"][-1] == 1
    assert ForwardPlan(q, q, q, _call(), persistent=False).step.fixed["sched"] is None
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=DEVICE)
    packed = randn(20, 2, 16, dtype=F16)
    plan = ForwardPlan(packed, packed, packed, _call(), cu_seqlens_q=cu, cu_seqlens_k=cu,
                       max_seqlen_q=13, max_seqlen_k=13)
    assert not plan.persistent
    got = attention_forward(packed, packed, packed, _call(), cu_seqlens_q=cu, cu_seqlens_k=cu,
                            max_seqlen_q=13, max_seqlen_k=13)
    monkeypatch.delenv("KERNELS_FWD_PERSISTENT")
    _same(got, attention_forward(packed, packed, packed, _call(), cu_seqlens_q=cu,
                                 cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13))


def _call():
    from kernels.core.call import AttentionCall
    return AttentionCall(causal=True, softmax_scale=0.25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="two CUDA streams at once")
def test_two_streams_at_once():
    """One plan launched on two streams concurrently: each stream's launches draw from their
    own counter (a shared one would hand a tile to one launch and skip it in the other)."""
    q, k, v = (randn(4, 8, 1024, 64, dtype=BF16) for _ in range(3))
    want = attention_forward(q, k, v, causal=True, softmax_scale=0.125, persistent=False)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    torch.cuda.synchronize()
    for _ in range(4):
        for s in streams:
            with torch.cuda.stream(s):
                outs.append(attention_forward(q, k, v, causal=True, softmax_scale=0.125,
                                              persistent=True))
    torch.cuda.synchronize()
    for got in outs:
        _same(got, want)
    for s in streams:
        with torch.cuda.stream(s):
            _counter_is_zero(DEVICE)
