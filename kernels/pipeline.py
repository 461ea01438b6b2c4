"""The call pipeline every entry point goes through: resolve → cached plan → run.

* **Resolve** (``resolve_attention``, ``resolve_kvcache``; the only callers of
  kernels/validation.py): check the arguments once, fill in the defaults, and describe the
  call as one ``AttentionCall`` (kernels/core/call.py) without its per-call tensors.
* **Plan cache** (``plans``, a ``PlanCache``): the ``AttentionPlan`` / ``KVCacheRunner``
  (kernels/core/backend.py, where the Triton-or-fallback choice is made) of each call
  signature -- class, shape, strides, dtype, device and 16-byte alignment of every tensor, plus
  the options with their types. A hit skips the validation (every checked property is in the
  key). Bounded, least recently used first out, thread-safe, with ``stats()`` and ``clear()``.
* **Run**: eager calls run the plan directly (an ``autograd.Function`` when a gradient is
  wanted); calls that cannot be keyed -- inside ``torch.compile``, tensor subclasses,
  ``torch.func`` transforms -- go through the custom ops ``fused_attention::fwd`` / ``bwd`` /
  ``kvcache``, whose arguments are the call's tensors and one string generated from its
  ``AttentionCall`` (``call_spec``); the ops' bodies look their plan up in the same cache, so
  a compiled graph pays the eager path's host cost. Both autograd routes share one backward
  (``_gradients``).
"""
import collections
import dataclasses
import hashlib
import threading
import warnings

import torch

from .core import call as _call_module
from .core.backend import AttentionPlan, KVCacheRunner, PagedVarlenRunner, SlotWriter
from .core.call import (NO_DOUBLE_BACKWARD, AttentionCall, call_spec, default_softmax_scale,
                        lse_shape, new_like, new_out, out_dtype_of, parse_spec, with_tensors,
                        without_tensors)
from .core.mods import Descale, aux_grad_buffers, aux_grad_mask, sinks_grad
from .validation import (FP8_DTYPE, SEED_LIMIT, check_attn_mask, check_cache_lengths,
                         check_cu_seqlens, check_drop_layout, check_fp8, check_kvcache, check_mods,
                         check_num_splits, check_out, check_paged_varlen, check_seed,
                         check_slot_write, check_values_in_keys, check_written_in_place,
                         expand_scale, host_readable, validate_attention)

PACKED_LAYOUT = "(total_rows, heads, head_dim) (packed sequences)"
# Options of an attention call, in the order the public functions pass them.
OPTIONS = ("causal", "dropout_p", "softmax_scale", "window", "num_splits", "softcap",
           "chunk_size", "score_mod", "mask_mod", "drop_layout")
KV_OPTIONS = ("causal", "softmax_scale", "window", "num_splits", "softcap", "chunk_size",
              "score_mod", "mask_mod")


# --------------------------------------------------------------------------------------------
# The plan cache
# --------------------------------------------------------------------------------------------
class PlanCache:
    """Launch plans by call signature: at most ``maxsize``, the least recently used dropped
    first; safe to use from several threads (one lock around the dict; a plan itself may be
    built twice by two threads at once, which only costs time). ``stats()``: hits, misses,
    evictions, size, maxsize; ``clear()`` drops every plan (the next calls rebuild them)."""

    def __init__(self, maxsize=512):
        self._plans = collections.OrderedDict()
        self._lock = threading.Lock()
        self.maxsize = maxsize
        self.hits = self.misses = self.evictions = 0

    def get(self, key):
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                self.misses += 1
            else:
                self.hits += 1
                self._plans.move_to_end(key)
            return plan

    def get_or_build(self, key, build):
        """The plan of ``key``, or ``build()``'s, kept under ``key``."""
        plan = self.get(key)
        return self.put(key, build()) if plan is None else plan

    def put(self, key, plan):
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > max(self.maxsize, 0):
                self._plans.popitem(last=False)
                self.evictions += 1
        return plan

    def clear(self):
        with self._lock:
            self._plans.clear()

    def values(self):
        with self._lock:
            return list(self._plans.values())

    def __len__(self):
        return len(self._plans)

    def stats(self) -> dict:
        with self._lock:
            return dict(hits=self.hits, misses=self.misses, evictions=self.evictions,
                        size=len(self._plans), maxsize=self.maxsize)


plans = PlanCache()


def _signature(t):
    """What a plan fixes about a tensor: class, shape, strides, dtype, device and whether its
    data pointer is 16-byte aligned (Triton specialises pointers on it). Raises for tensors
    without storage (``torch.func`` wrappers) and non-tensors: such calls are not keyed."""
    return (t.__class__, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _opt_sig(t):
    return None if t is None else _signature(t)


def _options_key(options, sinks, alibi_slopes, mod_aux):
    """The part of a key after its tensors: the options with their types (1 == True, but
    causal=1 is an error, causal=True is not) and the mods' tensors' signatures."""
    return (options, tuple(map(type, options)), _opt_sig(sinks),
            # (ALiBi slopes requiring grad are an error: checked when the plan is built)
            None if alibi_slopes is None else (*_signature(alibi_slopes),
                                               alibi_slopes.requires_grad),
            tuple(map(_signature, mod_aux)) if mod_aux else ())


def _fp8_key(descale, out_dtype):
    """The key part of a call's FP8 arguments: () for the calls without any (no cost)."""
    if descale is None and out_dtype is None:
        return ()
    return (None if descale is None else tuple(map(_opt_sig, descale)), out_dtype)


def _with_fp8(mods, descale):
    """``mods`` with the call's checked descales (``check_fp8``), if any."""
    return mods if descale is None else dataclasses.replace(mods, descale=descale)


_FP8_NO_GRAD = (
    "FP8 (float8_e4m3fn) attention is forward-only, as FlashAttention-3's and -4's are: no "
    "gradient flows through FP8 q, k or v. Train in bfloat16 (kernels.attention with bf16 "
    "q, k, v is differentiable), or run the FP8 call under torch.no_grad() / "
    "torch.inference_mode().")


def _refuse_fp8_grad(*tensors):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(_FP8_NO_GRAD)


def _keyable(*tensors):
    """Whether a call on these tensors can use a cached plan outside the custom ops: plain
    tensors on CPU or CUDA, outside torch.compile tracing."""
    for t in tensors:
        if t is not None and t.__class__ is not torch.Tensor:
            return False
    return not torch.compiler.is_compiling()


# --------------------------------------------------------------------------------------------
# Resolve: validation, defaults, the call's description
# --------------------------------------------------------------------------------------------
def resolve_attention(q, k, v, options, sinks, alibi_slopes, mod_aux, packed=None, seed=None,
                      descale=None, out_dtype=None):
    """Validate an ``attention`` (``packed`` None) or ``attention_varlen`` call (``packed`` =
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) as ``check_cu_seqlens`` returns
    them); ``descale`` (q, k, v descales) and ``out_dtype``: an FP8 call's (``check_fp8``).
    Returns (its ``AttentionPlan``, its ``CallMods`` with the converted tensors)."""
    (causal, dropout_p, softmax_scale, window, num_splits, softcap, chunk_size, score_mod,
     mask_mod, drop_layout) = options
    if packed is None:
        causal = validate_attention(q, k, v, causal, dropout_p, softmax_scale, seed, window)
        batch = q.shape[0]
    else:
        causal = validate_attention(q, k, v, causal, dropout_p, softmax_scale, seed, window,
                                    dims=3, layout=PACKED_LAYOUT)
        batch = packed[0].numel() - 1
    mods, chunk_size = check_mods(q, causal, window, softcap, sinks, chunk_size, alibi_slopes,
                                  score_mod, mask_mod, mod_aux, batch=batch)
    descale, out_dtype = check_fp8(q.dtype, k.dtype, descale, out_dtype, batch,
                                   k.shape[-2 if packed is not None else 1], q.device,
                                   dropout_p)
    mods = _with_fp8(mods, descale)
    check_num_splits(num_splits)
    drop_layout = check_drop_layout(drop_layout, q, k, packed is not None)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    call = AttentionCall(causal, float(softmax_scale), float(dropout_p), 0,
                         int(window) if window is not None else None,
                         None if drop_layout is None else tuple(drop_layout), chunk_size, mods,
                         out_dtype=out_dtype)
    max_seqlens = (None, None) if packed is None else tuple(packed[2:])
    return AttentionPlan(without_tensors(call), num_splits, max_seqlens,
                         fp8=k.dtype == FP8_DTYPE), mods


def check_arguments(q, k, v, causal, dropout_p, softmax_scale, seed):
    """Validate a dense call as ``attention`` would (raises the same errors) without running
    it; returns causal as a bool. For integrations that check before a collective."""
    plan, _ = resolve_attention(q, k, v, (causal, dropout_p, softmax_scale, None, 0, None, None,
                                          None, None, None), None, None, (), seed=seed)
    return plan.call.causal


def _packed(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k):
    """(cu_q, cu_k, max_q, max_k) of a packed call, checked (the lengths are read on the host
    once per cu_seqlens tensor: they size the plan's grid, which is part of its key); unchecked
    (max -1) when q, k are no 3-D tensors: ``resolve_attention`` then says what is wrong."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and q.dim() == k.dim() == 3):
        return cu_seqlens_q, cu_seqlens_k, -1, -1
    return (cu_seqlens_q, cu_seqlens_k,
            *check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k))


def attention_plan(q, k, v, options, sinks=None, alibi_slopes=None, mod_aux=(), packed=None,
                   descale=None, out_dtype=None):
    """(plan, mods) of a call: the cached plan (mods None: the call's own tensors are used as
    they come) when the call can be keyed, else a resolved uncached one (it runs through the
    custom ops, whose bodies look up their own)."""
    if _keyable(q, k, v):
        try:
            key = (_signature(q), _signature(k), _signature(v),
                   *_options_key(options, sinks, alibi_slopes, mod_aux),
                   None if packed is None else (_signature(packed[0]), _signature(packed[1]),
                                                *packed[2:]), *_fp8_key(descale, out_dtype))
        except (TypeError, AttributeError, RuntimeError):   # not tensors, or no storage
            key = None
        if key is not None:
            return plans.get_or_build(key, lambda: resolve_attention(
                q, k, v, options, sinks, alibi_slopes, mod_aux, packed, descale=descale,
                out_dtype=out_dtype)[0]), None
    return resolve_attention(q, k, v, options, sinks, alibi_slopes, mod_aux, packed,
                             descale=descale, out_dtype=out_dtype)


# --------------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------------
# The seed of every call without dropout: one shared CPU tensor (the ops never read it). Under
# torch.compile it enters the graph as an input, so Inductor emits no CPU C++ kernel to build it.
with torch.inference_mode(False):  # a normal tensor even if first imported in inference mode
    _NO_SEED = torch.zeros((), dtype=torch.int64, device="cpu")
_SEEDS = {}       # (seed, device) -> its tensor there: a fixed seed costs no copy per call
_MAX_SEEDS = 64


def seed_tensor(dropout_p, seed, device):
    """The call's Philox seed, a 0-d int64 tensor on the inputs' device: drawn there from
    PyTorch's generator of that device when ``seed`` is None (no copy, no sync; inside a CUDA
    graph each replay draws anew), else the given int (checked; one host-to-device copy per
    (seed, device)), or a one-element int64 tensor (the integrations': kept on the device)."""
    if isinstance(seed, torch.Tensor):
        if dropout_p == 0.0:
            return _NO_SEED
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise TypeError(f"seed as a tensor must be one int64 element, got "
                            f"{seed.dtype} {tuple(seed.shape)}")
        return seed.reshape(()).to(device)
    if seed is not None:
        check_seed(seed)
    if dropout_p == 0.0:
        return _NO_SEED
    if seed is None:
        return torch.randint(0, SEED_LIMIT - 1, (), dtype=torch.int64, device=device)
    key = (int(seed), device)
    t = _SEEDS.get(key)
    if t is None:
        if len(_SEEDS) >= _MAX_SEEDS:
            _SEEDS.clear()
        with torch.inference_mode(False):   # usable later outside inference mode too
            t = _SEEDS[key] = torch.tensor(key[0], dtype=torch.int64, device=device)
    return t


# --------------------------------------------------------------------------------------------
# Run: the eager route and the custom ops, one backward
# --------------------------------------------------------------------------------------------
def _distinct(*args):
    """``args`` with each repeat of a tensor object (also inside a list: ``mod_aux``) replaced
    by a view of it (``view_as``). Passing one tensor twice is ordinary -- one cu_seqlens for
    queries and keys (packed self-attention), ``attention(x, x, x)``, one table as sinks and
    mod_aux -- but Dynamo refuses an ``autograd.Function`` given one tensor at two inputs
    ("duplicate tensor input"); a view reads the same memory and sends its gradient to the
    same tensor. Every ``.apply`` and custom-op call that torch.compile can trace takes its
    tensors through here; nothing is allocated when no tensor repeats. (``_PlannedAttention``,
    the eager route, is never traced -- keyable calls only -- and skips the ~9 us this costs.)
    Outside tracing the arguments go through as they are: only Dynamo refuses a repeat."""
    if not torch.compiler.is_compiling():
        return args
    seen = []

    def one(a):
        if isinstance(a, list):
            return [one(x) for x in a]
        if isinstance(a, torch.Tensor):
            if any(a is b for b in seen):
                return a.view_as(a)
            seen.append(a)
        return a

    return tuple(one(a) for a in args)


def run_attention(plan, mods, q, k, v, seed, sinks, alibi_slopes, mod_aux, packed=None,
                  need_lse=True, descale=None):
    """(out, lse) of a planned call (``attention_plan``'s): eager (``mods`` None: a cached
    plan), with autograd when a gradient is wanted, else through the custom ops. lse may be
    None unless ``need_lse``. ``descale``: an FP8 call's (q, k, v) descales."""
    cu = (None, None) if packed is None else packed[:2]
    if plan.fp8:
        return _run_fp8(plan, mods, q, k, v, sinks, alibi_slopes, mod_aux, packed, descale)
    seed_t = (_NO_SEED if seed is None and plan.dropout_p == 0.0
              else seed_tensor(plan.dropout_p, seed, q.device))
    if mods is not None:   # not keyable: the custom ops (torch.compile, subclasses, torch.func)
        args = (q, k, v, *cu, *((-1, -1) if packed is None else packed[2:]), seed_t,
                mods.alibi_slopes, mods.sinks)
        spec = call_spec(plan.call, plan.num_splits)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (q, k, v, mods.sinks, *mods.aux)):
            aux_grad = aux_grad_mask(mods.score_mod, mods.aux) if mods.aux else ()
            return _OpAttention.apply(*_distinct(*args, spec, aux_grad, *mods.aux))
        return _fwd_op(*_distinct(*args, list(mods.aux), spec))   # (Dynamo cannot trace the
        #                                                           Function under no_grad)
    call = with_tensors(plan.call, sinks, alibi_slopes, mod_aux)
    if torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
            or sinks is not None and sinks.requires_grad
            or mod_aux and any(t.requires_grad for t in mod_aux)):
        route, recorded = plan.recorded_forward(q, k, v, seed_t, call, packed is not None,
                                                need_lse)
        if recorded is not None:   # the fallback's few-aten-op routes: autograd's own
            return recorded
        aux_grad = aux_grad_mask(plan.call.mods.score_mod, mod_aux) if mod_aux else ()
        return _PlannedAttention.apply(q, k, v, call.mods.sinks, seed_t, plan, call, route,
                                       aux_grad, *cu, *mod_aux)
    return plan.forward(q, k, v, seed_t, call, *cu)


def _run_fp8(plan, mods, q, k, v, sinks, alibi_slopes, mod_aux, packed, descale):
    """An FP8 call (forward only): the plan directly, or the forward op."""
    _refuse_fp8_grad(q, k, v, sinks, *mod_aux)
    cu = (None, None) if packed is None else packed[:2]
    if mods is not None:
        descale = mods.descale or (None, None, None)
        return _fwd_fp8_op(*_distinct(q, k, v, *cu,
                                      *((-1, -1) if packed is None else packed[2:]), _NO_SEED,
                                      mods.alibi_slopes, mods.sinks, list(mods.aux),
                                      call_spec(plan.call, plan.num_splits), *descale))
    call = with_tensors(plan.call, sinks, alibi_slopes, mod_aux, descale=descale)
    return plan.forward(q, k, v, _NO_SEED, call, *cu)


class _NoDoubleBackward(torch.autograd.Function):
    """Passes the first-order gradients through, attached to the graph of the inputs (q, k, v),
    with a backward that raises a clear error: the attention backward is a fused kernel with no
    derivative of its own."""

    generate_vmap_rule = True   # (torch.func.grad runs backward with grad mode on)

    @staticmethod
    def forward(grads, *inputs):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(NO_DOUBLE_BACKWARD)


def _gradients(run_backward, do, q, k, v, out, lse, sinks, packed, want_sinks):
    """The one backward of both autograd routes: ``run_backward(do)`` -> ((dq, dk, dv),
    daux) (the plan's backward, directly or through the backward op), the sinks' gradient,
    and the double-backward guard. Returns (grads, dsinks, daux)."""
    if torch.is_grad_enabled():   # create_graph=True: no graph of these, and a clear error
        with torch.no_grad():     # when one is asked for later
            grads, dsinks, daux = _gradients(run_backward, do, q, k, v, out, lse, sinks,
                                             packed, want_sinks)
        return _NoDoubleBackward.apply(tuple(grads), *_distinct(q, k, v, do)), dsinks, daux
    grads, daux = run_backward(do)
    dsinks = None
    if sinks is not None and want_sinks:
        dsinks = sinks_grad(sinks, lse, do, out, packed=packed)
    return grads, dsinks, daux


class _PlannedAttention(torch.autograd.Function):
    """Autograd of the eager route: the plan's forward and backward with no custom-op
    dispatch in between."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, seed_t, plan, call, route, aux_grad, cu_q=None, cu_k=None,
                *aux):
        # aux: the call's mod_aux (inputs here so that their gradients have a place).
        ctx.route, ctx.plan, ctx.call, ctx.aux_grad = route, plan, call, aux_grad
        out, lse = plan.forward(q, k, v, seed_t, call, cu_q, cu_k, route=route)
        ctx.save_for_backward(q, k, v, out, lse, seed_t, sinks, cu_q, cu_k, *aux)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, out, lse, seed_t, sinks, cu_q, cu_k, *aux = ctx.saved_tensors

        def run_backward(do):
            daux = (aux_grad_buffers(ctx.call.mods.score_mod, aux) if any(ctx.aux_grad)
                    else None)
            return ctx.plan.backward(do, q, k, v, out, lse, seed_t, ctx.call, cu_q, cu_k,
                                     daux=daux, own_output=True, route=ctx.route), daux

        grads, dsinks, daux = _gradients(run_backward, do, q, k, v, out, lse, sinks,
                                         cu_q is not None, ctx.needs_input_grad[3])
        return (*grads, dsinks, None, None, None, None, None, None, None,
                *(d if w else None for d, w in zip(daux or [None] * len(aux), ctx.aux_grad)))


def _op_plan(kind, spec, ints, tensors, sinks, alibi_slopes, mod_aux, make, descale=None):
    """The plan or runner of a custom op's call (validated when the public function traced or
    called it): from the plan cache by ``kind``, ``spec``, ``ints`` and the signatures of
    ``tensors`` (None where absent), sinks, slopes and mod_aux, else ``make(call,
    num_splits)`` of ``spec``; (it, its call with this call's tensors)."""
    key = (kind, spec, ints, *map(_opt_sig, tensors),
           None if alibi_slopes is None else _signature(alibi_slopes),
           None if sinks is None else _signature(sinks),
           tuple(map(_signature, mod_aux)) if mod_aux else (), *_fp8_key(descale, None))
    plan = plans.get(key)
    if plan is None:
        plan = make(*parse_spec(spec))
        plans.put(key, plan)
    if sinks is None and alibi_slopes is None and not mod_aux and descale is None:
        return plan, plan.call   # (with_tensors would return it as it is)
    return plan, with_tensors(plan.call, sinks, alibi_slopes, mod_aux, descale=descale)


def _in_fake_layout(out, q, head_dim_v, out_dtype=None):
    """``out`` in the fake's layout (``new_out(q, ...)``): the kernels' output has it but for a
    q without a unit last stride, which they read through a copy."""
    if q.stride(-1) != 1:
        expected = new_out(q, head_dim_v, out_dtype)
        if out.stride() != expected.stride():
            return expected.copy_(out)
    return out


def _attention_op_plan(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, sinks, mod_aux, spec,
                       descale=None):
    """``_op_plan`` of ``fused_attention::fwd`` / ``bwd``: an ``AttentionPlan``."""
    return _op_plan("op", spec, (max_q, max_k), (q, k, v, cu_q, cu_k), sinks, alibi_slopes,
                    mod_aux, lambda call, num_splits: AttentionPlan(
                        call, num_splits, (max_q, max_k), fp8=k.dtype == FP8_DTYPE), descale)


def public_descales(q_descale, k_descale, v_descale):
    """A call's three optional FP8 descales as one ``Descale``, or None when none is given
    (the public functions' and the ops' arguments alike)."""
    if q_descale is None and k_descale is None and v_descale is None:
        return None
    return Descale(q_descale, k_descale, v_descale)


# The ops are defined with ``torch.library.Library`` (CPU and CUDA kernels, fakes for tracing)
# rather than ``custom_op``: an op of ``custom_op`` always runs a Python autograd kernel that
# dispatches again (~25 us a call, the larger part of what a compiled graph paid for each of
# ours), and its autograd formula does not work under ``torch.func``. The autograd formula is
# ``_OpAttention``, an ``autograd.Function`` around the op, which torch.compile traces into the
# graph (its forward and backward are the ops) and torch.func transforms (with the ops' vmap
# rules below).
_LIB = torch.library.Library("fused_attention", "FRAGMENT")


def op_revision(paths) -> str:
    """The ops' overload name: "r" + a hash of the files at ``paths`` (this module and
    kernels/core/call.py: the schemas, and the spec strings a compiled graph carries).
    Inductor's FX-graph cache keys a graph on its code, which names each op but not its schema
    (pytorch/pytorch#187319, open): a graph compiled and cached by another version of this
    package would call ``fused_attention::fwd`` with that version's arguments. With the
    revision in every op's name, another version's graphs are never this one's."""
    digest = hashlib.sha1()
    for path in paths:
        try:
            with open(path, "rb") as f:
                digest.update(f.read())
        except OSError:   # no source beside the module (a frozen install): its path then
            digest.update(str(path).encode())
    return "r" + digest.hexdigest()[:12]


_REVISION = op_revision((__file__, _call_module.__file__))


def _define(name, schema, impl, fake):
    """``fused_attention::<name>`` (overload ``_REVISION``) with its CPU and CUDA kernel and
    its fake; defined once per process: a re-executed module (a reload, a tool re-importing
    the package) registers its functions over the old ones. Returns the op (an OpOverload)."""
    qualified = f"{name}.{_REVISION}"
    packet = getattr(torch.ops.fused_attention, name, None)
    if packet is None or _REVISION not in packet.overloads():
        _LIB.define(qualified + schema)
    with warnings.catch_warnings():   # "Overriding a previously registered kernel" (re-import)
        warnings.simplefilter("ignore", UserWarning)
        for key in ("CPU", "CUDA"):
            _LIB.impl(qualified, impl, key)
        torch.library.register_fake(f"fused_attention::{qualified}", fake, lib=_LIB)
    return getattr(getattr(torch.ops.fused_attention, name), _REVISION)


def _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed,
              alibi_slopes, sinks, mod_aux, spec, q_descale=None, k_descale=None,
              v_descale=None):
    """``fused_attention::fwd``: (out, lse) of the call ``spec`` (``call_spec``) describes;
    ``fused_attention::fwd_fp8`` (the same with FP8 descales: a schema of its own, so that
    every other compiled call passes no FP8 arguments)."""
    plan, call = _attention_op_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, alibi_slopes, sinks, mod_aux, spec,
                                    public_descales(q_descale, k_descale, v_descale))
    out, lse = plan.forward(q, k, v, seed, call, cu_seqlens_q, cu_seqlens_k)
    return _in_fake_layout(out, q, v.shape[-1], call.out_dtype), lse


def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed,
              alibi_slopes, sinks, mod_aux, spec, q_descale=None, k_descale=None,
              v_descale=None):   # (both ops' fake)
    return (new_out(q, v.shape[-1], parse_spec(spec)[0].out_dtype),
            q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32))


def _bwd_impl(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              seed, alibi_slopes, sinks, mod_aux, spec, aux_grad, own_output):
    """``fused_attention::bwd``: [dq, dk, dv, d(mod_aux[0]), ...] of ``fwd``'s call, the aux
    gradients fp32 where ``aux_grad`` is set, empty elsewhere. ``own_output``: o and lse are
    the forward's (an integration may pass another call's)."""
    plan, call = _attention_op_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, alibi_slopes, sinks, mod_aux, spec)
    daux = aux_grad_buffers(call.mods.score_mod, mod_aux) if any(aux_grad) else None
    grads = plan.backward(do, q, k, v, o, lse, seed, call, cu_seqlens_q, cu_seqlens_k,
                          daux=daux, own_output=own_output, into=True)
    return [*grads, *(d if g else q.new_empty(0, dtype=torch.float32)
                      for d, g in zip(daux or [None] * len(mod_aux), aux_grad))]


def _bwd_fake(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              seed, alibi_slopes, sinks, mod_aux, spec, aux_grad, own_output):
    return [new_like(q), new_like(k), new_like(v),
            *(torch.empty_like(t, dtype=torch.float32) if g
              else q.new_empty(0, dtype=torch.float32) for t, g in zip(mod_aux, aux_grad))]


_fwd_op = _define("fwd", "(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, "
                  "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor seed, "
                  "Tensor? alibi_slopes, Tensor? sinks, Tensor[] mod_aux, str spec) "
                  "-> (Tensor, Tensor)", _fwd_impl, _fwd_fake)
_fwd_fp8_op = _define("fwd_fp8", "(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, "
                      "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
                      "Tensor seed, Tensor? alibi_slopes, Tensor? sinks, Tensor[] mod_aux, "
                      "str spec, Tensor? q_descale, Tensor? k_descale, Tensor? v_descale) "
                      "-> (Tensor, Tensor)", _fwd_impl, _fwd_fake)
_bwd_op = _define("bwd", "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
                  "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
                  "SymInt max_seqlen_k, Tensor seed, Tensor? alibi_slopes, Tensor? sinks, "
                  "Tensor[] mod_aux, str spec, bool[] aux_grad, bool own_output) -> Tensor[]",
                  _bwd_impl, _bwd_fake)


class _OpAttention(torch.autograd.Function):
    """Autograd of the op route (torch.compile, tensor subclasses, torch.func): the forward
    is ``fused_attention::fwd``, the backward ``fused_attention::bwd`` (both traced into a
    compiled graph); vmap goes through the ops' rules."""
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, seed, alibi_slopes, sinks, spec, aux_grad,
                *aux):
        return _fwd_op(*_distinct(q, k, v, cu_q, cu_k, max_q, max_k, seed, alibi_slopes,
                                  sinks, list(aux), spec))

    @staticmethod
    def setup_context(ctx, inputs, output):
        (q, k, v, cu_q, cu_k, max_q, max_k, seed, alibi_slopes, sinks, spec, aux_grad,
         *aux) = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, seed, cu_q, cu_k, alibi_slopes, sinks, *aux)
        ctx.mark_non_differentiable(lse)
        ctx.max_seqlens, ctx.spec = (max_q, max_k), spec
        # Which mod_aux entries get a gradient (``aux_grad_mask``, checked by the caller).
        ctx.aux_grad = aux_grad

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, out, lse, seed, cu_q, cu_k, alibi_slopes, sinks, *aux = ctx.saved_tensors

        def run_backward(do):
            res = _bwd_op(*_distinct(do, q, k, v, out, lse, cu_q, cu_k, *ctx.max_seqlens,
                                     seed, alibi_slopes, sinks, aux, ctx.spec,
                                     list(ctx.aux_grad), True))
            return res[:3], [d if g else None for d, g in zip(res[3:], ctx.aux_grad)]

        grads, dsinks, daux = _gradients(run_backward, do, q, k, v, out, lse, sinks,
                                         cu_q is not None, ctx.needs_input_grad[9])
        return (*grads, None, None, None, None, None, None, dsinks, None, None,
                *(daux or ()))


# --------------------------------------------------------------------------------------------
# torch.func.vmap: the mapped dim folds into the batch (dense calls)
# --------------------------------------------------------------------------------------------
def _fold(x, dim, size):
    """``x`` with its vmapped dim ``dim`` (None: unmapped, expanded) folded into dim 0."""
    x = x.unsqueeze(0).expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _unfold(x, size):
    return x.reshape(size, x.shape[0] // size, *x.shape[1:])


def _vmap_refusal(what):
    return NotImplementedError(
        f"torch.func.vmap over kernels.attention maps q, k, v, do, out and lse of dense calls "
        f"only (folded into the batch); {what} cannot be mapped. Loop over the mapped dim, or "
        f"concatenate along the batch and call kernels.attention once")


def _check_vmappable(named_dims):
    for name, dim in named_dims:
        if dim is not None:
            raise _vmap_refusal(f"a mapped {name}")


@torch.library.register_vmap(_fwd_op)
def _fwd_vmap(info, in_dims, q, k, v, cu_q, cu_k, max_q, max_k, seed, alibi_slopes, sinks,
              mod_aux, spec):
    q_d, k_d, v_d, cu_q_d, cu_k_d, _, _, seed_d, alibi_d, sinks_d, aux_d, _ = in_dims
    _check_vmappable((("cu_seqlens", cu_q_d), ("cu_seqlens", cu_k_d), ("seed", seed_d),
                      ("alibi_slopes", alibi_d), ("sinks", sinks_d)))
    if cu_q is not None:
        raise _vmap_refusal("a packed (varlen) call")
    if any(d is not None for d in aux_d or ()):
        raise _vmap_refusal("a mapped mod_aux")
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        alibi_slopes = alibi_slopes.repeat(info.batch_size, 1)   # per-batch slopes
    n = info.batch_size
    out, lse = _fwd_op(_fold(q, q_d, n), _fold(k, k_d, n), _fold(v, v_d, n), None, None,
                       max_q, max_k, seed, alibi_slopes, sinks, mod_aux, spec)
    return (_unfold(out, n), _unfold(lse, n)), (0, 0)


@torch.library.register_vmap(_bwd_op)
def _bwd_vmap(info, in_dims, do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, seed, alibi_slopes,
              sinks, mod_aux, spec, aux_grad, own_output):
    (do_d, q_d, k_d, v_d, o_d, lse_d, cu_q_d, cu_k_d, _, _, seed_d, alibi_d, sinks_d, aux_d,
     *_) = in_dims
    _check_vmappable((("cu_seqlens", cu_q_d), ("cu_seqlens", cu_k_d), ("seed", seed_d),
                      ("alibi_slopes", alibi_d), ("sinks", sinks_d)))
    if cu_q is not None or any(aux_grad) or any(d is not None for d in aux_d or ()):
        raise _vmap_refusal("a packed call or mod_aux gradients")
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        alibi_slopes = alibi_slopes.repeat(info.batch_size, 1)
    n = info.batch_size
    res = _bwd_op(*(_fold(x, d, n) for x, d in ((do, do_d), (q, q_d), (k, k_d), (v, v_d),
                                                (o, o_d), (lse, lse_d))),
                  None, None, max_q, max_k, seed, alibi_slopes, sinks, mod_aux, spec, aux_grad,
                  own_output)
    grads = [_unfold(g, n) for g in res[:3]]
    return [*grads, *res[3:]], [0, 0, 0, *([None] * len(res[3:]))]


# --------------------------------------------------------------------------------------------
# The KV cache (forward only)
# --------------------------------------------------------------------------------------------
def _values_offset(k_cache, v_cache) -> int:
    """The byte offset of v_cache's first element inside k_cache's first row, or -1 (v_cache
    is its own tensor or another part of one, e.g. the V half of a vLLM cache). 0: the values
    may be the keys' first columns (MLA's latent cache: ``latent_values``)."""
    try:
        if v_cache.numel() == 0 or k_cache.numel() == 0:
            return -1   # (empty tensors share no element, whatever their data pointers say)
        offset = v_cache.data_ptr() - k_cache.data_ptr()
        row = k_cache.shape[-1] * k_cache.element_size()
    except (AttributeError, TypeError, RuntimeError, IndexError):
        return -1   # (not tensors, or without storage: the other checks say what is wrong)
    return offset if 0 <= offset < row else -1


def latent_values(k_cache, v_cache, k, v, k_scales, v_scales):
    """A cache call's values when v_cache may lie inside k_cache: (latent, v, v_scales).
    latent True: v_cache is ``k_cache[..., :Dv]`` (MLA: the values are the latent rows' first
    Dv columns), the new values are k's first Dv columns (None without k; written again
    through v_cache: the same bytes) and k's scales are v's (a tuple like ``v_scales``).
    Else (False, v, v_scales) as given. A v_cache starting inside k_cache's first row any
    other way, a v or v scale with a latent cache: ``check_values_in_keys`` says why."""
    offset = _values_offset(k_cache, v_cache)
    if offset < 0:
        return False, v, v_scales
    check_values_in_keys(k_cache, v_cache, offset, v, v_scales)
    return True, (None if k is None else k[..., :v_cache.shape[-1]]), k_scales


def resolve_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, options, sinks,
                    alibi_slopes, mod_aux, descale=None, out_dtype=None):
    """Validate an ``attention_with_kvcache`` call; (its ``KVCacheRunner``, its ``CallMods``
    with the converted tensors). ``descale``, ``out_dtype``: an FP8 call's (``check_fp8``)."""
    (causal, softmax_scale, window, num_splits, softcap, chunk_size, score_mod,
     mask_mod) = options
    causal = check_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale,
                           window, num_splits, block_table)
    mods, chunk_size = check_mods(q, causal, window, softcap, sinks, chunk_size, alibi_slopes,
                                  score_mod, mask_mod, mod_aux, batch=q.shape[0])
    descale, out_dtype = check_fp8(q.dtype, k_cache.dtype, descale, out_dtype, q.shape[0],
                                   k_cache.shape[2 if block_table is not None else 1],
                                   q.device)
    mods = _with_fp8(mods, descale)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_written_in_place(name, t)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    call = AttentionCall(causal, float(softmax_scale), 0.0, 0,
                         int(window) if window is not None else None, None, chunk_size, mods,
                         out_dtype=out_dtype)
    runner = KVCacheRunner(without_tensors(call), num_splits, fp8=k_cache.dtype == FP8_DTYPE)
    new = 0 if k is None else q.shape[2]
    if block_table is None:
        runner.lengths = (new, k_cache.shape[2], None, 0, 1)
    else:
        num_blocks, page_size = k_cache.shape[:2]
        runner.lengths = (new, block_table.shape[1] * page_size, block_table, num_blocks,
                          page_size)
    return runner, mods


def kvcache_descales(q, k_cache, block_table, q_descale, k_descale, v_descale, k_scale,
                     v_scale):
    """The (q, k, v) descales of an ``attention_with_kvcache`` call, or None: per-tensor scales
    (vLLM's ``k_scale`` / ``v_scale``) become (batch, heads_kv) views of one element (no copy
    for a tensor; a float costs a host-to-device copy per call)."""
    if k_scale is not None or v_scale is not None:
        k_descale, v_descale = (
            expand_scale(name, scale, descale, q, k_cache, block_table)
            for name, scale, descale in (("k_scale", k_scale, k_descale),
                                         ("v_scale", v_scale, v_descale)))
    return public_descales(q_descale, k_descale, v_descale)


def kvcache_runner(q, k_cache, v_cache, cache_seqlens, k, v, block_table, options, sinks,
                   alibi_slopes, mod_aux, descale=None, out_dtype=None, latent=False):
    """(runner, mods) as ``attention_plan``: cached (mods None) when the call can be keyed.
    ``latent``: v_cache is k_cache's prefix (``latent_values``; the plan reads V in K)."""
    tensors = (q, k_cache, v_cache, cache_seqlens, k, v, block_table)
    if _keyable(*tensors):
        try:
            key = ("kvcache", latent, *(_opt_sig(t) for t in tensors),
                   *_options_key(options, sinks, alibi_slopes, mod_aux),
                   *_fp8_key(descale, out_dtype))
        except (TypeError, AttributeError, RuntimeError):
            key = None
        if key is not None:
            return plans.get_or_build(key, lambda: resolve_kvcache(
                q, k_cache, v_cache, cache_seqlens, k, v, block_table, options, sinks,
                alibi_slopes, mod_aux, descale, out_dtype)[0]), None
    return resolve_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, options,
                           sinks, alibi_slopes, mod_aux, descale, out_dtype)


def run_kvcache(runner, mods, q, k_cache, v_cache, cache_seqlens, k, v, block_table, sinks,
                alibi_slopes, mod_aux, descale=None):
    """(out, lse) of a planned KV-cache call (the cache lengths checked where on the host)."""
    new, max_len, _, num_blocks, page_size = runner.lengths
    check_cache_lengths(cache_seqlens, new, max_len, block_table, num_blocks, page_size)
    inputs = [t for t in (q, k_cache, v_cache, k, v) if t is not None]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    if runner.fp8 and q.dtype == FP8_DTYPE:
        _refuse_fp8_grad(*inputs)
    if mods is None and not needs_grad:
        call = with_tensors(runner.call, sinks, alibi_slopes, mod_aux, descale=descale)
        return runner(q, k_cache, v_cache, cache_seqlens, k, v, call, block_table)
    if mods is None:
        mods = with_tensors(runner.call, sinks, alibi_slopes, mod_aux, descale=descale).mods
    args = (q, k_cache, v_cache, cache_seqlens, k, v, block_table, mods.alibi_slopes,
            mods.sinks, list(mods.aux), call_spec(runner.call, runner.num_splits),
            *(mods.descale or (None, None, None)))
    if needs_grad:
        with torch.no_grad():
            out, lse = _kvcache_op(*_distinct(*args))
        return _ForwardOnly.apply(*_distinct(out, lse, *inputs))
    return _kvcache_op(*_distinct(*args))


def _kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, block_table, alibi_slopes, sinks,
                  mod_aux, spec, q_descale=None, k_descale=None, v_descale=None):
    """``fused_attention::kvcache``: append (k, v) into the caches (in place), then attend."""
    runner, call = _op_plan("kvcache-op", spec, (_values_offset(k_cache, v_cache) == 0,),
                            (q, k_cache, v_cache, cache_seqlens, k, v, block_table), sinks,
                            alibi_slopes, mod_aux,
                            lambda call, n: KVCacheRunner(call, n,
                                                          fp8=k_cache.dtype == FP8_DTYPE),
                            public_descales(q_descale, k_descale, v_descale))
    return runner(q, k_cache, v_cache, cache_seqlens, k, v, call, block_table)


def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, k, v, block_table, alibi_slopes, sinks,
                  mod_aux, spec, q_descale=None, k_descale=None, v_descale=None):
    return (new_out(q, v_cache.shape[-1], parse_spec(spec)[0].out_dtype),
            q.new_empty(tuple(q.shape[:3]), dtype=torch.float32))


_kvcache_op = _define(
    "kvcache", "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
    "Tensor? k, Tensor? v, Tensor? block_table, Tensor? alibi_slopes, Tensor? sinks, "
    "Tensor[] mod_aux, str spec, Tensor? q_descale=None, Tensor? k_descale=None, "
    "Tensor? v_descale=None) -> (Tensor, Tensor)", _kvcache_impl, _kvcache_fake)


_KVCACHE_NO_BACKWARD = (
    "kernels.attention_with_kvcache is forward-only, as is attention_varlen with block_table "
    "(generation against a KV cache or its pages): no backward, and gradients cannot flow "
    "through them. For training use kernels.attention (dense batches) or "
    "kernels.attention_varlen without block_table (packed sequences), which are "
    "differentiable; to generate with parameters that require grad, wrap the step in "
    "torch.no_grad() or torch.inference_mode().")


@torch.library.custom_op("fused_attention::kvcache_no_backward", mutates_args=())
def _kvcache_no_backward(grad: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The backward of ``attention_with_kvcache``: raises when it runs. An op, not a plain
    ``raise``, so that torch.compile can trace the graph (a forward that is never
    differentiated compiles and runs) while a real backward still fails."""
    raise RuntimeError(_KVCACHE_NO_BACKWARD)


@_kvcache_no_backward.register_fake
def _(grad, inputs):
    return [torch.empty_like(x) for x in inputs]


class _ForwardOnly(torch.autograd.Function):
    """Attaches (out, lse) of a forward-only op (KV cache, paged packed sequences) to the
    inputs that require grad, with a backward that says the op is forward-only (a mutating op
    cannot have an autograd formula; PyTorch's own error would only say that none was
    registered)."""

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


# --------------------------------------------------------------------------------------------
# Packed queries over a paged cache (forward only)
# --------------------------------------------------------------------------------------------
def grid_rows(longest, total_q):
    """The query-row bound a paged plan's grid is built for: the longest query sequence
    rounded up to a power of two, at most the packed rows. Batches whose longest sequence
    changes (a serving engine's steps) then share a few plans instead of one per length; the
    grid covers a few more rows, whose programs return at once."""
    return max(1, min(1 << max(int(longest) - 1, 0).bit_length(), int(total_q)))


def paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                 max_seqlen_q, options, sinks, alibi_slopes, mod_aux, descale=None,
                 out_dtype=None, out=None, latent=False):
    """(out, lse) of ``attention_varlen(..., block_table=)``: resolved once per signature.

    The key holds ``grid_rows`` of the longest query sequence: ``max_seqlen_q`` as given for
    tensors on a GPU (no host read: a serving step neither syncs nor breaks CUDA-graph
    capture), else read on the host (free on the CPU; once per cu_seqlens_q tensor and version
    on a GPU without a bound). ``out``: written in place (its strides in the key).
    ``latent``: v_cache is k_cache's prefix (``latent_values``; in the key)."""
    (causal, dropout_p, softmax_scale, window, num_splits, softcap, chunk_size, score_mod,
     mask_mod, _) = options
    tensors = (q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out)
    key = None
    if _keyable(*tensors):
        try:
            # (a given bound is trusted off the host, read and checked on it: one rule,
            # check_cu_seqlens', as the miss path's check_paged_varlen applies it)
            bound = check_cu_seqlens(cu_seqlens_q, cu_seqlens_q, q, q, max_seqlen_q,
                                     max_seqlen_q, trust_hints=True)[0]
            key = ("paged-varlen", latent, *(_opt_sig(t) for t in tensors),
                   grid_rows(bound, q.shape[0]),
                   *_options_key(options, sinks, alibi_slopes, mod_aux),
                   *_fp8_key(descale, out_dtype))
        except (TypeError, AttributeError, RuntimeError, ValueError, IndexError):
            key = None   # the checks below say what is wrong
    runner = None if key is None else plans.get(key)
    if runner is None:
        causal, max_q, _ = check_paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
                                              seqused_k, block_table, max_seqlen_q, causal,
                                              dropout_p, softmax_scale, window)
        mods, chunk_size = check_mods(q, causal, window, softcap, sinks, chunk_size,
                                      alibi_slopes, score_mod, mask_mod, mod_aux,
                                      batch=cu_seqlens_q.numel() - 1)
        checked, out_dtype = check_fp8(q.dtype, k_cache.dtype, descale, out_dtype,
                                       cu_seqlens_q.numel() - 1, k_cache.shape[2], q.device)
        mods = _with_fp8(mods, checked)
        check_num_splits(num_splits)
        if out is not None:
            check_out(out, (*q.shape[:2], v_cache.shape[-1]), out_dtype_of(q.dtype, out_dtype),
                      q.device)
        if softmax_scale is None:
            softmax_scale = default_softmax_scale(q.shape[-1])
        call = AttentionCall(causal, float(softmax_scale), 0.0, 0,
                             int(window) if window is not None else None, None, chunk_size,
                             mods, out_dtype=out_dtype)
        # (max_q is -1 under tracing without a bound: the op reads it at run time)
        runner = PagedVarlenRunner(without_tensors(call), num_splits,
                                   grid_rows(max_q, q.shape[0]) if max_q >= 0 else max_q,
                                   fp8=k_cache.dtype == FP8_DTYPE)
        if key is not None:
            plans.put(key, runner)
    if seqused_k is None:
        seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    num_blocks, page_size = k_cache.shape[:2]
    check_cache_lengths(seqused_k, 0, block_table.shape[1] * page_size, block_table,
                        num_blocks, page_size)
    call = with_tensors(runner.call, sinks, alibi_slopes, mod_aux, descale=descale)
    inputs = [t for t in (q, k_cache, v_cache) if t.requires_grad]
    needs_grad = torch.is_grad_enabled() and bool(inputs)
    if runner.fp8 and q.dtype == FP8_DTYPE:
        _refuse_fp8_grad(*inputs)
    if key is not None and not needs_grad:
        return runner(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, call, out=out)
    mods = call.mods
    args = (q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, runner.max_seqlen_q,
            mods.alibi_slopes, mods.sinks, list(mods.aux),
            call_spec(runner.call, runner.num_splits), *(mods.descale or (None, None, None)))
    if needs_grad:
        with torch.no_grad():
            res, lse = _varlen_paged_op(*_distinct(*args))
        res, lse = _ForwardOnly.apply(*_distinct(res, lse, *inputs))
    else:
        res, lse = _varlen_paged_op(*_distinct(*args))
    if out is None:
        return res, lse
    out.copy_(res)   # (the op returns a new tensor: a custom op cannot alias its output)
    return out, lse


def write_kv_cache(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale):
    """``kernels.write_kv_cache``: validated once per signature (``check_slot_write``), then
    the cached ``SlotWriter`` runs. A latent cache (v_cache = k_cache[..., :Dv], v None:
    ``latent_values``) writes k's first Dv columns again as the values (the same bytes)."""
    _, v, (v_scale,) = latent_values(k_cache, v_cache, k, v, (k_scale,), (v_scale,))
    tensors = (k_cache, v_cache, k, v, slot_mapping)
    key = None
    if _keyable(*tensors) and not (host_readable(slot_mapping) and k.shape[0]):
        # (slots on the host are checked per call: cheap, and they change every call)
        key = ("slot-write", *map(_opt_sig, tensors), type(k_scale), type(v_scale))
    writer = None if key is None else plans.get(key)
    if writer is None:
        check_slot_write(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
        writer = SlotWriter(fp8=k_cache.dtype == FP8_DTYPE)
        if key is not None:
            plans.put(key, writer)
    descale = None
    if k_scale is not None or v_scale is not None:   # (an FP8 cache: checked with the key)
        rows = (k.shape[0], k.shape[1])
        # (expand_scale of a 3-D k and no cache: a (1, 1) view, then one per row and head)
        descale = Descale(None, *(expand_scale(name, scale, None, k, None, None)
                                  .expand(rows) if scale is not None else None
                                  for name, scale in (("k_scale", k_scale),
                                                      ("v_scale", v_scale))))
    writer(k_cache, v_cache, k, v, slot_mapping, descale)


def _varlen_paged_impl(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table,
                       max_seqlen_q, alibi_slopes, sinks, mod_aux, spec, q_descale=None,
                       k_descale=None, v_descale=None):
    runner, call = _op_plan(
        "paged-varlen-op", spec, (max_seqlen_q, _values_offset(k_cache, v_cache) == 0),
        (q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table), sinks, alibi_slopes,
        mod_aux,
        lambda call, n: PagedVarlenRunner(call, n, max_seqlen_q,
                                          fp8=k_cache.dtype == FP8_DTYPE),
        public_descales(q_descale, k_descale, v_descale))
    out, lse = runner(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, call)
    return _in_fake_layout(out, q, v_cache.shape[-1], call.out_dtype), lse


def _varlen_paged_fake(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table,
                       max_seqlen_q, alibi_slopes, sinks, mod_aux, spec, q_descale=None,
                       k_descale=None, v_descale=None):
    return (new_out(q, v_cache.shape[-1], parse_spec(spec)[0].out_dtype),
            q.new_empty(lse_shape(q, True), dtype=torch.float32))


_varlen_paged_op = _define(
    "varlen_paged", "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
    "Tensor seqused_k, Tensor block_table, SymInt max_seqlen_q, Tensor? alibi_slopes, "
    "Tensor? sinks, Tensor[] mod_aux, str spec, Tensor? q_descale=None, "
    "Tensor? k_descale=None, Tensor? v_descale=None) -> (Tensor, Tensor)",
    _varlen_paged_impl, _varlen_paged_fake)


# --------------------------------------------------------------------------------------------
# Entry points for integrations that own their autograd formula (kernels.sdpa, distributed)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class IntegrationCall:
    """One ``forward_with_lse`` / ``backward`` call, resolved: its ``plan`` and ``mods`` (as
    ``attention_plan`` returns them), ``packed`` (cu_seqlens and max lengths, or None), the
    seed tensor and the ``mod_aux`` of its ``attn_mask`` (() without one)."""
    plan: AttentionPlan
    mods: object
    packed: object
    seed_t: torch.Tensor
    mod_aux: tuple = ()

    @property
    def cu(self):
        return (None, None) if self.packed is None else self.packed[:2]

    @property
    def max_seqlens(self):
        return (-1, -1) if self.packed is None else self.packed[2:]


def integration_plan(q, k, v, causal, dropout_p, softmax_scale, window, cu_seqlens_q,
                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, drop_layout, seed,
                     attn_mask=None) -> IntegrationCall:
    """The ``IntegrationCall`` of a ``forward_with_lse`` / ``backward`` call, as
    ``attention_plan`` (``seed``: an int, or a one-element int64 tensor on the device;
    ``attn_mask``: ``attention``'s, dense calls only)."""
    score_mod = mask_mod = None
    mod_aux = ()
    if attn_mask is not None:
        if cu_seqlens_q is not None:
            raise ValueError("attn_mask is for dense calls (batch, heads, seq, head_dim); "
                             "packed sequences (cu_seqlens) take none")
        score_mod, mask_mod, mod_aux = check_attn_mask(attn_mask, q, k, None, None, ())
    options = (causal, dropout_p, softmax_scale, window, 0, None, None, score_mod, mask_mod,
               None if drop_layout is None else tuple(drop_layout))
    packed = None if cu_seqlens_q is None else _packed(cu_seqlens_q, cu_seqlens_k, q, k,
                                                         max_seqlen_q, max_seqlen_k)
    plan, mods = attention_plan(q, k, v, options, mod_aux=mod_aux, packed=packed)
    if plan.fp8:
        raise TypeError(f"FP8 (float8_e4m3fn) inputs are forward-only: they go through "
                        f"kernels.attention / attention_varlen; this entry point has a backward "
                        f"and takes float16, bfloat16 or float32, got q {q.dtype}")
    return IntegrationCall(plan, mods, packed, seed_tensor(plan.dropout_p, seed, q.device),
                           tuple(mod_aux))


def check_grad_shapes(do, q, out, lse, packed):
    if do.shape != q.shape[:-1] + out.shape[-1:] or out.shape[:-1] != q.shape[:-1] \
            or lse.shape != lse_shape(q, packed):
        raise ValueError(f"do and out must have q's shape {tuple(q.shape)} (with v's head_dim) "
                         f"and lse {lse_shape(q, packed)}, got do {tuple(do.shape)}, out "
                         f"{tuple(out.shape)}, lse {tuple(lse.shape)}")


def integration_forward(c: IntegrationCall, q, k, v):
    """(out, lse) of the call ``c``, without autograd."""
    with torch.no_grad():
        if c.mods is not None:
            return _fwd_op(*_distinct(q, k, v, *c.cu, *c.max_seqlens, c.seed_t, None, None,
                                      list(c.mods.aux),
                                      call_spec(c.plan.call, c.plan.num_splits)))
        call = with_tensors(c.plan.call, None, None, c.mod_aux)
        return c.plan.forward(q, k, v, c.seed_t, call, *c.cu)


def integration_backward(c: IntegrationCall, do, q, k, v, out, lse, aux_grad=False):
    """(dq, dk, dv) of the call ``c``, without autograd; with ``aux_grad`` (an additive
    ``attn_mask``'s gradient wanted) also the fp32 gradient of its float32 copy, ``mod_aux[0]``
    (``tensor_mask.bias_aux``)."""
    lse = lse.float().contiguous()
    aux = c.mod_aux if c.mods is None else c.mods.aux
    score_mod = c.plan.call.mods.score_mod
    wanted = [aux_grad and score_mod is not None and i in score_mod.grad_aux
              for i in range(len(aux))]
    with torch.no_grad():
        if c.mods is not None:
            res = _bwd_op(*_distinct(do, q, k, v, out, lse, *c.cu, *c.max_seqlens, c.seed_t,
                                     None, None, list(aux),
                                     call_spec(c.plan.call, c.plan.num_splits), wanted, False))
            grads, daux = tuple(res[:3]), res[3:]
        else:
            daux = aux_grad_buffers(score_mod, aux) if any(wanted) else None
            grads = c.plan.backward(do, q, k, v, out, lse, c.seed_t,
                                    with_tensors(c.plan.call, None, None, aux), *c.cu, daux=daux)
    if not aux_grad:
        return grads
    assert any(wanted), "aux_grad asks for the gradient of an additive attn_mask"
    return (*grads, daux[wanted.index(True)])


__all__ = ["plans", "PlanCache"]
