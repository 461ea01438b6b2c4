"""The one timing method of every benchmark: ``measure`` (one callable in one mode: status,
time quantiles, peak memory, first-call time) and ``time_interleaved`` (ratios of several
callables on a loaded machine).

Per row: ``make()`` builds the timed function and it is called once (compile, autotune; its
wall time is ``first_call_s``; a failure makes the row ``oom``, ``unsupported: <reason>`` or
``error: <message>``); peak memory on a GPU from a second call between
``reset_peak_memory_stats()`` and ``max_memory_allocated()`` less the inputs, on CPU from the
warm-up call's allocator records (:class:`CpuPeakMemory`); timing by ``triton.testing.do_bench``
on a GPU (L2 flushed, ``.grad`` cleared), on CPU at most ``cpu_reps`` wall-clock runs within
``cpu_max_s``; ``gpu_wall_reps=N``: N synchronised wall-clock runs (generation loops).
"""
import contextlib
import gc
import os
import statistics
import time
import warnings

import torch

QUANTILES = (0.5, 0.2, 0.8)


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is (or wraps) a device out-of-memory error."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = f"{type(exc).__name__}: {exc}".lower()
    return "out of memory" in text or "outofmemory" in text


def synchronize(device):
    """Wait for all queued work on ``device`` (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory(device, collect=True):
    """Return cached blocks to the device, after a garbage collection when ``collect`` (after an
    OOM or an error, whose traceback may have kept tensors in reference cycles)."""
    if collect:
        gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def quantiles(samples):
    """(median, p20, p80) of ``samples``."""
    samples = sorted(samples)
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    qs = statistics.quantiles(samples, n=10, method="inclusive")  # deciles: qs[1]=p20, qs[7]=p80
    return statistics.median(samples), qs[1], qs[7]


def time_cpu(fn, *, reps=5, max_s=3.0):
    """(median, p20, p80, runs) in ms of ``fn`` over up to ``reps`` runs or ``max_s`` seconds (>= 1
    run); ``runs``: how many there were.

    ``fn`` has already been called once (warm-up) by the caller.
    """
    samples = []
    start = time.perf_counter()
    while len(samples) < reps and (not samples or time.perf_counter() - start < max_s):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return (*quantiles(samples), len(samples))


def time_cuda(fn, *, warmup_ms=25, rep_ms=100, grad_to_none=None):
    """(median, p20, p80) in ms of ``fn`` from CUDA events via triton.testing.do_bench."""
    from triton.testing import do_bench

    res = do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                   quantiles=list(QUANTILES))
    return tuple(float(x) for x in res)


class PeakMemory:
    """Context manager: peak device memory allocated inside the block, above what was allocated
    on entry (``extra_bytes``); None on CPU, where it is not measured."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.extra_bytes = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        if self.cuda and exc[0] is None:
            torch.cuda.synchronize()
            self.extra_bytes = int(torch.cuda.max_memory_allocated() - self._base)
        return False


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for the duration: the profiler's backend (kineto) prints
    a line to stderr at every start and stop, which no setting turns off."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# PyTorch's attention ops, as torch.profiler names them: the one a call ran says what was
# timed. On CPU ours at dropout 0 hands the work to the first (kernels/core/fallback.py), the op
# SDPA's flash backend runs too: such rows time the same code, and their ratio says nothing.
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math",
                 "aten::_scaled_dot_product_flash_attention",
                 "aten::_scaled_dot_product_efficient_attention",
                 "aten::_scaled_dot_product_cudnn_attention")


def attention_op(op_names):
    """The first of ATTENTION_OPS among ``op_names`` (the ops a call ran), or None: the call
    computed attention with other ops (matmul, softmax: the book's code, our fallback's own
    path)."""
    return next((op for op in ATTENTION_OPS if op in op_names), None)


def ops_run(fn):
    """The names of the ops ``fn()`` runs on CPU (torch.profiler), for :func:`attention_op`."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    return {e.name() for e in prof.profiler.kineto_results.events()}


# Fewer timed runs than this give no spread: a p20-p80 range of one or two runs is not one (a
# slow CPU row gets a single run within --cpu-max-s).
MIN_RUNS_FOR_SPREAD = 3


def ratio_spread(num, den):
    """``num`` ms / ``den`` ms (two ok rows, or dicts with ``ms``, ``ms_p20``, ``ms_p80`` and
    optionally ``timed_runs``) with its spread: (ratio, low, high, noise), low = num p20 / den
    p80, high = num p80 / den p20; ``noise`` when 1 lies in [low, high], i.e. the two p20-p80
    ranges overlap: the run cannot tell the two apart. Without percentiles, or with fewer than
    MIN_RUNS_FOR_SPREAD timed runs on a side: (ratio, None, None, None), no spread measured."""
    ratio = num["ms"] / den["ms"]
    if None in (num.get("ms_p20"), num.get("ms_p80"), den.get("ms_p20"), den.get("ms_p80")):
        return ratio, None, None, None
    if min(r.get("timed_runs") or MIN_RUNS_FOR_SPREAD for r in (num, den)) < MIN_RUNS_FOR_SPREAD:
        return ratio, None, None, None
    low, high = num["ms_p20"] / den["ms_p80"], num["ms_p80"] / den["ms_p20"]
    return ratio, low, high, bool(low <= 1.0 <= high)


def format_ratio(ratio, low, high, noise):
    """``1.23x [1.10-1.35]``, ``NOISE`` appended when the ranges overlap (:func:`ratio_spread`);
    ``1.23x [no spread]`` where none was measured (too few timed runs)."""
    text = f"{ratio:.3g}x"
    if low is not None:
        return text + f" [{low:.3g}-{high:.3g}]" + (" NOISE" if noise else "")
    return text + " [no spread]"


class CpuPeakMemory:
    """Context manager: peak bytes held by PyTorch's CPU allocator inside the block above what
    it held on entry (``extra_bytes``; tensors only), from torch.profiler's memory records, and
    the names of the ops the block ran (``ops``: what was timed, :func:`attention_op`). The
    block runs on one PyTorch thread: the profiler does not see other threads' records (the
    fallback's workers), and the sizes do not depend on the thread count."""

    def __init__(self):
        self.extra_bytes = None
        self.ops = set()

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            with _quiet_stderr():
                self._prof.__exit__(*exc)
        finally:
            torch.set_num_threads(self._threads)
        if exc[0] is None:
            all_events = list(self._prof.profiler.kineto_results.events())
            self.ops = {e.name() for e in all_events}
            events = sorted((e.start_ns(), e.nbytes()) for e in all_events
                            if e.name() == "[memory]")
            held = peak = 0
            for _, nbytes in events:
                held += nbytes
                peak = max(peak, held)
            self.extra_bytes = int(peak)
        self._prof = None
        return False


def time_interleaved(fns, *, min_rounds=1, min_s=0.0, max_s=float("inf"), inner=1, warmup=1,
                     sync=None, rotate=False):
    """{name: [seconds per call, one sample a round]} of the callables ``fns`` run in turn,
    round after round, after ``warmup`` calls each, until ``min_rounds`` rounds and ``min_s``
    seconds are done, or ``max_s`` seconds have passed: on a loaded machine every callable sees
    the same load, so their ratios hold where their absolute times do not. A sample is
    ``inner`` calls and ``sync()`` (a CUDA synchronize) over ``inner``; ``rotate``: each round
    starts one callable later."""
    sync = sync or (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    names, times = list(fns), {name: [] for name in fns}
    start, rnd = time.perf_counter(), 0
    while True:
        first = rnd % len(names) if rotate else 0
        for name in names[first:] + names[:first]:
            t0 = time.perf_counter()
            for _ in range(inner):
                fns[name]()
            sync()
            times[name].append((time.perf_counter() - t0) / inner)
        rnd += 1
        elapsed = time.perf_counter() - start
        if elapsed > max_s or (rnd >= min_rounds and elapsed >= min_s):
            return times


# ``runs``: on CPU, the PyTorch attention op the warm-up call ran (ATTENTION_OPS), else None.
# ``timed_runs``: how many wall-clock runs the quantiles come from (None: do_bench's many).
MEASURE_KEYS = ("status", "ms", "ms_p20", "ms_p80", "timed_runs", "peak_mem_bytes",
                "first_call_s", "runs")


def mode_maker(forward, mode, dout, grads):
    """``make()`` returning the function timed for ``mode`` (fwd: ``forward()`` under no_grad;
    bwd: backward of one retained forward graph; fwd_bwd: both). ``forward()`` returns a tensor
    or a list, ``dout`` its upstream gradient(s), ``grads`` the leaves the backward writes."""
    if mode == "fwd":
        def make():
            def fn():
                with torch.no_grad():
                    return forward()
            return fn
    elif mode == "bwd":
        def make():
            out = forward()

            def fn():
                torch.autograd.backward(out, dout, retain_graph=True)
            return fn
    elif mode == "fwd_bwd":
        def make():
            def fn():
                torch.autograd.backward(forward(), dout)
            return fn
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return make


def describe(exc):
    """``Type: message`` of ``exc`` on one line, at most 240 characters."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:240]


def classify_failure(exc, caught_warnings=(), unsupported_reason=None):
    """Status string for an exception raised while running a case: ``oom``, ``unsupported: ..``
    (NotImplementedError, or what the provider's ``unsupported_reason`` recognises) or
    ``error: <type>: <message>``."""
    if is_oom(exc):
        return "oom"
    if unsupported_reason is not None:
        reason = unsupported_reason(exc, caught_warnings)
        if reason:
            return f"unsupported: {reason}"
    if isinstance(exc, NotImplementedError):
        return f"unsupported: {' '.join(str(exc).split())[:200]}"
    return f"error: {describe(exc)}"


def measure(make, device, *, grads=(), warmup_ms=25, rep_ms=100, cpu_reps=3, cpu_max_s=2.0,
            unsupported_reason=None, gpu_wall_reps=None):
    """Run the protocol in this module's docstring; return a dict with MEASURE_KEYS."""
    result = dict.fromkeys(MEASURE_KEYS)
    cuda = torch.device(device).type == "cuda"

    def clear_grads():
        for t in grads:
            t.grad = None

    status = None
    fn = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            cpu_mem = CpuPeakMemory() if not cuda else None
            try:
                with cpu_mem or contextlib.nullcontext():
                    fn = make()
                    fn()
                synchronize(device)
            except Exception as exc:  # classified below, never re-raised
                status = classify_failure(exc, caught, unsupported_reason)
            result["first_call_s"] = round(time.perf_counter() - t0, 3)
            if cpu_mem is not None:
                result["peak_mem_bytes"] = cpu_mem.extra_bytes
                result["runs"] = attention_op(cpu_mem.ops)
        if status is None and cuda and gpu_wall_reps:
            def synced():
                clear_grads()
                fn()
                synchronize(device)
            with PeakMemory(device) as pm:
                ms, p20, p80, runs = time_cpu(synced, reps=gpu_wall_reps, max_s=float("inf"))
            result.update(ms=ms, ms_p20=p20, ms_p80=p80, timed_runs=runs,
                          peak_mem_bytes=pm.extra_bytes)
            status = "ok"
        if status is None and cuda:
            clear_grads()
            fn = None  # frees the warm-up's graph and outputs (no cycles: no gc needed)
            with PeakMemory(device) as pm:
                fn = make()
                fn()
            result["peak_mem_bytes"] = pm.extra_bytes
        if status is None:
            if cuda:
                ms, p20, p80 = time_cuda(fn, warmup_ms=warmup_ms, rep_ms=rep_ms,
                                         grad_to_none=list(grads) or None)
            else:
                def timed():
                    clear_grads()
                    fn()
                # The warm-up counts toward the row's window (at least one timed run).
                left_s = max(0.0, cpu_max_s - result["first_call_s"])
                ms, p20, p80, runs = time_cpu(timed, reps=cpu_reps, max_s=left_s)
                result["timed_runs"] = runs
            result.update(ms=ms, ms_p20=p20, ms_p80=p80)
            status = "ok"
    except Exception as exc:
        status = classify_failure(exc, (), unsupported_reason)
    result["status"] = status
    fn = None
    clear_grads()
    if status != "ok":
        free_memory(device)
    return result
