#!/usr/bin/env python3
"""SASS instruction budget: our attention main loops against the Triton tutorial's, on sm_90.

What it measures
    The causal attention forward (and backward) of a project checkout and of the Triton 3.6
    tutorial 06 are compiled for sm_90a with triton 3.6 on this CPU-only machine by
    ``sm90_static.py`` in this folder (used as is: the real launchers, compile instead of launch,
    nothing runs). Each cubin is disassembled with the triton wheel's nvdisasm; in the SASS the tool
    finds each kernel's steady-state main loop (see below), counts the instructions of ONE
    iteration by class and normalises them to CTA-wide warp-instructions per 128x128 tile of work:

        per tile = instructions per warp per iteration x num_warps x 128*128 / (BLOCK_M x BLOCK_N)

    (queries x keys; the backward's tiles are its kernels' BLOCK_M x BLOCK_N too). Per kernel it
    also prints the config, registers, shared memory, CTAs/SM (the same estimate as sm90_static)
    and how the main and diagonal loops load K/V: TMA (UTMALDG), cp.async (LDGSTS) or plain LDG
    (synchronous, not pipelined). For the forward it adds the masked diagonal's cost per 128-row
    query block: every instruction from the end of the unmasked loop to the wait on the last
    tensor-core op, a masked loop counted BLOCK_M/BLOCK_N times (static: code a guard may skip
    is counted; the tutorial's d128 diagonal is straight-line code, not a loop).

    Compared: the project's DEFAULT config (the first config its autotuner keeps, which
    KERNELS_AUTOTUNE=0 runs) against the tutorial's best-known config for the shape (ANCHOR_FWD
    below; the tutorial's backward has one fixed config). The 3.6 tutorial is fp16-only (its bf16
    launch does not compile): the project's bf16 is compared against its fp16, and the output says
    so. Launch shape B1 H16 S4096, q_len = k_len; only the causal path is measured.

How to run (from the repository's root; ~1 min the first time on 2 cores, 20-30 s once the
Triton cache in --cache-dir holds the kernels):
    python tools/sass_budget.py --project . --tutorial PATH [--head-dims 64,128]
        [--dtypes fp16,bf16] [--no-backward] [--cache-dir DIR] [--json out.json] [--check]
    python tools/sass_budget.py --project . --tutorial PATH --prologue [--head-dims 64,128]
        [--cache-dir DIR] [--json out.json] [--check]   # per-program fixed cost instead (4
                                         # compiles, ~15 s cold, ~10 s cached), see below
    PATH: the Triton 3.6 tutorial's python/tutorials/06-fused-attention.py (not part of this
    repository; without it the tool says "not given" and exits 2). It needs triton 3.6.0 (the
    H100 host's version) with the nvdisasm/cuobjdump its wheel ships and a CPU torch. Started
    with another python it re-executes itself with the first of $SM90_VENV and
    ~/.cache/sm90-venv that exists (make one: ``python3 -m venv ~/.cache/sm90-venv &&
    ~/.cache/sm90-venv/bin/pip install triton==3.6.0 torch numpy``). The last line is:
        sass-budget: d64 ours/tutorial = X.XX, d128 ours/tutorial = Y.YY instructions per tile
        (<= 1.00 meets the budget)
    = forward main-loop totals, ours / tutorial; with several --dtypes the worst dtype's ratio.
    --check: exit 0 if every ratio is <= 1.00, 1 if not, 2 if one could not be measured (a
    kernel did not compile or its loop was not found reliably). --json writes every count.
    With --prologue the last line is instead
        sass-prologue: d64 ours A vs tutorial B (A/B x), d128 ours C vs tutorial D (C/D x);
        in-kernel descriptor fences ours E, tutorial F
    (A/B x printed as the ratio, e.g. 1.30x; n/a where a kernel was not measured), and --check
    exits 0 if ours <= the tutorial at every head_dim, 1 if not, 2 if one was not measured.

What the numbers mean
    Columns: hgmma (tensor-core instructions; every warp of a warpgroup issues each), mufu
    (EX2, RCP, ...), ffma / fmul / fadd (fp32), fmnmx, fsel (fp32 select/compare), conv (F2FP and
    other conversions), int (integer ALU, IMAD, VOTEU on vector registers), unif (the uniform
    datapath: U*, R2UR, S2UR, LDC), loads (global memory: LDG, LDGSTS, UTMALDG and their fences),
    smem (LDS/STS/LDSM/STSM), bar (BAR, mbarrier SYNCS, WARPGROUP arrive/wait, DEPBAR, MEMBAR,
    FENCE), other (SHFL, branches, NOP, local-memory spills, ...), total. An SM sub-partition
    issues at most one warp-instruction per clock, so the total is the issue work a tile of work
    costs; the classes say where a difference comes from (an unfolded softmax scale is a row of
    FMUL, per-thread cp.async addressing is int, a 64-wide BLOCK_N repeats the per-row softmax
    bookkeeping and the accumulator rescale twice per 128 keys).

What they do not mean
    A static count, not a timing. It ignores latency and stalls, how well tensor-core work
    overlaps the softmax, the pipes' different rates (MUFU 16 lanes/clk/SM, FFMA 128), occupancy
    (printed beside it, not folded in), memory traffic, and the prologue and epilogue (--prologue
    counts those, see below). A kernel with more instructions per tile can still be faster, and
    the reverse: only a GPU run says. It says nothing about correctness. The tutorial is one
    anchor at its best-known config, not an optimum (its d128 backward spills, see the notes the
    tool prints).

How the loop is found, and when it is not trusted
    A loop is a backward branch (BRA to a label at a lower address) in the kernel's main body
    (up to its last EXIT; cold stubs such as mbarrier retry loops sit after it and are not
    followed). Loops without HGMMA/HMMA are dropped, and of nested loops only the innermost are
    kept (the project's dK/dV loops sit inside its GQA group loop). Every instruction of the body
    counts once, including code that an internal branch may skip (a note says so when there is
    any). A loop's role (forward, dK/dV, dQ) comes from the kernel's name, or for the tutorial's
    combined _attn_bwd from the @triton.jit function holding its HGMMA lines (nvdisasm line info).
    Of a role's loops the one with the fewest FSEL/SEL per score element is the main (unmasked)
    loop; a second one must have >= MASKED_EXTRA_SELECTS more to be its masked (diagonal) loop.
    Triton does not unroll loops unless asked, so one iteration is one BLOCK_M x BLOCK_N tile;
    its HGMMA FLOPs are checked against the tile: 1/2 or 1/4 of it is a sliced tile (the
    tutorial's masked backward loops), more is redundant tensor-core work (noted and counted as
    issued: e.g. the project's 64x64, 8-warp dQ computes S and dP in both warpgroups). Anything
    else -- more than two loops of a role, masked and unmasked loops that cannot be told apart, a
    tile that does not match, a loop of unknown role, a warp-specialised kernel (per-warp counts
    would not add up) -- is reported as "loop not found reliably" and no number is printed for it.

Per-program fixed cost (--prologue)
    What a forward program issues besides its tiles' work: descriptor creation, barrier set-up,
    the Q load, pipeline prologue and drain, the final normalisation and stores; it weighs most
    at short sequences. Both sides are compiled at B128 H16 S128 (PROLOGUE_SHAPE), causal fp16 (the
    tutorial's only dtype; --dtypes and --no-backward do not apply), head_dim 64 and 128
    (--head-dims); ours at its first kept config for that shape, the tutorial at ANCHOR_FWD.
    With BLOCK_M = 128 a program skips the unmasked loop and runs one 128x128 masked diagonal
    tile, as a masked loop (BLOCK_M/BLOCK_N trips) or, where Triton folds a one-trip loop away
    (the tutorial at d128, BLOCK_N = BLOCK_M), as straight-line code after the unmasked loop.

    Definition. Main body = kernel entry to its last EXIT (the cold mbarrier-retry stubs after it
    are not counted, as above). Tile code = (1) every loop of the main body holding tensor-core
    instructions, its whole body (one trip = one tile: per-tile work, which the default mode
    counts), and (2) in each stretch of code outside those loops that holds tensor-core
    instructions, the span from the first of them to the warpgroup wait (WARPGROUP.DEPBAR) on the
    last -- the straight-line form of a loop trip: the tile's MMAs and the mask / softmax /
    rescale between them (when written, the tutorial's d128 diagonal: 773 instructions per warp,
    against the 780 of ours' masked loop body). Fixed = main body minus tile code, in three parts:
        prologue  entry -> the first tile code (descriptors made in the kernel, barrier
                  initialisation, Q, the first loop's pipeline prologue and its trip guard)
        between   outside the tile code between its first and last instruction (a loop's
                  pipeline drain, the next loop's set-up; before straight-line tile code, the
                  loads and barrier wait that feed it)
        epilogue  after the last tile code -> EXIT (1/l, lse and O stores)
    A..D = fixed x num_warps x 128/BLOCK_M: CTA-wide warp-instructions per 128 query rows, i.e.
    per program at BLOCK_M = 128 -- the issue-work unit of the per-tile budget (every warp
    issues the fixed code; an 8-warp kernel pays its uniform set-up twice as often as a 4-warp
    one). The table also prints the per-warp counts: 'around' = main body minus loop bodies (all
    a seq-128 program runs except its masked tile's loop body, straight-line tile code included),
    'sl-tile' = the straight-line tile code subtracted from it. Why a structural cut and not
    "subtract the tile's MMA and softmax arithmetic by instruction class": the classes cannot
    tell the mask's integer compares or a loop's address arithmetic (tile work) from set-up, and
    they would charge a loop body's overhead -- the per-tile budget's business -- to the fixed
    cost. What the cut leaves uneven: the loads and barrier wait that feed a straight-line tile
    count as fixed ('between'; in a loop they are in the body), which raises the straight-line
    side's figure (the tutorial's at d128) by at most its 'between'.
    Descriptor columns: desc = main-body instructions whose line info falls inside a
    make_tensor_descriptor(...) call (any file; ours' kernels/core/tma.py row_tiles today; 0 for
    host-side TensorDescriptor arguments, as the tutorial passes them, and after a project
    switch to those); fences = the kernel's PTX tensormap fences, release
    (tensormap.cp_fenceproxy, the copy of a descriptor made in shared memory to global) + acquire
    (fence.proxy.tensormap::generic.acquire), printed rel+acq; scratch = Triton's global scratch
    per program (descriptors made in the kernel live there, 128 B each). E, F in the last line =
    release + acquire fences of one kernel, the larger over the head_dims. Static counts: code a
    guard may skip is counted; no latency, no memory traffic (the fences and the descriptors'
    scratch writes and reads are the parts to time on a GPU).
"""
import argparse
import ast
import collections
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types

sys.dont_write_bytecode = True          # never write __pycache__ into a checkout or this folder

HERE = os.path.dirname(os.path.abspath(__file__))
SM90_STATIC = os.path.join(HERE, "sm90_static.py")
VENVS = [os.environ.get("SM90_VENV"), "~/.cache/sm90-venv"]

TILE = 128                              # counts are per TILE x TILE tile of work
SEQ, BATCH, HEADS = 4096, 1, 16         # launch shape (sm90_static's default), q_len = k_len
# The tutorial's best-known causal forward config per head_dim on H100 (BLOCK_M, BLOCK_N,
# num_warps, num_stages): 128x128 with 8 warps at d128; at d64, where BLOCK_N <= HEAD_DIM rules
# out 128x128, 128x64 with 4 warps. Change it here when a GPU measurement says otherwise.
ANCHOR_FWD = {128: (128, 128, 8, 3), 64: (128, 64, 4, 3)}
# Tensor-core FLOPs of one BLOCK_M x BLOCK_N tile, in units of BLOCK_M * BLOCK_N * head_dim:
# forward S = QK^T, O += PV; dK/dV S^T, dP^T, dV, dK; dQ S, dP, dQ.
GEMM_FLOPS = {"fwd": 4, "dkdv": 8, "dq": 6}
ROLE_NAMES = {"fwd": "forward", "dkdv": "dK/dV", "dq": "dQ"}
MASKED_EXTRA_SELECTS = 0.5          # per score element, masked loop vs unmasked one

COLUMNS = ["hgmma", "mufu", "ffma", "fmul", "fadd", "fmnmx", "fsel", "conv", "int", "unif",
           "loads", "smem", "bar", "other", "total"]


# ----------------------------------------------------------------------------- environment
def ensure_triton36():
    """Re-execute under a venv with triton 3.6 unless this python already has it."""
    try:
        import triton
        if triton.__version__.startswith("3.6."):
            return
        found = f"triton {triton.__version__}"
    except ImportError:
        found = "no triton"
    if not os.environ.get("SASS_BUDGET_REEXEC"):
        for venv in VENVS:
            py = os.path.join(os.path.expanduser(venv), "bin", "python") if venv else ""
            if py and os.access(py, os.X_OK):
                os.environ["SASS_BUDGET_REEXEC"] = "1"
                os.execv(py, [py, os.path.abspath(__file__)] + sys.argv[1:])
    sys.exit(f"sass_budget: needs triton 3.6 (the H100 host's), this python has {found}; make a "
             f"venv: python3 -m venv ~/.cache/sm90-venv && ~/.cache/sm90-venv/bin/pip install "
             f"triton==3.6.0 torch==2.13.0")


def load_sm90_static():
    spec = importlib.util.spec_from_file_location("sm90_static", SM90_STATIC)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def nvidia_tool(name):
    from triton import knobs
    path = getattr(knobs.nvidia, name).path
    if not path or not os.access(path, os.X_OK):
        sys.exit(f"sass_budget: the triton wheel has no {name} (triton/backends/nvidia/bin)")
    return path


# ----------------------------------------------------------------------------- compiling
class Compiler:
    """Compiles through sm90_static (CLI entry point, stdout/stderr captured) and keeps every
    compiled kernel. Only the config being compared is compiled: the autotuner's kept list is cut
    to it (the project's first kept config, or the tutorial's best-known one)."""

    def __init__(self, cache_dir):
        self.cache_dir = cache_dir
        self.tool = load_sm90_static()
        self.tool.setup_triton(cache_dir)
        self.kernels, self.log = [], []
        self.job, self.pick, self.force_compile = {}, None, False
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
        real_run, real_prune = JITFunction.run, Autotuner.prune_configs
        me = self

        def run(fn, *args, grid, warmup, **kwargs):
            # sm90_static calls this with warmup=True (compile only); so does force_compile.
            rec = dict(me.job, fn=fn.__name__, kwargs={k: v for k, v in kwargs.items()
                                                       if isinstance(v, (int, float, str))})
            try:
                kernel = real_run(fn, *args, grid=grid, warmup=warmup or me.force_compile,
                                  **kwargs)
            except Exception as e:
                me.kernels.append(dict(rec, kernel=None, error=innermost_error(e)))
                raise
            me.kernels.append(dict(rec, kernel=kernel, error=None))
            return kernel

        def prune_configs(tuner, *args, **kwargs):
            kept = real_prune(tuner, *args, **kwargs)
            return me.pick(tuner, kept) if me.pick else kept

        JITFunction.run = run       # sm90_static wraps this (it reads JITFunction.run on entry)
        Autotuner.prune_configs = prune_configs
        self._anchor_module = None

    def _tool(self, argv, job, pick):
        self.job, self.pick = job, pick
        start = len(self.kernels)
        out = {"text": ""}
        try:
            with captured_output() as out:
                self.tool.main(argv + ["--kept-only", "--cache-dir", self.cache_dir])
        except SystemExit as e:
            sys.exit(f"sass_budget: sm90_static stopped ({e}); its output:\n{out['text']}")
        except Exception as e:           # e.g. not a project checkout: no kernels package
            sys.exit(f"{out['text'][-2000:]}\nsass_budget: sm90_static failed "
                     f"({' '.join(argv[:2])}): {innermost_error(e)}")
        finally:
            self.job, self.pick = {}, None
            self.log.append(out["text"])
        return self.kernels[start:]

    def project(self, path, direction, dtype, hd, shape=()):
        """``shape``: extra sm90_static arguments (--seq/--batch/--heads; default its B1 H16
        S4096)."""
        def first_kept(tuner, kept):
            job["kept"] = [cfg_str(c.all_kwargs()) for c in kept]
            return kept[:1]
        job = dict(side="ours", dtype=dtype, head_dim=hd)
        argv = ["--project", path, "--head-dims", str(hd), "--dtypes", dtype,
                "--bwd-dtypes", dtype]
        argv += (["--fwd-flags", "causal", "--bwd-flags", ""] if direction == "fwd"
                 else ["--fwd-flags", "", "--bwd-flags", "causal"])
        return self._tool(argv + list(shape), job, first_kept)

    def anchor_forward(self, path, dtype, hd, shape=()):
        want = ANCHOR_FWD[hd]

        def best_known(tuner, kept):
            for c in list(kept) + list(tuner.configs):
                kw = c.all_kwargs()
                if (kw.get("BLOCK_M"), kw.get("BLOCK_N"), kw.get("num_warps"),
                        kw.get("num_stages")) == want:
                    return [c]
            return kept[:0]             # not offered by this tutorial: nothing compiles
        job = dict(side="tutorial", dtype=dtype, head_dim=hd)
        argv = ["--anchor", path, "--head-dims", str(hd), "--anchor-dtypes", dtype,
                "--anchor-variants", "causal"]
        return self._tool(argv + list(shape), job, best_known)

    def anchor_backward(self, path, dtype, hd):
        """The tutorial's ``_attention.backward`` (plain launches, one fixed config)."""
        import torch
        if self._anchor_module is None:
            try:
                import pytest  # noqa: F401
            except ImportError:           # the tutorial only decorates its tests with pytest.mark.*
                class Mark:
                    def __getattr__(self, name):
                        return lambda *a, **k: (lambda f: f)
                sys.modules["pytest"] = types.SimpleNamespace(mark=Mark())
            spec = importlib.util.spec_from_file_location("sass_budget_anchor", path)
            self._anchor_module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(self._anchor_module)
        tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        q, k, v, o, do = (torch.empty((BATCH, HEADS, SEQ, hd), dtype=tdt) for _ in range(5))
        lse = torch.empty((BATCH, HEADS, SEQ), dtype=torch.float32)
        ctx = types.SimpleNamespace(saved_tensors=(q, k, v, o, lse), sm_scale=hd ** -0.5,
                                    HEAD_DIM=hd, causal=True)
        self.job, self.force_compile = dict(side="tutorial", dtype=dtype, head_dim=hd), True
        start = len(self.kernels)
        out = {"text": ""}
        try:
            with captured_output() as out:
                self._anchor_module._attention.backward(ctx, do)
        except Exception:
            pass                          # recorded by run() (e.g. bf16: the tutorial is fp16-only)
        finally:
            self.job, self.force_compile = {}, False
            self.log.append(out["text"])
        return self.kernels[start:]


@contextlib.contextmanager
def captured_output():
    """Everything written to file descriptors 1 and 2 (Python prints, whatever sys.stdout they
    were bound to, MLIR and ptxas diagnostics) goes to ``box["text"]`` instead."""
    box = {"text": ""}
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            tmp.seek(0)
            box["text"] = tmp.read().decode("utf-8", "replace")


def innermost_error(e):
    """'Type: message' of the innermost cause (a CompilationError only carries a source excerpt)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip().strip("^")]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]


def cfg_str(kw):
    return f"{kw.get('BLOCK_M')}x{kw.get('BLOCK_N')} w{kw.get('num_warps')} s{kw.get('num_stages')}"


# ----------------------------------------------------------------------------- SASS
INS_RE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]\s+)?"
                    r"([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*(.*?)\s*;")
LABEL_RE = re.compile(r"^(\.L_x_\d+):")
LINE_RE = re.compile(r'//## File "([^"]+)", line (\d+)')
BRA_TARGET_RE = re.compile(r"`\((\.L_x_\d+)\)")
Ins = collections.namedtuple("Ins", "op pred args src")

TENSOR = {"HGMMA", "HMMA", "QGMMA", "IGMMA", "BGMMA", "IMMA"}
FP32 = {"FFMA": "ffma", "FFMA32I": "ffma", "FMUL": "fmul", "FMUL32I": "fmul", "FADD": "fadd",
        "FADD32I": "fadd", "FMNMX": "fmnmx", "FSEL": "fsel", "FSETP": "fsel", "FSET": "fsel",
        "MUFU": "mufu"}
CONV = {"F2FP", "F2F", "F2I", "I2F", "I2FP", "F2IP", "FRND"}
LOADS = {"LDG", "LDGSTS", "LDGDEPBAR", "UTMALDG", "UBLKCP", "UTMAPF", "UTMACCTL", "STG", "UTMASTG",
         "UBLKRED", "ATOMG", "RED", "REDG", "LD", "ST"}
SMEM = {"LDS", "STS", "LDSM", "STSM", "ATOMS"}
BAR = {"BAR", "SYNCS", "WARPGROUP", "DEPBAR", "WARPSYNC", "MEMBAR", "FENCE", "ERRBAR", "CCTL",
       "ARRIVES", "BSSY", "BSYNC", "NANOSLEEP", "ACQBULK"}
INT = {"IMAD", "IMUL", "IDP", "IADD3", "IADD", "IADD32I", "LEA", "LOP3", "LOP", "SHF", "SHL",
       "SHR", "ISETP", "SEL", "VIADD", "IMNMX", "VIMNMX", "IABS", "PRMT", "BMSK", "SGXT", "PLOP3",
       "P2R", "R2P", "MOV", "MOV32I", "CS2R", "S2R", "POPC", "FLO", "BREV", "VOTE", "VOTEU",
       "ISCADD"}


def classify(op):
    base = op.split(".")[0]
    if base in TENSOR:
        return "hgmma"
    for names, col in ((LOADS, "loads"), (SMEM, "smem"), (BAR, "bar"), (CONV, "conv")):
        if base in names:
            return col
    if base in FP32:
        return FP32[base]
    if base in INT:
        return "int"
    if base.startswith("U") or base in ("R2UR", "S2UR", "LDC"):
        return "unif"
    return "other"


def disassemble(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvidia_tool("nvdisasm"), "-c", "-g", f.name], check=True,
                              capture_output=True, text=True).stdout
        usage = subprocess.run([nvidia_tool("cuobjdump"), "-res-usage", f.name], check=True,
                               capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return sass, int(regs.group(1)) if regs else None, int(stack.group(1)) if stack else None


def parse(sass):
    """Instructions in address order and {label: index of the instruction it marks}."""
    ins, labels, pending, src = [], {}, [], None
    for line in sass.splitlines():
        m = LINE_RE.search(line)
        if m:
            src = (m.group(1), int(m.group(2)))
            continue
        m = LABEL_RE.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = INS_RE.match(line)
        if m:
            for lab in pending:
                labels[lab] = len(ins)
            pending = []
            ins.append(Ins(m.group(3), (m.group(2) or "").strip(), m.group(4), src))
    return ins, labels


def tensor_loops(ins, labels):
    """Innermost loops of the main body that hold tensor-core instructions: [(first, last)]."""
    exits = [k for k, i in enumerate(ins) if i.op == "EXIT" and not i.pred]
    end = exits[-1] if exits else len(ins) - 1
    heads = {}
    for k, i in enumerate(ins[:end + 1]):
        m = BRA_TARGET_RE.search(i.args) if i.op.startswith("BRA") else None
        t = labels.get(m.group(1)) if m else None
        if t is not None and t <= k and not any(x.op == "EXIT" and not x.pred
                                                for x in ins[t:k + 1]):
            heads[t] = max(heads.get(t, k), k)
    spans = [(t, e) for t, e in heads.items()
             if any(classify(x.op) == "hgmma" for x in ins[t:e + 1])]
    return sorted(s for s in spans
                  if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans))


def tally(body):
    c = collections.Counter(classify(i.op) for i in body)
    c["total"] = len(body)
    c["local"] = sum(i.op.split(".")[0] in ("LDL", "STL") for i in body)     # spills, in "other"
    return c


def tensor_flops(body, warps):
    """FLOPs of the CTA's tensor-core instructions in ``body`` (one execution)."""
    flops = 0
    for i in body:
        m = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", i.op)
        if m:       # one per warpgroup (each of its 4 warps issues it)
            flops += 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) * (warps // 4)
        m = re.match(r"HMMA\.(\d\d)(\d)(\d+)", i.op)
        if m:       # mma.sync: one per warp
            flops += 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) * warps
    return flops


_FUNCTIONS = {}


def source_function(path, line):
    """Name of the innermost function of ``path`` that contains ``line`` (None if unknown)."""
    if path not in _FUNCTIONS:
        try:
            tree = ast.parse(open(path).read())
            _FUNCTIONS[path] = [(n.lineno, n.end_lineno, n.name) for n in ast.walk(tree)
                                if isinstance(n, ast.FunctionDef)]
        except (OSError, SyntaxError):
            _FUNCTIONS[path] = []
    inside = [f for f in _FUNCTIONS[path] if f[0] <= line <= f[1]]
    return min(inside, key=lambda f: f[1] - f[0])[2] if inside else None


def role_of(name):
    name = (name or "").lower()
    if "dkdv" in name:
        return "dkdv"
    if re.search(r"(^|_)dq(_|$)", name):
        return "dq"
    if "fwd" in name:
        return "fwd"
    return None


def load_kind(counts_by_op):
    ops = counts_by_op
    if ops.get("UTMALDG"):
        return "TMA"
    if ops.get("LDGSTS"):
        return "cp.async"
    if ops.get("LDG"):
        return "LDG (not pipelined)"
    return "none"


def ctas_per_sm(regs, warps, smem):
    """Resident CTAs per SM by registers, warps and shared memory (sm90_static's estimate)."""
    per_warp = ((regs * 32 + 255) // 256) * 256
    by_smem = 233472 // (smem + 1024) if smem else 32
    return max(0, min(65536 // (per_warp * warps), by_smem, 64 // warps, 32))


# ----------------------------------------------------------------------------- analysis
def expected_tile(role, kw):
    if "BLOCK_M" in kw and "BLOCK_N" in kw:
        return kw["BLOCK_M"] * kw["BLOCK_N"]
    if role == "dkdv" and "BLOCK_M1" in kw:
        return kw["BLOCK_M1"] * kw["BLOCK_N1"]
    if role == "dq" and "BLOCK_M2" in kw:
        return kw["BLOCK_M2"] * kw["BLOCK_N2"]
    return None


def analyse(entry):
    """Loops, resources and per-tile counts of one compiled kernel."""
    k, kw = entry["kernel"], entry["kwargs"]
    warps = k.metadata.num_warps
    sass, regs, stack = disassemble(k.asm["cubin"])
    ins, labels = parse(sass)
    hd = kw.get("BLOCK_D", kw.get("HEAD_DIM"))
    out = dict(side=entry["side"], dtype=entry["dtype"], head_dim=entry["head_dim"],
               kernel=entry["fn"], kwargs=kw, warps=warps, regs=regs, stack=stack,
               smem=k.metadata.shared, kept=entry.get("kept"), loops=[], problems=[])
    out["ctas_per_sm"] = ctas_per_sm(regs, warps, out["smem"]) if regs else None
    log = getattr(k.metadata, "ptxas_log", None) or ""    # sm90_static's hook stores it
    m = re.search(r"\((C\d+)\)[^\n]*wgmma[^\n]*serialized", log)
    out["wgmma_serialized"] = m.group(1) if m else None    # ptxas C7515 / C7512 warnings
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    out["spill"] = (int(m.group(1)), int(m.group(2))) if m else None
    if "ttg.warp_specialize" in k.asm.get("ttgir", ""):
        out["problems"].append("warp-specialised kernel: per-warp counts do not add up")
    exits = [j for j, i in enumerate(ins) if i.op == "EXIT" and not i.pred]
    main_end = exits[-1] if exits else len(ins) - 1
    for first, last in tensor_loops(ins, labels):
        body = ins[first:last + 1]
        fns = collections.Counter(source_function(*i.src) for i in body
                                  if i.src and classify(i.op) == "hgmma")
        fn = fns.most_common(1)[0][0] if fns else None
        # The kernel's name decides where it is unambiguous (the project's three kernels, the
        # tutorial's forward); the tutorial's _attn_bwd holds dK/dV and dQ loops: line info.
        role = role_of(entry["fn"]) or role_of(fn)
        tile, redundancy = iteration_tile(role, kw, hd, tensor_flops(body, warps))
        c = tally(body)
        ops = collections.Counter(i.op.split(".")[0] for i in body)
        norm = warps * TILE * TILE / tile if tile else 0.0
        # Forward branches to a label inside the body skip code on some iterations; the count
        # takes every instruction as executed (branches to stubs past EXIT are not followed).
        skippable = 0
        for j, i in enumerate(body[:-1]):
            m = BRA_TARGET_RE.search(i.args) if i.op.startswith("BRA") else None
            t = labels.get(m.group(1)) if m else None
            if t is not None and first + j < t <= last:
                skippable += t - (first + j) - 1
        out["loops"].append(dict(
            first=first, last=last, source_function=fn, role=role, tile=tile,
            redundancy=redundancy, loads=load_kind(ops), per_warp=dict(c), skippable=skippable,
            selects_per_element=(ops["FSEL"] + ops["SEL"]) * warps * 32 / tile if tile else None,
            per_tile={col: c[col] * norm for col in COLUMNS + ["local"]}))
    out["main"] = {}
    if out["problems"]:                   # warp-specialised: no per-warp normalisation holds
        return out
    for role in sorted({L["role"] for L in out["loops"] if L["role"]}):
        why, loops = main_and_masked([L for L in out["loops"] if L["role"] == role], role, kw)
        if why:
            out["problems"].append(why)
        else:
            out["main"][role] = loops
    if any(L["role"] is None for L in out["loops"]):
        out["problems"].append("a loop whose role (forward, dK/dV, dQ) is unknown (no line info?)")
    if "fwd" in out["main"]:
        out["diagonal"] = diagonal_cost(ins, main_end, out["main"]["fwd"], kw, warps)
    return out


def iteration_tile(role, kw, hd, flops):
    """(score elements one loop iteration covers, redundancy), or (None, None) if unknown.

    Triton does not unroll loops unless asked (tl.range loop_unroll_factor), so one iteration is
    one tile of the config, BLOCK_M x BLOCK_N, and its tensor-core FLOPs should be the tile's.
    Half or a quarter of them: a sliced tile (the tutorial's masked backward loops step
    BLOCK / BLK_SLICE_FACTOR). More: the CTA computes part of the tile twice (redundancy > 1,
    e.g. both warpgroups computing the same S), which costs issue slots and is counted."""
    want = expected_tile(role, kw)
    if not (role and want and hd and flops):
        return None, None
    r = flops / (GEMM_FLOPS[role] * hd * want)
    if abs(r - 1) < 1e-9:
        return want, 1.0
    if any(abs(r * s - 1) < 1e-9 for s in (2, 4)):
        return want * r, 1.0
    if r > 1:
        return want, r
    return None, None


def main_and_masked(loops, role, kw):
    """(reason it failed, None) or (None, {"unmasked": main loop, "masked": loop or None}).

    The main loop is the role's loop with the fewest FSEL/SEL per score element; another loop of
    the role is its masked (diagonal) loop if it has >= MASKED_EXTRA_SELECTS more per element."""
    if any(L["tile"] is None for L in loops):
        return (f"{ROLE_NAMES[role]}: a loop's tensor-core work does not match the config's "
                f"tile ({expected_tile(role, kw)} elements)"), None
    loops = sorted(loops, key=lambda L: L["selects_per_element"])
    if len(loops) > 2:
        return (f"{ROLE_NAMES[role]}: {len(loops)} loops with tensor-core work (expected 1 or 2)",
                None)
    main, masked = loops[0], (loops[1] if len(loops) == 2 else None)
    if masked and masked["selects_per_element"] - main["selects_per_element"] < \
            MASKED_EXTRA_SELECTS:
        return (f"{ROLE_NAMES[role]}: cannot tell the masked loop from the unmasked one "
                f"({main['selects_per_element']:.2f} vs {masked['selects_per_element']:.2f} "
                f"selects per element)"), None
    return None, dict(unmasked=main, masked=masked)


def diagonal_cost(ins, main_end, loops, kw, warps):
    """Warp-instructions (CTA-wide) per 128-row query block of the causal diagonal: from the end
    of the unmasked loop to the wait after the last tensor-core op, masked loop trips included."""
    U, M = loops["unmasked"], loops["masked"]
    bm = kw["BLOCK_M"]
    if M is not None and M["first"] < U["last"]:
        return None                      # masked loop before the unmasked one: not a forward
    around = ins[U["last"] + 1:M["first"]] if M else []
    tail = ins[(M or U)["last"] + 1:main_end + 1]
    tensor = [j for j, i in enumerate(tail) if classify(i.op) == "hgmma"]
    if tensor:                           # straight-line diagonal code (or its last wgmma wait)
        wait = next((j for j in range(tensor[-1], len(tail))
                     if tail[j].op.startswith("WARPGROUP.DEPBAR")), tensor[-1])
        around = around + tail[:wait + 1]
    trips = bm * bm / M["tile"] if M else 0      # the diagonal block is BLOCK_M x BLOCK_M keys
    per_warp = len(around) + trips * (M["per_warp"]["total"] if M else 0)
    loads = M["loads"] if M else load_kind(collections.Counter(i.op.split(".")[0]
                                                               for i in around))
    return dict(per_block=per_warp * warps * TILE / bm, masked_loop_trips=trips,
                straight_line=M is None, around_per_warp=len(around), loads=loads)


# ----------------------------------------------------------------------------- report
def fmt_row(label, per_tile, width=34):
    return f"  {label:<{width}}" + "".join(f"{per_tile[c]:>7.0f}" for c in COLUMNS)


def header(width=34):
    return f"  {'':<{width}}" + "".join(f"{c:>7}" for c in COLUMNS)


def kernel_line(k, label, how):
    kw = k["kwargs"]
    if "BLOCK_M1" in kw:                  # the tutorial's backward: one kernel, two tiles
        cfg = (f"dK/dV {kw['BLOCK_M1']}x{kw['BLOCK_N1']}, dQ {kw['BLOCK_M2']}x{kw['BLOCK_N2']} "
               f"w{kw.get('num_warps')} s{kw.get('num_stages')}")
    else:
        cfg = cfg_str(kw)
    loads = []
    for role, m in k["main"].items():
        where = "main" if len(k["main"]) == 1 else f"{ROLE_NAMES[role]} main"
        loads.append(f"{where} {m['unmasked']['loads']}")
        if role == "fwd" and k.get("diagonal"):
            loads.append(f"diagonal {k['diagonal']['loads']}"
                         + (" (straight-line)" if k["diagonal"]["straight_line"] else ""))
        elif m["masked"]:
            loads.append(f"diagonal {m['masked']['loads']}")
    stack = f", spills {k['spill'][0]}/{k['spill'][1]} B" if k["spill"] and any(k["spill"]) \
        else (f", stack {k['stack']} B" if k["stack"] else "")
    if k["wgmma_serialized"]:
        stack += f", wgmma serialized (ptxas {k['wgmma_serialized']})"
    return (f"  {label:<15}{k['kernel']} {cfg} ({how}): {k['regs']} regs{stack}, "
            f"smem {k['smem']} B, {k['ctas_per_sm']} CTA/SM; loads: {', '.join(loads) or '?'}")


def pair_anchor(anchor, hd, dtype):
    """The tutorial kernel to compare a project dtype with: same dtype, else fp16."""
    for dt in (dtype, "fp16"):
        if (hd, dt) in anchor:
            return anchor[(hd, dt)], dt
    return None, None


def why_missing(k, role, label, failed_msg):
    """None when kernel ``k`` has a trusted ``role`` main loop, else a one-line reason."""
    if k is None:
        return f"{label}: did not compile ({failed_msg or 'no kernel'})"
    if role not in k["main"]:
        return f"{label}: loop not found reliably, left out ({'; '.join(k['problems']) or '?'})"
    return None


def report_forward(ours, anchor, head_dims, dtypes, failed):
    ratios = {}
    print(f"== forward, causal, B{BATCH} H{HEADS} S{SEQ}: main loop, warp-instructions per "
          f"{TILE}x{TILE} tile (all warps of a CTA) ==")
    for hd in head_dims:
        print(f"\nhead_dim {hd}")
        pairs = []                                  # (dtype, ours, tutorial, tutorial dtype)
        for dt in dtypes:
            o = ours.get((hd, dt))
            t, tdt = pair_anchor(anchor, hd, dt)
            why = (why_missing(o, "fwd", f"ours {dt}", failed.get(("ours", hd, dt)))
                   or why_missing(t, "fwd", "tutorial", failed.get(("tutorial", hd, "fp16"))))
            if why:
                print(f"  {why}")
                ratios.setdefault(hd, []).append(None)
                continue
            pairs.append((dt, o, t, tdt))
            ratios.setdefault(hd, []).append(main_total(o, "fwd") / main_total(t, "fwd"))
        if not pairs:
            continue
        kernels = [(f"ours {dt}", o, f"default = 1st of {len(o['kept'] or [])} kept")
                   for dt, o, _, _ in pairs]
        kernels += list({tdt: (f"tutorial {tdt}", t, "best-known") for _, _, t, tdt in pairs}
                        .values())
        for label, k, how in kernels:
            print(kernel_line(k, label, how))
        print(header())
        for label, k, _ in kernels:
            print(fmt_row(label, k["main"]["fwd"]["unmasked"]["per_tile"]))
        for dt, o, t, tdt in pairs:
            ou, tu = (k["main"]["fwd"]["unmasked"]["per_tile"] for k in (o, t))
            print(fmt_row(f"ours {dt} - tutorial {tdt}", {c: ou[c] - tu[c] for c in COLUMNS}))
        for dt, o, t, tdt in pairs:
            od, td = o.get("diagonal"), t.get("diagonal")
            if od and td:
                print(f"  masked diagonal per {TILE}-row query block: ours {dt} "
                      f"{od['per_block']:.0f} ({describe_diag(od)}), tutorial "
                      f"{td['per_block']:.0f} ({describe_diag(td)})")
        for line in [n for dt, o, _, _ in pairs for n in notes(o, f"ours {dt}")] + \
                [n for _, _, t, tdt in pairs[:1] for n in notes(t, f"tutorial {tdt}")]:
            print(line)
        for dt, o, t, tdt in pairs:
            note = "" if tdt == dt else f" (the 3.6 tutorial is {tdt}-only: ours {dt} vs its {tdt})"
            print(f"  main loop ours {dt}/tutorial: "
                  f"{main_total(o, 'fwd') / main_total(t, 'fwd'):.2f}{note}")
    return ratios


def main_total(k, role):
    return k["main"][role]["unmasked"]["per_tile"]["total"]


def describe_diag(d):
    if d["straight_line"]:
        return "straight-line code"
    n = d["masked_loop_trips"]
    return (f"{n:.0f} masked-loop trip{'' if n == 1 else 's'} + {d['around_per_warp']} "
            f"instructions/warp around them")


def tile_dims(k, role):
    """'BLOCK_M x BLOCK_N' (queries x keys) of kernel ``k``'s ``role`` tile."""
    kw = k["kwargs"]
    bm, bn = {"dkdv": ("BLOCK_M1", "BLOCK_N1"), "dq": ("BLOCK_M2", "BLOCK_N2")}.get(
        role, ("BLOCK_M", "BLOCK_N")) if "BLOCK_M1" in kw else ("BLOCK_M", "BLOCK_N")
    return f"{kw[bm]}x{kw[bn]}"


def notes(k, label):
    """Remarks on kernel ``k``'s main loops: redundant tensor-core work, spill traffic."""
    out = []
    for r, m in k["main"].items():
        L = m["unmasked"]
        if L["redundancy"] > 1:
            out.append(f"  note: {label} {ROLE_NAMES[r]}: the main loop's tensor-core work is "
                       f"{L['redundancy']:.2f}x its {tile_dims(k, r)} tile's (part of the tile is "
                       f"computed twice, e.g. by both warpgroups; counted as issued)")
        if L["skippable"]:
            out.append(f"  note: {label} {ROLE_NAMES[r]}: the main loop branches over up to "
                       f"{L['skippable']} of its {L['per_warp']['total']} instructions per warp "
                       f"on some iterations; all are counted")
        if L["per_tile"]["local"]:
            out.append(f"  note: {label} {ROLE_NAMES[r]}: the main loop has "
                       f"{L['per_tile']['local']:.0f} local-memory (spill) instructions per tile "
                       f"(in 'other')")
    return out


def report_backward(ours, anchor, head_dims, dtypes, failed):
    print(f"\n== backward, causal: main (unmasked) loops, warp-instructions per {TILE}x{TILE} tile "
          f"of work (queries x keys); information, not part of the budget ==")
    ratios = {}
    for hd in head_dims:
        print(f"\nhead_dim {hd}")
        for dt in dtypes:
            kv, q = ours.get((hd, dt, "dkdv")), ours.get((hd, dt, "dq"))
            t, tdt = pair_anchor(anchor, hd, dt)
            err = failed.get(("ours", hd, dt))
            why = [w for w in (why_missing(kv, "dkdv", f"ours {dt} dK/dV", err),
                               why_missing(q, "dq", f"ours {dt} dQ", err),
                               why_missing(t, "dkdv", "tutorial dK/dV", None),
                               why_missing(t, "dq", "tutorial dQ", None)) if w]
            if why:
                print("  " + "\n  ".join(why))
                ratios.setdefault(hd, []).append(None)
                continue
            print(kernel_line(kv, f"ours {dt}", "default"))
            print(kernel_line(q, f"ours {dt}", "default"))
            print(kernel_line(t, f"tutorial {tdt}", "its fixed config"))
            print(header())
            total = {}
            for side, by_role in (("ours", {"dkdv": kv, "dq": q}),
                                  ("tutorial", {"dkdv": t, "dq": t})):
                for role, k in by_role.items():
                    L = k["main"][role]["unmasked"]
                    print(fmt_row(f"{side} {ROLE_NAMES[role]} {tile_dims(k, role)}", L["per_tile"]))
                    total[side, role] = L["per_tile"]["total"]
            masked = [f"{side} {ROLE_NAMES[role]} "
                      f"{k['main'][role]['masked']['per_tile']['total']:.0f}"
                      for side, k, role in (("ours", kv, "dkdv"), ("ours", q, "dq"),
                                            ("tutorial", t, "dkdv"), ("tutorial", t, "dq"))
                      if k["main"][role]["masked"]]
            print(f"  masked (diagonal) loops, total per {TILE}x{TILE} tile: "
                  f"{', '.join(masked) or 'none'}")
            for line in notes(kv, f"ours {dt}") + notes(q, f"ours {dt}") + \
                    notes(t, f"tutorial {tdt}"):
                print(line)
            both = ((total["ours", "dkdv"] + total["ours", "dq"])
                    / (total["tutorial", "dkdv"] + total["tutorial", "dq"]))
            note = "" if tdt == dt else f" (the 3.6 tutorial is {tdt}-only: ours {dt} vs its {tdt})"
            print(f"  main loops ours {dt}/tutorial: dK/dV "
                  f"{total['ours', 'dkdv'] / total['tutorial', 'dkdv']:.2f}, dQ "
                  f"{total['ours', 'dq'] / total['tutorial', 'dq']:.2f}, "
                  f"dK/dV + dQ {both:.2f}{note}")
            ratios.setdefault(hd, []).append(both)
    return ratios


def summary_line(ratios, head_dims):
    parts = []
    for hd in head_dims:
        rs = ratios.get(hd) or [None]
        worst = None if any(r is None for r in rs) else max(rs)
        parts.append(f"d{hd} ours/tutorial = " + ("n/a" if worst is None else f"{worst:.2f}"))
    return "sass-budget: " + ", ".join(parts) + " instructions per tile (<= 1.00 meets the budget)"


# ----------------------------------------------------------------------------- --prologue
# One 128-row query block per (batch, head): with BLOCK_M = 128 (the configs compared when this
# was written) every program of the causal forward skips the unmasked loop and runs exactly one
# masked diagonal tile.
PROLOGUE_SHAPE = dict(seq=128, batch=128, heads=16)
PROLOGUE_DTYPE = "fp16"                 # the 3.6 tutorial's only dtype
PTX_DESC_OPS = {"replace": r"\btensormap\.replace\.",
                "release": r"\btensormap\.cp_fenceproxy\.",
                "acquire": r"\bfence\.proxy\.tensormap::generic\.acquire"}
_DESC_LINES = {}


def resolve_source(path, roots, files=()):
    """The file a line-info path names, preferring the copy under one of ``roots`` (longest
    common tail of at least two path components) or one of ``files`` of the same name: Triton's
    cache key is the source, not its path, so a kernel cached from another checkout carries that
    checkout's paths."""
    parts = [p for p in path.split(os.sep) if p]
    for root in roots:
        for n in range(len(parts) - 1, 1, -1):
            cand = os.path.join(root, *parts[-n:])
            if os.path.isfile(cand):
                return cand
    return next((f for f in files if os.path.basename(f) == os.path.basename(path)), path)


def descriptor_lines(path):
    """Lines of ``path`` inside a ``make_tensor_descriptor(...)`` call (``tl.`` or bare name):
    where nvdisasm's line info puts the code of a descriptor made in the kernel. Host-side
    descriptors (kernel arguments) have no such call in the kernel and count 0."""
    if path not in _DESC_LINES:
        lines = set()
        try:
            for n in ast.walk(ast.parse(open(path).read())):
                f = n.func if isinstance(n, ast.Call) else None
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name == "make_tensor_descriptor":
                    lines.update(range(n.lineno, (n.end_lineno or n.lineno) + 1))
        except (OSError, SyntaxError, ValueError):
            pass
        _DESC_LINES[path] = lines
    return _DESC_LINES[path]


def straight_line_tile(ins, lo, hi):
    """(first, last) of the tensor-core work in ins[lo:hi], a stretch outside any loop: from its
    first tensor-core instruction to the warpgroup wait (WARPGROUP.DEPBAR) on its last one (that
    instruction itself for synchronous mma.sync); None if the stretch has none."""
    t = [j for j in range(lo, hi) if classify(ins[j].op) == "hgmma"]
    if not t:
        return None
    wait = next((j for j in range(t[-1], hi) if ins[j].op.startswith("WARPGROUP.DEPBAR")), t[-1])
    return t[0], wait


def fixed_cost(entry, roots, files):
    """Per-program fixed cost of one compiled forward kernel (see the module docstring)."""
    k, kw = entry["kernel"], entry["kwargs"]
    warps = k.metadata.num_warps
    sass, regs, stack = disassemble(k.asm["cubin"])
    ins, labels = parse(sass)
    exits = [j for j, i in enumerate(ins) if i.op == "EXIT" and not i.pred]
    end = exits[-1] if exits else len(ins) - 1
    n = end + 1                                  # the main body; cold stubs after EXIT left out
    loops = tensor_loops(ins, labels)
    in_loop = [False] * n
    for a, b in loops:
        for j in range(a, b + 1):
            in_loop[j] = True
    stretches, j = [], 0                         # maximal runs of code outside the tile loops
    while j < n:
        if in_loop[j]:
            j += 1
            continue
        s = j
        while j < n and not in_loop[j]:
            j += 1
        stretches.append((s, j))
    straight = [w for s, e in stretches for w in [straight_line_tile(ins, s, e)] if w]
    tile = sorted([(a, b, "loop") for a, b in loops] + [(a, b, "straight") for a, b in straight])
    problems = []
    if "ttg.warp_specialize" in k.asm.get("ttgir", ""):
        problems.append("warp-specialised kernel: per-warp counts do not add up")
    if not tile:
        problems.append("no tensor-core instructions in the main body")
    first = tile[0][0] if tile else n
    last = tile[-1][1] if tile else n - 1
    in_tile = [False] * n
    for a, b, _ in tile:
        for j in range(a, b + 1):
            in_tile[j] = True
    sections = dict(prologue=list(range(0, first)),
                    between=[j for j in range(first, last + 1) if not in_tile[j]],
                    epilogue=list(range(last + 1, n)))
    fixed = sections["prologue"] + sections["between"] + sections["epilogue"]
    desc = [j for j in range(n) if ins[j].src and ins[j].src[1] in
            descriptor_lines(resolve_source(ins[j].src[0], roots, files))]
    ptx = k.asm.get("ptx", "")
    ops = {name: len(re.findall(rx, ptx)) for name, rx in PTX_DESC_OPS.items()}
    loop_len = sum(b - a + 1 for a, b in loops)
    straight_len = sum(b - a + 1 for a, b in straight)
    rows = kw.get("BLOCK_M") or TILE             # per 128 query rows = per program at BLOCK_M 128

    def counts(idx):
        c = tally([ins[j] for j in idx])
        return {col: c[col] for col in COLUMNS if c[col]}
    return dict(
        side=entry["side"], head_dim=entry["head_dim"], dtype=entry["dtype"], kernel=entry["fn"],
        kwargs=kw, config=cfg_str(kw), kept=entry.get("kept"), warps=warps, regs=regs,
        stack=stack, smem=k.metadata.shared, problems=problems,
        global_scratch=int(getattr(k.metadata, "global_scratch_size", 0) or 0),
        main_body=n, loops=[dict(first=a, last=b, length=b - a + 1) for a, b in loops],
        straight_line_tiles=[dict(first=a, last=b, length=b - a + 1) for a, b in straight],
        prologue=len(sections["prologue"]), between=len(sections["between"]),
        epilogue=len(sections["epilogue"]), straight_line=straight_len,
        around=n - loop_len, fixed=len(fixed),
        fixed_per_program=round(len(fixed) * warps * TILE / rows),
        descriptor_creation=len(desc),
        descriptor_in_fixed=sum(not in_tile[j] for j in desc),
        descriptor_source=sorted(collections.Counter(
            f"{os.path.basename(ins[j].src[0])}:{ins[j].src[1]}" for j in desc).items()),
        ptx_tensormap=ops, fences=ops["release"] + ops["acquire"],
        by_class={name: counts(idx) for name, idx in sections.items()}
        | {"fixed": counts(fixed), "descriptor_creation": counts(desc)},
        utmacctl=sum(ins[j].op.startswith("UTMACCTL") for j in range(n)))


def prologue_table(hd, rows, failed):
    s = PROLOGUE_SHAPE
    print(f"\nhead_dim {hd}: causal {PROLOGUE_DTYPE}, B{s['batch']} H{s['heads']} S{s['seq']} "
          f"(one masked diagonal tile per program); static SASS instructions per warp,\n"
          f"fixed/prog = fixed x num_warps x {TILE}/BLOCK_M (CTA-wide, per {TILE} query rows)")
    for side in ("ours", "tutorial"):
        r = rows.get(side)
        if r is None:
            print(f"  {side}: did not compile ({failed.get((side, hd)) or 'no forward kernel'})")
            continue
        loops = ", ".join(f"{L['length']}" for L in r["loops"]) or "none"
        sl = ", ".join(f"{L['length']}" for L in r["straight_line_tiles"]) or "none"
        how = (f"default = 1st of {len(r['kept'])} kept" if r["side"] == "ours" and r["kept"]
               else ("default" if r["side"] == "ours" else "best-known"))
        print(f"  {side:<9}{r['kernel']} {r['config']} ({how}): {r['regs']} regs, smem "
              f"{r['smem']} B; main body {r['main_body']}; tile loops {loops}; straight-line "
              f"tile code {sl}")
        for p in r["problems"]:
            print(f"  {side:<9}not measured: {p}")
    cols = [("prologue", 9), ("between", 8), ("epilogue", 9), ("around", 7), ("sl-tile", 8),
            ("fixed", 6), ("fixed/prog", 11), ("desc", 6), ("fences", 7), ("scratch", 8)]
    print("  " + " " * 9 + "".join(f"{c:>{w}}" for c, w in cols))
    for side in ("ours", "tutorial"):
        r = rows.get(side)
        if r is None or r["problems"]:
            continue
        t = r["ptx_tensormap"]
        vals = [r["prologue"], r["between"], r["epilogue"], r["around"], r["straight_line"],
                r["fixed"], r["fixed_per_program"], r["descriptor_creation"],
                f"{t['release']}+{t['acquire']}", f"{r['global_scratch']}B"]
        print("  " + f"{side:<9}" + "".join(f"{v:>{w}}" for v, (_, w) in zip(vals, cols)))
    for side in ("ours", "tutorial"):
        r = rows.get(side)
        if r and not r["problems"] and r["descriptor_creation"]:
            t = r["ptx_tensormap"]
            src = ", ".join(f"{f} ({c})" for f, c in r["descriptor_source"])
            print(f"  {side}: in-kernel descriptors: {r['descriptor_creation']} instructions/warp "
                  f"from {src} ({r['descriptor_in_fixed']} of them in the fixed code); PTX "
                  f"tensormap.replace {t['replace']}, cp_fenceproxy (release) {t['release']}, "
                  f"fence.proxy.tensormap acquire {t['acquire']}; global scratch "
                  f"{r['global_scratch']} B/program")


def prologue_summary(per_hd, head_dims):
    parts, fences = [], {"ours": None, "tutorial": None}
    for hd in head_dims:
        o, t = (per_hd.get(hd, {}).get(s) for s in ("ours", "tutorial"))
        ok = [r if r and not r["problems"] else None for r in (o, t)]
        a, b = (str(r["fixed_per_program"]) if r else "n/a" for r in ok)
        ratio = f"{ok[0]['fixed_per_program'] / ok[1]['fixed_per_program']:.2f}x" \
            if all(ok) and ok[1]["fixed_per_program"] else "n/a"
        parts.append(f"d{hd} ours {a} vs tutorial {b} ({ratio})")
        for side, r in zip(("ours", "tutorial"), ok):
            if r:
                fences[side] = max(fences[side] or 0, r["fences"])
    f = {s: "n/a" if v is None else str(v) for s, v in fences.items()}
    return (f"sass-prologue: {', '.join(parts)}; in-kernel descriptor fences ours {f['ours']}, "
            f"tutorial {f['tutorial']}")


def main_prologue(a, head_dims):
    import triton
    t0 = time.time()
    comp = Compiler(os.path.abspath(a.cache_dir))
    project, anchor = os.path.abspath(a.project), os.path.abspath(a.anchor)
    s = PROLOGUE_SHAPE
    shape = ["--seq", str(s["seq"]), "--batch", str(s["batch"]), "--heads", str(s["heads"])]
    entries = []
    for hd in head_dims:
        entries += comp.project(project, "fwd", PROLOGUE_DTYPE, hd, shape)
        entries += comp.anchor_forward(anchor, PROLOGUE_DTYPE, hd, shape)
    if a.verbose:
        print("".join(comp.log), file=sys.stderr)
    per_hd, failed, extra, compiled = {}, {}, [], {}
    for e in entries:
        if e["kernel"] is None:
            failed.setdefault((e["side"], e["head_dim"]), f"{e['fn']}: {e['error']}")
        else:
            compiled.setdefault((e["side"], e["head_dim"]), []).append(e)
    for (side, hd), es in compiled.items():
        # The forward kernel: by name, else the launch's only (or first) compiled kernel.
        pick = next((e for e in es if role_of(e["fn"]) == "fwd"), es[0])
        extra += [f"{side} d{hd}: the launch also compiled {e['fn']} (not counted)"
                  for e in es if e is not pick]
        per_hd.setdefault(hd, {})[side] = fixed_cost(pick, [project], [anchor])
    print(f"sass_budget --prologue: project {project}, anchor {anchor}; triton "
          f"{triton.__version__} for sm_90a, compiled/analysed in {time.time() - t0:.0f} s")
    print("  fixed = prologue + between + epilogue = the main body minus the tile code (loop\n"
          "  bodies with tensor-core ops; straight-line tensor-core code from its first\n"
          "  tensor-core op to the wait on its last: sl-tile); around = main body minus loop\n"
          "  bodies (all a seq-128 program runs besides its masked tile's loop body); desc =\n"
          "  instructions of make_tensor_descriptor calls; fences = PTX tensormap\n"
          "  release+acquire per kernel; scratch = global scratch per program")
    for line in extra:
        print(line)
    for hd in head_dims:
        prologue_table(hd, per_hd.get(hd, {}), failed)
    line = prologue_summary(per_hd, head_dims)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(project=project, anchor=anchor, triton=triton.__version__,
                           shape=PROLOGUE_SHAPE, dtype=PROLOGUE_DTYPE, summary=line,
                           failed={f"{k[0]} d{k[1]}": v for k, v in failed.items()},
                           kernels=[{k: v for k, v in r.items() if k != "kwargs"}
                                    | {"config": r["kwargs"]}
                                    for hd in head_dims for r in per_hd.get(hd, {}).values()]),
                      f, indent=1, default=str)
    print()
    print(line)
    if a.check:
        pairs = [tuple(per_hd.get(hd, {}).get(s) for s in ("ours", "tutorial"))
                 for hd in head_dims]
        if any(o is None or t is None or o["problems"] or t["problems"] for o, t in pairs):
            sys.exit(2)
        sys.exit(0 if all(o["fixed_per_program"] <= t["fixed_per_program"]
                          for o, t in pairs) else 1)


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for what the numbers mean.")
    ap.add_argument("--project", required=True, help="the repository's root (has kernels/)")
    ap.add_argument("--tutorial", "--anchor", dest="anchor", metavar="PATH",
                    help="the Triton 3.6 tutorial's 06-fused-attention.py (not in this "
                         "repository)")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--dtypes", default="fp16,bf16", help="the project's dtypes")
    ap.add_argument("--no-backward", action="store_true", help="forward only (faster)")
    ap.add_argument("--cache-dir", default=os.environ.get("TRITON_CACHE_DIR", os.path.join(
        os.path.expanduser("~"), ".cache", "sass-budget-cache")))
    ap.add_argument("--json", help="also write every number here")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless every forward ratio is <= 1.00 (with --prologue: unless "
                         "ours' fixed cost <= the tutorial's at every head_dim); 2: not measurable")
    ap.add_argument("--verbose", action="store_true", help="print sm90_static's output too")
    ap.add_argument("--prologue", action="store_true",
                    help="per-program fixed cost at B128 H16 S128 fp16 instead (see the docstring)")
    a = ap.parse_args()
    if not a.anchor:
        print("sass_budget: the Triton tutorial: not given (--tutorial PATH); nothing to compare "
              "against", file=sys.stderr)
        return 2
    ensure_triton36()
    import triton
    head_dims = [int(x) for x in a.head_dims.split(",") if x.strip()]
    dtypes = [x.strip() for x in a.dtypes.split(",") if x.strip()]
    for hd in head_dims:
        if hd not in ANCHOR_FWD:
            ap.error(f"no best-known tutorial config for head_dim {hd} (have {sorted(ANCHOR_FWD)})")
    if a.prologue:
        return main_prologue(a, head_dims)
    t0 = time.time()
    comp = Compiler(os.path.abspath(a.cache_dir))
    project, anchor = os.path.abspath(a.project), os.path.abspath(a.anchor)
    entries = []
    for hd in head_dims:
        for dt in dtypes:
            entries += comp.project(project, "fwd", dt, hd)
            if not a.no_backward:
                entries += comp.project(project, "bwd", dt, hd)
        for dt in dict.fromkeys(dtypes + ["fp16"]):
            entries += comp.anchor_forward(anchor, dt, hd)
            if not a.no_backward:
                entries += comp.anchor_backward(anchor, dt, hd)
    if a.verbose:
        print("".join(comp.log), file=sys.stderr)

    ours_f, anchor_f, ours_b, anchor_b, failed, results = {}, {}, {}, {}, {}, []
    for e in entries:
        if e["kernel"] is None:
            failed.setdefault((e["side"], e["head_dim"], e["dtype"]), f"{e['fn']}: {e['error']}")
            continue
        if "preprocess" in e["fn"]:
            continue
        r = analyse(e)
        results.append(r)
        key = (r["head_dim"], r["dtype"])
        if r["side"] == "ours":
            role = role_of(r["kernel"])
            (ours_f if role == "fwd" else ours_b)[key if role == "fwd" else key + (role,)] = r
        else:
            (anchor_f if r["kernel"] == "_attn_fwd" else anchor_b)[key] = r

    print(f"sass_budget: project {project}, anchor {anchor}; triton {triton.__version__} for "
          f"sm_90a, compiled/analysed in {time.time() - t0:.0f} s")
    for (side, hd, dt), msg in sorted(failed.items()):
        if side == "tutorial" and dt != "fp16":
            print(f"tutorial {dt} d{hd}: does not compile (its kernels are fp16-only): {msg[:100]}")
        else:
            print(f"{side} {dt} d{hd}: does not compile: {msg[:160]}")
    print()
    ratios = report_forward(ours_f, anchor_f, head_dims, dtypes, failed)
    bwd = {} if a.no_backward else report_backward(ours_b, anchor_b, head_dims, dtypes,
                                                          failed)
    line = summary_line(ratios, head_dims)
    if a.json:
        def clean(r):
            return {k: v for k, v in r.items() if k != "kwargs"} | {"config": r["kwargs"]}
        with open(a.json, "w") as f:
            json.dump(dict(project=project, anchor=anchor, triton=triton.__version__,
                           tile=TILE, seq=SEQ, batch=BATCH, heads=HEADS,
                           forward_ratios=ratios, backward_ratios=bwd, summary=line,
                           failed={" ".join(map(str, k)): v for k, v in failed.items()},
                           kernels=[clean(r) for r in results]), f, indent=1, default=str)
    print()
    print(line)
    if a.check:
        flat = [r for hd in head_dims for r in (ratios.get(hd) or [None])]
        if any(r is None for r in flat):
            sys.exit(2)
        sys.exit(0 if all(round(r, 2) <= 1.00 for r in flat) else 1)


if __name__ == "__main__":
    sys.exit(main())
