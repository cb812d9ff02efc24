"""The passes of ``vocab_parallel_sample`` over a logits block as Triton kernels (its CUDA path).

The sampler (``sample.py``) draws by inverse CDF in three levels (shard, tile, column), so that no
pass takes the prefix sum of a whole [c, V_local] block (amax, exp and a cumulative sum over it move
each fp32 block five times; these kernels read it once, then only the drawn tiles):

* ``tile_stats_kernel`` reads each row once and writes, per tile of TILE columns, the tile's max
  and Σ exp(z - max): [c, V_local / TILE] values;
* ``row_mass_kernel`` turns a row's tile statistics into its max, each tile's mass Σ exp(z - row
  max), their running sum and the row's mass (fp64): the ranks exchange (max, mass) to weigh their
  shards;
* ``tile_sample_kernel`` does the rest of a row's draws in one program: each draw's uniform
  (splitmix64 of the row key, as ``sample.draw_uniforms``), whether it falls in this rank's shard,
  its tile (a binary search of the running masses) and the fraction of that tile's mass below it,
  then its column: it reads only the drawn tile and returns the first column whose prefix sum of
  exp(z - tile max) exceeds fraction × the tile's own total.

The column step scales the fraction by the sum it computes itself, so the kernels' different
summation orders never move a draw outside its tile, and it picks only columns of positive mass (a
padding row, z = -inf, is never drawn, whatever the prefix sums' rounding). Folding the uniforms, the
shard and tile searches into these kernels replaces some fifty small torch launches per block with two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_kd.ops.triton_lse import LOG2E

TILES_PER_PROGRAM = 16
DRAW_BLOCK = 8  # draws at once: binary searches of [DRAW_BLOCK], then [DRAW_BLOCK, TILE] loads
DRAW_WARPS = 4  # with DRAW_BLOCK 8: ~120 registers a thread, four programs an SM
# bounds [c, 6] fp64 of each row's draws for this rank (``sample.vocab_parallel_sample``)
B_LO, B_HI, B_START, B_MASS, B_TOTAL, B_BELOW, NUM_BOUNDS = range(7)


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
def row_mass_kernel(
    max_ptr, sumexp_ptr,  # [c, NUM_TILES] fp32 (tile_stats_kernel)
    row_max_ptr, local_ptr,  # out [c] fp64: the row max (0 for a row of padding only), Σ exp(z - row max)
    tile_mass_ptr, tile_end_ptr,  # out [c, NUM_TILES] fp64: each tile's Σ exp(z - row max), their running sum
    NUM_TILES: tl.constexpr, BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    real = t < NUM_TILES
    m = tl.load(max_ptr + row * NUM_TILES + t, mask=real, other=float("-inf"))
    s = tl.load(sumexp_ptr + row * NUM_TILES + t, mask=real, other=0.0)
    row_max = tl.max(m, axis=0).to(tl.float64)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    mass = tl.where(real, s.to(tl.float64) * tl.exp(m.to(tl.float64) - row_max), 0.0)
    end = tl.cumsum(mass, axis=0)
    tl.store(tile_mass_ptr + row * NUM_TILES + t, mass, mask=real)
    tl.store(tile_end_ptr + row * NUM_TILES + t, end, mask=real)
    tl.store(row_max_ptr + row, row_max)
    tl.store(local_ptr + row, tl.max(end, axis=0))  # a running sum of masses >= 0 peaks at its end


@triton.jit
def _count_at_most(ends_ptr, value, NUM_TILES: tl.constexpr, LOG_TILES: tl.constexpr, STRICT: tl.constexpr):
    """Per value, #{t: ends[t] <= value} (``STRICT``: < value) of a row's sorted ``ends``: torch's
    searchsorted(right=True) (right=False), by a binary search of every value at once."""
    lo = tl.zeros(value.shape, dtype=tl.int32)
    hi = tl.full(value.shape, NUM_TILES, dtype=tl.int32)
    for _ in range(LOG_TILES):
        active, mid = lo < hi, (lo + hi) // 2
        end = tl.load(ends_ptr + mid, mask=active, other=0.0)
        below = (end < value) if STRICT else (end <= value)
        lo, hi = tl.where(active & below, mid + 1, lo), tl.where(active & ~below, mid, hi)
    return lo


@triton.jit
def _splitmix64(x):
    """splitmix64's output function on uint64 words (``sample.splitmix64``)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def tile_sample_kernel(
    z_ptr, z_stride,
    tile_mass_ptr, tile_end_ptr, local_ptr,  # row_mass_kernel's
    key_ptr,  # [c] int64 row keys
    bound_ptr,  # [c, NUM_BOUNDS] fp64: this rank's [lo, hi) of x = u·total, its start and mass, total, below it
    col_ptr,  # out [c, N] int64: the drawn column of this block, -1 where another rank's shard holds the draw
    N: tl.constexpr, V: tl.constexpr, NUM_TILES: tl.constexpr, LOG_TILES: tl.constexpr, TILE: tl.constexpr,
    DRAW_BLOCK: tl.constexpr,
    B_LO: tl.constexpr, B_HI: tl.constexpr, B_START: tl.constexpr, B_MASS: tl.constexpr, B_TOTAL: tl.constexpr,
    B_BELOW: tl.constexpr, NUM_BOUNDS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    masses, ends = tile_mass_ptr + row * NUM_TILES, tile_end_ptr + row * NUM_TILES
    local = tl.load(local_ptr + row)
    key = tl.load(key_ptr + row).to(tl.uint64, bitcast=True)
    bounds = bound_ptr + row * NUM_BOUNDS
    lo, hi = tl.load(bounds + B_LO), tl.load(bounds + B_HI)
    start, shard_mass = tl.load(bounds + B_START), tl.load(bounds + B_MASS)
    total, below = tl.load(bounds + B_TOTAL), tl.load(bounds + B_BELOW)
    # y rounded up to the rank's mass goes to the last tile with mass: the first whose running sum
    # reaches it
    last_tile = tl.max(_count_at_most(ends, tl.full((1,), 0.0, tl.float64) + local, NUM_TILES, LOG_TILES, True))
    k = tl.arange(0, TILE)[None, :]
    for d0 in range(0, N, DRAW_BLOCK):
        draws = d0 + tl.arange(0, DRAW_BLOCK)
        step = (draws + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
        u = (_splitmix64(key + step) >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)  # 2^-53
        x = tl.minimum(u * total, below)
        own = (draws < N) & (x >= lo) & (x < hi)
        y = tl.minimum(tl.maximum((x - start) / shard_mass, 0.0), 1.0) * local
        tile = tl.minimum(_count_at_most(ends, y, NUM_TILES, LOG_TILES, False), last_tile)
        tile_mass = tl.load(masses + tile, mask=own, other=1.0)
        tile_start = tl.load(ends + tile, mask=own, other=0.0) - tile_mass
        frac = tl.minimum(tl.maximum((y - tile_start) / tile_mass, 0.0), 1.0).to(tl.float32)
        cols = tile[:, None] * TILE + k
        z = tl.load(z_ptr + row * z_stride + cols, mask=own[:, None] & (cols < V), other=float("-inf"))
        _top, e = _exp_from_max(z, 1)
        positive = e > 0.0
        target = frac * tl.sum(e, axis=1)
        hit = (tl.cumsum(e, axis=1) > target[:, None]) & positive
        first = tl.min(tl.where(hit, k, TILE), axis=1)
        last = tl.max(tl.where(positive, k, -1), axis=1)  # a fraction rounded up to 1: the last with mass
        col = tile * TILE + tl.where(first < TILE, first, last)
        tl.store(col_ptr + row * N + draws, tl.where(own, col, -1).to(tl.int64), mask=draws < N)


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


def row_masses(tile_max: torch.Tensor, tile_sumexp: torch.Tensor):
    """Of the block whose tile statistics are given: the row max (0 for a row of padding only), each
    tile's mass Σ exp(z - row max), their running sums and the row's mass, all fp64 ([c], [c, T],
    [c, T], [c])."""
    rows, num_tiles = tile_max.shape
    row_max = torch.empty(rows, dtype=torch.float64, device=tile_max.device)
    local = torch.empty_like(row_max)
    tile_mass = torch.empty((rows, num_tiles), dtype=torch.float64, device=tile_max.device)
    tile_end = torch.empty_like(tile_mass)
    row_mass_kernel[(rows,)](tile_max, tile_sumexp, row_max, local, tile_mass, tile_end, NUM_TILES=num_tiles,
                             BLOCK_T=triton.next_power_of_2(num_tiles), num_warps=4)
    return row_max, tile_mass, tile_end, local


def draw_columns(z: torch.Tensor, tile_mass: torch.Tensor, tile_end: torch.Tensor, local_mass: torch.Tensor,
                 keys: torch.Tensor, num_draws: int, bounds: torch.Tensor, tile_size: int) -> torch.Tensor:
    """Columns [c, N] int64 of z drawn by the rows' keys [c] where the draw falls in this rank's
    shard (``bounds`` [c, NUM_BOUNDS] fp64), -1 elsewhere; the tiles' masses from ``row_masses``."""
    rows, num_tiles = tile_mass.shape
    cols = torch.empty((rows, num_draws), dtype=torch.int64, device=z.device)
    tile_sample_kernel[(rows,)](
        z, z.stride(0), tile_mass, tile_end, local_mass, keys.contiguous(), bounds.contiguous(), cols,
        N=num_draws, V=z.shape[1], NUM_TILES=num_tiles, LOG_TILES=num_tiles.bit_length(), TILE=tile_size,
        DRAW_BLOCK=DRAW_BLOCK, B_LO=B_LO, B_HI=B_HI, B_START=B_START, B_MASS=B_MASS, B_TOTAL=B_TOTAL,
        B_BELOW=B_BELOW, NUM_BOUNDS=NUM_BOUNDS, num_warps=DRAW_WARPS,
    )
    return cols
