"""Checks and read-outs the integrations share (modules, fuse_attention, the book's twins).

* The kernels' causal pattern written as the models write their masks (True = masked, what
  ``scores.masked_fill(mask, -inf)`` reads), derived from :func:`kernels.ops.visible_mask`:
  :func:`causal_masked` builds it, :func:`causal_mask_mismatch` compares a model's mask with it
  (the one "is this mask the kernels' pattern" test of the integrations).
* :func:`check_head_split`: ``d_out`` (or another width) splits into ``num_heads`` equal heads.
* What a user's attention module declares: :func:`context_length_of`,
  :func:`projection_features`, :func:`input_width`, :func:`is_plain_linear`.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops

__all__ = [
    "causal_masked",
    "causal_mask_mismatch",
    "check_head_split",
    "context_length_of",
    "projection_features",
    "input_width",
    "is_plain_linear",
]


# ---------------------------------------------------------------------------------------------
# The kernels' causal pattern, as a mask
# ---------------------------------------------------------------------------------------------

def causal_masked(q_len, k_len, device=None):
    """bool (q_len, k_len): True where the kernels' causal rule hides key j from query i
    (``~visible_mask``: causal aligned bottom-right, query i sees key j iff
    ``j <= i + k_len - q_len``). With ``q_len == k_len`` it is the book's
    ``triu(ones(n, n), diagonal=1)``."""
    return ~ops.visible_mask(q_len, k_len, causal=True, device=device)


def _ragged_causal_masked(q_len, k_lens, device=None):
    """bool (len(k_lens), 1, q_len, max(k_lens)): row r is :func:`causal_masked` over its own
    ``k_lens[r]`` keys (left-aligned), its columns past them masked too (ragged per-row
    caches)."""
    k_max = max(k_lens)
    rows = [F.pad(causal_masked(q_len, k, device), (0, k_max - k), value=True) for k in k_lens]
    return torch.stack(rows)[:, None]


def causal_mask_mismatch(mask, q_len, k_lens):
    """None if ``mask`` is the kernels' causal pattern (:func:`causal_masked`), else the index
    (a tuple of ints) of its first difference from it.

    ``mask`` is read as the models read it, True (any non-zero value) = masked, and broadcast
    against the pattern; the index is in the broadcast shape. ``k_lens``: one int, the pattern
    (q_len, k_lens); or one int per batch row, the (len(k_lens), 1, q_len, max(k_lens)) pattern
    of ragged per-row caches (keys left-aligned, columns past a row's keys masked). Reads the
    verdict back: one host sync (two on a mismatch).
    """
    if isinstance(k_lens, int):
        expected = causal_masked(q_len, k_lens, mask.device)
    else:
        expected = _ragged_causal_masked(q_len, k_lens, mask.device)
    diff = mask.bool() != expected
    if not bool(diff.any()):
        return None
    return tuple(int(t) for t in diff.nonzero()[0])


# ---------------------------------------------------------------------------------------------
# Head split
# ---------------------------------------------------------------------------------------------

def check_head_split(width, num_heads, *, name="d_out", when=""):
    """The head width ``width // num_heads``; ValueError unless ``width`` (called ``name`` in
    the message, ``when`` appended to the rule) splits into ``num_heads`` equal heads."""
    if num_heads < 1 or width % num_heads != 0:
        rest = width % num_heads if num_heads >= 1 else "undefined"
        raise ValueError(f"{name} must be divisible by num_heads{when}: got {name}={width}, "
                         f"num_heads={num_heads} ({name} % num_heads = {rest})")
    return width // num_heads


# ---------------------------------------------------------------------------------------------
# What an attention module declares
# ---------------------------------------------------------------------------------------------

def context_length_of(module):
    """context_length of a reference (or look-alike) module: its attribute, else its mask's."""
    ctx = getattr(module, "context_length", None)
    if ctx is None:
        ctx = module.mask.shape[-1]
    return int(ctx)


def _linear_of(proj):
    """The ``nn.Linear`` that ``proj`` is, or wraps as ``proj.linear`` (the book's
    ``LinearWithLoRA`` and its copies, possibly nested), else None."""
    for _ in range(8):
        if isinstance(proj, nn.Linear):
            return proj
        proj = getattr(proj, "linear", None)
        if not isinstance(proj, nn.Module):
            return None
    return None


def projection_features(proj):
    """(in_features, out_features) of a projection module, each None where unknown.

    Read from ``proj`` itself when it declares them as ints (``nn.Linear``, many adapters),
    else from the Linear it wraps as ``.linear`` (LoRA wrappers add a term of the same
    width). Never guessed from other submodules: a wrong width would reject valid inputs.
    """
    out = []
    for name in ("in_features", "out_features"):
        value = getattr(proj, name, None)
        if not isinstance(value, int):
            lin = _linear_of(proj)
            value = getattr(lin, name, None) if lin is not None else None
        out.append(value if isinstance(value, int) else None)
    return tuple(out)


def input_width(module):
    """d_in of an attention module: the first known ``in_features`` of its W_query, W_key,
    W_value projections (see :func:`projection_features`), else None."""
    for name in ("W_query", "W_key", "W_value"):
        d_in = projection_features(getattr(module, name))[0]
        if d_in is not None:
            return d_in
    return None


def is_plain_linear(proj):
    """True for an nn.Linear whose forward is nn.Linear's (a subclass with its own forward, a
    LoRA-style Linear, is not plain: it must be called, not stacked or assumed)."""
    return isinstance(proj, nn.Linear) and type(proj).forward is nn.Linear.forward
