"""Generation: split-KV (flash-decoding), packed GQA heads and attention_with_kvcache.

Against the float64 oracles (reference.attention, reference.attention_with_kvcache) with the
parity rule; on CPU every kernel runs in Triton's interpreter.
"""
import pytest
import torch
from helpers import DEVICE, assert_parity, randn

import kernels
import reference
from kernels.core.configs import MAX_SPLITS, clamp_splits, num_splits_heuristic
from kernels.core.forward import attention_forward

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


# ------------------------------------------------------------------------------------------
# Split-KV inside kernels.attention
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_len,k_len,hq,hkv,dtype", [
    (1, 300, 4, 1, F16),      # decoding, MQA: packed heads
    (4, 300, 8, 2, BF16),     # speculative decoding, GQA: packed heads
    (1, 17, 2, 2, F32),
    (4, 1, 2, 2, F16),        # one key: rows 0..2 see nothing in any split
    (37, 120, 4, 2, F16),     # a prefill-sized q_len: unpacked
], ids=lambda x: str(x).replace("torch.", ""))
def test_split_kv_parity(q_len, k_len, hq, hkv, dtype):
    q, k, v = randn(2, hq, q_len, 32, dtype=dtype), randn(2, hkv, k_len, 32, dtype=dtype), \
        randn(2, hkv, k_len, 32, dtype=dtype)
    ref = reference.attention(q, k, v)
    lowp = reference.attention(q, k, v, upcast=False)
    outs = {}
    for splits in (1, 2, 3, 7):
        out, lse = kernels.attention(q, k, v, num_splits=splits, return_lse=True)
        assert_parity(out, ref, lowp, name=f"num_splits={splits}")
        outs[splits] = (out, lse)
    for splits in (2, 3, 7):
        assert_parity(outs[splits][0], outs[1][0].double(), lowp, name="split vs unsplit")
        torch.testing.assert_close(outs[splits][1], outs[1][1], rtol=0, atol=1e-5)
    again = kernels.attention(q, k, v, num_splits=3)
    assert torch.equal(again, outs[3][0])      # a fixed merge order: deterministic


def test_split_kv_dropout_mask_is_the_unsplit_mask():
    """The keep bit of (row, column) does not depend on which split visits it: the split output
    matches the oracle under reference.dropout_keep_mask, and the gradients still flow."""
    q = randn(1, 4, 3, 16, dtype=F16, requires_grad=True)
    k, v = randn(1, 2, 90, 16, dtype=F16), randn(1, 2, 90, 16, dtype=F16)
    keep = reference.dropout_keep_mask(77, 1, 4, 3, 90, 0.3, device=DEVICE)
    kw = dict(dropout_p=0.3, keep_mask=keep)
    ref, lowp = reference.attention(q, k, v, **kw), reference.attention(q, k, v, upcast=False,
                                                                         **kw)
    for splits in (1, 4):
        out = kernels.attention(q, k, v, dropout_p=0.3, seed=77, num_splits=splits)
        assert_parity(out, ref, lowp, name=f"num_splits={splits}")
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("window,causal", [(5, True), (None, False)])
def test_split_kv_window_and_packed_sequences(window, causal):
    """Splits of a windowed block, and of packed sequences (the launcher, forced)."""
    q, k, v = randn(1, 4, 2, 16), randn(1, 2, 70, 16), randn(1, 2, 70, 16)
    out = kernels.attention(q, k, v, window=window, causal=causal, num_splits=3)
    kw = dict(window=window, causal=causal)
    assert_parity(out, reference.attention(q, k, v, **kw),
                  reference.attention(q, k, v, upcast=False, **kw))
    lens_q, lens_k = [3, 0, 20], [40, 5, 21]
    cu_q = torch.tensor([0, 3, 3, 23], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 40, 45, 66], dtype=torch.int32, device=DEVICE)
    qp, kp, vp = randn(23, 4, 16), randn(66, 2, 16), randn(66, 2, 16)
    got, lse = attention_forward(qp, kp, vp, causal=causal, softmax_scale=0.25, dropout_p=0.0,
                                 seed=0, window=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                 num_splits=3)
    want, want_lse = attention_forward(qp, kp, vp, causal=causal, softmax_scale=0.25,
                                       dropout_p=0.0, seed=0, window=window, cu_seqlens_q=cu_q,
                                       cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                       max_seqlen_k=max(lens_k), num_splits=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)


def test_num_splits_heuristic():
    """A pure function of the shapes and the SM count (FlashAttention-2's rule)."""
    assert num_splits_heuristic(torch.device("cuda"), 200, 512, sm_count=132) == 1  # full GPU
    assert num_splits_heuristic(torch.device("cuda"), 8, 1, sm_count=132) == 1      # one tile
    s = num_splits_heuristic(torch.device("cuda"), 8, 512, sm_count=132)  # decode, b1, 8 kv heads
    assert 8 * s >= 0.8 * 132 * 0.85 and s <= MAX_SPLITS
    assert num_splits_heuristic(torch.device("cpu"), 1, 512) == 1
    assert clamp_splits(500, 10 ** 6) == MAX_SPLITS and clamp_splits(7, 17) == 2


@pytest.mark.parametrize("bad,err", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_num_splits_bad(bad, err):
    q = randn(1, 2, 1, 16)
    with pytest.raises(err, match="num_splits"):
        kernels.attention(q, q, q, num_splits=bad)


# ------------------------------------------------------------------------------------------
# attention_with_kvcache
# ------------------------------------------------------------------------------------------
def _cache(b, hkv, max_len, d, dtype=F32):
    return randn(b, hkv, max_len, d, dtype=dtype), randn(b, hkv, max_len, d, dtype=dtype)


@pytest.mark.parametrize("q_len,hq,hkv,window,causal,append,splits,dtype", [
    (1, 4, 2, None, True, True, 0, F16),
    (1, 4, 1, None, True, True, 3, BF16),
    (4, 4, 2, 7, True, True, 2, F32),
    (3, 2, 2, None, False, True, 1, F16),
    (2, 4, 2, None, True, False, 2, F32),     # attend to the cache as filled, no append
], ids=lambda x: str(x).replace("torch.", ""))
def test_kvcache_parity_and_append(q_len, hq, hkv, window, causal, append, splits, dtype):
    B, max_len, d = 3, 80, 16
    lens = torch.tensor([0, 5, 63], dtype=torch.int32, device=DEVICE)
    if not append:
        lens = torch.tensor([1, 5, 63], dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = _cache(B, hkv, max_len, d, dtype)
    before = (k_cache.clone(), v_cache.clone())
    q = randn(B, hq, q_len, d, dtype=dtype)
    k, v = (randn(B, hkv, q_len, d, dtype=dtype) for _ in range(2)) if append else (None, None)
    out, lse = kernels.attention_with_kvcache(q, k_cache, v_cache, lens, k, v, causal=causal,
                                              window=window, num_splits=splits, return_lse=True)
    assert out.shape == q.shape and lse.shape == (B, hq, q_len)
    caches = [t.clone() for t in before]
    ref = reference.attention_with_kvcache(q, *caches, lens, k, v, causal=causal, window=window)
    caches_lowp = [t.clone() for t in before]
    lowp = reference.attention_with_kvcache(q, *caches_lowp, lens, k, v, causal=causal,
                                            window=window, upcast=False)
    assert_parity(out, ref, lowp)
    # The append, element by element: new rows at their offsets, everything else untouched.
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    if append:
        for b, n in enumerate(lens.tolist()):
            assert torch.equal(k_cache[b, :, n:n + q_len], k[b])
            assert torch.equal(k_cache[b, :, :n], before[0][b, :, :n])
            assert torch.equal(v_cache[b, :, n + q_len:], before[1][b, :, n + q_len:])


def test_kvcache_inference_mode_and_compile():
    k_cache, v_cache = _cache(2, 2, 40, 16)
    lens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    q, k, v = randn(2, 4, 1, 16), randn(2, 2, 1, 16), randn(2, 2, 1, 16)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    with torch.inference_mode():
        eager = kernels.attention_with_kvcache(q, k_cache, v_cache, lens, k, v)

    def step(q, kc, vc, k, v):
        return kernels.attention_with_kvcache(q, kc, vc, lens, k, v)

    compiled = torch.compile(step, fullgraph=True,
                             backend="aot_eager" if DEVICE == "cpu" else "inductor")
    got = compiled(q, kc2, vc2, k, v)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
    assert torch.equal(kc2, k_cache) and torch.equal(vc2, v_cache)   # the mutation is kept


def test_generation_with_preallocated_cache_matches_no_cache():
    """The reference GPTModel (tiny config) generating greedily with a preallocated cache and
    attention_with_kvcache gives the same tokens as the model without a cache."""
    torch.manual_seed(3)
    cfg = dict(vocab_size=50, context_length=32, emb_dim=32, n_heads=4, n_layers=2,
               drop_rate=0.0, qkv_bias=True)
    model = reference.GPTModel(cfg).to(DEVICE).eval()
    prompt = torch.randint(0, 50, (2, 5), device=DEVICE)
    n_new = 6
    want = reference.generate_text_simple(model, prompt, n_new, cfg["context_length"])

    H, hd = cfg["n_heads"], cfg["emb_dim"] // cfg["n_heads"]
    caches = [_cache(2, H, cfg["context_length"], hd) for _ in range(cfg["n_layers"])]
    lens = torch.zeros(2, dtype=torch.int32, device=DEVICE)

    def step(idx):
        b, n = idx.shape
        pos = torch.arange(int(lens[0]), int(lens[0]) + n, device=DEVICE)
        x = model.tok_emb(idx) + model.pos_emb(pos)
        for blk, (kc, vc) in zip(model.trf_blocks, caches):
            h = blk.norm1(x)
            att = blk.att
            q, k, v = (lin(h).view(b, n, H, hd).transpose(1, 2)
                       for lin in (att.W_query, att.W_key, att.W_value))
            o = kernels.attention_with_kvcache(q, kc, vc, lens, k, v)
            x = x + att.out_proj(o.transpose(1, 2).reshape(b, n, cfg["emb_dim"]))
            x = x + blk.ff(blk.norm2(x))
        lens.add_(n)
        return model.out_head(model.final_norm(x))[:, -1]

    with torch.inference_mode():
        tokens = prompt
        logits = step(prompt)
        for _ in range(n_new):
            nxt = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            logits = step(nxt)
    assert torch.equal(tokens, want)


I32 = torch.int32


# Cache lengths are checked on the host only: lengths on the GPU are the caller's contract and
# never read (that would sync; attention_with_kvcache's docstring). The cases of these checks run
# the whole call on the CPU, on every machine: validation raises before any kernel launches.
HOST_CHECKED = ("must be >= 0", "must fit the cache")


@pytest.mark.parametrize("change,err,match", [
    (dict(cache_seqlens=torch.tensor([1, 2], dtype=torch.int64, device=DEVICE)), ValueError,
     "cache_seqlens must be int32"),
    (dict(cache_seqlens=torch.tensor([1], dtype=I32, device=DEVICE)), ValueError,
     r"shape \(batch,\)"),
    (dict(cache_seqlens=[1, 2]), TypeError, "cache_seqlens must be a torch.Tensor"),
    (dict(v_cache=randn(2, 2, 30, 16)), ValueError, "k_cache and v_cache must have one shape"),
    (dict(q=randn(2, 4, 1, 16, dtype=F16)), ValueError, "q must match the caches' dtype"),
    (dict(q=randn(3, 4, 1, 16)), ValueError, "q must match the caches"),
    (dict(v=None), ValueError, "k and v must be given together"),
    (dict(k=randn(2, 2, 3, 16)), ValueError, r"k must be \(batch, heads_kv, q_len, head_dim\)"),
    (dict(q=randn(2, 3, 1, 16)), ValueError, "multiple of the key/value heads"),
    (dict(cache_seqlens=torch.tensor([-1, 2], dtype=I32)), ValueError, "must be >= 0"),
    (dict(cache_seqlens=torch.tensor([1, 40], dtype=I32)), ValueError, "must fit the cache"),
    (dict(num_splits=-2), ValueError, "num_splits"),
], ids=["lens-int64", "lens-shape", "lens-list", "cache-shapes", "q-dtype", "q-batch",
        "k-without-v", "k-shape", "heads", "negative-len", "overflow", "splits"])
def test_kvcache_bad_input(change, err, match):
    args = dict(q=randn(2, 4, 1, 16), k_cache=randn(2, 2, 40, 16), v_cache=randn(2, 2, 40, 16),
                cache_seqlens=torch.tensor([1, 2], dtype=I32, device=DEVICE),
                k=randn(2, 2, 1, 16), v=randn(2, 2, 1, 16))
    args.update(change)
    if match in HOST_CHECKED:
        args = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    with pytest.raises(err, match=match):
        kernels.attention_with_kvcache(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,cache_len", [(1, 32768), (8, 4096)])
def test_decode_gpu(batch, cache_len):
    """Decoding sizes: 32 query heads, 8 kv heads, head_dim 128, bf16, heuristic splits."""
    k_cache, v_cache = _cache(batch, 8, cache_len + 16, 128, BF16)
    lens = torch.full((batch,), cache_len, dtype=I32, device=DEVICE)
    q, k, v = randn(batch, 32, 1, 128, dtype=BF16), randn(batch, 8, 1, 128, dtype=BF16), \
        randn(batch, 8, 1, 128, dtype=BF16)
    out = kernels.attention_with_kvcache(q, k_cache, v_cache, lens, k, v)
    ref = reference.attention(q, k_cache[:, :, :cache_len + 1], v_cache[:, :, :cache_len + 1])
    lowp = reference.attention(q, k_cache[:, :, :cache_len + 1], v_cache[:, :, :cache_len + 1],
                               upcast=False)
    assert_parity(out, ref, lowp)
