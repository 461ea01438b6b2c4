"""``kernels.distributed``: context-parallel ring attention (``ring_attention``, ``shard``,
``unshard``).

The short import path of :mod:`kernels.integrations.distributed`: every name read here is that
module's object. To monkeypatch one, patch ``kernels.integrations.distributed`` itself.
"""
from .integrations import distributed as _impl


def __getattr__(name):
    return getattr(_impl, name)


def __dir__():
    return dir(_impl)
