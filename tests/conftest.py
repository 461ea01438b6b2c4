"""Test harness: run every kernel in Triton's CPU interpreter when there is no CUDA device.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a function, so it is set here, before
any test module imports ``kernels``.
"""
import os
import zlib
from typing import NamedTuple

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
else:
    # Correctness, not speed: one fitting config per launch instead of autotuning every small
    # test shape (tests/core/test_configs.py forces each config once). Override with
    # KERNELS_AUTOTUNE=1 to test the autotuned path.
    os.environ.setdefault("KERNELS_AUTOTUNE", "0")

import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the quick marks must be on by then
def pytest_collection_modifyitems(config, items):
    _mark_quick(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none "
                                   "(the CPU run covers the same kernel in Triton's interpreter)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class Route(NamedTuple):
    """Where a test's attention runs (the ``route`` fixture): ``name`` "kernel" or "fallback",
    and ``device``, where the test makes its tensors for it."""
    name: str
    device: str


@pytest.fixture(params=["kernel", "fallback"])
def route(request, monkeypatch):
    """Both routes a call can take: "kernel", the Triton kernels (on the GPU when there is one,
    else in Triton's interpreter; skipped where that interpreter cannot run), and "fallback",
    the PyTorch fallback that CPU tensors take without the interpreter (on a GPU machine too).
    Gives a ``Route``."""
    from helpers import DEVICE, interpreter_unusable_reason
    if request.param == "fallback":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setattr("kernels.core.backend._warned_fallback", True)
        return Route("fallback", "cpu")
    if DEVICE == "cpu" and interpreter_unusable_reason():
        pytest.skip(interpreter_unusable_reason())
    return Route("kernel", DEVICE)


@pytest.fixture(autouse=True)
def _seed_every_test(request):
    """Each test gets its own fixed seed (from its id): fresh inputs per test, reproducible runs."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


# --------------------------------------------------------------------------------------------
# `pytest -m quick`: one small test per route, the README's test command (a few minutes on 2
# cores). `pytest` alone runs the full suite, which is what CI (.ci/run) runs on both stacks.
# Each route names the tests that cover it; on a machine without a package the route's tests
# are skipped by their own checks, as in the full suite.
# --------------------------------------------------------------------------------------------
QUICK = {
    "dense forward (fp32, fp16, bf16; causal and not; q_len != k_len)": [
        "tests/core/test_forward.py::test_forward_parity[2-3-17-17-32-True-torch.float16]",
        "tests/core/test_forward.py::test_forward_parity[1-2-64-64-64-True-torch.bfloat16]",
        "tests/core/test_forward.py::test_forward_parity[1-1-97-200-16-False-torch.float32]",
        "tests/core/test_forward.py::test_bad_input",
    ],
    "backward": [
        "tests/core/test_backward.py::test_backward_parity[2x2-q17-k17-d40-causal-float16]",
        "tests/core/test_backward.py::test_backward_parity[1x2-q64-k17-d64-full-float32]",
    ],
    "dropout (the Philox mask, forward and backward)": [
        "tests/core/test_dropout_mask.py::test_philox_matches_triton_randint4x",
        "tests/core/test_forward.py::test_dropout_parity[33-70-True-torch.float32]",
        "tests/core/test_backward.py::test_dropout_parity[f32-causal]",
    ],
    "grouped-query heads, sliding window, packed sequences (varlen)": [
        "tests/core/test_gqa_window_varlen.py::test_gqa_parity[4-4-17-17-float16]",
        "tests/core/test_gqa_window_varlen.py::test_window_parity[1-2-2-40-40-float32]",
        "tests/core/test_gqa_window_varlen.py::test_varlen_parity[other-causal-gqa]",
        "tests/core/test_gqa_window_varlen.py::test_varlen_dropout",
    ],
    "KV cache, paged KV cache and split-KV": [
        "tests/core/test_kvcache.py::test_kvcache_parity_and_append[4-4-2-7-True-True-2-float32]",
        "tests/core/test_kvcache.py::test_split_kv_parity[1-17-2-2-float32]",
        "tests/core/test_paged_kvcache.py::test_paged_value_head_dim_and_strided_table",
        "tests/core/test_paged_serving.py::test_out_and_splits_match_the_oracle[kernel]",
    ],
    "MLA's latent cache (head_dim 576, values in the keys' rows)": [
        "tests/core/test_mla.py::test_kvcache_matches_the_non_absorbed_oracle"
        "[kernel-page13-mtp4-split]",
        "tests/core/test_mla.py::test_varlen_mixed_decode_and_prefill_rows[kernel]",
    ],
    "mods (softcap, ALiBi, score/mask mods, sinks, chunks)": [
        "tests/core/test_mods.py::test_feature_parity[everything]",
    ],
    "attn_mask (SDPA's boolean and additive masks)": [
        "tests/core/test_attn_mask.py::test_attn_mask_matches_the_oracle[kernel-17-97-shape1]",
        "tests/core/test_attn_mask.py::test_additive_mask_matches_the_oracle[kernel-17-97-shape1]",
    ],
    "CPU fallback (PyTorch path, same semantics and dropout mask)": [
        "tests/core/test_forward.py::test_cpu_fallback_same_semantics",
        "tests/core/test_forward.py::test_cpu_fallback_gradients[13-21-True-0.3]",
        "tests/core/test_fallback.py::test_fallback_parity[causal-rect]",
        "tests/core/test_fallback_mods.py::test_dense[one-block-everything-chunk]",
        "tests/core/test_fallback_mods.py::test_dropout[one-block-sinks]",
        "tests/core/test_fallback_mods.py::test_packed[one-block]",
        "tests/core/test_fallback_mods.py::test_kvcache[one-block-append]",
        "tests/core/test_fallback_philox.py::"
        "test_fallback_mask_is_the_kernels[native-1-gqa-causal]",
        "tests/core/test_fallback_philox.py::test_native_keep_bytes_match_the_oracle",
        "tests/core/test_fallback_small.py::"
        "test_small_route_is_the_oracle_with_the_kernels_mask[gqa-causal-rect]",
        "tests/core/test_layouts_property.py::test_module_fallback",
    ],
    "structure and the oracle": [
        "tests/core/test_structure.py::test_product_never_imports_the_oracles",
        "tests/test_reference.py::test_matches_book_multi_head_attention",
    ],
    "the book's modules, fuse_attention, LoRA": [
        "tests/integrations/test_modules.py::test_forward_backward_parity[mha-torch.float32]",
        "tests/integrations/test_modules.py::test_training_dropout_gradients",
        "tests/integrations/test_fuse.py::test_fuse_gpt_swaps_every_block_and_keeps_parameters",
        "tests/integrations/test_lora.py::"
        "test_lora_model_fused_trains_like_the_unfused[gpt-float32-lora_then_fuse]",
    ],
    "the book's companion package (llms-from-scratch)": [
        "tests/integrations/test_book_models.py::"
        "test_twin_matches_package_class[qwen3-torch.float32]",
    ],
    "transformers": [
        "tests/integrations/test_hf.py::test_logits_match_eager[kernel-llama]",
        "tests/integrations/test_hf.py::test_training_step_gradients_match_eager[kernel-gpt2]",
        "tests/integrations/test_hf_new_models.py::"
        "test_training_step_gradients_match_eager[fallback-gemma2]",
    ],
    "FlashAttention 2's API (kernels.flash_attn_interface)": [
        "tests/test_flash_attn_interface.py::test_one_line_switch",
    ],
    "SDPA registration and context parallelism": [
        "tests/integrations/test_sdpa.py::test_sdpa_op_forward_backward[causal]",
        "tests/integrations/test_distributed.py::"
        "test_ring_matches_single_device[w2-zigzag-causal-fp32]",
    ],
    "vLLM's attention backend (skipped without vLLM: CI's vllm stack)": [
        "tests/vllm_backend/test_backend.py::test_forward_mixed_batch_matches_the_oracle",
    ],
    "the benchmark CLI's argument errors": [
        "tests/test_benchmarks_smoke.py::test_cli_rejects_bad_values",
    ],
}
QUICK_IDS = {node for nodes in QUICK.values() for node in nodes}


def _mark_quick(config, items):
    """Mark the QUICK tests ``quick`` (a bare function name marks all its parametrizations);
    with ``-m quick``, a listed id that its collected file does not have is an error (a renamed
    test would silently drop its route from the quick run)."""
    quick = pytest.mark.quick
    seen, files = set(), set()
    for item in items:
        files.add(item.nodeid.split("::")[0])
        base = item.nodeid.split("[")[0]
        for node in (item.nodeid, base):
            if node in QUICK_IDS:
                item.add_marker(quick)
                seen.add(node)
    if "quick" in (config.getoption("markexpr") or ""):
        missing = sorted(n for n in QUICK_IDS - seen if n.split("::")[0] in files)
        if missing:
            raise pytest.UsageError("tests/conftest.py QUICK names tests that were not "
                                    "collected (renamed or removed?): " + ", ".join(missing))
