"""Smoke tests of the benchmark command (``python -m benchmarks``) and its FLOP count.

The CLI test runs the CPU path (kernel in Triton's interpreter) at --quick sizes in a
subprocess with CUDA hidden, so it checks the same thing on every machine; a GPU-marked test
runs a one-point CUDA sweep. No test depends on how fast the machine is: the CLI runs get no
time budget (``--time-budget 0``), and the budget's cut-off is tested with a deadline already
past.
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

from benchmarks.flops import attention_flops, gpt_step_flops, mha_flops, tflops
from benchmarks.parity import parity_ok
from benchmarks.plots import plot_filenames, x_range, y_scale
from benchmarks.providers import PROVIDERS
from benchmarks.report import format_tables, results_stem
from benchmarks.sweep import ROW_KEYS, SweepConfig, add_speedups, plan_tasks, run_sweep

REPO = Path(__file__).resolve().parents[1]
META_KEYS = {"device", "torch", "triton", "cuda", "commit", "date", "timing", "peak_mem", "flops",
             "args", "complete"}
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


def _interpreter_unusable():
    """Why Triton's CPU interpreter cannot run here, or None. Triton <= 3.6's interpreter
    converts 1-element arrays with int(), which NumPy >= 2.4 rejects (TypeError; fixed upstream,
    triton-lang/triton#9171): e.g. a GPU host with triton 3.6 and numpy 2.5."""
    import inspect

    import numpy
    import triton

    try:
        from triton.runtime import interpreter
        src = inspect.getsource(interpreter._patch_lang_tensor)
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    if (tuple(int(x) for x in numpy.__version__.split(".")[:2] if x.isdigit()) >= (2, 4)
            and "int(self.handle.data)" in src):
        return (f"Triton {triton.__version__}'s interpreter breaks with NumPy "
                f"{numpy.__version__} (triton-lang/triton#9171)")
    return None


def test_cli_quick_cpu(tmp_path):
    """`python -m benchmarks --quick` on CPU: parity, module rows, sweep, JSON + CSV schema.
    Run without a time budget: every row is run, whatever the machine's load."""
    reason = _interpreter_unusable()
    if reason:
        pytest.skip(reason)
    proc, data, csv_path = _run_cli(tmp_path, "--quick")
    meta, rows = _check_schema(data, csv_path)
    assert meta["device"] == "cpu" and meta["interpreter"] is True
    assert meta["args"]["time_budget"] == 0
    assert not [r for r in rows if r["status"] == "skipped: time budget"]
    assert "TIME BUDGET" not in proc.stdout
    assert "nothing about GPU speed" in proc.stdout
    assert all(p["ok"] for p in meta["parity"])
    attn = [r for r in rows if r["bench"] == "attention"]
    assert {r["provider"] for r in attn} == set(PROVIDERS)
    assert {r["mode"] for r in attn} == MODES
    ours = [r for r in attn if r["provider"] == "kernels"]
    assert ours and all(r["status"] == "ok" for r in ours)
    assert all(r["peak_mem_bytes"] is None for r in rows)  # not measured on CPU
    flex = [r for r in attn if r["provider"] == "flex" and r["dropout_p"] > 0]
    assert flex and all(r["status"] == "unsupported: FlexAttention has no dropout" for r in flex)
    # TFLOP/s is the one FLOP function over the measured median.
    r = ours[0]
    expect = tflops(attention_flops(r["batch"], r["heads"], r["seq_len"], r["seq_len"],
                                    r["head_dim"], causal=True, mode=r["mode"]), r["ms"])
    assert math.isclose(r["tflops"], expect, rel_tol=1e-9)
    benches = {(r["bench"], r["provider"]) for r in rows}
    assert {("module", "module_reference"), ("module", "module_kernels"),
            ("gpt_step", "gpt_step_reference"), ("gpt_step", "gpt_step_kernels")} <= benches
    gpt = [r for r in rows if r["provider"] == "gpt_step_kernels"][0]
    assert gpt["status"] == "ok" and gpt["fused_modules"] >= 1


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
    assert all(r["speedup_vs_best_sdpa"] > 0 for r in rows if r["provider"] == "kernels")


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
                peak_mem_bytes=None, first_call_s=None, speedup_vs_best_sdpa=None,
                best_sdpa=None)
    rows = [dict(base, provider="kernels", ms=1.0, tflops=5.0, status="ok"),
            dict(base, provider="sdpa_flash", ms=1.5, tflops=3.3, status="ok"),
            dict(base, provider="sdpa_math", ms=3.0, tflops=1.7, status="ok"),
            dict(base, provider="sdpa_cudnn", ms=None, tflops=None,
                 status="unsupported: cuDNN missing"),
            dict(base, provider="reference", ms=None, tflops=None, status="oom")]
    add_speedups(rows)
    assert rows[0]["speedup_vs_best_sdpa"] == 1.5 and rows[0]["best_sdpa"] == "sdpa_flash"
    text = format_tables(rows)
    assert "1.5x (flash)" in text and "oom" in text and "n/a" in text


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
