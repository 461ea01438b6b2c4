"""Benchmarks of the fused attention kernel against PyTorch's attention implementations.

Run ``python -m benchmarks --help``. Importing this package on a machine without CUDA sets
``TRITON_INTERPRET=1`` (Triton reads it when ``@triton.jit`` decorates a kernel, so it has to
happen before ``kernels`` is imported): the kernel then runs in Triton's CPU interpreter.
"""
import os
import sys


def use_interpreter_if_no_cuda(force_cpu: bool = False) -> bool:
    """Set TRITON_INTERPRET=1 when there is no CUDA device (or ``force_cpu``); return whether set.

    Must run before the first import of ``kernels``; warns when that already happened.
    """
    import torch

    if force_cpu or not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1" and "kernels" in sys.modules:
            print("benchmarks: warning: `kernels` was imported before TRITON_INTERPRET=1 was set; "
                  "its kernels may not run on CPU", file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return False


use_interpreter_if_no_cuda()
