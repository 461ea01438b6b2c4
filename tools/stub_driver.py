"""The stand-in Triton driver the developer tools use instead of a GPU: a CUDA target of the
given compute capability (``cc``, e.g. 90), device 0, stream 0 -- enough for Triton to compile
(sm90_static.py, precompile.py) and for the host-cost tool to launch through a stub libcuda
(host_overhead.py). Not a tool of its own: ``install(cc)`` is called by those.
``install_hip(arch)`` is the AMD twin (amd_static.py): a HIP target (``GPUTarget("hip", arch,
64)``, wave64) and a ROCm-looking ``torch`` (``torch.version.hip``, the device's gfx name, CU
count and LDS per workgroup), so the project's GPU detection takes its AMD path."""


def install(cc, target=None):
    """Make Triton's active driver the stand-in for ``cc`` and ``torch.cuda`` report that
    capability; returns the ``GPUTarget``."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    target = target or GPUTarget("cuda", cc, 32)

    class StubDriver:
        """What ``JITFunction.run`` and the compiler ask of ``triton.runtime.driver.active``."""
        _utils = None

        @property
        def utils(self):
            """Triton's CUDA utilities (built on first use, against whatever libcuda the
            process loads: host_overhead.py's stub): Triton's launcher asks them to encode
            host tensor descriptors."""
            if StubDriver._utils is None:
                from triton.backends.nvidia.driver import CudaUtils
                StubDriver._utils = CudaUtils()
            return StubDriver._utils

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


def install_hip(arch, capability, cu_count, lds_bytes):
    """Make Triton's active driver a stand-in for the AMD GPU ``arch`` (e.g. "gfx942") and
    ``torch`` look like a ROCm build on it: ``torch.version.hip`` set, ``get_device_capability``
    = ``capability``, ``get_device_properties`` with ``gcnArchName``, ``multi_processor_count``
    (CUs) and ``shared_memory_per_block_optin`` (LDS per workgroup). Returns the ``GPUTarget``."""
    import types

    import torch
    from triton.backends.compiler import GPUTarget

    target = install(0, GPUTarget("hip", arch, 64))
    props = types.SimpleNamespace(
        name=f"AMD Instinct ({arch}, stand-in)", gcnArchName=f"{arch}:sramecc+:xnack-",
        multi_processor_count=cu_count, shared_memory_per_block_optin=lds_bytes,
        major=capability[0], minor=capability[1], warp_size=64)
    torch.version.hip = "7.0.0-stand-in"
    torch.cuda.get_device_capability = lambda *a, **k: tuple(capability)
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_name = lambda *a, **k: props.name
    return target
