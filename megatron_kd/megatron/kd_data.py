"""Joining the teacher cache to a Megatron GPT dataset, and getting KD batches onto every rank.

``KDDataset`` wraps a GPTDataset: item i is the dataset's sample i plus its cached teacher ids /
log-probs. Rows are found by content: every cached sample records the digest of the tokens its
teacher read (``megatron_kd.cache.tokens``), and start-up digests each sample the run consumes and
looks it up, so one cache serves every run whose samples it holds, wherever the data lies and
whatever the run's length, batch size, seed or split (where the samples are the same windows of
the same tokens, they are found; where they are not, they are refused). Start-up stops with one
line on anything else that differs (tokenizer, sequence length, vocabulary, packing, loss mask:
the field and both values), on samples the cache lacks ("this run needs 240 samples; the cache
holds 120 of them", with the first lacking one and where it differs), and on a shard file the
run's samples need that is missing. Each read checks the sample's tokens against the digest again
(data rewritten during a run). With a loss mask (``megatron_kd.megatron.loss_mask``) the cache
holds entries only where the mask keeps the loss; every position the sample's loss mask keeps must
have them (a KDDataError otherwise), the others are padding and never reach the loss. Readers are
opened lazily in each process (DataLoader workers prefetch in parallel). A cache error met while
reading a sample is raised as ``KDDataError`` (a CacheError), which keeps its one line when
Megatron's DataLoader re-raises it from a worker process (``megatron_kd.errors.OneLineAcrossProcesses``).

``get_kd_batch`` extends Megatron's ``get_batch_on_this_tp_rank``: TP rank 0 reads the batch and
broadcasts every tensor to its TP group (Megatron's own broadcast covers only fixed keys), then
megatron-core splits the sequence for context parallelism, teacher tensors included.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_kd.cache import CacheError, CacheReader
from megatron_kd.cache.tokens import first_difference, sample_digest
from megatron_kd.errors import OneLineAcrossProcesses
from megatron_kd.megatron.data import tokenizer_fingerprint
from megatron_kd.megatron.loss_mask import loss_mask_field

TEACHER_KEYS = ("teacher_ids", "teacher_logprobs")
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", *TEACHER_KEYS)

# cache field -> (what a user calls it, what makes the two agree)
FIELDS = {
    "tokenizer_fingerprint": ("tokenizer", "a tokenizer of other tokens or another class (the fingerprint hashes "
                              "the class and every token); use the tokenizer the cache was built with"),
    "vocab_size": ("vocabulary size", "the run's --vocab-size / tokenizer must have the teacher's vocabulary"),
    "seq_length": ("sequence length", "the cache holds windows of its --seq-length; train at that length or "
                   "build a cache at this one"),
    "packing": ("packing", "the teacher saw the documents packed so (--reset-attention-mask / "
                "--reset-position-ids); pass the flags the cache was built with"),
}


class KDDataError(OneLineAcrossProcesses, CacheError):
    """A damaged or unreadable teacher cache met while reading a sample (one line, in any process)."""


class KDDataset(torch.utils.data.Dataset):
    def __init__(self, base, cache_path: str, *, tokenizer, vocab_size: int | None = None,
                 required_samples: int | None = None, packing: str = "none", progress: bool = True):
        self.base = base
        self.cache_path = str(cache_path)
        self.expect = {
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": int(vocab_size or tokenizer.vocab_size),
            "seq_length": base.config.sequence_length,
            "packing": packing,  # DocumentPacking.mode: the teacher saw the documents as the student will
        }
        try:
            reader = CacheReader(self.cache_path)
        except CacheError as e:
            raise CacheError(f"--kd-cache does not match this run: {e}") from None
        for field, want in self.expect.items():
            have = getattr(reader.meta, field)
            if have != want:
                name, why = FIELDS[field]
                raise CacheError(f"--kd-cache {self.cache_path}: {name} differs: the cache's is {have!r}, this "
                                 f"run's is {want!r}; {why}")
        self.loss_mask = loss_mask_field(base)
        if reader.meta.loss_mask != self.loss_mask:
            def name(field):
                return f"{field['mask']!r} (fingerprint {field['fingerprint']})" if field else "none (every token)"

            raise CacheError(f"--kd-cache {self.cache_path}: loss mask differs: the cache's teacher rows were taken "
                             f"under {name(reader.meta.loss_mask)}, this run's data has {name(self.loss_mask)}; build "
                             f"the cache from this data (megatron-kd cache build) or train on the data it was built "
                             f"from")
        self.meta = reader.meta
        self._reader, self._pid = reader, os.getpid()
        self._index = None  # digest -> cache sample, built where a sample is not where its index says
        # the samples training will consume (train_iters x global batch), not the whole epoch
        required = len(base) if required_samples is None else required_samples
        started = time.perf_counter()
        self.rows = self._match(required, progress)  # run sample -> the cache sample with its tokens
        self.match_seconds = time.perf_counter() - started
        try:  # cheap (a stat per shard file): a deleted shard must stop start-up, not read as zeros
            reader.check_files(np.unique(self.rows))
        except CacheError as e:
            raise CacheError(f"--kd-cache is damaged: {e}") from None

    def _match(self, required: int, progress: bool) -> np.ndarray:
        """The cache sample whose teacher read the tokens of each of the run's first ``required``
        samples: the same index where its digest agrees (the run reads the build's data), else any
        sample with that digest. CacheError with the count when some are in no sample of the cache."""
        show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
        digests = [sample_digest(self.base[j]["tokens"]) for j in
                   tqdm(range(required), desc="matching samples to the teacher cache", unit="sample",
                        disable=not show or required < 1000)]
        recorded = self.reader.token_entries(np.arange(min(required, self.meta.num_samples)))
        rows = np.arange(required, dtype=np.int64)
        stray = [j for j in range(required) if j >= len(recorded) or recorded[j] is None
                 or recorded[j][0] != digests[j]]
        for j in stray:
            rows[j] = self.index.get(digests[j], -1)
        lacking = np.flatnonzero(rows < 0)
        self.relocated = len(stray) - len(lacking)  # found at another index of the cache than their own
        if len(lacking):
            j = int(lacking[0])
            if j < len(recorded) and recorded[j] is not None:
                first, last = first_difference(recorded[j][1], self.base[j]["tokens"])
                why = (f"the cache's sample {j} was read by the teacher with other tokens (the first differing "
                       f"block: positions {first}..{last}), and no other sample of the cache has this one's")
            else:
                why = "no sample of the cache has its tokens"
            raise CacheError(f"--kd-cache {self.cache_path}: this run needs {required} samples; the cache holds "
                             f"{required - len(lacking)} of them. The first it lacks is sample {j}: {why}. A cache "
                             f"holds the windows of the data it was built from (its data, split, seed and "
                             f"--seq-length); build one from this run's data (megatron-kd cache build)")
        return rows

    @property
    def index(self) -> dict[str, int]:
        if self._index is None:
            self._index = self.reader.content_index()
        return self._index

    def __len__(self) -> int:
        return len(self.base)

    @property
    def reader(self) -> CacheReader:
        if self._pid != os.getpid():  # a DataLoader worker: zarr handles are not fork-safe
            self._reader, self._pid = CacheReader(self.cache_path), os.getpid()
        return self._reader

    def __getitem__(self, idx: int) -> dict:
        idx = int(idx)
        item = dict(self.base[idx])
        digest = sample_digest(item["tokens"])
        row = int(self.rows[idx]) if idx < len(self.rows) else self.index.get(digest, -1)
        if row < 0:
            raise KDDataError(f"--kd-cache {self.cache_path}: sample {idx} of this run (beyond the "
                              f"{len(self.rows)} it was sized for) is in no sample of the cache")
        try:
            ids, logprobs = self.reader.read(row)
            entry = self.reader.token_entries(row)[0]
        except CacheError as e:
            raise KDDataError(f"--kd-cache is damaged: {e}") from None
        if entry[0] != digest:
            first, last = first_difference(entry[1], item["tokens"]) or (0, len(item["tokens"]) - 1)
            raise KDDataError(f"--kd-cache {self.cache_path}: sample {idx} of this run no longer has the tokens the "
                              f"teacher read for the cache's sample {row} (the first differing block: positions "
                              f"{first}..{last}); its data changed after start-up")
        if self.loss_mask:
            uncovered = torch.nonzero((item["loss_mask"] > 0) & (ids[0, :, 0] < 0))
            if len(uncovered):
                raise KDDataError(f"--kd-cache {self.cache_path}: sample {idx} has no teacher entries at "
                                  f"position {int(uncovered[0])}, where this run's loss mask keeps the loss (the cache "
                                  f"was built under another mask or other Megatron-LM data flags)")
        item["sample_idx"] = torch.tensor(idx)
        item["teacher_ids"], item["teacher_logprobs"] = ids[0], logprobs[0]
        return item


def get_kd_batch(data_iterator, *, tp_group=None, cp_group=None, device=None) -> dict:
    """The micro-batch on every rank of the TP group: tokens, labels, loss_mask, position_ids
    [b, s], plus teacher_ids / teacher_logprobs [b, s, K] when the dataset carries them
    (the KD training split; validation splits do not)."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    if tp == 1 or dist.get_rank(tp_group) == 0:
        data = next(data_iterator)
        keys = BATCH_KEYS if TEACHER_KEYS[0] in data else BATCH_KEYS[:4]
        batch = {k: data[k].to(device, non_blocking=True) for k in keys}
    if tp > 1:
        src = dist.get_global_rank(tp_group, 0)
        if dist.get_rank(tp_group) == 0:
            b, s = batch["tokens"].shape
            k = batch["teacher_ids"].shape[-1] if "teacher_ids" in batch else 0
            header = torch.tensor([b, s, k], dtype=torch.int64, device=device)
        else:
            header = torch.empty(3, dtype=torch.int64, device=device)
        dist.broadcast(header, src, group=tp_group)
        b, s, k = (int(x) for x in header)
        if dist.get_rank(tp_group) != 0:
            spec = {"tokens": ((b, s), torch.int64), "labels": ((b, s), torch.int64),
                    "loss_mask": ((b, s), torch.float32), "position_ids": ((b, s), torch.int64),
                    "teacher_ids": ((b, s, k), torch.int32), "teacher_logprobs": ((b, s, k), torch.float32)}
            keys = BATCH_KEYS if k else BATCH_KEYS[:4]
            batch = {key: torch.empty(spec[key][0], dtype=spec[key][1], device=device) for key in keys}
        for key in batch:
            batch[key] = batch[key].contiguous()
            dist.broadcast(batch[key], src, group=tp_group)
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        # megatron-core's own zigzag split (chunks r and 2·cp-1-r of the sequence), applied to every
        # key along dim 1, teacher tensors included, so they stay aligned with the tokens
        from megatron.core.utils import get_batch_on_this_cp_rank

        batch = get_batch_on_this_cp_rank({**batch, "cu_seqlens": None}, is_hybrid_cp=False, cp_group=cp_group)
        batch.pop("cu_seqlens")
    return batch
