"""The package's structure rules that a refactoring could silently break: short kernel
signatures, no dependency of the product on the test oracles, one-way layering."""
import ast
import inspect
import os
import subprocess
import sys
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
    code = ("import sys, pkgutil, importlib, warnings, torch, kernels\n"
            "for m in pkgutil.walk_packages(kernels.__path__, 'kernels.'):\n"
            "    importlib.import_module(m.name)\n"
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


def _package_imports(path):
    """The ``kernels`` modules ``path`` imports, as dotted names (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("kernels"):
                found.add(module)
                found.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
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


def test_integrations_call_the_public_pipeline():
    """Integrations use the public functions (kernels/ops.py) and the mods' public types: no
    launcher, plan, backend or validation of their own."""
    allowed = {"kernels.ops", "kernels.core.common", "kernels.core.mods",
               "kernels.core.tensor_mask"}
    for path in sorted((ROOT / "kernels" / "integrations").rglob("*.py")) + [
            ROOT / "kernels" / "flash_attn_interface.py"]:
        used = {m for m in _package_imports(path)
                if not m.startswith("kernels.integrations")
                and m.rsplit(".", 1)[0] not in allowed | {"kernels.integrations", "kernels"}}
        used -= allowed
        used = {m for m in used if m not in ("kernels",) and not any(
            m.startswith(a + ".") for a in allowed)}
        assert not used, f"{path.relative_to(ROOT)} imports {sorted(used)}"
