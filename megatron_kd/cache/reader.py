"""``CacheReader``: teacher top-K tensors for any sample, ready for the loss.

The reader maps a global sample index to (partition, row) with the capture's layout, so any
data-parallel size reads correctly; with the capture's dp_size and micro_batch_size a rank's
samples are its own partition's rows in order, and ``prefetch`` streams them from consecutive
shards on a background thread. A shard file that is missing, fails its checksum or does not match
its binding record (binding.py: moved, swapped, copied from another cache) is a CacheError naming
it, never another sample's rows or fill values. The first read of a shard file in a process hashes
it whole (CRC32C, several GB/s, and the file is then in the page cache for zarr); later reads of an
unchanged file cost one stat. ``check_files`` is the cheap start-up form of the check (stats only).
Each sample's binding record also holds the digests of the tokens its teacher read (tokens.py):
``token_entries`` gives them, ``content_index`` finds samples by them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zarr

from megatron_kd.cache.binding import PartitionBindings
from megatron_kd.cache.codec import CacheError
from megatron_kd.cache.encodings import RowDecoder
from megatron_kd.cache.meta import CacheMeta, check_expected
from megatron_kd.cache.store import (ARRAYS, open_partition, open_root, partition_attrs, partition_name, read_done,
                                     read_root_meta, read_rows, strict)


@dataclass
class _Partition:
    ids: zarr.Array  # strict: a missing shard file is an error, not fill values
    logprobs: zarr.Array
    done: np.ndarray  # bool [rows]
    bindings: PartitionBindings


class CacheReader:
    """Reads a complete teacher cache.

    ``dp_rank`` / ``dp_size`` describe the reading job; they only matter for speed (same layout
    as the capture: sequential reads of one partition). ``expect`` maps cache fields
    (vocab_size, topk, seq_length, dataset_fingerprint, ...) to the values the job needs; any
    difference raises CacheError naming the field. ``allow_incomplete`` opens a store whose build
    has not finished (for inspection); reading a sample that is not written yet then raises.
    """

    def __init__(self, path, *, dp_rank: int = 0, dp_size: int = 1, expect: dict | None = None,
                 ids_dtype: torch.dtype = torch.int32, allow_incomplete: bool = False):
        self.path = Path(path)
        self.meta: CacheMeta = read_root_meta(self.path)
        if not self.meta.complete and not allow_incomplete:
            raise CacheError(f"{self.path}: incomplete cache ({self._incomplete_partitions()}); finish the "
                             f"build (re-run it to resume) before training on it")
        check_expected(self.meta, expect or {}, path=str(self.path))
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.ids_dtype = ids_dtype
        self._decode = RowDecoder(self.meta.codec, self.meta.sampled_draws, ids_dtype)
        self._root = open_root(self.path)
        self._partitions: dict[int, _Partition] = {}
        self._last_chunk = None  # ((rank, first row), (id gaps, codes)) of the last small read
        self._lock = threading.Lock()

    @property
    def same_layout_as_capture(self) -> bool:
        return self.dp_size == self.meta.dp_size

    def _incomplete_partitions(self) -> str:
        root, missing = open_root(self.path), []
        for rank in range(self.meta.dp_size):
            name = partition_name(rank)
            attrs = partition_attrs(self.path, self.meta, rank)
            if attrs is None:
                missing.append(f"{name} missing")
            elif not attrs["complete"]:
                done = read_done(self.path, open_partition(root, self.meta, rank, path=self.path), rank)
                missing.append(f"{name} has {int(done.sum())}/{self.meta.layout.rows_of(rank)} samples")
        return ", ".join(missing) or "completion record missing"

    def _partition(self, rank: int) -> _Partition:
        """A partition's arrays, rows_done and binding records, its metadata checked."""
        with self._lock:
            if rank not in self._partitions:
                group = open_partition(self._root, self.meta, rank, path=self.path)
                done = read_done(self.path, group, rank)
                arrays = {name: strict(group[name]) for name in ARRAYS}
                self._partitions[rank] = _Partition(arrays["ids"], arrays["logprobs"], done,
                                                    PartitionBindings(self.path, self.meta.store_id, rank, arrays))
            return self._partitions[rank]

    def _in_range(self, samples) -> np.ndarray:
        """Global sample indices as int64 [n]; CacheError for one outside the cache."""
        samples = np.atleast_1d(np.asarray(samples, dtype=np.int64))
        bad = samples[(samples < 0) | (samples >= self.meta.num_samples)]
        if len(bad):
            raise CacheError(f"{self.path}: sample {int(bad[0])} is outside the cache's 0..{self.meta.num_samples - 1}")
        return samples

    def _require_written(self, rank: int, rows: np.ndarray, samples: np.ndarray) -> None:
        done = self._partition(rank).done
        if not done[rows].all():
            missing = int(np.flatnonzero(~done[rows])[0])
            raise CacheError(f"{self.path / partition_name(rank)}: sample {int(samples[missing])} "
                             f"(row {int(rows[missing])}) was never written")

    def check_files(self, samples: Iterable[int] | None = None) -> int:
        """Start-up check, cheap (metadata, rows_done, binding records, one stat per shard file;
        nothing decoded or hashed): every partition that reading ``samples`` (default: all) touches
        opens and lists those rows as written, each shard holding them has its binding record naming
        this store, partition and shard, and each of its files is there with the recorded size.
        CacheError naming the first file that is not; returns how many shard files were checked."""
        if samples is None:
            samples = range(self.meta.num_samples)
        samples = self._in_range(samples if isinstance(samples, (range, np.ndarray)) else list(samples))
        ranks, rows = self.meta.layout.locate(samples)
        order = np.argsort(ranks, kind="stable")
        ranks, rows, samples = ranks[order], rows[order], samples[order]
        bounds = np.flatnonzero(np.diff(ranks)) + 1
        checked = 0
        for a, b in zip([0, *bounds], [*bounds, len(ranks)]):
            if a == b:
                continue
            rank = int(ranks[a])
            self._require_written(rank, rows[a:b], samples[a:b])
            bindings = self._partition(rank).bindings
            for shard in np.unique(rows[a:b] // bindings.shard_rows):
                bindings.check_sizes(int(shard))
                checked += len(ARRAYS)
        return checked

    def token_entries(self, samples) -> list:
        """The [digest, blocks] of the tokens each sample's teacher read (tokens.py), from the binding
        records (each loaded once, and already by ``check_files``); None for a sample not written."""
        samples = self._in_range(samples)
        ranks, rows = self.meta.layout.locate(samples)
        out = []
        for rank, row in zip(ranks.tolist(), rows.tolist()):
            part = self._partition(rank)
            shard_rows = part.bindings.shard_rows
            out.append(part.bindings.tokens(row // shard_rows)[row % shard_rows] if part.done[row] else None)
        return out

    def content_index(self) -> dict[str, int]:
        """Token digest -> the first written sample whose teacher read those tokens: how a run finds
        the rows of its samples by their content (every binding record is loaded once)."""
        index: dict[str, int] = {}
        for rank in range(self.meta.dp_size):
            part = self._partition(rank)
            samples = self.meta.layout.samples_of(rank)
            for shard in range(part.bindings.num_shards):
                start, stop = part.bindings.shard_range(shard)
                if not part.done[start:stop].any():
                    continue
                for row, entry in enumerate(part.bindings.tokens(shard), start):
                    if entry is not None and part.done[row]:
                        sample = int(samples[row])
                        if index.setdefault(entry[0], sample) > sample:
                            index[entry[0]] = sample
        return index

    def read(self, sample_idx) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [n, seq_length, K] (-1 = padding) and float32 log-probs (-inf = padding) for the
        given global sample index (n = 1) or indices (n = len)."""
        samples = self._in_range(sample_idx)
        ranks, rows = self.meta.layout.locate(samples)
        # runs of consecutive rows of one partition: one zarr read each
        breaks = np.flatnonzero((np.diff(ranks) != 0) | (np.diff(rows) != 1)) + 1
        runs = [self._read_rows(int(ranks[a]), int(rows[a]), int(rows[b - 1]) + 1, samples[a:b])
                for a, b in zip([0, *breaks], [*breaks, len(samples)])]
        if len(runs) == 1:
            return self._decode(*runs[0])
        return self._decode(np.concatenate([r[0] for r in runs]), np.concatenate([r[1] for r in runs]))

    def _read_rows(self, rank: int, r0: int, r1: int, samples: np.ndarray):
        part = self._partition(rank)
        self._require_written(rank, np.arange(r0, r1), samples)
        chunk = part.ids.chunks[0]
        if r1 - r0 < chunk:
            # Small reads (a DataLoader asking sample by sample) decode the whole chunk anyway: keep
            # the last chunk decoded so its neighbours come from memory.
            c0 = r0 // chunk * chunk
            if r1 <= c0 + chunk:
                key = (rank, c0)
                if self._last_chunk is None or self._last_chunk[0] != key:
                    self._last_chunk = (key, self._zarr_rows(part, c0, min(c0 + chunk, len(part.done))))
                ids, lps = self._last_chunk[1]
                return ids[r0 - c0:r1 - c0], lps[r0 - c0:r1 - c0]
        return self._zarr_rows(part, r0, r1)

    def _zarr_rows(self, part: _Partition, r0: int, r1: int):
        # each shard file bound to its place before zarr opens it (a stat once it has been hashed),
        # then a missing, truncated or corrupted one is a CacheError naming it
        for shard in range(r0 // part.bindings.shard_rows, (r1 - 1) // part.bindings.shard_rows + 1):
            part.bindings.check_content(shard)
        return read_rows(self.path, part.ids, r0, r1), read_rows(self.path, part.logprobs, r0, r1)

    def prefetch(self, samples: Iterable[int], *, block: int | None = None, depth: int = 4) -> Iterator:
        """Yield (sample_idx, ids [seq, K], logprobs [seq, K]) for ``samples`` in order, decoding
        ``block`` samples at a time on a background thread, at most ``depth`` blocks ahead."""
        samples = np.asarray(list(samples), dtype=np.int64)
        block = block or max(1, self.meta.rows_per_shard)
        q: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()

        def produce():
            try:
                for i in range(0, len(samples), block):
                    if stop.is_set():
                        return
                    chunk = samples[i:i + block]
                    q.put((chunk, *self.read(chunk)))
                q.put(None)
            except BaseException as e:  # surfaced in the consumer
                q.put(e)

        thread = threading.Thread(target=produce, name="kd-cache-prefetch", daemon=True)
        thread.start()
        try:
            while (item := q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                chunk, ids, lps = item
                for j, s in enumerate(chunk):
                    yield int(s), ids[j], lps[j]
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    q.get_nowait()
                except queue.Empty:
                    thread.join(timeout=0.05)
