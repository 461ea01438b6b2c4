"""The measurements of one provider of the CPU fallback rows (``--fallback-row``,
``--fallback-dropout``), run as a script in a fresh process by benchmarks/cpu_fallback.py:
``python benchmarks/cpu_fallback_probe.py --provider kernels_fallback --modes fwd fwd_bwd --seq
16384`` (``--dropout 0.1``: our fallback with its Philox mask, SDPA with ``dropout_p=0.1``).
Prints one JSON line per mode.

Run by path, not as ``-m benchmarks...``: importing the ``benchmarks`` package sets
TRITON_INTERPRET=1 on a machine without CUDA, and this row measures the PyTorch fallback,
which runs only with the interpreter off. So nothing here imports ``benchmarks``.

Protocol, per mode: a warm-up call of the same provider and mode at a small seq (imports,
thread pools, first-call caches), then the inputs (q, k, v, do: not counted), then

* ``--what memory``: the high-water mark of the resident set is reset
  (``/proc/self/clear_refs``, Linux) and one call at full size gives ``peak_extra_bytes`` =
  VmHWM - VmRSS before it (output and gradients included, as on the GPU); without clear_refs,
  ``ru_maxrss`` after minus before (a lower bound). The caller sets
  ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns freed blocks to the OS and the
  resident set follows live memory.
* ``--what time`` (run without that setting: it turns every large allocation into an mmap and
  page faults, measured to double the blockwise path's time): a first call at full size
  (``first_call_s``), then up to ``--reps`` timed calls, none started ``--max-s`` seconds after
  the first call began (at least one).
"""
import argparse
import gc
import json
import os
import resource
import sys
import time
import warnings

PROVIDERS = ("kernels_fallback", "kernels_fallback_blockwise", "sdpa")


def _status_kib(field):
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def _reset_hwm():
    """Reset VmHWM to the current RSS; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return _status_kib("VmHWM") <= _status_kib("VmRSS") + 64
    except OSError:
        return False


def measure(mode, warm, inputs, run, args):
    """Warm-up, inputs, then the peak extra memory of one full-size call (``--what memory``)
    or the first call and the timed calls (``--what time``)."""
    import torch

    from kernels.core import fallback
    from kernels.core.call import AttentionCall

    run(mode, *inputs(warm, mode))
    q, k, v, do = inputs(args.seq, mode)
    path = None
    if args.provider != "sdpa":
        window = args.seq if args.provider == "kernels_fallback_blockwise" else None
        path = ("sdpa" if fallback._sdpa_applies(
            q, k, None, AttentionCall(True, 1.0, args.dropout, 0, window))
                else "blockwise")
    gc.collect()
    if args.what == "time":
        t0 = time.perf_counter()
        run(mode, q, k, v, do)
        first = time.perf_counter() - t0
        samples = []
        while len(samples) < args.reps and (not samples
                                            or time.perf_counter() - t0 < args.max_s):
            t = time.perf_counter()
            run(mode, q, k, v, do)
            samples.append((time.perf_counter() - t) * 1e3)
        return {"mode": mode, "ms": samples, "first_call_s": round(first, 3),
                "threads": torch.get_num_threads(), "fallback_path": path, "warmup_seq": warm,
                "dropout_p": args.dropout}
    exact = _reset_hwm()
    if exact:
        method = "VmHWM after - VmRSS before (high-water mark reset via /proc/self/clear_refs)"
        base = _status_kib("VmRSS")
    else:
        method = "ru_maxrss after - ru_maxrss before (a lower bound: clear_refs unavailable)"
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run(mode, q, k, v, do)
    peak = _status_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "peak_extra_bytes": max(0, peak - base) * 1024,
            "peak_mem_method": method, "threads": torch.get_num_threads(),
            "fallback_path": path, "warmup_seq": warm, "dropout_p": args.dropout}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--provider", choices=PROVIDERS, required=True)
    p.add_argument("--modes", nargs="+", choices=("fwd", "fwd_bwd"), required=True)
    p.add_argument("--what", choices=("time", "memory"), required=True)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="0 = PyTorch's default")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-s", type=float, default=15.0)
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout_p (ours: seed 1234, the kernels' Philox mask; SDPA: its own)")
    args = p.parse_args(argv)

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    warnings.simplefilter("ignore")  # the fallback's one-time RuntimeWarning
    import torch
    import torch.nn.functional as F

    import kernels
    from kernels.core.common import interpreter_active

    if interpreter_active():
        print(json.dumps({"error": "TRITON_INTERPRET is set: the kernel would run in Triton's "
                                   "interpreter, not the PyTorch fallback"}))
        return 1
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    p = args.dropout

    def call(q, k, v):
        if args.provider == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        seed = 1234 if p > 0 else None
        if args.provider == "kernels_fallback_blockwise":
            # window = seq: the same function as plain causal, through the blockwise path
            # (the one dropout, windows, q_len != k_len and packed sequences take).
            return kernels.attention(q, k, v, causal=True, window=q.shape[2], dropout_p=p,
                                     seed=seed)
        return kernels.attention(q, k, v, causal=True, dropout_p=p, seed=seed)

    def inputs(n, mode):
        g = torch.Generator().manual_seed(n)
        shape = (args.batch, args.heads, n, args.head_dim)
        grad = mode == "fwd_bwd"
        q, k, v = (torch.randn(shape, generator=g).requires_grad_(grad) for _ in range(3))
        return q, k, v, torch.randn(shape, generator=g)

    def run(mode, q, k, v, do):
        if mode == "fwd":
            with torch.no_grad():
                call(q, k, v)
        else:
            call(q, k, v).backward(do)
            q.grad = k.grad = v.grad = None

    warm = 256 if args.seq > 512 else max(1, args.seq // 2)
    for mode in args.modes:
        print(json.dumps(measure(mode, warm, inputs, run, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
