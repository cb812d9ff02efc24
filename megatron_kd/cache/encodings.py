"""How a store holds the teacher's entries: the codec named in its metadata's ``encoding``.

    topk-v1            ids: uint32 id gaps, Blosc zstd byte-shuffled; logprobs: uint16 fixed-point
                       codes, Blosc lz4 bit-shuffled (codec.py). ``encoding`` is the dict that
                       stores of schema 2 have always held (no "codec" key), so they read, resume
                       and digest (store_id) exactly as before.
    topk-v2            ids: int32 id sets; logprobs: topk-v1's uint16 codes, each as byte-plane
                       zstd streams without padding (entry_codecs.py). Same values as topk-v1.
    sampled-counts-v1  ids: int32 id sets; logprobs: uint16 draw counts (the log-probs are
                       log(count / sampled_draws)), byte-plane zstd streams without padding.
    topk-v3            ids: int32 id sets, their byte planes per slot range; logprobs: uint8
                       probability levels (lossy, below), in streams by how flat each token is.

topk-v3's levels: u(p) = log(p + c) - log(1 + c - p), c = 2^-12, rounded to steps of 1/8 from u(0)
(level 0) to u(1) (level 133), decoded to the middle of the step. So |p̂ - p| <= (e^(1/16) - 1) ·
(min(p, 1 - p) + c): 6.5% of p, or of 1 - p near 1 (a peaked token's rest mass keeps its size),
and 1.6e-5 absolute below c; plus the float32 rounding of the decoded log-prob. The forward KL's
gradient with respect to the student's logits is q - p on the entries, so its error per entry is
that of p (tests/cache/test_encodings_topk_v3.py); a level decodes to a log-prob that codes back
to the same level, so decoded rows written again give the same bytes.

``encoding`` of the three newer ones is ``{"codec": NAME}``. The arrays' chunk codecs are zarr
array-to-bytes codecs registered here (``megatron_kd.id_sets_v1`` ...), followed by CRC32C; each
chunk of an array is coded on its own (no state across chunks), so zarr's sharding, partial
writes and reads work as for any codec. A store naming another codec is refused with one line.

Unless told, the writer picks the codec from the mode (sampled -> sampled-counts-v1, top-K ->
topk-v3: paired students trained within noise of lossless topk-v2's at the fidelity benchmark's GPU
preset, on 30% fewer bytes, and its teacher pass costs what topk-v2's does; README, "Which cache"),
and an existing store keeps its own (a resumed build stays byte-identical). The reader turns
every encoding into the same tensors: ids int32 [n, seq, K] with -1 padding, float32 log-probs
with -inf padding.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import torch
from zarr.abc.codec import ArrayBytesCodec
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.core.common import parse_named_configuration
from zarr.registry import register_codec

from megatron_kd.cache import entry_codecs as ec
from megatron_kd.cache.codec import (LOGPROB_SCALE, PAD_CODE, CacheError, code_logprobs, decode_topk, logprob_codes,
                                     sort_entries, topk_deltas_and_codes)

TOPK_V1, TOPK_V2, SAMPLED_COUNTS_V1, TOPK_V3 = "topk-v1", "topk-v2", "sampled-counts-v1", "topk-v3"
CODECS = (TOPK_V1, TOPK_V2, SAMPLED_COUNTS_V1, TOPK_V3)
# topk-v1's encoding field, exactly as stores of schema 2 hold it
TOPK_V1_ENCODING = {
    "ids": "sorted within a token, first id then gaps, uint32",
    "logprobs": "round(-logprob * logprob_scale) as uint16, pad_code = padding",
    "logprob_scale": LOGPROB_SCALE,
    "pad_code": PAD_CODE,
}
# log(count / draws) is exact to this much relative error of exp(logprob) · draws (float32 rounding)
_COUNT_SLACK = 1e-3


def default_codec(mode: str) -> str:
    return SAMPLED_COUNTS_V1 if mode == "sampled" else TOPK_V3


def encoding_field(codec: str) -> dict:
    """The metadata ``encoding`` value of ``codec``."""
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    return dict(TOPK_V1_ENCODING) if codec == TOPK_V1 else {"codec": codec}


def codec_of(encoding) -> str | None:
    """The codec an ``encoding`` field names; None when it names none this version reads."""
    if encoding == TOPK_V1_ENCODING:
        return TOPK_V1
    if isinstance(encoding, dict) and list(encoding) == ["codec"] and encoding["codec"] in CODECS[1:]:
        return encoding["codec"]
    return None


# ---------------------------------------------------------------- zarr chunk codecs
@dataclass(frozen=True)
class _ChunkCodec(ArrayBytesCodec):
    """A zarr array-to-bytes codec over one chunk [rows, seq, K] (tokens = rows · seq)."""

    is_fixed_size = False
    name = ""

    @classmethod
    def from_dict(cls, data):
        _, config = parse_named_configuration(data, cls.name, require_configuration=False)
        return cls(**(config or {}))

    def to_dict(self):
        config = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {"name": self.name, **({"configuration": config} if config else {})}

    def _encode_sync(self, chunk_array, chunk_spec):
        arr = chunk_array.as_numpy_array()
        return chunk_spec.prototype.buffer.from_bytes(self.encode_chunk(arr.reshape(-1, arr.shape[-1])))

    def _decode_sync(self, chunk_bytes, chunk_spec):
        shape = chunk_spec.shape
        out = self.decode_chunk(chunk_bytes.as_numpy_array(), int(np.prod(shape[:-1])), shape[-1])
        return chunk_spec.prototype.nd_buffer.from_numpy_array(out.reshape(shape))

    async def _encode_single(self, chunk_array, chunk_spec):
        return await asyncio.to_thread(self._encode_sync, chunk_array, chunk_spec)

    async def _decode_single(self, chunk_bytes, chunk_spec):
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def compute_encoded_size(self, input_byte_length, chunk_spec):
        raise NotImplementedError  # variable


@dataclass(frozen=True)
class IdSetsCodec(_ChunkCodec):
    name = "megatron_kd.id_sets_v1"

    def encode_chunk(self, arr):
        return ec.encode_id_sets(arr)

    def decode_chunk(self, buf, tokens, k):
        return ec.decode_id_sets(buf, tokens, k)


@dataclass(frozen=True)
class DrawCountsCodec(_ChunkCodec):
    draws: int = 1
    name = "megatron_kd.draw_counts_v1"

    def encode_chunk(self, arr):
        return ec.encode_draw_counts(arr, self.draws)

    def decode_chunk(self, buf, tokens, k):
        return ec.decode_draw_counts(buf, tokens, k, self.draws)


@dataclass(frozen=True)
class TopkCodesCodec(_ChunkCodec):
    name = "megatron_kd.topk_codes_v2"

    def encode_chunk(self, arr):
        return ec.encode_topk_codes(arr)

    def decode_chunk(self, buf, tokens, k):
        return ec.decode_topk_codes(buf, tokens, k)


@dataclass(frozen=True)
class ColumnIdSetsCodec(_ChunkCodec):
    name = "megatron_kd.column_id_sets_v1"

    def encode_chunk(self, arr):
        return ec.encode_column_id_sets(arr)

    def decode_chunk(self, buf, tokens, k):
        return ec.decode_column_id_sets(buf, tokens, k)


@dataclass(frozen=True)
class LevelsCodec(_ChunkCodec):
    name = "megatron_kd.prob_levels_v1"

    def encode_chunk(self, arr):
        return ec.encode_levels(arr)

    def decode_chunk(self, buf, tokens, k):
        return ec.decode_levels(buf, tokens, k)


for _cls in (IdSetsCodec, DrawCountsCodec, TopkCodesCodec, ColumnIdSetsCodec, LevelsCodec):
    register_codec(_cls.name, _cls)


# ---------------------------------------------------------------- arrays of each codec
@dataclass(frozen=True)
class ArraySpec:
    dtype: str
    fill_value: int
    serializer: object  # a zarr array-to-bytes codec, or "auto" (zarr's bytes codec)
    compressors: tuple


def array_specs(codec: str, draws: int) -> dict[str, ArraySpec]:
    """name -> how it is stored, for the arrays "ids" and "logprobs" of a partition."""
    crc = Crc32cCodec()
    if codec == TOPK_V1:
        # Measured at K=100 on teacher-like data (benchmarks/bench_cache.py): id gaps compress 15%
        # smaller with zstd than lz4, byte-shuffled (as small as bit-shuffled, faster to decode);
        # the fixed-point codes are within 5% under bit-shuffled lz4 and decode 2.5x faster than zstd.
        return {"ids": ArraySpec("uint32", 0, "auto", (BloscCodec(cname="zstd", clevel=5, shuffle="shuffle"), crc)),
                "logprobs": ArraySpec("uint16", 0, "auto", (BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"),
                                                            crc))}
    if codec == TOPK_V3:
        return {"ids": ArraySpec("int32", -1, ColumnIdSetsCodec(), (crc,)),
                "logprobs": ArraySpec("uint8", ec.PAD_LEVEL, LevelsCodec(), (crc,))}
    ids = ArraySpec("int32", -1, IdSetsCodec(), (crc,))
    if codec == TOPK_V2:
        return {"ids": ids, "logprobs": ArraySpec("uint16", PAD_CODE, TopkCodesCodec(), (crc,))}
    return {"ids": ids, "logprobs": ArraySpec("uint16", 0, DrawCountsCodec(draws=draws), (crc,))}


# ---------------------------------------------------------------- writer side: tensors -> arrays
def encode_rows(codec: str, ids, logprobs, *, vocab_size: int, draws: int, where: str = "") -> "PendingRows":
    """(ids, logprobs) [..., K] from a teacher pass -> the (ids, logprobs) arrays' values, sorted
    and encoded on the tensors' device, on their way to the host: ``PendingRows.result()`` gives
    them, checked (CacheError naming what is wrong)."""
    sorted_ids, sorted_lps, valid, checks = sort_entries(ids, logprobs, vocab_size, where=where)
    if codec == TOPK_V1:
        deltas, codes = topk_deltas_and_codes(sorted_ids, sorted_lps, valid)
        return PendingRows(deltas, np.uint32, codes, np.uint16, checks)
    if codec == TOPK_V2:
        values = torch.where(valid, logprob_codes(sorted_lps), PAD_CODE)
        return PendingRows(sorted_ids.to(torch.int32), np.int32, values, np.uint16, checks)
    if codec == TOPK_V3:
        values = torch.where(valid, probability_levels(sorted_lps), ec.PAD_LEVEL)
        return PendingRows(sorted_ids.to(torch.int32), np.int32, values.to(torch.uint8), np.uint8, checks)
    exact = sorted_lps.double().exp() * draws
    counts = torch.where(valid, exact.round(), 0)
    far = valid & ((exact - counts).abs() > _COUNT_SLACK * counts.clamp(min=1))
    uneven = valid.any(-1) & (counts.sum(-1) != draws)
    return PendingRows(sorted_ids.to(torch.int32), np.int32, counts.to(torch.int32), np.uint16,
                       _DrawCountChecks(checks, far, uneven, draws))


class _DrawCountChecks:
    """The entries' checks, then that a sampled cache's log-probs are log(count / draws) of counts
    summing to the draws."""

    def __init__(self, entries, far: torch.Tensor, uneven: torch.Tensor, draws: int):
        self.entries, self.far, self.uneven, self.draws = entries, far, uneven, draws
        self.stats = torch.cat([entries.stats, torch.stack([far.any(), uneven.any()]).double()])

    def verify(self, stats: list[float]) -> None:
        self.entries.verify(stats[:-2])
        if stats[-2] or stats[-1]:
            tok = tuple(torch.nonzero(self.far.any(-1) | self.uneven)[0].tolist())
            raise CacheError(f"{self.entries.where}topk_logprobs of token {tok} are not log(count / {self.draws}) of "
                             f"counts summing to sampled_draws={self.draws}; a sampled cache stores draw counts "
                             f"(write a top-K cache with codec {TOPK_V2!r} or {TOPK_V1!r} for other log-probs)")


class PendingRows:
    """Encoded rows on their way to the host, with the checks on them. From a GPU they are copied
    into pinned host memory behind the work already queued (non-blocking) and ``result`` waits for
    that copy alone: a teacher pass hands them over and goes on to launch its next forward, instead
    of waiting for its last one to finish (write_behind.py)."""

    def __init__(self, ids: torch.Tensor, ids_dtype, values: torch.Tensor, values_dtype, checks):
        self._dtypes, self._checks = (ids_dtype, values_dtype), checks
        tensors = (ids, values, checks.stats)
        self._event = None
        if ids.is_cuda:
            tensors = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                            for t in tensors)
            self._event = torch.cuda.Event()
            self._event.record()
        self._ids, self._values, self._stats = tensors

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """The (ids, logprobs) arrays' values; raises CacheError if the entries are bad."""
        if self._event is not None:
            self._event.synchronize()
        self._checks.verify(self._stats.tolist())
        (ids_dtype, values_dtype) = self._dtypes
        return (self._ids.numpy().astype(ids_dtype, copy=False), self._values.numpy().astype(values_dtype, copy=False))


def probability_levels(sorted_lps: torch.Tensor) -> torch.Tensor:
    """int32 topk-v3 levels of log-probs, in float64 on their device: round((u(p) - u(0)) / step)
    with u(p) = log(p + c) - log(1 + c - p) (entry_codecs.LEVEL_STEP, LEVEL_FLOOR); a log-prob a
    hair above 0 counts as p = 1. Padding (-inf) gives level 0, so mask it."""
    p = sorted_lps.double().exp().clamp_(max=1.0)
    u = torch.log(p + ec.LEVEL_FLOOR) - torch.log1p(ec.LEVEL_FLOOR - p)
    return torch.round((u - ec.LEVEL_ORIGIN) / ec.LEVEL_STEP).clamp_(0, ec.MAX_LEVEL).to(torch.int32)


# ---------------------------------------------------------------- reader side: arrays -> tensors
def _tables(draws: int) -> dict[str, np.ndarray]:
    """Stored value -> float32 log-prob, for the codecs decoded by lookup (topk-v2's codes are
    decoded by arithmetic: codec.code_logprobs)."""
    levels = np.full(ec.PAD_LEVEL + 1, -np.inf, np.float32)
    levels[:ec.MAX_LEVEL + 1] = np.log(ec.level_probabilities())
    out = {TOPK_V3: levels}
    if draws:
        with np.errstate(divide="ignore"):
            out[SAMPLED_COUNTS_V1] = np.log(np.arange(draws + 1, dtype=np.float64) / draws).astype(np.float32)
    return out


class RowDecoder:
    """The reader's last step: stored (ids, logprobs) values -> (ids int32 / ``ids_dtype``, float32
    log-probs) tensors, for one store's codec. topk-v3's uint8 levels are looked up two at a time
    (a 65,536-entry table of float32 pairs, 512 KiB): half the index conversions and gathers."""

    def __init__(self, codec: str, draws: int, ids_dtype: torch.dtype = torch.int32):
        self.codec, self.ids_dtype = codec, ids_dtype
        self._table = _tables(draws).get(codec)
        self._pairs = None
        if codec == TOPK_V3:  # entry (hi << 8 | lo) holds (table[lo], table[hi]): little-endian uint16
            lo, hi = np.meshgrid(self._table, self._table)
            self._pairs = np.ascontiguousarray(np.stack([lo, hi], -1)).view(np.float64).reshape(-1)

    def __call__(self, ids: np.ndarray, values: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.codec == TOPK_V1:
            return decode_topk(ids, values, ids_dtype=self.ids_dtype)
        out_ids = torch.from_numpy(np.ascontiguousarray(ids))
        if self.ids_dtype != torch.int32:
            out_ids = out_ids.to(self.ids_dtype)
        values = np.ascontiguousarray(values)
        if self.codec == TOPK_V2:
            lps = code_logprobs(values)
        elif self._pairs is not None and values.size % 2 == 0:
            lps = np.take(self._pairs, values.reshape(-1).view("<u2")).view(np.float32).reshape(values.shape)
        else:
            lps = np.take(self._table, values)
        return out_ids, torch.from_numpy(lps)
