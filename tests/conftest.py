"""Test harness: run every kernel in Triton's CPU interpreter when there is no CUDA device.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a function, so it is set here, before
any test module imports ``kernels``.
"""
import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
else:
    # Correctness, not speed: one fitting config per launch instead of autotuning every small
    # test shape (tests/core/test_configs.py forces each config once). Override with
    # KERNELS_AUTOTUNE=1 to test the autotuned path.
    os.environ.setdefault("KERNELS_AUTOTUNE", "0")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none "
                                   "(the CPU run covers the same kernel in Triton's interpreter)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_every_test(request):
    """Each test gets its own fixed seed (from its id): fresh inputs per test, reproducible runs."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
