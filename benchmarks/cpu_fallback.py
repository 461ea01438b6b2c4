"""The CPU fallback row (issue 15), opt-in with ``--fallback-row``: ``kernels.attention`` on CPU
tensors with Triton's interpreter off (the PyTorch fallback, kernels/core/fallback.py) against
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, batch 1, 2 heads,
head_dim 64, fp32, seq 16384 (``--fallback-seq``), fwd and fwd_bwd: time and peak extra memory.

Each provider runs in two fresh processes (benchmarks/cpu_fallback_probe.py, its protocol is
there), both with TRITON_INTERPRET unset and PyTorch on ``--cpu-threads`` threads: one times
it (first call, then up to ``--cpu-reps`` calls within 15 s), one measures its peak memory
with ``MALLOC_MMAP_THRESHOLD_=65536`` (which would slow the blockwise path ~2x if timed).
Rows: ``bench="fallback"``, providers

* ``kernels_fallback``: ``kernels.attention(q, k, v)``; at these inputs the fallback hands the
  work to PyTorch's CPU flash attention ops (``fallback_path: "sdpa"``);
* ``kernels_fallback_blockwise``: ``kernels.attention(..., window=seq)``, the same function
  through the fallback's blockwise path (``fallback_path: "blockwise"``), the one dropout,
  windows, q_len != k_len causal and packed sequences take;
* ``sdpa``: PyTorch's SDPA with its default CPU backend choice.

``peak_mem_bytes`` = peak resident memory above the inputs (output, gradients and temporaries
included), ``peak_mem_method`` says how it was read. On the kernels_fallback* rows:
``time_vs_sdpa`` = ms / SDPA's ms, ``target`` and ``target_met`` (issue 15: peak extra
<= 64 MiB and time within 3x of SDPA's; CPU targets, so judged on any machine).
"""
import json
import os
import subprocess
import sys

from .flops import attention_flops, tflops
from .providers import Case
from .sweep import new_row
from .timing import _quantiles

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_fallback_probe.py")
PROVIDERS = ("kernels_fallback", "kernels_fallback_blockwise", "sdpa")
MODES = ("fwd", "fwd_bwd")
SHAPE = dict(batch=1, heads=2, head_dim=64)
PEAK_TARGET_BYTES = 64 * 2**20
TIME_TARGET = 3.0
TARGET = ("issue 15: peak extra memory <= 64 MiB and time within 3x of SDPA's "
          "(peak_mem_bytes <= 67108864 and time_vs_sdpa <= 3)")
HANG_GUARD_S = 1800


def probe_env(what):
    """The child's environment: TRITON_INTERPRET unset (the fallback runs only then), CUDA
    hidden, the repository importable; for ``what="memory"`` glibc returning freed blocks to
    the OS (MALLOC_MMAP_THRESHOLD_), for ``"time"`` glibc's defaults."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "MALLOC_MMAP_THRESHOLD_")}
    repo = os.path.dirname(os.path.dirname(PROBE))
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               PYTHONPATH=repo + os.pathsep + env.get("PYTHONPATH", ""))
    if what == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    return env


def run_probe(provider, modes, seq, threads, reps, max_s, what, timeout=HANG_GUARD_S):
    """One fresh process for ``provider``; {mode: its JSON result, or {"error": text}}."""
    cmd = [sys.executable, PROBE, "--provider", provider, "--modes", *modes, "--what", what,
           "--seq", str(seq),
           "--batch", str(SHAPE["batch"]), "--heads", str(SHAPE["heads"]),
           "--head-dim", str(SHAPE["head_dim"]), "--threads", str(threads), "--reps", str(reps),
           "--max-s", str(max_s)]
    try:
        proc = subprocess.run(cmd, env=probe_env(what), capture_output=True, text=True,
                              timeout=timeout)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, rc = exc.stdout or "", f"probe ran over {timeout} s", None
        out = out.decode() if isinstance(out, bytes) else out
    results = {}
    for line in out.splitlines():
        if line.startswith("{"):
            res = json.loads(line)
            if "error" in res:
                return {m: res for m in modes}
            results[res["mode"]] = res
    tail = " ".join((err or out).split())[-200:]
    for m in modes:
        results.setdefault(m, {"error": f"probe exit {rc}: {tail}"})
    return results


def fallback_rows(seq=16384, threads=1, reps=3, max_s=15.0, progress=None):
    """The rows described in the module docstring (never raises for a failing probe)."""
    import torch

    case = Case(batch=SHAPE["batch"], heads=SHAPE["heads"], seq_len=seq,
                head_dim=SHAPE["head_dim"], dtype=torch.float32, dropout_p=0.0, device="cpu")
    rows = []
    for provider in PROVIDERS:
        if progress:
            progress(None, None, f"fallback {provider} seq {seq} (subprocess)")
        timed = run_probe(provider, MODES, seq, threads, reps, max_s, "time")
        memory = run_probe(provider, MODES, seq, threads, reps, max_s, "memory")
        for mode in MODES:
            res = dict(timed[mode])
            if "error" not in res:
                res.update(memory[mode])
            row = new_row(provider, mode, case, bench="fallback")
            row.update(peak_mem_method=res.get("peak_mem_method"), threads=res.get("threads"),
                       fallback_path=res.get("fallback_path"), warmup_seq=res.get("warmup_seq"))
            if "error" in res:
                row["status"] = f"error: {res['error']}"[:240]
            else:
                ms, p20, p80 = _quantiles(res["ms"])
                row.update(ms=ms, ms_p20=p20, ms_p80=p80, first_call_s=res["first_call_s"],
                           peak_mem_bytes=int(res["peak_extra_bytes"]), status="ok",
                           tflops=tflops(attention_flops(case.batch, case.heads, seq, seq,
                                                         case.head_dim, mode=mode), ms))
            rows.append(row)
    compare(rows)
    return rows


def compare(rows):
    """``time_vs_sdpa``, ``target`` and ``target_met`` on the kernels_fallback* rows."""
    sdpa = {r["mode"]: r for r in rows if r["provider"] == "sdpa" and r["status"] == "ok"}
    for r in rows:
        if not r["provider"].startswith("kernels_fallback"):
            continue
        r["target"] = TARGET
        ref = sdpa.get(r["mode"])
        if r["status"] != "ok" or ref is None:
            r["time_vs_sdpa"], r["target_met"] = None, None
            continue
        r["time_vs_sdpa"] = r["ms"] / ref["ms"]
        r["target_met"] = (r["peak_mem_bytes"] <= PEAK_TARGET_BYTES
                           and r["time_vs_sdpa"] <= TIME_TARGET)
    return rows
