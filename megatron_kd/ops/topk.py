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


@torch.no_grad()
def vocab_parallel_sample(hidden: torch.Tensor, weight: torch.Tensor, num_draws: int, *,
                          row_keys: torch.Tensor, tp_group: dist.ProcessGroup | None = None,
                          vocab_size: int | None = None, temperature: float = 1.0,
                          chunk_size: int | None = None):
    """``num_draws`` tokens drawn per position from softmax(hidden·Wᵀ/τ), as (ids int64 [..., N],
    logprobs float32 [..., N]): the distinct drawn ids (ascending) with log(count / N), then
    padding (-1, -inf).

    ``row_keys`` int64 [...] (hidden's leading shape) keys each row's draws (``sample_row_keys``):
    rows with the same key and logits get the same draws whatever else is in the batch.

    Inverse CDF in two stages, so no rank needs the full distribution. Every rank turns the same
    u into a shard, from the cumulative shard masses (the gathered per-rank (max, mass), in fp64:
    identical on every TP rank), then the shard's owner turns the rest of u into an id by
    searchsorted in its block's cumulative sum of exp(z - max). The cumulative sum is taken in
    place in the block's own dtype (fp32 for bf16/fp32 teachers): no second [chunk, V_local]
    block. fp32 prefix sums round each token's interval by about 2^-24 of the shard's mass, so only
    tokens below ~1e-6 of it see their (tiny) draw probability distorted; an fp64 copy would double
    the teacher pass's largest buffer for that.
    """
    rank, tp = group_rank(tp_group), group_size(tp_group)
    vocab_local = weight.shape[0]
    lead, n = hidden.shape[:-1], num_draws
    if tuple(row_keys.shape) != tuple(lead):
        raise ValueError(f"row_keys {tuple(row_keys.shape)} must have hidden's leading shape {tuple(lead)}")
    keys = row_keys.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    ids_out = torch.empty((*lead, n), dtype=torch.int64, device=hidden.device).view(-1, n)
    lps_out = torch.empty((*lead, n), dtype=torch.float32, device=hidden.device).view(-1, n)
    for a, b, z in _logits_chunks(hidden, weight, tp_group=tp_group, vocab_size=vocab_size,
                                  temperature=temperature, chunk_size=chunk_size, extra_block=False):
        row_max = z.amax(-1)
        cum = z.sub_(row_max.unsqueeze(1)).exp_().cumsum_(-1)  # in place: exp, then prefix sums
        local_mass = cum[:, -1].clone()  # >= 1: the row's largest entry is exp(0)
        stats = all_gather_stack(torch.stack([row_max, local_mass], -1), tp_group).double()  # [tp, c, 2]
        shard_mass = (stats[..., 1] * (stats[..., 0] - stats[..., 0].amax(0)).exp()).t()  # [c, tp]
        shard_end = shard_mass.cumsum(-1)
        shard_start = torch.cat([torch.zeros_like(shard_end[:, :1]), shard_end[:, :-1]], -1)
        total = shard_end[:, -1:]
        # below the total (u·total can round up to it), so x lies in a shard of positive mass
        x = torch.minimum(draw_uniforms(keys[a:b], n) * total, torch.nextafter(total, torch.zeros_like(total)))
        shard = (x.unsqueeze(-1) >= shard_end.unsqueeze(1)).sum(-1)  # [c, n]
        mine = shard == rank
        within = ((x - shard_start[:, rank:rank + 1]) / shard_mass[:, rank:rank + 1]).clamp_(0.0, 1.0)
        target = (within * local_mass.double().unsqueeze(1)).to(cum.dtype)
        local = torch.searchsorted(cum, target, right=True)
        # a target rounded up to the row's mass would land past the end: the last entry with mass
        last = torch.searchsorted(cum, local_mass.unsqueeze(1), right=False)
        draws = torch.minimum(local, last) + rank * vocab_local
        del z, cum
        local_ids = torch.where(mine, draws, -1).to(torch.float32)
        all_ids = all_gather_stack(local_ids, tp_group).amax(0)  # exactly one rank owns each draw
        ids_out[a:b], lps_out[a:b] = _counts_to_logprobs(all_ids.long(), n)
    return ids_out.view(*lead, n), lps_out.view(*lead, n)


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
