"""Teacher-side ops: the top-K (or a sample) of softmax(hidden · Wᵀ / τ) without full logits.

Per chunk of tokens each tensor-parallel rank projects onto its vocabulary shard, takes its local
top-K and its row (max, sum-exp) (one Triton kernel on CUDA, ``topk_triton.py``; torch elsewhere),
and one all-gather of [c, 2K + 2] gives every rank the candidates and the global logsumexp: the
global top-K is the top-K of the tp·K candidates, and log p = z/τ - logsumexp(z/τ). Never a
[tokens, V] tensor; one [chunk, V_local] block at a time.

Rows of the output layer beyond ``vocab_size`` (Megatron pads the vocabulary to a multiple of
128·tp) are not tokens: they are left out of both the top-K and the normalization.

``vocab_parallel_sample`` draws N tokens per position from the same distribution (Random-Sampling
KD): the draws' counts, log(count / N), replace the top-K as an unbiased sparse teacher. The draws
are a function of (row key, draw number) and the row's probabilities only, never of a generator's
state: draw j of a row is the inverse CDF at u_j = splitmix64(row key + (j + 1)·γ) (the j-th output
of a splitmix64 stream started at the row key), and the teacher pass makes the row key from
(seed, global sample index, position) (``sample_row_keys``). So a pass that is killed and resumed,
or run with other micro-batch or chunk sizes, draws the same tokens for the same rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kd.ops.comm import all_gather_stack, group_rank, group_size
from megatron_kd.ops.topk_kl import resolve_impl
from megatron_kd.ops.topk_kl_function import accumulation_dtype, auto_chunk_size, chunk_logits, mixed_gemms

_MAX_FLOAT_ID = 1 << 24  # ids travel through the all-gather as exact float32 values
_TEACHER_BLOCK_BYTES = 4 << 30


def _logits_chunks(hidden, weight, *, tp_group, vocab_size, temperature, chunk_size, extra_block=True):
    """Yield (start, end, z) with z = h·Wᵀ/τ for this rank's shard in fp32, padding rows at -inf."""
    rank, tp = group_rank(tp_group), group_size(tp_group)
    vocab_local = weight.shape[0]
    vocab_size = vocab_size or vocab_local * tp
    if not 0 < vocab_size <= vocab_local * tp:
        raise ValueError(f"vocab_size must be in (0, {vocab_local * tp}] (weight rows x tp), got {vocab_size}")
    if vocab_size >= _MAX_FLOAT_ID:
        raise ValueError(f"vocab_size {vocab_size} too large (ids are exchanged as float32, < 2^24)")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., {hidden.shape[-1]}] does not match weight [V_local, {weight.shape[1]}]")
    acc = accumulation_dtype(hidden.dtype)
    h2d = hidden.reshape(-1, hidden.shape[-1])
    w = weight if mixed_gemms(hidden) else weight.to(acc)
    start_id = rank * vocab_local
    n_real = max(0, min(vocab_local, vocab_size - start_id))  # this rank's rows that are real tokens
    # No gradients here, so a larger block than the loss's: per-chunk top-K and launch costs shrink
    # (measured on an H200 at V=201K: 128-row chunks 67 ms, 2048-row chunks 42 ms per 8K tokens).
    chunk = chunk_size or auto_chunk_size(h2d.shape[0], vocab_local, device=hidden.device, block_dtype=acc,
                                          gemm_dtype=acc, extra_block=extra_block, budget_bytes=_TEACHER_BLOCK_BYTES)
    for a in range(0, h2d.shape[0], chunk):
        b = min(a + chunk, h2d.shape[0])
        z = chunk_logits(h2d[a:b].to(w.dtype), w, acc)
        if temperature != 1.0:
            z.mul_(1.0 / temperature)
        z[:, n_real:] = float("-inf")
        yield a, b, z


def _combine_lse(rank_max: torch.Tensor, rank_sumexp: torch.Tensor) -> torch.Tensor:
    """[tp, c] per-rank (max, Σ exp(z - max)) -> [c] global logsumexp."""
    m = rank_max.amax(0)
    return m + (rank_sumexp * (rank_max - m).exp()).sum(0).log()


def _local_max_sumexp_(z: torch.Tensor):
    """Row max and Σ exp(z - max) of this rank's block; leaves exp(z - max) in z."""
    row_max = z.amax(-1)
    z.sub_(row_max.unsqueeze(1)).exp_()
    return row_max, z.sum(-1)


@torch.no_grad()
def vocab_parallel_topk(hidden: torch.Tensor, weight: torch.Tensor, k: int, *,
                        tp_group: dist.ProcessGroup | None = None, vocab_size: int | None = None,
                        temperature: float = 1.0, chunk_size: int | None = None, impl: str = "auto"):
    """(ids int64 [..., k] global, logprobs float32 [..., k]) in descending probability.

    ``impl``: "torch", "triton" (the kernel of ``topk_triton.py``) or "auto" (Triton on CUDA).

    hidden [..., h]; weight [V_local, h] = rows [r·V_local, (r+1)·V_local) on TP rank r.
    """
    rank, tp = group_rank(tp_group), group_size(tp_group)
    vocab_local = weight.shape[0]
    lead = hidden.shape[:-1]
    ids_out = torch.empty((*lead, k), dtype=torch.int64, device=hidden.device).view(-1, k)
    lps_out = torch.empty((*lead, k), dtype=torch.float32, device=hidden.device).view(-1, k)
    k_local = min(k, vocab_local)
    use_triton = resolve_impl(impl, hidden) == "triton"  # bf16/fp16/fp32 inputs: fp32 logits blocks
    for a, b, z in _logits_chunks(hidden, weight, tp_group=tp_group, vocab_size=vocab_size,
                                  temperature=temperature, chunk_size=chunk_size, extra_block=not use_triton):
        c = b - a
        if use_triton:
            from megatron_kd.ops.topk_triton import local_topk_max_sumexp

            vals, idx, row_max, sumexp = local_topk_max_sumexp(z, k_local)
        else:
            vals, idx = z.topk(k_local, dim=-1)
            row_max, sumexp = _local_max_sumexp_(z)
        del z
        # this rank's candidates: K values (-inf padded), K ids as floats (-1 padded), max, sumexp
        pack = vals.new_full((c, 2 * k + 2), float("-inf"))
        pack[:, :k_local] = vals
        pack[:, k:2 * k] = -1.0
        pack[:, k:k + k_local] = (idx + rank * vocab_local).to(pack.dtype)
        pack[:, 2 * k], pack[:, 2 * k + 1] = row_max, sumexp
        gathered = all_gather_stack(pack, tp_group)  # [tp, c, 2k + 2]
        lse = _combine_lse(gathered[..., 2 * k], gathered[..., 2 * k + 1])
        cand_vals = gathered[..., :k].permute(1, 0, 2).reshape(c, tp * k)
        cand_ids = gathered[..., k:2 * k].permute(1, 0, 2).reshape(c, tp * k)
        top_vals, pos = cand_vals.topk(k, dim=-1)
        ids_out[a:b] = cand_ids.gather(1, pos).long()
        lps_out[a:b] = (top_vals - lse.unsqueeze(1)).float()
    return ids_out.view(*lead, k), lps_out.view(*lead, k)


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
        from megatron_kd.ops.sample_triton import draw_columns, row_masses, tile_stats
    else:
        tile_stats, row_masses, draw_columns = _tile_stats_torch_, _row_masses_torch, _draw_columns_torch
    keys = row_keys.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    ids_out = torch.empty((*lead, n), dtype=torch.int64, device=hidden.device).view(-1, n)
    lps_out = torch.empty((*lead, n), dtype=torch.float32, device=hidden.device).view(-1, n)
    # torch's path pads the block to whole tiles: a copy when the last one is ragged
    for a, b, z in _logits_chunks(hidden, weight, tp_group=tp_group, vocab_size=vocab_size,
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
        # x in [shard_end[rank - 1], shard_end[rank]); below the total (u·total can round up to it),
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
