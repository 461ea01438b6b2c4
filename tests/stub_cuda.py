"""Triton's compiled (non-interpreter) launch path on a machine without a GPU, for tests.

Only what needs a GPU is replaced; Triton's own launch code runs as on a GPU host:
    * ``libcuda.so.1`` is a stub (``STUB_C``, built here with gcc) whose calls return at once;
      its ``cuLaunchKernelEx`` records each launch: the function handle, stream, grid, block,
      dynamic shared memory, launch attributes and every kernel parameter's bytes (the
      parameter sizes of each function handle are registered by the fake compile below,
      since ``cuLaunchKernelEx`` receives only pointers to the values). Its
      ``cuTensorMapEncodeTiled`` writes its inputs into the 128-byte map (``tensor_map_bytes``),
      after the driver's checks, so host tensor descriptors' maps can be compared too.
    * ``triton.runtime.driver.active`` is a stand-in CUDA driver (target sm_90, device 0, a
      fixed non-zero stream); its ``utils`` (the launcher module of Triton >= 3.8) is Triton's
      real ``CudaUtils``, built against the stub.
    * ``JITFunction._do_compile`` makes, instead of a compiled kernel, a stand-in whose ``run``
      is Triton's real ``CudaLauncher`` (its generated C launcher in 3.6, its generic C launcher
      in 3.8+), with a distinct function handle and shared-memory size per variant. Global
      scratch per program: 128 bytes per in-kernel tensor descriptor of the variant's TTIR
      (Triton's real front end), as Triton gives them on sm_90, so launches that need scratch
      call the caller's allocator as on a GPU. A variant with host tensor descriptor
      parameters gets the ``tensordesc_meta`` of Triton's real TTGIR stage for sm_90 (its TMA
      lowering) and takes them expanded as the launcher passes them (``expand_types``).
    * ``Autotuner._bench`` returns a constant: the autotuner keeps its first config.

Nothing is computed: kernels' outputs stay as allocated. Use in a fresh process whose
environment ``stub_env`` made (LD_LIBRARY_PATH is read at process start), before anything
launches a kernel.
"""
import ctypes
import hashlib
import os
import re
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
/* A tensor map holds its inputs (``tensor_map_bytes`` below writes the same bytes), so a
   launch with a wrong address, shape, stride or box shows in the parameter bytes. The
   driver's checks that Triton's own calls must pass are made too (CUDA_ERROR_INVALID_VALUE
   otherwise): rank 1-5, a 16-byte aligned address, strides that are multiples of 16 bytes
   below 2^40, boxes of 1-256 entries whose inner row is a multiple of 16 bytes and fits the
   swizzle span, element strides of 1-8. */
static const int tma_elem_bytes[13] = {1, 2, 4, 4, 8, 8, 2, 4, 8, 2, 4, 4, 4};
CUresult cuTensorMapEncodeTiled(void *m, int t, unsigned r, void *g, const uint64_t *dims,
                                const uint64_t *st, const unsigned *box, const unsigned *es,
                                int il, int sw, int l2, int oob) {
  uint8_t *out = (uint8_t *)m;
  uint64_t address = (uint64_t)(uintptr_t)g;
  if (t < 0 || t > 12 || r < 1 || r > 5 || address %% 16 || il != 0 || sw < 0 || sw > 3)
    return 1;
  for (unsigned i = 0; i < r; i++) {
    if (dims[i] == 0 || dims[i] > (1ull << 32) || box[i] == 0 || box[i] > 256 || es[i] == 0
        || es[i] > 8) return 1;
    if (i + 1 < r && (st[i] %% 16 || st[i] >= (1ull << 40))) return 1;
  }
  if ((box[0] * tma_elem_bytes[t]) %% 16 || (sw && box[0] * tma_elem_bytes[t] > (16u << sw)))
    return 1;
  memset(out, 0, 128);
  memcpy(out, &address, 8);
  out[8] = (uint8_t)t; out[9] = (uint8_t)r; out[10] = (uint8_t)il; out[11] = (uint8_t)sw;
  out[12] = (uint8_t)l2; out[13] = (uint8_t)oob;
  int off = 16;
  memcpy(out + off, dims, 8 * r); off += 8 * r;
  memcpy(out + off, st, 8 * (r - 1)); off += 8 * (r - 1);
  memcpy(out + off, box, 4 * r); off += 4 * r;
  memcpy(out + off, es, 4 * r);
  return 0;
}
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
    if ty == TENSOR_MAP:
        return TENSOR_MAP_BYTES
    raise StubUnavailable(f"parameter type {ty!r} is not handled by the stub")


# Host tensor descriptors (a ``tensordesc<dtype[block]>`` parameter). A kernel that lowers them
# to TMA (sm_90) takes, per descriptor, the encoded CUtensorMap by value (128 bytes, 64-byte
# aligned) and then the descriptor's shape (i32 each) and strides (i64 each); its compiled
# metadata holds one ``tensordesc_meta`` dict per descriptor parameter, from which Triton's
# launcher asks the driver (cuTensorMapEncodeTiled) for the map. Without that lowering
# (``tensordesc_meta`` empty) the descriptor is decomposed: base pointer, shape and strides (i64),
# the padding flag (and, from Triton 3.8, the tf32 rounding flag: i1 each), shape and strides.
TENSOR_MAP = "nvTmaDesc"
TENSOR_MAP_BYTES = 128
# Triton's compiler numbers TMA element types otherwise than CUtensorMapDataType for three of
# them (its launcher maps 8, 9, 10 to 10, 8, 9).
_TMA_DEVICE_TO_HOST = {8: 10, 9: 8, 10: 9}
L2_PROMOTION_128B = 2      # CU_TENSOR_MAP_L2_PROMOTION_L2_128B: what Triton asks for


def parse_descriptor(ty):
    """(element dtype, block shape) of a ``tensordesc<dtype[b0, b1, ...]>`` type, or None
    for any other type."""
    m = re.match(r"tensordesc<([^\[>]*)\[([^\]]*)\]", ty) if isinstance(ty, str) else None
    if m is None:
        return None
    return m.group(1), [int(b) for b in m.group(2).split(",")]


def decomposed_flags():
    """How many i1 flags a decomposed (not TMA-lowered) host descriptor passes: the padding
    flag, and from Triton 3.8 the tf32 rounding flag."""
    import triton
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return 1 if (major, minor) < (3, 8) else 2


def expand_types(types_, metas):
    """The launched parameter types: ``types_`` (flat, constexprs dropped) with each host
    descriptor expanded as the launcher passes it, given ``metas`` (its tensordesc_meta, one
    per descriptor, or None)."""
    out, k = [], 0
    for ty in types_:
        parsed = parse_descriptor(ty)
        if parsed is None:
            out.append(ty)
            continue
        dtype, block = parsed
        n = len(block)
        if metas and metas[k] is not None:
            out.append(TENSOR_MAP)
        else:
            out += ["*" + dtype] + ["i64"] * (2 * n) + ["i1"] * decomposed_flags()
        out += ["i32"] * n + ["i64"] * n
        k += 1
    return out


def descriptor_params(ty, meta, tensor, shape, strides):
    """[(label suffix, type, value)] of the launched parameters of a host descriptor of type
    ``ty`` over ``tensor`` with ``shape`` and ``strides`` (elements), as ``pack`` takes them."""
    n = len(shape)
    if meta is not None:
        head = [(".map", TENSOR_MAP, (tensor, meta, list(shape), list(strides)))]
    else:
        head = ([(".base", "*" + parse_descriptor(ty)[0], tensor)]
                + [(f".shape[{i}]", "i64", shape[i]) for i in range(n)]
                + [(f".strides[{i}]", "i64", strides[i]) for i in range(n)]
                + [(".padding_nan", "i1", 0), (".round_f32_to_tf32", "i1", 0)
                   ][:decomposed_flags()])
    return (head + [(f".shape[{i}]", "i32", shape[i]) for i in range(n)]
            + [(f".strides[{i}]", "i64", strides[i]) for i in range(n)])


def tensor_map_bytes(address, meta, shape, strides, padding_nan=False):
    """The stub driver's 128-byte CUtensorMap for what Triton's launcher asks of it for a
    descriptor (base ``address``, ``shape`` and ``strides`` in elements, outermost first) with
    ``meta`` (its tensordesc_meta entry): the driver's dimensions innermost first, strides in
    bytes without the innermost, the box, element strides 1, no interleave, the swizzle, L2
    promotion of 128 bytes, the out-of-bounds fill (NaN or zeros)."""
    size, n = meta["elem_size"], len(shape)
    dims = list(reversed(shape))
    if meta["fp4_padded"]:
        dims[0] *= 2
    st = [s * size for s in reversed(strides[:-1])]
    box = list(reversed(meta["block_size"]))
    host_type = _TMA_DEVICE_TO_HOST.get(meta["elem_type"], meta["elem_type"])
    out = struct.pack("<Q6B2x", address, host_type, n, 0, meta["swizzle"], L2_PROMOTION_128B,
                      1 if padding_nan else 0)
    out += struct.pack(f"<{n}Q{n - 1}Q{n}I{n}I", *dims, *st, *box, *([1] * n))
    return out + bytes(TENSOR_MAP_BYTES - len(out))


def describe_tensor_map(raw):
    """The fields of a stub tensor map (``tensor_map_bytes``), for messages."""
    address, dtype, n, interleave, swizzle, l2, oob = struct.unpack_from("<Q6B", raw)
    if not 1 <= n <= 5:
        return f"not a stub tensor map: {raw.hex()}"
    dims, st, box, es = (list(struct.unpack_from(f"<{k}{c}", raw, off)) for k, c, off in (
        (n, "Q", 16), (n - 1, "Q", 16 + 8 * n), (n, "I", 8 + 16 * n),
        (n, "I", 8 + 20 * n)))
    return (f"address {address:#x} type {dtype} dims {dims} strides {st} B box {box} "
            f"element strides {es} interleave {interleave} swizzle {swizzle} L2 {l2} "
            f"fill {oob}")


def pack(ty, value):
    """The bytes a launcher passes for ``value`` as a parameter of type ``ty``."""
    if ty.startswith("*"):
        ptr = 0 if value is None else value if isinstance(value, int) else value.data_ptr()
        return struct.pack("<Q", ptr)
    if ty == TENSOR_MAP:   # (tensor, tensordesc_meta entry, shape, strides)
        tensor, meta, shape, strides = value
        return tensor_map_bytes(tensor.data_ptr(), meta, shape, strides)
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
        self.lower_descriptors = True   # host descriptors of variants compiled from now on
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
            descs = [t for t in types_ if parse_descriptor(t)]
            n_desc, metas = stub._descriptors(fn, src, tgt, backend, options, bool(descs))
            if metas is None or not stub.lower_descriptors:
                metas = []   # as Triton gives where it rewrites descriptors to pointers
            types_ = expand_types(types_, metas)
            if metas:
                # Triton's driver builds its utils at start; Triton 3.6's launchers, when
                # loaded, read the tensor map type (PyCUtensorMap) it sets: built before them.
                triton.runtime.driver.active.utils
            sizes = [param_size(t) for t in types_] + [8, 8]   # + global, profile scratch
            if len(sizes) > MAX_PARAMS or sum(sizes) > RECORD_BYTES:
                raise StubUnavailable(f"{fn.__name__}: {len(sizes)} parameters, "
                                      f"{sum(sizes)} bytes: more than the stub records")
            arr = (ctypes.c_int * len(sizes))(*sizes)
            if lib.stub_set_params(handle, len(sizes), arr) != 0:
                raise StubUnavailable("more kernel variants than the stub has handles")
            meta = types.SimpleNamespace(
                num_ctas=getattr(options, "num_ctas", 1), num_warps=options.num_warps,
                shared=1024 * handle,     # distinct per variant, so a mix-up shows
                global_scratch_size=SCRATCH_PER_DESCRIPTOR * n_desc,
                global_scratch_align=SCRATCH_PER_DESCRIPTOR,
                profile_scratch_size=0, profile_scratch_align=1,
                launch_cooperative_grid=False, launch_pdl=False, tensordesc_meta=metas,
                instrumentation_mode="", warp_size=32, target=tgt, name=fn.__name__)
            kernel = _FakeKernel(fn.__name__, src, meta, handle, backend.pack_metadata(meta))
            stub.variants.append(dict(kernel=fn.__name__, src=src, types=types_, sizes=sizes,
                                      scratch=meta.global_scratch_size, tensordesc_meta=metas,
                                      num_warps=options.num_warps))
            kernel_cache[key] = kernel
            return kernel

        def bench(tuner, *args, config, **meta):
            return [1.0, 1.0, 1.0]

        JITFunction._do_compile = do_compile
        Autotuner._bench = bench

    def _descriptors(self, fn, src, target, backend, options, host):
        """(in-kernel tensor descriptors (tt.make_tensor_descriptor) in the variant's TTIR,
        its ``tensordesc_meta``): where ``host`` (the variant has host descriptor parameters),
        what Triton's real TTGIR stage for sm_90 gives (its TMA lowering: swizzle, element type,
        box per descriptor), else []; None where a stage failed."""
        try:
            from triton._C.libtriton import ir
            ctx = ir.context()
            ir.load_dialects(ctx)
            backend.load_dialects(ctx)
            mod = src.make_ir(target, options, backend.get_codegen_implementation(options),
                              backend.get_module_map(), ctx)
            stages = {}
            backend.add_stages(stages, options, src.language)
            ttir = stages["ttir"](mod, {})
            n = str(ttir).count("tt.make_tensor_descriptor")
        except Exception as e:   # noqa: BLE001 - reported by the caller
            self.ttir_failures.append(f"{fn.__name__}: {type(e).__name__}: "
                                      f"{str(e).strip().splitlines()[-1:]}")
            return 0, None
        if not host:
            return n, []
        try:
            metadata = {}
            stages["ttgir"](ttir, metadata)
            return n, list(metadata["tensordesc_meta"])
        except Exception as e:   # noqa: BLE001 - reported by the caller
            self.ttir_failures.append(f"{fn.__name__} (TTGIR): {type(e).__name__}: "
                                      f"{str(e).strip().splitlines()[-1:]}")
            return n, None

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
