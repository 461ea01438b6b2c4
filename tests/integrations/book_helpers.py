"""Helpers of the tests against llms-from-scratch (test_book_models.py, test_lora.py): the
package's modules, and the check of every decoding step of a generation against the package's
model run once, uncached."""
import copy
import importlib

import pytest
import torch

from helpers import assert_parity


def package(name):
    """llms_from_scratch.<name>; the Llama 3 modules skip without tiktoken."""
    if "llama3" in name:
        pytest.importorskip("tiktoken", reason="llms_from_scratch's llama3 modules import "
                            "tiktoken at module level (pip install tiktoken)")
    return importlib.import_module(f"llms_from_scratch.{name}")


def recorded(model, generate, new_tokens):
    """(tokens, last-position logits of the first ``new_tokens`` forwards, (batch, new_tokens,
    vocab)) of ``generate()`` run on ``model``."""
    rows = []
    handle = model.register_forward_hook(lambda m, args, out: rows.append(out[:, -1].detach()))
    try:
        tokens = generate()
    finally:
        handle.remove()
    return tokens, torch.stack(rows[:new_tokens], dim=1)


def assert_steps_match_package(steps, tokens, unfused, prompt_len, name):
    """Every decoding step's logits (``steps``, (batch, new_tokens, vocab)) vs the package's
    model run once, uncached, on the generated ``tokens`` (logits at position p predict token
    p + 1): float64 oracle, the package in its own dtype as the baseline. Stricter than equal
    tokens, which a tiny random model can keep through a wrong position or mask."""
    oracle = copy.deepcopy(unfused).double()
    if hasattr(oracle, "cfg"):
        oracle.cfg = dict(oracle.cfg, dtype=torch.float64)
    for m in (unfused, oracle):
        if isinstance(getattr(m, "current_pos", None), int):
            m.current_pos = 0           # kv_cache.gpt2 adds it to positions even uncached
    with torch.no_grad():
        want, base = (m(tokens[:, :-1])[:, prompt_len - 1:] for m in (oracle, unfused))
    assert_parity(steps, want, base, name=f"{name}: logits of the decoding steps")
