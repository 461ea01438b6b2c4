"""The opt-in Triton-interpreter rows of a CPU run (``python -m benchmarks --interpreter``).

On CPU a user runs ``kernels`` through its PyTorch fallback (kernels/core/fallback.py); our
Triton kernel itself runs there only in Triton's interpreter, 1,000-4,000x slower than
PyTorch. These rows say whether the interpreted kernel and the fallback agree, not how fast
either is on a GPU.

Rows ``bench="interpreter"``, one tiny shape (:data:`SHAPES`), causal, modes ``fwd`` and
``fwd_bwd``, dropout 0 and the sweep's other dropout values (same seed: both draw the same
mask), the sweep's first dtype, timed like every CPU row (measure.py):

* ``kernels_interpreter`` ("kernels (Triton interpreter)", ``backend: triton_interpreter``):
  ``kernels.attention`` with TRITON_INTERPRET=1;
* ``kernels`` ("kernels (PyTorch fallback)", ``backend: pytorch_fallback``): the same call
  with TRITON_INTERPRET=0.

On the interpreter's rows: ``max_abs_diff_vs_fallback`` (output; fwd_bwd: output and the
three gradients, the largest), ``diff_over_budget`` (the largest of difference / allowed,
allowed = 2x / 3x PyTorch's own error in the dtype against the float64 oracle, the parity
check's rule) and ``agrees`` (every difference within its budget; a weight dropped by one
and kept by the other would be far outside it).
"""
import time

import torch

from .flops import attention_flops, tflops
from .measure import MEASURE_KEYS, classify_failure, measure, mode_maker
from .providers import (FALLBACK, INTERPRETER, INTERPRETER_PROVIDER, Case, cpu_backend,
                        interpreter_unavailable, provider_label)
from .sweep import new_row

SHAPES = {"cpu": dict(batch=1, heads=2, seq_len=64, head_dim=32),
          "cpu_quick": dict(batch=1, heads=2, seq_len=32, head_dim=32)}
SEED = 1234
PROVIDERS = ((INTERPRETER_PROVIDER, INTERPRETER), ("kernels", FALLBACK))


def _call(q, k, v, p):
    import kernels

    return kernels.attention(q, k, v, causal=True, dropout_p=p, seed=SEED if p else None)


def _results(backend, inputs, p):
    """Output and gradients of one call on ``backend``, from fresh leaf copies."""
    q, k, v, do = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with cpu_backend(backend):
        out = _call(*leaves, p)
        grads = torch.autograd.grad(out, leaves, do)
    return [out.detach(), *grads]


def _budgets(inputs, p, n):
    """Per tensor (output, then dq, dk, dv; the first ``n``): 2x / 3x PyTorch's error in the
    dtype against float64, the parity rule (reference.parity), with the kernels' mask applied
    to both references."""
    import reference
    from reference.parity import GRAD_FACTOR, OUT_FACTOR, parity_budget

    q, k, v, do = inputs
    b, h, s, _ = q.shape
    keep = reference.dropout_keep_mask(SEED, b, h, s, s, p) if p else None
    outs = {}
    for upcast in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = reference.attention(*leaves, causal=True, dropout_p=p, keep_mask=keep,
                                  upcast=upcast)
        outs[upcast] = [out.detach(), *torch.autograd.grad(out, leaves, do.to(out.dtype))]
    return [parity_budget(outs[False][j], outs[True][j], outs[False][j],
                          factor=OUT_FACTOR if j == 0 else GRAD_FACTOR)[1] for j in range(n)]


def compare(inputs, p, mode):
    """{max_abs_diff_vs_fallback, diff_over_budget, agrees} for one point: the largest
    difference, the largest difference / allowed of the tensors compared, and whether every
    one is within its budget."""
    interp, fb = _results(INTERPRETER, inputs, p), _results(FALLBACK, inputs, p)
    n = 1 if mode == "fwd" else 4
    diffs = [(a.double() - b.double()).abs().max().item() for a, b in zip(interp[:n], fb[:n])]
    budgets = _budgets(inputs, p, n)
    ratio = max(d / b if b > 0 else (0.0 if d == 0 else float("inf"))
                for d, b in zip(diffs, budgets))
    return dict(max_abs_diff_vs_fallback=max(diffs), diff_over_budget=ratio,
                agrees=bool(ratio <= 1.0))


def interpreter_rows(dtype, dropouts, opts, deadline=float("inf"), progress=None, quick=False):
    """The rows of the module docstring (CPU only)."""
    shape = SHAPES["cpu_quick" if quick else "cpu"]
    reason = interpreter_unavailable()
    rows = []
    for p in dict.fromkeys([0.0, *dropouts]):
        case = Case(dtype=dtype, dropout_p=float(p), device="cpu", **shape)
        g = torch.Generator().manual_seed(7)
        dims = (case.batch, case.heads, case.seq_len, case.head_dim)
        inputs = [torch.randn(dims, generator=g).to(dtype) for _ in range(4)]
        for mode in ("fwd", "fwd_bwd"):
            point = []
            for name, backend in PROVIDERS:
                row = new_row(name, mode, case, bench="interpreter")
                row.update(backend=backend, label=provider_label(name, "cpu"))
                if progress:
                    progress(None, None, f"interpreter {name} {mode} p{p}")
                if reason:
                    row["status"] = f"skipped: {reason}"
                elif time.monotonic() > deadline:
                    row["status"] = "skipped: time budget"
                else:
                    row.update(_measure(case, mode, inputs, backend, opts))
                    if row["status"] == "ok":
                        row["tflops"] = tflops(attention_flops(*dims[:3], case.seq_len,
                                                               case.head_dim, mode=mode),
                                               row["ms"])
                point.append(row)
            ours = point[0]
            if ours["status"] == "ok" and point[1]["status"] == "ok":
                try:
                    ours.update(compare(inputs, case.dropout_p, mode))
                except Exception as exc:
                    ours["status"] = classify_failure(exc)
            rows += point
    return rows


def _measure(case, mode, inputs, backend, opts):
    q, k, v, do = inputs
    leaves = [t.detach().clone().requires_grad_(mode != "fwd") for t in (q, k, v)]
    try:
        make = mode_maker(lambda: _call(*leaves, case.dropout_p), mode, do, leaves)
        with cpu_backend(backend):
            return measure(make, "cpu", grads=leaves if mode != "fwd" else (),
                           cpu_reps=opts["cpu_reps"], cpu_max_s=opts["cpu_max_s"])
    except Exception as exc:
        return dict(dict.fromkeys(MEASURE_KEYS), status=classify_failure(exc))
