"""Public functional API: validation → custom ops (+ autograd) → host launchers.

Layers, each with one job:

* ``attention`` / ``attention_varlen`` (public): check arguments and say what was expected
  when they are wrong, resolve defaults (scale, seed), then call the custom op.
* ``fused_attention::fwd`` / ``fused_attention::bwd``: PyTorch custom ops with fake (meta)
  implementations and a registered autograd formula, so ``torch.compile(fullgraph=True)`` sees
  one opaque node instead of breaking the graph at a Triton launch.
* ``attention_forward`` / ``attention_backward`` (kernels/core/forward.py,
  kernels/core/backward.py): the Triton launchers, given one ``AttentionCall``
  (kernels/core/call.py) that describes the call. On CPU tensors they run in Triton's
  interpreter when TRITON_INTERPRET=1; otherwise CPU tensors take a PyTorch fallback
  (kernels/core/fallback.py) with the same semantics and dropout mask.
"""
import contextlib
import dataclasses
import os
import sys
import warnings
from typing import Optional

import torch

from .core import fallback
from .core.call import AttentionCall, default_softmax_scale, lse_shape, new_like, new_out
from .core.common import check_interpreter_setting, interpreter_active
from .core.configs import unsupported_gpu_reason
from .core.backward import BackwardPlan, attention_backward
from .core.forward import ForwardPlan, attention_forward
from .core.kvcache import KVCachePlan, kvcache_forward
from .core.mods import (NO_MODS, CallMods, MaskMod, ScoreMod, aux_grad_buffers, aux_grad_mask,
                        lookup, sinks_grad)
from .validation import (SEED_LIMIT, check_cu_seqlens, check_drop_layout, check_kvcache,
                         check_cache_lengths, check_mods, check_num_splits, check_seed,
                         validate_attention)

# The seed of every call without dropout: one shared CPU tensor (the ops never write it). Under
# torch.compile it enters the graph as an input, so Inductor emits no CPU C++ kernel to build it.
with torch.inference_mode(False):  # a normal tensor even if first imported in inference mode
    _NO_SEED = torch.zeros((), dtype=torch.int64, device="cpu")


# --------------------------------------------------------------------------------------------
# Implementations behind the custom ops
# --------------------------------------------------------------------------------------------
_warned_fallback = False
_warned_gpu = False
# Frames of these files are ours or PyTorch's (custom-op dispatch, nn.Module calls, compiled
# graphs): a warning skips them to land on the caller's own line.
_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
             os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, "<eval_with_key")


def _caller_stacklevel():
    """``stacklevel`` for a ``warnings.warn`` in the function calling this one: the first frame
    outside this package and torch (the user's line, however deep the dispatch)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def _use_fallback(t):
    """CPU tensors without Triton's interpreter, and CUDA tensors on GPUs the Triton kernels do
    not serve (before sm_80: ``configs.unsupported_gpu_reason``), take the PyTorch fallback
    (warned once, at the caller's line: this runs inside the custom op, a dozen frames below
    it)."""
    global _warned_fallback, _warned_gpu
    device = t.device
    if device.type == "cuda":
        reason = unsupported_gpu_reason(device)   # from configs' per-device cache
        if reason is not None and not _warned_gpu:
            warnings.warn(f"kernels.attention: {reason}; CUDA tensors on this GPU run a PyTorch "
                          f"path with the same semantics (dropout mask included) in O(seq) "
                          f"memory, at PyTorch's speed", RuntimeWarning,
                          stacklevel=_caller_stacklevel())
            _warned_gpu = True
        return reason is not None
    if device.type == "cpu":
        check_interpreter_setting()
    if device.type == "cpu" and not interpreter_active():
        if not _warned_fallback:
            warnings.warn("kernels.attention: CPU tensors run a PyTorch fallback with the same "
                          "semantics; the fused Triton kernel needs CUDA (or TRITON_INTERPRET=1 "
                          "to run it in Triton's interpreter)", RuntimeWarning,
                          stacklevel=_caller_stacklevel())
            _warned_fallback = True
        return True
    return False


def _unit_last(t):
    """Kernels need a unit stride in the last dim; any other layout is read in place.
    (``.contiguous()`` is a no-op, keeping that stride, on an empty tensor or a size-1 last
    dim: PyTorch calls those contiguous whatever their strides.)"""
    if t.stride(-1) == 1:
        return t
    if t.numel() == 0:
        return t.new_empty(t.shape)
    if t.shape[-1] == 1:  # one element per row: its stride is never used, restride the view
        return t.as_strided(t.shape, (*t.stride()[:-1], 1), t.storage_offset())
    return t.contiguous()


def _op_mods(softcap, alibi_slopes, sinks, score_mod, mask_mod, mod_aux):
    """The ``CallMods`` of the custom ops' flat arguments (softcap 0 = none, mods by name)."""
    return CallMods(softcap=softcap if softcap > 0 else None, alibi_slopes=alibi_slopes,
                    score_mod=lookup(score_mod, ScoreMod), mask_mod=lookup(mask_mod, MaskMod),
                    sinks=sinks, aux=tuple(mod_aux or ()))


def _longest(cu, hint):
    """max_seqlen to launch with: the hint, or (-1) the longest sequence of ``cu`` (a sync)."""
    if cu is None or hint >= 0:
        return hint
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


@torch.library.custom_op("fused_attention::fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
            max_seqlen_q: int, max_seqlen_k: int, causal: bool, dropout_p: float,
            softmax_scale: float, seed: torch.Tensor, window: int, num_splits: int,
            drop_layout: Optional[list[int]], chunk_size: int, softcap: float,
            alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
            score_mod: str, mask_mod: str, mod_aux: list[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    call = AttentionCall.from_op(causal, softmax_scale, dropout_p, seed, window, drop_layout,
                                 chunk_size, _op_mods(softcap, alibi_slopes, sinks, score_mod,
                                                      mask_mod, mod_aux))
    o = new_out(q, v.shape[-1])
    if q.shape[1] == 0:  # no query heads: an empty problem, like batch = 0 (validation.py)
        return o, q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)
    if _use_fallback(q):
        return fallback.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, call, o)
    return attention_forward(_unit_last(q), _unit_last(k), _unit_last(v), call,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             max_seqlen_q=_longest(cu_seqlens_q, max_seqlen_q),
                             max_seqlen_k=_longest(cu_seqlens_k, max_seqlen_k),
                             num_splits=num_splits, out=o)


@_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p,
      softmax_scale, seed, window, num_splits, drop_layout, chunk_size, softcap, alibi_slopes,
      sinks, score_mod, mask_mod, mod_aux):
    return new_out(q, v.shape[-1]), q.new_empty(lse_shape(q, cu_seqlens_q is not None),
                                                 dtype=torch.float32)


@torch.library.custom_op("fused_attention::bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            o: torch.Tensor, lse: torch.Tensor,
            cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
            max_seqlen_q: int, max_seqlen_k: int, causal: bool, dropout_p: float,
            softmax_scale: float, seed: torch.Tensor, window: int,
            drop_layout: Optional[list[int]], chunk_size: int, softcap: float,
            alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
            score_mod: str, mask_mod: str, mod_aux: list[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = AttentionCall.from_op(causal, softmax_scale, dropout_p, seed, window, drop_layout,
                                 chunk_size, _op_mods(softcap, alibi_slopes, sinks, score_mod,
                                                      mask_mod, mod_aux))
    return _bwd_run(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, call)


def _bwd_run(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, call,
             daux=None):
    """The body of the backward ops: (dq, dk, dv), and with ``daux`` (``attention_backward``'s)
    the score mod's aux gradients added into it."""
    if q.shape[1] == 0:  # no query heads: nothing reads k or v, whose gradients are 0
        return new_like(q), new_like(k).zero_(), new_like(v).zero_()
    if _use_fallback(q):
        return fallback.backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, call,
                                 new_like(q), new_like(k), new_like(v), daux=daux)
    return attention_backward(_unit_last(do), _unit_last(q), _unit_last(k), _unit_last(v),
                              _unit_last(o), lse, call, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=_longest(cu_seqlens_q, max_seqlen_q),
                              max_seqlen_k=_longest(cu_seqlens_k, max_seqlen_k), daux=daux)


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      dropout_p, softmax_scale, seed, window, drop_layout, chunk_size, softcap, alibi_slopes,
      sinks, score_mod, mask_mod, mod_aux):
    return new_like(q), new_like(k), new_like(v)


@torch.library.custom_op("fused_attention::bwd_aux", mutates_args=())
def _bwd_aux_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                o: torch.Tensor, lse: torch.Tensor,
                cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                max_seqlen_q: int, max_seqlen_k: int, causal: bool, dropout_p: float,
                softmax_scale: float, seed: torch.Tensor, window: int,
                drop_layout: Optional[list[int]], chunk_size: int, softcap: float,
                alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                score_mod: str, mask_mod: str, mod_aux: list[torch.Tensor],
                aux_grad: list[bool]) -> list[torch.Tensor]:
    """``fused_attention::bwd`` that also returns the score mod's aux gradients:
    [dq, dk, dv, d(mod_aux[0]), ...], fp32 where ``aux_grad`` is set, empty elsewhere."""
    call = AttentionCall.from_op(causal, softmax_scale, dropout_p, seed, window, drop_layout,
                                 chunk_size, _op_mods(softcap, alibi_slopes, sinks, score_mod,
                                                      mask_mod, mod_aux))
    daux = aux_grad_buffers(call.mods.score_mod, mod_aux)
    grads = _bwd_run(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, call, daux)
    return [*grads, *(d if g else q.new_empty(0, dtype=torch.float32)
                      for d, g in zip(daux, aux_grad))]


@_bwd_aux_op.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      dropout_p, softmax_scale, seed, window, drop_layout, chunk_size, softcap, alibi_slopes,
      sinks, score_mod, mask_mod, mod_aux, aux_grad):
    return [new_like(q), new_like(k), new_like(v),
            *(torch.empty_like(t, dtype=torch.float32) if g
              else q.new_empty(0, dtype=torch.float32) for t, g in zip(mod_aux, aux_grad))]


# The forward op's inputs after ``num_splits``, passed on to the backward op by name.
_FWD_TAIL = ("drop_layout", "chunk_size", "softcap", "alibi_slopes", "sinks", "score_mod",
             "mask_mod", "mod_aux")
_SINKS_INPUT = 17  # position of ``sinks`` among the forward op's inputs


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p,
     softmax_scale, seed, window, _num_splits) = inputs[:13]
    tail = dict(zip(_FWD_TAIL, inputs[13:]))
    o, lse = output
    aux = list(tail.get("mod_aux") or ())
    ctx.save_for_backward(q, k, v, o, lse, seed, cu_seqlens_q, cu_seqlens_k,
                          tail.get("alibi_slopes"), tail.get("sinks"), *aux)
    ctx.mark_non_differentiable(lse)
    ctx.args = (max_seqlen_q, max_seqlen_k, causal, dropout_p, softmax_scale)
    ctx.window = window
    ctx.tail = {name: tail.get(name) for name in ("drop_layout", "chunk_size", "softcap",
                                                  "score_mod", "mask_mod")}
    ctx.n_inputs = len(inputs)
    # Which mod_aux entries get a gradient (checked: declared by the score mod, fp32).
    ctx.aux_grad = aux_grad_mask(lookup(tail.get("score_mod"), ScoreMod), aux)


class _NoDoubleBackward(torch.autograd.Function):
    """Passes the first-order gradients through, attached to the graph of the inputs (q, k, v),
    with a backward that raises a clear error: the attention backward is a fused kernel with no
    derivative of its own."""

    @staticmethod
    def forward(ctx, grads, *inputs):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            "double backward (a gradient of a gradient) of kernels.attention is not supported: "
            "its backward is a fused kernel with no derivative of its own. Use "
            "reference.attention (plain PyTorch) or torch.nn.functional."
            "scaled_dot_product_attention where second derivatives are needed.")


def _backward(ctx, do, dlse):
    (q, k, v, o, lse, seed, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks,
     *aux) = ctx.saved_tensors
    create_graph = torch.is_grad_enabled()
    daux = [None] * len(aux)
    with torch.no_grad():
        if any(ctx.aux_grad):
            res = _bwd_aux_op(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *ctx.args, seed,
                              ctx.window, alibi_slopes=alibi_slopes, sinks=sinks, mod_aux=aux,
                              aux_grad=list(ctx.aux_grad), **ctx.tail)
            grads = tuple(res[:3])
            daux = [d if g else None for d, g in zip(res[3:], ctx.aux_grad)]
        else:
            grads = _bwd_op(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *ctx.args, seed,
                            ctx.window, alibi_slopes=alibi_slopes, sinks=sinks, mod_aux=aux,
                            **ctx.tail)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[_SINKS_INPUT]:
            dsinks = sinks_grad(sinks, lse, do, o, packed=cu_seqlens_q is not None)
    if create_graph:  # a later grad of these gradients must fail with a clear message
        grads = _NoDoubleBackward.apply(grads, q, k, v, do)
    # One entry per input of the forward op, a list for mod_aux (its last).
    out = [*grads] + [None] * (ctx.n_inputs - 4) + [daux]
    out[_SINKS_INPUT] = dsinks
    return tuple(out)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _seed_tensor(dropout_p, seed, device):
    """The call's Philox seed, a 0-d int64 tensor on the inputs' device: drawn there from
    PyTorch's generator of that device when ``seed`` is None (no copy, no sync; inside a CUDA
    graph each replay draws anew), else the given int (one host-to-device copy)."""
    if dropout_p == 0.0:
        return _NO_SEED
    if seed is None:
        return torch.randint(0, SEED_LIMIT - 1, (), dtype=torch.int64, device=device)
    key = (int(seed), device)
    t = _SEEDS.get(key)
    if t is None:   # a given seed is copied to the device once (the kernels never write it)
        if len(_SEEDS) >= _MAX_SEEDS:
            _SEEDS.clear()
        with torch.inference_mode(False):   # usable later outside inference mode too
            t = _SEEDS[key] = torch.tensor(key[0], dtype=torch.int64, device=device)
    return t


_SEEDS = {}       # (seed, device) -> its tensor there: a fixed seed costs no copy per call
_MAX_SEEDS = 64


# --------------------------------------------------------------------------------------------
# The eager fast path of ``attention``: one launch plan per call signature
# --------------------------------------------------------------------------------------------
_PACKED_LAYOUT = "(total_rows, heads, head_dim) (packed sequences)"
# Launch plans of ``attention`` calls, by signature (``_signature``): the first
# call of a signature validates and builds its plan; later ones skip the validation (every
# checked property is in the key), the custom-op dispatch and the launchers' Python.
_PLANS = {}
_MAX_PLANS = 512   # signatures kept; a program cycling through more rebuilds them


def _signature(t):
    """What a plan fixes about an input tensor: class, shape, strides, dtype, device and
    whether its data pointer is 16-byte aligned (Triton specialises pointers on it)."""
    return (t.__class__, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _remember(key, plan):
    """Keep ``plan`` for its signature (all of them dropped past _MAX_PLANS); returns it."""
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _with_mod_tensors(call, sinks, alibi_slopes, mod_aux):
    """``call`` (a plan's, its mods without tensors) with this call's sinks (fp32), ALiBi
    slopes and aux tensors, converted as ``check_mods`` converts them (no-ops on fp32)."""
    return dataclasses.replace(call, mods=dataclasses.replace(
        call.mods, sinks=sinks, aux=tuple(mod_aux),
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.float().contiguous()))


class _Plan:
    """How ``attention(q, k, v, ...)`` (or, with ``packed`` = (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k) checked by ``check_cu_seqlens``, ``attention_varlen``) runs
    for one validated signature: its ``AttentionCall`` (the mods' tensors come per call) and,
    once launched, its forward plan and a backward plan per gradient layout
    (kernels/core/forward.py ``ForwardPlan``, backward.py ``BackwardPlan``). On every call the
    route is decided anew (``_use_fallback``: CPU tensors run the interpreter or the PyTorch
    fallback as TRITON_INTERPRET says at that moment)."""

    def __init__(self, q, k, v, options, sinks, alibi_slopes, mod_aux, packed=None):
        (causal, dropout_p, softmax_scale, window, num_splits, softcap, chunk_size, score_mod,
         mask_mod, drop_layout) = options
        if packed is None:
            causal = validate_attention(q, k, v, causal, dropout_p, softmax_scale, None, window)
            batch = q.shape[0]
        else:
            causal = validate_attention(q, k, v, causal, dropout_p, softmax_scale, None, window,
                                        dims=3, layout=_PACKED_LAYOUT)
            batch = packed[0].numel() - 1
        mods, chunk_size = check_mods(q, causal, window, softcap, sinks, chunk_size,
                                      alibi_slopes, score_mod, mask_mod, mod_aux, batch=batch)
        check_num_splits(num_splits)
        drop_layout = check_drop_layout(drop_layout, q, k, packed is not None)
        self.max_seqlens = (None, None) if packed is None else packed[2:]
        if softmax_scale is None:
            softmax_scale = default_softmax_scale(q.shape[-1])
        # What stays: the mods without their tensors (a call's own are put in per call).
        self.mod_tensors = mods.has_tensors
        self.mods = dataclasses.replace(mods, alibi_slopes=None, sinks=None, aux=())
        self.call = AttentionCall(causal, float(softmax_scale), float(dropout_p), 0,
                                  int(window) if window is not None else None, drop_layout,
                                  chunk_size, self.mods)
        self.dropout_p, self.num_splits = float(dropout_p), int(num_splits)
        self.copy_last = q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
        self.fwd = None
        self.bwd = {}

    def __call__(self, q, k, v, seed, return_lse, sinks, alibi_slopes, mod_aux, cu=(None, None)):
        if seed is not None:
            check_seed(seed)
        if self.copy_last:   # the kernels need a unit-stride last dim (a differentiable copy)
            q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        seed_t = _seed_tensor(self.dropout_p, seed, q.device)
        call = self.call
        if self.mod_tensors:
            sinks = None if sinks is None else sinks.float()
            call = _with_mod_tensors(call, sinks, alibi_slopes, mod_aux)
        grad = torch.is_grad_enabled()
        aux_grad = (grad and mod_aux and any(t.requires_grad for t in mod_aux)
                    and any(aux_grad_mask(self.mods.score_mod, mod_aux)))
        if grad and (q.requires_grad or k.requires_grad or v.requires_grad
                     or sinks is not None and sinks.requires_grad or aux_grad):
            route = _use_fallback(q)
            recorded = None
            if route and cu[0] is None:   # the fallback's few-aten-op routes: autograd's own
                recorded = fallback.forward_recorded(
                    q, k, v, dataclasses.replace(call, seed=seed_t), need_lse=return_lse)
            if recorded is not None:
                out, lse = recorded
            else:
                out, lse = _PlannedAttention.apply(q, k, v, sinks, seed_t, self, call, route,
                                                   *cu, *mod_aux)
        else:
            out, lse = self.forward(q, k, v, seed_t, call, *cu)
        return (out, lse) if return_lse else out

    def forward(self, q, k, v, seed_t, call, cu_q=None, cu_k=None, route=None):
        """(out, lse); ``route``: the ``_use_fallback`` decision when the caller made it."""
        if _use_fallback(q) if route is None else route:
            # o None: the fallback's own buffer when its layout is new_out's (no copy)
            return fallback.forward(q, k, v, cu_q, cu_k, dataclasses.replace(call, seed=seed_t),
                                    None)
        plan = self.fwd
        if plan is None:
            max_q, max_k = self.max_seqlens
            plan = self.fwd = ForwardPlan(q, k, v, call, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                          max_seqlen_q=max_q, max_seqlen_k=max_k,
                                          num_splits=self.num_splits)
        return plan(q, k, v, call, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seed=seed_t)

    def backward(self, do, q, k, v, o, lse, seed_t, call, cu_q=None, cu_k=None, daux=None,
                 own_output=False, route=None):
        """(dq, dk, dv); ``daux``: d(mod_aux) buffers added into (``attention_backward``);
        ``own_output``: o is this plan's forward's output (its layout is the plan's);
        ``route``: the forward's ``_use_fallback``."""
        do = _unit_last(do)
        if _use_fallback(q) if route is None else route:
            # dq, dk, dv None: gradients in the fallback's own buffers (only autograd or the
            # integration reads them: any layout)
            return fallback.backward(do, q, k, v, o, lse, cu_q, cu_k,
                                     dataclasses.replace(call, seed=seed_t), None, None, None,
                                     daux=daux)
        if own_output:   # the forward's own output: one layout for the signature
            key = (do.stride(), do.data_ptr() % 16 == 0, daux is not None)
        else:            # an integration's (out, lse) may come from elsewhere
            o = _unit_last(o)
            key = (do.stride(), do.data_ptr() % 16 == 0, o.stride(), o.data_ptr() % 16 == 0,
                   daux is not None)
        plan = self.bwd.get(key)
        if plan is None:
            max_q, max_k = self.max_seqlens
            plan = self.bwd[key] = BackwardPlan(do, q, k, v, o, lse, call, cu_seqlens_q=cu_q,
                                                cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                                max_seqlen_k=max_k, aux_grad=daux is not None)
        return plan(do, q, k, v, o, lse, call, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    seed=seed_t, daux=daux)


class _PlannedAttention(torch.autograd.Function):
    """Autograd of the eager fast path: ``_Plan.forward`` / ``backward`` with no
    custom-op dispatch in between (the compiled path keeps the custom ops)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, seed_t, plan, call, route, cu_q=None, cu_k=None, *aux):
        # aux: the call's mod_aux (inputs here so that their gradients have a place).
        # route: ``_use_fallback(q)``; the backward follows the forward's.
        ctx.route = route
        out, lse = plan.forward(q, k, v, seed_t, call, cu_q, cu_k, route=route)
        ctx.save_for_backward(q, k, v, out, lse, seed_t, sinks, cu_q, cu_k, *aux)
        ctx.plan, ctx.call = plan, call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, out, lse, seed_t, sinks, cu_q, cu_k, *aux = ctx.saved_tensors
        wanted = ctx.needs_input_grad[10:]   # aux_grad_mask checked them in _Plan.__call__
        daux = aux_grad_buffers(ctx.call.mods.score_mod, aux) if any(wanted) else None
        # Grad mode is on here only for create_graph=True (a graph of the gradients).
        create_graph = torch.is_grad_enabled()
        with torch.no_grad() if create_graph else contextlib.nullcontext():
            grads = ctx.plan.backward(do, q, k, v, out, lse, seed_t, ctx.call, cu_q, cu_k,
                                      daux=daux, own_output=True,
                                      route=ctx.route)
            dsinks = None
            if sinks is not None and ctx.needs_input_grad[3]:
                dsinks = sinks_grad(sinks, lse, do, out, packed=cu_q is not None)
        if create_graph:  # a later grad of these gradients must fail with a clear message
            grads = _NoDoubleBackward.apply(grads, q, k, v, do)
        return (*grads, dsinks, None, None, None, None, None, None,
                *(d if w else None for d, w in zip(daux or [None] * len(aux), wanted)))


def _options_key(options, sinks, alibi_slopes, mod_aux):
    """The part of a plan's key after its q, k, v (or cache) tensors: the options with their
    types (1 == True, but causal=1 is an error, causal=True is not) and the mods' tensors'
    signatures."""
    return (options, tuple(x.__class__ for x in options),
            None if sinks is None else _signature(sinks),
            # (ALiBi slopes requiring grad are an error: checked when the plan is built)
            None if alibi_slopes is None else (*_signature(alibi_slopes),
                                               alibi_slopes.requires_grad),
            tuple(_signature(t) for t in mod_aux))


def _fast_plan(q, k, v, options, sinks, alibi_slopes, mod_aux, packed=None):
    """The ``_Plan`` of this ``attention`` call, or None when the call takes the general
    path: inside torch.compile (the custom ops), tensor subclasses, devices other than CPU and
    CUDA, empty problems.
    ``options``: the call's non-tensor arguments, in ``_Plan``'s order (drop_layout last)."""
    if (q.__class__ is not torch.Tensor or k.__class__ is not torch.Tensor
            or v.__class__ is not torch.Tensor or torch.compiler.is_compiling()):
        return None
    try:
        key = (_signature(q), _signature(k), _signature(v),
               *_options_key(options, sinks, alibi_slopes, mod_aux),
               None if packed is None else (_signature(packed[0]), _signature(packed[1]),
                                            *packed[2:]))
        plan = _PLANS.get(key)
    except (TypeError, AttributeError):   # not hashable, not tensors: the general path
        return None                       # says what is wrong with them
    if plan is not None:
        return plan
    if (q.device.type not in ("cpu", "cuda") or q.numel() == 0 or k.numel() == 0
            or v.numel() == 0 or q.dim() != (4 if packed is None else 3)):
        return None
    return _remember(key, _Plan(q, k, v, options, sinks, alibi_slopes, mod_aux, packed))


def _mod_op_args(mods, chunk_size):
    """The custom ops' keyword arguments of a call's ``CallMods`` and chunk size."""
    return dict(chunk_size=int(chunk_size or 0), softcap=float(mods.softcap or 0.0),
                alibi_slopes=mods.alibi_slopes, sinks=mods.sinks,
                score_mod=mods.score_mod.name if mods.score_mod is not None else "",
                mask_mod=mods.mask_mod.name if mods.mask_mod is not None else "",
                mod_aux=list(mods.aux))


def attention(q, k, v, *, causal=True, dropout_p=0.0, softmax_scale=None, seed=None,
              window=None, num_splits=0, return_lse=False, softcap=None, sinks=None,
              chunk_size=None, alibi_slopes=None, score_mod=None, mask_mod=None, mod_aux=()):
    """Fused scaled-dot-product attention: softmax(mask(q kᵀ · scale)) → dropout → @ v.

    Never materialises the (q_len × k_len) matrix; differentiable (FlashAttention-2-style
    backward that recomputes the weights); usable inside ``torch.compile(fullgraph=True)``.

    Args:
        q: (batch, heads_q, q_len, head_dim) float16 / bfloat16 / float32.
        k: (batch, heads_kv, k_len, head_dim), v: (batch, heads_kv, k_len, head_dim_v), q's
            dtype and device; v may have its own head dim (DeepSeek's MLA: 192 / 128), the
            output has it and the default scale stays 1 / sqrt(head_dim). heads_q must be a
            multiple of heads_kv: query head h reads kv head h // (heads_q // heads_kv)
            (grouped-query attention; heads_kv = 1 is multi-query), the rule of
            ``repeat_interleave`` and of SDPA's ``enable_gqa=True``. k and v are never copied
            or expanded. Any strides: views such as ``x.view(b, s, h, d).transpose(1, 2)`` are
            read in place (a copy is made only when the last dim is not unit-stride, on every
            path, the CPU fallback included). 1 <= head_dim, head_dim_v <= 512. heads_q = 0 is
            an empty
            problem (empty out and lse, zero gradients for k and v), like batch = 0;
            heads_kv = 0 with heads_q >= 1 is a ValueError.
        causal: mask keys in the future, aligned bottom-right when q_len != k_len::

                q_len=2, k_len=5 (KV-cache decoding)     q_len=5, k_len=2
                      k0 k1 k2 k3 k4                           k0 k1
                  q0   1  1  1  1  0                       q0   0  0   <- sees no key: zeros
                  q1   1  1  1  1  1                       q1   0  0
                                                           q2   0  0
                query i sees key j iff                     q3   1  0
                j <= i + (k_len - q_len)                   q4   1  1

        dropout_p: probability of zeroing each attention weight (after softmax); kept weights
            are scaled by 1 / (1 - dropout_p). 0 <= dropout_p < 1.
        softmax_scale: multiplies q kᵀ before the softmax; default 1 / sqrt(head_dim).
        seed: int in [0, 2**63) for the in-kernel Philox dropout mask; None draws one from
            PyTorch's default generator (so ``torch.manual_seed`` makes runs reproducible). The
            same (seed, shapes) give the same mask on every device; ``reference.dropout_keep_mask``
            recomputes it (query head h of batch b is row block b * heads_q + h).
        window: None, or a sliding window (requires causal): query i sees only the ``window``
            most recent keys, itself included, ``i + d - window < j <= i + d`` with
            d = k_len - q_len (Hugging Face's ``sliding_window``)::

                q_len = k_len = 5, window = 3
                      k0 k1 k2 k3 k4
                  q0   1  0  0  0  0
                  q1   1  1  0  0  0
                  q2   1  1  1  0  0
                  q3   0  1  1  1  0
                  q4   0  0  1  1  1

            ``window >= k_len`` is plain causal attention. Work is O(q_len · window): key tiles
            outside the band are never visited.
        num_splits: split-KV for launches too small to fill the GPU (decoding: few query rows,
            many keys): each query block's keys are shared among ``num_splits`` programs whose
            partial results are merged by their log-sum-exp (kernels/core/splitkv.py). 0 (default)
            lets ``kernels.core.configs.num_splits_heuristic`` choose from the shapes and the
            device's SM count (1 on CPU); 1 never splits; a larger value forces that many
            (splits left without keys cost an empty program). Forward only; results stay
            within the parity rule and deterministic.
        return_lse: also return the row log-sum-exp of the scaled scores.
        softcap: None, or > 0: Gemma 2's logit soft-capping of the scaled scores,
            ``s = softcap * tanh(s / softcap)``, before masking.
        sinks: None, or a float tensor (heads_q,) (float32; q's dtype accepted): gpt-oss's
            per-head sink logit, one more term of every row's softmax denominator with no
            value: ``w_ij = exp(s_ij) / (exp(sinks[h]) + sum_j exp(s_ij))``. Differentiable
            (``sinks.grad``). Dropout drops key weights only (the same mask as without sinks);
            lse includes the sink; a row that sees no key gives 0 (and lse = sinks[h]).
        chunk_size: None, or chunked attention (Llama 4; requires causal, not with window):
            query i at position P = i + k_len - q_len sees key j iff j <= P and
            j // chunk_size == P // chunk_size::

                q_len = k_len = 6, chunk_size = 3
                      k0 k1 k2 k3 k4 k5
                  q0   1  0  0  0  0  0
                  q1   1  1  0  0  0  0
                  q2   1  1  1  0  0  0
                  q3   0  0  0  1  0  0
                  q4   0  0  0  1  1  0
                  q5   0  0  0  1  1  1

            Key tiles outside a query block's chunk are never visited: O(q_len * chunk_size).
        alibi_slopes: None, or float32 (heads_q,) or (batch, heads_q): ALiBi (FlashAttention's
            convention), the bias ``-slope * |i + k_len - q_len - j|`` added to the (soft-capped)
            score before masking. Not differentiable.
        score_mod, mask_mod, mod_aux: a user's ``kernels.ScoreMod`` / ``kernels.MaskMod``
            (@triton.jit functions with PyTorch twins; contract in kernels/core/mods.py) and
            the tuple of tensors they read. The score mod applies after softcap and ALiBi, the
            mask mod on top of causal / window / chunk.

    Returns:
        out: (batch, heads_q, q_len, head_dim_v) in q's dtype. It has q's memory layout when q
            is dense (and head_dim_v == head_dim), so a head split by ``view().transpose(1, 2)``
            merges back with a free
            ``out.transpose(1, 2).reshape(batch, q_len, heads * head_dim)``.
        lse (only with ``return_lse``): float32 (batch, heads_q, q_len), natural log, -inf for a
            row that sees no key. Not differentiable.
        A NaN in a query row that sees a key gives NaN in that row of out and lse on every
        path, as in ``reference.attention`` (tests/core/test_layouts_property.py).
    """
    plan = _fast_plan(q, k, v, (causal, dropout_p, softmax_scale, window, num_splits, softcap,
                                chunk_size, score_mod, mask_mod, None), sinks, alibi_slopes,
                      mod_aux)
    if plan is not None:
        return plan(q, k, v, seed, return_lse, sinks, alibi_slopes, mod_aux)
    causal = validate_attention(q, k, v, causal, dropout_p, softmax_scale, seed, window)
    mods, chunk_size = check_mods(q, causal, window, softcap, sinks, chunk_size, alibi_slopes,
                                  score_mod, mask_mod, mod_aux, batch=q.shape[0])
    check_num_splits(num_splits)
    dropout_p = float(dropout_p)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    out, lse = _fwd_op(q, k, v, None, None, -1, -1, causal, dropout_p, float(softmax_scale),
                       _seed_tensor(dropout_p, seed, q.device), int(window or 0), int(num_splits),
                       None, **_mod_op_args(mods, chunk_size))
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     *, causal=True, dropout_p=0.0, softmax_scale=None, seed=None, window=None,
                     return_lse=False, softcap=None, sinks=None, chunk_size=None,
                     alibi_slopes=None, score_mod=None, mask_mod=None, mod_aux=()):
    """Attention over packed sequences of different lengths (FlashAttention's varlen layout).

    Sequence s is rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of q and
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` of k and v; it attends only within itself, with the
    causal mask aligned bottom-right per sequence and everything else as in ``attention``::

            cu_seqlens_q = cu_seqlens_k = [0, 2, 5]       (x = visible, causal)
                   k0 k1 | k2 k3 k4
              q0    x  . |  .  .  .      sequence 0: rows 0-1
              q1    x  x |  .  .  .
              -----------+---------
              q2    .  . |  x  .  .      sequence 1: rows 2-4
              q3    .  . |  x  x  .
              q4    .  . |  x  x  x

    Args:
        q: (total_q, heads_q, head_dim); k: (total_k, heads_kv, head_dim), v: (total_k,
            heads_kv, head_dim_v) with
            heads_q % heads_kv == 0 (grouped-query heads as in ``attention``; heads_q = 0 gives
            empty results). fp16 / bf16 / fp32, one dtype and device, any strides.
        cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,) on q's device, starting at 0,
            non-decreasing, ending at total_q / total_k. Zero-length sequences are allowed (a
            query row whose sequence has no keys gives zeros and lse -inf).
        max_seqlen_q, max_seqlen_k: optional ints, the longest sequence of each (sizes the
            grid). Outside ``torch.compile`` tracing, cu_seqlens are read once on the host
            (one small sync) and every check above runs, including that a hint is not smaller
            than a real length (ValueError). Inside a compiled graph nothing is read while
            tracing: the caller guarantees valid cu_seqlens and hints >= the real lengths (a
            missing hint is computed in the op, at run time).
        causal, dropout_p, softmax_scale, seed, window: as in ``attention``. The dropout mask
            gives every (sequence, query head, row, key column) its own Philox word;
            ``reference.dropout_keep_mask_varlen`` recomputes it.
        return_lse: also return the row log-sum-exp.
        softcap, sinks, chunk_size, alibi_slopes, score_mod, mask_mod, mod_aux: as in
            ``attention``, per sequence (positions and ``b`` count within each sequence);
            alibi_slopes may be (num_seqs, heads_q).

    Returns:
        out: (total_q, heads_q, head_dim_v) in q's dtype.
        lse (only with ``return_lse``): float32 (heads_q, total_q), natural log, -inf for rows
            that see no key. Not differentiable.
    """
    if (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 3
            and not torch.compiler.is_compiling()):
        # The lengths first (read on the host once per cu_seqlens tensor): they size the
        # launch plan's grid, which is part of its key.
        max_q, max_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q,
                                        max_seqlen_k)
        plan = _fast_plan(q, k, v, (causal, dropout_p, softmax_scale, window, 0, softcap,
                                    chunk_size, score_mod, mask_mod, None), sinks, alibi_slopes,
                          mod_aux, (cu_seqlens_q, cu_seqlens_k, max_q, max_k))
        if plan is not None:
            return plan(q, k, v, seed, return_lse, sinks, alibi_slopes, mod_aux,
                        (cu_seqlens_q, cu_seqlens_k))
    causal = validate_attention(q, k, v, causal, dropout_p, softmax_scale, seed, window, dims=3,
                                layout=_PACKED_LAYOUT, head_axis=1)
    max_seqlen_q, max_seqlen_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k,
                                                  max_seqlen_q, max_seqlen_k)
    mods, chunk_size = check_mods(q, causal, window, softcap, sinks, chunk_size, alibi_slopes,
                                  score_mod, mask_mod, mod_aux,
                                  batch=cu_seqlens_q.numel() - 1)
    dropout_p = float(dropout_p)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    out, lse = _fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                       dropout_p, float(softmax_scale), _seed_tensor(dropout_p, seed, q.device),
                       int(window or 0), 0, None, **_mod_op_args(mods, chunk_size))
    return (out, lse) if return_lse else out


@torch.library.custom_op("fused_attention::kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor, k: Optional[torch.Tensor],
                v: Optional[torch.Tensor], causal: bool, softmax_scale: float, window: int,
                num_splits: int, chunk_size: int, softcap: float,
                alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                score_mod: str, mask_mod: str, mod_aux: list[torch.Tensor],
                block_table: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    call = AttentionCall.from_op(causal, softmax_scale, 0.0, 0, window, None, chunk_size,
                                 _op_mods(softcap, alibi_slopes, sinks, score_mod, mask_mod,
                                          mod_aux))
    if q.shape[1] == 0:  # no query heads (and so no kv heads: no cache entry to append)
        return new_out(q, v_cache.shape[-1]), q.new_empty(tuple(q.shape[:3]), dtype=torch.float32)
    if _use_fallback(q):
        return fallback.kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, call,
                                        new_out(q, v_cache.shape[-1]), block_table=block_table)
    return kvcache_forward(_unit_last(q), k_cache, v_cache, cache_seqlens,
                           None if k is None else _unit_last(k),
                           None if v is None else _unit_last(v), call, num_splits=num_splits,
                           block_table=block_table)


@_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, window, num_splits,
      chunk_size, softcap, alibi_slopes, sinks, score_mod, mask_mod, mod_aux, block_table=None):
    return new_out(q, v_cache.shape[-1]), q.new_empty(tuple(q.shape[:3]), dtype=torch.float32)


_KVCACHE_NO_BACKWARD = (
    "kernels.attention_with_kvcache is forward-only (generation against a KV cache): it has no "
    "backward, and gradients cannot flow through it. For training use kernels.attention (dense "
    "batches) or kernels.attention_varlen (packed sequences), which are differentiable; to "
    "generate with parameters that require grad, wrap the step in torch.no_grad() or "
    "torch.inference_mode().")


@torch.library.custom_op("fused_attention::kvcache_no_backward", mutates_args=())
def _kvcache_no_backward(grad: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The backward of ``attention_with_kvcache``: raises when it runs. An op, not a plain
    ``raise``, so that torch.compile can trace the graph (a forward that is never
    differentiated compiles and runs) while a real backward still fails."""
    raise RuntimeError(_KVCACHE_NO_BACKWARD)


@_kvcache_no_backward.register_fake
def _(grad, inputs):
    return [torch.empty_like(x) for x in inputs]


class _KVCacheForwardOnly(torch.autograd.Function):
    """Attaches (out, lse) of the KV-cache op to the inputs that require grad, with a backward
    that says the op is forward-only (a mutating custom op cannot register an autograd formula;
    PyTorch's own error would only say that none was registered)."""

    @staticmethod
    def forward(ctx, out, lse, *inputs):
        ctx.mark_non_differentiable(lse)
        ctx.shapes = [x.shape for x in inputs]  # not the tensors: the caches change later
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[2:]) if need]
        grads = [None] * len(ctx.shapes)
        placeholders = [dout.new_zeros(ctx.shapes[i]) for i in wanted]
        for i, g in zip(wanted, _kvcache_no_backward(dout, placeholders)):
            grads[i] = g
        return (None, None, *grads)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=None, v=None, *, causal=True,
                           softmax_scale=None, window=None, num_splits=0, return_lse=False,
                           softcap=None, sinks=None, chunk_size=None, alibi_slopes=None,
                           score_mod=None, mask_mod=None, mod_aux=(), block_table=None):
    """Attention of new query tokens against a preallocated KV cache (generation), optionally
    appending their keys and values first; FlashAttention's serving API in our layout.

    Args:
        q: (batch, heads_q, q_len, head_dim): 1 token when decoding, a few for speculative
            decoding (any q_len works).
        k_cache: (batch, heads_kv, max_len, head_dim), v_cache: (batch, heads_kv, max_len,
            head_dim_v), q's dtype and device, heads_q % heads_kv == 0 (grouped-query heads
            read natively).
        cache_seqlens: int32 (batch,): how many positions of each row's cache are filled
            (rows may differ). Not modified: the caller advances it.
        k, v: optional (batch, heads_kv, q_len, head_dim or head_dim_v): written into the
            caches **in
            place** at positions cache_seqlens[b] ... cache_seqlens[b] + q_len - 1 before
            attending. Lengths on the CPU are checked (negative, or past max_len: ValueError);
            lengths on the GPU are the caller's contract (not read, to avoid a sync), and the
            kernels never write or read past max_len even if it is broken.
        causal: with n = cache_seqlens[b] (+ q_len with k, v), query i of row b sees cache
            positions j < n with j <= i + n - q_len (bottom-right over the filled length);
            False: every j < n.
        softmax_scale, window: as in ``attention``.
        num_splits: split-KV as in ``attention`` (0: heuristic; long caches at small batch get
            split across the GPU's SMs).
        return_lse: also return lse fp32 (batch, heads_q, q_len).
        softcap, sinks, chunk_size, alibi_slopes, score_mod, mask_mod, mod_aux: as in
            ``attention`` (positions count over the filled cache). Forward only here, so
            ``sinks`` gets no gradient.
        block_table: optional int32 (batch, max_blocks): a **paged** cache (FlashAttention
            2's and vLLM's layout). k_cache is then (num_blocks, page_size, heads_kv,
            head_dim) and v_cache (num_blocks, page_size, heads_kv, head_dim_v), a pool of
            pages shared by the batch; cache position j of row b is row j % page_size of page
            block_table[b, j // page_size], so max_len = max_blocks * page_size (any
            page_size >= 1). Only the entries covering a row's filled (and appended)
            positions are read (page indices in [0, num_blocks): checked when the table is
            on the CPU, the caller's contract on the GPU, like the lengths); k, v keep the
            (batch, heads_kv, q_len, .) layout and are written into their pages. The kernels
            read and write the pages in place (no gathered copy), with split-KV,
            grouped-query heads and every option above; one compile per page size.

    Returns:
        out (batch, heads_q, q_len, head_dim_v) in q's dtype [, lse]. heads = 0 (q of shape
        (batch, 0, q_len, head_dim), caches with 0 heads) gives an empty out and lse. Forward
        only: ``.backward()`` through it raises a RuntimeError that says so (train with
        ``attention`` or ``attention_varlen``); works under ``torch.inference_mode()`` and
        ``torch.compile(fullgraph=True)`` (a custom op that declares it mutates the caches).
    """
    plan = _kvcache_plan(q, k_cache, v_cache, cache_seqlens, k, v, block_table, (
        causal, softmax_scale, window, num_splits, softcap, chunk_size, score_mod, mask_mod),
        sinks, alibi_slopes, mod_aux)
    if plan is not None:
        out, lse = plan(q, k_cache, v_cache, cache_seqlens, k, v, block_table, sinks,
                        alibi_slopes, mod_aux)
        return (out, lse) if return_lse else out
    causal = check_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale,
                           window, num_splits, block_table)
    mods, chunk_size = check_mods(q, causal, window, softcap, sinks, chunk_size, alibi_slopes,
                                  score_mod, mask_mod, mod_aux, batch=q.shape[0])
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in head_dim (it is written in "
                             f"place), got strides {t.stride()}")
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    args = (q, k_cache, v_cache, cache_seqlens, k, v, causal, float(softmax_scale),
            int(window or 0), int(num_splits))
    mod_args = dict(_mod_op_args(mods, chunk_size), block_table=block_table)
    inputs = [t for t in (q, k_cache, v_cache, k, v) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        with torch.no_grad():
            out, lse = _kvcache_op(*args, **mod_args)
        out, lse = _KVCacheForwardOnly.apply(out, lse, *inputs)
    else:
        out, lse = _kvcache_op(*args, **mod_args)
    return (out, lse) if return_lse else out


class _KVCachePlan:
    """How ``attention_with_kvcache`` runs for one validated signature (forward only, no
    tensor requiring grad): its ``AttentionCall`` (mods' tensors per call) and, once launched,
    its ``KVCachePlan`` (kernels/core/kvcache.py). Per call: the cache lengths' host checks
    (when on the CPU) and the route (``_use_fallback``)."""

    def __init__(self, q, k_cache, v_cache, cache_seqlens, k, v, block_table, options, sinks,
                 alibi_slopes, mod_aux):
        (causal, softmax_scale, window, num_splits, softcap, chunk_size, score_mod,
         mask_mod) = options
        causal = check_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale,
                               window, num_splits, block_table)
        mods, chunk_size = check_mods(q, causal, window, softcap, sinks, chunk_size,
                                      alibi_slopes, score_mod, mask_mod, mod_aux,
                                      batch=q.shape[0])
        if softmax_scale is None:
            softmax_scale = default_softmax_scale(q.shape[-1])
        self.mod_tensors = mods.has_tensors
        self.mods = dataclasses.replace(mods, alibi_slopes=None, sinks=None, aux=())
        self.call = AttentionCall(causal, float(softmax_scale), 0.0, 0,
                                  int(window) if window is not None else None, None,
                                  chunk_size, self.mods)
        self.num_splits = int(num_splits)
        self.new = 0 if k is None else q.shape[2]
        if block_table is None:
            self.lengths = (k_cache.shape[2], None, 0, 1)
        else:
            num_blocks, page_size = k_cache.shape[:2]
            self.lengths = (block_table.shape[1] * page_size, block_table, num_blocks,
                            page_size)
        self.plan = None

    def __call__(self, q, k_cache, v_cache, cache_seqlens, k, v, block_table, sinks,
                 alibi_slopes, mod_aux):
        max_len, _, num_blocks, page_size = self.lengths
        check_cache_lengths(cache_seqlens, self.new, max_len, block_table, num_blocks,
                            page_size)
        call = self.call
        if self.mod_tensors:
            call = _with_mod_tensors(call, None if sinks is None else sinks.float(),
                                     alibi_slopes, mod_aux)
        if _use_fallback(q):
            return fallback.kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, call,
                                            new_out(q, v_cache.shape[-1]), block_table=block_table)
        if self.plan is None:
            self.plan = KVCachePlan(q, k_cache, v_cache, cache_seqlens, k, v, call,
                                    num_splits=self.num_splits, block_table=block_table)
        return self.plan(q, k_cache, v_cache, cache_seqlens, k, v, call, block_table=block_table)


def _kvcache_plan(q, k_cache, v_cache, cache_seqlens, k, v, block_table, options, sinks,
                  alibi_slopes, mod_aux):
    """The ``_KVCachePlan`` of this ``attention_with_kvcache`` call, or None for the general
    path (as ``_fast_plan``; also when a tensor requires grad, or a layout needs a copy)."""
    tensors = (q, k_cache, v_cache, cache_seqlens, k, v, block_table)
    if (any(t is not None and t.__class__ is not torch.Tensor for t in tensors)
            or torch.compiler.is_compiling()):
        return None
    try:
        key = ("kvcache", *(None if t is None else _signature(t) for t in tensors),
               *_options_key(options, sinks, alibi_slopes, mod_aux))
        plan = _PLANS.get(key)
    except (TypeError, AttributeError):
        return None
    if plan is None:
        if (q.device.type not in ("cpu", "cuda") or q.dim() != 4 or q.numel() == 0
                or any(t is not None and (t.dim() < 2 or t.stride(-1) != 1)
                       for t in tensors[:3] + tensors[4:])):
            return None
        plan = _remember(key, _KVCachePlan(q, k_cache, v_cache, cache_seqlens, k, v,
                                           block_table, options, sinks, alibi_slopes, mod_aux))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k_cache, v_cache, k, v)):
        return None   # the general path attaches the forward-only error to them
    return plan


# --------------------------------------------------------------------------------------------
# Entry points for integrations that own their autograd formula (kernels.sdpa)
# --------------------------------------------------------------------------------------------
def _integration_args(q, k, v, causal, dropout_p, softmax_scale, seed, window, cu_seqlens_q,
                      cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    seed_arg, seed = seed, None if isinstance(seed, torch.Tensor) else seed
    if cu_seqlens_q is None:
        causal = validate_attention(q, k, v, causal, dropout_p, softmax_scale, seed, window)
        max_seqlen_q = max_seqlen_k = -1
    else:
        causal = validate_attention(q, k, v, causal, dropout_p, softmax_scale, seed, window,
                                    dims=3,
                                    layout=_PACKED_LAYOUT)
        max_seqlen_q, max_seqlen_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k,
                                                      max_seqlen_q, max_seqlen_k)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    seed_t = _integration_seed(float(dropout_p), seed_arg, q.device)
    return (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, float(dropout_p),
            float(softmax_scale), seed_t, int(window or 0))


def _check_grad_shapes(do, q, out, lse, packed):
    if do.shape != q.shape or out.shape != q.shape or lse.shape != lse_shape(q, packed):
        raise ValueError(f"do and out must have q's shape {tuple(q.shape)} and lse "
                         f"{lse_shape(q, packed)}, got do {tuple(do.shape)}, out "
                         f"{tuple(out.shape)}, lse {tuple(lse.shape)}")


def _integration_plan(q, k, v, causal, dropout_p, softmax_scale, window, cu_seqlens_q,
                      drop_layout):
    """The launch plan of a dense ``forward_with_lse`` / ``backward`` call (packed ones take
    the general path), or None."""
    if cu_seqlens_q is not None or not isinstance(q, torch.Tensor):
        return None
    return _fast_plan(q, k, v, (causal, dropout_p, softmax_scale, window, 0, None, None, None,
                                None, drop_layout), None, None, ())


def _integration_seed(dropout_p, seed, device):
    """An integration's seed (an int, or a one-element int64 tensor kept on the device) as
    the kernels' 0-d int64 tensor on ``device``."""
    if dropout_p == 0.0:
        return _NO_SEED
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise TypeError(f"seed as a tensor must be one int64 element, got "
                            f"{seed.dtype} {tuple(seed.shape)}")
        return seed.reshape(()).to(device)
    check_seed(seed)
    return _seed_tensor(dropout_p, seed, device)


def forward_with_lse(q, k, v, *, causal=True, dropout_p=0.0, softmax_scale=None, seed=0,
                     window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                     max_seqlen_k=None, drop_layout=None):
    """(out, lse) of ``attention`` (dense) or ``attention_varlen`` (with cu_seqlens), same
    arguments and validation, but as a plain forward: for integrations that register their own
    backward (kernels.sdpa, kernels.distributed), which pass the same arguments to
    ``backward``. ``seed``: an int, or a 0-d int64 tensor on q's device (read by the
    kernels, never by the host: no sync), the dropout mask's Philox key; ignored without
    dropout.
    ``drop_layout``: see ``check_drop_layout`` (context parallelism's blocks)."""
    plan = _integration_plan(q, k, v, causal, dropout_p, softmax_scale, window, cu_seqlens_q,
                             drop_layout)
    if plan is not None:
        seed_t = _integration_seed(plan.dropout_p, seed, q.device)
        with torch.no_grad():
            return plan.forward(q, k, v, seed_t, plan.call)
    args = _integration_args(q, k, v, causal, dropout_p, softmax_scale, seed, window,
                             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    layout = check_drop_layout(drop_layout, q, k, cu_seqlens_q is not None)
    with torch.no_grad():
        return _fwd_op(q, k, v, *args, 0, layout, **_mod_op_args(NO_MODS, None))


def backward(do, q, k, v, out, lse, *, causal=True, dropout_p=0.0, softmax_scale=None, seed=0,
             window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, drop_layout=None):
    """(dq, dk, dv) for ``do`` = dL/d(out), given the (out, lse) of ``forward_with_lse`` with
    the same arguments; shapes and layouts of q, k, v. Deterministic. With another call's
    (out, lse) -- the merged result of several key blocks -- it gives this block's share of the
    gradients (FlashAttention-2's backward only needs the final out and lse)."""
    plan = _integration_plan(q, k, v, causal, dropout_p, softmax_scale, window, cu_seqlens_q,
                             drop_layout)
    if plan is not None:
        _check_grad_shapes(do, q, out, lse, False)
        seed_t = _integration_seed(plan.dropout_p, seed, q.device)
        with torch.no_grad():
            return plan.backward(do, q, k, v, out, lse.float().contiguous(), seed_t, plan.call)
    (cu_q, cu_k, max_q, max_k, causal, dropout_p, scale, seed_t,
     window) = _integration_args(q, k, v, causal, dropout_p, softmax_scale, seed, window,
                                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_grad_shapes(do, q, out, lse, cu_q is not None)
    layout = check_drop_layout(drop_layout, q, k, cu_q is not None)
    with torch.no_grad():
        return _bwd_op(do, q, k, v, out, lse.float().contiguous(), cu_q, cu_k, max_q, max_k,
                       causal, dropout_p, scale, seed_t, window, layout,
                       **_mod_op_args(NO_MODS, None))


def visible_mask(q_len, k_len, *, causal=True, window=None, chunk_size=None, device=None):
    """bool (q_len, k_len): True where query i sees key j under the kernels' rule (bottom-right
    causal ``j <= P`` with P = i + k_len - q_len; with ``window`` also ``j > P - window``; with
    ``chunk_size`` also ``j // chunk_size == P // chunk_size``; everything without causal). For
    integrations that must check that a model's own mask is the pattern the kernels compute;
    never used to compute attention."""
    return fallback.block_visible(0, q_len, 0, k_len, q_len, k_len, causal, window, device,
                                  chunk_size=chunk_size)
