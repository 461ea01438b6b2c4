"""``attention(attn_mask=)``: SDPA's boolean mask read by the kernels (the interpreter on CPU)
through their mask mod, and its additive float mask through their score mod, against the
float64 oracle (the mask as its mask; the bias as its score mod, -inf entries as its mask):
forward, lse and gradients (the bias's too) for every broadcast shape and odd memory layouts,
with causal and GQA, on both routes; the tile bounds equal a loop's and skip the tiles a mask
hides (NaN there never reaches the result); bad masks are clear errors."""
import pytest
import torch
import triton
import triton.language as tl

import kernels
from kernels.core import tensor_mask
from tests.helpers import DEVICE, assert_parity, check_call, randn

B, HQ, HKV = 2, 4, 2


def _mask(shape, seed, keep=0.7):
    """A random bool mask of ``shape`` with random spans (empty rows included) and holes."""
    gen = torch.Generator().manual_seed(seed)
    k_len = shape[-1]
    lo = torch.randint(0, k_len + 1, (*shape[:-1], 1), generator=gen)
    hi = lo + torch.randint(0, k_len + 1, (*shape[:-1], 1), generator=gen)
    cols = torch.arange(k_len)
    return ((cols >= lo) & (cols < hi) & (torch.rand(shape, generator=gen) < keep)).to(DEVICE)


def _case(mask, **kwargs):
    """The kernels' call with ``attn_mask`` and the oracle's with the same mask as its mask."""
    return (dict(attn_mask=mask, **kwargs),
            dict(mask_mod=lambda b, h, q_idx, kv_idx, aux: mask, **kwargs))


@pytest.mark.parametrize("q_len,k_len,shape", [
    (19, 23, (B, HQ, 19, 23)),          # per batch entry and head
    (17, 97, (B, 1, 17, 97)),           # per batch entry (transformers' masks)
    (1, 200, (B, 1, 1, 200)),           # key padding, one query row
    (40, 33, (40, 33)),                 # one mask for every batch entry and head
    (33, 17, (HQ, 33, 17)),             # 3-D: per head (right-aligned, as SDPA broadcasts)
])
def test_attn_mask_matches_the_oracle(q_len, k_len, shape, route):
    """Both routes: the kernels' mask mod and its PyTorch twin in the fallback."""
    if route.device != DEVICE:
        pytest.skip(f"the fallback route runs on {route.device}; this test's tensors are on "
                    f"{DEVICE}")
    mask = _mask(shape, seed=q_len * k_len)
    kernel, oracle = _case(mask, causal=False)
    check_call(kernel, b=B, hq=HQ, hkv=HKV, q_len=q_len, k_len=k_len, oracle_case=oracle)


def _check_bias(bias, q_len, k_len, causal=False, dtype=torch.float32, mask_mod=None):
    """The parity rule on out, lse, dq / dk / dv and the bias's own gradient: the oracle adds
    the bias's finite entries by a score mod (differentiating it) and takes its -inf entries as
    its mask (a row left without keys gives zeros in both); ``mask_mod``: the call's own, on
    top."""
    seen = bias.detach() > float("-inf")

    def oracle_mask(b_, h, q_idx, kv_idx, aux):
        return seen if mask_mod is None else seen & mask_mod.torch_fn(b_, h, q_idx, kv_idx, aux)

    check_call(dict(attn_mask=bias, causal=causal, mask_mod=mask_mod), dtype, b=B, hq=HQ,
               hkv=HKV, q_len=q_len, k_len=k_len, leaves=(bias,), oracle_case=lambda b: dict(
                   causal=causal, mod_aux=(b,),
                   score_mod=lambda s, b_, h, q_idx, kv_idx, aux: s + aux[0].masked_fill(
                       ~seen, 0.0).to(s.dtype),
                   mask_mod=oracle_mask))


@pytest.mark.parametrize("q_len,k_len,shape", [
    (19, 23, (B, HQ, 19, 23)),          # per batch entry and head
    (17, 97, (1, HQ, 17, 97)),          # T5's position bias: per head, shared by the batch
    (1, 200, (B, 1, 1, 200)),           # per key
    (40, 33, (40, 33)),                 # one for every batch entry and head
])
def test_additive_mask_matches_the_oracle(q_len, k_len, shape, route):
    """Both routes, -inf entries included (some rows see nothing); the bias's gradient summed
    over its broadcast dims."""
    if route.device != DEVICE:
        pytest.skip(f"the fallback route runs on {route.device}; this test's tensors are on "
                    f"{DEVICE}")
    seen = _mask(shape, seed=q_len + k_len)
    bias = (randn(*shape) * 2).masked_fill(~seen, float("-inf")).requires_grad_()
    _check_bias(bias, q_len, k_len)


def test_additive_mask_with_causal_in_low_precision():
    """A bf16 bias on bf16 inputs (converted to float32 once), causal, a transposed view."""
    q_len = k_len = 21
    bias = (randn(1, HQ, k_len, q_len) * 2).to(torch.bfloat16).transpose(-1, -2)
    _check_bias(bias.detach().requires_grad_(), q_len, k_len, causal=True,
                dtype=torch.bfloat16)


@triton.jit
def _even_keys_fn(b, h, q_idx, kv_idx, aux):
    return (kv_idx % 2) == 0


def _even_keys_torch(b, h, q_idx, kv_idx, aux):
    return (kv_idx % 2) == 0


@triton.jit
def _distance_fn(s, b, h, q_idx, kv_idx, aux):
    return s - 0.05 * tl.abs(q_idx - kv_idx).to(tl.float32)


def _distance_torch(s, b, h, q_idx, kv_idx, aux):
    return s - 0.05 * (q_idx - kv_idx).abs().to(s.dtype)


EVEN_KEYS = kernels.MaskMod("test_attn_mask.even_keys", _even_keys_fn, _even_keys_torch)
DISTANCE = kernels.ScoreMod("test_attn_mask.distance", _distance_fn, _distance_torch)


def test_attn_mask_keeps_the_other_mod():
    """A boolean attn_mask takes the mask mod's place and keeps the call's score mod; an
    additive one takes the score mod's place and keeps its mask mod (both had been dropped
    without a word: max error 1.66 with an even-keys mask mod under a zero bias)."""
    mask = _mask((B, 1, 19, 23), seed=11)
    kernel, oracle = _case(mask, causal=False, score_mod=DISTANCE)
    check_call(kernel, b=B, hq=HQ, hkv=HKV, q_len=19, k_len=23, oracle_case=oracle)
    bias = (randn(B, 1, 19, 23) * 2).requires_grad_()
    _check_bias(bias, 19, 23, causal=True, mask_mod=EVEN_KEYS)


def test_attn_mask_with_causal_and_odd_layouts():
    """On top of causal (bottom-right); a transposed view, a stride-0 expand and a slice with
    a non-unit last stride are read in place."""
    q_len, k_len = 21, 30
    base = _mask((B, 1, k_len, q_len), seed=3)
    for mask in (base.transpose(-1, -2),                               # transposed view
                 _mask((1, 1, q_len, 1), seed=4).expand(B, HQ, q_len, k_len),   # stride 0
                 _mask((B, 1, q_len, 2 * k_len), seed=5)[..., ::2]):   # last stride 2
        kernel, oracle = _case(mask, causal=True)
        check_call(kernel, b=B, hq=HQ, hkv=HKV, q_len=q_len, k_len=k_len, oracle_case=oracle)


def test_a_prepared_mask_is_the_tensor():
    """``TensorMask`` (bounds computed once) gives the tensor's results, bit for bit."""
    q, k, v = (randn(B, HQ, 17, 16) for _ in range(3))
    mask = _mask((B, 1, 17, 17), seed=6)
    prepared = kernels.TensorMask(mask)
    out = kernels.attention(q, k, v, causal=False, attn_mask=mask)
    assert torch.equal(kernels.attention(q, k, v, causal=False, attn_mask=prepared), out)
    assert torch.equal(kernels.attention(q, k, v, causal=False, attn_mask=prepared), out)


def _brute_spans(mask, group):
    """Per group of ``group`` rows of bool (q, k) ``mask`` the [lo, hi) of the keys any row
    sees, (k, 0) for none: a loop, independent of the reductions it checks."""
    q_len, k_len = mask.shape
    spans = []
    for g0 in range(0, q_len, group):
        cols = [j for j in range(k_len) if mask[g0:g0 + group, j].any()]
        spans.append([cols[0], cols[-1] + 1] if cols else [k_len, 0])
    return spans


@pytest.mark.parametrize("q_len,k_len", [(1, 1), (17, 97), (40, 1), (200, 33)])
def test_tile_bounds_are_the_spans(q_len, k_len):
    """Per 16 query rows the keys from the first seen (in any head) to the last, per 16 keys
    the rows that see them, equal to a loop's over random masks (holes, empty rows, an entry
    that sees nothing), ragged last groups included."""
    mask = _mask((3, 2, q_len, k_len), seed=q_len * 1000 + k_len).cpu()
    mask[0] = False
    key_bounds, query_bounds = kernels.TensorMask(mask).bounds(q_len, k_len)
    seen = mask.any(1)
    for b in range(3):
        assert key_bounds[b].tolist() == _brute_spans(seen[b], tensor_mask._GROUP)
        assert query_bounds[b].tolist() == _brute_spans(seen[b].T, tensor_mask._GROUP)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def _block_diagonal(n, block):
    pos = torch.arange(n, device=DEVICE)
    return (pos[:, None] // block) == (pos[None, :] // block)


def test_attn_mask_skips_the_tiles_it_hides():
    """A block-diagonal mask of blocks of 128 positions (whole tiles of every width up to 128)
    over 144: NaN values of keys 0..127 leave the second block's rows as they were, NaN queries
    0..127 leave its keys' dK / dV. Without the bounds (the same mask as a mask mod without
    ranges) every tile is visited and NaN reaches them."""
    block, n = 128, 144
    mask = _block_diagonal(n, block)
    q, k, v = (randn(1, 2, n, 16, requires_grad=True) for _ in range(3))

    def run(q, k, v, **kw):
        out = kernels.attention(q, k, v, causal=False, **kw)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return out.detach(), dk, dv

    out, dk, dv = run(q, k, v, attn_mask=mask)
    pv, pq = v.detach().clone(), q.detach().clone()
    pv[:, :, :block], pq[:, :, :block] = float("nan"), float("nan")
    poisoned = run(q, k, pv.requires_grad_(), attn_mask=mask)[0]
    _, dk_q, dv_q = run(pq.requires_grad_(), k, v, attn_mask=mask)
    assert torch.equal(poisoned[:, :, block:], out[:, :, block:])
    assert torch.equal(dk_q[:, :, block:], dk[:, :, block:])
    assert torch.equal(dv_q[:, :, block:], dv[:, :, block:])
    unbounded = kernels.MaskMod("tests.attn_mask_unbounded", tensor_mask.TENSOR_MASK.fn,
                                tensor_mask.TENSOR_MASK.torch_fn)
    aux = kernels.TensorMask(mask).aux(1, 2, n, n)
    blind = kernels.attention(q.detach(), k.detach(), pv, causal=False, mask_mod=unbounded,
                              mod_aux=aux)
    assert torch.isnan(blind[:, :, block:]).any()


@pytest.mark.parametrize("shape", [(B, 1, 40, 40), (1, HQ, 33, 50)])
def test_additive_mask_with_tile_bounds_matches_the_oracle(shape, route, monkeypatch):
    """From BIAS_BOUNDS_MIN_PAIRS pairs on (lowered here to reach it at small sizes) an
    additive mask also takes the mask mod's place for its tile bounds: the same results, the
    bias's gradient included, causal or not, -inf rows included; both routes."""
    if route.device != DEVICE:
        pytest.skip(f"the fallback route runs on {route.device}; this test's tensors are on "
                    f"{DEVICE}")
    monkeypatch.setattr(tensor_mask, "BIAS_BOUNDS_MIN_PAIRS", 0)
    q_len, k_len = shape[2:]
    seen = _mask(shape, seed=q_len + 7 * k_len)
    bias = (randn(*shape) * 2).masked_fill(~seen, float("-inf")).requires_grad_()
    for causal in (False, True):
        _check_bias(bias, q_len, k_len, causal=causal)


def test_additive_mask_skips_the_tiles_it_hides(monkeypatch):
    """A block-diagonal bias (0 in blocks of 128 positions, -inf elsewhere) over 144, with
    bounds: NaN values of keys 0..127 leave the second block's rows as they were, NaN queries
    0..127 its keys' dK / dV. Below BIAS_BOUNDS_MIN_PAIRS (no bounds) every tile is visited and
    NaN reaches them."""
    block, n = 128, 144
    bias = torch.zeros(n, n, device=DEVICE).masked_fill(~_block_diagonal(n, block),
                                                        float("-inf"))
    q, k, v = (randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
    pv, pq = v.detach().clone(), q.detach().clone()
    pv[:, :, :block], pq[:, :, :block] = float("nan"), float("nan")

    def run(q, k, v):
        out = kernels.attention(q, k, v, causal=False, attn_mask=bias)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return out.detach(), dk, dv

    assert n * n < tensor_mask.BIAS_BOUNDS_MIN_PAIRS
    assert torch.isnan(run(q, k, pv.requires_grad_())[0][:, :, block:]).any()
    monkeypatch.setattr(tensor_mask, "BIAS_BOUNDS_MIN_PAIRS", n * n)
    out, dk, dv = run(q, k, v)
    poisoned = run(q, k, pv.requires_grad_())[0]
    _, dk_q, dv_q = run(pq.requires_grad_(), k, v)
    assert torch.equal(poisoned[:, :, block:], out[:, :, block:])
    assert torch.equal(dk_q[:, :, block:], dk[:, :, block:])
    assert torch.equal(dv_q[:, :, block:], dv[:, :, block:])


def test_bad_masks_are_clear_errors():
    q, k, v = (randn(B, HQ, 8, 16) for _ in range(3))
    good = torch.ones(8, 8, dtype=torch.bool, device=DEVICE)
    with pytest.raises(TypeError, match="bool tensor .* or a floating one"):
        kernels.attention(q, k, v, attn_mask=torch.zeros(8, 8, dtype=torch.int64,
                                                         device=DEVICE))
    with pytest.raises(TypeError, match="bool tensor"):
        kernels.TensorMask(torch.zeros(8, 8, device=DEVICE))     # prepared: boolean only
    with pytest.raises(ValueError, match=r"does not broadcast to .* \(2, 4, 8, 8\)"):
        kernels.attention(q, k, v, attn_mask=torch.ones(3, 1, 8, 8, dtype=torch.bool,
                                                       device=DEVICE))
    with pytest.raises(ValueError, match="2 to 4 dims"):
        kernels.attention(q, k, v, attn_mask=torch.ones(8, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="mask_mod or mod_aux"):
        kernels.attention(q, k, v, attn_mask=good, mask_mod=tensor_mask.TENSOR_MASK)
    with pytest.raises(ValueError, match="score_mod or mod_aux"):
        kernels.attention(q, k, v, attn_mask=good.float(), score_mod=tensor_mask.TENSOR_BIAS)
    with pytest.raises(ValueError, match=r"does not broadcast to .* \(2, 4, 8, 8\)"):
        kernels.attention(q, k, v, attn_mask=torch.zeros(5, 8, device=DEVICE))
    with pytest.raises(ValueError, match="q must be"):
        kernels.attention(q[0], k, v, attn_mask=good)


def test_attn_mask_under_torch_compile(monkeypatch):
    """``torch.compile(fullgraph=True)`` traces the mask's bounds and its call, with the mask
    as a graph input or prepared outside, and a bias with its gradient, with and without its
    tile bounds; the same results and gradients as eager."""
    q, k, v = (randn(B, HQ, 33, 16, requires_grad=True) for _ in range(3))
    mask = _mask((B, 1, 33, 33), seed=7)
    prepared = kernels.TensorMask(mask)
    bias = randn(1, HQ, 33, 33, requires_grad=True)

    def run(fn, given):
        out = fn(q, k, v, given)
        leaves = (q, k, v) + ((given,) if isinstance(given, torch.Tensor)
                              and given.requires_grad else ())
        return (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))

    def call(q, k, v, given):
        return kernels.attention(q, k, v, causal=False, attn_mask=given)

    try:
        for given, min_pairs in ((mask, None), (prepared, None), (bias, None), (bias, 0)):
            if min_pairs is not None:   # the bias's bounds at this small size
                monkeypatch.setattr(tensor_mask, "BIAS_BOUNDS_MIN_PAIRS", min_pairs)
                torch._dynamo.reset()
            eager = run(call, given)
            got = run(torch.compile(call, fullgraph=True, backend="aot_eager"), given)
            assert all(torch.equal(a, b) for a, b in zip(got[:4], eager[:4]))
            if given is bias:   # atomics: the sums' order (last bits) may differ, on a GPU
                assert_parity(got[4], eager[4].double(), eager[4], name="dbias")
    finally:
        torch._dynamo.reset()



def test_a_mask_tensor_gets_its_bounds_once(monkeypatch):
    """Calls on one bool tensor (a model's layers) compute its bounds once; an in-place change
    of the mask makes new ones (and the results follow it)."""
    counted = []
    spans = tensor_mask._spans
    monkeypatch.setattr(tensor_mask, "_spans", lambda g: counted.append(1) or spans(g))
    q, k, v = (randn(1, 2, 20, 16) for _ in range(3))
    mask = _mask((1, 1, 20, 20), seed=9)
    first = kernels.attention(q, k, v, causal=False, attn_mask=mask)
    assert len(counted) == 2                          # key and query bounds
    assert torch.equal(kernels.attention(q, k, v, causal=False, attn_mask=mask), first)
    assert len(counted) == 2
    mask[..., :16, :] = False                         # rows 0..15 now see nothing
    changed = kernels.attention(q, k, v, causal=False, attn_mask=mask)
    assert len(counted) == 4
    assert (changed[:, :, :16] == 0).all() and torch.equal(changed[:, :, 16:], first[:, :, 16:])


def test_a_bias_tensor_gets_its_bounds_once(monkeypatch):
    """The same for an additive mask with tile bounds (T5's position bias, passed to every
    layer): found once per tensor and version, anew after an in-place change."""
    monkeypatch.setattr(tensor_mask, "BIAS_BOUNDS_MIN_PAIRS", 0)
    counted = []
    spans = tensor_mask._spans
    monkeypatch.setattr(tensor_mask, "_spans", lambda g: counted.append(1) or spans(g))
    q, k, v = (randn(1, 2, 20, 16) for _ in range(3))
    bias = randn(1, 2, 20, 20).masked_fill(~_mask((1, 2, 20, 20), seed=10), float("-inf"))
    first = kernels.attention(q, k, v, causal=False, attn_mask=bias)
    assert len(counted) == 2
    assert torch.equal(kernels.attention(q, k, v, causal=False, attn_mask=bias), first)
    assert len(counted) == 2
    bias[..., :16, :] = float("-inf")                 # rows 0..15 now see nothing
    changed = kernels.attention(q, k, v, causal=False, attn_mask=bias)
    assert len(counted) == 4
    assert (changed[:, :, :16] == 0).all() and torch.equal(changed[:, :, 16:], first[:, :, 16:])
