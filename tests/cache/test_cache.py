"""Teacher cache: round trip, precision, concurrent ranks, kill-and-resume, re-partitioned reads, errors.

1. round trip of teacher-like data: ids exact, probabilities within the codec's bound (topk-v1/v2
   2^-9 relative, topk-v3 its levels' bound; codec_bounds.py), padding kept
2. two processes write their partitions concurrently
3. a build killed with SIGKILL mid-write, then resumed, is byte-identical to an uninterrupted one
4. written with dp_size 4, read with dp_size 2 and 1 (and prefetched in training order)
5. every bad input / store raises one CacheError naming the field or file; the CLI exits 2
6. integrity: a missing shard (or rows_done chunk) is an error on read, in verify / inspect and at
   training start-up; damage to any file the store writes is one CacheError naming it; verify and
   inspect reach the last block
7. one writer per partition (a killed writer leaves no stale lock); a crash just before or just after
   a shard's rows_done lands never leaves a row marked done without its data
8. the codec's precision holds down to the documented floor, and the partition map is the order
   megatron-core's sampler hands samples to each data-parallel rank
"""

import json
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import zarr

from megatron_kd.cache import CacheError, CacheReader, CacheWriter, PartitionLayout
from megatron_kd.cache.codec import LOGPROB_SCALE, MAX_CODE, decode_topk
from megatron_kd.cache.encodings import TOPK_V1, default_codec
from megatron_kd.cache.inspect import inspect, verify
from megatron_kd.cli import main as cli_main
from tests.fixtures.cache_store import (_DP, _MBS, _META, _N, _ROWS, K, SEQ, VOCAB, _cli_error, _raises_naming,
                                        _tree_bytes, _writer, build, sample_data, sample_tokens)
from tests.fixtures.codec_bounds import assert_within_codec
from tests.fixtures.kd_inputs import encode_topk_v1, teacher_topk

ROOT = Path(__file__).parents[2]  # the children's working directory: they import tests.fixtures.cache_store


def as_sets(ids, lps):
    """Per token {id: logprob} of the valid entries (entry order is not part of the contract)."""
    out = []
    for i_row, l_row in zip(ids.reshape(-1, ids.shape[-1]).tolist(), lps.reshape(-1, lps.shape[-1]).tolist()):
        out.append({i: l for i, l in zip(i_row, l_row) if i >= 0 and l > float("-inf")})
    return out


def assert_same_topk(got_ids, got_lps, ids, lps, codec=default_codec("topk")):
    """The same entries per token, log-probs within what ``codec`` keeps (the writer's default unless told)."""
    assert got_ids.dtype == torch.int32 and got_lps.dtype == torch.float32
    got_sets, want_sets = as_sets(got_ids, got_lps), as_sets(ids, lps)
    assert [g.keys() for g in got_sets] == [w.keys() for w in want_sets]
    pairs = [(g[i], lp) for g, w in zip(got_sets, want_sets) for i, lp in w.items()]
    assert_within_codec([g for g, _ in pairs], [w for _, w in pairs], codec)
    # padding comes back as id -1 with log-prob -inf, together
    assert torch.equal(got_ids < 0, torch.isinf(got_lps))


def test_codec_round_trip_and_precision(seed):
    ids, lps = teacher_topk(500, 201_088, 100, zipf=1.0)
    got_ids, got_lps = decode_topk(*encode_topk_v1(ids, lps, 201_088))
    assert_same_topk(got_ids, got_lps, ids, lps, TOPK_V1)
    # the fixed-point step keeps every probability >= 2^-30 within 2^-9 relative, with margin
    deep = torch.linspace(-30 * np.log(2), 0, 10_000).view(100, 100).float()
    deep_ids = torch.arange(10_000).view(100, 100)  # already sorted per token: entries keep their order
    _, back = decode_topk(*encode_topk_v1(deep_ids, deep, 20_000))
    assert (back.double() - deep.double()).abs().max() <= 0.5 / 257 + 1e-6


def test_round_trip(tmp_path, seed):
    build(tmp_path / "c", num_samples=8, teacher_fingerprint="t1", dataset_fingerprint="d1")
    reader = CacheReader(tmp_path / "c", expect={"vocab_size": VOCAB, "topk": K, "dataset_fingerprint": "d1"})
    ids, lps = reader.read(range(8))
    assert ids.shape == (8, SEQ, K)
    for s in range(8):
        assert_same_topk(ids[s], lps[s], *sample_data(s, 0))
    one_ids, _ = reader.read(5)
    assert torch.equal(one_ids[0], ids[5])
    summary = inspect(tmp_path / "c", progress=False)
    assert summary["complete"] and summary["tokens"] == 8 * SEQ and summary["teacher_fingerprint"] == "t1"
    assert 0.5 < summary["mean_teacher_mass"] <= 1.0 + 1e-3
    assert verify(tmp_path / "c", progress=False)["ok"]


def _write_rank(rank, path, num_samples):
    build(path, num_samples=num_samples, dp_size=2, mbs=2, ranks=[rank])


def test_two_processes_write_concurrently(tmp_path, seed):
    path = str(tmp_path / "c")
    mp.start_processes(_write_rank, args=(path, 13), nprocs=2, join=True, start_method="spawn")
    reader = CacheReader(path)
    assert reader.meta.complete and reader.meta.dp_size == 2
    ids, lps = reader.read(range(13))
    for s in range(13):
        assert_same_topk(ids[s], lps[s], *sample_data(s, 0))


_KILL_CHILD = textwrap.dedent("""
    import time
    from tests.fixtures.cache_store import build, sample_data, sample_tokens
    from megatron_kd.cache import CacheWriter
    with CacheWriter({path!r}, vocab_size={vocab}, topk={k}, seq_length={seq}, num_samples={n},
                     dp_size=2, dp_rank=1, micro_batch_size=2, rows_per_shard=3) as w:
        for s in w.pending_samples():
            w.write(int(s), *sample_data(int(s), 0), tokens=sample_tokens(int(s)))
            print("wrote", int(s), flush=True)
            time.sleep(0.05)
""")


def test_killed_build_resumes_byte_identical(tmp_path, seed):
    n = 23
    build(tmp_path / "ref", num_samples=n, dp_size=2, mbs=2)

    path = tmp_path / "killed"
    build(path, num_samples=n, dp_size=2, mbs=2, ranks=[0])
    script = _KILL_CHILD.format(path=str(path), vocab=VOCAB, k=K, seq=SEQ, n=n)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    written = 0
    for line in child.stdout:  # kill mid-shard, after at least one shard reached the disk
        written += line.startswith("wrote")
        if written == 5:
            child.send_signal(signal.SIGKILL)
            break
    child.wait()
    assert child.returncode == -signal.SIGKILL
    partial = CacheReader(path, allow_incomplete=True)
    assert not partial.meta.complete
    with pytest.raises(CacheError, match="incomplete"):
        CacheReader(path)

    build(path, num_samples=n, dp_size=2, mbs=2, ranks=[1])  # resume
    assert _tree_bytes(path) == _tree_bytes(tmp_path / "ref")


def test_resume_after_close_with_partial_shard(tmp_path, seed):
    """A writer closed early (not killed) keeps its partial shard; the resumed build still matches."""
    n = 10
    build(tmp_path / "ref", num_samples=n, rows_per_shard=4)
    path = tmp_path / "early"
    w = CacheWriter(path, vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=n, rows_per_shard=4)
    for s in range(6):
        w.write(s, *sample_data(s, 0), tokens=sample_tokens(s))
    assert w.close() is False
    w = CacheWriter(path, vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=n, rows_per_shard=4)
    assert w.pending_samples().tolist() == [6, 7, 8, 9]
    assert w.write(3, *sample_data(3, 0), tokens=sample_tokens(3)) == 0  # already on disk: skipped
    for s in w.pending_samples():
        w.write(int(s), *sample_data(int(s), 0), tokens=sample_tokens(int(s)))
    assert w.close() is True
    assert _tree_bytes(path) == _tree_bytes(tmp_path / "ref")


def test_repartitioned_read(tmp_path, seed):
    n = 29
    build(tmp_path / "c", num_samples=n, dp_size=4, mbs=2)
    expected = [sample_data(s, 0) for s in range(n)]
    for dp_size in (2, 1):
        reader = CacheReader(tmp_path / "c", dp_size=dp_size)
        assert not reader.same_layout_as_capture
        perm = np.random.permutation(n)
        ids, lps = reader.read(perm)  # random order: rows from every partition
        for j, s in enumerate(perm):
            assert_same_topk(ids[j], lps[j], *expected[s])
        for rank in range(dp_size):
            # the samples a training rank with this layout consumes, in order (mbs 2)
            samples = [s for s in range(n) if (s // 2) % dp_size == rank]
            got = list(reader.prefetch(samples, block=3))
            assert [s for s, _, _ in got] == samples
            for s, i, lp in got:
                assert_same_topk(i, lp, *expected[s])


def test_writer_rejects_bad_entries(tmp_path, seed):
    w = CacheWriter(tmp_path / "c", vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=4)
    ids, lps = sample_data(1, 0)
    tokens = sample_tokens(1)
    cases = []
    bad = ids.clone(); bad[3, 0] = VOCAB; cases.append(("id 3001", bad, lps, tokens))
    bad = ids.clone(); bad[3, 0] = -5; cases.append(("id -5", bad, lps, tokens))
    bad = ids.clone(); bad[3, 1] = bad[3, 0]; cases.append(("repeats an id", bad, lps, tokens))
    bad = lps.clone(); bad[4, 2] = float("nan"); cases.append(("NaN", ids, bad, tokens))
    bad = lps.clone(); bad[4, 2] = float("inf"); cases.append((r"\+inf", ids, bad, tokens))
    bad = lps.clone(); bad[4, 2] = 0.5; cases.append(("<= 0", ids, bad, tokens))
    cases.append(("must be", ids[:-1], lps[:-1], tokens))  # seq_length mismatch
    cases.append(("tokens .* must be", ids, lps, tokens[:-1]))  # tokens of another length
    for match, i, lp, tok in cases:
        with pytest.raises(CacheError, match=match):
            w.write(1, i, lp, tokens=tok)
    with pytest.raises(CacheError, match="outside"):
        w.write(4, ids, lps, tokens=tokens)
    w2 = CacheWriter(tmp_path / "d", vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=4, dp_size=2, dp_rank=0)
    with pytest.raises(CacheError, match="rank 1's partition"):
        w2.write(1, ids, lps, tokens=tokens)


@pytest.mark.parametrize("field, value", [("vocab_size", VOCAB + 1), ("topk", K + 1), ("seq_length", SEQ + 1),
                                          ("num_samples", 9), ("dataset_fingerprint", "other")])
def test_reopen_with_other_parameters_fails(tmp_path, seed, field, value):
    params = dict(vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=8)
    CacheWriter(tmp_path / "c", **params, metadata={"dataset_fingerprint": "d1"})
    meta = {"dataset_fingerprint": "d1"}
    if field in params:
        params[field] = value
    else:
        meta[field] = value
    with pytest.raises(CacheError, match=f"{field}="):
        CacheWriter(tmp_path / "c", **params, metadata=meta)


def test_reader_errors(tmp_path, seed):
    build(tmp_path / "c", num_samples=6, dataset_fingerprint="d1")
    with pytest.raises(CacheError, match="dataset_fingerprint is 'd1', expected 'd2'"):
        CacheReader(tmp_path / "c", expect={"dataset_fingerprint": "d2"})
    with pytest.raises(CacheError, match="vocab_size is 3001, expected 5000"):
        CacheReader(tmp_path / "c", expect={"vocab_size": 5000})
    with pytest.raises(CacheError, match="outside"):
        CacheReader(tmp_path / "c").read([6])

    # a sample that was never written (store opened for inspection while incomplete)
    w = CacheWriter(tmp_path / "p", vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=6, rows_per_shard=2)
    for s in (0, 1):
        w.write(s, *sample_data(s, 0), tokens=sample_tokens(s))
    with pytest.raises(CacheError, match="sample 4 .*never written"):
        CacheReader(tmp_path / "p", allow_incomplete=True).read([0, 1, 4])

    # newer schema
    root_json = tmp_path / "c" / "zarr.json"
    doc = json.loads(root_json.read_text())
    doc["attributes"]["megatron_kd"]["schema_version"] = 99
    root_json.write_text(json.dumps(doc))
    with pytest.raises(CacheError, match="newer megatron_kd"):
        CacheReader(tmp_path / "c")


def test_truncated_shard_and_wrong_layout(tmp_path, seed, capsys):
    build(tmp_path / "c", num_samples=6, rows_per_shard=3)
    shard = sorted((tmp_path / "c" / "dp_00000" / "ids").rglob("c/*/*/*"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheError, match="truncated"):
        CacheReader(tmp_path / "c").read([0])
    assert cli_main(["cache", "verify", str(tmp_path / "c")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]  # (tqdm also writes there)
    assert len(err) == 1 and err[0].startswith("megatron-kd: error:") and "dp_00000" in err[0]

    build(tmp_path / "d", num_samples=6)
    meta_json = tmp_path / "d" / "dp_00000" / "logprobs" / "zarr.json"
    doc = json.loads(meta_json.read_text())
    doc["shape"][2] = K + 1
    meta_json.write_text(json.dumps(doc))
    with pytest.raises(CacheError, match="wrong layout"):
        CacheReader(tmp_path / "d").read([0])


def test_cli_inspect_and_verify(tmp_path, seed, capsys):
    build(tmp_path / "c", num_samples=4, teacher_fingerprint="teacher-xyz")
    assert cli_main(["cache", "verify", str(tmp_path / "c")]) == 0
    assert cli_main(["cache", "inspect", str(tmp_path / "c"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.split("OK", 1)[-1].split("\n", 1)[-1])
    assert summary["samples"] == 4 and summary["topk"] == K and summary["teacher_fingerprint"] == "teacher-xyz"
    assert summary["bytes_per_token"] > 0
    assert cli_main(["cache", "verify", str(tmp_path / "missing")]) == 2


# ------------------------------------------------------------------------------------------------------
# Integrity: every file the store writes is checked, a missing shard is an error, one writer
# per partition, rows_done only after the shard data, and the promises the layout and codec make.


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "c"
    build(path, num_samples=_N, dp_size=_DP, mbs=_MBS, rows_per_shard=_ROWS, **_META)
    return path


@pytest.fixture
def store(template, tmp_path) -> Path:
    """A fresh copy of a complete two-partition store."""
    path = tmp_path / "c"
    shutil.copytree(template, path)
    return path


def _block_files(path: Path, rank: int, name: str) -> list[Path]:
    """The shard files of ``ids`` / ``logprobs`` (or the chunk files of ``rows_done``) of a partition, in row order."""
    base = path / f"dp_{rank:05d}" / name / "c"
    return sorted((p for p in base.rglob("*") if p.is_file()), key=lambda p: int(p.relative_to(base).parts[0]))


def _block_samples(rank: int, block: int) -> np.ndarray:
    return PartitionLayout(_N, _DP, _MBS).samples_of(rank)[block * _ROWS:(block + 1) * _ROWS]


def _read_all(path):
    return CacheReader(path).read(range(_N))


@pytest.mark.parametrize("array", ["ids", "logprobs", "rows_done"])
def test_missing_shard_file_is_an_error(store, seed, capsys, array):
    """A deleted shard read back as fill values (log-probs 0, ids 0) while verify said OK and inspect
    reported a teacher mass of 3.11: it must stop reads, verify and inspect, naming the file."""
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(_DP))
    files = _block_files(store, rank, array)
    block = int(rng.integers(len(files)))
    files[block].unlink()
    _raises_naming(files[block], CacheReader(store).read, _block_samples(rank, block))
    _raises_naming(files[block], verify, store, progress=False)
    _raises_naming(files[block], inspect, store, progress=False)
    assert str(files[block]) in _cli_error(["cache", "verify", str(store)], capsys)
    assert str(files[block]) in _cli_error(["cache", "inspect", str(store)], capsys)


def test_training_startup_checks_every_shard_it_will_read(store, seed, monkeypatch):
    """KDDataset stops at start-up on a missing shard of a sample the run consumes, naming the file,
    and does not care about shards past the samples the run consumes."""
    from types import SimpleNamespace

    import megatron_kd.megatron.kd_data as kd_data

    class Samples:  # the run's samples: the tokens the store's teacher read
        config = SimpleNamespace(sequence_length=SEQ)

        def __len__(self):
            return _N

        def __getitem__(self, j):
            return {"tokens": sample_tokens(j)}

    monkeypatch.setattr(kd_data, "tokenizer_fingerprint", lambda tok: _META["tokenizer_fingerprint"])
    base = Samples()
    tok = SimpleNamespace(vocab_size=VOCAB)
    rng = np.random.default_rng(seed)
    rank, name = int(rng.integers(_DP)), str(rng.choice(["ids", "logprobs"]))
    files = _block_files(store, rank, name)
    block = int(rng.integers(1, len(files)))  # not the first: some samples come before it
    files[block].unlink()
    _raises_naming(files[block], kd_data.KDDataset, base, str(store), tokenizer=tok, required_samples=_N)
    first = int(_block_samples(rank, block).min())  # a shorter run never reads that shard
    kd_data.KDDataset(base, str(store), tokenizer=tok, required_samples=first)


def _damage_json(how: str, rng, data: bytes) -> bytes:
    return {"random bytes": lambda: rng.bytes(len(data)), "[]": lambda: b"[]",
            "invalid JSON": lambda: data[:len(data) // 2]}[how]()


@pytest.mark.parametrize("kind, how", [
    *[(kind, how) for kind in ("root zarr.json", "partition zarr.json", "array zarr.json")
      for how in ("random bytes", "[]", "invalid JSON")],
    *[(kind, "flipped byte") for kind in ("rows_done", "ids", "logprobs")],
])
def test_corrupt_file_is_one_error_naming_it(store, seed, capsys, kind, how):
    """Every file the store writes is checksummed (shards, rows_done) or validated (zarr.json): damage
    gives one CacheError naming the file, from the reader, verify, inspect, the CLI and a resuming writer."""
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(_DP))
    part = store / f"dp_{rank:05d}"
    if kind == "root zarr.json":
        file = store / "zarr.json"
    elif kind == "partition zarr.json":
        file = part / "zarr.json"
    elif kind == "array zarr.json":
        file = part / str(rng.choice(["ids", "logprobs", "rows_done"])) / "zarr.json"
    else:
        files = _block_files(store, rank, kind)
        file = files[int(rng.integers(len(files)))]
    data = bytearray(file.read_bytes())
    if how == "flipped byte":
        data[int(rng.integers(len(data)))] ^= int(rng.integers(1, 256))
    else:
        data = _damage_json(how, rng, bytes(data))
    file.write_bytes(bytes(data))

    _raises_naming(file, _read_all, store)
    _raises_naming(file, verify, store, progress=False)
    _raises_naming(file, inspect, store, progress=False)
    assert str(file) in _cli_error(["cache", "verify", str(store)], capsys)
    assert str(file) in _cli_error(["cache", "inspect", str(store)], capsys)
    if kind not in ("ids", "logprobs"):  # a writer reopening the partition reads everything else
        _raises_naming(file, _writer, store, rank)


def test_verify_and_inspect_reach_the_last_block(store, seed):
    """Damage the last block of the last partition (a scan that stops one block early misses it)."""
    rng = np.random.default_rng(seed)
    file = _block_files(store, _DP - 1, str(rng.choice(["ids", "logprobs"])))[-1]
    data = bytearray(file.read_bytes())
    data[int(rng.integers(len(data)))] ^= int(rng.integers(1, 256))
    file.write_bytes(bytes(data))
    _raises_naming(file, verify, store, progress=False)
    _raises_naming(file, inspect, store, progress=False)


_LOCK_CHILD = textwrap.dedent("""
    import time
    from tests.fixtures.cache_store import _writer
    w = _writer({path!r}, 1)
    print("locked", flush=True)
    time.sleep(120)
""")


def test_one_writer_per_partition(tmp_path, seed):
    """A second writer on a partition is refused while the first holds it (in this process or
    another); other partitions stay free, and a killed writer leaves no stale lock."""
    path = tmp_path / "c"
    first = _writer(path, 0)
    with pytest.raises(CacheError, match=f"another writer holds partition 0 of {re.escape(str(path))}"):
        _writer(path, 0)
    child = subprocess.Popen([sys.executable, "-c", _LOCK_CHILD.format(path=str(path))], stdout=subprocess.PIPE,
                             text=True, cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(CacheError, match="another writer holds partition 1"):
            _writer(path, 1)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    for s in first.pending_samples():
        first.write(int(s), *sample_data(int(s), 0), tokens=sample_tokens(int(s)))
    first.close()
    with _writer(path, 1) as w:  # the killed child's lock went with it
        for s in w.pending_samples():
            w.write(int(s), *sample_data(int(s), 0), tokens=sample_tokens(int(s)))
    with _writer(path, 0) as again:  # closed writers release their lock
        assert len(again.pending_samples()) == 0
    assert verify(path, progress=False)["ok"]


_CRASH_CHILD = textwrap.dedent("""
    import os, signal
    import zarr.storage._local as local
    from tests.fixtures.cache_store import _writer, sample_data, sample_tokens

    # zarr writes each file under a temporary name, then renames it into place: crash just before
    # or just after the rename of the target (the rows_done chunk of one shard)
    rename = local._move_with_retry

    def crash_at_target(tmp, path, *args):
        at_target = str(path).endswith({target!r})
        if at_target and {when!r} == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        rename(tmp, path, *args)
        if at_target and {when!r} == "after":
            os.kill(os.getpid(), signal.SIGKILL)

    local._move_with_retry = crash_at_target
    with _writer({path!r}, 1) as w:
        for s in w.pending_samples():
            w.write(int(s), *sample_data(int(s), 0), tokens=sample_tokens(int(s)))
""")


@pytest.mark.parametrize("when", ["before", "after"])
def test_crash_around_rows_done_write(template, tmp_path, seed, when):
    """The writer's crash-ordering promise: a row is marked in rows_done only once its shard data is
    on disk. Kill the writer at the exact dangerous point, just before or just after the rows_done
    chunk of a shard lands: every row marked done must read back correctly, and the resumed build
    must be byte-identical to an uninterrupted one."""
    path = tmp_path / "crashed"
    build(path, num_samples=_N, dp_size=_DP, mbs=_MBS, ranks=[0], **_META)
    shard = 1
    target = f"dp_00001/rows_done/c/{shard}"
    script = _CRASH_CHILD.format(path=str(path), target=target, when=when)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert child.returncode == -signal.SIGKILL, child.stderr
    part = path / "dp_00001"
    data_files = [part / name / "c" / str(shard) / "0" / "0" for name in ("ids", "logprobs")]
    if when == "before":  # the shard's data is on disk, its rows are not marked done
        assert all(f.is_file() for f in data_files) and not (path / target).exists()
    done = zarr.open_array(str(part / "rows_done"), mode="r")[:].astype(bool)
    assert done[:shard * _ROWS].all() and done[shard * _ROWS:].all() == (when == "after")
    # the promise itself: every row marked done is on disk, intact
    samples = PartitionLayout(_N, _DP, _MBS).samples_of(1)[done]
    ids, lps = CacheReader(path, allow_incomplete=True).read(samples)
    for j, s in enumerate(samples):
        assert_same_topk(ids[j], lps[j], *sample_data(int(s), 0))

    build(path, num_samples=_N, dp_size=_DP, mbs=_MBS, ranks=[1], **_META)  # resume
    assert _tree_bytes(path) == _tree_bytes(template)
    assert verify(path, progress=False)["ok"]


def test_codec_precision_down_to_the_documented_floor(seed):
    """Log-probs are stored within 1/514 nat (every p within 2^-9 relative) down to -255, not only at
    the depths teacher data usually reaches; anything deeper is stored as the floor, not as padding."""
    rng = np.random.default_rng(seed)
    limit = -(MAX_CODE + 0.5) / LOGPROB_SCALE  # ~ -254.998: the deepest value rounding to a code
    deep = np.concatenate([[-254.9, -254.99, -254.995, limit + 1e-4, -200.0, -128.0, -32.5, -32.0, -16.0, 0.0],
                           rng.uniform(limit + 1e-4, 0, 100 * 100 - 10)]).astype(np.float32)
    lps = torch.from_numpy(deep).view(100, 100)
    ids = torch.arange(100 * 100).view(100, 100)  # sorted per token: entries keep their order
    deltas, codes = encode_topk_v1(ids, lps, 20_000)
    stored = -codes.astype(np.float64) / LOGPROB_SCALE
    assert np.abs(stored - lps.double().numpy()).max() <= 0.5 / LOGPROB_SCALE + 1e-9
    assert np.expm1(np.abs(stored - lps.double().numpy())).max() < 2**-9
    back_ids, back = decode_topk(deltas, codes)
    assert torch.equal(back_ids, ids.int())
    # float32 decoding adds one rounding of a value of magnitude < 256 (ulp 2^-16)
    assert (back.double() - lps.double()).abs().max() <= 0.5 / LOGPROB_SCALE + 2**-16

    below = torch.tensor([[-255.0, -255.5, -300.0, -1e4, -3e38, float("-inf")]])
    below_ids, below_back = decode_topk(*encode_topk_v1(torch.arange(6).view(1, 6), below, 10))
    floor = np.float32(-MAX_CODE / LOGPROB_SCALE)
    assert below_back[0, :5].tolist() == [floor] * 5 and below_ids[0, :5].tolist() == [0, 1, 2, 3, 4]
    assert below_ids[0, 5] == -1 and below_back[0, 5] == float("-inf")  # -inf stays padding


@pytest.mark.filterwarnings("ignore::UserWarning")  # importing megatron.training: optional packages absent
@pytest.mark.parametrize("drop_last", [True, False])
def test_partition_map_is_megatron_sampler_order(tmp_path, seed, drop_last):
    """Partition r lists, front to back, exactly the samples megatron-core's pretraining sampler hands
    data-parallel rank r, and a writer fed in that order appends rows sequentially."""
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    rng = np.random.default_rng(seed)
    for _ in range(20):
        dp, mbs = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        n = int(rng.integers(1, 6 * dp * mbs))
        layout = PartitionLayout(n, dp, mbs)
        for rank in range(dp):
            order = [s for batch in MegatronPretrainingSampler(n, 0, mbs, rank, dp, drop_last=drop_last)
                     for s in batch]
            rows = layout.samples_of(rank)
            assert order == rows[:len(order)].tolist(), (n, dp, mbs, rank)
            if not drop_last:
                assert len(order) == len(rows)
            got_rank, got_row = layout.locate(order)
            assert (got_rank == rank).all() and got_row.tolist() == list(range(len(order)))

    n, dp, mbs, shard_rows = 22, 3, 2, 3
    for rank in range(dp):
        w = CacheWriter(tmp_path / "c", vocab_size=50, topk=2, seq_length=4, num_samples=n, dp_rank=rank, dp_size=dp,
                        micro_batch_size=mbs, rows_per_shard=shard_rows)
        order = [s for batch in MegatronPretrainingSampler(n, 0, mbs, rank, dp, drop_last=False) for s in batch]
        assert w.pending_samples().tolist() == order
        for i, s in enumerate(order):
            w.write(s, torch.tensor([[s % 49, 49]] * 4), torch.full((4, 2), -1.0),
                    tokens=sample_tokens(s, seq=4, vocab=50))
            # each shard reaches the disk as soon as its last row arrives: rows are appended in order
            flushed = len(order) if i + 1 == len(order) else (i + 1) // shard_rows * shard_rows
            assert w.pending_samples().tolist() == order[flushed:]
        assert w.close()
    ids, _ = CacheReader(tmp_path / "c").read(range(n))
    assert ids[:, 0, 0].tolist() == [s % 49 for s in range(n)]
