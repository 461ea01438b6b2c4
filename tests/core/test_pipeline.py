"""The call pipeline (kernels/pipeline.py): the plan cache, one description of a call carried
through the custom ops, the compiled route's plans, and the torch.func transforms."""
import threading

import pytest
import torch
from helpers import DEVICE, GRAD_FACTOR, assert_parity

import reference

import kernels
from kernels import pipeline
from kernels.core.call import AttentionCall, call_spec, parse_spec
from kernels.core.mods import SOFTCAP, CallMods


# ------------------------------------------------------------------------------ plan cache
def test_plan_cache_lru_stats_clear():
    cache = pipeline.PlanCache(maxsize=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1          # "a" is now the most recent
    cache.put("c", 3)                   # evicts "b", the least recently used
    assert cache.get("b") is None and cache.get("c") == 3 and cache.get("a") == 1
    assert cache.stats() == dict(hits=3, misses=1, evictions=1, size=2, maxsize=2)
    cache.clear()
    assert len(cache) == 0 and cache.get("a") is None


def test_plan_cache_is_the_public_one_and_bounded(monkeypatch):
    """``kernels.plans`` holds every entry point's plans; past ``maxsize`` the oldest go."""
    monkeypatch.setattr(kernels.plans, "maxsize", 2)
    kernels.plans.clear()
    before = kernels.plans.stats()
    for n in (5, 6, 7):
        q = torch.randn(1, 1, n, 8, device=DEVICE)
        kernels.attention(q, q, q)
    stats = kernels.plans.stats()
    assert stats["size"] == 2 and stats["evictions"] - before["evictions"] == 1
    q = torch.randn(1, 1, 7, 8, device=DEVICE)
    kernels.attention(q, q, q)
    assert kernels.plans.stats()["hits"] == stats["hits"] + 1


@pytest.mark.skipif(DEVICE != "cpu", reason="threads over the CPU fallback (fast)")
def test_plan_cache_threads(monkeypatch):
    """Several threads calling at once, with a cache small enough to evict while they run:
    every result equals the single-threaded one, and the cache stays consistent."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("kernels.core.backend._warned_fallback", True)
    monkeypatch.setattr(kernels.plans, "maxsize", 3)
    gen = torch.Generator().manual_seed(0)
    inputs = [tuple(torch.randn(2, 2, n, 16, generator=gen) for _ in range(3))
              for n in (3, 9, 17, 33, 40)]
    expected = [kernels.attention(*x, dropout_p=0.2, seed=i) for i, x in enumerate(inputs)]
    errors, results = [], {}

    def worker(w):
        try:
            for r in range(20):
                i = (w + r) % len(inputs)
                out = kernels.attention(*inputs[i], dropout_p=0.2, seed=i)
                results.setdefault((w, i), []).append(torch.equal(out, expected[i]))
        except Exception as e:   # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    assert results and all(all(v) for v in results.values())
    stats = kernels.plans.stats()
    assert stats["size"] <= 3 and stats["evictions"] > 0


# ----------------------------------------------------------------- one description of a call
def test_call_spec_round_trip():
    """The custom ops carry a call as one string generated from its fields and read back."""
    call = AttentionCall(True, 0.125, 0.25, 0, 7, (40, 50, 3, 5), None,
                         CallMods(softcap=30.0, score_mod=SOFTCAP))
    back, num_splits = parse_spec(call_spec(call, 3))
    assert back == call and num_splits == 3
    plain = AttentionCall(False, 1 / 3)
    assert parse_spec(call_spec(plain))[0] == plain


def test_compiled_calls_use_the_plan_cache():
    """Under torch.compile the custom ops' bodies look their plan up: after the first compiled
    call, later ones are cache hits, and the results equal the eager call's."""
    q, k, v = (torch.randn(1, 2, 11, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    eager = kernels.attention(q, k, v)
    eager.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    f = torch.compile(lambda q, k, v: kernels.attention(q, k, v), backend="aot_eager",
                      fullgraph=True)
    f(q, k, v).sum().backward()
    for t in (q, k, v):
        t.grad = None
    hits = kernels.plans.stats()["hits"]
    out = f(q, k, v)
    out.sum().backward()
    assert kernels.plans.stats()["hits"] >= hits + 2   # the forward op's and the backward's
    assert torch.equal(out, eager)
    assert all(torch.equal(t.grad, g) for t, g in zip((q, k, v), grads))


# ---------------------------------------------------------------------- torch.func transforms
def _qkv(b, h, n, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=gen).to(DEVICE) for _ in range(3)]


def test_func_grad_matches_oracle():
    """torch.func.grad through the custom ops equals FlashAttention's rule against float64."""
    q, k, v = _qkv(2, 2, 13, 16, 1)
    do = torch.randn_like(q)
    grads = torch.func.grad(lambda q, k, v: (kernels.attention(q, k, v) * do).sum(),
                            argnums=(0, 1, 2))(q, k, v)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    torch.autograd.backward(reference.attention(*refs), do.double())
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.autograd.backward(reference.attention(*low, upcast=False), do)
    for g, r, lp, name in zip(grads, refs, low, "qkv"):
        assert_parity(g, r.grad, lp.grad, factor=GRAD_FACTOR, name=f"d{name}")


def test_func_vmap_and_per_sample_grads():
    """vmap folds the mapped dim into the batch (the same bits as the batched call);
    vmap(grad) gives per-sample gradients, each the gradient of that sample's own call."""
    q, k, v = _qkv(3, 2, 9, 8, 2)
    out = torch.func.vmap(lambda q, k, v: kernels.attention(q[None], k[None], v[None])[0])(
        q, k, v)
    assert torch.equal(out, kernels.attention(q, k, v))

    def loss(q, k, v):
        return kernels.attention(q[None], k[None], v[None]).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss))(q, k, v)
    for i in range(3):
        qi = q[i].clone().requires_grad_()
        loss(qi, k[i], v[i]).backward()
        torch.testing.assert_close(per_sample[i], qi.grad, rtol=1e-5, atol=1e-5)


def test_func_vmap_refuses_what_it_cannot_map():
    q = torch.randn(2, 7, 2, 8, device=DEVICE)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="vmap over kernels.attention"):
        torch.func.vmap(lambda q: kernels.attention_varlen(q, q, q, cu, cu))(q)


def test_compiled_self_attention_one_tensor():
    """q, k and v one tensor (Dynamo refuses an autograd.Function given a tensor twice): the
    compiled call gives the eager result and gradient."""
    x = torch.randn(1, 2, 9, 16, device=DEVICE, requires_grad=True)
    eager = kernels.attention(x, x, x)
    (grad,) = torch.autograd.grad(eager.sum(), x)
    f = torch.compile(lambda x: kernels.attention(x, x, x), fullgraph=True,
                      backend="aot_eager" if DEVICE == "cpu" else "inductor")
    out = f(x)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], grad)


def test_reimport_keeps_the_ops():
    """A second import of the package (a reload, a tool that re-imports it) registers its ops
    again over the first ones instead of failing."""
    code = ("import sys, torch, kernels\n"
            "q = torch.randn(1, 1, 5, 8)\n"
            "a = kernels.attention(q, q, q)\n"
            "for n in [m for m in sys.modules if m.split('.')[0] == 'kernels']:\n"
            "    del sys.modules[n]\n"
            "import kernels\n"
            "assert torch.equal(kernels.attention(q, q, q), a)\n"
            "print('ok')\n")
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_compiled_graphs_name_the_ops_revision(tmp_path):
    """A compiled graph calls the ops by an overload named after this version's op layer
    (``pipeline.op_revision``), so that Inductor's FX-graph cache, which keys graphs on their
    code and not on op schemas, never hands this version another version's graph."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = torch.randn(1, 2, 9, 16, device=DEVICE)
    torch.compile(lambda x: kernels.attention(x, x, x, causal=True), backend=backend,
                  fullgraph=True)(x)
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes
               if n.op == "call_function"}
    assert f"fused_attention.fwd.{pipeline._REVISION}" in targets, targets
    for op in (pipeline._fwd_op, pipeline._fwd_fp8_op, pipeline._bwd_op, pipeline._kvcache_op,
               pipeline._varlen_paged_op):
        assert op._overloadname == pipeline._REVISION
    # The revision follows the bytes of the files it hashes (a schema edit changes it).
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text('schema = "(Tensor q) -> Tensor"\n')
    b.write_text("spec = 1\n")
    first = pipeline.op_revision((a, b))
    assert first == pipeline.op_revision((a, b)) and first.startswith("r")
    a.write_text('schema = "(Tensor q, Tensor k) -> Tensor"\n')
    assert pipeline.op_revision((a, b)) != first
