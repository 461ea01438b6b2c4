"""Every launch config of kernels/core/configs.py gives the right answer.

The interpreter's default config has BLOCK_M == BLOCK_N == 16; the GPU configs have
BLOCK_M != BLOCK_N and 32..128-wide tiles, which move the causal band, the ragged last tiles
and the dropout tiles. Forcing each config here covers that logic on CPU too (and on a GPU,
where KERNELS_AUTOTUNE=0 would otherwise run only the first config).
"""
import pytest
import torch
from helpers import GRAD_FACTOR, assert_parity, randn

import reference
from kernels.core.configs import bwd_configs, fixed_configs, fwd_configs, prune_configs
from kernels.core.backward import attention_backward
from kernels.core.forward import attention_forward

# (q_len, k_len, causal, window, kv heads for 2 query heads): the last one moves the window's
# left edge across the unequal tiles, with grouped-query heads.
SHAPES = [(150, 200, True, None, 2), (200, 150, True, None, 2), (77, 77, False, None, 2),
          (150, 200, True, 37, 1)]


def _id(cfg):
    return "M{BLOCK_M}-N{BLOCK_N}".format(**cfg.kwargs)


def _tiles(configs):
    """One config per tile shape: warps and stages do not change what the interpreter
    computes, the tile shapes (every GPU family's) move the masks and the dropout tiles. Not
    the warp-specialised forward copies (no dropout; tests/core/test_warp_spec.py)."""
    return list({(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]): c for c in configs
                 if not c.kwargs.get("WARP_SPEC")}.values())


def _inputs(q_len, k_len, heads_kv=2, dtype=torch.float16):
    return (randn(1, 2, q_len, 40, dtype=dtype), randn(1, heads_kv, k_len, 40, dtype=dtype),
            randn(1, heads_kv, k_len, 40, dtype=dtype))


@pytest.mark.parametrize("q_len,k_len,causal,window,heads_kv", SHAPES)
@pytest.mark.parametrize("config", _tiles(fwd_configs()), ids=_id)
def test_forward_config(config, q_len, k_len, causal, window, heads_kv):
    q, k, v = _inputs(q_len, k_len, heads_kv)
    keep = reference.dropout_keep_mask(5, 1, 2, q_len, k_len, 0.2, device=q.device)
    out, _ = attention_forward(q, k, v, causal=causal, softmax_scale=0.15, dropout_p=0.2,
                               seed=5, window=window, config=config)
    kw = dict(causal=causal, softmax_scale=0.15, dropout_p=0.2, keep_mask=keep, window=window)
    assert_parity(out, reference.attention(q, k, v, **kw),
                  reference.attention(q, k, v, upcast=False, **kw))


@pytest.mark.parametrize("q_len,k_len,causal,window,heads_kv", SHAPES)
@pytest.mark.parametrize("config", _tiles(bwd_configs()), ids=_id)
def test_backward_config(config, q_len, k_len, causal, window, heads_kv):
    q, k, v = _inputs(q_len, k_len, heads_kv)
    do = randn(*q.shape, dtype=q.dtype)
    keep = reference.dropout_keep_mask(9, 1, 2, q_len, k_len, 0.2, device=q.device)
    kw = dict(causal=causal, softmax_scale=0.15, dropout_p=0.2, keep_mask=keep, window=window)
    o, lse = attention_forward(q, k, v, causal=causal, softmax_scale=0.15, dropout_p=0.2, seed=9,
                               window=window)
    grads = attention_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=0.15,
                               dropout_p=0.2, seed=9, window=window, config=config)

    def ref_grads(upcast):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = reference.attention(*leaves, upcast=upcast, **kw)
        return torch.autograd.grad(out, leaves, do.to(out.dtype))

    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads(True), ref_grads(False)):
        assert_parity(g, r, lo, factor=GRAD_FACTOR, name=name)


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_fixed_config_fits_shared_memory(d):
    """Without autotuning the first config that fits is used; head_dim 256 must skip the
    128-row three-stage tiles that would not fit. (No CUDA device here: the H100's limits;
    tests/core/test_gpu_generations.py covers the other generations.)"""
    from kernels.core.common import block_d
    from kernels.core.configs import HOPPER, smem_bytes
    q = torch.empty(1, dtype=torch.bfloat16)
    cfg = fixed_configs(fwd_configs(), prune_configs, {"Q": q, "BLOCK_D": block_d(d)})[0]
    assert smem_bytes(cfg, block_d(d), 2) <= HOPPER.fwd_smem_cap
    if d <= 128:
        assert cfg is fwd_configs()[0] or cfg.kwargs == fwd_configs()[0].kwargs


def test_config_lists_keep_hopper_tiles():
    """What the sm_90 compile check found (docs/gpu.md), kept true by the lists: the
    resident side of each wgmma backward kernel is >= 64 rows (32 compiles to Ampere
    mma.sync), and the forward's register pruning drops the tiles that spilled (128-row blocks
    on 4 warps at head_dim 128; 64-wide score tiles per thread with dropout)."""
    from kernels.core.configs import HOPPER
    assert all(bn >= 64 for _, bn, _, _ in HOPPER.dkdv)
    assert all(bm >= 64 for bm, _, _, _ in HOPPER.dq)
    q = torch.empty(1, dtype=torch.bfloat16)

    def kept(d, dropout):
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps)
                for c in prune_configs(fwd_configs(), {"Q": q}, BLOCK_D=d, DROPOUT=dropout)]

    assert (128, 64, 4) in kept(64, False) and (128, 64, 4) not in kept(128, False)
    assert (128, 128, 8) in kept(128, False) and (128, 128, 8) not in kept(128, True)
    assert kept(128, True)[0] == (128, 64, 8)


def test_backward_tiles_fit_the_row_statistics_padding():
    """The backward loads whole BLOCK_M-row tiles of its row statistics unmasked: every
    backward config's (and the interpreter's) BLOCK_M must divide the padding
    (backward.stats_layout), or a last tile would read past it."""
    from kernels.core.configs import BWD_ROW_PAD
    for cfg in bwd_configs() + bwd_configs(interpret=True):
        assert BWD_ROW_PAD % cfg.kwargs["BLOCK_M"] == 0, cfg


def test_autotune_key_tells_grouped_heads_apart():
    """The backward's pruning keeps fewer dK/dV tiles for grouped query heads (a 64 x 128 tile
    spilled there): a call with grouped heads must not reuse the tuning of an ungrouped call of
    the same shape, so the autotune key (BUCKETS) says which it is."""
    from kernels.core.call import make_problem
    q = randn(1, 4, 100, 64)
    mha = make_problem(q, randn(1, 4, 100, 64), randn(1, 4, 100, 64)).tune_buckets()
    gqa = make_problem(q, randn(1, 2, 100, 64), randn(1, 2, 100, 64)).tune_buckets()
    assert mha[:2] == gqa[:2] == (128, 128) and mha != gqa


class _FakeKernel:
    """A jit kernel stand-in whose compilation fails for the configs named in ``failing``
    (as ptxas does for some degenerate specialisations), recording what was launched."""

    def __init__(self, failing, error):
        self.failing, self.error, self.launched = failing, error, []

    def __getitem__(self, grid):
        def launch(**kwargs):
            key = (kwargs["BLOCK_M"], kwargs["BLOCK_N"])
            if key in self.failing:
                raise self.error
            self.launched.append((key, grid))
        return launch


def test_launch_without_autotuning_skips_configs_that_do_not_compile():
    """KERNELS_AUTOTUNE=0 takes the first kept config that compiles, as the autotuner would
    (triton 3.6 ptxas crashes on sm_90 at k_len == 1 causal for some tiles), and
    raises when none does; compile-time errors only."""
    from triton.runtime.errors import PTXASError

    from kernels.core.launch import launch_first_compiling
    configs = bwd_configs(kernel="dq")[:3]
    keys = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in configs]
    grid = lambda kw: (kw["BLOCK_M"],)     # noqa: E731
    kernel = _FakeKernel({keys[0]}, PTXASError("ptxas failed with error code -11"))
    launch_first_compiling(kernel, grid, {"x": 1}, configs)
    assert kernel.launched == [(keys[1], (keys[1][0],))]
    kernel = _FakeKernel(set(keys), PTXASError("ptxas failed"))
    with pytest.raises(PTXASError):
        launch_first_compiling(kernel, grid, {}, configs)
    assert kernel.launched == []
    kernel = _FakeKernel({keys[0]}, ValueError("not a compile error"))
    with pytest.raises(ValueError):
        launch_first_compiling(kernel, grid, {}, configs)


def test_attn_mask_shared_memory_drops_the_tiles_that_would_not_load():
    """SDPA's attn_mask adds shared memory (configs.mods_smem_bytes, from the sm_90 compile
    of every forward config): at head_dim 128 the 128 x 128 three-stage tile needs 360,504
    bytes with an additive mask and 233,528 with a boolean one, over the H100's 232,448 a
    block may use; pruning drops it there and keeps it without a mask."""
    from kernels.core.call import ScoreSpec
    from kernels.core.configs import HOPPER, mods_smem_bytes, smem_bytes
    from kernels.core.mods import ModFns
    from kernels.core.tensor_mask import TENSOR_BIAS, TENSOR_MASK
    q = torch.empty(1, dtype=torch.bfloat16)
    specs = {"none": None,
             "bias": ScoreSpec(False, 0, (ModFns(TENSOR_BIAS.fn, TENSOR_BIAS.grad),), None, False),
             "mask": ScoreSpec(False, 0, (), TENSOR_MASK.fn, False)}
    measured = {"bias": 360504, "mask": 233528}    # sm_90, triton 3.6, 128 x 128, 8 warps, 3 st.

    def kept(spec):
        return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages): c
                for c in prune_configs(fwd_configs(), {"Q": q}, BLOCK_D=128, SPEC=spec)}

    big = (128, 128, 8, 3)
    assert big in kept(None)
    cfg = kept(None)[big]
    for name in ("bias", "mask"):
        estimate = smem_bytes(cfg, 128, 2) + mods_smem_bytes(cfg, specs[name])
        assert measured[name] <= estimate <= measured[name] + 1024, (name, estimate)
        assert big not in kept(specs[name]) and kept(specs[name]), name
        assert all(smem_bytes(c, 128, 2) + mods_smem_bytes(c, specs[name]) <= HOPPER.fwd_smem_cap
                   for c in kept(specs[name]).values())


def test_latent_width_takes_its_tiles_and_fits_every_generation():
    """MLA's 576-wide latent decode (q / k as 512 + 64, V in the K tile; docs/gpu.md "MLA
    (576)"): every family lists the latent tiles for it (LATENT; LATENT_CDNA on AMD), and every
    GPU keeps one whose shared memory estimate fits. Measured (tools/sm90_static.py --mla all,
    triton 3.6): 32 x 32 takes 102,400 B, over the 99 KiB (101,376 B) of sm_86 / 89 / 120,
    whose only tile is 32 x 16 (69,632 B); on AMD (tools/amd_static.py --variants mla, triton
    3.9) 32 x 32 spilled VGPRs on gfx942 and gfx950, 32 x 16 did not. Each estimate is at
    least what the compiler took."""
    from kernels.core import configs
    width = configs._padded_width(dict(HEAD_DIM=576, BLOCK_D=512, HEAD_DIM_V=512,
                                       BLOCK_DV=512))
    assert width == 576
    cands = [c for c in fwd_configs()
             if configs._key(c) in set(configs.LATENT["fwd"] + configs.LATENT_CDNA["fwd"])]
    measured = {(32, 32, 8, 1): 102400, (32, 16, 8, 1): 69632}
    for key, smem in measured.items():
        assert configs.smem_bytes(configs._configs([key])[0], width, 2) >= smem, key
    kib = 1024
    for family, smem, first in ((configs.AMPERE, 163 * kib, (32, 32, 8, 1)),
                                (configs.AMPERE, 99 * kib, (32, 16, 8, 1)),
                                (configs.HOPPER, 227 * kib, (32, 32, 8, 1)),
                                (configs.BLACKWELL, 227 * kib, (32, 32, 8, 1)),
                                (configs.CDNA3, 64 * kib, (32, 16, 8, 1)),
                                (configs.CDNA4, 160 * kib, (32, 16, 8, 1))):
        table = (configs.LATENT_CDNA if family.wave64 else configs.LATENT)["fwd"]
        entries = configs._family_entries(cands, family, "fwd", width)
        assert [configs._key(c) for c in entries] == list(table), family.name
        budget = min(family.fwd_smem_cap, smem)
        kept = configs._prune_table(cands, {}, width, 2, family, budget)
        estimate = configs.cdna_fwd_lds if family.wave64 else configs.smem_bytes
        assert kept and configs._key(kept[0]) == first, (family.name, smem)
        assert all(estimate(c, width, 2) <= budget for c in kept), (family.name, smem)
    # Widths up to 512 keep WIDE's tiles.
    assert [configs._key(c) for c in configs._family_entries(
        fwd_configs(), configs.HOPPER, "fwd", 512)] == list(configs.WIDE["fwd"])
