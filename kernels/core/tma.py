"""Tensor-memory-accelerator (TMA) tile loads: the jit helper that makes a tensor descriptor
per program, and the host-side checks of what TMA can read.

Kernels that take a ``TMA`` constexpr read tiles through ``row_tiles`` descriptors (on sm_90 one
bulk tensor copy per tile, ``UTMALDG``, instead of per-thread cp.async and its 64-bit address
arithmetic) and keep per-thread loads as the fallback for what TMA cannot read
(``tma_rows_ok``). Descriptors made in a kernel live in a global scratch buffer that Triton
allocates through ``triton.set_allocator`` (``tma_scratch``); each program makes its own (about
300 instructions a warp and two tensormap fences each on sm_90). Dense calls take host
descriptors instead (``TMA_HOST``: ``host_desc_layout``, ``desc_tile``), made once per call for
the whole tensors: the forward's Q, K, V, the backward's Q, dO, row statistics (dK/dV) and K, V
(dQ).
"""
import contextlib

import torch
import triton
import triton.language as tl

from .common import interpreter_active
from .configs import tma_capable

__all__ = ["row_tiles", "desc_tile", "host_desc_layout", "host_descs", "set_row_blocks",
           "TMA_HOST", "TMA_HOST_MODE", "tma_rows_ok", "tma_scratch", "tma_capable"]

# The TMA mode for host-side descriptors (the TMA constexpr of ``_attn_fwd``, ``_bwd_dkdv`` and
# ``_bwd_dq``): the streamed tiles read through descriptors made once per call on the host, not
# per program in the kernel.
TMA_HOST_MODE = 3
TMA_HOST = tl.constexpr(TMA_HOST_MODE)


@triton.jit
def row_tiles(base, n_rows, row_stride, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """Tensor descriptor of the (n_rows × HEAD_DIM) matrix at ``base`` (rows ``row_stride``
    apart, unit column stride) read in (BLOCK_ROWS × BLOCK_D) tiles: on sm_90+ a TMA descriptor
    (``desc.load([row, 0])`` is one bulk tensor copy into shared memory), which reads elements
    outside the matrix -- rows >= n_rows, head-dim padding -- as zeros. Needs a 16-byte aligned
    base and row stride (``tma_rows_ok`` checks them)."""
    return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[row_stride, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_D])


@triton.jit
def desc_tile(desc, b, h, row, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The (BLOCK_ROWS × BLOCK_D) tile at ``row`` of (batch b, head h) through ``desc``, a host
    descriptor of a (B, heads, rows, D) tensor with block (1, 1, BLOCK_ROWS, BLOCK_D)
    (``host_desc_layout``): rows past the tensor's and columns past D read as zeros."""
    return desc.load([b, h, row, 0]).reshape([BLOCK_ROWS, BLOCK_D])


# TMA's limits (CUDA driver API, cuTensorMapEncodeTiled): a 16-byte aligned global address
# and strides, strides below 2**40 bytes, at most 256 elements per box dimension.
_TMA_ALIGN = 16
_TMA_MAX_BOX = 256
_TMA_MAX_STRIDE = 2 ** 40


def tma_rows_ok(x, strides, n_rows, block_width) -> bool:
    """Whether every (batch, head) matrix of the 4-D view ``x`` -- rows ``strides[2]`` apart,
    its batch and head offsets ``strides[0]``, ``strides[1]`` -- can be read by a TMA
    descriptor at its (sequence's) first row, in tiles ``block_width`` wide."""
    size = x.element_size()
    batch, heads = x.shape[0], x.shape[1]
    offsets = [s for s, n in ((strides[0], batch), (strides[1], heads)) if n > 1]
    return (n_rows > 0 and block_width <= _TMA_MAX_BOX and x.data_ptr() % _TMA_ALIGN == 0
            and 0 < strides[2] * size < _TMA_MAX_STRIDE
            and all(s * size % _TMA_ALIGN == 0 for s in (*offsets, strides[2])))


def host_desc_layout(x):
    """(shape, strides) of a host tensor descriptor over the 4-D view ``x`` (B, heads, rows,
    D; unit last stride), or None where a descriptor cannot describe it: a base address or a
    stride that is not a multiple of 16 bytes, a zero stride on a dimension of more than one
    entry (an expanded batch or head: the in-kernel descriptors take those); the box's width
    is ``tma_rows_ok``'s to check (``forward.tma_mode`` asks both). A dimension
    of size 1 gets the stride a contiguous one would have (its stride is never multiplied by
    anything but 0, and TMA wants every stride positive and aligned)."""
    size = x.element_size()
    shape = list(x.shape)
    strides = list(x.stride())
    if min(shape) <= 0 or strides[3] != 1 or x.data_ptr() % _TMA_ALIGN:
        return None
    for i in (2, 1, 0):
        if shape[i] == 1:
            strides[i] = strides[i + 1] * shape[i + 1]
        if not (0 < strides[i] * size < _TMA_MAX_STRIDE and strides[i] * size % _TMA_ALIGN == 0):
            return None
    return shape, strides


def host_descs(named):
    """A ``KernelStep``'s ``descs`` for the 4-D tensors ``named`` ((kernel parameter, tensor)
    pairs): {parameter: (parameter, shape, strides)}, the per-call tensor passed under the
    parameter's own name; every tensor must be one ``host_desc_layout`` describes."""
    layouts = {name: host_desc_layout(x) for name, x in named}
    assert None not in layouts.values(), "host descriptors cannot describe these tensors"
    return {name: (name, *layout) for name, layout in layouts.items()}


def set_row_blocks(nargs, blocks):
    """Host descriptors' blocks for a config (a ``pre_hook``'s work, ``nargs`` the launch's
    arguments with the config's): each parameter of ``blocks`` ({parameter: (rows constexpr,
    width constexpr)}) that holds a descriptor gets block (1, 1, rows, width), one tile of a
    (B, heads, rows, D) tensor (``desc_tile``); the others (None) are left alone."""
    for name, (rows, width) in blocks.items():
        desc = nargs.get(name)
        if desc is not None:
            desc.block_shape = [1, 1, nargs[rows], nargs[width]]


@contextlib.contextmanager
def tma_scratch(device, on):
    """Triton's allocator for the launch: device-side tensor descriptors live in a global
    scratch buffer (128 bytes per descriptor and program) that Triton allocates through
    ``triton.set_allocator`` at launch. Installed for the launch only (the caller's own
    allocator, if any, is restored: Triton keeps it in a ContextVar); the interpreter and
    launches without descriptors need none."""
    if not on or interpreter_active():
        yield
        return

    def alloc(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    var = getattr(getattr(triton.runtime, "_allocation", None), "_allocator", None)
    if var is None:             # a Triton without the ContextVar: set it for good
        triton.set_allocator(alloc)
        yield
        return
    token = var.set(alloc)
    try:
        yield
    finally:
        var.reset(token)
