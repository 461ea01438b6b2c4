"""AMD Instinct (MI300: gfx942, MI350: gfx950) as the library sees it, checked on CPU.

On a ROCm build of PyTorch an AMD GPU is a ``cuda`` device whose capability reads (9, 4) or
(9, 5): here ``torch.version.hip`` and the device properties are mocked, and the library must
take its AMD path (never Hopper's): the gfx name, LDS and CUs per arch, no TMA, no tf32 dot
where Triton's HIP backend refuses it, the CDNA config tables and their pruning. The last test
compiles one forward per arch with Triton's HIP backend through tools/amd_static.py (no GPU).
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kernels.core import common, configs
from kernels.core.common import block_d
# The kept configs of one launch, as the generation tests ask for them.
from test_gpu_generations import _bwd_kept, _fwd_kept

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (gfx name, capability ROCm reports, CUs, LDS the runtime reports in KiB): the runtime's LDS
# figure for gfx950 is given as 64 KiB on purpose (some ROCm versions report that), the arch's
# 160 KiB must win.
AMD = [("gfx942", (9, 4), 304, 64), ("gfx950", (9, 5), 256, 64)]
LDS = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
HEAD_DIMS = [16, 64, 96, 128, 192, 256]


@pytest.fixture
def amd(monkeypatch):
    """Make the library see an AMD GPU on a ROCm PyTorch: ``amd(arch, capability, cus, lds)``."""
    def use(arch, capability, cus, lds_kib):
        configs._gpu.cache_clear()
        props = SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-", multi_processor_count=cus,
                                shared_memory_per_block_optin=lds_kib * 1024,
                                major=capability[0], minor=capability[1])
        monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: f"AMD {arch}")
        return configs.gpu_of(None)
    yield use
    configs._gpu.cache_clear()


def _key(cfg):
    return configs._key(cfg)


@pytest.mark.parametrize("arch,capability,cus,lds", AMD, ids=[a[0] for a in AMD])
def test_amd_is_detected_as_amd(amd, monkeypatch, arch, capability, cus, lds):
    gpu = amd(arch, capability, cus, lds)
    assert gpu.is_amd and gpu.arch == arch and gpu.name == arch
    assert gpu.smem_per_block == LDS[arch] and gpu.compute_units == cus
    family = configs.family_of(gpu)
    assert family.wave64 and family is not configs.HOPPER
    assert family is (configs.CDNA4 if arch == "gfx950" else configs.CDNA3)
    assert configs.unsupported_gpu_reason(None) is None
    # No TMA unit on AMD: descriptor loads off, though (9, x) is Hopper's major.
    monkeypatch.setattr(configs, "interpreter_active", lambda: False)
    assert not configs.tma_capable(None)


def test_nvidia_detection_unchanged(monkeypatch):
    """Without torch.version.hip a capability (9, 0) is still Hopper, with TMA."""
    configs._gpu.cache_clear()
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a, **k: SimpleNamespace(shared_memory_per_block_optin=227 << 10))
    monkeypatch.setattr(configs, "interpreter_active", lambda: False)
    try:
        gpu = configs.gpu_of(None)
        assert not gpu.is_amd and configs.family_of(gpu) is configs.HOPPER
        assert configs.tma_capable(None)
        assert common.dot_precision(torch.bfloat16) == "tf32"
        assert all("waves_per_eu" not in c.kwargs for c in configs.fwd_configs()
                   + configs.bwd_configs())
    finally:
        configs._gpu.cache_clear()


@pytest.mark.parametrize("arch,capability,cus,lds", AMD, ids=[a[0] for a in AMD])
@pytest.mark.parametrize("matmul", ["highest", "high"])
def test_dot_precision_is_one_the_hip_backend_accepts(amd, arch, capability, cus, lds, matmul):
    """Every precision asked for on AMD is in what Triton's HIP backend allows for the arch
    (read from the backend itself: tf32 only on gfx942), so no tl.dot fails to compile."""
    from triton.backends.amd.compiler import HIPBackend
    from triton.backends.compiler import GPUTarget
    amd(arch, capability, cus, lds)
    allowed = HIPBackend(GPUTarget("hip", arch, 64)).parse_options({}).allowed_dot_input_precisions
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul)
    try:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            assert common.dot_precision(dtype) in allowed, (arch, dtype)
        assert common.dot_precision(torch.bfloat16) == "ieee"
        fp32 = common.dot_precision(torch.float32)
        assert fp32 == ("tf32" if matmul == "high" and "tf32" in allowed else "ieee")
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.parametrize("arch,capability,cus,lds", AMD, ids=[a[0] for a in AMD])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dropout", [0, 1])
def test_cdna_tables_keep_a_config_that_fits(amd, arch, capability, cus, lds, dtype, dropout):
    """Every launch keeps a config from its arch's own table whose LDS estimate fits the
    arch, for wave64 (at most 16 warps of 64 lanes: 1024 threads a workgroup)."""
    gpu = amd(arch, capability, cus, lds)
    family = configs.family_of(gpu)
    own = {kernel: {tuple(e) for e in getattr(family, kernel)} | set(configs.WIDE[kernel])
           for kernel in ("fwd", "dkdv", "dq")}
    elem = torch.empty(0, dtype=dtype).element_size()
    for d in HEAD_DIMS:
        fwd = _fwd_kept(d, dtype, dropout)
        assert fwd, (arch, d)
        for cfg in fwd:
            assert _key(cfg) in own["fwd"], (arch, d, _key(cfg))
            assert 64 * cfg.num_warps <= 1024
            assert configs.cdna_fwd_lds(cfg, block_d(d), elem) <= LDS[arch], (arch, d, _key(cfg))
        for kernel in ("dkdv", "dq"):
            kept = _bwd_kept(kernel, d, dtype, dropout)
            assert kept, (arch, kernel, d)
            for cfg in kept:
                assert _key(cfg) in own[kernel], (arch, kernel, d, _key(cfg))
                assert configs.cdna_bwd_lds(cfg, block_d(d), elem, kernel == "dkdv") \
                    <= LDS[arch], (arch, kernel, d, _key(cfg))
                assert configs.BWD_ROW_PAD % cfg.kwargs["BLOCK_M"] == 0


@pytest.mark.parametrize("arch,capability,cus,lds", AMD, ids=[a[0] for a in AMD])
def test_cdna_defaults_are_the_checked_ones(amd, arch, capability, cus, lds):
    """The forward's defaults (first kept config) at head_dim 64 / 128 ask for waves_per_eu 2
    (the HIP-only compile option travels with the config), and gfx950 keeps a 2-stage tile
    for its larger LDS where gfx942 keeps none."""
    amd(arch, capability, cus, lds)
    for d in (64, 128):
        for dropout in (0, 1):
            cfg = _fwd_kept(d, dropout=dropout)[0]
            assert cfg.kwargs.get("waves_per_eu") == 2, (arch, d, _key(cfg))
    stages = {c.num_stages for c in _fwd_kept(128)}
    assert stages == ({1, 2} if arch == "gfx950" else {1})


@pytest.mark.parametrize("arch,capability,cus,lds", AMD, ids=[a[0] for a in AMD])
def test_split_heuristic_counts_compute_units(amd, arch, capability, cus, lds):
    """Split-KV counts the arch's CUs (the device properties' multi-processor count is not
    asked when the gfx table knows it)."""
    amd(arch, capability, cus, lds)
    dev = torch.device("cuda", 0)
    prev = configs.interpreter_active
    try:
        configs.interpreter_active = lambda: False
        for n_programs, tiles in ((8, 64), (32, 256), (300, 64)):
            got = configs.num_splits_heuristic(dev, n_programs, tiles)
            assert got == configs.num_splits_heuristic(dev, n_programs, tiles, sm_count=cus)
        assert configs.num_splits_heuristic(dev, 8, 64) > 1
        assert configs.num_splits_heuristic(dev, int(0.8 * cus) + 1, 64) == 1
    finally:
        configs.interpreter_active = prev


def test_one_compile_per_arch(tmp_path):
    """The forward's default config, compiled by Triton's HIP backend for gfx942 and gfx950
    through the static tool (a fresh cache, so it really compiles): no failure, MFMA, no
    spill, LDS within the arch's limit."""
    out = tmp_path / "amd.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "amd_static.py"),
                        "--project", ROOT, "--variants", "fwd", "--head-dims", "64",
                        "--fwd-flags", "causal", "--defaults-only", "--seq", "256",
                        "--cache-dir", str(tmp_path / "cache"), "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [x for x in json.loads(out.read_text()) if x["kernel"] == "_attn_fwd"]
    assert sorted(x["arch"] for x in rows) == ["gfx942", "gfx950"]
    for x in rows:
        assert x["status"] == "ok" and x["kept"], x
        assert x["mfma"] > 0 and x["vgpr_spill"] == 0 and x["sgpr_spill"] == 0, x
        assert x["smem"] <= x["smem_limit"] == LDS[x["arch"]], x


def test_direct_launch_goes_through_the_hip_launcher(monkeypatch):
    """On ROCm a launch plan calls the compiled kernel's launcher as Triton does: HIP's C entry
    takes its arguments in another order and has no PDL flag (``launch_pdl``), so the CUDA
    shortcut must not be taken there."""
    from kernels.core import launch
    calls = []

    class HipLauncher:          # what Triton 3.9's HIP launcher exposes (no launch_pdl)
        global_scratch_size, global_scratch_align, profile_scratch_size = 0, 1, 0
        launch_cooperative_grid = False
        arg_annotations = kernel_signature = None

        def launch(self, *args):
            raise AssertionError("the C entry was called with CUDA's argument order")

        def __call__(self, *args):
            calls.append(args)

    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    entry, expanded = launch._c_entry(HipLauncher(), (3, 2, 1), "fn", "meta", None)
    entry(7, [10, 11])
    assert calls == [(3, 2, 1, 7, "fn", "meta", None, None, None, 10, 11)]
    assert not expanded   # (no host descriptors were asked for)
