"""Constants and small helpers shared by the forward and backward kernels and their launchers."""
import os

import torch
import triton
import triton.language as tl

# exp(x) == exp2(x * LOG2E): the kernels work in base 2 with log2(e) folded into the scale.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_HEAD_DIM = 512
# Queries and keys of the forward-only cache paths (KV cache, paged packed queries) may be
# wider: DeepSeek's multi-head latent attention (MLA) decodes with 576-wide latent rows (512
# compressed kv + 64 rope key) whose values are their first 512 columns (docs/features.md, "MLA").
MAX_HEAD_DIM_LATENT = 576
# tl.dot needs every dimension >= 16, so small head dims are padded up to this.
MIN_BLOCK_D = 16



def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates a function, i.e. when this
# package is first imported: the kernels below are interpreted or compiled for good.
KERNELS_INTERPRETED = interpreter_active()


def check_interpreter_setting():
    """Raise a clear error when TRITON_INTERPRET was set after the kernels were defined as
    compiled kernels: launching them on CPU tensors would otherwise fail deep inside Triton
    with "0 active drivers ([]). There should only be one."."""
    if interpreter_active() and not KERNELS_INTERPRETED:
        raise RuntimeError(
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} was set after the "
            f"`kernels` package was first imported, but Triton reads it only then (when "
            f"@triton.jit defines the kernels), so the kernels are compiled ones and cannot run "
            f"on CPU tensors. Set TRITON_INTERPRET=1 before the first `import kernels` (in the "
            f"shell, at the top of the script, or in a conftest.py), or unset it to use the "
            f"PyTorch CPU fallback.")


def block_d(head_dim: int) -> int:
    """Padded tile width for ``head_dim``: the next power of two, at least MIN_BLOCK_D."""
    return max(MIN_BLOCK_D, triton.next_power_of_2(head_dim))


def head_blocks(head_dim: int) -> tuple:
    """(BLOCK_D, BLOCK_D2): the forward's tile widths for a q / k head dim. Up to MAX_HEAD_DIM
    one padded tile, (``block_d``, 0). Wider (MLA's 576) two: the first MAX_HEAD_DIM columns
    whole and the rest padded, (512, 64), so Q Kᵀ is two dots summed instead of one over a
    1024-wide tile that would be 44% padding (the registers and shared memory of a 1024-wide
    tile spill or do not fit on any GPU)."""
    if head_dim <= MAX_HEAD_DIM:
        return block_d(head_dim), 0
    return MAX_HEAD_DIM, block_d(head_dim - MAX_HEAD_DIM)


# AMD GPUs on which Triton's HIP backend accepts a tf32 (xf32) dot: CDNA3 only; gfx950 and the
# others allow ieee / bf16x3 / bf16x6 and fail to compile any tl.dot asked for tf32.
HIP_TF32_ARCHS = ("gfx942",)


def dot_precision(dtype: torch.dtype, device=None) -> str:
    """``tl.dot`` input precision for ``dtype`` on ``device`` (None: the current GPU).

    NVIDIA: fp32 follows torch.get_float32_matmul_precision() ("highest" -> IEEE fp32,
    otherwise tf32); fp16/bf16 get Triton's default ("tf32"), which only concerns fp32
    operands and leaves their tensor-core path alone. AMD (a ROCm build of PyTorch): "ieee"
    (the HIP backend's default; fp16/bf16 MFMA either way), and tf32 for fp32 only where the
    HIP backend allows it (``HIP_TF32_ARCHS``)."""
    if torch.version.hip:
        from .configs import gpu_of   # configs imports this module
        fast_fp32 = (dtype == torch.float32
                     and torch.get_float32_matmul_precision() != "highest")
        return "tf32" if fast_fp32 and gpu_of(device).arch in HIP_TF32_ARCHS else "ieee"
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def widen_bf16(dtype: torch.dtype) -> bool:
    """Whether kernels must widen bf16 to fp32 after each load: Triton's interpreter computes
    bf16 on raw bit patterns (dot, add and compare all give garbage), the GPU does not."""
    return dtype == torch.bfloat16 and interpreter_active()


@triton.jit
def widen(x, WIDEN: tl.constexpr):
    """fp32 copy of a freshly loaded tile when WIDEN (interpreter + bf16), else ``x`` unchanged."""
    if WIDEN:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def round_for_store(x, WIDEN: tl.constexpr):
    """Round fp32 ``x`` to the nearest bf16 value (ties to even) when WIDEN, keeping fp32.

    The interpreter's fp32 -> bf16 cast truncates; after this rounding the truncation is exact,
    so interpreter results match the GPU's round-to-nearest store.
    """
    if WIDEN:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def dot_operand(x, like, WIDEN: tl.constexpr):
    """fp32 tile ``x`` (P or dS) as a tl.dot operand of ``like``'s dtype (the input dtype).

    On the GPU that is a cast (fp16/bf16 tensor cores; a no-op for fp32). Under the interpreter
    with bf16 the operands are widened fp32 tiles, so instead round ``x`` to bf16 values and keep
    it fp32: the products then match the GPU's bf16 MMA.
    """
    if WIDEN:
        return round_for_store(x, WIDEN)
    else:
        return x.to(like.dtype)
