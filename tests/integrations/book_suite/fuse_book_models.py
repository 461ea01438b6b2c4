"""pytest plugin: run ``llms-from-scratch``'s own tests with every model they build fused.

Loaded by ``tests/integrations/test_book_package_suite.py`` as
``python -m pytest -p fuse_book_models ...`` (this directory on ``PYTHONPATH``) over the
package's installed test files, which stay unchanged. It

* wraps ``__init__`` of each model class of the package (``ch04.GPTModel``, ``GPTModelFast``,
  ``kv_cache.gpt2.GPTModel``, the plain and KV-cache ``Llama3Model`` / ``Llama3ModelFast``, the
  plain, KV-cache and batched KV-cache ``Qwen3Model``): once the package's constructor has
  run, ``kernels.fuse_attention(model, strict=True)`` swaps the attention modules in place, and
  the constructor raises ``AssertionError`` (so the test fails) unless the number swapped equals
  the number of the package's attention modules counted in the model beforehand (at least
  one) and none is left afterwards;
* replaces, in each collected test module's namespace only, the package's attention classes
  that the test builds directly (``MultiHeadAttention(...)``, ``GroupedQueryAttention(...)``)
  by a factory returning ``fuse_attention(module, strict=True)``'s twin (the same check:
  exactly one swapped); the package's own modules keep their classes, so models still build
  the originals for ``fuse_attention`` to recognise;
* counts, per test, the Triton forward launches (``ForwardPlan`` calls: dense, packed and
  KV-cache) and the PyTorch-fallback calls, so the caller can tell that the fused kernel ran;
* writes every construction, count and outcome as JSON to ``$BOOK_SUITE_RECORD``.

``BOOK_SUITE_NO_FUSE=1`` replaces ``kernels.fuse_attention`` by one that swaps nothing, to show
that the checks above then fail the tests (the harness's own test).
"""
import functools
import importlib
import json
import os

import torch

if not torch.cuda.is_available():
    # As tests/conftest.py: before anything imports kernels (read at @triton.jit time).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

_PKG = "llms_from_scratch."

#: The package's attention classes (the oracle of what must be swapped), "module.Class".
ATTENTION = (
    "ch03.CausalAttention", "ch03.MultiHeadAttention", "ch03.MultiHeadAttentionWrapper",
    "ch03.PyTorchMultiHeadAttention", "kv_cache.gpt2.MultiHeadAttention",
    "llama3.GroupedQueryAttention", "llama3.GroupedQueryAttentionFast",
    "kv_cache.llama3.GroupedQueryAttention", "kv_cache.llama3.GroupedQueryAttentionFast",
    "qwen3.GroupedQueryAttention", "kv_cache.qwen3.GroupedQueryAttention",
    "kv_cache_batched.qwen3.GroupedQueryAttention",
)

#: The package's model classes whose constructors are wrapped.
MODELS = (
    "ch04.GPTModel", "ch04.GPTModelFast", "kv_cache.gpt2.GPTModel",
    "llama3.Llama3Model", "llama3.Llama3ModelFast",
    "kv_cache.llama3.Llama3Model", "kv_cache.llama3.Llama3ModelFast",
    "qwen3.Qwen3Model", "kv_cache.qwen3.Qwen3Model", "kv_cache_batched.qwen3.Qwen3Model",
)

_current = {"test": "<outside tests>"}
_record = {"constructions": [], "kernel_launches": {}, "fallback_calls": {}, "reports": []}


def _resolve(names):
    """{class: "module.Class"} for the names that exist in the installed package."""
    found = {}
    for name in names:
        mod_name, cls_name = name.rsplit(".", 1)
        cls = getattr(importlib.import_module(_PKG + mod_name), cls_name, None)
        if cls is not None:
            found[cls] = name
    return found


_ATTENTION = {}


def _count_attention(module):
    """Package attention modules in ``module``, outermost only (a wrapper's heads not again)."""
    if type(module) in _ATTENTION:
        return 1
    return sum(_count_attention(child) for child in module.children())


def _log(kind, name, expected, swapped, left, fused_type):
    _record["constructions"].append({
        "test": _current["test"], "kind": kind, "class": name, "expected": expected,
        "swapped": swapped, "left": left, "fused_type": fused_type})


def _wrap_model(cls, name):
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if type(self) is not cls:   # a subclass's __init__ calling ours: fuse once, at the end
            return
        import kernels
        expected = _count_attention(self)
        _, swapped = kernels.fuse_attention(self, strict=True)
        left = _count_attention(self)
        _log("model", name, expected, swapped, left, None)
        if expected < 1 or swapped != expected or left:
            raise AssertionError(f"fuse_book_models: {name} has {expected} attention modules, "
                                 f"fuse_attention swapped {swapped}, {left} left unfused")

    cls.__init__ = __init__


def _fusing_factory(cls, name):
    @functools.wraps(cls, updated=())
    def build(*args, **kwargs):
        import kernels
        module = cls(*args, **kwargs)
        fused, swapped = kernels.fuse_attention(module, strict=True)
        _log("attention", name, 1, swapped, _count_attention(fused), type(fused).__name__)
        if swapped != 1 or fused is module or _count_attention(fused):
            raise AssertionError(f"fuse_book_models: {name} was not swapped "
                                 f"(swapped {swapped}, got {type(fused).__name__})")
        return fused

    build.fuse_book_models_original = cls
    return build


def _counting(fn, table):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        table[_current["test"]] = table.get(_current["test"], 0) + 1
        return fn(*args, **kwargs)
    return counted


def pytest_configure(config):
    import kernels
    import kernels.core.fallback
    import kernels.ops
    if os.environ.get("BOOK_SUITE_NO_FUSE") == "1":
        kernels.fuse_attention = lambda model, verbose=False, strict=False: (model, 0)
    _ATTENTION.update(_resolve(ATTENTION))
    for cls, name in _resolve(MODELS).items():
        _wrap_model(cls, name)
    # The Triton kernels (the interpreter on CPU): every forward launch, the KV cache's too,
    # is a call of a ForwardPlan (kernels/core/forward.py), whichever path built it; the
    # PyTorch fallback as kernels.ops calls it (module attributes looked up at call time).
    from kernels.core.forward import ForwardPlan
    ForwardPlan.__call__ = _counting(ForwardPlan.__call__, _record["kernel_launches"])
    for fn_name in ("forward", "kvcache_forward"):
        setattr(kernels.core.fallback, fn_name,
                _counting(getattr(kernels.core.fallback, fn_name), _record["fallback_calls"]))


def pytest_collection_modifyitems(session, config, items):
    seen = set()
    for item in items:
        mod = getattr(item, "module", None)
        if mod is None or id(mod) in seen:
            continue
        seen.add(id(mod))
        for attr, value in list(vars(mod).items()):
            if isinstance(value, type) and value in _ATTENTION:
                setattr(mod, attr, _fusing_factory(value, _ATTENTION[value]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["test"] = item.nodeid
    yield
    _current["test"] = "<outside tests>"


def pytest_runtest_logreport(report):
    _record["reports"].append({"test": report.nodeid, "when": report.when,
                               "outcome": report.outcome})


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("BOOK_SUITE_RECORD")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_record, f, indent=1)
