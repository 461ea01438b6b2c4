"""kernels.flash_mla_interface: FlashMLA's decoding API in its layout (q (batch, seq_len_q,
heads_q, 576), a paged latent cache (num_blocks, page_block_size, heads_k, 576), values its
first 512 columns): the same numbers as the native call, the non-absorbed MLA oracle
(reference.mla_attention) by the parity rule, FlashMLA's metadata objects old and new, and
its errors (RuntimeError; NotImplementedError for sparse attention and FlashMLA's packed FP8
cache). Small shapes: the kernels run in Triton's CPU interpreter."""
import inspect

import pytest
import torch

import kernels
import reference
from kernels.flash_mla_interface import (FlashMLASchedMeta, flash_mla_with_kvcache,
                                         get_mla_metadata)
from tests.helpers import DEVICE, assert_parity

NOPE, ROPE, RANK, V_DIM = 128, 64, 512, 128
D = RANK + ROPE
SCALE = (NOPE + ROPE) ** -0.5
BF16 = torch.bfloat16


def _problem(batch=2, s_q=2, heads=8, page=64, lens=(70, 9), dtype=BF16):
    """MLA weights, the per-row latent rows and q_nope / q_pe, the absorbed q in FlashMLA's
    layout, a shuffled page pool holding the rows and its block table."""
    w_uk = torch.randn(heads, NOPE, RANK, dtype=torch.float64) / NOPE ** 0.5
    w_uv = torch.randn(heads, RANK, V_DIM, dtype=torch.float64) / RANK ** 0.5
    q_nope = torch.randn(batch, heads, s_q, NOPE).to(dtype)
    q_pe = torch.randn(batch, heads, s_q, ROPE).to(dtype)
    c_kv = [torch.randn(n, RANK).to(dtype) for n in lens]
    k_pe = [torch.randn(n, ROPE).to(dtype) for n in lens]
    q = reference.absorb_query(q_nope, q_pe, w_uk).to(dtype).transpose(1, 2).contiguous()
    width = max(-(-n // page) for n in lens)
    pool = batch * width + 1
    cache = torch.zeros(pool, page, 1, D, dtype=dtype)
    table = torch.randperm(pool)[:batch * width].view(batch, width).to(torch.int32)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        cache[table[b].long()[pos // page], pos % page, 0] = reference.latent_rows(c_kv[b],
                                                                                   k_pe[b])
    lens = torch.tensor(lens, dtype=torch.int32)
    to = lambda t: t.to(DEVICE)   # noqa: E731
    return dict(w_uk=w_uk, w_uv=w_uv, q_nope=q_nope, q_pe=q_pe, c_kv=c_kv, k_pe=k_pe,
                q=to(q), cache=to(cache), table=to(table), lens=to(lens))


def test_signature_is_flash_mla_s():
    """FlashMLA's current parameter names, order and defaults (flash_mla 1.0, 2026)."""
    params = inspect.signature(flash_mla_with_kvcache).parameters
    assert list(params) == [
        "q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
        "num_splits", "softmax_scale", "causal", "is_fp8_kvcache", "indices", "attn_sink",
        "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length"]
    assert params["causal"].default is False and params["num_splits"].default is None
    meta, none = get_mla_metadata(torch.tensor([3], dtype=torch.int32), 16, 1)  # old call
    assert isinstance(meta, FlashMLASchedMeta) and none is None
    assert [f.name for f in __import__("dataclasses").fields(FlashMLASchedMeta.Config)] == [
        "b", "s_q", "h_q", "page_block_size", "h_k", "causal", "is_fp8_kvcache", "topk",
        "extra_page_block_size", "extra_topk"]


def test_decode_matches_native_and_oracle():
    """Two query tokens per row (MTP), causal: FlashMLA's layout in and out, bit-identical to
    the native call, and the non-absorbed oracle by the parity rule (lse too). A second call
    through the old interface's tensors gives the same bits."""
    p = _problem()
    meta, splits = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(p["q"], p["cache"], p["table"], p["lens"], 512, meta,
                                      splits, softmax_scale=SCALE, causal=True)
    assert out.shape == (2, 2, 8, 512) and out.dtype == BF16 and out.is_contiguous()
    assert lse.shape == (2, 8, 2) and lse.dtype == torch.float32
    native, native_lse = kernels.attention_with_kvcache(
        p["q"].transpose(1, 2), p["cache"], p["cache"][..., :512], p["lens"], causal=True,
        softmax_scale=SCALE, block_table=p["table"], return_lse=True)
    assert torch.equal(out, native.transpose(1, 2)) and torch.equal(lse, native_lse)
    assert meta.have_initialized and meta.config.h_q == 8 and meta.config.causal is True

    ref, ref_lse, low, low_lse = [], [], [], []
    for b in range(2):
        r, rl = reference.mla_attention(p["q_nope"][b], p["q_pe"][b], p["c_kv"][b],
                                        p["k_pe"][b], p["w_uk"], p["w_uv"],
                                        softmax_scale=SCALE, return_lse=True)
        rows = reference.latent_rows(p["c_kv"][b], p["k_pe"][b])[None, None]
        lo, ll = reference.attention(p["q"][b].transpose(0, 1).cpu()[None], rows,
                                     rows[..., :RANK], softmax_scale=SCALE, upcast=False,
                                     return_lse=True)
        ref.append(r)
        ref_lse.append(rl)
        low.append(reference.expand_output(lo[0], p["w_uv"]))
        low_lse.append(ll[0])
    got = reference.expand_output(out.transpose(1, 2).cpu(), p["w_uv"]).to(BF16)
    assert_parity(got, torch.stack(ref), torch.stack(low).to(BF16))
    assert_parity(lse.cpu(), torch.stack(ref_lse).float(), torch.stack(low_lse).float(),
                  name="lse")

    old_meta = torch.zeros(4, 16, dtype=torch.int32, device=DEVICE)   # the old tensors
    old_splits = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    again = flash_mla_with_kvcache(p["q"], p["cache"], p["table"], p["lens"], 512, old_meta,
                                   old_splits, softmax_scale=SCALE, causal=True)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    # q of another layout (a transposed view): the same numbers, out still contiguous.
    strided = p["q"].transpose(1, 2).contiguous().transpose(1, 2)
    third = flash_mla_with_kvcache(strided, p["cache"], p["table"], p["lens"], 512,
                                   get_mla_metadata()[0], softmax_scale=SCALE, causal=True)
    assert third[0].is_contiguous() and torch.equal(third[0], out)


def _raises(exc, call, *words):
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"


def test_errors():
    """RuntimeError for bad arguments (ours and the native checks' underneath, same message),
    NotImplementedError for sparse attention and FlashMLA's packed FP8 cache; nothing runs."""
    p = _problem(batch=2, s_q=1, heads=4, lens=(5, 3))
    q, cache, table, lens = p["q"], p["cache"], p["table"], p["lens"]

    def call(*args, **kw):
        base = dict(q=q, k_cache=cache, block_table=table, cache_seqlens=lens, head_dim_v=512,
                    tile_scheduler_metadata=get_mla_metadata()[0])
        base.update(kw)
        return lambda: flash_mla_with_kvcache(**base)

    _raises(NotImplementedError, call(indices=torch.zeros(2, 1, 8, dtype=torch.int32,
                                                          device=DEVICE)),
            "sparse attention", "indices")
    _raises(NotImplementedError, call(attn_sink=torch.zeros(4, device=DEVICE)), "attn_sink")
    _raises(NotImplementedError, call(is_fp8_kvcache=True), "656 bytes", "k_scale")
    _raises(RuntimeError, call(k_cache=cache.to(torch.float8_e4m3fn)), "same dtype",
            "is_fp8_kvcache")
    _raises(RuntimeError, call(head_dim_v=640), "head_dim_v", "640", "576")
    _raises(RuntimeError, call(q=q[0]), "4-D", "(batch, seq_len_q, num_heads_q, head_dim)")
    _raises(RuntimeError, call(block_table=None), "block_table and cache_seqlens")
    _raises(RuntimeError, call(q=q[..., :512]), "same head_dim")
    _raises(RuntimeError, call(q=q[:, :, :3], k_cache=torch.cat([cache, cache], 2)),
            "multiple of num_heads_k")
    _raises(RuntimeError, call(tile_scheduler_metadata=object()), "FlashMLASchedMeta")
    _raises(RuntimeError, call(num_splits=2), "num_splits must be None")
    # A native check underneath: its message, as RuntimeError.
    _raises(RuntimeError, call(block_table=table.long()), "block_table must be int32",
            "torch.int64")
    # One FlashMLASchedMeta per configuration (checked before anything runs).
    meta = FlashMLASchedMeta(have_initialized=True, config=FlashMLASchedMeta.Config(
        2, 1, 8, 64, 1, False, False, None, None, None))
    _raises(RuntimeError, call(tile_scheduler_metadata=meta), "h_q=8", "h_q=4")
