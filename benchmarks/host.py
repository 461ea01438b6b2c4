"""Host cost of one call: the public API's Python per call, ours vs PyTorch's, on a real device
(``python -m benchmarks host [--device cuda] [--shape 1x1x16x16] [--budget 20]``).

At tiny shapes a GPU finishes each kernel long before the host issues the next call, so back-
to-back calls time the host: batches of ``--inner`` calls (one synchronisation each), all cases
interleaved until ``--budget`` s; per case min, p20 and median in us, and the p20 over its
baseline's (SDPA's same call, the book's module; on CUDA also under torch.compile). Without CUDA
the rows are a CPU user's call (the fallback); without a GPU: tools/host_overhead.py.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

import kernels
import reference

from .args import POSITIVE_FLOAT, POSITIVE_INT, dims
from .measure import time_interleaved
from .report import DEFAULT_OUT, REPO_DIR, collect_meta, results_stem, write_results


def _cases(device, shape, dtype):
    """{name: (function of no arguments, baseline name or None)}."""
    b, h, n, d = shape
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)

    def fwd(fn, **kw):
        def run():
            with torch.no_grad():
                fn(q, k, v, **kw)
        return run

    def fwd_bwd(fn, **kw):
        return lambda: torch.autograd.grad(fn(q, k, v, **kw), (q, k, v), do)

    ours = kernels.attention
    sdpa = F.scaled_dot_product_attention
    cases = {
        "attention fwd": (fwd(ours, causal=True), "sdpa fwd"),
        "sdpa fwd": (fwd(sdpa, is_causal=True), None),
        "attention fwd+bwd": (fwd_bwd(ours, causal=True), "sdpa fwd+bwd"),
        "sdpa fwd+bwd": (fwd_bwd(sdpa, is_causal=True), None),
        "attention p=0.1 fwd+bwd": (fwd_bwd(ours, causal=True, dropout_p=0.1),
                                    "sdpa p=0.1 fwd+bwd"),
        "sdpa p=0.1 fwd+bwd": (fwd_bwd(sdpa, is_causal=True, dropout_p=0.1), None),
    }
    emb = h * d
    x = torch.randn(b, n, emb, device=device, dtype=dtype, requires_grad=True)
    for name, cls in (("FusedMultiHeadAttention", kernels.FusedMultiHeadAttention),
                      ("reference.MultiHeadAttention", reference.MultiHeadAttention)):
        module = cls(emb, emb, n, 0.0, num_heads=h).to(device=device, dtype=dtype)
        cases[f"{name} fwd+bwd"] = (
            (lambda m: lambda: m(x).sum().backward())(module),
            "reference.MultiHeadAttention fwd+bwd" if cls is kernels.FusedMultiHeadAttention
            else None)
    k_cache, v_cache = (torch.randn(b, h, 4 * n, d, device=device, dtype=dtype)
                        for _ in range(2))
    lens = torch.full((b,), n, dtype=torch.int32, device=device)
    q1, k1, v1 = (torch.randn(b, h, 1, d, device=device, dtype=dtype) for _ in range(3))
    cases["attention_with_kvcache decode"] = (
        lambda: kernels.attention_with_kvcache(q1, k_cache, v_cache, lens, k1, v1), None)
    from kernels.flash_attn_interface import flash_attn_func
    qb, kb, vb = (t.detach().transpose(1, 2) for t in (q, k, v))   # FlashAttention's layout

    def fa_fwd():
        with torch.no_grad():
            flash_attn_func(qb, kb, vb, causal=True)
    cases["flash_attn_func fwd"] = (fa_fwd, "attention fwd")
    packed = [torch.randn(2 * n, h, d, device=device, dtype=dtype) for _ in range(3)]
    cu = torch.tensor([0, n // 2, 2 * n], dtype=torch.int32, device=device)

    def varlen():
        with torch.no_grad():
            kernels.attention_varlen(*packed, cu, cu, n + n // 2, n + n // 2)
    cases["attention_varlen fwd"] = (varlen, None)
    if torch.device(device).type == "cuda":   # a torch.compile'd model's cost per call
        for name, fn, kw in (("sdpa", sdpa, dict(is_causal=True)),
                             ("attention", ours, dict(causal=True))):
            graph = torch.compile(lambda q, k, v, fn=fn, kw=kw: fn(q, k, v, **kw))
            base = None if name == "sdpa" else "sdpa compiled"
            cases[f"{name} compiled fwd"] = (fwd(graph), base and f"{base} fwd")
            cases[f"{name} compiled fwd+bwd"] = (fwd_bwd(graph), base and f"{base} fwd+bwd")
    return cases


def measure(device, shape, dtype, budget_s, inner):
    """Rows of per-call host time (us) per case; see the module docstring."""
    cases = _cases(device, shape, dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
    # warmup 3: compile, autotune, build launch plans; the first case of a round rotates.
    samples = time_interleaved({name: fn for name, (fn, _) in cases.items()}, min_rounds=5,
                               min_s=budget_s, inner=inner, warmup=3, sync=sync, rotate=True)
    rows = []
    for name, (_, base) in cases.items():
        s = sorted(t * 1e6 for t in samples[name])
        rows.append(dict(bench="host", case=name, shape="x".join(map(str, shape)),
                         dtype=str(dtype).replace("torch.", ""), min_us=s[0],
                         p20_us=s[len(s) // 5], median_us=s[len(s) // 2], batches=len(s),
                         inner=inner, baseline=base))
    by_name = {r["case"]: r for r in rows}
    for r in rows:
        if r["baseline"]:
            r["x_baseline_p20"] = r["p20_us"] / by_name[r["baseline"]]["p20_us"]
    return rows


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks host", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--shape", type=dims("1x1x16x16"), default=(1, 1, 16, 16), help="BxHxNxD")
    p.add_argument("--budget", type=POSITIVE_FLOAT, default=20.0, help="seconds of timing")
    p.add_argument("--inner", type=POSITIVE_INT, default=20, help="calls per timed batch")
    p.add_argument("--out-dir", default=DEFAULT_OUT)
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":   # what a CPU user's call runs: the PyTorch fallback
        os.environ["TRITON_INTERPRET"] = "0"
    torch.set_num_threads(1)
    rows = measure(device, args.shape, dtype, args.budget, args.inner)
    meta = collect_meta(device, vars(args), REPO_DIR)
    meta["what"] = ("host time per call (us): back-to-back calls at a tiny shape, one sync per "
                    "batch" + ("" if device == "cuda" else "; CPU tensors: the PyTorch fallback "
                               "or the interpreter, not the GPU path"))
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, results_stem(device) + "-host")
    write_results(stem, meta, rows)
    print(f"{'case':40} {'min':>8} {'p20':>8} {'median':>8}  x baseline (p20)")
    for r in rows:
        ratio = f"{r['x_baseline_p20']:.2f}x {r['baseline']}" if r.get("baseline") else ""
        print(f"{r['case']:40} {r['min_us']:8.1f} {r['p20_us']:8.1f} {r['median_us']:8.1f}  "
              f"{ratio}")
    print(f"wrote {stem}.json, .csv", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
