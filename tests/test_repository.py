"""The repository as a whole: what a plain (non-editable) install holds, and that nothing in it
points outside it (paths of other checkouts or machines, notes kept elsewhere, numbers of a
private issue tracker), so that whoever clones it can run and follow everything in it."""
import importlib.util
import os
import re
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
    # --no-build-isolation: the build uses this environment's setuptools (no download); a venv
    # without it (Python >= 3.12 makes none) lets pip fetch it, as a user's install does.
    isolation = [] if importlib.util.find_spec("setuptools") is None else [
        "--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation,
                    "--target", str(target), str(src)], check=True, cwd=elsewhere, timeout=300)
    installed = {p.name for p in target.iterdir()
                 if p.is_dir() and not p.name.endswith((".dist-info", ".egg-info"))}
    assert installed - {"__pycache__"} == {"kernels", "reference"}, installed
    env = {**os.environ, "PYTHONPATH": str(target), "TRITON_INTERPRET": "1"}
    code = ("import kernels, reference, kernels.hf, kernels.sdpa, kernels.book; "
            "print(kernels.__file__); print(kernels.book.__file__)")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300).stdout.split()
    # The installed copy was imported, not the checkout, with the book's twins as one package.
    assert out == [str(target / "kernels" / "__init__.py"),
                   str(target / "kernels" / "book" / "__init__.py")]


# What may not appear in the repository's text: a sibling checkout's folder, a machine's home
# or scratch path, notes that are not in the repository, and references to this project's own
# tracker ("issue 12", "#31", "issues 9 and 10"). Another project's numbers, written with the
# project's name ("FlashAttention #1895"), are fine: a reader can look them up.
OUTSIDE = [
    (re.compile(r"\.\./shared|shared/tools"), "a path outside the repository"),
    (re.compile(r"/(?:home|work|root|Users|tmp/bash_jobs)/\w"), "a machine path"),
    (re.compile(r"FIELD_NOTES"), "notes that are not in the repository"),
    (re.compile(r"\bissues? #?\d+(?:\s*(?:,|and)\s*#?\d+)*\b", re.I), "a tracker issue number"),
    (re.compile(r"(?<![\w/&])#\d{1,3}\b"), "a tracker issue number"),
]
# Another project's issue / PR, named with the project, e.g. "FlashAttention #1895",
# "triton-lang/triton#5567", "PyTorch issue 12345" (four digits or more: not ours).
OTHERS = re.compile(r"(?:[A-Za-z][\w.-]*[/ ]|PR |pull |issues? )#?\d{4,}|[\w-]+/[\w-]+#\d+")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml", ""}


def _tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split("\n")
        files = [ROOT / f for f in out if f]
    except (OSError, subprocess.CalledProcessError):   # not a git checkout: every file
        files = [p for p in ROOT.rglob("*") if ".git" not in p.parts]
    return [p for p in files if p.is_file() and p.suffix in TEXT_SUFFIXES
            and p.name != "test_repository.py"]


def test_nothing_points_outside_the_repository():
    found = []
    for path in _tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            line_wo_others = OTHERS.sub("", line)
            for pattern, what in OUTSIDE:
                m = pattern.search(line_wo_others)
                if m:
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: {what}: {m.group(0)!r}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("line, bad", [
    ("see ../shared/tools/x.py", True), ("(issue 12)", True), ("issues 9 and 10", True),
    ("fixed in #31", True), ("FlashAttention #1895", False), ("triton-lang/triton#5567", False),
    ("color #fff", False), ("row #1 of 3", True), ("PyTorch issue 123456", False),
    ("/home/user/x", True), ("FIELD_NOTES.md", True), ("a plain sentence", False),
])
def test_the_grep_catches_what_it_should(line, bad):
    line = OTHERS.sub("", line)
    assert any(p.search(line) for p, _ in OUTSIDE) == bad


def test_test_modules_have_unique_names():
    """The test directories are not packages (pytest's rootdir imports), so two test modules
    of one basename in different directories make the whole run stop at collection ("import
    file mismatch": tests/core/test_mla.py and tests/vllm_backend/test_mla.py did, in CI's
    pinned stack, which collects both)."""
    seen = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name != "conftest.py" and "__pycache__" not in path.parts:
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {n: p for n, p in seen.items() if len(p) > 1}
