"""The causal kernels' program order (kernels/core/tiles.program_ids): every (block, head,
batch) exactly once, and in linear grid order every head's and batch's longest block before any
shorter one; a persistent forward's tiles (``tile_ids``) in the same order."""
import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE

from kernels.core.tiles import program_ids, tile_ids


@triton.jit
def _record(OUT, LONGEST_FIRST: tl.constexpr, FIRST_IS_LONGEST: tl.constexpr):
    block, head, batch = program_ids(LONGEST_FIRST, FIRST_IS_LONGEST)
    lin = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1)
                                                   + tl.num_programs(1) * tl.program_id(2))
    tl.store(OUT + 3 * lin, block)
    tl.store(OUT + 3 * lin + 1, head)
    tl.store(OUT + 3 * lin + 2, batch)


@pytest.mark.parametrize("first_is_longest", [False, True])
@pytest.mark.parametrize("grid", [(5, 3, 2), (1, 4, 1), (7, 1, 3)])
def test_longest_blocks_start_first(grid, first_is_longest):
    n = grid[0] * grid[1] * grid[2]
    out = torch.full((n, 3), -1, dtype=torch.int32, device=DEVICE)
    _record[grid](out, LONGEST_FIRST=True, FIRST_IS_LONGEST=first_is_longest)
    ids = [tuple(r) for r in out.tolist()]            # in linear (start) order
    assert sorted(ids) == sorted((m, h, b) for m in range(grid[0]) for h in range(grid[1])
                                 for b in range(grid[2]))
    # The block of each program, in start order: longest first, each block of every head and
    # batch before the next.
    per_block = grid[1] * grid[2]
    blocks = [m for m, _, _ in ids]
    want = [r // per_block for r in range(n)]
    assert blocks == (want if first_is_longest else [grid[0] - 1 - m for m in want])


def test_plain_order_without_causal():
    grid = (3, 2, 2)
    out = torch.full((12, 3), -1, dtype=torch.int32, device=DEVICE)
    _record[grid](out, LONGEST_FIRST=False, FIRST_IS_LONGEST=False)
    assert [tuple(r) for r in out.tolist()] == [(m, h, b) for b in range(2) for h in range(2)
                                                for m in range(3)]


@triton.jit
def _record_tiles(OUT, n_tiles, n_blocks, n_heads, n_batch, LONGEST_FIRST: tl.constexpr,
                  FIRST_IS_LONGEST: tl.constexpr):
    # One program walks the tiles as a persistent program that drew them all would.
    for lin in range(0, n_tiles):
        block, head, batch = tile_ids(tl.cast(lin, tl.int64), n_blocks, n_heads, n_batch,
                                      LONGEST_FIRST, FIRST_IS_LONGEST)
        tl.store(OUT + 3 * lin, block)
        tl.store(OUT + 3 * lin + 1, head)
        tl.store(OUT + 3 * lin + 2, batch)


@pytest.mark.parametrize("longest_first,first_is_longest", [(True, False), (True, True),
                                                             (False, False)])
@pytest.mark.parametrize("grid", [(5, 3, 2), (1, 4, 1), (7, 1, 3)])
def test_tiles_in_program_order(grid, longest_first, first_is_longest):
    """Tile t of a persistent launch is the (block, head, batch) of the grid's t-th program."""
    n = grid[0] * grid[1] * grid[2]
    want = torch.full((n, 3), -1, dtype=torch.int32, device=DEVICE)
    _record[grid](want, LONGEST_FIRST=longest_first, FIRST_IS_LONGEST=first_is_longest)
    got = torch.full((n, 3), -1, dtype=torch.int32, device=DEVICE)
    _record_tiles[(1,)](got, n, *grid, LONGEST_FIRST=longest_first,
                        FIRST_IS_LONGEST=first_is_longest)
    assert got.tolist() == want.tolist()
