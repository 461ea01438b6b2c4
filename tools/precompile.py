"""Compile, before any timing, every kernel a device run will launch, in parallel on the
device's CPU cores, into the shared Triton and inductor caches; the timed stages then load
them (their autotuner still times each kept config on the GPU, but compiles nothing).

Why: on the first GPU run each shape's first call compiled and autotuned serially, ~6 s
forward + ~4 s backward, and the 166 s sweep reached seq 128 only. Compilation is CPU work; the
device has 16 cores.

How:
1. **Plan** (this process): the launches of the run (``workloads``): our forward and backward
   at each sweep point (seq x head_dim x dropout x TMA on / off), the Triton tutorial's
   forward and backward at each (seq, head_dim) (fp16: it compiles nothing else), and
   FlexAttention's compiled graphs (inference and training) at each dropout-free point. Each
   attention workload is replayed with Triton's ``Autotuner.run`` / ``JITFunction.run``
   patched to record instead of launch: every config the launch's own ``early_config_prune``
   keeps (kernels/core/configs.py), and Triton's in-memory cache key of the specialisation
   (``compute_cache_key``), so that a kernel shared by several shapes (the sweep's lengths
   are all multiples of 16: the same binary) is compiled once.
2. **Compile** (``--jobs`` processes): each unique (launch, config) is compiled with
   ``warmup=True`` (nothing launched) into ``TRITON_CACHE_DIR``; the Flex workloads run for
   real on the GPU (one compile thread each), filling inductor's FX-graph and kernel caches.
3. **Report** (``--json``): per unit its seconds and status, totals, and the fingerprint of the
   Triton install (version, libtriton hash, ptxas version, target) -- what a cache built
   elsewhere would have to match.

Our workloads call the launchers (``kernels.core.forward.attention_forward`` /
``kernels.core.backward.attention_backward``) with CPU tensors of the sweep's shapes and
layouts, as ``kernels.attention`` calls them on contiguous (batch, heads, seq, dim) inputs:
Triton specialises on dtypes, constexprs, 16-byte divisibility of pointers and ints and
ints equal to 1, all the same on CPU tensors (64-byte aligned) as on CUDA ones, and compiles
for the driver's target. The module and GPT-124M rows (8 x 1024, 12 x 64, bf16, views of a
(batch, seq, 768) projection: every stride a multiple of 16) specialise like the sweep's
d64 seq-1024 point, so they need no unit of their own.

A cache built on another machine is not used: Triton's on-disk key starts with
``triton_key()``, a hash of libtriton's bytes, which differ between a Python 3.11 build (the
static tools' venv) and the device's 3.12 one, and the cache's group files hold absolute
paths (runtime/cache.py ``get_group``). The fingerprint in the report lets a later session
compare installs.

``--dry-run``: the plan without any compile or GPU (works on a CPU-only machine with any
Triton: the launches are enumerated from the project's own config lists and pruning).
``--stub-target 90``: compile here, for sm_90, with a stand-in driver (tools/sm90_static.py's
method; Triton 3.6): the rehearsal of the compile path on a CPU-only machine. The tutorial's
kernels only with ``--tutorial PATH`` (Triton 3.6's tutorials/06-fused-attention.py, not part of
this repository); without it the tutorial is left out, and said so.

    python -m tools.precompile --jobs 16 --json OUT.json [--tutorial PATH] [--seq-lens ...]

(from the repository's root; benchmarks/gpu_check.sh runs it as its "precompile" stage).
"""
import argparse
import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import sys
import time

SEQ_LENS = (128, 512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (128, 64)
DROPOUTS = (0.0, 0.1)
# TMA off and in-kernel forward descriptors too at these lengths: the profile and tma_ab stages
# time ours without descriptors and with the per-program ones (KERNELS_TMA=0, =kernel).
TMA_OFF_MAX_SEQ = 1024
TOKENS, HIDDEN = 16384, 2048
KINDS = ("ours", "tutorial", "flex")

# The kernels must be compiled ones here (never interpreted: the interpreter would run them on
# the sweep's shapes), whatever the calling environment set.
if "kernels" not in sys.modules:
    os.environ.pop("TRITON_INTERPRET", None)


def build_parser():
    """The command line (also used by tools.device_plan to validate a device script)."""
    ap = argparse.ArgumentParser(prog="python -m tools.precompile", allow_abbrev=False,
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="compile processes (default: every core)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    ap.add_argument("--dropout", type=float, nargs="+", default=list(DROPOUTS))
    ap.add_argument("--tma-off-max-seq", type=int, default=TMA_OFF_MAX_SEQ,
                    help="also compile ours with KERNELS_TMA=0 and =kernel up to this seq "
                         "(0: never)")
    ap.add_argument("--persistent", action="store_true",
                    help="also compile ours with the persistent forward (KERNELS_FWD_PERSISTENT"
                         "=1: the persistent_ab stage)")
    ap.add_argument("--warp-spec", action="store_true",
                    help="also compile ours with the warp-specialised forward configs offered "
                         "(KERNELS_FWD_WARP_SPEC=1: the warpspec_ab stage)")
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                    help="what to compile: ours, the Triton tutorial, FlexAttention")
    ap.add_argument("--tutorial", metavar="PATH",
                    help="the Triton tutorial's fused attention (06-fused-attention.py); "
                         "without it the tutorial's kernels are not compiled")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--dry-run", action="store_true",
                    help="list the workloads (and, where Triton can enumerate them here, the "
                         "unique compile units); compile nothing")
    ap.add_argument("--stub-target", type=int, metavar="CC",
                    help="no GPU: compile for compute capability CC with a stand-in driver "
                         "(triton 3.6; tools/sm90_static.py's method), Flex skipped")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="stop after this many seconds (0: none), keeping what is compiled")
    ap.add_argument("--limit", type=int, default=0,
                    help="compile at most this many units (0: all; rehearsals)")
    return ap


# ----------------------------------------------------------------------------- workloads
def workloads(args):
    """Every workload of the run, as JSON-able dicts, in the order they are compiled (the
    sweep's order: seq ascending, so a budget cut leaves the first points compiled)."""
    out = []
    for seq in args.seq_lens:
        for d in args.head_dims:
            batch, heads = max(1, args.tokens // seq), max(1, args.hidden // d)
            shape = dict(batch=batch, heads=heads, seq=seq, head_dim=d)
            if "ours" in args.kinds:
                for p in args.dropout:
                    tmas = (1, "kernel", 0) if seq <= args.tma_off_max_seq else (1,)
                    for tma in tmas:
                        out.append(dict(kind="ours", dropout=p, tma=tma, **shape))
                    if args.persistent:
                        out.append(dict(kind="ours", dropout=p, tma=1, persistent=1, **shape))
                    if args.warp_spec:
                        out.append(dict(kind="ours", dropout=p, tma=1, warp_spec=1, **shape))
            if "tutorial" in args.kinds and args.tutorial:
                out.append(dict(kind="tutorial", dropout=0.0, tma=1, path=args.tutorial,
                                **shape))
            if "flex" in args.kinds and 0.0 in args.dropout:
                for graph in ("inference", "training"):
                    out.append(dict(kind="flex", dropout=0.0, tma=1, graph=graph, **shape))
    return out


def _label(w):
    extra = f" {w['graph']}" if w["kind"] == "flex" else (
        f" p{w['dropout']} tma{w['tma']}{' persistent' if w.get('persistent') else ''}"
        f"{' warp_spec' if w.get('warp_spec') else ''}"
        if w["kind"] == "ours" else "")
    return f"{w['kind']} {w['batch']}x{w['heads']}x{w['seq']} d{w['head_dim']}{extra}"


def _load_anchor(path):
    """The Triton tutorial's module at ``path``, as the sweep's provider loads it."""
    from benchmarks.providers import load_tutorial

    return load_tutorial(path)


def run_attention_workload(w):
    """Make the launches of one attention workload (ours or the tutorial), forward then
    backward, with CPU tensors: under :func:`intercept` nothing runs on a device."""
    import torch

    shape = (w["batch"], w["heads"], w["seq"], w["head_dim"])
    if w["kind"] == "ours":
        os.environ["KERNELS_TMA"] = str(w["tma"])
        os.environ["KERNELS_FWD_PERSISTENT"] = str(w.get("persistent", 0))
        os.environ["KERNELS_FWD_WARP_SPEC"] = str(w.get("warp_spec", 0))
        from kernels.core.backward import attention_backward
        from kernels.core.forward import attention_forward

        q, k, v, o, do = (torch.empty(shape, dtype=torch.bfloat16) for _ in range(5))
        p = w["dropout"]
        call = dict(causal=True, softmax_scale=w["head_dim"] ** -0.5, dropout_p=p,
                    seed=1234 if p else 0)
        o, lse = attention_forward(q, k, v, **call)
        attention_backward(do, q, k, v, o, lse, **call)
        return
    import types

    mod = _load_anchor(w["path"])
    q, k, v, do = (torch.empty(shape, dtype=torch.float16) for _ in range(4))
    saved = {}
    ctx = types.SimpleNamespace(save_for_backward=lambda *t: saved.setdefault("t", t))
    o = mod._attention.forward(ctx, q, k, v, True, w["head_dim"] ** -0.5, False)
    ctx.saved_tensors = saved["t"]
    mod._attention.backward(ctx, do.contiguous())


@contextlib.contextmanager
def intercept(mode, target_unit=None, on_unit=None):
    """Patch Triton so that launches do not run. ``mode="record"``: call ``on_unit(unit)`` for
    every (launch, config) a workload would compile -- unit = dict(launch=ordinal, kernel,
    config index into the launch's kept list, config text, key = Triton's in-memory cache key
    or None where it cannot be computed here). ``mode="compile"``: compile only the unit whose
    (launch, config) equals ``target_unit`` (``warmup=True``: no launch)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    orig_jit_run, orig_at_run = JITFunction.run, Autotuner.run
    state = dict(launch=-1, config=None, in_autotuner=False)

    def key_of(fn, args, kwargs):
        try:  # triton 3.x internals; a failure only means no de-duplication
            from triton.runtime.driver import driver
            from triton.runtime.jit import compute_cache_key

            device = driver.active.get_current_device()
            kernel_cache, key_cache, target, backend, binder = fn.device_caches[device]
            from triton import knobs

            # As JITFunction.run (triton 3.6) completes the options before binding.
            kw = dict(kwargs)
            kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
            kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            _, specialization, options = binder(*args, **kw)
            return f"{fn.__name__}|{target}|" + compute_cache_key(key_cache, specialization,
                                                                  options)
        except Exception:
            return None

    def jit_run(self, *args, grid, warmup, **kwargs):
        if not state["in_autotuner"]:
            state["launch"] += 1
            state["config"] = (0, f"num_warps={kwargs.get('num_warps', 4)} "
                                  f"num_stages={kwargs.get('num_stages', 3)}")
        index, text = state["config"]
        unit = dict(launch=state["launch"], kernel=self.__name__, config=index, config_text=text)
        if mode == "record":
            unit["key"] = key_of(self, args, kwargs)
            on_unit(unit)
            return None
        if (unit["launch"], unit["config"]) == tuple(target_unit):
            return orig_jit_run(self, *args, grid=grid, warmup=True, **kwargs)
        return None

    def at_run(self, *args, **kwargs):
        state["launch"] += 1
        self.nargs = dict(zip(self.arg_names, args))
        kept = self.prune_configs(kwargs)
        self.best_config = kept[0]  # read by launchers after the run; nothing was launched
        state["in_autotuner"] = True
        try:
            for i, config in enumerate(kept):
                full = {**self.nargs, **kwargs, **config.all_kwargs()}
                if config.pre_hook is not None:
                    config.pre_hook(full)   # the tutorial sets its descriptors' blocks here
                state["config"] = (i, str(config))
                # kwargs carry the launch's grid and warmup (KernelInterface.__getitem__).
                self.fn.run(*args, **{**kwargs, "warmup": True}, **config.all_kwargs())
        finally:
            state["in_autotuner"] = False
            self.nargs = None

    JITFunction.run = jit_run
    Autotuner.run = at_run
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = orig_jit_run, orig_at_run


def record_units(w):
    """The compile units of one attention workload (see :func:`intercept`)."""
    units = []
    with intercept("record", on_unit=units.append):
        run_attention_workload(w)
    return units


def approx_key(w, unit):
    """A de-duplication key when Triton's own cannot be computed (no driver here): what the
    binaries of two of our launches can differ in besides 16-divisible ints (seq_len does not
    enter; the kernel, its config, dtype, head_dim, dropout and TMA do)."""
    return (f"{unit['kernel']}|{unit['config_text']}|{w['kind']}|d{w['head_dim']}|"
            f"p{w['dropout']}|tma{w['tma']}|batch1={w['batch'] == 1}")


def plan(args, log=print):
    """(workloads, units): every unique compile unit with the workload that produces it."""
    work = workloads(args)
    units, seen = [], {}
    for wi, w in enumerate(work):
        if w["kind"] == "flex":
            units.append(dict(workload=wi, kernel="flex", launch=0, config=0,
                              config_text=w["graph"], key=f"flex|{_label(w)}"))
            continue
        try:
            found = record_units(w)
        except Exception as exc:
            raise SystemExit(f"precompile: enumerating {_label(w)} failed: "
                             f"{type(exc).__name__}: {exc}") from exc
        for u in found:
            key = u.pop("key") or approx_key(w, u)
            if key in seen:
                seen[key]["shared_by"] += 1
                continue
            u.update(workload=wi, key=hashlib.sha1(key.encode()).hexdigest()[:12], shared_by=1)
            seen[key] = u
            units.append(u)
    log(f"precompile: {len(work)} workloads, {len(units)} unique compile units "
        f"({sum(u['kernel'] == 'flex' for u in units)} Flex graphs)")
    return work, units


# ----------------------------------------------------------------------------- workers
_STUB = {"cc": None}


def install_stub_driver(cc):
    """No GPU: a stand-in Triton driver answering target ``cuda:cc`` (compile only; the static
    tools' method, tools/sm90_static.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/stub_driver.py
    import stub_driver
    stub_driver.install(cc)
    _STUB["cc"] = cc


def _die_with_parent():
    """Linux: the kernel kills this worker when the precompile process ends (a stage timeout
    kills only the parent; orphans would compile on through the timed stages)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _worker_init(stub_cc):
    _die_with_parent()
    os.environ.pop("TRITON_INTERPRET", None)
    # One inductor compile thread per worker: the pool already uses every core.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    if stub_cc:
        install_stub_driver(stub_cc)


def _flex_unit(w):
    """Run FlexAttention as the sweep does (benchmarks.providers, the same dynamo settings)
    once, so that its graphs land in inductor's caches."""
    import torch

    from benchmarks.measure import mode_maker
    from benchmarks.providers import Case, configure_dynamo, get_provider, reset_compiled

    configure_dynamo()
    reset_compiled()
    case = Case(batch=w["batch"], heads=w["heads"], seq_len=w["seq"], head_dim=w["head_dim"],
                dtype=torch.bfloat16, dropout_p=0.0,
                device="cuda" if torch.cuda.is_available() else "cpu")   # cpu: rehearsals
    q, k, v, do = case.make_inputs(generator_seed=w["seq"])
    forward = get_provider("flex").forward(case)
    if w["graph"] == "inference":
        q, k, v = q.detach(), k.detach(), v.detach()
    mode = "fwd" if w["graph"] == "inference" else "fwd_bwd"
    mode_maker(lambda: forward(q, k, v), mode, do, (q, k, v))()()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compile_unit(w, unit):
    """Compile one unit (in a worker process); returns (status, seconds, note)."""
    t0 = time.perf_counter()
    try:
        if unit["kernel"] == "flex":
            if _STUB["cc"]:
                return "skipped: no GPU (stand-in driver)", 0.0, ""
            _flex_unit(w)
        else:
            with intercept("compile", target_unit=(unit["launch"], unit["config"])):
                run_attention_workload(w)
        return "ok", round(time.perf_counter() - t0, 2), ""
    except Exception as exc:  # a config that does not compile: the autotuner skips it too
        text = " ".join(str(exc).split())[:200]
        return f"error: {type(exc).__name__}", round(time.perf_counter() - t0, 2), text


def fingerprint():
    """What Triton's on-disk cache key is made of here (compare across machines)."""
    info = {}
    try:
        import triton
        from triton.runtime.cache import triton_key

        info["triton"] = triton.__version__
        info["triton_key_sha"] = hashlib.sha256(triton_key().encode()).hexdigest()[:16]
        info["python"] = sys.version.split()[0]
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
        info["target"] = str(target)
        from triton.backends.nvidia.compiler import get_ptxas_version

        version = get_ptxas_version(target.arch)
        if isinstance(version, bytes):
            version = version.decode(errors="replace")
        info["ptxas"] = str(version).strip().splitlines()[-1]
    except Exception as exc:
        info["fingerprint_error"] = f"{type(exc).__name__}: {exc}"[:200]
    info["TRITON_CACHE_DIR"] = os.environ.get("TRITON_CACHE_DIR")
    return info


def main(argv=None):
    args = build_parser().parse_args(argv)
    if "tutorial" in args.kinds:
        if not args.tutorial:
            print("precompile: the Triton tutorial: not given (--tutorial PATH); not compiled")
        elif not os.path.exists(args.tutorial):
            raise SystemExit(f"precompile: the tutorial is missing: {args.tutorial}")
    import torch

    if args.stub_target:
        install_stub_driver(args.stub_target)
    elif not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("precompile: no CUDA device (use --dry-run, or --stub-target 90 to "
                         "compile for sm_90 with a stand-in driver)")
    if args.dry_run:
        return dry_run(args)
    start = time.perf_counter()
    work, units = plan(args)
    if args.limit:
        units = units[:args.limit]
    report = dict(fingerprint=fingerprint(), jobs=args.jobs, workloads=len(work),
                  units=len(units), plan_s=round(time.perf_counter() - start, 1), results=[])

    def save():
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report, f, indent=1)
            os.replace(tmp, args.json)

    save()
    import multiprocessing

    # Flex first: its graphs take longest; the kernels fill the pool around them.
    order = sorted(units, key=lambda u: u["kernel"] != "flex")
    ctx = multiprocessing.get_context("spawn")   # fresh CUDA / Triton state per worker
    deadline = start + args.time_limit if args.time_limit else None
    pool = cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx,
                                  initializer=_worker_init, initargs=(args.stub_target,))
    futures = {pool.submit(compile_unit, work[u["workload"]], u): u for u in order}
    try:
        done_iter = cf.as_completed(futures, timeout=None if deadline is None
                                    else max(1.0, deadline - time.perf_counter()))
        for n, fut in enumerate(done_iter, 1):
            u = futures[fut]
            try:
                status, secs, note = fut.result()
            except Exception as exc:   # the worker died (e.g. ptxas crashed it)
                status, secs, note = f"error: {type(exc).__name__}", None, str(exc)[:200]
            row = dict(workload=_label(work[u["workload"]]), kernel=u["kernel"],
                       config=u["config_text"], status=status, seconds=secs, note=note)
            report["results"].append(row)
            print(f"[{n}/{len(order)} {time.perf_counter() - start:6.1f}s] {row['workload']} "
                  f"{u['kernel']} {u['config_text']}: {status} {secs}s {note}", flush=True)
            if n % 8 == 0:
                save()
    except cf.TimeoutError:
        # --time-limit: the timed stages come next; what is compiled stays in the cache.
        report["cut_at_time_limit"] = True
        print(f"precompile: --time-limit {args.time_limit} s reached, "
              f"{len(futures) - len(report['results'])} units left to the timed stages",
              flush=True)
    finally:
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()     # no worker may outlive this stage (cf. _die_with_parent)
        pool.shutdown(wait=False, cancel_futures=True)
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    report["compile_s_sum"] = round(sum(r["seconds"] or 0 for r in report["results"]), 1)
    report["errors"] = sum(r["status"].startswith("error") for r in report["results"])
    save()
    print(f"precompile: {len(report['results'])} of {len(units)} units in {report['elapsed_s']} s "
          f"on {args.jobs} processes "
          f"({report['compile_s_sum']} s of compiling; {report['errors']} did not compile: "
          f"the autotuner skips those configs too)")
    return 0


def dry_run(args):
    """The plan without compiling: workloads, and the unique units where Triton can enumerate
    them on this machine (it needs no driver for pruning; the binder needs one, so the
    de-duplication key falls back to :func:`approx_key`)."""
    work = workloads(args)
    by_kind = {k: sum(w["kind"] == k for w in work) for k in KINDS}
    print(f"precompile --dry-run: {len(work)} workloads ({by_kind}); TRITON_CACHE_DIR="
          f"{os.environ.get('TRITON_CACHE_DIR')}; jobs {args.jobs}")
    for w in work[:6]:
        print(f"  {_label(w)}")
    if len(work) > 6:
        print(f"  ... {len(work) - 6} more")
    if "ours" in args.kinds:
        try:
            _, units = plan(dict_to_args(args, kinds=["ours"]))
            kernels = {}
            for u in units:
                kernels[u["kernel"]] = kernels.get(u["kernel"], 0) + 1
            print(f"  ours: {len(units)} unique (kernel, config) units: {kernels}")
        except SystemExit as exc:
            print(f"  ours: not enumerable here ({exc})")
            return 1
    if "tutorial" in args.kinds and args.tutorial:
        import py_compile

        py_compile.compile(args.tutorial, doraise=True)
        print(f"  tutorial: {args.tutorial} compiles as Python")
    return 0


def dict_to_args(args, **changes):
    """A copy of the parsed ``args`` with ``changes``."""
    return argparse.Namespace(**{**vars(args), **changes})


if __name__ == "__main__":
    # Through the package's module, so that the pool's workers unpickle
    # tools.precompile's functions, not a second copy of __main__.
    from tools.precompile import main as _main

    sys.exit(_main())
