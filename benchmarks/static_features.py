#!/usr/bin/env python3
"""Compile-only check of the feature variants the shared static tool does not launch: head
dims up to 512 with a value head dim of its own, soft-capping, sinks, ALiBi, chunked attention,
grouped-query heads, windows and packed sequences (with and without dropout).

Uses ``sm90_static.py`` (the shared tool, default ``../shared/tools``) as a library: the same
stand-in driver and the same patched launch that compiles each kept config for one GPU
generation instead of running it, so registers, spills, shared memory, wgmma and C7515 come
from the real launchers' arguments. Nothing is timed; no GPU is needed.

Usage (the tool's venv: triton 3.6, a CPU torch)::

    ~/.cache/sm90-venv/bin/python benchmarks/static_features.py [--arch 90] [--json out.json]
        [--only dims|features|shapes|paged]

``--only shapes`` (not part of the default run): degenerate lengths, where Triton specialises
an int argument equal to 1 and loops fold away -- q_len x k_len in SHAPES, causal or not, with
or without dropout, MHA and 2:1 GQA, head_dim 64 and 8 (``--dtype``; with ``--backward`` the
backward too; every kept config). 2026-11-26 it found dK/dV's descriptor in a loop the
pipeliner could not predicate at q_len 1 (fixed) and ptxas crashing (error -11) at k_len 1
causal for dQ's 128-row tiles and the 2-stage packed-GQA forward (other kept configs compile:
launches skip the failing ones).

``--only paged`` (not part of the default run): paged KV caches (kernels/core/paged.py) through
``kvcache_forward`` with a block table -- the append kernel and the paged forward (per-thread
loads, PAGED = the page size) -- at 8k keys per row, GQA 4:1, head_dim 128: decoding with
split-KV at page size 16, decoding at page size 256, 4 speculative tokens, a 128-token
prefill at page size 64 (PAGED_CASES).
"""
import argparse
import itertools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = os.path.dirname(HERE)

# (label, q/k head dim, v head dim): Gemma 4's global layers, DeepSeek's MLA, the old maximum.
DIMS = [("d512", 512, 512), ("mla 192/128", 192, 128), ("d256", 256, 256)]
# (label, AttentionCall fields + mods) at head_dim 128, causal.
FEATURES = ["softcap", "sinks", "alibi", "chunk", "gpt-oss (window+sinks)",
            "gemma2 (window+softcap)", "dropout+sinks", "gqa 4:1", "gqa 4:1+dropout",
            "window 512+dropout", "packed 1365+2731", "packed+dropout"]
# (q_len, k_len) of ``--only shapes``: both 1, one 1, one past a 128-row tile, a whole tile.
SHAPES = [(1, 1), (1, 3), (3, 1), (1, 130), (16, 16)]
# (label, q_len, page_size, num_splits) of ``--only paged``.
PAGED_CASES = [("decode p16 split 4", 1, 16, 4), ("decode p256", 1, 256, 1),
               ("4 tokens p16", 4, 16, 1), ("prefill 128 p64", 128, 64, 1)]
# A real 45-bit seed: Triton specialises an int argument equal to 1.
SEED = 0x5DEECE66D123


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tools", default=os.path.join(PROJECT, "..", "shared", "tools"))
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--only", choices=["dims", "features", "shapes", "paged"])
    ap.add_argument("--backward", action="store_true", help="also compile the backward")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    sys.path.insert(0, os.path.abspath(a.tools))
    import sm90_static as st
    st.setup_triton(st._default_cache_dir(), a.arch)
    sys.path.insert(0, PROJECT)
    import torch
    from kernels.core.backward import attention_backward
    from kernels.core.call import AttentionCall
    from kernels.core.forward import attention_forward
    from kernels.core.mods import CallMods

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    B, H, S = 1, 16, a.seq

    def launch(label, d, dv, call, heads_kv=H, packed=None, seq_lens=None):
        """Compile the forward (and backward) of one call: dense (B, H, S, d) -- (q_len, k_len)
        = ``seq_lens`` if given --, or packed sequences of the given lengths ((total, H, d),
        cu_seqlens)."""
        st.LABEL.clear()
        st.LABEL.update(side="project", dtype=a.dtype, head_dim=f"{d}/{dv}", flags=label)
        if packed:
            total = sum(packed)
            cu = torch.tensor([0] + packed).cumsum(0).to(torch.int32)
            q, k = torch.empty((total, H, d), dtype=dt), torch.empty((total, heads_kv, d), dtype=dt)
            v = torch.empty((total, heads_kv, dv), dtype=dt)
            lens = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(packed),
                        max_seqlen_k=max(packed))
            o_shape, lse_shape = (total, H, dv), (H, total)
        else:
            sq, sk = seq_lens or (S, S)
            q = torch.empty((B, H, sq, d), dtype=dt)
            k = torch.empty((B, heads_kv, sk, d), dtype=dt)
            v = torch.empty((B, heads_kv, sk, dv), dtype=dt)
            lens = {}
            o_shape, lse_shape = (B, H, sq, dv), (B, H, sq)
        attention_forward(q, k, v, call, **lens)
        if a.backward:
            o, do = (torch.empty(o_shape, dtype=dt) for _ in range(2))
            lse = torch.empty(lse_shape, dtype=torch.float32)
            attention_backward(do, q, k, v, o, lse, call, **lens)

    sinks = torch.zeros(H)
    slopes = torch.ones(H)
    with st.compile_instead_of_launch(all_configs=False):
        if a.only in (None, "dims"):
            for label, d, dv in DIMS:
                launch(f"causal {label}", d, dv, AttentionCall(causal=True,
                                                               softmax_scale=d ** -0.5))
        if a.only in (None, "features"):
            d = 128
            calls = {
                "softcap": dict(mods=CallMods(softcap=30.0)),
                "sinks": dict(mods=CallMods(sinks=sinks)),
                "alibi": dict(mods=CallMods(alibi_slopes=slopes)),
                "chunk": dict(chunk_size=1024),
                "gpt-oss (window+sinks)": dict(window=128, mods=CallMods(sinks=sinks)),
                "gemma2 (window+softcap)": dict(window=1024, mods=CallMods(softcap=50.0)),
                "dropout+sinks": dict(dropout_p=0.1, seed=SEED, mods=CallMods(sinks=sinks)),
                "gqa 4:1": dict(),
                "gqa 4:1+dropout": dict(dropout_p=0.1, seed=SEED),
                "window 512+dropout": dict(window=512, dropout_p=0.1, seed=SEED),
                "packed 1365+2731": dict(),
                "packed+dropout": dict(dropout_p=0.1, seed=SEED),
            }
            for label in FEATURES:
                launch(label, d, d, AttentionCall(causal=True, softmax_scale=d ** -0.5,
                                                  **calls[label]),
                       heads_kv=H // 4 if label.startswith("gqa") else H,
                       packed=[1365, 2731] if label.startswith("packed") else None)
        if a.only == "shapes":
            for (lq, lk), d, causal, p, kv_heads in itertools.product(
                    SHAPES, (64, 8), (False, True), (0.0, 0.1), (H, H // 2)):
                call = AttentionCall(causal=causal, softmax_scale=d ** -0.5, dropout_p=p,
                                     seed=SEED if p else 0)
                label = f"{lq}x{lk}{' causal' if causal else ''}{' dropout' if p else ''}" \
                        f"{' gqa' if kv_heads < H else ''}"
                launch(label, d, d, call, heads_kv=kv_heads, seq_lens=(lq, lk))
        if a.only == "paged":
            from kernels.core.kvcache import kvcache_forward
            d, kv_heads, keys = 128, H // 4, 8192
            for label, lq, page_size, splits in PAGED_CASES:
                st.LABEL.clear()
                st.LABEL.update(side="project", dtype=a.dtype, head_dim=f"{d}/{d}",
                                flags=f"paged {label}")
                max_blocks = keys // page_size
                pages = torch.empty((4 * max_blocks, page_size, kv_heads, d), dtype=dt)
                table = torch.arange(4 * max_blocks, dtype=torch.int32).view(4, max_blocks)
                lens = torch.full((4,), keys // 2, dtype=torch.int32)
                q = torch.empty((4, H, lq, d), dtype=dt)
                k = torch.empty((4, kv_heads, lq, d), dtype=dt)
                kvcache_forward(q, pages, pages, lens, k, k,
                                AttentionCall(causal=True, softmax_scale=d ** -0.5),
                                num_splits=splits, block_table=table)
    st.print_table(st.RECORDS)
    st.print_summary(st.RECORDS)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(st.RECORDS, f, default=str, indent=1)


if __name__ == "__main__":
    main()
