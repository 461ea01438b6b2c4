"""``kernels.hf``: our kernel as a Hugging Face transformers attention (``register()``,
``attention_function``, ``mask_hook``).

The short import path of :mod:`kernels.integrations.hf`: every name read here is that
module's object. To monkeypatch one, patch ``kernels.integrations.hf`` itself.
"""
from .integrations import hf as _impl


def __getattr__(name):
    return getattr(_impl, name)


def __dir__():
    return dir(_impl)
