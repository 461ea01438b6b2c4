"""``kernels.fuse``: ``fuse_attention``: swap a model's attention modules for the fused ones.

The short import path of :mod:`kernels.integrations.fuse`: every name read here is that
module's object. To monkeypatch one, patch ``kernels.integrations.fuse`` itself.
"""
from .integrations import fuse as _impl


def __getattr__(name):
    return getattr(_impl, name)


def __dir__():
    return dir(_impl)
