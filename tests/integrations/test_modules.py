"""The fused drop-in modules (kernels/modules.py) against the book's modules
(reference/).

Parity follows tests/helpers.py: a float64 copy of the reference module is the oracle, the
reference module in the test dtype is the baseline, and the fused module must be within
OUT_FACTOR (outputs) / GRAD_FACTOR (gradients) of the baseline's error.
Shapes stay tiny: on CPU every kernel runs in Triton's interpreter.
"""
import copy
import time

import pytest
import torch
import torch.nn as nn

import kernels.ops
from helpers import DEVICE, DTYPES, FLOOR_ULPS, GRAD_FACTOR, assert_parity, randn
from kernels import (
    FusedCausalAttention,
    FusedMultiHeadAttention,
    FusedMultiHeadAttentionWrapper,
)
from reference import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    attention,
    dropout_keep_mask,
)

# "Your journey starts with one step" (book section 3.3.1), batched twice as in section 3.5.3.
INPUTS = torch.tensor([
    [0.43, 0.15, 0.89],
    [0.55, 0.87, 0.66],
    [0.57, 0.85, 0.64],
    [0.22, 0.58, 0.33],
    [0.77, 0.25, 0.10],
    [0.05, 0.80, 0.55],
])
BOOK_BATCH = torch.stack((INPUTS, INPUTS))  # (2, 6, 3)

# Test sizes: 19 tokens spans two 16-row tiles with a ragged tail; head widths 8 and 16.
B, N, D_IN, CTX = 2, 19, 24, 24
# kind -> (reference class, fused class, d_out, num_heads argument, heads seen by the kernel).
# Causal: one head of width 16; wrapper: 3 heads of width 8; MHA: d_out 32 in 4 heads of 8.
KINDS = {
    "causal": (CausalAttention, FusedCausalAttention, 16, (), 1),
    "wrapper": (MultiHeadAttentionWrapper, FusedMultiHeadAttentionWrapper, 8, (3,), 3),
    "mha": (MultiHeadAttention, FusedMultiHeadAttention, 32, (4,), 4),
}
NAMES = tuple(KINDS)


def construct(kind, fused, *, dropout=0.0, qkv_bias=False, ctx=CTX):
    """A fresh (reference or fused) module of ``kind``, fp32 on the CPU."""
    ref_cls, fused_cls, d_out, heads, _ = KINDS[kind]
    cls = fused_cls if fused else ref_cls
    return cls(D_IN, d_out, ctx, dropout, *heads, qkv_bias=qkv_bias)


def make_pair(kind, *, dropout=0.0, qkv_bias=False, ctx=CTX):
    """(reference module, fused module with the same weights), both fp32 on DEVICE, eval mode."""
    ref = construct(kind, False, dropout=dropout, qkv_bias=qkv_bias, ctx=ctx)
    fused = construct(kind, True, dropout=dropout, qkv_bias=qkv_bias, ctx=ctx)
    fused.load_state_dict(ref.state_dict(), strict=True)
    return ref.to(DEVICE).eval(), fused.to(DEVICE).eval()


def assert_book(actual, expected):
    """``actual`` equals the book's value as printed, i.e. rounds to it at 4 decimals."""
    err = (actual.detach().double().cpu() - torch.tensor(expected, dtype=torch.float64)).abs()
    assert err.max().item() <= 0.5e-4, f"{actual} differs from the book's {expected}"


def kernel_seed(manual_seed):
    """The dropout seed kernels.attention(seed=None) draws right after torch.manual_seed."""
    torch.manual_seed(manual_seed)
    return torch.randint(0, kernels.ops.SEED_LIMIT - 1, (), dtype=torch.int64).item()


def reference_math(ref, x, *, dropout_p=0.0, keep_mask=None, upcast=False):
    """The reference module's forward with its attention core replaced by reference.attention
    (so the kernel's dropout mask can be applied); x (b, n, d_in) -> ref's output shape."""
    b, n, _ = x.shape
    kw = dict(causal=True, dropout_p=dropout_p, keep_mask=keep_mask, upcast=upcast)
    if isinstance(ref, MultiHeadAttention):
        H, hd = ref.num_heads, ref.head_dim
        q, k, v = (lin(x).view(b, n, H, hd).transpose(1, 2)
                   for lin in (ref.W_query, ref.W_key, ref.W_value))
        o = attention(q, k, v, **kw).to(q.dtype)  # (b, H, n, hd)
        return ref.out_proj(o.transpose(1, 2).reshape(b, n, ref.d_out))
    heads = list(ref.heads) if isinstance(ref, MultiHeadAttentionWrapper) else [ref]
    q, k, v = (torch.stack([getattr(h, name)(x) for h in heads], dim=1)
               for name in ("W_query", "W_key", "W_value"))  # (b, H, n, d_out)
    o = attention(q, k, v, **kw).to(q.dtype)
    return o.transpose(1, 2).reshape(b, n, -1)


# ---------------------------------------------------------------------------------------------
# The book's printed numbers, through the fused modules loaded with the reference's weights
# ---------------------------------------------------------------------------------------------

def test_book_multi_head_attention():
    torch.manual_seed(123)
    ref = MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    fused = FusedMultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    fused.load_state_dict(ref.state_dict(), strict=True)
    out = fused.to(DEVICE)(BOOK_BATCH.to(DEVICE))
    assert out.shape == (2, 6, 2)
    assert_book(out[0, 0], [0.3190, 0.4858])


def test_book_causal_attention():
    torch.manual_seed(123)
    ref = CausalAttention(3, 2, 6, 0.0)
    fused = FusedCausalAttention(3, 2, 6, 0.0)
    fused.load_state_dict(ref.state_dict(), strict=True)
    out = fused.to(DEVICE)(BOOK_BATCH.to(DEVICE))
    assert out.shape == (2, 6, 2)
    assert_book(out[0, 0], [-0.4519, 0.2216])
    assert_book(out[0, -1], [-0.5299, -0.1081])


def test_book_wrapper():
    torch.manual_seed(123)
    ref = MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    fused = FusedMultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    fused.load_state_dict(ref.state_dict(), strict=True)
    out = fused.to(DEVICE)(BOOK_BATCH.to(DEVICE))
    assert out.shape == (2, 6, 4)
    assert_book(out[0, 0], [-0.4519, 0.2216, 0.4772, 0.1063])


@pytest.mark.parametrize("kind", NAMES)
def test_same_seed_same_initial_weights(kind):
    """Parameters are created in the reference's order: a seed reproduces its weights."""
    torch.manual_seed(7)
    ref = construct(kind, False, qkv_bias=True)
    torch.manual_seed(7)
    fused = construct(kind, True, qkv_bias=True)
    ref_sd, fused_sd = ref.state_dict(), fused.state_dict()
    assert list(ref_sd) == list(fused_sd)
    for name in ref_sd:
        assert torch.equal(ref_sd[name], fused_sd[name]), name


# ---------------------------------------------------------------------------------------------
# Parity: outputs and every parameter's gradient, fp32 / bf16 / fp16 parameters
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", NAMES)
def test_forward_backward_parity(kind, dtype):
    ref, fused = make_pair(kind, qkv_bias=True)
    ref, fused = ref.to(dtype), fused.to(dtype)
    oracle = copy.deepcopy(ref).double()  # the same (rounded) weights, float64 math
    x = randn(B, N, D_IN, dtype=dtype)

    f_in, r_in, o_in = (t.detach().requires_grad_() for t in (x, x.clone(), x.double()))
    # dL/d(keys) of the oracle, per key projection: the key bias's gradient sums these rows.
    key_grads = {}
    for mod_name, mod in oracle.named_modules():
        if mod_name.endswith("W_key"):
            mod.register_full_backward_hook(
                lambda m, g_in, g_out, name=mod_name: key_grads.__setitem__(name, g_out[0]))
    f_out, r_out, o_out = fused(f_in), ref(r_in), oracle(o_in)
    # One random cotangent for all three, so no gradient is trivially symmetric.
    cot = randn(*f_out.shape, dtype=torch.float64)
    for out in (f_out, r_out, o_out):
        out.backward(cot.to(out.dtype))

    assert f_out.dtype == dtype
    assert_parity(f_out, o_out, r_out)
    assert_parity(f_in.grad, o_in.grad, r_in.grad, factor=GRAD_FACTOR, name="x.grad")
    f_params, r_params = dict(fused.named_parameters()), dict(ref.named_parameters())
    o_params = dict(oracle.named_parameters())
    assert f_params.keys() == r_params.keys()
    for name in f_params:
        extra = 0.0
        if name.endswith("W_key.bias"):
            # Softmax is shift-invariant per row, so the key bias's true gradient is exactly 0:
            # it is a sum of dK rows that cancels. Fused and PyTorch values are both rounding
            # noise of that sum, of size eps(dtype) * sum|dK| (from the float64 oracle's dK).
            dkeys = key_grads[name[:-len(".bias")]]
            extra = (FLOOR_ULPS * torch.finfo(dtype).eps
                     * dkeys.abs().sum(dim=tuple(range(dkeys.dim() - 1))).max().item())
        assert_parity(f_params[name].grad, o_params[name].grad, r_params[name].grad,
                      factor=GRAD_FACTOR, extra=extra, name=f"{name}.grad")


def test_autocast_matches_reference_under_autocast():
    """CPU autocast to bf16 (cuda: bf16 too): projections come out bf16, the kernel gets one
    dtype, and output and fp32 parameter gradients match the reference under autocast."""
    ref, fused = make_pair("mha", qkv_bias=True)
    oracle = copy.deepcopy(ref).double()
    x = randn(B, N, D_IN)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = fused(x)
        base = ref(x)
    want = oracle(x.double())
    assert out.dtype == torch.bfloat16
    assert_parity(out, want, base)
    cot = randn(*out.shape, dtype=torch.float64)
    for o in (out, base, want):
        o.backward(cot.to(o.dtype))
    o_params = dict(oracle.named_parameters())
    r_params = dict(ref.named_parameters())
    for name, p in fused.named_parameters():
        assert p.grad.dtype == torch.float32
        assert_parity(p.grad, o_params[name].grad, r_params[name].grad, factor=GRAD_FACTOR,
                      name=f"{name}.grad")


# ---------------------------------------------------------------------------------------------
# Dropout (training mode): the kernel's mask applied to the reference math
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", NAMES)
def test_training_dropout_is_reference_math_with_kernel_mask(kind):
    p = 0.3
    ref, fused = make_pair(kind, dropout=p)
    ref.train()
    fused.train()
    oracle = copy.deepcopy(ref).double()
    x = randn(B, N, D_IN)
    heads = KINDS[kind][4]

    torch.manual_seed(1234)
    out = fused(x)
    keep = dropout_keep_mask(kernel_seed(1234), B, heads, N, N, p, device=DEVICE)
    want = reference_math(oracle, x.double(), dropout_p=p, keep_mask=keep, upcast=True)
    base = reference_math(ref, x, dropout_p=p, keep_mask=keep, upcast=False)
    assert_parity(out, want, base)

    torch.manual_seed(1234)
    assert torch.equal(fused(x), out), "same torch seed must give the same dropout mask"
    torch.manual_seed(4321)
    assert not torch.equal(fused(x), out), "another torch seed must give another mask"


def test_training_dropout_gradients():
    p = 0.25
    ref, fused = make_pair("mha", dropout=p, qkv_bias=True)
    fused.train()
    oracle = copy.deepcopy(ref).double()
    x = randn(B, N, D_IN)
    torch.manual_seed(99)
    out = fused(x)
    keep = dropout_keep_mask(kernel_seed(99), B, 4, N, N, p, device=DEVICE)
    want = reference_math(oracle, x.double(), dropout_p=p, keep_mask=keep, upcast=True)
    base = reference_math(ref, x, dropout_p=p, keep_mask=keep, upcast=False)
    cot = randn(*out.shape, dtype=torch.float64)
    for o in (out, want, base):
        o.backward(cot.to(o.dtype))
    o_params, r_params = dict(oracle.named_parameters()), dict(ref.named_parameters())
    for name, prm in fused.named_parameters():
        assert_parity(prm.grad, o_params[name].grad, r_params[name].grad, factor=GRAD_FACTOR,
                      name=f"{name}.grad")


@pytest.mark.parametrize("kind", NAMES)
def test_eval_disables_dropout(kind):
    ref, fused = make_pair(kind, dropout=0.5)
    x = randn(B, 7, D_IN)
    torch.manual_seed(1)
    a = fused.eval()(x)
    torch.manual_seed(2)
    b = fused(x)
    assert torch.equal(a, b)
    for m in fused.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    assert torch.equal(fused.train()(x), a), "eval output must be the no-dropout output"


# ---------------------------------------------------------------------------------------------
# state_dict compatibility without a stored mask
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", NAMES)
def test_state_dict_round_trips_strict(kind):
    ref, fused = make_pair(kind, qkv_bias=True)
    ref_sd, fused_sd = ref.state_dict(), fused.state_dict()
    assert list(fused_sd) == list(ref_sd)  # same keys, same order
    for key in ref_sd:
        assert fused_sd[key].dtype == ref_sd[key].dtype, key
        assert torch.equal(fused_sd[key].cpu(), ref_sd[key].cpu()), key

    # fused -> reference, and reference -> a fresh fused, both strict.
    ref2, fused2 = make_pair(kind, qkv_bias=True)
    ref2.load_state_dict(fused_sd, strict=True)
    fused2.load_state_dict(ref_sd, strict=True)
    for key, value in ref_sd.items():
        assert torch.equal(ref2.state_dict()[key].cpu(), value.cpu()), key
        assert torch.equal(fused2.state_dict()[key].cpu(), value.cpu()), key
    # The mask entry follows the parameters' dtype, like the reference's buffer.
    assert list(fused.half().state_dict().values())[0].dtype == torch.float16


@pytest.mark.parametrize("kind", NAMES)
def test_no_mask_buffer(kind):
    _, fused = make_pair(kind)
    assert dict(fused.named_buffers()) == {}
    assert not any(hasattr(m, "mask") for m in fused.modules())


def test_huge_context_length_allocates_nothing():
    """The reference would allocate 131072**2 floats (64 GiB) for its mask."""
    start = time.perf_counter()
    fused = FusedMultiHeadAttention(16, 16, 131072, 0.0, num_heads=2)
    elapsed = time.perf_counter() - start
    assert dict(fused.named_buffers()) == {}
    assert sum(p.numel() for p in fused.parameters()) == 4 * 16 * 16 + 16
    assert elapsed < 5.0, f"construction took {elapsed:.1f} s"
    out = fused.to(DEVICE)(randn(1, 5, 16))  # and it runs, the mask never built
    assert out.shape == (1, 5, 16)


@pytest.mark.parametrize("kind", ("causal", "mha"))
def test_loading_a_non_causal_mask_raises(kind):
    ref, fused = make_pair(kind)
    sd = ref.state_dict()
    sd["mask"] = torch.zeros(CTX, CTX)  # all visible: not causal attention
    with pytest.raises(ValueError, match="not the causal pattern"):
        fused.load_state_dict(sd, strict=True)
    sd["mask"] = torch.triu(torch.ones(CTX + 1, CTX + 1), diagonal=1)
    with pytest.raises(ValueError, match=rf"expected the causal mask of shape \({CTX}, {CTX}\)"):
        fused.load_state_dict(sd, strict=False)


def test_loading_a_non_causal_mask_into_the_wrapper_raises():
    ref, fused = make_pair("wrapper")
    sd = ref.state_dict()
    sd["heads.1.mask"] = torch.tril(torch.ones(CTX, CTX))
    with pytest.raises(ValueError, match=r"heads\.1\.mask: not the causal pattern"):
        fused.load_state_dict(sd)


def test_bool_mask_and_missing_mask():
    ref, fused = make_pair("mha")
    sd = ref.state_dict()
    sd["mask"] = sd["mask"].bool()  # the same pattern as the book reads it
    fused.load_state_dict(sd, strict=True)
    del sd["mask"]
    with pytest.raises(RuntimeError, match='Missing key.*"mask"'):
        fused.load_state_dict(sd, strict=True)  # as strict as the reference
    result = fused.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["mask"] and result.unexpected_keys == []


# ---------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------

def test_heads_must_divide_d_out():
    with pytest.raises(ValueError, match=r"d_out must be divisible by num_heads: got d_out=10, "
                                         r"num_heads=4"):
        FusedMultiHeadAttention(8, 10, 16, 0.0, num_heads=4)


@pytest.mark.parametrize("kind", NAMES)
def test_input_errors(kind):
    _, fused = make_pair(kind, ctx=6)
    with pytest.raises(ValueError, match=r"got 7 tokens but its context_length is 6"):
        fused(randn(1, 7, D_IN))
    with pytest.raises(ValueError, match=rf"expected a 3-d input \(batch, num_tokens, d_in="
                                         rf"{D_IN}\); got a 2-d tensor of shape \(5, {D_IN}\)"):
        fused(randn(5, D_IN))
    with pytest.raises(ValueError, match=rf"expected d_in={D_IN} features .*; got {D_IN + 1}"):
        fused(randn(1, 5, D_IN + 1))


# ---------------------------------------------------------------------------------------------
# from_module, zero-copy head split/merge, torch.compile
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", NAMES)
def test_from_module_shares_parameters_and_state(kind):
    ref, _ = make_pair(kind, dropout=0.1, qkv_bias=True)
    ref = ref.to(torch.bfloat16).train()
    cls = KINDS[kind][1]
    fused = cls.from_module(ref)
    assert [id(p) for p in fused.parameters()] == [id(p) for p in ref.parameters()]
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert fused.training and all(m.training for m in fused.modules())
    assert all(p.dtype == torch.bfloat16 and p.device.type == torch.device(DEVICE).type
               for p in fused.parameters())
    drops = [m.p for m in fused.modules() if isinstance(m, nn.Dropout)]
    assert drops and all(p == 0.1 for p in drops)
    fused.load_state_dict(ref.state_dict(), strict=True)
    # eval mode carries over too, and then the outputs agree.
    ref.eval()
    fused = cls.from_module(ref)
    assert not fused.training
    oracle = copy.deepcopy(ref).double()
    x = randn(B, 9, D_IN, dtype=torch.bfloat16)
    assert_parity(fused(x), oracle(x.double()), ref(x))


def test_from_module_rejects_a_non_causal_mask():
    ref, _ = make_pair("mha")
    ref.mask.zero_()
    with pytest.raises(ValueError, match="not the causal pattern"):
        FusedMultiHeadAttention.from_module(ref)


@pytest.mark.parametrize("kind", ("wrapper", "mha"))
def test_heads_split_and_merge_without_copies(kind, monkeypatch):
    """q/k/v reach the kernel as strided views of the projections, and the kernel's output is
    merged into (b, n, H * hd) by a view (the same memory), not a copy."""
    _, fused = make_pair(kind)
    seen = {}
    real = kernels.ops.attention

    def spy(q, k, v, **kw):
        seen["q"] = q
        seen["o"] = real(q, k, v, **kw)
        return seen["o"]

    monkeypatch.setattr(kernels.ops, "attention", spy)
    if kind == "mha":
        fused.W_query.register_forward_hook(lambda m, i, out: seen.update(proj=out))
        fused.out_proj.register_forward_pre_hook(lambda m, args: seen.update(merged=args[0]))
        fused(randn(B, N, D_IN))
        assert seen["q"].data_ptr() == seen["proj"].data_ptr()
    else:
        seen["merged"] = fused(randn(B, N, D_IN))
    assert not seen["q"].is_contiguous(), "q should be the (b, H, n, hd) view of (b, n, H*hd)"
    assert seen["merged"].data_ptr() == seen["o"].data_ptr()
    assert seen["merged"].is_contiguous()


def test_torch_compile_fullgraph_matches_eager():
    """FusedMultiHeadAttention traces as one graph (the kernel is a custom op) and the compiled
    forward and backward match eager."""
    torch._dynamo.reset()
    ref, fused = make_pair("mha", qkv_bias=True)
    model = nn.Sequential(fused, nn.GELU(), nn.Linear(32, 8)).to(DEVICE)
    oracle = copy.deepcopy(nn.Sequential(ref, nn.GELU(), model[2])).double()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = randn(B, N, D_IN)

    out_c = compiled(x)
    out_c.sum().backward()
    grads_c = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out_e = model(x)
    out_e.sum().backward()
    out_o = oracle(x.double())
    out_o.sum().backward()

    assert_parity(out_c, out_o, out_e)
    o_params = dict(oracle.named_parameters())
    for name, p in model.named_parameters():
        assert_parity(grads_c[name], o_params[name].grad, p.grad, factor=GRAD_FACTOR,
                      name=f"{name}.grad")
    torch._dynamo.reset()


def test_torch_compile_training_dropout_draws_the_eager_mask():
    """Compiled in training mode, the kernel still draws its seed from torch's generator: after
    torch.manual_seed the output is the reference math with that seed's mask."""
    torch._dynamo.reset()
    p = 0.2
    ref, fused = make_pair("mha", dropout=p)
    fused.train()
    oracle = copy.deepcopy(ref).double()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    x = randn(B, N, D_IN)
    torch.manual_seed(11)
    out = compiled(x)
    keep = dropout_keep_mask(kernel_seed(11), B, 4, N, N, p, device=DEVICE)
    want = reference_math(oracle, x.double(), dropout_p=p, keep_mask=keep, upcast=True)
    base = reference_math(ref, x, dropout_p=p, keep_mask=keep, upcast=False)
    assert_parity(out, want, base)
    torch._dynamo.reset()
