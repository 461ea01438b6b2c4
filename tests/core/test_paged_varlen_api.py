"""``kernels.attention_varlen(..., block_table=)``: packed queries over a paged KV cache through
the public pipeline (the kernels' own tests are tests/core/test_paged_varlen.py)."""
import pytest
import torch
from helpers import DEVICE

import kernels
from kernels.core import backend


def _case(lens_q, lens_k, heads_q=4, heads_kv=2, d=16, page=4, seed=0):
    """Packed q, a shuffled page pool holding each sequence's keys, its block table, and the
    same keys packed (the dense-packed twin)."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = [-(-n // page) for n in lens_k]
    pool = sum(n_pages) + 3                        # spare pages nobody reads
    kp = torch.randn(pool, page, heads_kv, d, generator=gen)
    vp = torch.randn(pool, page, heads_kv, d, generator=gen)
    order = torch.randperm(pool, generator=gen)
    table = torch.full((len(lens_k), max(n_pages)), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(n_pages):
        table[s, :n] = order[used:used + n].int()
        used += n
    ks, vs = [], []
    for s, n in enumerate(lens_k):
        pos = torch.arange(n)
        pages, rows = table[s].long()[pos // page], pos % page
        ks.append(kp[pages, rows])
        vs.append(vp[pages, rows])
    q = torch.randn(sum(lens_q), heads_q, d, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    def to(t):
        return t.to(DEVICE)

    return (to(q), to(kp), to(vp), to(table), to(cu_q), to(cu_k),
            to(torch.tensor(lens_k, dtype=torch.int32)), to(torch.cat(ks)), to(torch.cat(vs)))


@pytest.mark.parametrize("kw", [dict(), dict(window=3), dict(causal=False, softcap=5.0)],
                         ids=["causal", "window", "full-softcap"])
def test_paged_equals_packed(kw):
    """Decode rows (1 query) and prefill rows in one call: the same bits as the packed call over
    the gathered keys, with the key counts given either way."""
    q, kp, vp, table, cu_q, cu_k, used, k, v = _case([1, 5, 3], [7, 5, 9])
    want, want_lse = kernels.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    got, lse = kernels.attention_varlen(q, kp, vp, cu_q, None, block_table=table,
                                        seqused_k=used, return_lse=True, **kw)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    assert torch.equal(kernels.attention_varlen(q, kp, vp, cu_q, cu_k, block_table=table,
                                                **kw), want)


@pytest.mark.skipif(DEVICE != "cpu", reason="the fallback serves CPU tensors")
def test_paged_fallback(monkeypatch):
    q, kp, vp, table, cu_q, cu_k, used, k, v = _case([2, 1], [9, 4], seed=1)
    want = kernels.attention_varlen(q, k, v, cu_q, cu_k)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(backend, "_warned_fallback", True)
    got = kernels.attention_varlen(q, kp, vp, cu_q, None, block_table=table, seqused_k=used)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_paged_compiled():
    q, kp, vp, table, cu_q, cu_k, used, k, v = _case([3, 1], [6, 8], seed=2)
    eager = kernels.attention_varlen(q, kp, vp, cu_q, None, block_table=table, seqused_k=used)
    compiled = torch.compile(
        lambda q: kernels.attention_varlen(q, kp, vp, cu_q, None, max_seqlen_q=3,
                                           block_table=table, seqused_k=used),
        fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    assert torch.equal(compiled(q), eager)


def test_paged_forward_only_and_errors():
    q, kp, vp, table, cu_q, cu_k, used, k, v = _case([2, 2], [3, 5], seed=3)
    qg = q.clone().requires_grad_()
    out = kernels.attention_varlen(qg, kp, vp, cu_q, None, block_table=table, seqused_k=used)
    with pytest.raises(RuntimeError, match="forward-only"):
        out.sum().backward()
    with pytest.raises(NotImplementedError, match="dropout"):
        kernels.attention_varlen(q, kp, vp, cu_q, None, block_table=table, seqused_k=used,
                                 dropout_p=0.1)
    with pytest.raises(ValueError, match="needs the key counts"):
        kernels.attention_varlen(q, kp, vp, cu_q, None, block_table=table)
    with pytest.raises(ValueError, match="block_table must be int32"):
        kernels.attention_varlen(q, kp, vp, cu_q, None, block_table=table.long(),
                                 seqused_k=used)
    with pytest.raises(ValueError, match="seqused_k goes with block_table"):
        kernels.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=used)
    if DEVICE == "cpu":   # counts on the host are checked: past the table's pages
        with pytest.raises(ValueError, match="block_table"):
            kernels.attention_varlen(q, kp, vp, cu_q, None, block_table=table,
                                     seqused_k=used + 40)
