"""Context parallelism: ring attention over ``torch.distributed`` with the single-device mask.

Every rank of a process group holds a slice of the sequence (``shard``); K/V blocks travel
around the ring of ranks while each rank attends its queries to the block it holds, and the
partial results are merged by their log-sum-exp. The backward sends K/V around the ring again
and dK/dV travel with them, each rank adding its share (FlashAttention-2's backward of a block
only needs the merged output and lse of its query rows). NCCL on GPUs, gloo on CPU.

Layouts of a sequence of ``S`` positions over a group of ``W`` ranks:

* ``"zigzag"`` (default): ``2W`` chunks of ``S / 2W``; rank ``r`` holds chunks ``r`` and
  ``2W - 1 - r`` (in that order). With causal attention every rank then has the same work at
  every step of the ring: step 0 is the rank's own causal block, and at a later step a rank
  either attends all its queries to the first chunk it receives (sender ``< r``) or its second
  query chunk to both chunks it receives (sender ``> r``).
* ``"contiguous"``: ``W`` chunks of ``S / W``; rank ``r`` holds chunk ``r``. With causal
  attention rank ``r`` has ``r + 1`` blocks of work and the last rank sets the pace.

A (query chunk ``a``, key chunk ``b``) pair in global order is fully visible (``b < a``), the
diagonal (``b == a``, causal square) or invisible (``b > a``: skipped, no kernel call).

Dropout: every block passes its global position (``drop_layout``) to the kernels, so the union of
the ranks' masks is ``reference.dropout_keep_mask(seed, batch, heads, S, S, p)`` of the whole
sequence -- the mask of a single-device ``kernels.attention`` call with the same seed, for any
chunk length (a block whose keys start inside a 4-column Philox group draws that group and picks
its words).

Bad input never hangs the group: before any ring traffic each rank checks its own arguments and
all ranks exchange their verdicts, shapes, dtypes and options in one small all-gather; an error
on any rank (or ranks that disagree) raises on every rank.
"""
import struct
import zlib

import torch
import torch.distributed as dist  # imported by ``import torch`` already: costs nothing here

from . import ops

__all__ = ["ring_attention", "shard", "unshard"]

_LAYOUTS = ("zigzag", "contiguous")
_DEVICE_TYPES = ("cpu", "cuda")


# --------------------------------------------------------------------------------------------
# Group, layout and agreement helpers
# --------------------------------------------------------------------------------------------
def _group_info(group, caller):
    """(world size, rank in the group) of ``group`` (None: the default group)."""
    if not dist.is_available():
        raise RuntimeError(f"{caller}: this PyTorch build has no torch.distributed")
    if group is None and not dist.is_initialized():
        raise RuntimeError(f"{caller}: torch.distributed is not initialized; call "
                           f"torch.distributed.init_process_group (e.g. under torchrun) first, "
                           f"or pass a process group")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{caller}: this process is not a member of the given group")
    return dist.get_world_size(group), rank


def _check_layout(layout):
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout must be 'zigzag' or 'contiguous', got {layout!r}")


def _chunks(layout, world, rank):
    """Global chunk indices held by ``rank``, in local order, and the number of chunks."""
    if layout == "zigzag":
        return (rank, 2 * world - 1 - rank), 2 * world
    return (rank,), world


def _comm_device(group, t):
    """Where the group's collectives take their tensors (NCCL: the GPU; gloo: the CPU)."""
    backend = str(dist.get_backend(group)).lower()
    if isinstance(t, torch.Tensor) and t.device.type == "cuda" and "nccl" in backend:
        return t.device
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bits(x):
    """A float as the int64 of its IEEE-754 double bits (exact equality across ranks)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _agree(caller, group, world, rank, device, error, fields, names):
    """One all-gather of every rank's (verdict, fields): raise on every rank if any rank
    rejected its input or the ranks disagree on a field. Returns the (world, n) int64 table."""
    row = torch.tensor([1 if error is not None else 0] + [int(f) for f in fields],
                       dtype=torch.int64, device="cpu")
    table = torch.empty(world * row.numel(), dtype=torch.int64, device=device)
    # all_gather_single: torch >= 2.13's name of all_gather_into_tensor (deprecated there).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(table, row.to(device), group=group)
    table = table.view(world, row.numel()).cpu()
    bad = [i for i in range(world) if table[i, 0]]
    if error is not None:
        raise type(error)(f"{caller} (rank {rank} of {world}): {error}") from error
    if bad:
        raise ValueError(f"{caller}: rank(s) {bad} of the group of {world} rejected their input "
                         f"(their own error says why); no rank went on")
    for j, (name, show) in enumerate(names, start=1):
        col = table[:, j].tolist()
        if show is None:
            continue
        if any(x != col[0] for x in col):
            per_rank = ", ".join(f"rank {i}: {show(x)}" for i, x in enumerate(col))
            raise ValueError(f"{caller}: the ranks disagree on {name} ({per_rank})")
    return table


def _dtype_code(dtype):
    """A stable int for any torch dtype (the same in every process)."""
    return zlib.crc32(str(dtype).encode())


def _dtype_of_code(code):
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype) and _dtype_code(value) == code:
            return str(value)
    return "?"


def _device_name(code):
    return _DEVICE_TYPES[code] if 0 <= code < len(_DEVICE_TYPES) else "other"


def _float_name(bits):
    return "None" if bits == _NONE else repr(struct.unpack("<d", struct.pack("<q", bits))[0])


_NONE = -(2 ** 63)  # field value of an absent option (seed=None, softmax_scale=None)


# --------------------------------------------------------------------------------------------
# shard / unshard
# --------------------------------------------------------------------------------------------
def _check_dim(x, dim):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a {x.dim()}-D tensor")
    return dim % x.dim()


def _prefixed(error, caller):
    """``error`` again, its message prefixed with the caller's name."""
    return type(error)(f"{caller}: {error}")


def shard(x, group=None, layout="zigzag", dim=2):
    """This rank's part of the full sequence ``x`` (the same ``x`` on every rank).

    ``dim``: the sequence dim (2 for ``(batch, heads, seq, head_dim)``). ``"zigzag"``: chunks
    ``r`` and ``2W - 1 - r`` of ``2W`` concatenated (a new tensor); ``"contiguous"``: chunk ``r``
    of ``W`` (a view). Differentiable; no communication. The length must divide into 2W
    (zigzag) or W (contiguous) equal chunks.
    """
    world, rank = _group_info(group, "shard")
    try:
        _check_layout(layout)
        dim = _check_dim(x, dim)
    except (TypeError, ValueError) as e:
        raise _prefixed(e, "shard") from None
    chunk_ids, n_chunks = _chunks(layout, world, rank)
    n = x.shape[dim]
    if n % n_chunks:
        raise ValueError(f"shard: a sequence of length {n} (dim {dim}) does not split into "
                         f"{n_chunks} equal chunks ({'2 x ' if layout == 'zigzag' else ''}"
                         f"world size {world}, layout {layout!r}); pad it to a multiple of "
                         f"{n_chunks}")
    c = n // n_chunks
    parts = [x.narrow(dim, i * c, c) for i in chunk_ids]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(x_local, group=None, layout="zigzag", dim=2):
    """Gather every rank's part (as made by ``shard``) back into the full sequence, on every
    rank (a collective: every rank of the group must call it). Not differentiable (the result
    is a new tensor outside autograd). Parts of different shapes or dtypes raise on every rank.
    """
    world, rank = _group_info(group, "unshard")
    error, shape, dtype_code, dev_code = None, [], -1, -1
    try:
        _check_layout(layout)
        dim = _check_dim(x_local, dim)
        shape = list(x_local.shape)
        if len(shape) > 8:
            raise ValueError(f"at most 8 dims, got {len(shape)}")
        dtype_code = _dtype_code(x_local.dtype)
        dev_code = _DEVICE_TYPES.index(x_local.device.type) \
            if x_local.device.type in _DEVICE_TYPES else -1
        if layout == "zigzag" and shape[dim] % 2:
            raise ValueError(f"a zigzag part holds two equal chunks, its length "
                             f"{shape[dim]} (dim {dim}) is odd")
    except Exception as e:  # noqa: BLE001 -- every error must reach the other ranks
        error = e
    if world == 1 and error is not None:
        raise _prefixed(error, "unshard") from error
    if world == 1:
        return x_local
    device = _comm_device(group, x_local)
    fields = [len(shape), *(shape + [-1] * (8 - len(shape))), dtype_code, dev_code]
    names = [("the number of dims", str)] + [(f"size of dim {i}", str) for i in range(8)] + [
        ("dtype", _dtype_of_code), ("device type", _device_name)]
    _agree("unshard", group, world, rank, device, error, fields, names)
    parts = [torch.empty_like(x_local, memory_format=torch.contiguous_format)
             for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    if layout == "contiguous":
        return torch.cat(parts, dim)
    c = x_local.shape[dim] // 2
    ordered = [None] * (2 * world)
    for r, part in enumerate(parts):
        ordered[r] = part.narrow(dim, 0, c)
        ordered[2 * world - 1 - r] = part.narrow(dim, c, c)
    return torch.cat(ordered, dim)


# --------------------------------------------------------------------------------------------
# The ring
# --------------------------------------------------------------------------------------------
class _Ring:
    """Everything a ring pass needs, resolved and agreed by all ranks."""

    def __init__(self, group, world, rank, layout, n_local, causal, dropout_p, scale, seed):
        self.group, self.world, self.rank, self.layout = group, world, rank, layout
        self.causal, self.dropout_p, self.scale, self.seed = causal, dropout_p, scale, seed
        self.chunk_ids, n_chunks = _chunks(layout, world, rank)
        self.n_local = n_local
        self.c = n_local // len(self.chunk_ids)           # chunk length
        self.total = self.c * n_chunks                     # global sequence length
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        self.send_to = dist.get_global_rank(group, nxt) if group is not None else nxt
        self.recv_from = dist.get_global_rank(group, prv) if group is not None else prv

    def source(self, step):
        """The rank whose K/V this rank holds at ``step``."""
        return (self.rank - step) % self.world

    def blocks(self, step):
        """Kernel calls of one ring step: (q rows (start, len), k rows (start, len), causal,
        drop_layout) in local coordinates of this rank's queries and the held K/V."""
        src = self.source(step)
        k_ids, _ = _chunks(self.layout, self.world, src)
        c = self.c
        pairs = []                                         # (local q chunk, local k chunk, diag)
        for i, a in enumerate(self.chunk_ids):
            for j, b in enumerate(k_ids):
                if not self.causal or b < a:
                    pairs.append((i, j, False))
                elif b == a:
                    pairs.append((i, j, True))
        if not pairs:
            return []
        if self.dropout_p > 0:
            # One call per chunk pair: each needs its own global row/column offsets.
            return [((i * c, c), (j * c, c), diag,
                     (self.total, self.total, self.chunk_ids[i] * c, k_ids[j] * c))
                    for i, j, diag in pairs]
        if src == self.rank:
            # The own block: in both layouts the local order is the global order, so one
            # (causal) call covers it (zigzag: chunk r before chunk 2W-1-r, which sees all of r).
            return [((0, self.n_local), (0, self.n_local), self.causal, None)]
        qs = sorted({i for i, _, _ in pairs})
        ks = sorted({j for _, j, _ in pairs})
        if len(pairs) == len(qs) * len(ks):                # a product of consecutive chunks
            return [((qs[0] * c, len(qs) * c), (ks[0] * c, len(ks) * c), False, None)]
        return [((i * c, c), (j * c, c), diag, None) for i, j, diag in pairs]

    def exchange(self, tensors):
        """Start sending ``tensors`` to the next rank and receiving the previous rank's into
        new buffers (async); returns (buffers, requests)."""
        bufs = [torch.empty_like(t) for t in tensors]
        p2p = [dist.P2POp(dist.isend, t, self.send_to, self.group) for t in tensors]
        p2p += [dist.P2POp(dist.irecv, b, self.recv_from, self.group) for b in bufs]
        return bufs, dist.batch_isend_irecv(p2p)

    def kernel_args(self, diag, drop_layout):
        return dict(causal=diag, dropout_p=self.dropout_p, softmax_scale=self.scale,
                    seed=self.seed, drop_layout=drop_layout)


def _wait(reqs):
    for req in reqs:
        req.wait()


def _merge(out_acc, lse_acc, out_b, lse_b):
    """In place: (out_acc, lse_acc) <- log-sum-exp merge with a block's (out_b, lse_b), fp32.
    Rows where both are -inf (no key seen yet) stay 0 / -inf."""
    lse = torch.logaddexp(lse_acc, lse_b)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    out_acc.mul_(torch.exp(lse_acc - safe).unsqueeze(-1))
    out_acc.add_(torch.exp(lse_b - safe).unsqueeze(-1) * out_b.float())
    lse_acc.copy_(lse)


def _ring_forward(ring, q, k, v):
    b, h, n, d = q.shape
    out_acc = torch.zeros(b, h, n, d, dtype=torch.float32, device=q.device)
    lse_acc = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)
    kv = (k, v)
    for step in range(ring.world):
        if step < ring.world - 1:                          # next block in flight meanwhile
            nxt, reqs = ring.exchange(kv)
        for (q0, ql), (k0, kl), diag, layout in ring.blocks(step):
            o, lse = ops.forward_with_lse(q[:, :, q0:q0 + ql], kv[0][:, :, k0:k0 + kl],
                                          kv[1][:, :, k0:k0 + kl],
                                          **ring.kernel_args(diag, layout))
            _merge(out_acc[:, :, q0:q0 + ql], lse_acc[:, :, q0:q0 + ql], o, lse)
        if step < ring.world - 1:
            _wait(reqs)
            kv = tuple(nxt)
    return out_acc, lse_acc


def _ring_backward(ring, do, q, k, v, out, lse):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k, v)
    dkv, dkv_reqs = None, None
    for step in range(ring.world):
        if step < ring.world - 1:
            nxt, kv_reqs = ring.exchange(kv)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for (q0, ql), (k0, kl), diag, layout in ring.blocks(step):
            rows = slice(q0, q0 + ql)
            cols = slice(k0, k0 + kl)
            g = ops.backward(do[:, :, rows], q[:, :, rows], kv[0][:, :, cols],
                             kv[1][:, :, cols], out[:, :, rows], lse[:, :, rows],
                             **ring.kernel_args(diag, layout))
            dq[:, :, rows] += g[0]
            dk[:, :, cols] += g[1]
            dv[:, :, cols] += g[2]
        if dkv_reqs is not None:                           # the held block's dK/dV so far
            _wait(dkv_reqs)                                # (also frees the last sent pair)
            dk += dkv[0]
            dv += dkv[1]
        dkv, dkv_reqs = ring.exchange((dk, dv))            # on to the next rank
        sent = (dk, dv)                                    # alive until its send is waited on
        if step < ring.world - 1:
            _wait(kv_reqs)
            kv = tuple(nxt)
    _wait(dkv_reqs)                                        # after W hops: this rank's own
    del sent
    return dq, dkv[0], dkv[1]


def _in_layout_of(t, value):
    """``value`` in ``t``'s dtype and memory layout."""
    return torch.empty_like(t).copy_(value)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        k, v = k.contiguous(), v.contiguous()              # sent whole over the ring
        out_acc, lse = _ring_forward(ring, q, k, v)
        out = _in_layout_of(q, out_acc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, do, q, k, v, out, lse)
        return _in_layout_of(q, dq), dk.to(k.dtype), dv.to(v.dtype), None


def _local_checks(q, k, v, causal, dropout_p, softmax_scale, seed, layout, world, backend):
    """This rank's own verdict (raises); returns causal as a bool."""
    _check_layout(layout)
    causal = ops.check_arguments(q, k, v, causal, dropout_p, softmax_scale, seed)
    if v.shape[-1] != q.shape[-1]:
        raise NotImplementedError(f"ring attention needs v's head_dim to be q's, got q "
                                  f"{tuple(q.shape)} and v {tuple(v.shape)}")
    if backend == "nccl" and q.device.type != "cuda":
        raise ValueError(f"the group's backend is NCCL, which needs CUDA tensors; q is on "
                         f"{q.device} (use gloo for CPU tensors)")
    n = q.shape[2]
    if k.shape[2] != n:
        raise ValueError(f"ring attention is self-attention over one sharded sequence: the q "
                         f"and k/v shards must have the same length, got q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)}")
    if n == 0:
        raise ValueError(f"the shards must not be empty, got q {tuple(q.shape)}")
    if layout == "zigzag" and n % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks (r and 2W-1-r), so its length "
                         f"must be even, got {n} (q {tuple(q.shape)}); see "
                         f"kernels.distributed.shard")
    return causal


# Options of kernels.attention that the ring does not pass on (its merge and its chunks of the
# sequence would each need their own handling of them): refused by name.
_NOT_IN_RING = ("window", "softcap", "sinks", "chunk_size", "alibi_slopes", "score_mod",
                "mask_mod", "mod_aux")


def _refuse_options(options):
    unknown = sorted(set(options) - set(_NOT_IN_RING))
    if unknown:
        raise TypeError(f"ring_attention() got unexpected keyword arguments {unknown}")
    given = sorted(name for name, value in options.items() if value not in (None, ()))
    if given:
        raise NotImplementedError(
            f"ring_attention does not support {', '.join(given)}: these kernels.attention "
            f"options are not passed through the ring (its per-chunk calls and lse merge); "
            f"use kernels.attention on one device for them")


def ring_attention(q, k, v, *, group=None, causal=True, dropout_p=0.0, softmax_scale=None,
                   seed=None, layout="zigzag", **options):
    """Context-parallel (ring) attention: this rank's shard of ``kernels.attention`` over the
    whole sequence sharded across ``group``.

    Args:
        q, k, v: this rank's shards ``(batch, heads, seq_local, head_dim)`` as made by
            ``shard(x, group, layout)`` (k, v may have fewer heads: grouped-query attention);
            every rank's shards have the same shape, dtype and device type.
        group: a ``torch.distributed`` process group (default: the default group). NCCL for
            CUDA tensors, gloo for CPU tensors. A group of size 1 is ``kernels.attention``.
        causal, dropout_p, softmax_scale: as ``kernels.attention``, the same on every rank.
        seed: Philox seed of the dropout mask, the same on every rank; None: rank 0 of the
            group draws one from PyTorch's generator (as ``kernels.attention`` does) and sends
            it to the others, so ``torch.manual_seed`` on rank 0 reproduces a run.
        layout: ``"zigzag"`` (balanced causal work) or ``"contiguous"``; see the module doc.
        options: kernels.attention's ``window``, ``softcap``, ``sinks``, ``chunk_size``,
            ``alibi_slopes``, ``score_mod``, ``mask_mod``, ``mod_aux`` are refused by name
            (NotImplementedError) when given; v must have q's head_dim.

    Returns:
        This rank's rows of the output, in q's dtype (``unshard`` gathers them), equal to the
        single-device ``kernels.attention(full q, full k, full v, ...)`` rows within the parity
        rule; with dropout the mask is the single-device mask of the same seed. Differentiable
        (the backward is a ring too and returns this rank's dq, dk, dv).

    Raises:
        on every rank, before any ring traffic, when any rank's input is bad or the ranks
        disagree on shapes, dtype, device type or options (one small all-gather decides).
    """
    _refuse_options(options)
    world, rank = _group_info(group, "ring_attention")
    backend = str(dist.get_backend(group)).lower()
    error, causal_b = None, causal
    try:
        causal_b = _local_checks(q, k, v, causal, dropout_p, softmax_scale, seed, layout, world,
                                 backend)
    except Exception as e:  # noqa: BLE001 -- every error must reach the other ranks
        error = e
    if world == 1:
        if error is not None:
            raise _prefixed(error, "ring_attention") from error
        return ops.attention(q, k, v, causal=causal_b, dropout_p=dropout_p,
                             softmax_scale=softmax_scale, seed=seed)

    ok = error is None
    p = float(dropout_p) if ok else 0.0
    seed_field = _NONE if not ok or p == 0.0 or seed is None else int(seed)
    drawn = 0
    if ok and p > 0 and seed is None and rank == 0:       # rank 0 draws, as kernels.attention
        drawn = int(torch.randint(0, ops.SEED_LIMIT - 1, (), dtype=torch.int64))
    dev_type = q.device.type if isinstance(q, torch.Tensor) else ""
    fields = ([*q.shape, k.shape[1]] if ok else [0] * 5) + [
        _dtype_code(q.dtype) if ok else -1,
        _DEVICE_TYPES.index(dev_type) if dev_type in _DEVICE_TYPES else -1,
        int(causal_b) if ok else 0, _bits(p),
        _NONE if not ok or softmax_scale is None else _bits(softmax_scale),
        _LAYOUTS.index(layout) if ok else -1, seed_field, drawn]
    names = [("batch", str), ("query heads", str), ("shard length (every rank holds an "
             "equal-length shard, see kernels.distributed.shard)", str), ("head_dim", str),
             ("key/value heads", str), ("dtype", _dtype_of_code),
             ("device type", _device_name),
             ("causal", lambda c: str(bool(c))), ("dropout_p", _float_name),
             ("softmax_scale", _float_name), ("layout", lambda c: _LAYOUTS[c]),
             ("seed", lambda s: "None" if s == _NONE else str(s)), ("drawn seed", None)]
    table = _agree("ring_attention", group, world, rank, _comm_device(group, q), error, fields,
                   names)
    if p > 0 and seed is None:
        seed = int(table[0, -1])                           # rank 0's draw, on every rank
    scale = float(softmax_scale) if softmax_scale is not None else \
        ops.default_softmax_scale(q.shape[-1])
    ring = _Ring(group, world, rank, layout, q.shape[2], causal_b, p, scale,
                 int(seed) if p > 0 else 0)
    return _RingAttention.apply(q, k, v, ring)
