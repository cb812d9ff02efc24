"""Chunk codecs of the entropy-coded encodings: id sets, draw counts, top-K codes.

The arrays keep their meaning in memory; only their bytes on disk change. Per token (a chunk's
tokens flattened, T of them, K slots each) the valid entries come first, padding after:

    ids       int32   ids ascending, then -1                      (topk-v2, sampled-counts-v1)
    counts    uint16  draws of each id (>= 1, summing to N), then 0           (sampled-counts-v1)
    codes     uint16  topk-v1's round(-logprob · 257), then PAD_CODE                    (topk-v2)

Each codec writes a chunk as a few byte-plane streams (streams.py):

    id sets      n (entries per token, width of K); id gaps, 4 planes: per token the first id,
                 then (gap to the next id) - 1
    draw counts  one byte per token: 1 if it has entries; the number of entries (uint64); count - 1
                 of every entry (width of N-1). No entries-per-token stream: a token's entries are
                 those whose counts reach N
    top-K codes  n; per token with entries its deepest (largest) code, 2 planes; per entry
                 deepest - code, 2 planes: the log-prob relative to the token's least likely
                 entry, which varies less than the log-prob itself

Padding costs nothing: a token costs its entries and a symbol or two. Counts are exact, so
sampled log-probs decode to log(count / N) to float32 rounding (topk-v1 stored them in 1/257-nat
steps); top-K codes are topk-v1's, so its precision holds. A chunk's content must be in this form
(the writer sorts each token; rows not written yet are all padding); anything else is a
ValueError at encoding (a bug, not user data), and bytes that do not decode to it a CacheError.
"""

from __future__ import annotations

import numpy as np

from megatron_kd.cache.codec import MAX_CODE, PAD_CODE, CacheError
from megatron_kd.cache.streams import pack_streams, plane_streams, read_planes, unpack_streams, width_for

ZSTD_LEVEL = 9  # bench_cache_fidelity.py: level 19 saves ~1% and writes several times slower
MAX_DRAWS = (1 << 16) - 1  # counts are uint16


def _prefix_counts(valid: np.ndarray, what: str) -> np.ndarray:
    """Entries per token of ``valid`` [T, K]; ValueError unless each token's valid slots come first."""
    n = valid.sum(1)
    if not (valid == (np.arange(valid.shape[1]) < n[:, None])).all():
        raise ValueError(f"{what}: a token has padding before an entry")
    return n


def _slots(n: np.ndarray, k: int) -> np.ndarray:
    """Flat [T·K] index of every entry, tokens in order, slots from 0."""
    starts = np.cumsum(n) - n
    return np.arange(int(n.sum())) + np.repeat(np.arange(len(n)) * k - starts, n)


def _limit(tokens: int, k: int) -> int:
    return 4 * tokens * k + 64  # no stream of a chunk holds more raw bytes than this


def _read_n(streams, tokens: int, k: int, what: str) -> np.ndarray:
    n = read_planes(streams, tokens, what=f"{what} entries per token")
    if n.size and n.max() > k:
        raise CacheError(f"{what}: a token has {int(n.max())} entries, more than K={k} (corrupted chunk)")
    return n


# ---------------------------------------------------------------- id sets
def id_set_streams(k: int) -> int:
    return width_for(k) + 4


def encode_id_sets(ids: np.ndarray) -> bytes:
    k = ids.shape[-1]
    ids = ids.reshape(-1, k).astype(np.int64)
    valid = ids >= 0
    n = _prefix_counts(valid, "id sets")
    flat = ids[valid]
    starts = (np.cumsum(n) - n)[n > 0]
    gaps = np.diff(flat, prepend=0) - 1
    gaps[starts] = flat[starts]
    if (ids[~valid] != -1).any() or (gaps < 0).any():
        raise ValueError("id sets: ids must ascend within a token, padding must be -1")
    return pack_streams([*plane_streams(n, width_for(k)), *plane_streams(gaps, 4)], ZSTD_LEVEL)


def decode_id_sets(buf, tokens: int, k: int) -> np.ndarray:
    """int32 [tokens, k]."""
    what = "id sets"
    s = unpack_streams(buf, id_set_streams(k), limit=_limit(tokens, k))
    w = width_for(k)
    n = _read_n(s[:w], tokens, k, what)
    gaps = read_planes(s[w:], int(n.sum()), what=f"{what} gaps")
    # running sums of gap + 1, restarted at each token's first entry
    run = np.cumsum(gaps + 1)
    first = (np.cumsum(n) - n)[n > 0]
    ids = run - np.repeat(run[first] - gaps[first], n[n > 0])
    if ids.size and ids.max() >= np.iinfo(np.int32).max:
        raise CacheError(f"{what}: id {int(ids.max())} out of range (corrupted chunk)")
    out = np.full(tokens * k, -1, np.int32)
    out[_slots(n, k)] = ids
    return out.reshape(tokens, k)


# ---------------------------------------------------------------- draw counts
def draw_count_streams(draws: int) -> int:
    return 2 + width_for(draws - 1)


def encode_draw_counts(counts: np.ndarray, draws: int) -> bytes:
    k = counts.shape[-1]
    counts = counts.reshape(-1, k).astype(np.int64)
    valid = counts > 0
    n = _prefix_counts(valid, "draw counts")
    sums = counts.sum(1)
    if (sums[n > 0] != draws).any():
        raise ValueError(f"draw counts: a token's counts do not sum to {draws}")
    flat = counts[valid]
    total = np.array([len(flat)], "<u8").view(np.uint8)
    return pack_streams([(n > 0).astype(np.uint8), total, *plane_streams(flat - 1, width_for(draws - 1))],
                        ZSTD_LEVEL)


def decode_draw_counts(buf, tokens: int, k: int, draws: int) -> np.ndarray:
    """uint16 [tokens, k]."""
    what = "draw counts"
    s = unpack_streams(buf, draw_count_streams(draws), limit=_limit(tokens, k))
    nonempty = read_planes(s[:1], tokens, what=f"{what} flags")
    if nonempty.size and nonempty.max() > 1:
        raise CacheError(f"{what}: flag {int(nonempty.max())}, expected 0 or 1 (corrupted chunk)")
    filled = np.flatnonzero(nonempty)
    if len(s[1]) != 8 or int(s[1].view("<u8")[0]) > tokens * k:
        raise CacheError(f"{what}: the number of entries is missing or more than {tokens} x {k} (corrupted chunk)")
    counts = read_planes(s[2:], int(s[1].view("<u8")[0]), what=f"{what} counts") + 1
    total = len(counts)
    end = np.cumsum(counts)
    # entry i belongs to the j-th token with entries when its draws lie in (j·N, (j+1)·N]
    j = (end - 1) // draws
    if (total and end[-1] != draws * len(filled)) or ((end - counts) // draws != j).any():
        raise CacheError(f"{what}: counts do not add up to {draws} draws per token (corrupted chunk)")
    n = np.zeros(tokens, np.int64)
    n[filled] = np.bincount(j, minlength=len(filled))
    if n.size and n.max() > k:
        raise CacheError(f"{what}: a token has {int(n.max())} entries, more than K={k} (corrupted chunk)")
    out = np.zeros(tokens * k, np.uint16)
    out[_slots(n, k)] = counts
    return out.reshape(tokens, k)


# ---------------------------------------------------------------- top-K codes
def topk_code_streams(k: int) -> int:
    return width_for(k) + 2 + 2


def encode_topk_codes(codes: np.ndarray) -> bytes:
    k = codes.shape[-1]
    codes = codes.reshape(-1, k).astype(np.int64)
    valid = codes != PAD_CODE
    n = _prefix_counts(valid, "top-K codes")
    flat = codes[valid]
    has = n > 0
    deepest = np.maximum.reduceat(flat, (np.cumsum(n) - n)[has]) if flat.size else np.zeros(0, np.int64)
    depths = np.repeat(deepest, n[has]) - flat
    return pack_streams([*plane_streams(n, width_for(k)), *plane_streams(deepest, 2), *plane_streams(depths, 2)],
                        ZSTD_LEVEL)


def decode_topk_codes(buf, tokens: int, k: int) -> np.ndarray:
    """uint16 [tokens, k]."""
    what = "top-K codes"
    s = unpack_streams(buf, topk_code_streams(k), limit=_limit(tokens, k))
    w = width_for(k)
    n = _read_n(s[:w], tokens, k, what)
    has = n > 0
    deepest = read_planes(s[w:w + 2], int(has.sum()), what=f"{what} deepest")
    codes = np.repeat(deepest, n[has]) - read_planes(s[w + 2:], int(n.sum()), what=f"{what} depths")
    if codes.size and (codes.min() < 0 or deepest.max() > MAX_CODE):
        raise CacheError(f"{what}: a code outside 0..{MAX_CODE} (corrupted chunk)")
    out = np.full(tokens * k, PAD_CODE, np.uint16)
    out[_slots(n, k)] = codes
    return out.reshape(tokens, k)
