"""kernels.hf: our kernel as a Hugging Face transformers attention implementation.

Models are built from tiny random configs (nothing is downloaded): GPT-2 (multi-head, per-layer
scaling), Llama (grouped-query heads) and Qwen2 (grouped-query heads, one full and one
sliding-window layer). The oracle is a float64 copy of the model whose attention is exact
float64 math over transformers' own boolean mask (``masking_utils.sdpa_mask``, the mask eager
attention adds); transformers' fp32 ``eager`` attention is the PyTorch baseline of the parity
rule. Without transformers (the ``[hf]`` extra) the file is skipped.
"""
import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_parity
from hf_helpers import (F64_ORACLE, VOCAB, assert_training_grads_match, assert_whole_mask,
                        masked_attention, models, padded_batch, register_f64_oracle,
                        skip_module_unless_registered)
from hf_helpers import model_route  # noqa: F401 (the fixture the tests below use)

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is not installed (pip install -e '.[hf]')")
from transformers import masking_utils as mu  # noqa: E402

from kernels import hf  # noqa: E402

skip_module_unless_registered()

ORACLE = F64_ORACLE


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_f64_oracle()


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
def _config(kind, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "gpt2":  # multi-head, scaling 1/sqrt(d) / (layer + 1)
        return transformers.GPT2Config(**{
            **dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                   attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                   scale_attn_by_inverse_layer_idx=True), **overrides})
    if kind == "llama":  # grouped-query: 4 query heads, 2 kv heads
        return transformers.LlamaConfig(**{**common, **overrides})
    if kind == "qwen2":  # grouped-query; layer 0 full attention, layer 1 a sliding window of 4
        return transformers.Qwen2Config(**{
            **common, **dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
            **overrides})
    raise ValueError(kind)


def _models(kind, **overrides):
    """(ours, eager fp32, float64 oracle): one set of random weights."""
    return models(transformers, _config(kind, **overrides), ORACLE)


# --------------------------------------------------------------------------------------------
# Registration and the name clash
# --------------------------------------------------------------------------------------------
def test_register_installs_attention_and_mask_hook():
    hf.register()  # idempotent
    assert transformers.AttentionInterface._global_mapping[hf.NAME] is hf.attention_function
    assert mu.AttentionMaskInterface._global_mapping[hf.NAME] is hf.mask_hook
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"),
                                                          attn_implementation=hf.NAME)
    assert model.config._attn_implementation == hf.NAME
    with pytest.raises(ValueError, match="hub kernels"):
        hf.register("kernels-community/flash-attn")


def test_register_refuses_transformers_before_5_4(monkeypatch):
    """transformers < 5.4 calls mask functions with cache_position instead of q_length and
    q_offset (as its sdpa_mask's signature shows): register() refuses it by name."""
    def old_sdpa_mask(batch_size, cache_position, kv_length, kv_offset=0, mask_function=None,
                      attention_mask=None, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(mu, "sdpa_mask", old_sdpa_mask)
    with pytest.raises(ImportError, match=r"transformers >= 5\.4.*cache_position"):
        hf.register()


def test_import_kernels_does_not_need_transformers():
    code = ("import sys, kernels, kernels.hf\n"
            "assert 'transformers' not in sys.modules, 'import kernels pulled transformers'\n"
            "sys.modules['transformers'] = None  # as if not installed\n"
            "try:\n    kernels.hf.register()\n"
            "except ImportError as e:\n    assert '[hf]' in str(e), e\n"
            "else:\n    raise AssertionError('register() without transformers did not raise')")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_transformers_does_not_take_our_package_for_its_kernels_hub():
    """transformers' is_kernels_available() finds the import name `kernels` (ours) and reads our
    distribution's version; inside its accepted range it would import Hugging Face kernel-hub
    symbols from us. Fails if our version (or transformers' range) ever makes that happen."""
    import importlib.util

    import kernels
    from transformers.utils import import_utils

    spec = importlib.util.find_spec("kernels")
    if spec is None or os.path.dirname(spec.origin) != os.path.dirname(kernels.__file__):
        pytest.skip("another `kernels` package shadows ours")
    found, version = import_utils._is_package_available("kernels", return_version=True)
    import_utils.is_kernels_available.cache_clear()
    assert not import_utils.is_kernels_available(), (
        f"transformers considers our `kernels` package (version {version}) to be Hugging "
        f"Face's kernel hub (accepted {import_utils.KERNELS_MIN_VERSION} <= version < "
        f"{import_utils.KERNELS_MAX_VERSION}); it would import hub symbols from us")


# --------------------------------------------------------------------------------------------
# Semantics against transformers' own mask, one attention call at a time
# --------------------------------------------------------------------------------------------
class _Module(torch.nn.Module):
    is_causal = True


# (q_len, kv_length, q_offset, kv_offset, mask width, window, 2-D mask rows as strings)
_CASES = {
    "prefill-left-right-pad": (7, 7, 0, 0, 7, None, ("1111100", "0001111")),
    "prefill-window": (7, 7, 0, 0, 7, 3, ("1111100", "0001111")),
    "prefill-window-no-pad": (7, 7, 0, 0, 7, 3, ("1111111", "1111111")),
    "cache-chunk": (3, 9, 6, 0, 9, None, ("111111111", "001111111")),
    "sliding-cache-decode": (2, 4, 8, 6, 10, 3, ("1111111111", "0000000111")),
    "sliding-cache-pad-dropped": (2, 4, 8, 6, 10, 3, ("1111111111", "0011111111")),
    "static-cache": (2, 12, 5, 0, 7, None, ("1111111", "0001111")),
    "static-cache-no-pad": (2, 12, 5, 0, 7, None, ("1111111", "1111111")),
    "holes": (6, 6, 0, 0, 6, None, ("101101", "111111")),
    # Every row padded alike: one dense call over the keys after the padding (kv_start 2).
    "same-left-pad-decode": (1, 6, 5, 0, 6, None, ("001111", "001111")),
    "same-left-pad-window": (2, 6, 4, 0, 6, 3, ("011111", "011111")),
}


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.usefixtures("model_route")
def test_attention_matches_transformers_mask(case):
    q_len, kv_len, q_off, kv_off, width, window, rows = _CASES[case]
    batch, heads, heads_kv, dim = len(rows), 4, 2, 8
    mask2d = torch.tensor([[c == "1" for c in r] for r in rows])
    assert mask2d.shape[1] == width
    fn = (mu.causal_mask_function if window is None
          else mu.sliding_window_causal_mask_function(window))
    sizes = dict(batch_size=batch, q_length=q_len, kv_length=kv_len,
                 q_offset=torch.tensor(q_off) if case.startswith("static") else q_off,
                 kv_offset=kv_off, mask_function=fn, attention_mask=mask2d, local_size=window)
    info = hf.mask_hook(**sizes)
    assert info.unsupported is None, info.unsupported
    # Dense where no key the queries can see is padding (the cache dropped row 1's padding).
    assert info.dense == (case in ("prefill-window-no-pad", "sliding-cache-pad-dropped",
                                   "static-cache-no-pad", "same-left-pad-decode",
                                   "same-left-pad-window"))
    assert info.kv_start == (2 if case == "same-left-pad-decode" else
                             1 if case == "same-left-pad-window" else 0)

    q = torch.randn(batch, heads, q_len, dim)
    k, v = torch.randn(batch, heads_kv, kv_len, dim), torch.randn(batch, heads_kv, kv_len, dim)
    out, weights = hf.attention_function(_Module(), q, k, v, info, scaling=0.3,
                                        sliding_window=window)
    assert weights is None and out.shape == (batch, q_len, heads, dim)

    ref_mask = mu.sdpa_mask(**{**sizes, "q_offset": q_off}, allow_is_causal_skip=False)
    ref = masked_attention(q, k, v, ref_mask, 0.3)
    lowp = masked_attention(q, k, v, ref_mask, 0.3, dtype=torch.float32)
    # Rows at padding positions are undefined in transformers (zeros here, as flash_attention_2).
    padded = torch.nn.functional.pad(mask2d, (0, max(0, kv_off + kv_len - width)))
    valid_q = padded[:, q_off:q_off + q_len]
    assert_parity(out[valid_q], ref[valid_q], lowp[valid_q])
    assert (out[~valid_q] == 0).all()


def test_other_patterns_use_the_whole_mask():
    """Patterns the fast layouts do not compute (extra mask functions, block-wise attention, a
    window over padding with holes) go through transformers' whole mask: exact."""
    module, x = _Module(), torch.randn(1, 2, 4, 8)
    sizes = dict(batch_size=1, q_length=4, kv_length=4)
    cases = {
        "or_mask_function": mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: q == k),
        "bidirectional and more": mu.and_masks(mu.bidirectional_mask_function,
                                               lambda b, h, q, k: q != k),
    }
    if hasattr(mu, "blockwise_overlay"):  # block-wise masks: not in transformers 5.4
        cases["block-wise"] = mu.and_masks(
            mu.causal_mask_function, mu.blockwise_overlay(torch.zeros(1, 4, dtype=torch.long)))
    for what, fn in cases.items():
        assert_whole_mask({**sizes, "mask_function": fn}, x, x, x, module=module)
    assert_whole_mask({**sizes, "mask_function": mu.sliding_window_causal_mask_function(2),
                       "attention_mask": torch.tensor([[True, False, True, True]]),
                       "local_size": 2}, x, x, x, module=module, sliding_window=2)
    # softcap, sinks (one per head), chunks and value head dims are supported: see
    # test_hf_new_models.py, which also checks their refusals.
    # Non-causal layers are computed (test_hf_encoders.py, which checks their refusals too).
    # Position biases (T5) are computed too (test_hf_encoders.py).
    with pytest.raises(NotImplementedError, match="sinks of shape"):
        hf.attention_function(module, x, x, x, None, s_aux=torch.zeros(1, 2, 4, 1))
    with pytest.raises(NotImplementedError, match="attention mask tensor"):
        hf.attention_function(module, x, x, x, torch.zeros(1, 1, 4, 4))
    with pytest.raises(NotImplementedError, match="sliding_window=2"):  # layer vs mask window
        hf.attention_function(module, x, x, x, hf.mask_hook(**sizes), sliding_window=2)


def test_models_refuse_what_they_cannot_do_exactly():
    ours, _, _ = _models("llama")
    ids = torch.randint(1, VOCAB, (1, 4))
    custom = torch.zeros(1, 1, 4, 4)  # a user's 4-D additive mask
    with torch.no_grad(), pytest.raises(NotImplementedError, match="attention mask tensor"):
        ours(ids, attention_mask=custom)


# --------------------------------------------------------------------------------------------
# Whole models: logits, generation, training
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
@pytest.mark.usefixtures("model_route")
def test_logits_match_eager(kind):
    ours, eager, oracle = _models(kind)
    ids, mask = padded_batch([7, 5], 9, left=[False, True])  # right- and left-padded rows
    with torch.no_grad():
        for attention_mask in (mask, None):  # padded (packed kernel), unpadded (dense kernel)
            valid = (mask if attention_mask is not None else torch.ones_like(mask)).bool()
            out = ours(ids, attention_mask=attention_mask).logits
            ref = oracle(ids, attention_mask=attention_mask).logits
            lowp = eager(ids, attention_mask=attention_mask).logits
            assert_parity(out[valid], ref[valid], lowp[valid], name=f"{kind} logits")


@pytest.mark.usefixtures("model_route")
def test_packed_sequences_match_eager():
    """Padding-free batches: position_ids restart at each packed sequence, no attention mask,
    no cache (transformers marks packed sequences only then)."""
    ours, eager, oracle = _models("qwen2")
    ids = torch.randint(1, VOCAB, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        out, ref, lowp = (m(ids, position_ids=pos, use_cache=False).logits
                          for m in (ours, oracle, eager))
        across = oracle(ids, position_ids=pos, use_cache=True).logits  # not marked packed
    assert not torch.allclose(ref, across), "the oracle did not treat the rows as packed"
    assert_parity(out, ref, lowp, name="packed logits")
    # FlashAttention's padding-free kwargs (DataCollatorWithFlattening) must agree with them.
    cu = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    flash_kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    with torch.no_grad():
        assert torch.equal(ours(ids, position_ids=pos, use_cache=False, **flash_kw).logits, out)
        for use_cache, bad in ((False, {"cu_seq_lens_q": cu.flip(0)}), (True, {})):
            with pytest.raises(NotImplementedError, match="cu_seq_lens"):
                ours(ids, position_ids=pos, use_cache=use_cache, **{**flash_kw, **bad})


@pytest.mark.parametrize("kind,cache", [("gpt2", "dynamic"), ("llama", "static"),
                                        ("qwen2", "dynamic")])
@pytest.mark.usefixtures("model_route")
def test_greedy_generate_matches_eager(kind, cache):
    """Left-padded batch of prompts, KV cache (q_len 1 against the cache): dynamic, or static
    (keys past the last query are empty slots); Qwen2 generates past its sliding window, so its
    window layer's cache drops keys (kv_offset > 0)."""
    ours, eager, _ = _models(kind)
    ids, mask = padded_batch([6, 3], 6, left=[True, True])
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        expected = eager.generate(ids, **kw)
        got = ours.generate(ids, **kw)
    assert got.shape[1] > ids.shape[1]
    assert torch.equal(got, expected), f"{kind}: {got.tolist()} != {expected.tolist()}"


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
@pytest.mark.usefixtures("model_route")
def test_training_step_gradients_match_eager(kind):
    ours, eager, oracle = _models(kind)
    assert_training_grads_match(kind, ours, eager, oracle, [8, 5], 8, left=[False, True])


@pytest.mark.usefixtures("model_route")
def test_training_with_dropout_is_reproducible():
    ours, _, _ = _models("llama", attention_dropout=0.25, num_hidden_layers=1)
    ours.train()
    ids = torch.randint(1, VOCAB, (2, 8))

    def step(seed):
        ours.zero_grad()
        torch.manual_seed(seed)
        loss = ours(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in ours.parameters() if p.grad is not None]

    loss_a, grads_a = step(1)
    loss_b, grads_b = step(1)
    loss_c, _ = step(2)
    assert torch.isfinite(loss_a)
    assert torch.equal(loss_a, loss_b) and all(map(torch.equal, grads_a, grads_b))
    assert not torch.equal(loss_a, loss_c), "another seed gave the same dropout mask"
    ours.eval()
    with torch.no_grad():
        assert not torch.equal(ours(ids, labels=ids).loss, loss_a), "dropout was not applied"


@pytest.mark.usefixtures("model_route")
def test_window_over_holes_matches_eager():
    """Qwen2's sliding layer over a padding mask with holes: the whole-mask path (it warns
    once), against float64 on the kept rows."""
    ours, eager, oracle = _models("qwen2")
    ids, mask = padded_batch([8, 8], 8, left=[False, False])
    mask[0, 2] = mask[1, 5] = 0
    with torch.no_grad(), pytest.warns(UserWarning, match="whole boolean mask"):
        hf._WHOLE_MASK_SAID.clear()
        out = ours(ids, attention_mask=mask).logits
    with torch.no_grad():
        ref, lowp = oracle(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert_parity(out[valid], ref[valid], lowp[valid], name="qwen2 logits, holes")
