"""kernels.hf under ``torch.compile(fullgraph=True)``: the mask hook reads nothing on the host
while tracing (eager calls pack padded rows, which reads the mask). Plain causal or
bidirectional layers with padding: one dense call whose key padding is a mask mod. Anything
whose pattern lives in the mask function's closures (windows, chunks, packed sequences, extra
mask functions), or a query offset held in a tensor (static caches): transformers' own boolean
mask, read by the kernels. Each model against the float64 oracle on its valid rows, with the
eager (packed) call of the same model as the PyTorch baseline; aot_eager on CPU (the kernels
in the interpreter, or the fallback)."""
import pytest
import torch
from helpers import assert_parity
from hf_helpers import padded_batch, register_f64_oracle, skip_module_unless_registered
from hf_helpers import model_route  # noqa: F401 (the fixture the tests below use)

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is not installed (pip install -e '.[hf]')")
import test_hf  # noqa: E402
import test_hf_encoders  # noqa: E402
import test_hf_new_models  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

from kernels import hf  # noqa: E402

skip_module_unless_registered()


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_f64_oracle()
    test_hf_new_models.register_oracle()


def _models(kind):
    if kind == "bert":
        return test_hf_encoders._triple(transformers.AutoModel,
                                        test_hf_encoders._bert_config())
    if kind in ("llama", "qwen2"):
        return test_hf._models(kind)
    return test_hf_new_models._models(kind)


def _run(kind, model, ids, mask):
    out = model(ids, attention_mask=mask)
    return out.last_hidden_state if kind == "bert" else out.logits


# llama, bert: the key-padding mask mod; qwen2 (a sliding-window layer), gemma4 (a sliding
# layer, head_dim 512, KV-shared layers that keep the last query rows of a mask): the whole
# mask.
@pytest.mark.parametrize("kind", ["llama", "bert", "qwen2", "gemma4"])
@pytest.mark.usefixtures("model_route")
def test_fullgraph_compile_with_padding(kind):
    ours, _, oracle = _models(kind)
    ids, mask = padded_batch([9, 6], 9, left=[False, True])
    mask[0, 3] = 0                                   # a hole: nothing is packed here
    if kind in ("qwen2", "gemma4"):                  # eager refuses a window over a hole
        mask[0, 3] = 1
    compiled = torch.compile(lambda ids, mask: _run(kind, ours, ids, mask), fullgraph=True,
                             backend="aot_eager")
    try:
        with torch.no_grad():
            got = compiled(ids, mask)
            eager, ref = _run(kind, ours, ids, mask), _run(kind, oracle, ids, mask)
    finally:
        torch._dynamo.reset()
    rows = torch.ones_like(mask, dtype=torch.bool) if kind == "bert" else mask.bool()
    assert_parity(got[rows], ref[rows], eager[rows], name=f"{kind} compiled, padded")


@pytest.mark.usefixtures("model_route")
def test_fullgraph_compile_t5_with_position_bias_and_padding():
    """T5 (its position bias added to transformers' boolean mask while tracing: padded
    encoder self-attention, causal decoder, cross-attention) under fullgraph=True."""
    ours, eager, oracle = test_hf_encoders._triple(transformers.AutoModelForSeq2SeqLM,
                                                   test_hf_encoders._t5_config())
    src, src_mask = padded_batch([7, 4], 7, left=[False, False])
    tgt, tgt_mask = padded_batch([5, 3], 5, left=[False, False])
    kw = dict(attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    compiled = torch.compile(lambda src, kw: ours(src, **kw).logits, fullgraph=True,
                             backend="aot_eager")
    try:
        with torch.no_grad():
            got = compiled(src, kw)
            ref, lowp = (m(src, **kw).logits for m in (oracle, eager))
    finally:
        torch._dynamo.reset()
    assert_parity(got, ref, lowp, name="T5 compiled, padded")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.usefixtures("model_route")
def test_compiled_static_cache_generate_matches_eager(kind):
    """transformers' compiled decoding: a static cache, the forward under
    ``torch.compile(fullgraph=True)``, left-padded prompts; Qwen2's sliding layer generates past
    its window. generate prepares each step's masks outside the compiled forward (our hook in
    eager, a tensor query offset) and passes them in, where the hook takes them back. Greedy
    tokens equal eager sdpa's."""
    ours, eager, _ = test_hf._models(kind)
    ids, mask = padded_batch([6, 3], 6, left=[True, True])
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    try:
        with torch.no_grad():
            expected = eager.generate(ids, **kw)
            ours.forward = torch.compile(ours.forward, fullgraph=True, backend="aot_eager")
            got = ours.generate(ids, **kw)
    finally:
        torch._dynamo.reset()
    assert got.shape[1] == ids.shape[1] + 4
    assert torch.equal(got, expected), f"{kind}: {got.tolist()} != {expected.tolist()}"


def test_traced_mask_takes_tensor_offsets_and_any_pattern(monkeypatch):
    """While tracing, a query offset held in a tensor (static caches) and an extra mask
    function (refused in eager calls) both go through transformers' own mask."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    fn = mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: k == 0)   # an attention sink
    sizes = dict(batch_size=2, q_length=3, kv_length=8, q_offset=torch.tensor(5),
                 kv_offset=0, mask_function=fn,
                 attention_mask=torch.tensor([[1] * 8, [0, 0] + [1] * 6]).bool())
    info = hf.mask_hook(**sizes)
    assert info.unsupported is None and info.dense_mask is not None
    expected = mu.sdpa_mask(**sizes, allow_is_causal_skip=False)
    assert torch.equal(info.dense_mask.mask, expected)
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 8, 8)
    layer = torch.nn.Module()
    out, _ = hf.attention_function(layer, q, k, k, info, scaling=0.5)
    ref = test_hf_encoders.masked_attention(q, k, k, expected, 0.5)
    lowp = test_hf_encoders.masked_attention(q, k, k, expected, 0.5, dtype=torch.float32)
    assert_parity(out, ref, lowp)
    kept = info[:, :, -1:, :]                        # a model keeping the last query row
    assert torch.equal(kept.dense_mask.mask, expected[:, :, -1:])
    # Read in place (a slice: batch stride 3 rows), not as a (2, 1, 8) mask of its own.
    out, _ = hf.attention_function(layer, q[:, :, -1:], k, k, kept, scaling=0.5)
    ref = test_hf_encoders.masked_attention(q[:, :, -1:], k, k, expected[:, :, -1:], 0.5)
    lowp = test_hf_encoders.masked_attention(q[:, :, -1:], k, k, expected[:, :, -1:], 0.5,
                                             dtype=torch.float32)
    assert_parity(out, ref, lowp, name="kept rows of a whole mask")


def test_whole_mask_skips_the_tiles_it_hides(monkeypatch):
    """Through the whole mask a chunked causal pattern (chunks of 128, whole tiles of every
    width up to 128) never reads another chunk's tiles: NaN values of keys 0..127 leave the
    second chunk's rows as they were, NaN queries 0..127 leave its keys' dK / dV. Without the
    bounds every tile is visited (NaN reaches them)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    chunk, n = 128, 144
    sizes = dict(batch_size=2, q_length=n, kv_length=n, q_offset=0, kv_offset=0,
                 mask_function=mu.chunked_causal_mask_function(chunk, torch.zeros(2, dtype=torch.long)),
                 attention_mask=torch.ones(2, n, dtype=torch.bool))
    info = hf.mask_hook(**sizes)
    assert info.dense_mask is not None
    layer = torch.nn.Module()
    q, k, v = (torch.randn(2, 2, n, 16, requires_grad=True) for _ in range(3))

    def run(q, k, v):
        out, _ = hf.attention_function(layer, q, k, v, info, scaling=0.25)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return out.detach(), dk, dv

    out, dk, dv = run(q, k, v)
    pv, pq = v.detach().clone(), q.detach().clone()
    pv[:, :, :chunk], pq[:, :, :chunk] = float("nan"), float("nan")
    poisoned_v = run(q, k, pv.requires_grad_())[0]
    _, dk_q, dv_q = run(pq.requires_grad_(), k, v)
    assert torch.equal(poisoned_v[:, chunk:], out[:, chunk:])
    assert torch.equal(dk_q[:, :, chunk:], dk[:, :, chunk:])
    assert torch.equal(dv_q[:, :, chunk:], dv[:, :, chunk:])
