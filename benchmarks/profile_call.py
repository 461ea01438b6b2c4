"""Probe: where one call's time goes, by kernel and on the host (torch.profiler), for ours in
the benchmark's three modes (fwd, bwd, fwd_bwd) at one shape, with SDPA's flash backend beside
it.

Why: the first H200 run (2026-11-26) timed ours at 128 x 16 heads x 128, d128, causal bf16 at
fwd 0.283 ms, bwd 0.760 ms but fwd_bwd 2.438 ms (1.4 ms more than the two), where every other
provider's fwd_bwd is about its fwd + bwd. The profile tells GPU kernel time (which kernel, how
many launches) from host time (validation, the custom op, autograd, allocations)::

    python -m benchmarks.profile_call [--batch 128 --heads 16 --seq 128 --head-dim 128]
                                      [--json OUT.json]

Prints, per (provider, mode): the CUDA-event time of one call (median of ``--reps``), the sum
of its GPU kernels' times and the top kernels by time, then the host's self time of the top
CPU ops. ``--device cpu`` runs the same on the CPU (the kernels' PyTorch path; no GPU
kernels): a smoke test of this script, not a measurement.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import kernels

from .measure import mode_maker

MODES = ("fwd", "bwd", "fwd_bwd")


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def _call_ms(call, reps, cuda):
    """Median time of one call: CUDA events on the GPU, the wall clock on the CPU."""
    times = []
    for _ in range(reps):
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile(name, call, reps, top, cuda=True):
    for _ in range(3):                      # compile, autotune, warm the allocator
        call()
    _sync(cuda)
    ms = _call_ms(call, reps, cuda)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(reps):
            call()
        _sync(cuda)
    events = prof.key_averages()
    gpu = sorted((e for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA"),
                 key=lambda e: -e.device_time_total)
    gpu_ms = sum(e.device_time_total for e in gpu) / 1e3 / reps
    cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    print(f"\n== {name}: {ms:.3f} ms per call (median of {reps}); GPU kernels "
          f"{gpu_ms:.3f} ms per call")
    for e in gpu[:top]:
        print(f"   gpu {e.device_time_total / 1e3 / reps:8.3f} ms  x{e.count // reps:<3d} "
              f"{e.key[:90]}")
    for e in cpu:
        print(f"   cpu {e.self_cpu_time_total / 1e3 / reps:8.3f} ms self  x{e.count // reps:<3d} "
              f"{e.key[:90]}")
    return dict(name=name, ms=ms, gpu_kernels_ms=gpu_ms,
                gpu=[(e.key, e.device_time_total / 1e3 / reps, e.count // reps)
                     for e in gpu[:top]],
                cpu_self=[(e.key, e.self_cpu_time_total / 1e3 / reps, e.count // reps)
                          for e in cpu])


def build_parser():
    """The command line (also used by benchmarks.device_plan to validate a device script)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_call", allow_abbrev=False,
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS))
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--json")
    ap.add_argument("--ncu", action="store_true",
                    help="for Nsight Compute: no torch.profiler; per (provider, mode) 3 warm-up "
                         "calls, then --reps calls between cudaProfilerStart / Stop (run under "
                         "`ncu --profile-from-start off`)")
    return ap


def _cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


PROVIDERS = {
    "ours": lambda q, k, v: kernels.attention(q, k, v, causal=True),
    "sdpa_flash": lambda q, k, v: _flash(q, k, v),
    "sdpa_cudnn": lambda q, k, v: _cudnn(q, k, v),
}


def main(argv=None):
    a = build_parser().parse_args(argv)
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("profile_call: no CUDA device here (--device cpu for a smoke run)")
    if not cuda and "sdpa_cudnn" in a.providers:
        a.providers = [p for p in a.providers if p != "sdpa_cudnn"]   # CUDA-only backend
    shape = (a.batch, a.heads, a.seq, a.head_dim)
    dtype = torch.bfloat16 if cuda else torch.float32
    q, k, v = (torch.randn(shape, device=a.device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    do = torch.randn(shape, device=a.device, dtype=dtype)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"shape {shape} {dtype} causal; {device_name}; KERNELS_TMA="
          f"{os.environ.get('KERNELS_TMA', '1')}")
    records = []
    for pname in a.providers:
        fn = PROVIDERS[pname]
        for mode in a.modes:
            # The benchmark's own timed functions (benchmarks/measure.py).
            call = mode_maker(lambda fn=fn: fn(q, k, v), mode, do, (q, k, v))()
            if a.ncu:
                for _ in range(3):          # compile, autotune, warm the allocator
                    call()
                _sync(cuda)
                if cuda:
                    torch.cuda.cudart().cudaProfilerStart()
                for _ in range(a.reps):
                    call()
                _sync(cuda)
                if cuda:
                    torch.cuda.cudart().cudaProfilerStop()
                print(f"ncu window: {pname} {mode}, {a.reps} calls", flush=True)
            else:
                records.append(profile(f"{pname} {mode}", call, a.reps, a.top, cuda))
            for t in (q, k, v):
                t.grad = None
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(shape=shape, device=device_name, torch=torch.__version__,
                           triton=_triton_version(), kernels_tma=os.environ.get("KERNELS_TMA", "1"),
                           records=records), f, indent=1)


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


def _flash(q, k, v):
    """SDPA's flash backend on the GPU (whatever SDPA picks on the CPU)."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


if __name__ == "__main__":
    main()
