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


def run_probe(provider, modes, seq, threads, reps, max_s, what, timeout=HANG_GUARD_S,
              shape=None, dropout=0.0):
    """One fresh process for ``provider``; {mode: its JSON result, or {"error": text}}."""
    shape = shape or SHAPE
    cmd = [sys.executable, PROBE, "--provider", provider, "--modes", *modes, "--what", what,
           "--seq", str(seq),
           "--batch", str(shape["batch"]), "--heads", str(shape["heads"]),
           "--head-dim", str(shape["head_dim"]), "--threads", str(threads), "--reps", str(reps),
           "--max-s", str(max_s), "--dropout", str(dropout)]
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


# --------------------------------------------------------------------------------------------
# Dropout (issue 22, item B): ``--fallback-dropout``
# --------------------------------------------------------------------------------------------
DROPOUT_SHAPE = dict(batch=1, heads=8, head_dim=64)
DROPOUT_P = 0.1
DROPOUT_SEQS = (1024, 4096, 8192)
DROPOUT_THREADS = (1, 2)
DROPOUT_REPS = 5
DROPOUT_PROVIDERS = ("kernels_fallback", "sdpa")
DROPOUT_TIME_TARGET = 1.2
SPREAD_TARGET = 1.5
MEM_FIXED = 64 * 2**20
MEM_PER_Q = 6  # output + dq + dk + dv + 2 for temporaries: a bound linear in seq
DROPOUT_TARGET = (f"issue 22: time_vs_sdpa <= {DROPOUT_TIME_TARGET} (SDPA with dropout_p="
                  f"{DROPOUT_P}), run_spread (max/min of the timed runs) < {SPREAD_TARGET}, "
                  f"peak_mem_bytes <= mem_bound_bytes (64 MiB + {MEM_PER_Q} x the bytes of q: "
                  "O(seq))")
# Without dropout (the same shape, seq 8192): peak extra memory <= max(64 MiB, 4x SDPA's).
MEMORY_SEQ = 8192
MEMORY_PROVIDERS = ("kernels_fallback", "kernels_fallback_blockwise", "sdpa")
MEMORY_TARGET = "issue 22: peak_mem_bytes <= max(64 MiB, 4 x SDPA's) (mem_bound_bytes)"


def _probe_row(bench, provider, seq, threads, reps, max_s, shape, dropout, progress):
    """One fwd_bwd row of ``provider`` from a time probe and a memory probe."""
    import torch

    case = Case(batch=shape["batch"], heads=shape["heads"], seq_len=seq,
                head_dim=shape["head_dim"], dtype=torch.float32, dropout_p=dropout,
                device="cpu")
    if progress:
        progress(None, None, f"{bench} {provider} seq {seq} threads {threads} (subprocess)")
    timed = run_probe(provider, ["fwd_bwd"], seq, threads, reps, max_s, "time", shape=shape,
                      dropout=dropout)["fwd_bwd"]
    res = dict(timed)
    if "error" not in res:
        res.update(run_probe(provider, ["fwd_bwd"], seq, threads, reps, max_s, "memory",
                             shape=shape, dropout=dropout)["fwd_bwd"])
    row = new_row(provider, "fwd_bwd", case, bench=bench)
    row.update(peak_mem_method=res.get("peak_mem_method"), threads=res.get("threads"),
               fallback_path=res.get("fallback_path"), warmup_seq=res.get("warmup_seq"),
               reps=None, ms_min=None, ms_max=None, run_spread=None)
    if "error" in res:
        row["status"] = f"error: {res['error']}"[:240]
        return row
    samples = res["ms"]
    ms, p20, p80 = _quantiles(samples)
    row.update(ms=ms, ms_p20=p20, ms_p80=p80, first_call_s=res["first_call_s"],
               peak_mem_bytes=int(res["peak_extra_bytes"]), status="ok", reps=len(samples),
               ms_min=min(samples), ms_max=max(samples),
               run_spread=max(samples) / min(samples),
               tflops=tflops(attention_flops(case.batch, case.heads, seq, seq, case.head_dim,
                                             mode="fwd_bwd"), ms))
    return row


def fallback_dropout_rows(seqs=DROPOUT_SEQS, threads=DROPOUT_THREADS, reps=DROPOUT_REPS,
                          memory_seq=MEMORY_SEQ, progress=None):
    """Issue 22's rows (never raises for a failing probe):

    * ``bench="fallback_dropout"``: forward + backward with dropout 0.1, batch 1, 8 heads,
      head_dim 64, fp32, causal, at each of ``seqs`` and PyTorch thread counts ``threads``:
      ``kernels_fallback`` (``kernels.attention(..., dropout_p=0.1)``, the blockwise path with
      the kernels' Philox mask) vs ``sdpa`` (``F.scaled_dot_product_attention(...,
      dropout_p=0.1)``). A first call, then ``reps`` timed calls (all of them: no time cap):
      ``ms`` = their median, ``run_spread`` = slowest / fastest. Ours: ``time_vs_sdpa``,
      ``mem_bound_bytes``, ``target``, ``target_met`` (DROPOUT_TARGET).
    * ``bench="fallback_memory"``: the same shape without dropout at seq ``memory_seq``, one
      timed call: both fallback paths and SDPA; ours: ``mem_bound_bytes`` = max(64 MiB, 4 x
      SDPA's peak) and ``target_met`` (MEMORY_TARGET).
    """
    rows = []
    for n_threads in threads:
        for seq in seqs:
            point = [_probe_row("fallback_dropout", provider, seq, n_threads, reps, 3600.0,
                                DROPOUT_SHAPE, DROPOUT_P, progress)
                     for provider in DROPOUT_PROVIDERS]
            rows += compare_dropout(point)
    if memory_seq:
        point = [_probe_row("fallback_memory", provider, memory_seq, threads[0], 1, 0.0,
                            DROPOUT_SHAPE, 0.0, progress) for provider in MEMORY_PROVIDERS]
        rows += compare_memory(point)
    return rows


def compare_dropout(rows):
    """``time_vs_sdpa``, ``mem_bound_bytes``, ``target`` and ``target_met`` on the ours rows
    of one (seq, threads) point of ``bench="fallback_dropout"``."""
    sdpa = next((r for r in rows if r["provider"] == "sdpa" and r["status"] == "ok"), None)
    for r in rows:
        if r["provider"] == "sdpa":
            continue
        q_bytes = r["batch"] * r["heads"] * r["seq_len"] * r["head_dim"] * 4
        r.update(target=DROPOUT_TARGET, mem_bound_bytes=MEM_FIXED + MEM_PER_Q * q_bytes,
                 time_vs_sdpa=None, target_met=None)
        if r["status"] != "ok" or sdpa is None:
            continue
        r["time_vs_sdpa"] = r["ms"] / sdpa["ms"]
        r["target_met"] = (r["time_vs_sdpa"] <= DROPOUT_TIME_TARGET
                           and r["run_spread"] < SPREAD_TARGET
                           and r["peak_mem_bytes"] <= r["mem_bound_bytes"])
    return rows


def compare_memory(rows):
    """``mem_bound_bytes``, ``target``, ``target_met`` on the ours rows of
    ``bench="fallback_memory"``."""
    sdpa = next((r for r in rows if r["provider"] == "sdpa" and r["status"] == "ok"), None)
    for r in rows:
        if r["provider"] == "sdpa":
            continue
        r.update(target=MEMORY_TARGET, mem_bound_bytes=None, target_met=None)
        if r["status"] == "ok" and sdpa is not None:
            r["mem_bound_bytes"] = max(MEM_FIXED, 4 * sdpa["peak_mem_bytes"])
            r["target_met"] = r["peak_mem_bytes"] <= r["mem_bound_bytes"]
    return rows
