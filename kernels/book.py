"""``kernels.book``: fused twins of the book's (``llms-from-scratch``) attention classes.

The short import path of :mod:`kernels.integrations.book`: every name read here is that
module's object. To monkeypatch one, patch ``kernels.integrations.book`` itself.
"""
from .integrations import book as _impl


def __getattr__(name):
    return getattr(_impl, name)


def __dir__():
    return dir(_impl)
