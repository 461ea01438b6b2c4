"""``kernels.sdpa``: our kernel as PyTorch SDPA's flash implementation (``register()``, ``NAME``).

The short import path of :mod:`kernels.integrations.sdpa`: every name read here is that
module's object. To monkeypatch one, patch ``kernels.integrations.sdpa`` itself.
"""
from .integrations import sdpa as _impl


def __getattr__(name):
    return getattr(_impl, name)


def __dir__():
    return dir(_impl)
