"""WriteBehind: a teacher pass's stores on worker threads write exactly what inline writes do.

The store is byte-identical to ``CacheWriter.write``'s for any queue depth, micro-batch size,
number of workers and codec, whatever order the workers' shards finish in; a shard's rows are
marked done only once that shard is on disk and bound, and one that never finishes leaves its rows
pending for a resumed pass (same bytes again); bad entries, checked on a worker once their copy
reaches the host, are raised by the next ``submit`` or ``drain`` and nothing of their micro-batch
or after it is stored; an error on a worker (a shard's record that cannot be written) is raised by
``drain`` or the next ``submit`` as the writer's own one-line CacheWriteError, and leaves the store
resumable.
"""

from __future__ import annotations

import functools
import shutil
import threading

import numpy as np
import pytest
import torch

from megatron_kd.cache import CacheError, CacheWriteError, CacheWriter
from megatron_kd.cache.write_behind import MAX_DEFAULT_WORKERS, WriteBehind, default_workers
from tests.fixtures.cache_store import K, SEQ, VOCAB, _tree_bytes, sample_data, sample_tokens
from tests.fixtures.kd_inputs import sampled_rows

N, DP, MBS, ROWS = 17, 2, 2, 3
CODECS = ("topk-v2", "topk-v3", "sampled-counts-v1")


def _open(path, rank, codec=None) -> CacheWriter:
    meta = {"mode": "sampled", "sampled_draws": K} if codec == "sampled-counts-v1" else None
    return CacheWriter(path, vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=N, dp_rank=rank, dp_size=DP,
                       micro_batch_size=MBS, rows_per_shard=ROWS, codec=codec, metadata=meta)


@functools.cache
def _generated(sample: int, seed: int, sampled: bool):
    if sampled:  # K draws per token, as a sampled teacher pass hands them over
        return sampled_rows(SEQ, VOCAB, K, zipf=1.0, generator=torch.Generator().manual_seed(seed * 1_009 + sample))
    return sample_data(sample, seed)


def _rows(sample: int, seed: int, codec=None):
    """A sample's rows, generated once per module (the teacher-like softmax is most of a test's time)."""
    return tuple(t.clone() for t in _generated(sample, seed, codec == "sampled-counts-v1"))


def _micro_batches(writer: CacheWriter, mbs: int, seed: int = 0, codec=None):
    pending = writer.pending_samples()
    for i in range(0, len(pending), mbs):
        samples = pending[i:i + mbs]
        data = [_rows(int(s), seed, codec) for s in samples]
        ids, lps = torch.stack([d[0] for d in data]), torch.stack([d[1] for d in data])
        yield samples, ids, lps, sample_tokens(samples, seed)


def _submit(behind: WriteBehind, batch) -> None:
    samples, ids, lps, tokens = batch
    behind.submit(samples, ids, lps, tokens=tokens)


def _serial(path, codec=None, seed=0) -> dict:
    for rank in range(DP):
        with _open(path, rank, codec) as writer:
            for samples, ids, lps, tokens in _micro_batches(writer, MBS, seed, codec):
                writer.write(samples, ids, lps, tokens=tokens)
    return _tree_bytes(path)


@pytest.mark.parametrize("depth, mbs, workers", [(1, 1, 1), (2, 2, 1), (3, 3, 1), (1, 1, 3), (2, 3, 4)])
def test_same_bytes_as_inline_writes(tmp_path, depth, mbs, workers):
    reference = _serial(tmp_path / "inline")
    path = tmp_path / "behind"
    for rank in range(DP):
        writer = _open(path, rank)
        with WriteBehind(writer, depth=depth, workers=workers) as behind:
            for batch in _micro_batches(writer, mbs):
                _submit(behind, batch)
        assert writer.close()
    assert _tree_bytes(path) == reference


@pytest.mark.parametrize("codec", CODECS)
def test_parallel_stores_write_the_serial_bytes_of_each_codec(tmp_path, codec):
    reference = _serial(tmp_path / "serial", codec)
    path = tmp_path / "parallel"
    for rank in range(DP):
        writer = _open(path, rank, codec)
        with WriteBehind(writer, workers=3) as behind:
            for batch in _micro_batches(writer, 1, codec=codec):
                _submit(behind, batch)
        assert writer.close()
    assert _tree_bytes(path) == reference


def _hold_shard_until_next_is_bound(writer, monkeypatch, *, then=None):
    """Make shard 0's write wait until shard 1 is on disk and marked (so it finishes second), and
    record the partition's state at that moment; ``then`` (an exception) replaces shard 0's write."""
    flush, bound, seen = writer.flush, threading.Event(), {}

    def out_of_order(shard):
        if shard == 0:
            assert bound.wait(timeout=30), "shard 1 was never written"
            seen["done"] = writer.done.copy()
            seen["records"] = [writer.bindings.record_file(s).exists() for s in range(writer.bindings.num_shards)]
            if then is not None:
                raise then
        flush(shard)
        if shard == 1:
            bound.set()

    monkeypatch.setattr(writer, "flush", out_of_order)
    return seen


def test_shards_finishing_out_of_order_mark_only_their_own_rows(tmp_path, monkeypatch):
    reference = tmp_path / "serial"
    _serial(reference)
    path = tmp_path / "parallel"
    writer = _open(path, 0)
    seen = _hold_shard_until_next_is_bound(writer, monkeypatch)
    with WriteBehind(writer, workers=3) as behind:
        for batch in _micro_batches(writer, 1):
            _submit(behind, batch)
    assert writer.close()
    # while shard 0 was still being written, shard 1's rows were done and bound, shard 0's not
    assert seen["done"][:2 * ROWS].tolist() == [False] * ROWS + [True] * ROWS
    assert seen["records"][:2] == [False, True]
    assert _tree_bytes(path / "dp_00000") == _tree_bytes(reference / "dp_00000")


def test_an_interrupted_parallel_pass_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    """Shard 1 reaches the disk, shard 0 never does (the pass dies while writing it): shard 0's
    samples stay pending, and resuming with workers writes the serial store."""
    reference = _serial(tmp_path / "serial")
    path = tmp_path / "parallel"
    writer = _open(path, 0)
    _hold_shard_until_next_is_bound(writer, monkeypatch, then=RuntimeError("the pass died here"))
    with pytest.raises(RuntimeError, match="the pass died here"):
        with WriteBehind(writer, workers=3) as behind:
            for batch in _micro_batches(writer, 1):
                _submit(behind, batch)
            behind.drain()
    writer._unlock()
    again = _open(path, 0)
    pending = again.pending_samples()
    assert np.isin(again.samples[:ROWS], pending).all() and not np.isin(again.samples[ROWS:2 * ROWS], pending).any()
    with WriteBehind(again, workers=3) as behind:
        for batch in _micro_batches(again, 1):
            _submit(behind, batch)
    assert again.close()
    other = _open(path, 1)
    with WriteBehind(other, workers=2) as behind:
        for batch in _micro_batches(other, 2):
            _submit(behind, batch)
    assert other.close()
    assert _tree_bytes(path) == reference


def test_bad_entries_raise_by_a_later_submit_or_drain(tmp_path):
    """A micro-batch with a NaN log-prob: ``submit`` does not wait to read the device's checks, so a
    later ``submit`` (once a worker has checked it) or ``drain`` raises the writer's one-line
    CacheError naming its first sample; the micro-batch before it is stored, nothing of it or after
    it."""
    writer = _open(tmp_path / "c", 0)
    batches = list(_micro_batches(writer, 2))
    samples, ids, lps, tokens = batches[1]
    lps[1, 5, 0] = float("nan")
    with pytest.raises(CacheError, match="NaN") as info:
        with WriteBehind(writer) as behind:
            _submit(behind, batches[0])
            behind.submit(samples, ids, lps, tokens=tokens)
            _submit(behind, batches[2])
            behind.drain()
    assert "\n" not in str(info.value) and f"sample {samples[0]}" in str(info.value)
    writer.close()
    # the good micro-batch is in the writer's buffers (its shard not yet full): closing wrote it
    again = _open(tmp_path / "c", 0)
    assert not np.isin(batches[0][0], again.pending_samples()).any()
    assert np.isin(samples, again.pending_samples()).all()
    assert np.isin(batches[2][0], again.pending_samples()).all()
    again.close()


@pytest.mark.parametrize("workers", [1, 3])
def test_an_error_on_the_worker_is_raised_and_the_store_resumes(tmp_path, workers):
    path = tmp_path / "c"
    writer = _open(path, 1)
    bindings = path / "dp_00001" / "bindings"
    shutil.rmtree(bindings, ignore_errors=True)
    bindings.write_bytes(b"")  # where the first full shard's record goes: the worker's flush fails
    behind = WriteBehind(writer, depth=2, workers=workers)
    with pytest.raises(CacheWriteError) as info:
        for batch in _micro_batches(writer, 1):
            _submit(behind, batch)
        behind.drain()
    msg = str(info.value)
    assert "\n" not in msg and str(bindings) in msg and "cannot write" in msg, msg
    behind.abandon()
    writer._unlock()  # a failed pass: the process would exit here
    bindings.unlink()
    again = _open(path, 1)  # nothing of the failed shard counts as written
    assert again.pending_samples().tolist() == again.samples.tolist()
    with WriteBehind(again, workers=workers) as behind:
        for batch in _micro_batches(again, 1):
            _submit(behind, batch)
    assert again.close()


def test_the_callers_error_is_not_masked(tmp_path):
    writer = _open(tmp_path / "c", 0)
    with pytest.raises(RuntimeError, match="teacher failed"):
        with WriteBehind(writer) as behind:
            _submit(behind, next(_micro_batches(writer, 1)))
            raise RuntimeError("teacher failed")
    writer._unlock()


@pytest.mark.parametrize("workers", [1, 3])
def test_a_failing_caller_still_stores_what_it_queued(tmp_path, monkeypatch, workers):
    """What a failed pass leaves on disk is what it had submitted, however slow the workers: with
    buffering that takes 0.2 s the second micro-batch has not begun when the caller fails, and is
    stored all the same (its samples fill the partition's first shard, which is then bound)."""
    import time

    writer = _open(tmp_path / "c", 0)
    buffer = writer.buffer
    monkeypatch.setattr(writer, "buffer", lambda encoded: (time.sleep(0.2), buffer(encoded))[1])
    batches = list(_micro_batches(writer, 2))
    with pytest.raises(RuntimeError, match="teacher failed"):
        with WriteBehind(writer, depth=2, workers=workers) as behind:
            _submit(behind, batches[0])
            _submit(behind, batches[1])
            raise RuntimeError("teacher failed")
    writer._unlock()  # the failed pass's process would exit here, dropping the rows buffered
    again = _open(tmp_path / "c", 0)
    submitted = np.concatenate([batches[0][0], batches[1][0]])
    on_disk = np.setdiff1d(again.samples, again.pending_samples())
    assert on_disk.tolist() == submitted[:ROWS].tolist()  # the full shard; the fourth sample was buffered
    again.close()


def test_default_workers_share_the_node_between_its_ranks(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    assert [default_workers(ranks) for ranks in (1, 8, 32, 128)] == [MAX_DEFAULT_WORKERS, 8, 2, 1]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert default_workers() == 4
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(3)))  # bound to its own cores already
    assert default_workers() == 3
