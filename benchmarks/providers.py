"""The attention implementations being compared ("providers"), on identical inputs: causal
(square, so PyTorch's top-left and our bottom-right alignment coincide), scale 1/sqrt(head_dim),
dropout ``p``. ``kernels`` is ours; ``reference`` the book's math (``reference_compiled`` under
torch.compile); ``sdpa_*`` one SDPA backend each; ``flex`` FlexAttention; ``triton_tutorial``
the Triton tutorial's kernel from ``--tutorial PATH`` (docs/performance.md describes each). On
CPU, TRITON_INTERPRET decides at each call what ``kernels.attention`` runs (:func:`cpu_backend`
picks it for a block of calls). A provider that cannot run a case says ``unsupported:
<reason>``, known up front (:meth:`Provider.static_reason`) or from its first call's error.
"""
import contextlib
import importlib.util
import os
import re
from dataclasses import dataclass

import torch

PROVIDERS = ("kernels", "reference", "reference_compiled", "sdpa_math", "sdpa_efficient",
             "sdpa_flash", "sdpa_cudnn", "flex", "triton_tutorial")
# The CPU run's default: what a CPU user can choose between (ours = the PyTorch fallback; SDPA
# on CPU has a flash backend without dropout and the math one; CUDA-only and compiled providers
# left out, any of them can still be named in --providers).
CPU_PROVIDERS = ("kernels", "reference", "sdpa_math", "sdpa_flash")
FALLBACK, INTERPRETER = "pytorch_fallback", "triton_interpreter"
# Providers that materialise the (seq x seq) score matrix: limited by --quadratic-max-seq.
QUADRATIC = ("reference", "reference_compiled", "sdpa_math")
# Providers that need torch.compile: slow to compile on CPU, so only run there when asked for.
COMPILED = ("reference_compiled", "flex")


@dataclass(frozen=True)
class Case:
    """One attention problem: q, k, v of shape (batch, heads, seq_len, head_dim)."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: torch.dtype
    dropout_p: float
    device: str
    causal: bool = True

    @property
    def dtype_name(self) -> str:
        """``"bfloat16"`` etc. (the dtype as written in the results)."""
        return str(self.dtype).replace("torch.", "")

    def make_inputs(self, generator_seed=0):
        """Random q, k, v (leaf tensors requiring grad) and an upstream gradient ``do``, drawn
        on the device from a generator seeded with ``generator_seed`` (never zeros)."""
        g = torch.Generator(device=self.device).manual_seed(generator_seed)
        shape = (self.batch, self.heads, self.seq_len, self.head_dim)

        def rnd():
            return torch.randn(shape, generator=g, device=self.device).to(self.dtype)

        q, k, v = (rnd().requires_grad_(True) for _ in range(3))
        return q, k, v, rnd()


@contextlib.contextmanager
def cpu_backend(name):
    """For the block: ``kernels`` on CPU tensors runs the PyTorch fallback (``FALLBACK``:
    TRITON_INTERPRET=0) or Triton's interpreter (``INTERPRETER``: TRITON_INTERPRET=1, which
    needs ``kernels`` imported with it set; see :func:`interpreter_unavailable`)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if name == INTERPRETER else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def interpreter_unavailable():
    """Why Triton's interpreter cannot run ``kernels`` in this process, or None."""
    from kernels.core.common import KERNELS_INTERPRETED

    if not KERNELS_INTERPRETED:
        return ("kernels was imported without TRITON_INTERPRET=1, so its kernels are compiled "
                "ones (python -m benchmarks sets it on CPU before importing kernels)")
    return None


def _clean_warning(text: str) -> str:
    text = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", str(text))
    return " ".join(text.split())


class Provider:
    """Base class: ``forward(case)`` returns ``f(q, k, v) -> out`` for that case."""

    name = "?"

    def static_reason(self, case: Case):
        """Why this provider cannot run ``case`` at all (a string), or None."""
        return None

    def forward(self, case: Case):
        """A callable ``f(q, k, v) -> out`` computing the case's attention."""
        raise NotImplementedError

    def unsupported_reason(self, exc: BaseException, caught_warnings):
        """If ``exc`` (raised by the first call) means "this case is not supported", the reason."""
        return None

    def context(self, case: Case):
        """Entered around everything measured for ``case`` (forward and backward)."""
        return contextlib.nullcontext()

    # What a CPU row of this provider runs when the profiler saw none of PyTorch's attention
    # ops (measure.ATTENTION_OPS) in its call: the row's ``runs``.
    own_ops = None


class KernelsProvider(Provider):
    """Ours: ``kernels.attention`` (on CPU tensors: the PyTorch fallback)."""

    name = "kernels"
    own_ops = "kernels' PyTorch fallback, its own ops (matmul, softmax, Philox dropout)"

    def forward(self, case):
        import kernels

        return lambda q, k, v: kernels.attention(q, k, v, causal=case.causal,
                                                 dropout_p=case.dropout_p)

    def context(self, case):
        if torch.device(case.device).type == "cpu":
            return cpu_backend(FALLBACK)
        return contextlib.nullcontext()


def _reference_lowp(q, k, v, causal, dropout_p):
    import reference

    return reference.attention(q, k, v, causal=causal, dropout_p=dropout_p, upcast=False)


class ReferenceProvider(Provider):
    """``reference.attention(upcast=False)`` in eager PyTorch."""

    name = "reference"
    own_ops = "reference.attention: eager matmul, softmax, dropout (the book's math)"

    def forward(self, case):
        return lambda q, k, v: _reference_lowp(q, k, v, case.causal, case.dropout_p)


_COMPILED = {}


def _compiled(key, fn):
    """``torch.compile(fn, dynamic=False)``, created once per key (recompiles per shape)."""
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=False)
    return _COMPILED[key]


def configure_dynamo(limit=256):
    """For compiled providers: a recompile limit no sweep reaches (never a silent fall back to
    eager), and AOTAutograd's donated buffers off (a backward reusing its saved tensors' memory
    refuses ``retain_graph=True``, which the ``bwd`` mode needs)."""
    import torch._dynamo.config as cfg

    for attr in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, max(getattr(cfg, attr), limit))
    try:
        import torch._functorch.config as functorch_cfg

        functorch_cfg.donated_buffer = False
    except (ImportError, AttributeError):  # older torch: no donated buffers
        pass


def reset_compiled():
    """Drop compiled graphs (called when the shape changes: each shape compiles afresh anyway)."""
    try:
        torch._dynamo.reset()
    except Exception:  # pragma: no cover - best effort
        pass


class ReferenceCompiledProvider(Provider):
    """``reference.attention(upcast=False)`` under ``torch.compile`` (one graph per shape)."""

    name = "reference_compiled"
    own_ops = "reference.attention under torch.compile (inductor's code)"

    def forward(self, case):
        fn = _compiled("reference", _reference_lowp)
        return lambda q, k, v: fn(q, k, v, case.causal, case.dropout_p)


_SDPA_BACKENDS = {
    "sdpa_math": "MATH",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
}


class SdpaProvider(Provider):
    """``F.scaled_dot_product_attention`` with one backend forced by ``sdpa_kernel``."""

    def __init__(self, name):
        self.name = name
        self.backend_name = _SDPA_BACKENDS[name]

    def static_reason(self, case):
        try:
            from torch.nn.attention import SDPBackend
        except ImportError:
            return "torch.nn.attention (sdpa_kernel) missing in this torch"
        if not hasattr(SDPBackend, self.backend_name):
            return f"SDPBackend.{self.backend_name} missing in this torch"
        on_cpu = torch.device(case.device).type == "cpu"
        if on_cpu and self.name in ("sdpa_efficient", "sdpa_cudnn"):
            return "CUDA-only backend"
        if self.name == "sdpa_cudnn" and not torch.backends.cudnn.is_available():
            return "cuDNN missing in this torch build"
        return None

    def function(self, **sdpa_kwargs):
        """``f(q, k, v)``: SDPA with this backend and ``sdpa_kwargs`` (the feature rows' too)."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, self.backend_name)

        def f(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
        return f

    def forward(self, case):
        return self.function(is_causal=case.causal, dropout_p=case.dropout_p)

    def unsupported_reason(self, exc, caught_warnings):
        text = str(exc)
        if not isinstance(exc, RuntimeError) or not ("No available kernel" in text
                                                     or "No viable backend" in text):
            return None
        msgs = [_clean_warning(w.message) for w in caught_warnings]
        msgs = [m for m in msgs if m and not m.endswith("not used because:")]
        reason = "; ".join(dict.fromkeys(msgs)) or _clean_warning(text)
        return reason[:200]


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class FlexProvider(Provider):
    """FlexAttention (compiled) with a causal BlockMask built once per shape."""

    name = "flex"
    own_ops = "FlexAttention under torch.compile"

    def static_reason(self, case):
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            return "torch.nn.attention.flex_attention missing in this torch"
        if case.dropout_p > 0:
            return "FlexAttention has no dropout"
        return None

    def forward(self, case):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(_causal_mask, B=None, H=None, Q_LEN=case.seq_len,
                                 KV_LEN=case.seq_len, device=case.device)
        fn = _compiled("flex", flex_attention)
        return lambda q, k, v: fn(q, k, v, block_mask=mask)


# The Triton tutorial's file (python/tutorials/06-fused-attention.py of Triton 3.6): written
# elsewhere, so not in this repository; ``--tutorial PATH`` (cli) sets it.
TUTORIAL = {"path": None}


def set_tutorial_path(path):
    """Where the Triton tutorial's fused attention is (None: the rows say "not given")."""
    TUTORIAL["path"] = os.path.abspath(path) if path else None


def load_tutorial(path=None):
    """The Triton tutorial's module from ``path`` (default: the one given by ``--tutorial``),
    imported once per process. It imports pytest for its test decorators (a stand-in is used
    where pytest is missing) and asks the active Triton driver for its device at import."""
    import sys

    mod = sys.modules.get("tutorial_fused_attention")
    if mod is None:
        try:
            importlib.import_module("pytest")   # the tutorial imports it for its test decorators
        except ImportError:
            import types

            class _Mark:
                def __getattr__(self, name):
                    return lambda *a, **k: (lambda f: f)
            sys.modules["pytest"] = types.SimpleNamespace(mark=_Mark())
        path = path or TUTORIAL["path"]
        if not path:
            raise FileNotFoundError("the Triton tutorial's file: not given (--tutorial PATH)")
        spec = importlib.util.spec_from_file_location("tutorial_fused_attention", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["tutorial_fused_attention"] = mod
    return mod


class TutorialProvider(Provider):
    """The Triton 3.6 tutorial 06 (``attention(q, k, v, causal, sm_scale, warp_specialize)``),
    fp16 only; inputs are converted by :meth:`prepare_inputs`, outside the timing."""

    name = "triton_tutorial"
    run_dtype = torch.float16

    def static_reason(self, case):
        if torch.device(case.device).type != "cuda":
            return "CUDA only (a compiled Triton kernel)"
        if case.dropout_p > 0:
            return "the Triton tutorial has no dropout"
        if case.head_dim not in (16, 32, 64, 128, 256):
            return "the Triton tutorial takes head_dim 16, 32, 64, 128 or 256"
        if case.seq_len % 128:
            return "the Triton tutorial's backward needs seq_len % 128 == 0"
        if not TUTORIAL["path"]:
            return "not given (--tutorial PATH: Triton 3.6's tutorials/06-fused-attention.py)"
        if not os.path.exists(TUTORIAL["path"]):
            return f"{TUTORIAL['path']} missing"
        return None

    def prepare_inputs(self, q, k, v, do):
        """fp16 leaf copies of the case's inputs (same values, rounded to fp16)."""
        def leaf(t):
            return t.detach().to(self.run_dtype).requires_grad_(t.requires_grad)
        return leaf(q), leaf(k), leaf(v), do.to(self.run_dtype).contiguous()

    def forward(self, case):
        mod = load_tutorial()
        scale = case.head_dim ** -0.5
        # warp_specialize=False: on Hopper the tutorial then passes host-side descriptors, the
        # setting of its own causal benchmark (bench_flash_attention: ws only for non-causal).
        def f(q, k, v):
            if q.dtype != self.run_dtype:   # a caller that skipped prepare_inputs: convert
                q, k, v = (t.to(self.run_dtype) for t in (q, k, v))     # (timed with it)
            return mod.attention(q, k, v, case.causal, scale, False)
        return f


def get_provider(name: str) -> Provider:
    """The provider called ``name`` (one of PROVIDERS)."""
    if name in _SDPA_BACKENDS:
        return SdpaProvider(name)
    for cls in (KernelsProvider, ReferenceProvider, ReferenceCompiledProvider, FlexProvider,
                TutorialProvider):
        if cls.name == name:
            return cls()
    raise ValueError(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)}")
