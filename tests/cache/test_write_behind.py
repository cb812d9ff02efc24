"""WriteBehind: a teacher pass's stores on a worker thread write exactly what inline writes do.

The store is byte-identical to ``CacheWriter.write``'s for any queue depth and micro-batch size;
bad entries raise on the caller's thread at the micro-batch that holds them, before anything of it
is queued; an error on the worker (a shard's record that cannot be written) is raised by ``drain``
or the next ``submit`` as the writer's own one-line CacheWriteError, and leaves the store resumable.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from megatron_kd.cache import CacheError, CacheWriteError, CacheWriter
from megatron_kd.cache.write_behind import WriteBehind
from test_cache import K, SEQ, VOCAB, _tree_bytes, build, sample_data

N, DP, MBS, ROWS = 17, 2, 2, 3


def _open(path, rank) -> CacheWriter:
    return CacheWriter(path, vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=N, dp_rank=rank, dp_size=DP,
                       micro_batch_size=MBS, rows_per_shard=ROWS)


def _micro_batches(writer: CacheWriter, mbs: int, seed: int = 0):
    pending = writer.pending_samples()
    for i in range(0, len(pending), mbs):
        samples = pending[i:i + mbs]
        data = [sample_data(int(s), seed) for s in samples]
        yield samples, torch.stack([d[0] for d in data]), torch.stack([d[1] for d in data])


@pytest.mark.parametrize("depth, mbs", [(1, 1), (2, 2), (3, 3)])
def test_same_bytes_as_inline_writes(tmp_path, depth, mbs):
    build(tmp_path / "inline", num_samples=N, dp_size=DP, mbs=MBS, rows_per_shard=ROWS)
    path = tmp_path / "behind"
    for rank in range(DP):
        writer = _open(path, rank)
        with WriteBehind(writer, depth=depth) as behind:
            for samples, ids, lps in _micro_batches(writer, mbs):
                behind.submit(samples, ids, lps)
        assert writer.close()
    assert _tree_bytes(path) == _tree_bytes(tmp_path / "inline")


def test_bad_entries_raise_at_their_micro_batch(tmp_path):
    writer = _open(tmp_path / "c", 0)
    batches = list(_micro_batches(writer, 2))
    with WriteBehind(writer) as behind:
        behind.submit(*batches[0])
        samples, ids, lps = batches[1]
        lps[1, 5, 0] = float("nan")
        with pytest.raises(CacheError, match="NaN") as info:
            behind.submit(samples, ids, lps)
        assert "\n" not in str(info.value) and f"sample {samples[0]}" in str(info.value)
        assert len(behind._queued) <= 1  # only the good micro-batch was queued
    writer.close()
    # the good micro-batch is in the writer's buffers (its shard not yet full): closing wrote it
    again = _open(tmp_path / "c", 0)
    assert not np.isin(batches[0][0], again.pending_samples()).any()
    assert np.isin(samples, again.pending_samples()).all()
    again.close()


def test_an_error_on_the_worker_is_raised_and_the_store_resumes(tmp_path):
    path = tmp_path / "c"
    writer = _open(path, 1)
    bindings = path / "dp_00001" / "bindings"
    shutil.rmtree(bindings, ignore_errors=True)
    bindings.write_bytes(b"")  # where the first full shard's record goes: the worker's flush fails
    behind = WriteBehind(writer, depth=2)
    with pytest.raises(CacheWriteError) as info:
        for batch in _micro_batches(writer, 1):
            behind.submit(*batch)
        behind.drain()
    msg = str(info.value)
    assert "\n" not in msg and str(bindings) in msg and "cannot write" in msg, msg
    behind.abandon()
    writer._unlock()  # a failed pass: the process would exit here
    bindings.unlink()
    again = _open(path, 1)  # nothing of the failed shard counts as written
    assert again.pending_samples().tolist() == again.samples.tolist()
    with WriteBehind(again) as behind:
        for batch in _micro_batches(again, 1):
            behind.submit(*batch)
    assert again.close()


def test_the_callers_error_is_not_masked(tmp_path):
    writer = _open(tmp_path / "c", 0)
    with pytest.raises(RuntimeError, match="teacher failed"):
        with WriteBehind(writer) as behind:
            behind.submit(*next(_micro_batches(writer, 1)))
            raise RuntimeError("teacher failed")
    writer._unlock()


def test_a_failing_caller_still_stores_what_it_queued(tmp_path, monkeypatch):
    """What a failed pass leaves on disk is what it had submitted, however slow the worker: with a
    store that takes 0.2 s the second micro-batch has not begun when the caller fails, and is
    stored all the same (its samples fill the partition's first shard, which is then bound)."""
    import time

    writer = _open(tmp_path / "c", 0)
    store = writer.store
    monkeypatch.setattr(writer, "store", lambda encoded: (time.sleep(0.2), store(encoded))[1])
    batches = list(_micro_batches(writer, 2))
    with pytest.raises(RuntimeError, match="teacher failed"):
        with WriteBehind(writer, depth=2) as behind:
            behind.submit(*batches[0])
            behind.submit(*batches[1])
            raise RuntimeError("teacher failed")
    writer._unlock()  # the failed pass's process would exit here, dropping the rows buffered
    again = _open(tmp_path / "c", 0)
    submitted = np.concatenate([batches[0][0], batches[1][0]])
    on_disk = np.setdiff1d(again.samples, again.pending_samples())
    assert on_disk.tolist() == submitted[:ROWS].tolist()  # the full shard; the fourth sample was buffered
    again.close()
