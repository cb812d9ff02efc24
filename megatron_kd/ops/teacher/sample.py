"""The teacher's sample of softmax(hidden · Wᵀ / τ) without full logits: ``vocab_parallel_sample``.

``vocab_parallel_sample`` draws N tokens per position from the distribution whose top-K
``topk.vocab_parallel_topk`` takes, over the same logits blocks (``topk.logits_chunks``), for
Random-Sampling KD: the draws' counts, log(count / N), replace the top-K as an unbiased sparse
teacher. The draws are a function of (row key, draw number) and the row's probabilities only, never
of a generator's state: draw j of a row is the inverse CDF at u_j = splitmix64(row key + (j + 1)·γ)
(the j-th output of a splitmix64 stream started at the row key), and the teacher pass makes the row
key from (seed, global sample index, position) (``sample_row_keys``). So a pass that is killed and
resumed, or run with other micro-batch or chunk sizes, draws the same tokens for the same rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kd.ops.comm import all_gather_stack, group_rank, group_size
from megatron_kd.ops.common import resolve_impl
from megatron_kd.ops.teacher.topk import logits_chunks


# splitmix64 (Steele, Lea, Flood 2014) in torch int64 arithmetic, which wraps like uint64 for + and *;
# >> on int64 is arithmetic, so each shift is masked back to a logical one.
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 words: a bijection whose outputs pass BigCrush for
    consecutive inputs (``x + k·γ``)."""
    x = (x ^ _shift_right(x, 30)) * _MUL1
    x = (x ^ _shift_right(x, 27)) * _MUL2
    return x ^ _shift_right(x, 31)


def _absorb(state: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return splitmix64((state ^ value) + _GAMMA)


def sample_row_keys(seed: int, sample_ids: torch.Tensor, seq_length: int) -> torch.Tensor:
    """int64 [seq_length, b]: the key of position p of global sample ``sample_ids[i]`` (sequence-
    first, as the teacher's hidden states are), a hash of (seed, sample index, position) alone."""
    sample_ids = torch.as_tensor(sample_ids, dtype=torch.int64)
    # torch.full, not torch.tensor: no host-to-device copy, which would wait for the GPU
    state = _absorb(torch.zeros((), dtype=torch.int64, device=sample_ids.device),
                    torch.full((), int(seed), dtype=torch.int64, device=sample_ids.device))
    state = _absorb(state, sample_ids).unsqueeze(0)  # [1, b]
    positions = torch.arange(seq_length, dtype=torch.int64, device=sample_ids.device).unsqueeze(1)
    return _absorb(state, positions)  # [s, b]


def draw_uniforms(row_keys: torch.Tensor, num_draws: int) -> torch.Tensor:
    """float64 [..., num_draws] in [0, 1): draw j of each row from the row's 64-bit key (53 bits)."""
    steps = torch.arange(1, num_draws + 1, dtype=torch.int64, device=row_keys.device) * _GAMMA
    words = splitmix64(row_keys.unsqueeze(-1) + steps)
    return _shift_right(words, 11).double() * 2.0 ** -53


SAMPLE_TILE = 256  # columns per tile of the sampler: its second pass reads num_draws x 256 values of a row


@torch.no_grad()
def vocab_parallel_sample(hidden: torch.Tensor, weight: torch.Tensor, num_draws: int, *,
                          row_keys: torch.Tensor, tp_group: dist.ProcessGroup | None = None,
                          vocab_size: int | None = None, temperature: float = 1.0,
                          chunk_size: int | None = None, impl: str = "auto"):
    """``num_draws`` tokens drawn per position from softmax(hidden·Wᵀ/τ), as (ids int64 [..., N],
    logprobs float32 [..., N]): the distinct drawn ids (ascending) with log(count / N), then
    padding (-1, -inf).

    ``row_keys`` int64 [...] (hidden's leading shape) keys each row's draws (``sample_row_keys``):
    rows with the same key and logits get the same draws whatever else is in the batch.
    ``impl``: "torch", "triton" (the kernels of ``sample_triton.py``) or "auto" (Triton on CUDA).

    Inverse CDF in three levels, so no rank needs the full distribution and no pass takes the
    prefix sum of a whole logits block. Each rank cuts its block into tiles of SAMPLE_TILE columns
    and reads it once for every tile's (max, Σ exp(z - max)). Every rank turns the same u into a
    shard, from the cumulative shard masses (the gathered per-rank (max, mass), in fp64: identical
    on every TP rank); the shard's owner turns the rest of u into a tile, from its tiles' cumulative
    masses (fp64), and the rest into a column, from the prefix sums of that tile alone (the block's
    dtype: fp32 for bf16/fp32 teachers). A token's draw probability is thus exact to fp64 at the
    tile level and to ~2^-24 of its tile's mass within it. The Triton path reads the block once,
    then only the drawn tiles; torch's works on the block in place.
    """
    rank, tp = group_rank(tp_group), group_size(tp_group)
    vocab_local = weight.shape[0]
    lead, n = hidden.shape[:-1], num_draws
    if tuple(row_keys.shape) != tuple(lead):
        raise ValueError(f"row_keys {tuple(row_keys.shape)} must have hidden's leading shape {tuple(lead)}")
    use_triton = resolve_impl(impl, hidden) == "triton"
    if use_triton:
        from megatron_kd.ops.teacher.sample_triton import draw_columns, row_masses, tile_stats
    else:
        tile_stats, row_masses, draw_columns = _tile_stats_torch_, _row_masses_torch, _draw_columns_torch
    keys = row_keys.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    ids_out = torch.empty((*lead, n), dtype=torch.int64, device=hidden.device).view(-1, n)
    lps_out = torch.empty((*lead, n), dtype=torch.float32, device=hidden.device).view(-1, n)
    # torch's path pads the block to whole tiles: a copy when the last one is ragged
    for a, b, z in logits_chunks(hidden, weight, tp_group=tp_group, vocab_size=vocab_size,
                                 temperature=temperature, chunk_size=chunk_size, extra_block=not use_triton):
        if not use_triton:
            z = _whole_tiles(z, SAMPLE_TILE)  # overwritten with exp(z - tile max) by the stats
        tile_max, tile_sumexp = tile_stats(z, SAMPLE_TILE)  # [c, T]
        row_max, tile_mass, tile_end, local_mass = row_masses(tile_max, tile_sumexp)  # fp64 [c], [c, T], [c, T], [c]
        stats = all_gather_stack(torch.stack([row_max, local_mass], -1), tp_group)  # [tp, c, 2] fp64
        shard_mass = (stats[..., 1] * (stats[..., 0] - stats[..., 0].amax(0)).exp()).t()  # [c, tp]
        shard_end = shard_mass.cumsum(-1)
        total = shard_end[:, -1]
        # draw j falls in shard #{r: shard_end[r] <= x_j}, x_j = u_j · total: this rank's draws have
        # x in [shard_end[rank - 1], shard_end[rank]); below the total (u·total can come out equal to it),
        # so x lies in a shard of positive mass. [c, 6] in sample_triton's B_* order
        bounds = torch.stack([shard_end[:, rank - 1] if rank else torch.zeros_like(total), shard_end[:, rank],
                              shard_end[:, rank] - shard_mass[:, rank], shard_mass[:, rank], total,
                              torch.nextafter(total, torch.zeros_like(total))], -1)
        cols = draw_columns(z, tile_mass, tile_end, local_mass, keys[a:b], n, bounds, SAMPLE_TILE)
        del z
        local_ids = torch.where(cols >= 0, cols + rank * vocab_local, -1).to(torch.float32)
        all_ids = all_gather_stack(local_ids, tp_group).amax(0)  # exactly one rank owns each draw
        ids_out[a:b], lps_out[a:b] = _counts_to_logprobs(all_ids.long(), n)
    return ids_out.view(*lead, n), lps_out.view(*lead, n)


def _whole_tiles(z: torch.Tensor, tile_size: int) -> torch.Tensor:
    """z [c, V_local] widened with -inf columns to whole tiles (a copy only when the last is ragged)."""
    pad = -z.shape[1] % tile_size
    return torch.nn.functional.pad(z, (0, pad), value=float("-inf")) if pad else z


def _tile_stats_torch_(z: torch.Tensor, tile_size: int):
    """``sample_triton.tile_stats`` in torch (z's dtype) for z of whole tiles, which it overwrites
    with exp(z - tile max): the values ``_draw_columns_torch`` takes."""
    tiles = z.view(z.shape[0], -1, tile_size)
    tile_max = tiles.amax(-1)
    tiles.sub_(torch.where(tile_max == float("-inf"), 0.0, tile_max).unsqueeze(-1)).exp_()
    return tile_max, tiles.sum(-1)


def _row_masses_torch(tile_max: torch.Tensor, tile_sumexp: torch.Tensor):
    """``sample_triton.row_masses`` in torch."""
    row_max = tile_max.amax(-1).double()
    row_max = torch.where(row_max == float("-inf"), 0.0, row_max)
    tile_mass = tile_sumexp.double() * (tile_max.double() - row_max.unsqueeze(1)).exp()
    tile_end = tile_mass.cumsum(-1)
    return row_max, tile_mass, tile_end, tile_end[:, -1].contiguous()


def _draw_columns_torch(e: torch.Tensor, tile_mass: torch.Tensor, tile_end: torch.Tensor, local_mass: torch.Tensor,
                        keys: torch.Tensor, n: int, bounds: torch.Tensor, tile_size: int) -> torch.Tensor:
    """``sample_triton.draw_columns`` in torch, from (and overwriting) ``_tile_stats_torch_``'s
    exp(z - tile max): each draw's uniform, whether this rank's shard holds it, its tile (searched
    in the tiles' fp64 running masses) and the fraction of that tile's mass below it, then its
    column by ``_tile_column``."""
    lo, hi, start, shard_mass, total, below = bounds.unsqueeze(-1).unbind(1)  # each [c, 1]
    x = torch.minimum(draw_uniforms(keys, n) * total, below)  # [c, n]
    own = (x >= lo) & (x < hi)
    local_mass = local_mass.unsqueeze(1)
    y = ((x - start) / shard_mass).clamp_(0.0, 1.0) * local_mass  # the draw's place in this rank's mass
    # the tile holding y; one rounded up to the rank's mass: the last tile with mass
    last_tile = torch.searchsorted(tile_end, local_mass, right=False)
    tile = torch.minimum(torch.searchsorted(tile_end, y, right=True), last_tile)
    mass = tile_mass.gather(1, tile)
    frac = ((y - (tile_end.gather(1, tile) - mass)) / mass).clamp_(0.0, 1.0)
    return _tile_column(e, torch.where(own, tile, -1), frac, tile_size)


def _tile_column(e: torch.Tensor, tile: torch.Tensor, frac: torch.Tensor, tile_size: int) -> torch.Tensor:
    """Per draw, the first column of its tile whose prefix sum of e (overwritten with them) exceeds
    frac × the tile's sum, by a binary search of every draw at once (log2(tile) gathers of [c, N]);
    -1 where ``tile`` is -1.

    The prefix sums are sequential, so each is >= the one before: the first one above a value
    rises there, and only columns of positive mass are drawn. A fraction rounded up to 1 searches
    just below the tile's sum instead: its last column with mass."""
    rows = e.shape[0]
    cum = e.view(rows, -1, tile_size).cumsum_(-1).view(rows, -1)
    start = tile.clamp(min=0) * tile_size  # [c, n]: the drawn tile's first column
    total = cum.gather(1, start + tile_size - 1)
    target = torch.minimum(frac.to(cum.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    lo, hi = torch.zeros_like(start), torch.full_like(start, tile_size - 1)  # the column is in [lo, hi]
    for _ in range(tile_size.bit_length() - 1):
        mid = (lo + hi) // 2
        above = cum.gather(1, start + mid) > target
        hi, lo = torch.where(above, mid, hi), torch.where(above, lo, mid + 1)
    return torch.where(tile >= 0, start + lo, -1)


def _counts_to_logprobs(draws: torch.Tensor, n: int):
    """[c, n] drawn ids -> distinct ids (ascending) with log(count / n), padded with -1 / -inf."""
    sorted_ids, _ = draws.sort(-1)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    run = first.long().cumsum(-1) - 1  # index of each draw's distinct id
    counts = torch.zeros_like(sorted_ids).scatter_add_(1, run, torch.ones_like(sorted_ids))
    ids = torch.full_like(sorted_ids, -1).scatter_(1, run, sorted_ids)
    logprobs = torch.where(counts > 0, (counts.float() / n).log(), float("-inf"))
    return ids, logprobs
