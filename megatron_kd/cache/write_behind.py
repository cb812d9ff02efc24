"""``WriteBehind``: a teacher pass's writes to its cache, stored by a pool of worker threads.

A teacher pass must cost what a logits forward costs, but storing a micro-batch is host work:
buffering rows, compressing a full shard (zstd, for topk-v2 about 0.1 M tokens per CPU-second)
and writing it. Done inline, the GPU idles for all of it. ``submit`` does the part that must see
the tensors on the caller's thread (``CacheWriter.encode_async``: the shapes checked, the per-token
sort, the codes and the entries' checks launched on the tensors' device, and their copy to pinned
host memory queued behind them) and never waits for the device: the caller goes on to launch the
next forward while the GPU still runs this one, so the GPU's queue never drains between
micro-batches. A worker waits for the copy, checks the entries and stores them. Bad entries (NaN
log-probs, ids out of range) are therefore raised by a later ``submit`` or by ``drain``, naming
the micro-batch's first sample; nothing of that micro-batch or after it is stored.

Each queued micro-batch is one task: it places its rows in their shards' buffers
(``CacheWriter.buffer``), in submission order (a task waits for its turn; tasks start in that
order, so the turn's holder is always running), then writes the shards it filled
(``CacheWriter.flush``) while later tasks buffer and write theirs: shards are independent files,
so ``workers`` shards compress at once. Compression holds no lock a worker needs: zstd, numpy and
zarr's codec threads (which already spread one shard's chunks over cores) release the GIL
(benchmarks/bench_teacher_topk.py --store-rate measures tokens/s against workers). At most
``depth + workers - 1`` encoded micro-batches wait or run, and ``workers`` full shards are being
written, so host memory stays bounded when the disk is slower than the teacher.

Nothing changes in what is written or when it counts as done: a shard's bytes depend on its rows
alone, whichever worker writes it and whenever, and a sample is marked done only once its shard
is on disk and bound (writer.py); shards finish out of order, each marking its own rows. When the
caller fails (an interrupt, an error in the next forward) the micro-batches already queued are
still stored, their data checked by ``encode``: what the store holds then depends on what was
submitted, not on how far the workers had got. Rows still buffered in a shard that is not full
are lost, as in a crash, and resuming recomputes them. An error on a worker (a full disk) is
raised by the next ``submit`` or by ``drain``; micro-batches whose turn comes after it are not
stored.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from megatron_kd.cache.writer import CacheWriter, EncodedSamples, PendingSamples

# More shards in flight than this buys nothing measurable (each write already spreads its chunks
# over zarr's codec threads) and costs a shard buffer (up to 64 MiB) each.
MAX_DEFAULT_WORKERS = 8


def default_workers(local_ranks: int | None = None) -> int:
    """Store workers for one rank: the CPU cores it may run on, shared with the other ranks of its
    node (``LOCAL_WORLD_SIZE``, torchrun's) unless its affinity is already its own share, at most
    MAX_DEFAULT_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if cores >= (os.cpu_count() or cores):  # the whole node: this rank's share of it
        cores //= max(local_ranks, 1)
    return max(1, min(MAX_DEFAULT_WORKERS, cores))


class WriteBehind:
    def __init__(self, writer: CacheWriter, depth: int = 2, workers: int = 1):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.writer, self.depth, self.workers = writer, depth, workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cache-store")
        self._queued: deque[Future] = deque()
        self._turn = threading.Condition()
        self._submitted = 0  # tickets handed out: micro-batch i buffers when _buffered == i
        self._buffered = 0
        self._failed = False  # a task raised: the ones after it store nothing

    def submit(self, sample_idx, topk_ids, topk_logprobs, *, tokens) -> None:
        """Encode samples on their device now (as ``CacheWriter.write`` takes them) and store them
        behind: a worker waits for their copy to the host and checks their entries."""
        self.submit_encoded(self.writer.encode_async(sample_idx, topk_ids, topk_logprobs, tokens=tokens))

    def submit_encoded(self, encoded: EncodedSamples | PendingSamples) -> None:
        """Store samples that ``CacheWriter.encode`` (or ``encode_async``) encoded behind; waits
        while the queue is full."""
        self._collect()  # finished stores leave the queue; the first error among them is raised here
        while len(self._queued) >= self.depth + self.workers - 1:
            wait(self._queued, return_when=FIRST_COMPLETED)
            self._collect()
        self._queued.append(self._pool.submit(self._store, self._submitted, encoded))
        self._submitted += 1

    def _collect(self) -> None:
        done = [f for f in self._queued if f.done()]
        for future in done:
            self._queued.remove(future)
        for future in done:
            future.result()

    def _store(self, ticket: int, encoded: EncodedSamples | PendingSamples) -> None:
        with self._turn:
            self._turn.wait_for(lambda: self._buffered == ticket)
        try:
            if self._failed:
                return
            if isinstance(encoded, PendingSamples):  # the device's copy, then the entries' checks
                encoded = encoded.result()
            _, full = self.writer.buffer(encoded)
        except BaseException:
            self._failed = True
            raise
        finally:
            with self._turn:
                self._buffered += 1
                self._turn.notify_all()
        try:
            for shard in full:
                self.writer.flush(shard)
        except BaseException:
            self._failed = True
            raise

    def drain(self) -> None:
        """Wait for every queued store; raise the first error of the workers (in submission order)."""
        try:
            wait(self._queued)
            while self._queued:
                self._queued.popleft().result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def abandon(self) -> None:
        """Finish the queued stores, keeping quiet about the workers' errors: the caller is failing,
        and its error, not theirs, is the one to raise."""
        self._pool.shutdown(wait=True)
        self._queued.clear()

    def __enter__(self) -> "WriteBehind":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.drain()
        else:
            self.abandon()
