"""``CacheWriter``: one data-parallel rank writes its partition of a teacher cache.

Ranks write concurrently, each only its own partition group; the root zarr.json is created once
with content every rank agrees on, and rewritten only by whichever rank completes the last
partition. Samples are buffered until a shard's rows are all present, then the shard is written in
one piece, then its binding record (binding.py: store, place, size and SHA-256 of each file, the
digests of the tokens each row's teacher read: tokens.py), and
only then are its rows marked in ``rows_done`` (zarr writes each file under a temporary name and
renames it into place; so does the record), so a row marked done is always on disk and bound, and a
killed build loses at most the shards it was filling. Opening a writer again on the same path with
the same parameters resumes: rows already done are skipped (``pending_samples`` lists the rest) and
the finished store is byte-identical to an uninterrupted build.

Resuming trusts rows_done only as far as the disk backs it: a shard whose rows are marked done but
whose record is missing or names another store or place, or whose files are missing or not the
recorded size (a partly written shard, rewritten on resume: not the recorded SHA-256 either, the
window between its data and its record), is not done. Its rows are un-marked (the partition's and
the store's completion records first, then its rows_done chunk, then the record and the files), so
``pending_samples`` lists them again and writing them restores the store; ``repaired_samples`` and
``repairs`` say what was un-marked and why, for the caller to report (the library prints nothing).

Any OSError while writing (a read-only store, permissions, a full disk) is one CacheWriteError (a
CacheError) naming the file: the store may be fine, only not writable here.

One writer per partition: the writer holds an exclusive flock on the partition's lock file until
``close``; a second writer on the same rank gets a CacheError. The OS drops the lock with the
process, so a killed writer leaves no stale lock.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import zarr

from megatron_kd.cache.binding import PartitionBindings
from megatron_kd.cache.codec import CacheBusyError, CacheError, CacheWriteError
from megatron_kd.cache.encodings import (CODECS, SAMPLED_COUNTS_V1, PendingRows, array_specs, default_codec, encode_rows,
                                         encoding_field)
from megatron_kd.cache.meta import ATTR_KEY, METADATA_KEYS, MODES, CacheMeta
from megatron_kd.cache.store import (ARRAYS, DONE, LOCK_FILE, block_file, create_partition, default_rows_per_shard,
                                     open_partition, open_root, partition_attrs, partition_name, read_done,
                                     read_root_meta, read_rows, strict)
from megatron_kd.cache.tokens import token_entries


# zarr's temporary file names (<target>.<uuid hex>.partial) and the binding records' (<target>.partial)
_TEMP_SUFFIX = re.compile(r"(\.[0-9a-f]{32})?\.partial$")


@contextmanager
def _os_errors(where: Path):
    """An OSError inside (read-only store, permission, disk full, a file where a folder belongs) as
    one CacheWriteError naming the file it hit (``where`` when it names none)."""
    try:
        yield
    except OSError as e:
        file = _TEMP_SUFFIX.sub("", str(e.filename)) if e.filename else str(where)
        raise CacheWriteError(f"{file}: cannot write the cache ({e.strerror or e}); the writer needs write access and "
                         f"free space there") from None


def _stored_meta(path: Path) -> CacheMeta | None:
    """The metadata of the store at ``path``; None where there is none yet."""
    if not os.path.lexists(path / "zarr.json"):
        return None
    with _os_errors(path):
        return read_root_meta(path)


def _open_or_create_root(path: Path, meta: CacheMeta) -> tuple[zarr.Group, CacheMeta]:
    """The root group for writing and the stored metadata (equal to ``meta`` in every field)."""
    if not os.path.lexists(path / "zarr.json"):
        try:
            zarr.create_group(store=str(path), attributes={ATTR_KEY: meta.to_attrs()}, zarr_format=3)
        except zarr.errors.ContainsGroupError:
            pass  # another rank created it first; compared below like any existing store
    stored = read_root_meta(path)
    for name, have, want in stored.mismatches(meta):
        raise CacheError(f"{path}: existing cache has {name}={have!r}, this writer has {name}={want!r}; "
                         f"use another path or the parameters it was built with")
    return open_root(path, mode="r+"), stored


def _lock_partition(path: Path, rank: int):
    """An open lock file of partition ``rank`` under an exclusive flock; CacheBusyError if another
    writer (this process or any other) holds it."""
    part = path / partition_name(rank)
    part.mkdir(parents=True, exist_ok=True)
    file = part / LOCK_FILE
    # non-blocking: a FIFO in its place is refused at once (ENXIO, or not a regular file below)
    handle = os.fdopen(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC, 0o644),
                       "ab")
    try:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise CacheError(f"{file}: not a regular file; the partition's lock must be one")
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise CacheBusyError(f"{file}: another writer holds partition {rank} of {path}; one writer per data-parallel "
                         f"rank (wait for it, or stop it: a killed writer's lock goes with its process)") from None
    except OSError as e:
        handle.close()
        raise CacheError(f"{file}: cannot lock partition {rank} ({e.strerror}); the cache needs a filesystem "
                         f"with flock") from None
    except BaseException:
        handle.close()
        raise
    return handle


@dataclasses.dataclass(frozen=True)
class EncodedSamples:
    """Samples checked and encoded by ``CacheWriter.encode``, on the host, ready for ``store``."""

    rows: np.ndarray  # [n] int64: the samples' rows in this partition
    ids: np.ndarray  # [n, seq_length, K]: the ids array's values
    values: np.ndarray  # [n, seq_length, K]: the logprobs array's values
    tokens: list  # [n] [digest, blocks] of the tokens the teacher read (tokens.py)


@dataclasses.dataclass(frozen=True)
class PendingSamples:
    """``CacheWriter.encode_async``'s samples: their rows, and their encoded values on the way to the host."""

    rows: np.ndarray
    shape: tuple[int, int, int]
    pending: PendingRows
    tokens: list

    def result(self) -> EncodedSamples:
        """The encoded samples; raises CacheError naming the first sample if their entries are bad."""
        ids, values = self.pending.result()
        return EncodedSamples(self.rows, ids.reshape(self.shape), values.reshape(self.shape), self.tokens)


class CacheWriter:
    """Writes the samples of data-parallel rank ``dp_rank`` (see layout.py for which those are).

    ``metadata`` may set temperature, mode ("topk" / "sampled"), sampled_draws, the
    teacher / tokenizer / dataset fingerprints, and "extra" (any JSON-serializable dict).

    ``codec`` (encodings.py): "topk-v1", "topk-v2", "sampled-counts-v1" or "topk-v3"; None picks the
    codec of the store already at ``path`` (so a build started by another version resumes as it
    began), else the mode's: sampled-counts-v1 for "sampled", topk-v3 for "topk". In sampled mode
    sampled_draws defaults to ``topk`` (a teacher pass draws K per token), or to the existing
    store's.

    After opening, ``repaired_samples`` holds the global indices of samples that rows_done listed
    as written but whose shard was not on disk as its binding record says (now pending again), and
    ``repairs`` one line per such shard saying why.
    """

    def __init__(self, path, *, vocab_size: int, topk: int, seq_length: int, num_samples: int,
                 dp_rank: int = 0, dp_size: int = 1, micro_batch_size: int = 1, metadata: dict | None = None,
                 rows_per_shard: int | None = None, codec: str | None = None):
        metadata = dict(metadata or {})
        unknown = set(metadata) - set(METADATA_KEYS)
        if unknown:
            raise ValueError(f"metadata keys {sorted(unknown)} are not cache fields; put them under 'extra' "
                             f"(known: {METADATA_KEYS})")
        if metadata.get("mode", "topk") not in MODES:
            raise ValueError(f"metadata mode must be one of {MODES}, got {metadata['mode']!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        for name, value in (("vocab_size", vocab_size), ("topk", topk), ("seq_length", seq_length)):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        self.path = Path(path)
        self.rank = dp_rank
        self._lock = None
        mode = metadata.get("mode", "topk")
        stored = _stored_meta(self.path)
        if codec is None:
            codec = stored.codec if stored is not None else default_codec(mode)
        if mode == "sampled" and not metadata.get("sampled_draws"):
            # a teacher pass draws K per token (CaptureConfig.draws); a store of before may hold 0
            metadata["sampled_draws"] = stored.sampled_draws if stored is not None else topk
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
        if codec == SAMPLED_COUNTS_V1 and (mode != "sampled" or metadata.get("sampled_draws", 0) < 1):
            raise ValueError(f"codec {codec!r} stores draw counts: it needs metadata mode 'sampled' and sampled_draws "
                             f">= 1 (got mode {mode!r}, sampled_draws {metadata.get('sampled_draws', 0)!r})")
        metadata["encoding"] = encoding_field(codec)
        probe = CacheMeta(vocab_size, topk, seq_length, num_samples, dp_size, micro_batch_size, 1)
        max_rows = max(probe.layout.rows_of(r) for r in range(dp_size))
        meta = CacheMeta(
            vocab_size=vocab_size, topk=topk, seq_length=seq_length, num_samples=num_samples,
            dp_size=dp_size, micro_batch_size=micro_batch_size,
            rows_per_shard=rows_per_shard or default_rows_per_shard(seq_length, topk, max_rows),
            **metadata,
        )
        with _os_errors(self.path):
            self.root, stored = _open_or_create_root(self.path, meta)
            # the stored fields (equal to ours, and exactly what store_id digests), without its completion
            self.meta = dataclasses.replace(stored, complete=False)
            self._lock = _lock_partition(self.path, dp_rank)
            try:
                self._open_partition()
            except BaseException:
                self._unlock()
                raise
        self._buffers: dict[int, dict] = {}  # shard index -> {"ids", "logprobs", "filled"}
        self._flushing: set[int] = set()  # full shards handed out by ``buffer``, not yet written by ``flush``

    def _open_partition(self) -> None:
        if partition_attrs(self.path, self.meta, self.rank) is not None:
            self.group = open_partition(self.root, self.meta, self.rank, path=self.path)
        else:
            self.group = create_partition(self.root, self.meta, self.rank)
        if not self.group.attrs["complete"]:
            # a killed writer can leave temporary files behind (zarr's, the records'); under the lock
            # none is in flight
            for stale in (self.path / partition_name(self.rank)).rglob("*.partial"):
                stale.unlink(missing_ok=True)
        self.samples = self.meta.layout.samples_of(self.rank)
        self.specs = array_specs(self.meta.codec, self.meta.sampled_draws)
        # an all-padding chunk is written like any other: a strict reader never meets a missing one
        self.arrays = {name: self.group[name].with_config({"write_empty_chunks": True}) for name in ARRAYS}
        self.shard_rows = self.group["ids"].shards[0]
        self.bindings = PartitionBindings(self.path, self.meta.store_id, self.rank,
                                          {name: self.group[name] for name in ARRAYS})
        self.done = read_done(self.path, self.group, self.rank)
        unbound = self._unbound_shards()
        self.repairs = list(unbound.values())
        self.repaired_samples = self._unmark(sorted(unbound))

    def _unbound_shards(self) -> dict[int, str]:
        """Shards with rows marked done that are not on disk as their binding records say -> why."""
        out = {}
        for shard in range(self.bindings.num_shards):
            start, stop = self.bindings.shard_range(shard)
            done = self.done[start:stop]
            if not done.any():
                continue
            try:
                if done.all():  # a whole shard is never rewritten: its record and sizes suffice (stats)
                    self.bindings.check_sizes(shard)
                else:  # a partial one is rewritten on resume: the crash window between data and record
                    self.bindings.check_content(shard)
            except CacheError as e:
                out[shard] = str(e)
        return out

    def _unmark(self, shards: list[int]) -> np.ndarray:
        """Un-mark the rows of ``shards``; returns their global sample indices. Completion records go
        first (root, then partition), then each rows_done chunk, then what is left of the shard: a
        crash part-way leaves rows either marked and still checked on the next resume, or not marked."""
        if not shards:
            return np.zeros(0, np.int64)
        if read_root_meta(self.path).complete:
            self.root.attrs.update({ATTR_KEY: self.meta.to_attrs()})  # self.meta.complete is False
        if self.group.attrs["complete"]:
            self.group.attrs.update({"complete": False})
        rows = []
        for shard in shards:
            start, stop = self.bindings.shard_range(shard)
            block_file(self.path, self.group[DONE], shard).unlink(missing_ok=True)  # a missing chunk: not done
            rows.extend(np.flatnonzero(self.done[start:stop]) + start)
            self.done[start:stop] = False
            self.bindings.discard(shard)
        return self.samples[np.asarray(rows, np.int64)]

    def _unlock(self) -> None:
        if getattr(self, "_lock", None) is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def __del__(self):
        self._unlock()

    # ---------------------------------------------------------------- progress
    @property
    def num_rows(self) -> int:
        return len(self.samples)

    def pending_samples(self) -> np.ndarray:
        """Global indices of this partition's samples not yet on disk, in row order."""
        return self.samples[~self.done]

    def is_done(self, sample_idx: int) -> bool:
        return bool(self.done[self._row(sample_idx)])

    def _row(self, sample_idx: int) -> int:
        if not 0 <= sample_idx < self.meta.num_samples:
            raise CacheError(f"sample {sample_idx} is outside the cache's 0..{self.meta.num_samples - 1}")
        rank, row = self.meta.layout.locate(sample_idx)
        if rank != self.rank:
            raise CacheError(f"sample {sample_idx} belongs to data-parallel rank {int(rank)}'s partition, "
                             f"not rank {self.rank}'s")
        return int(row)

    # ---------------------------------------------------------------- writing
    def write(self, sample_idx, topk_ids, topk_logprobs, *, tokens) -> int:
        """Store samples: ``sample_idx`` an int with [seq_length, K] tensors and its [seq_length]
        ``tokens`` (the ids the teacher read), or n indices with [n, seq_length, K] and [n, seq_length].
        Samples already on disk are skipped. Returns how many were new."""
        return self.store(self.encode(sample_idx, topk_ids, topk_logprobs, tokens=tokens))

    def _check_open(self) -> None:
        if self._lock is None:
            raise CacheError(f"{self.path / partition_name(self.rank)}: this writer is closed; open a new one "
                             f"to resume")

    def encode(self, sample_idx, topk_ids, topk_logprobs, *, tokens) -> EncodedSamples:
        """The first half of ``write``: check the samples (shape, partition, entries), digest their
        tokens and encode them on the tensors' device, then copy to host. Touches no state:
        ``store`` may run on another thread (write_behind.py) while the next micro-batch is encoded."""
        return self.encode_async(sample_idx, topk_ids, topk_logprobs, tokens=tokens).result()

    def encode_async(self, sample_idx, topk_ids, topk_logprobs, *, tokens) -> "PendingSamples":
        """``encode`` without waiting for the tensors' device: the shapes and the partition are
        checked and the tokens digested now (pass them from the host: a device tensor is copied
        back), the entries checked by ``PendingSamples.result`` once their copy has reached the host."""
        self._check_open()
        indices = np.atleast_1d(np.asarray(sample_idx, dtype=np.int64))
        expect = (len(indices), self.meta.seq_length, self.meta.topk)
        if np.ndim(sample_idx) == 0:
            expect = expect[1:]
        if tuple(topk_ids.shape) != expect or tuple(topk_logprobs.shape) != expect:
            raise CacheError(f"sample {indices[0]}: topk_ids {tuple(topk_ids.shape)} / topk_logprobs "
                             f"{tuple(topk_logprobs.shape)} must be {expect} (seq_length={self.meta.seq_length}, "
                             f"K={self.meta.topk})")
        if tuple(tokens.shape) != expect[:-1]:
            raise CacheError(f"sample {indices[0]}: tokens {tuple(tokens.shape)} must be {expect[:-1]} (the ids the "
                             f"teacher read, seq_length={self.meta.seq_length})")
        rows = np.array([self._row(int(sample)) for sample in indices], np.int64)
        digests = token_entries(tokens.reshape(len(indices), self.meta.seq_length))
        pending = encode_rows(self.meta.codec, topk_ids, topk_logprobs, vocab_size=self.meta.vocab_size,
                              draws=self.meta.sampled_draws,
                              where=f"sample {indices[0]}{'..' if len(indices) > 1 else ''}: ")
        return PendingSamples(rows, (len(indices), self.meta.seq_length, self.meta.topk), pending, digests)

    def store(self, encoded: EncodedSamples) -> int:
        """The second half of ``write``: buffer encoded samples and write each shard they fill.
        Returns how many samples were new."""
        new, full = self.buffer(encoded)
        for shard in full:
            self.flush(shard)
        return new

    def buffer(self, encoded: EncodedSamples) -> tuple[int, list[int]]:
        """``store`` without the writing: place encoded samples in their shards' buffers. Returns how
        many samples were new and the shards they filled, each to be written by ``flush`` (on any
        thread, shards concurrently: write_behind.py); until then samples of those shards count as
        done here. Calls of ``buffer`` must not overlap each other."""
        with _os_errors(self.path / partition_name(self.rank)):
            return self._store(encoded)

    def flush(self, shard: int) -> None:
        """Write a shard that ``buffer`` filled: its data files, its binding record, then its rows_done."""
        try:
            with _os_errors(self.path / partition_name(self.rank)):
                self._flush(shard)
        finally:
            self._flushing.discard(shard)

    def _store(self, encoded: EncodedSamples) -> tuple[int, list[int]]:
        self._check_open()
        new, full = 0, []
        for i, row in enumerate(encoded.rows.tolist()):
            # a shard being flushed marks its rows done after its data: test it first
            if row // self.shard_rows in self._flushing or self.done[row]:
                continue
            shard = row // self.shard_rows
            buf = self._buffers.get(shard)
            if buf is None:
                buf = self._buffers[shard] = self._new_buffer(shard)
            local = row - shard * self.shard_rows
            buf["ids"][local], buf["logprobs"][local] = encoded.ids[i], encoded.values[i]
            buf["tokens"][local] = encoded.tokens[i]
            if not buf["filled"][local]:
                buf["filled"][local] = True
                new += 1
            if buf["filled"].all():
                self._flushing.add(shard)
                full.append(shard)
        return new, full

    def _shard_range(self, shard: int) -> tuple[int, int]:
        start = shard * self.shard_rows
        return start, min(start + self.shard_rows, self.num_rows)

    def _new_buffer(self, shard: int) -> dict:
        start, stop = self._shard_range(shard)
        shape = (stop - start, self.meta.seq_length, self.meta.topk)
        buf = {name: np.full(shape, spec.fill_value, spec.dtype) for name, spec in self.specs.items()}
        buf["filled"] = self.done[start:stop].copy()
        buf["tokens"] = [None] * (stop - start)
        if buf["filled"].any():  # rows written by an earlier, interrupted run: rewrite the shard whole
            for name in ARRAYS:
                buf[name][:] = read_rows(self.path, strict(self.arrays[name]), start, stop)
            buf["tokens"] = list(self.bindings.load(shard)["tokens"])
        return buf

    def _flush(self, shard: int) -> None:
        """Write a buffered shard (whole, or its filled rows when closing early), bind it, mark its rows."""
        buf = self._buffers.pop(shard)
        start, stop = self._shard_range(shard)
        if not self.done[start:stop].any():
            # whatever lies there (a crashed write's files or record) is not bound: start the shard afresh,
            # so zarr never reads it back while writing some rows
            self.bindings.discard(shard)
        if buf["filled"].all():
            # the arrays at once: each write spreads its chunks over zarr's codec threads, and a pass
            # compresses its last shard after its last forward (write_behind.py)
            with ThreadPoolExecutor(len(ARRAYS), thread_name_prefix="cache-array") as arrays:
                for written in [arrays.submit(self.arrays[name].__setitem__, slice(start, stop), buf[name])
                                for name in ARRAYS]:
                    written.result()
        else:
            for local in np.flatnonzero(buf["filled"] & ~self.done[start:stop]):
                for name in ARRAYS:
                    self.arrays[name][start + local] = buf[name][local]
        self.bindings.write(shard, buf["tokens"])  # the files as they are on disk now
        # rows_done after the data and its record: a row marked done is always on disk and bound
        self.done[start:stop] |= buf["filled"]
        self.group[DONE][start:stop] = self.done[start:stop].astype(np.uint8)

    def close(self) -> bool:
        """Write what is buffered; record completion if every sample of the partition is present
        (and the whole store's completion if every partition is); release the partition's lock.
        Returns partition completeness."""
        if self._lock is None:  # closed already
            return bool(self.done.all())
        try:
            with _os_errors(self.path / partition_name(self.rank)):
                for shard in sorted(self._buffers):
                    self._flush(shard)
                if not self.done.all():
                    return False
                if not self.group.attrs.get("complete"):
                    self.group.attrs.update({"complete": True})
                self._complete_store_if_last()
            return True
        finally:
            self._unlock()

    def _complete_store_if_last(self) -> None:
        # Each rank marks its own partition before looking at the others, so the last one to
        # finish sees every partition complete; concurrent finishers write identical bytes.
        for rank in range(self.meta.dp_size):
            if rank == self.rank:
                continue
            attrs = partition_attrs(self.path, self.meta, rank)
            if attrs is None or not attrs["complete"]:
                return
        if not read_root_meta(self.path).complete:
            self.meta.complete = True
            self.root.attrs.update({ATTR_KEY: self.meta.to_attrs()})

    def __enter__(self) -> "CacheWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # buffered rows are dropped, as in a crash; the next writer resumes
            self._unlock()
