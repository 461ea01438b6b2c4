"""The forward's WARP_SPEC variant (one warp-specialised key loop over every visible tile, each
masked) against the float64 oracle and against the default three-range kernel, in Triton's
interpreter (tl.range's warp_specialize is a no-op there: this checks the merged loop's
arithmetic; whether it specialises is tools/sm90_static.py's question), and where its configs
are offered (``configs.warp_spec_configs``: KERNELS_FWD_WARP_SPEC=1, on sm_90, where the pass
takes the launch)."""
import pytest
import torch
import triton
from helpers import DEVICE, assert_parity, randn

import reference
from kernels.core import configs
from kernels.core.call import KeyLayout
from kernels.core.fp8 import Fp8Spec
from kernels.core.forward import _with_desc_blocks, attention_forward

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and configs.gpu_of(None).capability[0] != 9,
    reason="the warp-specialised configs are Hopper's (configs.HOPPER.fwd_warp_spec)")


def _cfg(bm, bn, ws):
    """A forced config: (bm, bn) in the interpreter; on a GPU 128 x 64 on 4 warps, 3 stages,
    one of the entries that specialise on sm_90 (its default twin is a Hopper entry too)."""
    if DEVICE == "cuda":
        bm, bn, stages = 128, 64, 3
    else:
        stages = 2
    kw = dict(BLOCK_M=bm, BLOCK_N=bn)
    if ws:
        kw["WARP_SPEC"] = True
    return triton.Config(kw, num_warps=4, num_stages=stages)


@pytest.mark.parametrize("b,hq,hkv,q_len,k_len,d,causal,window,dtype,tma", [
    (1, 2, 2, 37, 45, 32, True, None, F16, 2),     # ragged tiles, causal (diag > 0)
    (2, 2, 1, 45, 37, 64, True, None, F16, 3),     # q_len > k_len: rows that see no key, GQA
    (1, 2, 2, 33, 50, 24, False, None, BF16, 2),   # padded head dim, bf16 (widened)
    (1, 1, 1, 40, 40, 16, True, 9, F16, 3),        # sliding window: RANGE 0 merged too
    (2, 3, 3, 16, 80, 32, False, None, F16, 3),    # one query block, several key tiles
], ids=lambda x: str(x).replace("torch.", ""))
def test_ws_variant_parity(b, hq, hkv, q_len, k_len, d, causal, window, dtype, tma):
    q = randn(b, hq, q_len, d, dtype=dtype)
    k, v = randn(b, hkv, k_len, d, dtype=dtype), randn(b, hkv, k_len, d, dtype=dtype)
    kw = dict(causal=causal, softmax_scale=d ** -0.5, window=window)
    o, lse = attention_forward(q, k, v, config=_cfg(16, 16, True), tma=tma, **kw)
    o0, lse0 = attention_forward(q, k, v, config=_cfg(16, 16, False), tma=tma, **kw)
    # Same arithmetic, in the same order: an unmasked tile's all-true mask changes nothing.
    torch.testing.assert_close(o, o0, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse0, rtol=0, atol=0, equal_nan=True)
    rep = dict(causal=causal, softmax_scale=d ** -0.5, window=window)
    ref = reference.attention(q, k, v, upcast=True, **rep)
    lowp = reference.attention(q, k, v, upcast=False, **rep)
    assert_parity(o, ref, lowp)


@pytest.mark.parametrize("tma,dropout_p", [(0, 0.0), (3, 0.2)])
def test_ws_variant_refuses_what_the_pass_cannot_take(tma, dropout_p):
    """Q by per-thread loads (TMA 0 / 1) and dropout's Philox layout fail in Triton 3.6's pass
    on sm_90: the variant refuses them at compile time, with a message naming WARP_SPEC."""
    q, k, v = (randn(1, 1, 16, 16, dtype=F32) for _ in range(3))
    with pytest.raises(Exception, match="WARP_SPEC"):
        attention_forward(q, k, v, causal=True, softmax_scale=0.25, dropout_p=dropout_p,
                          seed=7, config=_cfg(16, 16, True), tma=tma)


def _offered(monkeypatch, enabled=True, **launch):
    """The WARP_SPEC configs the forward's prune hook puts first for a launch (sm_90: the
    family this CPU machine's prune takes), as (BLOCK_M, BLOCK_N, warps, stages)."""
    if enabled:
        monkeypatch.setenv("KERNELS_FWD_WARP_SPEC", "1")
    else:
        monkeypatch.delenv("KERNELS_FWD_WARP_SPEC", raising=False)
    args = dict(Q=torch.empty(1, 1, 16, 64, dtype=BF16), HEAD_DIM=64, HEAD_DIM_V=64,
                BLOCK_D=64, BLOCK_DV=64, TMA=3, DROPOUT=0, SPLIT=False, PACK_GQA=False,
                sched=None, KEYS=KeyLayout(False, False, 0), FP8=Fp8Spec(),
                BUCKETS=(1024, 1024, 0))
    args.update(launch)
    kept = configs.prune_configs(_with_desc_blocks(configs.fwd_configs()), {}, **args)
    ws = [configs._key(c)[:4] for c in kept if c.kwargs["WARP_SPEC"]]
    # WARP_SPEC configs lead, the table's follow, never mixed.
    assert [c.kwargs["WARP_SPEC"] for c in kept] == [True] * len(ws) + [False] * (
        len(kept) - len(ws))
    assert len(kept) > len(ws)
    return ws


def test_offered_only_when_enabled_and_taken(monkeypatch):
    assert configs.gpu_of(None).capability[0] == 9   # this check runs the Hopper tables
    assert _offered(monkeypatch) == list(configs.HOPPER.fwd_warp_spec)
    assert _offered(monkeypatch, enabled=False) == []
    for launch in (dict(TMA=1), dict(TMA=0), dict(DROPOUT=1), dict(SPLIT=True),
                   dict(PACK_GQA=True), dict(sched=object()),
                   dict(KEYS=KeyLayout(True, False, 0)), dict(KEYS=KeyLayout(False, True, 16)),
                   dict(FP8=Fp8Spec(mode=1)), dict(HEAD_DIM=256, BLOCK_D=256)):
        assert _offered(monkeypatch, **launch) == [], launch
    # In host-descriptor mode (TMA 3) and with in-kernel descriptors for Q too (TMA 2).
    assert _offered(monkeypatch, TMA=2) == list(configs.HOPPER.fwd_warp_spec)


def test_default_configs_keep_warp_spec_off():
    """Every config a forward launch may take says WARP_SPEC, off unless it is a copy made
    for it (a direct launch passes every kernel parameter)."""
    cfgs = _with_desc_blocks(configs.fwd_configs())
    assert all("WARP_SPEC" in c.kwargs for c in cfgs)
    ws = [c for c in cfgs if c.kwargs["WARP_SPEC"]]
    assert ws and all(c.num_warps == 4 for c in ws)
    assert len(cfgs) - len(ws) == len(configs._union("fwd"))
