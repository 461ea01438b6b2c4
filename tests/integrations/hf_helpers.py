"""Shared pieces of the transformers tests (test_hf*.py): the float64 attention the oracles
compute (and the plain oracle implementation, ``F64_ORACLE``), the (ours, eager, oracle)
model triple, padded batches."""
import contextlib
import copy

import pytest
import torch
from helpers import GRAD_FACTOR, assert_parity

from kernels import hf

VOCAB = 64


def skip_module_unless_registered():
    """Register kernels.hf, or skip the calling test module where it refuses this transformers
    (older than 5.4), with its error naming the version as the reason."""
    try:
        hf.register()
    except ImportError as e:
        pytest.skip(str(e), allow_module_level=True)


@pytest.fixture
def model_route(route, monkeypatch):
    """``route`` (tests/conftest.py) for whole models and transformers' calls: the tensors and
    models the test makes are on the route's device (made torch's default device there), and
    every backend decision the test's calls make is the route's."""
    from kernels.core import backend
    fallback = route.name == "fallback"
    decided = []
    choose = backend._use_fallback

    def use_fallback(*args, **kwargs):
        decided.append(choose(*args, **kwargs))
        return decided[-1]
    monkeypatch.setattr(backend, "_use_fallback", use_fallback)
    with contextlib.nullcontext() if route.device == "cpu" else torch.device(route.device):
        yield route
    # (On a GPU a cached plan keeps its decision: the kernel route may make none.)
    assert all(d == fallback for d in decided), f"route {route.name}: decisions {decided}"
    assert decided or not fallback, "no attention call was made on the fallback route"


# The float64 oracle as an attention implementation: exact float64 math over transformers' own
# boolean mask (``sdpa_mask``, never skipped), registered by ``register_f64_oracle``.
F64_ORACLE = "f64_oracle_for_tests"


def _f64_oracle_mask(*args, **kwargs):
    from transformers import masking_utils as mu
    kwargs["allow_is_causal_skip"] = False
    return mu.sdpa_mask(*args, **kwargs)


def _f64_oracle_attention(module, query, key, value, attention_mask, dropout=0.0,
                          scaling=None, position_bias=None, **kwargs):
    assert dropout == 0.0
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return masked_attention(query, key, value, attention_mask, scaling,
                            bias=position_bias).to(query.dtype), None


def register_f64_oracle():
    """Register kernels.hf and ``F64_ORACLE`` with transformers (idempotent)."""
    import transformers
    from transformers import masking_utils as mu
    hf.register()
    transformers.AttentionInterface.register(F64_ORACLE, _f64_oracle_attention)
    mu.AttentionMaskInterface.register(F64_ORACLE, _f64_oracle_mask)


def masked_attention(q, k, v, mask, scaling, *, softcap=None, sinks=None, bias=None,
                     dtype=torch.float64):
    """Eager's attention in ``dtype``: softcap · tanh(q kᵀ · scaling / softcap) (if given), an
    additive ``bias`` (T5's position bias; if given), a boolean (batch, 1, q_len, k_len) mask,
    one sink logit per head in the softmax (dropped after it, as gpt-oss does; if given), then
    @ v (v may have its own head_dim). Rows that see no key give zeros. q (batch, heads, q_len, d); k, v (batch, heads_kv, k_len, d or dv). Returns
    (batch, q_len, heads, dv)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:            # T5's position bias, added before the mask
        s = s + bias.to(dtype)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


def models(transformers, config, oracle, prepare=None, **from_config):
    """(ours, eager fp32, float64 oracle) of ``config``, one set of random weights, on torch's
    default device (``model_route``'s): eager built with ``from_config`` keywords and changed by
    ``prepare(eager)`` if given, then copied to ours ("triton_fused") and to the oracle (the
    registered attention ``oracle``, in float64)."""
    eager = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", **from_config).to(torch.get_default_device()).eval()
    if prepare is not None:
        prepare(eager)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation("triton_fused")
    oracle_model = copy.deepcopy(eager).double()
    oracle_model.set_attn_implementation(oracle)
    assert ours.config._attn_implementation == "triton_fused"
    return ours, eager, oracle_model


def padded_batch(lengths, total, *, left):
    """Token ids and a 2-D attention mask; row r has lengths[r] tokens, padded on the left or
    right (left[r])."""
    ids = torch.randint(1, VOCAB, (len(lengths), total))
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for r, (n, lft) in enumerate(zip(lengths, left)):
        if lft:
            mask[r, total - n:] = 1
        else:
            mask[r, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def assert_training_grads_match(kind, ours, eager, oracle, lengths, total, *, left):
    """One training step (loss on a padded batch, padding labels ignored) of each model: every
    parameter gradient of ours within the parity rule of the float64 oracle's, with eager's as
    the low-precision reference; parameters without a gradient agree with eager's."""
    for m in (ours, eager, oracle):
        m.train()
    ids, mask = padded_batch(lengths, total, left=left)
    labels = ids.masked_fill(mask == 0, -100)
    for m in (ours, eager, oracle):
        m(ids, attention_mask=mask, labels=labels).loss.backward()
    assert_param_grads_match(kind, ours, eager, oracle)


def assert_param_grads_match(kind, ours, eager, oracle, at_least=6):
    """Every parameter gradient of ``ours`` within the parity rule of the float64 oracle's,
    eager's as the low-precision reference; parameters without one agree with eager's; at
    least ``at_least`` compared."""
    named = dict(eager.named_parameters())
    ref_params = dict(oracle.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        if p.grad is None:
            assert named[name].grad is None, name
            continue
        assert_parity(p.grad, ref_params[name].grad, named[name].grad, factor=GRAD_FACTOR,
                      name=f"{kind} grad {name}")
        checked += 1
    assert checked >= at_least


def assert_whole_mask(sizes, q, k, v, *, module, scaling=0.3, **layer_kwargs):
    """``hf.mask_hook(**sizes)`` is a pattern the fast layouts do not compute: it warns (once
    per kind; the record is cleared first) and goes through transformers' whole mask, whose
    result matches eager's attention over ``sdpa_mask`` by the parity rule."""
    from transformers import masking_utils as mu

    hf._WHOLE_MASK_SAID.clear()
    with pytest.warns(UserWarning, match="whole boolean mask"):
        info = hf.mask_hook(**sizes)
    assert info.unsupported is None and info.dense_mask is not None, info
    out, _ = hf.attention_function(module, q, k, v, info, scaling=scaling, **layer_kwargs)
    ref_mask = mu.sdpa_mask(**sizes, allow_is_causal_skip=False,
                            allow_is_bidirectional_skip=False)
    ref = masked_attention(q, k, v, ref_mask, scaling)
    lowp = masked_attention(q, k, v, ref_mask, scaling, dtype=torch.float32)
    assert_parity(out, ref, lowp, name=f"whole mask: {info!r}")
    return out
