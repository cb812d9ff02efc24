"""Data errors met after start-up stay one line naming the file.

1. a damaged teacher-cache shard read inside a DataLoader worker (num_workers=1, as Megatron's
   --num-workers builds it) reaches the main process as a CacheError whose message is the
   worker's one line (the CLI prints a CacheError's message as its one line)
2. a torn megatron-core dataset index cache (a truncated *.npy, as SIGKILL inside np.save leaves
   it) is removed, said in one line, and rebuilt identical
"""


import numpy as np
import pytest
import torch

from megatron_kd.cache import CacheError, CacheWriter
from megatron_kd.megatron.data import ByteTokenizer, dataset_fingerprint, tokenizer_fingerprint
from megatron_kd.megatron.kd_data import KDDataset
from tests.fixtures.kd_inputs import teacher_topk
from tests.fixtures.tiny_teacher import SEQ, make_dataset

K, N = 4, 6


def _cache(path, dataset):
    tok = ByteTokenizer()
    meta = {"tokenizer_fingerprint": tokenizer_fingerprint(tok), "dataset_fingerprint": dataset_fingerprint(dataset)}
    with CacheWriter(path, vocab_size=tok.vocab_size, topk=K, seq_length=SEQ, num_samples=N, metadata=meta) as w:
        for s in w.pending_samples():
            ids, lps = teacher_topk(SEQ, tok.vocab_size, K)
            w.write(int(s), ids, lps, tokens=dataset[int(s)]["tokens"])
    return path


def test_cache_error_in_a_dataloader_worker_is_one_line(tmp_path, seed):
    dataset = make_dataset(tmp_path, num_samples=N)
    store = _cache(tmp_path / "cache", dataset)
    kd = KDDataset(dataset, str(store), tokenizer=ByteTokenizer(), required_samples=N)
    shards = sorted(p for p in (store / "dp_00000" / "ids" / "c").rglob("*") if p.is_file())
    damaged = shards[int(np.random.default_rng(seed).integers(len(shards)))]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    loader = torch.utils.data.DataLoader(kd, batch_size=1, num_workers=1)
    with pytest.raises(CacheError) as e:
        for _ in loader:
            pass
    message = str(e.value)
    assert "\n" not in message and str(damaged) in message and "DataLoader worker" not in message, message



def test_torn_index_cache_is_rebuilt(tmp_path, capsys):
    before = make_dataset(tmp_path, num_samples=N)
    samples = [before[i]["tokens"].clone() for i in range(N)]
    cache = tmp_path / "data" / "cache"
    shuffle = next(cache.glob("*-shuffle_index.npy"))
    # what SIGKILL inside the last np.save leaves: every file present, the last one cut short
    shuffle.write_bytes(shuffle.read_bytes()[:-8])
    capsys.readouterr()
    after = make_dataset(tmp_path, num_samples=N)
    err = capsys.readouterr().err.strip().splitlines()
    said = [line for line in err if line.startswith("megatron_kd: dataset index cache")]
    assert len(said) == 1 and str(cache) in said[0] and shuffle.name in said[0], err
    assert all(torch.equal(after[i]["tokens"], samples[i]) for i in range(N))
    np.load(shuffle, mmap_mode="r")  # written again, whole
