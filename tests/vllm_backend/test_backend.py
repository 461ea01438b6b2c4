"""The TRITON_FUSED backend's parts without an engine: the metadata builder from a hand-made
``CommonAttentionMetadata``, the cache writes through ``slot_mapping`` (FP8 bit-exact to our
own quantization), the forward against a float64 oracle, a steady decode step (no host read,
plan hits), the registration, and the configurations vLLM must refuse at start-up."""
import types

import pytest
import torch

PAGE, HEADS, HEADS_KV, D = 4, 4, 2, 16


@pytest.fixture(scope="module")
def vb():
    """kernels.vllm.backend (imports vLLM: the vllm stack only)."""
    import kernels.vllm.backend as backend
    return backend


def _layer_cache(pool=10, dtype=torch.float32):
    """One layer's cache as vLLM's LBNHC layout gives it: logical (blocks, heads_kv, page,
    2 * D) over token-major memory (blocks, page, heads_kv, 2 * D)."""
    return torch.zeros(pool, PAGE, HEADS_KV, 2 * D, dtype=dtype).transpose(1, 2)


def _common(vb, lens_q, lens_k, table):
    from vllm.v1.attention.backend import CommonAttentionMetadata
    cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    # each new token's slot: the positions past the sequence's computed keys
    slots = []
    for s, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        for pos in range(nk - nq, nk):
            slots.append(int(table[s, pos // PAGE]) * PAGE + pos % PAGE)
    return CommonAttentionMetadata(
        query_start_loc=cu, query_start_loc_cpu=cu.clone(),
        seq_lens=torch.tensor(lens_k, dtype=torch.int32), num_reqs=len(lens_q),
        num_actual_tokens=sum(lens_q), max_query_len=max(lens_q), max_seq_len=max(lens_k),
        block_table_tensor=table, slot_mapping=torch.tensor(slots, dtype=torch.int64))


def _builder(vb):
    return vb.TritonFusedMetadataBuilder(None, ["layer.0"], None, torch.device("cpu"))


def _impl(vb, **kw):
    return vb.TritonFusedImpl(HEADS, D, D ** -0.5, HEADS_KV, None, kw.pop("window", None),
                              kw.pop("kv_cache_dtype", "auto"), **kw)


def _layer(k_scale=1.0, v_scale=1.0):
    return types.SimpleNamespace(_k_scale=torch.tensor(k_scale), _v_scale=torch.tensor(v_scale))


def test_builder_views_vllm_tensors_and_splits_decode_only(vb, monkeypatch):
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    mixed = _builder(vb).build(0, _common(vb, [3, 1], [7, 9], table))
    assert mixed.num_splits == 1 and mixed.max_query_len == 3
    assert mixed.block_table is table   # vLLM's tensors as they are: no copy per step
    decode = _builder(vb).build(0, _common(vb, [1, 1], [7, 9], table))
    assert decode.num_splits == 0       # the split-KV heuristic
    monkeypatch.setenv(vb.ENV_DECODE_SPLITS, "3")
    assert _builder(vb).build(0, _common(vb, [1, 1], [7, 9], table)).num_splits == 3
    monkeypatch.setenv(vb.ENV_DECODE_SPLITS, "two")
    with pytest.raises(ValueError, match="KERNELS_VLLM_DECODE_SPLITS must be an int"):
        _builder(vb)


def test_cache_writes_follow_slot_mapping(vb):
    kv = _layer_cache()
    key, value = torch.randn(5, HEADS_KV, D), torch.randn(5, HEADS_KV, D)
    slots = torch.tensor([7, -1, 0, 33, -1])
    _impl(vb).do_kv_cache_update(_layer(), key, value, kv, slots)
    flat = kv.transpose(1, 2).reshape(-1, HEADS_KV, 2 * D)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], torch.cat([key[t], value[t]], -1))
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 3   # the -1 tokens wrote nothing


def test_fp8_cache_writes_are_our_quantization_bit_for_bit(vb):
    from kernels.core.fp8 import quantize_e4m3_torch
    kv = _layer_cache(dtype=torch.uint8)   # vLLM allocates FP8 caches as bytes
    key = (torch.randn(3, HEADS_KV, D) * 100).to(torch.bfloat16)
    value = torch.randn(3, HEADS_KV, D).to(torch.bfloat16)
    slots = torch.tensor([2, 9, -1])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)   # vLLM builds a layer under the model's dtype
    try:
        impl = _impl(vb, kv_cache_dtype="fp8")
    finally:
        torch.set_default_dtype(default)
    impl.do_kv_cache_update(_layer(0.25, 4.0), key, value, kv, slots)
    flat = kv.transpose(1, 2).reshape(-1, HEADS_KV, 2 * D)
    for t, s in ((0, 2), (1, 9)):
        want_k = quantize_e4m3_torch(key[t:t + 1, :, None], torch.full((1, HEADS_KV), 0.25))
        want_v = quantize_e4m3_torch(value[t:t + 1, :, None], torch.full((1, HEADS_KV), 4.0))
        assert torch.equal(flat[s, :, :D], want_k[0, :, 0].view(torch.uint8))
        assert torch.equal(flat[s, :, D:], want_v[0, :, 0].view(torch.uint8))


def _oracle(q, kv, md, window=None, sinks=None):
    """float64 attention of each sequence's queries (its last positions) over its keys."""
    import reference
    cache = kv.transpose(1, 2).double()
    ks, vs, cu_k = [], [], [0]
    for s, n in enumerate(md.seq_lens.tolist()):
        pos = torch.arange(n)
        rows = cache[md.block_table[s].long()[pos // PAGE], pos % PAGE]
        ks.append(rows[..., :D])
        vs.append(rows[..., D:])
        cu_k.append(cu_k[-1] + n)
    return reference.attention_varlen(q.double(), torch.cat(ks), torch.cat(vs),
                                      md.query_start_loc, torch.tensor(cu_k), window=window,
                                      sinks=sinks)


@pytest.mark.parametrize("window", [None, 3])
def test_forward_mixed_batch_matches_the_oracle(vb, window):
    """Decode rows, a prefill chunk and a prefix-cache hit in one step, written into vLLM's
    output buffer (padded past the batch's tokens), sinks on."""
    table = torch.randperm(10)[:9].view(3, 3).int()
    md = _builder(vb).build(0, _common(vb, [1, 4, 2], [9, 6, 11], table))
    kv = _layer_cache()
    kv.copy_(torch.randn_like(kv))
    q = torch.randn(7, HEADS, D)
    output = torch.full((9, HEADS, D), float("nan"))   # 2 padding rows vLLM does not read
    sinks = torch.randn(HEADS)
    impl = _impl(vb, window=window, sinks=sinks)
    got = impl.forward(_layer(), torch.cat([q, torch.randn(2, HEADS, D)]), None, None, kv, md,
                       output)
    assert got is output and torch.isnan(output[7:]).all()
    want = _oracle(q, kv, md, window=window, sinks=sinks)
    assert (output[:7].double() - want).abs().max() < 1e-5


def test_a_steady_decode_step_reads_no_metadata_and_hits_its_plan(vb, monkeypatch):
    """vLLM updates its metadata tensors in place each step: with the metadata off the host
    (a GPU's), no step after the first reads them, and every one hits its plan."""
    import kernels
    from helpers import metadata_on_a_gpu
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # the kernels' route: what a GPU runs
    table = torch.arange(9, dtype=torch.int32).view(3, 3)
    common = _common(vb, [1, 1, 1], [5, 6, 7], table)
    impl, kv, output = _impl(vb), _layer_cache(), torch.empty(3, HEADS, D)
    kernels.plans.clear()
    with metadata_on_a_gpu(monkeypatch, common.query_start_loc, common.seq_lens,
                           table) as reads:
        for step in range(3):
            md = _builder(vb).build(0, common)
            impl.forward(_layer(), torch.randn(3, HEADS, D), None, None, kv, md, output)
            common.seq_lens.add_(1)   # in place, as vLLM's persistent buffers
            common.query_start_loc.copy_(common.query_start_loc_cpu)   # rewritten each step
            if step == 0:
                warm = kernels.plans.stats()
    stats = kernels.plans.stats()
    assert reads == []
    assert stats["misses"] == warm["misses"] and stats["hits"] == warm["hits"] + 2, stats


def test_registration_and_the_cpu_override(vb, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    import kernels.vllm as kv
    # (register() also puts the MLA backend in CPU_MLA's and AMX_MLA's places: restored too;
    # test_mla_backend.py checks those)
    slots = (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CPU_MLA,
             AttentionBackendEnum.AMX_MLA)
    original = {e: e.get_path() for e in slots}
    monkeypatch.delenv(kv.ENV_CPU_OVERRIDE, raising=False)
    kv.register()
    kv.register()   # idempotent: the entry point runs in every process, maybe twice
    assert AttentionBackendEnum["TRITON_FUSED"].get_class() is vb.TritonFusedBackend
    assert {e: e.get_path() for e in slots} == original   # nothing else changed
    monkeypatch.setenv(kv.ENV_CPU_OVERRIDE, "1")
    try:
        kv.register()
        assert AttentionBackendEnum.CPU_ATTN.get_path() == kv.BACKEND_PATH
    finally:
        from vllm.v1.attention.backends.registry import register_backend
        for e, path in original.items():
            register_backend(e, path)


@pytest.mark.parametrize("what, kwargs, reason", [
    ("MLA", dict(use_mla=True), "MLA not supported"),
    ("sparse", dict(use_sparse=True), "sparse not supported"),
    ("encoder", dict(attn_type="encoder"), "attention type encoder not supported"),
    ("cross", dict(attn_type="encoder_decoder"), "encoder_decoder not supported"),
    ("non-causal", dict(use_non_causal=True), "non-causal attention not supported"),
    ("e5m2 cache", dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype not supported"),
    ("fp8 + fp32", dict(kv_cache_dtype="fp8", dtype=torch.float32), "float16 or bfloat16"),
    ("head 1024", dict(head_size=1024), "head_size not supported"),
    ("per-head scales", dict(use_per_head_quant_scales=True), "per-head quant scales"),
])
def test_vllm_refuses_what_we_do_not_support(vb, what, kwargs, reason):
    from vllm.platforms.interface import DeviceCapability
    args = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
                use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
                use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
                attn_type="decoder")
    assert vb.TritonFusedBackend.validate_configuration(**args) == []
    args.update(kwargs)
    reasons = vb.TritonFusedBackend.validate_configuration(**args)
    assert any(reason in r for r in reasons), (what, reasons)


def test_supported_options_pass(vb):
    from vllm.platforms.interface import DeviceCapability
    for dtype, cache in ((torch.float16, "fp8"), (torch.bfloat16, "fp8_e4m3"),
                         (torch.float32, "auto")):
        assert vb.TritonFusedBackend.validate_configuration(
            head_size=128, dtype=dtype, kv_cache_dtype=cache, block_size=16, use_mla=False,
            has_sink=True, use_sparse=False, use_mm_prefix=False,
            use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
            attn_type="decoder", has_sliding_window=True) == []


def test_the_impl_refuses_what_the_backend_declares_unsupported(vb):
    """vLLM's CPU platform takes our class path without validate_configuration: the impl
    refuses the same configurations as the model is built (start-up)."""
    with pytest.raises(NotImplementedError, match="FP8 KV cache needs a float16 or bfloat16"):
        _impl(vb, kv_cache_dtype="fp8")   # under fp32, the default dtype here
    with pytest.raises(NotImplementedError, match="kv_cache_dtype not supported"):
        _impl(vb, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(NotImplementedError, match="attention type encoder not supported"):
        _impl(vb, attn_type="encoder")
