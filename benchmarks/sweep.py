"""The attention sweep: every (dtype, head_dim, dropout) config x seq_len x provider x mode.

Shapes follow the FlashAttention papers: ``batch = max(1, tokens // seq_len)`` at a fixed token
budget, ``heads = hidden // head_dim`` at a fixed hidden size. Order (:func:`plan_tasks`): the
primary config (the first of each of --dtypes, --head-dims, --dropout) with every provider, then
the other configs, closest first, without the torch.compile providers, then those; within one,
seq_len, provider, mode. Rows the time budget leaves out are written as ``skipped: time
budget``; after an OOM a provider's larger seq_lens say ``skipped: oom at seq_len N``.
"""
import itertools
import time
from dataclasses import dataclass, field

import torch

from .flops import attention_flops, tflops
from .measure import (MEASURE_KEYS, classify_failure, free_memory, measure, mode_maker,
                      ratio_spread)
from .providers import (COMPILED, FALLBACK, QUADRATIC, Case, configure_dynamo, get_provider,
                        reset_compiled)

ROW_KEYS = ("bench", "provider", "mode", "dtype", "causal", "dropout_p", "batch", "heads",
            "seq_len", "head_dim", "ms", "ms_p20", "ms_p80", "tflops", "peak_mem_bytes",
            "status", "first_call_s", "runs", "same_code_as", "best_sdpa_ms_over_ours",
            "best_sdpa", "best_sdpa_ratio_low", "best_sdpa_ratio_high", "best_sdpa_noise")


@dataclass
class SweepConfig:
    """What to sweep and how to time it (filled from the command line)."""

    device: str
    seq_lens: list
    modes: list
    dtypes: list
    head_dims: list
    dropouts: list
    providers: list
    tokens: int
    hidden: int
    quadratic_max_seq: int
    explicit_providers: bool = False
    warmup_ms: float = 25
    rep_ms: float = 100
    cpu_reps: int = 3
    cpu_max_s: float = 2.0
    deadline: float = float("inf")  # time.monotonic() value after which nothing new starts
    causal: bool = True
    extra: dict = field(default_factory=dict)


def ordered_configs(dtypes, head_dims, dropouts):
    """(dtype, head_dim, dropout_p) triples, the ones closest to the primary values first.

    The primary value of each dimension is the first one given; a config's rank is the number
    of dimensions in which it differs from the primary one.
    """
    triples = list(itertools.product(enumerate(dtypes), enumerate(head_dims), enumerate(dropouts)))
    triples.sort(key=lambda t: sum(i != 0 for i, _ in t))  # stable: product order within a rank
    return [tuple(x for _, x in t) for t in triples]


def plan_tasks(cfg):
    """[(config, providers)] in run order: the primary config with every provider, then the
    other configs with the providers that need no torch.compile, then the compiled providers
    (reference_compiled, flex: seconds of compilation per shape) for the other configs. When
    the time budget runs out, what is cut is therefore the least informative part."""
    configs = ordered_configs(cfg.dtypes, cfg.head_dims, cfg.dropouts)
    eager = [p for p in cfg.providers if p not in COMPILED]
    compiled = [p for p in cfg.providers if p in COMPILED]
    tasks = [(configs[0], list(cfg.providers))]
    tasks += [(c, eager) for c in configs[1:] if eager]
    tasks += [(c, compiled) for c in configs[1:] if compiled]
    return tasks


def shape_for(seq_len, head_dim, tokens, hidden):
    """(batch, heads) for a point: batch*seq_len = tokens (at least 1), heads*head_dim = hidden."""
    return max(1, tokens // seq_len), max(1, hidden // head_dim)


def new_row(provider, mode, case, bench="attention"):
    """A result row with every ROW_KEYS field, measurements still None; on CPU ours' sweep rows
    also name the implementation that ran (``backend``) and their ``label`` in tables."""
    row = dict.fromkeys(ROW_KEYS)
    row.update(bench=bench, provider=provider, mode=mode, dtype=case.dtype_name,
               causal=case.causal, dropout_p=case.dropout_p, batch=case.batch,
               heads=case.heads, seq_len=case.seq_len, head_dim=case.head_dim)
    if bench == "attention" and provider == "kernels" and torch.device(case.device).type == "cpu":
        row.update(backend=FALLBACK, label="kernels (PyTorch fallback)")
    return row


def _static_skip(cfg, name, provider, case):
    reason = provider.static_reason(case)
    if reason:
        return f"unsupported: {reason}"
    if name in QUADRATIC and case.seq_len > cfg.quadratic_max_seq:
        return (f"skipped: stores seq_len^2 scores; limited to seq_len <= {cfg.quadratic_max_seq}"
                " (--quadratic-max-seq)")
    if (name in COMPILED and not cfg.explicit_providers
            and cfg.device.startswith("cpu")):
        return "skipped: torch.compile providers run on CPU only when named in --providers"
    return None


def run_sweep(cfg: SweepConfig, torch_dtype, on_row=None, on_point=None, progress=None,
              after_primary=None):
    """Run the sweep; return the rows, sorted by config, seq_len, provider and mode.
    ``torch_dtype(name)``: a dtype name's torch dtype; called back: ``on_row(row)``,
    ``on_point(rows)`` after each (config, seq_len) point, ``progress(done, total, text)``, and
    once ``after_primary(rows)`` after the primary config (the CLI's feature rows)."""
    configure_dynamo()
    rows = []
    total = (len(cfg.dtypes) * len(cfg.head_dims) * len(cfg.dropouts) * len(cfg.seq_lens)
             * len(cfg.providers) * len(cfg.modes))
    oom_at = {}  # (provider, dtype, head_dim, dropout, mode) -> seq_len of the first OOM
    providers = {name: get_provider(name) for name in cfg.providers}
    for task_index, ((dtype_name, head_dim, dropout_p), names) in enumerate(plan_tasks(cfg)):
        if task_index == 1 and after_primary is not None:
            after_primary(rows)
            after_primary = None
        for seq_len in cfg.seq_lens:
            batch, heads = shape_for(seq_len, head_dim, cfg.tokens, cfg.hidden)
            case = Case(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim,
                        dtype=torch_dtype(dtype_name), dropout_p=dropout_p, device=cfg.device,
                        causal=cfg.causal)
            inputs = None
            if any(n in COMPILED for n in names):
                reset_compiled()
            for name in names:
                provider = providers[name]
                for mode in cfg.modes:
                    row = new_row(name, mode, case)
                    key = (name, dtype_name, head_dim, dropout_p, mode)
                    status = _static_skip(cfg, name, provider, case)
                    if status is None and key in oom_at:
                        status = f"skipped: oom at seq_len {oom_at[key]}"
                    if status is None and time.monotonic() > cfg.deadline:
                        status = "skipped: time budget"
                    if progress:
                        progress(len(rows), total, f"{name} {mode} {dtype_name} d{head_dim} "
                                                   f"p{dropout_p} seq {seq_len}")
                    if status is None and inputs is None:
                        # Same seed for every provider and mode: identical inputs.
                        try:
                            inputs = case.make_inputs(generator_seed=seq_len)
                        except Exception as exc:  # e.g. no memory for the inputs themselves
                            inputs = classify_failure(exc)
                    if status is None and isinstance(inputs, str):
                        status = inputs
                    if status is None:
                        q, k, v, do = inputs
                        row.update(_measure_provider(cfg, provider, case, mode, q, k, v, do))
                        if row["status"] == "ok":
                            row["tflops"] = tflops(
                                attention_flops(batch, heads, seq_len, seq_len, head_dim,
                                                causal=case.causal, mode=mode), row["ms"])
                        elif row["status"] == "oom":
                            oom_at[key] = seq_len
                    else:
                        row["status"] = status
                    rows.append(row)
                    if on_row:
                        on_row(row)
            inputs = None
            free_memory(cfg.device, collect=False)
            if on_point:
                on_point(rows)
    if after_primary is not None:  # the primary config was the only one
        after_primary(rows)
    if progress:
        progress(len(rows), total, "done")
    order = {c: i for i, c in enumerate(ordered_configs(cfg.dtypes, cfg.head_dims,
                                                        cfg.dropouts))}
    rows.sort(key=lambda r: (order[(r["dtype"], r["head_dim"], r["dropout_p"])], r["seq_len"],
                             cfg.providers.index(r["provider"]), cfg.modes.index(r["mode"])))
    add_speedups(rows)
    return rows


def _measure_provider(cfg, provider, case, mode, q, k, v, do):
    """Measure ``provider`` on (q, k, v) in ``mode``; a failing ``provider.forward`` is a row."""
    try:
        forward = provider.forward(case)
    except Exception as exc:
        return dict(dict.fromkeys(MEASURE_KEYS),
                    status=classify_failure(exc, (), provider.unsupported_reason))
    extra = {}
    prepare = getattr(provider, "prepare_inputs", None)
    if prepare is not None:  # e.g. fp16 copies for an fp16-only kernel, made outside timing
        try:
            q, k, v, do = prepare(q, k, v, do)
        except Exception as exc:
            return dict(dict.fromkeys(MEASURE_KEYS), status=classify_failure(exc))
        extra["run_dtype"] = str(q.dtype).replace("torch.", "")
    if mode == "fwd":  # inference: no autograd graph, so also no "backward unsupported" errors
        q, k, v = q.detach(), k.detach(), v.detach()
    make = mode_maker(lambda: forward(q, k, v), mode, do, (q, k, v))
    with provider.context(case):  # forward and backward (on CPU: which `kernels` runs)
        result = extra | measure(make, cfg.device, grads=(q, k, v) if mode != "fwd" else (),
                                 warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms,
                                 cpu_reps=cfg.cpu_reps, cpu_max_s=cfg.cpu_max_s,
                                 unsupported_reason=provider.unsupported_reason)
    if (result["status"] == "ok" and result["runs"] is None
            and torch.device(cfg.device).type == "cpu"):
        result["runs"] = provider.own_ops   # profiled: none of PyTorch's attention ops ran
    return result


def point_key(row):
    """The fields that identify one measured problem (everything but provider and results)."""
    return (row["bench"], row["mode"], row["dtype"], row["causal"], row["dropout_p"],
            row["batch"], row["heads"], row["seq_len"], row["head_dim"])


def add_speedups(rows):
    """Per point: ``same_code_as`` on each ok row that ran one of PyTorch's attention ops (on
    CPU, ``runs``): the other providers whose rows ran that same op (timing PyTorch against
    itself). On each ok ``kernels`` row: the speed-up over the fastest SDPA backend that ran
    that point with other code, with its spread (``best_sdpa_ratio_low`` / ``_high`` from the
    two rows' p20 / p80) and ``best_sdpa_noise`` (the ranges overlap: not a difference)."""
    from .measure import ATTENTION_OPS

    points = {}
    for r in rows:
        if r["status"] == "ok":
            points.setdefault(point_key(r), []).append(r)
    for point in points.values():
        for r in point:
            if r.get("runs") in ATTENTION_OPS:
                r["same_code_as"] = [o["provider"] for o in point
                                     if o is not r and o.get("runs") == r["runs"]]
    for point in points.values():
        for r in point:
            if r["provider"] != "kernels":
                continue
            same = r.get("same_code_as") or ()
            sdpa = [o for o in point if o["provider"].startswith("sdpa_")
                    and o["provider"] not in same]
            if not sdpa:
                continue
            best = min(sdpa, key=lambda o: o["ms"])
            ratio, low, high, noise = ratio_spread(best, r)
            r.update(best_sdpa_ms_over_ours=ratio, best_sdpa=best["provider"],
                     best_sdpa_ratio_low=low, best_sdpa_ratio_high=high, best_sdpa_noise=noise)
    return rows
