"""Zarr v3 layout of a teacher cache, shared by the writer, the reader and verify/inspect.

    <path>/zarr.json                  root group; attributes["megatron_kd"] = CacheMeta
    <path>/dp_00003/zarr.json         partition of data-parallel rank 3; attributes: rank, rows, complete
    <path>/dp_00003/ids/              uint32 [rows, seq_length, K]  id gaps (codec.py)
    <path>/dp_00003/logprobs/         uint16 [rows, seq_length, K]  fixed-point log-probs
    <path>/dp_00003/rows_done/        uint8  [rows]                 1 once a row's shard is on disk

A chunk holds a few consecutive samples (about 4 MiB of ids: zarr's per-chunk cost stays small
next to decoding) and a shard file holds ``rows_per_shard`` consecutive rows of a partition, so a
rank that trains with the capture's layout reads its shards in order.
Chunks are Blosc/zstd-compressed (byte-shuffled) and carry a CRC32C; shard indexes carry one
too, so a truncated or corrupted shard fails loudly instead of reading as fill values.
"""

from __future__ import annotations

import json
from pathlib import Path

import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from megatron_kd.cache.codec import CacheError
from megatron_kd.cache.meta import ATTR_KEY, CacheMeta

ARRAYS = ("ids", "logprobs")
DONE = "rows_done"
# Shards of about this many raw bytes: large sequential files, bounded writer buffers.
SHARD_TARGET_BYTES = 64 << 20
BYTES_PER_ENTRY = 6  # uint32 id gap + uint16 code


def partition_name(rank: int) -> str:
    return f"dp_{rank:05d}"


CHUNK_TARGET_BYTES = 4 << 20  # of uint32 id gaps


def default_rows_per_shard(seq_length: int, topk: int, rows: int) -> int:
    per_row = seq_length * topk * BYTES_PER_ENTRY
    return int(max(1, min(max(rows, 1), SHARD_TARGET_BYTES // max(per_row, 1))))


def rows_per_chunk(seq_length: int, topk: int, shard_rows: int) -> int:
    """The largest divisor of shard_rows whose chunk stays within CHUNK_TARGET_BYTES."""
    target = max(1, CHUNK_TARGET_BYTES // max(seq_length * topk * 4, 1))
    return max(d for d in range(1, min(target, shard_rows) + 1) if shard_rows % d == 0)


def _compressor(name: str):
    # Measured at K=100 on teacher-like data (benchmarks/bench_cache.py): id gaps compress 15%
    # smaller with zstd than lz4, byte-shuffled (as small as bit-shuffled, faster to decode);
    # the fixed-point codes are within 5% under bit-shuffled lz4 and decode 2.5x faster than zstd.
    if name == "ids":
        return [BloscCodec(cname="zstd", clevel=5, shuffle="shuffle"), Crc32cCodec()]
    return [BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"), Crc32cCodec()]


def read_root_meta(path: str | Path) -> CacheMeta:
    """The CacheMeta stored at ``path``; CacheError when there is no megatron_kd cache there."""
    path = Path(path)
    root_json = path / "zarr.json"
    if not root_json.is_file():
        raise CacheError(f"{path}: no zarr.json; not a megatron_kd cache (or not written yet)")
    try:
        doc = json.loads(root_json.read_text())
    except json.JSONDecodeError as e:
        raise CacheError(f"{root_json}: unreadable JSON ({e})") from None
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise CacheError(f"{root_json}: expected a Zarr v3 group (zarr_format 3, node_type group)")
    attrs = doc.get("attributes", {}).get(ATTR_KEY)
    if attrs is None:
        raise CacheError(f"{root_json}: no '{ATTR_KEY}' attributes; not a megatron_kd cache")
    return CacheMeta.from_attrs(attrs, path=str(path))


def open_root(path: str | Path, mode: str = "r") -> zarr.Group:
    return zarr.open_group(store=str(path), mode=mode, zarr_format=3)


def create_partition(root: zarr.Group, meta: CacheMeta, rank: int) -> zarr.Group:
    rows = meta.layout.rows_of(rank)
    group = root.create_group(partition_name(rank), attributes={"rank": rank, "rows": rows, "complete": False})
    shape = (rows, meta.seq_length, meta.topk)
    shard_rows = min(meta.rows_per_shard, max(rows, 1))
    chunk_rows = rows_per_chunk(meta.seq_length, meta.topk, shard_rows)
    for name, dtype in (("ids", "uint32"), ("logprobs", "uint16")):
        group.create_array(
            name, shape=shape, dtype=dtype, chunks=(chunk_rows, meta.seq_length, meta.topk),
            shards=(shard_rows, meta.seq_length, meta.topk), compressors=_compressor(name), fill_value=0,
        )
    group.create_array(DONE, shape=(rows,), dtype="uint8", chunks=(shard_rows,), fill_value=0)
    return group


def open_partition(root: zarr.Group, meta: CacheMeta, rank: int, *, path) -> zarr.Group:
    """An existing partition group, checked against the metadata (shapes, dtypes, presence)."""
    name = partition_name(rank)
    try:
        group = root[name]
    except KeyError:
        raise CacheError(f"{Path(path) / name}: partition of data-parallel rank {rank} is missing") from None
    rows = meta.layout.rows_of(rank)
    expected = {"ids": ((rows, meta.seq_length, meta.topk), "uint32"),
                "logprobs": ((rows, meta.seq_length, meta.topk), "uint16"),
                DONE: ((rows,), "uint8")}
    for name_, (shape, dtype) in expected.items():
        try:
            arr = group[name_]
        except KeyError:
            raise CacheError(f"{Path(path) / name / name_}: array missing") from None
        if tuple(arr.shape) != shape or str(arr.dtype) != dtype:
            raise CacheError(f"{Path(path) / name / name_}: wrong layout, shape {tuple(arr.shape)} dtype "
                             f"{arr.dtype}, expected shape {shape} dtype {dtype}")
    return group
