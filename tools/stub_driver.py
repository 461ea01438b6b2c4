"""The stand-in Triton driver the developer tools use instead of a GPU: a CUDA target of the
given compute capability (``cc``, e.g. 90), device 0, stream 0 -- enough for Triton to compile
(sm90_static.py, precompile.py) and for the host-cost tool to launch through a stub libcuda
(host_overhead.py). Not a tool of its own: ``install(cc)`` is called by those."""


def install(cc):
    """Make Triton's active driver the stand-in for ``cc`` and ``torch.cuda`` report that
    capability; returns the ``GPUTarget``."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", cc, 32)

    class StubDriver:
        """What ``JITFunction.run`` and the compiler ask of ``triton.runtime.driver.active``."""

        def get_current_target(self):
            return target

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        def is_active(self):
            return True

    triton.runtime.driver.set_active(StubDriver())
    torch.cuda.get_device_capability = lambda *a, **k: (cc // 10, cc % 10)
    return target
