"""DeepSeek's multi-head latent attention (MLA, DeepSeek V2 / V3): the float64 oracle of the
absorbed latent-cache kernels, in plain PyTorch.

A cache row of MLA holds, per token, ``c_kv`` (kv_lora_rank = 512 wide: the normed output of
``kv_a_proj``) and ``k_pe`` (64 wide: the rotary key, shared by every head). The model's
**non-absorbed** attention up-projects them per head ``h``::

    k_nope[h] = c_kv @ W_UK[h]^T          (len, qk_nope_head_dim = 128)
    v[h]      = c_kv @ W_UV[h]            (len, v_head_dim = 128)
    k[h]      = [k_nope[h], k_pe]         (len, 192)
    q[h]      = [q_nope[h], q_pe[h]]      (q_len, 192)
    out[h]    = softmax(q[h] k[h]^T * scale, bottom-right causal) @ v[h]

with the model's scale ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (1 / sqrt(192)).
The **absorbed** form (FlashMLA's decode) folds W_UK into the query and W_UV into the
output, so every query head attends to the one latent head, rows ``[c_kv, k_pe]`` (576 wide),
with values the rows' first 512 columns::

    q_lat[h]   = [q_nope[h] @ W_UK[h], q_pe[h]]      (q_len, 576)    ``absorb_query``
    out_lat[h] = softmax(q_lat[h] rows^T * scale) @ c_kv             (q_len, 512)
    out[h]     = out_lat[h] @ W_UV[h]                                 ``expand_output``

``q_lat[h] . row = q_nope[h] . k_nope[h] + q_pe[h] . k_pe``: the same scores, so the same
softmax, lse and (by linearity) output. ``mla_attention`` computes the non-absorbed form (the
oracle); ``latent_rows``, ``absorb_query`` and ``expand_output`` build the absorbed inputs and
map the absorbed output back. ``split_kv_b_proj`` reads W_UK / W_UV out of DeepSeek's
``kv_b_proj.weight``.

Nothing here imports ``kernels``: the oracle must not share the code it checks.
"""
import torch

from .functional import attention

__all__ = ["mla_attention", "latent_rows", "absorb_query", "expand_output", "split_kv_b_proj"]


def split_kv_b_proj(weight, heads, qk_nope_head_dim=128, v_head_dim=128):
    """(W_UK (heads, qk_nope_head_dim, rank), W_UV (heads, rank, v_head_dim)) from DeepSeek's
    ``kv_b_proj.weight`` (heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank): its rows are,
    head after head, the head's k_nope rows then its v rows (DeepSeek's
    ``kv.view(..., heads, qk_nope_head_dim + v_head_dim).split(...)``)."""
    rank = weight.shape[-1]
    expected = (heads * (qk_nope_head_dim + v_head_dim), rank)
    if weight.dim() != 2 or tuple(weight.shape) != expected:
        raise ValueError(f"kv_b_proj.weight must be (heads * (qk_nope_head_dim + v_head_dim), "
                         f"kv_lora_rank) = {expected}; got {tuple(weight.shape)}")
    w = weight.view(heads, qk_nope_head_dim + v_head_dim, rank)
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:].transpose(1, 2)


def _check(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv=None):
    heads, q_len, nope = q_nope.shape
    shapes = (f"q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, c_kv "
              f"{tuple(c_kv.shape)}, k_pe {tuple(k_pe.shape)}, w_uk {tuple(w_uk.shape)}"
              + ("" if w_uv is None else f", w_uv {tuple(w_uv.shape)}"))
    rank, rope = c_kv.shape[-1], k_pe.shape[-1]
    ok = (q_pe.shape[:2] == (heads, q_len) and q_pe.shape[-1] == rope
          and c_kv.dim() == 2 and k_pe.dim() == 2 and k_pe.shape[0] == c_kv.shape[0]
          and tuple(w_uk.shape) == (heads, nope, rank)
          and (w_uv is None or (w_uv.dim() == 3 and w_uv.shape[:2] == (heads, rank))))
    if not ok:
        raise ValueError("MLA expects q_nope (heads, q_len, nope), q_pe (heads, q_len, rope), "
                         "c_kv (k_len, rank), k_pe (k_len, rope), w_uk (heads, nope, rank), "
                         f"w_uv (heads, rank, v_head_dim); got {shapes}")


def mla_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, *, softmax_scale, causal=True,
                  upcast=True, return_lse=False):
    """Non-absorbed MLA of one sequence (module docstring): k and v up-projected per head from
    the latent rows, then ``reference.attention`` (bottom-right causal; a query that sees no
    key gives 0 and lse -inf).

    Args:
        q_nope: (heads, q_len, qk_nope_head_dim); q_pe: (heads, q_len, qk_rope_head_dim), the
            rotary part (rotary already applied).
        c_kv: (k_len, kv_lora_rank); k_pe: (k_len, qk_rope_head_dim), shared by every head.
        w_uk: (heads, qk_nope_head_dim, kv_lora_rank); w_uv: (heads, kv_lora_rank, v_head_dim).
        softmax_scale: the caller's (MLA: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)).
        causal: bottom-right: query i sees key j iff j <= i + k_len - q_len.
        upcast: every step in float64 (the oracle); False: every step in q_nope's dtype.

    Returns:
        out (heads, q_len, v_head_dim) and, with ``return_lse``, lse (heads, q_len).
    """
    _check(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv)
    dtype = torch.float64 if upcast else q_nope.dtype
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (t.to(dtype) for t in
                                            (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    heads = q_nope.shape[0]
    k_nope = torch.einsum("lr,hnr->hln", c_kv, w_uk)               # (heads, k_len, nope)
    k = torch.cat([k_nope, k_pe.expand(heads, *k_pe.shape)], dim=-1)
    v = torch.einsum("lr,hrv->hlv", c_kv, w_uv)                     # (heads, k_len, v_dim)
    q = torch.cat([q_nope, q_pe], dim=-1)
    out, lse = attention(q[None], k[None], v[None], causal=causal, softmax_scale=softmax_scale,
                         upcast=upcast, return_lse=True)
    return (out[0], lse[0]) if return_lse else out[0]


def latent_rows(c_kv, k_pe):
    """The absorbed cache rows ``[c_kv, k_pe]``: (..., kv_lora_rank + qk_rope_head_dim)."""
    return torch.cat([c_kv, k_pe], dim=-1)


def absorb_query(q_nope, q_pe, w_uk):
    """``q_lat = [q_nope @ W_UK, q_pe]`` per head, in float64: q_nope (..., heads, q_len,
    nope), q_pe (..., heads, q_len, rope), w_uk (heads, nope, rank) -> (..., heads, q_len,
    rank + rope). The caller rounds it to the kernels' dtype."""
    q_abs = torch.einsum("...hqn,hnr->...hqr", q_nope.double(), w_uk.double())
    return torch.cat([q_abs, q_pe.double()], dim=-1)


def expand_output(out_lat, w_uv):
    """The absorbed output mapped back, in float64: out_lat (..., heads, q_len, rank) @ W_UV
    (heads, rank, v_head_dim) per head -> (..., heads, q_len, v_head_dim)."""
    return torch.einsum("...hqr,hrv->...hqv", out_lat.double(), w_uv.double())
