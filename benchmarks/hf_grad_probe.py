"""Probe: per-parameter gradient errors of one training step of a tiny transformers Gemma 2
(two layers: a sliding window of 4, then full attention; soft-capping 1.0; fp32) with
``attn_implementation="triton_fused"`` (ours) and ``"eager"``, each against the same model in
float64 with eager attention. Variants drop the soft-cap and / or the window, to tell which
feature an error comes from.

Why: tests/integrations/test_hf_new_models.py::test_training_step_gradients_match_eager[gemma2]
failed on an H200 (2026-11-26; triton 3.6, transformers 5.17): q_proj's gradient of layer 0
was 0.109 off the float64 oracle against a budget of 0.033 (3x eager's error), while on the CPU
(Triton's interpreter) ours is ~1e-7 off. Run on the GPU with and without TMA
(benchmarks/gpu_check.sh, stage "probe")::

    python -m benchmarks.hf_grad_probe [--json OUT.json]   # KERNELS_TMA=0: per-thread loads

Prints one line per (variant, attention parameter): max |ours - fp64|, max |eager - fp64|,
max |fp64 gradient|. Needs transformers. On a CPU the kernels' PyTorch path runs (set
TRITON_INTERPRET=1 before the start for the Triton kernels in the interpreter).
"""
import copy
import json
import os

import torch

VOCAB = 50
# (label, sliding_window, attn_logit_softcapping)
VARIANTS = [("window 4 + softcap 1", 4, 1.0), ("softcap 1", None, 1.0),
            ("window 4", 4, None), ("plain", None, None)]


def _batch(device):
    """Two rows of 9 positions: 9 tokens, and 6 tokens right-padded (the test left-pads it; a
    left-padded row's padding queries see no key, which turns float64 eager's softmax into
    NaN). The padding takes ours to its packed-sequence kernel, as in the test."""
    ids = torch.randint(1, VOCAB, (2, 9), device=device)
    mask = torch.ones(2, 9, dtype=torch.long, device=device)
    mask[1, 6:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def probe(label, window, softcap, device, rows=None):
    import transformers

    from kernels.integrations import hf
    hf.register()
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, intermediate_size=64, head_dim=8,
        query_pre_attn_scalar=8, sliding_window=window or 64, attn_logit_softcapping=softcap,
        initializer_range=0.2, layer_types=["sliding_attention" if window else
                                            "full_attention", "full_attention"])
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager").to(device)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation("triton_fused")
    exact = copy.deepcopy(eager).double()
    ids, mask = _batch(device)
    labels = ids.masked_fill(mask == 0, -100)
    for m in (ours, eager, exact):
        m.train()
        m(ids, attention_mask=mask, labels=labels).loss.backward()
    theirs, ref = dict(eager.named_parameters()), dict(exact.named_parameters())
    for name, p in ours.named_parameters():
        if "self_attn" not in name or p.grad is None:
            continue
        r = ref[name].grad
        err = (p.grad.double() - r).abs().max().item()
        err_eager = (theirs[name].grad.double() - r).abs().max().item()
        ref_max = r.abs().max().item()
        print(f"{label:22s} {name:40s} ours {err:.3e}  eager {err_eager:.3e}  "
              f"max|g| {ref_max:.3e}", flush=True)
        if rows is not None:
            rows.append(dict(variant=label, param=name, ours_err=err, eager_err=err_eager,
                             ref_max=ref_max, ours_over_eager=err / err_eager
                             if err_eager else None))


def build_parser():
    """The command line (also used by benchmarks.device_plan to validate a device script)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.hf_grad_probe", allow_abbrev=False,
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write every line's numbers here (after each variant)")
    ap.add_argument("--variants", nargs="+", choices=[v[0] for v in VARIANTS],
                    default=[v[0] for v in VARIANTS], metavar="LABEL",
                    help="which variants (labels as printed; default all)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                torch=torch.__version__, kernels_tma=os.environ.get("KERNELS_TMA", "1"),
                kernels_autotune=os.environ.get("KERNELS_AUTOTUNE", "1"))
    try:
        import transformers
        import triton
        meta.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError as exc:
        meta["import_error"] = str(exc)
    print(f"device {device}, KERNELS_TMA={meta['kernels_tma']}, "
          f"KERNELS_AUTOTUNE={meta['kernels_autotune']}")
    rows = []
    for label, window, softcap in VARIANTS:
        if label not in args.variants:
            continue
        probe(label, window, softcap, device, rows)
        if args.json:   # after each variant: a cut run keeps what it measured
            with open(args.json, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
