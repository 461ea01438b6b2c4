"""The package's structure rules that a refactoring could silently break: short kernel
signatures, no dependency of the product on the test oracles, one-way layering."""
import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kernels.core.backward
import kernels.core.forward
import kernels.core.kvcache
import kernels.core.splitkv

ROOT = Path(__file__).resolve().parents[2]
# Past this many parameters a kernel is hard to call by name and to extend: group related
# arguments (strides as tuples, the call's scalars as named tuples, kernels/core/call.py).
MAX_KERNEL_PARAMS = 30


def _kernels():
    """{name: Python function} of every @triton.jit kernel the core launches (private names
    in the launcher modules; compiled or interpreted, a jit function keeps its ``fn``)."""
    found = {}
    for module in (kernels.core.forward, kernels.core.backward, kernels.core.splitkv,
                   kernels.core.kvcache):
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if name.startswith("_") and inspect.isfunction(fn) \
                    and fn.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = fn
    return found


def test_kernels_have_short_signatures():
    launched = _kernels()
    assert {"kernels.core.forward._attn_fwd", "kernels.core.backward._bwd_dkdv",
            "kernels.core.backward._bwd_dq"} <= set(launched)
    too_long = {name: len(inspect.signature(fn).parameters) for name, fn in launched.items()
                if len(inspect.signature(fn).parameters) > MAX_KERNEL_PARAMS}
    assert not too_long, f"kernels with more than {MAX_KERNEL_PARAMS} parameters: {too_long}"


def test_product_never_imports_the_oracles():
    """``reference`` is the independent second implementation the tests compare against: no
    module of ``kernels`` (core, public layer, integrations) may import it, at import time or
    when the CPU fallback computes (dropout included)."""
    # An integration whose engine is an optional extra (kernels.vllm.backend) may be absent.
    code = ("import sys, pkgutil, importlib, warnings, torch, kernels\n"
            "OPTIONAL = {'vllm'}\n"
            "for m in pkgutil.walk_packages(kernels.__path__, 'kernels.'):\n"
            "    try:\n"
            "        importlib.import_module(m.name)\n"
            "    except ModuleNotFoundError as err:\n"
            "        if err.name not in OPTIONAL:\n"
            "            raise\n"
            "warnings.simplefilter('ignore')\n"
            "q = torch.randn(1, 2, 9, 8, requires_grad=True)\n"
            "for kw in ({}, {'dropout_p': 0.3, 'seed': 1}, {'window': 3}):\n"
            "    kernels.attention(q, q, q, **kw).sum().backward()\n"
            "print(sorted(n for n in sys.modules if n == 'reference' "
            "or n.startswith('reference.')))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the fallback
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_core_does_not_import_upward():
    """The kernel core imports neither the public layer nor the integrations."""
    for path in (ROOT / "kernels" / "core").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, f"{path.name}: from {'.' * node.level}{node.module}"
                assert node.level == 1 or not (node.module or "").startswith("kernels"), \
                    f"{path.name}: from {node.module}"
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
                assert not any(n.split(".")[0] in ("kernels", "reference") for n in names), \
                    f"{path.name}: import {names}"


def _imports_of(path):
    """(node, the dotted module it imports from, relative imports resolved) of every import
    statement in ``path``, lazy ones too; ``ast.Import`` nodes give None."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                yield node, ".".join(base + ([node.module] if node.module else []))
            else:
                yield node, node.module or ""
        elif isinstance(node, ast.Import):
            yield node, None


def _package_imports(path):
    """The ``kernels`` modules ``path`` imports, as dotted names (relative imports resolved)."""
    found = set()
    for node, module in _imports_of(path):
        if isinstance(node, ast.ImportFrom):
            if module.startswith("kernels"):
                found.add(module)
                found.update(f"{module}.{a.name}" for a in node.names)
        else:
            found.update(a.name for a in node.names if a.name.startswith("kernels"))
    return found


def _product_files():
    return sorted((ROOT / "kernels").rglob("*.py"))


def test_only_the_resolve_step_imports_validation():
    """The pipeline (docs/layout.md): validation runs in one step, kernels/pipeline.py's
    resolve; everything else reaches it through the public functions."""
    importers = {str(p.relative_to(ROOT)) for p in _product_files()
                 if "kernels.validation" in _package_imports(p)}
    assert importers == {"kernels/pipeline.py"}, importers


def test_only_the_core_chooses_the_backend():
    """The Triton-or-fallback decision (``_use_fallback``) is called in kernels/core/backend.py
    only, and only the core runs the fallback (the public layer may read its visibility rule)."""
    for path in _product_files():
        rel = str(path.relative_to(ROOT))
        calls = [n for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "_use_fallback"]
        assert not calls or rel == "kernels/core/backend.py", f"{rel} decides the backend"
        if not rel.startswith("kernels/core/") and rel != "kernels/ops.py":
            assert "kernels.core.fallback" not in _package_imports(path), rel


# The integration layer (docs/layout.md): each integration is one module (book and vllm: one
# package each) with one name, the one users import, plus the checks modules, fuse and book
# share.
INTEGRATIONS = ("modules", "fuse", "book", "sdpa", "hf", "distributed", "flash_attn_interface",
                "flash_mla_interface", "vllm")
INTEGRATION_HELPERS = ("model_checks",)
# The public layer (the functions, their pipeline and checks) and the kernel core (kernels/core/).
PUBLIC_LAYER = ("__init__", "ops", "pipeline", "validation")
# What an integration may import: the package's public names (``from kernels import
# attention``), the public functions with the integrations' entry points (kernels/ops.py), the
# mods' public types; other integrations. Never the pipeline, validation or the rest of the core.
INTEGRATION_MAY_IMPORT = {"kernels", "kernels.ops", "kernels.core.common", "kernels.core.mods",
                          "kernels.core.tensor_mask"}


def _is_module(dotted):
    """Whether ``dotted`` (a ``kernels...`` name) is a module or package of this checkout."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported_modules(path):
    """The ``kernels`` modules ``path`` imports (anywhere in it, lazily too), resolved:
    ``from X import a`` is module ``X.a`` where that is a module, else module ``X``."""
    found = set()
    for node, module in _imports_of(path):
        if isinstance(node, ast.ImportFrom):
            if module == "kernels" or module.startswith("kernels."):
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    found.add(sub if _is_module(sub) else module)
        else:
            found.update(a.name for a in node.names
                         if a.name == "kernels" or a.name.startswith("kernels."))
    return found


def _module_paths(name):
    """The files of ``kernels.<name>``: the module, or every file of the package."""
    if (ROOT / "kernels" / name).is_dir():
        return sorted((ROOT / "kernels" / name).rglob("*.py"))
    path = ROOT / "kernels" / f"{name}.py"
    return [path] if path.is_file() else []


def _integrations():
    missing = [n for n in INTEGRATIONS if not _module_paths(n)]
    assert not missing, f"integrations without a module: {missing}"
    return list(INTEGRATIONS)


def test_every_module_is_in_one_layer():
    """Every top-level module of ``kernels`` is the core, the public layer or a listed
    integration: a new integration is added to INTEGRATIONS (and so to the rules below)."""
    layered = {"core", *PUBLIC_LAYER, *INTEGRATIONS, *INTEGRATION_HELPERS}
    top = {p.stem for p in (ROOT / "kernels").glob("*.py")} | {
        p.name for p in (ROOT / "kernels").iterdir() if (p / "__init__.py").is_file()}
    assert top - layered == set(), f"modules in no layer (tests/core/test_structure.py): " \
                                   f"{sorted(top - layered)}"


def test_integrations_call_the_public_pipeline():
    """Integrations use the public functions (kernels/ops.py) and the mods' public types: no
    launcher, plan, backend, pipeline or validation of their own."""
    layer = [f"kernels.{n}" for n in (*INTEGRATIONS, *INTEGRATION_HELPERS)]
    checked = 0
    for name in (*_integrations(), *INTEGRATION_HELPERS):
        for path in _module_paths(name):
            used = {m for m in _imported_modules(path) if m not in INTEGRATION_MAY_IMPORT
                    and not any(m == i or m.startswith(i + ".") for i in layer)}
            assert not used, f"{path.relative_to(ROOT)} imports {sorted(used)}"
            checked += 1
    assert checked >= len(INTEGRATIONS) + len(INTEGRATION_HELPERS)


def test_one_module_one_name_per_integration():
    """Each integration is one module object under one name, the one users import: no
    forwarding module (a module-level ``__getattr__``), no file of the same name elsewhere in
    ``kernels``, no ``kernels.integrations`` package, no second ``sys.modules`` key for any
    ``kernels`` module, and ``kernels.<name>`` is that module."""
    names = _integrations()
    for name in names:
        same = [p for p in (ROOT / "kernels").rglob(f"{name}*")
                if p.stem == name and (p.suffix == ".py" or p.is_dir())
                and p.parent.name != "__pycache__"]
        home = ROOT / "kernels" / (name if (ROOT / "kernels" / name).is_dir() else f"{name}.py")
        assert same == [home], f"kernels.{name}: more than one home: " \
                               f"{[str(p.relative_to(ROOT)) for p in same]}"
    for path in _product_files():
        tree = ast.parse(path.read_text())
        assert not [n for n in tree.body if isinstance(n, ast.FunctionDef)
                    and n.name == "__getattr__"], f"{path.relative_to(ROOT)} forwards names"
    code = textwrap.dedent(f"""\
        import importlib, importlib.util, json, sys, kernels
        mods = {{n: importlib.import_module('kernels.' + n) for n in {names!r}}}
        ours = {{id(m) for k, m in sys.modules.items() if k.split('.')[0] == 'kernels'}}
        keys = {{}}   # every sys.modules key of each kernels module, whatever the key
        for key, m in list(sys.modules.items()):
            if id(m) in ours:
                keys.setdefault(id(m), []).append(key)
        print(json.dumps({{
            'integrations_package': importlib.util.find_spec('kernels.integrations') is not None,
            'names': {{n: [m.__name__, getattr(kernels, n, None) is m, keys[id(m)]]
                      for n, m in mods.items()}},
            'aliased': sorted(k for ks in keys.values() if len(ks) > 1 for k in ks),
            'misnamed': sorted(k for ks in keys.values() for k in ks
                               if sys.modules[k].__name__ != k)}}))
        """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert not found["integrations_package"], "kernels.integrations exists again"
    assert found["names"] == {n: [f"kernels.{n}", True, [f"kernels.{n}"]] for n in names}, \
        found["names"]
    assert found["aliased"] == [] and found["misnamed"] == [], found
