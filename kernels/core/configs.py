"""Launch configurations: the one place that lists block sizes, warps and stages, the pruning
of each kernel's list and the autotune keys.

On a GPU the kernels are autotuned over these lists, pruned per head_dim by shared-memory
footprint and register estimates; in Triton's CPU interpreter autotuning would time every config
in Python, so one small fixed config is used. The lists are short on purpose: every config is
compiled and timed once per autotune key (``FWD_TUNE_KEY``, ``BWD_TUNE_KEY``: the power-of-two
buckets of q_len and k_len, head_dim and each compiled feature flag; Triton adds every tensor
argument's dtype) and a long list costs minutes.

``KERNELS_AUTOTUNE=0`` turns autotuning off on the GPU: each launch then takes the first config
of its list that survives pruning and compiles (``launch_first_compiling``). The GPU test suite
sets it, so that its hundreds of small shapes do not each compile and time every config
(tests/core/test_gpu.py runs every config once).
``KERNELS_TMA=0`` turns tensor-descriptor (TMA) loads off everywhere (``tma_capable``): the
per-thread loads of other GPUs, for A/B timings (benchmarks/gpu_check.sh, stage "tma_ab") and
as a way around a TMA problem on a new GPU or Triton. ``KERNELS_TMA=kernel`` keeps TMA but
makes every descriptor in the kernel, per program (``host_descriptors_enabled``: the forward
and backward before host descriptors, for the same A/B).
``KERNELS_FWD_PERSISTENT=1`` launches dense forward calls persistently (``persistent_enabled``:
``PERSISTENT_PROGRAMS_PER_SM`` programs per SM drawing query blocks, longest first, from a
counter; the A/B of benchmarks/gpu_check.sh's stage "persistent_ab"); off by default until a GPU
says it wins. ``KERNELS_FWD_WARP_SPEC=1`` offers the forward's autotuner warp-specialised
configs where they apply (``warp_spec_configs``; stage "warpspec_ab"); off by default too.
"""
import functools
import math
import os
from typing import NamedTuple, Optional

import torch
import triton
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import OutOfResources, PTXASError

from .common import head_blocks, interpreter_active

# ---------------------------------------------------------------------------------------------
# GPU generations
# ---------------------------------------------------------------------------------------------
class Gpu(NamedTuple):
    """What pruning needs to know of a GPU: its compute capability and the shared memory one
    block may use (bytes; the opt-in maximum; on AMD the LDS a workgroup may use). On AMD
    (a ROCm build of PyTorch) ``arch`` is the gfx name ("gfx942") and ``compute_units`` the CU
    count; the capability PyTorch reports there ((9, 4) on MI300) says nothing about NVIDIA's
    generations."""
    capability: tuple
    smem_per_block: int
    arch: str = ""           # AMD only: the gfx architecture name
    compute_units: int = 0   # AMD only (split-KV counts with it)

    @property
    def is_amd(self) -> bool:
        return bool(self.arch)

    @property
    def name(self) -> str:
        return self.arch or f"sm_{self.capability[0]}{self.capability[1]}"


# Shared memory per block (opt-in maximum) by compute capability, from NVIDIA's tables: used
# when the device cannot be asked (no CUDA device: the static compile tools, the CPU tests).
_SMEM_PER_BLOCK = {(7, 0): 96, (7, 5): 64, (8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99,
                   (9, 0): 227, (10, 0): 227, (10, 3): 227, (11, 0): 227, (12, 0): 99,
                   (12, 1): 99}
# Without any CUDA device (the CPU test suite), pruning answers for an H100.
_NO_DEVICE = (9, 0)
# The oldest generation the Triton kernels serve: Triton 3.x has no tensor-core code below
# sm_80 (every tl.dot becomes FMA loops that spill kilobytes), so older GPUs take the PyTorch
# path (kernels.ops routes them; kernels/core/fallback.py).
MIN_CAPABILITY = (8, 0)

# AMD Instinct (CDNA) by gfx name: LDS per workgroup (bytes) and compute units, from AMD's
# CDNA3 / CDNA4 ISA guides and data sheets: MI300X (gfx942) 64 KiB, 304 CUs; MI355X (gfx950)
# 160 KiB, 256 CUs. The LDS figure is what Triton's HIP backend compiles against (its
# ``OutOfResources`` check at load); the table wins over what the runtime reports, which on
# some ROCm versions is 64 KiB on gfx950 too.
AMD_ARCHS = {"gfx942": (64 * 1024, 304), "gfx950": (160 * 1024, 256)}
# An AMD GPU not in the table (gfx90a, RDNA) is pruned with the smallest of these budgets.
_AMD_DEFAULT = "gfx942"


def hip_runtime() -> bool:
    """Whether PyTorch is a ROCm build: its ``cuda`` devices are then AMD GPUs."""
    return bool(getattr(torch.version, "hip", None))


def _amd_gpu(index):
    props = torch.cuda.get_device_properties(index)
    arch = str(getattr(props, "gcnArchName", "") or _AMD_DEFAULT).split(":")[0]
    lds, cus = AMD_ARCHS.get(arch, AMD_ARCHS[_AMD_DEFAULT])
    try:
        capability = tuple(torch.cuda.get_device_capability(index))
    except (AssertionError, RuntimeError):
        capability = (props.major, props.minor)
    return Gpu(capability, lds, arch, int(getattr(props, "multi_processor_count", 0) or cus))


@functools.lru_cache(maxsize=None)
def _gpu(index):
    if hip_runtime():
        return _amd_gpu(index)
    try:
        capability = tuple(torch.cuda.get_device_capability(index))
    except (AssertionError, RuntimeError):  # CPU-only torch or no driver
        capability = _NO_DEVICE
    try:
        smem = int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)
    except (AssertionError, RuntimeError, AttributeError):
        smem = _SMEM_PER_BLOCK.get(capability, _SMEM_PER_BLOCK[_NO_DEVICE]) * 1024
    return Gpu(capability, smem)


def gpu_of(device=None) -> Gpu:
    """The ``Gpu`` of a CUDA ``device`` (torch.device, index or None = the current one)."""
    if isinstance(device, torch.device):
        device = device.index if device.type == "cuda" else None
    return _gpu(device)


# Generations whose forward reads K / V (and Q) tiles with the tensor memory accelerator (TMA:
# tensor descriptors, cp.async.bulk.tensor / UTMALDG) instead of per-thread cp.async: Hopper
# (sm_90), where the static compile check keeps every config spill-free with it (fewer registers
# in all of them; docs/gpu.md). Ampere-class GPUs (sm_80/86/89) have no TMA. Blackwell
# (sm_100, sm_120) has the unit, but its tables were chosen with cp.async: with TMA three sm_100
# head_dim-128 causal configs, the default among them, compile to 128 registers and spill 4-8 B,
# so both keep per-thread loads until their tables are re-checked with it.
TMA_MAJORS = (9,)
# dK/dV with dropout keeps per-thread loads from this padded head dim up: with descriptors its
# default 32 x 128 tile compiled to 255 registers and spilled 72-120 B at head_dim 128 on sm_90
# (Philox words, keep mask and the descriptors' tiles live at once); per-thread loads: 0 B.
TMA_DKDV_DROPOUT_MAX_WIDTH = 64


def tma_capable(device=None) -> bool:
    """Whether the forward may use tensor-descriptor (TMA) loads on ``device``: on the GPU
    generations of ``TMA_MAJORS``, and always under Triton's interpreter (which emulates descriptor
    loads, so the CPU test suite covers that code path); never with ``KERNELS_TMA=0``."""
    # AMD GPUs have no TMA unit: Triton rewrites descriptor loads into pointer loads there,
    # with more VGPRs and a scratch allocator for nothing.
    return tma_enabled() and _nvidia_generation_in(device, TMA_MAJORS)


def _nvidia_generation_in(device, majors) -> bool:
    """Whether ``device`` (``gpu_of``: a CUDA device, or the static tools' stub target for CPU
    tensors) is an NVIDIA GPU whose compute capability's major is in ``majors``; always under
    Triton's interpreter, so that the CPU test suite covers what those GPUs run."""
    if interpreter_active():
        return True
    gpu = gpu_of(device)
    return not gpu.is_amd and gpu.capability[0] in majors


def sm_count_of(device) -> int:
    """Streaming multiprocessors of the CUDA ``device`` (on AMD: compute units, 304 on MI300X,
    256 on MI355X, each running a workgroup as an NVIDIA SM runs a block)."""
    return gpu_of(device).compute_units or torch.cuda.get_device_properties(
        device).multi_processor_count


def unsupported_gpu_reason(device) -> Optional[str]:
    """Why the Triton kernels do not run on this CUDA device, or None when they do."""
    gpu = gpu_of(device)
    if gpu.is_amd or gpu.capability >= MIN_CAPABILITY:
        return None
    return (f"{torch.cuda.get_device_name(device)} ({gpu.name}) has no tensor-core path in "
            f"Triton {triton.__version__} (tl.dot compiles to FMA loops below sm_80)")


# FP8 tensor cores (mma / wgmma with e4m3 operands): Ada (sm_89) and later.
FP8_MIN_CAPABILITY = (8, 9)


def fp8_unsupported_reason(device) -> Optional[str]:
    """Why FP8 calls do not run the Triton kernels on this CUDA device, or None."""
    gpu = gpu_of(device)
    if torch.version.hip is None and gpu.capability >= FP8_MIN_CAPABILITY:
        return None
    return (f"{torch.cuda.get_device_name(device)} ({gpu.name}) has no FP8 tensor-core path "
            f"here (FP8 kernels need sm_89 or later on NVIDIA; AMD is not checked with FP8)")


# Autotune keys (kernel argument names). Sequence lengths enter as power-of-two buckets, so a new
# length re-tunes only when it changes bucket.
FWD_TUNE_KEY = ["BUCKETS", "HEAD_DIM", "HEAD_DIM_V", "SPEC", "KEYS", "PACK_GQA",
                "SPLIT", "DROPOUT", "PRECISION", "TMA"]
BWD_TUNE_KEY = ["BUCKETS", "HEAD_DIM", "HEAD_DIM_V", "SPEC", "VARLEN", "DROPOUT",
                "DOT_PRECISION", "TMA"]
# The backward's row statistics are padded to multiples of this many rows per (sequence, head)
# (backward.stats_layout), so its kernels load whole BLOCK_M-row tiles of them without a mask:
# every backward config's BLOCK_M must divide it (tests/core/test_configs.py checks the tables).
BWD_ROW_PAD = 128


# ---------------------------------------------------------------------------------------------
# Launch configs per GPU generation family
# ---------------------------------------------------------------------------------------------
# Entries are (BLOCK_M, BLOCK_N, num_warps, num_stages). The first entry a launch's pruning keeps
# is also its fixed choice under KERNELS_AUTOTUNE=0 (the default config). Every table was chosen
# from what ptxas makes of each entry for that generation (the static compile check of
# docs/gpu.md, triton 3.6): fits the GPU's shared memory, no register spills, no
# serialized wgmma (C7515) on sm_90, at head_dim 64 and 128 for bf16/fp16, causal or not, with
# or without dropout.
class Family(NamedTuple):
    """The launch configs of one GPU generation family and what its pruning checks."""
    name: str
    fwd: tuple               # forward configs, in preference order
    dkdv: tuple              # dK/dV: BLOCK_N keys resident, BLOCK_M query rows streamed
    dq: tuple                # dQ: BLOCK_M query rows resident, BLOCK_N keys streamed
    fwd_smem_cap: int        # bytes: the forward's shared-memory estimate must stay below both
    bwd_smem_cap: int        # this and the GPU's limit (headroom for the compiler's scratch)
    register_model: bool     # prune by per-thread register estimates (wgmma tiles) ...
    max_head_dim: tuple      # ... or: per entry of fwd / dkdv / dq, the largest head_dim
                             # (padded) it is listed for (mma.sync tiles, verified per entry)
    distinct_rows: bool = False  # forward and dQ: prefer tiles whose resident rows give
                             # every warp its own (``_distinct_rows``): wgmma's warpgroups
                             # otherwise compute the same rows twice
    fwd_edge_regs: int = 0   # forward with a window / chunk edge: accumulator + score tile
                             # per thread at most this (0: no such budget)
    wave64: bool = False     # AMD CDNA: 64-lane waves, MFMA, LDS; its entries per launch
    tables: Optional[dict] = None  # come from ``tables`` (kernel, padded width, dropout)
    short_fwd_warps: int = 0  # forward, q_len <= SHORT_Q_LEN at padded head_dim <= 64: this
                             # many warps first (0: the table's order)
    fwd_warp_spec: tuple = ()  # forward entries with a warp-specialised copy (WARP_SPEC),
                             # offered with KERNELS_FWD_WARP_SPEC=1 (``warp_spec_configs``)


# Hopper (sm_90): 227 KiB per block; tl.dot is wgmma, and Triton gives the chained dots of
# every kernel here all warps along the resident rows (warpsPerCTA [num_warps, 1]), 16 rows per
# warp: with fewer resident rows than 16 x num_warps the two warpgroups compute the same rows
# (64 rows on 8 warps: 1.5-1.67x the tile's tensor work, the softmax twice). ``distinct_rows``
# drops such forward and dQ tiles wherever one with distinct rows fits (docs/gpu.md,
# "Per-tile speed"). Forward: 128 x 128 on 8 warps first (the accumulator rescale and the row
# bookkeeping once per 128 keys; 3 stages take 224 KiB at head_dim 128, hence the higher cap),
# 128 x 64 with dropout or a window / chunk edge at 128 (the register model), 64 x 64 on
# 8 warps only at width 256. dK/dV: the resident side >= 64 (32-key blocks compile to mma.sync
# on sm_90), 8 warps, 2 stages (a third brings C7515 back); 64 x 128 at head_dim 64 without
# dropout or grouped heads; the 64-key tiles stay (their rows are shared, but with grouped
# heads at 128 they were the ones that did not spill). dQ: 128 query rows on 8 warps or 64 on
# 4; at width 256 only 128 x 16 on 8 warps compiled spill-free (160 KiB, 164 KiB with dropout:
# hence the backward cap of 176 KiB).
HOPPER = Family(
    name="hopper (sm_90)",
    fwd=((128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3),
         (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4), (64, 64, 8, 2)),
    dkdv=((64, 128, 8, 2), (32, 128, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2), (16, 128, 8, 2),
          (16, 64, 8, 2)),
    dq=((128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 16, 8, 2)),
    fwd_smem_cap=224 * 1024, bwd_smem_cap=176 * 1024, register_model=True, max_head_dim=(),
    distinct_rows=True, fwd_edge_regs=96, short_fwd_warps=4,
    fwd_warp_spec=((128, 64, 4, 3), (128, 64, 4, 2), (128, 128, 4, 2), (128, 32, 4, 4),
                   (64, 64, 4, 3)))

# At q_len <= SHORT_Q_LEN every program of a causal forward runs one query block: its fixed cost
# (set-up, Q, the final scaling and stores), which every warp issues, is most of its work. On
# sm_90 at head_dim 64 an 8-warp 128 x 128 program issues it twice over (tools/sass_budget.py
# --prologue: 4720 warp-instructions per program vs 3792 for the tutorial's 4-warp 128 x 64),
# so short calls take the family's ``short_fwd_warps`` configs first. Autotuning still times
# every kept config; this is the order KERNELS_AUTOTUNE=0 takes.
SHORT_Q_LEN = 128

# Ampere-style tensor cores (mma.sync): A100 (sm_80, 163 KiB), A10 / RTX 3090 (sm_86, 99 KiB),
# L4 / RTX 4090 (sm_89, 99 KiB), RTX 5090 (sm_120, 99 KiB). mma.sync takes its operands from
# registers, so the wgmma tiles spill here (the forward's 128 x 64 at head_dim 128, every dQ
# tile at 128, dK/dV 32 x 128 with dropout: 10 KB): smaller tiles per head_dim class, each
# entry listed for the largest head_dim it compiles spill-free at.
AMPERE = Family(
    name="ampere (sm_80, sm_86, sm_89, sm_120)",
    fwd=((128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 4), (64, 64, 8, 2),
         (64, 32, 4, 3), (64, 32, 8, 2), (32, 32, 4, 2)),
    dkdv=((32, 128, 8, 2), (16, 128, 8, 2), (16, 64, 8, 2), (32, 64, 8, 2), (16, 32, 4, 2),
          (16, 32, 8, 1)),
    dq=((128, 32, 8, 2), (64, 32, 4, 3), (64, 32, 8, 2), (32, 32, 4, 2), (32, 64, 4, 2),
        (32, 16, 4, 2), (16, 32, 4, 2)),
    fwd_smem_cap=200 * 1024, bwd_smem_cap=160 * 1024, register_model=False,
    max_head_dim=((64, 64, 64, 64, 128, 128, 256, 256),
                  (64, 64, 128, 64, 128, 256),
                  (64, 64, 128, 128, 64, 128, 256)))

# Datacenter Blackwell (sm_100): the Hopper tiles compile to tcgen05 with far fewer registers,
# but some Hopper tiles spilled 4-8 B there with dropout (dK/dV 32 x 128 and dQ 64 x 32 at
# head_dim 64, dQ 64 x 64 at 128, the last two Hopper defaults): the tiles that did not.
BLACKWELL = Family(
    name="blackwell (sm_100)",
    # The sm_90 forward list as it was verified here (before sm_90's own reordering).
    fwd=((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 4),
         (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 4), (128, 128, 8, 2), (64, 64, 8, 2)),
    dkdv=((32, 64, 8, 2), (64, 64, 8, 2), (16, 64, 8, 2)),
    dq=((128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 8, 2)),
    fwd_smem_cap=200 * 1024, bwd_smem_cap=160 * 1024, register_model=True, max_head_dim=())

# Head dims above 256 (Gemma 4's 512; padded widths 512): every generation takes these small
# tiles instead of its family's. At width 512 no wgmma tile compiled spill-free on sm_90
# (the 64-row forward needs 128 fp32 accumulator registers per thread at 8 warps, and Triton
# caps 16-warp kernels at 128 registers: every 64-row config spilled 136 B - 7 KB; triton 3.6,
# docs/gpu.md), so these are mma.sync tiles: the forward 32 x 32 (210 registers) and
# 32 x 16 (173), dK/dV 16 x 32 (245) and 16 x 16 (167), dQ 16 x 16 (250), all spill-free; on
# sm_86 (99 KiB per block) the dK/dV 16 x 32 does not fit and 16 x 16 (81920 B) is taken.
WIDE_MIN_WIDTH = 512
WIDE = dict(fwd=((32, 32, 8, 1), (32, 16, 8, 2)),
            dkdv=((16, 32, 8, 2), (16, 16, 8, 1)),
            dq=((16, 16, 8, 1),))
# fp32 at those widths on NVIDIA: with IEEE dots (PyTorch's default "highest" matmul
# precision: FMA loops, no tensor cores) WIDE's forward tiles spilled 4-23 KB on sm_86 to
# sm_100 and took 130-132 KiB, over the 99 KiB of sm_86/89/120; 16 x 16 on 4 warps compiled
# spill-free everywhere, IEEE or TF32 (239-255 registers, 64-65 KiB).
# The fp32 backward's smallest tiles need 128-129 KiB: on the 99 KiB GPUs it has no config
# that loads (backend.AttentionPlan then runs the fallback, warned).
WIDE_FP32 = dict(fwd=((16, 16, 4, 1),))
# MLA's latent width (q / k head dim 576 = 512 + 64 as two tiles, common.head_blocks; padded
# width 576; V read from the K tile: KeyLayout.v_in_k): the forward's tiles on every
# generation, bf16 / fp16 and an e4m3 cache read by bf16 q (fp32 keeps WIDE_FP32). Measured on
# the decode launches (paged and dense, 16 / 128 query heads packed into rows, 1 / 4 tokens,
# 1 / 4 splits; tools/sm90_static.py --mla all, triton 3.6; tools/amd_static.py --variants mla,
# triton 3.9; docs/gpu.md "MLA (576)"): 64-row tiles spilled everywhere (sm_86 mma.sync 92-340
# B, sm_90 wgmma 1.1-3.4 KB, sm_100 tcgen05 144-208 B on 8 warps, more on 4 or 16), so 32 rows
# on mma.sync; 32 x 64 spilled 8-104 B with the e4m3 cache on sm_90 / sm_100, 16 x 32 on 4
# warps 20 B on sm_120. WIDE's 32 x 32 takes 102,400 B, over the 99 KiB (101,376 B) of
# sm_86 / 89 / 120, where WIDE kept nothing that loads; 32 x 16 takes 69,632 B. One stage: on
# NVIDIA two took the same shared memory and registers. On AMD (LATENT_CDNA) 32 x 32 on 8
# waves spilled 157-200 VGPRs on gfx942 and 20-61 on gfx950; 32 x 16 compiled spill-free on
# both (216-220 VGPRs, 32 KiB of LDS).
LATENT_MIN_WIDTH = WIDE_MIN_WIDTH + 1
LATENT = dict(fwd=((32, 32, 8, 1), (32, 16, 8, 1)))
LATENT_CDNA = dict(fwd=((32, 16, 8, 1),))

# fp32 with IEEE dots (PyTorch's default "highest" matmul precision) on NVIDIA below those
# widths, per padded head_dim (16 and 32 take 64's): tl.dot is an FMA loop there, no tensor
# cores, and the family tables (chosen for bf16/fp16 tensor-core tiles) spilled in all 34 kept
# configs at head_dim 64 on sm_90, causal +- dropout (dK/dV 64 x 128: 50 KB, dQ 128 x 64:
# 31 KB, forward 128 x 128: 10 KB; tools/sm90_static.py, triton 3.6). These tiles compiled
# spill-free on sm_80 to sm_120, causal, with and without dropout (dK/dV 16 x 16 with dropout:
# 8-16 B on sm_80 / 86 / 89), except at width 256 on sm_90, where the least-spilling tile is
# listed (16 x 16 on 8 warps: forward 0.4 KB, dQ 1.7 KB, dK/dV 2.8 KB; docs/gpu.md). TF32
# keeps the family tables. No GPU has timed them yet: the autotuner picks among them.
_FMA_NARROW = ((16, 16, 8, 1),)
FMA_FP32 = {64: dict(fwd=((32, 32, 8, 1), (32, 16, 8, 2), (16, 16, 4, 1)),
                     dkdv=((16, 32, 8, 1), (16, 16, 8, 1)),
                     dq=((32, 16, 4, 2), (16, 16, 8, 1))),
            128: dict(fwd=_FMA_NARROW, dkdv=_FMA_NARROW, dq=_FMA_NARROW),
            256: dict(fwd=_FMA_NARROW, dkdv=_FMA_NARROW, dq=_FMA_NARROW)}

# AMD CDNA (MI300: gfx942, MI350: gfx950): 64-lane waves, MFMA, LDS. Chosen from what LLVM's
# AMDGPU backend makes of each entry (tools/amd_static.py, triton 3.9): per arch, kernel,
# padded head_dim (64: also 16 and 32; 128; 256) and dropout, the entries that compiled with no
# VGPR or SGPR spill at every flag checked (causal or not), in preference order, the first
# (the default) also spill-free with grouped heads, packed sequences, split-KV and paged
# caches where one was (the autotuner times the rest). A workgroup of
# w waves spreads over a CU's 4 SIMDs, whose 512 registers per lane (architected + accumulation
# VGPRs) it shares: 512 per lane at 4 waves and one wave per SIMD, 256 with waves_per_eu 2 or
# 8 waves. Entries may carry a fifth element, waves_per_eu (a HIP compile option: the
# occupancy LLVM budgets registers for; 0 = its own choice): AMD's own Triton attention runs
# 128 x 64, 4 waves, 1 stage, waves_per_eu 2 -- here 128 x 64 spilled on gfx942 (at head_dim
# 64: 1-26 SGPRs; at 128: 70-155 VGPRs), 128 x 32 did not. With num_stages 2 Triton's stream
# pipeliner buffers K / V in LDS: on gfx950 (160 KiB) 128 x 64 with 2 stages compiled
# spill-free at head_dim 128 (with dropout too: accumulation VGPRs take the accumulator).
# Every entry at width 256 with waves_per_eu 2 spilled (hundreds of VGPRs): 64 x 32 without it
# is the forward's default there, on gfx950 on 8 waves, on gfx942 with waves_per_eu 1 (the
# budget of its one wave per SIMD; 64 x 32 on 8 waves spilled 2-5 SGPRs there, and with 2
# stages it did not (36 KiB of LDS) but the LDS estimate's bound prunes it) -- on 4 waves
# without it, the packed, split-KV and paged forwards spilled 8-18 SGPRs (into VGPR lanes).
# At head_dim 128 on gfx942 the paged forward spilled 8 SGPRs with 128 x 32 and 6-21 with every
# other 4096-element tile tried but 256 x 16 (the whole 64 KiB of LDS): 128 x 16 is the default
# there, 128 x 32 stays second for the autotuner.
_F128_32, _F128_16 = (128, 32, 4, 1, 2), (128, 16, 4, 1, 2)
_F64_32_W8, _F64_32_WPE1 = (64, 32, 8, 1), (64, 32, 4, 1, 1)
_F128_64 = (128, 64, 4, 1, 2)
_F128_64_S2 = (128, 64, 4, 2, 2)
_F64_64 = (64, 64, 4, 1, 2)
_F64_32, _F32_32, _F32_32_W8 = (64, 32, 4, 1), (32, 32, 4, 1), (32, 32, 8, 1)
_K32_128, _K32_64, _K16_128 = (32, 128, 8, 1), (32, 64, 4, 1), (16, 128, 8, 1)
_K16_64, _K16_32 = (16, 64, 4, 1), (16, 32, 4, 1)
_Q128_64, _Q64_32 = (128, 64, 8, 1), (64, 32, 4, 1)
_Q32_32, _Q16_32 = (32, 32, 4, 1), (16, 32, 4, 1)
# (kernel, padded width, dropout) -> entries.
CDNA3_TABLES = {
    ("fwd", 64, False): (_F128_32, _F64_32, _F32_32),
    ("fwd", 64, True): (_F128_32, _F32_32, _F32_32_W8),
    ("fwd", 128, False): (_F128_16, _F128_32, _F64_32, _F32_32),
    ("fwd", 128, True): (_F128_32, _F32_32_W8),
    ("fwd", 256, False): (_F64_32_WPE1, _F64_32, _F32_32),
    ("fwd", 256, True): (_F64_32, _F32_32_W8),
    ("dkdv", 64, False): (_K32_128, _K32_64, _K16_64, _K16_32),
    ("dkdv", 64, True): (_K32_128, _K32_64, _K16_64, _K16_32),
    ("dkdv", 128, False): (_K32_64, _K16_128, _K16_64, _K16_32),
    ("dkdv", 128, True): (_K16_128, _K16_64, _K16_32),
    ("dkdv", 256, False): (_K16_32, _K16_64),
    ("dkdv", 256, True): (_K16_64, _K16_32),
    ("dq", 64, False): (_Q64_32, _Q32_32, _Q16_32),
    ("dq", 64, True): (_Q64_32, _Q32_32, _Q16_32),
    ("dq", 128, False): (_Q64_32, _Q32_32, _Q16_32),
    ("dq", 128, True): (_Q64_32, _Q32_32, _Q16_32),
    ("dq", 256, False): (_Q64_32, _Q32_32, _Q16_32),
    ("dq", 256, True): (_Q64_32, _Q32_32, _Q16_32),
}
CDNA4_TABLES = {
    ("fwd", 64, False): (_F64_64, _F128_64_S2, _F128_64, _F128_32, _F64_32),
    ("fwd", 64, True): (_F128_32, _F64_32, _F32_32),
    ("fwd", 128, False): (_F128_32, _F128_64_S2, _F128_64, _F64_64, _F64_32),
    ("fwd", 128, True): (_F128_64_S2, _F128_32, _F32_32),
    ("fwd", 256, False): (_F64_32_W8, _F64_32, _F32_32),
    ("fwd", 256, True): (_F64_32, _F32_32),
    ("dkdv", 64, False): (_K32_64, _K32_128, _K16_64, _K16_32),
    ("dkdv", 64, True): (_K32_64, _K16_64, _K16_32),
    ("dkdv", 128, False): (_K32_64, _K16_128, _K16_64, _K16_32),
    ("dkdv", 128, True): (_K32_64, _K16_128, _K16_64, _K16_32),
    ("dkdv", 256, False): (_K16_64, _K16_32),
    ("dkdv", 256, True): (_K16_64, _K16_32),
    ("dq", 64, False): (_Q64_32, _Q128_64, _Q32_32, _Q16_32),
    ("dq", 64, True): (_Q64_32, _Q32_32, _Q16_32),
    ("dq", 128, False): (_Q64_32, _Q32_32, _Q16_32),
    ("dq", 128, True): (_Q64_32, _Q32_32, _Q16_32),
    ("dq", 256, False): (_Q64_32, _Q32_32, _Q16_32),
    ("dq", 256, True): (_Q64_32, _Q32_32, _Q16_32),
}


def _cdna(name, tables, lds):
    def union(kernel):
        return tuple(dict.fromkeys(e for (k, _, _), es in tables.items() if k == kernel
                                   for e in es))
    return Family(name=name, fwd=union("fwd"), dkdv=union("dkdv"), dq=union("dq"),
                  fwd_smem_cap=lds, bwd_smem_cap=lds, register_model=False, max_head_dim=(),
                  wave64=True, tables=tables)


CDNA3 = _cdna("cdna3 (gfx942)", CDNA3_TABLES, 64 * 1024)
CDNA4 = _cdna("cdna4 (gfx950)", CDNA4_TABLES, 160 * 1024)

_INTERPRET = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)
_KERNELS = ("fwd", "dkdv", "dq")


def family_of(gpu: Gpu) -> Family:
    """The config family of a GPU generation that the Triton kernels serve (sm_80 and newer;
    older ones are routed to the PyTorch path before any launch)."""
    if gpu.is_amd:
        return CDNA4 if gpu.arch == "gfx950" else CDNA3
    major = gpu.capability[0]
    return HOPPER if major == 9 else BLACKWELL if major in (10, 11) else AMPERE


def _configs(table):
    out = []
    for bm, bn, w, s, *wpe in table:
        kwargs = {"BLOCK_M": bm, "BLOCK_N": bn}
        if wpe and wpe[0]:
            kwargs["waves_per_eu"] = wpe[0]   # a HIP compile option, passed with the launch
        out.append(triton.Config(kwargs, num_warps=w, num_stages=s))
    return out


def _platform_families():
    """The families of this PyTorch build's GPUs: AMD's on ROCm (their entries carry the
    HIP-only ``waves_per_eu``, which CUDA's compiler would refuse), NVIDIA's otherwise."""
    return (CDNA3, CDNA4) if hip_runtime() else (HOPPER, BLACKWELL, AMPERE)


def _union(kernel):
    """Every family's entries of this platform for ``kernel`` and the wide tiles, in order,
    once: what an autotuner is built with (its pruning then keeps the running GPU's own)."""
    wide = list(WIDE[kernel]) + ([] if hip_runtime() else list(WIDE_FP32.get(kernel, ())) + [
        e for table in FMA_FP32.values() for e in table[kernel]]) + [
        e for table in (LATENT, LATENT_CDNA) for e in table.get(kernel, ())]
    return list(dict.fromkeys([e for fam in _platform_families()
                               for e in getattr(fam, kernel)] + wide))


def fwd_configs(interpret: bool = False):
    """Candidate configs of the forward kernel (BLOCK_M queries x BLOCK_N keys per step), of
    every family, and the warp-specialised copies (WARP_SPEC) of the entries a family lists
    in ``fwd_warp_spec``; ``prune_configs`` keeps the GPU's."""
    if interpret:
        return [_INTERPRET]
    ws = list(dict.fromkeys(e for fam in _platform_families() for e in fam.fwd_warp_spec))
    return _configs(_union("fwd")) + [
        triton.Config(dict(c.kwargs, WARP_SPEC=True), num_warps=c.num_warps,
                      num_stages=c.num_stages) for c in _configs(ws)]


def bwd_configs(interpret: bool = False, kernel: str = "both"):
    """Candidate configs of the backward kernels of every family: ``kernel="dkdv"`` (BLOCK_N
    keys per program, BLOCK_M query rows per step), ``"dq"`` (the converse) or ``"both"`` (the
    union, in order: what the tests force on both kernels at once)."""
    if interpret:
        return [_INTERPRET]
    tables = {"dkdv": _union("dkdv"), "dq": _union("dq"),
              "both": list(dict.fromkeys(_union("dkdv") + _union("dq")))}
    if kernel not in tables:
        raise ValueError(f"kernel must be one of {sorted(tables)}, got {kernel!r}")
    return _configs(tables[kernel])


def tma_enabled() -> bool:
    """False when the environment sets KERNELS_TMA=0 (see the module docstring)."""
    return os.environ.get("KERNELS_TMA", "1") != "0"


def host_descriptors_enabled() -> bool:
    """False when the environment sets KERNELS_TMA=kernel: dense forward and backward calls
    then make their descriptors in the kernel as packed sequences do (see the module
    docstring)."""
    return os.environ.get("KERNELS_TMA", "1") != "kernel"


# A persistent forward's programs per SM (``persistent_enabled``). Tiles are handed out by a
# counter, so programs beyond what an SM holds at once only draw an empty ticket; two let a
# program's prologue and epilogue overlap another's tiles where two fit (4-warp configs).
PERSISTENT_PROGRAMS_PER_SM = 2
# The interpreter's persistent grid: a few programs, so that the tests see tiles drawn by more
# than one (they run one after another there: the first draws them all) and the counter reset.
PERSISTENT_INTERPRET_PROGRAMS = 3


# Generations that take the persistent forward: Hopper, where every kept config compiles to it
# without spills (+4 to +67 registers over the grid launch, median +30; tools/sm90_static.py
# "+persistent" flags, 2026-11-28). On sm_100 the same configs gained up to 97 registers and
# 8 of 22 spilled (4-184 B; a default among them): the grid launch stays there.
PERSISTENT_MAJORS = (9,)


def persistent_capable(device) -> bool:
    """Whether a persistent forward may launch on ``device`` (``PERSISTENT_MAJORS``; the
    interpreter: always, so the CPU suite covers the code)."""
    return _nvidia_generation_in(device, PERSISTENT_MAJORS)


def persistent_enabled() -> bool:
    """True when the environment sets KERNELS_FWD_PERSISTENT=1 (see the module docstring)."""
    return os.environ.get("KERNELS_FWD_PERSISTENT", "0") == "1"


def persistent_programs(device) -> int:
    """How many programs a persistent forward launches on ``device`` at most."""
    if device.type != "cuda" or interpreter_active():
        return PERSISTENT_INTERPRET_PROGRAMS
    return PERSISTENT_PROGRAMS_PER_SM * sm_count_of(device)


def autotune_enabled() -> bool:
    """False when the environment sets KERNELS_AUTOTUNE=0 (see the module docstring)."""
    return os.environ.get("KERNELS_AUTOTUNE", "1") != "0"


def with_pre_hook(configs, pre_hook, **defaults):
    """``configs`` as copies whose ``pre_hook`` is ``pre_hook`` (a kernel's host descriptor
    blocks: ``forward.set_desc_blocks``, ``backward.set_bwd_desc_blocks``), with ``defaults``
    for the kwargs a config does not set."""
    return [triton.Config({**defaults, **c.kwargs}, num_warps=c.num_warps,
                          num_stages=c.num_stages, num_ctas=c.num_ctas, maxnreg=c.maxnreg,
                          pre_hook=pre_hook)
            for c in configs]


def fixed_configs(configs, prune, kernel_args):
    """The configs a launch may use without autotuning, in order: those of ``configs`` that
    ``prune`` (an ``early_config_prune`` hook) keeps for these keyword arguments of the kernel.
    The launch takes the first that compiles (``launch_first_compiling``)."""
    return prune(configs, {}, **kernel_args)


# What a config's compilation or loading may raise; the autotuner skips such a config, and so
# does a launch without autotuning. Seen: triton 3.6's ptxas crashes (error -11) on sm_90 for
# k_len == 1 with causal masking (the length specialised to a constant) at the 128-row, 8-warp
# dQ tiles and the 2-stage packed-GQA forward tiles; other configs compile.
_COMPILE_ERRORS = (PTXASError, OutOfResources, CompileTimeAssertionFailure)


def smem_bytes(config, block_d: int, elem_bytes: int) -> int:
    """Shared-memory estimate of a forward config: the query tile plus num_stages buffered K
    and V tiles (the pipelined loads), all of width block_d. Exact for wgmma (sm_90); an upper
    bound for mma.sync, which keeps the query tile in registers."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    return (bm + 2 * max(config.num_stages, 1) * bn) * block_d * elem_bytes


# What SDPA's attn_mask adds to a forward config's shared memory (sm_90, triton 3.6, bf16,
# every forward config compiled at head_dim 64 and 128, against ``smem_bytes``): the additive
# mask's fp32 (BLOCK_M, BLOCK_N) tile is a pipelined load, buffered num_stages - 1 times (128 x
# 128 with 3 stages at head_dim 128: 360,504 bytes, over every GPU's block limit); the boolean
# mask at most 32 bytes per query row (a layout conversion: 4,152 bytes at 128 x 128); each
# with at most 64 bytes of barriers. Other mods load nothing per tile that is pipelined.
_BIAS_ELEM_BYTES = 4
_MASK_ROW_BYTES = 32
_MOD_BARRIER_BYTES = 64


def mods_smem_bytes(config, spec) -> int:
    """Shared memory the tensor mods of ``spec`` (the launch's ``ScoreSpec``; None: no mods)
    add to a forward config (above)."""
    if spec is None:
        return 0
    from .tensor_mask import TENSOR_BIAS, TENSOR_MASK   # (tensor_mask imports mods only)
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    extra = 0
    if any(m.fn is TENSOR_BIAS.fn for m in spec.mods):
        extra += ((max(config.num_stages, 1) - 1) * bm * bn * _BIAS_ELEM_BYTES
                  + _MOD_BARRIER_BYTES)
    if spec.mask_mod is TENSOR_MASK.fn:
        extra += bm * _MASK_ROW_BYTES + _MOD_BARRIER_BYTES
    return extra


def _bwd_smem_bytes(config, width, elem_bytes, dkdv):
    """Shared-memory estimate (an upper bound) of a backward config: the resident side's two
    tiles plus two streamed tiles per pipeline stage."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    resident, streamed = (bn, bm) if dkdv else (bm, bn)
    return elem_bytes * width * (2 * resident + 2 * streamed * max(config.num_stages, 1))


# LDS of the CDNA configs, from what Triton 3.9's HIP backend allocates (tools/amd_static.py
# reads it per config): with one stage the loads go to registers and LDS only stages the dot
# operands, one tile at a time (the forward: the larger of the query tile and a K + V pair;
# the backward: the resident tile); each further stage buffers a K and a V tile (the backward:
# two streamed tiles), plus the pipeliner's barriers. Every CDNA config measured stays within
# these; the upper bounds above (``smem_bytes``) would keep nothing at head_dim 256 in fp32 on
# gfx942's 64 KiB, where the real use fits.
_CDNA_PIPELINE_SLACK = 2048


def cdna_fwd_lds(config, block_d: int, elem_bytes: int) -> int:
    """LDS estimate (bytes) of a forward config on AMD CDNA."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    extra = max(config.num_stages, 1) - 1
    return ((max(bm, 2 * bn) if not extra else bm + 2 * extra * bn) * block_d * elem_bytes
            + (_CDNA_PIPELINE_SLACK if extra else 0))


def cdna_bwd_lds(config, width: int, elem_bytes: int, dkdv: bool) -> int:
    """LDS estimate (bytes) of a backward config on AMD CDNA."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    resident, streamed = (bn, bm) if dkdv else (bm, bn)
    extra = max(config.num_stages, 1) - 1
    return ((resident + 2 * extra * streamed) * width * elem_bytes
            + (_CDNA_PIPELINE_SLACK if extra else 0))


def _key(config):
    """A config's table entry: (BLOCK_M, BLOCK_N, warps, stages[, waves_per_eu]); a forward
    config with WARP_SPEC on is no family table's entry (``warp_spec_configs``)."""
    wpe = config.kwargs.get("waves_per_eu", 0)
    return (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps,
            config.num_stages) + ((wpe,) if wpe else ()) + (
        ("warp_spec",) if config.kwargs.get("WARP_SPEC") else ())


def _family_entries(configs, family, kernel, width, dropout=False, elem_bytes=2, fma=False):
    """``configs`` that ``family`` lists for ``kernel`` at this padded head_dim (and, for the
    AMD families, with or without dropout; on NVIDIA at the widest heads, for elements of
    ``elem_bytes``; ``fma``: fp32 with IEEE dots, ``FMA_FP32``), in the family's order of
    preference."""
    table = getattr(family, kernel)
    if fma and not family.wave64 and width < WIDE_MIN_WIDTH:
        table = FMA_FP32[max(width, 64)][kernel]
        allowed = set(table)
    elif family.wave64 and width < WIDE_MIN_WIDTH:
        table = family.tables[(kernel, min(max(width, 64), 256), bool(dropout))]
        allowed = set(table)
    elif width >= WIDE_MIN_WIDTH:
        table = WIDE[kernel]
        if width >= LATENT_MIN_WIDTH:
            table = (LATENT_CDNA if family.wave64 else LATENT).get(kernel, table)
        if elem_bytes >= 4 and not family.wave64:
            table = WIDE_FP32.get(kernel, table)
        allowed = set(table)
    elif family.register_model:
        allowed = set(table)
    else:
        limits = family.max_head_dim[_KERNELS.index(kernel)]
        allowed = {e for e, d in zip(table, limits) if width <= d}
    by_key = {_key(c): c for c in configs if _key(c) in allowed}
    return [by_key[e] for e in table if e in by_key]


def _fma_dots(args, elem_bytes) -> bool:
    """Whether a launch's tl.dot runs as FMA loops: fp32 operands with IEEE precision (the
    backward's DOT_PRECISION, the forward's PRECISION.dot: ``call.Precision``)."""
    precision = args.get("PRECISION")
    dot = precision.dot if precision is not None else args.get("DOT_PRECISION")
    return elem_bytes >= 4 and dot == "ieee"


def _q_tensor(args):
    """The launch's query tensor: Q, or with host descriptors (TMA_HOST: the forward's and
    dK/dV's Q is a stand-in pointer) the tensor DESC_Q describes."""
    desc = args.get("DESC_Q")
    return getattr(desc, "base", None) if desc is not None else args.get("Q")


def _launch_gpu(args) -> Gpu:
    q = _q_tensor(args)
    return gpu_of(q.device if isinstance(q, torch.Tensor) and q.device.type == "cuda" else None)


# Per-thread register budgets of the forward's wgmma tiles (fp32 values), from the sm_90 compile
# check (docs/gpu.md): every config over them spilled, every kept one compiles
# spill-free at head_dim 64 and 128, bf16/fp16, causal or not, with or without dropout. The
# accumulator is BLOCK_M x BLOCK_D, the score tile BLOCK_M x BLOCK_N; dropout's Philox words and
# keep mask live beside the score tile, halving its room.
_FWD_ACC_REGS = 64
_FWD_TILE_REGS = 64
_FWD_TILE_REGS_DROPOUT = 32
# With a window's or chunk's left edge (an extra masked loop, the rows' edge bounds) sm_90 has
# its own budget (``Family.fwd_edge_regs``): 128 x 128 at head_dim 128 (accumulator + score
# tile 64 + 64 per thread) spilled 20 B there with 2 stages, 128 x 128 at 64 and 128 x 64 at
# 128 (96) did not.


# Sliding windows and chunks add a masked loop in front of the unmasked one; with more than two
# pipeline stages ptxas then serialized the wgmma (C7515) of every forward and dQ config on sm_90.
_WINDOW_MAX_STAGES = 2


def _stages_ok(config, kwargs) -> bool:
    spec = kwargs.get("SPEC")
    return spec is None or not spec.edge or config.num_stages <= _WINDOW_MAX_STAGES


def _padded_width(args) -> int:
    """The widest padded head dim of a launch: q/k's or v's (kernels/core/common.block_d)."""
    if "BLOCK_D" in args and int(args.get("HEAD_DIM", 0)) > int(args["BLOCK_D"]):
        # A split q / k head dim (common.head_blocks: MLA's 576 as 512 + 64): its two tiles'
        # width, not the next power of two.
        return max(sum(head_blocks(int(args["HEAD_DIM"]))), int(args["BLOCK_DV"]))
    dims = [int(args[k]) for k in ("HEAD_DIM", "HEAD_DIM_V", "BLOCK_D", "BLOCK_DV")
            if k in args] or [64]
    return max(16, triton.next_power_of_2(max(dims)))


def _distinct_rows(config, rows: int) -> bool:
    """Whether ``rows`` resident rows (BLOCK_M of the forward and dQ, BLOCK_N of dK/dV) give
    each warp its own: Triton lays chained wgmma dots out with all warps along the rows, 16
    rows per warp, so fewer rows than 16 x num_warps are computed by several warps (64 rows on
    8 warps: both warpgroups, 1.5-1.67x the tile's tensor work on sm_90)."""
    return rows >= 16 * config.num_warps


def _prefer_distinct_rows(configs, family, width, resident):
    """``configs`` without the tiles whose warps share rows, when the family asks for it and
    one with distinct rows is left (at width 256 on sm_90 none fits: the shared-row tiles
    stay)."""
    if not family.distinct_rows or width >= WIDE_MIN_WIDTH:
        return configs
    return [c for c in configs if _distinct_rows(c, resident(c))] or configs


def _fwd_fits_registers(config, block_d: int, dropout: bool, edge_regs: int = 0) -> bool:
    threads = 32 * config.num_warps
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    tile_budget = _FWD_TILE_REGS_DROPOUT if dropout else _FWD_TILE_REGS
    return (bm * block_d <= _FWD_ACC_REGS * threads and bm * bn <= tile_budget * threads
            and (not edge_regs or bm * (block_d + bn) <= edge_regs * threads))


# Warp specialisation (WARP_SPEC; kernels/core/forward.py ``_fwd_block``): on sm_90 one key
# loop, every tile masked, split by Triton 3.6 into a TMA producer warpgroup and two consumer
# warpgroups (12 warps, setmaxnreg 40 / 232; 168 registers, no spills, no C7515 at head_dim 64
# and 128, plain, causal and windowed, fp16 and bf16: tools/sm90_static.py). What the pass
# takes (Triton 3.6): Q, K, V through descriptors (TMA 2 or 3), no early return (packed
# sequences), no dropout (its Philox words' join / reshape), one tile loop per program (not
# persistent); not compiled here: split-KV, packed GQA heads, FP8, paged caches, head dims over
# 128. num_warps 8 compiles unspecialised: 4-warp entries only.
WARP_SPEC_MAX_WIDTH = 128


def warp_spec_enabled() -> bool:
    """True when the environment sets KERNELS_FWD_WARP_SPEC=1: the forward's autotuner (and a
    launch without it, first) then also takes the warp-specialised configs where they apply
    (``warp_spec_configs``); off by default until a GPU says they win and are right."""
    return os.environ.get("KERNELS_FWD_WARP_SPEC", "0") == "1"


def warp_spec_configs(configs, args, block_d, elem_bytes, family, budget):
    """The WARP_SPEC configs of ``configs`` that the launch ``args`` (``_fwd_launch``) may
    take: ``family``'s ``fwd_warp_spec`` entries, fitting ``budget`` bytes of shared memory,
    where the kernel compiles them (see above); [] unless ``warp_spec_enabled()``."""
    if not warp_spec_enabled() or not family.fwd_warp_spec or block_d > WARP_SPEC_MAX_WIDTH:
        return []
    keys, fp8 = args.get("KEYS"), args.get("FP8")
    if (args.get("TMA") not in (2, 3) or args.get("DROPOUT") or args.get("SPLIT")
            or args.get("PACK_GQA") or args.get("sched") is not None
            or (keys is not None and (keys.varlen or keys.page_size))
            or (fp8 is not None and fp8.mode)):
        return []
    by_key = {_key(c)[:-1]: c for c in configs if c.kwargs.get("WARP_SPEC")}
    return [by_key[e] for e in family.fwd_warp_spec
            if e in by_key and smem_bytes(by_key[e], block_d, elem_bytes)
            + mods_smem_bytes(by_key[e], args.get("SPEC")) <= budget]


def _fwd_launch(named_args, kwargs):
    """What the forward's pruning reads of a launch: (its arguments by name, padded head dim,
    q's element size, the GPU's config family, the shared memory a block may use). The
    kernel's arguments arrive in ``named_args`` (positional) and ``kwargs`` (keywords: every
    launch here passes them by name)."""
    args = {**named_args, **kwargs}
    q = _q_tensor(args)
    gpu = _launch_gpu(args)
    family = family_of(gpu)
    return (args, _padded_width(args), q.element_size() if q is not None else 2, family,
            min(family.fwd_smem_cap, gpu.smem_per_block))


def prune_configs(configs, named_args, **kwargs):
    """Triton `early_config_prune` hook of the forward: the warp-specialised configs first
    where they are enabled and apply (``warp_spec_configs``), then those of the family tables
    (``_prune_table``). Never returns an empty list."""
    launch = _fwd_launch(named_args, kwargs)
    return warp_spec_configs(configs, *launch) + _prune_table(
        [c for c in configs if not c.kwargs.get("WARP_SPEC")], *launch)


def _prune_table(configs, args, block_d, elem_bytes, family, budget):
    """The forward's configs from the family tables: keep the running GPU family's configs
    (``family_of``) whose tiles fit its shared memory at this head_dim and, for wgmma tiles,
    stay within the register budgets (e.g. 128x64 with 4 warps at head_dim 128 spilled)."""
    dropout = bool(args.get("DROPOUT", False))
    candidates = _family_entries(configs, family, "fwd", block_d, dropout, elem_bytes,
                                 _fma_dots(args, elem_bytes))
    spec = args.get("SPEC")
    base = cdna_fwd_lds if family.wave64 else smem_bytes

    def lds(c, block_d, elem_bytes):
        return base(c, block_d, elem_bytes) + mods_smem_bytes(c, spec)

    fitting = [c for c in candidates if lds(c, block_d, elem_bytes) <= budget]
    edge_regs = family.fwd_edge_regs if spec is not None and spec.edge else 0
    in_registers = [c for c in fitting if _stages_ok(c, args) and (
        not family.register_model or block_d >= WIDE_MIN_WIDTH
        or _fwd_fits_registers(c, block_d, dropout, edge_regs))]
    if in_registers:
        if edge_regs:
            # A window or chunk keeps its shared-row 64-row tile: its 2-stage list is short
            # (128 x 128 does not fit at head_dim 128), and 64-row blocks cross fewer edge tiles.
            return in_registers
        kept = _prefer_distinct_rows(in_registers, family, block_d,
                                     lambda c: c.kwargs["BLOCK_M"])
        buckets = args.get("BUCKETS")
        if (family.short_fwd_warps and block_d <= 64 and buckets is not None
                and buckets[0] <= SHORT_Q_LEN):
            kept.sort(key=lambda c: c.num_warps != family.short_fwd_warps)   # stable
        return kept
    if fitting:
        return fitting
    # None fits (fp32 with head_dim > 128): as listed (4 stages) fp32 head_dim 256 needs 264 KiB
    # on sm_90, over the 227 KiB a block gets.
    return [_least_shared_memory(candidates or configs,
                                 lambda c: lds(c, block_d, elem_bytes), budget)]


def _least_shared_memory(configs, estimate, budget):
    """The config of ``configs`` with the smallest shared-memory ``estimate``, with fewer
    pipeline stages until it is within ``budget`` (or down to one): where nothing fits."""
    smallest = min(configs, key=estimate)
    for stages in range(max(smallest.num_stages, 1), 0, -1):
        cfg = triton.Config(dict(smallest.kwargs), num_warps=smallest.num_warps,
                            num_stages=stages, pre_hook=smallest.pre_hook)
        if stages == 1 or estimate(cfg) <= budget:
            return cfg


# Register budgets of the backward's wgmma tiles (sm_90; 255 registers per thread).
_BWD_ACC_REGS = 128      # fp32 accumulator values per thread (dK+dV, or dQ)
_BWD_TILE_REGS = 64      # fp32 values per thread of one (BLOCK_M, BLOCK_N) score tile
# dK/dV streams (BLOCK_M, head_dim) tiles of Q and dO: at 64 x 128 every config spilled on sm_90,
# at 32 x 128 and 64 x 64 none did (docs/gpu.md).
_DKDV_STREAM_ELEMS = 64 * 64
# dK/dV with dropout or grouped-query heads (the runtime loop over the group's query heads
# around the tile loops): the score tile per thread. 64 x 128 on 8 warps (32) spilled at head_dim 64
# with dropout (8/12 B) and with 4 query heads per kv head (60-112 B); 32 x 128 (16) did not.
_DKDV_TIGHT_TILE_REGS = 16
# dQ: the accumulator plus the live score tiles (S/P and dP; with dropout the Philox words and
# the keep mask double them), fp32 values per thread: acc + 2 x tile (with dropout acc + 4 x
# tile) <= 160. On sm_90: 128 x 128 at head_dim 128 (64 + 2 x 64) spilled 108 B; with dropout
# 128 x 64 at 128 (64 + 4 x 32) 8 B, 128 x 32 at width 256 (128 + 4 x 16) 108 B; 128 x 16 at
# width 256 (128 + 4 x 8) and every tile <= 160 compiled spill-free. 4-warp tiles spilled with
# 128 accumulator values (64 x 32 and 64 x 16 at width 256: 88-540 B): at most 64 there.
_DQ_LIVE_REGS = 160
_DQ_ACC_REGS_4_WARPS = 64


def prune_bwd_configs(configs, named_args, **kwargs):
    """``early_config_prune`` for the backward kernels: keep the running GPU family's configs
    that fit on chip.

    Per program, the dK/dV kernel keeps BLOCK_N rows of K, V and two fp32 accumulators resident
    and streams BLOCK_M rows of Q, dO per pipeline stage; the dQ kernel does the converse with
    one accumulator. Estimates use the padded head dim; the autotuner also skips configs that
    fail to compile, so this only saves compile time and spills. Keeps at least one config.
    """
    args = {**named_args, **kwargs}
    width = _padded_width(args)
    q = _q_tensor(args)
    elem = q.element_size() if isinstance(q, torch.Tensor) else 2
    dkdv = "DK" in args
    dropout = bool(args.get("DROPOUT", False))
    seq = args.get("seq")
    grouped = seq is not None and int(seq.group) > 1
    gpu = _launch_gpu(args)
    family = family_of(gpu)
    budget = min(family.bwd_smem_cap, gpu.smem_per_block)
    candidates = _family_entries(configs, family, "dkdv" if dkdv else "dq", width, dropout,
                                 elem, _fma_dots(args, elem))

    def fits_registers(cfg):
        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
        resident, n_acc = (bn, 2) if dkdv else (bm, 1)
        threads = 32 * cfg.num_warps
        acc, tile = n_acc * resident * width / threads, bm * bn / threads
        if acc > _BWD_ACC_REGS or tile > _BWD_TILE_REGS:
            return False
        if dkdv:
            return (bm * width <= _DKDV_STREAM_ELEMS
                    and (not (dropout or grouped) or tile <= _DKDV_TIGHT_TILE_REGS))
        return (acc + (4 if dropout else 2) * tile <= _DQ_LIVE_REGS
                and (cfg.num_warps > 4 or acc <= _DQ_ACC_REGS_4_WARPS))

    lds = cdna_bwd_lds if family.wave64 else _bwd_smem_bytes

    def fits_memory(cfg):
        return lds(cfg, width, elem, dkdv) <= budget and _stages_ok(cfg, args)

    def fits(cfg):
        return fits_memory(cfg) and (not family.register_model or width >= WIDE_MIN_WIDTH
                                     or fits_registers(cfg))

    kept = [cfg for cfg in candidates if fits(cfg)]
    if kept:
        # dK/dV keeps its shared-row 64-key tiles: with grouped heads they spilled least.
        return kept if dkdv else _prefer_distinct_rows(kept, family, width,
                                                       lambda c: c.kwargs["BLOCK_M"])
    # None fits the family's cap: its smallest tile where the GPU still holds it (bf16 dQ at
    # head_dim 256 on sm_100), else the wide-head tiles (WIDE) that fit, else the least shared
    # memory. (fp32 at head_dim 256 on sm_90: every dQ tile's resident rows alone passed 227
    # KiB, the smallest, 128 x 16, needed 311 KiB: the launch had no config that loads.)
    smallest = min(candidates or configs,
                   key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], -c.num_warps,
                                  c.num_stages))
    if lds(smallest, width, elem, dkdv) <= gpu.smem_per_block:
        return [smallest]
    wide = _family_entries(configs, family, "dkdv" if dkdv else "dq", WIDE_MIN_WIDTH)
    fitting = [c for c in wide if fits_memory(c)]
    return fitting or [_least_shared_memory(candidates + wide or configs,
                                            lambda c: lds(c, width, elem, dkdv), budget)]


# --------------------------------------------------------------------------------------------
# Split-KV and packed GQA heads (forward launches too small to fill the GPU: decoding)
# --------------------------------------------------------------------------------------------
# At most this many splits (each costs a partial output of the launch's size in fp32).
MAX_SPLITS = 128
# Pack the query heads of a kv group into one program when q_len is at most this (decoding and
# speculative decoding): the group's K/V tiles are then read once instead of once per head.
PACK_GQA_MAX_Q_LEN = 16
# The tile sizes the heuristic counts with (the launch's own tiles are autotuned later).
_NOMINAL_BLOCK_M = 64
_NOMINAL_BLOCK_N = 64
_MIN_BLOCK_N = 16


def num_splits_heuristic(device, n_programs, n_key_tiles, sm_count=None):
    """Splits for a launch of ``n_programs`` (query blocks x heads x batch, counted with
    64-row blocks) over ``n_key_tiles`` 64-key tiles, on a device with ``sm_count`` SMs
    (default: the device's SMs or, on AMD, compute units; CPU and Triton's interpreter:
    none, so 1).

    FlashAttention-2's rule: no split when the programs already fill 80% of the SMs; else the
    smallest split count whose wave efficiency (programs / SMs, over its ceiling) reaches 85%
    of the best over 1..min(MAX_SPLITS, SMs, key tiles). A pure function of the shapes and SMs.
    """
    if sm_count is None:
        if device.type != "cuda" or interpreter_active():
            return 1
        sm_count = sm_count_of(device)
    if n_programs >= 0.8 * sm_count or n_key_tiles <= 1:
        return 1
    max_splits = min(MAX_SPLITS, sm_count, n_key_tiles)

    def eligible(s):  # a split count whose tiles per split differ from the next smaller one's
        return s == 1 or math.ceil(n_key_tiles / s) != math.ceil(n_key_tiles / (s - 1))

    def efficiency(s):
        waves = n_programs * s / sm_count
        return waves / math.ceil(waves)

    effs = {s: efficiency(s) for s in range(1, max_splits + 1) if eligible(s)}
    best = max(effs.values())
    return min(s for s, e in effs.items() if e >= 0.85 * best)


def clamp_splits(num_splits, k_len):
    """A requested split count clamped to [1, MAX_SPLITS] and to the number of key tiles of the
    smallest tile size (16 keys): more splits than that would only add empty programs."""
    return max(1, min(num_splits, MAX_SPLITS, triton.cdiv(max(k_len, 1), _MIN_BLOCK_N)))


def nominal_tiles(rows, k_len):
    """(query blocks, key tiles) counted with the heuristic's nominal 64 x 64 tiles."""
    return triton.cdiv(rows, _NOMINAL_BLOCK_M), triton.cdiv(k_len, _NOMINAL_BLOCK_N)
