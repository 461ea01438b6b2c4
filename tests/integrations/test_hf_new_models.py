"""kernels.hf on the architectures whose attention goes beyond causal + sliding window:

* Gemma 2: attention logit soft-capping (``softcap``) and alternating sliding-window layers;
* gpt-oss: attention sinks (``s_aux``, one learned logit per head) on sliding and full layers;
* Llama 4 (text model): chunked attention layers (``attention_chunk_size``) mixed with full
  layers;
* Gemma 4: head_dim 512 on its global layers (sliding layers 16), and a KV-shared layer, whose
  mask ``generate`` cuts to the last query row;
* DeepSeek V2 / V3: multi-head latent attention, q/k head_dim 24 (16 + 8 rotary), v head_dim 16.

Models are built from tiny random configs (nothing is downloaded). As in test_hf.py, the oracle
is a float64 copy of the model whose attention is exact float64 math (soft-capping, sinks and
value head dims included) over transformers' own boolean mask (``masking_utils.sdpa_mask``);
transformers' fp32 ``eager`` attention is the PyTorch baseline of the parity rule. Each
model's feature is first shown to change that oracle's logits, so a kernel ignoring it fails.
Without transformers (the ``[hf]`` extra) the file is skipped.
"""
import contextlib
import inspect

import pytest
import torch
from helpers import GRAD_FACTOR, assert_parity
from hf_helpers import (VOCAB, assert_training_grads_match, assert_whole_mask,
                        masked_attention, models, padded_batch, skip_module_unless_registered)
from hf_helpers import model_route  # noqa: F401 (the fixture the tests below use)

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is not installed (pip install -e '.[hf]')")
from transformers import masking_utils as mu  # noqa: E402

from kernels import hf, ops  # noqa: E402

skip_module_unless_registered()

ORACLE = "f64_oracle_new_models"
KINDS = ["gemma2", "gpt_oss", "llama4", "gemma4", "deepseek_v2", "deepseek_v3"]


# --------------------------------------------------------------------------------------------
# The float64 oracle, and switches that take a feature out of it
# --------------------------------------------------------------------------------------------
# Features the oracle leaves out while a test shows that they matter (see _oracle_without).
_IGNORED = set()


def _oracle_mask(*args, **kwargs):
    kwargs["allow_is_causal_skip"] = False
    if "mask" in _IGNORED:  # plain causal instead of the window or chunks
        kwargs["mask_function"] = mu.causal_mask_function
        kwargs.pop("local_size", None)
    return mu.sdpa_mask(*args, **kwargs)


def _oracle_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      softcap=None, s_aux=None, sinks=None, **kwargs):
    assert dropout == 0.0
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    sinks = s_aux if s_aux is not None else sinks
    out = masked_attention(query, key, value, attention_mask, scaling,
                     softcap=None if "softcap" in _IGNORED else softcap,
                     sinks=None if "sinks" in _IGNORED else sinks)
    return out.to(query.dtype), None


@contextlib.contextmanager
def _oracle_without(feature):
    _IGNORED.add(feature)
    try:
        yield
    finally:
        _IGNORED.discard(feature)


def register_oracle():
    """Register kernels.hf and this file's oracle with transformers (idempotent)."""
    hf.register()
    transformers.AttentionInterface.register(ORACLE, _oracle_attention)
    mu.AttentionMaskInterface.register(ORACLE, _oracle_mask)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_oracle()


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
_MLA = dict(_SMALL, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            first_k_dense_replace=2, n_routed_experts=2, num_experts_per_tok=1)


# The architectures' config classes (Gemma 4 came after transformers 5.4, the oldest supported).
_CONFIG_CLASS = {"gemma2": "Gemma2Config", "gpt_oss": "GptOssConfig",
                 "llama4": "Llama4TextConfig", "gemma4": "Gemma4TextConfig",
                 "deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config"}


def _skip_unless_available(kind):
    name = _CONFIG_CLASS[kind]
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name} ({kind})")


def _config(kind):
    _skip_unless_available(kind)
    if kind == "gemma2":  # layer 0 a sliding window of 4, layer 1 full; every layer capped at 1.
        # Larger weights than the default 0.02, so the cap bends the scores.
        return transformers.Gemma2Config(**_SMALL, intermediate_size=64, head_dim=8,
                                         query_pre_attn_scalar=8, sliding_window=4,
                                         attn_logit_softcapping=1.0, initializer_range=0.2)
    if kind == "gpt_oss":  # sinks on layer 0 (sliding window of 4) and layer 1 (full)
        return transformers.GptOssConfig(**_SMALL, intermediate_size=32, head_dim=8,
                                         sliding_window=4, num_local_experts=1,
                                         num_experts_per_tok=1)
    if kind == "llama4":  # layer 0 chunks of 4 (with RoPE), layer 1 full (NoPE); dense MLPs
        return transformers.Llama4TextConfig(**_SMALL, intermediate_size=32,
                                             intermediate_size_mlp=64, head_dim=8,
                                             attention_chunk_size=4, no_rope_layers=[1, 0],
                                             moe_layers=[], num_local_experts=1)
    if kind == "gemma4":  # sliding (head_dim 16, window 4), global (512), global reusing its k/v
        return transformers.Gemma4TextConfig(
            **dict(_SMALL, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1),
            intermediate_size=64, head_dim=16, global_head_dim=512, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "full_attention"],
            num_kv_shared_layers=1, vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8)
    if kind == "deepseek_v2":  # q through a low-rank projection; dense MLPs
        return transformers.DeepseekV2Config(**_MLA, q_lora_rank=12)
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(**_MLA, q_lora_rank=None, n_group=1, topk_group=1)
    raise ValueError(kind)


def _spread_sinks(model):
    """gpt-oss: sinks spread over heads, not all near 0 as initialised."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)


def _models(kind):
    """(ours, eager fp32, float64 oracle): one set of random weights. Eager experts (gpt-oss'
    MoE): the default grouped matmul has no float64 for the oracle."""
    return models(transformers, _config(kind), ORACLE,
                  prepare=_spread_sinks if kind == "gpt_oss" else None,
                  experts_implementation="eager")


def test_configs_have_the_features_under_test():
    """The tiny configs really build what the file claims to test (those of the architectures
    this transformers has: the others' tests skip)."""
    attn = {kind: [layer.self_attn for layer in _models(kind)[0].model.layers]
            for kind in KINDS if hasattr(transformers, _CONFIG_CLASS[kind])}
    assert [a.sliding_window for a in attn["gemma2"]] == [4, None]
    assert all(a.attn_logit_softcapping == 1.0 for a in attn["gemma2"])
    assert [a.sliding_window for a in attn["gpt_oss"]] == [4, None]
    assert all(a.sinks.shape == (4,) for a in attn["gpt_oss"])
    cfg = _config("llama4")
    assert cfg.layer_types == ["chunked_attention", "full_attention"]
    if "gemma4" in attn:
        assert [a.head_dim for a in attn["gemma4"]] == [16, 512, 512]
        assert attn["gemma4"][2].is_kv_shared_layer
    for kind in ("deepseek_v2", "deepseek_v3"):
        assert all((a.qk_head_dim, a.v_head_dim) == (24, 16) for a in attn[kind])


# --------------------------------------------------------------------------------------------
# One attention call at a time: the new keywords, against the float64 reference
# --------------------------------------------------------------------------------------------
class _Module(torch.nn.Module):
    is_causal = True


# (q_len, kv_length, q_offset, kv_offset, mask width, window, 2-D mask rows as strings)
_CALLS = {
    "prefill-pad": (7, 7, 0, 0, 7, None, ("1111100", "0001111")),
    "prefill-window-pad": (7, 7, 0, 0, 7, 3, ("1111100", "0001111")),
    "decode-sliding-cache": (1, 4, 9, 6, 10, 3, ("1111111111", "0000000111")),
    "no-pad": (5, 5, 0, 0, 5, None, None),
}


@pytest.mark.parametrize("feature", ["softcap", "sinks", "v_dim", "softcap+sinks+v_dim"])
@pytest.mark.parametrize("case", list(_CALLS))
@pytest.mark.usefixtures("model_route")
def test_attention_function_features(case, feature):
    """softcap, s_aux and a value head_dim of their own, dense and packed (padding) calls."""
    q_len, kv_len, q_off, kv_off, width, window, rows = _CALLS[case]
    batch, heads, heads_kv, dim = 2, 4, 2, 8
    v_dim = 12 if "v_dim" in feature else dim
    softcap = 0.7 if "softcap" in feature else None
    sinks = torch.randn(heads) if "sinks" in feature else None
    mask2d = None if rows is None else torch.tensor([[c == "1" for c in r] for r in rows])
    fn = (mu.causal_mask_function if window is None
          else mu.sliding_window_causal_mask_function(window))
    sizes = dict(batch_size=batch, q_length=q_len, kv_length=kv_len, q_offset=q_off,
                 kv_offset=kv_off, mask_function=fn, attention_mask=mask2d, local_size=window)
    info = hf.mask_hook(**sizes)
    assert info.unsupported is None, info.unsupported
    assert info.dense == (rows is None)
    q = 2 * torch.randn(batch, heads, q_len, dim)  # scores of a few units: the cap bends them
    k = 2 * torch.randn(batch, heads_kv, kv_len, dim)
    v = torch.randn(batch, heads_kv, kv_len, v_dim)
    out, weights = hf.attention_function(_Module(), q, k, v, info, scaling=0.5,
                                        sliding_window=window, softcap=softcap, s_aux=sinks)
    assert weights is None and out.shape == (batch, q_len, heads, v_dim)

    ref_mask = mu.sdpa_mask(**sizes, allow_is_causal_skip=False)
    ref = masked_attention(q, k, v, ref_mask, 0.5, softcap=softcap, sinks=sinks)
    lowp = masked_attention(q, k, v, ref_mask, 0.5, softcap=softcap, sinks=sinks,
                            dtype=torch.float32)
    plain = masked_attention(q, k, v, ref_mask, 0.5)
    if softcap is not None or sinks is not None:  # the feature changes the answer
        assert (plain - ref).abs().max() > 0.05
    if mask2d is None:
        valid_q = torch.ones(batch, q_len, dtype=torch.bool)
    else:
        padded = torch.nn.functional.pad(mask2d, (0, max(0, kv_off + kv_len - width)))
        valid_q = padded[:, q_off:q_off + q_len]
    assert_parity(out[valid_q], ref[valid_q], lowp[valid_q])
    assert (out[~valid_q] == 0).all()


@pytest.mark.usefixtures("model_route")
def test_attention_function_sink_gradients():
    """Sinks are learned: their gradient (and q's, k's, v's) flows through the packed path."""
    rows = ("11111100", "00111111")
    mask2d = torch.tensor([[c == "1" for c in r] for r in rows])
    sizes = dict(batch_size=2, q_length=8, kv_length=8,
                 mask_function=mu.sliding_window_causal_mask_function(3),
                 attention_mask=mask2d, local_size=3)
    info = hf.mask_hook(**sizes)
    assert not info.dense
    q, k, v = torch.randn(2, 4, 8, 8), torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8)
    sinks = torch.randn(4)
    valid_q = mask2d[:, None, :, None].transpose(1, 2)  # (batch, q_len, 1, 1)
    do = torch.randn(2, 8, 4, 8) * valid_q
    ref_mask = mu.sdpa_mask(**sizes, allow_is_causal_skip=False)
    grads = {}
    for name, dtype in (("ours", torch.float32), ("ref", torch.float64),
                        ("lowp", torch.float32)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
        if name == "ours":
            out, _ = hf.attention_function(_Module(), *leaves[:3], info, scaling=0.4,
                                           sliding_window=3, s_aux=leaves[3])
        else:
            out = masked_attention(*leaves[:3], ref_mask, 0.4, sinks=leaves[3], dtype=dtype)
        grads[name] = torch.autograd.grad((out * do.to(dtype)).sum(), leaves)
    for i, what in enumerate(("dq", "dk", "dv", "dsinks")):
        assert_parity(grads["ours"][i], grads["ref"][i], grads["lowp"][i], factor=GRAD_FACTOR,
                      name=what)
    assert grads["ref"][3].abs().max() > 1e-3  # the sinks' gradient is not trivially zero


# --------------------------------------------------------------------------------------------
# Chunked masks: what the kernel is asked to compute is transformers' pattern
# --------------------------------------------------------------------------------------------
# (q_len, kv_length, q_offset, kv_offset, mask width or None (no mask), chunk, mask rows)
_CHUNKED = {
    "prefill-no-pad": (10, 10, 0, 0, None, 4, None),
    "prefill-left-pad": (10, 10, 0, 0, 10, 4, ("1111111111", "0001111111")),
    "prefill-right-pad": (10, 10, 0, 0, 10, 4, ("1111111111", "1111111000")),
    "prefill-left-right": (9, 9, 0, 0, 9, 3, ("000111111", "111111100")),
    "decode-no-pad": (1, 4, 9, 6, None, 4, None),
    "decode-left-pad": (1, 4, 9, 6, 10, 4, ("1111111111", "0011111111")),
    "decode-same-left-pad": (1, 4, 9, 6, 10, 4, ("0011111111", "0011111111")),
    "cached-prefill-across-chunks": (4, 7, 6, 3, 10, 4, ("1111111111", "0111111111")),
    "cached-prefill-no-pad": (5, 8, 6, 3, None, 4, None),
    "static-cache": (2, 12, 5, 0, 7, 4, ("1111111", "0001111")),
}


def _kernel_visibility(info, q_len, kv_len):
    """bool (batch, q_len, kv_len): which keys the kernel calls hf.attention_function makes
    for ``info`` let each query see, from the kernels' own rule (``ops.visible_mask``) over
    the keys and queries the MaskInfo hands them; padded query rows see nothing."""
    out = torch.zeros(info.batch_size, q_len, kv_len, dtype=torch.bool)
    rule = dict(causal=True, window=info.window, chunk_size=info.chunk_size)
    if info.dense:
        keys = torch.arange(info.kv_start, info.kv_used)
        out[:, :, keys] = ops.visible_mask(q_len, len(keys), **rule)
        return out
    for b in range(info.batch_size):
        q_rows = info.indices_q[info.cu_seqlens_q[b]:info.cu_seqlens_q[b + 1]] - b * q_len
        k_rows = info.indices_k[info.cu_seqlens_k[b]:info.cu_seqlens_k[b + 1]] - b * kv_len
        seen = ops.visible_mask(len(q_rows), len(k_rows), **rule)
        out[b, q_rows[:, None], k_rows[None, :]] = seen
    return out


@pytest.mark.parametrize("case", list(_CHUNKED))
def test_chunked_mask_layout_is_transformers_pattern(case):
    """No kernel runs: the keys and queries the hook hands the kernel, under the kernel's own
    chunk rule, see exactly what transformers' chunked mask lets them see."""
    q_len, kv_len, q_off, kv_off, width, chunk, rows = _CHUNKED[case]
    batch = 2
    mask2d = None if rows is None else torch.tensor([[c == "1" for c in r] for r in rows])
    if mask2d is not None:  # transformers' count: the padding before each row's first token
        left = (mask2d.long().cumsum(-1) == 0).sum(-1)
    else:
        left = torch.zeros(batch, dtype=torch.long)
    sizes = dict(batch_size=batch, q_length=q_len, kv_length=kv_len,
                 q_offset=torch.tensor(q_off) if case.startswith("static") else q_off,
                 kv_offset=kv_off, mask_function=mu.chunked_causal_mask_function(chunk, left),
                 attention_mask=mask2d, local_size=chunk)
    info = hf.mask_hook(**sizes)
    assert info.unsupported is None, info.unsupported
    assert info.chunk_size == chunk and info.window is None
    assert info.dense == (case in ("prefill-no-pad", "decode-no-pad", "decode-same-left-pad",
                                   "cached-prefill-no-pad")), info
    expected = mu.sdpa_mask(**{**sizes, "q_offset": q_off}, allow_is_causal_skip=False)[:, 0]
    if mask2d is None:
        valid_q = torch.ones(batch, q_len, dtype=torch.bool)
    else:
        padded = torch.nn.functional.pad(mask2d, (0, max(0, kv_off + kv_len - width)))
        valid_q = padded[:, q_off:q_off + q_len]
    got = _kernel_visibility(info, q_len, kv_len)
    assert torch.equal(got[valid_q], expected[valid_q])
    assert not got[~valid_q].any()


@pytest.mark.usefixtures("model_route")
def test_chunked_attention_matches_transformers_mask():
    """The kernel itself on a chunked, left/right-padded, cached call (packed) and on a dense
    one starting its keys at a chunk boundary (kv_start > 0)."""
    for case in ("cached-prefill-across-chunks", "cached-prefill-no-pad"):
        q_len, kv_len, q_off, kv_off, width, chunk, rows = _CHUNKED[case]
        mask2d = None if rows is None else torch.tensor([[c == "1" for c in r] for r in rows])
        left = (torch.zeros(2, dtype=torch.long) if mask2d is None
                else (mask2d.long().cumsum(-1) == 0).sum(-1))
        sizes = dict(batch_size=2, q_length=q_len, kv_length=kv_len, q_offset=q_off,
                     kv_offset=kv_off, mask_function=mu.chunked_causal_mask_function(chunk, left),
                     attention_mask=mask2d, local_size=chunk)
        info = hf.mask_hook(**sizes)
        assert info.dense == (mask2d is None) and info.kv_start == (1 if mask2d is None else 0)
        q, k, v = torch.randn(2, 4, q_len, 8), torch.randn(2, 2, kv_len, 8), torch.randn(
            2, 2, kv_len, 8)
        out, _ = hf.attention_function(_Module(), q, k, v, info, scaling=0.3)
        ref_mask = mu.sdpa_mask(**sizes, allow_is_causal_skip=False)
        ref = masked_attention(q, k, v, ref_mask, 0.3)
        lowp = masked_attention(q, k, v, ref_mask, 0.3, dtype=torch.float32)
        valid_q = (torch.ones(2, q_len, dtype=torch.bool) if mask2d is None
                   else mask2d[:, q_off:q_off + q_len])
        assert_parity(out[valid_q], ref[valid_q], lowp[valid_q], name=case)


# (position ids of padding-free packed rows, chunk size). transformers counts chunks by the
# tokens' position ids from 5.23 on, by their index in the row before: sequences start at a
# chunk boundary or in the middle of one, by either count, or both.
_PACKED_CHUNKED = {
    "aligned": ([[0, 1, 2, 3, 0, 1, 0, 1]], 2),
    "mid-chunk-positions-and-index": ([[3, 4, 5, 0, 1, 2]], 2),
    "mid-chunk-index": ([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2]], 4),
    "two-rows": ([[0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 7, 8, 0, 1, 2, 3]], 3),
}


@pytest.mark.parametrize("case", list(_PACKED_CHUNKED))
@pytest.mark.usefixtures("model_route")
def test_packed_chunked_attention_matches_transformers_mask(case):
    """Padding-free packed rows through a chunked layer, both masks built by this transformers'
    own ``create_chunked_causal_mask`` (whichever way this version builds them): the kernel on
    our hook's MaskInfo matches exact attention over transformers' boolean mask, whose chunks
    cut the sequences."""
    pos, chunk = _PACKED_CHUNKED[case]
    pos = torch.tensor(pos)
    batch, length = pos.shape
    cfg = _config("llama4")
    cfg.attention_chunk_size = chunk
    # The cache argument: past_key_values, renamed cache in transformers 5.24.
    params = inspect.signature(mu.create_chunked_causal_mask).parameters
    no_cache = {"cache" if "cache" in params else "past_key_values": None}
    masks = {}
    for impl in ("triton_fused", ORACLE):
        cfg._attn_implementation = impl
        masks[impl] = mu.create_chunked_causal_mask(
            config=cfg, inputs_embeds=torch.zeros(batch, length, 1), attention_mask=None,
            position_ids=pos, **no_cache)
    info, ref_mask = masks["triton_fused"], masks[ORACLE]
    assert isinstance(info, hf.MaskInfo) and info.unsupported is None, info
    seq = mu.find_packed_sequence_indices(pos)
    packed_causal = (seq[:, :, None] == seq[:, None, :]) & torch.ones(
        length, length, dtype=torch.bool).tril()
    assert not torch.equal(ref_mask[:, 0], packed_causal), "the chunks do not change the mask"
    q, k, v = (torch.randn(batch, h, length, 8) for h in (4, 2, 2))
    out, _ = hf.attention_function(_Module(), q, k, v, info, scaling=0.3)
    ref = masked_attention(q, k, v, ref_mask, 0.3)
    lowp = masked_attention(q, k, v, ref_mask, 0.3, dtype=torch.float32)
    assert_parity(out, ref, lowp, name=case)


@pytest.mark.usefixtures("model_route")
def test_kept_query_rows_of_a_mask():
    """mask[:, :, -n:, :] (Gemma 4's KV-shared layers under generate): the last n query rows,
    keys and alignment unchanged, packed layouts re-derived; any other index is refused."""
    rows = ("1111100", "0001111")
    mask2d = torch.tensor([[c == "1" for c in r] for r in rows])
    sizes = dict(batch_size=2, q_length=7, kv_length=7,
                 mask_function=mu.sliding_window_causal_mask_function(3), attention_mask=mask2d,
                 local_size=3)
    info = hf.mask_hook(**sizes)
    full_ref = mu.sdpa_mask(**sizes, allow_is_causal_skip=False)
    assert info[:, :, 0:, :] is info and info[:, :, -0:, :] is info  # logits_to_keep=0: all
    for n in (1, 3):
        kept = info[:, :, -n:, :]
        assert (kept.q_length, kept.q_offset, kept.kv_length) == (n, 7 - n, 7)
        q, k, v = torch.randn(2, 4, n, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
        out, _ = hf.attention_function(_Module(), q, k, v, kept, scaling=0.3, sliding_window=3)
        ref_mask = full_ref[:, :, -n:, :]
        ref = masked_attention(q, k, v, ref_mask, 0.3)
        lowp = masked_attention(q, k, v, ref_mask, 0.3, dtype=torch.float32)
        valid_q = mask2d[:, -n:]
        assert_parity(out[valid_q], ref[valid_q], lowp[valid_q], name=f"last {n} rows")
        assert (out[~valid_q] == 0).all()
    x = torch.randn(2, 4, 2, 8)
    for bad in ((slice(None), slice(None), slice(0, 2), slice(None)), (0, slice(None)),
                (slice(None), slice(None), slice(None, None, 2), slice(None))):
        with pytest.raises(NotImplementedError, match="indexed with"):
            hf.attention_function(_Module(), x, x, x, info[bad])


def test_new_features_refuse_what_they_cannot_do_exactly():
    """Sinks that are not one logit per head are refused; chunk layouts the fast path does
    not compute go through the whole mask."""
    module, x = _Module(), torch.randn(2, 4, 6, 8)
    kv = torch.randn(2, 2, 6, 8)
    with pytest.raises(NotImplementedError, match=r"sinks of shape \(2, 4, 6, 1\)"):
        hf.attention_function(module, x, kv, kv, None, sinks=torch.zeros(2, 4, 6, 1))
    with pytest.raises(NotImplementedError, match="both s_aux and sinks"):
        hf.attention_function(module, x, kv, kv, None, s_aux=torch.zeros(4),
                              sinks=torch.zeros(4))
    # Chunks over padding with holes, a cache that dropped keys of the query's chunk (chunk
    # 4: query 9 sees keys 8 and 9), an announced size that disagrees: the whole mask.
    chunked = dict(batch_size=2, q_length=6, kv_length=6, local_size=2)
    holes = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    left = (holes.long().cumsum(-1) == 0).sum(-1)
    assert_whole_mask({**chunked, "mask_function": mu.chunked_causal_mask_function(2, left),
                       "attention_mask": holes}, x, kv, kv, module=module)
    zero = torch.zeros(2, dtype=torch.long)
    assert_whole_mask(dict(batch_size=2, q_length=1, kv_length=1, q_offset=9, kv_offset=9,
                           mask_function=mu.chunked_causal_mask_function(4, zero),
                           local_size=4), x[:, :, :1], kv[:, :, :1], kv[:, :, :1],
                      module=module)
    assert_whole_mask({**chunked, "local_size": 3,
                       "mask_function": mu.chunked_causal_mask_function(2, zero)}, x, kv, kv,
                      module=module)


# --------------------------------------------------------------------------------------------
# Whole models: logits, generation, training
# --------------------------------------------------------------------------------------------
# What each model's feature is, for the oracle to leave it out (None: its shapes, checked by
# test_configs_have_the_features_under_test).
_FEATURE = {"gemma2": "softcap", "gpt_oss": "sinks", "llama4": "mask", "gemma4": "mask",
            "deepseek_v2": None, "deepseek_v3": None}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("model_route")
def test_logits_match_eager(kind):
    ours, eager, oracle = _models(kind)
    ids, mask = padded_batch([10, 7], 11, left=[False, True])  # right- and left-padded rows
    with torch.no_grad():
        for attention_mask in (mask, None):  # padded (packed kernel), unpadded (dense kernel)
            valid = (mask if attention_mask is not None else torch.ones_like(mask)).bool()
            out = ours(ids, attention_mask=attention_mask).logits
            ref = oracle(ids, attention_mask=attention_mask).logits
            lowp = eager(ids, attention_mask=attention_mask).logits
            assert_parity(out[valid], ref[valid], lowp[valid], name=f"{kind} logits")
            if _FEATURE[kind] is not None:  # a kernel ignoring the feature would fail above
                with _oracle_without(_FEATURE[kind]):
                    without = oracle(ids, attention_mask=attention_mask).logits
                gap = (without - ref)[valid].abs().max().item()
                err = (lowp - ref)[valid].abs().max().item()
                assert gap > 100 * err, f"{kind}: its {_FEATURE[kind]} barely changes the logits"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("model_route")
def test_greedy_generate_matches_eager(kind):
    """Left-padded prompts, dynamic KV cache, generating past the sliding windows and chunks
    (their caches drop keys: kv_offset > 0)."""
    ours, eager, _ = _models(kind)
    ids, mask = padded_batch([6, 3], 6, left=[True, True])
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = eager.generate(ids, **kw)
        got = ours.generate(ids, **kw)
    assert got.shape[1] > ids.shape[1]
    assert torch.equal(got, expected), f"{kind}: {got.tolist()} != {expected.tolist()}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("model_route")
def test_training_step_gradients_match_eager(kind):
    ours, eager, oracle = _models(kind)
    assert_training_grads_match(kind, ours, eager, oracle, [9, 6], 9, left=[False, True])
    if kind == "gpt_oss":
        assert all(layer.self_attn.sinks.grad.abs().max() > 0 for layer in ours.model.layers)


@pytest.mark.usefixtures("model_route")
def test_llama4_packed_sequences_match_eager():
    """Padding-free packed rows through the chunked layer (chunks of 4), as this transformers
    version counts chunks: by position ids (from 5.23; they restart at 0 with each sequence) or
    by the tokens' index in the row (up to 5.22: the second sequence starts mid-chunk). The
    first sequence spans two chunks either way."""
    ours, eager, oracle = _models("llama4")
    ids = torch.randint(1, VOCAB, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2]])
    with torch.no_grad():
        out, ref, lowp = (m(ids, position_ids=pos, use_cache=False).logits
                          for m in (ours, oracle, eager))
    assert_parity(out, ref, lowp, name="packed llama4 logits")
    # FlashAttention's padding-free kwargs name the sequences, not the chunks cutting them.
    cu = torch.tensor([0, 6, 9, 12], dtype=torch.int32)
    flash_kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
    with torch.no_grad():
        assert torch.equal(ours(ids, position_ids=pos, use_cache=False, **flash_kw).logits, out)
