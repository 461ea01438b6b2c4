"""Timing and memory measurement: CUDA events on a GPU, a wall clock on CPU.

GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed before every call, warm-up and
repetitions given in milliseconds) returns the median and the 20th/80th percentiles.
CPU: the same quantiles over a handful of wall-clock runs; peak memory from the CPU
allocator's records in torch.profiler (:class:`CpuPeakMemory`).
"""
import contextlib
import gc
import os
import statistics
import time

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


def _quantiles(samples):
    samples = sorted(samples)
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    qs = statistics.quantiles(samples, n=10, method="inclusive")  # deciles: qs[1]=p20, qs[7]=p80
    return statistics.median(samples), qs[1], qs[7]


def time_cpu(fn, *, reps=5, max_s=3.0):
    """(median, p20, p80) in ms of ``fn`` over up to ``reps`` runs or ``max_s`` seconds (>= 1 run).

    ``fn`` has already been called once (warm-up) by the caller.
    """
    samples = []
    start = time.perf_counter()
    while len(samples) < reps and (not samples or time.perf_counter() - start < max_s):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _quantiles(samples)


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


class CpuPeakMemory:
    """Context manager: peak bytes held by PyTorch's CPU allocator inside the block, above what
    it held on entry (``extra_bytes``), the CPU analogue of ``PeakMemory`` (tensors only: no
    allocator caches or Python objects). Read from torch.profiler's memory records (each
    allocation and free, in order). The block runs with one PyTorch thread: the records of
    threads the profiler was not started in are not seen (the PyTorch fallback of
    ``kernels`` runs worker threads when given more than one), and the sizes do not depend on
    the thread count. The profiler costs a few ms per block (1-3 s the first time)."""

    def __init__(self):
        self.extra_bytes = None

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
            events = sorted((e.start_ns(), e.nbytes())
                            for e in self._prof.profiler.kineto_results.events()
                            if e.name() == "[memory]")
            held = peak = 0
            for _, nbytes in events:
                held += nbytes
                peak = max(peak, held)
            self.extra_bytes = int(peak)
        self._prof = None
        return False
