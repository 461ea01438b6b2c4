"""The repository as a whole: what a plain (non-editable) install holds, and that nothing in it
points outside it (paths of other checkouts or machines, notes kept elsewhere, numbers of a
private issue tracker), so that whoever clones it can run and follow everything in it."""
import os

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

def _copy_sources(dst):
    """The files a build reads, plus benchmarks/ and tools/ (to see that they stay out); a
    copy, so that no build/ or egg-info left in the checkout can add to what is installed."""
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    for name in ("kernels", "reference", "benchmarks", "tools"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dst / name,
                            ignore=shutil.ignore_patterns("__pycache__", "results"))

def test_plain_install_holds_kernels_and_reference_only(tmp_path):
    src, target, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    for d in (src, elsewhere):
        d.mkdir()
    _copy_sources(src)
    # --no-build-isolation: the build uses this environment's setuptools (no download).
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(src)],
                   check=True, cwd=elsewhere, timeout=300)
    installed = {p.name for p in target.iterdir()
                 if p.is_dir() and not p.name.endswith((".dist-info", ".egg-info"))}
    assert installed - {"__pycache__"} == {"kernels", "reference"}, installed
    env = {**os.environ, "PYTHONPATH": str(target), "TRITON_INTERPRET": "1"}
    code = ("import kernels, reference, kernels.hf, kernels.sdpa, kernels.book; "
            "print(kernels.__file__); print(kernels.book.__file__)")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300).stdout.split()
    # The installed copy was imported, not the checkout, and the short paths are real modules.
    assert out == [str(target / "kernels" / "__init__.py"), str(target / "kernels" / "book.py")]
