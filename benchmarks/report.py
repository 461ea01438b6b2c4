"""Results files (JSON, CSV), the terminal table and the run's metadata.

JSON: ``{"meta": {...}, "rows": [...]}``. ``meta`` always has device, torch, triton, cuda,
commit, date, plus how things were measured (timing, peak_mem, flops) and the run's arguments.
Every row has the keys of ``sweep.ROW_KEYS``; module rows add the extras in ``modules.py``,
feature rows those in ``features.py`` (every column: docs/performance.md).
CSV: one line per row, columns = the union of the rows' keys (extras empty where absent, lists
such as ``seqlens`` as JSON text).
"""
import csv
import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys

import torch

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# benchmarks/results/ of the checkout the command runs from.
DEFAULT_OUT = os.path.join(REPO_DIR, "benchmarks", "results")
# Columns every CSV line carries, so that a CSV read alone says where it was measured.
META_COLUMNS = ("device", "torch", "triton", "cuda", "commit", "date")

SHORT_NAMES = {"kernels": "kernels", "reference": "ref", "reference_compiled": "ref_comp",
               "sdpa_math": "math", "sdpa_efficient": "effic", "sdpa_flash": "flash",
               "sdpa_cudnn": "cudnn", "flex": "flex"}


def device_name(device) -> str:
    """GPU name (e.g. "NVIDIA H100 80GB HBM3") or "cpu"."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def git_commit(repo_dir) -> str:
    """Short commit hash of the checkout (``-dirty`` when it has changes), or "unknown"."""
    try:
        sha = subprocess.run(["git", "-C", repo_dir, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", repo_dir, "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def collect_meta(device, args_dict, repo_dir, interpreter=None):
    """The ``meta`` block: versions, device, date, and how things were measured. ``interpreter``
    (CPU): whether Triton's interpreter rows were asked for (default: TRITON_INTERPRET=1)."""
    import triton

    cuda = torch.device(device).type == "cuda"
    if interpreter is None:
        interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    meta = {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(repo_dir),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "interpreter": bool(interpreter) and not cuda,
        # How each column was measured and counted: docs/performance.md ("Columns").
        "timing": ("CUDA events (triton.testing.do_bench), L2 flushed before each call" if cuda
                   else "wall clock; kernels = the PyTorch fallback, except rows with backend "
                        "triton_interpreter"),
        "args": args_dict,
    }
    if cuda:
        props = torch.cuda.get_device_properties(torch.device(device))
        meta["sm_count"] = props.multi_processor_count
        meta["gpu_memory_bytes"] = props.total_memory
    else:
        meta["note"] = ("CPU run: kernels = its PyTorch fallback for CPU tensors (what a CPU user "
                        "runs), against SDPA and the reference in PyTorch"
                        + ("; rows with backend triton_interpreter run our Triton kernel in "
                           "Triton's interpreter (correctness, not speed)" if interpreter
                           else "; our Triton kernel is not run (--interpreter runs it in "
                                "Triton's interpreter)")
                        + ". These figures say nothing about GPU speed.")
    return meta


def results_stem(device, date=None) -> str:
    """``<YYYY-MM-DD>-<gpu-or-cpu>``, e.g. ``2026-11-22-nvidia-h100-80gb-hbm3``."""
    date = date or _dt.date.today().isoformat()
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-") or "cpu"
    return f"{date}-{slug}"


def _jsonable(value):
    if isinstance(value, float) and value != value:  # NaN -> null
        return None
    return value


def write_json(path, meta, rows):
    """Write ``{"meta": meta, "rows": rows}`` atomically (a partial run leaves a valid file)."""
    data = {"meta": meta, "rows": [{k: _jsonable(v) for k, v in r.items()} for r in rows]}
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _csv_cell(value):
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return value


def write_csv(path, rows):
    """Write rows as CSV, columns = union of the rows' keys in first-seen order."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    tmp = f"{path}.tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_cell(r.get(k)) for k in fields})
    os.replace(tmp, path)


def write_results(stem, meta, rows):
    """The one writer of every command: ``<stem>.json`` (meta and rows) and ``<stem>.csv`` (the
    rows, each with the meta's device and versions); returns the two paths."""
    write_json(stem + ".json", meta, rows)
    write_csv(stem + ".csv", [dict(r, **{k: meta.get(k) for k in META_COLUMNS}) for r in rows])
    return [stem + ".json", stem + ".csv"]


def _cell(row, metric):
    """A table cell: ``metric``'s value (``"mem"``: peak_mem_bytes in MiB) or the status."""
    status = row["status"]
    if status == "ok" and metric == "mem":
        value = row["peak_mem_bytes"]
        return "?" if value is None else f"{value / 2**20:.1f}"
    if status == "ok":
        value = row[metric]
        if value is None:
            return "?"
        return f"{value:.1f}" if value >= 10 else f"{value:.3g}"
    if status == "oom":
        return "oom"
    if status.startswith("unsupported"):
        return "n/a"
    if status.startswith("skipped: time"):
        return "time"
    if status.startswith("skipped"):
        return "-"
    return "ERR"


def format_tables(rows, metric="tflops", memory=False):
    """Readable text tables: one per (mode, dtype, head_dim, dropout), seq_len down, providers
    across, cells = ``metric`` ("tflops" or "ms") and, with ``memory`` (the CPU run), a second
    table of peak MiB; then the module / GPT rows."""
    out = []
    attn = [r for r in rows if r["bench"] == "attention"]
    providers = list(dict.fromkeys(r["provider"] for r in attn))
    groups = list(dict.fromkeys((r["mode"], r["dtype"], r["head_dim"], r["dropout_p"])
                                for r in attn))
    unit = "TFLOP/s" if metric == "tflops" else "ms (median)"
    labels = dict.fromkeys(f"{r['provider']} = {r['label']}" for r in attn if r.get("label"))
    if labels:
        out.append("\n" + "; ".join(labels))
    for mode, dtype, hd, p in groups:
        sel = [r for r in attn if (r["mode"], r["dtype"], r["head_dim"], r["dropout_p"])
               == (mode, dtype, hd, p)]
        for what, cell_unit in [(metric, unit)] + ([("mem", "peak MiB")] if memory else []):
            out.append(f"\n{mode}  {dtype}  head_dim={hd}  dropout={p}  causal  [{cell_unit}]")
            if what != "mem":
                out += _runs_lines(sel, providers)
            head = f"{'seq':>6} {'BxH':>6} " + " ".join(f"{SHORT_NAMES.get(n, n)[:8]:>8}"
                                                         for n in providers)
            out.append(head + ("  best_sdpa_ms_over_ours [p20-p80 range]" if what != "mem"
                               else ""))
            for seq in dict.fromkeys(r["seq_len"] for r in sel):
                cells = {r["provider"]: r for r in sel if r["seq_len"] == seq}
                any_row = next(iter(cells.values()))
                line = f"{seq:>6} {str(any_row['batch']) + 'x' + str(any_row['heads']):>6} "
                line += " ".join(f"{_cell(cells[n], what) if n in cells else '':>8}"
                                 for n in providers)
                k = cells.get("kernels")
                if what != "mem" and k:
                    line += _ratio_note(k)
                out.append(line)
    out += _module_lines([r for r in rows if r["bench"] in ("module", "gpt_step")])
    short = {SHORT_NAMES[n]: n for n in providers if SHORT_NAMES.get(n, n) != n}
    if short:
        out.append("\ncolumns: " + ", ".join(f"{k} = {v}" for k, v in short.items()))
    out.append("best_sdpa_ms_over_ours = the fastest SDPA backend's ms / ours (above 1: ours is "
               "faster; the backend in brackets) among those that run other code than ours; "
               "[low-high] = its p20 / our p80 to its p80 / our p20; NOISE = the range holds 1 "
               "(the two rows' p20-p80 ranges overlap: no difference measured); no spread = a "
               "row had fewer than 3 timed runs (raise --cpu-max-s); 'same op as X, not "
               "compared' = ours ran the very op X ran (runs:), so PyTorch was timed against "
               "itself")
    out.append("cells: number = ok; oom; n/a = unsupported; '-' = skipped (quadratic limit, "
               "earlier OOM, compile provider on CPU); time = time budget ran out; ERR = error "
               "(see status in the JSON)")
    return "\n".join(out)


def _ratio_note(row):
    """The ratio column of ours' sweep row: the ratio, its range and NOISE mark, then which
    providers ran the same op (left out of the comparison)."""
    note = ""
    if row.get("best_sdpa_ms_over_ours"):
        from .measure import format_ratio

        text = format_ratio(row["best_sdpa_ms_over_ours"], row.get("best_sdpa_ratio_low"),
                            row.get("best_sdpa_ratio_high"), row.get("best_sdpa_noise"))
        ratio, _, spread = text.partition(" ")
        note = f"  {ratio} ({SHORT_NAMES.get(row['best_sdpa'], row['best_sdpa'])})" + (
            f" {spread}" if spread else "")
    same = row.get("same_code_as") or ()
    if same:
        note += ("; " if note else "  ") + "same op as " + ", ".join(
            SHORT_NAMES.get(n, n) for n in same) + ", not compared"
    return note


def _runs_lines(sel, providers):
    """``runs:`` lines of a CPU table: what each provider's rows ran (measure.attention_op or
    the provider's own ops), so that a column is read as the code it timed."""
    lines = []
    for n in providers:
        runs = list(dict.fromkeys(r["runs"] for r in sel if r["provider"] == n and r.get("runs")))
        if runs:
            lines.append(f"  runs: {SHORT_NAMES.get(n, n)} = {' / '.join(runs)}")
    return lines


def _module_lines(rows):
    """The module / GPT-step table: each row named by its class (``label``), and on the book's
    rows "book / fused" = their ms / ours' ms with its range and NOISE mark
    (modules.add_book_ratios)."""
    if not rows:
        return []
    from .measure import format_ratio

    out = [f"\n{'module / model':<36} {'mode':<10} {'dtype':<9} {'p':>4} {'shape':>12} "
           f"{'ms':>9} {'TFLOP/s':>8} {'peak MiB':>8}  {'book / fused [p20-p80 range]':<30}"
           "  status"]
    for r in rows:
        shape = f"{r['batch']}x{r['seq_len']}x{r.get('emb_dim', '')}"
        ms = f"{r['ms']:.3f}" if r["ms"] is not None else ""
        tf = f"{r['tflops']:.3g}" if r["tflops"] is not None else ""
        mem = (f"{r['peak_mem_bytes'] / 2**20:.0f}" if r["peak_mem_bytes"] is not None
               else "")
        ratio = (format_ratio(r["book_over_fused"], r.get("book_over_fused_low"),
                              r.get("book_over_fused_high"), r.get("book_over_fused_noise"))
                 if r.get("book_over_fused") else "")
        name = r.get("label") or r["provider"]
        out.append(f"{name:<36} {r['mode']:<10} {r['dtype']:<9} "
                   f"{r['dropout_p']:>4} {shape:>12} {ms:>9} {tf:>8} {mem:>8}  {ratio:<30}"
                   f"  {r['status'][:40]}")
    out.append("book / fused = the book's row's ms / ours' ms at the same mode and dropout "
               "(above 1: ours is faster); [low-high] from the two rows' p20 / p80; NOISE = the "
               "range holds 1; no spread = fewer than 3 timed runs; python -m benchmarks "
               "modules times them interleaved, at four sizes")
    return out


FEATURE_BENCHES = ("gqa", "window", "chunk", "varlen", "mla", "fp8", "mask", "hf")
# (field, format) of the comparison shown on ours' rows, per bench.
_COMPARISONS = {"gqa": ("speedup_vs_mha", "{:.3g}x MHA"), "window": ("speedup_vs_full",
                                                                     "{:.3g}x full"),
                "chunk": ("speedup_vs_full", "{:.3g}x full"),
                "varlen": ("tflops_vs_dense_each", "{:.3g}x dense"),
                "mla": ("speedup_vs_padded", "{:.3g}x padded v"),
                "fp8": ("speedup_vs_bf16", "{:.3g}x bf16"),
                "mask": ("speedup_vs_native", "{:.3g}x native window"),
                "hf": ("speedup_vs_sdpa", "{:.3g}x sdpa")}


def _feature_shape(r):
    if r["bench"] == "varlen":
        return f"{r['batch']} seqs/{r.get('total_tokens')} tok x{r['heads']} d{r['head_dim']}"
    heads = f"{r['heads']}/{r['heads_kv']}" if r.get("heads_kv") not in (None, r["heads"]) else (
        str(r["heads"]))
    if r.get("cache_len"):   # an fp8 decode row: one query against the cache
        return f"{r['batch']}x{heads} q1 k{r['cache_len']} d{r['head_dim']}"
    win = f" w{r['window']}" if r.get("window") else ""
    win += f" c{r['chunk_size']}" if r.get("chunk_size") else ""
    dv = f"/v{r['head_dim_v']}" if r.get("head_dim_v") not in (None, r["head_dim"]) else ""
    return f"{r['batch']}x{heads}x{r['seq_len']} d{r['head_dim']}{dv}{win}"


def format_features(rows):
    """The feature rows (gqa, window, chunk, varlen, mla, fp8, mask, hf), with each target."""
    sel = [r for r in rows if r["bench"] in FEATURE_BENCHES]
    if not sel:
        return ""
    out = ["\nfeatures (shape: batch x heads[/kv heads] x seq, d = head dim[/v = v's], w = "
           "window, c = chunk; varlen: sequences/tokens)",
           f"{'bench':<8} {'provider':<26} {'mode':<8} {'dtype':<9} {'shape':<28} {'ms':>10} "
           f"{'TFLOP/s':>8} {'peak MiB':>8}  compared / status"]
    for r in sel:
        ms = f"{r['ms']:.3f}" if r["ms"] is not None else ""
        tf = f"{r['tflops']:.3g}" if r["tflops"] is not None else ""
        mem = f"{r['peak_mem_bytes'] / 2**20:.1f}" if r["peak_mem_bytes"] is not None else ""
        note = r["status"] if r["status"] != "ok" else ""
        field, fmt = _COMPARISONS[r["bench"]]
        if r["status"] == "ok" and r.get(field) is not None:
            note = fmt.format(r[field])
            if r["bench"] in ("window", "chunk") and r.get("ideal_speedup"):
                note += f" (ideal {r['ideal_speedup']:.3g}x)"
            if r["bench"] == "chunk" and r.get("speedup_vs_batched") is not None:
                note += f", {r['speedup_vs_batched']:.3g}x batched"
            if r["bench"] in ("mla", "mask") and r.get("best_sdpa_ms_over_ours") is not None:
                note += f", {r['best_sdpa_ms_over_ours']:.3g}x sdpa"
            if r["bench"] == "varlen" and r.get("tflops_vs_dense_padded") is not None:
                note += f", {r['tflops_vs_dense_padded']:.3g}x padded"
            met = r.get("target_met")
            note += ("; target met" if met else "; TARGET MISSED" if met is False
                     else "; target not judged (CPU interpreter)")
        provider = r.get("label") or r["provider"]
        out.append(f"{r['bench']:<8} {provider:<26} {r['mode']:<8} {r['dtype']:<9} "
                   f"{_feature_shape(r):<28} {ms:>10} {tf:>8} {mem:>8}  {note[:70]}")
    targets = list(dict.fromkeys(r["target"] for r in sel if r.get("target")))
    if targets:
        out.append("targets: " + "; ".join(targets))
    return "\n".join(out)


DECODE_SHORT = {"kernels": "split", "kernels_unsplit": "unsplit", "kernels_dense": "dense",
                "sdpa_flash": "flash", "sdpa_efficient": "effic", "sdpa_math": "math"}


def format_decode(rows, metric="gbps"):
    """The decode rows: one line per (batch, cache length), a cell per provider
    (GB/s of K and V read, or ``metric="ms"``), then on ours' split row: its split count,
    fraction of the copy bandwidth, speed-up over unsplit and over the fastest SDPA, target."""
    sel = [r for r in rows if r["bench"] == "decode"]
    if not sel:
        return ""
    providers = list(dict.fromkeys(r["provider"] for r in sel))
    first = sel[0]
    copy = next((r["copy_gbps"] for r in sel if r.get("copy_gbps")), None)
    unit = "GB/s of K+V read" if metric == "gbps" else "ms (median)"
    out = [f"\ndecode: q_len 1, heads {first['heads']}/{first['heads_kv']} kv, "
           f"d{first['head_dim']}, {first['dtype']}  [{unit}; copy "
           + (f"{copy:.0f} GB/s measured in this run]" if copy else "GB/s not measured]"),
           f"{'batch':>5} {'cache':>7} {'splits':>9} "
           + " ".join(f"{DECODE_SHORT.get(n, n)[:8]:>8}" for n in providers)
           + f" {'%copy':>6} {'x unspl':>7} {'x sdpa':>6}  target"]
    for key in dict.fromkeys((r["batch"], r["seq_len"]) for r in sel):
        cells = {r["provider"]: r for r in sel if (r["batch"], r["seq_len"]) == key}
        mine = cells.get("kernels", {})
        splits = (f"{mine['num_splits']} {mine['num_splits_how'][:5]}"
                  if mine.get("num_splits") is not None else "")
        line = f"{key[0]:>5} {key[1]:>7} {splits:>9} " + " ".join(
            f"{_cell(cells[n], metric) if n in cells else '':>8}" for n in providers)
        frac, unspl, sdpa = (mine.get(k) for k in ("bw_fraction", "speedup_vs_unsplit",
                                                  "best_sdpa_ms_over_ours"))
        line += f" {f'{100 * frac:.0f}%' if frac is not None else '':>6}"
        line += f" {f'{unspl:.3g}x' if unspl is not None else '':>7}"
        line += f" {f'{sdpa:.3g}x' if sdpa is not None else '':>6}"
        if mine.get("target"):
            met = mine.get("target_met")
            line += "  " + ("met" if met else "MISSED" if met is False else "not judged") + (
                f" ({mine['target']})")
        out.append(line)
    out.append("splits: the split count of ours' split row (heuristic = "
               "kernels.core.configs.num_splits_heuristic, forced = passed); %copy, x unspl, "
               "x sdpa and the target are on that row" + ("" if copy else
                                                   "; target not judged without a GPU"))
    return "\n".join(out)


def status_summary(rows):
    """Counts of each status kind, e.g. {"ok": 40, "unsupported": 12}."""
    counts = {}
    for r in rows:
        kind = r["status"].split(":")[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def errors(rows):
    """Rows whose status is an error (for the end-of-run message)."""
    return [r for r in rows if r["status"].startswith("error")]


def eprint(*args):
    """print to stderr."""
    print(*args, file=sys.stderr, flush=True)
