"""Context-parallel ring attention (kernels.distributed) on CPU: gloo, spawned processes.

Each launch starts ``world`` processes of this very file (``python test_distributed.py
--worker SPEC OUT``, a free port per launch, a deadline: a launch that is not done in time is
killed and fails, so nothing here can hang). A worker runs a list of cases: full inputs drawn
from a fixed seed on every rank, ``shard`` -> ``ring_attention`` -> backward -> ``unshard``;
rank 0 also runs the single-process ``kernels.attention`` on the full sequence. The parent
checks, per case, the gathered output and q/k/v gradients against the float64 oracle with the
parity rule (dropout through ``reference.dropout_keep_mask`` of the whole sequence: the union
of the ranks' masks must be the single-device mask), and against the single-process kernel.

Most launches run the PyTorch fallback (TRITON_INTERPRET unset in the children); one tiny
launch runs the Triton kernels in the interpreter (TRITON_INTERPRET=1 in the child's
environment, before it imports kernels).
"""
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parents[1]
CHILD_TIMEOUT_S = 45            # gloo's own timeout in the workers: a stuck collective ends
SEED, P = 2 ** 40 + 5, 0.25
DRAW_SEED = 4242                # rank 0's torch.manual_seed for the seed=None case

# --------------------------------------------------------------------------------------------
# Cases: (launch, name) -> options. Shapes are (batch, heads_q, heads_kv, seq, head_dim).
# --------------------------------------------------------------------------------------------
LAUNCHES = {
    "w2": dict(world=2, interpret=False, cases={
        "zigzag-causal-fp32": dict(shape=(2, 2, 2, 32, 16)),
        "zigzag-full-gqa-fp32": dict(shape=(1, 4, 2, 24, 16), causal=False),
        "zigzag-causal-gqa-bf16-dropout": dict(shape=(1, 4, 1, 32, 16), dtype="bfloat16", p=P),
        "zigzag-causal-dropout-seed-none": dict(shape=(1, 2, 2, 16, 8), p=0.3, seed=None),
        "contiguous-causal-fp16-dropout": dict(shape=(1, 2, 1, 16, 16), dtype="float16", p=0.1,
                                               layout="contiguous"),
        "contiguous-full-fp32-scale": dict(shape=(2, 2, 2, 10, 8), causal=False,
                                           layout="contiguous", scale=0.3),
        # Chunks of 2 and 6 tokens: key blocks start inside the 4-column Philox groups.
        "zigzag-chunk2-causal-dropout": dict(shape=(1, 2, 1, 8, 8), p=P),
        "contiguous-chunk6-full-dropout": dict(shape=(1, 2, 2, 12, 8), p=P, causal=False,
                                               layout="contiguous"),
    }),
    "w4": dict(world=4, interpret=False, cases={
        "zigzag-causal-fp32": dict(shape=(1, 2, 2, 40, 16)),
        "zigzag-causal-gqa-fp32-dropout": dict(shape=(1, 4, 2, 64, 8), p=P),
        "zigzag-full-bf16-dropout": dict(shape=(1, 2, 1, 32, 16), causal=False, p=0.1,
                                         dtype="bfloat16"),
        "contiguous-causal-gqa-fp32": dict(shape=(1, 4, 2, 20, 16), layout="contiguous"),
        "two-groups-zigzag-causal-dropout": dict(shape=(1, 2, 2, 16, 8), p=P, groups=2),
        "zigzag-chunk6-causal-gqa-dropout": dict(shape=(1, 4, 2, 48, 8), p=P),
        "contiguous-chunk2-causal-dropout": dict(shape=(1, 2, 1, 8, 8), p=P,
                                                 layout="contiguous"),
    }),
    "w3": dict(world=3, interpret=False, cases={
        "contiguous-causal-gqa-fp32-dropout": dict(shape=(1, 4, 2, 24, 16), p=P,
                                                   layout="contiguous"),
        "contiguous-full-fp32": dict(shape=(2, 2, 2, 21, 8), causal=False, layout="contiguous"),
        "contiguous-causal-bf16": dict(shape=(1, 2, 2, 27, 16), dtype="bfloat16",
                                       layout="contiguous"),
        "zigzag-causal-fp32-dropout": dict(shape=(1, 2, 1, 24, 8), p=P),
    }),
    "w2-interpreter": dict(world=2, interpret=True, cases={
        "zigzag-causal-gqa-fp32-dropout": dict(shape=(1, 2, 1, 16, 16), p=P),
        "zigzag-chunk6-causal-dropout": dict(shape=(1, 2, 1, 24, 8), p=P),
    }),
}
CASES = [(launch, name) for launch, spec in LAUNCHES.items() for name in spec["cases"]]


# --------------------------------------------------------------------------------------------
# Worker side (a child process of one launch)
# --------------------------------------------------------------------------------------------
def _inputs(case, index, dtype):
    b, h, hk, s, d = case["shape"]
    gen = torch.Generator().manual_seed(1000 + index)
    return [torch.randn(*shape, generator=gen).to(dtype)
            for shape in ((b, h, s, d), (b, hk, s, d), (b, hk, s, d), (b, h, s, d))]


def _run_case(case, index, rank, world, groups):
    import kernels
    import kernels.distributed as kd

    dtype = getattr(torch, case.get("dtype", "float32"))
    q, k, v, do = _inputs(case, index, dtype)
    layout, causal = case.get("layout", "zigzag"), case.get("causal", True)
    p, seed, scale = case.get("p", 0.0), case.get("seed", SEED), case.get("scale")
    group = groups[rank * len(groups) // world] if case.get("groups") else None
    leaves = [kd.shard(t, group, layout).detach().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(DRAW_SEED + rank)     # only rank 0's draw may count (seed=None)
    out = kd.ring_attention(*leaves, group=group, causal=causal, dropout_p=p,
                            softmax_scale=scale, seed=seed, layout=layout)
    out.backward(kd.shard(do, group, layout))
    got = [kd.unshard(t, group, layout) for t in (out, *(x.grad for x in leaves))]
    layouts_ok = all(x.dtype == dtype for x in (out, *(x.grad for x in leaves)))
    if dist_rank(group) != 0:
        return None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(DRAW_SEED)
    single = kernels.attention(*full, causal=causal, dropout_p=p, softmax_scale=scale,
                               seed=seed)
    single.backward(do)
    return dict(inputs=(q, k, v, do), ring=got, single=[single.detach()] + [
        x.grad for x in full], dtypes_ok=layouts_ok)


def dist_rank(group):
    import torch.distributed as dist
    return dist.get_rank(group)


def _shard_indices(world, rank):
    """Which global positions ``shard`` gives this rank, per layout (arange through it)."""
    import kernels.distributed as kd
    s = 4 * world
    x = torch.arange(s).view(1, 1, s, 1)
    return {layout: kd.shard(x, layout=layout).flatten().tolist()
            for layout in ("zigzag", "contiguous")}


# Bad input, run on every rank of a 3-rank launch: (scenario, per-rank kwargs changes).
def _bad_call(name, rank, world):
    import kernels.distributed as kd

    def t(n=8, d=8, dtype=torch.float32, heads=2):
        return torch.randn(1, heads, n, d, dtype=dtype)

    q, k, v, kw = t(), t(), t(), dict(causal=True)
    if name == "length" and rank == 1:
        q, k, v = t(10), t(10), t(10)
    elif name == "float64" and rank == 1:
        q, k, v = (x.double() for x in (q, k, v))
    elif name == "head_dim" and rank == 2:
        k, v = t(d=4), t(d=4)
    elif name == "dtype_mix" and rank == 1:
        q, k, v = (x.bfloat16() for x in (q, k, v))
    elif name == "odd_zigzag":
        q, k, v = t(7), t(7), t(7)
    elif name == "seed":
        kw.update(dropout_p=0.1, seed=rank)
    elif name == "layout" and rank == 0:
        kw.update(layout="ring")
    elif name == "causal" and rank == 2:
        kw.update(causal=False)
    elif name == "fatal" and rank == 1:
        q = q[0]
    if name == "unshard":
        return kd.unshard(t(10 if rank == 1 else 8))
    if name == "shard":
        return kd.shard(t(25))
    return kd.ring_attention(q, k, v, **kw)


BAD = {   # scenario -> {rank: expected message regex} ("*": every other rank)
    "length": {"*": r"disagree on shard length.*rank 1: 10"},
    "float64": {1: r"rank 1 of 3\): q must be float16, bfloat16, float32",
                "*": r"rank\(s\) \[1\] of the group of 3 rejected"},
    "head_dim": {2: r"rank 2 of 3\): q and k must have the same head_dim",
                 "*": r"rank\(s\) \[2\] of the group of 3 rejected"},
    "dtype_mix": {"*": r"disagree on dtype.*rank 1: torch.bfloat16"},
    "odd_zigzag": {"*": r"length must be even, got 7"},
    "seed": {"*": r"disagree on seed \(rank 0: 0, rank 1: 1, rank 2: 2\)"},
    "layout": {0: r"layout must be 'zigzag' or 'contiguous', got 'ring'",
               "*": r"rank\(s\) \[0\] of the group of 3 rejected"},
    "causal": {"*": r"disagree on causal.*rank 2: False"},
    "unshard": {"*": r"unshard: the ranks disagree on size of dim 2"},
    "shard": {"*": r"length 25 \(dim 2\) does not split into 6 equal chunks"},
}


def _worker(spec_path, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=CHILD_TIMEOUT_S))
    import kernels  # noqa: F401  (after the environment is final: TRITON_INTERPRET)
    from kernels.core.common import KERNELS_INTERPRETED
    out = {"shards": _shard_indices(world, rank), "interpreted": KERNELS_INTERPRETED}
    if spec["kind"] == "cases":
        # Every rank calls new_group for every group; ranks [0, W/2) and [W/2, W).
        groups = [dist.new_group(list(range(i * world // 2, (i + 1) * world // 2)))
                  for i in range(2)] if world % 2 == 0 else []
        for index, (name, case) in enumerate(spec["cases"].items()):
            out[name] = _run_case(case, index, rank, world, groups)
    else:
        errors = {}
        for name in BAD:
            start = time.monotonic()
            try:
                _bad_call(name, rank, world)
                errors[name] = ("no error", "", time.monotonic() - start)
            except Exception as e:  # noqa: BLE001
                errors[name] = (type(e).__name__, str(e), time.monotonic() - start)
        out["errors"] = errors
        # The group is still usable after all that: a good call runs the ring.
        q = torch.randn(1, 2, 8, 8)
        out["after"] = bool(torch.isfinite(
            kernels.distributed.ring_attention(q, q, q)).all())
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        _bad_call("fatal", rank, world)     # uncaught: every rank must exit with an error
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp, world, spec, *, interpret=False, timeout=60, expect_ok=True):
    """Run ``world`` workers; returns (per-rank results, return codes, stderr texts, seconds).
    Kills every worker and fails when the deadline passes."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(world):
        log = open(tmp / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path),
             str(tmp)], env=dict(env, RANK=str(rank)), stdout=log, stderr=subprocess.STDOUT,
            cwd=str(ROOT)))
    try:
        while any(p.poll() is None for p in procs):
            elapsed = time.monotonic() - start
            failed = expect_ok and any(p.poll() not in (None, 0) for p in procs)
            if elapsed > timeout or failed:
                time.sleep(0.5 if failed else 0)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    seconds = time.monotonic() - start
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    codes = [p.returncode for p in procs]
    if expect_ok and codes != [0] * world:
        raise AssertionError(f"launch of {world} ranks failed (codes {codes}, {seconds:.1f} s):\n"
                             + "\n".join(f"--- rank {r} ---\n{t[-3000:]}"
                                         for r, t in enumerate(texts)))
    results = [torch.load(tmp / f"rank{r}.pt", weights_only=False)
               if (tmp / f"rank{r}.pt").exists() else None for r in range(world)]
    return results, codes, texts, seconds


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    # The worker leaves through os._exit, skipping interpreter finalization: gloo's worker
    # threads may still be releasing a finished collective's tensors, and a thread that takes
    # the GIL while the interpreter finalizes aborts the process ("terminate called without an
    # active exception", SIGABRT; ~1 launch in 10 of the w3 launch on 2 cores, torch 2.13;
    # pytorch/pytorch#190489). destroy_process_group() does not join those threads.
    code = 0
    try:
        _worker(sys.argv[2], sys.argv[3])
    except BaseException:  # noqa: BLE001 -- an uncaught error must still fail the rank
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

import pytest  # noqa: E402
from helpers import (GRAD_FACTOR, assert_parity, fa2_oracle,  # noqa: E402
                     interpreter_unusable_reason)

import reference  # noqa: E402
from reference.parity import parity_budget  # noqa: E402


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Each launch runs once per module, when a test first needs it."""
    cache = {}

    def get(launch):
        if launch not in cache:
            spec = LAUNCHES[launch]
            results, _, _, seconds = _launch(
                tmp_path_factory.mktemp(launch), spec["world"],
                dict(kind="cases", cases=spec["cases"]), interpret=spec["interpret"],
                timeout=120 if spec["interpret"] else 60)
            cache[launch] = results
        return cache[launch]
    return get


def _lse64(q, k, causal, scale):
    group = q.shape[1] // k.shape[1]
    s = scale * (q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2))
    if causal:
        s = s.masked_fill(~reference.causal_mask(q.shape[2], k.shape[2]), float("-inf"))
    return torch.logsumexp(s, -1)


def _check(case, res):
    q, k, v, do = res["inputs"]
    b, h, _, s, d = case["shape"]
    causal, p = case.get("causal", True), case.get("p", 0.0)
    scale = case.get("scale") or 1.0 / math.sqrt(d)
    seed = case.get("seed", SEED)
    if p and seed is None:                  # what rank 0 drew after torch.manual_seed
        torch.manual_seed(DRAW_SEED)
        seed = int(torch.randint(0, 2 ** 63 - 1, (), dtype=torch.int64))
    keep = reference.dropout_keep_mask(seed, b, h, s, s, p) if p else None
    kw = dict(causal=causal, softmax_scale=scale, dropout_p=p, keep_mask=keep)
    leaves = {up: [t.detach().clone().requires_grad_() for t in (q, k, v)]
              for up in (True, False)}
    ref, lowp = (reference.attention(*leaves[up], upcast=up, **kw) for up in (True, False))
    ref_g = torch.autograd.grad(ref, leaves[True], do.double())
    lowp_g = torch.autograd.grad(lowp, leaves[False], do)
    assert res["dtypes_ok"], "ring outputs/gradients in the inputs' dtype"
    for who in ("ring", "single"):
        out, *grads = res[who]
        assert_parity(out, ref.detach(), lowp.detach(), name=f"{who} output")
        given_o, noise = fa2_oracle(q, k, v, do, out, _lse64(q, k, causal, scale), **kw)
        for name, g, r, lp, e, n in zip(("dq", "dk", "dv"), grads, ref_g, lowp_g, given_o,
                                        noise):
            inherited = (e - r).abs().max().item()
            assert_parity(g, r, lp, factor=GRAD_FACTOR, extra=inherited + n,
                          name=f"{who} {name}")
    # Ring vs the single-process kernel: within the parity budget of the output itself.
    for name, got, single, r, lp in zip(("out", "dq", "dk", "dv"), res["ring"], res["single"],
                                        (ref.detach(), *ref_g),
                                        (lowp.detach(), *lowp_g)):
        _, budget = parity_budget(single, r, lp, factor=GRAD_FACTOR if name != "out" else 2.0)
        err = (got.double() - single.double()).abs().max().item()
        assert err <= budget, f"ring {name} vs single-process kernel: {err:.3e} > {budget:.3e}"


@pytest.mark.parametrize("launch,name", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_ring_matches_single_device(launched, launch, name):
    """Output and q/k/v gradients gathered from the ranks = the single-process kernel and the
    float64 oracle (parity rule); with dropout, the oracle uses the whole sequence's mask."""
    if LAUNCHES[launch]["interpret"] and interpreter_unusable_reason():
        pytest.skip(interpreter_unusable_reason())
    results = launched(launch)
    case = LAUNCHES[launch]["cases"][name]
    assert all(r["interpreted"] == LAUNCHES[launch]["interpret"] for r in results)
    holders = [r[name] for r in results if r[name] is not None]
    assert len(holders) == case.get("groups", 1)      # group rank 0 of each group
    for res in holders:
        _check(case, res)


@pytest.mark.parametrize("launch", ["w2", "w3", "w4"])
def test_shard_layouts(launched, launch):
    """zigzag: rank r holds chunks r and 2W-1-r of 2W; contiguous: chunk r of W."""
    results = launched(launch)
    world = len(results)
    c2, c1 = 2, 4                                    # chunk lengths of a 4W sequence
    for rank, res in enumerate(results):
        zz = [*range(rank * c2, (rank + 1) * c2),
              *range((2 * world - 1 - rank) * c2, (2 * world - rank) * c2)]
        assert res["shards"]["zigzag"] == zz
        assert res["shards"]["contiguous"] == list(range(rank * c1, (rank + 1) * c1))


def test_bad_input_on_one_rank_ends_every_rank(tmp_path):
    """Bad input on one rank (or ranks that disagree) raises on every rank, at once, before
    any ring traffic; the group stays usable; an uncaught error exits every rank."""
    world = 3
    results, codes, texts, seconds = _launch(tmp_path, world, dict(kind="errors"),
                                             timeout=60, expect_ok=False)
    assert seconds < 60, "the launch hit its deadline: some rank hung"
    assert all(c not in (0, None) for c in codes), f"every rank must fail: codes {codes}"
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} did not get through the scenarios:\n{texts[rank]}"
        assert res["after"]
        for scenario, expected in BAD.items():
            kind, message, elapsed = res["errors"][scenario]
            pattern = expected.get(rank, expected["*"])
            assert kind != "no error", f"{scenario}: rank {rank} raised nothing"
            assert re.search(pattern, message, re.S), (
                f"{scenario}: rank {rank} raised {kind}: {message!r}, expected /{pattern}/")
            assert elapsed < 10, f"{scenario}: rank {rank} took {elapsed:.1f} s"
        assert "fatal" not in res["errors"]
    assert re.search(r"rank 1 of 3\): q must be 4-D", texts[1])
    for rank in (0, 2):
        assert re.search(r"rank\(s\) \[1\] of the group of 3 rejected", texts[rank])


def _single_process_group(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=timedelta(seconds=30))
    return dist


def test_group_of_one_is_plain_attention(tmp_path, monkeypatch):
    """A group of size 1: ring_attention is kernels.attention (same mask, same draw of the
    seed), shard/unshard are the identity. Fallback path, in this process."""
    import kernels
    import kernels.distributed as kd
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", True)
    dist = _single_process_group(tmp_path)
    try:
        q, k, v, do = (torch.randn(1, 2, 12, 8) for _ in range(4))
        got = []
        for fn in (kd.ring_attention, kernels.attention):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            torch.manual_seed(7)
            out = fn(*leaves, dropout_p=0.2)
            out.backward(do)
            got.append([out, *(x.grad for x in leaves)])
        for a, b in zip(*got):
            assert torch.equal(a, b)
        assert torch.equal(kd.unshard(kd.shard(q)), q)
        with pytest.raises(ValueError, match="layout must be"):
            kd.ring_attention(q, k, v, layout="ring")
    finally:
        dist.destroy_process_group()


def test_needs_an_initialized_process_group():
    import torch.distributed as dist

    import kernels.distributed as kd
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    q = torch.randn(1, 1, 8, 8)
    for fn in (lambda: kd.ring_attention(q, q, q), lambda: kd.shard(q), lambda: kd.unshard(q)):
        with pytest.raises(RuntimeError, match="init_process_group"):
            fn()


@pytest.mark.parametrize("option,value", [("softcap", 30.0), ("chunk_size", 4), ("window", 3),
                                          ("sinks", "tensor"), ("alibi_slopes", "tensor")])
def test_unsupported_options_are_refused_by_name(option, value):
    """kernels.attention's options that the ring does not pass on: a clear error before any
    process-group work, naming the option; a misspelled keyword stays a TypeError."""
    import kernels.distributed as kd
    q = torch.randn(1, 2, 8, 8)
    value = torch.zeros(2) if value == "tensor" else value
    with pytest.raises(NotImplementedError, match=f"ring_attention does not support {option}"):
        kd.ring_attention(q, q, q, **{option: value})
    with pytest.raises(TypeError, match="unexpected keyword"):
        kd.ring_attention(q, q, q, softcapp=1.0)
