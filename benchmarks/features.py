"""Feature rows (issue 9): grouped-query heads, a sliding window, packed variable-length
sequences, each against what it should be at least as good as. ``--features`` picks them,
``--no-features`` skips them; in the run order they come right after the sweep's primary
config (see cli.py), and rows not started within the time budget say ``skipped: time budget``.

Modes ``fwd`` and ``fwd_bwd``, causal, the sweep's first dtype, measured like every other row
(measure.py). Rows have every ``sweep.ROW_KEYS`` field (``heads`` = query heads) plus
``heads_kv`` and ``window`` (None = none); the comparison fields sit on the row of ours that
the target is about, with ``target`` (the issue's target, in words) and ``target_met`` (True /
False on a GPU when both rows ran; None on CPU, where the kernel runs in Triton's
interpreter and the figures say nothing about GPU speed, or when a row is missing).

=========  ======================  =========================================================
bench      provider                what
=========  ======================  =========================================================
gqa        kernels                 ``kernels.attention`` with k/v of ``heads_kv`` heads
gqa        kernels_mha             ours with k/v repeated to ``heads`` heads (MHA, same query
                                   heads, same values): the target is GQA >= MHA
                                   (``speedup_vs_mha`` = MHA ms / GQA ms >= 1)
gqa        sdpa_*                  ``F.scaled_dot_product_attention(enable_gqa=True)`` forced to
                                   one backend (CPU: math, flash; CUDA: flash, efficient,
                                   cudnn); ``speedup_vs_best_sdpa`` on the kernels row
window     kernels                 ``kernels.attention(window=W)``
window     kernels_causal          ours, full causal, same inputs: ``speedup_vs_full`` =
                                   causal ms / window ms, target >= 3.5; ``ideal_speedup`` =
                                   visible pairs causal / window (flops.ideal_window_speedup)
window     torch_varlen            PyTorch's packed flash attention
                                   (``torch.nn.attention.varlen.varlen_attn``, window_size
                                   (W-1, 0)) on the one sequence; CUDA only
varlen     kernels_varlen          ``kernels.attention_varlen`` on the packed batch
varlen     kernels_dense_each      ours dense, each sequence run alone (one call per sequence,
                                   batch 1, in order; views of the same packed tokens)
varlen     kernels_dense_padded    ours dense, one call on the batch right-padded to the
                                   longest sequence (padding keys come after every real query,
                                   so the real rows are exact); its padding work is not counted
varlen     torch_varlen            ``varlen_attn`` (window_size (-1, 0): causal); CUDA only
=========  ======================  =========================================================

Varlen rows: ``batch`` = number of sequences, ``seq_len`` = the longest, extra ``seqlens``
and ``total_tokens``; every varlen row counts the same FLOPs, each sequence's own causal work
(flops.varlen_flops: sum of len^2 / 2-based), so their TFLOP/s compare directly.
``tflops_vs_dense_each`` (target >= 0.9: varlen within 10 % of the dense kernel at the same
lengths) and ``tflops_vs_dense_padded`` sit on the kernels_varlen row.
"""
import random
import time

import torch

from .flops import attention_flops, ideal_window_speedup, tflops, varlen_flops
from .measure import MEASURE_KEYS, classify_failure, measure
from .providers import Case, SdpaProvider
from .sweep import add_speedups, new_row
from .timing import free_memory

FEATURES = ("gqa", "window", "varlen")
FEATURE_MODES = ("fwd", "fwd_bwd")
CPU_REPS = 1  # timed calls per row on CPU (after the warm-up call)

# Shapes per profile ("cuda", "cpu", "cpu_quick"). GPU: the points; CPU: tiny versions
# of the same code paths (the kernel runs in Triton's interpreter, 16x16 tiles).
SHAPES = {
    "cuda": dict(
        gqa=dict(batch=4, heads=32, heads_kv=8, seq_len=4096, head_dim=128),
        window=dict(batch=1, heads=16, seq_len=32768, head_dim=128, window=4096),
        varlen=dict(total=16384, lo=128, hi=4096, heads=16, head_dim=128, seed=0)),
    # CPU: a handful of 16x16 tiles per call (each interpreted call still takes 0.1-1 s).
    "cpu": dict(
        gqa=dict(batch=1, heads=2, heads_kv=1, seq_len=32, head_dim=32),
        window=dict(batch=1, heads=1, seq_len=64, head_dim=32, window=16),
        varlen=dict(total=64, lo=8, hi=32, heads=1, head_dim=32, seed=0)),
}
GQA_SDPA = {"cuda": ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn"),
            "cpu": ("sdpa_math", "sdpa_flash")}
TARGETS = {"gqa": ("speedup_vs_mha", 1.0, "GQA at least as fast as MHA with the same query "
                                          "heads (speedup_vs_mha >= 1)"),
           "window": ("speedup_vs_full", 3.5, "window at least 3.5x faster than full causal "
                                              "(speedup_vs_full >= 3.5)"),
           "varlen": ("tflops_vs_dense_each", 0.9, "varlen TFLOP/s within 10% of the dense "
                                                  "kernel's at the same lengths "
                                                  "(tflops_vs_dense_each >= 0.9)")}


def profile(device, quick=False):
    """"cuda" or "cpu" (the CPU shapes are already as small as the code paths allow, so
    ``--quick`` keeps them)."""
    return torch.device(device).type


def mixed_lengths(total, lo, hi, seed):
    """A fixed, seeded list of sequence lengths in [lo, hi] summing to ``total`` (hi >= 2*lo;
    the last one is whatever is left, also in [lo, hi])."""
    if hi < 2 * lo:
        raise ValueError(f"need hi >= 2 * lo, got lo={lo}, hi={hi}")
    rng = random.Random(seed)
    out, left = [], total
    while left > 0:
        if left <= hi:
            n = left
        else:
            n = rng.randint(lo, hi)
            if left - n < lo:
                n = left - lo
        out.append(n)
        left -= n
    return out


def _randn(g, shape, device, dtype):
    return torch.randn(shape, generator=g, device=device).to(dtype)


def _maker(forward, mode, douts):
    """``make()`` for fwd (under no_grad) or fwd_bwd (one backward through every output);
    ``forward()`` returns a list of outputs, ``douts`` their upstream gradients."""
    if mode == "fwd":
        def make():
            def fn():
                with torch.no_grad():
                    return forward()
            return fn
    elif mode == "fwd_bwd":
        def make():
            def fn():
                torch.autograd.backward(forward(), douts)
            return fn
    else:
        raise ValueError(f"feature rows time fwd and fwd_bwd, not {mode!r}")
    return make


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _sdpa_gqa(backend_name):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def f(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return f


def _torch_varlen_reason(device):
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:
        return "torch.nn.attention.varlen missing in this torch"
    if torch.device(device).type != "cuda":
        return "CUDA-only (PyTorch's packed flash attention)"
    return None


def _torch_varlen_refused(exc, caught_warnings):
    """PyTorch's varlen_attn is a young API (its arguments and supported cases vary by
    version and GPU): its refusal of a case is that peer's limitation, not an error of ours."""
    if isinstance(exc, (RuntimeError, TypeError, ValueError, NotImplementedError)):
        text = " ".join(str(exc).split())
        return f"varlen_attn: {type(exc).__name__}: {text}"[:200]
    return None


def _torch_varlen(q, k, v, cu, max_len, window):
    from torch.nn.attention.varlen import varlen_attn

    left = -1 if window is None else window - 1
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(left, 0))


class _Spec:
    """One provider of a feature: ``build()`` -> (forward returning a list of outputs, leaf
    inputs); ``douts`` the outputs' upstream gradients; ``static`` why it cannot run at all;
    ``unsupported(exc, warnings)`` which first-call errors mean "unsupported"; ``extra``
    fields of its rows."""

    def __init__(self, provider, build, douts, static=None, unsupported=None, extra=None):
        self.provider, self.build, self.douts, self.static = provider, build, douts, static
        self.unsupported, self.extra = unsupported, extra or {}


def _gqa_specs(sh, device, dtype, sdpa_names):
    B, H, Hkv, L, D = sh["batch"], sh["heads"], sh["heads_kv"], sh["seq_len"], sh["head_dim"]
    g = torch.Generator(device=device).manual_seed(L)
    q, k, v = (_randn(g, (B, h, L, D), device, dtype) for h in (H, Hkv, Hkv))
    do = _randn(g, (B, H, L, D), device, dtype)
    rep = H // Hkv
    case = Case(batch=B, heads=H, seq_len=L, head_dim=D, dtype=dtype, dropout_p=0.0,
                device=device)

    def ours(kv_rep):
        def build():
            import kernels

            qq = _leaf(q)
            kk, vv = (_leaf(x.repeat_interleave(kv_rep, 1)) for x in (k, v))
            return (lambda: [kernels.attention(qq, kk, vv, causal=True)]), (qq, kk, vv)
        return build

    def sdpa(name):
        def build():
            f = _sdpa_gqa(SdpaProvider(name).backend_name)
            qq, kk, vv = _leaf(q), _leaf(k), _leaf(v)
            return (lambda: [f(qq, kk, vv)]), (qq, kk, vv)
        prov = SdpaProvider(name)
        return _Spec(name, build, [do], static=prov.static_reason(case),
                     unsupported=prov.unsupported_reason, extra=dict(heads_kv=Hkv))

    specs = [_Spec("kernels", ours(1), [do], extra=dict(heads_kv=Hkv)),
             _Spec("kernels_mha", ours(rep), [do], extra=dict(heads_kv=H))]
    specs += [sdpa(n) for n in sdpa_names]
    flops = {m: attention_flops(B, H, L, L, D, causal=True, mode=m) for m in FEATURE_MODES}
    return case, specs, flops


def _window_specs(sh, device, dtype):
    B, H, L, D, W = sh["batch"], sh["heads"], sh["seq_len"], sh["head_dim"], sh["window"]
    g = torch.Generator(device=device).manual_seed(L)
    q, k, v, do = (_randn(g, (B, H, L, D), device, dtype) for _ in range(4))
    case = Case(batch=B, heads=H, seq_len=L, head_dim=D, dtype=dtype, dropout_p=0.0,
                device=device)

    def ours(window):
        def build():
            import kernels

            qq, kk, vv = _leaf(q), _leaf(k), _leaf(v)
            return (lambda: [kernels.attention(qq, kk, vv, causal=True, window=window)]), (
                qq, kk, vv)
        return build

    def varlen_build():
        # One packed sequence per batch entry: (B*L, H, D) views of the same values.
        qq, kk, vv = (_leaf(x.transpose(1, 2).reshape(B * L, H, D)) for x in (q, k, v))
        cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=device)
        return (lambda: [_torch_varlen(qq, kk, vv, cu, L, W).view(B, L, H, D).transpose(1, 2)]
                ), (qq, kk, vv)

    specs = [_Spec("kernels", ours(W), [do], extra=dict(heads_kv=H, window=W)),
             _Spec("kernels_causal", ours(None), [do], extra=dict(heads_kv=H, window=None)),
             _Spec("torch_varlen", varlen_build, [do], static=_torch_varlen_reason(device),
                   unsupported=_torch_varlen_refused, extra=dict(heads_kv=H, window=W))]
    flops = {(m, w): attention_flops(B, H, L, L, D, causal=True, mode=m, window=w)
             for m in FEATURE_MODES for w in (W, None)}
    return case, specs, flops


def _varlen_specs(sh, device, dtype):
    lens = mixed_lengths(sh["total"], sh["lo"], sh["hi"], sh["seed"])
    H, D, total, n, longest = sh["heads"], sh["head_dim"], sh["total"], len(lens), max(lens)
    g = torch.Generator(device=device).manual_seed(total)
    q, k, v, do = (_randn(g, (total, H, D), device, dtype) for _ in range(4))
    bounds = [0]
    for s in lens:
        bounds.append(bounds[-1] + s)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    case = Case(batch=n, heads=H, seq_len=longest, head_dim=D, dtype=dtype, dropout_p=0.0,
                device=device)
    spans = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def varlen_build():
        import kernels

        qq, kk, vv = _leaf(q), _leaf(k), _leaf(v)
        return (lambda: [kernels.attention_varlen(qq, kk, vv, cu, cu, longest, longest,
                                                  causal=True)]), (qq, kk, vv)

    def dense_each_build():
        import kernels

        qq, kk, vv = _leaf(q), _leaf(k), _leaf(v)

        def fwd():
            # (1, H, len, D) views of the packed tokens; the kernel reads strided views in place.
            return [kernels.attention(*(x[r].transpose(0, 1).unsqueeze(0) for x in (qq, kk, vv)),
                                      causal=True) for r in spans]
        return fwd, (qq, kk, vv)

    def padded(x):
        out = x.new_zeros(n, H, longest, D)
        for i, r in enumerate(spans):
            out[i, :, :lens[i]] = x[r].transpose(0, 1)
        return out

    def dense_padded_build():
        import kernels

        qq, kk, vv = (_leaf(padded(x)) for x in (q, k, v))
        return (lambda: [kernels.attention(qq, kk, vv, causal=True)]), (qq, kk, vv)

    def torch_varlen_build():
        qq, kk, vv = _leaf(q), _leaf(k), _leaf(v)
        return (lambda: [_torch_varlen(qq, kk, vv, cu, longest, None)]), (qq, kk, vv)

    extra = dict(heads_kv=H, window=None, total_tokens=total, seqlens=list(lens))
    do_each = [do[r].transpose(0, 1).unsqueeze(0) for r in spans]
    specs = [_Spec("kernels_varlen", varlen_build, [do], extra=extra),
             _Spec("kernels_dense_each", dense_each_build, do_each, extra=extra),
             _Spec("kernels_dense_padded", dense_padded_build, [padded(do)], extra=extra),
             _Spec("torch_varlen", torch_varlen_build, [do], static=_torch_varlen_reason(device),
                   unsupported=_torch_varlen_refused, extra=extra)]
    flops = {m: varlen_flops(lens, lens, H, D, causal=True, mode=m) for m in FEATURE_MODES}
    return case, specs, flops


def _measure_spec(spec, mode, device, opts):
    try:
        forward, grads = spec.build()
    except Exception as exc:
        return dict(dict.fromkeys(MEASURE_KEYS),
                    status=classify_failure(exc, (), spec.unsupported))
    grads = grads if mode != "fwd" else ()  # fwd: under no_grad, nothing written to .grad
    timing = {k: opts[k] for k in ("warmup_ms", "rep_ms", "cpu_reps", "cpu_max_s")}
    return measure(_maker(forward, mode, spec.douts), device, grads=grads,
                   unsupported_reason=spec.unsupported, **timing)


def feature_rows(device, dtype, features=FEATURES, opts=None, deadline=float("inf"),
                 progress=None, quick=False, sdpa_names=None):
    """Rows of the ``features`` (a subset of FEATURES), in that order; see the module
    docstring. ``sdpa_names`` restricts the SDPA backends of the GQA rows (None = the
    profile's)."""
    opts = dict(opts or dict(warmup_ms=10.0, rep_ms=50.0, cpu_reps=3, cpu_max_s=1.0))
    prof = profile(device, quick)
    if prof != "cuda":
        # The CPU rows exercise the code paths (their interpreted timings mean nothing): one
        # warm-up and one timed call each, so they add little to the default run.
        opts["cpu_reps"] = min(opts["cpu_reps"], CPU_REPS)
    shapes = SHAPES[prof]
    sdpa = GQA_SDPA["cuda" if prof == "cuda" else "cpu"]
    if sdpa_names is not None:
        sdpa = tuple(s for s in sdpa if s in sdpa_names)
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; choose from {FEATURES}")
    build = {"gqa": lambda sh: _gqa_specs(sh, device, dtype, sdpa),
             "window": lambda sh: _window_specs(sh, device, dtype),
             "varlen": lambda sh: _varlen_specs(sh, device, dtype)}
    rows = []
    for feature in features:
        sh = shapes[feature]
        try:
            case, specs, flops = build[feature](sh)
            setup_error = None
        except Exception as exc:  # e.g. no memory for the inputs
            setup_error, specs, case = classify_failure(exc), None, None
        if setup_error:
            rows.append(_failed_row(feature, sh, dtype, setup_error))
            continue
        frows = []
        for spec in specs:
            for mode in FEATURE_MODES:
                row = new_row(spec.provider, mode, case, bench=feature)
                row.update(heads_kv=None, window=None)
                row.update(spec.extra)
                if progress:
                    progress(None, None, f"{feature} {spec.provider} {mode}")
                if spec.static:
                    row["status"] = f"unsupported: {spec.static}"
                elif time.monotonic() > deadline:
                    row["status"] = "skipped: time budget"
                else:
                    row.update(_measure_spec(spec, mode, device, opts))
                    if row["status"] == "ok":
                        key = (mode, row["window"]) if feature == "window" else mode
                        row["tflops"] = tflops(flops[key], row["ms"])
                rows.append(row)
                frows.append(row)
        free_memory(device)
        _compare(feature, frows, device, sh)
    return rows


def _failed_row(feature, sh, dtype, status):
    case = Case(batch=sh.get("batch", 1), heads=sh["heads"], seq_len=sh.get("seq_len", sh.get(
        "hi", 1)), head_dim=sh["head_dim"], dtype=dtype, dropout_p=0.0, device="cpu")
    row = new_row("kernels", "fwd", case, bench=feature)
    row.update(heads_kv=sh.get("heads_kv", sh["heads"]), window=sh.get("window"), status=status)
    return row


def _compare(feature, rows, device, sh):
    """The comparison fields and the target on ours' rows of one feature (in place)."""
    by = {(r["provider"], r["mode"]): r for r in rows}
    field, threshold, text = TARGETS[feature]
    gpu = torch.device(device).type == "cuda"
    for mode in FEATURE_MODES:
        if feature == "gqa":
            mine, other = by.get(("kernels", mode)), by.get(("kernels_mha", mode))
            value = _ratio(other, mine, "ms")
        elif feature == "window":
            mine, other = by.get(("kernels", mode)), by.get(("kernels_causal", mode))
            value = _ratio(other, mine, "ms")
            if mine is not None:
                mine["ideal_speedup"] = ideal_window_speedup(sh["seq_len"], sh["seq_len"],
                                                             sh["window"])
        else:
            mine = by.get(("kernels_varlen", mode))
            other = by.get(("kernels_dense_each", mode))
            value = _ratio(mine, other, "tflops")
            if mine is not None:
                mine["tflops_vs_dense_padded"] = _ratio(
                    mine, by.get(("kernels_dense_padded", mode)), "tflops")
        if mine is None:
            continue
        mine[field] = value
        mine["target"] = text
        mine["target_met"] = (value >= threshold) if (gpu and value is not None) else None
    if feature == "gqa":
        add_speedups(rows)


def _ratio(a, b, key):
    """a[key] / b[key] when both rows are ok, else None."""
    if not a or not b or a["status"] != "ok" or b["status"] != "ok" or not b[key]:
        return None
    return a[key] / b[key]
