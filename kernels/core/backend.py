"""The one place that chooses how a call runs: the Triton kernels (their launch plans) or the
PyTorch fallback, behind one interface -- a plan per call signature.

* ``_use_fallback(t)``: the backend decision, made per call (CPU tensors run Triton's
  interpreter or the fallback as TRITON_INTERPRET says at that moment; GPUs the kernels do not
  serve take the fallback).
* ``AttentionPlan``: how ``attention`` / ``attention_varlen`` (and the integrations' entries)
  run for one validated signature -- its ``AttentionCall`` without the per-call tensors and,
  once launched, its ``ForwardPlan`` and one ``BackwardPlan`` per gradient layout
  (kernels/core/forward.py, backward.py). ``forward`` / ``backward`` take the per-call tensors.
* ``KVCachePlan``'s twin for ``attention_with_kvcache``: ``KVCacheRunner``; packed queries
  over a paged cache (``attention_varlen(..., block_table=)``): ``PagedVarlenRunner``.

Plans are built by kernels/pipeline.py (after validation) and kept in its plan cache; this
module validates nothing.
"""
import os
import sys
import warnings

import torch
from triton.runtime.errors import OutOfResources

from . import fallback
from .backward import BackwardPlan
from .call import lse_shape, new_like, new_out
from .common import check_interpreter_setting, interpreter_active
from .configs import fp8_unsupported_reason, unsupported_gpu_reason
from .forward import ForwardPlan
from .kvcache import KVCachePlan, SlotWritePlan, VarlenPagedPlan


class FallbackNotice(UserWarning):
    """Said once per process when CPU tensors run the PyTorch fallback: information (the
    results are the same), not a fault. Silence it with
    ``warnings.filterwarnings("ignore", category=kernels.FallbackNotice)``."""


_warned_fallback = False
_warned_gpu = False
_warned_fp8 = False
def _fp8_notice():
    global _warned_fp8
    if not _warned_fp8:
        _warned_fp8 = True
        warnings.warn("kernels: FP8 calls on this device run the PyTorch fallback, which "
                      "computes the FP8 kernel's quantized math (FP8-rounded inputs, descales, "
                      "weights rounded to e4m3 for the P @ V product) in higher precision: "
                      "the same results within the FP8 parity rule, but not an FP8 kernel and "
                      "no FP8 speed-up. Said once per process.", RuntimeWarning,
                      stacklevel=_caller_stacklevel())


_warned_unfit = set()


def _unfit_notice(err, device, launch):
    """Say (once per GPU and reason) that a signature's ``launch`` ("forward", "backward",
    "KV-cache forward") has no config this GPU loads -- Triton's ``OutOfResources`` from every
    config its pruning kept, ``err`` the last one's -- and that this pass of the signature runs
    the fallback from now on. Seen: the fp32 backward at head_dim 512 on GPUs with 99 KiB of
    shared memory per block (sm_86, sm_89, sm_120), whose tiles need 128-129 KiB
    (docs/features.md)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    key = (name, launch, str(err))
    if key not in _warned_unfit:
        _warned_unfit.add(key)
        warnings.warn(f"kernels: no launch config of the Triton {launch} loads on {name} "
                      f"({err}); calls of this signature run a PyTorch path with the same "
                      f"semantics (dropout mask included), at PyTorch's speed",
                      RuntimeWarning, stacklevel=_caller_stacklevel())


# Frames of these files are ours or PyTorch's (custom-op dispatch, nn.Module calls, compiled
# graphs): a warning skips them to land on the caller's own line.
_INTERNAL = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
             os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, "<eval_with_key")


def _caller_stacklevel():
    """``stacklevel`` for a ``warnings.warn`` in the function calling this one: the first frame
    outside this package and torch (the user's line, however deep the dispatch)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def _use_fallback(t):
    """Whether a call on ``t``'s device takes the PyTorch fallback: CPU tensors without
    Triton's interpreter, and CUDA tensors on GPUs the Triton kernels do not serve (before
    sm_80: ``configs.unsupported_gpu_reason``); warned once, at the caller's line. One tensor
    in, a bool out: the backend decision tools patch (tools/host_overhead.py)."""
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
            warnings.warn("kernels: note: CPU tensors run the PyTorch fallback, which computes "
                          "the same attention (same results, same dropout mask); the fused "
                          "Triton kernel runs on CUDA GPUs (or in Triton's interpreter with "
                          "TRITON_INTERPRET=1). Said once per process.", FallbackNotice,
                          stacklevel=_caller_stacklevel())
            _warned_fallback = True
        return True
    return False


def _route_fallback(t, fp8):
    """``_use_fallback(t)``, and for an FP8 call (``fp8``) also GPUs the kernels serve but
    without FP8 tensor cores (``configs.fp8_unsupported_reason``); an FP8 call on the fallback
    is said once (``_fp8_notice``)."""
    if not fp8:
        return _use_fallback(t)
    fallback = _use_fallback(t) or (t.device.type == "cuda"
                                    and fp8_unsupported_reason(t.device) is not None)
    if fallback:
        _fp8_notice()
    return fallback


def unit_last(t):
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


def _longest(cu, hint):
    """max_seqlen to launch with: the hint, or (None / -1) the longest sequence of ``cu``
    (a sync; only a compiled graph given no hint gets here)."""
    if cu is None or (hint is not None and hint >= 0):
        return hint
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


class AttentionPlan:
    """How one validated signature of ``attention`` (dense) or ``attention_varlen`` (packed:
    ``max_seqlens`` given) runs: ``call`` (an ``AttentionCall`` without seed or mods' tensors,
    which come per call) and ``num_splits``; the Triton plans are built at the first launch.
    The backend is chosen per call (``_use_fallback``); a backward follows its forward's.
    A launch with no config this GPU loads (``OutOfResources``) turns that pass to the
    fallback for good (``unfit``, warned once by ``_unfit_notice``): the forward's, the whole
    call; the backward's, the backward only (it starts from the kernel forward's o and lse)."""

    def __init__(self, call, num_splits=0, max_seqlens=(None, None), fp8=False):
        self.call, self.num_splits = call, int(num_splits)
        self.max_seqlens = max_seqlens
        self.dropout_p = call.dropout_p
        self.fwd = None
        self.bwd = {}
        self.cuda_route = None
        self.fp8 = fp8   # FP8 inputs (forward only; e4m3 k / v): the backend's FP8 rule
        self.unfit = ()   # the passes ("forward", "backward") with no config that loads

    def route(self, q):
        """``_use_fallback(q)``: decided once per plan on a GPU (a plan is for one device),
        per call on the CPU (TRITON_INTERPRET is read at each call); the fallback once a
        forward of this plan could not load (``unfit``)."""
        if "forward" in self.unfit:
            return True
        route = self.cuda_route
        if route is None or not q.is_cuda:
            route = _route_fallback(q, self.fp8)
            if q.is_cuda:
                self.cuda_route = route
        return route

    def _unfit(self, err, q, launch):
        """This plan's ``launch`` ("forward" or "backward") has no config that loads: that
        pass runs the fallback from now on."""
        self.unfit += (launch,)
        if launch == "forward":
            self.fwd = None
        else:
            self.bwd = {}
        _unfit_notice(err, q.device, launch)

    def forward(self, q, k, v, seed_t, call, cu_q=None, cu_k=None, route=None):
        """(out, lse) for this call's tensors; ``call``: the plan's with this call's mods'
        tensors; ``route``: the ``_use_fallback`` decision when the caller made it."""
        if q.shape[1] == 0:  # no query heads: an empty problem, like batch = 0
            return (new_out(q, v.shape[-1], call.out_dtype),
                    q.new_empty(lse_shape(q, cu_q is not None), dtype=torch.float32))
        if not ("forward" in self.unfit or (self.route(q) if route is None else route)):
            if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
                q, k, v = unit_last(q), unit_last(k), unit_last(v)
            try:
                plan = self.fwd
                if plan is None:
                    max_q, max_k = self.max_seqlens
                    plan = self.fwd = ForwardPlan(
                        q, k, v, call, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                        max_seqlen_q=_longest(cu_q, max_q), max_seqlen_k=_longest(cu_k, max_k),
                        num_splits=self.num_splits)
                return plan(q, k, v, call, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seed=seed_t)
            except OutOfResources as err:   # raised at load, before anything was launched
                self._unfit(err, q, "forward")
        # o None: the fallback's own buffer when its layout is new_out's (no copy)
        return fallback.forward(q, k, v, cu_q, cu_k, call.with_seed(seed_t), None)

    def recorded_forward(self, q, k, v, seed_t, call, packed, need_lse):
        """(route, (out, lse) or None) for a call that wants gradients: the route
        (``_use_fallback``) its backward follows, and, where the fallback serves the call with
        a few differentiable aten ops (``fallback.forward_recorded``), their result, whose
        backward autograd records (lse None unless ``need_lse``)."""
        route = self.route(q)
        if route and not packed and q.numel() and k.numel() and v.numel():
            return route, fallback.forward_recorded(unit_last(q), unit_last(k), unit_last(v),
                                                    call.with_seed(seed_t), need_lse=need_lse)
        return route, None

    def backward(self, do, q, k, v, o, lse, seed_t, call, cu_q=None, cu_k=None, daux=None,
                 own_output=False, route=None, into=None):
        """(dq, dk, dv). ``daux``: d(mod_aux) buffers added into (``attention_backward``);
        ``own_output``: o is this plan's forward's output (its layout is the plan's);
        ``route``: the forward's ``_use_fallback``; ``into``: True when the gradients must
        be in ``new_like``'s layouts (the custom op's; the kernels' are, the fallback then
        writes into such buffers), else the fallback's own buffers are returned."""
        if q.shape[1] == 0:  # no query heads: nothing reads k or v, whose gradients are 0
            return new_like(q), new_like(k).zero_(), new_like(v).zero_()
        do = unit_last(do)
        if not ("backward" in self.unfit or (self.route(q) if route is None else route)):
            if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
                q, k, v = unit_last(q), unit_last(k), unit_last(v)
            if own_output:   # the forward's own output: one layout for the signature
                key = (do.stride(), do.data_ptr() % 16 == 0, daux is not None)
            else:            # an integration's (out, lse) may come from elsewhere
                o = unit_last(o)
                key = (do.stride(), do.data_ptr() % 16 == 0, o.stride(),
                       o.data_ptr() % 16 == 0, daux is not None)
            try:
                plan = self.bwd.get(key)
                if plan is None:
                    max_q, max_k = self.max_seqlens
                    plan = self.bwd[key] = BackwardPlan(
                        do, q, k, v, o, lse, call, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                        max_seqlen_q=_longest(cu_q, max_q), max_seqlen_k=_longest(cu_k, max_k),
                        aux_grad=daux is not None)
                # (the kernels' gradients are in ``new_like``'s layouts already)
                return plan(do, q, k, v, o, lse, call, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            seed=seed_t, daux=daux)
            except OutOfResources as err:
                # Raised at a kernel's load. The launches before it wrote only the plan's own
                # buffers (daux is the dQ launch's, the last), so the fallback starts afresh
                # from (o, lse): the kernel forward's are those of the fallback's rule.
                self._unfit(err, q, "backward")
        into = (new_like(q), new_like(k), new_like(v)) if into else (None, None, None)
        return fallback.backward(do, q, k, v, o, lse, cu_q, cu_k, call.with_seed(seed_t),
                                 *into, daux=daux)


class KVCacheRunner:
    """How one validated signature of ``attention_with_kvcache`` runs (forward only):
    ``call`` without the mods' tensors, ``num_splits``; the ``KVCachePlan``
    (kernels/core/kvcache.py) is built at the first launch."""

    def __init__(self, call, num_splits=0, fp8=False):
        self.call, self.num_splits = call, int(num_splits)
        self.plan = None
        self.fp8 = fp8   # an FP8 cache: the backend's FP8 rule
        self.unfit = False   # its launch had no config that loads: the fallback from then on

    def __call__(self, q, k_cache, v_cache, cache_seqlens, k, v, call, block_table=None):
        """(out, lse); ``call``: the runner's with this call's mods' tensors."""
        if q.shape[1] == 0:  # no query heads (and so no kv heads: no cache entry to append)
            return (new_out(q, v_cache.shape[-1], call.out_dtype),
                    q.new_empty(tuple(q.shape[:3]), dtype=torch.float32))
        if not (self.unfit or _route_fallback(q, self.fp8)):
            q = unit_last(q)
            k = None if k is None else unit_last(k)
            v = None if v is None else unit_last(v)
            try:
                if self.plan is None:
                    self.plan = KVCachePlan(q, k_cache, v_cache, cache_seqlens, k, v, call,
                                            num_splits=self.num_splits, block_table=block_table)
                return self.plan(q, k_cache, v_cache, cache_seqlens, k, v, call,
                                 block_table=block_table)
            except OutOfResources as err:
                # An append launched before the failing load wrote what the fallback writes
                # again: the new rows at cache_seqlens, which no launch advances.
                self.unfit, self.plan = True, None
                _unfit_notice(err, q.device, "KV-cache forward")
        return fallback.kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, call,
                                        new_out(q, v_cache.shape[-1], call.out_dtype),
                                        block_table=block_table)


class PagedVarlenRunner:
    """How one validated signature of ``attention_varlen`` over a paged cache runs (forward
    only): ``call`` without the mods' tensors, ``num_splits``, ``max_seqlen_q``; the
    ``VarlenPagedPlan`` (kernels/core/kvcache.py) is built at the first launch."""

    def __init__(self, call, num_splits, max_seqlen_q, fp8=False):
        self.call, self.num_splits, self.max_seqlen_q = call, int(num_splits), max_seqlen_q
        self.plan = None
        self.fp8 = fp8   # an FP8 cache: the backend's FP8 rule
        self.unfit = False   # its launch had no config that loads: the fallback from then on

    def __call__(self, q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, call,
                 out=None):
        """(out (total_q, heads_q, Dv), lse (heads_q, total_q)); ``call``: the runner's with
        this call's mods' tensors; ``out``: written in place when given (the same strides at
        every call of a runner: its signature is in the plan key)."""
        if q.shape[1] == 0:
            return (new_out(q, v_cache.shape[-1], call.out_dtype) if out is None else out,
                    q.new_empty(lse_shape(q, True), dtype=torch.float32))
        if not (self.unfit or _route_fallback(q, self.fp8)):
            q = unit_last(q)
            try:
                if self.plan is None:
                    self.plan = VarlenPagedPlan(
                        q, k_cache, v_cache, call, cu_seqlens_q=cu_seqlens_q,
                        max_seqlen_q=_longest(cu_seqlens_q, self.max_seqlen_q),
                        seqused_k=seqused_k, block_table=block_table,
                        num_splits=self.num_splits, out=out)
                return self.plan(q, k_cache, v_cache, call, cu_seqlens_q=cu_seqlens_q,
                                 seqused_k=seqused_k, block_table=block_table, out=out)
            except OutOfResources as err:
                self.unfit, self.plan = True, None
                _unfit_notice(err, q.device, "paged forward")
        return fallback.varlen_paged_forward(q, k_cache, v_cache, cu_seqlens_q, seqused_k,
                                             block_table, call, out)


class SlotWriter:
    """How one validated signature of ``write_kv_cache`` runs: the append kernel
    (``kvcache.SlotWritePlan``, built at the first launch) or, where the kernels do not run,
    the fallback's indexed writes."""

    def __init__(self, fp8=False):
        self.fp8 = fp8   # an FP8 cache: the backend's FP8 rule
        self.plan = None

    def __call__(self, k_cache, v_cache, k, v, slot_mapping, descale=None):
        if k.numel() == 0:
            return
        if _route_fallback(k, self.fp8):
            fallback.write_slots(k_cache, v_cache, k, v, slot_mapping, descale)
            return
        k, v = unit_last(k), unit_last(v)
        if self.plan is None:
            self.plan = SlotWritePlan(k_cache, v_cache, k, v)
        self.plan(k_cache, v_cache, k, v, slot_mapping, descale)
