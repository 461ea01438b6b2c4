"""llms-from-scratch's own test files, unchanged, run against models fused by fuse_attention.

A subprocess runs ``python -m pytest -p fuse_book_models <the package's test files>`` (plugin:
tests/integrations/book_suite/fuse_book_models.py) in a temporary directory with
``TRITON_INTERPRET=1``: every model the package's tests construct (GPTModel, Llama3Model,
Qwen3Model and their KV-cache variants) is fused in its constructor, and every attention
module they build directly is replaced by its twin; a construction where ``fuse_attention``
swaps fewer than all of the package's attention modules fails its test. This test then checks,
from the plugin's record, that exactly the selected tests ran and passed, that each built and
fused as many attention modules as listed below, and that its attention ran on the Triton
kernel (launches counted, PyTorch fallback never called).

Selection (llms-from-scratch 1.0.19, each test run once unfused to classify it): ``SELECTED``
are the package's tests that pass offline; ``LEFT_OUT`` the rest of those files, with why (no
network in CI: downloads of tokenizers, weights or data; transformers 5's rotary API; tests
that return before building anything). The files not listed at all cannot be imported without
the package's optional dependencies (``FILES_LEFT_OUT``). The README's book section has the
table.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llms_from_scratch", reason="llms-from-scratch is not installed "
                    "(pip install --no-deps llms-from-scratch==1.0.19)")

HERE = Path(__file__).resolve().parent
PLUGIN_DIR = HERE / "book_suite"
REPO = HERE.parents[1]
TIMEOUT_S = 300

#: node id -> (attention modules fused while it runs, requirement beyond torch/pytest, what).
SELECTED = {
    "test_ch03.py::test_mha":
        (2, None, "ch03.MultiHeadAttention and PyTorchMultiHeadAttention, built directly"),
    "test_llama3.py::test_grouped_query_attention_equivalence":
        (2, None, "llama3 GroupedQueryAttention vs GroupedQueryAttentionFast, built directly"),
    "test_llama3.py::test_llama3_base_equivalence_with_transformers":
        (2, "transformers", "2-layer Llama3Model vs transformers' LlamaForCausalLM (eager)"),
    "test_llama3.py::test_rmsnorm_equivalence": (0, None, "RMSNorm only: no attention"),
    "test_qwen3.py::test_dummy_qwen3_forward": (2, None, "2-layer Qwen3Model forward"),
    "test_qwen3.py::test_dummy_qwen3_moe_forward": (2, None, "2-layer MoE Qwen3Model forward"),
    "test_qwen3.py::test_qwen3_kvcache_equivalence[dummy_cfg_base]":
        (4, None, "Qwen3Model vs kv_cache Qwen3Model fed one token at a time"),
    "test_qwen3.py::test_qwen3_base_equivalence_with_transformers":
        (2, "transformers", "2-layer Qwen3Model (QK-norm) vs transformers' Qwen3ForCausalLM"),
    "test_qwen3.py::test_rmsnorm_equivalence": (0, None, "RMSNorm only: no attention"),
    "test_appendix_a.py::test_dataset": (0, None, "appendix A's toy MLP: no attention"),
}

_TIKTOKEN_GPT2 = "downloads tiktoken's gpt2 BPE files (openaipublic.blob.core.windows.net)"
_QWEN_TOKENIZER = "downloads the Qwen 3 tokenizer from huggingface.co (rasbt/qwen3-from-scratch)"
_HF_TOKENIZERS = "downloads Qwen/Qwen3-0.6B(-Base) tokenizers from huggingface.co"
_ROPE_CONFIG = ("broken unfused with transformers 5: its RotaryEmbedding reads "
                "config.rope_parameters, which the test's RoPEConfig stub lacks (AttributeError)")
_VACUOUS = "the class/generate pair is incompatible: the test returns before building a model"

#: node id prefix (pytest --deselect) -> why it is not run.
LEFT_OUT = {
    "test_llama3.py::test_rope": _ROPE_CONFIG,
    "test_llama3.py::test_model_variants[generate_text_simple0-Llama3Model0]":
        _TIKTOKEN_GPT2 + "; builds the 1B Llama 3.2 config",
    "test_llama3.py::test_model_variants[generate_text_simple1-Llama3Model1]":
        _TIKTOKEN_GPT2 + "; builds the 1B Llama 3.2 config",
    "test_llama3.py::test_model_variants[generate_text_simple0-Llama3Model1]": _VACUOUS,
    "test_llama3.py::test_model_variants[generate_text_simple1-Llama3Model0]": _VACUOUS,
    "test_qwen3.py::test_qwen3_kvcache_equivalence[dummy_cfg_moe]":
        "skipped by the package on Linux (nondeterministic expert routing)",
    "test_qwen3.py::test_rope": _ROPE_CONFIG,
    "test_qwen3.py::test_model_variants": _QWEN_TOKENIZER + "; builds the 0.6B config",
    "test_qwen3.py::test_model_KV_noKV": _QWEN_TOKENIZER + "; builds the 0.6B config",
    "test_qwen3.py::test_model_batched_KV": _QWEN_TOKENIZER + "; builds the 0.6B config",
    "test_qwen3.py::test_all_special_tokens_roundtrip": _HF_TOKENIZERS,
    "test_qwen3.py::test_chat_wrap_and_equivalence": _HF_TOKENIZERS,
    "test_qwen3.py::test_multiturn_equivalence": _HF_TOKENIZERS,
    "test_qwen3.py::test_multiturn_prefix_stability": _HF_TOKENIZERS,
}

#: Whole files not passed to the subprocess.
FILES_LEFT_OUT = {
    "test_ch02.py": "downloads the-verdict.txt (raw.githubusercontent.com)",
    "test_generate.py": "1.0.19 ships test_ch02.py's test under this name: same download",
    "test_ch04.py": ("[generate_text_simple0-*] (3 tests) download tiktoken's gpt2 BPE files; "
                     "[generate_text_simple1-*] (3) return before building a model"),
    "test_ch05.py": "imports matplotlib (not installed with --no-deps); downloads data + gpt2 BPE",
    "test_ch06.py": "imports matplotlib and pandas; downloads the SMS spam data set",
    "test_ch07.py": "imports matplotlib; downloads instruction-data.json",
    "test_appendix_d.py": "imports matplotlib; downloads the-verdict.txt + gpt2 BPE",
    "test_appendix_e.py": "imports matplotlib and pandas; downloads the SMS spam data set",
}


def _have(module):
    return importlib.util.find_spec(module) is not None


def _run(tmp_path, tests_dir, args, **extra_env):
    """Run the package's tests with the plugin; (exit code, output tail, record)."""
    record_path = tmp_path / "record.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env.update(
        TRITON_INTERPRET="1",            # the Triton kernels in the interpreter (CPU tensors)
        BOOK_SUITE_RECORD=str(record_path),
        PYTHONDONTWRITEBYTECODE="1",     # no __pycache__ in site-packages
        HF_HUB_OFFLINE="1",              # nothing selected downloads; fail fast if one does
        PYTHONPATH=os.pathsep.join([str(PLUGIN_DIR), str(REPO)]
                                   + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        **extra_env,
    )
    cmd = [sys.executable, "-m", "pytest", "-p", "fuse_book_models", "-p", "no:cacheprovider",
           "-c", os.devnull, "--rootdir", str(tests_dir), "-q", "-rfEs", "--tb=short",
           "-W", "ignore::DeprecationWarning", *args]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"the package's tests did not finish in {TIMEOUT_S} s:\n{out[-4000:]}")
    output = (proc.stdout + proc.stderr)[-6000:]
    record = (json.loads(record_path.read_text(encoding="utf-8"))
              if record_path.exists() else None)
    return proc.returncode, output, record


@pytest.fixture
def tests_dir():
    path = Path(importlib.util.find_spec("llms_from_scratch").origin).parent / "tests"
    if not path.is_dir():
        pytest.skip(f"llms-from-scratch installed without its tests ({path})")
    if not _have("tiktoken"):
        # test_llama3.py imports it at module level (so does llms_from_scratch.llama3).
        pytest.skip("tiktoken is not installed (pip install tiktoken)")
    return path


def test_package_suite_runs_fused(tmp_path, tests_dir):
    selected = {node: spec for node, spec in SELECTED.items()
                if spec[1] is None or _have(spec[1])}
    files = sorted({node.split("::")[0] for node in SELECTED})
    deselect = list(LEFT_OUT) + [node for node in SELECTED if node not in selected]
    args = [str(tests_dir / f) for f in files]
    args += [arg for prefix in deselect for arg in ("--deselect", prefix)]
    rc, output, record = _run(tmp_path, tests_dir, args)
    assert rc == 0, f"the package's tests failed fused:\n{output}"

    calls = {r["test"]: r["outcome"] for r in record["reports"] if r["when"] == "call"}
    assert set(calls) == set(selected), (
        f"ran {sorted(calls)}, expected {sorted(selected)}: classify any new test of the "
        f"package in SELECTED or LEFT_OUT\n{output}")
    failed = [(r["test"], r["when"]) for r in record["reports"] if r["outcome"] != "passed"]
    assert not failed, f"not passed: {failed}\n{output}"

    swapped = {}
    for c in record["constructions"]:
        assert c["swapped"] == c["expected"] and c["left"] == 0, c
        swapped[c["test"]] = swapped.get(c["test"], 0) + c["swapped"]
    expected = {node: spec[0] for node, spec in selected.items()}
    assert {k: v for k, v in swapped.items() if v} == {k: v for k, v in expected.items() if v}
    assert sum(swapped.values()) == sum(expected.values()) > 0
    for node, (n_attention, _, what) in selected.items():
        launches = record["kernel_launches"].get(node, 0)
        assert record["fallback_calls"].get(node, 0) == 0, f"{node}: PyTorch fallback ran"
        if n_attention:
            assert launches > 0, f"{node} ({what}): no Triton kernel launch"
        else:
            assert launches == 0, f"{node} ({what}): unexpected kernel launches"


def test_harness_fails_when_nothing_is_fused(tmp_path, tests_dir):
    """The plugin's own check: with fuse_attention replaced by one that swaps nothing
    (BOOK_SUITE_NO_FUSE=1), a model test and a direct-attention test both fail."""
    nodes = ["test_ch03.py::test_mha", "test_qwen3.py::test_dummy_qwen3_forward"]
    rc, output, record = _run(tmp_path, tests_dir, [str(tests_dir / n) for n in nodes],
                              BOOK_SUITE_NO_FUSE="1")
    assert rc == 1, output
    calls = {r["test"]: r["outcome"] for r in record["reports"] if r["when"] == "call"}
    assert calls == {n: "failed" for n in nodes}, output
    assert output.count("AssertionError: fuse_book_models:") >= 2, output
    assert all(c["swapped"] == 0 for c in record["constructions"]), record
