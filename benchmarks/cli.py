"""Command line of ``python -m benchmarks`` (run from a checkout; docs/performance.md).

    python -m benchmarks [sweep] [OPTIONS]   the default: parity check, the module and GPT rows,
                                             the attention sweep with its feature rows
    python -m benchmarks modules [OPTIONS]   CPU: the book's module vs ours, interleaved ratios
    python -m benchmarks book [FAMILY...]    llms-from-scratch's models, original vs fused
    python -m benchmarks host [OPTIONS]      the host's cost per call, ours vs PyTorch's
    python -m benchmarks gpu-check OUTDIR    the device script (benchmarks/gpu_check.sh)

The sweep: parity against the float64 oracle (a failure exits with status 1 before anything is
timed), the module rows (``--no-modules``), then seq_len x mode x dtype x head_dim x dropout x
provider with the feature rows right after the primary config (the time budget cuts the
secondary configs first); ``<out-dir>/<date>-<gpu-or-cpu>.json`` / ``.csv`` are rewritten after
every point (a killed run leaves valid files, ``meta.complete = false``), then plots and a table.
Without CUDA, TRITON_INTERPRET=1 is set here, before ``kernels`` is imported: our calls take
the PyTorch fallback, except the rows ``--interpreter`` asks for. CPU figures say nothing about
GPU speed.
"""
import argparse
import contextlib
import importlib
import os
import subprocess
import sys
import time

from .args import COUNT, POSITIVE_FLOAT, POSITIVE_INT, PROBABILITY, SECONDS
from .report import DEFAULT_OUT, REPO_DIR

DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                 "float16": "float16", "half": "float16", "fp32": "float32",
                 "float32": "float32"}

# Defaults per device type (--quick: the smaller set). GPU head_dims: 128 (primary) and 64 as in
# the FlashAttention papers, then 512, the largest the kernels take (a secondary config).
# CPU: PyTorch only (ours = the PyTorch fallback), fp32 as CPU users run it; the run is sized to
# take about a minute on an idle 2-core machine.
DEFAULTS = {
    "cuda": dict(seq_lens=[128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
                 modes=["fwd", "bwd", "fwd_bwd"], dtypes=["bfloat16", "float16"],
                 head_dims=[128, 64, 512], dropout=[0.0, 0.1], tokens=16384, hidden=2048,
                 quadratic_max_seq=8192, time_budget=300.0),
    "cuda_quick": dict(seq_lens=[1024, 4096], modes=["fwd", "bwd", "fwd_bwd"],
                       dtypes=["bfloat16"], head_dims=[128], dropout=[0.0, 0.1], tokens=16384,
                       hidden=2048, quadratic_max_seq=8192, time_budget=150.0),
    "cpu": dict(seq_lens=[128, 512, 1024], modes=["fwd", "bwd", "fwd_bwd"],
                dtypes=["float32"], head_dims=[64], dropout=[0.0, 0.1], tokens=2048,
                hidden=512, quadratic_max_seq=1 << 30, time_budget=120.0),
    "cpu_quick": dict(seq_lens=[128, 256], modes=["fwd", "bwd", "fwd_bwd"], dtypes=["float32"],
                      head_dims=[32], dropout=[0.0, 0.1], tokens=256, hidden=128,
                      quadratic_max_seq=1 << 30, time_budget=60.0),
}


def parity_shapes(device_type, head_dims, interpreter=False):
    """Shapes of the parity check: odd seq_len (partial tiles), one per swept head_dim on GPU
    (so its compiled kernels are reused by the sweep); on CPU one per head_dim for the PyTorch
    fallback, one tiny shape for Triton's interpreter (``interpreter``)."""
    if device_type == "cuda":
        return [(2, 3, 257, hd) for hd in head_dims]
    if interpreter:
        return [(1, 2, 40, 32)]
    return [(2, 4, 257, hd) for hd in head_dims]


def _dtype_name(text):
    try:
        return DTYPE_ALIASES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; use one of {', '.join(sorted(DTYPE_ALIASES))}") from None


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (argparse prints the whole ~20-line usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one to show: options whose default depends on the
    device say it in their help (from DEFAULTS), switches have none."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _per_device(key):
    """``key``'s defaults as help text: GPU, GPU --quick, CPU, CPU --quick."""
    def show(v):
        return " ".join(map(str, v)) if isinstance(v, list) else str(v)
    d = DEFAULTS
    return (f"default: GPU {show(d['cuda'][key])} (--quick {show(d['cuda_quick'][key])}); "
            f"CPU {show(d['cpu'][key])} (--quick {show(d['cpu_quick'][key])})")


def build_parser():
    """The argparse parser (every sweep dimension can be chosen). Options come in groups, each
    a screen or less of ``--help``; every numeric option is checked as it is parsed."""
    from .book_models import FAMILIES as BOOK_FAMILIES
    from .features import FEATURES
    from .flops import MODES
    from .providers import PROVIDERS

    p = _Parser(
        prog="python -m benchmarks [sweep]", formatter_class=_Help,
        epilog="Other commands: python -m benchmarks {modules,book,host,gpu-check} --help",
        description="Parity check, then a benchmark of kernels.attention against PyTorch's "
                    "attention. GPU: the full sweep within --time-budget. CPU: ours as CPU "
                    "tensors run it (the PyTorch fallback) vs SDPA and the book's reference, "
                    "with peak memory; these CPU figures say nothing about GPU speed.")
    run = p.add_argument_group("what to run")
    run.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                     help="auto: cuda if available")
    run.add_argument("--quick", action="store_true", help="a small sweep (a quick look)")
    run.add_argument("--skip-parity", action="store_true", help="do not run the parity check")
    run.add_argument("--no-modules", action="store_true",
                     help="skip the MultiHeadAttention and GPT training-step rows")
    run.add_argument("--no-sweep", action="store_true", help="skip the attention sweep")
    run.add_argument("--features", nargs="+", choices=list(FEATURES), metavar="FEATURE",
                     help=f"feature rows to run, of {', '.join(FEATURES)} (default: all on "
                          "GPU; none on CPU unless --interpreter); docs/performance.md says "
                          "what each compares")
    run.add_argument("--no-features", action="store_true", help="skip the feature rows")
    run.add_argument("--interpreter", action="store_true",
                     help="CPU: also run our Triton kernel in Triton's interpreter (1,000-4,000x "
                          "slower than PyTorch): a parity check at a tiny shape, the feature rows")
    run.add_argument("--strict", action="store_true",
                     help="exit with status 2 when any row has status 'error: ...'")

    sweep = p.add_argument_group("sweep dimensions (defaults depend on the device)")
    sweep.add_argument("--seq-lens", type=POSITIVE_INT, nargs="+", metavar="N",
                       help="sequence lengths, q_len = k_len; " + _per_device("seq_lens"))
    sweep.add_argument("--modes", nargs="+", choices=list(MODES),
                       help="default: all of " + ", ".join(MODES))
    sweep.add_argument("--dtypes", type=_dtype_name, nargs="+", metavar="DTYPE",
                       help="bf16, fp16, fp32; " + _per_device("dtypes"))
    sweep.add_argument("--head-dims", type=POSITIVE_INT, nargs="+", metavar="D",
                       help=_per_device("head_dims"))
    sweep.add_argument("--dropout", type=PROBABILITY, nargs="+", metavar="P",
                       help="dropout probabilities in [0, 1); " + _per_device("dropout"))
    sweep.add_argument("--providers", nargs="+", choices=list(PROVIDERS), metavar="NAME",
                       help=f"of {', '.join(PROVIDERS)} (default: GPU all, triton_tutorial "
                            "with --tutorial; CPU kernels, reference, sdpa_math, sdpa_flash)")
    sweep.add_argument("--tutorial", metavar="PATH",
                       help="the Triton tutorial's fused attention (Triton 3.6's "
                            "tutorials/06-fused-attention.py) for the triton_tutorial rows "
                            "(default: none, and those rows say 'not given')")
    sweep.add_argument("--tokens", type=POSITIVE_INT,
                       help="batch * seq_len per point (batch >= 1); " + _per_device("tokens"))
    sweep.add_argument("--hidden", type=POSITIVE_INT,
                       help="heads * head_dim per point; " + _per_device("hidden"))
    sweep.add_argument("--quadratic-max-seq", type=POSITIVE_INT, metavar="N",
                       help="largest seq_len for the providers that store seq^2 scores "
                            "(reference, reference_compiled, sdpa_math); default: GPU 8192, "
                            "CPU no limit")
    sweep.add_argument("--time-budget", type=SECONDS, metavar="S",
                       help="seconds for the whole run, 0 = no limit; points not started by "
                            "then are recorded as 'skipped: time budget'; "
                            + _per_device("time_budget"))

    timing = p.add_argument_group("timing")
    timing.add_argument("--warmup-ms", type=POSITIVE_FLOAT, default=10.0,
                        help="do_bench warm-up time (GPU)")
    timing.add_argument("--rep-ms", type=POSITIVE_FLOAT, default=50.0,
                        help="do_bench repetition time (GPU)")
    timing.add_argument("--cpu-reps", type=POSITIVE_INT, default=3,
                        help="most timed runs per row on CPU")
    timing.add_argument("--cpu-max-s", type=SECONDS, default=1.0,
                        help="CPU: no timed run of a row starts this many seconds after its "
                             "warm-up call began (at least one runs)")
    timing.add_argument("--cpu-threads", type=COUNT, default=1,
                        help="CPU: PyTorch's intra-op threads, 0 = PyTorch's default (1 keeps "
                             "small shapes steady on a busy machine)")

    out = p.add_argument_group("output")
    out.add_argument("--out-dir", default=DEFAULT_OUT, help="where JSON/CSV/PNG go")
    out.add_argument("--no-plots", action="store_true", help="no PNG plots")
    out.add_argument("--table-metric", choices=["tflops", "ms"],
                     help="what the terminal table shows (default: tflops on GPU, ms on CPU)")

    extra = p.add_argument_group("extra rows, opt-in (run after the sweep's budget is decided)")
    extra.add_argument("--book-models", nargs="*", choices=list(BOOK_FAMILIES),
                       metavar="FAMILY",
                       help="llms-from-scratch's models as they are vs kernels.fuse_attention: "
                            "generation tokens/s and a training step, random weights (default: "
                            f"not run; no FAMILY = all of {', '.join(BOOK_FAMILIES)})")
    extra.add_argument("--book-layers", type=POSITIVE_INT, metavar="N",
                       help="layers of the book models (default: each config's own)")
    return p


def resolve_args(args, device_type):
    """Fill unset options with the defaults for ``device_type`` ("cuda" or "cpu")."""
    defaults = DEFAULTS[device_type + ("_quick" if args.quick else "")]
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)
    if getattr(args, "features", None) is None:
        from .features import DEFAULT_FEATURES

        # CPU: the feature rows run our kernel in Triton's interpreter, so only when asked.
        cpu_ok = device_type == "cuda" or getattr(args, "interpreter", False)
        args.features = list(DEFAULT_FEATURES[device_type]) if cpu_ok else []
    args.explicit_providers = args.providers is not None
    if args.providers is None:
        from .providers import CPU_PROVIDERS, PROVIDERS

        args.providers = [p for p in (PROVIDERS if device_type == "cuda" else CPU_PROVIDERS)
                          if p != "triton_tutorial" or args.tutorial]
    if args.table_metric is None:
        args.table_metric = "tflops" if device_type == "cuda" else "ms"
    return args


class Progress:
    """A one-line progress display on stderr: redrawn in place on a terminal, a line every
    ``every_s`` seconds in a log."""

    def __init__(self, start, every_s=5.0):
        self.start, self.every_s, self.tty, self._last = start, every_s, sys.stderr.isatty(), -1e9

    def __call__(self, done, total, text):
        now = time.monotonic()
        msg = f"[{now - self.start:6.1f}s] {text}"
        if done is not None:
            msg = f"[{'#' * int(24 * (done / total if total else 1.0)):<24}] {done}/{total} {msg}"
        if self.tty:
            print("\r" + msg[:118].ljust(118), end="", file=sys.stderr, flush=True)
        elif now - self._last >= self.every_s or text == "done":
            print(msg, file=sys.stderr, flush=True)
            self._last = now

    def close(self):
        """End the in-place line."""
        if self.tty:
            print(file=sys.stderr, flush=True)


def use_interpreter():
    """Set TRITON_INTERPRET=1 (a CPU run). It takes effect at the first import of ``kernels``
    (all imports of it are lazy): warns when that already happened."""
    if os.environ.get("TRITON_INTERPRET") != "1" and "kernels" in sys.modules:
        print("benchmarks: warning: `kernels` was imported before TRITON_INTERPRET=1 was set; "
              "its kernels may not run on CPU", file=sys.stderr)
    os.environ["TRITON_INTERPRET"] = "1"


def _gpu_check(argv):
    script = os.path.join(REPO_DIR, "benchmarks", "gpu_check.sh")
    return subprocess.call(["bash", script, *argv])


def _main_of(module):
    """``benchmarks.<module>.main``, imported when its command runs."""
    return lambda argv: importlib.import_module(f".{module}", __package__).main(argv)


# Subcommands other than the sweep; "book" is the sweep's runner with only the book rows.
COMMANDS = {"host": _main_of("host"), "modules": _main_of("modules"), "gpu-check": _gpu_check}


def main(argv=None):
    """Entry point; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and not argv[0].startswith("-") else "sweep"
    if command in COMMANDS:
        return COMMANDS[command](argv[1:])
    if command == "book":
        argv = ["--no-modules", "--no-sweep", "--no-features", "--book-models"] + argv[1:]
    elif argv and argv[0] == "sweep":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    start = time.monotonic()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    device_type = "cuda" if (args.device != "cpu" and torch.cuda.is_available()) else "cpu"
    if device_type == "cpu":
        use_interpreter()
    resolve_args(args, device_type)
    from .providers import FALLBACK, cpu_backend, set_tutorial_path

    set_tutorial_path(args.tutorial)
    if device_type == "cpu":
        # Imported while TRITON_INTERPRET=1, so that Triton's interpreter can run our kernels
        # where asked; TRITON_INTERPRET=0 for the run then sends every other call to the
        # PyTorch fallback.
        importlib.import_module("kernels")
    with cpu_backend(FALLBACK) if device_type == "cpu" else contextlib.nullcontext():
        return _run(args, device_type, start)


def _check_parity(args, device, device_type, dtypes):
    """The parity results of ours as the device runs it (and, on CPU with ``--interpreter``, of
    the interpreted kernel at a tiny shape), each naming its ``backend`` on CPU."""
    from .parity import check_parity
    from .providers import FALLBACK, INTERPRETER, cpu_backend, interpreter_unavailable

    results = check_parity(device, dtypes, parity_shapes(device_type, args.head_dims))
    if device_type == "cuda":
        return results
    for r in results:
        r["backend"] = FALLBACK
    if args.interpreter and interpreter_unavailable() is None:
        with cpu_backend(INTERPRETER):
            more = check_parity(device, dtypes, parity_shapes("cpu", [], interpreter=True))
        results += [dict(r, backend=INTERPRETER) for r in more]
    return results


def _run(args, device_type, start):
    import torch

    from . import report
    from .features import feature_rows
    from .modules import gpt_rows, module_rows
    from .providers import INTERPRETER, cpu_backend
    from .sweep import SweepConfig, run_sweep

    device = "cuda" if device_type == "cuda" else "cpu"
    eprint = report.eprint
    if device_type == "cpu" and args.cpu_threads and args.cpu_threads > 0:
        # With more threads than idle cores, every tiny PyTorch op waits at a thread barrier for
        # a descheduled worker (measured: SDPA at seq 64 took 8 ms with 2 threads on a busy
        # 2-core machine, 0.05 ms with 1).
        torch.set_num_threads(args.cpu_threads)
    deadline = start + args.time_budget if args.time_budget and args.time_budget > 0 else (
        float("inf"))
    meta = report.collect_meta(device, dict(vars(args)), REPO_DIR, interpreter=args.interpreter)
    eprint(f"benchmarks: device {meta['device']}, torch {meta['torch']}, triton "
           f"{meta['triton']}, cuda {meta['cuda']}, commit {meta['commit']}")
    if device_type == "cpu":
        eprint("benchmarks: NO GPU - " + meta["note"])
    os.makedirs(args.out_dir, exist_ok=True)
    stem = report.results_stem(device)
    stem_path = os.path.join(args.out_dir, stem)

    # 1. Parity.
    if not args.skip_parity:
        t0 = time.monotonic()
        # The primary dtype only (the test suite covers the others): every dtype, head_dim and
        # dropout setting costs an autotuning pass of compiles before anything is timed.
        dtypes = [getattr(torch, args.dtypes[0])]
        try:
            parity = _check_parity(args, device, device_type, dtypes)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            eprint(f"benchmarks: PARITY CHECK COULD NOT RUN: {type(exc).__name__}: {exc}")
            return 1
        meta["parity"] = parity
        bad = [r for r in parity if not r["ok"]]
        for r in bad:
            eprint(f"  parity FAIL [{r.get('backend') or device}] {r['name']} {r['dtype']} "
                   f"{r['shape']}: err {r['err']:.3e} > budget {r['budget']:.3e}")
        if bad:
            eprint(f"benchmarks: PARITY FAILED for {len(bad)} of {len(parity)} checks "
                   "(error above 2x/3x PyTorch's own error vs float64); nothing was timed.")
            return 1
        worst = max(r["err"] / r["budget"] for r in parity if r["budget"] > 0)
        eprint(f"benchmarks: parity ok: {len(parity)} checks (output and gradients, each shape "
               f"and dropout), the largest error {worst:.2f}x its budget "
               f"({time.monotonic() - t0:.1f}s; the results file lists each)")

    rows = []
    meta["complete"] = False

    def save(current):
        meta["elapsed_s"] = round(time.monotonic() - start, 1)
        return report.write_results(stem_path, meta, current)

    progress = Progress(start)
    primary = getattr(torch, args.dtypes[0])
    opts = dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, cpu_reps=args.cpu_reps,
                cpu_max_s=args.cpu_max_s)
    # 2. Module level.
    if not args.no_modules:
        rows += module_rows(device, primary, args.dropout, opts, deadline, progress, args.quick)
        save(rows)
        rows += gpt_rows(device, primary, opts, deadline, progress, args.quick)
        save(rows)
    # 2b. Book models (opt-in): asked for, so before the sweep that the time budget cuts.
    if args.book_models is not None:
        from .book_models import FAMILIES as BOOK_FAMILIES
        from .book_models import book_rows

        done_before = list(rows)
        rows += book_rows(device, primary, args.book_models or BOOK_FAMILIES, opts, deadline,
                          progress, layers=args.book_layers,
                          on_rows=lambda current: save(done_before + current))
        save(rows)
    # 3. Sweep, with the feature rows after its primary config.
    done = list(rows)
    feature_list = [] if args.no_features else list(dict.fromkeys(args.features))
    feat = []

    def run_features(sweep_so_far=()):
        if not feature_list:
            return
        # On CPU the feature rows exercise our kernel's code paths in Triton's interpreter.
        cpu = device_type == "cpu"
        with cpu_backend(INTERPRETER) if cpu else contextlib.nullcontext():
            new = feature_rows(device, primary, feature_list, opts, deadline, progress,
                               args.quick,
                               sdpa_names=args.providers if args.explicit_providers else None)
        for r in new if cpu else ():   # which implementation ours ran
            if r["provider"].startswith("kernels") or r["provider"].endswith("triton_fused"):
                r["backend"] = INTERPRETER
        feat.extend(new)
        save(done + feat + list(sweep_so_far))

    if args.no_sweep:
        run_features()
        rows = done + feat
    else:
        cfg = SweepConfig(device=device, seq_lens=args.seq_lens, modes=args.modes,
                          dtypes=args.dtypes, head_dims=args.head_dims, dropouts=args.dropout,
                          providers=args.providers, tokens=args.tokens, hidden=args.hidden,
                          quadratic_max_seq=args.quadratic_max_seq,
                          explicit_providers=args.explicit_providers,
                          warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, cpu_reps=args.cpu_reps,
                          cpu_max_s=args.cpu_max_s, deadline=deadline)
        sweep_rows = run_sweep(cfg, lambda name: getattr(torch, name),
                               on_point=lambda current: save(done + feat + current),
                               progress=progress, after_primary=run_features)
        rows = done + feat + sweep_rows
    progress.close()
    meta["complete"] = True
    paths = save(rows)
    if not args.no_plots:
        from .plots import write_plots

        try:
            paths += write_plots(rows, args.out_dir, stem, title=meta["device"])
        except Exception as exc:  # plotting must not lose a finished sweep
            print(f"plots: failed ({type(exc).__name__}: {exc}); results files are intact")
    from .book_models import format_book
    from .features import format_mla_decode

    for text in (report.format_tables(rows, args.table_metric, memory=device_type == "cpu"),
                 report.format_features(rows),
                 report.format_decode(rows, "ms" if args.table_metric == "ms" else "gbps"),
                 format_mla_decode(rows, "ms" if args.table_metric == "ms" else "gbps"),
                 format_book(rows)):
        if text:
            print(text)
    if device_type == "cpu":
        print("\nNOTE: " + meta["note"])
    summary = report.status_summary(rows)
    print(f"\n{len(rows)} rows: " + ", ".join(f"{k} {v}" for k, v in sorted(summary.items()))
          + f"; {time.monotonic() - start:.1f}s")
    cut = sum(r["status"] == "skipped: time budget" for r in rows)
    if cut:
        print(f"TIME BUDGET: {cut} rows were not run within --time-budget {args.time_budget:.0f}s "
              "(status 'skipped: time budget'); raise it or narrow the sweep to get them")
    for r in report.errors(rows):
        print(f"  ERROR {r['provider']} {r['mode']} {r['dtype']} d{r['head_dim']} "
              f"p{r['dropout_p']} seq {r['seq_len']}: {r['status']}")
    print("wrote " + ", ".join(paths))
    if args.strict and report.errors(rows):
        return 2
    return 0
