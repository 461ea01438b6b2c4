"""Our kernel as PyTorch SDPA's flash-attention implementation (torch >= 2.10), and as its
memory-efficient one (the calls with an ``attn_mask``).

::

    import kernels.sdpa, torch
    kernels.sdpa.register()                                            # once; activates nothing
    torch.nn.attention.activate_flash_attention_impl("triton_fused")   # opt in
    ...  # F.scaled_dot_product_attention on CUDA, flash or efficient backend -> our kernel
    torch.nn.attention.restore_flash_attention_impl()                  # back to PyTorch's own

Activation overrides the CUDA kernels of PyTorch's flash ops (as torch's own FA4 provider,
``torch.nn.attention._fa4``, does): ``aten::_scaled_dot_product_flash_attention`` and its
backward (what ``F.scaled_dot_product_attention`` calls), and ``aten::_flash_attention_forward``
/ ``_backward`` (dense (batch, seq, heads, dim) or packed with ``cum_seq_q/k``, with FA2's
``window_size_left/right``). Semantics are those of the ops being replaced:

* ``is_causal`` with q_len != k_len is aligned **bottom-right** in these ops (PyTorch's
  vendored FlashAttention-2 masks key ``j > i + k_len - q_len``; SDPA itself never sends a
  non-square causal call to flash), which is our kernel's alignment.
* ``scale``; grouped-query k/v (``enable_gqa``) natively; dropout with SDPA's RNG contract:
  the forward draws a Philox seed from PyTorch's default generator (``torch.manual_seed``
  makes runs reproducible) and returns it as ``rng_state = [seed, 0]`` (uint64); the backward
  regenerates the identical mask from it.
* ``window_size_left = L``, ``window_size_right = 0`` (or ``is_causal``) is our causal
  ``window = L + 1``.
* SDPA's memory-efficient op, ``aten::_scaled_dot_product_efficient_attention`` and its
  backward, is overridden too: SDPA sends it the calls flash does not take, among them every
  call with an ``attn_mask`` (which SDPA hands over as an additive bias, a bool mask turned
  into 0 / -inf) and fp32 inputs. The bias is read through its strides (SDPA's broadcast view
  costs no copy) and is differentiable: its gradient has the broadcast shape (B, H, L, S)
  and the bias's dtype, as PyTorch's kernel returns it (summed by autograd afterwards; an
  fp32 buffer of that shape while computed). ``is_causal`` with q_len != k_len is
  top-left aligned in this op (query i sees keys j <= i), run as a bool mask. A bias gets
  tile bounds from its entries above -inf (``attention``'s, from 512 x 512 pairs per head on:
  a causal or padding mask turned into a bias skips the tiles it hides; found on the device,
  the bias is not read on the host); a row whose keys are all -inf
  gives zeros where PyTorch gives NaN. The logsumexp is (B, H, L rounded up to 32), as
  PyTorch's; the output is laid out (B, L, H, D) in memory, as the op's meta function says (a
  copy when q is laid out (B, H, L, D)). ``aten::_efficient_attention_forward`` (the
  xFormers-style op with its own mask types) keeps PyTorch's kernel.

Anything else raises ``RuntimeError`` naming what is unsupported (once the CUDA kernel is
overridden there is no public way back to PyTorch's for one call): ``return_debug_mask``,
ALiBi slopes, ``seqused_k``, paged KV (``block_table``), ``num_splits > 1``, windows that look
ahead (``window_size_right > 0``) or bidirectional local windows. Rows that see no key return
zeros with lse ``-inf`` (FlashAttention-2 reports ``+inf`` there; the lse only feeds our own
backward).
"""
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from . import ops

NAME = "triton_fused"
MIN_TORCH = (2, 10)
# The ops we override, if this torch has them (their schemas grow between versions; extra
# keyword arguments are accepted and checked below).
_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward")


def _torch_version():
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def register(name: str = NAME) -> None:
    """Register our implementation with ``torch.nn.attention.register_flash_attention_impl``
    under ``name``; the user activates it with ``activate_flash_attention_impl(name)``.
    Raises RuntimeError on a torch without the registry (before 2.10)."""
    try:
        from torch.nn.attention import register_flash_attention_impl
    except ImportError:
        raise RuntimeError(
            f"kernels.sdpa.register() needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} "
            f"(torch.nn.attention.register_flash_attention_impl); this is torch "
            f"{torch.__version__}. Call kernels.attention directly instead.") from None
    register_flash_attention_impl(name, register_fn=_install)


@dataclass
class _Handle:
    """What the registry keeps while we are active; ``remove`` restores PyTorch's kernels."""
    library: Optional[torch.library.Library]

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _install() -> _Handle:
    lib = torch.library.Library("aten", "IMPL", "CUDA")
    impls = {"_scaled_dot_product_flash_attention": sdpa_flash_forward,
             "_scaled_dot_product_flash_attention_backward": sdpa_flash_backward,
             "_flash_attention_forward": flash_forward,
             "_flash_attention_backward": flash_backward,
             "_scaled_dot_product_efficient_attention": sdpa_efficient_forward,
             "_scaled_dot_product_efficient_attention_backward": sdpa_efficient_backward}
    for op in _OPS:
        if hasattr(torch.ops.aten, op):
            lib.impl(op, impls[op], "CUDA")
    return _Handle(lib)


def overridden_ops():
    """The aten ops that have a CUDA kernel now (ours while active, on a CUDA build also
    PyTorch's own otherwise)."""
    return [op for op in _OPS if hasattr(torch.ops.aten, op) and
            torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CUDA")]


# --------------------------------------------------------------------------------------------
# Argument translation
# --------------------------------------------------------------------------------------------
def _unsupported_arg(what):
    """The RuntimeError for a flash-op argument (or combination) our kernel does not honour."""
    return RuntimeError(f"kernels.sdpa ({NAME} flash attention): {what} is not supported")


def _check_extras(return_debug_mask=False, alibi_slopes=None, seqused_k=None,
                  block_table=None, num_splits=None, **unknown):
    if return_debug_mask:
        raise _unsupported_arg("return_debug_mask=True")
    for name, value in (("alibi_slopes", alibi_slopes), ("seqused_k", seqused_k),
                        ("block_table (paged KV)", block_table)):
        if value is not None:
            raise _unsupported_arg(name)
    if num_splits is not None and num_splits > 1:
        raise _unsupported_arg(f"num_splits={num_splits}")
    extra = {k: v for k, v in unknown.items() if v is not None}
    if extra:
        raise _unsupported_arg(f"argument(s) {sorted(extra)}")


def _causal_window(is_causal, window_size_left, window_size_right):
    """FA2's (is_causal, window_size_left, window_size_right) -> our (causal, window)."""
    left = -1 if window_size_left is None else int(window_size_left)
    right = -1 if window_size_right is None else int(window_size_right)
    if is_causal:
        right = 0
    if right == 0:
        return True, (left + 1 if left >= 0 else None)
    if right < 0 and left < 0:
        return False, None
    raise _unsupported_arg(f"window_size_left={left}, window_size_right={right} (only causal "
                           f"windows: window_size_right=0)")


def _new_seed(dropout_p, device):
    """SDPA's RNG contract: a fresh Philox seed from PyTorch's generator of ``device``, drawn
    there (a 0-d int64 tensor: no copy, no sync; a CUDA graph draws anew on each replay)."""
    if dropout_p == 0.0:
        return 0
    return torch.randint(0, ops.SEED_LIMIT - 1, (), dtype=torch.int64, device=device)


def _rng_tensors(seed, device):
    """(rng_state (2,) uint64 = [seed, offset 0], unused () uint64), as the flash ops return;
    built on the device from the seed tensor (no host round trip)."""
    rng_state = torch.zeros(2, dtype=torch.int64, device=device)
    if isinstance(seed, torch.Tensor):
        rng_state[0] = seed
    return rng_state.view(torch.uint64), torch.zeros((), dtype=torch.uint64, device=device)


def _seed_of(rng_state):
    """The seed in an rng_state, as a 0-d int64 tensor on its device (never read here)."""
    if rng_state is None or not rng_state.numel():
        return 0
    return rng_state.reshape(-1)[:1].view(torch.int64).reshape(())


def _bshd(*tensors):
    return tuple(None if t is None else t.transpose(1, 2) for t in tensors)


# --------------------------------------------------------------------------------------------
# The implementations (each takes the aten op's arguments)
# --------------------------------------------------------------------------------------------
def sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False,
                       return_debug_mask=False, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention``: q (B, H, L, D), k/v (B, H_kv, S, D).
    Returns (out, logsumexp (B, H, L) fp32, None, None, L, S, rng_state, unused, debug mask)."""
    _check_extras(return_debug_mask=return_debug_mask)
    seed = _new_seed(dropout_p, query.device)
    out, lse = ops.forward_with_lse(query, key, value, causal=bool(is_causal),
                                    dropout_p=float(dropout_p), softmax_scale=scale, seed=seed)
    rng_state, unused = _rng_tensors(seed, query.device)
    return (out, lse, None, None, query.shape[2], key.shape[2], rng_state, unused,
            torch.empty(0, dtype=query.dtype, device=query.device))


def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                        max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                        scale=None):
    """``aten::_scaled_dot_product_flash_attention_backward``: (dq, dk, dv) in (B, H, seq, D)."""
    return ops.backward(grad_out, query, key, value, out, logsumexp, causal=bool(is_causal),
                        dropout_p=float(dropout_p), softmax_scale=scale,
                        seed=_seed_of(philox_seed))


def flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                  return_debug_mask, *, scale=None, window_size_left=None,
                  window_size_right=None, **extra):
    """``aten::_flash_attention_forward``: dense q (B, L, H, D), k/v (B, S, H_kv, D), or packed
    (total, H, D) with int32 ``cum_seq_q/k``. Returns (out, logsumexp, rng_state, unused,
    debug mask); logsumexp (B, H, L) or (H, total_q)."""
    _check_extras(return_debug_mask=return_debug_mask, **extra)
    causal, window = _causal_window(is_causal, window_size_left, window_size_right)
    seed = _new_seed(dropout_p, query.device)
    packed = cum_seq_q is not None
    if (cum_seq_k is not None) != packed:
        raise _unsupported_arg("cum_seq_q without cum_seq_k (or the reverse)")
    q, k, v = (query, key, value) if packed else _bshd(query, key, value)
    out, lse = ops.forward_with_lse(
        q, k, v, causal=causal, dropout_p=float(dropout_p), softmax_scale=scale, seed=seed,
        window=window, cu_seqlens_q=cum_seq_q, cu_seqlens_k=cum_seq_k,
        max_seqlen_q=int(max_q) if packed else None, max_seqlen_k=int(max_k) if packed else None)
    rng_state, unused = _rng_tensors(seed, query.device)
    return (out if packed else out.transpose(1, 2), lse, rng_state, unused,
            torch.empty(0, dtype=query.dtype, device=query.device))


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                   max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                   window_size_left=None, window_size_right=None):
    """``aten::_flash_attention_backward``: (dq, dk, dv) in the inputs' layout."""
    causal, window = _causal_window(is_causal, window_size_left, window_size_right)
    packed = cum_seq_q is not None and cum_seq_q.numel() > 0
    if packed:
        tensors = (grad_out, query, key, value, out)
    else:
        tensors = _bshd(grad_out, query, key, value, out)
        cum_seq_q = cum_seq_k = None
    grads = ops.backward(*tensors, logsumexp, causal=causal, dropout_p=float(dropout_p),
                         softmax_scale=scale, seed=_seed_of(rng_state), window=window,
                         cu_seqlens_q=cum_seq_q, cu_seqlens_k=cum_seq_k,
                         max_seqlen_q=int(max_q) if packed else None,
                         max_seqlen_k=int(max_k) if packed else None)
    return grads if packed else _bshd(*grads)


# --------------------------------------------------------------------------------------------
# SDPA's memory-efficient op: calls with an attn_mask (and fp32, and SDPA's non-square causal)
# --------------------------------------------------------------------------------------------
# The efficient op's logsumexp is (B, H, L rounded up to this), as its CUDA kernel and meta
# function allocate it (a compiled graph checks the size).
_EFFICIENT_LSE_ALIGN = 32
# Its bias gradient's last dim is padded to this in memory (the meta function's strides).
_BIAS_GRAD_ALIGN = 16


@functools.lru_cache(maxsize=16)
def _top_left_causal(q_len, k_len, device):
    """SDPA's ``is_causal`` when q_len != k_len: query i sees keys j <= i (top-left aligned;
    our kernel's causal is bottom-right), as a bool mask. Cached: one tensor per shape, so its
    tile bounds are computed once (``TensorMask.of``)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()


def _efficient_mask(query, key, attn_bias, is_causal):
    """The efficient op's (attn_bias, is_causal) as our (causal, attn_mask). ``is_causal`` is
    top-left aligned there: the same as ours when q_len == k_len, else a tril mask (not with
    an attn_bias as well: SDPA never sends both)."""
    q_len, k_len = query.shape[2], key.shape[2]
    if not is_causal or q_len == k_len:
        return bool(is_causal), attn_bias
    if attn_bias is not None:
        raise _unsupported_arg(f"is_causal=True with q_len {q_len} != k_len {k_len} (top-left "
                               f"aligned) together with an attn_bias")
    return False, _top_left_causal(q_len, k_len, query.device)


def _bhsd_of_bshd(out):
    """``out`` (B, H, L, D) with the memory layout of a (B, L, H, D) tensor, as the efficient
    op's meta function allocates it (a compiled graph asserts the strides); a copy only where
    it is not already so (q laid out (B, H, L, D))."""
    t = out.transpose(1, 2)
    return out if t.is_contiguous() else t.contiguous().transpose(1, 2)


def sdpa_efficient_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                           is_causal=False, *, scale=None):
    """``aten::_scaled_dot_product_efficient_attention``: q (B, H, L, D), k/v (B, H_kv, S, D),
    ``attn_bias`` None or broadcastable to (B, H, L, S): float added to the scaled scores (SDPA
    converts a bool attn_mask to 0 / -inf before this op), or bool. Returns (out, logsumexp
    (B, H, L rounded up to 32) fp32 or (B, H, 0) without ``compute_log_sumexp``, philox seed,
    philox offset), the seed a 0-d int64 drawn as ``_new_seed`` does, the offset 0."""
    causal, mask = _efficient_mask(query, key, attn_bias, is_causal)
    seed = _new_seed(dropout_p, query.device)
    out, lse = ops.forward_with_lse(query, key, value, causal=causal,
                                    dropout_p=float(dropout_p), softmax_scale=scale, seed=seed,
                                    attn_mask=mask)
    b, h, q_len = lse.shape
    if not compute_log_sumexp:
        lse = lse.new_empty((b, h, 0))
    elif q_len % _EFFICIENT_LSE_ALIGN:
        lse = torch.nn.functional.pad(lse, (0, -q_len % _EFFICIENT_LSE_ALIGN))
    seed_t = seed if isinstance(seed, torch.Tensor) else torch.zeros((), dtype=torch.int64)
    return _bhsd_of_bshd(out), lse, seed_t, torch.zeros((), dtype=torch.int64)


def sdpa_efficient_backward(grad_out, query, key, value, attn_bias, out, logsumexp,
                            philox_seed, philox_offset, dropout_p, grad_input_mask,
                            is_causal=False, *, scale=None):
    """``aten::_scaled_dot_product_efficient_attention_backward``: (dq, dk, dv, d_attn_bias),
    each laid out as the op's meta function allocates it (dq, dk, dv as (B, seq, H, D) in
    memory; d_attn_bias attn_bias's shape and dtype, last dim padded to 16 in memory, each
    element its own gradient: SDPA's broadcast view sums it afterwards), d_attn_bias None
    unless ``grad_input_mask[3]`` asks for it."""
    causal, mask = _efficient_mask(query, key, attn_bias, is_causal)
    bias_grad = (bool(grad_input_mask[3]) and isinstance(attn_bias, torch.Tensor)
                 and attn_bias.is_floating_point())
    grads = ops.backward(grad_out, query, key, value, out,
                         logsumexp[..., :query.shape[2]], causal=causal,
                         dropout_p=float(dropout_p), softmax_scale=scale,
                         seed=_seed_of(philox_seed), attn_mask=mask, attn_mask_grad=bias_grad)
    dq, dk, dv = (_bhsd_of_bshd(g) for g in grads[:3])
    if not bias_grad:
        return dq, dk, dv, None
    k_len = attn_bias.shape[-1]
    d_bias = attn_bias.new_empty((*attn_bias.shape[:-1], -(-k_len // _BIAS_GRAD_ALIGN)
                                  * _BIAS_GRAD_ALIGN))[..., :k_len]
    return dq, dk, dv, d_bias.copy_(grads[3])
