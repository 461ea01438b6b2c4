"""Measure the two ceilings of the GPU: bf16 matmul rate and device-memory copy bandwidth.

``python -m benchmarks.ceilings [--out FILE.json]``

* matmul: ``torch.matmul`` of random bf16 8192x8192 by 8192x8192 (2*8192^3 FLOPs), median of
  ``triton.testing.do_bench`` (CUDA events), in TFLOP/s.
* copy: ``dst.copy_(src)`` of a 1 GiB buffer of random data, bytes read + bytes written over
  the median time, in GB/s (1e9 bytes).

These are the measured ceilings that attention TFLOP/s figures are judged against
(docs/performance.md). Needs CUDA; on CPU it says so and exits with status 0 without numbers.
"""
import argparse
import sys

import torch


def matmul_tflops(n=8192, dtype=torch.bfloat16):
    """TFLOP/s of an n x n x n matmul on random data: (median, low, high) = rates at the
    median, 80th- and 20th-percentile times."""
    from triton.testing import do_bench

    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms, p20, p80 = do_bench(lambda: torch.matmul(a, b), warmup=100, rep=500,
                            quantiles=[0.5, 0.2, 0.8])
    flops = 2.0 * n ** 3
    return tuple(flops / (t * 1e-3) / 1e12 for t in (ms, p80, p20))


def copy_gbps(nbytes=1 << 30):
    """GB/s of a device-to-device copy, counting bytes read + written: (median, low, high)."""
    from triton.testing import do_bench

    src = torch.randn(nbytes // 4, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    ms, p20, p80 = do_bench(lambda: dst.copy_(src), warmup=100, rep=500,
                            quantiles=[0.5, 0.2, 0.8])
    moved = 2.0 * src.numel() * src.element_size()
    return tuple(moved / (t * 1e-3) / 1e9 for t in (ms, p80, p20))


def main(argv=None):
    """Measure, print, optionally write JSON (report's writer, with device and versions);
    returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.ceilings", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the numbers to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ceilings: no CUDA device; nothing measured (CPU numbers would mean nothing here)")
        return 0
    from .report import REPO_DIR, collect_meta, write_json

    mm, cp = matmul_tflops(), copy_gbps()
    print(f"ceilings on {torch.cuda.get_device_name()}: bf16 8192^3 matmul {mm[0]:.0f} TFLOP/s "
          f"({mm[1]:.0f}..{mm[2]:.0f}); copy {cp[0]:.0f} GB/s ({cp[1]:.0f}..{cp[2]:.0f})")
    if args.out:
        meta = collect_meta("cuda", vars(args), REPO_DIR)
        meta["timing"] += ("; random data; copy counts bytes read + written; median = the rate "
                           "at the median time, low / high = at the 80th / 20th percentile")
        write_json(args.out, meta, [
            dict(what="matmul bf16 8192^3", unit="TFLOP/s", median=mm[0], low=mm[1], high=mm[2]),
            dict(what="copy 1 GiB", unit="GB/s", median=cp[0], low=cp[1], high=cp[2])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
