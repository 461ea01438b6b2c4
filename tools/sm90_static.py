#!/usr/bin/env python3
"""Static indicators of the project's Triton attention kernels per NVIDIA GPU generation (default
sm_90, H100), without a GPU.

Every kernel is compiled by Triton for target ``cuda:<cc>`` (PTX, then the bundled ptxas -- or
``ptxas-blackwell`` for sm_100/sm_120, which Triton picks itself -- to a cubin) on this CPU-only
machine; nothing is launched. ``--arch`` picks the compute capabilities (default ``90``): 75 (T4,
Colab's free GPU), 80 (A100), 86 (A10, RTX 3090), 89 (L4, RTX 4090), 90 (H100), 100 (B200),
120 (RTX 5090); several run in parallel processes, one per arch (``--jobs``). Per compiled kernel it
reports registers, ptxas spill bytes, Triton's shared memory against that GPU's per-block limit,
and from PTX/SASS which tensor-core instruction the dots became (``mma`` column: Hopper
``wgmma.mma_async`` on 90, Blackwell ``tcgen05.mma`` on 100, Ampere-style ``mma.sync`` elsewhere,
``fma`` when a dot got no tensor-core instruction at all), whether loads use TMA
(``cp.async.bulk.tensor``) or ``cp.async``, and whether there is local memory (LDL/STL).

The launchers' contract this tool relies on (new launcher arguments need defaults):
``attention_forward(q, k, v, causal=, softmax_scale=, dropout_p=, seed=)`` and
``attention_backward(do, q, k, v, o, lse, causal=, softmax_scale=, dropout_p=, seed=)`` with
(batch, heads, seq, head_dim) CPU tensors.

How the kernels are reached: the real launchers are called (project: ``kernels.core.forward.
attention_forward`` / ``kernels.core.backward.attention_backward``; the Triton tutorial, when
``--tutorial PATH`` gives its file: its ``_attention.forward``) with CPU tensors while
``Autotuner.run`` and ``JITFunction.run`` are patched to compile (``warmup=True``) every config
instead of timing/launching it. So the arguments, constexprs and divisibility specialisation are
exactly what a launch on that GPU would produce, and each config's status says whether the
project's ``early_config_prune`` keeps it.
A stand-in driver answers ``get_current_target()`` with GPUTarget("cuda", cc, 32) and
``torch.cuda.get_device_capability()`` is patched to (cc // 10, cc % 10) (the tutorial asks it at
import; a project prune hook that asks it sees the chosen GPU).

What a GPU does with a config over its shared memory: Triton raises OutOfResources when loading
the kernel (metadata.shared > the device's opt-in maximum per block). The autotuner times such a
config as inf and skips it, so an autotuned launch still works while one kept config fits; a launch
with a fixed config (the project's KERNELS_AUTOTUNE=0: the first kept config) fails.
sm_75 (T4): Triton 3.x has no tensor-core path below sm_80 (AccelerateMatmul: "Dot op using MMA
for compute capability 75 has been deprecated. It falls back to the FMA path."), so every dot,
fp16 and bf16 alike, compiles to FMA, without error; no software pipelining either (cp.async).

Usage, from the repository's root (a venv with triton==3.6.0 -- the H100 host's version -- and a
CPU torch, made once by ``python3 -m venv VENV && VENV/bin/pip install triton==3.6.0 torch numpy``):
    VENV/bin/python tools/sm90_static.py --project . --kept-only \
        [--tutorial /path/to/06-fused-attention.py] [--json out.json] [--seq 4096]
    # every GPU generation at once (7 processes, --jobs at a time; the table has an arch column):
    VENV/bin/python tools/sm90_static.py --project . --kept-only \
        --arch 75,80,86,89,90,100,120 --json all.json
    # FP8 forward variants (fp8: q, k, v e4m3; fp8kv: an e4m3 KV cache read by bf16 q):
    VENV/bin/python tools/sm90_static.py --project . --kept-only --dtypes fp8,fp8kv \
        --fwd-flags "causal;plain" --bwd-flags "" --arch 89,90,100,120
    # DeepSeek MLA's absorbed decode (head dim 576 = 512 + 64, V = K's first 512 columns, one
    # latent head; --mla all: the launches of MLA_ALL below), bf16 / fp16 q, and an e4m3 cache:
    VENV/bin/python tools/sm90_static.py --project . --kept-only --mla all \
        --dtypes bf16,fp16,fp8kv --fwd-flags "" --bwd-flags "" --arch 80,86,89,90,100,120
    # one consumer GPU, fp16 only:
    VENV/bin/python tools/sm90_static.py --project . --kept-only \
        --arch 86 --dtypes fp16 --bwd-dtypes fp16
MLA launches (``--mla``, ';'-separated, each ``paged`` or ``dense`` with ``+hN`` query heads
(default 16; DeepSeek has 128 per GPU without tensor parallelism), ``+qN`` query tokens per
sequence (default 1; 4: speculative decoding) and ``+sN`` KV splits (default 1)): what the
serving path launches, ``kernels.core.kvcache.varlen_paged_forward(q, k_cache, k_cache[...,
:512], call, ...)`` for ``paged`` (q (4 x qN, hN, 576), k_cache (pages, 64, 1, 576), 4
sequences of ``--seq`` - 7 keys) and ``kvcache_forward`` on a dense (4, 1, ``--seq``, 576)
cache for ``dense``; causal, softmax_scale 1/sqrt(192), over ``--dtypes`` bf16 / fp16 (q and
cache) and fp8kv (bf16 q, e4m3 cache, k / v descales in ``call.mods.descale``); other dtypes
are skipped, as is fp8kv below sm_89. Rows: head_dim 576, flags ``mla <launch>``.
The Triton tutorial (python/tutorials/06-fused-attention.py of Triton 3.6) is not part of this
repository: without ``--tutorial`` its rows are "not given".
The table goes to stdout, progress and compile diagnostics to stderr. Compiled kernels are cached
(default ~/.cache/sm90-triton-cache; the target is part of Triton's cache key, so archs share one
cache dir), so a re-run only recompiles what changed. The tutorial kernel of the 3.6 tree is
fp16-only: its bf16 launch fails to compile (reported as such).

Columns: arch = compute capability; regs = registers/thread; spill = ptxas spill store/load
bytes; smem = Triton dynamic shared memory per block (limit per arch in ARCHS below, e.g. H100
227 KiB = 232448 B; above it the launch fails); blk/SM = resident blocks per SM by regs, warps and
smem (estimate); mma = tensor-core instruction kind; wgmma / mma.sync / tcgen05 = PTX instruction
counts; tma / cp.async = PTX bulk-tensor / async-copy counts; LDL/STL = SASS local-memory
instructions; notes: C7515 = ptxas "wgmma serialized" warning (sm_90), ws = warp-specialised,
tmem = Blackwell tensor-memory columns.
Status: ok / pruned-ok (config dropped by the launch's early_config_prune, compiled anyway) /
FAIL (compile error, first error line in notes) / ">smem" appended when the block needs more
shared memory than that GPU gives one block (">tmem": more than 512 tensor-memory columns).
After the table: one summary line per launch, then one per GPU over the kept configs (variants,
failures, >smem, C7515, default = first kept config spilling or not loadable, launches with no
loadable config, mma kinds). JSON rows carry ``arch`` (int cc), ``mma_kind`` ("wgmma",
"mma.sync", "tcgen05", "fma" or "" for a kernel without dot), ``smem_limit``, ``tcgen05``,
``tmem`` and ``tmem_over_limit`` besides the sm_90-era fields.
"""
import argparse
import contextlib
import importlib.util
import io
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import warnings
from collections import namedtuple

sys.dont_write_bytecode = True          # never write __pycache__ into the project checkout
warnings.filterwarnings("ignore")

# Per-GPU limits. Source: CUDA C++ Programming Guide, "Compute Capabilities" (section 5.1.3,
# https://docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html):
# Table 30 (max resident blocks / warps per SM) and Table 31 (32-bit registers per SM, max shared
# memory per SM and per thread block, KB = 1024 B). The per-block figure is the opt-in maximum
# (cudaDevAttrMaxSharedMemoryPerBlockOptin), which is what Triton compares metadata.shared with
# at load time (triton/compiler/compiler.py, OutOfResources). Per SM minus per block is the
# shared memory reserved per resident block ("reserved for system use", same guide): 1 KB from
# cc 8.0 on, 0 on 7.5. The occupancy estimate (blk/SM) uses the per-SM figures.
KB = 1024
Arch = namedtuple("Arch", "cc gpus smem_block smem_sm regs_sm warps_sm blocks_sm reserved")
ARCHS = {a.cc: a for a in (
    Arch(75, "T4, RTX 20xx", 64 * KB, 64 * KB, 65536, 32, 16, 0),
    Arch(80, "A100", 163 * KB, 164 * KB, 65536, 64, 32, KB),
    Arch(86, "A10, RTX 3090", 99 * KB, 100 * KB, 65536, 48, 16, KB),
    Arch(89, "L4, RTX 4090", 99 * KB, 100 * KB, 65536, 48, 24, KB),
    Arch(90, "H100", 227 * KB, 228 * KB, 65536, 64, 32, KB),
    Arch(100, "B200", 227 * KB, 228 * KB, 65536, 64, 32, KB),
    Arch(120, "RTX 5090", 99 * KB, 100 * KB, 65536, 48, 24, KB),
)}
ARCH = ARCHS[90]                        # the arch this process compiles for (setup_triton sets it)
TMEM_COLUMNS = 512                      # Blackwell tensor memory per SM (Triton's launch check)


def _default_cache_dir():
    return os.path.join(os.path.expanduser("~"), ".cache", "sm90-triton-cache")


# ----------------------------------------------------------------------------- setup
def setup_triton(cache_dir, cc=90):
    """Point Triton at its own cache, install the stand-in driver for compute capability ``cc``
    and the ptxas-log hook. One arch per process: Triton keeps its compiled kernels per device
    (JITFunction.device_caches), with the target read once, so archs do not mix in a process."""
    global ARCH
    ARCH = ARCHS[cc]
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ.pop("TRITON_INTERPRET", None)
    from triton import knobs

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/stub_driver.py
    import stub_driver
    target = stub_driver.install(cc)

    def hook(backend, stages, options, language, capability):
        orig = stages["cubin"]

        def cubin(src, metadata):
            buf = io.StringIO()
            old = knobs.nvidia.dump_ptxas_log
            knobs.nvidia.dump_ptxas_log = True
            try:
                with contextlib.redirect_stdout(buf):
                    out = orig(src, metadata)
            finally:
                knobs.nvidia.dump_ptxas_log = old
            metadata["ptxas_log"] = buf.getvalue()   # stored in the cached metadata json
            return out

        stages["cubin"] = cubin

    knobs.runtime.add_stages_inspection_hook = hook
    return target


def _sm_name(cc):
    """ptxas's --gpu-name for ``cc``, as Triton gives it ("a" features from sm_90 on)."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    return sm_arch_from_capability(cc)


# ----------------------------------------------------------------------------- analysis
def _ptxas_log(kernel):
    log = getattr(kernel.metadata, "ptxas_log", None)
    if log:
        return log
    # Cache entry made without our hook: run the bundled ptxas -v on the PTX again (Triton's
    # choice of binary: ptxas-blackwell from sm_100 on).
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([get_ptxas(ARCH.cc).path, "-v", f"--gpu-name={_sm_name(ARCH.cc)}",
                            src, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
        return r.stderr + r.stdout


def _blocks_per_sm(regs, warps, smem):
    threads_regs = ((regs * 32 + 255) // 256) * 256          # per-warp allocation granularity
    by_regs = (ARCH.regs_sm // threads_regs) // warps if threads_regs else 99
    by_warps = ARCH.warps_sm // warps
    by_smem = ARCH.smem_sm // (smem + ARCH.reserved) if smem else 99
    return max(0, min(by_regs, by_warps, by_smem, ARCH.blocks_sm))


def _mma_kind(r, ttgir):
    """Tensor-core instruction(s) the dots became; "fma" when a dot got none, "" with no dot."""
    kinds = [k for k in ("tcgen05", "wgmma", "mma_sync") if r[k]]
    if kinds:
        return "+".join(k.replace("_", ".") for k in kinds)
    return "fma" if re.search(r"\btt\.dot\b", ttgir) else ""


def analyze(kernel):
    ptx = kernel.asm["ptx"]
    sass = kernel.asm["sass"]
    log = _ptxas_log(kernel)
    md = kernel.metadata
    m = re.search(r"Used (\d+) registers", log)
    regs = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                  log)
    stack, sst, sld = (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else (None,) * 3
    warps = md.num_warps
    ttgir = kernel.asm.get("ttgir", "")
    r = dict(
        regs=regs, stack=stack, spill_st=sst, spill_ld=sld,
        smem=md.shared, warps_total=warps,
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
        tcgen05=len(re.findall(r"\btcgen05\.mma\b", ptx)),
        tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        cp_async=len(re.findall(r"cp\.async\.c[ag]\.shared", ptx)),
        ptx_local=len(re.findall(r"\b(?:ld|st)\.local", ptx)),
        sass_ldl=len(re.findall(r"\bLDL(?:\.\w+)*\s", sass)),
        sass_stl=len(re.findall(r"\bSTL(?:\.\w+)*\s", sass)),
        hgmma=len(re.findall(r"\bHGMMA", sass)),
        hmma=len(re.findall(r"\bHMMA", sass)),
        # FP8 tensor-core ops: PTX wgmma / mma.sync with e4m3 operands (SASS QGMMA on
        # Hopper, QMMA on Ada / Blackwell consumer parts).
        fp8_mma=len(re.findall(r"(?:wgmma\.mma_async|\bmma\.sync|\btcgen05\.mma)\S*e4m3", ptx))
        + len(re.findall(r"\btcgen05\.mma\.cta_group::\d\.kind::f8f6f4", ptx)),
        sass_fp8=len(re.findall(r"\bQ(?:G)?MMA", sass)),
        c7515="C7515" in log,
        warp_specialized=("ttg.warp_specialize" in ttgir) or ("nvws." in ttgir),
        global_scratch=getattr(md, "global_scratch_size", 0) or 0,
        tmem=getattr(md, "tmem_size", 0) or 0,
        ptxas_warnings=[ln.strip() for ln in log.splitlines() if "warning" in ln.lower()
                        or "C7515" in ln or "Performance" in ln],
    )
    r["mma_kind"] = _mma_kind(r, ttgir)
    r["blocks_per_sm"] = _blocks_per_sm(regs or 0, warps, md.shared) if regs else None
    r["smem_limit"] = ARCH.smem_block
    r["smem_over_limit"] = md.shared > ARCH.smem_block
    r["tmem_over_limit"] = r["tmem"] > TMEM_COLUMNS
    return r


# ----------------------------------------------------------------------------- capture
RECORDS = []
LABEL = {}


def _describe(e, diag=""):
    """One line for a compile failure: the innermost cause (CompilationError only carries the
    source location), the failing MLIR pass from the captured stderr, or the ptxas error."""
    outer = type(e).__name__
    while e.__cause__ is not None:
        e = e.__cause__
    name = type(e).__name__ if type(e).__name__ == outer else f"{outer}/{type(e).__name__}"
    src = getattr(e, "src", None)
    node = getattr(e, "node", None)
    if src is not None and hasattr(node, "lineno"):     # a CompilationError: show the line
        line = src.split("\n")[node.lineno - 1].strip()
        return f"{name}: {getattr(e, 'error_message', None) or line}"[:220]
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    # The first "error :" line (ptxas: "ptxas k.ptx, line N; error   : ...", MLIR "error: ...")
    # before "`ptxas` failed with error code 255" and the like.
    pick = next((ln for ln in lines if re.search(r"\berror\s*:", ln)), None)
    pick = pick or next((ln for ln in lines
                         if "ptxas" in ln.lower() and "error" in ln.lower()), None)
    pick = pick or next((ln for ln in lines if "error" in ln.lower()), None)
    pick = re.sub(r"\S*/tmp\w*\.ptx", "k.ptx", pick or (lines[-1] if lines else ""))
    m = re.search(r"^.*\berror\s*:.*$", diag, re.M)
    if m and m.group(0).strip() not in pick:
        pick += f" -- {m.group(0).strip()[:120]}"
    m = re.search(r"Pipeline failed while executing \[`(\w+)`", diag)
    if m:
        pick += f" (MLIR pass {m.group(1)})"
    m = re.search(r"Assertion `[^']*' failed", diag)
    if m:
        pick += f" [{m.group(0)[:90]}]"
    return f"{name}: {pick}"[:220]


@contextlib.contextmanager
def _capture_fd2():
    """Collect what C++ (MLIR diagnostics, IR dumps of failing pipelines) writes to fd 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        box = {"text": ""}
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box["text"] = tmp.read().decode("utf-8", "replace")


def _cfg_of(kwargs):
    return dict(BLOCK_M=kwargs.get("BLOCK_M", kwargs.get("BLOCK_SIZE")),
                BLOCK_N=kwargs.get("BLOCK_N"),
                warps=kwargs.get("num_warps", 4), stages=kwargs.get("num_stages", 3))


@contextlib.contextmanager
def compile_instead_of_launch(all_configs=True):
    """Patch Autotuner.run / JITFunction.run: compile each (pruned) config, launch nothing."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    orig_jit_run = JITFunction.run
    orig_at_run = Autotuner.run
    state = {"pruned": None}

    def jit_run(self, *args, grid, warmup, **kwargs):
        rec = dict(arch=ARCH.cc, **LABEL, kernel=self.__name__, **_cfg_of(kwargs))
        rec["kept"] = state["pruned"] if state["pruned"] is not None else True
        t = time.time()
        kernel = None
        err = None
        with _capture_fd2() as diag:
            try:
                kernel = orig_jit_run(self, *args, grid=grid, warmup=True, **kwargs)
            except Exception as e:     # compile-time failure of this config: record it
                err = e
        if err is None:
            rec.update(analyze(kernel), status="ok")
        else:
            rec.update(status="FAIL", error=_describe(err, diag["text"]))
        rec["compile_s"] = round(time.time() - t, 1)
        RECORDS.append(rec)
        print(f"  {_one_line(rec)}", file=sys.stderr, flush=True)
        return kernel

    def at_run(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        kept = self.prune_configs(kwargs)
        todo = list(self.configs) if all_configs else list(kept)
        for extra in kept:                  # prune may synthesise a config (project fallback)
            if extra not in todo:
                todo.append(extra)
        for config in todo:
            full = {**self.nargs, **kwargs, **config.all_kwargs()}
            if config.pre_hook is not None:
                config.pre_hook(full)       # e.g. the tutorial sets TMA block shapes here
            state["pruned"] = config in kept
            try:
                self.fn.run(*args, **kwargs, **config.all_kwargs())
            finally:
                state["pruned"] = None
        self.nargs = None

    JITFunction.run = jit_run
    Autotuner.run = at_run
    try:
        yield
    finally:
        JITFunction.run = orig_jit_run
        Autotuner.run = orig_at_run


def _one_line(r):
    head = f"sm_{r['arch']} {r['kernel']} {r.get('dtype')} d{r.get('head_dim')} {r.get('flags')} " \
           f"{r['BLOCK_M']}x{r['BLOCK_N']} w{r['warps']} s{r['stages']}"
    if r["status"] != "ok":
        return f"{head}: {r['error']}"
    return f"{head}: regs {r['regs']} spill {r['spill_st']}/{r['spill_ld']} smem {r['smem']} " \
           f"{r['mma_kind'] or 'no dot'} (wgmma {r['wgmma']} mma.sync {r['mma_sync']} " \
           f"tcgen05 {r['tcgen05']}) tma {r['tma']} ({r['compile_s']}s)"


# ----------------------------------------------------------------------------- MLA
MLA_D, MLA_DV, MLA_PAGE, MLA_SEQS = 576, 512, 64, 4
MLA_SCALE = 192 ** -0.5          # DeepSeek's (128 nope + 64 rope) ** -0.5, not 576 ** -0.5
# ``--mla all``: paged decode at 16 and 128 query heads, 1 and 4 tokens, 1 and 4 splits; dense.
MLA_ALL = ("paged;paged+s4;paged+q4;paged+q4+s4;paged+h128;paged+h128+s4;paged+h128+q4;"
           "paged+h128+q4+s4;dense;dense+s4;dense+h128+s4")


def mla_launches(spec):
    """The ';'-separated MLA launches of ``--mla`` (``all``: MLA_ALL)."""
    spec = MLA_ALL if spec.strip() == "all" else spec
    out = [x.strip() for x in spec.split(";") if x.strip()]
    for x in out:
        kind, *opts = x.split("+")
        if kind not in ("paged", "dense") or any(not re.fullmatch(r"[hqs]\d+", o) for o in opts):
            raise SystemExit(f"sm90_static: --mla {x!r}: paged or dense, then +hN, +qN, +sN")
    return out


def mla_launch(flags, dtype, seq):
    """A callable making the MLA decode launch ``flags`` (``mla_launches``) with ``dtype``
    (bf16, fp16 or fp8kv: bf16 q over an e4m3 cache) and ``seq`` cache positions per sequence,
    on CPU tensors; None for another dtype (and for fp8kv below sm_89)."""
    import torch
    from kernels.core.call import AttentionCall
    from kernels.core.kvcache import kvcache_forward, varlen_paged_forward
    from kernels.core.mods import CallMods, Descale
    kind, *opts = flags.split("+")
    opt = {o[0]: int(o[1:]) for o in opts}
    heads, q_len, splits = opt.get("h", 16), opt.get("q", 1), opt.get("s", 1)
    qdt, kdt = {"bf16": (torch.bfloat16,) * 2, "fp16": (torch.float16,) * 2,
                "fp8kv": (torch.bfloat16, torch.float8_e4m3fn)}.get(dtype, (None, None))
    # FP8 caches from sm_89 on (configs.FP8_MIN_CAPABILITY: the project routes older GPUs'
    # elsewhere; Triton has no e4m3 there). AMD's ARCH.cc is a gfx name: not skipped.
    if qdt is None or (kdt == torch.float8_e4m3fn and isinstance(ARCH.cc, int)
                       and ARCH.cc < 89):
        return None
    n = MLA_SEQS
    mods = CallMods()
    if kdt == torch.float8_e4m3fn:
        one = torch.ones((n, 1), dtype=torch.float32)
        mods = CallMods(descale=Descale(k=one, v=one))
    call = AttentionCall(causal=True, softmax_scale=MLA_SCALE, mods=mods)
    k_lens = torch.full((n,), max(seq - 7, 1), dtype=torch.int32)
    if kind == "dense":
        q = torch.empty((n, heads, q_len, MLA_D), dtype=qdt)
        cache = torch.empty((n, 1, seq, MLA_D), dtype=kdt)
        return lambda: kvcache_forward(q, cache, cache[..., :MLA_DV], k_lens, None, None, call,
                                       num_splits=splits)
    pages = -(-seq // MLA_PAGE)
    q = torch.empty((n * q_len, heads, MLA_D), dtype=qdt)
    cache = torch.empty((n * pages, MLA_PAGE, 1, MLA_D), dtype=kdt)
    table = torch.arange(n * pages, dtype=torch.int32).reshape(n, pages)
    cu = torch.arange(n + 1, dtype=torch.int32) * q_len
    return lambda: varlen_paged_forward(q, cache, cache[..., :MLA_DV], call, cu_seqlens_q=cu,
                                        max_seqlen_q=q_len, block_table=table,
                                        seqused_k=k_lens, num_splits=splits)


# ----------------------------------------------------------------------------- project
def run_project(project, dtypes, head_dims, fwd_flags, bwd_dtypes, bwd_flags, seq, batch, heads,
                all_configs, mla=()):
    import torch
    sys.path.insert(0, os.path.abspath(project))
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        del sys.modules[name]
    from kernels.core.forward import attention_forward as _fwd
    from kernels.core.backward import attention_backward as _bwd

    def _contract(fn):
        # The launchers are called as documented in this module's docstring; say so if they change.
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except TypeError as e:
                raise SystemExit(f"sm90_static: {fn.__module__}.{fn.__name__} no longer takes the "
                                 f"arguments this tool passes ({e}); new launcher arguments need "
                                 f"defaults (see this tool's docstring)") from e
        return call

    attention_forward, attention_backward = _contract(_fwd), _contract(_bwd)
    # fp8: q, k, v e4m3 (bf16 output); fp8kv: an e4m3 KV cache read by bf16 q (forward only,
    # no dropout: those flags are skipped).
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
           "fp8": torch.float8_e4m3fn}
    qkv_dt = {"fp8kv": ("bf16", "fp8", "fp8")}

    def t(d, dtype):
        return torch.empty((batch, heads, seq, d), dtype=dtype)

    with compile_instead_of_launch(all_configs):
        for dt in dtypes:
            for d in head_dims:
                for flags in fwd_flags:
                    causal, p = "causal" in flags, (0.1 if "dropout" in flags else 0.0)
                    if dt.startswith("fp8") and p:
                        continue
                    LABEL.clear()
                    LABEL.update(side="project", dtype=dt, head_dim=d, flags=flags)
                    q, k, v = (t(d, tdt[x]) for x in qkv_dt.get(dt, (dt, dt, dt)))
                    # "persistent": the persistent forward; "warpspec": the warp-specialised
                    # configs offered too (A/B variants, off by default).
                    extra = dict(persistent=True) if "persistent" in flags else {}
                    os.environ["KERNELS_FWD_WARP_SPEC"] = "1" if "warpspec" in flags else "0"
                    attention_forward(q, k, v, causal=causal, softmax_scale=d ** -0.5,
                                      dropout_p=p, seed=0x5DEECE66D123 if p else 0, **extra)
        for dt in dtypes:
            for flags in mla:      # MLA decode (``mla_launch``): head dim 576, forward only
                fn = mla_launch(flags, dt, seq)
                if fn is None:
                    continue
                LABEL.clear()
                LABEL.update(side="project", dtype=dt, head_dim=MLA_D, flags=f"mla {flags}")
                try:
                    fn()
                except Exception as e:   # a failure outside any config's compile (host code)
                    RECORDS.append(dict(arch=ARCH.cc, **LABEL, kernel="(launch)", BLOCK_M=None,
                                        BLOCK_N=None, warps=None, stages=None, kept=True,
                                        status="FAIL", error=f"{type(e).__name__}: "
                                                         f"{str(e)[:160]}"))
        for dt in bwd_dtypes:
            for d in head_dims:
                for flags in bwd_flags:
                    causal, p = "causal" in flags, (0.1 if "dropout" in flags else 0.0)
                    LABEL.clear()
                    LABEL.update(side="project", dtype=dt, head_dim=d, flags=flags)
                    q, k, v, o, do = (t(d, tdt[dt]) for _ in range(5))
                    lse = torch.empty((batch, heads, seq), dtype=torch.float32)
                    attention_backward(do, q, k, v, o, lse, causal=causal,
                                       softmax_scale=d ** -0.5, dropout_p=p,
                                       seed=0x5DEECE66D123 if p else 0)
    LABEL.clear()


# ----------------------------------------------------------------------------- anchor
def _ensure_pytest_stub():
    try:
        import pytest  # noqa: F401
    except ImportError:            # the tutorial only uses pytest.mark.* decorators at import
        mod = types.ModuleType("pytest")

        class _Mark:
            def __getattr__(self, name):
                return lambda *a, **k: (lambda f: f)
        mod.mark = _Mark()
        mod.skip = lambda *a, **k: None
        sys.modules["pytest"] = mod


def run_anchor(path, dtypes, head_dims, variants, seq, batch, heads, all_configs):
    """The tutorial's forward ``_attention.forward(q, k, v, causal, sm_scale, warp_specialize)``.

    On sm_90 the tutorial passes host TensorDescriptors (TMA) unless warp_specialize, in which
    case it passes pointers and the kernel builds device-side descriptors (also TMA)."""
    import torch
    _ensure_pytest_stub()
    spec = importlib.util.spec_from_file_location("anchor_fused_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}
    with compile_instead_of_launch(all_configs):
        for dt in dtypes:
            for d in head_dims:
                for var in variants:
                    causal = "causal" in var
                    ws = "ws" in var
                    LABEL.clear()
                    LABEL.update(side="anchor", dtype=dt, head_dim=d,
                                 flags=var + (",dev-desc" if ws else ",host-desc"))
                    q, k, v = (torch.empty((batch, heads, seq, d), dtype=tdt[dt])
                               for _ in range(3))
                    try:
                        ctx = types.SimpleNamespace(save_for_backward=lambda *a: None)
                        mod._attention.forward(ctx, q, k, v, causal, 0.5, ws)
                    except Exception as e:   # e.g. failure before any config compiled
                        RECORDS.append(dict(arch=ARCH.cc, **LABEL, kernel="_attn_fwd",
                                            BLOCK_M=None, BLOCK_N=None,
                                            warps=None, stages=None, kept=True, status="FAIL",
                                            error=f"{type(e).__name__}: {str(e)[:160]}"))
    LABEL.clear()


# ----------------------------------------------------------------------------- output
COLS = ["arch", "side", "kernel", "dtype", "head_dim", "flags", "BLOCK_M", "BLOCK_N", "warps",
        "stages", "status", "regs", "spill", "smem", "blk/SM", "mma", "wgmma", "mma.sync",
        "tcgen05", "tma", "cp.async", "LDL/STL", "notes"]


def _usable(r):
    """Would a GPU of this arch load the kernel? (compiles, fits shared and tensor memory)"""
    return r["status"] == "ok" and not r["smem_over_limit"] and not r.get("tmem_over_limit")


def _row(r):
    status = r["status"]
    if status == "ok" and not r.get("kept", True):
        status = "pruned-ok"
    if status == "FAIL" and not r.get("kept", True):
        status = "pruned-FAIL"
    if status != "FAIL" and status != "pruned-FAIL" and r.get("smem_over_limit"):
        status += ">smem"
    if status != "FAIL" and status != "pruned-FAIL" and r.get("tmem_over_limit"):
        status += ">tmem"
    base = [f"sm_{r['arch']}", r.get("side", ""), r["kernel"], r.get("dtype", ""),
            r.get("head_dim", ""), r.get("flags", ""), r.get("BLOCK_M"), r.get("BLOCK_N"),
            r.get("warps"), r.get("stages"), status]
    if r["status"] != "ok":
        return base + [""] * (len(COLS) - len(base) - 1) + [r.get("error", "")]
    notes = []
    if r["c7515"]:
        notes.append("C7515")
    if r["warp_specialized"]:
        notes.append(f"ws({r['warps_total']}w)")
    if r["stack"]:
        notes.append(f"stack {r['stack']}")
    if r["global_scratch"]:
        notes.append(f"gscratch {r['global_scratch']}")
    if r.get("tmem"):
        notes.append(f"tmem {r['tmem']}")
    if r.get("fp8_mma") or r.get("sass_fp8"):
        notes.append(f"fp8 mma {r['fp8_mma']} (SASS Q*MMA {r['sass_fp8']})")
    return base + [r["regs"], f"{r['spill_st']}/{r['spill_ld']}", r["smem"], r["blocks_per_sm"],
                   r["mma_kind"] or "-", r["wgmma"], r["mma_sync"], r["tcgen05"], r["tma"],
                   r["cp_async"], f"{r['sass_ldl']}/{r['sass_stl']}", " ".join(notes)]


def _collapse(records):
    """Per launch, fold the configs that fail with one same error into one row."""
    rows, groups = [], {}
    for r in records:
        if r["status"] != "FAIL":
            rows.append(r)
            continue
        key = (r["arch"], r.get("side"), r["kernel"], r.get("dtype"), r.get("head_dim"),
               r.get("flags"), r.get("error"))
        if key in groups:
            groups[key]["cfgs"].append(r)
        else:
            groups[key] = dict(r, cfgs=[r])
            rows.append(groups[key])
    out = []
    for r in rows:
        if "cfgs" in r and len(r["cfgs"]) > 1:
            cf = " ".join(f"{c['BLOCK_M']}x{c['BLOCK_N']}w{c['warps']}s{c['stages']}"
                          for c in r["cfgs"])
            r = dict(r, BLOCK_M="*", BLOCK_N="*", warps="*", stages="*", kept=True,
                     error=f"{len(r['cfgs'])} configs ({cf}): {r['error']}")
        out.append(r)
    return out


def print_table(records, out=sys.stdout):
    records = _collapse(records)
    rows = [COLS] + [[("" if c is None else str(c)) for c in _row(r)] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLS) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1], file=out)


def _launches(records):
    """Records grouped per launch (arch, side, kernel, dtype, head_dim, flags), in order."""
    groups = {}
    for r in records:
        key = (r["arch"], r.get("side"), r["kernel"], r.get("dtype"), r.get("head_dim"),
               r.get("flags"))
        groups.setdefault(key, []).append(r)
    return groups


def print_summary(records, out=sys.stdout):
    """One line per launch: how many configs compile, spill, hit C7515, miss wgmma, etc."""
    print("\nsummary (configs per launch; kept = survive the prune hook)", file=out)
    for key, rs in _launches(records).items():
        ok = [r for r in rs if r["status"] == "ok"]
        n = lambda f: sum(1 for r in ok if f(r))  # noqa: E731
        limit = f"smem>{ARCHS[key[0]].smem_block // KB}KiB"
        print(f"  sm_{' '.join(str(k) for k in key)}: {len(rs)} configs, "
              f"{sum(1 for r in rs if r.get('kept', True))} kept, {len(rs) - len(ok)} fail, "
              f"{n(lambda r: r['spill_st'] or r['spill_ld'])} spill, "
              f"{n(lambda r: r['c7515'])} C7515, "
              f"{n(lambda r: r['mma_sync'] and not r['wgmma'])} mma.sync-only, "
              f"{n(lambda r: r['tma'])} TMA, {n(lambda r: r['smem_over_limit'])} {limit}",
              file=out)


def print_arch_summary(records, out=sys.stdout):
    """One line per arch over the kept configs: what a GPU of that generation would get.

    default = the first kept config of a launch (what KERNELS_AUTOTUNE=0 launches); a launch
    with no loadable config fails on that GPU even autotuned (every config times as inf)."""
    print("\nper GPU (kept configs; default = first kept config of a launch)", file=out)
    per_arch = {}
    for key, rs in _launches(records).items():
        kept = [r for r in rs if r.get("kept", True)]
        if kept:
            per_arch.setdefault(key[0], []).append(kept)
    for cc, launches in per_arch.items():
        rows = [r for g in launches for r in g]
        ok = [r for r in rows if r["status"] == "ok"]
        kinds = {}
        for r in ok:
            kinds[r["mma_kind"] or "no dot"] = kinds.get(r["mma_kind"] or "no dot", 0) + 1
        spill = sum(1 for g in launches if g[0]["status"] == "ok"
                    and (g[0]["spill_st"] or g[0]["spill_ld"]))
        arch = ARCHS[cc]
        print(f"  sm_{cc} ({arch.gpus}; {arch.smem_block // KB} KiB smem/block): "
              f"{len(rows)} kept variants, {len(rows) - len(ok)} fail, "
              f"{sum(1 for r in ok if r['smem_over_limit'] or r.get('tmem_over_limit'))} >smem, "
              f"{sum(1 for r in ok if r['c7515'])} C7515, default configs spilling "
              f"{spill}/{len(launches)}, defaults that would not load "
              f"{sum(1 for g in launches if not _usable(g[0]))}, launches with no loadable "
              f"config {sum(1 for g in launches if not any(_usable(r) for r in g))}; mma: "
              + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())), file=out)


# ----------------------------------------------------------------------------- driver
def _run_arch(a, cc):
    """Compile everything asked for, for compute capability ``cc``, in this process."""
    setup_triton(a.cache_dir, cc)
    import triton
    import torch
    print(f"triton {triton.__version__}, torch {torch.__version__}, target cuda:{cc} "
          f"({_sm_name(cc)}), seq {a.seq}, B {a.batch}, H {a.heads}, "
          f"cache {os.environ['TRITON_CACHE_DIR']}", file=sys.stderr)
    split = lambda s, sep=",": [x for x in (y.strip() for y in s.split(sep)) if x]  # noqa: E731
    hds = [int(x) for x in split(a.head_dims)]
    if a.project:
        run_project(a.project, split(a.dtypes), hds, split(a.fwd_flags, ";"),
                    split(a.bwd_dtypes), split(a.bwd_flags, ";"), a.seq, a.batch, a.heads,
                    not a.kept_only, mla_launches(a.mla))
    if a.anchor:
        run_anchor(a.anchor, split(a.anchor_dtypes), hds, split(a.anchor_variants, ";"),
                   a.seq, a.batch, a.heads, not a.kept_only)
    return RECORDS


def _arch_worker(a, cc, path):
    records = _run_arch(a, cc)
    with open(path, "w") as f:
        json.dump(records, f, default=str)


def _run_archs(a, archs, jobs):
    """Several archs: one forked process per arch (Triton reads the target once per process),
    ``jobs`` at a time, each handing its records back as a JSON file. Forked before this
    process imports torch or triton."""
    ctx = multiprocessing.get_context("fork")
    results, todo, running, failed = {}, list(archs), {}, []
    with tempfile.TemporaryDirectory(prefix="sm90_static-") as tmp:
        while todo or running:
            while todo and len(running) < jobs:
                cc = todo.pop(0)
                path = os.path.join(tmp, f"{cc}.json")
                proc = ctx.Process(target=_arch_worker, args=(a, cc, path), name=f"sm_{cc}")
                proc.start()
                running[proc.sentinel] = (cc, proc, path)
            for sentinel in multiprocessing.connection.wait(list(running)):
                cc, proc, path = running.pop(sentinel)
                proc.join()
                if proc.exitcode == 0 and os.path.exists(path):
                    with open(path) as f:
                        results[cc] = json.load(f)
                else:
                    failed.append(f"sm_{cc} (exit {proc.exitcode})")
    if failed:
        raise SystemExit(f"sm90_static: the run failed for {', '.join(failed)}; see its "
                         f"messages above")
    return [r for cc in archs for r in results[cc]]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", help="project checkout (has kernels/forward.py)")
    ap.add_argument("--tutorial", "--anchor", dest="anchor", metavar="PATH",
                    help="the Triton tutorial's python/tutorials/06-fused-attention.py (Triton "
                         "3.6; not part of this repository)")
    ap.add_argument("--arch", default="90",
                    help="comma-separated compute capabilities: " + ", ".join(
                        f"{cc} ({x.gpus})" for cc, x in ARCHS.items()) + " (default 90)")
    ap.add_argument("--jobs", type=int, default=0,
                    help="archs compiled at once, one process each (default: min(archs, CPUs))")
    ap.add_argument("--dtypes", default="bf16,fp16",
                    help="forward dtypes (project): bf16, fp16, fp32, fp8 (q, k, v e4m3), "
                         "fp8kv (bf16 q, e4m3 k, v)")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--fwd-flags", default="causal;causal+dropout;plain;dropout",
                    help="';'-separated: causal, causal+dropout, plain, dropout; "
                         "+persistent (e.g. causal+persistent): the persistent forward; "
                         "+warpspec: the warp-specialised configs too")
    ap.add_argument("--bwd-dtypes", default="bf16")
    ap.add_argument("--bwd-flags", default="causal", help="as --fwd-flags; '' skips backward")
    ap.add_argument("--anchor-dtypes", default="fp16,bf16",
                    help="the 3.6 tutorial kernel is fp16-only (bf16 is tried and reported)")
    ap.add_argument("--anchor-variants", default="causal",
                    help="';'-separated: causal (host TMA descriptors: what the tutorial "
                         "runs causal on Hopper), plain, plain+ws (warp_specialize with device "
                         "descriptors: the tutorial's Hopper non-causal benchmark), causal+ws")
    ap.add_argument("--mla", default="",
                    help="';'-separated MLA decode launches at head dim 576: paged or dense, "
                         "+hN query heads, +qN tokens, +sN splits (e.g. 'paged+h128+s4'); "
                         "'all': " + MLA_ALL + " (default: none)")
    ap.add_argument("--seq", type=int, default=4096, help="q_len = k_len of the launch")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kept-only", action="store_true",
                    help="compile only the configs the prune hooks keep (default: all, marked)")
    ap.add_argument("--cache-dir", default=os.environ.get("TRITON_CACHE_DIR",
                                                          _default_cache_dir()))
    ap.add_argument("--json", help="also write all records as JSON here")
    a = ap.parse_args(argv)
    if not a.project and not a.anchor:
        ap.error("give --project and/or --tutorial")
    mla_launches(a.mla)                 # an unknown --mla launch: fail before compiling
    if not a.anchor:
        print("sm90_static: the Triton tutorial: not given (--tutorial PATH)", file=sys.stderr)
    try:
        archs = list(dict.fromkeys(int(x) for x in a.arch.split(",") if x.strip()))
    except ValueError:
        archs = [None]
    if not archs or any(cc not in ARCHS for cc in archs):
        ap.error(f"--arch {a.arch!r}: give compute capabilities among "
                 f"{','.join(str(cc) for cc in ARCHS)}")

    if len(archs) == 1:
        records = _run_arch(a, archs[0])
    else:
        records = _run_archs(a, archs, a.jobs or min(len(archs), os.cpu_count() or 1))
    print_table(records)
    print_summary(records)
    print_arch_summary(records)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1, default=str)
    n_fail = sum(r["status"] != "ok" for r in records)
    print(f"\n{len(records)} kernels compiled for {', '.join(f'sm_{cc}' for cc in archs)}, "
          f"{n_fail} failed to compile", file=sys.stderr)


if __name__ == "__main__":
    main()
