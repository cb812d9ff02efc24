"""Teacher cache: bytes per token on disk and read+decode throughput of one process (CPU).

    python -m benchmarks.bench_cache                       # K=100, V=201,088, 64 samples x 2048 tokens
    python -m benchmarks.bench_cache --samples 16 --seq-length 4096 --rows-per-shard 4,16
    python -m benchmarks.bench_cache --pool 1 --pool-dir /tmp/pools   # A/B of two checkouts: same data
    python -m benchmarks.bench_cache --draws 16 --codecs topk-v1,sampled-counts-v1   # sampled caches

Every cache is written once per codec (``--codecs``, default topk-v1, topk-v2 and topk-v3; with
--draws, topk-v1 and sampled-counts-v1) from the same rows. topk-v3 rounds the probabilities
(encodings.py: within 6.5% of p, of 1 - p near 1, 1.6e-5 below 2^-12); the others keep topk-v1's
1/257-nat log-probs or the exact draw counts. ``--draws N`` makes sampled rows instead of
top-K ones: N draws per token from the same teacher-like distribution, as the teacher pass stores
them (distinct ids with log(count / N)). Real teacher rows: benchmarks/bench_cache_fidelity.py.

Read rates (prefetch of every sample, the store in the page cache, best of --repeats): a fresh
CacheReader's first pass (decoding plus the first-touch check of each shard file against its binding
record: read whole, CRC32C) and a later pass of the same reader (decoding plus a stat per file), in
wall-clock tokens/s and tokens per CPU-second of the process.

Data is teacher-like (tests/fixtures/kd_inputs.teacher_topk: Student-t logits, mean top-1 p ~0.5, top-100
mass ~0.9), once with uniform ids (the worst case for id compression) and once with a Zipf(1)
unigram prior on ids (real LM top-K lists favour frequent, i.e. low BPE, ids). Naive storage
(int32 ids + bf16 values) is 600 bytes/token at K=100. Positions are independent: the top-K sets
of neighbouring tokens overlap no more than chance, so a codec's gains here do not come from
repeats between neighbours (a real teacher's rows: bench_cache_fidelity.py rows).

Keep --pool >= --samples for bytes/token of topk-v2, topk-v3 and sampled-counts-v1: their zstd streams span
a whole zarr chunk, which can hold several samples, so repeated pool samples compress against each
other (measured 2026-12-01, 32 draws, V=201,088: 6.3 / 3.2 bytes/token with --pool 2 at 8 / 32 rows
per shard, 25.2 with 4 distinct samples). topk-v1's Blosc blocks are too short to see the repeats.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from benchmarks.common.cache_measure import measure
from tests.fixtures.kd_inputs import sampled_rows, teacher_topk


def make_pool(args, zipf: float) -> list:
    """A pool of distinct samples, generated once (the full-vocabulary softmax is the slow part:
    minutes per sample at V=201,088 on a busy 2-core machine); with --pool-dir kept there and reused,
    so that A/B runs of two checkouts read the very same data."""
    file = None
    if args.pool_dir is not None:
        kind = f"d{args.draws}" if args.draws else f"k{args.topk}"
        file = args.pool_dir / f"pool-v{args.vocab}-{kind}-s{args.seq_length}-n{args.pool}-zipf{zipf}.pt"
        if file.exists():
            return torch.load(file)
    torch.manual_seed(0)
    make = sampled_rows if args.draws else teacher_topk
    pool = [make(args.seq_length, args.vocab, args.draws or args.topk, zipf=zipf) for _ in range(args.pool)]
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(pool, file)
    return pool


def run(args, zipf: float, rows_per_shard: int, codec: str, workdir: Path) -> dict:
    path = workdir / f"cache-zipf{zipf}-rps{rows_per_shard}-{codec}"
    r = measure(path, make_pool(args, zipf), vocab=args.vocab, k=args.draws or args.topk, seq_length=args.seq_length,
                samples=args.samples, rows_per_shard=rows_per_shard, codec=codec, draws=args.draws,
                repeats=args.repeats)
    shutil.rmtree(path, ignore_errors=True)
    return {"zipf": zipf, **r}


def print_table(rows: list[dict], first: str = "ids") -> None:
    print(f"\n{first:10} {'codec':18} {'rows/shard':>10} {'bytes/token':>12} {'shards B/tok':>12} {'write tok/s':>12} "
          f"{'1st pass tok/s':>15} {'later tok/s':>12} {'1st tok/CPU-s':>14} {'later tok/CPU-s':>16} "
          f"{'read(1) tok/s':>14}")
    for r in rows:
        label = r.get("label") or ("zipf(1)" if r.get("zipf") else "uniform")
        print(f"{label:10} {r['codec']:18} {r['rows_per_shard']:>10} {r['bytes_per_token']:>12.1f} "
              f"{r['shard_bytes_per_token']:>12.1f} {r['write_tok_s']:>12.3g} {r['first_tok_s']:>15.3g} "
              f"{r['later_tok_s']:>12.3g} {r['first_tok_cpu_s']:>14.3g} {r['later_tok_cpu_s']:>16.3g} "
              f"{r['read_one_by_one_tok_s']:>14.3g}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=201_088)
    p.add_argument("--topk", type=int, default=100)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--pool", type=int, default=8, help="distinct generated samples (reused cyclically)")
    p.add_argument("--rows-per-shard", default="8,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--pool-dir", type=Path, default=None, help="keep generated sample pools here and reuse them")
    p.add_argument("--draws", type=int, default=0, help="sampled rows: this many draws per token (0: top-K rows)")
    p.add_argument("--codecs", default=None, help="comma-separated codecs (default: topk-v1 and the mode's new one)")
    args = p.parse_args()
    codecs = (args.codecs or ("topk-v1,sampled-counts-v1" if args.draws else "topk-v1,topk-v2,topk-v3")).split(",")
    if args.pool < args.samples and any(c != "topk-v1" for c in codecs):
        print(f"note: --pool {args.pool} < --samples {args.samples}: repeated samples inside a chunk understate the "
              f"bytes/token of {', '.join(c for c in codecs if c != 'topk-v1')} (use --pool >= --samples)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_cache_"))
    print(f"torch threads {torch.get_num_threads()}, {f'{args.draws} draws' if args.draws else f'K={args.topk}'}, "
          f"V={args.vocab}, "
          f"{args.samples} samples x {args.seq_length} tokens, workdir {workdir}")
    rows = []
    for zipf in (0.0, 1.0):
        for rps in map(int, args.rows_per_shard.split(",")):
            for codec in codecs:
                r = run(args, zipf, rps, codec, workdir)
                rows.append(r)
                print(r, flush=True)
    print_table(rows)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
