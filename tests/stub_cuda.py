"""Triton's compiled (non-interpreter) launch path on a machine without a GPU, for tests.

Only what needs a GPU is replaced; Triton's own launch code runs as on a GPU host:
    * ``libcuda.so.1`` is a stub (``STUB_C``, built here with gcc) whose calls return at once;
      its ``cuLaunchKernelEx`` records each launch: the function handle, stream, grid, block,
      dynamic shared memory, launch attributes and every kernel parameter's bytes (the
      parameter sizes of each function handle are registered by the fake compile below,
      since ``cuLaunchKernelEx`` receives only pointers to the values).
    * ``triton.runtime.driver.active`` is a stand-in CUDA driver (target sm_90, device 0, a
      fixed non-zero stream); its ``utils`` (the launcher module of Triton >= 3.8) is Triton's
      real ``CudaUtils``, built against the stub.
    * ``JITFunction._do_compile`` makes, instead of a compiled kernel, a stand-in whose ``run``
      is Triton's real ``CudaLauncher`` (its generated C launcher in 3.6, its generic C launcher
      in 3.8+), with a distinct function handle and shared-memory size per variant. Global
      scratch per program: 128 bytes per in-kernel tensor descriptor of the variant's TTIR
      (Triton's real front end), as Triton gives them on sm_90, so launches that need scratch
      call the caller's allocator as on a GPU.
    * ``Autotuner._bench`` returns a constant: the autotuner keeps its first config.

Nothing is computed: kernels' outputs stay as allocated. Use in a fresh process whose
environment ``stub_env`` made (LD_LIBRARY_PATH is read at process start), before anything
launches a kernel.
"""
import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import types

TARGET_CC = 90
STREAM = 0x5EED0          # the stand-in driver's current stream: a launch must pass this one
SCRATCH_PER_DESCRIPTOR = 128
MAX_PARAMS = 256          # per kernel, as the stub's tables hold them
RECORD_BYTES = 4096       # parameter bytes recorded per launch
RECORDS = 1024            # launches kept (a ring: read them before more are made)

STUB_C = r"""
#include <stdint.h>
#include <string.h>
typedef int CUresult;
/* cuda.h's CUlaunchConfig */
typedef struct {
  unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  void *hStream; void *attrs; unsigned int numAttrs;
} LaunchConfig;

#define HANDLES 4096
#define MAX_PARAMS %(MAX_PARAMS)d
#define RECORD_BYTES %(RECORD_BYTES)d
#define RECORDS %(RECORDS)d

typedef struct {
  uint64_t function, stream;
  uint32_t grid[3], block[3], shared, num_attrs;
  int32_t nbytes;   /* -1: no sizes registered for the handle; -2: more than RECORD_BYTES */
  uint8_t bytes[RECORD_BYTES];
} StubLaunch;

static int n_params[HANDLES];
static int param_size[HANDLES][MAX_PARAMS];
StubLaunch stub_launches[RECORDS];
long stub_count = 0;

int stub_set_params(long h, int n, const int *sizes) {
  if (h < 0 || h >= HANDLES || n < 0 || n > MAX_PARAMS) return -1;
  for (int i = 0; i < n; i++) param_size[h][i] = sizes[i];
  n_params[h] = n;
  return 0;
}

CUresult cuLaunchKernelEx(const LaunchConfig *config, void *f, void **params, void **extra) {
  StubLaunch *r = &stub_launches[stub_count %% RECORDS];
  uintptr_t h = (uintptr_t)f;
  r->function = h;
  r->stream = (uint64_t)(uintptr_t)config->hStream;
  r->grid[0] = config->gridDimX; r->grid[1] = config->gridDimY; r->grid[2] = config->gridDimZ;
  r->block[0] = config->blockDimX; r->block[1] = config->blockDimY;
  r->block[2] = config->blockDimZ;
  r->shared = config->sharedMemBytes;
  r->num_attrs = config->numAttrs;
  r->nbytes = -1;
  if (h < HANDLES && n_params[h] > 0) {
    int off = 0;
    for (int i = 0; i < n_params[h]; i++) {
      int s = param_size[h][i];
      if (off + s > RECORD_BYTES) { off = -2; break; }
      memcpy(r->bytes + off, params[i], s);
      off += s;
    }
    r->nbytes = off;
  }
  stub_count++;
  return 0;
}

/* The rest of what Triton's launchers and utils module link: return at once. */
CUresult cuCtxGetCurrent(void **p) { *p = (void *)1; return 0; }
CUresult cuCtxSetCurrent(void *p) { return 0; }
CUresult cuCtxGetDevice(int *d) { *d = 0; return 0; }
CUresult cuCtxGetLimit(size_t *v, int l) { *v = 0; return 0; }
CUresult cuCtxSetLimit(int l, size_t v) { return 0; }
CUresult cuDeviceGet(int *d, int o) { *d = 0; return 0; }
CUresult cuDeviceGetAttribute(int *v, int a, int d) { *v = 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **p, int d) { *p = (void *)1; return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return 0; }
CUresult cuFuncGetAttribute(int *v, int a, void *f) { *v = 0; return 0; }
CUresult cuFuncSetAttribute(void *f, int a, int v) { return 0; }
CUresult cuFuncSetCacheConfig(void *f, int c) { return 0; }
CUresult cuGetErrorString(int e, const char **s) { *s = "stub libcuda"; return 0; }
CUresult cuModuleGetFunction(void **f, void *m, const char *n) { *f = (void *)1; return 0; }
CUresult cuModuleLoadData(void **m, const void *img) { *m = (void *)1; return 0; }
CUresult cuModuleUnload(void *m) { return 0; }
CUresult cuOccupancyMaxActiveClusters(int *n, void *f, const void *c) { *n = 1; return 0; }
/* A pointer argument's device address is the host address: CPU tensors stand in. */
CUresult cuPointerGetAttribute(void *data, int attr, uint64_t ptr) {
  *(uint64_t *)data = ptr; return 0; }
CUresult cuPointerGetAttributes(unsigned n, int *a, void **d, uint64_t p) { return 0; }
CUresult cuStreamIsCapturing(void *s, int *st) { *st = 0; return 0; }
CUresult cuTensorMapEncodeTiled(void *m, int t, unsigned r, void *g, const uint64_t *s,
                                const uint64_t *st, const unsigned *b, const unsigned *e,
                                int i, int sw, int l2, int oob) { return 0; }
CUresult cuTensorMapEncodeIm2col(void *m) { return 0; }
""" % dict(MAX_PARAMS=MAX_PARAMS, RECORD_BYTES=RECORD_BYTES, RECORDS=RECORDS)


class StubUnavailable(Exception):
    """The stub cannot be built or installed here (the message says why)."""


def build(directory):
    """Build the stub ``libcuda.so.1`` (and the ``libcuda.so`` link Triton's builds use) in
    ``directory``; returns it. Raises StubUnavailable without a C compiler."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise StubUnavailable("no C compiler (gcc or $CC) to build the stub libcuda")
    tag = hashlib.sha256(STUB_C.encode()).hexdigest()[:12]
    d = os.path.join(directory, f"stubcuda-{tag}")
    lib = os.path.join(d, "libcuda.so.1")
    if not os.path.exists(lib):
        os.makedirs(d, exist_ok=True)
        src = os.path.join(d, "stub.c")
        with open(src, "w") as f:
            f.write(STUB_C)
        r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1",
                            "-o", lib + ".tmp", src], capture_output=True, text=True,
                           timeout=120)
        if r.returncode:
            raise StubUnavailable(f"building the stub libcuda with {cc} failed:\n{r.stderr}")
        os.replace(lib + ".tmp", lib)
    link = os.path.join(d, "libcuda.so")
    if not os.path.lexists(link):
        os.symlink("libcuda.so.1", link)
    return d


def stub_env(stub_dir, cache_dir, env=None):
    """The environment of a process that runs Triton's compiled path on the stub: no
    interpreter, the stub first in the loader's path and Triton's, a private Triton cache
    (launchers built here are linked against the stub)."""
    env = dict(os.environ if env is None else env)
    env["TRITON_INTERPRET"] = "0"
    env["LD_LIBRARY_PATH"] = stub_dir + (":" + env["LD_LIBRARY_PATH"]
                                         if env.get("LD_LIBRARY_PATH") else "")
    env["TRITON_LIBCUDA_PATH"] = stub_dir
    env["TRITON_CACHE_DIR"] = cache_dir
    env["CUDA_VISIBLE_DEVICES"] = ""      # a CUDA build of torch must not find a real GPU
    return env


# Bytes of a kernel parameter of each Triton type (the kernel ABI: the launchers store
# floats in their own width).
_SIZES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "fp16": 2, "bf16": 2,
          "i32": 4, "u32": 4, "fp32": 4, "f32": 4, "i64": 8, "u64": 8, "fp64": 8}


def flat_types(signature_values):
    """The signature's parameter types in launch order: tuples flattened, constexprs kept
    (as "constexpr"), as the launchers walk them."""
    out = []
    for ty in signature_values:
        if isinstance(ty, tuple):
            out.extend(flat_types(ty))
        else:
            out.append(ty)
    return out


def param_size(ty):
    if ty.startswith("*"):
        return 8
    if ty in _SIZES:
        return _SIZES[ty]
    raise StubUnavailable(f"parameter type {ty!r} (host tensor descriptors and other types "
                          f"are not handled by the stub)")


def pack(ty, value):
    """The bytes a launcher passes for ``value`` as a parameter of type ``ty``."""
    if ty.startswith("*"):
        ptr = 0 if value is None else value if isinstance(value, int) else value.data_ptr()
        return struct.pack("<Q", ptr)
    if ty in ("fp32", "f32"):
        return struct.pack("<f", value)
    if ty == "fp64":
        return struct.pack("<d", value)
    if ty == "fp16":
        return struct.pack("<e", value)
    if ty == "bf16":
        return struct.pack("<f", value)[2:]
    n = _SIZES[ty]
    return (int(value) & ((1 << (8 * n)) - 1)).to_bytes(n, "little")


class _Launch(ctypes.Structure):
    _fields_ = [("function", ctypes.c_uint64), ("stream", ctypes.c_uint64),
                ("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3),
                ("shared", ctypes.c_uint32), ("num_attrs", ctypes.c_uint32),
                ("nbytes", ctypes.c_int32), ("bytes", ctypes.c_uint8 * RECORD_BYTES)]


class Stub:
    """The installed stubs: ``launches()`` counts the stub's launches, ``records(since)``
    reads them, ``variants[handle]`` describes each fake-compiled variant (kernel name, its
    ASTSource, parameter types and sizes, scratch)."""

    def __init__(self, stub_dir):
        import torch
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia import driver as nv_driver
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        self.lib = lib = ctypes.CDLL(os.path.join(stub_dir, "libcuda.so.1"))
        lib.stub_set_params.argtypes = [ctypes.c_long, ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_int)]
        self._count = ctypes.c_long.in_dll(lib, "stub_count")
        self._ring = (_Launch * RECORDS).in_dll(lib, "stub_launches")
        self.variants = [None]          # handle -> dict; handle 0 unused
        self.ttir_failures = []
        target = GPUTarget("cuda", TARGET_CC, 32)
        stub = self

        class StubDriver:
            """What Triton's runtime asks of ``triton.runtime.driver.active``."""
            launcher_cls = nv_driver.CudaLauncher

            def __init__(self):
                self._utils = None

            @property
            def utils(self):    # Triton >= 3.8 launches through it: built on first use
                if self._utils is None:
                    self._utils = nv_driver.CudaUtils()
                return self._utils

            def get_current_target(self):
                return target

            def get_current_device(self):
                return 0

            def set_current_device(self, device):
                pass

            def get_current_stream(self, device=None):
                return STREAM

            def get_active_torch_device(self):
                return torch.device("cpu")

            def get_device_interface(self):
                return torch.cuda

            def is_active(self):
                return True

            def map_python_to_cpp_type(self, ty):
                return nv_driver.ty_to_cpp(ty)

        triton.runtime.driver.set_active(StubDriver())

        def do_compile(fn, key, signature, device, constexprs, options, attrs, warmup):
            kernel_cache, _, tgt, backend, _ = fn.device_caches[device]
            src = fn.ASTSource(fn, signature, constexprs, attrs)
            handle = len(stub.variants)
            types_ = [t for t in flat_types(src.signature.values()) if t != "constexpr"]
            sizes = [param_size(t) for t in types_] + [8, 8]   # + global, profile scratch
            if len(sizes) > MAX_PARAMS or sum(sizes) > RECORD_BYTES:
                raise StubUnavailable(f"{fn.__name__}: {len(sizes)} parameters, "
                                      f"{sum(sizes)} bytes: more than the stub records")
            arr = (ctypes.c_int * len(sizes))(*sizes)
            if lib.stub_set_params(handle, len(sizes), arr) != 0:
                raise StubUnavailable("more kernel variants than the stub has handles")
            n_desc = stub._descriptors(fn, src, tgt, backend, options)
            meta = types.SimpleNamespace(
                num_ctas=getattr(options, "num_ctas", 1), num_warps=options.num_warps,
                shared=1024 * handle,     # distinct per variant, so a mix-up shows
                global_scratch_size=SCRATCH_PER_DESCRIPTOR * n_desc,
                global_scratch_align=SCRATCH_PER_DESCRIPTOR,
                profile_scratch_size=0, profile_scratch_align=1,
                launch_cooperative_grid=False, launch_pdl=False, tensordesc_meta=None,
                instrumentation_mode="", warp_size=32, target=tgt, name=fn.__name__)
            kernel = _FakeKernel(fn.__name__, src, meta, handle, backend.pack_metadata(meta))
            stub.variants.append(dict(kernel=fn.__name__, src=src, types=types_, sizes=sizes,
                                      scratch=meta.global_scratch_size,
                                      num_warps=options.num_warps))
            kernel_cache[key] = kernel
            return kernel

        def bench(tuner, *args, config, **meta):
            return [1.0, 1.0, 1.0]

        JITFunction._do_compile = do_compile
        Autotuner._bench = bench

    def _descriptors(self, fn, src, target, backend, options):
        """In-kernel tensor descriptors (tt.make_tensor_descriptor) in the variant's TTIR."""
        try:
            from triton._C.libtriton import ir
            ctx = ir.context()
            ir.load_dialects(ctx)
            backend.load_dialects(ctx)
            mod = src.make_ir(target, options, backend.get_codegen_implementation(options),
                              backend.get_module_map(), ctx)
            stages = {}
            backend.add_stages(stages, options, src.language)
            return str(stages["ttir"](mod, {})).count("tt.make_tensor_descriptor")
        except Exception as e:   # noqa: BLE001 - reported by the caller
            self.ttir_failures.append(f"{fn.__name__}: {type(e).__name__}: "
                                      f"{str(e).strip().splitlines()[-1:]}")
            return 0

    def launches(self):
        return self._count.value

    def records(self, since):
        """The launches made since ``launches()`` was ``since``: dicts with handle, stream,
        grid, block, shared, num_attrs and the parameter bytes split per parameter."""
        now = self._count.value
        if now - since > RECORDS:
            raise AssertionError(f"{now - since} launches since the last read: more than the "
                                 f"stub's ring of {RECORDS} holds")
        out = []
        for i in range(since, now):
            r = self._ring[i % RECORDS]
            h = int(r.function)
            if r.nbytes < 0:
                raise AssertionError(f"launch {i} of handle {h}: no parameter sizes known "
                                     f"({r.nbytes})")
            raw = bytes(r.bytes[:r.nbytes])
            params, off = [], 0
            for s in self.variants[h]["sizes"]:
                params.append(raw[off:off + s])
                off += s
            out.append(dict(handle=h, kernel=self.variants[h]["kernel"], stream=int(r.stream),
                            grid=tuple(r.grid), block=tuple(r.block), shared=int(r.shared),
                            num_attrs=int(r.num_attrs), params=params))
        return out


class _FakeKernel:
    """Stands for a CompiledKernel: Triton's real CudaLauncher as ``run`` (on the stub)."""

    def __init__(self, name, src, meta, handle, packed_metadata):
        from triton.backends.nvidia.driver import CudaLauncher
        self.name = name
        self.src = src
        self.metadata = meta
        self.module = object()
        self.function = handle          # what the stub's cuLaunchKernelEx receives
        self.packed_metadata = packed_metadata
        self.run = CudaLauncher(src, meta)

    def launch_metadata(self, grid, stream, *args):
        return None
