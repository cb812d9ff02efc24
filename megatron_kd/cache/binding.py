"""Binding records: every shard file bound to its store and to its place in it.

The CRC32Cs inside a shard prove the file is intact, not that it belongs where it lies: two shards
of a partition swapped, or one copied from another build of the same shape or from another
teacher's cache, decode cleanly and would be distilled from. So each shard of a partition has a
small record, written (atomically: temporary name, then rename) after the shard's data files are
in place and before its rows_done chunk:

    <path>/dp_00003/bindings/000012.json
    {"store_id": "9c1f...", "rank": 3, "shard": 12, "rows": [36, 39],
     "files": {"ids":      {"path": "dp_00003/ids/c/12/0/0",      "bytes": 81234, "sha256": "3f9a...(32 hex)"},
               "logprobs": {"path": "dp_00003/logprobs/c/12/0/0", "bytes": 40551, "sha256": "c41e...(32 hex)"}},
     "tokens": [["5c0f...", "8e21..."], ["a4b1...", "03d9..."], null]}

``tokens`` binds each row to the tokens its teacher read (tokens.py: the window's digest and its
block digests; null for a row not written yet, in a shard a closed writer flushed part-way).

``store_id`` (meta.py) is the digest of the root metadata's identity, so a record copied along with
its shard from a cache of another teacher, dataset or shape names another store; rank, shard, rows
and paths pin the record to one place, and the size and SHA-256 of each file's whole content pin the
file to the record. Everything in a record is derived from the data, so a resumed build writes the
same bytes as an uninterrupted one. (Two builds with equal parameters are the same store: a shard
copied between them carries the same rows, or its digest differs from the record it lands beside.)

Checks, from cheapest:
- ``check_sizes``: the record exists, names this store / partition / shard / file, and each file is
  a regular file of the recorded size (stats only): training start-up, a resuming writer.
- ``check_content``: that, plus each file's SHA-256 (streamed through a small buffer; not the CRC32C
  of the file, which is the same for every file of one layout: store.checksum_regular), computed on
  the first touch of a file by this
  process; afterwards a file whose (device, inode, size, mtime) are unchanged is not hashed again,
  so a DataLoader reading sample by sample pays one stat per shard file and read: the reader, verify.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import zarr

from megatron_kd.cache.codec import CacheError
from megatron_kd.cache.store import (
    ARRAYS,
    block_file,
    block_limit,
    block_rows,
    checksum_regular,
    load_json,
    partition_name,
    stat_regular,
)
from megatron_kd.cache.tokens import valid_entry

BINDINGS = "bindings"
RECORD_NAME = re.compile(r"(\d{6,})\.json")
_RECORD_KEYS = ("store_id", "rank", "shard", "rows", "files", "tokens")
_FILE_KEYS = ("path", "bytes", "sha256")


class PartitionBindings:
    """The binding records of one partition: where they and their files lie, how to write and check them."""

    def __init__(self, path, store_id: str, rank: int, arrays: dict[str, zarr.Array]):
        self.path = Path(path)
        self.store_id = store_id
        self.rank = rank
        self.arrays = arrays  # "ids" / "logprobs" -> the partition's zarr array
        self.rows = arrays["ids"].shape[0]
        self.shard_rows = block_rows(arrays["ids"])
        self.seq_length = arrays["ids"].shape[1]
        self.num_shards = -(-self.rows // self.shard_rows)
        self.dir = self.path / partition_name(rank) / BINDINGS
        self._limits = {name: block_limit(arr) for name, arr in arrays.items()}
        self._verified: set[tuple] = set()  # (file, device, inode, size, mtime_ns) whose content matched
        self._tokens: dict[int, list] = {}  # shard -> its record's tokens, once loaded

    # ------------------------------------------------------------ places
    def record_file(self, shard: int) -> Path:
        return self.dir / f"{shard:06d}.json"

    def data_file(self, name: str, shard: int) -> Path:
        return block_file(self.path, self.arrays[name], shard)

    def shard_range(self, shard: int) -> tuple[int, int]:
        return shard * self.shard_rows, min((shard + 1) * self.shard_rows, self.rows)

    def _relative(self, name: str, shard: int) -> str:
        return self.data_file(name, shard).relative_to(self.path).as_posix()

    # ------------------------------------------------------------ writing
    def write(self, shard: int, tokens: list) -> None:
        """Bind shard ``shard``: hash its data files as they are now on disk and write its record
        (temporary file, then rename: a reader sees the old record or the new one, never a torn one).
        ``tokens``: each row's [digest, blocks] (tokens.py), None for a row not written."""
        start, stop = self.shard_range(shard)
        if len(tokens) != stop - start:
            raise ValueError(f"shard {shard} has {stop - start} rows, got token digests for {len(tokens)}")
        files = {}
        for name in ARRAYS:
            size, digest = checksum_regular(self.data_file(name, shard), self._limits[name])
            files[name] = {"path": self._relative(name, shard), "bytes": size, "sha256": digest}
        record = {"store_id": self.store_id, "rank": self.rank, "shard": shard, "rows": [start, stop], "files": files,
                  "tokens": list(tokens)}
        target = self.record_file(shard)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")  # the writer's start-up sweep removes strays
        tmp.write_text(_canonical(record))
        os.replace(tmp, target)
        self._tokens.pop(shard, None)

    def discard(self, shard: int) -> None:
        """Remove shard ``shard``'s record, then its data files: what is left of a shard that is not
        (or no longer) bound. Its rows must not be marked done any more."""
        self.record_file(shard).unlink(missing_ok=True)
        self._tokens.pop(shard, None)
        for name in ARRAYS:
            self.data_file(name, shard).unlink(missing_ok=True)

    # ------------------------------------------------------------ checking
    def load(self, shard: int) -> dict:
        """Shard ``shard``'s record, checked to name this store, partition, shard, rows and files."""
        file = self.record_file(shard)
        start, stop = self.shard_range(shard)
        if not os.path.lexists(file):
            raise CacheError(f"{file}: missing; shard {shard} (rows {start}..{stop - 1}) of partition {self.rank} is "
                             f"marked written but has no binding record (a shard not written by this store's writer)")
        record = load_json(file)
        if tuple(sorted(record)) != tuple(sorted(_RECORD_KEYS)):
            raise CacheError(f"{file}: keys {sorted(record)}, expected {sorted(_RECORD_KEYS)} (a binding record)")
        if record["store_id"] != self.store_id:
            raise CacheError(f"{file}: binding record of store {record['store_id']!r}, this store is "
                             f"{self.store_id!r}; it was copied from another cache")
        if (record["rank"], record["shard"], record["rows"]) != (self.rank, shard, [start, stop]):
            raise CacheError(f"{file}: binding record of partition {record['rank']!r} shard {record['shard']!r} rows "
                             f"{record['rows']!r}, expected partition {self.rank} shard {shard} rows {[start, stop]}; "
                             f"it was moved or copied from another place")
        files = record["files"]
        if not isinstance(files, dict) or sorted(files) != sorted(ARRAYS):
            raise CacheError(f"{file}: files names {sorted(files) if isinstance(files, dict) else files!r}, expected "
                             f"{sorted(ARRAYS)}")
        for name in ARRAYS:
            entry = files[name]
            want = self._relative(name, shard)
            if not isinstance(entry, dict) or sorted(entry) != sorted(_FILE_KEYS):
                raise CacheError(f"{file}: files.{name} is {entry!r}, expected an object with keys {list(_FILE_KEYS)}")
            if entry["path"] != want:
                raise CacheError(f"{file}: files.{name}.path is {entry['path']!r}, expected {want!r}; the record was "
                                 f"moved or copied from another place")
            size, digest = entry["bytes"], entry["sha256"]
            if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= self._limits[name]:
                raise CacheError(f"{file}: files.{name}.bytes is {size!r}, expected an integer in "
                                 f"1..{self._limits[name]}")
            if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{32}", digest):
                raise CacheError(f"{file}: files.{name}.sha256 is {digest!r}, expected 32 lowercase hex digits")
        tokens = record["tokens"]
        if not isinstance(tokens, list) or len(tokens) != stop - start:
            raise CacheError(f"{file}: tokens is not a list of {stop - start} rows' token digests")
        for row, entry in enumerate(tokens, start):
            if entry is not None and not valid_entry(entry, self.seq_length):
                raise CacheError(f"{file}: tokens[{row - start}] (row {row}) is {str(entry)[:60]!r}, expected "
                                 f"[16 hex digits, the block digests of a {self.seq_length}-token window] or null")
        self._tokens[shard] = tokens
        return record

    def tokens(self, shard: int) -> list:
        """Shard ``shard``'s rows' [digest, blocks] (None: not written), from its record (loaded once)."""
        if shard not in self._tokens:
            self.load(shard)
        return self._tokens[shard]

    def check_sizes(self, shard: int) -> dict:
        """The record of ``shard`` (checked as in ``load``) and its files' sizes: stats only."""
        record = self.load(shard)
        for name in ARRAYS:
            st = stat_regular(self.data_file(name, shard), self._limits[name])
            self._check_size(name, shard, record, None if st is None else st.st_size)
        return record

    def check_content(self, shard: int, names=ARRAYS) -> None:
        """Shard ``shard``'s files ``names`` match its record in size and SHA-256; a file already
        verified by this object and unchanged since (same device, inode, size, mtime) is not re-read."""
        record = None
        for name in names:
            file = self.data_file(name, shard)
            st = stat_regular(file, self._limits[name])  # refuses a FIFO or device before anything reads it
            key = None if st is None else (str(file), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if key is not None and key in self._verified:
                continue
            if record is None:
                record = self.load(shard)
            self._check_size(name, shard, record, None if st is None else st.st_size)
            size, digest = checksum_regular(file, self._limits[name])
            self._check_size(name, shard, record, size)
            want = record["files"][name]["sha256"]
            if digest != want:
                raise CacheError(f"{file}: content does not match its binding record {self.record_file(shard)} "
                                 f"(sha256 {digest} vs {want}); the file was moved, replaced or copied from another "
                                 f"cache")
            self._verified.add(key)

    def _check_size(self, name: str, shard: int, record: dict, size: int | None) -> None:
        file = self.data_file(name, shard)
        start, stop = self.shard_range(shard)
        if size is None:
            raise CacheError(f"{file}: missing (rows {start}..{stop - 1} of {self.arrays[name].path}); the store "
                             f"records them as written")
        want = record["files"][name]["bytes"]
        if size != want:
            raise CacheError(f"{file}: {size} bytes, its binding record {self.record_file(shard)} says {want}; the "
                             f"file was truncated, moved, replaced or copied from another cache")

    def unexpected_records(self) -> list[Path]:
        """Files in the bindings folder that are no record of a shard of this partition."""
        if not self.dir.is_dir():
            return []
        out = []
        for entry in sorted(self.dir.iterdir()):
            m = RECORD_NAME.fullmatch(entry.name)
            if m is None or int(m.group(1)) >= self.num_shards:
                out.append(entry)
        return out


def _canonical(record: dict) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
