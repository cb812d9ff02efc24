"""Teacher cache: every shard bound to its store and its place; only regular files read; writer errors.

1. a shard file swapped within a partition or between partitions (of equal sizes too), copied from
   another build of the same shape or from another teacher's cache, or copied together with its binding record: verify,
   the reader (read and prefetch), CacheReader.check_files and the CLI refuse, naming the file
2. the store_id digest: deterministic, another teacher gives another, a changed field is caught; a
   schema_version 1 store, or a schema_version 2 one (no token digests), is refused with a line
   saying to rebuild it
3. rows_done ahead of the data (a shard deleted from a complete or an incomplete partition, a crash
   between a shard's data and its record): a resumed build rewrites those rows and ends byte-identical
4. a FIFO or a /dev/zero link in place of a shard or a zarr.json: inspect and verify refuse at once
5. a writer that cannot write (read-only store, a file where a folder belongs): one CacheError line
"""

import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from megatron_kd.cache import CacheError, CacheReader, CacheWriteError, PartitionLayout
from megatron_kd.cache.inspect import inspect, verify
from tests.fixtures.cache_store import (_cli_error, _raises_naming, _tree_bytes, _writer, build, sample_data,
                                        sample_tokens)

# as test_cache's integrity tests: 13 samples, dp 2, mbs 2, 3 rows per shard (partition 0: shards of
# 3, 3, 1 rows; partition 1: 3, 3)
_META = {"tokenizer_fingerprint": "tok-fp", "dataset_fingerprint": "data-fp"}
_N, _DP, _MBS, _ROWS = 13, 2, 2, 3
_LAYOUT = PartitionLayout(_N, _DP, _MBS)


def _build(path, *, seed=0, **meta):
    build(path, num_samples=_N, dp_size=_DP, mbs=_MBS, rows_per_shard=_ROWS, seed=seed, **{**_META, **meta})
    return path


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """The store under test, another build of the same shape and metadata with other data, and
    another teacher's cache (same shape, other teacher_fingerprint)."""
    root = tmp_path_factory.mktemp("binding")
    return {"this": _build(root / "this"), "other_build": _build(root / "other_build", seed=1),
            "other_teacher": _build(root / "other_teacher", seed=2, teacher_fingerprint="another-teacher")}


@pytest.fixture
def store(templates, tmp_path) -> Path:
    path = tmp_path / "c"
    shutil.copytree(templates["this"], path)
    return path


def _shard(path: Path, rank: int, name: str, shard: int) -> Path:
    return path / f"dp_{rank:05d}" / name / "c" / str(shard) / "0" / "0"


def _record(path: Path, rank: int, shard: int) -> Path:
    return path / f"dp_{rank:05d}" / "bindings" / f"{shard:06d}.json"


def _samples_of(rank: int, shard: int) -> np.ndarray:
    return _LAYOUT.samples_of(rank)[shard * _ROWS:(shard + 1) * _ROWS]


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)


def _all_refuse(store: Path, files: list[Path], samples: np.ndarray, capsys) -> None:
    """verify, a read of ``samples``, a prefetch of every sample, check_files and the CLI's verify all
    raise one CacheError line naming one of ``files``."""
    def names_one(fn, *args, **kw):
        with pytest.raises(CacheError) as info:
            fn(*args, **kw)
        msg = str(info.value)
        assert "\n" not in msg and any(str(f) in msg for f in files), (msg, files)

    names_one(verify, store, progress=False)
    names_one(CacheReader(store).read, samples)
    names_one(lambda: list(CacheReader(store).prefetch(range(_N), block=2)))
    names_one(CacheReader(store).check_files)
    line = _cli_error(["cache", "verify", str(store)], capsys)
    assert any(str(f) in line for f in files), (line, files)


@pytest.mark.parametrize("name", ["ids", "logprobs"])
def test_shards_swapped_within_a_partition(store, seed, capsys, name):
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(_DP))
    a, b = _shard(store, rank, name, 0), _shard(store, rank, name, 1)
    assert a.stat().st_size != b.stat().st_size  # so that stats alone (check_files) see it too
    _swap(a, b)
    _all_refuse(store, [a, b], np.concatenate([_samples_of(rank, 0), _samples_of(rank, 1)]), capsys)


def test_shards_of_equal_size_swapped_are_refused_on_read(tmp_path):
    # the topk-v1 fixture's two logprobs shards are 120 bytes each, and the CRC32C of either whole
    # file (chunks that end with their own CRC32C) is the same value: only the records' SHA-256 tells
    # them apart, on the first read of each
    store = tmp_path / "store"
    shutil.copytree(Path(__file__).parent / "data" / "topk_v1" / "store", store)
    a, b = (store / "dp_00000" / "logprobs" / "c" / str(shard) / "0" / "0" for shard in (0, 1))
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    _swap(a, b)
    CacheReader(store).check_files()  # stats only: the sizes agree
    for samples in ([0], [2], [0, 1, 2]):
        _raises_naming(a if samples != [2] else b, CacheReader(store).read, samples)


@pytest.mark.parametrize("name", ["ids", "logprobs"])
def test_shards_swapped_between_partitions(store, capsys, name):
    # the same place in both partitions, at a shard whose compressed sizes differ (equal sizes happen:
    # the template's ids shard 1 is 2,259 bytes in both), so that stats alone (check_files) see it too
    def size(rank, shard):
        return _shard(store, rank, name, shard).stat().st_size

    differing = [s for s in (0, 1) if size(0, s) != size(1, s)]
    assert differing, f"{name}: shards 0 and 1 each have one size in both partitions"
    shard = differing[0]
    a, b = _shard(store, 0, name, shard), _shard(store, 1, name, shard)
    _swap(a, b)
    _all_refuse(store, [a, b], np.concatenate([_samples_of(0, shard), _samples_of(1, shard)]), capsys)


def test_shard_and_record_swapped_together(store, seed, capsys):
    """Moving the records along with their shards does not help: a record names its own place."""
    rank = int(np.random.default_rng(seed).integers(_DP))
    for name in ("ids", "logprobs"):
        _swap(_shard(store, rank, name, 0), _shard(store, rank, name, 1))
    _swap(_record(store, rank, 0), _record(store, rank, 1))
    _all_refuse(store, [_record(store, rank, 0), _record(store, rank, 1)], _samples_of(rank, 0), capsys)


@pytest.mark.parametrize("source", ["other_build", "other_teacher"])
def test_shard_copied_from_another_cache(templates, store, seed, capsys, source):
    rng = np.random.default_rng(seed)
    rank, name, shard = int(rng.integers(_DP)), str(rng.choice(["ids", "logprobs"])), int(rng.integers(2))
    target = _shard(store, rank, name, shard)
    assert target.stat().st_size != _shard(templates[source], rank, name, shard).stat().st_size
    shutil.copyfile(_shard(templates[source], rank, name, shard), target)
    _all_refuse(store, [target], _samples_of(rank, shard), capsys)


def test_shard_copied_with_its_record_from_another_teacher(templates, store, seed, capsys):
    """The record travels with the shard, so sizes and digests agree; its store_id does not."""
    rng = np.random.default_rng(seed)
    rank, shard = int(rng.integers(_DP)), int(rng.integers(2))
    other = templates["other_teacher"]
    for name in ("ids", "logprobs"):
        shutil.copyfile(_shard(other, rank, name, shard), _shard(store, rank, name, shard))
    shutil.copyfile(_record(other, rank, shard), _record(store, rank, shard))
    _all_refuse(store, [_record(store, rank, shard)], _samples_of(rank, shard), capsys)


def test_records_missing_or_stray(store, seed, capsys):
    rank, shard = 1, int(np.random.default_rng(seed).integers(2))
    record = _record(store, rank, shard)
    saved = record.read_bytes()
    record.unlink()
    _all_refuse(store, [record], _samples_of(rank, shard), capsys)
    record.write_bytes(saved)
    assert verify(store, progress=False)["ok"]
    stray = _record(store, rank, 7)  # partition 1 has 2 shards
    stray.write_bytes(saved)
    _raises_naming(stray, verify, store, progress=False)


def test_store_id(templates, store, seed):
    """Deterministic (two separate builds of the same parameters share it), another teacher gives
    another, a field edited after the build no longer matches it; inspect reports it."""
    ids = {k: CacheReader(p).meta.store_id for k, p in templates.items()}
    assert ids["this"] == ids["other_build"] != ids["other_teacher"]
    assert len(ids["this"]) == 32 and int(ids["this"], 16) >= 0
    summary = inspect(store, progress=False)
    assert summary["store_id"] == ids["this"]

    root_json = store / "zarr.json"
    doc = json.loads(root_json.read_text())
    doc["attributes"]["megatron_kd"]["temperature"] = 2.0
    root_json.write_text(json.dumps(doc))
    _raises_naming(root_json, CacheReader, store)
    with pytest.raises(CacheError, match="store_id is"):
        CacheReader(store)


def test_schema_version_1_is_refused(store):
    root_json = store / "zarr.json"
    doc = json.loads(root_json.read_text())
    attrs = doc["attributes"]["megatron_kd"]
    attrs["schema_version"] = 1
    del attrs["store_id"]
    root_json.write_text(json.dumps(doc))
    for fn in (CacheReader, lambda p: verify(p, progress=False), lambda p: inspect(p, progress=False),
               lambda p: _writer(p, 0)):
        with pytest.raises(CacheError, match="schema_version 1 has no chunk binding.*rebuild"):
            fn(store)


def test_schema_version_2_is_refused(store):
    """A store of before the token digests (its binding records without "tokens") is refused, not
    read with rows bound to no tokens."""
    root_json = store / "zarr.json"
    doc = json.loads(root_json.read_text())
    attrs = doc["attributes"]["megatron_kd"]
    attrs["schema_version"] = 2
    attrs["store_id"] = dataclasses.replace(CacheReader(store).meta, schema_version=2).store_id
    root_json.write_text(json.dumps(doc))
    for record in store.glob("dp_*/bindings/*.json"):
        fields = json.loads(record.read_text())
        del fields["tokens"]
        record.write_text(json.dumps(fields))
    for fn in (CacheReader, lambda p: verify(p, progress=False), lambda p: inspect(p, progress=False),
               lambda p: _writer(p, 0)):
        _raises_naming(root_json, fn, store)
        with pytest.raises(CacheError, match="schema_version 2 has no digests of the tokens its teacher read .*; "
                                             "rebuild the cache with this megatron_kd"):
            fn(store)


# ------------------------------------------------------------------------------------------------------
# rows_done ahead of the data


def _resume(path) -> dict:
    """Resume every partition; the samples each writer found marked done but not on disk."""
    repaired = {}
    for rank in range(_DP):
        with _writer(path, rank) as w:
            repaired[rank] = w.repaired_samples.tolist()
            for s in w.pending_samples():
                w.write(int(s), *sample_data(int(s), 0), tokens=sample_tokens(int(s)))
    return repaired


@pytest.mark.parametrize("what", ["ids", "logprobs", "record"])
def test_resume_rewrites_a_deleted_shard_of_a_complete_partition(templates, store, seed, what):
    rng = np.random.default_rng(seed)
    rank, shard = int(rng.integers(_DP)), int(rng.integers(2))
    (_record(store, rank, shard) if what == "record" else _shard(store, rank, what, shard)).unlink()
    with _writer(store, rank) as w:  # the missing rows are pending again, and said to be
        assert w.repaired_samples.tolist() == _samples_of(rank, shard).tolist()
        assert len(w.repairs) == 1 and "\n" not in w.repairs[0]
        assert w.pending_samples().tolist() == _samples_of(rank, shard).tolist()
    with pytest.raises(CacheError, match="incomplete"):  # until they are written again
        CacheReader(store)
    _resume(store)
    assert _tree_bytes(store) == _tree_bytes(templates["this"])
    assert verify(store, progress=False)["ok"]


def test_resume_rewrites_a_deleted_shard_of_an_incomplete_partition(templates, tmp_path, seed):
    path = tmp_path / "c"
    build(path, num_samples=_N, dp_size=_DP, mbs=_MBS, rows_per_shard=_ROWS, ranks=[0], **_META)
    first = _LAYOUT.samples_of(1)[:4]  # shard 0 whole and one row of shard 1 (flushed by close)
    w = _writer(path, 1)
    for s in first:
        w.write(int(s), *sample_data(int(s), 0), tokens=sample_tokens(int(s)))
    assert w.close() is False
    name = str(np.random.default_rng(seed).choice(["ids", "logprobs"]))
    _shard(path, 1, name, 0).unlink()
    summary = inspect(path, progress=False)  # inspect still works on an incomplete store
    assert not summary["complete"] and summary["store_id"] == CacheReader(templates["this"]).meta.store_id
    repaired = _resume(path)
    assert repaired == {0: [], 1: first[:3].tolist()}
    assert _tree_bytes(path) == _tree_bytes(templates["this"])


def test_crash_between_a_shards_data_and_its_record(templates, tmp_path, seed):
    """A partly written shard is rewritten whole when resumed; a crash after its new data lands and
    before its new record does leaves data and record apart: those rows are not done any more."""
    path = tmp_path / "c"
    build(path, num_samples=_N, dp_size=_DP, mbs=_MBS, rows_per_shard=_ROWS, ranks=[0], **_META)
    samples = _LAYOUT.samples_of(1)
    w = _writer(path, 1)
    s = int(samples[3])  # one row of shard 1
    w.write(s, *sample_data(s, 0), tokens=sample_tokens(s))
    assert w.close() is False

    class Crash(Exception):
        pass

    with pytest.raises(Crash):
        with _writer(path, 1) as w:
            def crash(shard, tokens):
                raise Crash
            w.bindings.write = crash
            for s in samples[3:6]:  # completes shard 1: rewritten whole, then the crash
                w.write(int(s), *sample_data(int(s), 0), tokens=sample_tokens(int(s)))
    record = json.loads(_record(path, 1, 1).read_text())
    assert record["files"]["ids"]["bytes"] != _shard(path, 1, "ids", 1).stat().st_size  # apart
    repaired = _resume(path)
    assert repaired[1] == [int(samples[3])]
    assert _tree_bytes(path) == _tree_bytes(templates["this"])


# ------------------------------------------------------------------------------------------------------
# only regular files of bounded size

_CLI_CHILD = textwrap.dedent("""
    import sys
    from megatron_kd.cli import main
    for command in ("inspect", "verify"):
        print(command, "exit", main(["cache", command, {path!r}]), flush=True)
""")


@pytest.mark.parametrize("target", ["shard", "zarr.json"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_special_files_are_refused_at_once(store, seed, kind, target):
    """A FIFO blocked inspect forever and a link to /dev/zero read until the OOM killer came: both
    commands must exit 2 with one line naming the file, in seconds (child process: memory capped,
    timed out, so a regression fails instead of hanging or exhausting the machine)."""
    rank = int(np.random.default_rng(seed).integers(_DP))
    file = _shard(store, rank, "ids", 0) if target == "shard" else store / f"dp_{rank:05d}" / "ids" / "zarr.json"
    file.unlink()
    if kind == "fifo":
        os.mkfifo(file)
    else:
        file.symlink_to("/dev/zero")
    limit = 4 << 30

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    child = subprocess.run([sys.executable, "-c", _CLI_CHILD.format(path=str(store))], capture_output=True,
                           text=True, timeout=120, preexec_fn=cap_memory, cwd=Path(__file__).parents[2])
    assert child.stdout.splitlines() == ["inspect exit 2", "verify exit 2"], (child.stdout, child.stderr[-2000:])
    errors = [ln for ln in child.stderr.splitlines() if ln.startswith("megatron-kd: error:")]
    assert len(errors) == 2 and all(str(file) in ln and "not a regular file" in ln for ln in errors), child.stderr
    assert "Traceback" not in child.stderr


def test_oversized_file_is_refused(store):
    """A regular file larger than any file of its kind can be is not read: a zarr.json of 17 MiB
    (its own valid JSON, then whitespace)."""
    file = store / "dp_00000" / "zarr.json"
    file.write_bytes(file.read_bytes() + b" " * (17 << 20))
    with pytest.raises(CacheError, match="more than"):
        CacheReader(store).read([0])
    _raises_naming(file, verify, store, progress=False)


# ------------------------------------------------------------------------------------------------------
# a writer that cannot write


def _running_as_root_can_write(path: Path) -> bool:
    try:
        (path / ".probe").write_bytes(b"")
    except OSError:
        return False
    (path / ".probe").unlink()
    return True


@pytest.mark.parametrize("complete", [True, False])
def test_writer_on_a_read_only_store(templates, tmp_path, complete):
    path = tmp_path / "c"
    if complete:
        shutil.copytree(templates["this"], path)
    else:
        build(path, num_samples=_N, dp_size=_DP, mbs=_MBS, rows_per_shard=_ROWS, ranks=[0], **_META)
    modes = {}
    for p in [path, *path.rglob("*")]:
        modes[p] = p.stat().st_mode
        p.chmod(modes[p] & ~0o222)
    try:
        if _running_as_root_can_write(path / "dp_00000"):
            pytest.skip("chmod does not stop this user (root) from writing; "
                        "test_writer_cannot_write_where_a_folder_is_a_file covers the error path")
        with pytest.raises(CacheWriteError) as info:
            _writer(path, 1)
        msg = str(info.value)
        assert "\n" not in msg and str(path) in msg and "cannot" in msg
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


def test_writer_cannot_write_where_a_folder_is_a_file(tmp_path):
    """OSErrors while writing are one CacheError naming the file, for any user (root included): the
    store's parent is a file; a partition's bindings folder is a file when a shard is flushed."""
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(CacheWriteError) as info:
        _writer(blocker / "c", 0)
    assert "\n" not in str(info.value) and str(blocker) in str(info.value)

    path = tmp_path / "c"
    w = _writer(path, 1)
    bindings = path / "dp_00001" / "bindings"
    shutil.rmtree(bindings, ignore_errors=True)
    bindings.write_bytes(b"")  # where the shard's record goes
    samples = _LAYOUT.samples_of(1)
    s = int(samples[0])
    w.write(s, *sample_data(s, 0), tokens=sample_tokens(s))
    with pytest.raises(CacheWriteError) as info:
        for s in samples[1:3]:  # the shard's last row: data, then the record, which cannot be written
            w.write(int(s), *sample_data(int(s), 0), tokens=sample_tokens(int(s)))
    msg = str(info.value)
    assert "\n" not in msg and str(bindings) in msg and "cannot write" in msg, msg
    w._unlock()
    again = _writer(path, 1)  # nothing of the failed shard counts as written
    assert again.pending_samples().tolist() == samples.tolist()
    again._unlock()
