"""Chunk codecs of the entropy-coded encodings: id sets, draw counts, top-K codes, levels.

The arrays keep their meaning in memory; only their bytes on disk change. Per token (a chunk's
tokens flattened, T of them, K slots each) the valid entries come first, padding after:

    ids       int32   ids ascending, then -1             (topk-v2, sampled-counts-v1, topk-v3)
    counts    uint16  draws of each id (>= 1, summing to N), then 0           (sampled-counts-v1)
    codes     uint16  topk-v1's round(-logprob · 257), then PAD_CODE                    (topk-v2)
    levels    uint8   the probability's level (level_probabilities), then PAD_LEVEL     (topk-v3)

Each codec writes a chunk as a few byte-plane streams (streams.py):

    id sets      n (entries per token, width of K); id gaps, 4 planes: per token the first id,
                 then (gap to the next id) - 1
    draw counts  one byte per token: 1 if it has entries; the number of entries (uint64); count - 1
                 of every entry (width of N-1). No entries-per-token stream: a token's entries are
                 those whose counts reach N
    top-K codes  n; per token with entries its deepest (largest) code, 2 planes; per entry
                 deepest - code, 2 planes: the log-prob relative to the token's least likely
                 entry, which varies less than the log-prob itself
    column id sets   (topk-v3) n; per slot range of column_groups, the steps (first id + 1, then
                 the gap to the previous id) of the tokens' entries in those slots, 4 planes
    levels       (topk-v3) n; one byte per token: its context, the octile of the chunk's tokens by
                 mean level; per context the levels of its tokens' entries

Padding costs nothing: a token costs its entries and a symbol or two. Counts are exact, so
sampled log-probs decode to log(count / N) to float32 rounding (topk-v1 stored them in 1/257-nat
steps); top-K codes are topk-v1's, so its precision holds; levels are lossy (encodings.py says
how much). A chunk's content must be in this form
(the writer sorts each token; rows not written yet are all padding); anything else is a
ValueError at encoding (a bug, not user data), and bytes that do not decode to it a CacheError.

Decoders are numpy over the whole chunk, in int32: ids are running sums along each token's row of
a [T, K] matrix of steps (built in place from the byte planes), values a plain copy; padding is
scattered only when some token of the chunk is not full (top-K chunks rarely, sampled ones always).
"""

from __future__ import annotations

import math

import numpy as np

from megatron_kd.cache.codec import MAX_CODE, PAD_CODE, CacheError
from megatron_kd.cache.streams import pack_streams, plane_streams, read_planes, unpack_streams, width_for

ZSTD_LEVEL = 9  # bench_cache_fidelity.py: level 19 saves ~1% and writes several times slower
MAX_DRAWS = (1 << 16) - 1  # counts are uint16
ID_GROUPS = 10  # topk-v3: slot ranges with id streams of their own (column_groups)
# topk-v3's zstd levels, measured on top-100 Zipf rows at V = 201,088 (8192 tokens, 2026-12-01): id
# streams 131.8 / 132.6 / 133.2 bytes/token at levels 1 / 3 / 9 (longer searches find matches in
# near-random gaps that cost more than their literals), encoding 0.43 / 0.48 / 0.26 M tokens/s;
# levels 63.1 / 62.4 / 61.8 at 2.2 / 0.93 / 0.33 M tokens/s
COLUMN_ID_ZSTD_LEVEL = 1
LEVELS_ZSTD_LEVEL = 3
# topk-v3: a token's levels go to one of this many streams by how flat its distribution is
# (encode_levels): on those rows 55.2 bytes/token against 62.4 in one stream
LEVEL_CONTEXTS = 8

# topk-v3's probability levels: u(p) = log(p + c) - log(1 + c - p) in steps of LEVEL_STEP from
# u(0) (level 0) to u(1) (MAX_LEVEL); see level_probabilities
LEVEL_STEP = 1 / 8
LEVEL_FLOOR = 2.0 ** -12  # c
LEVEL_ORIGIN = math.log(LEVEL_FLOOR / (1 + LEVEL_FLOOR))
MAX_LEVEL = round(-2 * LEVEL_ORIGIN / LEVEL_STEP)
PAD_LEVEL = 255
assert MAX_LEVEL < PAD_LEVEL


def level_probabilities() -> np.ndarray:
    """float64 [MAX_LEVEL + 1]: the probability each level decodes to, the middle of its interval
    of u (so that it codes back to the same level); level 0 (p below u^-1(u(0) + step/2), about
    LEVEL_FLOOR · step / 2) decodes to the middle of that interval of p, never to 0."""
    u = LEVEL_ORIGIN + LEVEL_STEP * np.arange(MAX_LEVEL + 1)
    p = np.minimum((np.exp(u) * (1 + LEVEL_FLOOR) - LEVEL_FLOOR) / (1 + np.exp(u)), 1.0)
    half = math.exp(LEVEL_ORIGIN + LEVEL_STEP / 2)
    p[0] = (half * (1 + LEVEL_FLOOR) - LEVEL_FLOOR) / (1 + half) / 2
    return p


def _prefix_counts(valid: np.ndarray, what: str) -> np.ndarray:
    """Entries per token of ``valid`` [T, K]; ValueError unless each token's valid slots come first."""
    if valid.all():
        return np.full(valid.shape[0], valid.shape[1], np.int64)
    n = valid.sum(1)
    if not (valid == (np.arange(valid.shape[1]) < n[:, None])).all():
        raise ValueError(f"{what}: a token has padding before an entry")
    return n


def _limit(tokens: int, k: int) -> int:
    return 4 * tokens * k + 64  # no stream of a chunk holds more raw bytes than this


def _read_n(streams, tokens: int, k: int, what: str) -> np.ndarray:
    n = read_planes(streams, tokens, what=f"{what} entries per token")
    if n.size and n.max() > k:
        raise CacheError(f"{what}: a token has {int(n.max())} entries, more than K={k} (corrupted chunk)")
    return n


def _unpack_counted(buf, num_streams: int, tokens: int, k: int, what: str) -> tuple[np.ndarray, list]:
    """A chunk whose streams begin with the entries per token: (n, the streams after it)."""
    s = unpack_streams(buf, num_streams, limit=_limit(tokens, k))
    w = width_for(k)
    return _read_n(s[:w], tokens, k, what), s[w:]


def _valid_slots(n: np.ndarray, k: int) -> np.ndarray | None:
    """bool [T, k]: slot j of token t holds an entry (j < n[t]); None when every token is full."""
    if n.size == 0 or int(n.min()) == k:
        return None
    return np.arange(k, dtype=np.int32) < n[:, None]


def _ids_from_steps(steps, n: np.ndarray, tokens: int, k: int, what: str) -> np.ndarray:
    """int32 [tokens, k] ids from ``steps``: per entry, tokens in order, the first id + 1, then the
    gap to the previous id, each >= 1 (a flat array of the entries, or [tokens, k] with zeros on
    padding). Running sums along each token's row, less one; -1 on padding. CacheError for a step
    below 1 or an id past int32 (what corrupted bytes give)."""
    valid = _valid_slots(n, k)
    if steps.ndim == 1:  # the entries alone: check them before they are spread over the rows
        low = steps.min(initial=1)
        if valid is None:
            steps = steps.reshape(tokens, k)
        else:
            flat, steps = steps, np.zeros((tokens, k), np.int32)
            steps[valid] = flat
    else:
        low = steps.min(initial=1) if valid is None else np.where(valid, steps, 1).min(initial=1)
    if low < 1:
        raise CacheError(f"{what}: ids not ascending (corrupted chunk)")
    # with every step in [1, 2^31) a running sum that passes 2^31 - 1 wraps to a negative number at
    # that entry, so "steps >= 1, sums >= 1" is "ids ascending and within int32"; rows with padding
    # (zero steps there) are checked by their sums instead
    if valid is not None and steps.size and steps.sum(1, dtype=np.int64).max() > np.iinfo(np.int32).max:
        raise CacheError(f"{what}: an id past int32 (corrupted chunk)")
    ids = np.cumsum(steps, axis=1, dtype=np.int32, out=steps)
    if valid is None and ids.min(initial=1) < 1:
        raise CacheError(f"{what}: an id past int32 (corrupted chunk)")
    ids -= 1
    if valid is not None:
        ids[~valid] = -1
    return ids


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
    n, s = _unpack_counted(buf, id_set_streams(k), tokens, k, what)
    # gap + 1 per entry: the first entry of a token gives id + 1, the others id - previous id, so a
    # running sum along each token's row, less one, is the ids
    steps = read_planes(s, int(n.sum()), what=f"{what} gaps", dtype=np.int32)
    steps += 1
    return _ids_from_steps(steps, n, tokens, k, what)


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
    nonempty = read_planes(s[:1], tokens, what=f"{what} flags", dtype=np.uint8)
    if nonempty.size and nonempty.max() > 1:
        raise CacheError(f"{what}: flag {int(nonempty.max())}, expected 0 or 1 (corrupted chunk)")
    filled = np.flatnonzero(nonempty)
    if len(s[1]) != 8 or int(s[1].view("<u8")[0]) > tokens * k:
        raise CacheError(f"{what}: the number of entries is missing or more than {tokens} x {k} (corrupted chunk)")
    wide = np.int64 if tokens * draws >= np.iinfo(np.int32).max else np.int32
    counts = read_planes(s[2:], int(s[1].view("<u8")[0]), what=f"{what} counts", dtype=wide)
    counts += 1
    # a token's entries end where the running sum of counts reaches a multiple of N; the j-th such
    # point must be j·N (no token's counts step over a multiple), the last one the last entry
    end = np.cumsum(counts, dtype=wide)
    last = np.flatnonzero(end % draws == 0)
    if len(last) != len(filled) or (len(last) and (last[-1] != len(counts) - 1 or (
            end[last] != draws * np.arange(1, len(last) + 1, dtype=wide)).any())) or (len(counts) and not len(last)):
        raise CacheError(f"{what}: counts do not add up to {draws} draws per token (corrupted chunk)")
    n = np.zeros(tokens, np.int64)
    n[filled] = np.diff(last, prepend=-1)
    if n.size and n.max() > k:
        raise CacheError(f"{what}: a token has {int(n.max())} entries, more than K={k} (corrupted chunk)")
    valid = _valid_slots(n, k)
    if valid is None:
        return counts.astype(np.uint16).reshape(tokens, k)
    out = np.zeros((tokens, k), np.uint16)
    out[valid] = counts
    return out


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
    n, s = _unpack_counted(buf, topk_code_streams(k), tokens, k, what)
    has = n > 0
    deepest = read_planes(s[:2], int(has.sum()), what=f"{what} deepest", dtype=np.uint16)
    depths = read_planes(s[2:], int(n.sum()), what=f"{what} depths", dtype=np.uint16)
    if deepest.size and deepest.max() > MAX_CODE:
        raise CacheError(f"{what}: a code outside 0..{MAX_CODE} (corrupted chunk)")
    valid = _valid_slots(n, k)
    # code = deepest - depth in uint16: a depth past its token's deepest code wraps above it
    if valid is None:  # every token full: deepest code per row, less the depths
        depths = depths.reshape(tokens, k)
        codes = np.subtract(deepest[:, None], depths, out=depths)
        wrapped = codes.size and (codes > deepest[:, None]).any()
    else:
        per_entry = np.repeat(deepest, n[has])
        codes = per_entry - depths
        wrapped = codes.size and (codes > per_entry).any()
    if wrapped:
        raise CacheError(f"{what}: a code outside 0..{MAX_CODE} (corrupted chunk)")
    if valid is None:
        return codes
    out = np.full((tokens, k), PAD_CODE, np.uint16)
    out[valid] = codes
    return out


# ---------------------------------------------------------------- topk-v3: id sets by column
def column_groups(k: int) -> list[tuple[int, int]]:
    """The slot ranges [a, b) whose id steps share streams: ID_GROUPS about equal ranges (one per
    slot when K is smaller). In ascending order the j-th id of a top-K set lies deeper in the
    vocabulary the larger j is, and under a frequency-ordered (BPE) vocabulary its gaps grow with
    j, so each range gets byte planes of its own, whose statistics zstd codes apart."""
    g = min(ID_GROUPS, k)
    bounds = [j * k // g for j in range(g + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def column_id_set_streams(k: int) -> int:
    return width_for(k) + 4 * len(column_groups(k))


def encode_column_id_sets(ids: np.ndarray) -> bytes:
    k = ids.shape[-1]
    ids = ids.reshape(-1, k)
    if ids.size and (ids.min() < -1 or ids.max() >= np.iinfo(np.int32).max):
        raise ValueError("id sets: ids must be -1 or in [0, 2^31 - 1)")
    ids = ids.astype(np.int32, copy=False)
    valid = ids >= 0
    n = _prefix_counts(valid, "id sets")
    full = valid.all()
    steps = np.empty_like(ids)  # first id + 1, then the gaps
    steps[:, 0] = ids[:, 0] + 1
    np.subtract(ids[:, 1:], ids[:, :-1], out=steps[:, 1:])
    if (steps.min(initial=1) if full else np.where(valid, steps, 1).min(initial=1)) < 1:
        raise ValueError("id sets: ids must ascend within a token, padding must be -1")
    streams = plane_streams(n, width_for(k))
    for a, b in column_groups(k):
        streams += plane_streams(steps[:, a:b] if full else steps[:, a:b][valid[:, a:b]], 4)  # tokens in order
    return pack_streams(streams, COLUMN_ID_ZSTD_LEVEL)


def decode_column_id_sets(buf, tokens: int, k: int) -> np.ndarray:
    """int32 [tokens, k]."""
    what = "id sets"
    n, s = _unpack_counted(buf, column_id_set_streams(k), tokens, k, what)
    valid = _valid_slots(n, k)
    # the steps' bytes go straight to their place in a [tokens, k, 4] byte array: viewed as
    # little-endian int32 it is the steps, zeros on padding
    raw = np.zeros((tokens, k, 4), np.uint8)
    for g, (a, b) in enumerate(column_groups(k)):
        count = tokens * (b - a) if valid is None else int(np.count_nonzero(valid[:, a:b]))
        for j, plane in enumerate(s[4 * g:4 * g + 4]):
            if len(plane) not in (0, count):
                raise CacheError(f"{what}: byte plane {j} of slots {a}..{b - 1} holds {len(plane)} bytes, "
                                 f"expected {count} (or none)")
            if not len(plane):
                continue
            if valid is None:
                raw[:, a:b, j] = plane.reshape(tokens, b - a)
            else:
                target = raw[:, a:b, j]
                target[valid[:, a:b]] = plane
    return _ids_from_steps(raw.view("<i4").reshape(tokens, k), n, tokens, k, what)


# ---------------------------------------------------------------- topk-v3: probability levels
def level_streams(k: int) -> int:
    return width_for(k) + 1 + LEVEL_CONTEXTS


def encode_levels(levels: np.ndarray) -> bytes:
    """Per token its context (which of LEVEL_CONTEXTS streams holds its levels: the octile of the
    chunk's tokens by mean level, i.e. how flat the teacher is there), then the levels of each
    context's tokens, in token order."""
    k = levels.shape[-1]
    levels = levels.reshape(-1, k)
    valid = levels != PAD_LEVEL
    n = _prefix_counts(valid, "levels")
    if (levels[valid] > MAX_LEVEL).any():
        raise ValueError(f"levels: a level above {MAX_LEVEL}")
    has = n > 0
    mean = np.where(valid, levels, 0).sum(1, dtype=np.int64) / np.maximum(n, 1)
    context = np.zeros(len(n), np.uint8)
    if has.any():
        edges = np.quantile(mean[has], np.arange(1, LEVEL_CONTEXTS) / LEVEL_CONTEXTS)
        context[has] = np.searchsorted(edges, mean[has], side="right")
    streams = [*plane_streams(n, width_for(k)), context]
    for c in range(LEVEL_CONTEXTS):
        rows = context == c
        streams.append(np.ascontiguousarray(levels[rows][valid[rows]], np.uint8))
    return pack_streams(streams, LEVELS_ZSTD_LEVEL)


def decode_levels(buf, tokens: int, k: int) -> np.ndarray:
    """uint8 [tokens, k]."""
    what = "levels"
    n, s = _unpack_counted(buf, level_streams(k), tokens, k, what)
    valid = _valid_slots(n, k)
    context = s[0]
    if len(context) != tokens or (tokens and int(context.max()) >= LEVEL_CONTEXTS):
        raise CacheError(f"{what}: {len(context)} token contexts, expected {tokens} below {LEVEL_CONTEXTS} "
                         f"(corrupted chunk)")
    # the streams one after the other hold the tokens' levels in order of (context, token)
    order = np.argsort(context, kind="stable")
    token_ends = np.cumsum(np.bincount(context, minlength=LEVEL_CONTEXTS))
    entry_ends = np.cumsum(n[order])[token_ends - 1] if tokens else np.zeros(LEVEL_CONTEXTS, np.int64)
    entry_ends[token_ends == 0] = 0
    held = np.cumsum([len(x) for x in s[1:]])
    if not np.array_equal(held, entry_ends):
        raise CacheError(f"{what}: the context streams hold {held.tolist()} levels in all, expected "
                         f"{entry_ends.tolist()} (corrupted chunk)")
    levels = np.concatenate(s[1:])
    if levels.size and int(levels.max()) > MAX_LEVEL:
        raise CacheError(f"{what}: level {int(levels.max())} above {MAX_LEVEL} (corrupted chunk)")
    out = np.empty((tokens, k), np.uint8)
    if valid is None:
        out[order] = levels.reshape(tokens, k)
    else:
        in_order = np.full((tokens, k), PAD_LEVEL, np.uint8)
        in_order[valid[order]] = levels
        out[order] = in_order
    return out
