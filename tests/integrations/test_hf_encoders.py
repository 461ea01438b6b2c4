"""kernels.hf on non-causal layers: encoders (BERT; ModernBERT's bidirectional sliding-window
layers), encoder-decoder cross-attention (BART) and transformers' bidirectional "power
feature" (``is_causal=False`` on a decoder, Llama here).

transformers builds these masks with ``create_bidirectional_mask``: every query sees every key
the 2-D padding mask keeps (the mask marks keys only, so padded query rows are computed too).
Our mask hook turns that into one dense ``causal=False`` call, or packed keys
(``kernels.attention_varlen``) where rows are padded, holes included. The oracle is a float64
copy of each model whose attention is exact float64 math over transformers' own boolean mask
(``hf_helpers.F64_ORACLE``); transformers' fp32 ``eager`` is the PyTorch baseline of the
parity rule. Tiny random configs, nothing downloaded."""
import copy
import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers import assert_parity
from hf_helpers import (F64_ORACLE, VOCAB, assert_param_grads_match, assert_whole_mask,
                        masked_attention, padded_batch, register_f64_oracle,
                        skip_module_unless_registered)
from hf_helpers import model_route  # noqa: F401 (the fixture the tests below use)

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is not installed (pip install -e '.[hf]')")
from transformers import masking_utils as mu  # noqa: E402

import kernels  # noqa: E402
from kernels import hf  # noqa: E402

skip_module_unless_registered()

ORACLE = F64_ORACLE


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_f64_oracle()


class _Layer(torch.nn.Module):
    is_causal = False


def _bert_config():
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)


def _bart_config():
    return transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, forced_eos_token_id=None)


def _triple(auto_class, config):
    """(ours, eager fp32, float64 oracle): one set of random weights on torch's default
    device (``model_route``'s)."""
    eager = auto_class.from_config(config, attn_implementation="eager").to(
        torch.get_default_device()).eval()
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(hf.NAME)
    oracle = copy.deepcopy(eager).double()
    oracle.set_attn_implementation(ORACLE)
    return ours, eager, oracle


def _holes(batch):
    ids, mask = padded_batch([9, 6, 4], 9, left=[False, True, False])
    mask[2] = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1])     # padding between tokens
    return ids.masked_fill(mask == 0, 0)[:batch], mask[:batch]


def _transformers_mask(sizes, local_size=None):
    """The boolean (batch, 1, q_len, kv_len) mask transformers' sdpa builds, never skipped."""
    return mu.sdpa_mask(**sizes, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                        local_size=local_size)


# --------------------------------------------------------------------------------------------
# One attention call against transformers' own bidirectional mask
# --------------------------------------------------------------------------------------------
# (q_len, kv_len, 2-D key padding rows as strings); q_len != kv_len is cross-attention.
_CASES = {
    "no-padding": (6, 6, None),
    "right-left-padding": (6, 6, ("111100", "001111")),
    "holes": (6, 6, ("101101", "111111")),
    "same-left-padding": (6, 6, ("001111", "001111")),        # dense over keys 2..5
    "cross-attention": (3, 7, ("1111100", "1111111")),
    "a-row-of-padding": (4, 4, ("0000", "1101")),
}


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.usefixtures("model_route")
def test_attention_matches_transformers_bidirectional_mask(case):
    q_len, kv_len, rows = _CASES[case]
    batch, heads, heads_kv, dim = 2, 4, 2, 8
    mask2d = None if rows is None else torch.tensor([[c == "1" for c in r] for r in rows])
    sizes = dict(batch_size=batch, q_length=q_len, kv_length=kv_len, q_offset=0, kv_offset=0,
                 mask_function=mu.bidirectional_mask_function, attention_mask=mask2d)
    info = hf.mask_hook(**sizes)
    assert info.unsupported is None and not info.causal, info
    assert info.dense == (case in ("no-padding", "same-left-padding"))
    assert info.kv_start == (2 if case == "same-left-padding" else 0)

    q = torch.randn(batch, heads, q_len, dim)
    k, v = torch.randn(batch, heads_kv, kv_len, dim), torch.randn(batch, heads_kv, kv_len, dim)
    out, weights = hf.attention_function(_Layer(), q, k, v, info, scaling=0.4)
    assert weights is None and out.shape == (batch, q_len, heads, dim)
    ref_mask = _transformers_mask(sizes)
    ref = masked_attention(q, k, v, ref_mask, 0.4)
    lowp = masked_attention(q, k, v, ref_mask, 0.4, dtype=torch.float32)
    # Every query row, padding positions too: the mask marks keys only, as eager reads it. A
    # row whose keys are all padding gives zeros (eager: a uniform average; sdpa: NaN).
    assert_parity(out, ref, lowp)
    if case == "a-row-of-padding":
        assert (out[0] == 0).all()


# (2-D key padding rows, or None; the window w of |q - kv| <= w)
_LOCAL = {
    "no-padding": (None, 2),
    "right-left-padding": (("1111100", "0011111"), 2),
    "same-left-padding": (("0011111", "0011111"), 1),         # dense over keys 2..6
    "wide": (("1110000", "1111111"), 9),                      # covers every key: no window
}


@pytest.mark.parametrize("case", list(_LOCAL))
@pytest.mark.usefixtures("model_route")
def test_bidirectional_window_matches_transformers_mask(case):
    """transformers' sliding_window_bidirectional_mask_function (ModernBERT's local layers):
    every query row, padded positions too, against the mask transformers builds."""
    rows, w = _LOCAL[case]
    batch, heads, heads_kv, n, dim = 2, 4, 2, 7, 8
    mask2d = None if rows is None else torch.tensor([[c == "1" for c in r] for r in rows])
    fn = mu.sliding_window_bidirectional_mask_function(w)
    sizes = dict(batch_size=batch, q_length=n, kv_length=n, q_offset=0, kv_offset=0,
                 mask_function=fn, attention_mask=mask2d)
    info = hf.mask_hook(**sizes, local_size=w)
    assert info.unsupported is None and not info.causal and info.window == w + 1, info
    assert info.dense == (case in ("no-padding", "same-left-padding"))
    q = torch.randn(batch, heads, n, dim)
    k, v = torch.randn(batch, heads_kv, n, dim), torch.randn(batch, heads_kv, n, dim)
    # The layer passes FlashAttention's convention, w + 1 (ModernBERT's sliding_window).
    out, _ = hf.attention_function(_Layer(), q, k, v, info, scaling=0.4, sliding_window=w + 1)
    ref_mask = _transformers_mask(sizes, local_size=w)
    assert ref_mask is not None and not ref_mask.all()
    ref = masked_attention(q, k, v, ref_mask, 0.4)
    lowp = masked_attention(q, k, v, ref_mask, 0.4, dtype=torch.float32)
    assert_parity(out, ref, lowp)
    if rows is None:   # no mask at all: the layer's window alone
        out, _ = hf.attention_function(_Layer(), q, k, v, None, scaling=0.4,
                                       sliding_window=w + 1)
        assert_parity(out, ref, lowp)


def test_bidirectional_window_other_layouts():
    """A window over padding with holes, or between different query and key sequences, goes
    through transformers' whole mask; a layer whose window disagrees with its mask raises."""
    x = torch.randn(1, 2, 5, 8)
    fn = mu.sliding_window_bidirectional_mask_function(2)
    holes = dict(batch_size=1, q_length=5, kv_length=5, mask_function=fn, local_size=2,
                 attention_mask=torch.tensor([[True, False, True, True, True]]))
    assert_whole_mask(holes, x, x, x, module=_Layer(), sliding_window=3)
    cross = dict(batch_size=1, q_length=3, kv_length=5, mask_function=fn, local_size=2)
    assert_whole_mask(cross, x[:, :, :3], x, x, module=_Layer(), sliding_window=3)
    info = hf.mask_hook(batch_size=1, q_length=5, kv_length=5, mask_function=fn)
    with pytest.raises(NotImplementedError, match="sliding_window=5"):
        hf.attention_function(_Layer(), x, x, x, info, sliding_window=5)
    assert "keeping only some query rows" in repr(info[:, :, -2:, :])


def test_mismatched_layers_are_refused():
    x = torch.randn(1, 2, 4, 8)
    sizes = dict(batch_size=1, q_length=4, kv_length=4)
    bidirectional = hf.mask_hook(**sizes, mask_function=mu.bidirectional_mask_function)
    causal = hf.mask_hook(**sizes)

    class Causal(torch.nn.Module):
        is_causal = True
    with pytest.raises(NotImplementedError, match="a causal layer given a bidirectional mask"):
        hf.attention_function(Causal(), x, x, x, bidirectional)
    with pytest.raises(NotImplementedError, match="a non-causal layer given a causal mask"):
        hf.attention_function(_Layer(), x, x, x, causal)
    with pytest.raises(NotImplementedError, match="a non-causal layer given a causal mask"):
        hf.attention_function(Causal(), x, x, x, causal, is_causal=False)
    with pytest.raises(NotImplementedError, match="sliding window .* not its keys"):
        hf.attention_function(_Layer(), x, x[:, :, :3], x[:, :, :3], None, sliding_window=2)
    # Image tokens, or any other mask function over the bidirectional mask: the whole mask.
    local = mu.and_masks(mu.bidirectional_mask_function, lambda b, h, q, k: abs(q - k) < 2)
    assert_whole_mask({**sizes, "mask_function": local}, x, x, x, module=_Layer())
    # No mask at all (cross-attention without an encoder mask): every key.
    out, _ = hf.attention_function(_Layer(), x, x, x, None)
    ref = masked_attention(x, x, x, None, 8 ** -0.5, dtype=torch.float32)
    assert torch.allclose(out, ref, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("padding", ["none", "right-left", "holes"])
@pytest.mark.usefixtures("model_route")
def test_bert_matches_eager(padding):
    ours, eager, oracle = _triple(transformers.AutoModel, _bert_config())
    ids, mask = _holes(3)
    if padding == "right-left":
        ids, mask = padded_batch([9, 5], 9, left=[False, True])
    attention_mask = None if padding == "none" else mask
    with torch.no_grad():
        out, ref, lowp = (m(ids, attention_mask=attention_mask).last_hidden_state
                          for m in (ours, oracle, eager))
    assert_parity(out, ref, lowp, name=f"BERT hidden states ({padding})")


@pytest.mark.parametrize("padding", ["none", "right-left"])
@pytest.mark.usefixtures("model_route")
def test_modernbert_matches_eager(padding):
    """ModernBERT: local layers (a bidirectional window of 2 positions each side) between
    global ones."""
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, local_attention=4, global_attn_every_n_layers=3,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, cls_token_id=1,
        sep_token_id=2, embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0)
    ours, eager, oracle = _triple(transformers.AutoModel, config)
    assert config.layer_types[:2] == ["full_attention", "sliding_attention"]
    ids, mask = padded_batch([9, 6], 9, left=[False, True])
    attention_mask = None if padding == "none" else mask
    with torch.no_grad():
        out, ref, lowp = (m(ids, attention_mask=attention_mask).last_hidden_state
                          for m in (ours, oracle, eager))
    assert_parity(out, ref, lowp, name=f"ModernBERT hidden states ({padding})")


@pytest.mark.usefixtures("model_route")
def test_bert_training_gradients_match_eager():
    ours, eager, oracle = _triple(transformers.AutoModelForMaskedLM, _bert_config())
    ids, mask = _holes(3)
    labels = ids.masked_fill(mask == 0, -100)
    for m in (ours, eager, oracle):
        m.train()
        m(ids, attention_mask=mask, labels=labels).loss.backward()
    assert_param_grads_match("BERT", ours, eager, oracle, at_least=10)


@pytest.mark.usefixtures("model_route")
def test_bart_cross_attention_logits_and_generate_match_eager():
    """Encoder (bidirectional, padded sources), decoder self-attention (causal) and
    cross-attention (bidirectional over the encoder's padded keys, q_len != k_len)."""
    models = _triple(transformers.AutoModelForSeq2SeqLM, _bart_config())
    src, src_mask = padded_batch([7, 4], 7, left=[False, False])
    tgt, tgt_mask = padded_batch([5, 5], 5, left=[False, False])
    _assert_seq2seq(models, src, src_mask, tgt, tgt_mask, "BART")


def _assert_seq2seq(models, src, src_mask, tgt, tgt_mask, name):
    """(ours, eager, oracle) of a seq2seq model: logits within the parity rule of the float64
    oracle's (eager's as the low-precision reference), greedy generation equal to eager's."""
    ours, eager, oracle = models
    kw = dict(attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    with torch.no_grad():
        out, ref, lowp = (m(src, **kw).logits for m in (ours, oracle, eager))
        assert_parity(out, ref, lowp, name=f"{name} logits")
        gen = dict(attention_mask=src_mask, max_new_tokens=4, do_sample=False, num_beams=1)
        assert torch.equal(ours.generate(src, **gen), eager.generate(src, **gen))


def _t5_config():
    return transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, pad_token_id=0, decoder_start_token_id=0, eos_token_id=1)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padding-with-holes"])
@pytest.mark.usefixtures("model_route")
def test_t5_position_bias_logits_generate_and_gradients_match_eager(padded, monkeypatch):
    """T5's learned relative position bias (passed to every layer as ``position_bias``):
    without padding an additive ``attn_mask`` on the native causal / bidirectional call; over
    padding (a hole in a source) added to transformers' boolean mask, as sdpa does. Logits
    against float64, greedy generation against eager, and one training step's gradients
    (``relative_attention_bias`` included) within the parity rule."""
    ours, eager, oracle = _triple(transformers.AutoModelForSeq2SeqLM, _t5_config())
    src, src_mask = padded_batch([7, 4] if padded else [7, 7], 7, left=[False, False])
    tgt, tgt_mask = padded_batch([5, 3] if padded else [5, 5], 5, left=[False, False])
    if padded:
        src_mask[0, 2] = 0
    _assert_seq2seq((ours, eager, oracle), src, src_mask, tgt, tgt_mask, "T5")
    if padded:   # one additive mask per position bias and forward, shared by its layers
        built, biased = [], hf._biased
        monkeypatch.setattr(hf, "_biased",
                            lambda *a: built.append(1) or biased(*a))
        with torch.no_grad():
            ours(src, attention_mask=src_mask, decoder_input_ids=tgt,
                 decoder_attention_mask=tgt_mask)
        # the encoder's self-attention, the decoder's and its cross-attention (one per
        # stack's two layers; was one per layer: 6)
        assert len(built) == 3, built
    labels = tgt.masked_fill(tgt_mask == 0, -100)
    for m in (ours, eager, oracle):
        m.train()
        m(src, attention_mask=src_mask, labels=labels).loss.backward()
    bias = ours.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    assert_param_grads_match("T5", ours, eager, oracle, at_least=10)


@pytest.mark.usefixtures("model_route")
def test_decoder_with_is_causal_false_matches_eager():
    """transformers' "power feature": ``is_causal=False`` makes a decoder bidirectional (its
    masks and its layers); ours computes it instead of refusing."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ours, eager, oracle = _triple(transformers.AutoModelForCausalLM, config)
    ids, mask = padded_batch([7, 5], 7, left=[False, True])
    with torch.no_grad():
        causal = ours(ids, attention_mask=mask).logits
        out, ref, lowp = (m(ids, attention_mask=mask, is_causal=False).logits
                          for m in (ours, oracle, eager))
    assert not torch.allclose(causal, out), "is_causal=False changed nothing"
    assert_parity(out, ref, lowp, name="bidirectional Llama logits")


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_random_bidirectional_masks_match_transformers(data):
    """Random padding (holes too where no window), windows, lengths and heads on the fallback
    route, every query row against transformers' own mask (derandomized: the same examples on
    every run)."""
    batch = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(1, 12))
    w = data.draw(st.one_of(st.none(), st.integers(0, 12)))
    rows = []
    for _ in range(batch):
        if w is None:
            rows.append(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        else:   # one run of kept keys: left and right padding
            a = data.draw(st.integers(0, n))
            b = data.draw(st.integers(a, n))
            rows.append([a <= j < b for j in range(n)])
    mask2d = torch.tensor(rows, dtype=torch.bool)
    fn = (mu.bidirectional_mask_function if w is None
          else mu.sliding_window_bidirectional_mask_function(w))
    sizes = dict(batch_size=batch, q_length=n, kv_length=n, q_offset=0, kv_offset=0,
                 mask_function=fn, attention_mask=mask2d)
    info = hf.mask_hook(**sizes, local_size=w)
    assert info.unsupported is None, info
    heads_kv, group, dim = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), 8
    q = torch.randn(batch, heads_kv * group, n, dim)
    k, v = torch.randn(batch, heads_kv, n, dim), torch.randn(batch, heads_kv, n, dim)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"    # the fallback, read per call for CPU tensors
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kernels.FallbackNotice)
            out, _ = hf.attention_function(_Layer(), q, k, v, info, scaling=0.5,
                                           sliding_window=None if w is None else w + 1)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    ref_mask = _transformers_mask(sizes, local_size=w)
    ref = masked_attention(q, k, v, ref_mask, 0.5)
    lowp = masked_attention(q, k, v, ref_mask, 0.5, dtype=torch.float32)
    assert_parity(out, ref, lowp)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.usefixtures("model_route")
def test_traced_padding_layout(causal, monkeypatch):
    """The layout the hook gives a plain causal or bidirectional mask with padding under
    tracing (``torch.compiler.is_compiling``): one dense call, the key padding a mask mod,
    holes too; a causal layer's padded query rows are zeros (as the packed path gives them),
    a bidirectional layer's are computed. (Other patterns: test_hf_compile.py.)"""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    rows = ("1101111", "0001111", "1111100")
    mask2d = torch.tensor([[c == "1" for c in r] for r in rows])
    batch, n, dim = 3, 7, 8
    fn = mu.causal_mask_function if causal else mu.bidirectional_mask_function
    sizes = dict(batch_size=batch, q_length=n, kv_length=n, q_offset=0, kv_offset=0,
                 mask_function=fn, attention_mask=mask2d)
    info = hf.mask_hook(**sizes)
    assert info.unsupported is None and info.dense and info.key_padding is not None, info
    layer = _Layer()
    layer.is_causal = causal
    q, k, v = torch.randn(batch, 4, n, dim), torch.randn(batch, 2, n, dim), torch.randn(
        batch, 2, n, dim)
    out, _ = hf.attention_function(layer, q, k, v, info, scaling=0.5)
    ref_mask = _transformers_mask(sizes)
    ref = masked_attention(q, k, v, ref_mask, 0.5)
    lowp = masked_attention(q, k, v, ref_mask, 0.5, dtype=torch.float32)
    kept = mask2d if causal else torch.ones_like(mask2d)
    assert_parity(out[kept], ref[kept], lowp[kept])
    assert (out[~kept] == 0).all()
