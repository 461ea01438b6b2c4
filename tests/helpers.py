"""Test devices, inputs, the parity assertion, ``check_dense`` and ``check_call`` (one call
with its mods against the oracle: out, lse, gradients) (the budget rule lives in
reference.parity; fa2_oracle derives the extra allowance of FlashAttention-2-style gradients in
float64)."""
import contextlib
import math

import torch

import reference

from reference.parity import FLOOR_ULPS, GRAD_FACTOR, OUT_FACTOR, parity_budget  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def assert_parity(out, ref, ref_lowp, *, factor=OUT_FACTOR, extra=0.0, name="output"):
    """Assert FlashAttention's budget rule (reference/parity.py); NaNs always fail.

    ``extra``: an allowance derived in float64 from the inputs themselves (see ``fa2_oracle``),
    never a hand-picked tolerance.
    """
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in the result (an element never written?)"
    err, budget = parity_budget(out, ref, ref_lowp, factor=factor)
    assert err <= budget + extra, (
        f"{name}: max error {err:.3e} vs float64 oracle exceeds the budget {budget:.3e} "
        f"({factor}x PyTorch-{out.dtype} error + floor) + derived allowance {extra:.3e}")


def assert_fp8_parity(out, ref, out_pt, *, factor=2.0, name="output"):
    """FlashAttention-3's FP8 rule (hopper/test_flash_attn.py): ``ref`` the float64 oracle on
    the FP8-rounded inputs times their descales, ``out_pt`` the same math with FP8
    intermediates (P rounded to e4m3 as the kernel rounds it); pass when max|out - ref| <=
    factor * max|out_pt - ref| + atol, atol = 2 * the rounding noise of (ref + 0.3 - 0.3) in
    out's dtype (FA3 uses factor 3 with soft-capping). NaNs always fail."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in the result"
    r = ref.to(out.dtype)
    atol = 2 * (r + 0.3 - 0.3 - r).abs().max().item() if r.numel() else 0.0
    err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    base = (out_pt.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    assert err <= factor * base + atol, (
        f"{name}: max error {err:.3e} vs float64 oracle exceeds {factor} x the FP8 PyTorch "
        f"error {base:.3e} + atol {atol:.3e}")


def interpreter_unusable_reason():
    """Why Triton's CPU interpreter cannot run the kernels here, or None. Triton <= 3.6's
    interpreter converts 1-element index arrays with int(), which NumPy >= 2.4 rejects (every
    loop over tensor bounds fails with TypeError; fixed upstream, triton-lang/triton#9171): e.g.
    the GPU host's triton 3.6 with numpy 2.5 (2026-11-26)."""
    import inspect

    import numpy
    import triton

    try:
        from triton.runtime import interpreter
        src = inspect.getsource(interpreter._patch_lang_tensor)
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    if (tuple(int(x) for x in numpy.__version__.split(".")[:2] if x.isdigit()) >= (2, 4)
            and "int(self.handle.data)" in src):
        return (f"Triton {triton.__version__}'s interpreter breaks with NumPy "
                f"{numpy.__version__} (triton-lang/triton#9171)")
    return None


def randn(*shape, dtype=torch.float32, device=DEVICE, requires_grad=False):
    """Standard-normal test input (never zeros or ones)."""
    x = torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)
    return x.requires_grad_(requires_grad)


def fa2_oracle(q, k, v, do, o, lse, *, causal, softmax_scale, dropout_p, keep_mask,
               window=None):
    """Two allowances on top of FlashAttention's budget rule, both computed in float64 and
    both owed to the FlashAttention-2 formulation, not to a kernel bug:

    * gradients from FA-2's formulas given the forward's ``o`` as stored (rounded to the
      input dtype): their distance to the true gradient is error inherited through
      delta = rowsum(dO * O). It matters when PyTorch's own low-precision gradient happens to
      be nearly exact (tiny shapes, one key per row: P = 1 makes dS = dP - delta vanish);
    * a first-order bound (2 fp32 ulps) of the fp32 rounding FA-2 cannot avoid: P =
      exp2(s * c - lse * log2 e) has relative error ~eps * (|s| + |lse|), and dS = P * (dP -
      delta) subtracts two sums (a dot, a rowsum of dO * O) of size |dO| |V| and |dO| |O|.
      It is fp32-sized: visible only for fp32 inputs, where PyTorch's softmax is more exact.

    Grouped-query k, v (fewer heads than q) are expanded here and their gradients summed over
    each group; ``window`` is the sliding window of ``reference.causal_mask``.

    Returns ((dq, dk, dv) given o, (dq, dk, dv) max fp32 rounding allowance).
    """
    group = q.shape[1] // k.shape[1]
    q, k, v, do, o = (t.double() for t in (q, k, v, do, o))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = softmax_scale * (q @ k.transpose(-1, -2))
    if causal:
        s = s.masked_fill(~reference.causal_mask(q.shape[2], k.shape[2], device=q.device,
                                                 window=window), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)          # rows that see no key: P = 0
    drop = keep_mask / (1.0 - dropout_p) if keep_mask is not None else torch.ones_like(p)
    dv = (p * drop).transpose(-1, -2) @ do
    dp = (do @ v.transpose(-1, -2)) * drop
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    given_o = (softmax_scale * (ds @ k), softmax_scale * (ds.transpose(-1, -2) @ q), dv)

    p_rel = s.nan_to_num(0.0, neginf=0.0).abs() + lse.double().nan_to_num(
        0.0, neginf=0.0)[..., None].abs()                    # P's relative error / eps
    sums = (do.abs() @ v.abs().transpose(-1, -2)) * drop + (do.abs() * o.abs()).sum(
        -1, keepdim=True)                                   # size of dP and delta
    ds_err = p * (sums + p_rel * (dp - delta).abs())
    noise = (softmax_scale * (ds_err @ k.abs()),
             softmax_scale * (ds_err.transpose(-1, -2) @ q.abs()),
             (p * p_rel * drop).transpose(-1, -2) @ do.abs())
    given_o, noise = (tuple(_group_sum(t, group, i) for i, t in enumerate(ts))
                      for ts in (given_o, noise))
    eps = torch.finfo(torch.float32).eps
    return given_o, [2 * eps * n.max().item() if n.numel() else 0.0 for n in noise]


def _group_sum(t, group, index):
    """dk, dv (index 1, 2) of expanded kv heads summed back over each group of query heads."""
    if index == 0 or group == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // group, group, n, d).sum(2)


def grads_of(out, leaves, do):
    """d(out)/d(leaves) for the upstream gradient ``do`` (cast to out's dtype)."""
    return torch.autograd.grad(out, leaves, do.to(out.dtype))


def check_dense(b, hq, hkv, q_len, k_len, d, dtype, *, causal=True, window=None, dropout_p=0.0,
                seed=None):
    """``kernels.attention`` vs the float64 oracle (``reference.attention``, dropout through
    ``reference.dropout_keep_mask``): the output and dq/dk/dv by the budget rule, the
    gradients plus ``fa2_oracle``'s allowance (from the kernel's own o and lse); fresh inputs on DEVICE. Returns the kernel's (out, grads)."""
    import kernels

    q = randn(b, hq, q_len, d, dtype=dtype, requires_grad=True)
    k = randn(b, hkv, k_len, d, dtype=dtype, requires_grad=True)
    v = randn(b, hkv, k_len, d, dtype=dtype, requires_grad=True)
    do = randn(b, hq, q_len, d, dtype=dtype)
    out, lse = kernels.attention(q, k, v, causal=causal, window=window, dropout_p=dropout_p,
                                 seed=seed, return_lse=True)
    grads = grads_of(out, (q, k, v), do)
    keep = None
    if dropout_p > 0:
        keep = reference.dropout_keep_mask(seed, b, hq, q_len, k_len, dropout_p, device=DEVICE)
    kw = dict(causal=causal, window=window, dropout_p=dropout_p, keep_mask=keep)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, upcast=True, **kw)
    ref_grads = grads_of(ref, leaves, do)
    lowp = reference.attention(*leaves, upcast=False, **kw)
    lowp_grads = grads_of(lowp, leaves, do)
    assert_parity(out, ref, lowp)

    scale = 1.0 / math.sqrt(d)
    given_o, noise = fa2_oracle(q.detach(), k.detach(), v.detach(), do, out.detach(), lse,
                                causal=causal, softmax_scale=scale, dropout_p=dropout_p,
                                keep_mask=keep, window=window)
    for name, g, r, lp, e, n in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads, given_o,
                                    noise):
        inherited = (e - r).abs().max().item() if r.numel() else 0.0
        assert_parity(g, r, lp, factor=GRAD_FACTOR, extra=inherited + n, name=name)
    return out, grads


def oracle_kwargs(case):
    """A call's keyword arguments as the oracle takes them: the mods' PyTorch twins."""
    return {key: getattr(value, "torch_fn", value) for key, value in case.items()}


def grads_with_unused(out, inputs, do):
    """d(out)/d(inputs) for the upstream gradient ``do``; None for an input out does not use."""
    return torch.autograd.grad(out, inputs, do, allow_unused=True)


def check_call(case, dtype=torch.float32, b=2, hq=4, hkv=2, q_len=19, k_len=23, d=16, dv=16,
               seed=None, dropout_p=0.0, oracle_case=None, num_splits=0, leaves=()):
    """Run ``kernels.attention(**case)`` and the oracle in float64 and in ``dtype``; assert the
    parity rule on out, lse and every gradient (sinks included: ``sinks="random"`` draws them).
    ``oracle_case``: the oracle's own arguments where they differ from the kernel's (a mask the
    oracle takes as a mask). ``leaves``: more tensors of ``case`` whose gradients are checked
    too (an additive attn_mask); ``oracle_case`` is then a function of the oracle's copies of
    them returning its arguments. Returns (out, gradients)."""
    import kernels

    case = dict(case)
    make_oracle_case = oracle_case if callable(oracle_case) else (
        lambda *_: dict(case if oracle_case is None else oracle_case))
    q = randn(b, hq, q_len, d, dtype=dtype, requires_grad=True)
    k = randn(b, hkv, k_len, d, dtype=dtype, requires_grad=True)
    v = randn(b, hkv, k_len, dv, dtype=dtype, requires_grad=True)
    sinks = case.pop("sinks", None)
    if sinks == "random":
        sinks = randn(hq, requires_grad=True)
    inputs = [q, k, v] + ([sinks] if sinks is not None else []) + list(leaves)
    first_leaf = len(inputs) - len(leaves)
    keep = None
    if dropout_p:
        keep = reference.dropout_keep_mask(seed, b, hq, q_len, k_len, dropout_p, device=DEVICE)
    out, lse = kernels.attention(q, k, v, sinks=sinks, dropout_p=dropout_p, seed=seed,
                                 return_lse=True, num_splits=num_splits, **case)
    assert out.shape == (b, hq, q_len, dv) and out.dtype == dtype
    do = randn(*out.shape, dtype=dtype)
    grads = grads_with_unused(out, inputs, do)

    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    low_in = [t.detach().clone().requires_grad_() for t in inputs]
    refs = {}
    for name, ins, upcast in (("ref", ref_in, True), ("low", low_in, False)):
        oracle = dict(make_oracle_case(*ins[first_leaf:]))
        oracle.pop("sinks", None)
        o, l = reference.attention(*ins[:3], sinks=ins[3] if sinks is not None else None,
                                   dropout_p=dropout_p, keep_mask=keep, upcast=upcast,
                                   return_lse=True, **oracle_kwargs(oracle))
        refs[name] = (o, l, grads_with_unused(o, ins, do.to(o.dtype)))
    (ro, rl, rg), (lo, ll, lg) = refs["ref"], refs["low"]
    assert_parity(out, ro, lo)
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ from the oracle"
    assert_parity(lse[finite], rl[finite].float(), ll[finite].float(), name="lse")
    names = ("dq", "dk", "dv") + (("dsinks",) if sinks is not None else ()) + tuple(
        f"d(leaf {i})" for i in range(len(leaves)))
    for name, g, r, l in zip(names, grads, rg, lg):
        assert_parity(g, r, l, factor=GRAD_FACTOR, name=name)
    return out, grads


@contextlib.contextmanager
def metadata_on_a_gpu(monkeypatch, *watched):
    """Treat index tensors as a GPU's (``host_readable`` False: no free host read, as for a
    serving engine's metadata on the device) and record every host read of the ``watched``
    tensors (``tolist``, ``item``, ``int``, ``bool``, ``index``): yields the list of reads."""
    from kernels import pipeline, validation
    monkeypatch.setattr(validation, "host_readable", lambda t: False)
    monkeypatch.setattr(pipeline, "host_readable", lambda t: False)
    reads = []
    ids = {id(t) for t in watched}
    for name in ("tolist", "item", "__int__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **k):
            if id(self) in ids:
                reads.append(_name)
            return _real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, spy)
    yield reads
