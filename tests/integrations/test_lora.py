"""LoRA (the book's appendix E: ``llms_from_scratch.appendix_e``) and fuse_attention, both orders.

The book's recipe, ``replace_linear_with_lora`` on a frozen model, is applied before fusing (the
twins must recognise the LoRA-wrapped projections) and after fusing (it must wrap the twins'
projections, which the twins then call). Either way the fused model's outputs, the gradients
of every LoRA parameter and the parameters after an optimizer step over the LoRA parameters
only equal the unfused LoRA model's within the parity rule (tests/helpers.py: float64 copy =
oracle, the unfused model in float32 = baseline). LoRA's B starts at zero in the package, which
would make every LoRA output and A-gradient zero: here B is random. Projections that are
neither nn.Linear nor the package's LoRA wrapper go through fuse_attention's numerical check:
swapped and right, or left alone, never wrong.
"""
import copy

import pytest
import torch
import torch.nn as nn

from book_helpers import assert_steps_match_package, package, recorded
from helpers import DEVICE, GRAD_FACTOR, assert_parity, randn

pytest.importorskip("llms_from_scratch", reason="llms-from-scratch is not installed "
                    "(pip install --no-deps llms-from-scratch==1.0.19)")

import kernels.fuse  # noqa: E402
from benchmarks.book_models import gpt2_kv_generate, gpt2_uncached_generate  # noqa: E402
from kernels import (  # noqa: E402
    FusedMultiHeadAttention,
    FusedMultiHeadAttentionWrapper,
    book,
    fuse_attention,
)
from llms_from_scratch.appendix_e import (  # noqa: E402
    LinearWithLoRA,
    LoRALayer,
    replace_linear_with_lora,
)
from reference import GPTModel, MultiHeadAttention, MultiHeadAttentionWrapper  # noqa: E402

# Tiny configs (the interpreter's time grows with heads and tokens): two layers, two heads.
GPT = {"vocab_size": 64, "context_length": 16, "emb_dim": 32, "n_heads": 2, "n_layers": 2,
       "drop_rate": 0.0, "qkv_bias": True}
QWEN = {"vocab_size": 64, "context_length": 16, "emb_dim": 32, "hidden_dim": 48, "n_heads": 2,
        "head_dim": 16, "qk_norm": True, "n_kv_groups": 1, "rope_base": 1e6,
        "dtype": torch.float32, "n_layers": 2}
LLAMA = {"vocab_size": 64, "context_length": 16, "emb_dim": 32, "hidden_dim": 48, "n_heads": 2,
         "n_kv_groups": 1, "rope_base": 5e5, "dtype": torch.float32, "n_layers": 2,
         "rope_freq": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_context_length": 16}}


MODELS = {  # name -> (build the unfused model in a dtype, config, twin class of its attention)
    "gpt": (lambda dtype: GPTModel(GPT), GPT, FusedMultiHeadAttention),
    "ch04_gpt": (lambda dtype: package("ch04").GPTModel(GPT), GPT, FusedMultiHeadAttention),
    "gpt2_kv": (lambda dtype: package("kv_cache.gpt2").GPTModel(GPT), GPT,
                book.FusedMultiHeadAttentionKV),
    # The package's Llama 3 / Qwen 3 take their dtype from the config (they cast to it).
    "llama3": (lambda dtype: package("llama3").Llama3Model(dict(LLAMA, dtype=dtype)), LLAMA,
               book.FusedLlama3GroupedQueryAttention),
    "qwen3": (lambda dtype: package("qwen3").Qwen3Model(dict(QWEN, dtype=dtype)), QWEN,
              book.FusedQwen3GroupedQueryAttention),
}
ORDERS = ("lora_then_fuse", "fuse_then_lora")


def add_lora(model, rank=4, alpha=2.0):
    """Appendix E: freeze the model, wrap every nn.Linear in LinearWithLoRA (its LoRA layer in
    the wrapped layer's dtype: the package makes it float32); B made random."""
    for p in model.parameters():
        p.requires_grad_(False)
    replace_linear_with_lora(model, rank, alpha)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LinearWithLoRA):
                m.lora.to(m.linear.weight.dtype)
            if isinstance(m, LoRALayer):
                m.B.normal_(0.0, 0.1)
    return model


def lora_pair(build, order, dtype=torch.float32):
    """(unfused, fused, swapped count): the same LoRA model, unfused and fused, in ``order``,
    built in ``dtype``."""
    unfused = build(dtype).to(DEVICE, dtype)
    if order == "lora_then_fuse":
        add_lora(unfused)
        fused, count = fuse_attention(copy.deepcopy(unfused))
    else:
        fused, count = fuse_attention(copy.deepcopy(unfused))
        add_lora(unfused)
        add_lora(fused)
        # Same LoRA values; also checks that the state_dicts (masks included) still match.
        fused.load_state_dict(unfused.state_dict(), strict=True)
    return unfused, fused, count


def lora_params(model):
    return {n: p for n, p in model.named_parameters() if ".lora." in n}


def check_step(models, run):
    """``run(model)`` -> output, scalar loss on (fused, unfused, oracle): outputs, every LoRA
    gradient and the LoRA parameters after one SGD step over them agree within the rule."""
    outs = []
    for m in models:
        out, loss = run(m)
        loss.backward()
        outs.append(out)
    assert_parity(outs[0], outs[2], outs[1], name="output")
    params = [lora_params(m) for m in models]
    assert list(params[0]) == list(params[1]) and params[0], "LoRA parameters differ"
    assert all(p.grad is None for n, p in models[0].named_parameters() if n not in params[0])
    for name, p in params[0].items():
        assert p.grad is not None and p.grad.abs().max() > 0, f"{name}: no gradient"
        assert_parity(p.grad, params[2][name].grad, params[1][name].grad, factor=GRAD_FACTOR,
                      name=f"{name}.grad")
    before = {n: p.detach().clone() for n, p in params[0].items()}
    for ps in params:
        torch.optim.SGD(ps.values(), lr=0.5).step()
    for name, p in params[0].items():
        assert not torch.equal(p, before[name]), f"{name}: not updated"
        assert_parity(p, params[2][name], params[1][name], factor=GRAD_FACTOR,
                      name=f"{name} after the step")


# Every model in float32; the two attention families (GPT, grouped-query with RoPE) in bf16.
TRAIN_CASES = [(name, torch.float32) for name in MODELS] + [
    ("gpt", torch.bfloat16), ("qwen3", torch.bfloat16)]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name,dtype", TRAIN_CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_lora_model_fused_trains_like_the_unfused(name, dtype, order):
    build, cfg, twin = MODELS[name]
    torch.manual_seed(0)
    unfused, fused, count = lora_pair(build, order, dtype)
    assert all(p.dtype == dtype for p in fused.parameters())
    assert count == cfg["n_layers"]
    for block in fused.trf_blocks:
        assert type(block.att) is twin
        assert all(type(getattr(block.att, p)) is LinearWithLoRA
                   for p in ("W_query", "W_key", "W_value", "out_proj"))
    oracle = copy.deepcopy(unfused).double()
    if hasattr(oracle, "cfg"):
        oracle.cfg = dict(oracle.cfg, dtype=torch.float64)
    idx = torch.randint(0, cfg["vocab_size"], (2, 8), device=DEVICE)
    target = torch.randint(0, cfg["vocab_size"], (2, 8), device=DEVICE)

    def run(m):
        logits = m.train()(idx)
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                   target.flatten())

    check_step((fused, unfused, oracle), run)


KV_MODELS = {  # name -> (build the unfused model, the fused model's cached greedy generation)
    "gpt2_kv": (MODELS["gpt2_kv"][0], gpt2_kv_generate),
    "llama3_kv": (lambda dtype: package("kv_cache.llama3").Llama3Model(dict(LLAMA, dtype=dtype)),
                  None),
    "qwen3_kv": (lambda dtype: package("kv_cache.qwen3").Qwen3Model(dict(QWEN, dtype=dtype)),
                 None),
}
NEW_TOKENS = 12     # prompt 4 + 12: the configs' context_length


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", tuple(KV_MODELS))
def test_lora_kv_cache_generation(name, order):
    """A LoRA model with a KV cache, fused: greedy generation with the cache gives the unfused
    LoRA model's uncached tokens, and every cached step's logits are within the parity rule of
    the unfused model run once on the generated tokens (Llama 3 / Qwen 3 through the package's
    kv_cache.generate, GPT-2 through its cache protocol: the package's own cached GPT-2 fails,
    see benchmarks/book_models.py)."""
    build, cached = KV_MODELS[name]
    torch.manual_seed(0)
    unfused, fused, count = lora_pair(build, order)
    assert count == len(fused.trf_blocks)
    unfused.eval()
    fused.eval()
    prompt = torch.randint(0, GPT["vocab_size"], (1, 4), device=DEVICE)
    if cached is None:
        generate = package("kv_cache.generate").generate_text_simple
        want = generate(unfused, prompt, NEW_TOKENS, use_cache=False)
        run = lambda: generate(fused, prompt, NEW_TOKENS, use_cache=True)  # noqa: E731
    else:
        want = gpt2_uncached_generate(unfused, prompt, NEW_TOKENS)
        run = lambda: cached(fused, prompt, NEW_TOKENS)  # noqa: E731
    tokens, steps = recorded(fused, run, NEW_TOKENS)
    assert torch.equal(tokens, want), f"{name}: {tokens.tolist()} != {want.tolist()}"
    assert_steps_match_package(steps, tokens, unfused, prompt.shape[1], name)


@pytest.mark.parametrize("order", ORDERS)
def test_lora_wrapper_heads(order):
    """MultiHeadAttentionWrapper with LoRA heads: the fused wrapper calls each head's LoRA
    projections (no stacked weights) and still runs all heads in one launch."""
    torch.manual_seed(0)
    unfused, fused, count = lora_pair(
        lambda dtype: nn.Sequential(MultiHeadAttentionWrapper(16, 8, 8, 0.0, num_heads=2)), order)
    assert count == 1 and type(fused[0]) is FusedMultiHeadAttentionWrapper
    assert not fused[0]._plain_linears()
    oracle = copy.deepcopy(unfused).double()
    x = randn(2, 6, 16)
    cot = randn(2, 6, 16, dtype=torch.float64)

    def run(m):
        out = m(x.to(torch.float64 if m is oracle else torch.float32))
        return out, (out * cot.to(out.dtype)).sum()

    check_step((fused, unfused, oracle), run)


class TanhProjection(nn.Sequential):
    """A projection that is not a Linear: Linear then tanh."""

    def __init__(self, d_in, d_out):
        super().__init__(nn.Linear(d_in, d_out), nn.Tanh())


class UserLoRA(nn.Module):
    """A user's own copy of the book's LinearWithLoRA (another class)."""

    def __init__(self, linear, rank=2):
        super().__init__()
        self.linear = linear
        self.A = nn.Parameter(torch.randn(linear.in_features, rank))
        self.B = nn.Parameter(torch.randn(rank, linear.out_features))

    def forward(self, x):
        return self.linear(x) + x @ self.A @ self.B


class RawProjection(nn.Module):
    """A projection with no in_features anywhere: its input width cannot be found."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_in, d_out) / d_in ** 0.5)

    def forward(self, x):
        return x @ self.w


def test_unknown_projections_are_checked_and_never_wrong(capsys, monkeypatch):
    checked = []
    real_check = kernels.fuse._numerical_check

    def recording_check(module, twin, seed=0):
        checked.append(module)
        return real_check(module, twin, seed)

    monkeypatch.setattr(kernels.fuse, "_numerical_check", recording_check)
    torch.manual_seed(0)
    mods = [MultiHeadAttention(16, 16, 8, 0.0, num_heads=2) for _ in range(5)]
    mods[0].W_query = TanhProjection(16, 16)
    mods[1].W_value = UserLoRA(mods[1].W_value)
    mods[2].W_key = RawProjection(16, 16)                     # d_in from W_query
    for name in ("W_query", "W_key", "W_value"):              # no d_in anywhere
        setattr(mods[3], name, RawProjection(16, 16))
    add_lora(mods[4])                                         # the package's: known, unchecked
    model = nn.ModuleList(mods).to(DEVICE).eval()
    unfused, oracle = copy.deepcopy(model), copy.deepcopy(model).double()
    _, count = fuse_attention(model, verbose=True)
    report = capsys.readouterr().out
    assert count == 4
    assert checked == mods[:4]
    assert "3 (MultiHeadAttention): left alone: cannot check numerically (unknown input size)" \
        in report
    assert model[3] is mods[3]
    x = randn(2, 8, 16)
    with torch.no_grad():
        for i in (0, 1, 2, 4):
            assert type(model[i]) is FusedMultiHeadAttention
            assert_parity(model[i](x), oracle[i](x.double()), unfused[i](x), name=f"module {i}")
