"""PNG plots of a results file: TFLOP/s vs seq_len per provider (one figure per mode) and peak
memory vs seq_len. Needs matplotlib; without it, :func:`write_plots` says so and returns []."""
import math
import os


def _configs(rows):
    return list(dict.fromkeys((r["dtype"], r["head_dim"], r["dropout_p"]) for r in rows))


def _grid(n):
    cols = min(n, 4)
    return math.ceil(n / cols), cols


def write_plots(rows, out_dir, stem, title=""):
    """Write ``<stem>-tflops-<mode>.png`` for each mode and ``<stem>-memory.png``; return paths.

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
    rows = [r for r in rows if r["bench"] == "attention"]
    if not rows:
        return []
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    colors = {p: f"C{i}" for i, p in enumerate(providers)}
    paths = []
    configs = _configs(rows)

    def panel(ax, sel, metric, scale=1.0):
        drawn = False
        for p in providers:
            pts = sorted((r["seq_len"], r[metric] / scale) for r in sel
                         if r["provider"] == p and r["status"] == "ok" and r[metric] is not None)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", ms=3, label=p, color=colors[p])
                drawn = True
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        return drawn

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for mode in modes:
        nr, nc = _grid(len(configs))
        fig, axes = plt.subplots(nr, nc, figsize=(4.5 * nc, 3.6 * nr), squeeze=False)
        for ax, (dtype, hd, p) in zip(axes.flat, configs):
            sel = [r for r in rows if (r["mode"], r["dtype"], r["head_dim"], r["dropout_p"])
                   == (mode, dtype, hd, p)]
            panel(ax, sel, "tflops")
            ax.set_title(f"{dtype} d={hd} dropout={p}", fontsize=9)
            ax.set_xlabel("seq_len")
            ax.set_ylabel("TFLOP/s")
        for ax in list(axes.flat)[len(configs):]:
            ax.axis("off")
        handles, labels = _legend(axes)
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8)
        fig.suptitle(f"causal attention, {mode}: TFLOP/s vs seq_len  {title}", fontsize=10)
        fig.tight_layout(rect=(0, 0.06, 1, 0.95))
        path = os.path.join(out_dir, f"{stem}-tflops-{mode}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    mem_rows = [r for r in rows if r["peak_mem_bytes"] is not None]
    if mem_rows:
        panels = [(m, c) for m in modes for c in configs]
        nr, nc = len(modes), len(configs)
        fig, axes = plt.subplots(nr, nc, figsize=(4.0 * nc, 3.2 * nr), squeeze=False)
        for ax, (mode, (dtype, hd, p)) in zip(axes.flat, panels):
            sel = [r for r in mem_rows if (r["mode"], r["dtype"], r["head_dim"], r["dropout_p"])
                   == (mode, dtype, hd, p)]
            panel(ax, sel, "peak_mem_bytes", scale=2**20)
            ax.set_yscale("log")
            ax.set_title(f"{mode} {dtype} d={hd} p={p}", fontsize=8)
            ax.set_xlabel("seq_len")
            ax.set_ylabel("peak MiB above inputs")
        handles, labels = _legend(axes)
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8)
        fig.suptitle(f"peak memory per call vs seq_len  {title}", fontsize=10)
        fig.tight_layout(rect=(0, 0.06, 1, 0.95))
        path = os.path.join(out_dir, f"{stem}-memory.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def _legend(axes):
    seen = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    return list(seen.values()), list(seen.keys())
