"""``kernels.vllm``: our paged attention as vLLM v1 attention backends, ``TRITON_FUSED``
(multi-head, grouped-query, multi-query attention) and ``TRITON_FUSED_MLA`` (DeepSeek's
multi-head latent attention).

vLLM loads it through the ``vllm.general_plugins`` entry point this package installs
(``register``, run in every vLLM process). Registering adds the name only: a GPU user selects
it with ``--attention-backend TRITON_FUSED`` (or ``TRITON_FUSED_MLA`` for an MLA model; or
``LLM(..., attention_backend=...)``). vLLM's CPU platform ignores that choice and always takes
CPU_ATTN's class path (CPU_MLA's or AMX_MLA's for MLA models); there the environment variable
``KERNELS_VLLM=1`` makes ``register`` put our backends in those places. Without it installing
this package changes nothing in a user's vLLM.

The backends themselves (``kernels.vllm.backend``, ``kernels.vllm.mla``) import vLLM; this
module does not, so that ``kernels`` never needs vLLM. See docs/integrations.md, "vLLM".
"""
import os

BACKEND_NAME = "TRITON_FUSED"
BACKEND_PATH = "kernels.vllm.backend.TritonFusedBackend"
MLA_BACKEND_NAME = "TRITON_FUSED_MLA"
MLA_BACKEND_PATH = "kernels.vllm.mla.TritonFusedMLABackend"
# Set to "1" to serve vLLM's CPU platform with our backends in CPU_ATTN's place (and CPU_MLA's,
# AMX_MLA's: the CPU platform picks AMX_MLA for MLA models on AMX CPUs).
ENV_CPU_OVERRIDE = "KERNELS_VLLM"


def register() -> None:
    """Register ``TRITON_FUSED`` and ``TRITON_FUSED_MLA`` with vLLM's attention-backend
    registry (idempotent); with ``KERNELS_VLLM=1`` on vLLM's CPU platform, also as CPU_ATTN's
    class and as CPU_MLA's and AMX_MLA's. The ``vllm.general_plugins`` entry point calls it in
    every vLLM process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, path in ((BACKEND_NAME, BACKEND_PATH), (MLA_BACKEND_NAME, MLA_BACKEND_PATH)):
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)
    if os.environ.get(ENV_CPU_OVERRIDE, "") == "1":
        from vllm.platforms import current_platform
        if current_platform.is_cpu():
            register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
            # The platform picks AMX_MLA on AMX CPUs (and then keeps chunked prefill and
            # prefix caching on), CPU_MLA elsewhere: ours in both places.
            register_backend(AttentionBackendEnum.CPU_MLA, MLA_BACKEND_PATH)
            register_backend(AttentionBackendEnum.AMX_MLA, MLA_BACKEND_PATH)


def probe(model) -> dict:
    """What serves ``model``'s attention in this vLLM worker: {"impls": the attention and MLA
    layers' impl class names, "calls": our backends' call counts in this process
    (``forward``, ``decode_forward``, ``cache_write``; ``mla_decode``, ``mla_prefill``,
    ``mla_prefill_context``, ``mla_cache_write``)}. For ``LLM.apply_model(kernels.vllm.probe)``:
    proof that an engine runs our backends, not others, in every worker process."""
    import sys
    from vllm.model_executor.layers.attention import Attention, MLAAttention
    impls = sorted({type(m.impl).__name__ for m in model.modules()
                    if isinstance(m, (Attention, MLAAttention))})
    calls = {}
    for part in ("backend", "mla"):   # counted only where ours was imported (= selected)
        module = sys.modules.get(f"{__name__}.{part}")
        calls.update(dict(module.CALLS) if module is not None else {})
    return {"impls": impls, "calls": calls}
