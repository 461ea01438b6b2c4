"""PyTorch fallback for CPU tensors when Triton's interpreter is off: the kernels' semantics
(bottom-right causal, sliding window, grouped-query heads, packed sequences, rows without keys
-> zeros / lse -inf, and the same Philox dropout mask) in O(seq) memory.

* Where PyTorch's own CPU flash attention computes exactly the same thing (no dropout, no
  window, dense, non-causal or causal with q_len == k_len, where top-left and bottom-right
  alignment agree), its aten ops do the work: they return the lse too, and are PyTorch's
  speed. Two things those ops assume are made true here: a unit stride in head_dim (they read
  each row as a contiguous vector; any other last-dim stride gave wrong output and gradients,
  so such a tensor is copied first, as the kernels' launchers do), and finite q and k (with
  fewer than 16 keys, a row whose scores are all NaN came back as zeros with lse 0 instead of
  NaN; inputs with a NaN or an infinity take the blockwise path below, where NaN in gives NaN
  out for every row it reaches, as in the kernels and the oracle).
* Everything else (our dropout mask, windows, q_len != k_len causal, packed sequences) is
  computed block by block over query rows, each block against only the keys it can see, so
  memory stays O(block · k_len) instead of O(q_len · k_len).

The visibility rule and the dropout row ids mirror kernels/core/tiles.py and
kernels/core/dropout.py; the dropout bits come from ``reference.dropout`` (the PyTorch twin of
the kernels' counter).
"""
import torch

from .call import lse_shape

# Score elements per block of query rows (all batches and heads together): a few fp32
# temporaries of this size are alive at once, ~4 MiB each.
_BLOCK_ELEMS = 1 << 20


def _row_blocks(batch, heads, q_len, k_len):
    """[start, end) query-row blocks whose (batch, heads, rows, k_len) scores fit _BLOCK_ELEMS."""
    rows = max(1, min(q_len, _BLOCK_ELEMS // max(1, batch * heads * k_len)))
    return [(i, min(i + rows, q_len)) for i in range(0, q_len, rows)]


def _key_span(i0, i1, q_len, k_len, causal, window):
    """[k0, k1): the keys any of the query rows [i0, i1) can see (kernels/core/tiles.key_range)."""
    if not causal:
        return 0, k_len
    diag = k_len - q_len
    k1 = min(max(i1 + diag, 0), k_len)
    k0 = 0 if window is None else min(max(i0 + diag - window + 1, 0), k1)
    return k0, k1


def block_visible(i0, i1, k0, k1, q_len, k_len, causal, window, device):
    """Bool (i1 - i0, k1 - k0): query i sees key j (kernels/core/tiles.visible, in PyTorch)."""
    rows = torch.arange(i0, i1, device=device)[:, None]
    cols = torch.arange(k0, k1, device=device)[None, :]
    diag = k_len - q_len
    vis = torch.ones((i1 - i0, k1 - k0), dtype=torch.bool, device=device)
    if causal:
        vis = cols <= rows + diag
        if window is not None:
            vis = vis & (cols > rows + diag - window)
    return vis


class _Dense:
    """One dense problem: q (B, H, q_len, D), k/v (B, H_kv, k_len, D), fp32 math; dropout rows
    ``row_base[b, h] + i`` with ``groups`` counters per row (kernels/core/dropout.py)."""

    def __init__(self, q, k, v, causal, window, softmax_scale, dropout_p, seed, row_base,
                 groups, col_offset=0):
        self.group = q.shape[1] // k.shape[1]
        self.q, self.k, self.v = q.float(), self._expand(k.float()), self._expand(v.float())
        self.causal, self.window, self.scale = causal, window, softmax_scale
        self.dropout_p, self.seed, self.row_base, self.groups = dropout_p, seed, row_base, groups
        self.col_offset = col_offset

    def _expand(self, x):
        return x.repeat_interleave(self.group, dim=1) if self.group > 1 else x

    def reduce_group(self, x):
        """(B, H, k_len, D) gradient of the expanded k/v -> (B, H_kv, k_len, D)."""
        if self.group == 1:
            return x
        B, H, n, D = x.shape
        return x.view(B, H // self.group, self.group, n, D).sum(2)

    def blocks(self):
        B, H, q_len, _ = self.q.shape
        return _row_blocks(B, H, q_len, self.k.shape[2])

    def keys(self, i0, i1):
        """[k0, k1): the only keys rows [i0, i1) see (causal and window bound the work)."""
        return _key_span(i0, i1, self.q.shape[2], self.k.shape[2], self.causal, self.window)

    def scores(self, i0, i1, k0, k1):
        """Scaled scores of rows [i0, i1) x keys [k0, k1), -inf where invisible:
        (B, H, i1 - i0, k1 - k0)."""
        q_len, k_len = self.q.shape[2], self.k.shape[2]
        s = torch.matmul(self.q[:, :, i0:i1], self.k[:, :, k0:k1].transpose(-2, -1)) * self.scale
        vis = block_visible(i0, i1, k0, k1, q_len, k_len, self.causal, self.window, s.device)
        return s.masked_fill(~vis, float("-inf"))

    def drop(self, i0, i1, k0, k1):
        """Dropout factor keep / (1 - p) of rows [i0, i1) x keys [k0, k1) (1.0 without
        dropout)."""
        if self.dropout_p == 0:
            return 1.0
        from reference.dropout import dropout_keep_rows
        B, H, _, _ = self.q.shape
        rows = (self.row_base[:, :, None]
                + torch.arange(i0, i1, device=self.q.device)[None, None, :]).reshape(-1)
        # The counters of columns [0, k1), of which [k0, k1) are kept: Philox words come in
        # groups of 4 columns, so the mask is cut from the row's first column on.
        c = self.col_offset
        keep = dropout_keep_rows(self.seed, rows, c + k1, self.dropout_p, groups=self.groups)
        return keep[:, c + k0:].view(B, H, i1 - i0, k1 - k0) / (1.0 - self.dropout_p)


def _sdpa_applies(q, k, cu_q, causal, window, dropout_p):
    """Whether PyTorch's CPU flash attention computes exactly our result (see the docstring):
    the forward and the backward of one call decide alike (same q, k and arguments)."""
    return (cu_q is None and window is None and dropout_p == 0.0
            and (not causal or q.shape[2] == k.shape[2]) and min(q.shape[2], k.shape[2]) > 0
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
            and bool(torch.isfinite(q).all()) and bool(torch.isfinite(k).all()))


def _unit_last(x):
    """``x`` itself when head_dim is unit-stride (any other strides are fine for the aten ops),
    else a copy with a unit stride there: the aten CPU flash ops read each row as a contiguous
    vector. (``.contiguous()`` alone keeps the stride of a size-1 head_dim.)"""
    if x.stride(-1) == 1:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _expand_kv(q, *kv):
    group = q.shape[1] // kv[0].shape[1]
    return [x.repeat_interleave(group, dim=1) if group > 1 else x for x in kv]


def _sdpa_forward(q, k, v, causal, softmax_scale, o):
    q, k, v = (_unit_last(x) for x in (q, k, v))
    k, v = _expand_kv(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=softmax_scale)
    o.copy_(out)
    return o, lse.float().contiguous()


def _sdpa_backward(do, q, k, v, o, lse, causal, softmax_scale, dq, dk, dv):
    q, k, v, o = (_unit_last(x) for x in (q, k, v, o))
    k_e, v_e = _expand_kv(q, k, v)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.contiguous(), q, k_e, v_e, o, lse, 0.0, causal, scale=softmax_scale)
    group = q.shape[1] // k.shape[1]
    for out, g in zip((dq, dk, dv), grads):
        if out is not dq and group > 1:  # kv heads: sum over each group of query heads
            B, H, n, D = g.shape
            g = g.view(B, H // group, group, n, D).sum(2)
        out.copy_(g)
    return dq, dk, dv


def _probs(s, lse):
    # Rows with no visible key have lse = -inf and all-masked scores: P = exp(-inf) = 0.
    return torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])


def _forward_dense(pb, o, lse):
    for i0, i1 in pb.blocks():
        k0, k1 = pb.keys(i0, i1)
        s = pb.scores(i0, i1, k0, k1)
        blk_lse = torch.logsumexp(s, dim=-1)
        lse[:, :, i0:i1] = blk_lse
        p = _probs(s, blk_lse) * pb.drop(i0, i1, k0, k1)
        o[:, :, i0:i1] = torch.matmul(p, pb.v[:, :, k0:k1]).to(o.dtype)


def _backward_dense(pb, do, o, lse, dq, dk, dv):
    do = do.float()
    dk_h = torch.zeros_like(pb.k)
    dv_h = torch.zeros_like(pb.v)
    for i0, i1 in pb.blocks():
        k0, k1 = pb.keys(i0, i1)
        p = _probs(pb.scores(i0, i1, k0, k1), lse[:, :, i0:i1])
        drop = pb.drop(i0, i1, k0, k1)
        do_b = do[:, :, i0:i1]
        delta = (do_b * o[:, :, i0:i1].float()).sum(-1, keepdim=True)  # right with dropout too
        ds = p * (torch.matmul(do_b, pb.v[:, :, k0:k1].transpose(-2, -1)) * drop - delta)
        dq[:, :, i0:i1] = (torch.matmul(ds, pb.k[:, :, k0:k1]) * pb.scale).to(dq.dtype)
        dk_h[:, :, k0:k1] += torch.matmul(ds.transpose(-2, -1), pb.q[:, :, i0:i1]) * pb.scale
        dv_h[:, :, k0:k1] += torch.matmul((p * drop).transpose(-2, -1), do_b)
    dk.copy_(pb.reduce_group(dk_h))
    dv.copy_(pb.reduce_group(dv_h))


def _problems(q, k, v, cu_q, cu_k, causal, window, softmax_scale, dropout_p, seed,
              drop_layout=None):
    """(dense problem, q-row slice, k-row slice) per batch or packed sequence. Dense: one
    problem for the whole batch; packed: one per sequence on (1, H, len, D) views.
    ``drop_layout`` (dense only): (q_total, k_total, row_offset, col_offset) of a block."""
    common = (causal, window, softmax_scale, dropout_p, seed)
    if cu_q is None:
        B, H, q_len, _ = q.shape
        q_total, k_total, row_off, col_off = drop_layout or (q_len, k.shape[2], 0, 0)
        row_base = torch.arange(B * H, device=q.device).view(B, H) * q_total + row_off
        groups = (k_total + 3) // 4
        return [(_Dense(q, k, v, *common, row_base, groups, col_off), slice(None),
                 slice(None))]
    total_q, H, _ = q.shape
    groups = (k.shape[0] + 3) // 4
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    out = []
    for s in range(len(bounds_q) - 1):
        rq = slice(bounds_q[s], bounds_q[s + 1])
        rk = slice(bounds_k[s], bounds_k[s + 1])
        row_base = (torch.arange(H, device=q.device) * total_q + bounds_q[s]).view(1, H)
        views = [x[r].transpose(0, 1).unsqueeze(0) for x, r in ((q, rq), (k, rk), (v, rk))]
        out.append((_Dense(*views, *common, row_base, groups), rq, rk))
    return out


def _fields(call):
    """(causal, window, softmax_scale, dropout_p, seed, drop_layout) of an ``AttentionCall``."""
    return (call.causal, call.window, call.softmax_scale, call.dropout_p, call.seed,
            call.drop_layout)


def _view(x, r, packed):
    """The 4-D view of output ``x`` that matches a problem's rows ``r``."""
    return x[r].transpose(0, 1).unsqueeze(0) if packed else x


def forward(q, k, v, cu_q, cu_k, call, o):
    """(o, lse) as the forward kernel returns them for ``call`` (an ``AttentionCall``,
    kernels/core/call.py); ``o`` is written in place."""
    causal, window, softmax_scale, dropout_p, seed, drop_layout = _fields(call)
    if _sdpa_applies(q, k, cu_q, causal, window, dropout_p):
        return _sdpa_forward(q, k, v, causal, softmax_scale, o)
    packed = cu_q is not None
    lse = torch.empty(lse_shape(q, packed), dtype=torch.float32, device=q.device)
    for pb, rq, _ in _problems(q, k, v, cu_q, cu_k, causal, window, softmax_scale, dropout_p,
                               seed, drop_layout):
        lse_v = lse[:, rq].unsqueeze(0) if packed else lse
        _forward_dense(pb, _view(o, rq, packed), lse_v)
    return o, lse


def backward(do, q, k, v, o, lse, cu_q, cu_k, call, dq, dk, dv):
    """(dq, dk, dv) as the backward kernels return them for ``call``, written into the given
    tensors."""
    causal, window, softmax_scale, dropout_p, seed, drop_layout = _fields(call)
    if _sdpa_applies(q, k, cu_q, causal, window, dropout_p):
        return _sdpa_backward(do, q, k, v, o, lse, causal, softmax_scale, dq, dk, dv)
    packed = cu_q is not None
    dq.zero_()  # rows of no sequence (none when cu_seqlens are valid) stay 0
    dk.zero_()
    dv.zero_()
    for pb, rq, rk in _problems(q, k, v, cu_q, cu_k, causal, window, softmax_scale, dropout_p,
                                seed, drop_layout):
        lse_v = lse[:, rq].unsqueeze(0) if packed else lse
        _backward_dense(pb, _view(do, rq, packed), _view(o, rq, packed), lse_v,
                        _view(dq, rq, packed), _view(dk, rk, packed), _view(dv, rk, packed))
    return dq, dk, dv


def kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, call, o):
    """``attention_with_kvcache`` row by row: append (k, v) in place, then each row b attends
    to its first n_b cache positions as ``call`` says. Returns (o, lse (B, H_q, q_len))."""
    B, H, q_len, _ = q.shape
    lens = cache_seqlens.tolist()
    if k is not None:
        for b, n in enumerate(lens):
            k_cache[b, :, n:n + q_len] = k[b]
            v_cache[b, :, n:n + q_len] = v[b]
    lse = torch.empty((B, H, q_len), dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        n = n + (q_len if k is not None else 0)
        o_b, lse_b = forward(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n], None,
                             None, call, o[b:b + 1])
        lse[b:b + 1] = lse_b
    return o, lse
