"""The split-KV merge (kernels/core/splitkv.py) when the splits' log-sum-exps are far apart.

Each split hands the merge its normalised partial output and its lse; the merge weighs split s
by exp(lse_s - m), m the largest lse of all the splits. A merge that took m from some splits
only (the first, say) would still pass on random inputs, whose lse differ by a few units, and
fail only where a split it skipped exceeds m by more than fp32's exp range (~88): exp overflows
to inf and the row turns NaN. Here one block of keys is aligned with the query and scaled so
its scores sit ~300 above the others, and that block is placed in the first, a middle or the
last split.

The hot block is a quarter of 256 keys: the last quarter lands in a split other than the first
for any key tile of 16 to 128 keys (4 splits of 64 keys with the interpreter's 16-key tiles,
where the second quarter is split 1 too); the first quarter is the control a merge with a
wrong max would still pass.
"""
import pytest
import torch
from helpers import DEVICE, assert_parity, randn

import kernels
import reference

HEAD_DIM, K_LEN, SPLITS = 16, 256, 4
# The hot keys' scores: about this much above the others (each hot score varies by ~1).
GAP = 300.0


def _hot_inputs(B, H, q_len, k_len, hot, dtype):
    """q, k, v (B, H, ., HEAD_DIM) with keys [hot[0], hot[1]) of every row aligned with the
    queries: query rows are 4 * u (u a unit vector per head), those keys GAP * u / scale / 4
    plus unit noise, so their scaled scores are GAP + O(1) against O(1) for the others."""
    u = torch.nn.functional.normalize(randn(B, H, 1, HEAD_DIM), dim=-1)
    q = (4.0 * u).expand(B, H, q_len, HEAD_DIM).contiguous()
    k = randn(B, H, k_len, HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    k[:, :, hot[0]:hot[1]] += (GAP / scale / 4.0) * u
    v = randn(B, H, k_len, HEAD_DIM)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _exp_allowance(lse, v):
    """The fp32 rounding no kernel avoids at these scores, derived from the inputs: a weight
    P = exp(s - lse) computed in fp32 is off by a relative ~eps * (|s| + |lse|) <= 2 eps |lse|
    for the weights that matter (s <= lse), so the output by up to that times max |v|
    (first order, as tests/helpers.fa2_oracle bounds it), doubled. At lse ~ 300 it exceeds
    PyTorch's own fp32 error, which rounds its scores once fewer."""
    eps = torch.finfo(torch.float32).eps
    return 2 * eps * 2 * lse.abs().max().item() * v.abs().max().item()


QUARTERS = {"first": (0, 64), "second": (64, 128), "last": (192, 256)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("where", sorted(QUARTERS))
def test_split_merge_with_far_apart_lse(where, dtype):
    q, k, v = _hot_inputs(2, 2, 3, K_LEN, QUARTERS[where], dtype)
    ref, ref_lse = reference.attention(q, k, v, causal=False, return_lse=True)
    lowp = reference.attention(q, k, v, causal=False, upcast=False)
    assert ref_lse.min() > GAP - 20          # the hot block dominates every row
    out, lse = kernels.attention(q, k, v, causal=False, num_splits=SPLITS, return_lse=True)
    extra = _exp_allowance(ref_lse, v)
    assert_parity(out, ref, lowp, name=f"hot {where} quarter, {SPLITS} splits", extra=extra)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-3)


def test_split_merge_decoding_from_a_cache():
    """One query token against KV-cache rows of different lengths (the decoding case split-KV
    is for), each row's hot keys in the last quarter of its filled positions."""
    B, H, cap = 2, 2, K_LEN
    lens = [K_LEN, 160]
    q, k_cache, v_cache = _hot_inputs(B, H, 1, cap, (0, 0), torch.float32)
    u = q[:, :, :1] / 4.0
    for b, n in enumerate(lens):
        k_cache[b, :, n - n // 4:n] += (GAP / HEAD_DIM ** -0.5 / 4.0) * u[b]
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out, lse = kernels.attention_with_kvcache(q, k_cache, v_cache, seqlens, causal=False,
                                              num_splits=SPLITS, return_lse=True)
    for b, n in enumerate(lens):
        args = (q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n])
        ref, ref_lse = reference.attention(*args, causal=False, return_lse=True)
        assert ref_lse.min() > GAP - 20
        assert_parity(out[b:b + 1], ref, reference.attention(*args, causal=False, upcast=False),
                      name=f"row {b} ({n} keys)", extra=_exp_allowance(ref_lse, args[2]))
        torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, rtol=0, atol=1e-3)
