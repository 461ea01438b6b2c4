"""Runs vLLM engines in this process and prints their greedy tokens and logprobs as one JSON
line after ``RESULT:`` (vLLM's shutdown logs may follow it). Used by
tests/vllm_backend/test_engine.py, one subprocess per attention-backend choice: vLLM caches
the backend selection per process.

    python tests/vllm_backend/driver.py '<json: {"runs": [run, ...]}>'

A run: {"model": dir, "prompts": [[ids]], "max_tokens": n, "rounds": r, "engine": {LLM
kwargs}, "mla_cpu_chunked_prefill": bool (``mla_cpu_chunked_prefill`` below)}. For each, the
result holds the tokens, each token's logprob, the prompt tokens served from the prefix
cache, and a probe of the engine's attention layers (their impl classes and how often our
backend's forward and cache writes ran), which proves the backend that served it by something
other than its tokens.
"""
import contextlib
import gc
import json
import os
import sys


@contextlib.contextmanager
def mla_cpu_chunked_prefill():
    """vLLM's CPU platform keeping chunked prefill and prefix caching for an MLA model, which
    it turns off unless the CPU has AMX (``CpuPlatform.check_and_update_config``: the
    scheduler's ``enable_chunked_prefill`` and ``max_num_batched_tokens``, the cache's
    ``enable_prefix_caching``). Only those three fields are given back their values from
    before the platform's hook, for MLA models, while the block runs; only for OUR MLA backend
    (KERNELS_VLLM=1): vLLM's CPU_MLA has no context support."""
    assert os.environ.get("KERNELS_VLLM") == "1", "chunked prefill on CPU MLA: ours only"
    from vllm.platforms.cpu import CpuPlatform
    hook = CpuPlatform.__dict__["check_and_update_config"]

    def check_and_update_config(cls, vllm_config):
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        kept = (sched.enable_chunked_prefill, sched.max_num_batched_tokens,
                cache.enable_prefix_caching)
        hook.__func__(cls, vllm_config)
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            (sched.enable_chunked_prefill, sched.max_num_batched_tokens,
             cache.enable_prefix_caching) = kept

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = hook


def main(spec):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kernels.vllm
    results = []
    for run in spec["runs"]:
        engine = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                      max_model_len=256, seed=0)
        engine.update(run.get("engine", {}))
        with (mla_cpu_chunked_prefill() if run.get("mla_cpu_chunked_prefill")
              else contextlib.nullcontext()):
            llm = LLM(model=run["model"], **engine)
        sampling = SamplingParams(max_tokens=run.get("max_tokens", 8), temperature=0.0,
                                  logprobs=0)
        tokens, logprobs, cached = [], [], []
        # "rounds": the same prompts again in the same engine: with prefix caching on, the
        # later rounds hit the blocks the first one filled (num_cached_tokens says how many).
        for _ in range(run.get("rounds", 1)):
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in run["prompts"]],
                                sampling, use_tqdm=False)
            for o in outs:
                c = o.outputs[0]
                tokens.append(list(c.token_ids))
                logprobs.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                cached.append(o.num_cached_tokens or 0)
        results.append({"tokens": tokens, "logprobs": logprobs, "cached": cached,
                        "probe": llm.apply_model(kernels.vllm.probe)})
        del llm
        gc.collect()
    print("RESULT:" + json.dumps(results), flush=True)


if __name__ == "__main__":   # vLLM's multiprocess mode spawns: the guard is needed
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main(json.loads(sys.argv[1]))
