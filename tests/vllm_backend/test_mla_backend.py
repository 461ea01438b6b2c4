"""The TRITON_FUSED_MLA backend's parts without an engine, at DeepSeek's real latent sizes
(kv_lora_rank 512 + rope 64 = the 576-wide cache row; q/k heads 128 + 64, v heads 128): the
latent cache writes through ``slot_mapping`` (FP8 bit-exact to our own quantization), decode
(``forward_mqa``: one-token and multi-token rows, split-KV, an FP8 cache) and prefill
(``forward_mha``, with and without cached context: the path vLLM's CPU platform never
takes) against float64 oracles, the registration, and the refusals."""
import types

import pytest
import torch

PAGE, HEADS, RANK, ROPE, NOPE, VDIM = 4, 4, 512, 64, 128, 128
LATENT = RANK + ROPE
SCALE = (NOPE + ROPE) ** -0.5


@pytest.fixture(scope="module")
def mla():
    """kernels.vllm.mla (imports vLLM: the vllm stack only)."""
    import kernels.vllm.mla as mla
    return mla


class _KvBProj:
    """vLLM's kv_b_proj (a linear layer returning (out, bias)): latent (T, RANK) -> (T, HEADS *
    (NOPE + VDIM))."""
    def __init__(self):
        self.weight = torch.randn(RANK, HEADS * (NOPE + VDIM)) * RANK ** -0.5

    def __call__(self, x):
        return (x @ self.weight.to(x.dtype), None)


def _impl(mla, kv_b_proj=None, dtype=torch.float32, **kw):
    """Our impl as vLLM's MLAAttention builds it (under the model's dtype as the default)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    args = dict(sliding_window=None, kv_cache_dtype="auto", attn_type="decoder",
                kv_lora_rank=RANK)
    args.update(kw)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with set_current_vllm_config(VllmConfig()):
            return mla.TritonFusedMLAImpl(
                HEADS, args["kv_lora_rank"] + ROPE, SCALE, 1, None, args["sliding_window"],
                args["kv_cache_dtype"], None, args["attn_type"], None, q_lora_rank=128,
                kv_lora_rank=args["kv_lora_rank"], qk_nope_head_dim=NOPE,
                qk_rope_head_dim=ROPE, qk_head_dim=NOPE + ROPE, v_head_dim=VDIM,
                kv_b_proj=kv_b_proj or _KvBProj(), indexer=None)
    finally:
        torch.set_default_dtype(default)


def _slots(table, lens_new, lens_k):
    """Each new token's slot: the positions past its sequence's context."""
    out = []
    for s, (nq, nk) in enumerate(zip(lens_new, lens_k)):
        out += [int(table[s, p // PAGE]) * PAGE + p % PAGE for p in range(nk - nq, nk)]
    return torch.tensor(out)


def _rows(cache, table, s, n):
    """Sequence s's first n latent rows (n, LATENT) of a (blocks, PAGE, LATENT) cache."""
    pos = torch.arange(n)
    return cache[table[s].long()[pos // PAGE], pos % PAGE]


def _attend(q, k, v, scale=SCALE):
    """float64 attention of q (nq, H, D) over k (nk, H or 1, D), v: the queries are the last
    nq positions (causal bottom-right)."""
    q, k, v = q.double(), k.double(), v.double()
    nq, nk = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k.expand(nk, q.shape[1], -1)) * scale
    visible = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + nk - nq
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.expand(nk, q.shape[1], -1))


def test_cache_writes_are_latent_rows_at_slot_mapping(mla):
    cache = torch.zeros(10, PAGE, LATENT)
    # as vLLM hands them: k_pe a strided view of the kv_a projection's output
    kv_a = torch.randn(5, RANK + ROPE + 8)
    kv_c, k_pe = kv_a[:, :RANK], kv_a[:, None, RANK + 8:]
    slots = torch.tensor([7, -1, 0, 33, -1])
    mla.CALLS.clear()
    _impl(mla).do_kv_cache_update(kv_c, k_pe, cache, slots, "auto", torch.tensor(1.0))
    flat = cache.view(-1, LATENT)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], torch.cat([kv_c[t], k_pe[t, 0]]))
    assert int((flat.abs().sum(1) > 0).sum()) == 3   # the -1 tokens wrote nothing
    assert mla.CALLS["mla_cache_write"] == 1


def test_fp8_cache_writes_are_our_quantization_bit_for_bit(mla):
    from kernels.core.fp8 import quantize_e4m3_torch
    cache = torch.zeros(4, PAGE, LATENT, dtype=torch.uint8)   # vLLM allocates FP8 as bytes
    kv_c = (torch.randn(3, RANK) * 100).to(torch.bfloat16)
    k_pe = torch.randn(3, 1, ROPE).to(torch.bfloat16)
    scale = torch.tensor(0.25)
    impl = _impl(mla, dtype=torch.bfloat16, kv_cache_dtype="fp8")
    impl.do_kv_cache_update(kv_c, k_pe, cache, torch.tensor([2, 9, -1]), "fp8", scale)
    flat = cache.view(-1, LATENT)
    for t, s in ((0, 2), (1, 9)):
        row = torch.cat([kv_c[t], k_pe[t, 0]])[None, None, None]   # (1, 1, 1, LATENT)
        want = quantize_e4m3_torch(row, torch.full((1, 1), 0.25))
        assert torch.equal(flat[s], want.view(-1).view(torch.uint8))   # one scale per row


def _decode_metadata(mla, lens_q, lens_k, table, num_splits=1):
    cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    return types.SimpleNamespace(decode=mla.TritonFusedMLADecodeMetadata(
        block_table=table, seq_lens=torch.tensor(lens_k, dtype=torch.int32),
        dcp_tot_seq_lens=None, query_start_loc=cu, max_query_len=max(lens_q),
        num_splits=num_splits))


@pytest.mark.parametrize("lens_q, splits, interpret", [
    ([1, 1, 1], 1, False),
    ([1, 3, 2], 1, False),   # speculative rows: causal bottom-right in the same call
    ([1, 1, 1], 2, True),    # the Triton split-KV kernels (interpreter), 2 splits
])
def test_forward_mqa_matches_float64(mla, monkeypatch, lens_q, splits, interpret):
    """Absorbed decode: every query head over the ONE latent head, values = its first 512
    columns; q handed as vLLM does, the (absorbed nope, rope) halves."""
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    table = torch.randperm(12)[:9].view(3, 3).int()
    lens_k = [9, 7, 12]
    cache = torch.randn(12, PAGE, LATENT)
    n = sum(lens_q)
    q_nope, q_pe = torch.randn(n, HEADS, RANK), torch.randn(n, HEADS, ROPE)
    mla.CALLS.clear()
    out, lse = _impl(mla).forward_mqa((q_nope, q_pe), cache,
                                      _decode_metadata(mla, lens_q, lens_k, table, splits),
                                      types.SimpleNamespace())
    assert out.shape == (n, HEADS, RANK) and lse is None and mla.CALLS["mla_decode"] == 1
    q, start = torch.cat([q_nope, q_pe], -1), 0
    for s, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        rows = _rows(cache, table, s, nk)[:, None]
        want = _attend(q[start:start + nq], rows, rows[..., :RANK])
        assert (out[start:start + nq].double() - want).abs().max() < 1e-5, s
        start += nq


def test_forward_mqa_fp8_cache(mla):
    """An FP8 latent cache (written by our cache write, scale 0.5) read with bf16 queries:
    the oracle attends over the dequantized rows."""
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    lens_k = [10, 7]
    impl = _impl(mla, dtype=torch.bfloat16, kv_cache_dtype="fp8")
    cache = torch.zeros(6, PAGE, LATENT, dtype=torch.uint8)
    latents = torch.randn(sum(lens_k), LATENT).to(torch.bfloat16)
    scale = torch.tensor(0.5)
    impl.do_kv_cache_update(latents[:, :RANK], latents[:, None, RANK:], cache,
                            _slots(table, lens_k, lens_k), "fp8", scale)
    q = torch.randn(2, HEADS, LATENT).to(torch.bfloat16)
    layer = types.SimpleNamespace(_k_scale=scale)
    out, _ = impl.forward_mqa(q, cache.view(torch.float8_e4m3fn),
                              _decode_metadata(mla, [1, 1], lens_k, table), layer)
    deq = cache.view(torch.float8_e4m3fn).to(torch.float32) * 0.5
    for s, nk in enumerate(lens_k):
        rows = _rows(deq, table, s, nk)[:, None]
        want = _attend(q[s:s + 1], rows, rows[..., :RANK])
        assert (out[s:s + 1].double() - want).abs().max() < 3e-2, s


@pytest.mark.parametrize("context", [[0, 0], [5, 0], [6, 9]])
def test_forward_mha_matches_float64(mla, context):
    """Prefill: the new tokens' latents up-projected by kv_b_proj, with each sequence's cached
    context (gathered from the pages, up-projected, before its new keys) where it has one."""
    proj = _KvBProj()
    impl = _impl(mla, kv_b_proj=proj)
    lens_new = [4, 3]
    lens_k = [c + n for c, n in zip(context, lens_new)]
    table = torch.randperm(10)[:8].view(2, 4).int()
    latents = [torch.randn(n, LATENT) for n in lens_k]
    cache = torch.zeros(10, PAGE, LATENT)
    for s, rows in enumerate(latents):   # the whole sequences: vLLM writes before attending
        for p in range(lens_k[s]):
            cache[table[s, p // PAGE], p % PAGE] = rows[p]
    new = torch.cat([rows[c:] for rows, c in zip(latents, context)])
    q = torch.randn(sum(lens_new), HEADS, NOPE + ROPE)
    cu = torch.tensor([0, *torch.tensor(lens_new).cumsum(0).tolist()], dtype=torch.int32)
    chunked = (types.SimpleNamespace(context_lens_list=context) if any(context) else None)
    md = types.SimpleNamespace(prefill=types.SimpleNamespace(
        query_start_loc=cu, max_query_len=max(lens_new), chunked_context=chunked,
        query_lens_cpu=torch.tensor(lens_new), block_table=table))
    output = torch.full((sum(lens_new), HEADS * VDIM), float("nan"))
    mla.CALLS.clear()
    impl.forward_mha(q, new[:, :RANK], new[:, None, RANK:], cache, md, torch.tensor(1.0),
                     output)
    assert mla.CALLS["mla_prefill_context" if chunked else "mla_prefill"] == 1
    w = proj.weight.double()
    for s, rows in enumerate(latents):
        kv = (rows[:, :RANK].double() @ w).view(-1, HEADS, NOPE + VDIM)
        k = torch.cat([kv[..., :NOPE], rows[:, None, RANK:].double().expand(-1, HEADS, -1)],
                      -1)
        want = _attend(q[cu[s]:cu[s + 1]], k, kv[..., NOPE:])
        got = output[cu[s]:cu[s + 1]].view(-1, HEADS, VDIM).double()
        assert (got - want).abs().max() < 1e-4, s


def test_registration_and_the_cpu_override(mla, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    import kernels.vllm as kv
    slots = (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CPU_MLA,
             AttentionBackendEnum.AMX_MLA)
    original = {e: e.get_path() for e in slots}
    monkeypatch.delenv(kv.ENV_CPU_OVERRIDE, raising=False)
    kv.register()
    kv.register()   # idempotent
    assert AttentionBackendEnum["TRITON_FUSED_MLA"].get_class() is mla.TritonFusedMLABackend
    assert {e: e.get_path() for e in slots} == original   # nothing else changed
    monkeypatch.setenv(kv.ENV_CPU_OVERRIDE, "1")
    try:
        kv.register()
        assert AttentionBackendEnum.CPU_MLA.get_path() == kv.MLA_BACKEND_PATH
        assert AttentionBackendEnum.AMX_MLA.get_path() == kv.MLA_BACKEND_PATH
        assert AttentionBackendEnum.CPU_ATTN.get_path() == kv.BACKEND_PATH
    finally:
        for e, path in original.items():
            register_backend(e, path)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(sliding_window=8), "sliding_window not supported with MLA"),
    (dict(kv_cache_dtype="fp8"), "FP8 KV cache needs a float16 or bfloat16 model"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype not supported"),
    (dict(attn_type="encoder"), "attention type encoder not supported"),
    (dict(kv_lora_rank=1024), "kv_lora_rank 1024 > 512"),
])
def test_the_impl_refuses_at_start_up(mla, kwargs, reason):
    """vLLM's CPU platform takes CPU_MLA's class path unvalidated: the impl refuses as the
    model is built, with the reasons of validate_configuration and MLA's own."""
    with pytest.raises(NotImplementedError, match="TRITON_FUSED_MLA cannot serve") as err:
        _impl(mla, **kwargs)
    assert reason in str(err.value)


def test_vllm_validation_and_what_is_not_offered(mla):
    from vllm.platforms.interface import DeviceCapability
    args = dict(head_size=LATENT, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=16,
                use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False,
                use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
                attn_type="decoder")
    backend = mla.TritonFusedMLABackend
    assert backend.validate_configuration(**args) == []
    assert "non-MLA not supported" in backend.validate_configuration(**dict(args,
                                                                             use_mla=False))
    assert "sparse not supported" in backend.validate_configuration(**dict(args,
                                                                            use_sparse=True))
    assert "DCP not supported" in backend.validate_configuration(**dict(args, use_dcp=True))
    assert not backend.supports_head_size(LATENT + 1)
    assert not _impl(mla).fused_output_quant_supported(None)
