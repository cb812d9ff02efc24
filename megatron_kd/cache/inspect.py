"""``verify`` and ``inspect`` of a teacher cache (the ``megatron-kd cache verify|inspect`` commands)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_kd.cache.codec import CacheError
from megatron_kd.cache.reader import CacheReader
from megatron_kd.cache.store import read_root_meta, stat_regular


def store_bytes(path: Path) -> int:
    """Bytes of every file under ``path``: stats only, links to folders not followed; anything but a
    folder or a regular file (a FIFO, a device, a link to one) is a CacheError naming it."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            st = stat_regular(Path(folder) / name, limit=1 << 62)  # no bound: the size is what is asked
            total += 0 if st is None else st.st_size  # None: a temporary file renamed meanwhile
    return total


def _scan(reader: CacheReader, desc: str, progress: bool):
    """Decode every sample, partition by partition (sequential shards); yield (ids, logprobs) blocks."""
    meta = reader.meta
    block = max(1, meta.rows_per_shard)
    with tqdm(total=meta.num_samples, desc=desc, unit="sample", disable=not progress) as bar:
        for rank in range(meta.dp_size):
            samples = meta.layout.samples_of(rank)
            for i in range(0, len(samples), block):
                ids, lps = reader.read(samples[i:i + block])
                bar.update(len(ids))
                yield ids, lps


def verify(path, *, progress: bool = True) -> dict:
    """Check metadata, every partition's metadata and rows_done, that every shard has its binding
    record naming this store and its place and every shard file its recorded size and SHA-256, and
    that every chunk of every partition, the last block included, decodes (CRC32C-checked).

    Raises CacheError with one line naming the file and the problem; returns a summary.
    """
    reader = CacheReader(path)  # root metadata, schema version, store_id, completion record
    meta = reader.meta
    for rank in range(meta.dp_size):
        # zarr.json of the partition and its arrays, rows_done (every row done), no stray records
        stray = reader._partition(rank).bindings.unexpected_records()
        if stray:
            raise CacheError(f"{stray[0]}: not the binding record of a shard of partition {rank} (records are "
                             f"NNNNNN.json for its {reader._partition(rank).bindings.num_shards} shards)")
    files = reader.check_files()  # every shard has its record, bound to its place; every file its recorded size
    # then every block decodes, each shard file hashed against its record on first touch
    tokens = with_entries = 0
    for ids, lps in _scan(reader, "verify", progress):
        tokens += ids.shape[0] * ids.shape[1]
        valid = ids >= 0
        if (valid != torch.isfinite(lps)).any():
            raise CacheError(f"{path}: decoded padding of ids and log-probs disagree")
        with_entries += int(valid[..., 0].sum())
    return {"path": str(path), "samples": meta.num_samples, "tokens": tokens, "tokens_with_entries": with_entries,
            "files": files, "ok": True}


def inspect(path, *, progress: bool = True) -> dict:
    """Summary of a cache: its codec, mode (draws of a sampled cache), packing, loss mask, sizes,
    bytes/token (every file of the store over its tokens; with a loss mask also over the tokens with
    entries), mean teacher top-K mass, K, vocab, fingerprints."""
    path = Path(path)
    meta = read_root_meta(path)
    summary = {
        "path": str(path), "store_id": meta.store_id, "complete": meta.complete,
        "schema_version": meta.schema_version, "codec": meta.codec,
        "mode": meta.mode, "sampled_draws": meta.sampled_draws, "packing": meta.packing,
        "loss_mask": meta.loss_mask.get("mask", "none"), "loss_mask_fingerprint": meta.loss_mask.get("fingerprint", ""),
        "samples": meta.num_samples, "seq_length": meta.seq_length,
        "tokens": meta.num_samples * meta.seq_length, "topk": meta.topk, "vocab_size": meta.vocab_size,
        "temperature": meta.temperature, "dp_size": meta.dp_size, "micro_batch_size": meta.micro_batch_size,
        "rows_per_shard": meta.rows_per_shard, "bytes": store_bytes(path),
        "teacher_fingerprint": meta.teacher_fingerprint, "tokenizer_fingerprint": meta.tokenizer_fingerprint,
        "dataset_fingerprint": meta.dataset_fingerprint,
    }
    summary["bytes_per_token"] = summary["bytes"] / max(summary["tokens"], 1)
    if meta.complete:
        mass_sum, counted = 0.0, 0
        for ids, lps in _scan(CacheReader(path), "inspect", progress):
            mass = lps.exp().sum(-1)  # padding is -inf -> 0
            has_entries = (ids >= 0).any(-1)
            mass_sum += float(mass[has_entries].double().sum())
            counted += int(has_entries.sum())
        summary["mean_teacher_mass"] = mass_sum / max(counted, 1)
        summary["tokens_with_entries"] = counted
        summary["bytes_per_token_with_entries"] = summary["bytes"] / max(counted, 1)
    return summary
