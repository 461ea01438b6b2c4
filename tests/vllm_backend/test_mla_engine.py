"""Our MLA backend (``TRITON_FUSED_MLA``) inside vLLM's own engine (vLLM's CPU build): a tiny
random DeepSeek-V3 (latent attention: one 576-wide latent row per token, the query heads
attending to it absorbed at decode, up-projected at prefill) generates the greedy tokens of
transformers' eager attention and of vLLM's own CPU_MLA backend, several decode steps after
prompts of 5, 17, 40, 67 and 69 tokens; and once through the Triton interpreter (the paged and
split-KV kernels themselves over the 576-wide latent, values read as its first 512 columns).

Every vLLM run here turns vLLM's ``rotary_embedding`` custom op off (``custom_ops: ["all",
"-rotary_embedding"]``: its PyTorch implementation instead): vLLM's CPU rotary kernel
mis-handles MLA's strided 3-D q_pe / k_pe, which puts vLLM's CPU_MLA itself far from
transformers; without it CPU_MLA matches transformers to ~4e-5 in logprobs.

vLLM's CPU platform turns chunked prefill and prefix caching off for MLA models (only AMX
CPUs keep them). One engine of ours here keeps them anyway (driver.py's
``mla_cpu_chunked_prefill``: the platform's hook is kept from changing those settings, in the
driver process, for our backend only): 32-token steps (prompts over 32 tokens are prefilled in
chunks, each later chunk reading the earlier ones' latents from the pages) and a second round
that hits the prefix cache, so ``forward_mha`` with cached context serves an engine; compared
with transformers and with our non-chunked engine (CPU_MLA has no context support)."""
import pytest

from engine_helpers import PROMPTS, run_engines
from test_engine import LOGPROB_TOL, MAX_TOKENS, PREFIX_PROMPTS, _transformers

# vLLM's own CPU rotary op is wrong for MLA's strided q_pe / k_pe (see the module docstring).
NO_CPU_ROTARY = {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}
# Both engines ask for CPU_MLA: the CPU platform's choice on CPUs without AMX (AMX CPUs get
# AMX_MLA unless CPU_MLA is asked for); with KERNELS_VLLM=1 ours is in its place.
ENGINE = dict(NO_CPU_ROTARY, attention_backend="CPU_MLA")


# bf16 logprobs of two implementations (ours and CPU_MLA: 0.05 apart on this model).
BF16_LOGPROB_TOL = 0.15


# The fp32 engines' prompts: 5, 17 and 40 tokens, and two of 67 and 69 sharing their first 64.
FP32_PROMPTS = PROMPTS + PREFIX_PROMPTS
# Page size: vLLM's CPU platform forces 16 for MLA models (CPU_MLA's place).
MLA_PAGE = 16


@pytest.fixture(scope="module")
def served(models):
    """(ours, vLLM CPU_MLA's, transformers' (tokens, logprobs)): fp32 and bf16 engines; ours
    alone with an FP8 cache (CPU_MLA has none) and fp32 with chunked prefill and prefix
    caching (CPU_MLA has no context support); one process for each backend."""
    fp32 = dict(model=models["deepseek_v3"], prompts=FP32_PROMPTS, max_tokens=MAX_TOKENS,
                engine=ENGINE)
    bf16 = dict(fp32, prompts=PROMPTS, engine=dict(ENGINE, dtype="bfloat16"))
    fp8 = dict(bf16, engine=dict(ENGINE, dtype="bfloat16", kv_cache_dtype="fp8"))
    chunked = dict(fp32, rounds=2, mla_cpu_chunked_prefill=True, engine=dict(
        ENGINE, max_num_batched_tokens=32, enable_prefix_caching=True))
    ours = run_engines([fp32, bf16, fp8, chunked], ours=True)
    theirs = run_engines([fp32, bf16], ours=False)
    return ours, theirs, _transformers(fp32["model"], FP32_PROMPTS, MAX_TOKENS)


def test_mla_tokens_equal_transformers_and_vllm_cpu_mla(served):
    (ours, _, _, _), (theirs, _), (ref_tokens, ref_lps) = served
    assert ours["tokens"] == theirs["tokens"], "ours vs vLLM's CPU_MLA"
    assert ours["tokens"] == ref_tokens, "ours vs transformers"
    for got, want, ref in zip(ours["logprobs"], theirs["logprobs"], ref_lps):
        assert max(abs(x - y) for x, y in zip(got, want)) <= LOGPROB_TOL
        assert max(abs(x - y) for x, y in zip(got, ref)) <= LOGPROB_TOL


def test_mla_bf16_and_an_fp8_cache(served):
    """bf16: CPU_MLA's tokens. An FP8 latent cache (ours only): the first token of each prompt
    comes from the prefill, which reads the new tokens' exact latents, so it is bf16's; the
    decode steps read the quantized cache (e4m3 on random weights: the tokens part later)."""
    (_, bf16, fp8, _), (_, their_bf16), _ = served
    assert bf16["tokens"] == their_bf16["tokens"]
    for got, want in zip(bf16["logprobs"], their_bf16["logprobs"]):
        assert max(abs(x - y) for x, y in zip(got, want)) <= BF16_LOGPROB_TOL
    assert [t[0] for t in fp8["tokens"]] == [t[0] for t in bf16["tokens"]]
    assert all(len(t) == MAX_TOKENS for t in fp8["tokens"])


def test_mla_served_by_ours_prefill_and_decode(served):
    """Not the tokens: the MLA layers' impl class and our call counters (prefill, every decode
    step, cache writes); vLLM's run has its own impl and none of our calls."""
    (ours, _, _, _), (theirs, _), _ = served
    (probe,), (their_probe,) = ours["probe"], theirs["probe"]
    assert probe["impls"] == ["TritonFusedMLAImpl"], probe
    calls = probe["calls"]
    layers = 2
    assert calls["mla_prefill"] >= layers, calls
    assert calls["mla_decode"] >= layers * (MAX_TOKENS - 1), calls   # every decode step
    assert calls["mla_cache_write"] >= layers * MAX_TOKENS, calls
    assert their_probe["impls"] == ["CPUMLAImpl"] and not their_probe["calls"], their_probe


def _max_gap(a, b):
    return max(max(abs(x - y) for x, y in zip(got, want)) for got, want in zip(a, b))


def test_mla_chunked_prefill_and_prefix_cache_hits(served):
    """A configuration vLLM's CPU platform refuses for MLA by default (driver.py's
    ``mla_cpu_chunked_prefill`` keeps it): 32-token steps, so the 40-, 67- and 69-token
    prompts are prefilled in chunks (a later chunk reads the earlier chunks' latents from the
    pages), and a second round of the same prompts whose full pages are prefix-cache hits.
    Both rounds: transformers' tokens, as close in logprobs as CPU_MLA's non-chunked engine
    is (+ LOGPROB_TOL); our non-chunked engine's tokens, logprobs within LOGPROB_TOL."""
    (plain, _, _, chunked), (theirs, _), (ref_tokens, ref_lps) = served
    (probe,) = chunked["probe"]
    assert probe["impls"] == ["TritonFusedMLAImpl"], probe
    assert probe["calls"]["mla_prefill_context"] > 0, probe["calls"]   # cached context read
    n = len(FP32_PROMPTS)
    # second round: every full page of each prompt from the prefix cache (none for 5 tokens)
    hits = [len(p) // MLA_PAGE * MLA_PAGE for p in FP32_PROMPTS]
    assert chunked["cached"][n:] == hits and hits[2:] == [32, 64, 64], chunked["cached"]
    their_gap = _max_gap(theirs["logprobs"], ref_lps)
    for r in range(2):
        tokens, lps = chunked["tokens"][r * n:(r + 1) * n], chunked["logprobs"][r * n:(r + 1) * n]
        assert tokens == ref_tokens, f"round {r}: ours chunked vs transformers"
        assert tokens == plain["tokens"], f"round {r}: ours chunked vs ours not chunked"
        assert _max_gap(lps, ref_lps) <= max(their_gap, LOGPROB_TOL), r
        assert _max_gap(lps, plain["logprobs"]) <= LOGPROB_TOL, r


def test_triton_interpreter_serves_mla(models):
    """TRITON_INTERPRET=1: the Triton kernels themselves (packed prefill over 192-wide q/k and
    128-wide v; paged decode and its split-KV form, 2 splits forced, over the 576-wide
    latent with values its first 512 columns) serve the engine: transformers' tokens."""
    prompts, max_tokens = PROMPTS[:2], 3
    run = dict(model=models["deepseek_v3"], prompts=prompts, max_tokens=max_tokens,
               engine=ENGINE)
    (res,) = run_engines([run], extra_env={"TRITON_INTERPRET": "1",
                                           "KERNELS_VLLM_DECODE_SPLITS": "2"})
    ref, ref_lps = _transformers(run["model"], prompts, max_tokens)
    assert res["tokens"] == ref
    for got, want in zip(res["logprobs"], ref_lps):
        assert max(abs(x - y) for x, y in zip(got, want)) <= LOGPROB_TOL
    calls = res["probe"][0]["calls"]
    assert calls["mla_prefill"] > 0 and calls["mla_decode"] > 0, calls
