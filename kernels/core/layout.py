"""Host-side description of one attention call, shared by the forward and backward launchers.

Both layouts reach the kernels as 4-D (batch, heads, seq, head_dim) views:

* dense: q (B, heads_q, q_len, D), k/v (B, heads_kv, k_len, D) as given; lse (B, heads_q, q_len).
* packed (varlen): q (total_q, heads_q, D) is viewed as (1, heads_q, total_q, D) and the
  kernels' batch axis runs over the sequences, whose row offsets come from ``cu_seqlens``
  (the batch stride is 0); lse (heads_q, total_q).

In both, the lse entry of (batch or sequence b, head h, row i) sits at
``b * lse_strides[0] + h * lse_strides[1] + row_start + i``: the kernels use that offset as the
row id of the dropout counter too (kernels/core/dropout.py).
"""
from typing import NamedTuple, Optional

import torch
import triton


class Problem(NamedTuple):
    q: torch.Tensor               # (B or 1, heads_q, q_len or total_q, D)
    k: torch.Tensor               # (B or 1, heads_kv, k_len or total_k, D)
    v: torch.Tensor
    batch: int                    # B, or the number of packed sequences
    heads: int                    # query heads
    group: int                    # query heads per kv head
    q_len: int                    # dense length, or the longest packed sequence (grid extent)
    k_len: int
    cu_q: Optional[torch.Tensor]  # int32 (batch + 1,) for packed sequences, else None
    cu_k: Optional[torch.Tensor]
    lse_shape: tuple
    lse_strides: tuple            # (batch stride, head stride) of lse
    drop_groups: int              # Philox counters per row id (kernels/core/dropout.py)

    @property
    def varlen(self) -> bool:
        return self.cu_q is not None

    def strides(self, x):
        """(batch, head, seq) strides of a 4-D view; the batch stride is 0 for packed
        sequences, whose offsets come from cu_seqlens instead."""
        return (0 if self.varlen else x.stride(0)), x.stride(1), x.stride(2)

    def dropout_args(self, drop_layout=None):
        """(groups, row-id batch stride, row-id head stride, row offset, column offset) of the
        dropout counter (kernels/core/dropout.py): the lse layout's by default; with
        ``drop_layout = (q_total, k_total, row_offset, col_offset)`` (dense only) those of the
        longer sequence this call is a block of."""
        if drop_layout is None:
            return (self.drop_groups, *self.lse_strides, 0, 0)
        q_total, k_total, row_offset, col_offset = drop_layout
        assert not self.varlen and col_offset % 4 == 0
        assert row_offset + self.q_len <= q_total and col_offset + self.k_len <= k_total
        return (triton.cdiv(k_total, 4), self.heads * q_total, q_total, row_offset, col_offset)

    def cu_args(self, dummy):
        """The cu_seqlens pointers (``dummy`` for dense calls: never read there)."""
        return (self.cu_q, self.cu_k) if self.varlen else (dummy, dummy)


def packed_view(x):
    """(total, heads, D) packed tensor as a (1, heads, total, D) view (no copy)."""
    return x.transpose(0, 1).unsqueeze(0)


def dense_problem(q, k, v) -> Problem:
    """q (B, heads_q, q_len, D); k, v (B, heads_kv, k_len, D)."""
    B, H, q_len, _ = q.shape
    H_kv, k_len = k.shape[1], k.shape[2]
    assert H_kv > 0 and H % H_kv == 0 or H == H_kv == 0
    return Problem(q, k, v, B, H, H // H_kv if H_kv else 1, q_len, k_len, None, None,
                   (B, H, q_len), (H * q_len, q_len), triton.cdiv(k_len, 4))


def varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k) -> Problem:
    """q (total_q, heads_q, D); k, v (total_k, heads_kv, D); cu_q, cu_k int32 (n + 1,);
    max_q, max_k: the longest sequence lengths (grid extents; >= the real ones)."""
    total_q, H, _ = q.shape
    total_k, H_kv, _ = k.shape
    assert H_kv > 0 and H % H_kv == 0
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    return Problem(packed_view(q), packed_view(k), packed_view(v), cu_q.numel() - 1, H,
                   H // H_kv, max_q, max_k, cu_q, cu_k, (H, total_q), (0, total_q),
                   triton.cdiv(total_k, 4))
