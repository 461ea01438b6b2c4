#!/usr/bin/env python3
"""Host (CPU-side) cost of one call of the project's public attention API on the GPU path,
measured without a GPU, against torch SDPA on the same tensors.

What it measures
    The project's real GPU-path Python (validation, custom-op dispatch, autograd, launchers,
    autotuner lookup, Triton's JIT binder and Triton 3.6's generated C launcher) runs on CPU
    tensors; only what needs a GPU is stubbed (below). Timed in microseconds per call, ONLY
    through the public API so that renamed internals do not break it, at --shapes (batch, heads,
    seq, head_dim), default bf16 (1,1,16,16) and (2,2,128,128). The host cost does not depend on
    the shape, but the baselines' CPU math does: the SDPA and module rows run at the first shape
    only (tiny, so their math is a few us); later shapes time our six attention rows, to show
    that our cost stays the same (shape-dependent host code would show up there).
        attention fwd no_grad   ``kernels.attention(q, k, v, causal=True)`` under no_grad
        attention fwd grad      the same with grad enabled (graph built, no backward)
        attention fwd+bwd       ``torch.autograd.backward(kernels.attention(...), dO)`` (fixed dO,
                                 .grad cleared before each call)
        attention p=0.1 ...      the same three with ``dropout_p=0.1`` (seed=None, the default)
        sdpa ...                 ``torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                 is_causal=True)`` (and ``dropout_p=0.1``), same six cases and
                                 tensors: the baseline. SDPA's rows include its (tiny) CPU math.
        FusedMultiHeadAttention / MultiHeadAttention (reference)
                                 ``kernels.FusedMultiHeadAttention`` vs ``reference.
                                 MultiHeadAttention`` with the same constructor arguments
                                 (d_in = d_out = heads*head_dim, context_length = seq,
                                 dropout 0.0, heads), fwd no_grad and fwd+bwd, x (batch, seq, d_in)
        triton bare launch       a no-op ``@triton.jit`` kernel with one pointer argument through
                                 the same stubbed Triton: the floor of any Triton launch here.
    Timing: every case is warmed up, then timed in batches of --inner calls; batches of ALL cases
    run round-robin (the starting case rotates every round) until --budget seconds (counted from
    the start of the tool, setup included; at least 5 rounds) or --rounds, so load from other
    jobs spreads over all cases. Per case: min, p20 and median of its batches' per-call times.
    torch runs with one thread; gc stays on (its cost is part of a call).
    The last line is the summary, from the FIRST shape's p20 column (p20 rather than min: on a
    shared, loaded machine the minimum is one lucky batch, while the 20th percentile is still
    close to the uncontended speed but stable from run to run):
        host-overhead: fwd A us (SDPA B, A/Bx), fwd+bwd .., dropout fwd+bwd .., module fwd+bwd C us
        (reference D, C/Dx), launch floor E us, recompiles per 40 seeds: N
    --json PATH writes every number (all percentiles, launches per call, the variants per
    kernel, versions, notes).

    Seed specialisation probe: after warm-up, ``torch.manual_seed(0)`` (so every run draws the
    same seeds) and --seeds (default 40) dropout fwd+bwd calls with seed=None (a new random
    Philox seed per call, the API default), first shape. Every compiled variant gets its own
    function handle, and the stub libcuda counts launches per handle, so the tool reports how
    many distinct compiled variants of each kernel those calls launched, and in which kernel
    arguments the variants differ (``drop[0]`` = field 0 of the tuple argument ``drop``). More
    than one for a kernel means a per-call integer (the seed, or similar) is specialised by
    Triton (``% 16 == 0`` -> divisibility attribute, ``== 1`` -> constexpr, ``< 2**31`` -> i32):
    on a GPU every new variant is a compile of seconds inside a call. "recompiles per 40
    seeds" = the sum over kernels of (variants - 1); 0 is the target (e.g. the seed in
    ``do_not_specialize``, or passed in a tensor).

What is stubbed (everything else is the real code of the project, torch and Triton 3.6)
    * ``triton.runtime.driver.active``: a stand-in driver (target ``cuda`` sm_90, device 0,
      stream 0), as sm90_static.py does; ``torch.cuda.get_device_capability`` -> (9, 0).
    * ``JITFunction._do_compile``: instead of compiling, a fake CompiledKernel whose ``run`` is
      Triton's real ``CudaLauncher`` (its generated C launcher, built by gcc and cached in the
      tool's private Triton cache, linked against a stub ``libcuda.so.1`` whose calls return at
      once and which counts ``cuLaunchKernelEx`` calls per function handle); Triton's real
      ``launch_metadata`` / hook chains. Global scratch per program = 128 B per
      ``tt.make_tensor_descriptor`` in the kernel's TTIR (triton 3.6 gives every in-kernel
      descriptor a 128-byte slot; the TTIR comes from Triton's real front end, ~0.3 s per new
      variant, cached in the cache dir), so launches that need scratch call the project's
      allocator as on a GPU. num_warps from the config, shared memory 0.
    * ``Autotuner._bench`` returns a constant: the autotuner keeps its first config per key, as
      after a warm autotune (no benchmarking inside calls).
    * The project's fallback decision (the ONE private hook): CPU tensors would take the
      PyTorch fallback. Rule: the function named ``_use_fallback`` (FALLBACK_HOOK below) in
      the module that defines ``kernels.attention`` (today kernels/ops.py), a module global
      the op bodies look up at call time, taking one tensor and returning True for the
      fallback. It is replaced (in every ``kernels`` module that holds it) by its own CUDA
      branch: the original called with a stand-in whose ``.device`` is ``cuda:0`` (a
      supported sm_90 GPU), once per distinct extra arguments, its answer kept (on a GPU a
      plan decides its route once, as ``q.is_cuda``; CPU tensors would ask at every call and
      charge the GPU path for it); if that raises or says "fallback", by ``lambda t: False``
      (the header line and the JSON's ``fallback_hook`` say which). Renamed or moved: pass
      ``--fallback-hook MODULE:NAME`` or update FALLBACK_HOOK; the tool fails and says so
      when it is gone. Every warm-up call and every timed batch of an API case must reach the
      stub's ``cuLaunchKernelEx`` at least once per call, or the tool fails (the fallback ran,
      or the decision moved elsewhere: the number would be void).

What is left out (so a GPU host pays more than these numbers)
    * the driver's own time: ``cuLaunchKernelEx`` and one ``cuPointerGetAttribute`` per pointer
      argument (estimated 2-5 us per launch, not measured);
    * the CUDA caching allocator: CPU malloc stands in for ``torch.empty`` on the device;
    * the CUDA autograd engine's hand-off to its per-device thread: on CPU the backward runs on
      the calling thread; on CUDA it runs on another thread, woken per backward;
    * anything behind ``t.device.type == "cuda"`` in the project (e.g. a
      ``torch.cuda.get_device_properties`` per call): CPU tensors do not reach it;
    * the driver's encode of host-side TensorDescriptor arguments (``cuTensorMapEncodeTiled``,
      a stub here): the project encodes each buffer's descriptor once and keeps it per data
      pointer (kernels/core/launch.py ``_HostDesc``); the tool's calls reuse their tensors, so
      every call after the first hits that cache -- a loop whose activations land at new
      addresses pays one encode per new buffer (estimated ~1 us each, not measured);
    * compile and autotune time (warm-up and the seed probe absorb them).
    The stubbed kernels write nothing, so outputs and gradients are uninitialised memory;
    denormals are flushed (``torch.set_flush_denormal``) so that garbage cannot slow the
    modules' CPU projections.

How it relates to a real GPU
    On a GPU host this Python runs at roughly the speed measured here (inferred from one H200
    benchmark run, whose host-bound forward matched this 2-core VM's uncontended min/p20).
    When a call's host time exceeds its GPU time -- small problems, and every problem under
    ~1 ms of GPU work -- ``triton.testing.do_bench`` measures roughly the host time (minus what
    the GPU runs concurrently, e.g. the L2 flush), not the kernels. So a row here is a lower
    bound on what a benchmark reports for small shapes, and the time a training step loses per
    attention call when it is host-bound.

How to read the ratios
    "x base" = our p20 / SDPA's p20 on the same call: how many times more host time our API
    costs than PyTorch's own attention entry point (whose CPU rows also include its small math,
    so the ratio understates our overhead slightly; with dropout SDPA's CPU mask generation is
    a large part of its row, so that ratio understates more). The module ratio compares whole
    modules (projections included) with the book's reference. The bare launch is the floor of
    one Triton launch: a call that launches L kernels cannot cost less than L times it;
    "launches" (stub ``cuLaunchKernelEx`` calls per call) is in the table. On a loaded 2-core
    machine p20 and the ratios move 10-20% from run to run: compare two checkouts by
    alternating runs on the same machine, look at min as well, and trust differences of 2x,
    not of 10%.

Usage, from the repository's root (a venv with triton==3.6.0 -- the H100 host's version -- a
CPU torch and numpy, made once by ``python3 -m venv ~/.cache/sm90-venv &&
~/.cache/sm90-venv/bin/pip install triton==3.6.0 torch numpy``; gcc on PATH):
    python tools/host_overhead.py --project . [--budget 60] [--shapes 1x1x16x16,2x2x128x128]
        [--dtype bf16] [--seeds 40] [--inner 20] [--rounds 200] [--cache-dir DIR] [--json out.json]
        [--fallback-hook kernels.ops:_use_fallback]
    Started with any python3, it builds its stub libcuda.so.1 with gcc into the cache dir (default
    ~/.cache/host-overhead; first use only), then re-executes itself in a subprocess with the
    first python of: this one if it has triton 3.6 and torch, $SM90_VENV, ~/.cache/sm90-venv,
    with LD_LIBRARY_PATH / TRITON_LIBCUDA_PATH on the stub
    and a private TRITON_CACHE_DIR (<cache dir>/triton: the C launchers, built once). Nothing is
    written into the project (no bytecode). Runtime: --budget seconds, setup included (first
    run: ~15 s of it are C-launcher builds and TTIR, later ~3 s), or setup + 5 rounds if longer.
    The table goes to stdout, progress to stderr; the last stdout line is the summary. Exit 0
    when measured, 2 when it could not measure (no triton 3.6, no gcc, the fallback hook gone,
    an API call that reached no launch, an error in the project's code on this path).

Fragile (Triton 3.6 internals it relies on): ``JITFunction._do_compile``'s signature,
``CompiledKernel.run`` / ``launch_metadata`` / ``_init_handles``, ``CudaLauncher(src, metadata)``,
``Autotuner._bench``, ``ASTSource.make_ir`` and the backend's ``ttir`` stage; the stub implements
the libcuda calls 3.6's launcher makes. Another Triton version: update these and the stub.
"""
import argparse
import ctypes
import gc
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types

sys.dont_write_bytecode = True          # never write __pycache__ into the project checkout


VENVS = [os.environ.get("SM90_VENV"), "~/.cache/sm90-venv"]
CHILD_ENV = "HOST_OVERHEAD_CHILD"       # set in the re-executed measuring process
FALLBACK_HOOK = "_use_fallback"         # the rule: see "The project's fallback decision" above
TARGET_CC = 90
SCRATCH_PER_DESCRIPTOR = 128            # triton 3.6: one 128-B global-scratch slot per descriptor
MIN_ROUNDS = 5
WARMUP = 5
DROPOUT = 0.1

# The stand-in for libcuda.so.1: the calls Triton 3.6's generated launcher makes, all returning
# CUDA_SUCCESS at once; cuLaunchKernelEx counts launches, in total and per function handle (the
# fake CompiledKernels number their variants 1, 2, ...).
STUB_C = r"""
#include <stddef.h>
#include <stdint.h>
typedef int CUresult;
#define HANDLES 65536
static volatile long launches = 0;
static volatile long per_handle[HANDLES];
CUresult cuCtxGetCurrent(void **p) { *p = (void *)1; return 0; }
CUresult cuCtxSetCurrent(void *p) { return 0; }
CUresult cuDeviceGet(int *d, int o) { *d = 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **p, int d) { *p = (void *)1; return 0; }
CUresult cuFuncSetAttribute(void *f, int a, int v) { return 0; }
CUresult cuGetErrorString(int e, const char **s) { *s = "host_overhead stub"; return 0; }
CUresult cuPointerGetAttribute(void *data, int attr, uint64_t ptr) {
  *(uint64_t *)data = ptr; return 0; }
CUresult cuPointerGetAttributes(unsigned n, int *a, void **d, uint64_t p) { return 0; }
CUresult cuTensorMapEncodeTiled(void *m, int t, unsigned r, void *g, const uint64_t *s,
                                const uint64_t *st, const unsigned *b, const unsigned *e,
                                int i, int sw, int l2, int oob) { return 0; }
/* What Triton's utils module (cuda_utils) also links: host tensor descriptors are encoded
   through it (cuTensorMapEncodeTiled above). */
CUresult cuCtxGetDevice(int *d) { *d = 0; return 0; }
CUresult cuCtxGetLimit(size_t *v, int l) { *v = 0; return 0; }
CUresult cuCtxSetLimit(int l, size_t v) { return 0; }
CUresult cuDeviceGetAttribute(int *v, int a, int d) { *v = 0; return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return 0; }
CUresult cuFuncGetAttribute(int *v, int a, void *f) { *v = 0; return 0; }
CUresult cuFuncSetCacheConfig(void *f, int c) { return 0; }
CUresult cuModuleGetFunction(void **f, void *m, const char *n) { *f = (void *)1; return 0; }
CUresult cuModuleLoadData(void **m, const void *img) { *m = (void *)1; return 0; }
CUresult cuModuleUnload(void *m) { return 0; }
CUresult cuOccupancyMaxActiveClusters(int *n, void *f, const void *c) { *n = 1; return 0; }
CUresult cuStreamIsCapturing(void *s, int *st) { *st = 0; return 0; }
CUresult cuTensorMapEncodeIm2col(void *m) { return 0; }
CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) {
  uintptr_t h = (uintptr_t)f;
  launches++;
  if (h < HANDLES) per_handle[h]++;
  return 0;
}
long host_overhead_stub_launches(void) { return launches; }
long host_overhead_stub_handle_launches(long h) {
  return (h >= 0 && h < HANDLES) ? per_handle[h] : -1; }
"""


class Fail(Exception):
    """The tool could not measure; the message says why and what to do."""


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", default=".", help="project checkout (holds kernels/, reference/)")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="seconds for the whole run, setup included (at least 5 rounds are timed)")
    ap.add_argument("--shapes", default="1x1x16x16,2x2x128x128",
                    help="(batch x heads x seq x head_dim),...; the summary uses the first")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--seeds", type=int, default=40, help="dropout calls of the seed probe")
    ap.add_argument("--inner", type=int, default=20, help="calls per timed batch")
    ap.add_argument("--rounds", type=int, default=200, help="at most this many rounds")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                        "host-overhead"))
    ap.add_argument("--fallback-hook", default=None, metavar="MODULE:NAME",
                    help=f"the function that sends CPU tensors to the PyTorch fallback (default: "
                         f"{FALLBACK_HOOK} in the module defining kernels.attention)")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--compiled", action="store_true",
                    help="also time fwd+bwd through torch.compile (ours vs SDPA, first shape): "
                         "the path of users who compile their model")
    ap.add_argument("--serving", action="store_true",
                    help="also time a serving engine's decode step per layer (vLLM's "
                         "TRITON_FUSED backend: kernels.write_kv_cache at the step's slots, then "
                         "kernels.attention_varlen over a paged cache with max_seqlen_q and "
                         "out=), index tensors treated as a GPU's (no free host read), against "
                         "SDPA's one-token decode over a dense cache of the same keys")
    ap.add_argument("--profile", metavar="SUBSTRING",
                    help="instead of timing: cProfile 2000 calls of each case whose name "
                         "contains SUBSTRING (first shape) after the warm-up, and print the "
                         "functions by own time (where a call's host time goes)")
    a = ap.parse_args(argv)
    try:
        a.shape_list = [tuple(int(x) for x in s.lower().split("x")) for s in a.shapes.split(",")]
    except ValueError:
        ap.error(f"--shapes: expected e.g. 1x1x16x16,2x2x128x128, got {a.shapes!r}")
    if not a.shape_list or any(len(s) != 4 or min(s) < 1 for s in a.shape_list):
        ap.error(f"--shapes: four positive sizes per shape, got {a.shapes!r}")
    if a.inner < 1 or a.rounds < 1 or a.seeds < 0:
        ap.error("--inner and --rounds must be >= 1, --seeds >= 0")
    return a


# ----------------------------------------------------------------------------- parent process
def _has_triton36_here():
    try:
        from importlib import metadata
        return (metadata.version("triton").startswith("3.6.")
                and bool(metadata.version("torch")))
    except Exception:
        return False


def pick_python():
    if _has_triton36_here():
        return sys.executable
    for venv in VENVS:
        py = os.path.join(os.path.expanduser(venv), "bin", "python") if venv else ""
        if py and os.access(py, os.X_OK):
            return py
    return None


def build_stub(cache_dir):
    """The stub libcuda.so.1 (+ a libcuda.so link for -lcuda) in <cache_dir>/stubcuda-<hash>."""
    tag = hashlib.sha256(STUB_C.encode()).hexdigest()[:12]
    d = os.path.join(cache_dir, f"stubcuda-{tag}")
    lib, link = os.path.join(d, "libcuda.so.1"), os.path.join(d, "libcuda.so")
    if not os.path.exists(lib):
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if not cc:
            raise Fail("needs gcc (or $CC) to build its stub libcuda.so.1 (and Triton needs it "
                       "to build its C launchers)")
        os.makedirs(d, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            src, out = os.path.join(tmp, "stub.c"), os.path.join(tmp, "libcuda.so.1")
            with open(src, "w") as f:
                f.write(STUB_C)
            r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1",
                                "-o", out, src], capture_output=True, text=True)
            if r.returncode:
                raise Fail(f"building the stub libcuda with {cc} failed:\n{r.stderr}")
            shutil.copy(src, os.path.join(d, "stub.c"))      # for reading, not used
            os.replace(out, lib)
        print(f"host_overhead: built the stub libcuda in {d}", file=sys.stderr)
    if not os.path.lexists(link):
        try:
            os.symlink("libcuda.so.1", link)
        except FileExistsError:
            pass
    return d


def parent(argv):
    start = time.time()
    a = parse_args(argv)
    try:
        stub = build_stub(os.path.abspath(os.path.expanduser(a.cache_dir)))
    except Fail as e:
        print(f"host-overhead: not measured: {e}")
        return 2
    py = pick_python()
    if py is None:
        print("host-overhead: not measured: needs triton 3.6 (the H100 host's) with a CPU torch; "
              "make a venv: python3 -m venv ~/.cache/sm90-venv && ~/.cache/sm90-venv/bin/pip "
              "install triton==3.6.0 torch==2.13.0 numpy")
        return 2
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["LD_LIBRARY_PATH"] = stub + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH")
                                     else "")
    env["TRITON_LIBCUDA_PATH"] = stub
    env["TRITON_CACHE_DIR"] = os.path.join(os.path.abspath(os.path.expanduser(a.cache_dir)),
                                           "triton")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env[CHILD_ENV] = json.dumps(dict(start=start, stub=stub, python=py))
    try:
        r = subprocess.run([py, os.path.abspath(__file__)] + list(argv), env=env)
    except KeyboardInterrupt:
        return 130
    if r.returncode < 0:
        print(f"host-overhead: not measured: the measuring process ({py}) died of signal "
              f"{-r.returncode}")
        return 2
    return r.returncode


# ----------------------------------------------------------------------------- child: stubs
class Stub:
    """The stand-in Triton driver, fake compile, constant autotuner bench and launch counters."""

    def __init__(self, stub_dir, cache_dir):
        from triton.backends.nvidia.driver import CudaLauncher
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/stub_driver.py
        import stub_driver
        stub_driver.install(TARGET_CC)
        import triton
        # Triton's utils module first: each launcher module reads the descriptor type it
        # defines (driver.PyCUtensorMap) when it is built.
        triton.runtime.driver.active.utils

        lib = ctypes.CDLL(os.path.join(stub_dir, "libcuda.so.1"))
        lib.host_overhead_stub_launches.restype = ctypes.c_long
        lib.host_overhead_stub_handle_launches.restype = ctypes.c_long
        lib.host_overhead_stub_handle_launches.argtypes = [ctypes.c_long]
        self.launches = lib.host_overhead_stub_launches
        self.handle_launches = lib.host_overhead_stub_handle_launches
        self.variants = [None]          # handle -> dict(kernel=..., ...); handle 0 unused
        self.srcs = [None]              # handle -> the variant's ASTSource
        self.ttir_failures = []
        self.desc_cache_path = os.path.join(cache_dir, "descriptors.json")
        try:
            with open(self.desc_cache_path) as f:
                self.desc_cache = json.load(f)
        except (OSError, ValueError):
            self.desc_cache = {}
        self.desc_cache_dirty = False
        me = self

        class FakeKernel:
            """Stands for a CompiledKernel: Triton's real CudaLauncher as ``run`` (stub libcuda),
            the real ``launch_metadata`` / ``_init_handles`` / ``run``."""

            _init_handles = CompiledKernel._init_handles
            launch_metadata = CompiledKernel.launch_metadata
            run = CompiledKernel.run   # the property

            def __init__(self, jit_fn, src, options, handle, scratch):
                num_ctas = getattr(options, "num_ctas", 1)
                meta = types.SimpleNamespace(
                    num_ctas=num_ctas, num_warps=options.num_warps, shared=0,
                    global_scratch_size=scratch, global_scratch_align=SCRATCH_PER_DESCRIPTOR,
                    profile_scratch_size=0, profile_scratch_align=1,
                    launch_cooperative_grid=False, launch_pdl=False,
                    tensordesc_meta=_tensordesc_meta(src.signature))
                self.name = jit_fn.__name__
                self.module = object()          # "loaded": _init_handles returns at once
                self.function = handle          # what the stub's cuLaunchKernelEx receives
                self.packed_metadata = (options.num_warps, num_ctas, 0)
                self.metadata = meta
                self.src = src
                self._run = CudaLauncher(src, meta)

        def do_compile(fn, key, signature, device, constexprs, options, attrs, warmup):
            kernel_cache, _, tgt, backend, _ = fn.device_caches[device]
            src = fn.ASTSource(fn, signature, constexprs, attrs)
            n_desc = me.descriptors(fn, src, tgt, backend, options)
            handle = len(me.variants)
            kernel = FakeKernel(fn, src, options, handle, SCRATCH_PER_DESCRIPTOR * n_desc)
            me.variants.append(dict(kernel=fn.__name__, handle=handle,
                                    num_warps=options.num_warps,
                                    num_stages=getattr(options, "num_stages", None),
                                    descriptors=n_desc))
            me.srcs.append(src)
            kernel_cache[key] = kernel
            return kernel

        def bench(tuner, *args, config, **meta):
            return [1.0, 1.0, 1.0]

        JITFunction._do_compile = do_compile
        Autotuner._bench = bench

    def descriptors(self, fn, src, target, backend, options):
        """In-kernel tensor descriptors (tt.make_tensor_descriptor ops) in the variant's TTIR."""
        key = hashlib.sha256((src.hash() + repr(sorted(options.__dict__.items())))
                             .encode()).hexdigest()
        if key in self.desc_cache:
            return self.desc_cache[key]
        try:
            from triton._C.libtriton import ir
            ctx = ir.context()
            ir.load_dialects(ctx)
            backend.load_dialects(ctx)
            mod = src.make_ir(target, options, backend.get_codegen_implementation(options),
                              backend.get_module_map(), ctx)
            stages = {}
            backend.add_stages(stages, options, src.language)
            n = str(stages["ttir"](mod, {})).count("tt.make_tensor_descriptor")
        except Exception as e:          # a variant the front end rejects: no scratch assumed
            self.ttir_failures.append(f"{fn.__name__}: {str(e).strip().splitlines()[-1:]}")
            return 0
        self.desc_cache[key] = n
        self.desc_cache_dirty = True
        return n

    def save(self):
        if self.desc_cache_dirty:
            tmp = f"{self.desc_cache_path}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.desc_cache, f)
            os.replace(tmp, self.desc_cache_path)

    def handle_counts(self):
        return [self.handle_launches(h) for h in range(len(self.variants))]


# ----------------------------------------------------------------------------- child: the hook
def install_fallback_hook(kernels, spec):
    """Replace the project's fallback decision by its CUDA branch (see the module docstring)."""
    import importlib
    import torch
    if spec:
        mod_name, _, name = spec.partition(":")
        where = f"--fallback-hook {spec}"
    else:
        mod_name, name = getattr(kernels.attention, "__module__", None), FALLBACK_HOOK
        where = f"FALLBACK_HOOK ({FALLBACK_HOOK!r}) in {os.path.abspath(__file__)}"
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:
        raise Fail(f"cannot import {mod_name!r} for the fallback hook ({e}); update {where}")
    orig = getattr(mod, name, None)
    if not callable(orig):
        raise Fail(f"{mod_name} has no function {name!r}: the hook that decides whether a tensor "
                   f"takes the PyTorch fallback (CPU tensors do) is gone or renamed. Update "
                   f"{where}, or pass --fallback-hook MODULE:NAME naming the function the op "
                   f"bodies call (a module global, looked up at call time, one tensor -> bool)")
    stand_in = types.SimpleNamespace(device=torch.device("cuda", 0))
    mode = "cuda-branch"
    try:
        if orig(stand_in):
            mode = "constant-false (its CUDA branch says fallback for sm_90)"
    except Exception as e:
        mode = f"constant-false (its CUDA branch raised {type(e).__name__}: {e})"

    if mode == "cuda-branch":
        # The CUDA branch's answer for the stand-in device, once per extra arguments (e.g. an
        # FP8 flag): on a GPU a plan decides its route once (``q.is_cuda``: cached), while here
        # every call's tensors are CPU tensors, which would ask again at every call and charge
        # the GPU path a cost it does not pay.
        answers = {}

        def use_fallback(t, *args, _orig=orig, _dev=stand_in, **kwargs):
            key = (args, tuple(sorted(kwargs.items())))
            answer = answers.get(key)
            if answer is None:
                answer = answers[key] = _orig(_dev, *args, **kwargs)
            return answer
    else:
        def use_fallback(t, *args, **kwargs):
            return False
    replaced = []
    for m_name, m in list(sys.modules.items()):
        if m is None or not (m_name == "kernels" or m_name.startswith("kernels.")):
            continue
        for attr, val in list(vars(m).items()):
            if val is orig:
                setattr(m, attr, use_fallback)
                replaced.append(f"{m_name}.{attr}")
    return dict(hook=f"{mod_name}.{name}", mode=mode, replaced=replaced)


# ----------------------------------------------------------------------------- child: cases
class Case:
    def __init__(self, group, variant, shape, fn, api, pair=None):
        self.group, self.variant, self.shape, self.fn, self.api = group, variant, shape, fn, api
        self.pair = pair                # (group, variant) of the baseline it is compared with
        self.samples, self.launches, self.calls = [], 0, 0

    @property
    def name(self):
        return f"{self.group} {self.variant}"


def shape_label(shape):
    return "x".join(str(s) for s in shape)


def make_cases(kernels, reference, shape, dtype, full):
    """The cases of one shape; ``full``: with the SDPA and module rows (first shape only)."""
    import torch
    import torch.nn.functional as F
    b, h, n, d = shape
    label = shape_label(shape)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
               .requires_grad_() for _ in range(3))
    do = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    attention, sdpa, backward = kernels.attention, F.scaled_dot_product_attention, \
        torch.autograd.backward
    no_grad = torch.no_grad

    def clear():
        q.grad = k.grad = v.grad = None

    def ours(p):
        def fwd_nograd():
            with no_grad():
                attention(q, k, v, causal=True, dropout_p=p)

        def fwd_grad():
            attention(q, k, v, causal=True, dropout_p=p)

        def fwd_bwd():
            clear()
            backward(attention(q, k, v, causal=True, dropout_p=p), do)
        return fwd_nograd, fwd_grad, fwd_bwd

    def theirs(p):
        def fwd_nograd():
            with no_grad():
                sdpa(q, k, v, is_causal=True, dropout_p=p)

        def fwd_grad():
            sdpa(q, k, v, is_causal=True, dropout_p=p)

        def fwd_bwd():
            clear()
            backward(sdpa(q, k, v, is_causal=True, dropout_p=p), do)
        return fwd_nograd, fwd_grad, fwd_bwd

    cases = []
    for p in (0.0, DROPOUT):
        tag = "" if p == 0.0 else f"p={p} "
        for variant, f_ours, f_sdpa in zip(("fwd no_grad", "fwd grad", "fwd+bwd"), ours(p),
                                           theirs(p)):
            cases.append(Case("attention", tag + variant, label, f_ours, True,
                              ("sdpa", tag + variant) if full else None))
            if full:
                cases.append(Case("sdpa", tag + variant, label, f_sdpa, False))
    if not full:
        for c in cases:
            c.key = (c.group, c.variant, shape)
        return cases, (q, k, v, do)

    # modules: same constructor arguments for both, same initial weights (creation order)
    emb = h * d
    x = torch.randn(b, n, emb, generator=gen, dtype=torch.float32).to(dtype).requires_grad_()
    dout = torch.randn(b, n, emb, generator=gen, dtype=torch.float32).to(dtype)
    mlabel = f"b{b} n{n} emb{emb} h{h}"
    for group, cls, api in (("FusedMultiHeadAttention", kernels.FusedMultiHeadAttention, True),
                            ("MultiHeadAttention (ref)", reference.MultiHeadAttention, False)):
        torch.manual_seed(0)
        m = cls(emb, emb, n, 0.0, h).to(dtype).train()
        params = [x, *m.parameters()]

        def m_fwd(m=m):
            with no_grad():
                m(x)

        def m_fwd_bwd(m=m, params=params):
            for t in params:
                t.grad = None
            backward(m(x), dout)
        base = "MultiHeadAttention (ref)" if api else None
        cases.append(Case(group, "fwd no_grad", mlabel, m_fwd, api,
                          base and (base, "fwd no_grad")))
        cases.append(Case(group, "fwd+bwd", mlabel, m_fwd_bwd, api, base and (base, "fwd+bwd")))
    for c in cases:
        c.key = (c.group, c.variant, shape)
    return cases, (q, k, v, do)


def compiled_cases(kernels, shape, dtype):
    """fwd no_grad and fwd+bwd of ``torch.compile``d functions calling ours / SDPA (first
    shape): what a call costs a user who compiles the model (without CUDA graphs)."""
    import torch
    import torch.nn.functional as F
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
               .requires_grad_() for _ in range(3))
    do = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    label = shape_label(shape)
    ours = torch.compile(lambda q, k, v: kernels.attention(q, k, v, causal=True))
    theirs = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                          is_causal=True))

    def make(f):
        def fwd_nograd():
            with torch.no_grad():
                f(q, k, v)

        def fwd_bwd():
            q.grad = k.grad = v.grad = None
            torch.autograd.backward(f(q, k, v), do)
        return fwd_nograd, fwd_bwd
    cases = []
    for variant, f_ours, f_sdpa in zip(("compiled fwd no_grad", "compiled fwd+bwd"),
                                       make(ours), make(theirs)):
        cases.append(Case("attention", variant, label, f_ours, True, ("sdpa", variant)))
        cases.append(Case("sdpa", variant, label, f_sdpa, False))
    for c in cases:
        c.key = (c.group, c.variant, shape)
    return cases


SERVING_SHAPE = dict(seqs=2, heads_q=2, heads_kv=1, head_dim=16, page=16, pages_per_seq=2)


def serving_cases(kernels, dtype):
    """A decode step of one layer as vLLM's TRITON_FUSED backend makes it (kernels/vllm/): the
    new keys and values written at their slots, then one paged attention call with the
    engine's bound and output buffer; baseline: SDPA's one-token decode (no_grad) over a dense
    cache of the same length. The metadata tensors are updated in place between calls, as the
    engine's persistent buffers are, and treated as a GPU's (``host_readable`` False: reading
    them would sync), so the steady step's plan-cache hit is what is timed."""
    import torch
    import torch.nn.functional as F
    from kernels import pipeline, validation
    for module in (validation, pipeline):
        if hasattr(module, "host_readable"):
            module.host_readable = lambda t: False
    sh = SERVING_SHAPE
    n, hq, hkv, d, page = sh["seqs"], sh["heads_q"], sh["heads_kv"], sh["head_dim"], sh["page"]
    blocks = n * sh["pages_per_seq"]
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(blocks, page, hkv, 2 * d, generator=gen).to(dtype)
    k_cache, v_cache = cache[..., :d], cache[..., d:]   # vLLM's halves of one layer tensor
    table = torch.arange(blocks, dtype=torch.int32).view(n, -1)
    lens = torch.full((n,), page * sh["pages_per_seq"] // 2, dtype=torch.int32)
    cu_q = torch.arange(n + 1, dtype=torch.int32)
    slots = (table[:, 0].long() * page)   # any slots: the stub's kernels write nothing
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    new_k, new_v = (torch.randn(n, hkv, d, generator=gen).to(dtype) for _ in range(2))
    out = torch.empty(n, hq, d, dtype=dtype)
    k_len = int(lens[0])
    q4 = torch.randn(n, hq, 1, d, generator=gen).to(dtype)
    k4, v4 = (torch.randn(n, hq, k_len, d, generator=gen).to(dtype) for _ in range(2))

    def step():
        lens.add_(0)   # in place, as the engine's buffers: a new version each step
        cu_q.add_(0)
        kernels.write_kv_cache(k_cache, v_cache, new_k, new_v, slots)
        kernels.attention_varlen(q, k_cache, v_cache, cu_q, None, max_seqlen_q=1,
                                 block_table=table, seqused_k=lens, out=out)

    def sdpa_decode():
        with torch.no_grad():
            F.scaled_dot_product_attention(q4, k4, v4)

    label = f"{n} seqs x {k_len} keys, {hq}/{hkv} heads, d{d}, page {page}"
    cases = [Case("serving", "paged decode step", label, step, True, ("sdpa", "decode")),
             Case("sdpa", "decode", label, sdpa_decode, False)]
    for c in cases:
        c.key = (c.group, c.variant, label)
    return cases


def bare_launch_case():
    import torch
    import triton

    @triton.jit
    def _host_overhead_noop(X):
        pass

    x = torch.empty(16, dtype=torch.float32)

    def launch():
        _host_overhead_noop[(1,)](x)
    c = Case("triton bare launch", "(no-op, 1 pointer)", "-", launch, False)
    c.key = (c.group, c.variant, None)
    c.must_launch = True
    return c


# ----------------------------------------------------------------------------- child: running
def run_checked(stub, c, calls, hook):
    """Call a case ``calls`` times; an API case must reach the stub launcher every call."""
    for _ in range(calls):
        before = stub.launches()
        c.fn()
        if (c.api or getattr(c, "must_launch", False)) and stub.launches() == before:
            raise Fail(f"'{c.name}' ({c.shape}) reached no kernel launch: the PyTorch fallback "
                       f"(or another non-Triton path) ran, so its time would be void. "
                       f"{hook['hook']} was replaced ({', '.join(hook['replaced'])}), yet CPU "
                       f"tensors still took the fallback: the decision moved elsewhere. Update "
                       f"FALLBACK_HOOK in {os.path.abspath(__file__)} or pass --fallback-hook "
                       f"MODULE:NAME naming the function the op bodies now call.")


def seed_probe(stub, kernels, tensors, seeds):
    """Dropout fwd+bwd with seed=None ``seeds`` times: compiled variants launched per kernel."""
    import torch
    q, k, v, do = tensors
    before = stub.handle_counts()
    compiled_before = len(stub.variants)
    torch.manual_seed(0)
    for _ in range(seeds):
        q.grad = k.grad = v.grad = None
        torch.autograd.backward(kernels.attention(q, k, v, causal=True, dropout_p=DROPOUT), do)
    after = stub.handle_counts()
    per_kernel = {}
    for h in range(1, len(stub.variants)):
        got = after[h] - (before[h] if h < len(before) else 0)
        if got > 0:
            per_kernel.setdefault(stub.variants[h]["kernel"], []).append(h)
    variants = {name: len(hs) for name, hs in per_kernel.items()}
    return dict(seeds=seeds, variants_per_kernel=variants,
                recompiles=sum(n - 1 for n in variants.values()),
                specialised_on={name: specialised_on([stub.srcs[h] for h in hs])
                                for name, hs in per_kernel.items() if len(hs) > 1},
                new_compiles=len(stub.variants) - compiled_before)


def specialised_on(srcs):
    """The kernel arguments whose specialisation (divisibility / constexpr / type) differs
    between these variants of one kernel, e.g. ``drop[0]`` = field 0 of the argument ``drop``."""
    names = srcs[0].fn.arg_names
    out = set()
    for field in ("attrs", "constants", "signature"):
        dicts = [getattr(src, field, None) or {} for src in srcs]
        for path in set().union(*dicts):
            if len({repr(d.get(path)) for d in dicts}) > 1:
                if isinstance(path, str):
                    out.add(path)
                elif isinstance(path, tuple) and path and isinstance(path[0], int):
                    out.add(names[path[0]] + "".join(f"[{i}]" for i in path[1:]))
                else:
                    out.add(repr(path))
    return sorted(out)


def time_all(stub, cases, inner, deadline, max_rounds):
    gc.collect()
    n, rounds = len(cases), 0
    clock = time.perf_counter_ns
    while rounds < max_rounds:
        t_round = time.time()
        for j in range(n):
            c = cases[(j + rounds) % n]
            f = c.fn
            l0 = stub.launches()
            t0 = clock()
            for _ in range(inner):
                f()
            t1 = clock()
            dl = stub.launches() - l0
            if (c.api or getattr(c, "must_launch", False)) and dl < inner:
                raise Fail(f"a timed batch of '{c.name}' ({c.shape}) made {dl} launches in "
                           f"{inner} calls: a call took the PyTorch fallback (or another "
                           f"non-Triton path); the measurement is void")
            c.samples.append((t1 - t0) / inner / 1e3)
            c.launches += dl
            c.calls += inner
        rounds += 1
        now = time.time()
        if rounds >= MIN_ROUNDS and now + (now - t_round) > deadline:
            break
    return rounds


def stats(c):
    s = sorted(c.samples)
    q = statistics.quantiles(s, n=10, method="inclusive") if len(s) > 1 else [s[0]] * 9
    return dict(min_us=round(s[0], 2), p20_us=round(q[1], 2),
                median_us=round(statistics.median(s), 2),
                p80_us=round(q[7], 2), batches=len(s), calls=c.calls,
                launches_per_call=round(c.launches / c.calls, 2) if c.calls else None)


def fmt_us(x):
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def fmt_ratio(r):
    return f"{r:.2f}x" if r < 3 else f"{r:.1f}x"


def git_rev(project):
    try:
        r = subprocess.run(["git", "-C", project, "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, timeout=10)
        rev = r.stdout.strip()
        if rev:
            dirty = subprocess.run(["git", "-C", project, "status", "--porcelain",
                                    "--untracked-files=no"], capture_output=True, text=True,
                                   timeout=10).stdout.strip()
            return rev + ("+dirty" if dirty else "")
    except Exception:
        pass
    return None


def profile_cases(cases, calls=2000):
    """--profile: each case's calls under cProfile, functions by own time (the profiler's own
    cost inflates every number; read the shares, not the microseconds)."""
    import cProfile
    import pstats
    if not cases:
        raise Fail("--profile: no case matches")
    for c in cases:
        best = float("inf")   # the fastest of 50 batches of 100 calls, without the profiler
        for _ in range(50):
            t0 = time.perf_counter()
            for _ in range(100):
                c.fn()
            best = min(best, (time.perf_counter() - t0) * 1e4)
        print(f"==== {c.name} {c.shape}: {best:.1f} us per call (fastest of 50 batches of 100 "
              f"calls, no profiler)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            c.fn()
        prof.disable()
        print(f"==== {c.name} {c.shape}: {calls} calls under cProfile")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(30)
    return 0


def child(argv):
    info = json.loads(os.environ[CHILD_ENV])
    start, a = info["start"], parse_args(argv)
    deadline = start + a.budget
    cache_dir = os.path.abspath(os.path.expanduser(a.cache_dir))
    project = os.path.abspath(a.project)
    log = lambda msg: print(f"host_overhead: {msg}", file=sys.stderr, flush=True)  # noqa: E731

    import triton
    if not triton.__version__.startswith("3.6."):
        raise Fail(f"needs triton 3.6 (the H100 host's), {sys.executable} has triton "
                   f"{triton.__version__}; set $SM90_VENV to a venv with triton==3.6.0")
    import torch
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)      # garbage outputs of the stubbed kernels stay cheap
    stub = Stub(info["stub"], cache_dir)

    for pkg in ("kernels", "reference"):
        if not os.path.isdir(os.path.join(project, pkg)):
            raise Fail(f"{project} is not a project checkout (no {pkg}/); pass --project")
    sys.path.insert(0, project)
    import kernels
    import reference
    if not os.path.abspath(kernels.__file__).startswith(os.path.join(project, "kernels")):
        raise Fail(f"'import kernels' found {kernels.__file__}, not {project}/kernels (the "
                   f"unrelated PyPI 'kernels' package?)")
    hook = install_fallback_hook(kernels, a.fallback_hook)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]

    t0 = time.time()
    cases, probe_tensors = [], None
    for i, shape in enumerate(a.shape_list):
        cs, tensors = make_cases(kernels, reference, shape, dtype, full=i == 0)
        cases += cs
        probe_tensors = probe_tensors or tensors
    if a.compiled:
        cases += compiled_cases(kernels, a.shape_list[0], dtype)
    if a.serving:
        cases += serving_cases(kernels, dtype)
    bare = bare_launch_case()
    cases.append(bare)
    log(f"{len(cases)} cases; warming up (compiles, C launchers; the first run builds them)")
    for c in cases:
        run_checked(stub, c, WARMUP, hook)
    log(f"warm-up {time.time() - t0:.1f} s; seed probe ({a.seeds} dropout fwd+bwd, seed=None)")
    t1 = time.time()
    probe = seed_probe(stub, kernels, probe_tensors, a.seeds)
    for c in cases:                     # variants the probe compiled are warm too now
        run_checked(stub, c, 1, hook)
    if a.profile:
        return profile_cases([c for c in cases if a.profile in c.name
                              and (c.shape == cases[0].shape or c.group == "serving")])
    log(f"seed probe {time.time() - t1:.1f} s; timing until the budget ({a.budget:.0f} s) ends")
    compiled_before = len(stub.variants)
    rounds = time_all(stub, cases, a.inner, deadline, a.rounds)
    compiles_timed = len(stub.variants) - compiled_before
    stub.save()
    runtime = time.time() - start

    res = {c.key: stats(c) for c in cases}
    for c in cases:
        if c.pair:
            base = res[c.pair + (c.key[2],)]
            res[c.key]["x_baseline_p20"] = round(res[c.key]["p20_us"] / base["p20_us"], 3)

    # ---- table
    rev = git_rev(project)
    env_knobs = {k: v for k, v in os.environ.items() if k.startswith("KERNELS_")}
    print(f"host overhead per call, GPU path with a stub driver/libcuda (target sm_{TARGET_CC}); "
          f"project {project}" + (f" @ {rev}" if rev else ""))
    print(f"torch {torch.__version__} (1 thread), triton {triton.__version__}, python "
          f"{sys.version.split()[0]}, dtype {a.dtype}, causal; {rounds} rounds x {a.inner} calls "
          f"per case; fallback hook {hook['hook']} -> {hook['mode']}"
          + (f"; env {env_knobs}" if env_knobs else ""))
    head = f"{'case':44s} {'shape':20s} {'min':>8s} {'p20':>8s} {'median':>8s} {'launches':>8s} " \
           f"{'x base':>7s}"
    print(head)
    print("-" * len(head))
    for c in cases:
        r = res[c.key]
        ratio = f"{r['x_baseline_p20']:.2f}" if "x_baseline_p20" in r else ""
        lpc = r["launches_per_call"]
        lpc = f"{lpc:.0f}" if abs(lpc - round(lpc)) < 0.005 else f"{lpc:.2f}"
        print(f"{c.name:44s} {c.shape:20s} {r['min_us']:8.1f} {r['p20_us']:8.1f} "
              f"{r['median_us']:8.1f} {lpc:>8s} {ratio:>7s}")
    print(f"(us per call; 'x base' = p20 / the p20 of sdpa's same call, or of the reference "
          f"module; launches = stub cuLaunchKernelEx per call, {stub.launches()} in this run; "
          f"baselines and modules at the first shape only, where their CPU math is small)")
    vk = ", ".join(f"{k} {n}" + (f" (differ in {', '.join(probe['specialised_on'][k])})"
                                  if k in probe["specialised_on"] else "")
                   for k, n in sorted(probe["variants_per_kernel"].items()))
    print(f"seed probe: {probe['seeds']} dropout fwd+bwd calls with seed=None launched "
          f"{vk or 'nothing'} compiled variant(s) per kernel (more than 1 = a per-call int is "
          f"specialised: a recompile on a GPU)")
    notes = []
    if compiles_timed:
        notes.append(f"{compiles_timed} kernel variant(s) compiled inside the timed rounds "
                     f"(new seed specialisations): their batches are outliers; min/p20 are not "
                     f"affected much")
    if stub.ttir_failures:
        notes.append("TTIR front end failed (global scratch assumed 0) for: "
                     + "; ".join(stub.ttir_failures[:5]))
    if rounds < 20:
        notes.append(f"only {rounds} rounds: raise --budget for steadier percentiles")
    for note in notes:
        print(f"note: {note}")

    first = a.shape_list[0]

    def p20(group, variant, shape=first):
        return res[(group, variant, shape)]["p20_us"]
    pairs = [("fwd", "fwd no_grad", "attention", "sdpa", "SDPA"),
             ("fwd+bwd", "fwd+bwd", "attention", "sdpa", "SDPA"),
             ("dropout fwd+bwd", f"p={DROPOUT} fwd+bwd", "attention", "sdpa", "SDPA"),
             ("module fwd+bwd", "fwd+bwd", "FusedMultiHeadAttention", "MultiHeadAttention (ref)",
              "reference")]
    parts, summary = [], {}
    for label, variant, ours, base, base_label in pairs:
        o, b_ = p20(ours, variant), p20(base, variant)
        parts.append(f"{label} {fmt_us(o)} us ({base_label} {fmt_us(b_)}, {fmt_ratio(o / b_)})")
        summary[label] = dict(ours_p20_us=o, baseline_p20_us=b_, ratio=round(o / b_, 3))
    if a.compiled:
        for label, variant in (("compiled fwd", "compiled fwd no_grad"),
                               ("compiled fwd+bwd", "compiled fwd+bwd")):
            o, b_ = p20("attention", variant), p20("sdpa", variant)
            parts.append(f"{label} {fmt_us(o)} us (SDPA {fmt_us(b_)}, {fmt_ratio(o / b_)})")
            summary[label] = dict(ours_p20_us=o, baseline_p20_us=b_, ratio=round(o / b_, 3))
    if a.serving:
        step = next(c for c in cases if c.group == "serving")
        o, b_ = res[step.key]["p20_us"], res[step.pair + (step.key[2],)]["p20_us"]
        parts.append(f"paged decode step {fmt_us(o)} us (SDPA decode {fmt_us(b_)}, "
                     f"{fmt_ratio(o / b_)})")
        summary["paged decode step"] = dict(ours_p20_us=o, baseline_p20_us=b_,
                                            ratio=round(o / b_, 3))
    floor = res[bare.key]["p20_us"]
    parts.append(f"launch floor {fmt_us(floor)} us")
    parts.append(f"recompiles per {probe['seeds']} seeds: {probe['recompiles']}")
    summary.update(launch_floor_p20_us=floor, recompiles=probe["recompiles"])
    if a.json:
        out = dict(
            tool="host_overhead", project=project, git=rev, stub_launches=stub.launches(),
            versions=dict(torch=torch.__version__, triton=triton.__version__,
                          python=sys.version.split()[0]),
            settings=dict(shapes=[list(s) for s in a.shape_list], dtype=a.dtype, inner=a.inner,
                          rounds=rounds, budget_s=a.budget, seeds=a.seeds, target=f"sm_{TARGET_CC}",
                          threads=1, env=env_knobs),
            fallback_hook=hook, summary=summary, seed_probe=probe,
            cases=[dict(group=c.group, variant=c.variant, shape=c.shape,
                        baseline=(f"{c.pair[0]} {c.pair[1]}" if c.pair else None), **res[c.key])
                   for c in cases],
            variants=stub.variants[1:], notes=notes, runtime_s=round(runtime, 1))
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"runtime {time.time() - start:.0f} s (warm-up {t1 - t0:.0f} s)", file=sys.stderr)
    print("host-overhead: " + ", ".join(parts), flush=True)
    return 0


# Element types of TMA descriptors as a compiled kernel's metadata gives them (the launcher maps
# them to the driver's); any value the launcher's table holds does for the stub's encode.
_TMA_ELEM = {"fp16": 6, "bf16": 9, "fp32": 7, "fp8e4nv": 0, "fp8e5": 0}


def _tensordesc_meta(signature):
    """What a compiled kernel's ``tensordesc_meta`` holds for its host-descriptor parameters
    (one dict each, in parameter order), or None without any: so that Triton's launcher
    encodes each descriptor with ``cuTensorMapEncodeTiled`` (the stub's) as on sm_90, instead
    of the decomposed form of a kernel not lowered to TMA."""
    metas = []
    for ty in signature.values():
        m = re.match(r"tensordesc<([^[>]*)\[([^]]*)\]", ty) if isinstance(ty, str) else None
        if m:
            dtype, block = m.group(1), [int(x) for x in m.group(2).split(",")]
            size = 1 if dtype.startswith("fp8") else 4 if dtype == "fp32" else 2
            metas.append(dict(swizzle=3, elem_size=size, elem_type=_TMA_ELEM.get(dtype, 0),
                              block_size=block[:-1] + [min(block[-1], 128 // size)],
                              fp4_padded=False))
    return metas or None


def main(argv):
    if CHILD_ENV not in os.environ:
        return parent(argv)
    try:
        return child(argv)
    except Fail as e:
        print(f"host-overhead: not measured: {e}", flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        traceback.print_exc()
        print(f"host-overhead: not measured: {type(e).__name__}: {e}", flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
