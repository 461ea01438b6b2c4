#!/usr/bin/env python3
"""Randomized differential check: random calls across the feature matrix, each against the
float64 oracle (``reference``) by FlashAttention's budget rule.

The pinned tests check each feature on a few shapes; this draws the combinations nobody wrote
down. Routes: ``dense`` (``kernels.attention`` with its backward), ``varlen`` (packed
sequences, with theirs), ``kvcache`` (decoding with an append and split-KV), ``paged`` (the
same over a paged cache), ``paged_varlen`` (packed queries over pages) and ``fa``
(``flash_attn_interface.flash_attn_func`` with its backward: two-sided ``window_size``,
FlashAttention 3's ``attention_chunk`` with or without causal, ``s_aux`` sinks; its oracle's
mask is ``reference.flash_attn_mask``, FA3's rule). Drawn with them: dtype, batch,
grouped-query heads, lengths 1-80 and now and then up to 300 (q_len > k_len included, empty
packed sequences), head dims
1-80 and now and then 128 or 256 (a value head dim of its own), causal / window / chunk /
neither, softcap, ALiBi (per head or per batch entry), sinks (with their gradient), a user
score mod (a bias table) and mask mod (per-row prefix or per-head stripes), on dense calls
without a mod SDPA's ``attn_mask``, boolean or additive (every broadcast shape, a transposed
one; drawn from a stream of its own; the additive one's gradient checked as a leaf), dropout, a custom softmax scale, transposed views. Case
``i`` of seed ``S`` is drawn from ``random.Random(f"{S}:{i}")`` alone, so ``--seed S --only i`` replays it.

What is checked: out (and lse where there is one, its -inf rows exactly) within the parity
budget (``reference.parity``: factor x PyTorch's own error in the input dtype + a floor);
gradients within 3x PyTorch's error plus two allowances computed in float64 from the inputs,
both owed to FlashAttention-2's formulation (tests/helpers.py ``fa2_oracle`` explains them):
the error inherited from the stored o through delta = rowsum(dO * O), which is exactly the
gradient of sum_i (delta_i - delta'_i) * lse_i (d lse_i / d s_ij = P_ij, mods included), and
two fp32 ulps of the size of the terms P = exp(s - lse) and dS = P (dP - delta) are computed
from (the kernels compute in fp32 whatever the inputs). KV caches: the appended cache bit for
bit equal to the oracle's.

Usage (on CPU the kernels run in Triton's interpreter; a few seconds per case)::

    python tools/fuzz_parity.py --cases 200 [--seed S] [--routes dense,varlen]
        [--backends kernel,compiled,fallback] [--budget SECONDS]
    python tools/fuzz_parity.py --seed S --only 17 -v      # replay one case, with tracebacks
    python tools/fuzz_parity.py --device cuda --budget 60  # on a GPU: the compiled kernels

Prints a line per case and a summary; exits 1 if any case failed. tests/test_fuzz_parity.py
runs a few fixed cases of it in CI.
"""
import argparse
import math
import os
import random
import sys
import time
import traceback
import warnings

if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    # The interpreter for the kernels on CPU tensors (read when @triton.jit decorates), not
    # with --device cuda.
    if not any(a in ("--device=cuda", "cuda") for a in sys.argv[1:]):
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels  # noqa: E402
import reference  # noqa: E402
from reference.parity import GRAD_FACTOR, OUT_FACTOR, parity_budget  # noqa: E402

ROUTES = ("dense", "varlen", "kvcache", "paged", "paged_varlen", "fa")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
EPS32 = torch.finfo(torch.float32).eps


class Mismatch(AssertionError):
    """A result outside its budget."""


# ------------------------------------------------------------------ drawing a case
def _length(rng, lo=1):
    """Lengths weighted to the edges: 1, around a 16-row tile, some longer, rarely up to 300
    (many tiles: the interpreter's tiles are 16 x 16)."""
    if rng.random() < 0.03:
        return rng.randint(81, 300)
    return max(lo, rng.choice([1, 1, 2, 3, 5, 7, 15, 16, 17, 31, 33, rng.randint(1, 80)]))


def _dim(rng):
    if rng.random() < 0.04:
        return rng.choice([128, 256])
    return rng.choice([1, 8, 16, 17, 24, 32, 40, 64, 72, rng.randint(1, 80)])


def draw_case(seed, index, routes=ROUTES):
    """The case ``index`` of ``seed``: a dict of plain values (printable, replayable)."""
    rng = random.Random(f"{seed}:{index}")
    route = rng.choice(routes)
    c = dict(route=route, dtype=rng.choice(sorted(DTYPES)), batch=rng.randint(1, 3),
             heads_kv=rng.randint(1, 3), group=rng.choice([1, 1, 2, 3]), d=_dim(rng))
    c["dv"] = c["d"] if rng.random() < 0.7 or route == "fa" else _dim(rng)
    c["causal"] = rng.random() < 0.7
    c["window"] = c["chunk"] = None
    edge = rng.random()
    if c["causal"] and edge < 0.25:
        c["window"] = rng.randint(1, 40)
    elif c["causal"] and edge < 0.45:
        c["chunk"] = rng.randint(1, 40)
    c["softcap"] = rng.choice([None, None, None, round(rng.uniform(0.5, 30.0), 3)])
    c["alibi"] = rng.choice([None, None, None, "heads", "batch"])
    c["sinks"] = rng.random() < 0.25
    c["mod"] = None if route == "fa" else rng.choice([None, None, None, None, "bias", "mask",
                                                      "both"])
    # SDPA's boolean attn_mask (dense calls without a mod of their own), drawn from a stream
    # of its own so that the other draws of every case stay what they were.
    extra = random.Random(f"{seed}:{index}:attn_mask")
    if route == "dense" and c["mod"] is None and extra.random() < 0.3:
        c["attn_mask"] = extra.choice(ATTN_MASK_SHAPES)
        if extra.random() < 0.5:      # an additive float mask: a bias, -inf where hidden
            c["attn_mask"] += ":bias"
    c["scale"] = None if rng.random() < 0.7 else round(rng.uniform(0.05, 1.5), 3)
    c["transposed"] = rng.random() < 0.4
    c["dropout"] = 0.0
    if route in ("dense", "varlen") and rng.random() < 0.3:
        c["dropout"] = rng.choice([0.1, 0.5])
    c["grad"] = route in ("dense", "varlen", "fa") and rng.random() < 0.75
    if route == "fa":   # FlashAttention's window_size (left, right) and FA3's attention_chunk
        c["window"] = c["chunk"] = None
        c["window_size"] = (rng.choice([-1, -1, 0, 1, 3, rng.randint(0, 40)]),
                            rng.choice([-1, -1, 0, 1, 3, rng.randint(0, 40)]))
        c["attention_chunk"] = rng.choice([0, 0, rng.randint(1, 40)])
    if route in ("dense", "fa"):
        c["q_len"], c["k_len"] = _length(rng), _length(rng)
    elif route in ("varlen", "paged_varlen"):
        n = c["batch"]
        c["lens_q"] = [rng.choice([0, 1, _length(rng)]) for _ in range(n)]
        if route == "varlen":
            c["lens_k"] = [rng.choice([0, _length(rng)]) for _ in range(n)]
        else:   # keys: the cache's filled count; the queries are its last positions
            c["lens_k"] = [lq + rng.choice([0, 0, rng.randint(0, 40)]) for lq in c["lens_q"]]
        if sum(c["lens_q"]) == 0:
            c["lens_q"][0] = 1
            c["lens_k"][0] = max(c["lens_k"][0], 1)
    else:
        c["q_len"] = rng.choice([1, 1, 2, 4, _length(rng)])
        c["append"] = rng.random() < 0.5
        c["cache_len"] = rng.randint(c["q_len"] if c["append"] else 1, 90)
        c["seqlens"] = [rng.randint(0, c["cache_len"] - (c["q_len"] if c["append"] else 0))
                        for _ in range(c["batch"])]
        c["num_splits"] = rng.choice([0, 1, 2, 3, 5])
    if route in ("paged", "paged_varlen"):
        c["page_size"] = rng.choice([1, 3, 4, 16, 32])
    c["dropout_seed"] = rng.randrange(2**40)
    c["input_seed"] = rng.randrange(2**31)
    return c


def describe(c):
    skip = {"input_seed", "dropout_seed"}
    return " ".join(f"{k}={v}" for k, v in c.items()
                    if k not in skip and v not in (None, False, 0.0))


# ------------------------------------------------------------------ inputs
def _randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


def _view(t, transposed, seq_axis=2):
    """t itself, or the same values as a transposed view (a (b, s, h, d) buffer seen as
    (b, h, s, d), the layout a head split by ``view().transpose(1, 2)`` gives)."""
    if not transposed:
        return t
    return t.transpose(1, seq_axis).contiguous().transpose(1, seq_axis)


# Two user mods (kernels/core/mods.py's contract), with their PyTorch twins for the oracle.
@triton.jit
def _rel_bias(s, b, h, q_idx, kv_idx, aux):
    """A relative-position bias: table aux[0] (heads, 9), distances clipped to [-4, 4]."""
    d = tl.minimum(tl.maximum(q_idx - kv_idx, -4), 4) + 4
    return s + tl.load(aux[0] + h * 9 + d)


def _rel_bias_torch(s, b, h, q_idx, kv_idx, aux):
    d = (q_idx - kv_idx).clamp(-4, 4) + 4
    return s + aux[0].reshape(-1)[h * 9 + d].to(s.dtype)


@triton.jit
def _prefix_or_stripes(b, h, q_idx, kv_idx, aux):
    """Key j is seen iff j < aux[1][b] (a per-row prefix) or (j + h) % 3 != 0: a pattern
    that differs per batch entry and head, with no tile ranges (every tile visited)."""
    return (kv_idx < tl.load(aux[1] + b)) | ((kv_idx + h) % 3 != 0)


def _prefix_or_stripes_torch(b, h, q_idx, kv_idx, aux):
    return (kv_idx < aux[1].reshape(-1)[b]) | ((kv_idx + h) % 3 != 0)


REL_BIAS = kernels.ScoreMod("fuzz_parity.rel_bias", _rel_bias, _rel_bias_torch)
PREFIX_OR_STRIPES = kernels.MaskMod("fuzz_parity.prefix_or_stripes", _prefix_or_stripes,
                                    _prefix_or_stripes_torch)


def _twins(opts, bias=None):
    """The oracle's options: the mods' PyTorch twins in place of the mods, an attn_mask as
    the oracle's mask mod; an additive one's finite part added by a score mod, from ``bias``
    where given (the oracle's differentiable copy of it)."""
    twins = {k: getattr(v, "torch_fn", v) for k, v in opts.items() if k != "attn_mask"}
    mask = opts.get("attn_mask")
    if mask is not None and mask.dtype == torch.bool:
        twins["mask_mod"] = lambda b, h, q_idx, kv_idx, aux: mask
    elif mask is not None:      # a bias: its finite part added, its -inf entries a mask
        seen = mask.detach() > float("-inf")
        finite = (mask.detach() if bias is None else bias).masked_fill(~seen, 0.0)
        twins["score_mod"] = lambda s, b, h, q_idx, kv_idx, aux: s + finite.to(s.dtype)
        twins["mask_mod"] = lambda b, h, q_idx, kv_idx, aux: seen
    return twins


# attn_mask's shapes, as (batch, heads_q, q_len, k_len) factors kept (1: broadcast; a name
# with fewer letters: fewer dims, SDPA's right-aligned broadcasting).
ATTN_MASK_SHAPES = ("bhqk", "b1qk", "b11k", "qk", "hqk", "b1qk_transposed")


def _attn_mask(c, gen, hq):
    """A random bool mask (random spans per row, holes, some empty rows) of the case's
    attn_mask shape; for a ":bias" kind, a float32 bias of normal values, -inf where that
    mask hides."""
    kind, _, bias = c["attn_mask"].partition(":")
    sizes = dict(b=c["batch"], h=hq, q=c["q_len"], k=c["k_len"])
    shape = [sizes.get(x, 1) for x in kind.split("_")[0]]
    k_len = c["k_len"]
    lo = torch.randint(0, k_len + 1, (*shape[:-1], 1), generator=gen)
    hi = lo + torch.randint(0, k_len + 1, (*shape[:-1], 1), generator=gen)
    cols = torch.arange(k_len)
    mask = (cols >= lo) & (cols < hi) & (torch.rand(shape, generator=gen) < 0.8)
    if bias:
        mask = torch.randn(shape, generator=gen).masked_fill(~mask, float("-inf"))
    if kind.endswith("_transposed"):
        mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
    return mask


def _mods(c, gen, num):
    """softcap, alibi_slopes, sinks, score_mod, mask_mod, mod_aux in the API's form; ``num`` =
    batch entries / sequences."""
    hq = c["heads_kv"] * c["group"]
    slopes = None
    if c["alibi"] == "heads":
        slopes = torch.rand(hq, generator=gen)
    elif c["alibi"] == "batch":
        slopes = torch.rand(num, hq, generator=gen)
    sinks = _randn(gen, hq, dtype=torch.float32) if c["sinks"] else None
    mods = dict(softcap=c["softcap"], alibi_slopes=slopes, sinks=sinks)
    if c.get("attn_mask"):
        mods["attn_mask"] = _attn_mask(c, gen, hq)
    mod = c.get("mod")
    if mod:
        mods["score_mod"] = REL_BIAS if mod in ("bias", "both") else None
        mods["mask_mod"] = PREFIX_OR_STRIPES if mod in ("mask", "both") else None
        mods["mod_aux"] = (torch.randn(hq, 9, generator=gen) * 0.5,
                           torch.randint(0, 12, (num,), generator=gen, dtype=torch.int32))
    return mods


# ------------------------------------------------------------------ the call under test
_MODE = {"compile": False, "device": "cpu"}


def _api(name):
    """The public function ``name`` (of ``kernels``, or ``flash_attn_func`` of its
    FlashAttention API), looked up at each call (tests patch them). On the "compiled" backend
    it runs in ``torch.compile(fullgraph=True)`` (aot_eager on the CPU, where the kernels stay
    in the interpreter; inductor on a GPU): the custom ops' traced path (fake tensors, the
    mutation of KV caches). With ``--device cuda`` (kernel and compiled backends) its tensor
    arguments are moved there (strides kept; differentiable, so gradients reach the CPU
    leaves), its results moved back, and the arguments it wrote in place (KV caches) copied
    back: inputs, oracle and checks stay on the CPU."""
    if name == "flash_attn_func":
        from kernels import flash_attn_interface
        fn = flash_attn_interface.flash_attn_func
    else:
        fn = getattr(kernels, name)
    device = _MODE["device"]
    if _MODE["compile"]:
        fn = torch.compile(fn, fullgraph=True,
                           backend="aot_eager" if device == "cpu" else "inductor")
    if device == "cpu":
        return fn

    def on_device(*args, **kwargs):
        def move(x):
            return x.to(device) if isinstance(x, torch.Tensor) else x
        moved = [move(a) for a in args]
        result = fn(*moved, **{k: move(v) for k, v in kwargs.items()})
        for a, m in zip(args, moved):
            if isinstance(a, torch.Tensor) and not a.requires_grad:
                a.copy_(m)                       # written in place (caches); else a no-op
        return tuple(r.cpu() if isinstance(r, torch.Tensor) else r for r in result)
    return on_device


# ------------------------------------------------------------------ checks
def check(name, out, ref, lowp, factor=OUT_FACTOR, extra=0.0):
    if out.shape != ref.shape:
        raise Mismatch(f"{name}: shape {tuple(out.shape)} != oracle {tuple(ref.shape)}")
    if torch.isnan(out).any():
        raise Mismatch(f"{name}: NaN")
    err, budget = parity_budget(out, ref, lowp, factor=factor)
    if not err <= budget + extra:
        raise Mismatch(f"{name}: error {err:.3e} > budget {budget:.3e} + allowance {extra:.3e}")
    return (err / (budget + extra) if budget + extra > 0 else 0.0), name


def check_lse(lse, ref, lowp, q, k, scale):
    """lse (fp32 whatever the inputs) with two allowances of 2 fp32 ulps: of |lse| for each
    of the two roundings of the exp2 domain FlashAttention works in (scores times log2(e),
    and max + log2(l) times ln(2)), and of the largest sum scale * sum_d |q_d k_d| a score is
    summed from (Cauchy-Schwarz: scale * max |q_i| * max |k_j|): a score that cancels to
    near 0 keeps the rounding of its terms, and with one key lse is that score, where
    PyTorch's own error, one sample, may happen to be ~0."""
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(lse), finite):
        raise Mismatch("lse: its -inf rows differ from the oracle's")
    size = ref[finite].abs().max().item() if finite.any() else 0.0
    dots = 0.0
    if q.numel() and k.numel():
        dots = scale * (q.double().norm(dim=-1).max() * k.double().norm(dim=-1).max()).item()
    return check("lse", lse[finite], ref[finite], lowp[finite].float(),
                 extra=2 * 2 * EPS32 * size + 2 * EPS32 * dots)


def _scale(c):
    return c["scale"] or 1 / math.sqrt(c["d"])


def fa2_allowances(oracle, leaves, o_stored, do, scale, group):
    """Per-leaf extra allowances of FlashAttention-2-style gradients (module docstring).

    ``oracle(q, k, v, **oracle.extras(leaves), v_override=None)`` returns (out, lse) in
    float64 for float64 leaves (q, k, v[, sinks][, bias]) in the call's layout, with the dense
    (batch, heads, rows, dim) view of q, k, v given by ``oracle.dense``. Returns a list of
    floats, one per leaf."""
    leaves_in = leaves
    leaves = [t.detach().double().requires_grad_() for t in leaves]
    extras = oracle.extras(leaves)
    out, lse = oracle(*leaves[:3], **extras)
    do64, o_st = do.double(), o_stored.detach().double()
    c = (do64 * out.detach()).sum(-1) - (do64 * o_st).sum(-1)      # delta_true - delta_stored
    c = oracle.lse_layout(c).masked_fill(~torch.isfinite(lse.detach()), 0.0)
    inherited = torch.autograd.grad((c * lse.nan_to_num(0.0, neginf=0.0)).sum(), leaves,
                                    allow_unused=True)
    # The kernels return that gradient rounded to the leaf's dtype: one more ulp of its size
    # (where the true gradient is ~0, PyTorch's error and the floor do not cover it).
    extra = [(1 + torch.finfo(t.dtype).eps) * g.abs().max().item()
             if g is not None and g.numel() else 0.0 for g, t in zip(inherited, leaves_in)]
    # 2 fp32 ulps of the sizes the FA-2 backward rounds (fa2_oracle in tests/helpers.py).
    # The kernels compute in fp32 whatever the input dtype, so this holds for all of them; it
    # matters where the true gradient is ~0 (one visible key: dS = P (dP - delta) = 0), so that
    # PyTorch's error and the floor are ~0 too.
    q, k, v, do_d, o_d = oracle.dense(*(t.detach() for t in leaves[:3]), do64, o_st)
    p, lse_d, drop = oracle.weights(*leaves[:3], **extras)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logp = torch.where(p > 0, p.clamp_min(1e-300).log(), torch.zeros_like(p))
    lse_f = lse_d.nan_to_num(0.0, neginf=0.0)[..., None]
    p_rel = torch.where(p > 0, (logp + lse_f).abs(), torch.zeros_like(p)) + lse_f.abs()
    dp = (do_d @ v.transpose(-1, -2)) * drop
    delta = (do_d * o_d).sum(-1, keepdim=True)
    sums = (do_d.abs() @ v.abs().transpose(-1, -2)) * drop + (do_d.abs() * o_d.abs()).sum(
        -1, keepdim=True)
    ds_err = p * (sums + p_rel * (dp - delta).abs())
    noise = [scale * (ds_err @ k.abs()), scale * (ds_err.transpose(-1, -2) @ q.abs()),
             (p * p_rel * drop).transpose(-1, -2) @ do_d.abs()]
    for i in (1, 2):
        b, h, n, dd = noise[i].shape
        noise[i] = noise[i].view(b, h // group, group, n, dd).sum(2)
    for i, n in enumerate(noise):
        extra[i] += 2 * EPS32 * (n.max().item() if n.numel() else 0.0)
    if oracle.sinks_given:
        p_sink = (1.0 - p.sum(-1)).clamp_min(0.0)                   # the sink's weight
        size = (do_d.abs() * o_d.abs()).sum(-1)                     # |delta|'s terms
        extra[3] += 2 * EPS32 * (p_sink * size).sum().item()
    if oracle.bias_given:       # d(bias) is dS, summed over the dims the bias broadcasts
        bias = leaves[-1]
        shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
        extra[-1] += 2 * EPS32 * ds_err.sum_to_size(shape).max().item() if ds_err.numel() \
            else 0.0
    return extra


def grads_check(out, leaves, ref_fn, low_fn, oracle, do, c, scale):
    """dq, dk, dv[, dsinks][, dbias] against the oracle's with the FA-2 allowances."""
    grads = torch.autograd.grad(out, leaves, do, allow_unused=True)
    ref_in = [t.detach().double().requires_grad_() for t in leaves]
    low_in = [t.detach().clone().requires_grad_() for t in leaves]
    ro = ref_fn(*ref_in)
    rg = torch.autograd.grad(ro, ref_in, do.double(), allow_unused=True)
    lo = low_fn(*low_in)
    lg = torch.autograd.grad(lo, low_in, do, allow_unused=True)
    extra = fa2_allowances(oracle, leaves, out, do, scale, c["group"])
    names = ("dq", "dk", "dv") + ("dsinks",) * oracle.sinks_given + (
        "dbias",) * oracle.bias_given
    assert len(names) == len(leaves)
    worst = (0.0, "")
    for name, g, r, lg_, e in zip(names, grads, rg, lg, extra):
        worst = max(worst, check(name, g, r, lg_, GRAD_FACTOR, e))
    return worst


def _check_all(c, gen, outs, lses, q, k, leaves, ref_fn, oracle):
    """out and lse (each (ours, float64 oracle, PyTorch in the dtype)), then with
    ``c["grad"]`` the gradients of ``leaves`` for a random dO (``grads_check``)."""
    out = outs[0]
    worst = check("out", *outs)
    worst = max(worst, check_lse(*lses, q.detach(), k.detach(), _scale(c)))
    if c["grad"]:
        do = _randn(gen, *out.shape, dtype=out.dtype)
        worst = max(worst, grads_check(out, leaves, ref_fn(True), ref_fn(False), oracle, do, c,
                                       _scale(c)))
    return worst


# ------------------------------------------------------------------ routes
class DenseOracle:
    """reference.attention in float64 with the case's options; ``weights`` gives P by
    attending to the identity (one value column per key)."""

    bias_given = False    # an additive attn_mask among the leaves (dense calls)

    def __init__(self, kw, keep, sinks_given):
        self.opts, self.kw, self.keep, self.sinks_given = kw, _twins(kw), keep, sinks_given

    def extras(self, leaves):
        """The oracle's keyword arguments for the leaves after q, k, v."""
        rest = list(leaves[3:])
        extras = {"sinks": rest.pop(0)} if self.sinks_given else {}
        if self.bias_given:
            extras["bias"] = rest.pop(0)
        return extras

    def __call__(self, q, k, v, sinks=None, v_override=None, keep=True, bias=None):
        kw = dict(self.kw if bias is None else _twins(self.opts, bias))
        if self.sinks_given:
            kw["sinks"] = sinks
        p = kw.pop("dropout_p")
        return reference.attention(q, k, v if v_override is None else v_override, upcast=True,
                                   return_lse=True, keep_mask=self.keep if keep else None,
                                   dropout_p=p if keep else 0.0, **kw)

    @staticmethod
    def lse_layout(c):
        return c

    @staticmethod
    def dense(*ts):
        return ts

    def weights(self, q, k, v, sinks=None, bias=None):
        b, hkv, n, _ = k.shape
        eye = torch.eye(n, dtype=torch.float64).expand(b, hkv, n, n)
        p, lse = self(q.detach(), k.detach(), eye, sinks.detach() if sinks is not None
                      else None, keep=False, bias=None if bias is None else bias.detach())
        drop = (self.keep / (1 - self.kw["dropout_p"])).double() if self.keep is not None \
            else torch.ones_like(p)
        return p, lse, drop


def _trainable(c, gen, num, q, k, v):
    """The options of a differentiable route (dense, varlen), its sinks and the leaves its
    gradients are checked for (q, k, v[, sinks][, an additive attn_mask]; requiring grad with
    ``c["grad"]``)."""
    mods = _mods(c, gen, num)
    sinks = mods.pop("sinks")
    opts = dict(causal=c["causal"], window=c["window"], chunk_size=c["chunk"],
                softmax_scale=c["scale"], dropout_p=c["dropout"], **mods)
    bias = mods.get("attn_mask")
    leaves = [q, k, v] + ([sinks] if sinks is not None else []) + (
        [bias] if bias is not None and bias.is_floating_point() else [])
    if c["grad"]:
        for t in leaves:
            t.requires_grad_()
    return opts, sinks, leaves


def run_dense(c, gen):
    dtype = DTYPES[c["dtype"]]
    b, hkv, hq = c["batch"], c["heads_kv"], c["heads_kv"] * c["group"]
    q = _view(_randn(gen, b, hq, c["q_len"], c["d"], dtype=dtype), c["transposed"])
    k = _view(_randn(gen, b, hkv, c["k_len"], c["d"], dtype=dtype), c["transposed"])
    v = _view(_randn(gen, b, hkv, c["k_len"], c["dv"], dtype=dtype), c["transposed"])
    opts, sinks, leaves = _trainable(c, gen, b, q, k, v)
    out, lse = _api("attention")(q, k, v, sinks=sinks, seed=c["dropout_seed"], return_lse=True,
                                 **opts)
    keep = None
    if c["dropout"]:
        keep = reference.dropout_keep_mask(c["dropout_seed"], b, hq, c["q_len"], c["k_len"],
                                           c["dropout"])
    oracle = DenseOracle(opts, keep, sinks is not None)
    oracle.bias_given = len(leaves) > 3 + (sinks is not None)

    def ref_fn(upcast):
        def fn(q, k, v, *rest):
            extras = oracle.extras((q, k, v, *rest))
            return reference.attention(q, k, v, sinks=extras.get("sinks"), upcast=upcast,
                                       keep_mask=keep, **_twins(opts, extras.get("bias")))
        return fn

    with torch.no_grad():
        ins = [t.detach().double() for t in leaves]
        ro, rl = oracle(*ins[:3], **oracle.extras(ins))
        lo, ll = reference.attention(*(t.detach() for t in leaves[:3]), upcast=False,
                                     sinks=None if sinks is None else sinks.detach(),
                                     keep_mask=keep, return_lse=True, **_twins(opts))
    return _check_all(c, gen, (out, ro, lo), (lse, rl, ll), q, k, leaves, ref_fn, oracle)


class VarlenOracle(DenseOracle):
    """reference.attention_varlen; ``dense`` views the packed tensors as one batch entry of
    all rows (P is zero across sequences, so the dense formulas hold)."""

    def __init__(self, kw, keeps, sinks_given, cu_q, cu_k):
        super().__init__(kw, keeps, sinks_given)
        self.cu_q, self.cu_k = cu_q, cu_k

    def __call__(self, q, k, v, sinks=None, v_override=None, keep=True):
        kw = dict(self.kw)
        if self.sinks_given:
            kw["sinks"] = sinks
        p = kw.pop("dropout_p")
        return reference.attention_varlen(
            q, k, v if v_override is None else v_override, self.cu_q, self.cu_k, upcast=True,
            return_lse=True, keep_masks=self.keep if keep else None,
            dropout_p=p if keep else 0.0, **kw)

    @staticmethod
    def lse_layout(c):          # (total_q, heads) -> (heads, total_q)
        return c.transpose(0, 1)

    @staticmethod
    def dense(*ts):
        return tuple(t.transpose(0, 1).unsqueeze(0) for t in ts)

    def weights(self, q, k, v, sinks=None):
        total_k, hkv = k.shape[:2]
        eye = torch.eye(total_k, dtype=torch.float64)[:, None, :].expand(total_k, hkv, total_k)
        p, lse = self(q.detach(), k.detach(), eye, sinks.detach() if sinks is not None
                      else None, keep=False)
        p = p.transpose(0, 1).unsqueeze(0)                            # (1, hq, total_q, total_k)
        drop = torch.ones_like(p)
        if self.keep is not None:
            scale = 1 / (1 - self.kw["dropout_p"])
            for s, m in enumerate(self.keep):
                drop[0, :, self.cu_q[s]:self.cu_q[s + 1],
                     self.cu_k[s]:self.cu_k[s + 1]] = m.double() * scale
        return p, lse.unsqueeze(0), drop


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def run_varlen(c, gen):
    dtype = DTYPES[c["dtype"]]
    hkv, hq = c["heads_kv"], c["heads_kv"] * c["group"]
    cu_q, cu_k = _cu(c["lens_q"]), _cu(c["lens_k"])
    q = _randn(gen, cu_q[-1], hq, c["d"], dtype=dtype)
    k = _randn(gen, cu_k[-1], hkv, c["d"], dtype=dtype)
    v = _randn(gen, cu_k[-1], hkv, c["dv"], dtype=dtype)
    if c["transposed"]:   # head-major buffers seen as (total, heads, dim)
        q, k, v = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v))
    opts, sinks, leaves = _trainable(c, gen, c["batch"], q, k, v)
    tq, tk = (torch.tensor(x, dtype=torch.int32) for x in (cu_q, cu_k))
    out, lse = _api("attention_varlen")(q, k, v, tq, tk, max(c["lens_q"]), max(c["lens_k"]),
                                        sinks=sinks, seed=c["dropout_seed"], return_lse=True,
                                        **opts)
    keeps = None
    if c["dropout"]:
        keeps = reference.dropout_keep_mask_varlen(c["dropout_seed"], cu_q, cu_k, hq,
                                                   c["dropout"])
    oracle = VarlenOracle(opts, keeps, sinks is not None, cu_q, cu_k)

    def ref_fn(upcast):
        def fn(q, k, v, s=None):
            return reference.attention_varlen(q, k, v, cu_q, cu_k, sinks=s, upcast=upcast,
                                              keep_masks=keeps, **_twins(opts))
        return fn

    with torch.no_grad():
        ins = [t.detach() for t in leaves]
        ro, rl = oracle(*[t.double() for t in ins])
        lo, ll = reference.attention_varlen(*ins[:3], cu_q, cu_k, upcast=False,
                                            sinks=ins[3] if sinks is not None else None,
                                            keep_masks=keeps, return_lse=True, **_twins(opts))
    return _check_all(c, gen, (out, ro, lo), (lse, rl, ll), q, k, leaves, ref_fn, oracle)


def _to_pages_like(cache, table, page_size):
    """A (b, h, max_len, d) cache's pages in ``table``'s order: (b * max_blocks, page_size, h,
    d), the last page of each row zero-padded."""
    b, h, n, d = cache.shape
    blocks = table.shape[1]
    padded = torch.zeros(b, h, blocks * page_size, d, dtype=cache.dtype)
    padded[:, :, :n] = cache
    return padded.view(b, h, blocks, page_size, d).permute(0, 2, 3, 1, 4).reshape(
        b * blocks, page_size, h, d)


def _to_pages(cache, page_size, gen):
    """A (b, h, max_len, d) cache as a pool of pages (num_blocks, page_size, h, d) in shuffled
    order, two spare pages of noise, and its block table (b, max_blocks)."""
    b, h, n, d = cache.shape
    blocks = -(-n // page_size)
    num = b * blocks + 2
    perm = torch.randperm(num, generator=gen)[:b * blocks].view(b, blocks)
    pages = torch.randn(num, page_size, h, d, generator=gen).to(cache.dtype)
    pages[perm.flatten()] = _to_pages_like(cache, perm, page_size)
    return pages, perm.to(torch.int32)


def _from_pages(pages, table, n):
    b, blocks = table.shape
    ps, h, d = pages.shape[1:]
    return pages[table.long().flatten()].view(b, blocks, ps, h, d).permute(
        0, 3, 1, 2, 4).reshape(b, h, blocks * ps, d)[:, :, :n]


def run_kvcache(c, gen):
    dtype = DTYPES[c["dtype"]]
    b, hkv, hq, n = c["batch"], c["heads_kv"], c["heads_kv"] * c["group"], c["cache_len"]
    q = _view(_randn(gen, b, hq, c["q_len"], c["d"], dtype=dtype), c["transposed"])
    k_cache = _randn(gen, b, hkv, n, c["d"], dtype=dtype)
    v_cache = _randn(gen, b, hkv, n, c["dv"], dtype=dtype)
    new_k = new_v = None
    if c["append"]:
        new_k = _randn(gen, b, hkv, c["q_len"], c["d"], dtype=dtype)
        new_v = _randn(gen, b, hkv, c["q_len"], c["dv"], dtype=dtype)
    seqlens = torch.tensor(c["seqlens"], dtype=torch.int32)
    mods = _mods(c, gen, b)
    opts = dict(causal=c["causal"], window=c["window"], chunk_size=c["chunk"],
                softmax_scale=c["scale"], **mods)
    # The oracle's caches, before the call writes into ours: float64 and the input dtype.
    ref_k, ref_v = k_cache.double(), v_cache.double()
    low_k, low_v = k_cache.clone(), v_cache.clone()
    if c["route"] == "paged":
        kc, table = _to_pages(k_cache, c["page_size"], gen)
        vc = torch.randn(kc.shape[:3] + (c["dv"],), generator=gen).to(dtype)
        vc[table.long().flatten()] = _to_pages_like(v_cache, table, c["page_size"])
        out, lse = _api("attention_with_kvcache")(q, kc, vc, seqlens, new_k, new_v,
                                                  block_table=table,
                                                  num_splits=c["num_splits"],
                                                  return_lse=True, **opts)
        got_k, got_v = _from_pages(kc, table, n), _from_pages(vc, table, n)
    else:
        out, lse = _api("attention_with_kvcache")(q, k_cache, v_cache, seqlens, new_k, new_v,
                                                  num_splits=c["num_splits"], return_lse=True,
                                                  **opts)
        got_k, got_v = k_cache, v_cache
    ro, rl = reference.attention_with_kvcache(
        q.double(), ref_k, ref_v, c["seqlens"],
        None if new_k is None else new_k.double(), None if new_v is None else new_v.double(),
        upcast=True, return_lse=True, **_twins(opts))
    lo, ll = reference.attention_with_kvcache(q, low_k, low_v, c["seqlens"], new_k, new_v,
                                              upcast=False, return_lse=True, **_twins(opts))
    if not (torch.equal(got_k, low_k) and torch.equal(got_v, low_v)):
        raise Mismatch("cache: the appended cache differs from the oracle's")
    worst = check("out", out, ro, lo)
    return max(worst, check_lse(lse, rl, ll, q, low_k, _scale(c)))


def run_paged_varlen(c, gen):
    dtype = DTYPES[c["dtype"]]
    hkv, hq, ps = c["heads_kv"], c["heads_kv"] * c["group"], c["page_size"]
    lens_q, lens_k = c["lens_q"], c["lens_k"]
    cu_q = _cu(lens_q)
    q = _randn(gen, cu_q[-1], hq, c["d"], dtype=dtype)
    n = max(max(lens_k), 1)
    k_dense = _randn(gen, len(lens_k), hkv, n, c["d"], dtype=dtype)
    v_dense = _randn(gen, len(lens_k), hkv, n, c["dv"], dtype=dtype)
    kc, table = _to_pages(k_dense, ps, gen)
    vc = torch.randn(kc.shape[:3] + (c["dv"],), generator=gen).to(dtype)
    vc[table.long().flatten()] = _to_pages_like(v_dense, table, ps)
    mods = _mods(c, gen, len(lens_q))
    opts = dict(causal=c["causal"], window=c["window"], chunk_size=c["chunk"],
                softmax_scale=c["scale"], **mods)
    used = torch.tensor(lens_k, dtype=torch.int32)
    out, lse = _api("attention_varlen")(q, kc, vc, torch.tensor(cu_q, dtype=torch.int32), None,
                                        max(lens_q), block_table=table, seqused_k=used,
                                        return_lse=True, **opts)
    # The oracle over the same keys packed: sequence s's first lens_k[s] positions.
    k = torch.cat([k_dense[s, :, :lens_k[s]].transpose(0, 1) for s in range(len(lens_k))])
    v = torch.cat([v_dense[s, :, :lens_k[s]].transpose(0, 1) for s in range(len(lens_k))])
    cu_k = _cu(lens_k)
    ro, rl = reference.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k,
                                        upcast=True, return_lse=True, **_twins(opts))
    lo, ll = reference.attention_varlen(q, k, v, cu_q, cu_k, upcast=False, return_lse=True,
                                        **_twins(opts))
    worst = check("out", out, ro, lo)
    return max(worst, check_lse(lse, rl, ll, q, k, _scale(c)))


def run_fa(c, gen):
    dtype = DTYPES[c["dtype"]]
    b, hkv, hq = c["batch"], c["heads_kv"], c["heads_kv"] * c["group"]
    q = _randn(gen, b, c["q_len"], hq, c["d"], dtype=dtype)       # FlashAttention's layout
    k = _randn(gen, b, c["k_len"], hkv, c["d"], dtype=dtype)
    v = _randn(gen, b, c["k_len"], hkv, c["dv"], dtype=dtype)
    if c["transposed"]:   # head-major buffers seen as (b, s, h, d)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    mods = _mods(c, gen, b)
    sinks = mods.pop("sinks")
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    if c["grad"]:
        for t in leaves:
            t.requires_grad_()
    out, lse, _ = _api("flash_attn_func")(q, k, v, softmax_scale=c["scale"], causal=c["causal"],
                                     window_size=c["window_size"],
                                     softcap=c["softcap"] or 0.0,
                                     alibi_slopes=mods["alibi_slopes"],
                                     attention_chunk=c["attention_chunk"], s_aux=sinks,
                                     return_attn_probs=True)
    opts = dict(causal=False, softmax_scale=c["scale"], dropout_p=0.0,
                mask_mod=reference.flash_attn_mask(c["causal"], c["window_size"],
                                                   chunk=c["attention_chunk"]),
                **mods)

    def bhsd(t):
        return t.transpose(1, 2)

    def ref_fn(upcast):
        def fn(q, k, v, s=None):
            return bhsd(reference.attention(bhsd(q), bhsd(k), bhsd(v), sinks=s, upcast=upcast,
                                            **opts))
        return fn

    oracle = FaOracle(opts, None, sinks is not None)
    with torch.no_grad():
        ins = [t.detach() for t in leaves]
        ro, rl = oracle(*[t.double() for t in ins])
        lo, ll = oracle.call(*ins, upcast=False)
    return _check_all(c, gen, (out, ro, lo), (lse, rl, ll), q, k, leaves, ref_fn, oracle)


class FaOracle(DenseOracle):
    """DenseOracle in FlashAttention's (b, s, h, d) layout (lse stays (b, h, s))."""

    def call(self, q, k, v, sinks=None, v_override=None, upcast=True):
        kw = dict(self.kw)
        if self.sinks_given:
            kw["sinks"] = sinks
        vv = v if v_override is None else v_override
        out, lse = reference.attention(q.transpose(1, 2), k.transpose(1, 2), vv.transpose(1, 2),
                                       upcast=upcast, return_lse=True, **kw)
        return out.transpose(1, 2), lse

    def __call__(self, q, k, v, sinks=None, v_override=None, keep=True):
        return self.call(q, k, v, sinks, v_override)

    @staticmethod
    def lse_layout(c):          # (b, s, h) -> (b, h, s)
        return c.transpose(1, 2)

    @staticmethod
    def dense(*ts):
        return tuple(t.transpose(1, 2) for t in ts)

    def weights(self, q, k, v, sinks=None):
        b, n, hkv, _ = k.shape
        eye = torch.eye(n, dtype=torch.float64)[None, :, None, :].expand(b, n, hkv, n)
        p, lse = self(q.detach(), k.detach(), eye, sinks.detach() if sinks is not None
                      else None)
        return p.transpose(1, 2), lse, torch.ones_like(p.transpose(1, 2))


RUNNERS = {"fa": run_fa, "dense": run_dense, "varlen": run_varlen, "kvcache": run_kvcache,
           "paged": run_kvcache, "paged_varlen": run_paged_varlen}


def run_case(c, backend="kernel", device="cpu"):
    """Run one drawn case on ``backend``: "kernel" (the Triton kernels: Triton's interpreter
    on CPU), "compiled" (the same under ``torch.compile``, ``_api``) or "fallback" (the
    PyTorch path CPU tensors take with TRITON_INTERPRET=0, read at each call). ``device``:
    where the kernel and compiled backends run (``_api``); the fallback always on the CPU.
    Returns (the worst error / budget ratio, <= 1, and the check it came from), or raises
    ``Mismatch`` (or the call's own error)."""
    gen = torch.Generator().manual_seed(c["input_seed"])
    saved = os.environ.get("TRITON_INTERPRET")
    if backend == "fallback" or device == "cpu":   # read per call for CPU tensors only
        os.environ["TRITON_INTERPRET"] = "0" if backend == "fallback" else "1"
    _MODE.update(compile=backend == "compiled",
                 device="cpu" if backend == "fallback" else device)
    if _MODE["compile"]:
        torch._dynamo.reset()       # a fresh cache per case: no recompile limit across cases
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kernels.FallbackNotice)
            return RUNNERS[c["route"]](c, gen)
    finally:
        _MODE.update(compile=False, device="cpu")
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def build_parser():
    """The command line (also validated by the device script's dry run, tools/device_plan)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=50)
    ap.add_argument("--seed", type=int, default=None, help="default: drawn, and printed")
    ap.add_argument("--only", type=int, default=None, help="run case ONLY of --seed")
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--backends", default="kernel",
                    help="some of kernel, compiled, fallback, comma-separated (each case on "
                         "each)")
    ap.add_argument("--device", default="cpu",
                    help="cpu (the kernels in Triton's interpreter) or cuda (compiled kernels; "
                         "inputs, oracle and checks on the CPU)")
    ap.add_argument("--budget", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("-v", "--verbose", action="store_true", help="tracebacks of failures")
    return ap


def main(argv=None):
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.device != "cpu":
        # One fitting config per launch, as the test suite on a GPU: autotuning every random
        # shape would time hundreds of configs per case.
        os.environ.setdefault("KERNELS_AUTOTUNE", "0")
    seed = a.seed if a.seed is not None else random.randrange(2**31)
    routes = tuple(a.routes.split(","))
    unknown = set(routes) - set(ROUTES)
    if unknown:
        ap.error(f"unknown routes {sorted(unknown)}; expected some of {ROUTES}")
    backends = tuple(a.backends.split(","))
    if not set(backends) <= {"kernel", "compiled", "fallback"}:
        ap.error(f"--backends: some of kernel, compiled, fallback; got {a.backends}")
    indices = [a.only] if a.only is not None else range(a.cases)
    print(f"fuzz_parity: seed {seed}, backends {','.join(backends)} on {a.device}, torch "
          f"{torch.__version__}, triton {triton.__version__}", flush=True)
    start, failed, ran, worst = time.time(), [], 0, (0.0, "")
    for i in indices:
        if a.budget is not None and time.time() - start > a.budget:
            break
        c = draw_case(seed, i, routes)
        for backend in backends:
            t0 = time.time()
            try:
                ratio, name = run_case(c, backend, a.device)
                worst = max(worst, (ratio, f"{name} of case {i} on the {backend}"))
                status = f"ok {ratio:.2f} {name}"
            except Exception as e:  # noqa: BLE001 -- every failure is reported, then counted
                failed.append(i)
                status = f"FAIL {type(e).__name__}: {e}"
                if a.verbose:
                    traceback.print_exc()
            ran += 1
            print(f"[{i}] {backend} {time.time() - t0:5.1f}s {status} | {describe(c)}",
                  flush=True)
    print(f"fuzz_parity: {ran} runs, {len(failed)} failed"
          + (f" (replay: --seed {seed} --only N for N in {failed})" if failed else "")
          + f", worst error/budget {worst[0]:.2f} ({worst[1]}), {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
