"""Direct launches (kernels/core/launch.py ``KernelStep``) pass the same launch as Triton's own,
checked without a GPU.

After a plan's first launch through Triton, ``KernelStep`` calls the compiled kernel's launcher
itself with the arguments by position: Triton internals that change between versions. Here
Triton's real launcher runs on a stub libcuda (tests/stub_cuda.py) that records each launch:
function handle, stream, grid, block, shared memory, launch attributes and every kernel
parameter's bytes. Every ``KernelStep`` of the plans below launches twice with the same
per-call arguments (the same tensors, so pointers must match too): first through Triton
(``kernel[grid](**args)`` / the autotuner), then directly; the two records must be equal, bar
the global scratch pointer (a fresh buffer through Triton, the shared per-stream one directly:
both set where the variant needs scratch). The Triton launch's parameter bytes are also
decoded against the arguments by name, which checks the recording itself. A step then launches
directly with copies of its tensors (new pointers, decoded against them) and with its first
arguments again. Host tensor descriptors (TMA mode 3, forward and backward) are checked as
the rest: their expected parameters are the stub's tensor map of the tensor (address, shape,
strides, the compiled box), then shape and strides; planted bugs in ``launch._HostDesc`` (a
descriptor kept for one buffer served for another, a box one row short) must be found. Then
each plan is called a second time: every ``KernelStep`` must launch directly (only launches
outside a ``KernelStep`` may still go through Triton).

The compiled path needs TRITON_INTERPRET unset and the stub loaded at process start, so the
checks run in a subprocess (``python tests/core/test_direct_launch.py --child``) with a deadline.
A Triton whose launcher cannot be built without a GPU skips with the reason.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
CHILD_TIMEOUT = 300    # seconds; about 20-40 s on 2 cores (the C launchers are built here)
SKIP_EXIT = 3          # the child's exit status when the stub path cannot run here


# ------------------------------------------------------------------------------ the child
def _cases(torch):
    """(name, plan builder, call[, stub options]) of every plan kind; tiny fp16 shapes (nothing
    is computed). Stub options: ``lower_descriptors`` (``Stub``) for the variants the case
    compiles."""
    from kernels.core.backward import BackwardPlan
    from kernels.core.call import AttentionCall
    from kernels.core.forward import ForwardPlan
    from kernels.core.kvcache import KVCachePlan, SlotWritePlan, VarlenPagedPlan

    g = torch.Generator().manual_seed(0)
    f16 = torch.float16

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(f16)

    def call(dropout_p=0.0, causal=True):
        seed = torch.tensor(1234, dtype=torch.int64)   # one seed tensor: same pointer twice
        return AttentionCall(causal=causal, softmax_scale=0.125, dropout_p=dropout_p,
                             seed=seed)

    # Arguments of one kind differ (lengths, strides: v is (B, N, H, D) transposed), so that
    # two of them swapped would show.
    B, H, N, NK, D = 1, 2, 40, 56, 32
    q, k, v = rnd(B, H, N, D), rnd(B, H, NK, D), rnd(B, NK, H, D).transpose(1, 2)
    o, do = rnd(B, H, N, D), rnd(B, N, H, D).transpose(1, 2)
    lse = torch.zeros(B, H, N, dtype=torch.float32)
    # packed sequences: (total, heads, D) with cu_seqlens
    lens, lens_k = [13, 27], [21, 30]
    cu_q = torch.tensor([0, 13, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 21, 51], dtype=torch.int32)
    qp, op, dop = (rnd(sum(lens), H, D) for _ in range(3))
    kp, vp = rnd(sum(lens_k), H, D), rnd(sum(lens_k), H, D)
    lsep = torch.zeros(H, sum(lens), dtype=torch.float32)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    varlen_init = dict(varlen, max_seqlen_q=max(lens), max_seqlen_k=max(lens_k))
    # KV caches: dense (B, H_kv, L, D), paged (blocks, page, H_kv, D); decoding GQA q
    Hq, Hkv, L, page = 4, 2, 64, 16
    qd = rnd(2, Hq, 1, D)
    kc, vc = rnd(2, Hkv, L, D), rnd(2, Hkv, L, D)
    kn, vn = rnd(2, Hkv, 1, D), rnd(2, Hkv, 1, D)
    seqlens = torch.tensor([5, 30], dtype=torch.int32)
    kpg, vpg = rnd(8, page, Hkv, D), rnd(8, page, Hkv, D)
    table = torch.tensor([[3, 1, 6, 0], [2, 7, 4, 5]], dtype=torch.int32)
    qs = rnd(1, H, 4, D)      # split-KV over a longer key range
    ks, vs = rnd(1, H, 96, D), rnd(1, H, 96, D)

    def fwd(qq, kk, vv, c, init=None, per=None, **kw):
        init, per = init or {}, per or {}
        return (lambda: ForwardPlan(qq, kk, vv, c, **init, **kw),
                lambda plan: plan(qq, kk, vv, c, **per))

    def bwd(tensors, c, init=None, per=None, **kw):
        init, per = init or {}, per or {}
        return (lambda: BackwardPlan(*tensors, c, **init, **kw),
                lambda plan: plan(*tensors, c, **per))

    def kvc(c, table_=None, **kw):
        kk, vv = (kpg, vpg) if table_ is not None else (kc, vc)
        return (lambda: KVCachePlan(qd, kk, vv, seqlens, kn, vn, c, block_table=table_, **kw),
                lambda plan: plan(qd, kk, vv, seqlens, kn, vn, c, block_table=table_))

    # A serving step (kernels/vllm/): slot writes (int64 slots, -1 skipped) into the two
    # halves of one layer cache, then packed queries over the pages into a strided out.
    layer = rnd(8, page, Hkv, 2 * D)
    kl, vl = layer[..., :D], layer[..., D:]
    kt, vt = rnd(3, Hkv, D), rnd(3, Hkv, D)
    slots = torch.tensor([17, -1, 100], dtype=torch.int64)
    qv = rnd(5, Hq, D)
    out_v = rnd(5, Hq, D + 8)[..., :D]
    cu_v, used = torch.tensor([0, 1, 5], dtype=torch.int32), torch.tensor([9, 40],
                                                                            dtype=torch.int32)

    def serving_fwd(c):
        init = dict(cu_seqlens_q=cu_v, max_seqlen_q=4, seqused_k=used, block_table=table,
                    out=out_v)
        return (lambda: VarlenPagedPlan(qv, kl, vl, c, **init),
                lambda plan: plan(qv, kl, vl, c, cu_seqlens_q=cu_v, seqused_k=used,
                                  block_table=table, out=out_v))

    # Host descriptors (TMA mode 3): one per Q, K, V, made per call from the tensor. A head dim
    # of its own for the decomposed ones (a variant compiled anew, without TMA lowering).
    D2 = 64
    q2, k2, v2 = rnd(B, H, N, D2), rnd(B, NK, H, D2).transpose(1, 2), rnd(B, H, NK, D2)

    c0, cd = call(), call(dropout_p=0.1)
    return [
        ("fwd dense tma=3 (host descriptors)", *fwd(q, k, v, c0, tma=3)),
        ("fwd dense tma=3 (host descriptors) dropout non-causal",
         *fwd(q, k, v, call(0.1, causal=False), tma=3)),
        ("fwd dense tma=3 (host descriptors, not lowered to TMA: decomposed)",
         *fwd(q2, k2, v2, cd, tma=3), dict(lower_descriptors=False)),
        ("fwd dense tma=2", *fwd(q, k, v, c0, tma=2)),
        ("fwd dense tma=0 dropout", *fwd(q, k, v, cd, tma=0)),
        ("fwd dense tma=1 dropout non-causal", *fwd(q, k, v, call(0.1, causal=False), tma=1)),
        ("fwd packed tma=2 dropout", *fwd(qp, kp, vp, cd, varlen_init, varlen, tma=2)),
        ("fwd packed tma=0", *fwd(qp, kp, vp, c0, varlen_init, varlen, tma=0)),
        ("fwd split-KV (2 splits) + combine", *fwd(qs, ks, vs, call(causal=False),
                                                   num_splits=2, tma=2)),
        ("kvcache append + fwd (GQA packed)", *kvc(c0, num_splits=1)),
        ("kvcache append + fwd split-KV + combine", *kvc(c0, num_splits=2)),
        ("paged kvcache append + fwd", *kvc(c0, table, num_splits=1)),
        ("slot write (identity table, int64 slots)",
         lambda: SlotWritePlan(kl, vl, kt, vt),
         lambda plan: plan(kl, vl, kt, vt, slots)),
        ("paged varlen fwd into a strided out (a serving step)", *serving_fwd(c0)),
        ("bwd dense tma=3 (host descriptors)", *bwd((do, q, k, v, o, lse), c0, tma=3)),
        ("bwd dense tma=3 (host descriptors) dropout", *bwd((do, q, k, v, o, lse), cd, tma=3)),
        ("bwd dense tma=1", *bwd((do, q, k, v, o, lse), c0, tma=1)),
        ("bwd dense tma=0 dropout", *bwd((do, q, k, v, o, lse), cd, tma=0)),
        ("bwd dense tma=1 dropout", *bwd((do, q, k, v, o, lse), cd, tma=1)),
        ("bwd packed dropout", *bwd((dop, qp, kp, vp, op, lsep), cd, varlen_init, varlen,
                                    tma=0)),
        ("bwd packed tma=1", *bwd((dop, qp, kp, vp, op, lsep), c0, varlen_init, varlen,
                                  tma=1)),
    ]


def _flat(stub_cuda, name, ty, value, metas):
    """(label, type, value) of each launched (non-constexpr) parameter of argument ``name``. A
    host descriptor (``value``: its tensor, shape, strides) gives several, as its
    ``tensordesc_meta`` entry (the next of ``metas``) makes them."""
    if isinstance(ty, tuple):
        out = []
        for i, t in enumerate(ty):
            out += _flat(stub_cuda, f"{name}[{i}]", t, value[i], metas)
        return out
    if stub_cuda.parse_descriptor(ty):
        return [(name + suffix, t, v) for suffix, t, v
                in stub_cuda.descriptor_params(ty, next(metas, None), *value)]
    return [] if ty == "constexpr" else [(name, ty, value)]


# The host descriptors' blocks, by constexpr name or size, as ``forward.set_desc_blocks`` and
# ``backward.set_bwd_desc_blocks`` set them.
_DESC_BLOCKS = {"DESC_Q": (1, 1, "BLOCK_M", "BLOCK_D"), "DESC_K": (1, 1, "BLOCK_N", "BLOCK_D"),
                "DESC_V": (1, 1, "BLOCK_N", "BLOCK_DV"), "DESC_DO": (1, 1, "BLOCK_M", "BLOCK_DV"),
                "DESC_STATS": (2, 1, 1, "BLOCK_M")}


def _descriptor_errors(stub_cuda, src, step, per_call):
    """A step's host descriptors against their tensors, independently of the plan's layout:
    the tensor's shape, its strides (where a dimension has more than one entry: a single
    entry's stride is free), a unit last stride, and a block in the kernel's signature
    (what Triton compiled) of the config's tiles."""
    errors = []
    names = src.fn.arg_names
    constants = {names[k[0]] if isinstance(k, tuple) else k: v
                 for k, v in getattr(src, "constants", {}).items()}
    for name, (source, shape, strides) in step.descs.items():
        t = per_call[source]
        if list(shape) != list(t.shape) or strides[-1] != 1 or any(
                n > 1 and s != ts for n, s, ts in zip(t.shape, strides, t.stride())):
            errors.append(f"{name}: shape {list(shape)}, strides {list(strides)} for a "
                          f"{source} of shape {list(t.shape)}, strides {list(t.stride())}")
        _, block = stub_cuda.parse_descriptor(src.signature[name])
        if name in _DESC_BLOCKS:
            want = [constants.get(c) if isinstance(c, str) else c for c in _DESC_BLOCKS[name]]
            if block != want:
                errors.append(f"{name}: block {block} compiled, the config's tiles {want}")
        else:
            errors.append(f"{name}: a host descriptor this test does not know the block of")
    return errors


def _fresh(value):
    """An argument as new objects: a tensor's copy (another pointer), a new tuple."""
    if hasattr(value, "data_ptr"):
        return value.clone()
    if not isinstance(value, tuple):
        return value
    items = [_fresh(v) for v in value]
    return type(value)._make(items) if hasattr(value, "_make") else tuple(items)


def _show(stub_cuda, ty, raw):
    """A recorded parameter for a message: a tensor map's fields, else its bytes."""
    return stub_cuda.describe_tensor_map(raw) if ty == stub_cuda.TENSOR_MAP else raw.hex()


def _compare(stub_cuda, stub, step, per_call, first, second):
    """Differences between the Triton launch ``first`` and the direct one ``second`` of one
    KernelStep call (a list of strings; empty: equal)."""
    errors = []
    if len(first) != 1 or len(second) != 1:
        return [f"launches: {len(first)} through Triton, {len(second)} direct (1 each expected)"]
    a, b = first[0], second[0]
    for field in ("handle", "stream", "grid", "block", "shared", "num_attrs"):
        if a[field] != b[field]:
            errors.append(f"{field}: Triton {a[field]}, direct {b[field]}")
    if a["stream"] != stub_cuda.STREAM:
        errors.append(f"stream {a['stream']:#x}, not the driver's current {stub_cuda.STREAM:#x}")
    variant = stub.variants[a["handle"]]
    src, fn = variant["src"], step.jit_fn
    # The Triton launch decoded against the arguments by name: checks the recorded layout. A
    # host descriptor's expected bytes: the tensor map of its tensor (address, shape, strides,
    # the compiled block), then its shape and strides.
    values = {**step.fixed, **per_call}
    for name, (source, shape, strides) in step.descs.items():
        values[name] = (per_call[source], shape, strides)
    metas = iter(variant["tensordesc_meta"] or ())
    labels, types = [], []
    for name, ty in zip(fn.arg_names, src.signature.values()):
        for label, t, value in _flat(stub_cuda, name, ty, values.get(name), metas):
            labels.append(label)
            types.append(t)
            expected, recorded = stub_cuda.pack(t, value), a["params"][len(labels) - 1]
            if recorded != expected:
                shown = (_show(stub_cuda, t, expected) if t == stub_cuda.TENSOR_MAP
                         else repr(value))
                errors.append(f"Triton's launch: {label} ({t}) recorded "
                              f"{_show(stub_cuda, t, recorded)}, its value {shown}")
    if len(labels) != len(a["params"]) - 2:
        errors.append(f"{len(labels)} parameters from the signature, {len(a['params']) - 2} "
                      f"recorded")
    for i, (label, t) in enumerate(zip(labels, types)):
        if a["params"][i] != b["params"][i]:
            errors.append(f"{label}: Triton {_show(stub_cuda, t, a['params'][i])}, direct "
                          f"{_show(stub_cuda, t, b['params'][i])}")
    scratch_a, scratch_b = (int.from_bytes(r["params"][-2], "little") for r in (a, b))
    if variant["scratch"] and not (scratch_a and scratch_b):
        errors.append(f"global scratch of {variant['scratch']} B per program: Triton "
                      f"{scratch_a:#x}, direct {scratch_b:#x}")
    if not variant["scratch"] and (scratch_a or scratch_b):
        errors.append(f"global scratch without descriptors: {scratch_a:#x}, {scratch_b:#x}")
    if a["params"][-1] != b["params"][-1]:
        errors.append("profile scratch differs")
    return errors


def child(out_path, only=None):
    sys.path[:0] = [str(TESTS), str(ROOT)]
    import stub_cuda
    result = dict(cases=[], errors=[])
    try:
        stub = stub_cuda.Stub(os.environ["TRITON_LIBCUDA_PATH"])
    except (stub_cuda.StubUnavailable, ImportError, AttributeError, OSError) as e:
        result["skip"] = f"{type(e).__name__}: {e}"
        Path(out_path).write_text(json.dumps(result))
        return SKIP_EXIT
    import torch
    import triton
    from triton.runtime.jit import JITFunction

    def no_device(*args, **kwargs):
        raise RuntimeError("no CUDA device (stub driver)")
    # The device queries answer as on a CPU-only torch with a CUDA build too (whose runtime
    # would otherwise load the stub libcuda): the kernels' tables for an H100 (sm_90).
    torch.cuda.get_device_capability = torch.cuda.get_device_properties = no_device

    from kernels.core import launch
    result.update(triton=triton.__version__, version=launch.TRITON_VERSION,
                  listed=list(launch.DIRECT_LAUNCH_TRITON), direct_launch=launch.DIRECT_LAUNCH)
    torch.set_num_threads(1)

    through_triton = []       # kernel names launched by JITFunction.run
    orig_run = JITFunction.run

    def counting_run(self, *args, **kwargs):
        through_triton.append(self.__name__)
        return orig_run(self, *args, **kwargs)
    JITFunction.run = counting_run

    state = dict(double=False, steps=[])
    orig_call = launch.KernelStep.__call__

    def doubled(self, device, per_call, ctx=None):
        """A step's first call: launched through Triton, then directly with the same
        arguments (the same objects: the step keeps the first call's tuples as pointers),
        compared with Triton's launch; then directly with new tuples of copies (as a plan's
        per-call tuples and tensors come), decoded against them."""
        if not state["double"] or self.direct is not None:
            return orig_call(self, device, per_call, ctx)
        name = self.jit_fn.__name__
        n0 = stub.launches()
        orig_call(self, device, per_call, ctx)
        first = stub.records(n0)
        if self.direct is None:
            state["steps"].append(dict(kernel=name, errors=["not kept for direct launches"]))
            return None
        n1, n_triton = stub.launches(), len(through_triton)
        orig_call(self, device, per_call, ctx)
        second = stub.records(n1)
        errors = _compare(stub_cuda, stub, self, per_call, first, second)
        # New tuples of copies: the launch must carry the copies' pointers (decoded against
        # them by name), not those the step kept from its first call.
        fresh = {n: _fresh(v) for n, v in per_call.items()}
        n2 = stub.launches()
        orig_call(self, device, fresh, ctx)
        third = stub.records(n2)
        errors += [f"new tuples: {e}" for e in _compare(stub_cuda, stub, self, fresh, third,
                                                         third)]
        # The first call's arguments again, after the copies: equal to Triton's launch of them
        # (a host descriptor kept per buffer must be that buffer's).
        n3 = stub.launches()
        orig_call(self, device, per_call, ctx)
        errors += [f"first arguments again: {e}" for e in _compare(
            stub_cuda, stub, self, per_call, first, stub.records(n3))]
        if self.descs and first:
            errors += _descriptor_errors(stub_cuda, stub.variants[first[0]["handle"]]["src"],
                                         self, per_call)
        if len(through_triton) != n_triton:
            errors.append(f"the direct launch went through Triton: {through_triton[n_triton:]}")
        state["steps"].append(dict(kernel=name, entry=self.direct[0].__name__,
                                   kept=[k[1] for k in self.direct[3]],
                                   handle=first[0]["handle"] if first else None,
                                   params=len(first[0]["params"]) if first else 0,
                                   scratch=stub.variants[first[0]["handle"]]["scratch"]
                                   if first else 0, descs=sorted(self.descs),
                                   lowered=bool(first and stub.variants[first[0]["handle"]]
                                                ["tensordesc_meta"]), errors=errors))
        return None
    launch.KernelStep.__call__ = doubled

    # The gate: with DIRECT_LAUNCH off (a Triton not listed), steps keep Triton's own path.
    launch.DIRECT_LAUNCH = False
    cases = _cases(torch)
    build, run = next(c[1:3] for c in cases if "tma=2" in c[0])
    plan = build()
    run(plan)
    n_triton = len(through_triton)
    run(plan)
    result["gate_off"] = dict(direct_kept=plan.step.direct is not None,
                              second_call_through_triton=through_triton[n_triton:])

    # The comparison, on every version (an unlisted one reports whether it could be added).
    launch.DIRECT_LAUNCH = True

    def run_case(name, build, run, options=None):
        entry = dict(name=name, steps=[], errors=[])
        stub.lower_descriptors = (options or {}).get("lower_descriptors", True)
        try:
            plan = build()
            state.update(double=True, steps=[])
            run(plan)
            entry["steps"] = state["steps"]
            state["double"] = False
            # The plan's second call: every KernelStep launches directly.
            n0, n_triton = stub.launches(), len(through_triton)
            run(plan)
            again = stub.records(n0)
            entry["second_call"] = dict(launches=[r["kernel"] for r in again],
                                        through_triton=through_triton[n_triton:])
        except Exception as e:  # noqa: BLE001 - reported per case
            import traceback
            entry["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
        finally:
            state["double"] = False
            stub.lower_descriptors = True
        return entry

    for name, build, run, *options in cases:
        if not only or only in name:
            result["cases"].append(run_case(name, build, run, *options))

    # Planted bugs in the host descriptors' direct launches, which the comparison must find:
    # a descriptor kept for the first buffer served for every buffer, a block one row short.
    # A new plan for each (its steps make their descriptors anew).
    host = next((c for c in cases if "tma=3" in c[0]), None)
    orig_desc_call, orig_desc_init = launch._HostDesc.__call__, launch._HostDesc.__init__

    def stale(self, tensor):
        if not hasattr(self, "planted"):
            self.planted = orig_desc_call(self, tensor)
        return self.planted

    def short_block(self, first, meta, expanded):
        if meta is not None:
            box = meta["block_size"]
            meta = dict(meta, block_size=[*box[:-2], box[-2] - 1, box[-1]])
        orig_desc_init(self, first, meta, expanded)

    result["planted"] = {}
    for bug, attr, patch in (("stale descriptor", "__call__", stale),
                             ("short block", "__init__", short_block)):
        if host is None:
            break
        setattr(launch._HostDesc, attr, patch)
        try:
            result["planted"][bug] = run_case(f"{host[0]}, planted: {bug}", *host[1:3])
        finally:
            launch._HostDesc.__call__ = orig_desc_call
            launch._HostDesc.__init__ = orig_desc_init
    result["ttir_failures"] = stub.ttir_failures
    result["variants"] = [dict(kernel=v["kernel"], params=len(v["sizes"]) - 2,
                               scratch=v["scratch"]) for v in stub.variants[1:]]
    Path(out_path).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------ the test
@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import stub_cuda
    tmp = tmp_path_factory.mktemp("direct_launch")
    try:
        stub_dir = stub_cuda.build(str(tmp))
    except stub_cuda.StubUnavailable as e:
        pytest.skip(f"the stub libcuda cannot be built here: {e}")
    out = tmp / "report.json"
    env = stub_cuda.stub_env(stub_dir, str(tmp / "triton-cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]]
                                                      if env.get("PYTHONPATH") else []))
    try:
        r = subprocess.run([sys.executable, __file__, "--child", str(out)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the stub-driver process ran past {CHILD_TIMEOUT} s:\n{e.stderr}")
    if r.returncode == SKIP_EXIT:
        import triton
        pytest.skip(f"triton {triton.__version__}'s launcher cannot run on the stub driver: "
                    f"{json.loads(out.read_text())['skip']}")
    assert r.returncode == 0 and out.exists(), \
        f"the stub-driver process failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_version_gate(report):
    """DIRECT_LAUNCH is on exactly for the listed versions, and off, steps keep Triton's own
    path (their second call goes through Triton again)."""
    from kernels.core import launch
    assert launch.DIRECT_LAUNCH_TRITON == tuple(report["listed"])
    assert report["direct_launch"] == (report["version"] in report["listed"])
    gate = report["gate_off"]
    assert not gate["direct_kept"], "DIRECT_LAUNCH off, yet the step kept a direct launch"
    assert gate["second_call_through_triton"] == ["_attn_fwd"], gate


def test_direct_launches_equal_tritons(report):
    """Every KernelStep's direct launch equals Triton's launch of the same arguments, and a
    plan's second call launches every step directly."""
    failures, compared = [], set()
    for case in report["cases"]:
        failures += [f"{case['name']}: {e}" for e in case["errors"]]
        if not case["steps"]:
            failures.append(f"{case['name']}: no KernelStep launched")
        for step in case["steps"]:
            compared.add(step["kernel"])
            # The launcher's C entry itself, not Triton's Python around it (launch.py
            # ``_c_entry``: "through_run" means this version's launcher looked otherwise).
            if step.get("entry") != "launch":
                failures.append(f"{case['name']} / {step['kernel']}: direct launch through "
                                f"{step.get('entry')!r}, not the launcher's C entry")
            failures += [f"{case['name']} / {step['kernel']}: {e}" for e in step["errors"]]
        second = case.get("second_call")
        if second:
            direct_expected = [s["kernel"] for s in case["steps"]]
            stray = [k for k in second["through_triton"] if k in direct_expected]
            if stray:
                failures.append(f"{case['name']}: second call launched {stray} through Triton")
            missing = set(direct_expected) - set(second["launches"])
            if missing:
                failures.append(f"{case['name']}: second call did not launch {sorted(missing)}")
    # The steps keep their plans' constant tuples as pointers (checked above, same objects).
    assert any(step.get("kept") for case in report["cases"] for step in case["steps"]), \
        "no step kept a per-call tuple as pointers"
    # Every kernel the plans launch, and scratch (TMA) variants among them.
    assert compared >= {"_attn_fwd", "_append_kv", "_bwd_preprocess", "_bwd_dkdv", "_bwd_dq"}, \
        compared
    assert any(v["scratch"] for v in report["variants"]), \
        f"no variant with descriptors' scratch: {report['ttir_failures']}"
    assert not report["ttir_failures"], report["ttir_failures"]
    # Host descriptors (TMA mode 3): lowered to TMA (tensor maps) and decomposed.
    host = {step["lowered"] for case in report["cases"] for step in case["steps"]
            if step.get("descs")}
    assert host == {True, False}, f"host-descriptor steps lowered / decomposed: {host}"
    if report["version"] not in report["listed"]:
        outcome = ("matched: it can be added to DIRECT_LAUNCH_TRITON" if not failures else
                   f"did NOT match ({len(failures)} differences, e.g. {failures[0]})")
        pytest.skip(f"triton {report['triton']} is not in DIRECT_LAUNCH_TRITON (direct launches "
                    f"are off on it); its direct launches {outcome}")
    assert not failures, "\n".join(failures)


def test_planted_descriptor_bugs_found(report):
    """The comparison finds wrong host descriptors in direct launches: one kept for the first
    buffer served for a new one (its copies' launch must carry their addresses), a box one row
    short (every launch's tensor maps differ from Triton's)."""
    planted = report["planted"]
    assert set(planted) == {"stale descriptor", "short block"}, planted
    for bug, case in planted.items():
        assert not case["errors"], (bug, case["errors"])
        errors = [e for step in case["steps"] for e in step["errors"]]
        for name in ("DESC_Q", "DESC_K", "DESC_V"):
            found = [e for e in errors if f"{name}.map" in e]
            assert found, f"{bug}: no difference found in {name}'s tensor map: {errors}"
            if bug == "stale descriptor":   # only the copies' launch is wrong
                assert all(e.startswith("new tuples:") for e in found), found


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None))
    sys.exit(f"usage: {sys.argv[0]} --child REPORT.json [CASE-SUBSTRING]")
