"""The dry run of a device script: validate one command of benchmarks/gpu_check.sh and say what
it would do, without a GPU and without running it.

    python -m tools.device_plan MODULE [ARGS...]     (from the repository's root)

stands in for ``python -m MODULE ARGS...`` when gpu_check.sh runs with ``DRY_RUN=1``: the same
argument list goes through the module's own parser, so a misspelt flag, provider, mode or
stage fails here, on the CPU, instead of in a lent device call. Per module:

* ``benchmarks`` (the CLI): parse, fill the GPU defaults (``resolve_args(args, "cuda")``),
  check every provider's ``static_reason`` on a CUDA case of each point, and print the plan
  (rows, providers, lengths, configs, the time budget).
* ``tools.precompile``: its ``--dry-run`` (the workloads, and the unique compile units
  as the project's own config lists and pruning give them here).
* ``benchmarks.host``, ``benchmarks.ceilings``: parse; print the settings.
* ``pytest``: collect the tests (``--collect-only -q``; ``-n`` and ``--junitxml`` dropped).

Any other module must at least be importable (``importlib.util.find_spec``). Exit status 0
when the command is valid, else 2 (argparse's) or 1.
"""
import importlib
import importlib.util
import sys


def _cli(argv):
    from benchmarks.cli import build_parser, resolve_args
    from benchmarks.providers import Case, get_provider
    from benchmarks.sweep import ordered_configs, shape_for

    args = build_parser().parse_args(argv)
    resolve_args(args, "cuda")
    print(f"benchmarks: providers {args.providers}; seq {args.seq_lens}; modes {args.modes}; "
          f"dtypes {args.dtypes}; head_dims {args.head_dims}; dropout {args.dropout}; "
          f"time budget {args.time_budget} s; out {args.out_dir}")
    parts = []
    if not args.skip_parity:
        parts.append("parity")
    if not args.no_modules:
        parts.append("module + GPT rows")
    if args.book_models is not None:
        parts.append(f"book models {args.book_models or 'all'}")
    if not args.no_sweep:
        import torch

        from benchmarks.cli import DTYPE_ALIASES
        n = (len(args.dtypes) * len(args.head_dims) * len(args.dropout) * len(args.seq_lens)
             * len(args.providers) * len(args.modes))
        parts.append(f"sweep {n} rows")
        unsupported = {}
        for dtype, d, p in ordered_configs(args.dtypes, args.head_dims, args.dropout):
            for seq in args.seq_lens:
                batch, heads = shape_for(seq, d, args.tokens, args.hidden)
                case = Case(batch=batch, heads=heads, seq_len=seq, head_dim=d,
                            dtype=getattr(torch, DTYPE_ALIASES[dtype]), dropout_p=p,
                            device="cuda")
                for name in args.providers:
                    reason = get_provider(name).static_reason(case)
                    if reason:
                        unsupported.setdefault((name, reason), 0)
                        unsupported[(name, reason)] += len(args.modes)
        for (name, reason), count in unsupported.items():
            print(f"  {name}: {count} rows unsupported on this machine's torch ({reason})")
    if args.features and not args.no_features:
        parts.append(f"features {args.features}")
    print(f"  runs: {', '.join(parts) or 'nothing'}")
    return 0


def _pytest(argv):
    import pytest

    keep, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        if a in ("-n", "--junitxml"):
            skip = 1
            continue
        if a.startswith("--junitxml=") or a.startswith("-n="):
            continue
        keep.append(a)
    print(f"pytest (collect only): {' '.join(keep)}")
    return int(pytest.main(keep + ["--collect-only", "-q"]))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    module, rest = argv[0], argv[1:]
    if module == "benchmarks":
        return _cli(rest)
    if module == "pytest":
        return _pytest(rest)
    if importlib.util.find_spec(module) is None:
        print(f"device_plan: no module named {module!r}", file=sys.stderr)
        return 1
    if module == "tools.precompile":
        from tools.precompile import main as precompile_main

        return precompile_main(rest + ["--dry-run"])
    mod = importlib.import_module(module)
    parser = getattr(mod, "build_parser", None)
    if parser is None:
        print(f"{module}: importable (no build_parser to validate its arguments)")
        return 0
    args = parser().parse_args(rest)
    print(f"{module}: {vars(args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
