"""FlashAttention's parity budget: the one definition used by the tests and the benchmarks.

With ``ref`` the float64 oracle and ``ref_lowp`` the same math done by PyTorch in the input
dtype, a kernel result passes when

    max|out - ref| <= factor * max|ref_lowp - ref| + floor

with factor 2 for outputs and 3 for gradients (FlashAttention's rule), and ``floor`` a few ulps
of the dtype times the reference's magnitude, for cases where PyTorch happens to be exact.
It needs no per-dtype tolerance table and holds at any size.
"""
import torch

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
FLOOR_ULPS = 4.0


def parity_budget(out, ref, ref_lowp, *, factor=OUT_FACTOR):
    """Return (max error of ``out``, allowed error) against float64 ``ref``.

    Args:
        out: kernel result, any shape, its dtype sets the floor's ulp.
        ref: float64 oracle of the same shape.
        ref_lowp: PyTorch's result in the input dtype, the baseline error.
        factor: multiple of the baseline error allowed (OUT_FACTOR or GRAD_FACTOR).
    """
    if out.numel() == 0:
        return 0.0, 0.0
    ref = ref.double()
    err = (out.double() - ref).abs().max().item()
    base = (ref_lowp.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    floor = FLOOR_ULPS * torch.finfo(out.dtype).eps * max(scale, 1e-3)
    return err, factor * base + floor
