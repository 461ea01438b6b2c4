"""Test devices, inputs and the parity assertion (the budget rule lives in reference.parity)."""
import torch

from reference.parity import GRAD_FACTOR, OUT_FACTOR, parity_budget  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def assert_parity(out, ref, ref_lowp, *, factor=OUT_FACTOR, name="output"):
    """Assert FlashAttention's budget rule (reference/parity.py); NaNs always fail."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in the result (an element never written?)"
    err, budget = parity_budget(out, ref, ref_lowp, factor=factor)
    assert err <= budget, (
        f"{name}: max error {err:.3e} vs float64 oracle exceeds the budget {budget:.3e} "
        f"({factor}x PyTorch-{out.dtype} error + floor)")


def randn(*shape, dtype=torch.float32, device=DEVICE, requires_grad=False):
    """Standard-normal test input (never zeros or ones)."""
    x = torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)
    return x.requires_grad_(requires_grad)
