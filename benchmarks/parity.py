"""Quick parity check of ``kernels.attention`` against the float64 oracle, run before timing,
by the rule the tests use (``reference.parity.parity_budget``, FlashAttention's: within 2x for
the output and 3x for the gradients of PyTorch's own error in the dtype, plus a floor; NaN
never passes; with dropout the kernel's mask is reproduced by ``reference.dropout_keep_mask``).
"""
import torch

from reference.parity import GRAD_FACTOR, OUT_FACTOR, parity_budget


def parity_ok(out, ref, ref_lowp, *, factor=OUT_FACTOR):
    """True when ``out`` is within ``factor`` x PyTorch-in-dtype error (+ floor) of ``ref``."""
    if out.shape != ref.shape or torch.isnan(out).any():
        return False
    err, allowed = parity_budget(out, ref, ref_lowp, factor=factor)
    return err <= allowed


def _grads(fn, q, k, v, do):
    """Output and (dq, dk, dv) of ``fn`` for upstream gradient ``do`` (fresh leaf copies)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do.to(out.dtype))
    return out.detach(), (dq, dk, dv)


def check_parity(device, dtypes, shapes, *, dropout_p=0.1, seed=1234):
    """``kernels.attention`` (causal) against the oracle per dtype and (batch, heads, seq_len,
    head_dim) shape: output and gradients without dropout and with ``dropout_p``, and the same
    bits for a repeated seed; a list of dicts (name, dtype, shape, err, budget, ok)."""
    import kernels
    import reference

    results = []
    for dtype in dtypes:
        for (b, h, s, d) in shapes:
            q, k, v, do = (torch.randn(b, h, s, d, device=device).to(dtype) for _ in range(4))
            for p in (0.0, dropout_p):
                keep = (reference.dropout_keep_mask(seed, b, h, s, s, p, device=device)
                        if p > 0 else None)

                def ours_fn(q, k, v, p=p):
                    return kernels.attention(q, k, v, causal=True, dropout_p=p, seed=seed)

                def ref_fn(q, k, v, p=p, keep=keep, upcast=True):
                    return reference.attention(q, k, v, causal=True, dropout_p=p,
                                               keep_mask=keep, upcast=upcast)

                ours, g_ours = _grads(ours_fn, q, k, v, do)
                ref, g_ref = _grads(ref_fn, q, k, v, do)
                low, g_low = _grads(lambda q, k, v: ref_fn(q, k, v, upcast=False), q, k, v, do)
                pairs = [("out", ours, ref, low, OUT_FACTOR)]
                pairs += [(n, a, r, l_, GRAD_FACTOR)
                          for n, a, r, l_ in zip(("dq", "dk", "dv"), g_ours, g_ref, g_low)]
                for name, out, r, low_, factor in pairs:
                    err, allowed = parity_budget(out, r, low_, factor=factor)
                    results.append({
                        "name": f"{name} dropout={p}", "dtype": str(dtype).replace("torch.", ""),
                        "shape": [b, h, s, d], "err": err, "budget": allowed,
                        "ok": bool(err <= allowed and not torch.isnan(out).any()),
                    })
            again = kernels.attention(q, k, v, causal=True, dropout_p=dropout_p, seed=seed)
            first = kernels.attention(q, k, v, causal=True, dropout_p=dropout_p, seed=seed)
            results.append({"name": "dropout same seed -> same bits",
                            "dtype": str(dtype).replace("torch.", ""), "shape": [b, h, s, d],
                            "err": (again.double() - first.double()).abs().max().item(),
                            "budget": 0.0, "ok": bool(torch.equal(again, first))})
    return results
