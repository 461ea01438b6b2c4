"""Timing and memory measurement: CUDA events on a GPU, a wall clock on CPU.

GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed before every call, warm-up and
repetitions given in milliseconds) returns the median and the 20th/80th percentiles.
CPU: the same quantiles over a handful of wall-clock runs (the kernel runs in Triton's
interpreter there, so the figures say nothing about GPU speed).
"""
import gc
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
