"""fuse_attention (kernels/fuse.py): swapping the book's attention modules inside
a model.

A tiny GPTModel (reference/gpt.py) is fused in place; training with an optimizer created before
the swap, greedy generation and state_dicts must behave as in the unfused model. Parity follows
tests/helpers.py (float64 copy = oracle, fp32 unfused copy = baseline).
"""
import copy

import pytest
import torch
import torch.nn as nn

from helpers import DEVICE, assert_parity, randn
from kernels import (
    FusedCausalAttention,
    FusedMultiHeadAttention,
    FusedMultiHeadAttentionWrapper,
    fuse_attention,
)
from reference import (
    CausalAttention,
    GPTModel,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v2,
    generate_text_simple,
)

TINY_GPT = {
    "vocab_size": 97,
    "context_length": 16,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 2,
    "drop_rate": 0.0,
    "qkv_bias": False,
}


class UserMultiHeadAttention(nn.Module):
    """A user's own copy of the book's MultiHeadAttention (another class, same structure)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads):
        super().__init__()
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), 1))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (lin(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for lin in (self.W_query, self.W_key, self.W_value))
        scores = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:n, :n], -torch.inf)
        weights = self.dropout(torch.softmax(scores / self.head_dim ** 0.5, dim=-1))
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, n, self.d_out))


def tiny_gpt():
    return GPTModel(TINY_GPT).to(DEVICE)


def tokens(batch, n):
    return torch.randint(0, TINY_GPT["vocab_size"], (batch, n), device=DEVICE)


def test_fuse_gpt_swaps_every_block_and_keeps_parameters():
    model = tiny_gpt()
    before = [(name, id(p)) for name, p in model.named_parameters()]
    sd_before = model.state_dict()
    fused, count = fuse_attention(model)
    assert fused is model
    assert count == TINY_GPT["n_layers"]
    assert all(isinstance(block.att, FusedMultiHeadAttention) for block in model.trf_blocks)
    assert [(name, id(p)) for name, p in model.named_parameters()] == before
    # Checkpoints are interchangeable: same keys (masks included), same values.
    sd_after = model.state_dict()
    assert list(sd_after) == list(sd_before)
    for key in sd_before:
        assert torch.equal(sd_after[key].cpu(), sd_before[key].cpu()), key
    assert not any(name.endswith("mask") for name, _ in model.named_buffers())
    # Fusing again finds nothing left to do.
    assert fuse_attention(model) == (model, 0)


def test_optimizer_built_before_fusing_trains_like_the_unfused_model():
    model = tiny_gpt()
    unfused = copy.deepcopy(model)
    oracle = copy.deepcopy(model).double()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, unfused, oracle)]
    fuse_attention(model)  # after the optimizer exists: it must still drive the model
    inputs, targets = tokens(2, 12), tokens(2, 12)

    def step(m, opt):
        opt.zero_grad()
        logits = m(inputs)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        return loss.detach()

    for i in range(3):
        losses = [step(m, opt) for m, opt in zip((model, unfused, oracle), opts)]
        assert_parity(losses[0], losses[2], losses[1], name=f"loss at step {i}")
    # The optimizer really updated the fused model's attention weights.
    assert opts[0].state[model.trf_blocks[0].att.W_query.weight]["step"].item() == 3


def test_greedy_generation_is_unchanged():
    model = tiny_gpt().eval()
    unfused = copy.deepcopy(model)
    fuse_attention(model)
    prompt = tokens(2, 4)
    ctx = TINY_GPT["context_length"]
    # 14 new tokens: the last steps feed the full context (16 tokens).
    want = generate_text_simple(unfused, prompt, max_new_tokens=14, context_size=ctx)
    got = generate_text_simple(model, prompt, max_new_tokens=14, context_size=ctx)
    assert torch.equal(got, want)


def test_duck_typed_and_book_modules_are_swapped_self_attention_is_not():
    model = nn.ModuleDict({
        "user_mha": UserMultiHeadAttention(16, 16, 8, 0.0, num_heads=2),
        "book_mha": MultiHeadAttention(16, 16, 8, 0.0, num_heads=4),
        "causal": CausalAttention(16, 8, 8, 0.0),
        "wrapper": MultiHeadAttentionWrapper(16, 4, 8, 0.0, num_heads=2),
        "stack": nn.Sequential(nn.Linear(16, 16), MultiHeadAttention(16, 16, 8, 0.0, 2)),
        "self_v2": SelfAttention_v2(16, 16),
    }).to(DEVICE).eval()
    originals = copy.deepcopy(model)
    ids = [id(p) for p in model.parameters()]
    _, count = fuse_attention(model)
    assert count == 5
    assert isinstance(model["user_mha"], FusedMultiHeadAttention)
    assert isinstance(model["book_mha"], FusedMultiHeadAttention)
    assert isinstance(model["causal"], FusedCausalAttention)
    assert isinstance(model["wrapper"], FusedMultiHeadAttentionWrapper)
    assert all(isinstance(h, FusedCausalAttention) for h in model["wrapper"].heads)
    assert isinstance(model["stack"][1], FusedMultiHeadAttention)
    assert type(model["self_v2"]) is SelfAttention_v2  # not causal: left alone
    assert [id(p) for p in model.parameters()] == ids

    x = randn(2, 8, 16)
    for name in ("user_mha", "causal", "wrapper"):
        base = originals[name]
        oracle = copy.deepcopy(base).double()
        assert_parity(model[name](x), oracle(x.double()), base(x), name=name)


def test_non_causal_masks_and_lookalikes_missing_parts_are_left_alone():
    bidirectional = MultiHeadAttention(16, 16, 8, 0.0, num_heads=2)
    bidirectional.mask.zero_()  # attends to the future: not what the kernel computes
    no_mask = MultiHeadAttention(16, 16, 8, 0.0, num_heads=2)
    del no_mask.mask
    wrapper_plus = MultiHeadAttentionWrapper(16, 4, 8, 0.0, num_heads=2)
    wrapper_plus.extra = nn.Linear(8, 8)  # a wrapper with more than heads
    model = nn.ModuleList([bidirectional, no_mask, wrapper_plus])
    _, count = fuse_attention(model)
    # Only the two causal heads inside wrapper_plus qualify on their own.
    assert count == 2
    assert model[0] is bidirectional and model[1] is no_mask and model[2] is wrapper_plus
    assert all(isinstance(h, FusedCausalAttention) for h in wrapper_plus.heads)


def test_root_module_and_shared_modules():
    mha = MultiHeadAttention(16, 16, 8, 0.0, num_heads=2).train()
    fused, count = fuse_attention(mha)
    assert count == 1 and isinstance(fused, FusedMultiHeadAttention) and fused.training
    assert fused.W_query.weight is mha.W_query.weight

    shared = MultiHeadAttention(16, 16, 8, 0.0, num_heads=2)
    model = nn.Sequential(shared, shared)  # one module used twice (weight tying)
    _, count = fuse_attention(model)
    assert count == 1 and model[0] is model[1]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_fused_gpt_in_low_precision(dtype):
    """module.to(dtype) before fusing: the fused blocks keep the dtype and match the baseline."""
    model = tiny_gpt().eval().to(dtype)
    oracle = copy.deepcopy(model).double()  # the same rounded weights, float64 math
    unfused = copy.deepcopy(model)
    fuse_attention(model)
    idx = tokens(2, 10)
    out = model(idx)
    assert out.dtype == dtype
    assert_parity(out, oracle(idx), unfused(idx))


def test_greedy_generation_gpt_124m_unchanged():
    """Fusing GPT_CONFIG_124M at full size (12 layers x 12 heads, random weights under the
    book's seed) leaves its greedy generation from the book's "Hello, I am" tokens unchanged,
    token for token."""
    from reference import GPT_CONFIG_124M, GPTModel
    torch.manual_seed(123)
    model = GPTModel(GPT_CONFIG_124M).to(DEVICE).eval()
    prompt = torch.tensor([[15496, 11, 314, 716]], device=DEVICE)  # "Hello, I am" (GPT-2 BPE)
    ctx = GPT_CONFIG_124M["context_length"]
    want = generate_text_simple(model, prompt, max_new_tokens=6, context_size=ctx)
    _, swapped = fuse_attention(model)  # in place: no second 163M-parameter copy
    assert swapped == GPT_CONFIG_124M["n_layers"]
    got = generate_text_simple(model, prompt, max_new_tokens=6, context_size=ctx)
    assert torch.equal(got, want)
