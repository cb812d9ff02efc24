"""One teacher cache serves every run over the same tokens, and only those: rows are found by the
digest of the tokens their teacher read (``megatron_kd.cache.tokens``), not by megatron-core's
description of the data.

1. what one cache serves (the README's table): the same data at another path, a shorter run, the
   samples of a smaller global batch, the split written with quotes; and what it refuses with the
   count of the samples it holds: another seed, another split, the data rewritten at the same path
   (documents reordered), documents re-tokenized (the first differing block named)
2. each served sample's rows are those of the cache sample with its tokens
3. a sample whose tokens change after start-up is refused on read, naming it and the block
4. other mismatches name the field and both values: a tokenizer of the same size with other tokens,
   the sequence length
"""

import re
import shutil

import numpy as np
import pytest
import torch

from megatron_kd.cache import CacheError, CacheReader, CacheWriter
from megatron_kd.megatron.data import ByteTokenizer, build_gpt_datasets, tokenizer_fingerprint, write_indexed_dataset
from megatron_kd.megatron.kd_data import KDDataError, KDDataset
from tests.fixtures.chat_inputs import CHATML_SPECIALS, megatron_tokenizer, save_tokenizer
from tests.fixtures.kd_inputs import teacher_topk

SEQ, K, BUILT = 32, 4, 24  # the cache holds the first 24 samples of the build's run


def _documents(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, 256, rng.integers(20, 90))) + [ByteTokenizer().eod] for _ in range(40)]


def _dataset(prefix, *, split="100,0,0", seed=0, samples=BUILT, seq=SEQ):
    train, _, _ = build_gpt_datasets([str(prefix)], split=split, seq_length=seq, seed=seed,
                                     tokenizer=ByteTokenizer(), num_samples=(samples, 0, 0))
    return train


@pytest.fixture
def built(tmp_path, seed):
    """A cache of the first BUILT samples of a byte dataset (two partitions, micro-batch 2), with
    random teacher rows for each sample."""
    docs = _documents(seed)
    prefix = write_indexed_dataset(tmp_path / "data" / "docs", docs, ByteTokenizer().vocab_size)
    dataset = _dataset(prefix)
    meta = {"tokenizer_fingerprint": tokenizer_fingerprint(ByteTokenizer())}
    torch.manual_seed(seed)
    for rank in range(2):
        with CacheWriter(tmp_path / "cache", vocab_size=258, topk=K, seq_length=SEQ, num_samples=BUILT, dp_rank=rank,
                         dp_size=2, micro_batch_size=2, rows_per_shard=4, metadata=meta) as w:
            for s in w.pending_samples():
                w.write(int(s), *teacher_topk(SEQ, 258, K), tokens=dataset[int(s)]["tokens"])
    return {"docs": docs, "prefix": prefix, "cache": tmp_path / "cache", "tmp": tmp_path}


def _kd(dataset, cache, required=BUILT, tokenizer=None):
    return KDDataset(dataset, str(cache), tokenizer=tokenizer or ByteTokenizer(), required_samples=required,
                     progress=False)


def _served_rows_match(kd, dataset):
    """Every served sample's teacher rows are the rows of the cache sample whose tokens it has."""
    reader = CacheReader(kd.cache_path)
    by_digest = reader.content_index()
    from megatron_kd.cache.tokens import sample_digest

    for j in range(len(kd.rows)):
        item = kd[j]
        row = by_digest[sample_digest(dataset[j]["tokens"])]
        ids, lps = reader.read(row)
        assert torch.equal(item["tokens"], dataset[j]["tokens"])
        assert torch.equal(item["teacher_ids"], ids[0]) and torch.equal(item["teacher_logprobs"], lps[0])


def _refused(fn) -> tuple[int, int, str]:
    with pytest.raises(CacheError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    m = re.search(r"this run needs (\d+) samples; the cache holds (\d+) of them", message)
    assert m, message
    return int(m.group(1)), int(m.group(2)), message


# ---------------------------------------------------------------- 1, 2. what one cache serves
def test_the_same_data_at_another_path_is_served(built):
    copy = built["tmp"] / "node-local" / "docs"
    copy.parent.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{built['prefix']}{suffix}", f"{copy}{suffix}")
    dataset = _dataset(copy)
    kd = _kd(dataset, built["cache"])
    assert kd.relocated == 0
    _served_rows_match(kd, dataset)


def test_a_shorter_run_and_a_smaller_batch_are_served(built):
    # 20 iterations of a global batch of 1 and 5 of 4: the first samples of the build's order
    for required in (20, 5 * 4, 3):
        dataset = _dataset(built["prefix"], samples=required)
        kd = _kd(dataset, built["cache"], required=required)
        assert len(kd.rows) == required and kd.relocated == 0
    _served_rows_match(kd, dataset)


def test_the_split_written_with_quotes_is_served(built):
    # a recipe's --split "'100,0,0'" (the quotes kept by the shell): megatron-core reads the same
    # split, under another description
    dataset = _dataset(built["prefix"], split="'100,0,0'")
    kd = _kd(dataset, built["cache"])
    _served_rows_match(kd, dataset)


def test_samples_found_at_other_indices_are_served(built):
    # the samples of another seed that the build's run also cut: served where the cache holds them
    # all (here: the build's own samples in another order, as a shuffled blend hands them out)
    dataset = _dataset(built["prefix"])
    order = list(reversed(range(BUILT)))

    class Reordered(torch.utils.data.Dataset):
        config, unique_identifiers = dataset.config, dataset.unique_identifiers

        def __len__(self):
            return BUILT

        def __getitem__(self, j):
            return dataset[order[j]]

    kd = _kd(Reordered(), built["cache"])
    assert kd.relocated == BUILT and list(kd.rows) == order
    _served_rows_match(kd, Reordered())


@pytest.mark.parametrize("change", ["seed", "split"])
def test_another_seed_or_split_is_refused_with_the_count(built, change):
    dataset = _dataset(built["prefix"], **({"seed": 1} if change == "seed" else {"split": "80,20,0"}))
    needs, holds, message = _refused(lambda: _kd(dataset, built["cache"]))
    assert needs == BUILT and holds < BUILT, message
    assert "The first it lacks is sample" in message and "megatron-kd cache build" in message


def test_data_rewritten_at_the_same_path_is_refused(built):
    docs = built["docs"]
    write_indexed_dataset(built["prefix"], docs[1:] + docs[:1], ByteTokenizer().vocab_size)  # reordered
    shutil.rmtree(built["prefix"] / "cache")  # megatron-core's indices of the old documents' lengths
    dataset = _dataset(built["prefix"])
    needs, holds, message = _refused(lambda: _kd(dataset, built["cache"]))
    # a window inside one document can come back whole under the new order: a few may be held
    assert needs == BUILT and holds < BUILT // 4, message


def test_retokenized_documents_are_refused_naming_the_block(built):
    # one token of every document changed (lengths kept: megatron-core cuts the same windows), so
    # some of the cached windows hold one, whatever the seed's shuffle
    dataset = _dataset(built["prefix"])
    before = [dataset[j]["tokens"].clone() for j in range(BUILT)]
    docs = [list(d) for d in built["docs"]]
    for doc in docs:
        doc[11] = (doc[11] + 1) % 256
    write_indexed_dataset(built["prefix"], docs, ByteTokenizer().vocab_size)
    changed = _dataset(built["prefix"])
    differ = [j for j in range(BUILT) if not torch.equal(changed[j]["tokens"], before[j])]
    assert differ
    j = differ[0]
    position = int(torch.nonzero(changed[j]["tokens"] != before[j])[0])
    needs, holds, message = _refused(lambda: _kd(changed, built["cache"]))
    assert (needs, holds) == (BUILT, BUILT - len(differ)), message
    first = position // 16 * 16  # a 32-token window has block digests of 16 tokens
    assert f"The first it lacks is sample {j}: the cache's sample {j} was read by the teacher with other tokens " \
           f"(the first differing block: positions {first}..{first + 15})" in message, message


# ---------------------------------------------------------------- 3. tokens changed after start-up
def test_a_sample_changed_after_start_up_is_refused_on_read(built):
    dataset = _dataset(built["prefix"])
    kd = _kd(dataset, built["cache"])
    assert torch.equal(kd[5]["tokens"], dataset[5]["tokens"])
    real = dataset.__class__.__getitem__

    def changed(self, j):
        item = dict(real(self, j))
        if j == 5:
            item["tokens"] = item["tokens"].clone()
            item["tokens"][-1] += 1
        return item

    dataset.__class__.__getitem__ = changed
    try:
        with pytest.raises(KDDataError, match=r"sample 5 of this run no longer has the tokens the teacher read for "
                                              r"the cache's sample 5 \(the first differing block: positions 16\.\.31\)"):
            kd[5]
        kd[4]  # the others still read
    finally:
        dataset.__class__.__getitem__ = real


# ---------------------------------------------------------------- 4. the field and both values
def test_a_tokenizer_of_the_same_size_with_other_tokens_is_refused(built, tmp_path):
    first = megatron_tokenizer(save_tokenizer(tmp_path / "first", CHATML_SPECIALS, eos="<|im_end|>"))
    second = megatron_tokenizer(save_tokenizer(tmp_path / "second", [CHATML_SPECIALS[i] for i in (0, 2, 1)],
                                               eos="<|im_end|>"))
    assert first.vocab_size == second.vocab_size
    cache = tmp_path / "cache-of-first"
    dataset = _dataset(built["prefix"])
    with CacheWriter(cache, vocab_size=first.vocab_size, topk=K, seq_length=SEQ, num_samples=2,
                     metadata={"tokenizer_fingerprint": tokenizer_fingerprint(first)}) as w:
        for s in range(2):
            w.write(s, *teacher_topk(SEQ, first.vocab_size, K), tokens=dataset[s]["tokens"])
    _kd(dataset, cache, required=2, tokenizer=first)
    with pytest.raises(CacheError, match=rf"tokenizer differs: the cache's is '{tokenizer_fingerprint(first)}', this "
                                         rf"run's is '{tokenizer_fingerprint(second)}'"):
        _kd(dataset, cache, required=2, tokenizer=second)


def test_another_sequence_length_names_both(built):
    dataset = _dataset(built["prefix"], seq=2 * SEQ)
    with pytest.raises(CacheError, match=rf"sequence length differs: the cache's is {SEQ}, this run's is {2 * SEQ}"):
        _kd(dataset, built["cache"])
