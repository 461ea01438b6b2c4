#!/usr/bin/env python3
"""Per-tile SASS cost of the score modifications in the causal forward (static, sm_90, triton 3.6).

What it measures
    For each variant -- plain causal, soft-capping, sinks, ALiBi, chunked attention
    (chunk_size 1024), a sliding window of 1024 with soft-capping (Gemma 2) and a sliding window
    of 1024 with sinks (gpt-oss) -- the project's causal forward is compiled for sm_90a with
    triton 3.6 and measured by the shared ``../shared/tools/sass_budget.py`` (used as a library,
    unchanged): the steady-state (unmasked) main loop's warp-instructions per 128x128 tile of
    scores by class (mufu, ffma, fmul, fadd, int, unif, ..., total), CTA-wide, and the masked
    diagonal's cost per 128-row query block. The table gives each variant's total per tile, its
    difference from plain causal, the classes that changed, and for MUFU the change per score
    (one MUFU per score = 128*128/32 = 512 warp-instructions per tile).

    sass_budget.py launches only plain causal attention (``attention_forward(q, k, v,
    causal=True, softmax_scale=...)``). To reach the modifications without touching the product
    code, each variant gets a temporary copy of the ``kernels/`` package at ONE commit (``git
    archive <commit> kernels``, default HEAD, resolved once at the start and printed) in which
    ``kernels/core/forward.py`` has a wrapper appended: ``attention_forward`` builds ``call`` as
    the real function does (``call or AttentionCall(**call_fields)``, the launcher's own
    keyword-only arguments passed through), then ``dataclasses.replace``s the variant's fields
    into it (``window=`` / ``chunk_size=``, and ``mods=CallMods(softcap=, sinks=, alibi_slopes=)``
    with fp32 (heads,) tensors) and calls the real launcher. Kernel source, configs and prune
    hooks are the commit's: the kernel compiled is the one the real launch would compile.

    With a window or a chunk the forward has THREE tensor-core loops (the left edge, masked; the
    unmasked main loop; the diagonal, masked), which sass_budget's own report refuses ("expected
    1 or 2"). This script accepts exactly that shape: in address order masked / unmasked /
    masked, the middle one with the fewest selects per score and each other one at least
    sass_budget.MASKED_EXTRA_SELECTS more; the diagonal is then costed by sass_budget's
    ``diagonal_cost`` from the main loop to the diagonal loop, and the left-edge loop is reported
    per tile (column "edge"). Anything else is printed as not measured, with sass_budget's reason.

How to run (CPU only; the sm90 venv: triton 3.6.0, a CPU torch; it re-executes itself with
~/.cache/sm90-venv/bin/python when started with another python):
    nice python3 benchmarks/sass_features.py [--commit HEAD] [--head-dims 64,128] [--dtype fp16]
        [--variants plain,softcap,...] [--json out.json] [--no-tutorial]
    14 forward kernels (7 variants x 2 head dims) + the tutorial's: ~30 s with an empty Triton
    cache on the 2-core dev machine (each kernel compiles in 1-4 s), ~20 s once sass_budget's
    cache (~/.cache/sass-budget-cache, --cache-dir) holds them. The copies go to
    ~/.cache/sass-features/<commit>/<variant> and are removed at the end (--keep keeps them).
    Make the venv with: python3 -m venv ~/.cache/sm90-venv &&
    ~/.cache/sm90-venv/bin/pip install triton==3.6.0 torch==2.13.0 numpy

    Columns: config (BLOCK_M x BLOCK_N, warps, stages: the default), regs and CTA/SM
    (sass_budget's occupancy estimate), total (main loop per 128x128 tile), delta and d/score
    (vs plain causal, per tile and per score element: delta x 32 / 128^2), MUFU/score (change in
    MUFU per score), diag/blk and d diag (masked diagonal per 128-row query block, and vs plain),
    the classes that changed, and [edge loop N/tile] for the window's / chunk's masked left-edge
    loop.

What the numbers are
    Static instruction counts of one iteration of the compiled main loop, normalised to a 128x128
    tile (sass_budget.py's docstring has the method): the issue work a tile costs, and by class
    where a difference comes from. The config is the project's default (the first config its
    autotuner keeps for that launch), which may differ between variants; it is printed. Launch
    shape B1 H16 S4096, q_len = k_len, causal.

What they are not
    Timings. A static count ignores latency, stalls, the pipes' rates (MUFU issues 16 lanes per
    clock per SM, FFMA 128: one more MUFU per score costs more time than one more FFMA), how the
    softmax overlaps the tensor cores, occupancy and memory traffic. The main loop is the
    steady state only: the prologue and epilogue (where the sinks act) are not in it, and how
    many tiles a row visits (a window visits fewer) is not either. Only a GPU run says what a
    feature costs in time.
"""
import argparse
import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True          # nothing written into the checkout or the tool folder

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = os.path.dirname(HERE)
DEFAULT_TOOLS = os.path.join(PROJECT, "..", "shared", "tools")
VENVS = [os.environ.get("SM90_VENV"), "~/.cache/sm90-venv"]

SOFTCAP = 50.0      # Gemma 2's attention logit cap (the value does not change the code)
# name -> (label, AttentionCall fields, mods: softcap value / sinks / alibi)
VARIANTS = collections.OrderedDict([
    ("plain", ("plain causal", {}, {})),
    ("softcap", ("softcap", {}, {"softcap": SOFTCAP})),
    ("sinks", ("sinks", {}, {"sinks": True})),
    ("alibi", ("alibi", {}, {"alibi": True})),
    ("chunk", ("chunk_size 1024", {"chunk_size": 1024}, {})),
    ("gemma2", ("window 1024 + softcap (Gemma 2)", {"window": 1024}, {"softcap": SOFTCAP})),
    ("gptoss", ("window 1024 + sinks (gpt-oss)", {"window": 1024}, {"sinks": True})),
])
CLASSES = ["hgmma", "mufu", "ffma", "fmul", "fadd", "fmnmx", "fsel", "conv", "int", "unif",
           "loads", "smem", "bar", "other", "total"]
SCORES_PER_TILE = 128 * 128
LANES = 32

# Appended to the copy's kernels/core/forward.py (placeholders: {name}, {fields}, {mods}).
WRAPPER = '''

# ---- appended by benchmarks/sass_features.py to a temporary copy: variant {name} ----
import dataclasses as _sf_dataclasses
import inspect as _sf_inspect

from .mods import CallMods as _SfCallMods  # noqa: F401  (the variant's mods are CallMods fields)

_SF_FIELDS = {fields}
_SF_MODS = {mods}
_sf_real_attention_forward = attention_forward
_SF_LAUNCH_KW = frozenset(
    n for n, p in _sf_inspect.signature(attention_forward).parameters.items()
    if p.kind is p.KEYWORD_ONLY)


def attention_forward(q, k, v, call=None, **kwargs):
    """The real launcher with the variant's AttentionCall fields and mods added."""
    launch = {{n: kwargs.pop(n) for n in list(kwargs) if n in _SF_LAUNCH_KW}}
    call = call or AttentionCall(**kwargs)      # as the real function builds it
    heads = q.shape[1]                          # dense (B, H, S, D) and packed (T, H, D) alike
    mods = {{}}
    if "softcap" in _SF_MODS:
        mods["softcap"] = float(_SF_MODS["softcap"])
    if _SF_MODS.get("sinks"):
        mods["sinks"] = torch.zeros(heads, dtype=torch.float32, device=q.device)
    if _SF_MODS.get("alibi"):
        mods["alibi_slopes"] = torch.tensor(
            [2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], dtype=torch.float32,
            device=q.device)
    call = _sf_dataclasses.replace(call, **_SF_FIELDS,
                                   mods=_sf_dataclasses.replace(call.mods, **mods))
    return _sf_real_attention_forward(q, k, v, call, **launch)
'''


# ----------------------------------------------------------------------------- environment
def ensure_triton36():
    try:
        import triton
        if triton.__version__.startswith("3.6."):
            return
    except ImportError:
        pass
    if not os.environ.get("SASS_FEATURES_REEXEC"):
        for venv in VENVS:
            py = os.path.join(os.path.expanduser(venv), "bin", "python") if venv else ""
            if py and os.access(py, os.X_OK):
                os.environ["SASS_FEATURES_REEXEC"] = "1"
                os.execv(py, [py, os.path.abspath(__file__)] + sys.argv[1:])
    sys.exit("sass_features: needs triton 3.6; make the venv: python3 -m venv ~/.cache/sm90-venv"
             " && ~/.cache/sm90-venv/bin/pip install triton==3.6.0 torch==2.13.0 numpy")


def load_sass_budget(tools):
    path = os.path.join(os.path.abspath(tools), "sass_budget.py")
    spec = importlib.util.spec_from_file_location("sass_budget", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_copy(project, commit, name, fields, mods, work):
    """kernels/ at ``commit`` under work/<commit>/<name>, the variant's wrapper appended."""
    dest = os.path.join(work, commit[:12], name)
    if os.path.exists(dest):
        shutil.rmtree(dest)
    os.makedirs(dest)
    archive = subprocess.run(["git", "-C", project, "archive", commit, "kernels"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    fwd = os.path.join(dest, "kernels", "core", "forward.py")
    with open(fwd) as f:
        src = f.read()
    assert "def attention_forward(" in src and "call = call or AttentionCall(**call_fields)" \
        in src, f"{commit[:12]}: attention_forward no longer builds its call as this script expects"
    if fields or mods:
        with open(fwd, "a") as f:
            f.write(WRAPPER.format(name=name, fields=repr(fields), mods=repr(mods)))
    return dest


# ----------------------------------------------------------------------------- analysis
def forward_loops(sb, r, entry):
    """{"main": per-tile counts, "edge": per-tile counts or None, "diag": per-block total or
    None, "masked_loop": per-tile counts or None} of an analysed forward kernel, or a reason."""
    if "fwd" in r["main"]:
        m = r["main"]["fwd"]
        d = r.get("diagonal")
        return dict(main=m["unmasked"]["per_tile"], edge=None,
                    masked_loop=m["masked"]["per_tile"] if m["masked"] else None,
                    diag=d["per_block"] if d else None, loops=1 + (m["masked"] is not None))
    loops = sorted((L for L in r["loops"] if L["role"] == "fwd"), key=lambda L: L["first"])
    others = [p for p in r["problems"] if "loops with tensor-core work" not in p]
    if len(loops) != 3 or others or any(L["tile"] is None for L in loops):
        return "; ".join(r["problems"]) or "no forward loop"
    edge, main, diag = loops
    sel = [L["selects_per_element"] for L in loops]
    if not (sel[1] + sb.MASKED_EXTRA_SELECTS <= min(sel[0], sel[2])):
        return (f"three loops, the middle one not the unmasked one (selects per element "
                f"{sel[0]:.2f} / {sel[1]:.2f} / {sel[2]:.2f})")
    k = entry["kernel"]
    ins, _ = sb.parse(sb.disassemble(k.asm["cubin"])[0])
    exits = [j for j, i in enumerate(ins) if i.op == "EXIT" and not i.pred]
    d = sb.diagonal_cost(ins, exits[-1] if exits else len(ins) - 1,
                         dict(unmasked=main, masked=diag), r["kwargs"], r["warps"])
    return dict(main=main["per_tile"], edge=edge["per_tile"], masked_loop=diag["per_tile"],
                diag=d["per_block"] if d else None, loops=3)


def measure(sb, comp, copy, dtype, hd):
    """Compile the copy's causal forward at (dtype, hd) and measure it: a dict, or a reason."""
    entries = [e for e in comp.project(copy, "fwd", dtype, hd) if "fwd" in e["fn"]]
    if not entries:
        return "nothing compiled"
    e = entries[-1]
    if e["kernel"] is None:
        return f"does not compile: {e['error']}"
    r = sb.analyse(e)
    got = forward_loops(sb, r, e)
    if isinstance(got, str):
        return f"loop not found reliably: {got}"
    kw = r["kwargs"]
    got.update(config=sb.cfg_str(kw), regs=r["regs"], spill=r["spill"],
               wgmma_serialized=r["wgmma_serialized"], ctas_per_sm=r["ctas_per_sm"],
               kept=len(r["kept"] or []))
    return got


def changed(main, base, tol=0.5):
    return {c: main[c] - base[c] for c in CLASSES if c != "total"
            and abs(main[c] - base[c]) > tol}


def fmt_delta(x):
    return f"{x:+.0f}" if abs(x) >= 0.5 else "0"


def report(results, head_dims, variants, tutorial):
    print("\n== causal forward, fp16, B1 H16 S4096: unmasked main loop, warp-instructions per "
          "128x128 tile (static) ==")
    for hd in head_dims:
        base = results.get(("plain", hd))
        print(f"\nhead_dim {hd}" + (f"  (tutorial 06 at its best-known config: "
                                      f"{tutorial[hd]:.0f} per tile)" if tutorial.get(hd) else ""))
        print(f"  {'variant':<34}{'config':<14}{'regs':>5}{'CTA/SM':>7}{'total':>7}{'delta':>7}"
              f"{'d/score':>8}{'MUFU/score':>11}{'diag/blk':>9}{'d diag':>7}"
              "  classes changed (per tile)")
        for name in variants:
            r = results.get((name, hd))
            label = VARIANTS[name][0]
            if isinstance(r, str) or r is None:
                print(f"  {label:<34}not measured: {r}")
                continue
            ok = isinstance(base, dict)
            dt = r["main"]["total"] - base["main"]["total"] if ok else float("nan")
            dm = (r["main"]["mufu"] - base["main"]["mufu"]) * LANES / SCORES_PER_TILE \
                if ok else float("nan")
            dd = (r["diag"] - base["diag"]) if ok and r["diag"] is not None and \
                base["diag"] is not None else None
            ch = changed(r["main"], base["main"]) if ok else {}
            extra = []
            if r["edge"] is not None:
                extra.append(f"edge loop {r['edge']['total']:.0f}/tile")
            if r["wgmma_serialized"]:
                extra.append(f"wgmma serialized ({r['wgmma_serialized']})")
            if r["spill"] and any(r["spill"]):
                extra.append(f"spills {r['spill'][0]}/{r['spill'][1]} B")
            diag = f"{r['diag']:.0f}" if r["diag"] is not None else "-"
            print(f"  {label:<34}{r['config']:<14}{r['regs']:>5}{r['ctas_per_sm']:>7}"
                  f"{r['main']['total']:>7.0f}"
                  f"{fmt_delta(dt):>7}{dt * LANES / SCORES_PER_TILE:>+8.2f}{dm:>+11.2f}{diag:>9}"
                  f"{(fmt_delta(dd) if dd is not None else '-'):>7}  "
                  + (", ".join(f"{c} {v:+.0f}" for c, v in ch.items()) or "-")
                  + (f"  [{'; '.join(extra)}]" if extra else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for what the numbers mean.")
    ap.add_argument("--project", default=PROJECT, help="the git checkout to snapshot")
    ap.add_argument("--commit", default="HEAD", help="the commit whose kernels/ is measured")
    ap.add_argument("--tools", default=DEFAULT_TOOLS, help="folder of sass_budget.py")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=",".join(VARIANTS))
    ap.add_argument("--work-dir", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                       "sass-features"),
                    help="where the temporary copies go (<commit>/<variant>/kernels)")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                        "sass-budget-cache"))
    ap.add_argument("--no-tutorial", action="store_true", help="skip the tutorial reference")
    ap.add_argument("--keep", action="store_true", help="keep the copies")
    ap.add_argument("--json")
    a = ap.parse_args()
    ensure_triton36()
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r} (have {', '.join(VARIANTS)})")
    if "plain" not in variants:
        variants.insert(0, "plain")
    head_dims = [int(x) for x in a.head_dims.split(",") if x.strip()]
    commit = subprocess.run(["git", "-C", a.project, "rev-parse", a.commit], check=True,
                            capture_output=True, text=True).stdout.strip()
    sb = load_sass_budget(a.tools)
    import triton
    t0 = time.time()
    comp = sb.Compiler(os.path.abspath(a.cache_dir))
    print(f"sass_features: kernels/ of {commit} ({a.project}); triton {triton.__version__}, "
          f"sm_90a; {a.dtype}; cache {a.cache_dir}", flush=True)
    results, copies = {}, []
    for name in variants:
        label, fields, mods = VARIANTS[name]
        copy = make_copy(a.project, commit, name, fields, mods, a.work_dir)
        copies.append(copy)
        for hd in head_dims:
            t = time.time()
            results[name, hd] = measure(sb, comp, copy, a.dtype, hd)
            r = results[name, hd]
            print(f"  {label} d{hd}: " + (f"{r['main']['total']:.0f} per tile ({r['config']})"
                                           if isinstance(r, dict) else r)
                  + f" [{time.time() - t:.0f} s]", flush=True)
    tutorial = {}
    if not a.no_tutorial:
        for hd in head_dims:
            if hd not in sb.ANCHOR_FWD:
                continue
            for e in comp.anchor_forward(sb.DEFAULT_ANCHOR, "fp16", hd):
                if e["kernel"] is not None and e["fn"] == "_attn_fwd":
                    r = sb.analyse(e)
                    if "fwd" in r["main"]:
                        tutorial[hd] = r["main"]["fwd"]["unmasked"]["per_tile"]["total"]
    report(results, head_dims, variants, tutorial)
    print(f"\nkernels/ at {commit}; compiled and analysed in {time.time() - t0:.0f} s. Static "
          f"counts (not timings); MUFU/score = change in MUFU per score element "
          f"(512 warp-instructions per tile = 1 per score); diag/blk = masked diagonal per "
          f"128-row query block.")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(commit=commit, triton=triton.__version__, dtype=a.dtype,
                           tutorial=tutorial,
                           results={f"{n} d{hd}": r for (n, hd), r in results.items()}),
                      f, indent=1, default=str)
    if not a.keep:
        for c in copies:
            shutil.rmtree(c, ignore_errors=True)


if __name__ == "__main__":
    main()
