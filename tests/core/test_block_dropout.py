"""Blocks of a longer sequence (context parallelism) draw their piece of the one dropout mask.

``kernels.ops.forward_with_lse / backward(drop_layout=(q_total, k_total, row_offset,
col_offset))`` run a (query block x key block) of a (q_total x k_total) attention; the dropout
mask must be that block of ``reference.dropout_keep_mask`` of the whole sequence, in the
interpreted kernels and in the PyTorch fallback, so merging the blocks by their lse gives the
single-call result.
"""
import pytest
import torch
from helpers import GRAD_FACTOR, assert_parity, randn

import kernels
import reference
from kernels import ops

SEED, P = 2 ** 35 + 11, 0.3
ROWS = [(0, 12), (12, 28), (28, 40)]
# Column blocks: offsets on the 4-column Philox groups, and offsets that straddle them (any
# chunk length of context parallelism: a group's words are then split between two blocks).
COL_SPLITS = {"aligned": [(0, 8), (8, 24), (24, 40)],
              "odd": [(0, 2), (2, 9), (9, 23), (23, 40)]}


@pytest.mark.parametrize("cols", sorted(COL_SPLITS))
def test_blocks_draw_the_whole_sequence_mask(route, cols):
    COLS = COL_SPLITS[cols]
    B, H, S, D = 2, 2, 40, 16
    q, k, v, do = (randn(B, H, S, D, device=route.device) for _ in range(4))
    keep = reference.dropout_keep_mask(SEED, B, H, S, S, P, device=route.device)
    outs, lses = {}, {}
    for r0, r1 in ROWS:
        for c0, c1 in COLS:
            qb, kb, vb, dob = q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], do[:, :, r0:r1]
            layout = (S, S, r0, c0)
            out, lse = ops.forward_with_lse(qb, kb, vb, causal=False, dropout_p=P, seed=SEED,
                                            drop_layout=layout)
            kw = dict(causal=False, dropout_p=P, keep_mask=keep[:, :, r0:r1, c0:c1])
            assert_parity(out, reference.attention(qb, kb, vb, **kw),
                          reference.attention(qb, kb, vb, upcast=False, **kw))
            grads = ops.backward(dob, qb, kb, vb, out, lse, causal=False, dropout_p=P,
                                 seed=SEED, drop_layout=layout)
            for upcast in (True, False):
                leaves = [t.detach().clone().requires_grad_() for t in (qb, kb, vb)]
                o = reference.attention(*leaves, upcast=upcast, **kw)
                g = torch.autograd.grad(o, leaves, dob.to(o.dtype))
                if upcast:
                    ref_g = g
                else:
                    lowp_g = g
            for name, got, r, lp in zip(("dq", "dk", "dv"), grads, ref_g, lowp_g):
                assert_parity(got, r, lp, factor=GRAD_FACTOR, name=name,
                              extra=8 * 1.2e-7 * r.abs().max().item())
            outs[r0, c0], lses[r0, c0] = out, lse

    # Merging each row block's key blocks by their lse is the single call, same seed.
    whole = kernels.attention(q, k, v, causal=False, dropout_p=P, seed=SEED)
    for r0, r1 in ROWS:
        lse_all = torch.stack([lses[r0, c0] for c0, _ in COLS])
        lse = torch.logsumexp(lse_all, 0)
        merged = sum(torch.exp(lses[r0, c0] - lse)[..., None] * outs[r0, c0] for c0, _ in COLS)
        torch.testing.assert_close(merged, whole[:, :, r0:r1], rtol=0, atol=2e-6)


@pytest.mark.parametrize("layout,match", [
    ((40, 40, -1, 0), "offsets >= 0"),
    ((40, 40, 30, 0), "inside the totals"),
    ((40, 40, 0), "4 ints"),
])
def test_bad_drop_layout(layout, match):
    q = randn(1, 1, 12, 16)
    with pytest.raises(ValueError, match=match):
        ops.forward_with_lse(q, q, q, causal=False, dropout_p=P, seed=1, drop_layout=layout)
