"""PNG plots of a results file: TFLOP/s vs seq_len per provider (one figure per mode) and peak
memory vs seq_len. Needs matplotlib; without it, :func:`write_plots` says so and returns [].

Every panel of a figure spans the same x-range, the seq_lens of the whole sweep (rows of any
status), so panels with missing points (skipped, unsupported) still line up with the others.
A panel's y-axis is logarithmic when its values span more than ``LOG_RATIO`` (on CPU the
interpreted kernel is orders of magnitude below PyTorch, and on a linear axis it lies on zero).
"""
import math
import os

LOG_RATIO = 30.0  # max/min of a panel's values above which its y-axis is logarithmic


def _configs(rows):
    return list(dict.fromkeys((r["dtype"], r["head_dim"], r["dropout_p"]) for r in rows))


def _grid(n):
    cols = min(n, 4)
    return math.ceil(n / cols), cols


def y_scale(values, ratio=LOG_RATIO):
    """``"log"`` when the positive ``values`` span more than ``ratio`` (max/min), else
    ``"linear"``."""
    vals = [v for v in values if v is not None and v > 0]
    if len(vals) >= 2 and max(vals) / min(vals) > ratio:
        return "log"
    return "linear"


def x_range(rows):
    """(seq_lens, (lo, hi)): the sorted seq_lens of all ``rows`` (any status) and x-limits
    a little outside them on a log axis, shared by every panel."""
    seqs = sorted({r["seq_len"] for r in rows})
    if not seqs:
        return [], None
    return seqs, (seqs[0] / 1.25, seqs[-1] * 1.25)


def plot_filenames(stem, modes, memory=True):
    """Names of the PNGs :func:`write_plots` writes for ``modes`` (and the memory plot)."""
    names = [f"{stem}-tflops-{mode}.png" for mode in modes]
    if memory:
        names.append(f"{stem}-memory.png")
    return names


def _attention_rows(rows):
    return [r for r in rows if r["bench"] == "attention"]


def _panel(ax, sel, providers, colors, metric, seqs, xlim, scale=1.0, force_log=False):
    """Draw one panel; return the values drawn."""
    drawn = []
    for p in providers:
        pts = sorted((r["seq_len"], r[metric] / scale) for r in sel
                     if r["provider"] == p and r["status"] == "ok" and r[metric] is not None)
        if pts:
            xs, ys = zip(*pts)
            # On CPU ours' rows carry a label saying which implementation ran.
            label = next((r["label"] for r in sel if r["provider"] == p and r.get("label")), p)
            ax.plot(xs, ys, marker="o", ms=3, label=label, color=colors[p])
            drawn += ys
    ax.set_xscale("log", base=2)
    if xlim:
        ax.set_xlim(*xlim)
        ax.set_xticks(seqs)
        ax.set_xticklabels([str(s) for s in seqs], fontsize=8)
        ax.minorticks_off()
    ax.set_yscale("log" if force_log else y_scale(drawn))
    if not drawn:
        ax.text(0.5, 0.5, "no ok rows", ha="center", va="center", transform=ax.transAxes,
                fontsize=9, color="0.4")
    ax.grid(True, which="both", alpha=0.3)
    return drawn


def tflops_figure(rows, mode, title=""):
    """The TFLOP/s-vs-seq_len figure of ``mode``: one panel per (dtype, head_dim, dropout)."""
    import matplotlib.pyplot as plt

    rows = _attention_rows(rows)
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    colors = {p: f"C{i}" for i, p in enumerate(providers)}
    configs = _configs(rows)
    seqs, xlim = x_range(rows)
    nr, nc = _grid(len(configs))
    fig, axes = plt.subplots(nr, nc, figsize=(4.5 * nc, 3.6 * nr), squeeze=False)
    for ax, (dtype, hd, p) in zip(axes.flat, configs):
        sel = [r for r in rows if (r["mode"], r["dtype"], r["head_dim"], r["dropout_p"])
               == (mode, dtype, hd, p)]
        _panel(ax, sel, providers, colors, "tflops", seqs, xlim)
        ax.set_title(f"{dtype} d={hd} dropout={p}", fontsize=9)
        ax.set_xlabel("seq_len")
        ax.set_ylabel("TFLOP/s")
    for ax in list(axes.flat)[len(configs):]:
        ax.axis("off")
    handles, labels = _legend(axes)
    fig.legend(handles, labels, loc="lower center", ncol=min(max(len(labels), 1), 8), fontsize=8)
    fig.suptitle(f"causal attention, {mode}: TFLOP/s vs seq_len  {title}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    return fig


def memory_figure(rows, title=""):
    """Peak memory vs seq_len, one panel per (mode, config); None when no row has it."""
    import matplotlib.pyplot as plt

    rows = _attention_rows(rows)
    mem_rows = [r for r in rows if r["peak_mem_bytes"] is not None]
    if not mem_rows:
        return None
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    colors = {p: f"C{i}" for i, p in enumerate(providers)}
    configs = _configs(rows)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    seqs, xlim = x_range(rows)
    panels = [(m, c) for m in modes for c in configs]
    nr, nc = len(modes), len(configs)
    fig, axes = plt.subplots(nr, nc, figsize=(4.0 * nc, 3.2 * nr), squeeze=False)
    for ax, (mode, (dtype, hd, p)) in zip(axes.flat, panels):
        sel = [r for r in mem_rows if (r["mode"], r["dtype"], r["head_dim"], r["dropout_p"])
               == (mode, dtype, hd, p)]
        _panel(ax, sel, providers, colors, "peak_mem_bytes", seqs, xlim, scale=2**20,
               force_log=True)
        ax.set_title(f"{mode} {dtype} d={hd} p={p}", fontsize=8)
        ax.set_xlabel("seq_len")
        ax.set_ylabel("peak MiB above inputs")
    handles, labels = _legend(axes)
    fig.legend(handles, labels, loc="lower center", ncol=min(max(len(labels), 1), 8), fontsize=8)
    fig.suptitle(f"peak memory per call vs seq_len  {title}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    return fig


def write_plots(rows, out_dir, stem, title=""):
    """Write ``<stem>-tflops-<mode>.png`` for each mode and ``<stem>-memory.png`` (when peak
    memory was measured: GPU, and CPU in-process); return the paths.

    Only ``bench == "attention"`` rows with status ok are drawn.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots: matplotlib is not installed; skipping PNG plots "
              "(pip install matplotlib, or plot the CSV elsewhere)")
        return []
    rows = _attention_rows(rows)
    if not rows:
        return []
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    figures = [tflops_figure(rows, mode, title) for mode in modes]
    memory = memory_figure(rows, title)
    names = plot_filenames(stem, modes, memory=memory is not None)
    paths = []
    for name, fig in zip(names, figures + ([memory] if memory is not None else [])):
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=90 if fig is not memory else 80)
        plt.close(fig)
        paths.append(path)
    return paths


def _legend(axes):
    seen = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    return list(seen.values()), list(seen.keys())
