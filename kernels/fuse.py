"""Swap the book's causal attention modules inside any model for their fused twins, in place.

    model, count = fuse_attention(GPTModel(cfg))   # every TransformerBlock.att is now fused

Recognised (by class or by duck typing, so user copies of the book's classes work too):

* MultiHeadAttention-like: ``W_query``, ``W_key``, ``W_value`` and ``out_proj`` are modules
  (see projections below), has ``num_heads``, ``head_dim``, ``d_out``, ``dropout`` (with
  ``.p``) and a causal ``mask``
  -> :class:`~kernels.modules.FusedMultiHeadAttention`;
* CausalAttention-like: the same without ``out_proj``
  -> :class:`~kernels.modules.FusedCausalAttention`;
* MultiHeadAttentionWrapper-like: only a ModuleList ``heads`` of CausalAttention-like modules
  -> :class:`~kernels.modules.FusedMultiHeadAttentionWrapper`;
* the attention classes of ``llms-from-scratch`` (the book's companion package: KV-cache GPT-2,
  Llama 3, Qwen 3 and their KV-cache variants), recognised by class, never by structure, and
  only when their ``forward`` is the package's -> their twins in :mod:`kernels.book`.

Left alone: ``SelfAttention_v1/v2`` (no mask: not causal), modules whose ``mask`` is not the
causal pattern, already fused modules, modules whose ``forward`` takes more than ``x`` (e.g.
``use_cache=``), and look-alikes or subclasses whose ``forward`` is not the book's and does not
pass a numerical check against the twin (another scale, rotary embeddings, ...).
``fuse_attention(model, verbose=True)`` says what was swapped and why the rest was not;
``strict=True`` makes anything left alone an error.

Projections (``W_query``, ``W_key``, ``W_value``, ``out_proj``) may be any module: the twins
hold and call the very same modules, so LoRA applied before fusing (the book's appendix-E
``replace_linear_with_lora``) keeps training, and LoRA applied after fusing wraps the twins'
projections just as it would the originals'. Known projections are ``nn.Linear`` and the
package's ``llms_from_scratch.appendix_e.LinearWithLoRA`` around one (by class, its forward
the package's). Any other projection is an unknown module (a user's LoRA copy, a Linear
followed by tanh, ...): the module is then swapped only after the numerical check, even when
its own forward is the book's, and left alone if the check fails or cannot run (e.g. the input
width cannot be found). The package classes of :mod:`kernels.book`, recognised by class, call
their projections exactly as the package does (same modules, same order): any projection
module works there unchecked.
"""
import contextlib
import copy
import inspect
import logging
import sys

import torch
import torch.nn as nn

from .book import BookTwin, _book_class, book_twin
from .model_checks import (
    causal_mask_mismatch,
    context_length_of,
    input_width,
    is_plain_linear,
    projection_features,
)
from .modules import FusedCausalAttention, FusedMultiHeadAttention, FusedMultiHeadAttentionWrapper

logger = logging.getLogger(__name__)

__all__ = ["fuse_attention"]


def _has_causal_mask(module):
    """True if ``module.mask`` is the book's (ctx, ctx) causal mask (triu ones, diagonal=1)."""
    mask = getattr(module, "mask", None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        return False
    if mask.is_meta:
        return True  # no values to check; the shape is right
    ctx = context_length_of(module)
    return mask.shape[0] == ctx and causal_mask_mismatch(mask, ctx, ctx) is None


def _has_qkv(module):
    """Projections W_query, W_key, W_value are modules (nn.Linear, LoRA wrappers, any)."""
    return all(isinstance(getattr(module, name, None), nn.Module)
               for name in ("W_query", "W_key", "W_value"))


def _has_dropout(module):
    return isinstance(getattr(module, "dropout", None), nn.Module) and \
        hasattr(module.dropout, "p")


def _is_causal_attention(module):
    """reference.CausalAttention or a look-alike (no out_proj)."""
    return (_has_qkv(module) and not hasattr(module, "out_proj") and _has_dropout(module)
            and _has_causal_mask(module))


def _is_multi_head_attention(module):
    """reference.MultiHeadAttention or a look-alike (out_proj + head bookkeeping)."""
    if not (_has_qkv(module) and isinstance(getattr(module, "out_proj", None), nn.Module)
            and _has_dropout(module) and _has_causal_mask(module)):
        return False
    try:
        num_heads, head_dim, d_out = int(module.num_heads), int(module.head_dim), int(module.d_out)
    except (AttributeError, TypeError, ValueError):
        return False
    out_features = projection_features(module.W_query)[1]   # None for an unknown projection
    return num_heads >= 1 and num_heads * head_dim == d_out and \
        out_features in (None, d_out)


def _is_wrapper(module):
    """reference.MultiHeadAttentionWrapper or a look-alike: nothing but ``heads``, all causal."""
    heads = getattr(module, "heads", None)
    if not isinstance(heads, nn.ModuleList) or len(heads) == 0:
        return False
    # Any other child or parameter would take part in a forward we do not reproduce.
    if [name for name, _ in module.named_children()] != ["heads"]:
        return False
    if any(True for _ in module.named_parameters(recurse=False)):
        return False
    return all(_is_causal_attention(h) for h in heads)


#: Modules whose classes' ``forward`` is the book's own (recognised without a numerical check);
#: looked up in ``sys.modules`` only, never imported.
_KNOWN_FORWARD_MODULES = ("reference.modules", "llms_from_scratch.ch03")
_KNOWN_FORWARD_CLASSES = ("CausalAttention", "MultiHeadAttention", "MultiHeadAttentionWrapper")


def _has_known_forward(module):
    """True if ``type(module).forward`` is the book's chapter-3 forward of that name."""
    fwd = getattr(type(module), "forward", None)
    for mod_name in _KNOWN_FORWARD_MODULES:
        mod = sys.modules.get(mod_name)
        for cls_name in _KNOWN_FORWARD_CLASSES:
            cls = getattr(mod, cls_name, None) if mod is not None else None
            if cls is not None and getattr(cls, "forward", None) is fwd:
                return True
    return False


#: Projection wrappers whose forward is known (``linear(x) + lora(x)``), by "module.Class";
#: looked up in ``sys.modules`` only, never imported.
_KNOWN_LORA = ("llms_from_scratch.appendix_e", "LinearWithLoRA", "LoRALayer")


def _known_projection(proj):
    """True if ``proj`` is an nn.Linear (its forward) or the package's LinearWithLoRA, with the
    package's forward and LoRALayer, around one."""
    if is_plain_linear(proj):
        return True
    mod = sys.modules.get(_KNOWN_LORA[0])
    wrapper, layer = (getattr(mod, name, None) if mod is not None else None
                      for name in _KNOWN_LORA[1:])
    if wrapper is None or layer is None:
        return False
    return (isinstance(proj, wrapper) and type(proj).forward is wrapper.forward
            and is_plain_linear(getattr(proj, "linear", None))
            and isinstance(getattr(proj, "lora", None), layer)
            and type(proj.lora).forward is layer.forward)


def _projections_known(module):
    """True if every projection of ``module`` (each head's, for a wrapper) is known."""
    mods = list(module.heads) if hasattr(module, "heads") else [module]
    names = ("W_query", "W_key", "W_value", "out_proj")
    return all(_known_projection(getattr(m, name)) for m in mods for name in names
               if getattr(m, name, None) is not None)


def _takes_only_x(module):
    """True if ``module.forward`` accepts exactly one positional argument and nothing else.

    The chapter-3 twins' forward is ``forward(x)``; any extra parameter (even a defaulted one
    such as ``use_cache=False``, or ``*args``/``**kwargs``) could be passed by the caller and
    would then fail or be ignored by the twin: never swapped.
    """
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)


@contextlib.contextmanager
def _eval_mode(*modules):
    """Put ``modules`` (and all their submodules) in eval mode; restore every flag afterwards."""
    flags = [(m, m.training) for root in modules for m in root.modules()]
    try:
        for root in modules:
            root.eval()
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _first_param(module):
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point():
            return t
    return None


def _in_features(module):
    """Input width for the numerical check: the projections' own (``input_width``), else the
    first ``in_features`` among W_query's submodules (a guess: if wrong, the check fails and the
    module is left alone)."""
    first = module.heads[0] if hasattr(module, "heads") else module
    d_in = input_width(first)
    if d_in is None:
        d_in = next((m.in_features for m in first.W_query.modules()
                     if isinstance(getattr(m, "in_features", None), int)), None)
    if d_in is None:
        raise ValueError("unknown input width")
    return int(d_in)


def _numerical_check(module, twin, seed=0):
    """None if ``twin`` reproduces ``module`` on a small random input, else why not.

    Both run once in eval mode without grad on x ~ N(0, 1) of shape (2, min(ctx, 8), d_in), in
    the module's own dtype and device, with a fixed seed (the global RNG state is restored).
    Parity rule (reference/parity.py): with ``ref`` a float64 copy of ``module``, ``ref_lowp``
    ``module`` itself, the twin passes when ``max|twin - ref| <= 2 max|ref_lowp - ref| + floor``
    with ``floor = 4 eps(dtype) max(|ref|max, 1e-3)``. If no float64 copy can be made (e.g. a
    module that refuses ``.double()``), the budget is ``64 eps(dtype) max(|out|max, 1e-3)``
    against ``module``'s own output: a few rounding errors of the output's magnitude.
    """
    ref_t = _first_param(module)
    if ref_t is None or ref_t.is_meta:
        return "cannot check numerically (no parameters with values)"
    dtype, device = ref_t.dtype, ref_t.device
    try:
        ctx = context_length_of(module.heads[0] if hasattr(module, "heads") else module)
        n, d_in = min(ctx, 8), _in_features(module)
    except (AttributeError, TypeError, ValueError, IndexError):
        return "cannot check numerically (unknown input size)"
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), _eval_mode(module, twin):
        torch.manual_seed(seed)
        x = torch.randn(2, n, d_in, device=device, dtype=dtype)
        try:
            lowp = module(x)
            out = twin(x)
        except Exception as e:  # noqa: BLE001 - any failure means "do not swap"
            return f"forward differs (check failed: {type(e).__name__}: {e})"
        if not (isinstance(lowp, torch.Tensor) and isinstance(out, torch.Tensor)
                and lowp.shape == out.shape):
            return "forward differs (output is not a tensor of the twin's shape)"
        eps = torch.finfo(dtype).eps
        try:
            ref = copy.deepcopy(module).double()(x.double()).double()
        except Exception:  # noqa: BLE001
            ref = None
        if ref is not None and ref.shape == out.shape:
            err = (out.double() - ref).abs().max().item()
            base = (lowp.double() - ref).abs().max().item()
            budget = 2.0 * base + 4.0 * eps * max(ref.abs().max().item(), 1e-3)
        else:
            err = (out.double() - lowp.double()).abs().max().item()
            budget = 64.0 * eps * max(lowp.abs().max().item(), 1e-3)
    if not err <= budget:  # also catches NaN
        return f"forward differs (max error {err:.3g} > budget {budget:.3g})"
    return None


def _looks_like_attention(module):
    return (any(hasattr(module, n) for n in ("W_query", "W_key", "W_value"))
            or isinstance(getattr(module, "heads", None), nn.ModuleList)
            or "attention" in type(module).__name__.lower())


def _classify(module):
    """(twin, reason): twin is the fused replacement, else reason says why not.

    (None, None) for modules that do not look like attention (not reported).
    """
    if isinstance(module, (FusedCausalAttention, FusedMultiHeadAttention,
                           FusedMultiHeadAttentionWrapper, BookTwin)):
        return None, None
    found = _book_class(module)
    if found is not None:
        cls, _ = found
        if type(module).forward is not cls.forward:
            return None, (f"forward differs: {type(module).__name__}.forward overrides "
                          f"{cls.__module__}.{cls.__qualname__}.forward")
        twin = book_twin(module)
        if twin is None:
            return None, "its head layout is one the fused twin cannot run"
        return twin, None
    if _is_multi_head_attention(module):
        build, known = FusedMultiHeadAttention.from_module, _has_known_forward(module)
    elif _is_causal_attention(module):
        build, known = FusedCausalAttention.from_module, _has_known_forward(module)
    elif _is_wrapper(module):
        build = FusedMultiHeadAttentionWrapper.from_module
        known = _has_known_forward(module) and all(_has_known_forward(h) for h in module.heads)
    else:
        if not _looks_like_attention(module):
            return None, None
        if (_has_qkv(module) or hasattr(module, "heads")) and not _has_causal_mask(module) \
                and not isinstance(getattr(module, "heads", None), nn.ModuleList):
            return None, "no causal mask"
        return None, "not a recognised attention layout"
    if not _takes_only_x(module):
        return None, "forward signature differs (the fused twin takes only forward(x))"
    try:
        twin = build(module)
    except (AttributeError, TypeError, ValueError) as e:
        return None, f"cannot build the fused twin ({e})"
    # An unknown projection module is checked too, whatever the module's own forward.
    if not (known and _projections_known(module)):
        why = _numerical_check(module, twin)
        if why is not None:
            return None, why
    return twin, None


def _fused_twin(module):
    """The fused replacement of ``module``, or None if it is not a recognised attention."""
    return _classify(module)[0]


def fuse_attention(model, verbose=False, strict=False):
    """Replace, in place, every causal attention module of ``model`` by its fused twin.

    The twins are built with ``from_module``: they hold the very same Parameter objects (an
    optimizer created before the swap keeps updating the model), on the same device and dtype,
    in the same train/eval mode; the reference's O(context_length^2) mask buffers are dropped.
    State dict keys are unchanged, so checkpoints load before and after fusing.

    Safety: a module is swapped only if its ``forward`` is the book's own (the chapter-3
    classes of ``reference`` / ``llms_from_scratch.ch03``, or a package class of
    :mod:`kernels.book`), or, for a look-alike or a subclass overriding ``forward``, if its
    forward takes only ``x`` and passes a numerical check against the twin (see
    ``_numerical_check``). Package classes whose ``forward`` is overridden are left alone.
    Projections may be any module (LoRA before or after fusing); a chapter-3 module whose
    projections are neither nn.Linear nor the package's ``LinearWithLoRA`` is swapped only
    after the numerical check.

    Args:
        model: any nn.Module (a GPTModel, a single attention module, ...). Tensor shapes are
            unchanged by the swap: each attention still maps (b, n, d_in) -> (b, n, d_out).
        verbose: print one line per attention-looking module: "swapped" or "left alone: why".
            The same lines always go to the ``kernels.fuse`` logger (INFO).
        strict: raise ValueError, listing them, if any attention-looking module is left alone
            (the model is then left partly fused: the swaps already made stay).

    Returns:
        (model, count): the model (a new module if ``model`` itself was an attention module,
        else the same object) and the number of modules swapped (a wrapper counts once).
    """
    report = []
    root, why = _classify(model)
    if root is not None:
        report.append(("<root>", model, None))
        result = (root, 1)
    else:
        if why is not None:
            report.append(("<root>", model, why))
        result = (model, _fuse_children(model, {}, "", report))
    left = []
    for name, module, why in report:
        line = (f"{name} ({type(module).__name__}): "
                + ("swapped" if why is None else f"left alone: {why}"))
        logger.info(line)
        if verbose:
            print(f"fuse_attention: {line}")
        if why is not None:
            left.append(line)
    if strict and left:
        raise ValueError("fuse_attention(strict=True): attention modules left alone:\n  "
                         + "\n  ".join(left))
    return result


def _fuse_children(module, twins, prefix="", report=None):
    """Swap recognised children of ``module`` (recursively); returns the number newly swapped.

    ``twins`` maps id(original) -> (original, twin or None), so a module shared by several
    parents gets one twin and stays shared (holding the original keeps its id from being
    reused), and is checked and reported once. ``report`` collects (name, module, why).
    """
    count = 0
    report = [] if report is None else report
    # Not named_children(): it yields a module shared under two names only once.
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        full = f"{prefix}{name}"
        if id(child) in twins:
            twin = twins[id(child)][1]
        else:
            twin, why = _classify(child)
            twins[id(child)] = (child, twin)
            if twin is not None:
                count += 1
                report.append((full, child, None))
            elif why is not None:
                report.append((full, child, why))
        if twin is not None:
            # setattr re-registers the child under the same name (works for ModuleList and
            # Sequential too, whose children are named "0", "1", ...).
            setattr(module, name, twin)
        else:
            count += _fuse_children(child, twins, f"{full}.", report)
    return count
