"""Smoke tests of the benchmark command (``python -m benchmarks``) and its FLOP count.

The CLI test runs the CPU path (ours = the PyTorch fallback, vs SDPA and the reference, with
peak memory) at --quick sizes in a subprocess with CUDA hidden, so it checks the same thing on
every machine; another runs the opt-in ``--interpreter`` path (our kernel's parity and the
feature rows in Triton's interpreter: grouped-query heads, sliding window, chunked attention,
packed sequences, MLA head dims, decoding against a KV cache, SDPA's flash backend with ours,
recorded as skipped on CPU); another runs the CPU path of the transformers rows (not in the
CPU default); another runs a head_dim 512 sweep point; a GPU-marked test runs a one-point
CUDA sweep. No test depends on how fast the machine is: the
CLI runs get no time budget (``--time-budget 0``), and the budget's cut-off is tested with a
deadline already past.
"""
import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import interpreter_unusable_reason

from benchmarks.book_models import (BOOK_SHAPES, FAMILIES, book_rows, family_config,
                                    format_book, package_reason)
from benchmarks.features import (HF_SHAPES, SHAPES, decode_compare,
                                 decode_targets, feature_rows, hf_reason, mixed_lengths,
                                 splits_used)
from benchmarks.features import main as features_main
from benchmarks.features import (MLA_DECODE_OURS, format_mla_decode, mla_decode_compare,
                                 mla_decode_mtp, mla_decode_points, mla_read_bytes)
from benchmarks.cli import DEFAULTS, build_parser, parity_shapes, resolve_args
from benchmarks.flops import (attention_flops, gbps, gpt_step_flops, ideal_chunk_speedup,
                              ideal_window_speedup, kv_read_bytes, mha_flops, tflops,
                              varlen_flops, visible_pairs)
from benchmarks.parity import parity_ok
from benchmarks.plots import plot_filenames, x_range, y_scale
from benchmarks.providers import CPU_PROVIDERS, FALLBACK, INTERPRETER, PROVIDERS, cpu_backend
from benchmarks.report import format_decode, format_features, format_tables, results_stem
from benchmarks.sweep import ROW_KEYS, SweepConfig, add_speedups, plan_tasks, run_sweep

REPO = Path(__file__).resolve().parents[1]
META_KEYS = {"device", "torch", "triton", "cuda", "commit", "date", "timing", "args", "complete"}
MODES = {"fwd", "bwd", "fwd_bwd"}


def _status_ok(status):
    return (status in ("ok", "oom") or status.startswith("unsupported: ")
            or status.startswith("skipped: ") or status.startswith("error: "))


# Only a guard against a hung subprocess, far above what the runs need (the --quick CPU run takes
# ~35 s on an idle 2-core machine): no assertion depends on the machine's speed.
HANG_GUARD_S = 1800


def _run_cli(out_dir, *extra, cuda=False, timeout=HANG_GUARD_S):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    if not cuda:
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    # --time-budget 0: no limit, so every row runs however busy the machine is.
    cmd = [sys.executable, "-m", "benchmarks", "--out-dir", str(out_dir), "--no-plots",
           "--strict", "--time-budget", "0", *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                                  f"stderr:\n{proc.stderr[-4000:]}")
    files = sorted(out_dir.glob("*.json"))
    assert len(files) == 1, files
    return proc, json.loads(files[0].read_text()), files[0].with_suffix(".csv")


def _check_schema(data, csv_path):
    meta, rows = data["meta"], data["rows"]
    assert META_KEYS <= set(meta), META_KEYS - set(meta)
    assert meta["complete"] is True
    assert rows
    for r in rows:
        assert set(ROW_KEYS) <= set(r), set(ROW_KEYS) - set(r)
        assert _status_ok(r["status"]), r["status"]
        assert not r["status"].startswith("error"), r
        assert isinstance(r["causal"], bool) and isinstance(r["dropout_p"], float)
        for key in ("batch", "heads", "seq_len", "head_dim"):
            assert isinstance(r[key], int) and r[key] > 0
        if r["status"] == "ok":
            assert r["ms"] > 0 and r["ms_p20"] <= r["ms"] <= r["ms_p80"], r
            assert r["tflops"] > 0
        else:
            assert r["ms"] is None and r["tflops"] is None
    with open(csv_path, newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert set(ROW_KEYS) <= set(table[0])
    assert [t["provider"] for t in table] == [r["provider"] for r in rows]
    return meta, rows


def test_importing_benchmarks_changes_no_environment():
    """Importing the package and its modules decides nothing: the command sets TRITON_INTERPRET
    (before importing ``kernels``), an import does not."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os, benchmarks, benchmarks.cli, benchmarks.features, benchmarks.book_models, "
            "benchmarks.modules, benchmarks.providers; print(os.environ.get('TRITON_INTERPRET'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr[-2000:]


def test_cli_quick_cpu(tmp_path):
    """`python -m benchmarks --quick` on CPU: what a CPU user can choose between. Ours is the
    PyTorch fallback there (never Triton's interpreter), next to SDPA's CPU backends and the
    reference (its math in the sweep, the book's classes in the module rows), every row with
    its peak memory; parity of the fallback; JSON + CSV schema. Run without a time budget:
    every row is run, whatever the machine's load."""
    proc, data, csv_path = _run_cli(tmp_path, "--quick")
    meta, rows = _check_schema(data, csv_path)
    assert meta["device"] == "cpu" and meta["interpreter"] is False
    assert meta["args"]["time_budget"] == 0
    assert not [r for r in rows if r["status"] == "skipped: time budget"]
    assert "TIME BUDGET" not in proc.stdout
    assert "nothing about GPU speed" in proc.stdout
    assert meta["parity"] and all(p["ok"] and p["backend"] == "pytorch_fallback"
                                  for p in meta["parity"])
    attn = [r for r in rows if r["bench"] == "attention"]
    assert {r["provider"] for r in attn} == set(CPU_PROVIDERS)
    assert {r["mode"] for r in attn} == MODES and {r["dropout_p"] for r in attn} == {0.0, 0.1}
    ours = [r for r in attn if r["provider"] == "kernels"]
    assert ours and all(r["status"] == "ok" for r in ours)
    assert all(r["backend"] == "pytorch_fallback" and r["label"] == "kernels (PyTorch fallback)"
               for r in ours)
    assert "kernels = kernels (PyTorch fallback)" in proc.stdout and "[peak MiB]" in proc.stdout
    assert not [r for r in rows if r.get("backend") == "triton_interpreter"]
    # SDPA's CPU flash backend has no dropout; the math one does.
    flash = [r for r in attn if r["provider"] == "sdpa_flash" and r["dropout_p"] > 0]
    assert flash and all(r["status"].startswith("unsupported: ") for r in flash)
    # Peak memory on every ok row: the reference stores the (seq x seq) scores, growing with
    # seq (batch x seq is fixed: batch x heads x seq^2 grows as seq), and the fallback does
    # not (at p = 0 it hands the work to PyTorch's CPU flash attention).
    for r in rows:
        if r["status"] == "ok":
            assert isinstance(r["peak_mem_bytes"], int) and r["peak_mem_bytes"] >= 0, r
    fwd = {(r["provider"], r["seq_len"]): r["peak_mem_bytes"] for r in attn
           if r["mode"] == "fwd" and r["dropout_p"] == 0 and r["status"] == "ok"}
    lo, hi = sorted({s for _, s in fwd})[0], sorted({s for _, s in fwd})[-1]
    assert fwd["reference", hi] > fwd["reference", lo] > 0
    assert fwd["kernels", hi] < fwd["reference", hi]
    # TFLOP/s is the one FLOP function over the measured median.
    r = ours[0]
    expect = tflops(attention_flops(r["batch"], r["heads"], r["seq_len"], r["seq_len"],
                                    r["head_dim"], causal=True, mode=r["mode"]), r["ms"])
    assert math.isclose(r["tflops"], expect, rel_tol=1e-9)
    benches = {(r["bench"], r["provider"]) for r in rows}
    assert {("module", "module_reference"), ("module", "module_kernels"),
            ("module", "module_reference_wrapper"), ("gpt_step", "gpt_step_reference"),
            ("gpt_step", "gpt_step_kernels")} <= benches
    fused = [r for r in rows if r["provider"] in ("module_kernels", "gpt_step_kernels")]
    assert fused and all(r["status"] == "ok" and r["backend"] == "pytorch_fallback"
                         for r in fused)
    gpt = [r for r in rows if r["provider"] == "gpt_step_kernels"][0]
    assert gpt["fused_modules"] >= 1
    # The feature rows run our kernel in Triton's interpreter: not in the CPU default.
    assert {r["bench"] for r in rows} == {"attention", "module", "gpt_step"}
    _check_cpu_labels(rows, proc.stdout)


FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _check_cpu_labels(rows, stdout):
    """What each CPU row ran (``runs``, profiled), which comparisons time the same code, the
    spread and NOISE mark of each ratio, and the module table's "book / fused" column."""
    attn = [r for r in rows if r["bench"] == "attention" and r["status"] == "ok"]
    assert all(r["runs"] for r in attn)
    by = {(r["provider"], r["mode"], r["dropout_p"], r["seq_len"]): r for r in attn}
    for r in attn:
        if r["provider"] != "kernels":
            continue
        flash = by.get(("sdpa_flash", r["mode"], r["dropout_p"], r["seq_len"]))
        if r["dropout_p"] == 0:
            # The fallback hands a dense causal fp32 call to PyTorch's CPU flash op, the op
            # SDPA's flash backend runs: marked, and left out of the speed-up.
            assert r["runs"] == FLASH_CPU == flash["runs"], (r, flash)
            assert r["same_code_as"] == ["sdpa_flash"] and flash["same_code_as"] == ["kernels"]
            assert r["best_sdpa"] == "sdpa_math"
        else:   # its own dropout path: no PyTorch attention op
            assert r["runs"].startswith("kernels' PyTorch fallback"), r
            assert not r["same_code_as"]
        low, ratio, high = (r["best_sdpa_ratio_low"], r["best_sdpa_ms_over_ours"],
                            r["best_sdpa_ratio_high"])
        best = by[(r["best_sdpa"], r["mode"], r["dropout_p"], r["seq_len"])]
        if min(r["timed_runs"], best["timed_runs"]) < 3:   # a slow row: no spread measured
            assert low is None and r["best_sdpa_noise"] is None
            continue
        assert low <= ratio <= high
        assert r["best_sdpa_noise"] is (low <= 1 <= high)
        assert math.isclose(low, best["ms_p20"] / r["ms_p80"], rel_tol=1e-9)
        assert math.isclose(high, best["ms_p80"] / r["ms_p20"], rel_tol=1e-9)
    assert all(r["runs"] == "aten::_scaled_dot_product_attention_math"
               for r in attn if r["provider"] == "sdpa_math")
    assert f"runs: kernels = {FLASH_CPU}" in stdout
    assert "same op as flash, not compared" in stdout
    assert any(r.get("best_sdpa_noise") for r in attn) == (" NOISE" in stdout.split(
        "module / model")[0])
    # The module table: the classes' names, and "book / fused" on the book's rows.
    mods = [r for r in rows if r["bench"] in ("module", "gpt_step")]
    table = stdout[stdout.index("module / model"):]
    assert "book / fused" in table and "module_reference" not in table
    for r in mods:
        assert r["label"] in table
        fused = {"module_reference": "module_kernels", "module_reference_wrapper":
                 "module_kernels", "gpt_step_reference": "gpt_step_kernels"}.get(r["provider"])
        if fused is None:
            assert r.get("book_over_fused") is None
            continue
        [ours] = [o for o in mods if (o["provider"], o["mode"], o["dropout_p"])
                  == (fused, r["mode"], r["dropout_p"])]
        assert math.isclose(r["book_over_fused"], r["ms"] / ours["ms"], rel_tol=1e-9)
        if min(r["timed_runs"], ours["timed_runs"]) < 3:
            assert r["book_over_fused_noise"] is None
        else:
            assert r["book_over_fused_noise"] is (r["book_over_fused_low"] <= 1
                                                  <= r["book_over_fused_high"])
    module_fused = [r for r in mods if r["provider"] == "module_kernels"]
    assert {r["runs"] for r in module_fused if r["dropout_p"] == 0} == {FLASH_CPU}


def test_cli_interpreter_cpu(tmp_path):
    """`--interpreter` (CPU, opt-in): the interpreted kernel's parity and the feature rows
    (grouped-query heads, sliding window, chunked attention, packed sequences, MLA head dims,
    decoding against a KV cache, SDPA's flash backend with ours, recorded as skipped on CPU),
    all in Triton's interpreter."""
    reason = interpreter_unusable_reason()
    if reason:
        pytest.skip(reason)
    proc, data, csv_path = _run_cli(tmp_path, "--quick", "--interpreter", "--no-modules",
                                    "--no-sweep", "--dtypes", "bf16")
    meta, rows = _check_schema(data, csv_path)
    assert meta["interpreter"] is True and "Triton's interpreter" in meta["note"]
    backends = {p["backend"] for p in meta["parity"]}
    assert backends == {"pytorch_fallback", "triton_interpreter"}
    assert all(p["ok"] for p in meta["parity"])
    _check_feature_rows(rows, csv_path)
    assert "features (shape:" in proc.stdout
    _check_decode_rows(rows, csv_path)
    assert "decode: q_len 1" in proc.stdout
    _check_mla_decode_rows(rows)
    ours = [r for r in rows if r["bench"] in ("gqa", "window", "chunk", "varlen", "mla",
                                              "decode") and r["provider"].startswith("kernels")]
    assert ours and all(r["backend"] == "triton_interpreter" for r in ours)
    # hf is not in the CPU default.
    assert not [r for r in rows if r["bench"] == "hf"]


def test_integration_rows_cpu():
    """On CPU: the hf rows run a tiny Llama (sdpa vs ours; training with and without
    dropout, greedy generation) with speed-ups from their own medians and no target judged.
    No assertion on speed."""
    reason = interpreter_unusable_reason()
    if reason:
        pytest.skip(reason)
    rows = feature_rows("cpu", torch.bfloat16, ["hf"])
    hf = [r for r in rows if r["bench"] == "hf"]
    sh = HF_SHAPES["cpu"]
    assert [(r["provider"], r["mode"], r["dropout_p"]) for r in hf] == [
        (p, m, d) for m, d in [("fwd_bwd", x) for x in sh["dropouts"]] + [("generate", 0.0)]
        for p in ("hf_sdpa", "hf_triton_fused")]
    if hf_reason():
        assert all(r["status"] == f"skipped: {hf_reason()}" for r in hf)
    else:
        assert all(r["status"] == "ok" for r in hf), [r["status"] for r in hf]
        for base, mine in zip(hf[::2], hf[1::2]):
            assert mine["speedup_vs_sdpa"] == pytest.approx(base["ms"] / mine["ms"])
            assert mine["target_met"] is None and "sdpa" in mine["target"]
            assert (mine["heads"], mine["heads_kv"], mine["layers"]) == (
                sh["heads"], sh["heads_kv"], sh["layers"])
        gen = [r for r in hf if r["mode"] == "generate"]
        assert all(r["tokens_per_s"] == pytest.approx(sh["new_tokens"] / (r["ms"] * 1e-3))
                   for r in gen)
    assert "x sdpa" in format_features(rows) or hf_reason()


def test_book_model_rows_cpu():
    """On CPU: each llms-from-scratch family (tiny one-layer configs) runs its
    training step and batch-2 greedy generation, original vs fused; ratios from the rows' own
    medians, no target judged; GPT-2 KV's own cached decoding fails with the package's error,
    recorded as such. No assertion on speed (one warm-up and one timed call per row)."""
    pytest.importorskip("llms_from_scratch", reason="llms-from-scratch is not installed "
                        "(pip install --no-deps llms-from-scratch==1.0.19)")
    reason = interpreter_unusable_reason()
    if reason:
        pytest.skip(reason)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI runs PyTorch on CPU (--cpu-threads): tiny ops
    try:
        rows = book_rows("cpu", torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    sh = BOOK_SHAPES["cpu"]
    want = []
    for fam in FAMILIES:
        want += [(fam, "train_step", sh["train_batch"], p) for p in ("original", "fused")]
        gen = (("original", "original_uncached", "fused") if fam == "gpt2_kv"
               else ("original", "fused"))
        want += [(fam, "generate", b, p) for b in sh["batches"] for p in gen]
    assert [(r["family"], r["mode"], r["batch"], r["provider"]) for r in rows] == want
    for r in rows:
        assert set(ROW_KEYS) <= set(r) and r["bench"] == "book"
        if package_reason(r["family"]):
            assert r["status"] == f"skipped: {package_reason(r['family'])}" and r["ms"] is None
            continue
        if (r["family"], r["mode"], r["provider"]) == ("gpt2_kv", "generate", "original"):
            assert r["status"].startswith("unsupported: llms-from-scratch 1.0.19 kv_cache.gpt2")
            continue
        assert r["status"] == "ok", r
        n = sh["new_tokens"] if r["mode"] == "generate" else r["seq_len"]
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * n / (r["ms"] * 1e-3))
        assert (r["tflops"] > 0 if r["mode"] == "train_step" else r["tflops"] is None)
        if r["provider"] == "fused":
            assert r["fused_modules"] == r["layers"] == 1 and r["target_met"] is None
    by = {(r["family"], r["mode"], r["batch"], r["provider"]): r for r in rows}
    for (fam, mode, batch, prov), mine in by.items():
        if prov != "fused" or mine["status"] != "ok":
            continue
        base = by[fam, mode, batch, "original"]
        if base["status"] == "ok":
            assert mine["speedup_vs_original"] == pytest.approx(base["ms"] / mine["ms"])
        else:  # gpt2_kv generation: compared with the package's uncached generation instead
            assert mine["speedup_vs_original"] is None
            assert mine["speedup_vs_original_uncached"] == pytest.approx(
                by[fam, mode, batch, "original_uncached"]["ms"] / mine["ms"])
    assert "book models" in format_book(rows) and "target not judged" in format_book(rows)


def test_book_model_rows_budget_and_configs():
    """A deadline already past: every book row is written, none measured; the GPU configs
    are the package's Qwen 3 0.6B / Llama 3.2 1B constants (when it is installed), cut to
    --book-layers when asked and saying so."""
    rows = book_rows("cpu", torch.bfloat16, deadline=float("-inf"))
    gen = len(BOOK_SHAPES["cpu"]["batches"])
    assert len(rows) == len(FAMILIES) * (2 + 2 * gen) + gen  # + gpt2_kv's original_uncached
    assert all(r["ms"] is None for r in rows)
    assert all(r["status"] == "skipped: time budget"
               or r["status"] == f"skipped: {package_reason(r['family'])}" for r in rows)
    cfg, text = family_config("qwen3", "cuda", layers=4)
    assert cfg["n_layers"] == 4 and "4 of its 28 layers" in text
    assert (cfg["emb_dim"], cfg["n_heads"], cfg["n_kv_groups"], cfg["head_dim"],
            cfg["vocab_size"]) == (1024, 16, 8, 128, 151936)
    if package_reason("qwen3") is None:
        from llms_from_scratch.qwen3 import QWEN_CONFIG_06_B

        assert family_config("qwen3", "cuda")[0] == QWEN_CONFIG_06_B
    if package_reason("llama3") is None:
        from llms_from_scratch.llama3 import LLAMA32_CONFIG_1B

        assert family_config("llama3", "cuda")[0] == LLAMA32_CONFIG_1B


def _check_feature_rows(rows, csv_path):
    """The CPU feature rows ran, and what they report is computed from what was measured:
    FLOPs from flops.py, the ratios from the rows' own medians, no target judged on CPU."""
    by = {(r["bench"], r["provider"], r["mode"]): r for r in rows}
    shapes = SHAPES["cpu"]
    for mode in ("fwd", "fwd_bwd"):
        # Grouped-query heads: ours with 1 kv head, vs ours MHA (2 kv heads) and SDPA.
        gqa, mha = by["gqa", "kernels", mode], by["gqa", "kernels_mha", mode]
        assert gqa["status"] == mha["status"] == "ok"
        assert (gqa["heads"], gqa["heads_kv"]) == (2, 1) and mha["heads_kv"] == 2
        assert gqa["speedup_vs_mha"] == pytest.approx(mha["ms"] / gqa["ms"])
        assert gqa["target_met"] is None and "MHA" in gqa["target"]
        assert by["gqa", "sdpa_flash", mode]["status"] == by["gqa", "sdpa_math", mode][
            "status"] == "ok"  # the CPU backends that take enable_gqa=True
        assert gqa["best_sdpa"] in ("sdpa_flash", "sdpa_math")
        L = gqa["seq_len"]
        assert gqa["tflops"] == pytest.approx(tflops(
            attention_flops(1, 2, L, L, gqa["head_dim"], mode=mode), gqa["ms"]))
        # Sliding window vs full causal; the ideal from the visible pairs.
        win, full = by["window", "kernels", mode], by["window", "kernels_causal", mode]
        assert win["status"] == full["status"] == "ok"
        W, L = shapes["window"]["window"], shapes["window"]["seq_len"]
        assert (win["window"], full["window"], win["seq_len"]) == (W, None, L)
        assert win["speedup_vs_full"] == pytest.approx(full["ms"] / win["ms"])
        assert win["ideal_speedup"] == pytest.approx(ideal_window_speedup(L, L, W))
        assert win["tflops"] == pytest.approx(tflops(
            attention_flops(1, 1, L, L, win["head_dim"], mode=mode, window=W), win["ms"]))
        assert win["tflops"] * win["ms"] < full["tflops"] * full["ms"]  # fewer FLOPs counted
        assert by["window", "torch_varlen", mode]["status"].startswith("unsupported: CUDA")
        # Chunked attention vs full causal and vs the chunks as a batch of sequences; the
        # ideal from the visible pairs, every chunk row but the causal one counting them.
        ch, cfull = by["chunk", "kernels", mode], by["chunk", "kernels_causal", mode]
        cbat = by["chunk", "kernels_chunks_batched", mode]
        C, L = shapes["chunk"]["chunk_size"], shapes["chunk"]["seq_len"]
        assert ch["status"] == cfull["status"] == cbat["status"] == "ok"
        assert (ch["chunk_size"], cfull["chunk_size"], cbat["chunk_size"]) == (C, None, C)
        assert ch["seq_len"] == cbat["seq_len"] == L and ch["window"] is None
        assert ch["speedup_vs_full"] == pytest.approx(cfull["ms"] / ch["ms"])
        assert ch["speedup_vs_batched"] == pytest.approx(cbat["ms"] / ch["ms"])
        assert ch["ideal_speedup"] == pytest.approx(ideal_chunk_speedup(L, L, C))
        chunk_flops = attention_flops(1, 1, L, L, ch["head_dim"], mode=mode, chunk_size=C)
        for r in (ch, cbat):
            assert r["tflops"] == pytest.approx(tflops(chunk_flops, r["ms"]))
        assert cfull["tflops"] == pytest.approx(tflops(
            attention_flops(1, 1, L, L, ch["head_dim"], mode=mode), cfull["ms"]))
        assert ch["target_met"] is None and "3.2" in ch["target"]
        assert by["chunk", "torch_varlen", mode]["status"].startswith("unsupported: CUDA")
        # Packed sequences: every row counts the same FLOPs, each sequence's own causal work.
        var = by["varlen", "kernels_varlen", mode]
        lens = var["seqlens"]
        assert sum(lens) == var["total_tokens"] == shapes["varlen"]["total"]
        assert var["batch"] == len(lens) > 1 and var["seq_len"] == max(lens)
        flops = varlen_flops(lens, lens, var["heads"], var["head_dim"], mode=mode)
        for name in ("kernels_varlen", "kernels_dense_each", "kernels_dense_padded"):
            r = by["varlen", name, mode]
            assert r["status"] == "ok" and r["seqlens"] == lens
            assert r["tflops"] == pytest.approx(tflops(flops, r["ms"]))
        assert var["tflops_vs_dense_each"] == pytest.approx(
            by["varlen", "kernels_dense_each", mode]["ms"] / var["ms"])
        assert var["tflops_vs_dense_padded"] == pytest.approx(
            by["varlen", "kernels_dense_padded", mode]["ms"] / var["ms"])
        assert var["target_met"] is None
        # MLA head dims: ours native vs v zero-padded to q's head dim, and SDPA (CPU flash
        # refuses Dv != D, recorded with its reason); FLOPs of the MLA problem on every row.
        sh = shapes["mla"]
        mla, padded = by["mla", "kernels", mode], by["mla", "kernels_padded", mode]
        assert mla["status"] == padded["status"] == by["mla", "sdpa_math", mode]["status"] == "ok"
        assert (mla["head_dim"], mla["head_dim_v"]) == (sh["head_dim"], sh["head_dim_v"])
        assert mla["speedup_vs_padded"] == pytest.approx(padded["ms"] / mla["ms"])
        assert mla["best_sdpa"] == "sdpa_math" and mla["best_sdpa_ms_over_ours"] == pytest.approx(
            by["mla", "sdpa_math", mode]["ms"] / mla["ms"])
        mla_flops = attention_flops(sh["batch"], sh["heads"], sh["seq_len"], sh["seq_len"],
                                    sh["head_dim"], mode=mode, head_dim_v=sh["head_dim_v"])
        for r in (mla, padded):
            assert r["tflops"] == pytest.approx(tflops(mla_flops, r["ms"]))
        assert mla["target_met"] is None and "padded" in mla["target"]
        flash = by["mla", "sdpa_flash", mode]["status"]
        assert flash.startswith("unsupported: ") and "last dim" in flash, flash
        # A window as a bool and as an additive mask, each against the native window.
        native = by["mask", "kernels_window", mode]
        for name in ("kernels", "kernels_bias"):
            masked = by["mask", name, mode]
            assert masked["status"] == native["status"] == "ok", name
            assert masked["speedup_vs_native"] == pytest.approx(native["ms"] / masked["ms"])
    with open(csv_path, newline="") as f:
        table = [t for t in csv.DictReader(f) if t["bench"] == "varlen"]
    assert table and json.loads(table[0]["seqlens"]) == lens


def _check_decode_rows(rows, csv_path):
    """The CPU decode rows ran (split forced, since the heuristic gives 1 in the interpreter),
    and their bytes, GB/s, FLOPs and speed-ups are computed from their own shapes and medians;
    no copy bandwidth and no target on CPU."""
    sh = SHAPES["cpu"]["decode"]
    H, Hkv, D = sh["heads"], sh["heads_kv"], sh["head_dim"]
    dec = [r for r in rows if r["bench"] == "decode"]
    points = [(b, n) for b in sh["batches"] for n in sh["cache_lens"]]
    assert list(dict.fromkeys((r["batch"], r["seq_len"]) for r in dec)) == points
    for B, L in points:
        by = {r["provider"]: r for r in dec if (r["batch"], r["seq_len"]) == (B, L)}
        assert set(by) == {"kernels", "kernels_unsplit", "kernels_dense", "kernels_paged",
                           "sdpa_flash", "sdpa_efficient"}
        assert by["sdpa_efficient"]["status"] == "unsupported: CUDA-only backend"
        for name, r in by.items():
            assert (r["heads"], r["heads_kv"], r["head_dim"], r["q_len"]) == (H, Hkv, D, 1)
            assert r["mode"] == "fwd" and r["dtype"] == "bfloat16" and r["window"] is None
            assert r["kv_bytes"] == kv_read_bytes(B, Hkv, L, D) == 2 * B * Hkv * L * D * 2
            assert r["copy_gbps"] is None and r["bw_fraction"] is None
            if name == "sdpa_efficient":
                assert r["gbps"] is None
                continue
            assert r["status"] == "ok", r
            assert r["gbps"] == pytest.approx(r["kv_bytes"] / (r["ms"] * 1e-3) / 1e9)
            assert r["tflops"] == pytest.approx(4 * B * H * L * D / (r["ms"] * 1e-3) / 1e12)
        mine, unsplit, dense = by["kernels"], by["kernels_unsplit"], by["kernels_dense"]
        assert (mine["num_splits"], mine["num_splits_arg"], mine["num_splits_how"]) == (
            sh["num_splits"], sh["num_splits"], "forced") and mine["num_splits"] > 1
        assert (dense["num_splits"], dense["num_splits_how"]) == (sh["num_splits"], "forced")
        assert (unsplit["num_splits"], unsplit["num_splits_arg"],
                unsplit["num_splits_how"]) == (1, 1, "none")
        assert "num_splits" not in by["sdpa_flash"]
        assert mine["speedup_vs_unsplit"] == pytest.approx(unsplit["ms"] / mine["ms"])
        paged = by["kernels_paged"]
        assert paged["paged_vs_dense"] == pytest.approx(mine["ms"] / paged["ms"])
        assert mine["best_sdpa_ms_over_ours"] == pytest.approx(by["sdpa_flash"]["ms"] / mine["ms"])
        assert mine["best_sdpa"] == "sdpa_flash"
        assert mine["target"] is None and mine["target_met"] is None
    with open(csv_path, newline="") as f:
        table = [t for t in csv.DictReader(f) if t["bench"] == "decode"]
    assert len(table) == len(dec) and int(table[0]["kv_bytes"]) == dec[0]["kv_bytes"]


def _decode_point(batch, cache_len, ms):
    """Synthetic rows of one GPU decode point (32/8 heads, d128, bf16); ``ms`` per provider."""
    rows = []
    for name, t in ms.items():
        rows.append(dict(bench="decode", provider=name, mode="fwd", dtype="bfloat16",
                         causal=True, dropout_p=0.0, batch=batch, heads=32, heads_kv=8,
                         seq_len=cache_len, head_dim=128, q_len=1, window=None,
                         kv_bytes=kv_read_bytes(batch, 8, cache_len, 128), gbps=None,
                         copy_gbps=None, bw_fraction=None, ms=t, ms_p20=t, ms_p80=t,
                         tflops=1.0 if t else None, peak_mem_bytes=None, first_call_s=None,
                         best_sdpa_ms_over_ours=None, best_sdpa=None,
                         status="ok" if t else "unsupported: x"))
        if name.startswith("kernels"):
            rows[-1].update(num_splits=14 if name == "kernels" else 1,
                            num_splits_arg=0 if name == "kernels" else 1,
                            num_splits_how="heuristic" if name == "kernels" else "none")
    return rows


def test_decode_bandwidth_speedup_and_targets():
    """Decode rows: GB/s = K+V bytes / time, its fraction of the copy bandwidth, the speed-up
    over unsplit and the decode targets (batch 1: >= 70% of copy at >= 32k, >= 50% at 8k,
    >= 5x unsplit at 32k), judged only on a GPU and only with every value present."""
    assert decode_targets(1, 32768) == [("bw_fraction", 0.7), ("speedup_vs_unsplit", 5.0)]
    assert decode_targets(1, 131072) == [("bw_fraction", 0.7)]
    assert decode_targets(1, 8192) == [("bw_fraction", 0.5)]
    assert decode_targets(1, 16384) == decode_targets(8, 32768) == decode_targets(1, 64) == []
    nbytes = kv_read_bytes(1, 8, 32768, 128)  # 128 MiB
    assert nbytes == 2 * 8 * 32768 * 128 * 2 and gbps(nbytes, 0.1) == pytest.approx(1342.17728)
    # 32k: 2100 GB/s of a 3000 GB/s copy = 0.7, 6x unsplit: met.
    fast = nbytes / 2100e9 * 1e3
    rows = decode_compare(_decode_point(1, 32768, dict(
        kernels=fast, kernels_unsplit=6 * fast, kernels_dense=fast, sdpa_flash=2 * fast,
        sdpa_efficient=None)), gpu=True, copy_gbps=3000.0)
    by = {r["provider"]: r for r in rows}
    mine = by["kernels"]
    assert mine["gbps"] == pytest.approx(2100.0) and mine["bw_fraction"] == pytest.approx(0.7)
    assert mine["speedup_vs_unsplit"] == pytest.approx(6.0)
    assert mine["best_sdpa_ms_over_ours"] == pytest.approx(2.0)
    assert by["sdpa_flash"]["bw_fraction"] == pytest.approx(0.35)
    assert all(r["copy_gbps"] == 3000.0 for r in rows) and by["sdpa_efficient"]["gbps"] is None
    assert mine["target"] == "bw_fraction >= 0.7 and speedup_vs_unsplit >= 5"
    assert mine["target_met"] is True
    # 4x unsplit misses the speed-up target even at full bandwidth.
    rows2 = decode_compare(_decode_point(1, 32768, dict(
        kernels=fast, kernels_unsplit=4 * fast)), gpu=True, copy_gbps=3000.0)
    assert rows2[0]["target_met"] is False
    # No copy bandwidth, or a CPU run: computed fields, no verdict.
    rows3 = decode_compare(_decode_point(1, 8192, dict(kernels=1.0, kernels_unsplit=2.0)),
                           gpu=True, copy_gbps=None)
    assert rows3[0]["bw_fraction"] is None and rows3[0]["target_met"] is None
    assert rows3[0]["target"] == "bw_fraction >= 0.5"
    rows4 = decode_compare(_decode_point(1, 8192, dict(kernels=1.0, kernels_unsplit=2.0)),
                           gpu=False, copy_gbps=3000.0)
    assert rows4[0]["bw_fraction"] is not None and rows4[0]["target_met"] is None
    # A point without a target.
    rows5 = decode_compare(_decode_point(8, 16384, dict(kernels=1.0, kernels_unsplit=2.0)),
                           gpu=True, copy_gbps=3000.0)
    assert rows5[0]["target"] is None and rows5[0]["target_met"] is None
    text = format_decode(rows + rows5)
    assert "copy 3000 GB/s measured in this run" in text
    assert "2100.0" in text and "70%" in text and "6x" in text and "met (bw_fraction" in text
    assert "14 heuri" in text and "MISSED" in format_decode(rows2)


def test_decode_splits_follow_the_heuristic():
    """The split count recorded on ours' rows is kernels.core.configs' heuristic over the launch's
    nominal tiles (packed GQA: one program per kv group): on an H100's 132 SMs the GPU shapes
    get 14-16 splits at batch 1 and 2 at batch 8; none on CPU."""
    sh = SHAPES["cuda"]["decode"]
    h100 = {(b, n): splits_used("cuda", b, sh["heads"], sh["heads_kv"], 1, n, 0, sm_count=132)
            for b in sh["batches"] for n in sh["cache_lens"]}
    assert all(how == "heuristic" for _, how in h100.values())
    assert [h100[1, n][0] for n in sh["cache_lens"]] == [16, 16, 16, 15, 14, 14, 14, 15]
    assert [h100[8, n][0] for n in sh["cache_lens"]] == [2] * 8
    assert splits_used("cpu", 1, 4, 1, 1, 128, 0) == (1, "heuristic")
    assert splits_used("cpu", 1, 4, 1, 1, 64, 4) == (4, "forced")
    assert splits_used("cpu", 1, 4, 1, 1, 32, 4) == (2, "forced")  # clamped: 2 tiles of 16
    assert splits_used("cpu", 1, 4, 1, 1, 64, 1) == (1, "none")


def test_cpu_backend_and_peak_memory():
    """cpu_backend sets TRITON_INTERPRET for its block and restores it; CpuPeakMemory sees the
    largest set of tensors alive at once (not the inputs), on one thread, and gives the
    thread count back."""
    import os

    from benchmarks.measure import CpuPeakMemory

    saved = os.environ.get("TRITON_INTERPRET")
    with cpu_backend(FALLBACK):
        assert os.environ["TRITON_INTERPRET"] == "0"
        with cpu_backend(INTERPRETER):
            assert os.environ["TRITON_INTERPRET"] == "1"
        assert os.environ["TRITON_INTERPRET"] == "0"
    assert os.environ.get("TRITON_INTERPRET") == saved
    x = torch.randn(256, 1024)  # 1 MiB, alive before: not counted
    threads = torch.get_num_threads()
    with CpuPeakMemory() as pm:
        assert torch.get_num_threads() == 1
        a = x * 2          # +1 MiB
        b = torch.cat([a, a, a])  # +3 MiB: 4 MiB alive
        del a, b
        c = x + 1          # 1 MiB
        del c
    assert torch.get_num_threads() == threads
    assert 4 * 2**20 <= pm.extra_bytes < 5 * 2**20


@pytest.mark.gpu
def test_cli_one_point_cuda(tmp_path):
    """The CUDA path: do_bench timing, peak memory, speed-up column, at one small point."""
    _, data, csv_path = _run_cli(
        tmp_path, "--skip-parity", "--no-modules", "--seq-lens", "256", "--dtypes", "bf16",
        "--head-dims", "64", "--dropout", "0.0", "--modes", "fwd", "fwd_bwd",
        "--providers", "kernels", "sdpa_flash", "sdpa_math", cuda=True)
    meta, rows = _check_schema(data, csv_path)
    assert meta["device"] != "cpu" and meta["cuda"]
    for r in rows:
        assert r["status"] == "ok", r
        assert isinstance(r["peak_mem_bytes"], int) and r["peak_mem_bytes"] >= 0
    assert all(r["best_sdpa_ms_over_ours"] > 0 for r in rows if r["provider"] == "kernels")


def test_flops_documented_numbers():
    """The convention: 4*B*H*Lq*Lk*D forward, halved for causal, bwd 2.5x, fwd_bwd 3.5x."""
    full = 4 * 1 * 1 * 128 * 128 * 64
    assert attention_flops(1, 1, 128, 128, 64, causal=False) == full
    assert attention_flops(1, 1, 128, 128, 64, causal=True) == full / 2
    assert attention_flops(1, 1, 128, 128, 64, causal=True, mode="bwd") == 2.5 * full / 2
    assert attention_flops(1, 1, 128, 128, 64, causal=True, mode="fwd_bwd") == 3.5 * full / 2
    assert attention_flops(2, 16, 4096, 4096, 128) == 4 * 2 * 16 * 4096 * 4096 * 128 / 2
    assert tflops(1e12, 1000.0) == 1.0 and tflops(1.0, None) is None
    # Module: 4 projections (2 FLOPs per weight and token) + the core.
    assert mha_flops(1, 8, 4, 4, 2) == 4 * 2 * 8 * 4 * 4 + attention_flops(1, 2, 8, 8, 2)
    assert gpt_step_flops(10, 1, 1, 8, 4, 2) == 6 * 10 * 8 + attention_flops(
        1, 2, 8, 8, 2, mode="fwd_bwd")
    with pytest.raises(ValueError):
        attention_flops(1, 1, 1, 1, 1, mode="backward")


@pytest.mark.parametrize("q_len,k_len,window", [(6, 6, None), (6, 6, 3), (2, 6, 3), (5, 2, None),
                                                (7, 9, 1), (9, 7, 4), (8, 8, 8), (8, 8, 20)])
def test_visible_pairs_match_the_mask(q_len, k_len, window):
    """visible_pairs counts the kernels' bottom-right causal / window mask exactly."""
    i = torch.arange(q_len)[:, None]
    j = torch.arange(k_len)[None, :]
    d = k_len - q_len
    mask = j <= i + d
    if window is not None:
        mask &= j > i + d - window
    assert visible_pairs(q_len, k_len, window=window) == int(mask.sum())
    assert visible_pairs(q_len, k_len, causal=False) == q_len * k_len


def test_window_and_varlen_flops():
    """The ideal window speed-up is computed (4.27x for 4096 at 32k), window FLOPs count the
    visible pairs, window >= k_len is plain causal, varlen sums each sequence's own count."""
    assert round(ideal_window_speedup(32768, 32768, 4096), 2) == 4.27
    assert ideal_window_speedup(128, 128, 128) == 1.0
    pairs = visible_pairs(128, 128, window=16)
    assert attention_flops(2, 3, 128, 128, 64, window=16) == 4 * 2 * 3 * 64 * pairs
    assert attention_flops(2, 3, 128, 128, 64, window=16, mode="fwd_bwd") == 3.5 * (
        4 * 2 * 3 * 64 * pairs)
    assert attention_flops(1, 1, 128, 128, 64, window=128) == attention_flops(1, 1, 128, 128, 64)
    lens = [100, 7, 300]
    assert varlen_flops(lens, lens, 4, 64, mode="bwd") == sum(
        attention_flops(1, 4, n, n, 64, mode="bwd") for n in lens)
    assert varlen_flops(lens, lens, 4, 64) == 4 * 4 * 64 * sum(n * n for n in lens) / 2


@pytest.mark.parametrize("q_len,k_len,chunk", [(6, 6, 3), (7, 7, 3), (64, 64, 16), (5, 9, 4),
                                               (9, 5, 4), (8, 8, 1), (8, 8, 8), (8, 8, 20),
                                               (3, 10, 4), (0, 4, 2)])
def test_chunk_pairs_match_the_mask(q_len, k_len, chunk):
    """The closed form of visible_pairs(chunk_size=...) counts the kernels' chunked mask: query
    i at P = i + k_len - q_len sees key j iff j <= P and j // chunk == P // chunk."""
    i = torch.arange(q_len)[:, None]
    j = torch.arange(k_len)[None, :]
    pos = i + k_len - q_len
    mask = (j <= pos) & (pos >= 0) & (j // chunk == pos.clamp(min=0) // chunk)
    assert visible_pairs(q_len, k_len, chunk_size=chunk) == int(mask.sum())
    if chunk >= k_len:
        assert visible_pairs(q_len, k_len, chunk_size=chunk) == visible_pairs(q_len, k_len)


def test_chunk_and_mla_flops():
    """Chunked attention: the ideal speed-up (4.0 for chunk 8192 at 32k: four causal triangles a
    quarter as long), FLOPs by visible pairs, chunk >= k_len plain causal. A value head dim of
    its own: forward 2 * pairs * (D + Dv), backward 2 * pairs * (3D + 2Dv) per batch and head,
    the usual count when Dv = D."""
    assert visible_pairs(32768, 32768, chunk_size=8192) == 4 * 8192 * 8193 // 2
    assert ideal_chunk_speedup(32768, 32768, 8192) == pytest.approx(32769 / 8193)
    assert round(ideal_chunk_speedup(32768, 32768, 8192), 2) == 4.0
    assert round(ideal_chunk_speedup(64, 64, 16), 2) == 3.82  # the CPU shape
    pairs = visible_pairs(128, 128, chunk_size=16)
    assert attention_flops(2, 3, 128, 128, 64, chunk_size=16, mode="bwd") == 2.5 * (
        4 * 2 * 3 * 64 * pairs)
    assert attention_flops(1, 1, 128, 128, 64, chunk_size=128) == attention_flops(
        1, 1, 128, 128, 64)
    with pytest.raises(ValueError):
        visible_pairs(8, 8, window=2, chunk_size=4)
    with pytest.raises(ValueError):
        visible_pairs(8, 8, causal=False, chunk_size=4)
    for mode, (qk, pv) in {"fwd": (1, 1), "bwd": (3, 2), "fwd_bwd": (4, 3)}.items():
        # causal: the n^2 / 2 convention, 64 * 64 / 2 pairs
        assert attention_flops(2, 4, 64, 64, 192, mode=mode, head_dim_v=128) == (
            2 * 4 * 2 * (64 * 64 / 2) * (qk * 192 + pv * 128))
        assert attention_flops(2, 4, 64, 64, 96, mode=mode, head_dim_v=96) == attention_flops(
            2, 4, 64, 64, 96, mode=mode)


def _check_mla_decode_rows(rows):
    """The CPU mla_decode rows (interpreter): every point's three rows ran, fwd, bf16 q, the
    bytes, GB/s, FLOPs (the one formula, Dv 512) and ratios from their own shapes and medians;
    the first point's fwd_bwd rows say forward only; no copy rate and no verdict on CPU."""
    sh = SHAPES["cpu"]["mla_decode"]
    mla = [r for r in rows if r["bench"] == "mla_decode"]
    points = mla_decode_points(sh)
    assert list(dict.fromkeys((r["heads"], r["batch"], r["seq_len"], r["q_len"])
                              for r in mla)) == points
    assert [(r["provider"], r["mode"]) for r in mla[:6]] == [
        (p, m) for p in MLA_DECODE_OURS for m in ("fwd", "fwd_bwd")]
    assert all(r["status"] == "unsupported: forward only" for r in mla if r["mode"] != "fwd")
    fwd = [r for r in mla if r["mode"] == "fwd"]
    assert len(fwd) == 3 * len(points) and all(r["status"] == "ok" for r in fwd), fwd
    by = {(r["provider"], r["heads"], r["batch"], r["seq_len"], r["q_len"]): r for r in fwd}
    for H, B, L, q in points:
        mine, copy, fp8 = (by[p, H, B, L, q] for p in MLA_DECODE_OURS)
        for r in (mine, copy, fp8):
            assert (r["head_dim"], r["head_dim_v"], r["heads_kv"], r["dtype"]) == (
                576, 512, 1, "bfloat16")
            assert r["page_size"] == sh["page_size"] and r["backend"] == "triton_interpreter"
            assert r["num_splits"] == sh["num_splits"] and r["num_splits_how"] == "forced"
            assert r["tflops"] == pytest.approx(tflops(B * H * q * L * (576 + 512) * 2, r["ms"]))
            assert r["gbps"] == pytest.approx(r["kv_bytes"] / (r["ms"] * 1e-3) / 1e9)
            assert r["copy_gbps"] is None and r["bw_fraction"] is None
        assert mine["kv_bytes"] == B * L * 576 * 2 == 2 * fp8["kv_bytes"]
        assert copy["kv_bytes"] == B * L * (576 + 512) * 2
        assert (mine["cache_dtype"], fp8["cache_dtype"]) == ("bfloat16", "float8_e4m3fn")
        assert mine["v_in_k"] and fp8["v_in_k"] and not copy["v_in_k"]
        assert mine["speedup_vs_v_copy"] == pytest.approx(copy["ms"] / mine["ms"])
        assert fp8["speedup_vs_bf16"] == pytest.approx(mine["ms"] / fp8["ms"])
        assert mine["target_met"] is None and "v_copy" in mine["target"]
        if q > 1:
            assert mine["ms_over_q_len_1"] == pytest.approx(
                mine["ms"] / by["kernels", H, B, L, 1]["ms"])
    assert "x vcopy" in format_mla_decode(rows, "ms")


def test_mla_decode_bytes_ratios_table_and_printer(tmp_path, capsys):
    """mla_decode on made-up GPU rows: bytes of the latent read once (V in K), or with V's
    copy, or in e4m3; GB/s and its fraction of the copy rate, the A/B ratios, the target judged
    on a GPU only, the MTP ratio, the table and ``python -m benchmarks.features`` printing it
    from a results file. The GPU points: heads 16 / 128, batch 8 / 64, 4k / 32k keys, page 64,
    and one two-token (MTP) point with its one-token twin."""
    gpu = SHAPES["cuda"]["mla_decode"]
    points = mla_decode_points(gpu)
    assert len(points) == 9 and points[-1] == (128, 64, 4096, 2) and (128, 64, 4096, 1) in points
    assert gpu["page_size"] == 64 and gpu["num_splits"] == 0
    assert mla_read_bytes(64, 4096) == 64 * 4096 * 576 * 2
    assert mla_read_bytes(64, 4096, 1) * 2 == mla_read_bytes(64, 4096)
    assert mla_read_bytes(8, 32768, v_copy=True) == 8 * 32768 * 1088 * 2

    def point(q_len, ms, copy_gbps=4246.0, gpu_run=True):
        rows = []
        for name, t in zip(MLA_DECODE_OURS, ms):
            rows.append(dict(bench="mla_decode", provider=name, mode="fwd", heads=128,
                             batch=64, seq_len=4096, q_len=q_len, page_size=64,
                             status="ok" if t else "oom", ms=t, num_splits=1,
                             num_splits_how="heuristic", kv_bytes=mla_read_bytes(
                                 64, 4096, 1 if name == "kernels_fp8" else 2,
                                 v_copy=name == "kernels_v_copy"), tflops=1.0))
        return mla_decode_compare(rows, gpu_run, copy_gbps)

    t = mla_read_bytes(64, 4096) / 3000e9 * 1e3        # 3000 GB/s for the latent read once
    one = point(1, [t, 1.5 * t, 0.8 * t])
    mine, copy, fp8 = one
    assert mine["gbps"] == pytest.approx(3000.0)
    assert mine["bw_fraction"] == pytest.approx(3000.0 / 4246.0)
    assert copy["gbps"] == pytest.approx(3000.0 * 1088 / 576 / 1.5)
    assert mine["speedup_vs_v_copy"] == pytest.approx(1.5) and mine["target_met"] is True
    assert fp8["speedup_vs_bf16"] == pytest.approx(1.25)
    assert point(1, [t, 0.9 * t, t])[0]["target_met"] is False
    assert point(1, [t, None, t])[0]["target_met"] is None       # the copy row's oom
    assert point(1, [t, 2 * t, t], None, gpu_run=False)[0]["target_met"] is None
    rows = mla_decode_mtp(one + point(2, [1.2 * t, 1.8 * t, t]))
    assert rows[3]["ms_over_q_len_1"] == pytest.approx(1.2) and "ms_over_q_len_1" not in rows[0]
    text = format_mla_decode(rows)
    assert "copy 4246 GB/s measured in this run" in text and "3000.0" in text
    assert "71%" in text and "1.5x" in text and "1.25x" in text and " 1.2 " in text
    assert "met" in text and "page 64" in text
    (tmp_path / "r.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    assert features_main([str(tmp_path)]) == 0
    assert "3000.0" in capsys.readouterr().out


def test_sweep_head_dim_512():
    """head_dim 512 is in the GPU default sweep (a secondary config, after d64; heads = hidden //
    512 = 4; its parity shape too), not in the CPU defaults; a d512 point runs through the sweep
    on CPU (ours = the fallback, SDPA's CPU backends) with the one FLOP count."""
    assert DEFAULTS["cuda"]["head_dims"] == [128, 64, 512]
    assert 512 not in DEFAULTS["cpu"]["head_dims"] + DEFAULTS["cpu_quick"]["head_dims"]
    args = resolve_args(build_parser().parse_args([]), "cuda")
    assert args.head_dims == [128, 64, 512]
    tasks = [c for c, _ in plan_tasks(SweepConfig(
        device="cuda", seq_lens=[4096], modes=["fwd"], dtypes=args.dtypes,
        head_dims=args.head_dims, dropouts=args.dropout, providers=["kernels"],
        tokens=args.tokens, hidden=args.hidden, quadratic_max_seq=8192))]
    assert tasks[:4] == [("bfloat16", 128, 0.0), ("bfloat16", 128, 0.1), ("bfloat16", 64, 0.0),
                         ("bfloat16", 512, 0.0)]
    assert (2, 3, 257, 512) in parity_shapes("cuda", args.head_dims)
    cfg = SweepConfig(device="cpu", seq_lens=[32], modes=["fwd", "fwd_bwd"], dtypes=["float32"],
                      head_dims=[512], dropouts=[0.0],
                      providers=["kernels", "sdpa_math", "sdpa_flash"], tokens=64, hidden=1024,
                      quadratic_max_seq=1 << 30, cpu_reps=1, cpu_max_s=0.0)
    rows = run_sweep(cfg, lambda name: getattr(torch, name))  # ours: the fallback on CPU
    assert len(rows) == 3 * 2
    for r in rows:
        assert (r["head_dim"], r["heads"], r["batch"], r["seq_len"]) == (512, 2, 2, 32)
        assert r["status"] == "ok", r
        assert r.get("backend") == ("pytorch_fallback" if r["provider"] == "kernels" else None)
        assert r["tflops"] == pytest.approx(tflops(
            attention_flops(2, 2, 32, 32, 512, mode=r["mode"]), r["ms"]))
    assert all(r["best_sdpa_ms_over_ours"] > 0 for r in rows if r["provider"] == "kernels")


def test_mixed_lengths_are_fixed_and_in_range():
    for total, lo, hi in ((16384, 128, 4096), (64, 8, 32), (5000, 100, 200), (50, 100, 300)):
        lens = mixed_lengths(total, lo, hi, seed=0)
        assert sum(lens) == total and lens == mixed_lengths(total, lo, hi, seed=0)
        assert all(lo <= n <= hi for n in lens) or lens == [total]
    gpu = SHAPES["cuda"]["varlen"]
    lens = mixed_lengths(gpu["total"], gpu["lo"], gpu["hi"], gpu["seed"])
    assert sum(lens) == 16384 and len(set(lens)) > 1


def test_feature_rows_respect_the_time_budget():
    """A deadline already past: every feature row is written, none is measured (no kernel
    runs), each says why."""
    rows = feature_rows("cpu", torch.bfloat16, deadline=float("-inf"))
    assert {r["bench"] for r in rows} == {"gqa", "window", "chunk", "varlen", "mla", "decode",
                                          "fp8", "mask", "mla_decode", "hf"}
    assert all(r["ms"] is None for r in rows)
    assert all(r["status"] == "skipped: time budget" or r["status"].startswith(
        ("unsupported: ", "skipped: transformers")) for r in rows), {
        r["status"] for r in rows}
    assert {r["provider"] for r in rows if r["status"] == "skipped: time budget"} >= {
        "kernels", "kernels_mha", "kernels_causal", "kernels_chunks_batched", "kernels_varlen",
        "kernels_dense_each", "kernels_dense_padded", "kernels_padded", "kernels_unsplit",
        "kernels_dense", "kernels_fp8", "kernels_cache", "kernels_cache_fp8", "kernels_window",
        "kernels_bias", "kernels_v_copy"}
    assert all(r.get("target_met") is None for r in rows)
    assert "features (shape:" in format_features(rows)
    # decode, then the integration rows last: every point written
    assert [r["bench"] for r in rows][-1] == "hf"
    dec = [r for r in rows if r["bench"] == "decode"]
    assert len(dec) == 6 * 4 and rows.index(dec[-1]) < min(
        i for i, r in enumerate(rows) if r["bench"] == "hf")
    assert all(r["copy_gbps"] is None and r["gbps"] is None for r in dec)
    assert "decode: q_len 1" in format_decode(dec)


def test_features_run_after_the_primary_config():
    """The sweep calls the feature hook once, after the primary config's rows and before the
    others (so the time budget cuts secondary configs first)."""
    seen = []
    called = []
    cfg = SweepConfig(device="cpu", seq_lens=[32, 64], modes=["fwd"], dtypes=["bfloat16"],
                      head_dims=[32, 64], dropouts=[0.0], providers=["kernels", "sdpa_math"],
                      tokens=64, hidden=64, quadratic_max_seq=1 << 30, deadline=float("-inf"))
    run_sweep(cfg, lambda name: getattr(torch, name), on_row=seen.append,
              after_primary=lambda rows: called.append((len(seen), len(rows))))
    assert called == [(2 * 2, 2 * 2)]  # seq_lens x providers x modes of the primary config
    called.clear()
    cfg.head_dims = [32]
    run_sweep(cfg, lambda name: getattr(torch, name), after_primary=lambda r: called.append(1))
    assert called == [1]  # only a primary config: called at the end


def test_targets_in_the_table():
    """GPU rows with a target say met / MISSED."""
    base = dict(mode="fwd", dtype="bfloat16", causal=True, dropout_p=0.0, batch=1, heads=32,
                seq_len=4096, head_dim=128, ms_p20=None, ms_p80=None, peak_mem_bytes=None,
                first_call_s=None, best_sdpa_ms_over_ours=None, best_sdpa=None, heads_kv=8,
                window=None, tflops=1.0, status="ok")
    rows = [dict(base, bench="gqa", provider="kernels", ms=1.0, speedup_vs_mha=1.2,
                 target="GQA >= MHA", target_met=True),
            dict(base, bench="window", provider="kernels", ms=1.0, window=4096,
                 speedup_vs_full=3.0, ideal_speedup=4.27, target="3.5x", target_met=False)]
    text = format_features(rows)
    assert "1.2x MHA; target met" in text and "3x full (ideal 4.27x); TARGET MISSED" in text
    text = format_features([dict(base, bench="chunk", provider="kernels", ms=1.0, heads=16,
                                 heads_kv=16, seq_len=32768, chunk_size=8192,
                                 speedup_vs_full=3.5, ideal_speedup=4.0,
                                 speedup_vs_batched=0.95, target="3.2x", target_met=True),
                            dict(base, bench="mla", provider="kernels", ms=1.0, heads=16,
                                 heads_kv=16, head_dim=192, head_dim_v=128,
                                 speedup_vs_padded=1.1, best_sdpa_ms_over_ours=2.0,
                                 target="padded", target_met=True)])
    assert "1x16x32768 d128 c8192" in text and "3.5x full (ideal 4x), 0.95x batched" in text
    assert "1x16x4096 d192/v128" in text and "1.1x padded v, 2x sdpa; target met" in text


def test_parity_ok_rule():
    """Within 2x PyTorch-in-dtype error passes; far outside, or NaN, fails."""
    ref = torch.randn(64, 32, dtype=torch.float64)
    low = ref.to(torch.bfloat16)
    assert parity_ok(low, ref, low)
    assert not parity_ok(low + 1.0, ref, low)
    bad = low.clone()
    bad[0, 0] = float("nan")
    assert not parity_ok(bad, ref, low)


def test_plan_puts_primary_first_and_compiled_last():
    cfg = SweepConfig(device="cuda", seq_lens=[128], modes=["fwd"], dtypes=["bfloat16", "float16"],
                      head_dims=[128, 64], dropouts=[0.0, 0.1], providers=list(PROVIDERS),
                      tokens=1024, hidden=256, quadratic_max_seq=8192)
    tasks = plan_tasks(cfg)
    assert tasks[0] == (("bfloat16", 128, 0.0), list(PROVIDERS))
    ranks = [sum(a != b for a, b in zip(c, ("bfloat16", 128, 0.0))) for c, p in tasks
             if "kernels" in p]
    assert ranks == sorted(ranks)
    compiled = [i for i, (_, p) in enumerate(tasks) if p == ["reference_compiled", "flex"]]
    assert compiled and min(compiled) > max(i for i, (_, p) in enumerate(tasks) if "kernels" in p)


def test_speedup_and_table():
    """Speed-up over the fastest ok SDPA backend, and a table that shows every status."""
    base = dict(bench="attention", mode="fwd", dtype="bfloat16", causal=True, dropout_p=0.0,
                batch=1, heads=2, seq_len=128, head_dim=64, ms_p20=None, ms_p80=None,
                peak_mem_bytes=None, first_call_s=None, best_sdpa_ms_over_ours=None,
                best_sdpa=None)
    rows = [dict(base, provider="kernels", ms=1.0, tflops=5.0, status="ok"),
            dict(base, provider="sdpa_flash", ms=1.5, tflops=3.3, status="ok"),
            dict(base, provider="sdpa_math", ms=3.0, tflops=1.7, status="ok"),
            dict(base, provider="sdpa_cudnn", ms=None, tflops=None,
                 status="unsupported: cuDNN missing"),
            dict(base, provider="reference", ms=None, tflops=None, status="oom")]
    add_speedups(rows)
    assert rows[0]["best_sdpa_ms_over_ours"] == 1.5 and rows[0]["best_sdpa"] == "sdpa_flash"
    assert rows[0]["best_sdpa_noise"] is None   # no percentiles: no spread to judge
    text = format_tables(rows)
    assert "1.5x (flash)" in text and "oom" in text and "n/a" in text


def _point(**providers):
    """Rows of one sweep point: ``name=(ms, p20, p80, runs)`` per provider."""
    base = dict(bench="attention", mode="fwd", dtype="float32", causal=True, dropout_p=0.0,
                batch=1, heads=2, seq_len=128, head_dim=64, tflops=1.0, peak_mem_bytes=None,
                first_call_s=None, status="ok")
    return [dict(base, provider=name, ms=ms, ms_p20=p20, ms_p80=p80, runs=runs)
            for name, (ms, p20, p80, runs) in providers.items()]


def test_same_code_is_not_compared_and_noise_is_marked():
    """A point where ours ran the op SDPA's flash ran: that pair is marked and left out, the
    speed-up is against the next backend; its range comes from the p20s / p80s, and NOISE marks
    a range holding 1 (and only such a range)."""
    flash, math_op = "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::math"
    rows = _point(kernels=(1.0, 0.9, 1.1, flash), sdpa_flash=(0.5, 0.45, 0.55, flash),
                  sdpa_math=(1.05, 0.95, 1.2, math_op), reference=(3.0, 2.9, 3.1, "eager"))
    add_speedups(rows)
    ours = rows[0]
    assert ours["same_code_as"] == ["sdpa_flash"] and rows[1]["same_code_as"] == ["kernels"]
    assert rows[3].get("same_code_as") is None   # no PyTorch attention op: nothing to match
    assert ours["best_sdpa"] == "sdpa_math" and math.isclose(ours["best_sdpa_ms_over_ours"], 1.05)
    assert math.isclose(ours["best_sdpa_ratio_low"], 0.95 / 1.1)
    assert math.isclose(ours["best_sdpa_ratio_high"], 1.2 / 0.9)
    assert ours["best_sdpa_noise"] is True
    text = format_tables(rows)
    assert "1.05x (math) [0.864-1.33] NOISE; same op as flash, not compared" in text
    assert f"runs: kernels = {flash}" in text and "runs: ref = eager" in text
    # Apart: no NOISE. Ours' own code: nothing left out, the fastest backend counts.
    rows = _point(kernels=(1.0, 0.9, 1.1, "own"), sdpa_flash=(2.0, 1.9, 2.1, flash),
                  sdpa_math=(3.0, 2.8, 3.2, math_op))
    add_speedups(rows)
    assert rows[0]["best_sdpa"] == "sdpa_flash" and rows[0]["best_sdpa_noise"] is False
    # One timed run has no spread: no range, no verdict, and the table says so.
    single = [dict(r, timed_runs=1 if r["provider"] == "sdpa_flash" else 5) for r in rows]
    add_speedups(single)
    assert single[0]["best_sdpa_ratio_low"] is None and single[0]["best_sdpa_noise"] is None
    assert "  2x (flash) [no spread]" in format_tables(single)
    assert not rows[0].get("same_code_as")
    [line] = [x for x in format_tables(rows).splitlines() if x.lstrip().startswith("128 ")]
    assert line.endswith("  2x (flash) [1.73-2.33]"), line


@pytest.mark.parametrize("num, den, noise", [
    ((1.0, 0.9, 1.1), (1.05, 1.0, 1.2), True),    # overlapping ranges
    ((2.0, 1.9, 2.2), (1.0, 0.9, 1.1), False),    # apart
    ((1.0, 1.0, 1.0), (1.0, 1.0, 1.0), True),     # identical
])
def test_ratio_spread(num, den, noise):
    from benchmarks.measure import ratio_spread

    def row(t):
        return dict(ms=t[0], ms_p20=t[1], ms_p80=t[2])
    ratio, low, high, got = ratio_spread(row(num), row(den))
    assert low <= ratio <= high and got is noise
    assert math.isclose(low, num[1] / den[2]) and math.isclose(high, num[2] / den[1])


def test_module_table_names_classes_and_gives_book_over_fused():
    """The module rows' table: each row named by its class, "book / fused" on the book's rows
    (from the medians, with its range and NOISE mark), none on ours."""
    from benchmarks.modules import add_book_ratios, _label

    base = dict(bench="module", mode="fwd", dtype="float32", dropout_p=0.0, batch=2,
                seq_len=512, emb_dim=256, tflops=1.0, peak_mem_bytes=None, status="ok")
    rows = [_label(dict(base, provider="module_reference", ms=3.0, ms_p20=2.9, ms_p80=3.2,
                        runs=None), cpu=True),
            _label(dict(base, provider="module_kernels", ms=2.0, ms_p20=1.9, ms_p80=2.1,
                        runs="aten::x"), cpu=True),
            _label(dict(base, provider="module_reference_wrapper", ms=2.05, ms_p20=1.8,
                        ms_p80=2.3, runs=None), cpu=True)]
    add_book_ratios(rows)
    assert rows[0]["book_over_fused"] == 1.5 and rows[0]["book_over_fused_noise"] is False
    assert rows[2]["book_over_fused_noise"] is True and "book_over_fused" not in rows[1]
    assert rows[0]["runs"].startswith("the book's code") and rows[1]["runs"] == "aten::x"
    text = format_tables(rows)
    assert "book / fused" in text and "module_" not in text
    lines = {line.split("  ")[0]: line for line in text.splitlines()}
    assert "1.5x [1.38-1.68]" in lines["MultiHeadAttention (book)"]
    assert "NOISE" in lines["MultiHeadAttentionWrapper (book)"]
    assert "x [" not in lines["FusedMultiHeadAttention (ours)"]


def test_time_budget_cuts_rows_not_started():
    """A deadline already past: no row is measured, each one that could run says
    'skipped: time budget' (the others keep their static reason), and every row is written."""
    cfg = SweepConfig(device="cpu", seq_lens=[32, 64], modes=["fwd", "fwd_bwd"],
                      dtypes=["bfloat16"], head_dims=[32], dropouts=[0.0, 0.1],
                      providers=list(PROVIDERS), tokens=64, hidden=64, quadratic_max_seq=1 << 30,
                      deadline=float("-inf"))
    rows = run_sweep(cfg, lambda name: getattr(torch, name))
    assert len(rows) == 2 * 2 * 2 * len(PROVIDERS)
    assert all(r["ms"] is None for r in rows)
    budget = [r for r in rows if r["status"] == "skipped: time budget"]
    assert {r["provider"] for r in budget} >= {"kernels", "reference", "sdpa_math"}
    assert all(r["status"] == "skipped: time budget" or r["status"].startswith(
        ("unsupported: ", "skipped: torch.compile")) for r in rows), {r["status"] for r in rows}


def _row(provider, seq_len, tflops_value, dropout_p=0.0, status="ok"):
    return dict(bench="attention", provider=provider, mode="fwd", dtype="bfloat16",
                head_dim=64, dropout_p=dropout_p, seq_len=seq_len, status=status,
                tflops=tflops_value if status == "ok" else None, peak_mem_bytes=None)


def _plot_rows():
    """Two configs; the dropout one has a single ok point and a row skipped at seq 128."""
    rows = [_row(p, s, t) for p, t in (("kernels", 1e-5), ("sdpa_math", 1e-2))
            for s in (32, 64, 128)]
    return rows + [_row("kernels", 32, 1e-5, dropout_p=0.1),
                   _row("kernels", 128, None, dropout_p=0.1, status="skipped: time budget")]


def test_plot_scale_and_x_range_rules():
    """Log y-axis when a panel's values span decades; one x-range taken from all rows (also
    skipped ones)."""
    assert y_scale([1e-5, 1e-5, 2e-2]) == "log"  # CPU: interpreted kernel vs PyTorch
    assert y_scale([100.0, 250.0, 300.0]) == "linear"
    assert y_scale([0.5]) == "linear" and y_scale([]) == "linear"
    assert y_scale([None, 0.0, 1.0, 29.0]) == "linear"
    seqs, (lo, hi) = x_range(_plot_rows())
    assert seqs == [32, 64, 128] and lo < 32 and hi > 128


def test_plot_panels_share_x_range():
    """In the figure: the spread panel is log-scaled, and the dropout panel (one point) spans
    the same x-range, ticked at the swept seq_lens, as the full one."""
    rows = _plot_rows()
    seqs, (lo, hi) = x_range(rows)
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plots import tflops_figure

    fig = tflops_figure(rows, "fwd")
    try:
        axes = [ax for ax in fig.axes if ax.get_title()]
        assert len(axes) == 2
        assert axes[0].get_yscale() == "log"  # 1e-5 next to 1e-2
        assert axes[0].get_xlim() == axes[1].get_xlim() == pytest.approx((lo, hi))
        assert list(axes[1].get_xticks()) == [32, 64, 128]
    finally:
        plt.close(fig)


def test_cpu_outputs_are_gitignored():
    """Every file a default CPU run writes into benchmarks/results/ is ignored by git (else the
    next run records `commit: ...-dirty` without any source change); GPU results are not."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    modes = ["fwd", "bwd", "fwd_bwd"]

    def ignored(name):
        rc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q",
                             f"benchmarks/results/{name}"]).returncode
        assert rc in (0, 1), f"git check-ignore failed ({rc})"
        return rc == 0

    for stem in (results_stem("cpu"), "2026-11-22-cpu"):
        names = [stem + ".json", stem + ".csv"] + plot_filenames(stem, modes, memory=True)
        assert all(ignored(n) for n in names), [n for n in names if not ignored(n)]
    gpu = "2026-11-22-nvidia-h100-80gb-hbm3"
    names = [gpu + ".json", gpu + ".csv"] + plot_filenames(gpu, modes, memory=True)
    assert not any(ignored(n) for n in names), [n for n in names if ignored(n)]


@pytest.mark.parametrize("argv, flag", [
    (["--seq-lens", "0"], "--seq-lens"),               # was a ZeroDivisionError deep in the run
    (["--seq-lens", "128", "-5"], "--seq-lens"),
    (["--head-dims", "0"], "--head-dims"),
    (["--tokens", "-1"], "--tokens"),
    (["--dropout", "1.0"], "--dropout"),
    (["--dropout", "-0.1"], "--dropout"),
    (["--cpu-reps", "0"], "--cpu-reps"),
    (["--cpu-threads", "-1"], "--cpu-threads"),
    (["--time-budget", "nan"], "--time-budget"),
    (["--warmup-ms", "0"], "--warmup-ms"),
    (["--providers", "nope"], "--providers"),
    (["--dtypes", "int8"], "--dtypes"),
])
def test_cli_rejects_bad_values(argv, flag, capsys):
    """Every bad value is one line on stderr naming its flag, exit status 2, before anything
    runs (argparse's ``type=`` checks; the parser prints no usage block)."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"argument {flag}" in err and "error" in err


def test_cli_help_shows_defaults_and_no_issue_numbers():
    """``--help``: defaults shown (fixed ones by argparse, per-device ones in the help text),
    options in groups of a screen or less, no issue numbers."""
    text = build_parser().format_help()
    assert "(default: 10.0)" in text and "default: GPU 128 256" in text
    assert "issue" not in text.lower()
    groups = text.split("\n\n")
    assert max(len(g.splitlines()) for g in groups) <= 45
    # Every option with a value says its default (fixed, or per device in its help).
    parser = build_parser()
    formatter = parser.formatter_class(parser.prog)
    for action in parser._actions:
        if action.nargs != 0 and action.option_strings:
            assert "default" in formatter._get_help_string(action), action.option_strings
    # Good values still parse.
    args = build_parser().parse_args(["--seq-lens", "64", "--dropout", "0", "0.5",
                                      "--time-budget", "0", "--cpu-threads", "0"])
    assert args.seq_lens == [64] and args.dropout == [0.0, 0.5] and args.time_budget == 0.0


def test_cpu_module_ratio_rows(tmp_path):
    """`python -m benchmarks modules` (the README's CPU table): one row per (size, dropout,
    mode) with both medians, the ratio computed from them, versions and commit in the JSON and
    CSV (no assertion on speed)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "benchmarks", "modules", "--sizes", "2x16x64", "1x8x128",
           "--reps", "2", "--max-s", "5", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [json_path] = list(tmp_path.glob("*-modules-cpu.json"))
    data = json.loads(json_path.read_text())
    assert {"torch", "triton", "commit", "loadavg_before"} <= set(data["meta"])
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2
    assert {(r["batch"], r["seq_len"], r["emb_dim"]) for r in rows} == {(2, 16, 64), (1, 8, 128)}
    for r in rows:
        assert r["heads"] == r["emb_dim"] // 64 and r["reps"] >= 1
        assert math.isclose(r["speedup"], r["book_ms"] / r["fused_ms"], rel_tol=1e-2)
        # The range: p20-p80 of the per-round ratios; NOISE exactly when it holds 1.
        assert 0 < r["speedup_low"] <= r["speedup_high"]
        assert r["noise"] is (r["speedup_low"] <= 1 <= r["speedup_high"])
        # At dropout 0 the fused module's core is PyTorch's CPU flash op; with dropout ours.
        assert (r["fused_runs"] == "aten::_scaled_dot_product_flash_attention_for_cpu") is (
            r["dropout_p"] == 0), r
    assert "book / fused" in proc.stdout and "reference.MultiHeadAttention" in proc.stdout
    assert (" NOISE" in proc.stdout) is any(r["noise"] for r in rows)
    with open(json_path.with_suffix(".csv")) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    bad = subprocess.run([sys.executable, "-m", "benchmarks", "modules", "--sizes", "8x0x128"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--sizes" in bad.stderr
