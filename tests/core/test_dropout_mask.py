"""reference.dropout reproduces Triton's Philox and the kernel's dropout mask bit for bit.

Triton kernels run in the interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET before
this module imports triton); Philox is integer code, so the interpreter's bits are the GPU's.
"""
import pytest
import torch
import triton
import triton.language as tl

from helpers import DEVICE
from kernels.core.dropout import dropout_keep_tile, dropout_threshold
from reference import dropout_keep_mask, philox4x32

SEEDS = [0, 1, 123, 2**33 + 5, 2**62 + 7]


@triton.jit
def _randint4x_kernel(seed, offsets_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[w, i] = word w of tl.randint4x(seed, offsets[i]), zero-extended to int64."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = idx < n
    offsets = tl.load(offsets_ptr + idx, mask=in_range, other=0)  # int64
    r0, r1, r2, r3 = tl.randint4x(seed, offsets)
    tl.store(out_ptr + idx, r0.to(tl.int64), mask=in_range)
    tl.store(out_ptr + n + idx, r1.to(tl.int64), mask=in_range)
    tl.store(out_ptr + 2 * n + idx, r2.to(tl.int64), mask=in_range)
    tl.store(out_ptr + 3 * n + idx, r3.to(tl.int64), mask=in_range)


@triton.jit
def _keep_tile_kernel(seed, out_ptr, bh_base, q_len, k_len, threshold,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[bh, i, j] = dropout_keep_tile's bit for head bh_base + bh, row i, column j."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    start_n = tl.program_id(2) * BLOCK_N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # The dense layout's row id base (bh * q_len) and Philox counters per row (kernels/_dropout).
    row_base = (bh + bh_base).to(tl.int64) * q_len
    keep = dropout_keep_tile(seed, row_base, offs_m, start_n, (k_len + 3) // 4, threshold,
                             BLOCK_M, BLOCK_N)
    ptrs = out_ptr + (bh * q_len + offs_m[:, None]).to(tl.int64) * k_len + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(offs_m[:, None] < q_len) & (offs_n[None, :] < k_len))


def _triton_randint4x(seed, offsets):
    """(4, n) int64 words of tl.randint4x for int64 ``offsets`` (n,)."""
    out = torch.empty(4, offsets.numel(), dtype=torch.int64, device=offsets.device)
    block = 64
    _randint4x_kernel[(triton.cdiv(offsets.numel(), block),)](
        seed, offsets, out, offsets.numel(), BLOCK=block)
    return out


def _kernel_mask(seed, n_heads, q_len, k_len, p, block_m=16, block_n=16, bh_base=0):
    """bool (n_heads, q_len, k_len) from dropout_keep_tile over a grid of tiles."""
    out = torch.full((n_heads, q_len, k_len), 2, dtype=torch.int8, device=DEVICE)
    grid = (triton.cdiv(q_len, block_m), n_heads, triton.cdiv(k_len, block_n))
    _keep_tile_kernel[grid](seed, out, bh_base, q_len, k_len, dropout_threshold(p),
                            BLOCK_M=block_m, BLOCK_N=block_n)
    assert (out != 2).all(), "the test kernel left elements unwritten"
    return out.bool()


def test_philox_matches_triton_randint4x():
    base = torch.arange(48, dtype=torch.int64)
    offsets = torch.cat([
        base,                              # small counters
        2**31 - 24 + base,                 # across the int32 sign bit
        2**32 - 24 + base,                 # across the low/high word boundary
        2**40 + 12345 + base,              # high word in use
        torch.tensor([2**62 + 3, 2**63 - 1]),
    ]).to(DEVICE)
    for seed in SEEDS:
        expected = _triton_randint4x(seed, offsets)
        got = torch.stack(philox4x32(seed, offsets))
        assert torch.equal(got, expected), f"seed {seed}: Philox words differ from tl.randint4x"
        assert got.min() >= 0 and got.max() < 2**32


def test_philox_known_answer():
    # Philox-4x32-10 known-answer vector from Random123's kat_vectors (counter 0, key 0), so the
    # reference is tied to the published algorithm, not only to Triton's implementation.
    words = philox4x32(0, torch.zeros(1, dtype=torch.int64))
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("seed", [42, 2**40 + 3])
def test_mask_matches_kernel_tile(seed, p):
    batch, heads, q_len, k_len = 2, 3, 17, 37
    expected = _kernel_mask(seed, batch * heads, q_len, k_len, p)
    got = dropout_keep_mask(seed, batch, heads, q_len, k_len, p, device=DEVICE)
    assert got.shape == (batch, heads, q_len, k_len) and got.dtype == torch.bool
    assert torch.equal(got.view(batch * heads, q_len, k_len), expected)


def test_mask_matches_kernel_tile_with_counters_above_2_to_32():
    # bh ~ 2**28 puts the Philox counter (bh * q_len + i) * groups + j // 4 near 2**33: checks that
    # both sides use 64-bit counters. The reference is evaluated from the docstring definition
    # through philox4x32, since dropout_keep_mask would need the whole 2**28-head tensor.
    seed, p, bh_base, n_heads, q_len, k_len = 9, 0.5, 2**28, 2, 5, 21
    expected = _kernel_mask(seed, n_heads, q_len, k_len, p, bh_base=bh_base)
    groups = (k_len + 3) // 4
    bh = torch.arange(n_heads, dtype=torch.int64)[:, None, None] + bh_base
    i = torch.arange(q_len, dtype=torch.int64)[None, :, None]
    j = torch.arange(k_len, dtype=torch.int64)[None, None, :]
    counter = (bh * q_len + i) * groups + j // 4
    assert counter.max() > 2**32
    words = torch.stack(philox4x32(seed, counter), dim=-1)  # (heads, q_len, k_len, 4)
    word = words.gather(-1, (j % 4).expand(n_heads, q_len, k_len)[..., None])[..., 0]
    assert torch.equal((word >> 8) >= dropout_threshold(p), expected.cpu())


@pytest.mark.parametrize("p", [0.1, 0.3, 0.9])
def test_kept_fraction(p):
    keep = dropout_keep_mask(1234, 2, 4, 64, 64, p)
    assert abs(keep.float().mean().item() - (1 - p)) <= 0.02


def test_p_zero_keeps_everything():
    assert dropout_keep_mask(5, 2, 3, 17, 37, 0.0).all()


def test_seeds_and_reproducibility():
    a = dropout_keep_mask(11, 2, 2, 32, 40, 0.5)
    assert torch.equal(a, dropout_keep_mask(11, 2, 2, 32, 40, 0.5))
    assert not torch.equal(a, dropout_keep_mask(12, 2, 2, 32, 40, 0.5))
    # Seeds differing only in their high 32 bits must differ too (both halves are the key).
    assert not torch.equal(a, dropout_keep_mask(11 + 2**32, 2, 2, 32, 40, 0.5))


def test_chunking_does_not_change_the_mask(monkeypatch):
    import reference.dropout as rd

    whole = dropout_keep_mask(77, 2, 3, 19, 45, 0.3)
    monkeypatch.setattr(rd, "_CHUNK", 7)  # a few rows per chunk, not dividing the row count
    assert torch.equal(whole, dropout_keep_mask(77, 2, 3, 19, 45, 0.3))


def test_argument_errors():
    with pytest.raises(ValueError, match="seed"):
        dropout_keep_mask(-1, 1, 1, 4, 4, 0.1)
    with pytest.raises(ValueError, match="seed"):
        dropout_keep_mask(2**63, 1, 1, 4, 4, 0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_keep_mask(0, 1, 1, 4, 4, 1.0)
