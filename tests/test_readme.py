"""The README's two commands: each does all of its own set-up from a clone.

Under the heading "The two commands" the README gives exactly two command lines, one that runs
the tests and one that runs the benchmark. Each must install the package with the extras its
job needs (``pip install -e ".[test]" && ...``) before running it, so that it works alone in a
fresh clone and environment. Checked here without a network: the lines' shape, that the extras
exist in setup.py, and that what each job imports from outside the standard library and this
repository is installed by that command (its extras plus the install requirements). A fresh
clone and venv running the two lines for real is a manual check (docs/performance.md says
when it was last done)."""
import ast
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## The two commands"
# The job of each command and the extra it must install first.
JOBS = {"test": ["python", "-m", "pytest", "-m", "quick"], "bench": ["python", "-m", "benchmarks"]}
# Where each job's code is: pytest imports every test module while collecting, even with -m;
# `python -m benchmarks` imports the benchmarks package.
JOB_CODE = {"test": ["tests"], "bench": ["benchmarks"]}
# Needed but not imported by the job's own code: Triton's CPU interpreter imports numpy, and
# both jobs run kernels in it on a machine without CUDA (triton does not declare it).
NOT_IMPORTED = {"test": {"numpy"}, "bench": {"numpy"}}
# Imported by the benchmark only where installed (behind a check of its own): the transformers
# rows (features.hf_reason) and the book-model rows (opt-in, book_models.package_reason). The
# tests' optional packages are found by the scan: a module that needs one skips itself with
# pytest.importorskip.
OPTIONAL = {"test": set(), "bench": {"transformers", "llms_from_scratch"}}


def readme_commands(text):
    """The command lines of the first ``bash`` block under HEADING (comments stripped)."""
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block under {HEADING!r}"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def parse_command(line):
    """(extras, job argv) of ``pip install -e ".[a,b]" && job ...``; AssertionError otherwise."""
    steps = [s.strip() for s in line.split("&&")]
    assert len(steps) == 2, f"{line!r}: want `pip install -e \".[extra]\" && <job>`"
    install = shlex.split(steps[0])
    if install[:2] == ["python", "-m"]:
        install = install[2:]
    assert install[:3] == ["pip", "install", "-e"] and len(install) == 4, line
    m = re.fullmatch(r"\.\[([\w,\s-]+)\]", install[3])
    assert m, f"{line!r}: installs {install[3]!r}, not the checkout with extras"
    return {e.strip() for e in m.group(1).split(",")}, shlex.split(steps[1])


def setup_requirements():
    """(install_requires, extras_require) of setup.py as distribution names, read with ast."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords
          if k.arg in ("install_requires", "extras_require")}

    def names(reqs):
        return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("-", "_")
                for r in reqs}
    return names(kw["install_requires"]), {k: names(v) for k, v in kw["extras_require"].items()}


def _guarded(node, parents):
    """Whether an import sits in a ``try`` that catches its failure."""
    for p in parents:
        if isinstance(p, ast.Try) and any(
                h.type is None or "Error" in ast.unparse(h.type) or "Exception" in
                ast.unparse(h.type) for h in p.handlers):
            return True
    return False


def _skipped_without(tree):
    """Names a module gives to ``pytest.importorskip`` at module level: without them pytest
    skips the whole module instead of failing to collect it."""
    names = set()
    for stmt in tree.body:
        for node in ast.walk(stmt):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                names.add(node.args[0].value.split(".")[0])
    return names


def imported_top_level(paths, module_level_only):
    """Top-level names imported by the .py files under ``paths`` (absolute imports only; those
    in a ``try`` that catches the failure left out, and those a module skips itself without,
    ``pytest.importorskip``). ``module_level_only``: not inside functions (what importing the
    module runs)."""
    found = set()
    for base in paths:
        for path in sorted((ROOT / base).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            mine, stack = set(), [(tree, ())]
            while stack:
                node, parents = stack.pop()
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                        module_level_only):
                    continue
                if isinstance(node, ast.Import) and not _guarded(node, parents):
                    mine |= {a.name.split(".")[0] for a in node.names}
                elif (isinstance(node, ast.ImportFrom) and node.level == 0
                      and not _guarded(node, parents)):
                    mine.add(node.module.split(".")[0])
                for child in ast.iter_child_nodes(node):
                    stack.append((child, parents + (node,)))
            found |= mine - _skipped_without(tree)
    return found


def local_names():
    """Importable names that come from this repository: its packages and top-level modules, and
    the test helpers (tests/ is on sys.path while pytest runs)."""
    names = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    names |= {p.stem for p in ROOT.glob("*.py")}
    names |= {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests", "tools"}
    return names


def test_the_two_commands_are_self_contained():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert HEADING in text, f"the README has no {HEADING!r} heading"
    lines = readme_commands(text)
    assert len(lines) == 2, lines
    requires, extras = setup_requirements()
    jobs = {}
    for line in lines:
        wanted, job = parse_command(line)
        assert wanted <= set(extras), f"{line!r}: no extra {wanted - set(extras)} in setup.py"
        kind = next((k for k, argv in JOBS.items() if job == argv), None)
        assert kind, f"{line!r}: runs {job}, not one of {list(JOBS.values())}"
        assert kind in wanted, f"{line!r}: runs the {kind} job without installing [{kind}]"
        jobs[kind] = set().union(*(extras[e] for e in wanted))
    assert set(jobs) == set(JOBS), "one command runs the tests, the other the benchmark"
    stdlib, local = set(sys.stdlib_module_names), local_names()
    for kind, installed in jobs.items():
        have = requires | installed
        needed = imported_top_level(JOB_CODE[kind], module_level_only=kind == "test")
        needed = {n.lower() for n in needed - stdlib - local - OPTIONAL[kind]} | NOT_IMPORTED[kind]
        if kind == "test":
            needed.add("pytest")
        missing = needed - have
        assert not missing, (f"`{' '.join(JOBS[kind])}` needs {sorted(missing)}, which its README "
                             f"command does not install (it installs {sorted(have)})")


@pytest.mark.parametrize("line, ok", [
    ('pip install -e ".[test]" && python -m pytest -m quick', True),
    ('python -m pip install -e ".[bench]" && python -m benchmarks', True),
    ("python -m pytest -m quick", False),                     # no set-up
    ('pip install -e . && python -m benchmarks', False),      # no extras
    ('pip install -e ".[test]"; python -m pytest -m quick', False),  # runs even if it fails
])
def test_the_parser_rejects_commands_that_are_not_self_contained(line, ok):
    try:
        parse_command(line)
    except AssertionError:
        assert not ok
    else:
        assert ok


def test_the_import_scan_sees_what_a_job_needs(tmp_path, monkeypatch):
    """A job module importing a package (at module level, unguarded) is seen; one behind a
    ``try`` or inside a function (for the test job) is not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        "import os\nimport pandas\nfrom scipy import stats\ntry:\n    import yaml\n"
        "except ImportError:\n    yaml = None\ndef f():\n    import polars\n")
    (tmp_path / "pkg" / "b.py").write_text(
        "import pytest\nhf = pytest.importorskip('transformers')\nimport transformers\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert imported_top_level(["pkg"], module_level_only=True) == {"os", "pandas", "scipy",
                                                                   "pytest"}
    assert imported_top_level(["pkg"], module_level_only=False) == {"os", "pandas", "scipy",
                                                                    "polars", "pytest"}
