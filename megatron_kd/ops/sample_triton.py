"""The two passes of ``vocab_parallel_sample`` over a logits block as Triton kernels (its CUDA path).

The sampler (``topk.py``) draws by inverse CDF in three levels (shard, tile, column), so that no
pass takes the prefix sum of a whole [c, V_local] block (amax, exp and a cumulative sum over it move
each fp32 block five times; these two kernels read it once, then only the drawn tiles):

* ``tile_stats_kernel`` reads each row once and writes, per tile of TILE columns, the tile's max
  and Σ exp(z - max): [c, V_local / TILE] values, which the sampler turns (in fp64) into the tiles'
  cumulative masses and, for each draw, its tile and the fraction of that tile's mass below it;
* ``tile_draw_kernel`` reads only the drawn tiles: per draw it takes the tile's prefix sums of
  exp(z - tile max) and returns the first column whose sum exceeds fraction × the tile's own total.

The second kernel scales the fraction by the sum it computes itself, so the two kernels' different
summation orders never move a draw outside its tile, and it picks only columns of positive mass (a
padding row, z = -inf, is never drawn, however the prefix sums round).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_kd.ops.triton_lse import LOG2E

TILES_PER_PROGRAM = 16
DRAW_BLOCK = 16


@triton.jit
def _exp_from_max(z, axis: tl.constexpr):
    """(max along ``axis``, exp(z - max)); an all -inf tile gives (-inf, zeros)."""
    m = tl.max(z, axis=axis)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.exp2((z - tl.expand_dims(m_ref, axis)) * LOG2E)


@triton.jit
def tile_stats_kernel(
    z_ptr, z_stride,
    max_ptr, sumexp_ptr,  # out [c, NUM_TILES] fp32
    V: tl.constexpr, NUM_TILES: tl.constexpr, TILE: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.program_id(1) * TILES_PER_PROGRAM + tl.arange(0, TILES_PER_PROGRAM)
    cols = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
    z = tl.load(z_ptr + row * z_stride + cols, mask=cols < V, other=float("-inf"))
    m, e = _exp_from_max(z, 1)
    out = row * NUM_TILES + tiles
    tl.store(max_ptr + out, m, mask=tiles < NUM_TILES)
    tl.store(sumexp_ptr + out, tl.sum(e, axis=1), mask=tiles < NUM_TILES)


@triton.jit
def tile_draw_kernel(
    z_ptr, z_stride,
    tile_ptr, frac_ptr,  # [c, N] int64 (-1: not drawn here), fp32 in [0, 1]
    col_ptr,  # out [c, N] int64: the drawn column of this block, -1 where tile is -1
    N, V: tl.constexpr, TILE: tl.constexpr, DRAW_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    draws = tl.program_id(1) * DRAW_BLOCK + tl.arange(0, DRAW_BLOCK)
    at = row * N + draws
    tile = tl.load(tile_ptr + at, mask=draws < N, other=-1)
    frac = tl.load(frac_ptr + at, mask=draws < N, other=0.0)
    k = tl.arange(0, TILE)[None, :]
    cols = tile[:, None] * TILE + k
    z = tl.load(z_ptr + row * z_stride + cols, mask=(tile[:, None] >= 0) & (cols < V), other=float("-inf"))
    _, e = _exp_from_max(z, 1)
    positive = e > 0.0
    target = frac * tl.sum(e, axis=1)
    hit = (tl.cumsum(e, axis=1) > target[:, None]) & positive
    first = tl.min(tl.where(hit, k, TILE), axis=1)
    last = tl.max(tl.where(positive, k, -1), axis=1)  # a fraction rounded up to 1: the last with mass
    col = tile * TILE + tl.where(first < TILE, first, last)
    tl.store(col_ptr + at, tl.where(tile >= 0, col, -1), mask=draws < N)


def tile_stats(z: torch.Tensor, tile_size: int):
    """Of an fp32 block z [c, V_local]: per tile of ``tile_size`` columns (the last one ragged) its
    max and Σ exp(z - max), both [c, ceil(V_local / tile_size)] fp32 (-inf and 0 for a tile of
    padding rows)."""
    rows, vocab_local = z.shape
    num_tiles = triton.cdiv(vocab_local, tile_size)
    tile_max = torch.empty((rows, num_tiles), dtype=torch.float32, device=z.device)
    tile_sumexp = torch.empty_like(tile_max)
    grid = (rows, triton.cdiv(num_tiles, TILES_PER_PROGRAM))
    tile_stats_kernel[grid](z, z.stride(0), tile_max, tile_sumexp, V=vocab_local, NUM_TILES=num_tiles, TILE=tile_size,
                            TILES_PER_PROGRAM=TILES_PER_PROGRAM, num_warps=8)
    return tile_max, tile_sumexp


def tile_draws(z: torch.Tensor, tile: torch.Tensor, frac: torch.Tensor, tile_size: int) -> torch.Tensor:
    """Columns [c, N] int64 of z drawn in the given tiles [c, N] (int64, -1 for none: -1 out) at the
    given fractions [c, N] of each tile's mass."""
    rows, n = tile.shape
    cols = torch.empty_like(tile)
    tile_draw_kernel[(rows, triton.cdiv(n, DRAW_BLOCK))](
        z, z.stride(0), tile.contiguous(), frac.float().contiguous(), cols, n, V=z.shape[1], TILE=tile_size,
        DRAW_BLOCK=DRAW_BLOCK, num_warps=8,
    )
    return cols
