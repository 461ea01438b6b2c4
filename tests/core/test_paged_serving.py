"""What a serving engine's step needs of ``attention_varlen(..., block_table=)`` and
``write_kv_cache`` (vLLM's backend, kernels/vllm/): no host read of its metadata when it gives
``max_seqlen_q`` (a sync on a GPU, and CUDA-graph capture fails on one), cached plans across
steps whose longest query changes, ``out=`` written in place, and slot-mapped cache writes
(FP8 quantized as our own quantization, bit for bit)."""
import pytest
import torch
from helpers import DEVICE, assert_parity, metadata_on_a_gpu

import kernels
import reference
from kernels.core.fp8 import quantize_e4m3_torch

PAGE = 4


def _step(lens_q, lens_k, heads_q=4, heads_kv=2, d=16, pool=20, gen=None):
    """One engine step: packed q, a page pool, block table, cu_seqlens_q and key counts; the
    keys of sequence s are its first lens_k[s] positions; its queries the last lens_q[s]."""
    gen = gen or torch.Generator().manual_seed(0)
    width = max(-(-n // PAGE) for n in lens_k)
    table = torch.randperm(pool, generator=gen)[:len(lens_k) * width].view(len(lens_k), width)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    return dict(q=torch.randn(sum(lens_q), heads_q, d, generator=gen),
                kc=torch.randn(pool, PAGE, heads_kv, d, generator=gen),
                vc=torch.randn(pool, PAGE, heads_kv, d, generator=gen),
                table=table.int(), cu_q=cu_q, lens=torch.tensor(lens_k, dtype=torch.int32))


def _oracle(s, **kw):
    """float64 packed attention over each sequence's gathered keys (reference/)."""
    ks, vs, cu_k = [], [], [0]
    for b, n in enumerate(s["lens"].tolist()):
        pos = torch.arange(n)
        pages = s["table"][b].long()[pos // PAGE]
        ks.append(s["kc"][pages, pos % PAGE])
        vs.append(s["vc"][pages, pos % PAGE])
        cu_k.append(cu_k[-1] + n)
    args = (s["q"], torch.cat(ks), torch.cat(vs), s["cu_q"], torch.tensor(cu_k))
    return (reference.attention_varlen(*(a.double() if a.is_floating_point() else a
                                         for a in args), **kw),
            reference.attention_varlen(*args, upcast=False, **kw))


def _call(s, route, **kw):
    dev = route.device
    return kernels.attention_varlen(
        s["q"].to(dev), s["kc"].to(dev), s["vc"].to(dev), s["cu_q"].to(dev), None,
        block_table=s["table"].to(dev), seqused_k=s["lens"].to(dev), **kw)


def test_out_and_splits_match_the_oracle(route):
    """A mixed step (decode rows, a chunk, a prefix-cached prefill) into a strided ``out``
    (vLLM's output buffer is another layout than q's), with and without split-KV."""
    s = _step([1, 5, 1, 3], [9, 7, 13, 11])
    ref, ref_lowp = _oracle(s)
    for splits in (1, 3):
        buf = torch.full((s["q"].shape[0], 4 * 16 + 8), float("nan"), device=route.device)
        out = buf[:, :64].view(-1, 4, 16)          # row stride 72: not q's
        got = _call(s, route, max_seqlen_q=5, num_splits=splits, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.isnan(buf[:, 64:]).all()       # nothing written outside out
        assert_parity(out.cpu(), ref, ref_lowp)


def test_a_steady_step_reads_no_metadata_and_hits_its_plan(monkeypatch):
    """Steps whose tensors vLLM updates in place: after the first, no host read of
    cu_seqlens_q, the key counts or the block table, and plan-cache hits, also when the
    longest query changes within its power-of-two bucket (5 -> 7 -> 8)."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")   # the kernels' route: what a GPU runs
    s = _step([1, 5, 1, 3], [9, 7, 13, 11])
    q, kc, vc, table, cu_q, lens = (s[n].to(DEVICE) for n in
                                    ("q", "kc", "vc", "table", "cu_q", "lens"))
    out = torch.empty_like(q)
    kernels.plans.clear()
    with metadata_on_a_gpu(monkeypatch, cu_q, lens, table) as reads:
        for step, (lens_q, longest) in enumerate((([1, 5, 1, 3], 5), ([1, 7, 1, 1], 7),
                                                   ([8, 1, 0, 1], 8))):
            cu_q.copy_(torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()]))
            lens.add_(1)
            before = kernels.plans.stats()
            kernels.attention_varlen(q, kc, vc, cu_q, None, max_seqlen_q=longest,
                                     block_table=table, seqused_k=lens, out=out)
            after = kernels.plans.stats()
            if step:   # the first step plans; the others only look their plan up
                assert after["hits"] == before["hits"] + 1, (step, after)
                assert after["misses"] == before["misses"], (step, after)
        assert reads == []
    # The last step against the oracle (reads allowed again).
    s.update(cu_q=cu_q.cpu(), lens=lens.cpu())
    assert_parity(out.cpu(), *_oracle(s))


def test_a_longer_query_crossing_its_bucket_plans_anew():
    """max_seqlen_q 8 -> 9 leaves the bucket: a new plan whose grid covers the longer rows
    (a reused one would leave them unwritten)."""
    kernels.plans.clear()
    for lens_q in ([8, 1, 1, 1], [9, 1, 1, 0]):
        s = _step(lens_q, [12, 9, 13, 11])
        got = _call(s, type("R", (), {"device": DEVICE}), max_seqlen_q=max(lens_q))
        assert_parity(got.cpu(), *_oracle(s))
    assert kernels.plans.stats()["misses"] >= 2


def test_serving_arguments_are_checked():
    s = _step([1, 2], [5, 6])
    with pytest.raises(ValueError, match="max_seqlen_q=1 is smaller"):
        _call(s, type("R", (), {"device": "cpu"}), max_seqlen_q=1)
    with pytest.raises(ValueError, match="out must be"):
        _call(s, type("R", (), {"device": "cpu"}), out=torch.empty(3, 4, 8))
    with pytest.raises(ValueError, match="num_splits goes with block_table"):
        kernels.attention_varlen(s["q"], s["q"], s["q"], s["cu_q"], s["cu_q"], num_splits=2)
    with pytest.raises(ValueError, match="out goes with block_table"):
        kernels.attention_varlen(s["q"], s["q"], s["q"], s["cu_q"], s["cu_q"], out=s["q"])


def _one_cache(pool=6, heads_kv=2, d=8, dtype=torch.float32):
    """vLLM's layer cache: K and V as the two halves of one (pool, page, heads, 2d) tensor."""
    cache = torch.zeros(pool, PAGE, heads_kv, 2 * d, dtype=dtype, device=DEVICE)
    return cache, cache[..., :d], cache[..., d:]


@pytest.mark.parametrize("slots", [[3, -1, 0, 17, 8, -1, 23], [-1, -1]])
def test_write_kv_cache_at_slots(route, slots):
    cache, kc, vc = _one_cache()
    if route.device != DEVICE:
        cache, kc, vc = (t.to(route.device) for t in (cache, kc, vc))
    n = len(slots)
    k, v = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    slot_t = torch.tensor(slots, device=route.device)
    kernels.write_kv_cache(kc, vc, k.to(route.device), v.to(route.device), slot_t)
    want = torch.zeros(6 * PAGE, 2, 16)
    for t, slot in enumerate(slots):
        if slot >= 0:
            want[slot] = torch.cat([k[t], v[t]], -1)
    assert torch.equal(cache.view(-1, 2, 16).cpu(), want)


def test_write_kv_cache_fp8_is_our_quantization_bit_for_bit(route):
    cache, kc, vc = _one_cache(dtype=torch.float8_e4m3fn)
    if route.device != DEVICE:
        cache, kc, vc = (t.to(route.device) for t in (cache, kc, vc))
    slots = [5, -1, 11, 0]
    k = (torch.randn(4, 2, 8) * 300).to(torch.bfloat16)   # some past e4m3's 448: clamped
    v = (torch.randn(4, 2, 8) * 3).to(torch.bfloat16)
    k_scale, v_scale = torch.tensor([0.5]), 2.0
    kernels.write_kv_cache(kc, vc, k.to(route.device), v.to(route.device),
                           torch.tensor(slots, device=route.device), k_scale=k_scale.to(
                               route.device), v_scale=v_scale)
    qk = quantize_e4m3_torch(k.unsqueeze(2), torch.full((4, 2), 0.5)).squeeze(2)
    qv = quantize_e4m3_torch(v.unsqueeze(2), torch.full((4, 2), 2.0)).squeeze(2)
    flat = cache.view(-1, 2, 16).cpu().view(torch.uint8)
    for t, slot in enumerate(slots):
        if slot >= 0:
            assert torch.equal(flat[slot, :, :8], qk[t].view(torch.uint8))
            assert torch.equal(flat[slot, :, 8:], qv[t].view(torch.uint8))
    assert (flat[[1, 2, 3, 4]] == 0).all()   # untouched slots stay zero


def test_write_kv_cache_checks():
    cache, kc, vc = _one_cache()
    k = torch.randn(2, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping values must be < num_blocks"):
        kernels.write_kv_cache(kc, vc, k, k, torch.tensor([0, 24], device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        kernels.write_kv_cache(kc, vc, k, k, torch.tensor([0.0, 1.0], device=DEVICE))
    with pytest.raises(ValueError, match="k and v must be"):
        kernels.write_kv_cache(kc, vc, k[:, :1], k, torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="k_scale / v_scale quantize"):
        kernels.write_kv_cache(kc, vc, k, k, torch.tensor([0, 1], device=DEVICE), k_scale=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 0])
def test_a_decode_step_captures_in_a_cuda_graph_gpu(num_splits):
    """What vLLM's full CUDA graphs of decode batches do (TRITON_FUSED declares
    UNIFORM_SINGLE_TOKEN_DECODE): a step -- slot writes, then the paged decode with vLLM's
    bound -- captured once under ``torch.cuda.set_sync_debug_mode("error")`` (a host read
    would raise), replayed after the metadata buffers are rewritten in place, equals the same
    step run eagerly."""
    dev = "cuda"
    s = _step([1, 1, 1, 1], [9, 7, 13, 11])
    q, kc, vc, table, cu_q, lens = (s[n].to(dev) for n in ("q", "kc", "vc", "table", "cu_q",
                                                            "lens"))
    new_k, new_v = torch.randn(4, 2, 16, device=dev), torch.randn(4, 2, 16, device=dev)
    slots = torch.zeros(4, dtype=torch.int64, device=dev)
    out = torch.empty_like(q)

    def step():
        kernels.write_kv_cache(kc, vc, new_k, new_v, slots)
        kernels.attention_varlen(q, kc, vc, cu_q, None, max_seqlen_q=1, block_table=table,
                                 seqused_k=lens, num_splits=num_splits, out=out)

    def set_positions():   # the last key of each sequence is this step's token
        pos = lens.long() - 1
        slots.copy_(table.long()[torch.arange(4, device=dev), pos // PAGE] * PAGE + pos % PAGE)

    set_positions()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()   # warm-up: plans built, kernels compiled
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(2):   # next steps: new tokens, one more key each, in the same buffers
        lens.add_(1)
        set_positions()
        for t in (q, new_k, new_v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        step()
        assert torch.equal(got, out)
