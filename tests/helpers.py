"""One source of truth for test devices, inputs and the parity budget.

Parity rule (FlashAttention's): with ``ref`` the float64 oracle and ``ref_lowp`` the same math
done by PyTorch in the input dtype, a kernel output passes when

    max|out - ref| <= FACTOR * max|ref_lowp - ref| + floor

with FACTOR = 2 for outputs and 3 for gradients, and ``floor`` a few ulps of the dtype times the
reference's magnitude, for cases where PyTorch happens to be exact.
"""
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
FLOOR_ULPS = 4.0


def parity_error(out, ref, ref_lowp):
    """(kernel error, budget) for ``out`` against float64 ``ref``, with ``ref_lowp`` as baseline."""
    err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    base = (ref_lowp.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    scale = ref.double().abs().max().item() if out.numel() else 0.0
    floor = FLOOR_ULPS * torch.finfo(out.dtype).eps * max(scale, 1e-3)
    return err, base, floor


def assert_parity(out, ref, ref_lowp, *, factor=OUT_FACTOR, name="output"):
    """Assert FlashAttention's budget rule (see module docstring); NaNs always fail."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in the result (an element never written?)"
    err, base, floor = parity_error(out, ref, ref_lowp)
    assert err <= factor * base + floor, (
        f"{name}: max error {err:.3e} vs float64 oracle exceeds {factor}x PyTorch-{out.dtype} "
        f"error {base:.3e} + floor {floor:.3e}")


def randn(*shape, dtype=torch.float32, device=DEVICE, requires_grad=False):
    """Standard-normal test input (never zeros or ones)."""
    x = torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)
    return x.requires_grad_(requires_grad)
