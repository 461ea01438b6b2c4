"""Engine runs for tests/vllm_backend: each in a subprocess of its own (vLLM caches its
backend choice per process), with a deadline."""
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Each engine subprocess imports vLLM (~20 s), starts engines (~6-40 s each) and generates.
ENGINE_DEADLINE_S = 600
# Prompts of several lengths (token ids: the engines run without a tokenizer).
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 17, 40))]


def run_engines(runs, *, ours=True, extra_env=None, timeout=ENGINE_DEADLINE_S, fails=False):
    """Run ``runs`` (driver.py's spec) in a fresh process, our backend in CPU_ATTN's place
    when ``ours`` (KERNELS_VLLM=1: the installed entry point does it); their results (with
    ``fails``: the output of a process that must fail)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KERNELS_VLLM", "TRITON_INTERPRET")}
    # (insecure serialization: the driver's probe is a function sent to vLLM's worker
    # processes by ``LLM.apply_model``; a test's own engine only)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", KERNELS_VLLM="1" if ours else "0")
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, str(HERE / "driver.py"), json.dumps({"runs": runs})],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if fails:   # a run that must stop: its output, for the test to read the reason
        assert proc.returncode != 0, proc.stdout[-3000:]
        return proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, (
        f"engine process failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT:"):])
