"""The device script's dry run (benchmarks/gpu_check.sh with DRY_RUN=1): the commands of the
prepared device call go through their modules' own parsers on the CPU, so that a typo fails
here and not in a lent GPU call. Subprocesses only (the script sets up its own environment);
about 15-25 s on a busy 2-core machine."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.sh")


def _run_script(tmp_path, stages, **env):
    full = dict(os.environ, DRY_RUN="1", GPU_CHECK_STAGES=stages, PYTHON=sys.executable,
                GPU_CHECK_WORK=str(tmp_path / "work"), GPU_CHECK_PACK="1",
                GPU_CHECK_CACHE=str(tmp_path / "cache"), **env)
    full.pop("TRITON_CACHE_DIR", None)
    return subprocess.run(["bash", SCRIPT, str(tmp_path / "out")], env=full, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not os.path.exists("/bin/bash") and not os.path.exists("/usr/bin/bash"),
                    reason="needs bash")
def test_speed_stages_dry_run_validate_and_pack(tmp_path):
    r = _run_script(tmp_path, "sweep dropout")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # The sweep's plan as the GPU would run it: 7 lengths x 2 head dims x 3 modes x 5 providers.
    assert "providers ['kernels', 'sdpa_cudnn', 'sdpa_flash', 'flex', 'triton_tutorial']" in out
    assert "sweep 210 rows" in out
    assert "dropout [0.1]" in out
    for name in ("sweep (bf16, d128 + d64, dropout 0): exit 0",
                 "sweep with dropout 0.1: exit 0"):
        assert name in out
    # Each stage packed the work folder into the one file a device call brings back.
    assert (tmp_path / "out" / "results.tar").exists()
    assert (tmp_path / "out" / "check.log").exists()


def test_a_bad_argument_fails_the_dry_run(tmp_path):
    r = _run_script(tmp_path, "precompile", PRECOMPILE_ARGS="--seq-len 128")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-2000:]
    assert "unrecognized arguments: --seq-len 128" in out


def test_device_plan_rejects_unknown_provider_and_module():
    bad = subprocess.run([sys.executable, "-m", "tools.device_plan", "benchmarks",
                          "--providers", "kernels", "sdpa_flashh"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'sdpa_flashh'" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "tools.device_plan",
                              "benchmarks.hostt"], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 1 and "no module named" in missing.stderr


def test_precompile_plan_lists_the_run(tmp_path):
    # The tutorial is not in the repository: a stand-in file (the dry run only compiles it as
    # Python), and without one the tutorial is left out and said so.
    tutorial = tmp_path / "06-fused-attention.py"
    tutorial.write_text("def attention(*args):\n    pass\n")
    cmd = [sys.executable, "-m", "tools.precompile", "--dry-run", "--kinds", "tutorial", "flex"]
    r = subprocess.run(cmd + ["--tutorial", str(tutorial)], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    # 7 lengths x 2 head dims: one tutorial workload each, Flex's two graphs each.
    assert "42 workloads ({'ours': 0, 'tutorial': 14, 'flex': 28})" in r.stdout
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "not given (--tutorial PATH)" in r.stdout
    assert "28 workloads ({'ours': 0, 'tutorial': 0, 'flex': 28})" in r.stdout


@pytest.mark.skipif(not os.path.exists("/bin/bash") and not os.path.exists("/usr/bin/bash"),
                    reason="needs bash")
def test_host_stage_dry_run_parses_its_arguments(tmp_path):
    """The speed list's host stage (benchmarks/host.py on the GPU) goes through its parser."""
    r = _run_script(tmp_path, "host")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "benchmarks.host: {'device': 'cuda'" in out and "host cost per call: exit 0" in out


@pytest.mark.skipif(not os.path.exists("/bin/bash") and not os.path.exists("/usr/bin/bash"),
                    reason="needs bash")
def test_variants_list_dry_run(tmp_path):
    """The "variants" list: precompile with the persistent forward and the warp-specialised
    configs, the persistent A/B, the variants' tests, the warp-specialised run."""
    r = _run_script(tmp_path, "variants")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "tma1 persistent" in out and "tma1 warp_spec" in out   # the precompile plan
    for persist in (1, 0):
        assert f"persistent_ab KERNELS_FWD_PERSISTENT={persist}: exit 0" in out
    assert "variant tests (GPU): exit 0" in out
    assert "warpspec_ab KERNELS_FWD_WARP_SPEC=1: exit 0" in out
    assert "modes ['fwd']" in out


@pytest.mark.skipif(not os.path.exists("/bin/bash") and not os.path.exists("/usr/bin/bash"),
                    reason="needs bash")
def test_fuzz_stage_dry_run_parses_its_arguments(tmp_path):
    """Stage "fuzz" (tools/fuzz_parity.py on the GPU) goes through the tool's parser."""
    r = _run_script(tmp_path, "fuzz")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "tools.fuzz_parity: {" in out and "'device': 'cuda'" in out
    assert "'backends': 'kernel,compiled'" in out
    assert "fuzz (random calls vs the float64 oracle): exit 0" in out
