"""topk-v3 (encodings.py, entry_codecs.py): id sets by slot range and probability levels.

1. its own representation (int32 id sets, uint8 levels) round-trips bit for bit, on random chunks
   and adversarial ones: tokens without entries, K full, neighbours with the same ids, all
   padding, K = 1 and K >= 256, ids up to int32's limit with gaps that need all four bytes
2. a written-then-read cache written again gives the same bytes (the levels' decoded log-probs
   code back to the same levels), and a resumed build equals an uninterrupted one
3. truncated or inconsistent chunks and a corrupted shard file are one-line CacheErrors
4. the lossy bound: every probability within (e^(step/2) - 1)·(min(p, 1 - p) + c) of the
   teacher's, and so the forward-KL gradient with respect to the student's logits (q - p on the
   teacher's entries) within the same bound per entry, measured through topk_kl_reference
5. stores of the other codecs still read (topk-v2 / sampled-counts-v1 written here, the topk-v1
   fixture in test_codecs.py), and inspect names topk-v3 and its bytes/token
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_kd.cache import CacheError, CacheReader, CacheWriter
from megatron_kd.cache import entry_codecs as ec
from megatron_kd.cache.encodings import probability_levels
from megatron_kd.cache.inspect import inspect, verify
from megatron_kd.ops import topk_kl_reference
from tests.fixtures.cache_store import sample_tokens
from tests.fixtures.codec_bounds import topk_v3_bound
from tests.fixtures.kd_inputs import sampled_rows, teacher_topk


def _id_sets(rng, tokens: int, k: int, n: np.ndarray, vocab: int) -> np.ndarray:
    ids = np.full((tokens, k), -1, np.int32)
    for t in range(tokens):
        ids[t, :n[t]] = np.sort(rng.choice(vocab, n[t], replace=False))
    return ids


def _levels(rng, tokens: int, k: int, n: np.ndarray) -> np.ndarray:
    lev = np.full((tokens, k), ec.PAD_LEVEL, np.uint8)
    for t in range(tokens):
        lev[t, :n[t]] = rng.integers(0, ec.MAX_LEVEL + 1, n[t])
    return lev


def _round_trip(ids: np.ndarray, lev: np.ndarray) -> None:
    tokens, k = ids.shape
    got_ids = ec.decode_column_id_sets(ec.encode_column_id_sets(ids), tokens, k)
    got_lev = ec.decode_levels(ec.encode_levels(lev), tokens, k)
    assert got_ids.dtype == np.int32 and np.array_equal(got_ids, ids)
    assert got_lev.dtype == np.uint8 and np.array_equal(got_lev, lev)


# ---------------------------------------------------------------- 1. the representation round-trips
@pytest.mark.parametrize("k", [1, 7, 100, 300])
def test_random_chunks_round_trip_exactly(seed, k):
    rng = np.random.default_rng(seed)
    tokens = 203
    n = rng.integers(0, k + 1, tokens)
    n[:2], n[2:5] = 0, k  # tokens without entries, full tokens
    _round_trip(_id_sets(rng, tokens, k, n, 201_088), _levels(rng, tokens, k, n))


def test_adversarial_chunks_round_trip_exactly(seed):
    rng = np.random.default_rng(seed)
    k, tokens = 100, 64
    full = np.full(tokens, k)
    # every token full (the decoder's fast path), neighbours sharing every id
    same = np.repeat(_id_sets(rng, 1, k, full[:1], 201_088), tokens, 0)
    _round_trip(same, _levels(rng, tokens, k, full))
    # all padding (rows not written yet)
    _round_trip(np.full((tokens, k), -1, np.int32), np.full((tokens, k), ec.PAD_LEVEL, np.uint8))
    # ids up to int32's limit, gaps of all four bytes; the deepest and shallowest levels
    big = np.sort(rng.choice(np.iinfo(np.int32).max - 1, (tokens, k), replace=False), 1).astype(np.int32)
    big[0] = np.arange(k)  # gaps of 1
    big[1, -1] = np.iinfo(np.int32).max - 1  # the largest id that decodes (id + 1 fits int32)
    lev = _levels(rng, tokens, k, full)
    lev[0], lev[1] = 0, ec.MAX_LEVEL
    _round_trip(big, lev)
    # one full token among empty ones, and the reverse
    n = np.zeros(tokens, np.int64)
    n[tokens // 2] = k
    _round_trip(_id_sets(rng, tokens, k, n, 5000), _levels(rng, tokens, k, n))
    _round_trip(_id_sets(rng, tokens, k, k - n, 5000), _levels(rng, tokens, k, k - n))
    # no tokens
    _round_trip(np.zeros((0, k), np.int32), np.zeros((0, k), np.uint8))


def test_encoder_refuses_what_is_not_its_representation():
    with pytest.raises(ValueError, match="ascend"):
        ec.encode_column_id_sets(np.array([[5, 3, -1]], np.int32))
    with pytest.raises(ValueError, match="ascend"):
        ec.encode_column_id_sets(np.array([[5, 5, -1]], np.int32))
    with pytest.raises(ValueError, match="padding before"):
        ec.encode_column_id_sets(np.array([[-1, 3, 4]], np.int32))
    with pytest.raises(ValueError, match="above"):
        ec.encode_levels(np.array([[ec.MAX_LEVEL + 1, 0]], np.uint8))


# ---------------------------------------------------------------- 2. through the store
def _write(path, data, *, k, seq, vocab, codec="topk-v3", rows_per_shard=2, only=None):
    w = CacheWriter(path, vocab_size=vocab, topk=k, seq_length=seq, num_samples=len(data),
                    rows_per_shard=rows_per_shard, codec=codec)
    for s in (range(len(data)) if only is None else only):
        w.write(s, *data[s], tokens=sample_tokens(s, seq=seq, vocab=vocab))
    return w.close()


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".writer.lock"}


def test_decoded_rows_code_back_to_the_same_bytes(tmp_path, seed):
    vocab, seq, k, n = 20_000, 24, 16, 5
    g = torch.Generator().manual_seed(seed)
    data = [teacher_topk(seq, vocab, k, zipf=1.0, generator=g) for _ in range(n)]
    ids, lps = data[0][0].clone(), data[0][1].clone()
    ids[2, k // 2:] = -1  # a token in part padding
    ids[3], lps[3] = -1, float("-inf")  # a token of padding only
    lps[4, 0], lps[4, 1] = 0.0, 4e-4  # p = 1, and a log-prob a hair above 0
    lps[5, 0] = -700.0  # far below the floor: level 0
    data[0] = (ids, lps)
    assert _write(tmp_path / "a", data, k=k, seq=seq, vocab=vocab)
    reader = CacheReader(tmp_path / "a")
    assert reader.meta.codec == "topk-v3"
    again = [reader.read(s) for s in range(n)]
    assert _write(tmp_path / "b", [(i[0], l[0]) for i, l in again], k=k, seq=seq, vocab=vocab)
    assert _tree(tmp_path / "a") != {} and _tree(tmp_path / "a") == _tree(tmp_path / "b")
    # every level decodes to a log-prob that codes back to it
    table = np.log(ec.level_probabilities()).astype(np.float32)
    assert torch.equal(probability_levels(torch.from_numpy(table)), torch.arange(ec.MAX_LEVEL + 1, dtype=torch.int32))
    # resume: one shard whole, one in part, then the rest
    assert not _write(tmp_path / "c", data, k=k, seq=seq, vocab=vocab, only=(0, 1, 3))
    w = CacheWriter(tmp_path / "c", vocab_size=vocab, topk=k, seq_length=seq, num_samples=n, rows_per_shard=2)
    assert w.meta.codec == "topk-v3"  # a store keeps its codec
    for s in w.pending_samples():
        w.write(int(s), *data[int(s)], tokens=sample_tokens(s, seq=seq, vocab=vocab))
    assert w.close() and _tree(tmp_path / "c") == _tree(tmp_path / "a")
    summary = inspect(tmp_path / "a", progress=False)
    assert summary["codec"] == "topk-v3" and 0 < summary["bytes_per_token"] < 6 * k
    assert verify(tmp_path / "a", progress=False)["ok"]


# ---------------------------------------------------------------- 3. damage
def test_damaged_chunks_are_one_line_cache_errors(seed):
    rng = np.random.default_rng(seed)
    tokens, k = 50, 20
    n = np.full(tokens, k)
    n[3] = 5
    ids, lev = _id_sets(rng, tokens, k, n, 90_000), _levels(rng, tokens, k, n)
    bi, bv = ec.encode_column_id_sets(ids), ec.encode_levels(lev)
    cases = [
        (lambda: ec.decode_column_id_sets(bi[:-1], tokens, k), "streams hold"),  # truncated
        (lambda: ec.decode_levels(bv[:-3], tokens, k), "streams hold"),
        (lambda: ec.decode_column_id_sets(bi[:5], tokens, k), "header"),
        (lambda: ec.decode_column_id_sets(bi, tokens + 1, k), "entries per token"),  # another chunk's shape
        (lambda: ec.decode_levels(bv, tokens, 300), "header"),  # K >= 256: another stream count
    ]
    for step in (0, np.iinfo(np.int32).max):  # a step of 0 (ids not ascending), and ids past int32
        bad = np.diff(ids.astype(np.int64), axis=1, prepend=-1)
        bad[0, 1] = step
        streams = [*ec.plane_streams(np.full(tokens, k, np.int64) - (np.arange(tokens) == 3) * 15, 1)]
        for a, b in ec.column_groups(k):
            valid = ids[:, a:b] >= 0
            streams += ec.plane_streams(bad[:, a:b][valid], 4)
        forged = ec.pack_streams(streams, 3)
        cases.append((lambda forged=forged: ec.decode_column_id_sets(forged, tokens, k),
                      "ascending" if step == 0 else "past int32"))
    def forged_levels(context, first):
        return ec.pack_streams([*ec.plane_streams(np.full(tokens, k), 1), context, first,
                                *[np.zeros(0, np.uint8)] * (ec.LEVEL_CONTEXTS - 1)], 3)

    zeros = np.zeros(tokens, np.uint8)
    cases += [(lambda: ec.decode_levels(forged_levels(zeros, np.full(tokens * k, ec.MAX_LEVEL + 1, np.uint8)),
                                        tokens, k), "above"),
              (lambda: ec.decode_levels(forged_levels(zeros, np.zeros(tokens * k - 1, np.uint8)), tokens, k),
               "hold"),
              (lambda: ec.decode_levels(forged_levels(zeros + ec.LEVEL_CONTEXTS, np.zeros(0, np.uint8)), tokens, k),
               "contexts")]
    for decode, words in cases:
        with pytest.raises(CacheError) as e:
            decode()
        assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def test_corrupted_shard_file_is_named(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = [teacher_topk(16, 3000, 8, generator=g) for _ in range(2)]
    _write(tmp_path / "c", data, k=8, seq=16, vocab=3000)
    shard = next(p for p in (tmp_path / "c" / "dp_00000" / "logprobs").rglob("*") if p.is_file() and p.parent.name == "0")
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(CacheError) as e:
        CacheReader(tmp_path / "c").read(0)
    assert "\n" not in str(e.value) and str(shard) in str(e.value)


# ---------------------------------------------------------------- 4. the lossy bound
def test_probabilities_and_kl_gradient_within_the_bound(seed):
    """Per entry |p̂ - p| <= (e^(step/2) - 1)·(min(p, 1 - p) + c) (plus float32 rounding); the forward
    KL's gradient with respect to the student logits is q - p on the teacher's entries (tail none:
    M·q - p, M the entries' mass), so its error is within |p̂ - p| per entry plus |M̂ - M|·q."""
    vocab, k, tokens = 400, 32, 96
    g = torch.Generator().manual_seed(seed)
    ids, lps = teacher_topk(tokens, vocab, k, zipf=1.0, generator=g)
    ids, lps = ids.clone(), lps.clone()
    lps[0, 0], lps[1, :] = 0.0, -math.log(k)  # p = 1; k equal entries
    lps[2] = torch.linspace(-1e-3, -40.0, k)  # from p ~ 1 to far below the floor
    order = torch.argsort(ids, -1)
    ids, lps = torch.gather(ids, -1, order), torch.gather(lps, -1, order)
    levels = probability_levels(lps)
    decoded = torch.from_numpy(np.log(ec.level_probabilities()).astype(np.float32))[levels.long()]
    p, p_hat = lps.double().exp(), decoded.double().exp()
    bound = topk_v3_bound(lps)  # the level's error and the decoded log-prob's float32 rounding
    assert ((p_hat - p).abs() <= bound).all(), float(((p_hat - p).abs() / bound).max())
    assert ((p_hat - p).abs() > 0.3 * bound).any()  # the bound is near what happens, not loose

    # the gradient with respect to the logits: identity weight, so hidden = logits
    logits = torch.randn(tokens, vocab, dtype=torch.float64, generator=g) * 2
    grads = {}
    for name, teacher in (("exact", lps), ("topk-v3", decoded)):
        z = logits.clone().requires_grad_()
        loss, _ = topk_kl_reference(z, torch.eye(vocab, dtype=torch.float64), ids, teacher.double(), tail="none")
        loss.backward()
        grads[name] = z.grad
    q = torch.softmax(logits, -1)
    mass_err = (p_hat - p).sum(-1, keepdim=True).abs()
    per_entry = torch.zeros(tokens, vocab, dtype=torch.float64).scatter_(1, ids, bound)
    diff = (grads["topk-v3"] - grads["exact"]).abs()
    assert (diff <= per_entry + mass_err * q + 1e-12).all()
    # and per token, in L1: at most twice the summed bound
    assert (diff.sum(-1) <= 2 * bound.sum(-1) + 1e-12).all()


# ---------------------------------------------------------------- 5. the other codecs
def test_stores_of_the_other_codecs_still_read(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    vocab, seq, k = 3000, 12, 8
    top = [teacher_topk(seq, vocab, k, generator=g) for _ in range(3)]
    _write(tmp_path / "v2", top, k=k, seq=seq, vocab=vocab, codec="topk-v2")
    v2_ids, v2_lps = CacheReader(tmp_path / "v2").read(np.arange(3))
    assert CacheReader(tmp_path / "v2").meta.codec == "topk-v2"
    assert torch.equal(v2_ids.sort(-1).values, torch.stack([t[0] for t in top]).int().sort(-1).values)
    assert (v2_lps.sort(-1).values - torch.stack([t[1] for t in top]).sort(-1).values).abs().max() <= 0.5 / 257 + 1e-6
    draws = [sampled_rows(seq, vocab, k, generator=g) for _ in range(3)]
    w = CacheWriter(tmp_path / "s", vocab_size=vocab, topk=k, seq_length=seq, num_samples=3, rows_per_shard=2,
                    metadata={"mode": "sampled", "sampled_draws": k})
    for s, (i, l) in enumerate(draws):
        w.write(s, i, l, tokens=sample_tokens(s, seq=seq, vocab=vocab))
    assert w.close()
    s_ids, s_lps = CacheReader(tmp_path / "s").read(np.arange(3))
    assert torch.equal(s_ids, torch.stack([d[0] for d in draws]).int())
    assert torch.equal(s_lps, torch.stack([d[1] for d in draws]))
