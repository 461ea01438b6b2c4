"""A launch with no config the GPU can load runs the PyTorch fallback for its signature, warned
once, instead of failing the call.

Triton raises ``OutOfResources`` at a kernel's load when its shared memory passes the GPU's
per-block limit; when every config the pruning kept does (fp32 at head_dim 512 on GPUs with
99 KiB per block: the backward's smallest tiles need 128-129 KiB, docs/features.md), the
launch can never run there. Here the plans' launches raise it as Triton does, before anything
is launched, and the results must still match the float64 oracle: a failing forward (the
whole call on the fallback), a failing backward after a kernel forward (the fallback's
backward from the kernel's o and lse, dropout mask included), a failing KV-cache forward (the
fallback appends and attends).
"""
import warnings

import pytest
import torch
from helpers import DEVICE, assert_parity, check_dense, interpreter_unusable_reason, randn
from triton.runtime.errors import OutOfResources

import kernels
import reference
from kernels.core import backend

F32 = torch.float32


@pytest.fixture(autouse=True)
def _kernel_route(monkeypatch):
    """The kernel route (its plans are what fails), fresh plans and notices per test."""
    if DEVICE == "cpu" and interpreter_unusable_reason():
        pytest.skip(interpreter_unusable_reason())
    kernels.plans.clear()
    monkeypatch.setattr(backend, "_warned_unfit", set())
    yield
    kernels.plans.clear()


def _unloadable(monkeypatch, plan_class):
    """Make every launch of ``plan_class`` fail as an unloadable kernel does; returns the list
    of attempts."""
    attempts = []

    def launch(self, *args, **kwargs):
        attempts.append(plan_class.__name__)
        raise OutOfResources(132096, 101376, "shared memory")

    monkeypatch.setattr(plan_class, "__call__", launch)
    return attempts


@pytest.mark.parametrize("launch,plan_class", [("forward", backend.ForwardPlan),
                                               ("backward", backend.BackwardPlan)])
def test_unloadable_launch_runs_the_fallback(launch, plan_class, monkeypatch):
    attempts = _unloadable(monkeypatch, plan_class)
    kernel_forwards = []
    if launch == "backward":   # count the kernel forwards
        run = backend.ForwardPlan.__call__
        monkeypatch.setattr(backend.ForwardPlan, "__call__", lambda self, *a, **kw: (
            kernel_forwards.append(1), run(self, *a, **kw))[1])
    with pytest.warns(RuntimeWarning, match=f"no launch config of the Triton {launch} loads"):
        check_dense(1, 4, 2, 33, 33, 16, F32, dropout_p=0.2, seed=11)
    assert len(attempts) == 1
    # That pass stays on the fallback: no second attempt, no second warning. A failing
    # backward leaves the forward on the kernel.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        check_dense(1, 4, 2, 33, 33, 16, F32, dropout_p=0.2, seed=12)
    assert len(attempts) == 1
    assert len(kernel_forwards) == (2 if launch == "backward" else 0)


def test_unloadable_kvcache_launch_runs_the_fallback(monkeypatch):
    attempts = _unloadable(monkeypatch, backend.KVCachePlan)
    b, hq, hkv, q_len, max_len, d = 2, 4, 2, 3, 32, 16
    q = randn(b, hq, q_len, d)
    k, v = randn(b, hkv, q_len, d), randn(b, hkv, q_len, d)
    caches = [randn(b, hkv, max_len, d), randn(b, hkv, max_len, d)]
    lens = torch.tensor([5, 20], dtype=torch.int32, device=DEVICE)
    expected_caches = [c.clone() for c in caches]
    ref = reference.attention_with_kvcache(q, *expected_caches, lens, k, v)
    lowp = reference.attention_with_kvcache(q, *[c.clone() for c in caches], lens, k, v,
                                            upcast=False)
    with pytest.warns(RuntimeWarning, match="no launch config of the Triton KV-cache forward"):
        out = kernels.attention_with_kvcache(q, *caches, lens, k, v)
    assert attempts == ["KVCachePlan"]
    assert_parity(out, ref, lowp)
    for got, expected in zip(caches, expected_caches):
        assert torch.equal(got, expected)      # the new rows appended once, in place
