"""Teacher cache: round trip, precision, concurrent ranks, kill-and-resume, re-partitioned reads, errors.

1. round trip of teacher-like data: ids exact, probabilities within 2^-9 relative, padding kept
2. two processes write their partitions concurrently
3. a build killed with SIGKILL mid-write, then resumed, is byte-identical to an uninterrupted one
4. written with dp_size 4, read with dp_size 2 and 1 (and prefetched in training order)
5. every bad input / store raises one CacheError naming the field or file; the CLI exits 2
"""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from kd_inputs import teacher_topk
from megatron_kd.cache import CacheError, CacheReader, CacheWriter
from megatron_kd.cache.codec import decode_topk, encode_topk
from megatron_kd.cache.inspect import inspect, verify
from megatron_kd.cli import main as cli_main

VOCAB, K, SEQ = 3001, 12, 40


def sample_data(sample: int, seed: int, seq=SEQ, vocab=VOCAB, k=K):
    """Deterministic teacher top-K for one sample (so a resumed build can regenerate it)."""
    torch.manual_seed(seed * 100_003 + sample)
    ids, lps = teacher_topk(seq, vocab, k, zipf=1.0)
    if sample % 3 == 0:  # padding in both spellings, and a fully padded token
        ids[0, k // 2:] = -1
        lps[1, 1:] = float("-inf")
        ids[2], lps[2] = -1, float("-inf")
    return ids, lps


def build(path, *, num_samples, dp_size=1, mbs=1, seed=0, ranks=None, rows_per_shard=3, **meta):
    for rank in (range(dp_size) if ranks is None else ranks):
        with CacheWriter(path, vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=num_samples,
                         dp_rank=rank, dp_size=dp_size, micro_batch_size=mbs, rows_per_shard=rows_per_shard,
                         metadata=meta or None) as w:
            for s in w.pending_samples():
                w.write(int(s), *sample_data(int(s), seed))


def as_sets(ids, lps):
    """Per token {id: logprob} of the valid entries (entry order is not part of the contract)."""
    out = []
    for i_row, l_row in zip(ids.reshape(-1, ids.shape[-1]).tolist(), lps.reshape(-1, lps.shape[-1]).tolist()):
        out.append({i: l for i, l in zip(i_row, l_row) if i >= 0 and l > float("-inf")})
    return out


def assert_same_topk(got_ids, got_lps, ids, lps):
    assert got_ids.dtype == torch.int32 and got_lps.dtype == torch.float32
    for got, want in zip(as_sets(got_ids, got_lps), as_sets(ids, lps)):
        assert got.keys() == want.keys()
        for i, lp in want.items():
            if lp >= -30 * np.log(2):  # p >= 2^-30: relative error of p within 2^-9
                assert abs(np.expm1(got[i] - lp)) <= 2**-9, (i, got[i], lp)
    # padding comes back as id -1 with log-prob -inf, together
    assert torch.equal(got_ids < 0, torch.isinf(got_lps))


def test_codec_round_trip_and_precision(seed):
    ids, lps = teacher_topk(500, 201_088, 100, zipf=1.0)
    got_ids, got_lps = decode_topk(*encode_topk(ids, lps, 201_088))
    assert_same_topk(got_ids, got_lps, ids, lps)
    # the fixed-point step keeps every probability >= 2^-30 within 2^-9 relative, with margin
    deep = torch.linspace(-30 * np.log(2), 0, 10_000).view(100, 100).float()
    deep_ids = torch.arange(10_000).view(100, 100)  # already sorted per token: entries keep their order
    _, back = decode_topk(*encode_topk(deep_ids, deep, 20_000))
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
    import sys, time
    sys.path[:0] = {paths!r}
    from test_cache import build, sample_data
    from megatron_kd.cache import CacheWriter
    with CacheWriter({path!r}, vocab_size={vocab}, topk={k}, seq_length={seq}, num_samples={n},
                     dp_size=2, dp_rank=1, micro_batch_size=2, rows_per_shard=3) as w:
        for s in w.pending_samples():
            w.write(int(s), *sample_data(int(s), 0))
            print("wrote", int(s), flush=True)
            time.sleep(0.05)
""")


def _tree_bytes(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_killed_build_resumes_byte_identical(tmp_path, seed):
    n = 23
    build(tmp_path / "ref", num_samples=n, dp_size=2, mbs=2)

    path = tmp_path / "killed"
    build(path, num_samples=n, dp_size=2, mbs=2, ranks=[0])
    here = str(Path(__file__).parent)
    script = _KILL_CHILD.format(paths=[here, str(Path(here).parent)], path=str(path), vocab=VOCAB, k=K,
                                seq=SEQ, n=n)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
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
        w.write(s, *sample_data(s, 0))
    assert w.close() is False
    w = CacheWriter(path, vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=n, rows_per_shard=4)
    assert w.pending_samples().tolist() == [6, 7, 8, 9]
    assert w.write(3, *sample_data(3, 0)) == 0  # already on disk: skipped
    for s in w.pending_samples():
        w.write(int(s), *sample_data(int(s), 0))
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
    cases = []
    bad = ids.clone(); bad[3, 0] = VOCAB; cases.append(("id 3001", bad, lps))
    bad = ids.clone(); bad[3, 0] = -5; cases.append(("id -5", bad, lps))
    bad = ids.clone(); bad[3, 1] = bad[3, 0]; cases.append(("repeats an id", bad, lps))
    bad = lps.clone(); bad[4, 2] = float("nan"); cases.append(("NaN", ids, bad))
    bad = lps.clone(); bad[4, 2] = float("inf"); cases.append((r"\+inf", ids, bad))
    bad = lps.clone(); bad[4, 2] = 0.5; cases.append(("<= 0", ids, bad))
    cases.append(("must be", ids[:-1], lps[:-1]))  # seq_length mismatch
    for match, i, lp in cases:
        with pytest.raises(CacheError, match=match):
            w.write(1, i, lp)
    with pytest.raises(CacheError, match="outside"):
        w.write(4, ids, lps)
    w2 = CacheWriter(tmp_path / "d", vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=4, dp_size=2, dp_rank=0)
    with pytest.raises(CacheError, match="rank 1's partition"):
        w2.write(1, ids, lps)


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
        w.write(s, *sample_data(s, 0))
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
    with pytest.raises(CacheError, match="unreadable"):
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
