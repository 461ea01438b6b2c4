"""Launch configs per GPU generation, decided on CPU with each generation's published limits.

The pruning hooks ask ``torch.cuda`` for the running GPU's compute capability and shared memory
per block; here those answers are mocked for each generation, so every family's choices are
checked without its GPU: the kept configs fit that GPU's shared memory, no launch is left
without one, and GPUs the kernels do not serve are routed to the PyTorch path with a warning
that names them. (What ptxas makes of each config is the static compile check's job,
docs/gpu.md.)
"""
import warnings
from types import SimpleNamespace

import pytest
import torch

from kernels import ops
from kernels.core import configs
from kernels.core.call import Precision, ScoreSpec
from kernels.core.common import block_d

# (capability, shared memory per block in KiB, example card): NVIDIA's published limits.
GENERATIONS = [((8, 0), 163, "A100"), ((8, 6), 99, "RTX 3090"), ((8, 9), 99, "L4"),
               ((9, 0), 227, "H100"), ((10, 0), 227, "B200"), ((12, 0), 99, "RTX 5090")]
HEAD_DIMS = [16, 64, 96, 128, 192, 256]


@pytest.fixture
def gpu(monkeypatch):
    """Make the pruning see a chosen GPU: ``gpu(capability, smem_kib)``."""
    def use(capability, smem_kib, name="Test GPU"):
        configs._gpu.cache_clear()
        props = SimpleNamespace(shared_memory_per_block_optin=smem_kib * 1024)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: name)
        return configs.gpu_of(None)
    yield use
    configs._gpu.cache_clear()


def _fwd_kept(d, dtype=torch.bfloat16, dropout=0, precision="tf32"):
    q = torch.empty(1, dtype=dtype)
    return configs.prune_configs(configs.fwd_configs(), {}, Q=q, BLOCK_D=block_d(d),
                                 DROPOUT=dropout, PRECISION=Precision(False, precision))


def _bwd_kept(kernel, d, dtype=torch.bfloat16, dropout=0, precision="tf32"):
    q = torch.empty(1, dtype=dtype)
    args = dict(Q=q, HEAD_DIM=d, DROPOUT=dropout, DOT_PRECISION=precision)
    args.update(DK=q) if kernel == "dkdv" else args.update(DQ=q)
    return configs.prune_bwd_configs(configs.bwd_configs(kernel=kernel), {}, **args)


def _key(cfg):
    return (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages)


@pytest.mark.parametrize("capability,smem,card", GENERATIONS, ids=[g[2] for g in GENERATIONS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dropout", [0, 1])
def test_every_launch_keeps_a_config_that_fits(gpu, capability, smem, card, dtype, dropout):
    gpu(capability, smem)
    family = configs.family_of(configs.gpu_of(None))
    for d in HEAD_DIMS:
        fwd = _fwd_kept(d, dtype, dropout)
        assert fwd, (card, d)
        for cfg in fwd:
            assert _key(cfg) in family.fwd, (card, d, _key(cfg))
            assert configs.smem_bytes(cfg, block_d(d), 2) <= smem * 1024, (card, d, _key(cfg))
        for kernel in ("dkdv", "dq"):
            kept = _bwd_kept(kernel, d, dtype, dropout)
            assert kept, (card, kernel, d)
            assert all(_key(c) in getattr(family, kernel) for c in kept), (card, kernel, d)
            assert all(configs._bwd_smem_bytes(c, block_d(d), 2, kernel == "dkdv")
                       <= smem * 1024 for c in kept), (card, kernel, d)


@pytest.mark.parametrize("capability,smem,card", GENERATIONS, ids=[g[2] for g in GENERATIONS])
@pytest.mark.parametrize("dropout", [0, 1])
def test_fp32_launches_keep_a_config_that_fits(gpu, capability, smem, card, dropout):
    """fp32 doubles every tile's bytes: where none of the family's tiles fits, the pruning
    still keeps one that does (the wide-head tiles, or fewer stages). On sm_90 at head_dim 256
    the dQ launch was left with 128 x 16 alone, 311 KiB of shared memory: no launch at all."""
    gpu(capability, smem)
    for d in HEAD_DIMS:
        for cfg in _fwd_kept(d, torch.float32, dropout):
            assert configs.smem_bytes(cfg, block_d(d), 4) <= smem * 1024, (card, d, _key(cfg))
        for kernel in ("dkdv", "dq"):
            kept = _bwd_kept(kernel, d, torch.float32, dropout)
            assert kept, (card, kernel, d)
            for cfg in kept:
                assert configs._bwd_smem_bytes(cfg, block_d(d), 4, kernel == "dkdv") <= (
                    smem * 1024), (card, kernel, d, _key(cfg))


@pytest.mark.parametrize("capability,smem,card", GENERATIONS, ids=[g[2] for g in GENERATIONS])
@pytest.mark.parametrize("dropout", [0, 1])
def test_fp32_widest_heads_forward_takes_its_own_tile(gpu, capability, smem, card, dropout):
    """Above head_dim 256 in fp32 (IEEE dots: FMA loops) the wide-head 8-warp forward tiles
    spilled 4-23 KB and took 130-132 KiB (no load on the 99 KiB cards); every generation takes
    the one fp32 tile, 16 x 16 on 4 warps, spill-free at 64 KiB. bf16 keeps the wide-head
    tiles."""
    gpu(capability, smem)
    for d in (320, 512):
        assert [_key(c) for c in _fwd_kept(d, torch.float32, dropout)] == [(16, 16, 4, 1)]
        assert _key(_fwd_kept(d, torch.bfloat16, dropout)[0]) == configs.WIDE["fwd"][0]


@pytest.mark.parametrize("capability,smem,card", GENERATIONS, ids=[g[2] for g in GENERATIONS])
@pytest.mark.parametrize("dropout", [0, 1])
def test_fp32_ieee_takes_the_fma_tiles(gpu, capability, smem, card, dropout):
    """fp32 with IEEE dots (FMA loops) below width 512: every generation keeps exactly the
    spill-free FMA tiles (configs.FMA_FP32), in their order; the family tables, whose kept
    tiles spilled 8-50 KB there, stay for TF32 and bf16."""
    gpu(capability, smem)
    family = configs.family_of(configs.gpu_of(None))
    for d in (16, 64, 96, 128, 256):
        tiles = configs.FMA_FP32[max(block_d(d), 64)]
        fwd = [_key(c) for c in _fwd_kept(d, torch.float32, dropout, "ieee")]
        # Short queries at width <= 64 put the 4-warp tile first on sm_90 (SHORT_Q_LEN):
        # no BUCKETS here, so the table's order.
        assert fwd == list(tiles["fwd"]), (card, d)
        for kernel in ("dkdv", "dq"):
            kept = [_key(c) for c in _bwd_kept(kernel, d, torch.float32, dropout, "ieee")]
            table = {_key(c): c for c in configs.bwd_configs(kernel=kernel)}
            fitting = [e for e in tiles[kernel] if configs._bwd_smem_bytes(
                table[e], block_d(d), 4, kernel == "dkdv") <= smem * 1024]
            assert kept and kept == fitting, (card, kernel, d)
        tf32 = _fwd_kept(d, torch.float32, dropout, "tf32")
        assert all(_key(c) in family.fwd for c in tf32) or d > 128, (card, d)
        assert all(_key(c) in family.fwd for c in _fwd_kept(d, torch.bfloat16, dropout,
                                                              "ieee")), (card, d)


def test_hopper_defaults_unchanged(gpu):
    """sm_90's choices are the ones its static check was run on (docs/gpu.md,
    "Per-tile speed"): 128-key forward tiles without dropout, 128-row dQ tiles on 8 warps."""
    gpu((9, 0), 227)
    assert _key(_fwd_kept(64)[0]) == (128, 128, 8, 3)
    assert _key(_fwd_kept(128)[0]) == (128, 128, 8, 3)
    assert _key(_fwd_kept(64, dropout=1)[0]) == (128, 64, 8, 3)
    assert _key(_fwd_kept(128, dropout=1)[0]) == (128, 64, 8, 3)
    assert _key(_fwd_kept(256)[0]) == (64, 64, 8, 2)
    assert _key(_bwd_kept("dkdv", 64)[0]) == (64, 128, 8, 2)
    assert _key(_bwd_kept("dkdv", 64, dropout=1)[0]) == (32, 128, 8, 2)
    assert _key(_bwd_kept("dkdv", 128)[0]) == (32, 128, 8, 2)
    assert _key(_bwd_kept("dq", 64)[0]) == (128, 64, 8, 2)
    assert _key(_bwd_kept("dq", 128)[0]) == (128, 64, 8, 2)
    assert _key(_bwd_kept("dq", 128, dropout=1)[0]) == (128, 32, 8, 2)
    # Width 256 (and q/k 192 with v 128, padded to 256): the one dQ tile without spills.
    assert [_key(c) for c in _bwd_kept("dq", 256)] == [(128, 16, 8, 2)]
    assert [_key(c) for c in _bwd_kept("dq", 256, dropout=1)] == [(128, 16, 8, 2)]
    # No mma.sync-only tile (a 32-row resident side) on the wgmma generation.
    assert all(c.kwargs["BLOCK_N"] >= 64 for c in _bwd_kept("dkdv", 64))


def test_hopper_register_budgets_of_variants(gpu):
    """The sm_90 tiles that spilled in a variant are not its default: 128 x 128 forward with a
    window or chunk edge at head_dim 128 (20 B), 64 x 128 dK/dV with grouped-query heads at 64
    (60-112 B); both stay the default of the plain launch."""
    gpu((9, 0), 227)
    q = torch.empty(1, dtype=torch.bfloat16)
    edge = ScoreSpec(causal=True, edge=1, mods=(), mask_mod=None, sinks=False)   # a window
    for d, first in ((64, (128, 128, 8, 2)), (128, (128, 64, 8, 2))):
        kept = configs.prune_configs(configs.fwd_configs(), {}, Q=q, BLOCK_D=d, SPEC=edge)
        assert _key(kept[0]) == first, d
        assert all(c.num_stages <= 2 for c in kept) and len(kept) >= 2
    for group, first in ((1, (64, 128, 8, 2)), (4, (32, 128, 8, 2))):
        kept = configs.prune_bwd_configs(configs.bwd_configs(kernel="dkdv"), {}, Q=q, DK=q,
                                         HEAD_DIM=64, seq=SimpleNamespace(group=group))
        assert _key(kept[0]) == first, group


@pytest.mark.parametrize("d", [16, 64, 96, 128])
@pytest.mark.parametrize("dropout", [0, 1])
def test_hopper_warps_own_their_rows(gpu, d, dropout):
    """Up to head_dim 128 every kept sm_90 forward and dQ tile gives each warp query rows of
    its own (BLOCK_M >= 16 x num_warps): Triton puts all warps of the chained wgmma dots along
    the rows, so a 64-row tile on 8 warps computes its score tile twice. (dK/dV keeps its
    64-key tiles: with grouped-query heads they spilled least; so does a windowed forward.)"""
    gpu((9, 0), 227)
    for cfg in _fwd_kept(d, dropout=dropout) + _bwd_kept("dq", d, dropout=dropout):
        assert cfg.kwargs["BLOCK_M"] >= 16 * cfg.num_warps, (d, _key(cfg))


@pytest.mark.parametrize("capability,smem", [((8, 6), 99), ((8, 9), 99), ((12, 0), 99)])
def test_consumer_cards_get_their_own_tiles(gpu, capability, smem):
    """99 KiB cards: the wgmma tiles that spilled there (128 x 64 forward at head_dim 128,
    every dQ tile at 128) are not chosen, and head_dim 256 still has a config."""
    gpu(capability, smem)
    assert configs.family_of(configs.gpu_of(None)) is configs.AMPERE
    assert _key(_fwd_kept(128, dropout=1)[0])[:2] != (128, 64)
    assert all(c.kwargs["BLOCK_M"] <= 64 for c in _bwd_kept("dq", 128))
    assert _fwd_kept(256) and _bwd_kept("dkdv", 256) and _bwd_kept("dq", 256)


def test_device_limits_come_from_the_device(gpu):
    """The shared-memory limit is the device's (opt-in per block), the table only without
    one; a GPU whose limit is lower than its generation's still gets configs that fit."""
    assert gpu((9, 0), 100).smem_per_block == 100 * 1024
    assert all(configs.smem_bytes(c, 128, 2) <= 100 * 1024 for c in _fwd_kept(128))


@pytest.mark.parametrize("capability,routed", [((7, 5), True), ((7, 0), True), ((8, 0), False),
                                               ((9, 0), False), ((12, 0), False)])
def test_pre_ampere_gpus_take_the_pytorch_path(gpu, monkeypatch, capability, routed):
    gpu(capability, 64, name="Tesla T4")
    reason = configs.unsupported_gpu_reason(torch.device("cuda", 0))
    assert (reason is not None) == routed
    monkeypatch.setattr("kernels.core.backend._warned_gpu", False)
    fake_cuda_tensor = SimpleNamespace(device=torch.device("cuda", 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ops._use_fallback(fake_cuda_tensor) == routed
    if routed:
        assert "Tesla T4" in reason and f"sm_{capability[0]}{capability[1]}" in reason
        assert len(caught) == 1 and "same semantics" in str(caught[0].message)
    else:
        assert not caught
