"""Module-level benchmarks, reference vs ours: ``bench="module"`` (reference.MultiHeadAttention
vs kernels.FusedMultiHeadAttention with the same weights, ``fwd`` / ``fwd_bwd``, training mode)
and ``bench="gpt_step"`` (reference.GPTModel vs a copy through kernels.fuse_attention, one
AdamW training step); on CPU also the interleaved ratio rows of ``python -m benchmarks
modules`` (:func:`main`). Columns: docs/performance.md.
"""
import contextlib
import copy
import os
import time

import torch

from .flops import gpt_step_flops, mha_flops, tflops
from .measure import (MEASURE_KEYS, attention_op, classify_failure, format_ratio, free_memory,
                      measure, mode_maker, ops_run, quantiles, ratio_spread, time_interleaved)
from .providers import Case
from .sweep import new_row

# Sizes per profile ("cuda", "cpu", "cpu_quick"): (batch, seq_len, emb_dim, heads) of the
# module benchmark; overrides of GPT_CONFIG_124M and the batch of the GPT step. CPU: PyTorch
# only (ours is the PyTorch fallback there), sized so that each row takes tens of ms.
MODULE_SHAPE = {"cuda": (8, 1024, 768, 12), "cpu": (2, 512, 256, 4),
                "cpu_quick": (1, 128, 128, 2)}
GPT_OVERRIDES = {
    "cuda": {},
    "cpu": {"vocab_size": 1024, "context_length": 256, "emb_dim": 256, "n_heads": 4,
            "n_layers": 2},
    "cpu_quick": {"vocab_size": 256, "context_length": 128, "emb_dim": 128, "n_heads": 2,
                  "n_layers": 1},
}
GPT_BATCH = {"cuda": 8, "cpu": 2, "cpu_quick": 1}
CPU_BACKEND = "pytorch_fallback"  # what ours runs on CPU in these rows (providers.FALLBACK)
# Each row's name in tables (``label``): the class it times, and whose it is.
LABELS = {"module_reference": "MultiHeadAttention (book)",
          "module_kernels": "FusedMultiHeadAttention (ours)",
          "module_reference_wrapper": "MultiHeadAttentionWrapper (book)",
          "gpt_step_reference": "GPTModel (book)",
          "gpt_step_kernels": "GPTModel + fuse_attention (ours)"}
# The book's rows and ours they are compared with (add_book_ratios).
BOOK_VS_FUSED = {"module_reference": "module_kernels",
                 "module_reference_wrapper": "module_kernels",
                 "gpt_step_reference": "gpt_step_kernels"}
# What a CPU row ran when the profiler saw none of PyTorch's attention ops.
OWN_OPS = {"module_kernels": "kernels' PyTorch fallback, its own ops",
           "gpt_step_kernels": "kernels' PyTorch fallback, its own ops"}
BOOK_OPS = "the book's code: matmul, softmax, dropout"


def add_book_ratios(rows):
    """On each ok book row (BOOK_VS_FUSED) whose fused row at the same mode and dropout is ok:
    ``book_over_fused`` = book ms / fused ms (above 1: ours is faster), its spread
    ``book_over_fused_low`` / ``_high`` (from p20 / p80) and ``book_over_fused_noise`` (the two
    p20-p80 ranges overlap). Returns ``rows``."""
    ok = {(r["provider"], r["mode"], r["dropout_p"]): r for r in rows if r["status"] == "ok"}
    for (name, mode, p), r in ok.items():
        fused = ok.get((BOOK_VS_FUSED.get(name), mode, p))
        if fused is not None:
            ratio, low, high, noise = ratio_spread(r, fused)
            r.update(book_over_fused=ratio, book_over_fused_low=low, book_over_fused_high=high,
                     book_over_fused_noise=noise)
    return rows


def _label(row, cpu):
    """Name the row's class; on CPU fill ``runs`` where no PyTorch attention op ran."""
    row["label"] = LABELS[row["provider"]]
    if cpu and row["status"] == "ok" and row.get("runs") is None:
        row["runs"] = OWN_OPS.get(row["provider"], BOOK_OPS)
    return row


def _profile(device, quick):
    kind = torch.device(device).type
    return "cpu_quick" if kind == "cpu" and quick else kind


def module_rows(device, dtype, dropouts, opts, deadline=float("inf"), progress=None,
                quick=False):
    """Rows for reference.MultiHeadAttention vs kernels.FusedMultiHeadAttention."""
    import kernels
    import reference

    batch, seq, emb, heads = MODULE_SHAPE[_profile(device, quick)]
    cpu = torch.device(device).type == "cpu"
    providers = ("module_reference", "module_kernels") + (("module_reference_wrapper",) if cpu
                                                           else ())
    rows = []
    for dropout in dropouts:
        case = Case(batch=batch, heads=heads, seq_len=seq, head_dim=emb // heads, dtype=dtype,
                    dropout_p=dropout, device=device)
        torch.manual_seed(0)
        modules = {}
        try:
            ref = reference.MultiHeadAttention(emb, emb, seq, dropout, heads)
            fused = kernels.FusedMultiHeadAttention(emb, emb, seq, dropout, heads)
            missing, _ = fused.load_state_dict(ref.state_dict(), strict=False)
            names = {n for n, _ in fused.named_parameters()}
            same = not (set(missing) & names)
            modules = {"module_reference": ref, "module_kernels": fused}
            if cpu:
                modules["module_reference_wrapper"] = reference.MultiHeadAttentionWrapper(
                    emb, emb // heads, seq, dropout, heads)
            build_error = None
        except Exception as exc:
            same, build_error = False, classify_failure(exc)
        for name in providers:
            for mode in ("fwd", "fwd_bwd"):
                row = new_row(name, mode, case, bench="module")
                row.update(emb_dim=emb, same_weights=same if name != "module_reference_wrapper"
                           else False)
                if cpu and name == "module_kernels":
                    row["backend"] = CPU_BACKEND
                if progress:
                    progress(None, None, f"{name} {mode} p{dropout}")
                if build_error:
                    row["status"] = build_error
                elif time.monotonic() > deadline:
                    row["status"] = "skipped: time budget"
                else:
                    row.update(_measure_module(modules[name], case, mode, emb, device, opts))
                    if row["status"] == "ok":
                        row["tflops"] = tflops(mha_flops(batch, seq, emb, emb, heads, mode=mode),
                                               row["ms"])
                rows.append(_label(row, cpu))
        modules = None
        free_memory(device)
    return add_book_ratios(rows)


def _measure_module(module, case, mode, emb, device, opts):
    """Measure ``module`` (moved to the case's device and dtype, training mode) in ``mode``."""
    try:
        module.to(device=device, dtype=case.dtype).train()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(case.batch, case.seq_len, emb, generator=g).to(device, case.dtype)
        x.requires_grad_(True)
        dout = torch.randn(case.batch, case.seq_len, emb, generator=g).to(device, case.dtype)
    except Exception as exc:
        return dict(dict.fromkeys(MEASURE_KEYS), status=classify_failure(exc))
    grads = [x, *module.parameters()] if mode != "fwd" else []
    make = mode_maker(lambda: module(x), mode, dout, grads)
    return measure(make, device, grads=grads, **opts)


def train_step(model, idx, autocast_dtype=None, lr=1e-4):
    """The timed training step of a causal LM (``model(tokens)`` -> logits) on ``idx`` (batch,
    seq + 1): zero_grad, forward on ``idx[:, :-1]`` (under ``torch.autocast`` in
    ``autocast_dtype`` when given), cross-entropy against ``idx[:, 1:]`` in fp32, backward,
    AdamW step (its state is created at the first call)."""
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    inp, tgt = idx[:, :-1], idx[:, 1:]
    ctx = (lambda: torch.autocast(idx.device.type, dtype=autocast_dtype)) if autocast_dtype else (
        contextlib.nullcontext)

    def step():
        opt.zero_grad(set_to_none=True)
        with ctx():
            logits = model(inp)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
        loss.backward()
        opt.step()
    return step


def linear_weights(model):
    """Number of nn.Linear weights of ``model`` (the ``linear_params`` of
    flops.gpt_step_flops)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def gpt_rows(device, dtype, opts, deadline=float("inf"), progress=None, quick=False):
    """Rows for one GPT training step without and with kernels.fuse_attention."""
    import kernels
    import reference

    kind = torch.device(device).type
    profile = _profile(device, quick)
    cfg = dict(reference.GPT_CONFIG_124M, **GPT_OVERRIDES[profile])
    batch, seq = GPT_BATCH[profile], cfg["context_length"]
    use_autocast = kind == "cuda"
    run_dtype = dtype if use_autocast else torch.float32
    case = Case(batch=batch, heads=cfg["n_heads"], seq_len=seq,
                head_dim=cfg["emb_dim"] // cfg["n_heads"], dtype=run_dtype,
                dropout_p=float(cfg.get("drop_rate", 0.0)), device=device)
    extra = dict(n_layers=cfg["n_layers"], emb_dim=cfg["emb_dim"], vocab_size=cfg["vocab_size"],
                 autocast=use_autocast)
    rows = []
    models, build_error = {}, None
    try:
        torch.manual_seed(0)
        base = reference.GPTModel(cfg)
        fused, count = kernels.fuse_attention(copy.deepcopy(base))
        models = {"gpt_step_reference": (base, None), "gpt_step_kernels": (fused, count)}
    except Exception as exc:
        build_error = classify_failure(exc)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=g)
    for name in ("gpt_step_reference", "gpt_step_kernels"):
        row = new_row(name, "train_step", case, bench="gpt_step")
        row.update(extra)
        if kind == "cpu" and name == "gpt_step_kernels":
            row["backend"] = CPU_BACKEND
        row["fused_modules"] = models[name][1] if name in models else None
        if progress:
            progress(None, None, name)
        if build_error:
            row["status"] = build_error
        elif time.monotonic() > deadline:
            row["status"] = "skipped: time budget"
        else:
            try:
                model = models[name][0].to(device).train()
                step = train_step(model, idx.to(device), dtype if use_autocast else None)
                row.update(measure(lambda: step, device, **opts))
                linear = linear_weights(model)
                if row["status"] == "ok":
                    row["tflops"] = tflops(gpt_step_flops(linear, cfg["n_layers"], batch, seq,
                                                          cfg["emb_dim"], cfg["n_heads"]),
                                           row["ms"])
                    row["tokens_per_s"] = batch * seq / (row["ms"] * 1e-3)
            except Exception as exc:
                row["status"] = classify_failure(exc)
            model = step = None
            models.pop(name, None)
            free_memory(device)
        rows.append(_label(row, kind == "cpu"))
    return add_book_ratios(rows)


# --------------------------------------------------------------------------------------------
# CPU: the fused module against the book's class, one row per size (``python -m
# benchmarks modules``). Not a timed test: a measurement, written to benchmarks/results/.
# --------------------------------------------------------------------------------------------
# (batch, tokens, d_model): the book's small sizes up to GPT-2's width at 1k tokens; heads of
# 64 as in GPT-2 (d_model // 64).
CPU_RATIO_SIZES = ((8, 64, 128), (4, 256, 256), (2, 512, 256), (2, 1024, 768))
CPU_RATIO_DROPOUTS = (0.0, 0.1)


# The modules command's table: one line per row, printed as it is measured.
RATIO_HEADER = (f"{'batch x tokens x d_model':<25} {'heads':>5} {'p':>4} {'mode':<8} "
                f"{'book ms [p20-p80]':>22} {'fused ms [p20-p80]':>22}  "
                f"{'book / fused [range]':<27}  fused runs")
RATIO_LEGEND = ("book = reference.MultiHeadAttention (the book's class), fused = "
                "kernels.FusedMultiHeadAttention (ours), same weights; book / fused above 1: "
                "ours is faster; [range] = p20-p80 of the per-round ratios (each round times "
                "both under the same load), NOISE = it holds 1 (no difference measured); fused "
                "runs = the PyTorch attention op the fused module's call ran (profiled), or its "
                "own ops")


def format_ratio_row(r):
    """One line of the modules command's table (RATIO_HEADER)."""
    size = f"{r['batch']} x {r['seq_len']} x {r['emb_dim']}"
    ratio = format_ratio(r["speedup"], r["speedup_low"], r["speedup_high"], r["noise"])
    return (f"{size:<25} {r['heads']:>5} {r['dropout_p']:>4} {r['mode']:<8} "
            f"{_ms_range(r['book_ms'], r['book_p20'], r['book_p80']):>22} "
            f"{_ms_range(r['fused_ms'], r['fused_p20'], r['fused_p80']):>22}  {ratio:<27}  "
            f"{r['fused_runs']}")


def _ms_range(ms, p20, p80):
    return f"{ms:.3f} [{p20:.3g}-{p80:.3g}]"


def cpu_ratio_rows(sizes=CPU_RATIO_SIZES, dropouts=CPU_RATIO_DROPOUTS, reps=15, max_s=20.0,
                   threads=1, min_s=1.0, echo=print):
    """Rows ``bench="module_cpu_ratio"``: the book's ``MultiHeadAttention`` and ours with the
    same weights, training mode, fp32 CPU tensors (ours = the PyTorch fallback), ``fwd`` and
    ``fwd_bwd`` (``.sum().backward()``); medians and p20/p80 of interleaved runs, ``speedup`` =
    book ms / fused ms with ``speedup_low`` / ``speedup_high`` (p20 / p80 of the per-round
    ratios) and ``noise`` (that range holds 1), ``fused_runs`` = what ours ran (profiled: PyTorch's
    attention op, or the fallback's own ops). ``echo``: called with the
    table's header and each row's line as it is measured."""
    import statistics

    import kernels
    import reference

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1: the fused module would run Triton's "
                           "interpreter, not the CPU fallback; unset it")
    torch.set_num_threads(threads)
    echo(RATIO_HEADER)
    rows = []
    for batch, seq, emb in sizes:
        heads = max(1, emb // 64)
        for p in dropouts:
            torch.manual_seed(0)
            book = reference.MultiHeadAttention(emb, emb, seq, p, heads).train()
            fused = kernels.FusedMultiHeadAttention(emb, emb, seq, p, heads).train()
            fused.load_state_dict(book.state_dict(), strict=False)
            x = torch.randn(batch, seq, emb, requires_grad=True)
            for mode in ("fwd", "fwd_bwd"):
                def call(m, mode=mode):
                    y = m(x)
                    if mode == "fwd_bwd":
                        y.sum().backward()
                # What ours runs decides what the ratio means: at dropout 0 the fallback hands
                # the core to PyTorch's CPU flash op (the book's class runs matmul + softmax).
                fused_runs = attention_op(ops_run(lambda: call(fused))) or OWN_OPS[
                    "module_kernels"]
                # min_s gives short rows (a few ms a round) hundreds of rounds: with 15, the
                # 8 x 64 x 128 forward read 1.02x, 3.21x, 1.04x and 0.97x in four runs of one
                # commit on a loaded 2-core machine.
                times = time_interleaved(
                    {"book": lambda: call(book), "fused": lambda: call(fused)},
                    min_rounds=reps, min_s=min_s, max_s=max_s)
                times = {k: [t * 1e3 for t in v] for k, v in times.items()}
                med = {k: statistics.median(v) for k, v in times.items()}
                q = {k: statistics.quantiles(v, n=5) if len(v) > 1 else [v[0]] * 4
                     for k, v in times.items()}
                # The spread of the ratio itself: one book / fused ratio per round, both of
                # whose calls saw the same load (tighter than the two ranges apart).
                _, low, high = quantiles([b / f for b, f in zip(times["book"],
                                                                times["fused"])])
                ratio, noise = med["book"] / med["fused"], bool(low <= 1.0 <= high)
                row = dict(bench="module_cpu_ratio", batch=batch, seq_len=seq, emb_dim=emb,
                           heads=heads, dropout_p=p, mode=mode, threads=threads,
                           reps=len(times["book"]), book_ms=round(med["book"], 3),
                           fused_ms=round(med["fused"], 3), book_p20=round(q["book"][0], 3),
                           book_p80=round(q["book"][3], 3), fused_p20=round(q["fused"][0], 3),
                           fused_p80=round(q["fused"][3], 3), speedup=round(ratio, 3),
                           speedup_low=round(low, 3), speedup_high=round(high, 3),
                           noise=noise, fused_runs=fused_runs)
                rows.append(row)
                echo(format_ratio_row(row))
    echo(RATIO_LEGEND)
    return rows


def main(argv=None):
    """``python -m benchmarks modules``: the CPU rows above, written to
    ``benchmarks/results/<date>-modules-cpu.json`` and ``.csv`` (git-ignored: CPU results),
    with versions, commit and the machine's load average before and after."""
    import argparse

    from .args import POSITIVE_FLOAT, POSITIVE_INT, SECONDS, dims
    from .report import DEFAULT_OUT, REPO_DIR, collect_meta, write_results

    ap = argparse.ArgumentParser(prog="python -m benchmarks modules", description=main.__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sizes", type=dims("8x64x128"), nargs="+", default=list(CPU_RATIO_SIZES),
                    metavar="BxTxD", help="batch x tokens x d_model, e.g. 8x64x128")
    ap.add_argument("--reps", type=POSITIVE_INT, default=15, help="timed rounds per row, at least")
    ap.add_argument("--min-s", type=SECONDS, default=1.0,
                    help="seconds per row, at least (more rounds for short rows)")
    ap.add_argument("--max-s", type=POSITIVE_FLOAT, default=20.0,
                    help="seconds per row, at most (whatever --reps and --min-s say)")
    ap.add_argument("--threads", type=POSITIVE_INT, default=1, help="PyTorch intra-op threads")
    ap.add_argument("--out-dir", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    load_before = os.getloadavg()
    rows = cpu_ratio_rows(sizes=args.sizes, reps=args.reps, max_s=args.max_s,
                          threads=args.threads, min_s=args.min_s)
    meta = collect_meta("cpu", vars(args), REPO_DIR, interpreter=False)
    meta.update(loadavg_before=load_before, loadavg_after=os.getloadavg(),
                cpu_count=os.cpu_count(),
                book="reference.MultiHeadAttention (the book's class)",
                fused="kernels.FusedMultiHeadAttention (ours: the PyTorch fallback on CPU)",
                timing="wall clock, book and fused interleaved, medians (p20/p80 beside); "
                       "speedup = book / fused, noise = the p20-p80 ranges overlap")
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"{meta['date'][:10]}-modules-cpu")
    write_results(stem, meta, rows)
    print(f"wrote {stem}.json, {stem}.csv (commit {meta['commit']}, torch {meta['torch']}, "
          f"load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
