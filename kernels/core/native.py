"""The kernels' dropout mask on the CPU, compiled: Philox-4x32-10 in a few lines of C.

The CPU fallback draws the kernels' own mask (kernels/core/dropout.py) so that a CPU run and a
GPU run of one seed drop the same weights. In PyTorch ops that costs ~100 tensor ops per
Philox call (~40-90 ns per 4 weights on one thread), in NumPy about half of that: at the book's
sizes it was most of what a small call with dropout cost (8 x 2 heads x 64 x 64: ~0.4 ms of
a ~1.4 ms forward). The C loop below draws and compares in one pass, 8 counters per vector,
writing each decision where the caller's mask wants it, as a byte or as the fp32 mask already
scaled by 1 / (1 - p): 0.08 ms there (NumPy 0.45, PyTorch 0.65; one thread).

It is built on first use with the system's C compiler (``$CC``, else ``cc``), as Triton
builds its own launchers, for this machine's CPU (``-march=native``, so the file's name holds
the CPU's identity), into ``$KERNELS_CACHE_DIR`` (default ``~/.cache/fused-causal-attention``),
and loaded with ctypes. Without a compiler, on a failed build, or with ``KERNELS_NATIVE=0``,
:func:`keep_fn` returns None and callers use the PyTorch / NumPy twin
(``dropout.philox_words``): the same bits (tests/core/test_fallback_philox.py checks all three
against each other), slower.
"""
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

# GCC / Clang vector extensions: 8 counters per step (AVX-512 or AVX2 where -march=native
# finds them, plain scalar code elsewhere). Words are kept in 64-bit lanes: a uint32 times a
# 32-bit constant fits, ``>> 32`` is the Philox round's high half and ``& M`` its low half.
_SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef uint64_t u64x8 __attribute__((vector_size(64)));
#define LANES 8

/* For each counter i: the four words of tl.randint4x(seed, counter[i]) (Philox-4x32-10, key =
   the seed's two halves, counter = (lo, hi, 0, 0)); element w of 4-element group slot[i] (i
   when slot is NULL) of out = (word w >= bound) == keep: a byte 0 / 1, or with as_float a
   float, value where that holds and 0 elsewhere. */
void philox_keep(uint64_t seed, const int64_t *counter, int64_t n, uint32_t bound,
                 const int64_t *slot, int keep, void *out, int as_float, float value) {
    const uint64_t M = 0xFFFFFFFFu;
    for (int64_t base = 0; base < n; base += LANES) {
        int64_t m = n - base < LANES ? n - base : LANES;
        uint64_t lanes[LANES] = {0};
        memcpy(lanes, counter + base, (size_t)m * sizeof(uint64_t));
        u64x8 c;
        memcpy(&c, lanes, sizeof(c));
        u64x8 c0 = c & M, c1 = c >> 32, c2 = c0 ^ c0, c3 = c2;
        uint64_t k0 = seed & M, k1 = seed >> 32;
        for (int r = 0; r < 10; ++r) {
            u64x8 pa = c0 * 0xD2511F53u, pb = c2 * 0xCD9E8D57u;
            u64x8 n0 = (pb >> 32) ^ c1 ^ k0;
            u64x8 n2 = (pa >> 32) ^ c3 ^ k1;
            c1 = pb & M;
            c3 = pa & M;
            c0 = n0;
            c2 = n2;
            k0 = (k0 + 0x9E3779B9u) & M;
            k1 = (k1 + 0xBB67AE85u) & M;
        }
        uint64_t w[4][LANES];
        memcpy(w[0], &c0, sizeof(c0));
        memcpy(w[1], &c1, sizeof(c1));
        memcpy(w[2], &c2, sizeof(c2));
        memcpy(w[3], &c3, sizeof(c3));
        for (int64_t j = 0; j < m; ++j) {
            int64_t g = 4 * (slot ? slot[base + j] : base + j);
            for (int q = 0; q < 4; ++q) {
                int hit = (w[q][j] >= bound) == (keep != 0);
                if (as_float)
                    ((float *)out)[g + q] = hit ? value : 0.0f;
                else
                    ((uint8_t *)out)[g + q] = (uint8_t)hit;
            }
        }
    }
}
"""
_FLAG_SETS = (["-O3", "-march=native"], ["-O3"])   # the second where the first fails
_LOCK = threading.Lock()
_STATE = {}   # "fn": the loaded function or None, once decided


def _cpu_identity():
    """What ``-march=native`` depends on: the CPU's model and feature flags (Linux), else the
    platform's description."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(dict.fromkeys(lines))   # the first CPU's (all are alike)
    except OSError:
        return platform.platform() + platform.processor()


def cache_dir():
    """Where the built library goes: ``$KERNELS_CACHE_DIR``, else ``~/.cache/
    fused-causal-attention`` (``$XDG_CACHE_HOME`` respected)."""
    root = os.environ.get("KERNELS_CACHE_DIR")
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fused-causal-attention")


def _build(compiler):
    """Path of the built library (built now unless a previous build for this source, compiler
    and CPU is there), or None when every flag set failed."""
    key = hashlib.sha256("\0".join([_SOURCE, compiler, _cpu_identity(), platform.machine()])
                         .encode()).hexdigest()[:16]
    directory = cache_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"philox-{key}.so")
    if os.path.exists(path):
        return path
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src = os.path.join(tmp, "philox.c")
        with open(src, "w", encoding="utf-8") as f:
            f.write(_SOURCE)
        for flags in _FLAG_SETS:
            built = os.path.join(tmp, "philox.so")
            cmd = [compiler, *flags, "-shared", "-fPIC", "-std=c99", "-o", built, src]
            try:
                run = subprocess.run(cmd, capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError):
                return None
            if run.returncode == 0:
                os.replace(built, path)   # atomic: a concurrent builder wrote the same bytes
                return path
    return None


def _load():
    if os.environ.get("KERNELS_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc") \
        or shutil.which("clang")
    if compiler is None:
        return None
    try:
        path = _build(compiler)
        if path is None:
            return None
        fn = ctypes.CDLL(path).philox_keep
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_float]
    fn.restype = None
    return fn


def keep_fn():
    """The compiled ``philox_keep`` (C signature in ``_SOURCE``), or None where it cannot be
    had (see the module docstring). Built or loaded once per process."""
    if "fn" not in _STATE:
        with _LOCK:
            if "fn" not in _STATE:
                _STATE["fn"] = _load()
    return _STATE["fn"]


def draw_keep(seed, counter, bound, out, slot=None, keep=True, value=None):
    """Write the keep (``keep=True``) or drop decisions of the Philox words of ``counter``
    into ``out``; False when the compiled loop is not available (nothing written).

    Args:
        seed: int in [0, 2**63).
        counter: contiguous int64 CPU tensor (n,) of counters in [0, 2**63).
        bound: ``dropout_threshold(p) << 8``: word w keeps its weight iff w >= bound.
        out: contiguous bool / uint8 CPU tensor, or float32 with ``value``: element 4 * g + w
            is word w of the counter put in group g (a byte 0 / 1, or ``value`` / 0).
        slot: optional contiguous int64 CPU tensor (n,): counter i's group (default i).
        value: a float: ``out`` is float32 and gets ``value`` where the decision holds (the
            dropout mask with its 1 / (1 - p) scale, in one pass).
    """
    fn = keep_fn()
    if fn is None:
        return False
    n = counter.numel()
    assert counter.dtype.itemsize == 8 and counter.is_contiguous() and out.is_contiguous()
    assert out.element_size() == (1 if value is None else 4)
    assert slot is None or slot.numel() == n
    # The loop writes through raw pointers: a tensor off the CPU (a meta buffer made on a
    # default device) would crash the process, not raise.
    assert all(t.device.type == "cpu" for t in (counter, out) + (() if slot is None else (slot,)))
    if n:
        fn(int(seed), counter.data_ptr(), n, int(bound),
           None if slot is None else slot.data_ptr(), int(bool(keep)), out.data_ptr(),
           int(value is not None), 0.0 if value is None else float(value))
    return True
