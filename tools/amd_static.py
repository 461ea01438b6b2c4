#!/usr/bin/env python3
"""Static check of the project's Triton attention kernels on AMD Instinct GPUs, without one:
MI300 (gfx942, CDNA3) and MI350 / MI355 (gfx950, CDNA4).

Every kept config of every variant is compiled by Triton's HIP backend (``GPUTarget("hip",
arch, 64)``: LLVM's AMDGPU backend to amdgcn, then linked to an hsaco) on this CPU-only
machine; nothing is launched. The project's real launchers are called with CPU tensors while
a stand-in driver (tools/stub_driver.py ``install_hip``) makes Triton target the AMD GPU and
PyTorch look like a ROCm build on it (``torch.version.hip``, the gfx name, CUs, LDS), so the
project's GPU detection, config tables and pruning answer as on that GPU. The compile-instead-
of-launch machinery and the failure descriptions are tools/sm90_static.py's (imported).

Variants (``--variants``, default all): fwd (bf16; causal, plain, causal+dropout), bwd
(causal, causal+dropout: the preprocess, dK/dV and dQ kernels), gqa (16 query heads on 4 kv
heads, forward and backward), packed (varlen, forward and backward), splitkv (decoding, one
query row, 4 splits, the combine kernel), paged (decoding over a paged cache, page 16, split
heuristic), each at ``--head-dims`` (default 64,128,256). Not in the default set: mla
(DeepSeek MLA's absorbed decode at head dim 576: the launches of ``--mla``, default all of
sm90_static's ``MLA_ALL``, paged and dense latent caches, V = K's first 512 columns; in
``--mla-dtypes`` bf16, fp16 (fp8kv, bf16 q over an e4m3 cache, when asked: the project runs
no FP8 on AMD, configs.fp8_unsupported_reason); flags ``mla <dtype> <launch>``; see
sm90_static's docstring).

Per compiled kernel: VGPRs (architected) and AGPRs, spilled VGPRs / SGPRs (the amdgcn
metadata's ``.vgpr_spill_count`` / ``.sgpr_spill_count``), scratch bytes per lane, LDS
(Triton's ``metadata.shared``, what the HIP driver compares with the limit at load) against
the arch's LDS per workgroup (64 KiB gfx942, 160 KiB gfx950), occupancy (waves per SIMD, from
the compiler's comment) and the MFMA instructions (``v_mfma_*``, counted; the first kind
named). A matmul kernel without MFMA is reported as ``fma``.
After the table: one line per launch and one per arch over the kept configs (failures, over
LDS, default configs spilling, matmul kernels without MFMA, the default config per launch).
``tests/core/test_amd.py`` runs it for one forward per arch (``--defaults-only``).

Usage, from the repository's root, with a venv holding Triton 3.9 (the HIP backend compiles
without ROCm: LLVM and the linker ship in the wheel) and a CPU torch (``pip install -e
".[test]"`` into a venv made with the CPU torch, as the README's install says):
    VENV/bin/python tools/amd_static.py [--arch gfx942,gfx950] [--variants fwd,bwd]
        [--head-dims 64,128] [--fwd-flags "causal;plain"] [--defaults-only | --all-configs]
        [--json out.json]
    VENV/bin/python tools/amd_static.py --variants mla [--mla "paged;paged+s4"]   # MLA (576)
The archs run in parallel processes (one each). Compiled kernels are cached (default
~/.cache/amd-triton-cache), so a re-run only recompiles what changed; a full cold run of both
archs takes ~10 minutes on 2 cores. Exit status 1 when a target is missed (a kept config fails
to compile or is over LDS, a default config spills VGPRs, a matmul kernel lacks MFMA). SGPR
spills are counted apart: LLVM saves SGPRs in VGPR lanes (``v_writelane``), without memory
traffic.
"""
import argparse
import json
import multiprocessing
import os
import re
import sys
import tempfile
from collections import namedtuple

sys.dont_write_bytecode = True
TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
import sm90_static as S  # noqa: E402  (the compile-instead-of-launch machinery)

KB = 1024
# Per-arch facts: LDS per workgroup and CUs (AMD's CDNA3 / CDNA4 ISA guides and data sheets),
# the capability a ROCm PyTorch reports.
AmdArch = namedtuple("AmdArch", "cc gpus capability lds cus")
ARCHS = {a.cc: a for a in (
    AmdArch("gfx942", "MI300X, MI300A, MI325X", (9, 4), 64 * KB, 304),
    AmdArch("gfx950", "MI350X, MI355X", (9, 5), 160 * KB, 256),
)}
VARIANTS = ("fwd", "bwd", "gqa", "packed", "splitkv", "paged")
# Opt-in variants (not in --variants' default): mla, at head dim 576 whatever --head-dims says.
EXTRA_VARIANTS = ("mla",)
# Kernels whose source has a tl.dot (a compile without MFMA means the FMA path).
MATMUL_KERNELS = ("_attn_fwd", "_bwd_dkdv", "_bwd_dq")


def _meta(asm, key):
    m = re.search(rf"^[\s-]*\.{key}:\s*(\d+)", asm, re.M)
    return int(m.group(1)) if m else None


def analyze(kernel):
    """What one compiled HIP kernel uses (the record fields sm90_static's rows read too)."""
    asm = kernel.asm.get("amdgcn", "")
    md = kernel.metadata
    mfma = re.findall(r"\bv_mfma_(\w+)", asm)
    occ = re.search(r";\s*Occupancy:\s*(\d+)", asm)
    r = dict(
        vgprs=_meta(asm, "vgpr_count"), agprs=_meta(asm, "agpr_count"),
        sgprs=_meta(asm, "sgpr_count"),
        vgpr_spill=_meta(asm, "vgpr_spill_count") or 0,
        sgpr_spill=_meta(asm, "sgpr_spill_count") or 0,
        scratch=_meta(asm, "private_segment_fixed_size") or 0,
        smem=md.shared, warps_total=md.num_warps,
        occupancy=int(occ.group(1)) if occ else None,
        mfma=len(mfma), mfma_kind=mfma[0] if mfma else "",
        waves_per_eu=getattr(md, "waves_per_eu", 0) or 0,
    )
    r["wpe"] = r["waves_per_eu"] or ""
    r["regs"] = r["vgprs"]
    r["spill_st"] = r["vgpr_spill"] + r["sgpr_spill"]
    r["spill_ld"] = r["scratch"]
    arch = ARCHS[S.ARCH.cc]
    r["smem_limit"] = arch.lds
    r["smem_over_limit"] = md.shared > arch.lds
    r["tmem_over_limit"] = False
    return r


def _setup(cache_dir, arch):
    import stub_driver
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ.pop("TRITON_INTERPRET", None)
    a = ARCHS[arch]
    stub_driver.install_hip(arch, a.capability, a.cus, a.lds)
    S.ARCH = a                       # sm90_static labels its records with ARCH.cc
    S.analyze = analyze              # its compile hook analyses with this module's reader
    S._one_line = _one_line          # and prints its progress lines with this one


def _one_line(r):
    head = f"{r['arch']} {r['kernel']} d{r.get('head_dim')} {r.get('flags')} {_cfg(r)}"
    if r["status"] != "ok":
        return f"{head}: {r['error']}"
    return (f"{head}: vgpr {r['vgprs']} agpr {r['agprs']} spill {r['vgpr_spill']}/"
            f"{r['sgpr_spill']} scratch {r['scratch']} lds {r['smem']} occ {r['occupancy']} "
            f"mfma {r['mfma']} ({r['compile_s']}s)")


FWD_FLAGS = ("causal", "plain", "causal+dropout")


def run_project(project, variants, head_dims, seq, all_configs, fwd_flags=FWD_FLAGS,
                defaults_only=False, mla=(), mla_dtypes=("bf16",)):
    import torch
    from triton.runtime.autotuner import Autotuner
    if defaults_only:                # only the first kept config: what KERNELS_AUTOTUNE=0 runs
        prune = Autotuner.prune_configs
        Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]
    sys.path.insert(0, os.path.abspath(project))
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        del sys.modules[name]
    from kernels.core.backward import attention_backward
    from kernels.core.forward import attention_forward

    bf16 = torch.bfloat16
    B, H, HKV = 1, 16, 4

    def t(*shape, dtype=bf16):
        return torch.empty(shape, dtype=dtype)

    def launch(label, fn, dtype="bf16"):
        S.LABEL.clear()
        S.LABEL.update(side="project", dtype=dtype, **label)
        try:
            fn()
        except Exception as e:   # a failure outside any config's compile (launcher, host code)
            S.RECORDS.append(dict(arch=S.ARCH.cc, **S.LABEL, kernel="(launch)", BLOCK_M=None,
                                  BLOCK_N=None, warps=None, stages=None, kept=True,
                                  status="FAIL", error=f"{type(e).__name__}: {str(e)[:160]}"))

    seed = 0x5DEECE66D123
    with S.compile_instead_of_launch(all_configs):
        for d in head_dims:
            sc = d ** -0.5
            if "fwd" in variants:
                for flags in fwd_flags:
                    causal, p = "causal" in flags, (0.1 if "dropout" in flags else 0.0)
                    q = t(B, H, seq, d)
                    launch(dict(head_dim=d, flags=flags), lambda: attention_forward(
                        q, q, q, causal=causal, softmax_scale=sc, dropout_p=p,
                        seed=seed if p else 0))
            if "bwd" in variants:
                for flags in ("causal", "causal+dropout"):
                    p = 0.1 if "dropout" in flags else 0.0
                    q = t(B, H, seq, d)
                    lse = t(B, H, seq, dtype=torch.float32)
                    launch(dict(head_dim=d, flags="bwd " + flags), lambda: attention_backward(
                        q, q, q, q, q, lse, causal=True, softmax_scale=sc, dropout_p=p,
                        seed=seed if p else 0))
            if "gqa" in variants:
                q, kv = t(B, H, seq, d), t(B, HKV, seq, d)
                lse = t(B, H, seq, dtype=torch.float32)
                launch(dict(head_dim=d, flags="gqa causal"), lambda: attention_forward(
                    q, kv, kv, causal=True, softmax_scale=sc))
                launch(dict(head_dim=d, flags="bwd gqa causal"), lambda: attention_backward(
                    q, q, kv, kv, q, lse, causal=True, softmax_scale=sc))
            if "packed" in variants:
                lens = [seq // 2 - 3, seq // 4 + 5, seq // 4 - 2]
                cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(3)], dtype=torch.int32)
                total = int(cu[-1])
                q = t(total, H, d)
                lse = t(H, total, dtype=torch.float32)
                kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                          max_seqlen_k=max(lens), causal=True, softmax_scale=sc)
                launch(dict(head_dim=d, flags="packed causal"),
                       lambda: attention_forward(q, q, q, **kw))
                launch(dict(head_dim=d, flags="bwd packed causal"),
                       lambda: attention_backward(q, q, q, q, q, lse, **kw))
            if "splitkv" in variants:
                q, kv = t(4, H, 1, d), t(4, HKV, seq, d)
                k_lens = torch.full((4,), seq - 7, dtype=torch.int32)
                launch(dict(head_dim=d, flags="splitkv decode"), lambda: attention_forward(
                    q, kv, kv, causal=True, softmax_scale=sc, k_lens=k_lens, num_splits=4))
            if "paged" in variants:
                page, pages = 16, seq // 16
                q = t(4, H, 1, d)
                cache = t(4 * pages, page, HKV, d)
                table = torch.arange(4 * pages, dtype=torch.int32).reshape(4, pages)
                k_lens = torch.full((4,), seq - 7, dtype=torch.int32)

                def paged():
                    from kernels.core.paged import paged_view
                    kv = paged_view(cache)
                    attention_forward(q, kv, kv, causal=True, softmax_scale=sc, k_lens=k_lens,
                                      block_table=table, num_splits=0)
                launch(dict(head_dim=d, flags="paged decode"), paged)
        if "mla" in variants:
            for dt in mla_dtypes:
                for flags in mla:
                    fn = S.mla_launch(flags, dt, seq)
                    if fn is not None:
                        # the dtype in the flags too: this tool's launches are keyed on them
                        launch(dict(head_dim=S.MLA_D, flags=f"mla {dt} {flags}"), fn, dt)
    S.LABEL.clear()
    return S.RECORDS


# ----------------------------------------------------------------------------- output
COLS = ["arch", "kernel", "head_dim", "flags", "BLOCK_M", "BLOCK_N", "warps", "stages", "wpe",
        "status", "vgpr", "agpr", "sgpr", "spill v/s", "scratch", "lds", "occ", "mfma", "notes"]


def _status(r):
    s = r["status"]
    if not r.get("kept", True):
        s = "pruned-" + s
    if s.endswith("ok") and r.get("smem_over_limit"):
        s += ">lds"
    return s


def _row(r):
    base = [r["arch"], r["kernel"], r.get("head_dim", ""), r.get("flags", ""), r.get("BLOCK_M"),
            r.get("BLOCK_N"), r.get("warps"), r.get("stages"), r.get("wpe", ""), _status(r)]
    if r["status"] != "ok":
        return base + [""] * (len(COLS) - len(base) - 1) + [r.get("error", "")]
    mfma = f"{r['mfma']} {r['mfma_kind']}" if r["mfma"] else (
        "fma" if r["kernel"] in MATMUL_KERNELS else "-")
    return base + [r["vgprs"], r["agprs"], r["sgprs"], f"{r['vgpr_spill']}/{r['sgpr_spill']}",
                   r["scratch"], r["smem"], r["occupancy"], mfma, ""]


def print_table(records, out=sys.stdout):
    rows = [COLS] + [["" if c is None else str(c) for c in _row(r)] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLS) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1], file=out)


def _spills(r):
    """VGPR spills (to scratch memory, or to AGPRs) or a scratch frame."""
    return r["status"] == "ok" and bool(r["vgpr_spill"] or r["scratch"])


def _sgpr_spills(r):
    """SGPR spills only: saved in VGPR lanes (v_writelane / v_readlane), no memory traffic."""
    return r["status"] == "ok" and not _spills(r) and bool(r["sgpr_spill"])


def _launch_groups(records):
    groups = {}
    for r in records:
        key = (r["arch"], r.get("head_dim"), r.get("flags"), r["kernel"])
        groups.setdefault(key, []).append(r)
    return groups


def _cfg(r):
    wpe = f" wpe{r['wpe']}" if r.get("wpe") else ""
    if r.get("BLOCK_M") is None:
        return "(none)"
    return f"{r['BLOCK_M']}x{r['BLOCK_N']} w{r['warps']} s{r['stages']}{wpe}"


def summarize(records, out=sys.stdout):
    """Per launch and per arch; returns the number of missed targets."""
    print("\nper launch (kept configs; default = the first kept one)", file=out)
    per_arch = {}
    for key, rs in _launch_groups(records).items():
        kept = [r for r in rs if r.get("kept", True)]
        if not kept:
            continue
        per_arch.setdefault(key[0], []).append(kept)
        d = kept[0]
        state = ("FAIL" if d["status"] != "ok" else
                 f"vgpr {d['vgprs']} agpr {d['agprs']} spill {d['vgpr_spill']}/{d['sgpr_spill']}"
                 f" lds {d['smem']} occ {d['occupancy']} mfma {d['mfma']}")
        print(f"  {key[0]} d{key[1]} {key[2]} {key[3]}: {len(kept)} kept, "
              f"{sum(r['status'] != 'ok' for r in kept)} fail, "
              f"{sum(bool(_spills(r)) for r in kept)} spill, "
              f"{sum(_sgpr_spills(r) for r in kept)} SGPR-only spill, "
              f"{sum(r['status'] == 'ok' and r['smem_over_limit'] for r in kept)} >lds; "
              f"default {_cfg(d)}: {state}", file=out)
    print("\nper arch (kept configs)", file=out)
    missed = 0
    for arch, launches in per_arch.items():
        rows = [r for g in launches for r in g]
        ok = [r for r in rows if r["status"] == "ok"]
        fails = len(rows) - len(ok)
        over = sum(r["smem_over_limit"] for r in ok)
        spill_kept = sum(bool(_spills(r)) for r in ok)
        spill_def = sum(bool(_spills(g[0])) or g[0]["status"] != "ok" for g in launches)
        sgpr_def = sum(_sgpr_spills(g[0]) for g in launches)
        no_mfma = sum(1 for r in ok if r["kernel"] in MATMUL_KERNELS and not r["mfma"])
        kinds = sorted({r["mfma_kind"] for r in ok if r["mfma"]})
        a = ARCHS[arch]
        print(f"  {arch} ({a.gpus}; {a.lds // KB} KiB LDS, {a.cus} CUs): {len(rows)} kept "
              f"configs in {len(launches)} launches, {fails} fail, {over} over LDS, "
              f"{spill_kept} kept spilling VGPRs, default configs spilling VGPRs "
              f"{spill_def}/{len(launches)} (SGPRs only, into VGPR lanes: {sgpr_def}), "
              f"matmul kernels without MFMA {no_mfma}; MFMA: {', '.join(kinds) or '-'}",
              file=out)
        missed += fails + over + spill_def + no_mfma
    return missed


# ----------------------------------------------------------------------------- driver
def _worker(a, arch, path):
    _setup(a.cache_dir, arch)
    import torch
    import triton
    print(f"amd_static: triton {triton.__version__}, torch {torch.__version__}, target "
          f"hip:{arch}, seq {a.seq}", file=sys.stderr)
    records = run_project(a.project, a.variants, a.head_dims, a.seq, a.all_configs,
                          [x for x in a.fwd_flags.split(";") if x], a.defaults_only,
                          S.mla_launches(a.mla), a.mla_dtypes)
    for r in records:     # the waves_per_eu a config asked for (a compile option on HIP)
        r.setdefault("wpe", "")
    with open(path, "w") as f:
        json.dump(records, f, default=str)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", default=".", help="the project checkout (default .)")
    ap.add_argument("--arch", default="gfx942,gfx950", help="among " + ", ".join(ARCHS))
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="among " + ",".join(VARIANTS + EXTRA_VARIANTS) + " (default: all but "
                         + ",".join(EXTRA_VARIANTS) + ")")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--mla", default="all",
                    help="the mla variant's launches (sm90_static's --mla; default all: "
                         + S.MLA_ALL + ")")
    ap.add_argument("--mla-dtypes", default="bf16,fp16",
                    help="the mla variant's dtypes: bf16, fp16, fp8kv (bf16 q, e4m3 cache: "
                         "compiled when asked, though the project runs no FP8 on AMD)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--fwd-flags", default=";".join(FWD_FLAGS),
                    help="';'-separated forward flags among " + ", ".join(FWD_FLAGS))
    ap.add_argument("--defaults-only", action="store_true",
                    help="compile only the first kept config of each launch (its default)")
    ap.add_argument("--all-configs", action="store_true",
                    help="also compile the configs the prune hooks drop (marked pruned-)")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                        "amd-triton-cache"))
    ap.add_argument("--json", help="also write all records as JSON here")
    a = ap.parse_args(argv)
    archs = [x.strip() for x in a.arch.split(",") if x.strip()]
    a.variants = [x.strip() for x in a.variants.split(",") if x.strip()]
    a.head_dims = [int(x) for x in a.head_dims.split(",") if x.strip()]
    a.mla_dtypes = [x.strip() for x in a.mla_dtypes.split(",") if x.strip()]
    S.mla_launches(a.mla)                   # an unknown --mla launch: fail before compiling
    bad = [x for x in archs if x not in ARCHS] + [
        v for v in a.variants if v not in VARIANTS + EXTRA_VARIANTS] + [
        x for x in a.mla_dtypes if x not in ("bf16", "fp16", "fp8kv")]
    if bad:
        ap.error(f"unknown {bad}: archs {list(ARCHS)}, variants "
                 f"{list(VARIANTS + EXTRA_VARIANTS)}, mla dtypes bf16, fp16, fp8kv")
    ctx = multiprocessing.get_context("fork")
    records = []
    with tempfile.TemporaryDirectory(prefix="amd_static-") as tmp:
        procs = []
        for arch in archs:
            path = os.path.join(tmp, f"{arch}.json")
            p = ctx.Process(target=_worker, args=(a, arch, path), name=arch)
            p.start()
            procs.append((arch, p, path))
        for arch, p, path in procs:
            p.join()
            if p.exitcode != 0 or not os.path.exists(path):
                raise SystemExit(f"amd_static: the {arch} run failed (exit {p.exitcode})")
            with open(path) as f:
                records += json.load(f)
    print_table(records)
    missed = summarize(records)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1, default=str)
    print(f"\n{len(records)} kernels compiled for {', '.join(archs)}; targets missed: {missed}",
          file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
