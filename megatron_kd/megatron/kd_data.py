"""Joining the teacher cache to a Megatron GPT dataset, and getting KD batches onto every rank.

``KDDataset`` wraps a GPTDataset: item i is the dataset's sample i plus its global index and its
cached teacher ids / log-probs. Start-up checks the cache against the run (vocabulary, K,
sequence length, tokenizer and dataset fingerprints, the loss mask of chat data) and that every
shard file the run's samples need is there, and stops with one clear message on any difference.
With a loss mask (``megatron_kd.megatron.loss_mask``) the cache holds entries only where the mask keeps
the loss; every position the sample's loss mask keeps must have them (a KDDataError otherwise),
the others are padding and never reach the loss (their loss mask is 0). Readers are opened lazily in
each process (DataLoader workers prefetch in parallel). A cache error met while reading a sample
is raised as ``KDDataError`` (a CacheError), which keeps its one line when Megatron's DataLoader
re-raises it from a worker process (``megatron_kd.errors.OneLineAcrossProcesses``).

``get_kd_batch`` extends Megatron's ``get_batch_on_this_tp_rank``: TP rank 0 reads the batch and
broadcasts every tensor to its TP group (Megatron's own broadcast covers only fixed keys), then
megatron-core splits the sequence for context parallelism, teacher tensors included.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_kd.cache import CacheError, CacheReader
from megatron_kd.megatron.loss_mask import loss_mask_field
from megatron_kd.errors import OneLineAcrossProcesses
from megatron_kd.megatron.data import dataset_fingerprint, tokenizer_fingerprint

TEACHER_KEYS = ("teacher_ids", "teacher_logprobs")
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", *TEACHER_KEYS)


class KDDataError(OneLineAcrossProcesses, CacheError):
    """A damaged or unreadable teacher cache met while reading a sample (one line, in any process)."""


class KDDataset(torch.utils.data.Dataset):
    def __init__(self, base, cache_path: str, *, tokenizer, vocab_size: int | None = None,
                 required_samples: int | None = None, packing: str = "none"):
        self.base = base
        self.cache_path = str(cache_path)
        seq_length = base.config.sequence_length
        self.expect = {
            "seq_length": seq_length,
            "dataset_fingerprint": dataset_fingerprint(base),
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": int(vocab_size or tokenizer.vocab_size),
            "packing": packing,  # DocumentPacking.mode: the teacher saw the documents as the student will
        }
        try:
            reader = CacheReader(self.cache_path, expect=self.expect)
        except CacheError as e:
            raise CacheError(f"--kd-cache does not match this run: {e}") from None
        self.loss_mask = loss_mask_field(base)
        if reader.meta.loss_mask != self.loss_mask:
            def name(field):
                return f"{field['mask']!r} (fingerprint {field['fingerprint']})" if field else "none (every token)"

            raise CacheError(f"--kd-cache {self.cache_path}: its teacher rows were taken under the loss mask "
                             f"{name(reader.meta.loss_mask)}, this run's data has {name(self.loss_mask)}; build the "
                             f"cache from this data (megatron-kd cache build) or train on the data it was built from")
        # the samples training will consume (train_iters x global batch), not the whole epoch
        required = len(base) if required_samples is None else required_samples
        if reader.meta.num_samples < required:
            raise CacheError(f"--kd-cache {self.cache_path}: holds {reader.meta.num_samples} samples, this run "
                             f"consumes {required}; build the cache with the run's --train-iters / batch size")
        try:  # cheap (a stat per shard file): a deleted shard must stop start-up, not read as zeros
            reader.check_files(range(required))
        except CacheError as e:
            raise CacheError(f"--kd-cache is damaged: {e}") from None
        self.meta = reader.meta
        self._reader, self._pid = reader, os.getpid()

    def __len__(self) -> int:
        return len(self.base)

    @property
    def reader(self) -> CacheReader:
        if self._pid != os.getpid():  # a DataLoader worker: zarr handles are not fork-safe
            self._reader, self._pid = CacheReader(self.cache_path), os.getpid()
        return self._reader

    def __getitem__(self, idx: int) -> dict:
        item = dict(self.base[idx])
        try:
            ids, logprobs = self.reader.read(int(idx))
        except CacheError as e:
            raise KDDataError(f"--kd-cache is damaged: {e}") from None
        if self.loss_mask:
            uncovered = torch.nonzero((item["loss_mask"] > 0) & (ids[0, :, 0] < 0))
            if len(uncovered):
                raise KDDataError(f"--kd-cache {self.cache_path}: sample {int(idx)} has no teacher entries at "
                                  f"position {int(uncovered[0])}, where this run's loss mask keeps the loss (the cache "
                                  f"was built under another mask or other Megatron-LM data flags)")
        item["sample_idx"] = torch.tensor(int(idx))
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
