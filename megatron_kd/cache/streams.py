"""Byte streams for the entropy-coded cache encodings (sampled-counts-v1, topk-v2, topk-v3).

A chunk is encoded as a few streams of byte symbols, each compressed with zstd on its own, so that
every stream's statistics stay apart (zstd codes literals with one Huffman table per block: mixing
the id bytes with the count bytes would give both one table). An unsigned integer stream of width
W bytes is stored as W byte planes (plane j: byte j of every value, little-endian), the layout of
Blosc's byte shuffle: the low plane of id gaps or counts is skewed and Huffman-coded near its
entropy, the high planes are mostly zero, and a plane that is all zero is stored empty. zstd's
matches also find what repeats from token to token (a teacher's top-K sets overlap at
neighbouring positions). Measured on teacher rows against an Elias-gamma split (the class of each
value entropy-coded, its low bits stored raw): within 4% either way in size, several times faster
to decode in numpy (benchmarks/bench_cache_fidelity.py).

Container of one chunk: a byte with the number of streams S, then per stream its raw length and
stored length (uint32 little-endian each) and a method byte (0: stored, 1: zstd), then the
payloads in order. A stream is zstd-compressed only when that makes it smaller.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numcodecs.zstd import Zstd

from megatron_kd.cache.codec import CacheError

_HEADER = np.dtype([("raw", "<u4"), ("stored", "<u4"), ("method", "u1")])
_STORED, _ZSTD = 0, 1
_COMPRESS_POOL: ThreadPoolExecutor | None = None  # made on first use: readers never start it
_COMPRESS_POOL_LOCK = threading.Lock()
# below this many raw bytes a chunk's streams compress one after another: handing them to threads
# costs more than it saves
PARALLEL_BYTES = 1 << 18


# ---------------------------------------------------------------- integers as byte planes
_WIDTHS = {1: np.uint8, 2: np.dtype("<u2"), 4: np.dtype("<u4")}


def plane_streams(v: np.ndarray, width: int) -> list[np.ndarray]:
    """``width`` (1, 2 or 4) byte planes of unsigned values below 256**width; an all-zero plane is
    returned empty. ValueError for a value out of range (a codec bug)."""
    v = np.asarray(v)
    if v.size and (v.min() < 0 or int(v.max()) >= 1 << (8 * width)):
        raise ValueError(f"values {int(v.min())}..{int(v.max())} do not fit {width} byte(s)")
    raw = v.astype(_WIDTHS[width]).view(np.uint8).reshape(-1, width)
    out = []
    for j in range(width):
        plane = np.ascontiguousarray(raw[:, j])
        out.append(plane if plane.any() else np.zeros(0, np.uint8))
    return out


def read_planes(streams: list[np.ndarray], count: int, *, what: str, dtype=np.int64) -> np.ndarray:
    """Inverse of ``plane_streams``: ``count`` values (``dtype``, int64 by default) from their planes.
    A narrower ``dtype`` (int32 where the values fit) halves the decoders' memory traffic."""
    width = len(streams)
    for j, plane in enumerate(streams):
        if len(plane) not in (0, count):
            raise CacheError(f"{what}: byte plane {j} holds {len(plane)} bytes, expected {count} (or none)")
    if width == 1:
        return (streams[0] if len(streams[0]) else np.zeros(count, np.uint8)).astype(dtype)
    joined = np.zeros((count, width), np.uint8)
    for j, plane in enumerate(streams):
        if len(plane):
            joined[:, j] = plane
    values = joined.view(_WIDTHS[width]).reshape(count)
    if np.dtype(dtype).itemsize == width:  # reinterpreted, not copied: int32 from 4 planes reads
        return values.view(np.dtype(dtype).newbyteorder("<"))  # 2^31 and above as negative (callers check)
    return values.astype(dtype)


def width_for(limit: int) -> int:
    """Bytes (1, 2 or 4) that hold every value in [0, limit]."""
    return 1 if limit < 1 << 8 else 2 if limit < 1 << 16 else 4


# ---------------------------------------------------------------- container
def _compress_pool() -> ThreadPoolExecutor:
    global _COMPRESS_POOL
    with _COMPRESS_POOL_LOCK:
        if _COMPRESS_POOL is None:
            _COMPRESS_POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="zstd")
        return _COMPRESS_POOL


def _forget_pool_in_child() -> None:
    global _COMPRESS_POOL, _COMPRESS_POOL_LOCK
    _COMPRESS_POOL, _COMPRESS_POOL_LOCK = None, threading.Lock()  # a forked child has none of the threads


os.register_at_fork(after_in_child=_forget_pool_in_child)


def pack_streams(streams: list[np.ndarray], level: int) -> bytes:
    """Streams (uint8 arrays) -> one chunk's bytes; each stream zstd-compressed when that is smaller.
    The streams compress at once (zstd releases the GIL): a chunk costs its largest stream, not all of
    them, which is what a teacher pass waits for after its last forward (write_behind.py)."""
    zstd = Zstd(level=level)
    raws = [np.ascontiguousarray(s, dtype=np.uint8).tobytes() for s in streams]
    large = [raw for raw in raws if len(raw) > 32]
    parallel = len(large) > 1 and sum(map(len, large)) >= PARALLEL_BYTES
    compressed = iter(_compress_pool().map(zstd.encode, large) if parallel else map(zstd.encode, large))
    header = np.zeros(len(streams), _HEADER)
    payloads = []
    for i, raw in enumerate(raws):
        packed = next(compressed) if len(raw) > 32 else raw
        method = _ZSTD if len(packed) < len(raw) else _STORED
        payloads.append(packed if method == _ZSTD else raw)
        header[i] = (len(raw), len(payloads[-1]), method)
    return bytes([len(streams)]) + header.tobytes() + b"".join(payloads)


def unpack_streams(buf, count: int, *, limit: int) -> list[np.ndarray]:
    """Inverse of ``pack_streams``: ``count`` uint8 streams; each stream's raw length must be at most
    ``limit`` bytes (a corrupted header never makes zstd allocate more)."""
    buf = memoryview(buf).cast("B")
    head = 1 + count * _HEADER.itemsize
    if len(buf) < head or buf[0] != count:
        raise CacheError(f"chunk of {len(buf)} bytes does not start with a header of {count} streams")
    header = np.frombuffer(buf[1:head], _HEADER)
    if int(header["stored"].sum(dtype=np.int64)) != len(buf) - head:
        raise CacheError(f"chunk streams hold {int(header['stored'].sum(dtype=np.int64))} bytes, the chunk "
                         f"{len(buf) - head}")
    out, offset = [], head
    zstd = Zstd()
    for raw, stored, method in header.tolist():
        if raw > limit or method not in (_STORED, _ZSTD) or (method == _STORED and raw != stored):
            raise CacheError(f"chunk stream header (raw {raw}, stored {stored}, method {method}) is invalid")
        payload = buf[offset:offset + stored]
        offset += stored
        data = zstd.decode(payload) if method == _ZSTD else payload
        if len(data) != raw:
            raise CacheError(f"chunk stream decodes to {len(data)} bytes, its header says {raw}")
        out.append(np.frombuffer(data, np.uint8))
    return out
