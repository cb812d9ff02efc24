"""Zarr v3 layout of a teacher cache, shared by the writer, the reader and verify/inspect.

    <path>/zarr.json                  root group; attributes["megatron_kd"] = CacheMeta
    <path>/dp_00003/zarr.json         partition of data-parallel rank 3; attributes: rank, rows, complete
    <path>/dp_00003/ids/              uint32 [rows, seq_length, K]  id gaps (codec.py)
    <path>/dp_00003/logprobs/         uint16 [rows, seq_length, K]  fixed-point log-probs
    <path>/dp_00003/rows_done/        uint8  [rows]                 1 once a row's shard is on disk
    <path>/dp_00003/bindings/000012.json   binding record of shard 12: store, place, sizes, SHA-256s, token digests (binding.py)
    <path>/dp_00003/.writer.lock      empty; the partition's one writer holds an flock on it

A chunk holds a few consecutive samples (about 4 MiB of ids: zarr's per-chunk cost stays small
next to decoding) and a shard file holds ``rows_per_shard`` consecutive rows of a partition, so a
rank that trains with the capture's layout reads its shards in order; rows_done has one chunk per
shard.

Integrity: every binary file carries a CRC32C (ids / logprobs chunks and shard indexes, rows_done
chunks) and every zarr.json is parsed and checked here against the root metadata before zarr
opens it, so damage anywhere is one CacheError naming the file. Zarr reads a file that is not
there as fill values; here a shard or rows_done chunk that should exist (its rows are marked done,
or its partition is complete) and does not is an error instead. Every file is opened only if it is
a regular file (a symbolic link to one is fine) of bounded size: a FIFO in place of a shard would
block zarr's read forever, a link to /dev/zero would read until memory runs out.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from megatron_kd.cache.codec import CacheError
from megatron_kd.cache.encodings import array_specs
from megatron_kd.cache.meta import ATTR_KEY, CacheMeta

ARRAYS = ("ids", "logprobs")
DONE = "rows_done"
LOCK_FILE = ".writer.lock"
# Shards of about this many raw bytes: large sequential files, bounded writer buffers.
SHARD_TARGET_BYTES = 64 << 20
BYTES_PER_ENTRY = 6  # uint32 id gap + uint16 code
# zarr.json documents and binding records are a few KiB; anything this large is not one
JSON_LIMIT = 16 << 20


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


def one_line(e: BaseException) -> str:
    """An exception as ``Type: message`` on one line (zarr's messages span several)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"


def _check_regular(file: Path, st: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise CacheError(f"{file}: not a regular file ({_kind(st.st_mode)}); the store holds only regular files")
    if st.st_size > limit:
        raise CacheError(f"{file}: {st.st_size} bytes, more than the {limit} a file of this kind can hold "
                         f"(not written by this store's writer)")


def stat_regular(file: Path, limit: int) -> os.stat_result | None:
    """The stat of ``file`` (symbolic links followed) if it is a regular file of at most ``limit``
    bytes; None if it does not exist; CacheError naming it otherwise. One stat, nothing opened."""
    try:
        st = os.stat(file)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise CacheError(f"{file}: unreadable ({e.strerror})") from None
    _check_regular(file, st, limit)
    return st


def _open_nonblocking(file: Path) -> int:
    """A read descriptor of ``file``; CacheError naming it when it is missing or unreadable."""
    try:
        return os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise CacheError(f"{file}: missing") from None
    except OSError as e:
        raise CacheError(f"{file}: unreadable ({e.strerror})") from None


def read_regular(file: Path, limit: int) -> bytes:
    """The bytes of ``file``, a regular file of at most ``limit`` bytes; CacheError naming it when it
    is missing, something else (FIFO, device, directory) or larger. Opened non-blocking, so a FIFO
    is refused at once instead of waiting for a writer; the type is checked on the open descriptor."""
    fd = _open_nonblocking(file)
    with os.fdopen(fd, "rb") as f:
        _check_regular(file, os.fstat(fd), limit)
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise CacheError(f"{file}: unreadable ({e.strerror})") from None
    if len(data) > limit:
        raise CacheError(f"{file}: more than the {limit} bytes a file of this kind can hold (still growing?)")
    return data


def checksum_regular(file: Path, limit: int) -> tuple[int, str]:
    """(size, the first 32 hex digits of the SHA-256 of its content) of ``file``, checked as in
    ``read_regular``. Not a CRC: every chunk and shard index of a shard file ends with its own
    CRC32C, and a CRC over blocks that each end with their CRC is the same for every file of the
    same layout (a CRC's residue), so it would tell no two shards apart. SHA-256 (~1.8 GB/s on one
    core with the CPU's SHA instructions) is streamed through a small buffer: a kernel copy into a
    cache-resident buffer, not a copy of the whole file into fresh memory."""
    fd = _open_nonblocking(file)
    try:
        _check_regular(file, os.fstat(fd), limit)
        buf = np.empty(1 << 20, np.uint8)
        digest, size = hashlib.sha256(), 0
        while n := os.readv(fd, [buf]):
            digest.update(buf[:n])
            size += n
            if size > limit:
                raise CacheError(f"{file}: more than the {limit} bytes a file of this kind can hold (still growing?)")
    except OSError as e:
        raise CacheError(f"{file}: unreadable ({e.strerror})") from None
    finally:
        os.close(fd)
    return size, digest.hexdigest()[:32]


def load_json(file: Path) -> dict:
    """A zarr.json document (or binding record); CacheError naming the file when it is missing, not a
    regular file of at most JSON_LIMIT bytes, not UTF-8 JSON, or not a JSON object (random bytes,
    ``[]``, a torn write)."""
    raw = read_regular(file, JSON_LIMIT)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise CacheError(f"{file}: not UTF-8 text; expected Zarr v3 JSON metadata (corrupted?)") from None
    except (ValueError, RecursionError) as e:
        raise CacheError(f"{file}: unreadable JSON ({e}); expected Zarr v3 metadata (corrupted?)") from None
    if not isinstance(doc, dict):
        raise CacheError(f"{file}: holds a JSON {type(doc).__name__}, expected an object (Zarr v3 metadata)")
    return doc


def _zarr_node(doc: dict, file: Path, node_type: str) -> dict:
    """The attributes of a parsed zarr.json, after checking it is a Zarr v3 node of that type."""
    if doc.get("zarr_format") != 3 or doc.get("node_type") != node_type:
        raise CacheError(f"{file}: zarr_format {doc.get('zarr_format')!r} node_type {doc.get('node_type')!r}, "
                         f"expected a Zarr v3 {node_type} (zarr_format 3, node_type {node_type})")
    attrs = doc.get("attributes", {})
    if not isinstance(attrs, dict):
        raise CacheError(f"{file}: attributes is a JSON {type(attrs).__name__}, expected an object")
    return attrs


def _zarr_open(file: Path, open_fn):
    """Run zarr's open of the node described by ``file``; any zarr error becomes a CacheError naming it."""
    try:
        return open_fn()
    except CacheError:
        raise
    except Exception as e:
        raise CacheError(f"{file}: zarr cannot open it ({one_line(e)})") from None


def read_root_meta(path: str | Path) -> CacheMeta:
    """The CacheMeta stored at ``path``; CacheError when there is no megatron_kd cache there."""
    path = Path(path)
    root_json = path / "zarr.json"
    if not os.path.lexists(root_json):
        raise CacheError(f"{path}: no zarr.json; not a megatron_kd cache (or not written yet)")
    attrs = _zarr_node(load_json(root_json), root_json, "group").get(ATTR_KEY)
    if attrs is None:
        raise CacheError(f"{root_json}: no '{ATTR_KEY}' attributes; not a megatron_kd cache")
    if not isinstance(attrs, dict):
        raise CacheError(f"{root_json}: attributes.{ATTR_KEY} is a JSON {type(attrs).__name__}, expected an object")
    return CacheMeta.from_attrs(attrs, path=str(root_json))


def open_root(path: str | Path, mode: str = "r") -> zarr.Group:
    return _zarr_open(Path(path) / "zarr.json", lambda: zarr.open_group(store=str(path), mode=mode, zarr_format=3))


def create_partition(root: zarr.Group, meta: CacheMeta, rank: int) -> zarr.Group:
    rows = meta.layout.rows_of(rank)
    group = root.create_group(partition_name(rank), attributes={"rank": rank, "rows": rows, "complete": False})
    shape = (rows, meta.seq_length, meta.topk)
    shard_rows = min(meta.rows_per_shard, max(rows, 1))
    chunk_rows = rows_per_chunk(meta.seq_length, meta.topk, shard_rows)
    for name, spec in array_specs(meta.codec, meta.sampled_draws).items():
        group.create_array(
            name, shape=shape, dtype=spec.dtype, chunks=(chunk_rows, meta.seq_length, meta.topk),
            shards=(shard_rows, meta.seq_length, meta.topk), serializer=spec.serializer,
            compressors=list(spec.compressors), fill_value=spec.fill_value,
        )
    group.create_array(DONE, shape=(rows,), dtype="uint8", chunks=(shard_rows,), fill_value=0,
                       compressors=[ZstdCodec(level=0), Crc32cCodec()])
    return group


def partition_attrs(path, meta: CacheMeta, rank: int) -> dict | None:
    """A partition's attributes (rank, rows, complete), checked; None while it is not created yet."""
    file = Path(path) / partition_name(rank) / "zarr.json"
    if not file.exists():
        return None
    attrs = _zarr_node(load_json(file), file, "group")
    rows = meta.layout.rows_of(rank)
    for key, ok, want in (("rank", attrs.get("rank") == rank, rank), ("rows", attrs.get("rows") == rows, rows),
                          ("complete", isinstance(attrs.get("complete"), bool), "true or false")):
        if not ok:
            raise CacheError(f"{file}: attributes.{key} is {attrs.get(key)!r}, expected {want}")
    return attrs


def open_partition(root: zarr.Group, meta: CacheMeta, rank: int, *, path) -> zarr.Group:
    """An existing partition group, checked against the metadata (attributes, array shapes, dtypes
    and blocks); every zarr.json on the way is validated first, so damage names its file."""
    name = partition_name(rank)
    part = Path(path) / name
    attrs = partition_attrs(path, meta, rank)
    if attrs is None:
        raise CacheError(f"{part}: partition of data-parallel rank {rank} is missing")
    if meta.complete and not attrs["complete"]:
        raise CacheError(f"{part / 'zarr.json'}: attributes.complete is false, expected true (the root's "
                         f"completion record says every partition is complete)")
    group = _zarr_open(part / "zarr.json", lambda: root[name])
    rows, seq, k = meta.layout.rows_of(rank), meta.seq_length, meta.topk
    shard_rows = min(meta.rows_per_shard, max(rows, 1))
    chunk_rows = rows_per_chunk(seq, k, shard_rows)
    # name: (shape, chunks, shards, dtype), as create_partition makes them
    specs = array_specs(meta.codec, meta.sampled_draws)
    expected = {name_: ((rows, seq, k), (chunk_rows, seq, k), (shard_rows, seq, k), spec.dtype)
                for name_, spec in specs.items()}
    expected[DONE] = ((rows,), (shard_rows,), None, "uint8")
    for name_, (shape, chunks, shards, dtype) in expected.items():
        file = part / name_ / "zarr.json"
        if not file.exists():
            raise CacheError(f"{part / name_}: array missing")
        _zarr_node(load_json(file), file, "array")
        arr = _zarr_open(file, lambda: group[name_])
        if tuple(arr.shape) != shape or str(arr.dtype) != dtype:
            raise CacheError(f"{part / name_}: wrong layout, shape {tuple(arr.shape)} dtype "
                             f"{arr.dtype}, expected shape {shape} dtype {dtype}")
        if tuple(arr.chunks) != chunks or (tuple(arr.shards) if arr.shards else None) != shards:
            raise CacheError(f"{file}: chunks {arr.chunks} shards {arr.shards}, expected chunks {chunks} "
                             f"shards {shards} (rows_per_shard={meta.rows_per_shard})")
        if name_ in specs:
            _check_serializer(file, arr, specs[name_], meta.codec)
    return group


def _check_serializer(file: Path, arr: zarr.Array, spec, codec: str) -> None:
    """The chunk codec of an entry array is the one its store's codec uses (a zarr.json of another
    encoding, or another number of draws, would decode the chunks as something else)."""
    if spec.serializer == "auto":
        return
    inner = getattr(arr.metadata.codecs[0], "codecs", ())  # the sharding codec's chunk codecs
    have = inner[0].to_dict() if inner else None
    if have != spec.serializer.to_dict():
        raise CacheError(f"{file}: chunk codec {have!r}, expected {spec.serializer.to_dict()!r} (encoding {codec})")


# ---------------------------------------------------------------- blocks: shard files / rows_done chunks
def block_rows(arr: zarr.Array) -> int:
    """Rows per file of ``arr``: a shard of ids / logprobs, a chunk of rows_done."""
    return (arr.shards or arr.chunks)[0]


def block_file(path, arr: zarr.Array, block: int) -> Path:
    return Path(path) / arr.path / arr.metadata.encode_chunk_key((block,) + (0,) * (arr.ndim - 1))


def block_limit(arr: zarr.Array) -> int:
    """The most bytes one file of ``arr`` can hold: twice its raw bytes (blosc and zstd never expand
    data that much), plus room for per-chunk headers, checksums and the shard index."""
    rows = block_rows(arr)
    raw = rows * int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
    chunks_per_block = rows // arr.chunks[0]
    return 2 * raw + 64 * chunks_per_block + (64 << 10)


def strict(arr: zarr.Array) -> zarr.Array:
    """``arr`` reading a missing file as an error, not as fill values."""
    return arr.with_config({"read_missing_chunks": False})


def read_rows(path, arr: zarr.Array, r0: int, r1: int, *, missing_ok: bool = False) -> np.ndarray:
    """``arr[r0:r1]`` (``arr`` from ``strict`` unless ``missing_ok``); on failure, CacheError naming
    the first of its files that is missing or does not decode (CRC32C, truncation)."""
    try:
        return arr[r0:r1]
    except Exception as e:
        err = e
    per = block_rows(arr)
    for block in range(r0 // per, (r1 - 1) // per + 1):
        file = block_file(path, arr, block)
        if not missing_ok and not file.is_file():
            last = min((block + 1) * per, arr.shape[0]) - 1
            raise CacheError(f"{file}: missing (rows {block * per}..{last} of {arr.path}); the store records "
                             f"them as written")
        try:
            arr[max(r0, block * per):min(r1, (block + 1) * per)]
        except Exception as e:
            raise CacheError(f"{file}: unreadable, truncated or corrupted ({one_line(e)})") from None
    raise CacheError(f"{Path(path) / arr.path}: rows {r0}..{r1 - 1} unreadable ({one_line(err)})") from None


def read_done(path, group: zarr.Group, rank: int) -> np.ndarray:
    """rows_done of a partition as bool, checked: 0 / 1 only, and every row done once the partition
    is complete (then a missing chunk is an error; before, it is rows not written yet)."""
    arr = group[DONE]
    complete = bool(group.attrs["complete"])
    limit = block_limit(arr)
    for block in range(-(-arr.shape[0] // block_rows(arr))):  # before zarr opens any of them
        stat_regular(block_file(path, arr, block), limit)
    raw = read_rows(path, strict(arr) if complete else arr, 0, arr.shape[0], missing_ok=not complete)
    bad = np.flatnonzero(raw > 1)
    if len(bad):
        raise CacheError(f"{block_file(path, arr, int(bad[0]) // block_rows(arr))}: rows_done holds {int(raw[bad[0]])} "
                         f"for row {int(bad[0])}, expected 0 or 1")
    done = raw.astype(bool)
    if complete and not done.all():
        row = int(np.flatnonzero(~done)[0])
        raise CacheError(f"{block_file(path, arr, row // block_rows(arr))}: row {row} is not marked done, expected "
                         f"every row done (partition {rank} is marked complete)")
    return done
