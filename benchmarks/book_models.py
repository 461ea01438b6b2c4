"""Book-model rows: llms-from-scratch 1.0.19's models as they are (``original``) vs the same
weights after ``kernels.fuse_attention`` (``fused``): greedy generation (tokens/s) and a
training step, random weights, nothing downloaded. ``python -m benchmarks book [FAMILY ...]``.
The families, configs, protocol and columns (``speedup_vs_original`` = original ms / fused ms,
...) are in docs/performance.md. ``gpt2_kv_generate`` / ``gpt2_uncached_generate`` are also
the tests' generation loops.
"""
import copy
import importlib
import importlib.util

import torch

from .features import integration_row, ratio
from .flops import gpt_step_flops, tflops
from .measure import MEASURE_KEYS, classify_failure, free_memory, measure
from .modules import linear_weights, train_step
from .providers import Case

FAMILIES = ("qwen3", "llama3", "gpt2_kv", "qwen3_batched")
PACKAGE = "llms-from-scratch==1.0.19"
CPU_REPS = 1  # timed calls per row on CPU (after the warm-up call)
TARGET = "fused faster than the package's model (speedup_vs_original > 1)"

# family -> package modules (under llms_from_scratch.) of the generation and training models,
# the class name, and the generate module (None: gpt2_kv_generate)
FAMILY_MODELS = {
    "qwen3": dict(gen="kv_cache.qwen3", train="qwen3", cls="Qwen3Model",
                  generate="kv_cache.generate"),
    "llama3": dict(gen="kv_cache.llama3", train="llama3", cls="Llama3Model",
                   generate="kv_cache.generate"),
    "gpt2_kv": dict(gen="kv_cache.gpt2", train="kv_cache.gpt2", cls="GPTModel", generate=None),
    "qwen3_batched": dict(gen="kv_cache_batched.qwen3", train="kv_cache_batched.qwen3",
                          cls="Qwen3Model", generate="kv_cache_batched.generate"),
}

# Shapes per profile. GPU: the measured points; CPU: tiny versions of the same code paths.
BOOK_SHAPES = {
    "cuda": dict(batches=(1, 8), prompt=512, new_tokens=256, train_batch=1, train_seq=2048,
                 gen_reps=2),
    "cpu": dict(batches=(2,), prompt=8, new_tokens=4, train_batch=1, train_seq=16,
                gen_reps=None),
}

# The package's QWEN_CONFIG_06_B and LLAMA32_CONFIG_1B (1.0.19; tests/test_benchmarks_smoke.py
# checks they still are), written out so that rows without the package still carry their shapes.
# "dtype" is set to the run's dtype when a model is built.
_QWEN3_06B = {"vocab_size": 151_936, "context_length": 40_960, "emb_dim": 1024, "n_heads": 16,
              "n_layers": 28, "hidden_dim": 3072, "head_dim": 128, "qk_norm": True,
              "n_kv_groups": 8, "rope_base": 1_000_000.0, "dtype": torch.bfloat16}
_LLAMA32_1B = {"vocab_size": 128_256, "context_length": 131_072, "emb_dim": 2048, "n_heads": 32,
               "n_layers": 16, "hidden_dim": 8192, "n_kv_groups": 8, "rope_base": 500_000.0,
               "dtype": torch.bfloat16,
               "rope_freq": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_context_length": 8192}}
# The CPU profile's models: the same architectures at these tiny sizes.
_TINY = {"vocab_size": 64, "context_length": 64, "emb_dim": 32, "n_heads": 2, "n_layers": 1}
_QWEN3_TINY = dict(_QWEN3_06B, **_TINY, hidden_dim=48, head_dim=16, n_kv_groups=1)
_LLAMA3_TINY = dict(_LLAMA32_1B, **_TINY, hidden_dim=48, n_kv_groups=1,
                    rope_freq=dict(_LLAMA32_1B["rope_freq"], original_context_length=16))
_GPT2_TINY = dict(_TINY, drop_rate=0.1, qkv_bias=False)


def _gpt2_124m():
    from reference import GPT_CONFIG_124M

    sh = BOOK_SHAPES["cuda"]
    ctx = max(GPT_CONFIG_124M["context_length"], sh["train_seq"],
              sh["prompt"] + sh["new_tokens"])
    return dict(GPT_CONFIG_124M, context_length=ctx), (
        f"GPT-2 124M (reference.GPT_CONFIG_124M, context_length {ctx})")


def family_config(family, profile, layers=None):
    """(config dict, description) of ``family`` for ``profile`` ("cuda" or "cpu"), cut to
    ``layers`` layers when given (the description says so)."""
    if profile == "cuda":
        if family == "gpt2_kv":
            cfg, text = _gpt2_124m()
        elif family == "llama3":
            cfg, text = dict(_LLAMA32_1B), "Llama 3.2 1B shapes (llama3.LLAMA32_CONFIG_1B)"
        else:
            cfg, text = dict(_QWEN3_06B), "Qwen 3 0.6B shapes (qwen3.QWEN_CONFIG_06_B)"
        text += ", random weights"
    else:
        cfg = dict({"gpt2_kv": _GPT2_TINY, "llama3": _LLAMA3_TINY}.get(family, _QWEN3_TINY))
        text = "tiny CPU config (interpreter smoke run), random weights"
    if layers and layers < cfg["n_layers"]:
        text += f", {layers} of its {cfg['n_layers']} layers"
        cfg["n_layers"] = layers
    return cfg, text


def _head_dim(cfg):
    return cfg.get("head_dim") or cfg["emb_dim"] // cfg["n_heads"]


def package_reason(family):
    """Why ``family``'s rows cannot run here (None: they can)."""
    if importlib.util.find_spec("llms_from_scratch") is None:
        return f"llms-from-scratch not installed (pip install --no-deps {PACKAGE})"
    if family == "llama3" and importlib.util.find_spec("tiktoken") is None:
        return ("tiktoken not installed (llms_from_scratch's llama3 modules import it; "
                "pip install tiktoken)")
    return None


def _package(name):
    return importlib.import_module(f"llms_from_scratch.{name}")


def build_model(family, kind, cfg, device, dtype):
    """The package's model of ``family`` (``kind`` "gen" or "train", see FAMILY_MODELS) from
    ``cfg`` in ``dtype``, built on ``device``, seeded random weights."""
    spec = FAMILY_MODELS[family]
    cls = getattr(_package(spec[kind]), spec["cls"])
    torch.manual_seed(0)
    with torch.device(device):
        if family == "gpt2_kv":
            return cls(cfg).to(dtype)
        return cls(dict(cfg, dtype=dtype))


def gpt2_kv_generate(model, idx, new_tokens):
    """Greedy decoding of a ``kv_cache.gpt2.GPTModel`` over its own cache protocol (KVCache,
    ``use_cache=True``, ``current_pos``), as kv_cache.generate does for Llama / Qwen: a prefill,
    then a cached forward per new token but the last."""
    cache = _package("kv_cache.gpt2").KVCache(n_layers=len(model.trf_blocks))
    model.eval()
    model.current_pos = 0
    with torch.no_grad():
        logits = model(idx, use_cache=True, cache=cache)
        for step in range(new_tokens):
            nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
            if step + 1 < new_tokens:
                logits = model(nxt, use_cache=True, cache=cache)
    return idx


def gpt2_uncached_generate(model, idx, new_tokens):
    """The package's uncached greedy generation (``ch04.generate_text_simple``) of a
    ``kv_cache.gpt2.GPTModel`` (its ``current_pos`` reset: it offsets positions even
    uncached)."""
    model.eval()
    model.current_pos = 0
    return _package("ch04").generate_text_simple(model, idx, new_tokens,
                                                 model.pos_emb.num_embeddings)


def _generate_call(family, provider, model, idx, new_tokens):
    if provider == "original_uncached":
        return lambda: gpt2_uncached_generate(model, idx, new_tokens)
    if family == "gpt2_kv":
        return lambda: gpt2_kv_generate(model, idx, new_tokens)
    generate = _package(FAMILY_MODELS[family]["generate"]).generate_text_simple
    return lambda: generate(model, idx, new_tokens)


def _generate_name(family, provider):
    if provider == "original_uncached":
        return "ch04.generate_text_simple (no cache)"
    if family == "gpt2_kv":
        return "benchmarks.book_models.gpt2_kv_generate"
    return FAMILY_MODELS[family]["generate"] + ".generate_text_simple"


def _gpt2_cache_bug(exc, caught_warnings):
    """1.0.19's kv_cache.gpt2 cached step: a RuntimeError of the package, not ours."""
    if isinstance(exc, RuntimeError):
        text = " ".join(str(exc).split())
        return ("llms-from-scratch 1.0.19 kv_cache.gpt2 fails at its cached steps (causal "
                f"mask sliced by columns): {text}")[:240]
    return None


def _providers(family, mode):
    if family == "gpt2_kv" and mode == "generate":
        return ("original", "original_uncached", "fused")
    return ("original", "fused")


def book_rows(device, dtype, families=FAMILIES, opts=None, deadline=float("inf"),
              progress=None, layers=None, on_rows=None):
    """Rows of ``families`` (a subset of FAMILIES, in that order); see the module docstring.
    ``layers``: cut every model to that many layers. ``on_rows(rows)`` is called after each
    family with the rows so far (the CLI saves them)."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown book model family {unknown}; choose from {FAMILIES}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    gpu = torch.device(device).type == "cuda"
    sh = BOOK_SHAPES["cuda" if gpu else "cpu"]
    opts = dict(opts or dict(warmup_ms=10.0, rep_ms=50.0, cpu_reps=CPU_REPS, cpu_max_s=1.0))
    if not gpu:
        opts["cpu_reps"] = min(opts["cpu_reps"], CPU_REPS)
    rows = []
    for family in families:
        rows += family_rows(family, sh, device, dtype, opts, deadline, progress, layers)
        if on_rows:
            on_rows(list(rows))
    return rows


def family_rows(family, sh, device, dtype, opts, deadline=float("inf"), progress=None,
                layers=None):
    """The rows of one family: the training step, then generation at each batch; within a
    point, original (gpt2_kv generation: and original_uncached) then fused."""
    gpu = torch.device(device).type == "cuda"
    static = package_reason(family)
    cfg, text = family_config(family, "cuda" if gpu else "cpu", layers)
    full = family_config(family, "cuda" if gpu else "cpu")[0]["n_layers"]
    spec = FAMILY_MODELS[family]
    extra = dict(family=family, config=text, layers=cfg["n_layers"], layers_full=full,
                 heads_kv=cfg.get("n_kv_groups", cfg["n_heads"]), emb_dim=cfg["emb_dim"],
                 vocab=cfg["vocab_size"], tokens_per_s=None, fused_modules=None)
    points = [("train_step", sh["train_batch"], sh["train_seq"])]
    points += [("generate", b, sh["prompt"]) for b in sh["batches"]]
    models = {}  # kind -> {"original": (model, None), "fused": (model, count)} or a status
    rows = []
    for mode, batch, seq in points:
        kind = "train" if mode == "train_step" else "gen"
        p = float(cfg.get("drop_rate", 0.0)) if mode == "train_step" else 0.0
        case = Case(batch=batch, heads=cfg["n_heads"], seq_len=seq, head_dim=_head_dim(cfg),
                    dtype=dtype, dropout_p=p, device=device)
        point = []
        for provider in _providers(family, mode):
            cls_mod = spec[kind]
            row = integration_row("book", provider, mode, case,
                                   dict(extra, model=f"llms_from_scratch.{cls_mod}.{spec['cls']}"),
                                   static, deadline)
            if mode == "generate":
                row.update(prompt=sh["prompt"], new_tokens=sh["new_tokens"],
                           generate=_generate_name(family, provider))
            point.append(row)
            if row["status"] is not None:
                continue
            if progress:
                progress(None, None, f"book {family} {provider} {mode} batch {batch}")
            if kind not in models:
                models.clear()  # one kind's pair of models alive at a time
                free_memory(device)
                models[kind] = _model_pair(family, kind, cfg, device, dtype)
            pair = models[kind]
            if isinstance(pair, str):
                row["status"] = pair
                continue
            model, count = pair["fused" if provider == "fused" else "original"]
            if provider == "fused":
                row["fused_modules"] = count
                if count != cfg["n_layers"]:
                    row["status"] = (f"error: fuse_attention swapped {count} of "
                                     f"{cfg['n_layers']} attention modules")
                    continue
            row.update(_measure_point(family, provider, mode, model, batch, seq, cfg, sh,
                                      device, opts))
            model = pair = None  # only ``models`` holds them (freed when the kind changes)
        rows += _compare(point, gpu)
    models.clear()
    free_memory(device)
    return rows


def _model_pair(family, kind, cfg, device, dtype):
    """{"original": (model, None), "fused": (fused deep copy, count)} or a failure status."""
    import kernels

    try:
        model = build_model(family, kind, cfg, device, dtype)
        fused, count = kernels.fuse_attention(copy.deepcopy(model))
        return {"original": (model, None), "fused": (fused, count)}
    except Exception as exc:  # e.g. no memory for the two models
        return classify_failure(exc)


def _measure_point(family, provider, mode, model, batch, seq, cfg, sh, device, opts):
    """Measure one row; the measurement fields, plus tflops / tokens_per_s when ok."""
    gpu = torch.device(device).type == "cuda"
    g = torch.Generator().manual_seed(seq + batch)
    try:
        if mode == "train_step":
            ids = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=g).to(device)
            model.train()
            if family == "gpt2_kv":
                model.current_pos = 0
            step = train_step(model, ids)
            out = measure(lambda: step, device, **opts)
        else:
            ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=g).to(device)
            call = _generate_call(family, provider, model, ids, sh["new_tokens"])
            bug = _gpt2_cache_bug if (family, provider) == ("gpt2_kv", "original") else None
            out = measure(lambda: call, device, unsupported_reason=bug,
                          gpu_wall_reps=sh["gen_reps"] if gpu else None, **opts)
    except Exception as exc:  # inputs / optimizer not built (measure() classifies the rest)
        out = dict(dict.fromkeys(MEASURE_KEYS), status=classify_failure(exc))
    finally:
        step = None
        for t in model.parameters():
            t.grad = None
        free_memory(device, collect=False)
    if out["status"] == "ok":
        if mode == "train_step":
            heads = cfg["n_heads"]
            out["tflops"] = tflops(gpt_step_flops(linear_weights(model), cfg["n_layers"], batch,
                                                  seq, heads * _head_dim(cfg), heads), out["ms"])
            out["tokens_per_s"] = batch * seq / (out["ms"] * 1e-3)
        else:
            out["tokens_per_s"] = batch * sh["new_tokens"] / (out["ms"] * 1e-3)
    return out


def _compare(point, gpu):
    """``speedup_vs_original`` (and for gpt2_kv generation ``speedup_vs_original_uncached``),
    ``target`` and ``target_met`` on the fused row of one point (in place)."""
    by = {r["provider"]: r for r in point}
    mine = by.get("fused")
    if mine is None:
        return point
    value = ratio(by.get("original"), mine, "ms")
    mine["speedup_vs_original"] = value
    if "original_uncached" in by:
        mine["speedup_vs_original_uncached"] = ratio(by["original_uncached"], mine, "ms")
    mine["target"] = TARGET
    mine["target_met"] = (value > 1.0) if gpu and value is not None else None
    return point


def format_book(rows):
    """The book rows as a table (one line per row; the comparison on the fused rows)."""
    sel = [r for r in rows if r["bench"] == "book"]
    if not sel:
        return ""
    out = ["\nbook models (llms-from-scratch: original vs kernels.fuse_attention; generate: "
           "batch x prompt + new tokens; train_step: batch x seq)",
           f"{'family':<14} {'provider':<18} {'mode':<10} {'dtype':<9} {'shape':<14} "
           f"{'layers':>6} {'ms':>10} {'tokens/s':>10} {'TFLOP/s':>8} {'peak MiB':>8}  "
           "compared / status"]
    for r in sel:
        shape = (f"{r['batch']}x{r['prompt']}+{r['new_tokens']}" if r["mode"] == "generate"
                 else f"{r['batch']}x{r['seq_len']}")
        ms = f"{r['ms']:.1f}" if r["ms"] is not None else ""
        tps = f"{r['tokens_per_s']:.4g}" if r.get("tokens_per_s") is not None else ""
        tf = f"{r['tflops']:.3g}" if r["tflops"] is not None else ""
        mem = f"{r['peak_mem_bytes'] / 2**20:.0f}" if r["peak_mem_bytes"] is not None else ""
        note = r["status"] if r["status"] != "ok" else ""
        if r["status"] == "ok" and r.get("target"):
            value = r.get("speedup_vs_original")
            note = f"{value:.3g}x original" if value is not None else "original not timed"
            met = r.get("target_met")
            note += ("; target met" if met else "; TARGET MISSED" if met is False
                     else "; target not judged")
            if r.get("speedup_vs_original_uncached") is not None:
                note += f"; {r['speedup_vs_original_uncached']:.3g}x uncached"
        layers = (f"{r['layers']}/{r['layers_full']}" if r["layers"] != r["layers_full"]
                  else str(r["layers"]))
        out.append(f"{r['family']:<14} {r['provider']:<18} {r['mode']:<10} {r['dtype']:<9} "
                   f"{shape:<14} {layers:>6} {ms:>10} {tps:>10} {tf:>8} {mem:>8}  {note[:80]}")
    out.append("target: " + TARGET + " at every point; judged on a GPU only")
    return "\n".join(out)
