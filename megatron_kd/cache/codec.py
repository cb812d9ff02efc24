"""Per-token encoding of the teacher's top-K entries (ids exact, log-probs in 16-bit fixed point).

Within each token the valid entries are sorted by id and padding goes last:

    id_deltas  uint32 [..., K]  first valid id, then gaps to the next id; the first padding entry
                                holds -(last id + 1) (two's complement) and later ones 0, so a
                                running sum gives -1 on padding
    codes      uint16 [..., K]  round(-logprob · LOGPROB_SCALE), clamped to [0, PAD_CODE - 1];
                                PAD_CODE marks padding

Sorted ids turn into small gaps that a byte-shuffling compressor packs tightly; the values follow
in the same order. The fixed-point step is 1/257 nat, so the stored log-prob is within 1/514 nat of
the given one and every probability comes back with relative error <= e^(1/514) - 1 < 2^-9 (what
bf16 storage gives at best), down to log-prob -255 (exactly -(MAX_CODE + 1/2)/257 ~ -254.998,
p ~ 1e-111); anything smaller is stored as the floor -MAX_CODE/257, still a valid entry. Decoding
to float32 adds one float32 rounding (under 2^-16 nat at that depth). The order of the K entries
is not kept: the loss does not depend on it.
"""

from __future__ import annotations

import numpy as np
import torch

LOGPROB_SCALE = 257.0  # codes per nat
PAD_CODE = np.iinfo(np.uint16).max
MAX_CODE = PAD_CODE - 1
# A log-prob a hair above 0 is rounding in the teacher's log-softmax; more than this is not a log-prob.
_POSITIVE_SLACK = 1e-3


class CacheError(ValueError):
    """A teacher cache that is malformed, mismatched, incomplete, or fed bad data."""


class CacheBusyError(CacheError):
    """A partition another writer holds: the cache is fine, only not this process's to write now."""


class CacheWriteError(CacheError):
    """The writer cannot write (read-only store, permissions, a full disk): the cache may be fine."""


class EntryChecks:
    """What ``sort_entries`` checks, left on the device: ``stats`` (float64: the lowest and highest
    id, whether any log-prob is NaN or +inf, the largest finite one, whether an id repeats within a
    token; empty without entries), which ``verify`` reads once they are on the host (a teacher pass
    copies them behind its queued work: write_behind.py)."""

    def __init__(self, stats: torch.Tensor, repeated: torch.Tensor, vocab_size: int, where: str):
        self.stats, self.repeated, self.vocab_size, self.where = stats, repeated, vocab_size, where

    def verify(self, stats: list[float]) -> None:
        """Raise CacheError for the first thing wrong, given ``stats`` on the host (empty: no entries)."""
        if not stats:
            return
        lo, hi, nan, posinf, top, dup = stats
        where = self.where
        if lo < -1 or hi >= self.vocab_size:
            raise CacheError(f"{where}topk_ids holds id {int(lo if lo < -1 else hi)}; expected -1 or "
                             f"[0, {self.vocab_size}) (vocab_size={self.vocab_size})")
        if nan:
            raise CacheError(f"{where}topk_logprobs holds NaN")
        if posinf:
            raise CacheError(f"{where}topk_logprobs holds +inf")
        if top > _POSITIVE_SLACK:
            raise CacheError(f"{where}topk_logprobs holds {top:.4g} > 0; log-probabilities must be <= 0")
        if dup:
            tok = torch.nonzero(self.repeated)[0][:-1].tolist()
            raise CacheError(f"{where}topk_ids repeats an id within token {tuple(tok)}")


def sort_entries(ids, logprobs, vocab_size: int, *, where: str = ""):
    """(ids, logprobs) [..., K] -> (ids int64, logprobs float32, valid bool) [..., K] with each
    token's valid entries sorted by id and padding last, and their ``EntryChecks``, still to be
    verified: nothing here waits for the device.

    Padding is id -1 or log-prob -inf. The checks find ids outside [-1, vocab_size), ids repeated
    within a token, NaN / +inf / positive log-probs. Tensors are sorted on their own device (a
    teacher pass hands over CUDA tensors: the per-token sort then costs the GPU a few microseconds
    instead of the writer's CPU most of its time). What is wrong with the shapes or dtypes raises
    here.
    """
    ids = ids.detach() if torch.is_tensor(ids) else torch.from_numpy(np.asarray(ids))
    lps = logprobs.detach().float() if torch.is_tensor(logprobs) else torch.from_numpy(np.asarray(logprobs, np.float32))
    lps = lps.to(ids.device)
    if ids.shape != lps.shape:
        raise CacheError(f"{where}topk_ids {tuple(ids.shape)} and topk_logprobs {tuple(lps.shape)} must have the same "
                         f"shape")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise CacheError(f"{where}topk_ids must be integers, got {ids.dtype}")
    ids = ids.long()
    valid = (ids >= 0) & torch.isfinite(lps)
    big = vocab_size  # sorts padding after every real id
    key = torch.where(valid, ids, big)
    sorted_ids, order = torch.sort(key, dim=-1, stable=True)
    sorted_lps = torch.gather(lps, -1, order)
    sorted_valid = sorted_ids < big
    repeated = (torch.diff(sorted_ids, dim=-1) == 0) & sorted_valid[..., 1:]
    stats = torch.empty(0, dtype=torch.float64, device=ids.device)
    if ids.numel():  # every check in one tensor: one device-to-host copy
        stats = torch.stack([
            ids.min().double(), ids.max().double(), lps.isnan().any().double(), lps.isposinf().any().double(),
            torch.nan_to_num(lps, nan=-np.inf, posinf=-np.inf).max().double(), repeated.any().double()])
    sorted_ids = torch.where(sorted_valid, sorted_ids, -1)
    sorted_lps = torch.where(sorted_valid, sorted_lps, -np.inf)
    return sorted_ids, sorted_lps, sorted_valid, EntryChecks(stats, repeated, vocab_size, where)


def logprob_codes(sorted_lps: torch.Tensor) -> torch.Tensor:
    """int32 fixed-point codes round(-logprob · LOGPROB_SCALE) in [0, MAX_CODE] (round half to even,
    as numpy's rint); padding (-inf) gives MAX_CODE, so mask it."""
    return torch.round(-sorted_lps.double() * LOGPROB_SCALE).clamp_(0, MAX_CODE).to(torch.int32)


def topk_deltas_and_codes(sorted_ids, sorted_lps, sorted_valid) -> tuple[torch.Tensor, torch.Tensor]:
    """The topk-v1 values of sorted entries, on their device: (id deltas int64, codes int32)."""
    # running sums of these give the sorted ids, then -1 from the first padding entry on
    prev = torch.cat([torch.zeros_like(sorted_ids[..., :1]), sorted_ids[..., :-1]], -1)
    prev_valid = torch.cat([torch.ones_like(sorted_valid[..., :1]), sorted_valid[..., :-1]], -1)
    first_pad = ~sorted_valid & prev_valid
    deltas = torch.where(sorted_valid, sorted_ids - prev, torch.where(first_pad, -1 - prev, 0))
    return deltas, torch.where(sorted_valid, logprob_codes(sorted_lps), PAD_CODE)


def decode_topk(id_deltas: np.ndarray, codes: np.ndarray, *, ids_dtype=torch.int32) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of the topk-v1 encoding (``topk_deltas_and_codes``, as uint32 / uint16): torch (ids [..., K] with -1 padding, float32 log-probs with -inf)."""
    deltas = torch.from_numpy(np.ascontiguousarray(id_deltas).view(np.int32))  # ids < 2^31
    ids = torch.cumsum(deltas, dim=-1, dtype=ids_dtype)
    return ids, torch.from_numpy(code_logprobs(codes))


def code_logprobs(codes: np.ndarray) -> np.ndarray:
    """float32 log-probs of uint16 fixed-point codes (topk-v1, topk-v2): -code / LOGPROB_SCALE in
    float32 arithmetic, -inf for PAD_CODE (three vector passes: half a 65,536-entry table lookup)."""
    codes = np.ascontiguousarray(codes)
    logprobs = codes.astype(np.float32)
    logprobs *= np.float32(-1.0 / LOGPROB_SCALE)
    np.putmask(logprobs, codes == PAD_CODE, -np.inf)
    return logprobs
