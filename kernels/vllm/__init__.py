"""``kernels.vllm``: our paged attention as a vLLM v1 attention backend, ``TRITON_FUSED``.

vLLM loads it through the ``vllm.general_plugins`` entry point this package installs
(``register``, run in every vLLM process). Registering adds the name only: a GPU user selects
it with ``--attention-backend TRITON_FUSED`` (or ``LLM(..., attention_backend=
"TRITON_FUSED")``). vLLM's CPU platform ignores that choice and always takes CPU_ATTN's class
path; there the environment variable ``KERNELS_VLLM=1`` makes ``register`` put our backend in
CPU_ATTN's place. Without it installing this package changes nothing in a user's vLLM.

The backend itself (``kernels.vllm.backend``) imports vLLM; this module does not, so that
``kernels`` never needs vLLM. See docs/integrations.md, "vLLM".
"""
import os

BACKEND_NAME = "TRITON_FUSED"
BACKEND_PATH = "kernels.vllm.backend.TritonFusedBackend"
# Set to "1" to serve vLLM's CPU platform with our backend in CPU_ATTN's place.
ENV_CPU_OVERRIDE = "KERNELS_VLLM"


def register() -> None:
    """Register ``TRITON_FUSED`` with vLLM's attention-backend registry (idempotent); with
    ``KERNELS_VLLM=1`` on vLLM's CPU platform, also as CPU_ATTN's class. The
    ``vllm.general_plugins`` entry point calls it in every vLLM process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    if os.environ.get(ENV_CPU_OVERRIDE, "") == "1":
        from vllm.platforms import current_platform
        if current_platform.is_cpu():
            register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


def probe(model) -> dict:
    """What serves ``model``'s attention in this vLLM worker: {"impls": the attention layers'
    impl class names, "calls": our backend's call counts in this process (``forward``,
    ``decode_forward``, ``cache_write``)}. For ``LLM.apply_model(kernels.vllm.probe)``: proof
    that an engine runs ``TRITON_FUSED``, not another backend, in every worker process."""
    import sys
    from vllm.model_executor.layers.attention import Attention
    impls = sorted({type(m.impl).__name__ for m in model.modules() if isinstance(m, Attention)})
    backend = sys.modules.get(__name__ + ".backend")
    return {"impls": impls, "calls": dict(backend.CALLS) if backend is not None else {}}
