"""Launch configurations: the one place that lists block sizes, warps and stages, the pruning
of each kernel's list and the autotune keys.

On a GPU the kernels are autotuned over these lists, pruned per head_dim by shared-memory
footprint and register estimates; in Triton's CPU interpreter autotuning would time every config
in Python, so one small fixed config is used. The lists are short on purpose: every config is
compiled and timed once per autotune key (``FWD_TUNE_KEY``, ``BWD_TUNE_KEY``: the power-of-two
buckets of q_len and k_len, head_dim and each compiled feature flag; Triton adds every tensor
argument's dtype) and a long list costs minutes.

``KERNELS_AUTOTUNE=0`` turns autotuning off on the GPU: each launch then takes the first config
of its list that survives pruning. The GPU test suite sets it, so that its hundreds of small
shapes do not each compile and time every config (tests/core/test_gpu.py runs every config once).
"""
import math
import os

import torch
import triton

from .common import interpreter_active

# Hopper has 228 KB of shared memory per SM (227 KB usable by one block); leave headroom for
# the compiler's own scratch (layout conversions, reductions).
SMEM_BUDGET_BYTES = 200 * 1024

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
# The first entry that survives pruning is also the fixed choice under KERNELS_AUTOTUNE=0:
# forward (128, 64, 8 warps) for head_dim <= 128, (64, 64, 8 warps) at 256. Chosen from what
# ptxas makes of each on sm_90 (../shared/tools/sm90_static.py with triton 3.6; the tables are
# in benchmarks/NOTES.md): every listed config that survives pruning compiles to wgmma (no
# Ampere mma.sync), without serialized wgmma (C7515), and without register spills at
# head_dim 64 and 128 for bf16/fp16, causal or not, with or without dropout.
_FWD = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 4),
        (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 4), (128, 128, 8, 2), (64, 64, 8, 2)]
# dK/dV: BLOCK_N keys stay resident, BLOCK_M query rows stream. The resident side must be >= 64
# (32-key blocks compile to mma.sync on sm_90), 4 warps spill at head_dim 128 in every tile,
# and a third pipeline stage brings C7515 back, hence 8 warps and 2 stages throughout. Same
# 32 x 128 tile as the Triton tutorial's dK/dV.
_BWD_DKDV = [(32, 128, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2), (16, 128, 8, 2), (16, 64, 8, 2)]
# dQ: BLOCK_M query rows resident (>= 64 for wgmma), BLOCK_N keys stream.
_BWD_DQ = [(64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3), (64, 64, 8, 3)]
_INTERPRET = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)

# Autotune keys (kernel argument names). Sequence lengths enter as power-of-two buckets, so a new
# length re-tunes only when it changes bucket.
FWD_TUNE_KEY = ["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL", "WINDOW", "VARLEN", "SEQUSED_K",
                "PACK_GQA", "SPLIT", "DROPOUT", "DOT_PRECISION"]
BWD_TUNE_KEY = ["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL", "WINDOW", "VARLEN", "DROPOUT",
                "DOT_PRECISION"]


def _configs(table):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in table]


def fwd_configs(interpret: bool = False):
    """Candidate configs for the forward kernel (BLOCK_M queries x BLOCK_N keys per step)."""
    return [_INTERPRET] if interpret else _configs(_FWD)


def bwd_configs(interpret: bool = False, kernel: str = "both"):
    """Candidate configs of the backward kernels: ``kernel="dkdv"`` (BLOCK_N keys per program,
    BLOCK_M query rows per step), ``"dq"`` (the converse) or ``"both"`` (the union, in order:
    what the tests force on both kernels at once)."""
    if interpret:
        return [_INTERPRET]
    tables = {"dkdv": _BWD_DKDV, "dq": _BWD_DQ,
              "both": list(dict.fromkeys(_BWD_DKDV + _BWD_DQ))}
    if kernel not in tables:
        raise ValueError(f"kernel must be one of {sorted(tables)}, got {kernel!r}")
    return _configs(tables[kernel])


def autotune_enabled() -> bool:
    """False when the environment sets KERNELS_AUTOTUNE=0 (see the module docstring)."""
    return os.environ.get("KERNELS_AUTOTUNE", "1") != "0"


def fixed_config(configs, prune, kernel_args):
    """The config a launch uses without autotuning: the first of ``configs`` that ``prune``
    (an ``early_config_prune`` hook) keeps for these keyword arguments of the kernel."""
    return prune(configs, {}, **kernel_args)[0]


def smem_bytes(config, block_d: int, elem_bytes: int) -> int:
    """Rough shared-memory footprint of a config: the query tile plus num_stages buffered K
    and V tiles (the pipelined loads), all of width block_d."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    return (bm + 2 * max(config.num_stages, 1) * bn) * block_d * elem_bytes


# Per-thread register budgets of the forward (fp32 values), from the sm_90 compile check
# (../shared/tools/sm90_static.py, triton 3.6, benchmarks/NOTES.md): every config over them
# spilled, every kept one compiles spill-free at head_dim 64 and 128, bf16/fp16, causal or not,
# with or without dropout. The accumulator is BLOCK_M x BLOCK_D, the score tile BLOCK_M x
# BLOCK_N; dropout's Philox words and keep mask live beside the score tile, halving its room.
_FWD_ACC_REGS = 64
_FWD_TILE_REGS = 64
_FWD_TILE_REGS_DROPOUT = 32


# Sliding windows add a masked loop in front of the unmasked one; with more than two pipeline
# stages ptxas then serialized the wgmma (C7515) of every forward and dQ config on sm_90.
_WINDOW_MAX_STAGES = 2


def _stages_ok(config, kwargs) -> bool:
    return not kwargs.get("WINDOW", False) or config.num_stages <= _WINDOW_MAX_STAGES


def _fwd_fits_registers(config, block_d: int, dropout: bool) -> bool:
    threads = 32 * config.num_warps
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    tile_budget = _FWD_TILE_REGS_DROPOUT if dropout else _FWD_TILE_REGS
    return bm * block_d <= _FWD_ACC_REGS * threads and bm * bn <= tile_budget * threads


def prune_configs(configs, named_args, **kwargs):
    """Triton `early_config_prune` hook of the forward: drop configs whose tiles cannot fit
    shared memory at this head_dim (head_dim 256 with 128x128 tiles and 3 stages would fail to
    launch) or would spill registers (e.g. 128x64 with 4 warps at head_dim 128). The kernel's
    arguments arrive in ``named_args`` (positional) and ``kwargs`` (keywords: every launch here
    passes them by name)."""
    args = {**named_args, **kwargs}
    block_d = args.get("BLOCK_D", 64)
    elem_bytes = args["Q"].element_size() if "Q" in args else 2
    fitting = [c for c in configs if smem_bytes(c, block_d, elem_bytes) <= SMEM_BUDGET_BYTES]
    dropout = bool(args.get("DROPOUT", False))
    in_registers = [c for c in fitting if _fwd_fits_registers(c, block_d, dropout)
                    and _stages_ok(c, args)]
    if in_registers:
        return in_registers
    if fitting:
        return fitting
    # None fits (fp32 with head_dim > 128): the smallest tiles with fewer pipeline stages. As
    # listed (4 stages) fp32 head_dim 256 needs 264 KiB on sm_90, over the 227 KiB a block gets.
    smallest = min(configs, key=lambda c: smem_bytes(c, block_d, elem_bytes))
    for stages in range(max(smallest.num_stages, 1), 0, -1):
        cfg = triton.Config(dict(smallest.kwargs), num_warps=smallest.num_warps,
                            num_stages=stages)
        if stages == 1 or smem_bytes(cfg, block_d, elem_bytes) <= SMEM_BUDGET_BYTES:
            return [cfg]


# Budgets for prune_bwd_configs, H100-sized with headroom: 227 KiB of shared memory per block
# (the compiler also needs scratch for layout conversions) and 255 registers per thread.
_BWD_SMEM_BUDGET = 160 * 1024
_BWD_ACC_REGS = 128      # fp32 accumulator values per thread (dK+dV, or dQ)
_BWD_TILE_REGS = 64      # fp32 values per thread of one (BLOCK_M, BLOCK_N) score tile
# dK/dV streams (BLOCK_M, head_dim) tiles of Q and dO: at 64 x 128 every config spilled on sm_90,
# at 32 x 128 and 64 x 64 none did (benchmarks/NOTES.md).
_DKDV_STREAM_ELEMS = 64 * 64
# dQ with dropout: accumulator + score tile, fp32 values per thread. 128 x 64 at head_dim 128
# (64 + 32) spilled with dropout on sm_90; 64 x 64 and 128 x 32 (<= 80) did not.
_DQ_DROPOUT_REGS = 80


def prune_bwd_configs(configs, named_args, **kwargs):
    """``early_config_prune`` for the backward kernels: drop configs that cannot fit on chip.

    Per program, the dK/dV kernel keeps BLOCK_N rows of K, V and two fp32 accumulators resident
    and streams BLOCK_M rows of Q, dO per pipeline stage; the dQ kernel does the converse with
    one accumulator. Estimates use the padded head dim; the autotuner also skips configs that
    fail to compile, so this only saves compile time and spills. Keeps at least one config.
    """
    args = {**named_args, **kwargs}
    width = max(16, triton.next_power_of_2(int(args["HEAD_DIM"])))
    elem = args["Q"].element_size() if isinstance(args.get("Q"), torch.Tensor) else 2
    dkdv = "DK" in args
    dropout = bool(args.get("DROPOUT", False))

    def fits(cfg):
        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
        resident, streamed, n_acc = (bn, bm, 2) if dkdv else (bm, bn, 1)
        threads = 32 * cfg.num_warps
        smem = elem * width * (2 * resident + 2 * streamed * max(cfg.num_stages, 1))
        return (smem <= _BWD_SMEM_BUDGET
                and n_acc * resident * width <= _BWD_ACC_REGS * threads
                and bm * bn <= _BWD_TILE_REGS * threads
                and (not dkdv or bm * width <= _DKDV_STREAM_ELEMS)
                and (dkdv or not dropout
                     or (bm * width + bm * bn) <= _DQ_DROPOUT_REGS * threads)
                and _stages_ok(cfg, args))

    kept = [cfg for cfg in configs if fits(cfg)]
    if kept:
        return kept
    smallest = min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"],
                                           -c.num_warps, c.num_stages))
    return [smallest]


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
    (default: the device's; CPU and Triton's interpreter: none, so 1).

    FlashAttention-2's rule: no split when the programs already fill 80% of the SMs; else the
    smallest split count whose wave efficiency (programs / SMs, over its ceiling) reaches 85%
    of the best over 1..min(MAX_SPLITS, SMs, key tiles). A pure function of the shapes and SMs.
    """
    if sm_count is None:
        if device.type != "cuda" or interpreter_active():
            return 1
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
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
