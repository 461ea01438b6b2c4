"""``kernels.modules``: the drop-in modules (``FusedCausalAttention``, ``FusedMultiHeadAttention``,
``FusedMultiHeadAttentionWrapper``).

The short import path of :mod:`kernels.integrations.modules`: every name read here is that
module's object. To monkeypatch one, patch ``kernels.integrations.modules`` itself.
"""
from .integrations import modules as _impl


def __getattr__(name):
    return getattr(_impl, name)


def __dir__():
    return dir(_impl)
