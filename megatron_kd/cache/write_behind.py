"""``WriteBehind``: a teacher pass's writes to its cache, stored on a worker thread.

A teacher pass must cost what a logits forward costs, but storing a micro-batch is host work:
buffering rows, compressing a full shard (zstd, for topk-v2 about 0.1 M tokens per CPU-second)
and writing it. Done inline, the GPU idles for all of it. ``submit`` does the part that must see
the tensors (``CacheWriter.encode``: checks, the per-token sort and the codes on the tensors'
device, then one copy to host) on the caller's thread, so bad data still raises at the
micro-batch that holds it, and queues the rest (``CacheWriter.store``) for one worker thread;
the caller goes on to the next forward while the worker compresses (zstd and numpy release the
GIL). At most ``depth`` encoded micro-batches wait, so host memory stays bounded when the disk
is slower than the teacher.

Nothing changes in what is written or when it counts as done: the worker stores micro-batches
in submission order, and a sample is marked done only once its shard is on disk and bound
(writer.py). When the caller fails (an interrupt, an error in the next forward) the
micro-batches already queued are still stored, at most ``depth`` of them and their data checked
by ``encode``: what the store holds then depends on what was submitted, not on how far the
worker had got. Rows still buffered in a shard that is not full are lost, as in a crash, and
resuming recomputes them. An error on the worker (a full disk) is raised by the next ``submit``
or by ``drain``.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from megatron_kd.cache.writer import CacheWriter


class WriteBehind:
    def __init__(self, writer: CacheWriter, depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.writer, self.depth = writer, depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-store")
        self._queued: deque[Future] = deque()

    def submit(self, sample_idx, topk_ids, topk_logprobs) -> None:
        """Encode samples now (as ``CacheWriter.write`` takes them) and store them behind."""
        encoded = self.writer.encode(sample_idx, topk_ids, topk_logprobs)
        # collect finished stores (their errors surface here) and wait while the queue is full
        while self._queued and (self._queued[0].done() or len(self._queued) >= self.depth):
            self._queued.popleft().result()
        self._queued.append(self._pool.submit(self.writer.store, encoded))

    def drain(self) -> None:
        """Wait for every queued store; raise the first error of the worker."""
        try:
            while self._queued:
                self._queued.popleft().result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def abandon(self) -> None:
        """Finish the queued stores, keeping quiet about the worker's errors: the caller is failing,
        and its error, not the worker's, is the one to raise."""
        while self._queued:
            future = self._queued.popleft()
            if future.cancelled() or future.exception() is not None:
                break  # the writer failed (or drain gave up on it): the rest is not stored
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "WriteBehind":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.drain()
        else:
            self.abandon()
