"""Twins of llms-from-scratch's attention classes (kernels/book/) against the
package itself.

The package (``pip install --no-deps llms-from-scratch==1.0.19``) is the oracle: every twin
is compared with its package class holding the same weights, in float64 (``.double()`` copies,
the oracle) and in the test dtype (the baseline of the parity rule, tests/helpers.py): outputs,
KV-cache contents and the gradients of one training step; then whole models, fused with
``kernels.fuse_attention``, generate the same greedy tokens as the package's models through
the package's own generate functions, cache on and off. Tiny random configs, nothing
downloaded. The Llama 3 modules import ``tiktoken`` at module level: their tests skip without
it.
"""
import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from helpers import DEVICE, GRAD_FACTOR, assert_parity, randn

pytest.importorskip("llms_from_scratch", reason="llms-from-scratch is not installed "
                    "(pip install --no-deps llms-from-scratch==1.0.19)")

from benchmarks.book_models import gpt2_kv_generate  # noqa: E402
from book_helpers import assert_steps_match_package, package, recorded  # noqa: E402
from kernels import book, fuse_attention  # noqa: E402
from llms_from_scratch.ch04 import generate_text_simple  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)
# Model configs: 2 query heads sharing 1 kv head (grouped-query), head_dim 16, one layer: the
# interpreter's time grows with heads and past 16 tokens, and generation runs ~70 kernel calls.
QWEN = {"vocab_size": 64, "context_length": 32, "emb_dim": 32, "hidden_dim": 48, "n_heads": 2,
        "head_dim": 16, "qk_norm": True, "n_kv_groups": 1, "rope_base": 1e6,
        "dtype": torch.float32, "n_layers": 1}
LLAMA = {"vocab_size": 64, "context_length": 32, "emb_dim": 32, "hidden_dim": 48, "n_heads": 2,
         "n_kv_groups": 1, "rope_base": 5e5, "dtype": torch.float32, "n_layers": 1,
         "rope_freq": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_context_length": 16}}
GPT = {"vocab_size": 64, "context_length": 32, "emb_dim": 32, "n_heads": 2, "n_layers": 1,
       "drop_rate": 0.0, "qkv_bias": True}
NEW_TOKENS = 16


def rope_tables(family, cfg, dtype=torch.float64):
    mod = package(family)
    if family == "llama3":
        cos, sin = mod.compute_rope_params(cfg["emb_dim"] // cfg["n_heads"], cfg["rope_base"],
                                           cfg["context_length"], cfg["rope_freq"])
    else:
        cos, sin = mod.compute_rope_params(cfg["head_dim"], cfg["rope_base"],
                                           cfg["context_length"])
    return cos.to(DEVICE, dtype), sin.to(DEVICE, dtype)


def causal(end, start=0, batch=None):
    """The packages' masks: triu(ones(end, end), 1)[start:end, :end], (1, 1, n, end)."""
    m = torch.ones(end, end, dtype=torch.bool, device=DEVICE).triu(1)[start:end, :end]
    return m[None, None] if batch is None else m[None, None].expand(batch, 1, -1, -1)


# ---------------------------------------------------------------------------------------------
# Module level: one twin per package class, same weights, float64 oracle
# ---------------------------------------------------------------------------------------------
# kind -> (package module, class name, twin, constructor kwargs, kind of forward)
KINDS = {
    "gpt2_kv": ("kv_cache.gpt2", "MultiHeadAttention", book.FusedMultiHeadAttentionKV,
                dict(d_in=32, d_out=32, context_length=32, dropout=0.0, num_heads=4), "gpt2"),
    "pytorch_mha": ("ch03", "PyTorchMultiHeadAttention", book.FusedPyTorchMultiHeadAttention,
                    dict(d_in=32, d_out=32, num_heads=4), "plain_nomask"),
    "llama3": ("llama3", "GroupedQueryAttention", book.FusedLlama3GroupedQueryAttention,
               dict(d_in=64, d_out=64, num_heads=4, num_kv_groups=2), "plain"),
    "llama3_fast": ("llama3", "GroupedQueryAttentionFast",
                    book.FusedLlama3GroupedQueryAttentionFast,
                    dict(d_in=64, d_out=64, num_heads=4, num_kv_groups=2), "rope_nomask"),
    "llama3_kv": ("kv_cache.llama3", "GroupedQueryAttention",
                  book.FusedLlama3GroupedQueryAttentionKV,
                  dict(d_in=64, d_out=64, num_heads=4, num_kv_groups=2), "kv"),
    "qwen3": ("qwen3", "GroupedQueryAttention", book.FusedQwen3GroupedQueryAttention,
              dict(d_in=32, num_heads=4, num_kv_groups=2, head_dim=16, qk_norm=True), "plain"),
    "qwen3_kv": ("kv_cache.qwen3", "GroupedQueryAttention", book.FusedQwen3GroupedQueryAttentionKV,
                 dict(d_in=32, num_heads=4, num_kv_groups=1, head_dim=16, qk_norm=True), "kv"),
    "qwen3_batched": ("kv_cache_batched.qwen3", "GroupedQueryAttention",
                      book.FusedQwen3GroupedQueryAttentionBatchedKV,
                      dict(d_in=32, num_heads=4, num_kv_groups=2, head_dim=16, qk_norm=True),
                      "batched"),
}
B, N0, N1 = 2, 5, 3  # batch, prompt tokens, tokens of the cached step


def package_class(kind):
    mod, name = KINDS[kind][:2]
    return getattr(package(mod), name)


def build(kind, dtype):
    """The package module of ``kind`` (seeded init) in ``dtype``: Llama/Qwen get dtype= as
    their models pass it (Qwen's QK-norm scales stay float32), the others .to(dtype)."""
    cls, kwargs = package_class(kind), KINDS[kind][3]
    if "num_kv_groups" in kwargs:
        return cls(**kwargs, dtype=dtype).to(DEVICE)
    return cls(**kwargs).to(DEVICE, dtype)


def family(kind):
    return "llama3" if kind.startswith("llama3") else "qwen3"


def scenario(kind, module, xs, tables):
    """Run ``module`` as its model would: a prompt, then (cache kinds) a step with the cache.
    Returns (outputs, final cache as a list of tensors)."""
    forward = KINDS[kind][4]
    x0, x1 = xs
    if forward == "plain_nomask":
        return [module(x0)], []
    cos, sin = tables
    if forward == "rope_nomask":
        return [module(x0, cos, sin)], []
    if forward == "plain":
        return [module(x0, causal(N0)[0, 0], cos, sin)], []
    if forward == "gpt2":
        # The package's cached step fails (its mask is sliced by columns): the oracle runs the
        # prompt and the step as one sequence, which is what the cached step must reproduce.
        if isinstance(module, book.BookTwin):
            o0, cache = module(x0, use_cache=True)
            o1, cache = module(x1, use_cache=True, start_pos=N0, cache=cache)
            return [o0, o1], list(cache)
        o, cache = module(torch.cat([x0, x1], dim=1), use_cache=True)
        return [o[:, :N0], o[:, N0:]], list(cache)
    if forward == "kv":
        o0, cache = module(x0, causal(N0), cos, sin)
        o1, cache = module(x1, causal(N0 + N1, N0), cos, sin, start_pos=N0, cache=cache)
        return [o0, o1], list(cache)
    assert forward == "batched"
    start = torch.zeros(B, dtype=torch.long, device=DEVICE)
    o0, cache = module(x0, causal(N0), cos, sin, start_pos=start, cache=None)
    o1, cache = module(x1, causal(N0 + N1, N0, batch=B), cos, sin, start_pos=start + N0,
                       cache=cache)
    return [o0, o1], [torch.cat([k for k, _ in cache]), torch.cat([v for _, v in cache])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", tuple(KINDS))
def test_twin_matches_package_class(kind, dtype):
    """Outputs, cache contents and all gradients of one training step, vs the package class
    with the same weights (float64 oracle, the package in ``dtype`` as the baseline)."""
    ref = build(kind, dtype)
    oracle = copy.deepcopy(ref).double()
    twin = KINDS[kind][2].from_module(copy.deepcopy(ref))
    assert type(twin) is KINDS[kind][2]
    d_in = KINDS[kind][3]["d_in"]
    xs = (randn(B, N0, d_in, dtype=dtype), randn(B, N1, d_in, dtype=dtype))
    tables = rope_tables(family(kind), LLAMA if family(kind) == "llama3" else QWEN)
    inputs = {m: [x.detach().clone().to(torch.float64 if m is oracle else dtype)
                  .requires_grad_() for x in xs] for m in (twin, ref, oracle)}
    runs = {m: scenario(kind, m, inputs[m], tables if m is oracle else
                        tuple(t.float() for t in tables)) for m in (twin, ref, oracle)}
    cots = [randn(*o.shape, dtype=torch.float64) for o in runs[oracle][0]]
    for m, (outs, _) in runs.items():
        sum((o * c.to(o.dtype)).sum() for o, c in zip(outs, cots)).backward()

    (f_outs, f_cache), (r_outs, r_cache), (o_outs, o_cache) = runs[twin], runs[ref], runs[oracle]
    for i, (f, r, o) in enumerate(zip(f_outs, r_outs, o_outs)):
        assert f.dtype == r.dtype
        assert_parity(f, o, r, name=f"output of step {i}")
    assert len(f_cache) == len(r_cache)
    for name, f, r, o in zip(("keys", "values"), f_cache, r_cache, o_cache):
        assert f.dtype == r.dtype, f"cached {name}: dtype {f.dtype}, package {r.dtype}"
        assert_parity(f, o, r, name=f"cached {name}")
    used = [x for x in inputs[twin] if x.grad is not None]
    for i, (f, r, o) in enumerate(zip(used, inputs[ref], inputs[oracle])):
        assert_parity(f.grad, o.grad, r.grad, factor=GRAD_FACTOR, name=f"x{i}.grad")
    f_p, r_p, o_p = (dict(m.named_parameters()) for m in (twin, ref, oracle))
    assert list(f_p) == list(r_p)
    for name in f_p:
        assert_parity(f_p[name].grad, o_p[name].grad, r_p[name].grad, factor=GRAD_FACTOR,
                      name=f"{name}.grad")


def test_batched_twin_runs_ragged_rows():
    """Per-row caches of different lengths (the package's torch.cat of the rows fails there):
    each row equals the package module run on that row alone; the next caches are per row."""
    kind = "qwen3_batched"
    ref = build(kind, torch.float32)
    oracle = copy.deepcopy(ref).double()
    twin = KINDS[kind][2].from_module(copy.deepcopy(ref))
    cos, sin = rope_tables("qwen3", QWEN)
    lens, n = (3, 6), 2
    prompts = [randn(1, L, 32) for L in lens]
    x = randn(len(lens), n, 32)
    with torch.no_grad():
        caches = [ref(p, causal(L), cos.float(), sin.float(),
                      start_pos=torch.zeros(1, dtype=torch.long), cache=None)[1][0]
                  for p, L in zip(prompts, lens)]
        k_max = max(lens) + n
        mask = torch.ones(len(lens), 1, n, k_max, dtype=torch.bool, device=DEVICE)
        for r, L in enumerate(lens):   # row r's keys left-aligned, padding masked
            mask[r, 0, :, :L + n] = causal(L + n, L)[0, 0]
        out, nxt = twin(x, mask, cos.float(), sin.float(), start_pos=torch.tensor(lens),
                        cache=caches)
        for r, L in enumerate(lens):
            row = [(ref, torch.float32), (oracle, torch.float64)]
            want = [m(x[r:r + 1].to(dt), causal(L + n, L), cos.to(dt), sin.to(dt),
                      start_pos=torch.tensor([L]),
                      cache=[tuple(t.to(dt) for t in caches[r])]) for m, dt in row]
            assert_parity(out[r:r + 1], want[1][0], want[0][0], name=f"row {r}")
            for i, name in enumerate(("keys", "values")):
                assert nxt[r][i].shape == (1, 2, L + n, 16)
                assert_parity(nxt[r][i], want[1][1][0][i], want[0][1][0][i],
                              name=f"row {r} cached {name}")
        # The package's way of padding (zeros: "visible") names keys a short row does not
        # have: not the kernel's pattern, so it is refused.
        mask[0, 0, :, lens[0] + n:] = False
        with pytest.raises(ValueError, match="columns past them masked"):
            twin(x, mask, cos.float(), sin.float(), start_pos=torch.tensor(lens), cache=caches)


# ---------------------------------------------------------------------------------------------
# Masks: exactly the kernel's pattern, or ValueError
# ---------------------------------------------------------------------------------------------

def test_masks_that_are_not_the_kernel_pattern_raise():
    cos, sin = (t.float() for t in rope_tables("qwen3", QWEN))
    x = randn(B, 4, 32)
    plain = book.FusedQwen3GroupedQueryAttention(32, 4, 2, 16, qk_norm=True)
    kv = book.FusedQwen3GroupedQueryAttentionKV(32, 4, 2, 16, qk_norm=True)
    batched = book.FusedQwen3GroupedQueryAttentionBatchedKV(32, 4, 2, 16, qk_norm=True)
    window = causal(4) | ~torch.ones(4, 4, dtype=torch.bool, device=DEVICE).triu(-1)
    per_head = causal(4).repeat(1, 4, 1, 1)
    per_head[0, 2, 3, 0] = True
    bad = {
        "not bool": (causal(4).float(), "bool mask"),
        "bidirectional": (torch.zeros(4, 4, dtype=torch.bool), "not the pattern"),
        "sliding window": (window, "not the pattern"),
        "top-left causal": (torch.ones(4, 4, dtype=torch.bool).triu(1).T, "not the pattern"),
        "wrong shape": (causal(5), "broadcasts to"),
        "one head differs": (per_head, "not the pattern"),
    }
    for name, (mask, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            plain(x, mask, cos, sin)
    with pytest.raises(ValueError, match="bool tensor"):
        plain(x, None, cos, sin)
    # A cached step: 4 new tokens after 3 cached ones need the bottom-right mask over 7 keys.
    _, cache = kv(randn(B, 3, 32), causal(3), cos, sin)
    for mask in (torch.ones(4, 7, dtype=torch.bool).triu(1),   # top-left: the GPT-2 bug
                 causal(4)):                                    # no cached keys
        with pytest.raises(ValueError):
            kv(x, mask.to(DEVICE), cos, sin, start_pos=3, cache=cache)
    kv(x, causal(7, 3)[0, 0], cos, sin, start_pos=3, cache=cache)   # 2-D is fine too
    # Batched: every row must be the pattern.
    start = torch.zeros(B, dtype=torch.long)
    _, caches = batched(randn(B, 3, 32), causal(3), cos, sin, start_pos=start)
    mask = causal(7, 3, batch=B).clone()
    mask[1, 0, 0, 3] = True
    with pytest.raises(ValueError, match=r"index \(1, "):
        batched(x, mask, cos, sin, start_pos=start + 3, cache=caches)
    # More queries than keys (the twins never build that: their keys include the queries'):
    # a row would see nothing, where the package's softmax gives NaN.
    with pytest.raises(ValueError, match="see no key"):
        book.check_mask(torch.ones(4, 2, dtype=torch.bool).triu(-1), 1, 1, 4, 2, who="mask")


# ---------------------------------------------------------------------------------------------
# state_dict and construction
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", tuple(KINDS))
def test_same_seed_same_weights_and_state_dict_round_trips(kind):
    torch.manual_seed(0)
    ref = build(kind, torch.float32)
    torch.manual_seed(0)
    kwargs = dict(KINDS[kind][3])
    if "num_kv_groups" in kwargs:
        kwargs["dtype"] = torch.float32
    twin = KINDS[kind][2](**kwargs).to(DEVICE)
    ref_sd, twin_sd = ref.state_dict(), twin.state_dict()
    assert list(twin_sd) == list(ref_sd)
    for key in ref_sd:
        assert torch.equal(twin_sd[key], ref_sd[key]), key
    fresh_ref, fresh_twin = build(kind, torch.float32), KINDS[kind][2](**kwargs).to(DEVICE)
    fresh_twin.load_state_dict(ref_sd, strict=True)
    fresh_ref.load_state_dict(twin_sd, strict=True)
    for name, value in fresh_twin.state_dict().items():
        assert torch.equal(value, ref_sd[name]), name
    for attr in ("num_heads", "head_dim", "d_out", "num_kv_groups", "group_size"):
        assert getattr(twin, attr, None) == getattr(ref, attr, None), attr


# ---------------------------------------------------------------------------------------------
# Whole models: fuse_attention, then the package's own generate functions
# ---------------------------------------------------------------------------------------------
MODELS = {  # name -> (package module, model class, config, KV-cache generate module or None)
    "gpt2_kv": ("kv_cache.gpt2", "GPTModel", GPT, None),
    "llama3": ("llama3", "Llama3Model", LLAMA, None),
    "llama3_kv": ("kv_cache.llama3", "Llama3Model", LLAMA, "kv_cache.generate"),
    "qwen3": ("qwen3", "Qwen3Model", QWEN, None),
    "qwen3_kv": ("kv_cache.qwen3", "Qwen3Model", QWEN, "kv_cache.generate"),
    "qwen3_batched": ("kv_cache_batched.qwen3", "Qwen3Model", QWEN,
                      "kv_cache_batched.generate"),
}


def model_pair(name):
    mod, cls, cfg, _ = MODELS[name]
    unfused = getattr(package(mod), cls)(cfg).to(DEVICE).eval()
    fused, count = fuse_attention(copy.deepcopy(unfused))
    assert count == cfg["n_layers"]
    return unfused, fused


@pytest.mark.parametrize("name", tuple(MODELS))
def test_fused_model_generates_the_same_tokens(name):
    """Greedy tokens of the fused model == the package's model, cache on and off, with the
    package's generate functions (GPT-2 KV: its cache protocol vs uncached generation), and
    the logits of every step within the parity rule."""
    unfused, fused = model_pair(name)
    cfg, gen_mod = MODELS[name][2], MODELS[name][3]
    batch = 2 if name == "qwen3_batched" else 1   # the batched model: two different prompts
    prompt = torch.randint(0, cfg["vocab_size"], (batch, 4), device=DEVICE)
    ctx = cfg["context_length"]
    want = generate_text_simple(unfused, prompt, NEW_TOKENS, ctx)
    runs = {"no cache": lambda: generate_text_simple(fused, prompt, NEW_TOKENS, ctx)}
    if name == "gpt2_kv":
        runs["cache"] = lambda: gpt2_kv_generate(fused, prompt, NEW_TOKENS)
        try:   # 1.0.19's own cached decoding fails at its second step (see the module)
            assert torch.equal(gpt2_kv_generate(unfused, prompt, NEW_TOKENS), want)
        except RuntimeError:
            pass
    elif gen_mod is not None:
        generate = package(gen_mod).generate_text_simple
        assert torch.equal(generate(unfused, prompt, NEW_TOKENS, use_cache=True), want)
        runs = {f"cache={c}": lambda c=c: generate(fused, prompt, NEW_TOKENS, use_cache=c)
                for c in (True, False)}
    assert batch == 1 or not torch.equal(want[0], want[1])
    for how, run in runs.items():
        tokens, steps = recorded(fused, run, NEW_TOKENS)
        assert torch.equal(tokens, want), f"{name}, {how}: {tokens.tolist()} != {want.tolist()}"
        assert_steps_match_package(steps, tokens, unfused, prompt.shape[1], f"{name}, {how}")


def test_fused_model_logits_and_training_step():
    """A Qwen 3 model with a KV cache, fused: logits and every gradient of one training step
    match the package's model (float64 oracle)."""
    unfused, fused = model_pair("qwen3_kv")
    oracle = copy.deepcopy(unfused).double()
    oracle.cfg = dict(oracle.cfg, dtype=torch.float64)
    idx = torch.randint(0, QWEN["vocab_size"], (2, 12), device=DEVICE)
    target = torch.randint(0, QWEN["vocab_size"], (2, 12), device=DEVICE)
    outs = []
    for m in (fused, unfused, oracle):
        m.train()
        logits = m(idx)
        nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
        outs.append(logits)
    assert_parity(outs[0], outs[2], outs[1], name="logits")
    params = [dict(m.named_parameters()) for m in (fused, unfused, oracle)]
    for name in params[0]:
        assert_parity(params[0][name].grad, params[2][name].grad, params[1][name].grad,
                      factor=GRAD_FACTOR, name=f"{name}.grad")


# ---------------------------------------------------------------------------------------------
# fuse_attention
# ---------------------------------------------------------------------------------------------

def test_fuse_attention_swaps_every_class_and_keeps_parameters():
    ch04 = package("ch04")
    models = {name: getattr(package(MODELS[name][0]), MODELS[name][1])(MODELS[name][2])
              for name in MODELS}
    gpt_cfg = dict(GPT, n_layers=2)
    models["ch04"] = ch04.GPTModel(gpt_cfg)
    models["ch04_fast"] = ch04.GPTModelFast(gpt_cfg)
    models["llama3_fast"] = package("llama3").Llama3ModelFast(LLAMA)
    models["llama3_kv_fast"] = package("kv_cache.llama3").Llama3ModelFast(LLAMA)
    expected = {"gpt2_kv": book.FusedMultiHeadAttentionKV,
                "llama3": book.FusedLlama3GroupedQueryAttention,
                "llama3_kv": book.FusedLlama3GroupedQueryAttentionKV,
                "qwen3": book.FusedQwen3GroupedQueryAttention,
                "qwen3_kv": book.FusedQwen3GroupedQueryAttentionKV,
                "qwen3_batched": book.FusedQwen3GroupedQueryAttentionBatchedKV,
                "ch04": __import__("kernels").FusedMultiHeadAttention,
                "ch04_fast": book.FusedPyTorchMultiHeadAttention,
                "llama3_fast": book.FusedLlama3GroupedQueryAttentionFast,
                "llama3_kv_fast": book.FusedLlama3GroupedQueryAttentionFast}
    for name, model in models.items():
        params = [(n, id(p)) for n, p in model.named_parameters()]
        sd = model.state_dict()
        fused, count = fuse_attention(model)
        assert fused is model and count == len(model.trf_blocks), name
        assert all(type(block.att) is expected[name] for block in model.trf_blocks), name
        assert [(n, id(p)) for n, p in model.named_parameters()] == params, name
        assert list(model.state_dict()) == list(sd), name
        assert fuse_attention(model) == (model, 0), name


def test_fuse_attention_leaves_an_overridden_forward_alone():
    base = package_class("qwen3")

    class Hotter(base):   # another softmax temperature: not what the twin computes
        def forward(self, x, mask, cos, sin):
            return super().forward(x * 2, mask, cos, sin)

    class Renamed(base):  # same forward: the twin reproduces it
        pass

    model = nn.ModuleList([Hotter(32, 4, 2, 16, True), Renamed(32, 4, 2, 16, True)])
    _, count = fuse_attention(model)
    assert count == 1
    assert type(model[0]) is Hotter
    assert type(model[1]) is book.FusedQwen3GroupedQueryAttention


def test_importing_kernels_does_not_import_the_package():
    code = ("import sys, torch, kernels\n"
            "kernels.fuse_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)))\n"
            "assert 'llms_from_scratch' not in sys.modules, 'imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
