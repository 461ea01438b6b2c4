"""One tensor passed as two arguments: ``attention_varlen(q, k, v, cu, cu,
...)`` is ordinary packed self-attention, yet Dynamo refuses an ``autograd.Function`` given
one tensor twice. Every entry point, compiled fullgraph (``aot_eager``) with gradients where
it is differentiable, gets every pair of its same-typed tensor arguments (same dtype, shape and
requires_grad: one object could stand for both) as ONE object, and must equal the eager call
with distinct copies, bit for bit: outputs, lse, the caches it writes, and gradients (an
aliased leaf's gradient is the sum of its copies').

The pairs are generated from each case's arguments; to keep the number of compiles small, one
compiled call aliases one pair of every group at once (a round-robin schedule of disjoint
pairs), so an entry point costs as many compiles as its largest group has rounds (3 here).
"""
import itertools
from typing import Callable, NamedTuple

import pytest
import torch
import triton
import triton.language as tl

import kernels
from kernels import MaskMod, ScoreMod
from kernels import flash_attn_interface as fa
from tests.helpers import DEVICE, interpreter_unusable_reason

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and interpreter_unusable_reason() is not None,
                                reason=str(interpreter_unusable_reason()))

B, H, S, D = 2, 2, 8, 16          # dense: (batch, heads, seq, head_dim)
LENS = (3, 5)                     # packed: two sequences, 8 tokens
PAGE, PAGES = 4, 3                # paged caches: page size, pages per sequence


# ------------------------------------------------------------------ mods reading mod_aux
@triton.jit
def _head_bias(s, b, h, q_idx, kv_idx, aux):
    """s + aux[0][h] - aux[1][h] * (q - kv): a learned per-head bias and a fixed slope."""
    return s + tl.load(aux[0] + h) - tl.load(aux[1] + h) * (q_idx - kv_idx).to(tl.float32)


@triton.jit
def _head_bias_aux_grad(ds, s, b, h, q_idx, kv_idx, aux, daux):
    tl.atomic_add(daux[0] + h, tl.sum(tl.sum(ds, 1), 0))


def _head_bias_torch(s, b, h, q_idx, kv_idx, aux):
    return (s + aux[0].reshape(-1)[h].to(s.dtype)
            - aux[1].reshape(-1)[h].to(s.dtype) * (q_idx - kv_idx).to(s.dtype))


HEAD_BIAS = ScoreMod("tests.aliased.head_bias", _head_bias, _head_bias_torch,
                     aux_grad=_head_bias_aux_grad, grad_aux=(0,))


@triton.jit
def _int_keys(b, h, q_idx, kv_idx, aux):
    """Hides the keys kv with (kv + aux[2][b] + aux[3].flat[b]) % 3 == 0: int32 mod tensors
    shaped like seqused_k / cache_seqlens (aux[2]) and block_table (aux[3])."""
    return (kv_idx + tl.load(aux[2] + b) + tl.load(aux[3] + b)) % 3 != 0


def _int_keys_torch(b, h, q_idx, kv_idx, aux):
    return (kv_idx + aux[2].reshape(-1)[b] + aux[3].reshape(-1)[b]) % 3 != 0


INT_KEYS = MaskMod("tests.aliased.int_keys", _int_keys, _int_keys_torch)
MODS = dict(score_mod=HEAD_BIAS, mask_mod=INT_KEYS)


def _mod_aux(t, n):
    """(aux0 (H,) f32 [grad], aux1 (H,) f32, aux2 (n,) int32, aux3 (n, PAGES) int32)."""
    return dict(aux0=torch.randn(H, device=DEVICE).requires_grad_(t),
                aux1=torch.rand(H, device=DEVICE) * 0.1,
                # values valid as the key counts / block table they may stand for
                aux2=torch.randint(2, 8, (n,), dtype=torch.int32, device=DEVICE),
                aux3=_pages(n))


def _aux(a):
    return (a["aux0"], a["aux1"], a["aux2"], a["aux3"])


def _randn(*shape, grad=False, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_(grad)


def _cu():
    return torch.tensor([0, *itertools.accumulate(LENS)], dtype=torch.int32, device=DEVICE)


def _pages(n):
    """A block table (n, PAGES) over a pool of n * PAGES pages, shuffled."""
    return torch.randperm(n * PAGES, device=DEVICE).to(torch.int32).view(n, PAGES)


# ------------------------------------------------------------------ the entry points
class Case(NamedTuple):
    """An entry point: ``make()`` its tensor arguments (fresh random), ``call(**tensors)`` its
    outputs (a tensor or a tuple), ``grad``: differentiable (backward checked), ``mutated``:
    the arguments it writes in place (compared after the call), ``apart``: pairs that are not
    one object's two roles (each with its reason)."""
    make: Callable
    call: Callable
    grad: bool
    mutated: tuple = ()
    apart: tuple = ()


def _attention():
    return dict(q=_randn(B, H, S, D, grad=True), k=_randn(B, H, S, D, grad=True),
                v=_randn(B, H, S, D, grad=True), sinks=_randn(H, grad=True),
                alibi=torch.rand(H, device=DEVICE), **_mod_aux(True, B))


def _varlen():
    n = sum(LENS)
    return dict(q=_randn(n, H, D, grad=True), k=_randn(n, H, D, grad=True),
                v=_randn(n, H, D, grad=True), cu_q=_cu(), cu_k=_cu(), sinks=_randn(H, grad=True),
                alibi=torch.rand(H, device=DEVICE), **_mod_aux(True, len(LENS)))


def _paged():
    n, pool = len(LENS), len(LENS) * PAGES
    return dict(q=_randn(sum(LENS), H, D, grad=True), k_cache=_randn(pool, PAGE, H, D, grad=True),
                v_cache=_randn(pool, PAGE, H, D, grad=True), cu_q=_cu(),
                seqused_k=torch.tensor([7, 10], dtype=torch.int32, device=DEVICE),
                block_table=_pages(n), sinks=_randn(H), alibi=torch.rand(H, device=DEVICE),
                **_mod_aux(False, n))


def _kvcache():
    new = _randn(B, H, 2, D, grad=True)
    # v equals k in value (another object): caches aliased as one take both appends, which
    # then agree, as the distinct caches' do.
    return dict(q=_randn(B, H, 2, D, grad=True), k_cache=_randn(B * PAGES, PAGE, H, D),
                v_cache=_randn(B * PAGES, PAGE, H, D), k=new,
                v=new.detach().clone().requires_grad_(), block_table=_pages(B),
                cache_seqlens=torch.tensor([3, 6], dtype=torch.int32, device=DEVICE),
                sinks=_randn(H), alibi=torch.rand(H, device=DEVICE), **_mod_aux(False, B))


def _fp8():
    f8 = torch.float8_e4m3fn
    return dict(q=_randn(B, H, S, D, dtype=f8), k=_randn(B, H, S, D, dtype=f8),
                v=_randn(B, H, S, D, dtype=f8),
                **{n: torch.rand(B, H, device=DEVICE) + 0.5
                   for n in ("q_descale", "k_descale", "v_descale", "alibi")})


def _fa_dense():
    return dict(q=_randn(B, S, H, D, grad=True), k=_randn(B, S, H, D, grad=True),
                v=_randn(B, S, H, D, grad=True), s_aux=_randn(H),
                alibi=torch.rand(H, device=DEVICE))


def _fa_varlen():
    n = sum(LENS)
    return dict(q=_randn(n, H, D, grad=True), k=_randn(n, H, D, grad=True),
                v=_randn(n, H, D, grad=True), cu_q=_cu(), cu_k=_cu(), s_aux=_randn(H),
                alibi=torch.rand(H, device=DEVICE))


def _fa_kvcache():
    new = _randn(B, 2, H, D)
    return dict(q=_randn(B, 2, H, D), k_cache=_randn(B, 12, H, D), v_cache=_randn(B, 12, H, D),
                k=new, v=new.clone(),
                # (values valid in each of the three roles: any may stand for another)
                cache_seqlens=torch.tensor([1, 0], dtype=torch.int32, device=DEVICE),
                cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32, device=DEVICE),
                cache_leftpad=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                rotary_cos=torch.rand(12, 4, device=DEVICE),
                rotary_sin=torch.rand(12, 4, device=DEVICE),
                s_aux=_randn(H), alibi=torch.rand(H, device=DEVICE))


CASES = {
    "attention": Case(_attention, lambda q, k, v, sinks, alibi, **a: kernels.attention(
        q, k, v, causal=True, sinks=sinks, alibi_slopes=alibi, mod_aux=_aux(a), return_lse=True,
        **MODS), grad=True),
    "attention_fp8": Case(_fp8, lambda q, k, v, q_descale, k_descale, v_descale, alibi:
                          kernels.attention(q, k, v, causal=True, alibi_slopes=alibi,
                                            q_descale=q_descale, k_descale=k_descale,
                                            v_descale=v_descale, return_lse=True), grad=False),
    "attention_varlen": Case(_varlen, lambda q, k, v, cu_q, cu_k, sinks, alibi, **a:
                             kernels.attention_varlen(
                                 q, k, v, cu_q, cu_k, max(LENS), max(LENS), causal=True,
                                 window=4, sinks=sinks, alibi_slopes=alibi, mod_aux=_aux(a),
                                 return_lse=True, **MODS), grad=True),
    "attention_varlen_paged": Case(
        _paged, lambda q, k_cache, v_cache, cu_q, seqused_k, block_table, sinks, alibi, **a:
        kernels.attention_varlen(q, k_cache, v_cache, cu_q, None, max(LENS),
                                 block_table=block_table, seqused_k=seqused_k, causal=True,
                                 sinks=sinks, alibi_slopes=alibi, mod_aux=_aux(a),
                                 return_lse=True, **MODS), grad=False),
    "attention_with_kvcache": Case(
        _kvcache, lambda q, k_cache, v_cache, k, v, block_table, cache_seqlens, sinks, alibi,
        **a: kernels.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k, v,
                                            block_table=block_table, causal=True, sinks=sinks,
                                            alibi_slopes=alibi, mod_aux=_aux(a),
                                            return_lse=True, **MODS),
        grad=False, mutated=("k_cache", "v_cache")),
    "flash_attn_func": Case(_fa_dense, lambda q, k, v, s_aux, alibi: fa.flash_attn_func(
        q, k, v, causal=True, alibi_slopes=alibi, s_aux=s_aux, return_attn_probs=True)[:2],
        grad=True),
    "flash_attn_varlen_func": Case(
        _fa_varlen, lambda q, k, v, cu_q, cu_k, s_aux, alibi: fa.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(LENS), max(LENS), causal=True, window_size=(3, 0),
            alibi_slopes=alibi, s_aux=s_aux, return_attn_probs=True)[:2], grad=True),
    "flash_attn_with_kvcache": Case(
        _fa_kvcache, lambda q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
        cache_leftpad, rotary_cos, rotary_sin, s_aux, alibi: fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, causal=True, alibi_slopes=alibi, s_aux=s_aux,
            return_softmax_lse=True), grad=False, mutated=("k_cache", "v_cache"),
        # rotary rotates the new k, not v: one cache would take two different appends
        apart=(("k_cache", "v_cache"),)),
}


# ------------------------------------------------------------------ the pairs
def _groups(tensors, apart=()):
    """Names of the arguments one object could stand for, grouped: same dtype, shape and
    requires_grad (groups of one dropped; a pair in ``apart`` is two groups)."""
    groups = {}
    for name, t in tensors.items():
        key = (t.dtype, tuple(t.shape), t.requires_grad)
        key += tuple(i for i, pair in enumerate(apart) if name == pair[1])
        groups.setdefault(key, []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _matchings(names):
    """Every pair of ``names`` once, as rounds of disjoint pairs (the circle method)."""
    ring = list(names) + ([None] if len(names) % 2 else [])
    rounds = []
    for _ in range(len(ring) - 1):
        rounds.append([(a, b) for a, b in zip(ring[:len(ring) // 2], ring[::-1])
                       if a is not None and b is not None])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return rounds


def _rounds(tensors, apart=()):
    """Rounds of aliasings, each one pair of every group, all pairs of every group covered."""
    per_group = [_matchings(g) for g in _groups(tensors, apart)]
    n = max(map(len, per_group), default=0)
    return [[p for rounds in per_group if i < len(rounds) for p in rounds[i]] for i in range(n)]


def test_rounds_cover_every_pair_once():
    names = list("abcde")
    got = [p for r in _matchings(names) for p in r]
    assert sorted(map(frozenset, got), key=sorted) == sorted(
        map(frozenset, itertools.combinations(names, 2)), key=sorted)
    assert all(len({x for p in r for x in p}) == 2 * len(r) for r in _matchings(names))


def _leaf(t):
    return t.detach().clone().requires_grad_(t.requires_grad)


def _flat(res):
    return list(res) if isinstance(res, (tuple, list)) else [res]


def _run(case, args, names_of):
    """Outputs, the written arguments and the gradients of the distinct leaves (by the names
    that share each leaf) of ``case.call(**args)``."""
    outs = _flat(case.call(**args))
    grads = {}
    leaves = {id(t): t for t in args.values() if t.requires_grad}
    if case.grad:
        gen = torch.Generator(DEVICE).manual_seed(0)   # one do for both calls
        do = [torch.randn(o.shape, generator=gen, device=DEVICE, dtype=o.dtype)
              if o.requires_grad else None for o in outs]
        loss = sum((o * d).sum() for o, d in zip(outs, do) if d is not None)
        for t, g in zip(leaves.values(), torch.autograd.grad(loss, list(leaves.values()))):
            grads[names_of(t)] = g
    return [o.detach() for o in outs], {m: args[m].detach() for m in case.mutated}, grads


@pytest.mark.parametrize("entry", CASES)
def test_aliased_arguments_compile(entry):
    case = CASES[entry]
    base = case.make()
    rounds = _rounds(base, case.apart)
    assert rounds, f"{entry}: no two arguments of one type (the case tests nothing)"
    for pairs in rounds:
        source = {n: n for n in base}
        for a, b in pairs:
            source[b] = a
        # Compiled: each pair one object (a fresh leaf per source).
        objs = {n: _leaf(base[n]) for n in base if source[n] == n}
        args = {n: objs[source[n]] for n in base}
        torch._dynamo.reset()   # a new aliasing is a new graph; no recompile limit in the way
        fn = torch.compile(lambda *ts: case.call(**dict(zip(base, ts))), fullgraph=True,
                           backend="aot_eager")
        got = _run(case._replace(call=lambda **kw: fn(*kw.values())), args,
                   lambda t: tuple(sorted(n for n in base if args[n] is t)))
        # Eager with distinct copies (each of the source's values).
        ref_args = {n: _leaf(base[source[n]]) for n in base}
        want = _run(case, ref_args, lambda t: next(n for n in base if ref_args[n] is t))
        what = f"{entry} with {' '.join(f'{a}={b}' for a, b in pairs)}"
        for i, (g, w) in enumerate(zip(got[0], want[0])):
            assert torch.equal(g, w), f"{what}: output {i} differs from distinct copies"
        for m in case.mutated:
            assert torch.equal(got[1][m], want[1][m]), f"{what}: {m} after the call differs"
        for names, g in got[2].items():
            w = sum(want[2][n] for n in names)
            assert torch.equal(g, w), f"{what}: gradient of {'='.join(names)} differs"
        assert set(got[2]) or not case.grad, f"{what}: no gradient checked"
