"""A cache written and read back, measured (bench_cache, bench_cache_fidelity rows): bytes per token on
disk, of the store and of its shard files alone, and write and read rates of one process.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from megatron_kd.cache import CacheReader, CacheWriter
from megatron_kd.cache.inspect import store_bytes


def shard_bytes(path: Path) -> int:
    """Bytes of the ids / logprobs shard files alone (no metadata, records or rows_done)."""
    return sum(p.stat().st_size for name in ("ids", "logprobs") for p in path.glob(f"dp_*/{name}/c/**/*")
               if p.is_file())


def measure(path: Path, pool: list, *, vocab: int, k: int, seq_length: int, samples: int, rows_per_shard: int,
            codec: str, draws: int = 0, repeats: int = 3, tokens=None) -> dict:
    """Write ``samples`` samples (``pool`` reused cyclically) with ``codec``; bytes/token and rates.
    ``tokens``: [len(pool), seq_length] the ids the teacher read for each pool entry (random ids if None)."""
    shutil.rmtree(path, ignore_errors=True)
    meta = {"mode": "sampled", "sampled_draws": draws} if draws else {}
    if tokens is None:
        tokens = torch.randint(0, vocab, (len(pool), seq_length), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    with CacheWriter(path, vocab_size=vocab, topk=k, seq_length=seq_length, num_samples=samples,
                     rows_per_shard=rows_per_shard, metadata=meta, codec=codec) as w:
        for s in range(samples):
            w.write(s, *pool[s % len(pool)], tokens=tokens[s % len(pool)])
    write_s = time.perf_counter() - t0
    tokens = samples * seq_length
    # per repeat: a fresh reader's first pass (each shard file checked against its binding record on
    # first touch), then a later pass of the same reader (a stat per file); best of --repeats, wall
    # clock and this process's CPU time (all threads: steadier than wall time on a shared machine)
    best = {"first": (float("inf"), float("inf")), "later": (float("inf"), float("inf"))}
    for _ in range(repeats):
        reader = CacheReader(path)
        for which in best:
            t0, c0 = time.perf_counter(), time.process_time()
            n = sum(ids.shape[0] for _, ids, _ in reader.prefetch(range(samples)))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best[which] = (min(best[which][0], wall), min(best[which][1], cpu))
    t0 = time.perf_counter()
    reader = CacheReader(path)
    for s in range(samples):
        reader.read(s)
    single_s = time.perf_counter() - t0
    return {"codec": codec, "rows_per_shard": rows_per_shard, "bytes_per_token": store_bytes(path) / tokens,
            "shard_bytes_per_token": shard_bytes(path) / tokens,
            "write_tok_s": tokens / write_s, "first_tok_s": n / best["first"][0], "later_tok_s": n / best["later"][0],
            "first_tok_cpu_s": n / best["first"][1], "later_tok_cpu_s": n / best["later"][1],
            "read_one_by_one_tok_s": tokens / single_s}
