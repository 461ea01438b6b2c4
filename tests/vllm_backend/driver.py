"""Runs vLLM engines in this process and prints their greedy tokens and logprobs as one JSON
line after ``RESULT:`` (vLLM's shutdown logs may follow it). Used by
tests/vllm_backend/test_engine.py, one subprocess per attention-backend choice: vLLM caches
the backend selection per process.

    python tests/vllm_backend/driver.py '<json: {"runs": [run, ...]}>'

A run: {"model": dir, "prompts": [[ids]], "max_tokens": n, "rounds": r, "engine": {LLM
kwargs}}. For each, the result holds the tokens, each token's logprob, the prompt tokens
served from the prefix cache, and a probe of the engine's attention
layers (their impl classes and how often our backend's forward and cache writes ran), which
proves the backend that served it by something other than its tokens.
"""
import gc
import json
import os
import sys


def main(spec):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kernels.vllm
    results = []
    for run in spec["runs"]:
        engine = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                      max_model_len=256, seed=0)
        engine.update(run.get("engine", {}))
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
