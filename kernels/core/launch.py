"""Kernel launches that skip Triton's Python after the first: the steps of a launch plan.

A Triton launch from Python (``kernel[grid](**args)``) binds the arguments, computes their
specialisation key, looks the compiled kernel up, and, through an autotuner, finds the tuned
config: 20-50 us of host time per launch, more than a short attention's GPU time. A launch plan
(``ForwardPlan``, ``BackwardPlan``) fixes everything a call's shapes, strides, dtype and options
decide; its ``KernelStep`` does the first launch through Triton (compiling and autotuning as
usual), keeps the compiled kernel, its config and grid, and from then on calls the compiled
kernel's launcher directly with the arguments in the kernel's parameter order, as Triton itself
would (``JITFunction.run``: ``kernel.run(grid..., stream, function, metadata, ...)``) -- its C
entry, past the launcher's per-launch Python (``_c_entry``).

This is sound because a plan is only reused for calls whose every specialised property is the
same: the plan's key holds the shapes, strides, dtypes and devices (hence the ints Triton
specialises on) and the 16-byte alignment of every data pointer; no per-call int reaches a
kernel (the dropout seed is a device tensor: kernels/core/dropout.py ``load_seed``).

Host tensor descriptors (the forward's and the backward's TMA_HOST: ``KernelStep(descs=...)``)
are made from the per-call tensors: through Triton at the first launch, encoded here for
direct ones and kept per buffer address (``_HostDescs``).

Direct launches are used on CUDA only, with no Triton launch hooks installed (a profiler's
hooks see every launch through Triton's own path); the interpreter always goes through Triton.
The launcher's arguments are Triton internals: direct launches are made only on the Triton
versions of ``DIRECT_LAUNCH_TRITON``, whose launches tests/core/test_direct_launch.py found
byte-identical to Triton's own; any other version keeps Triton's own path.
"""
import logging
import operator

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import interpreter_active
from .configs import _COMPILE_ERRORS

try:  # where Triton keeps launch hooks (3.4+); a profiler installs them
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton
    _knobs = None


# The Triton versions (major.minor) whose launch protocol (``CompiledKernel.run``'s arguments,
# the kernel's parameters by position) tests/core/test_direct_launch.py has checked: every
# kernel parameter, grid, block, shared memory and stream of a direct launch equal to Triton's
# own launch of the same call, recorded by a stub libcuda under Triton's real launcher. Add a
# version only after that test passed on it.
DIRECT_LAUNCH_TRITON = ("3.6", "3.8", "3.9")
TRITON_VERSION = ".".join(triton.__version__.split(".")[:2])
# Read by ``KernelStep._keep`` at each first launch (the test switches it on for a version
# not yet listed, to check it).
DIRECT_LAUNCH = TRITON_VERSION in DIRECT_LAUNCH_TRITON
_unchecked_logged = False


def _log_unchecked():
    global _unchecked_logged
    if not _unchecked_logged:
        _unchecked_logged = True
        logging.getLogger(__name__).debug(
            "triton %s is not in DIRECT_LAUNCH_TRITON %s: kernels launch through Triton's own "
            "path (tests/core/test_direct_launch.py checks a version's direct launches)",
            triton.__version__, DIRECT_LAUNCH_TRITON)


def _hooks_installed() -> bool:
    if _knobs is None:
        return True
    hook = _knobs.runtime.launch_enter_hook
    return bool(getattr(hook, "calls", hook))


def _driver():
    return triton.runtime.driver.active


def launch_context():
    """(current device index, its current stream) for direct launches made now, or None when
    they must go through Triton (launch hooks installed, e.g. a profiler's)."""
    if _hooks_installed():
        return None
    drv = _driver()
    index = drv.get_current_device()
    return index, drv.get_current_stream(index)


def _scratch_var():
    """Triton's ContextVar holding the allocator of in-kernel descriptors' global scratch."""
    return getattr(getattr(triton.runtime, "_allocation", None), "_allocator", None)


class KernelStep:
    """One kernel of a plan: ``jit_fn`` (the @triton.jit kernel) launched on ``grid(cfg)``
    with ``configs`` (None: through ``tuned``, its autotuner) and ``fixed`` (the non-tensor
    arguments and constexprs). ``__call__(device, per_call)`` launches with the per-call
    arguments."""

    def __init__(self, jit_fn, grid, fixed, configs=None, tuned=None, scratch=False, descs=None):
        self.jit_fn, self.grid, self.fixed = jit_fn, grid, fixed
        self.configs, self.tuned, self.scratch = configs, tuned, scratch
        # Host tensor descriptors: {kernel parameter: (the per-call tensor's parameter, shape,
        # strides)}, made at each launch from that tensor (blocks: the config's pre_hook).
        self.descs = descs or {}
        self.direct = None   # (launch, template, slots, kept, descs) once known
        self.device = None

    def __call__(self, device, per_call, ctx=None):
        """Launch with ``per_call`` ({parameter name: value}: the tensors and the tuples that
        hold them). ``ctx``: ``launch_context()`` when the caller makes several launches in a
        row (read once for all of them), else read here."""
        direct = self.direct
        if direct is not None:
            if ctx is None:
                ctx = launch_context()
            if ctx is not None and ctx[0] == self.device:
                launch, template, slots, kept, descs = direct
                values = list(template)
                for pos, name in slots:
                    values[pos] = per_call[name]
                for pos, name, first, pointers in kept:
                    value = per_call[name]
                    values[pos] = pointers if value is first else value
                if descs is not None:
                    # Each host descriptor becomes the launcher's arguments for it (the
                    # encoded descriptor, its shape and strides) at its position.
                    descs.splice(values, per_call)
                launch(ctx[1], values)
                return
        self._first(device, per_call)

    def _first(self, device, per_call):
        """Launch through Triton (compiling / autotuning as needed); on CUDA keep what a
        direct launch needs."""
        from .tma import tma_scratch
        args = {**self.fixed, **per_call}
        for name, (src, shape, strides) in self.descs.items():
            # A placeholder block: every config's pre_hook sets its own.
            args[name] = TensorDescriptor(args[src], shape, strides, [1] * len(shape))
        with tma_scratch(device, self.scratch):
            if self.configs is None:
                kernel = self.tuned[self.grid](**args)
                # The config the autotuner launched (None where a tool replaced its run).
                cfg = getattr(self.tuned, "best_config", None)
            else:
                kernel, cfg = launch_first_compiling(self.jit_fn, self.grid, args, self.configs)
        if interpreter_active() or cfg is None:
            return
        self._keep(kernel, cfg, args, device)

    def _keep(self, kernel, cfg, args, device):
        if not DIRECT_LAUNCH:
            _log_unchecked()
            return
        names = getattr(self.jit_fn, "arg_names", None)
        run = getattr(kernel, "run", None)
        if names is None or run is None or not hasattr(kernel, "packed_metadata"):
            return   # a Triton whose compiled kernels look otherwise: keep its own path
        fixed = {**self.fixed, **cfg.kwargs}
        if any(n not in fixed and n not in args for n in names):
            return
        grid = tuple(self.grid(cfg.kwargs))
        grid = grid + (1,) * (3 - len(grid))
        if self.scratch:
            self._alloc = _ScratchPerStream(device)
        # The arguments in the kernel's parameter order: the fixed ones in place, the per-call
        # ones (tensors and the tuples holding them) filled in by position at each launch.
        # Fixed tensors of a few bytes (the plan's dummies, held by the plan) as their
        # pointers, like the kept tuples below.
        template = [_as_pointers(v) if isinstance(v, torch.Tensor) and _tiny(v) else v
                    for v in (fixed.get(n) for n in names)]
        slots = tuple((i, n) for i, n in enumerate(names) if n not in fixed
                      and n not in self.descs)
        if {n for _, n in slots} != set(args) - set(fixed) - set(self.descs):
            return   # a per-call argument the kernel does not take: keep Triton's own checks
        # A plan passes some per-call tuples as the same object at every call (its lengths and
        # dummies: ``ForwardPlan.seq`` ...): for those, the tuple with its tensors as their data
        # pointers, made once. The launcher takes an int for a pointer as it is, where for a
        # tensor it calls ``data_ptr()`` and asks the driver about the pointer
        # (``cuPointerGetAttribute``) at every launch. A tuple is immutable: the same object
        # holds the same tensors, whose pointers stay (the plan's own, never resized). Kept
        # (hence alive) only where its tensors' storages are a few bytes: a first call's
        # buffers (split-KV partials, a mod's tensors) are not held.
        kept = tuple((i, n, args[n], _as_pointers(args[n])) for i, n in slots
                     if isinstance(args[n], tuple) and _tiny(args[n]))
        slots = tuple((i, n) for i, n in slots if not any(n == k[1] for k in kept))
        self.device = _driver().get_current_device()
        launch, expanded = _c_entry(run, grid, kernel.function, kernel.packed_metadata,
                                    self._alloc if self.scratch else None,
                                    raw=bool(self.descs))
        metas = getattr(kernel.metadata, "tensordesc_meta", None) or [None] * len(self.descs)
        if len(metas) != len(self.descs):
            return
        # In parameter order, as the launcher's descriptor metadata is.
        descs = [(names.index(n), self.descs[n][0], args[n]) for n in names if n in self.descs]
        descs = _HostDescs([(pos, src, _HostDesc(first, meta, expanded))
                            for (pos, src, first), meta in zip(descs, metas)]) if descs else None
        self.direct = (launch, tuple(template), slots, kept, descs)


def _tiny(value):
    """Whether every tensor in ``value`` (an argument: a tensor or a tuple of them, maybe
    nested) lives in a storage of at most 64 bytes (the plans' dummies, seeds)."""
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().nbytes() <= 64
    if isinstance(value, tuple):
        return all(map(_tiny, value))
    return True


def _as_pointers(value):
    """``value`` (a kernel argument: a tuple, maybe nested) with each tensor as its data
    pointer (an int: what the launcher reads from a tensor)."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if isinstance(value, tuple):
        return tuple(map(_as_pointers, value))
    return value


class _HostDesc:
    """One host descriptor parameter of direct launches: ``desc(tensor)`` is what a launch
    passes for it, the descriptor of ``tensor`` with the first launch's shape, strides and block
    (``first``, a TensorDescriptor). ``expanded``: the launcher's C entry is called itself, so
    the descriptor is encoded here as Triton's launcher would (``make_tensordesc_arg`` with the
    kernel's ``meta``: [CUtensorMap, *shape, *strides], the driver's cuTensorMapEncodeTiled);
    otherwise a TensorDescriptor, which Triton's launcher encodes."""

    def __init__(self, first, meta, expanded):
        self.shape, self.strides, self.block = first.shape, first.strides, first.block_shape
        self.meta, self.expanded, self.fill = meta, expanded, None
        if not expanded:
            return
        from triton.backends.nvidia import driver as nv_driver
        make = nv_driver.make_tensordesc_arg
        self.encode = ((lambda d: make(d, meta)) if make.__code__.co_argcount == 2
                       else (lambda d: make(d, meta, None)))
        utils = triton.runtime.driver.active.utils
        fill = getattr(utils, "fill_tma_descriptor_tiled", None) or getattr(
            utils, "fill_tma_descriptor", None)
        if (meta is not None and fill is not None and not meta.get("fp4_padded")
                and not meta.get("is_im2col") and not getattr(first, "round_f32_to_tf32", False)
                and first.padding == "zero"):
            # What make_tensordesc_arg does for this descriptor, its constant arguments made
            # once: the encode of a new buffer is then one C call (tests/core/
            # test_direct_launch.py checks the bytes against Triton's own launch).
            self.fill = fill
            self.fill_args = (meta["swizzle"], meta["elem_size"],
                              nv_driver.TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                              meta["block_size"], list(first.shape), list(first.strides), 0)
            self.tail = [*first.shape, *first.strides]

    def __call__(self, tensor):
        if self.fill is not None:
            return [self.fill(tensor.data_ptr(), *self.fill_args), *self.tail]
        desc = TensorDescriptor(tensor, self.shape, self.strides, self.block)
        return self.encode(desc) if self.expanded else [desc]


class _HostDescs:
    """A step's host descriptor parameters (``entries``: (position, per-call tensor's name,
    ``_HostDesc``) in parameter order): ``splice(values, per_call)`` replaces each one's slot in
    ``values`` (the launch's arguments by parameter) with what the launch passes for it. Encoded
    descriptors are kept per tuple of data pointers -- all else is fixed by the plan, so tensors
    at the same addresses have the same descriptors and the driver's encode runs once per set
    of buffers, not per call (a training loop's activations cycle through a few). Not kept
    where the launcher gets the tensors themselves (TensorDescriptors, or a kernel whose
    descriptors were not lowered to TMA: the decomposed form holds the base tensor)."""

    MAX_KEPT = 16

    def __init__(self, entries):
        self.positions = [pos for pos, _, _ in entries]
        self.descs = [desc for _, _, desc in entries]
        names = [src for _, src, _ in entries]
        self.tensors = (operator.itemgetter(*names) if len(names) > 1
                        else lambda per_call: (per_call[names[0]],))
        lo = self.positions[0]
        self.span = (lo, lo + len(entries)) if self.positions == list(
            range(lo, lo + len(entries))) else None
        self.keep = all(d.expanded and d.meta is not None for d in self.descs)
        self.kept = {}

    def _encode(self, tensors):
        """Each descriptor's arguments: one flat list over a span of consecutive parameters,
        else a list per descriptor."""
        encoded = [desc(t) for desc, t in zip(self.descs, tensors)]
        return [a for one in encoded for a in one] if self.span else encoded

    def splice(self, values, per_call):
        tensors = self.tensors(per_call)
        if self.keep:
            key = tuple(map(_data_ptr, tensors))
            args = self.kept.get(key)
            if args is None:
                if len(self.kept) >= self.MAX_KEPT:
                    self.kept.clear()
                args = self.kept[key] = self._encode(tensors)
        else:
            args = self._encode(tensors)
        if self.span:
            values[self.span[0]:self.span[1]] = args
        else:   # last first: earlier positions stay where they are
            for pos, one in zip(reversed(self.positions), reversed(args)):
                values[pos:pos + 1] = one


_data_ptr = torch.Tensor.data_ptr


def _c_entry(run, grid, function, metadata, alloc, raw=False):
    """(launch, expanded): ``launch`` as ``_launch_fn`` makes it; ``raw`` asks for the C entry
    beneath Triton's host descriptor wrapper (which encodes TensorDescriptor arguments at every
    launch): ``expanded`` is True when ``launch`` takes the descriptors' encoded arguments
    (``_HostDesc``), False when it takes TensorDescriptors (Triton's own path)."""
    c_launch = getattr(run, "launch", None)
    if raw and c_launch is not None:
        inner = _closure(c_launch).get("launcher")
        if inner is None:   # (another version's C protocol: _launch_fn goes through run)
            return _launch_fn(run, grid, function, metadata, alloc, force_run=True), False
        c_launch = inner
    launch = _launch_fn(run, grid, function, metadata, alloc, c_launch=c_launch)
    return launch, raw and getattr(launch, "c_entry", False)


def _closure(fn):
    """{free variable: value} of a Python closure (empty for anything else)."""
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()),
                    (c.cell_contents for c in cells)))


def _launch_fn(run, grid, function, metadata, alloc, c_launch=None, force_run=False):
    """``launch(stream, args)``: the compiled kernel's launch of ``args`` (its parameters in
    order) on ``grid``, as ``run(*grid, stream, function, metadata, None, None, None, *args)``
    makes it with no launch hooks (hence no launch metadata) -- but calling the launcher's C
    entry (``run.launch``) itself: ``run.__call__`` (Triton's ``CudaLauncher``) costs a few
    microseconds of Python per launch (scratch closures, allocator look-ups) for what is
    fixed here. The C entry gets exactly what ``__call__`` would give it: cooperative-grid and
    PDL flags from the kernel's metadata, the global scratch from ``alloc`` (Triton's allocator
    protocol: ``alloc(programs * ctas * bytes per program, alignment, stream)``; None where the
    kernel needs none), no profile scratch. Where ``run`` does more than that (a profile
    scratch: a profiler's instrumented kernel; GSan; a launcher of another shape) or the
    Triton version's C protocol is not one of the two below, ``run`` itself is called."""
    g0, g1, g2 = grid

    def through_run(stream, args):
        if alloc is None:
            run(g0, g1, g2, stream, function, metadata, None, None, None, *args)
            return
        var = _scratch_var()
        token = var.set(alloc)
        try:
            run(g0, g1, g2, stream, function, metadata, None, None, None, *args)
        finally:
            var.reset(token)

    size = getattr(run, "global_scratch_size", None)
    if (force_run or c_launch is None or size is None
            or getattr(run, "profile_scratch_size", 1) != 0
            or getattr(run, "gsan_enabled", False) or (size > 0 and alloc is None)
            or torch.version.hip):   # HIP's C entry takes another order (and has no PDL)
        return through_run
    if size == 0:
        alloc = None   # Triton asks the allocator only for a scratch size above 0
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    scratch_bytes = g0 * g1 * g2 * getattr(run, "num_ctas", 1) * size
    align = run.global_scratch_align
    if TRITON_VERSION == "3.6":
        # launch(grid, stream, function, coop, pdl, global scratch, profile scratch,
        #        metadata, launch metadata, enter hook, exit hook, *kernel args)
        if alloc is None:
            def launch(stream, args):
                c_launch(g0, g1, g2, stream, function, coop, pdl, None, None, metadata, None,
                         None, None, *args)
        else:
            def launch(stream, args):
                c_launch(g0, g1, g2, stream, function, coop, pdl,
                         alloc(scratch_bytes, align, stream), None, metadata, None, None, None,
                         *args)
        launch.c_entry = True
        return launch
    if TRITON_VERSION in ("3.8", "3.9"):
        # launch(grid, stream, function, coop, pdl, metadata, launch metadata, enter hook,
        #        exit hook, global scratch, profile scratch, annotations, signature, args)
        annotations, signature = run.arg_annotations, run.kernel_signature
        if alloc is None:
            def launch(stream, args):
                c_launch(g0, g1, g2, stream, function, coop, pdl, metadata, None, None, None,
                         None, None, annotations, signature, tuple(args))
        else:
            def launch(stream, args):
                c_launch(g0, g1, g2, stream, function, coop, pdl, metadata, None, None, None,
                         alloc(scratch_bytes, align, stream), None, annotations, signature,
                         tuple(args))
        launch.c_entry = True
        return launch
    return through_run


class _ScratchPerStream:
    """Triton's allocator for in-kernel descriptors' global scratch in direct launches: one
    buffer per (device, stream), shared by every step and grown when a launch needs more,
    instead of an allocation per launch. Launches on one stream run in order, so they can
    share it (a buffer replaced by a bigger one goes back to PyTorch's caching allocator,
    which reuses memory in stream order); another stream gets its own."""

    def __init__(self, device):
        self.device = device

    def __call__(self, size, alignment, stream):
        key = (self.device, stream)
        buf = _SCRATCH.get(key)
        if buf is None or buf.numel() < size:
            buf = _SCRATCH[key] = torch.empty(size, dtype=torch.int8, device=self.device)
        return buf


_SCRATCH = {}   # (device, stream) -> int8 buffer


_NO_CONFIG = triton.Config({})


def launch_first_compiling(kernel, grid, kernel_args, configs):
    """Launch ``kernel`` with the first of ``configs`` (a pruned list, in order) that compiles
    and loads, as the autotuner would among them; ``grid(config.kwargs)`` gives each one's grid
    (a config None: the kernel's own launch options, ``grid({})``).
    Returns (the compiled kernel, its config); raises the last config's error when none does."""
    for i, cfg in enumerate(configs):
        try:
            if cfg is None:   # a kernel without configs: Triton's default launch options
                return kernel[grid({})](**kernel_args), _NO_CONFIG
            if cfg.pre_hook is not None:   # as the autotuner does (e.g. descriptor blocks)
                cfg.pre_hook({**kernel_args, **cfg.all_kwargs()})
            return kernel[grid(cfg.kwargs)](**kernel_args, **cfg.kwargs, num_warps=cfg.num_warps,
                                            num_stages=cfg.num_stages), cfg
        except _COMPILE_ERRORS:
            if i == len(configs) - 1:
                raise
