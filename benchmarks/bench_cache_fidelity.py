"""Cache codecs on real teacher rows, and the sampled cache's draws against distillation quality.

    python -m benchmarks.bench_cache_fidelity rows --size cpu --out /tmp/cache-rows
    python -m benchmarks.bench_cache_fidelity rows --size cpu --out /tmp/cache-rows-8k \\
        --set vocab=8192 --set corpus_bytes=3000000 --set bpe_bytes=3000000
    python -m benchmarks.bench_cache_fidelity sweep --size cpu --out /tmp/cache-sweep
    python -m benchmarks.bench_cache_fidelity sweep --size gpu --out runs/cache-sweep [--resume]
    python -m benchmarks.bench_cache_fidelity quality --size cpu --out /tmp/cache-quality \
        --codecs topk-v2,topk-v3 --tails renorm,ghost,none

``rows``: the fidelity benchmark's corpus, BPE and teacher (benchmarks/bench_fidelity.py, its
preset and ``--set`` overrides), then its teacher pass (``capture_teacher``) over ``--rows`` of the
student's samples, kept in memory: a top-K stream (``--topk``) and a sampled stream per number of
draws (``--draws``). Each stream is written as a cache once per codec that can hold it (top-K:
topk-v1, topk-v2; sampled: topk-v1, sampled-counts-v1) and measured as bench_cache.py measures
(bytes/token of the whole store and of its shard files alone, write rate, read+decode rates of a
fresh reader's first pass, of a later pass, and sample by sample). Unlike bench_cache.py's
i.i.d. synthetic rows, neighbouring tokens here are a real LM's: their top-K sets overlap.

``sweep``: bench_fidelity's run with the variants ce, online, sampled{N} for every N of
``--draws`` and top100-renorm: one teacher, one student recipe and step count, a sampled cache of
its own per N (written with the default codec, sampled-counts-v1). Reports held-out CE and
KL(T||S) against online KD and against bytes/token on disk, and which configurations meet the
target (<= 40 bytes/token and held-out CE within 1% of online KD).

``quality``: a lossy codec against a lossless one on the student it trains. One teacher pass over
every student sample (top-``--topk``), kept in memory; the same rows written once per codec of
``--codecs``; then bench_fidelity's student (same initialization, data order and recipe) trained
once per codec and tail of ``--tails`` on each cache. The only difference between the runs of one
tail is the codec's rounding of the log-probs. Reports held-out CE and KL(T||S) per run and the
paired difference to the first codec.

OUT/rows.json, OUT/rows.md, OUT/sweep.json, OUT/sweep.md or OUT/quality.json, OUT/quality.md hold
the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

import benchmarks.common.fidelity as bf
from benchmarks.common.cache_measure import measure

TOP_K_CODECS = ("topk-v1", "topk-v2", "topk-v3")
SAMPLED_CODECS = ("topk-v1", "sampled-counts-v1")
TARGET_BYTES, TARGET_GAP = 40.0, 0.01


def teacher_streams(bench: bf.Bench, rows: int, topk: int, draws: list[int]) -> dict:
    """name -> (mode, K, pool of (ids, logprobs) per sample) from the bench's teacher pass, written
    to a lossless cache of the mode's default codec (topk-v2, sampled-counts-v1) under the bench's
    work directory and read back."""
    from megatron_kd.cache import CacheReader, CacheWriter
    from megatron_kd.teacher import CaptureConfig, MegatronTeacher, capture_teacher

    teacher = MegatronTeacher(bf.Autocast(bench.teacher, bench.dtype), vocab_size=bench.vocab, fingerprint="rows")
    out = {}
    for mode, k in [("topk", topk), *(("sampled", n) for n in draws)]:
        name = f"top{k}" if mode == "topk" else f"sampled{k}"
        path = bench.work / "streams" / name
        shutil.rmtree(path, ignore_errors=True)
        meta = {"mode": "sampled", "sampled_draws": k} if mode == "sampled" else None
        writer = CacheWriter(path, vocab_size=bench.vocab, topk=k, seq_length=bench.p.seq_length, num_samples=rows,
                             metadata=meta)
        capture_teacher(teacher, bench.student_ds, writer,
                        CaptureConfig(topk=k, mode=mode, micro_batch_size=bench.p.micro_batch_size, seed=bench.p.seed),
                        device=bench.device, progress=False)
        assert writer.close(), f"{path}: the teacher pass left samples unwritten"
        reader = CacheReader(path)
        out[name] = (mode, k, [tuple(t[0] for t in reader.read([i])) for i in range(rows)])
    return out


def student_tokens(bench: bf.Bench, rows: int) -> np.ndarray:
    """[rows, seq_length] the tokens of the bench's first student samples: what the teacher pass read."""
    return np.stack([np.asarray(bench.student_ds[i]["tokens"]) for i in range(rows)])


def run_rows(args, preset: bf.Preset, out: Path) -> dict:
    bench = bf.Bench(preset, out, bf.default_device(), bf.autocast_dtype("auto", bf.default_device()), log)
    if not (args.resume and bench.resume()):
        shutil.rmtree(out / "work", ignore_errors=True)
    bench.work.mkdir(parents=True, exist_ok=True)
    bench.build_data()
    bench.train_teacher()
    rows = min(args.rows, preset.student_steps * preset.micro_batch_size)
    t = time.perf_counter()
    streams = teacher_streams(bench, rows, args.topk, args.draws)
    log(f"teacher pass: {rows} samples x {preset.seq_length} tokens per stream, {time.perf_counter() - t:.0f} s")
    results = {"preset": bench.results["preset"], "teacher": {k: bench.results["teacher"][k]
                                                              for k in ("parameters", "steps", "heldout_ce")},
               "vocab": bench.vocab, "rows": rows, "seq_length": preset.seq_length, "streams": {}}
    tokens = student_tokens(bench, rows)
    for name, (mode, k, pool) in streams.items():
        ids = torch.stack([p[0] for p in pool])
        distinct = float((ids >= 0).sum(-1).double().mean())
        entry = {"mode": mode, "k": k, "mean_entries": distinct, "codecs": {}}
        for codec in (TOP_K_CODECS if mode == "topk" else SAMPLED_CODECS):
            r = measure(bench.work / "measure" / f"{name}-{codec}", pool, vocab=bench.vocab, k=k,
                        seq_length=preset.seq_length, samples=rows, rows_per_shard=args.rows_per_shard,
                        codec=codec, draws=k if mode == "sampled" else 0, repeats=args.repeats, tokens=tokens)
            entry["codecs"][codec] = r
            log(f"{name} {codec}: {r['bytes_per_token']:.1f} bytes/token ({r['shard_bytes_per_token']:.1f} in shard "
                f"files), read {r['later_tok_s']:.3g} tok/s (first pass {r['first_tok_s']:.3g})")
        results["streams"][name] = entry
    shutil.rmtree(bench.work / "measure", ignore_errors=True)
    bench.tb.close()
    return results


def rows_markdown(r: dict) -> str:
    p = r["preset"]
    lines = [f"# Cache codecs on teacher rows (BPE {r['vocab']:,}, {r['rows']} x {r['seq_length']} tokens)", "",
             f"Teacher {r['teacher']['parameters']:,} parameters, {r['teacher']['steps']} steps, held-out CE "
             f"{r['teacher']['heldout_ce']:.4f}; preset corpus {p['corpus_bytes']:,} bytes.", "",
             "| stream | entries/token | codec | bytes/token | shard files B/token | write tok/s | read tok/s "
             "(later pass) | first pass | read(1 sample) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in r["streams"].items():
        for codec, c in s["codecs"].items():
            lines.append(f"| {name} | {s['mean_entries']:.1f} | {codec} | {c['bytes_per_token']:.1f} | "
                         f"{c['shard_bytes_per_token']:.1f} | {c['write_tok_s']:.3g} | {c['later_tok_s']:.3g} | "
                         f"{c['first_tok_s']:.3g} | {c['read_one_by_one_tok_s']:.3g} |")
    return "\n".join(lines) + "\n"


def run_quality(args, preset: bf.Preset, out: Path) -> dict:
    from megatron_kd.cache import CacheWriter
    from megatron_kd.cache.inspect import store_bytes
    from megatron_kd.megatron.data import dataset_fingerprint, tokenizer_fingerprint

    bench = bf.Bench(preset, out, bf.default_device(), bf.autocast_dtype("auto", bf.default_device()), log)
    shutil.rmtree(out / "work", ignore_errors=True)
    shutil.rmtree(out / "tensorboard", ignore_errors=True)
    bench.work.mkdir(parents=True, exist_ok=True)
    bench.build_data()
    bench.train_teacher()
    samples = preset.student_steps * preset.micro_batch_size
    t = time.perf_counter()
    (_, k, pool), = teacher_streams(bench, samples, args.topk, []).values()
    log(f"teacher pass: {samples} samples x {preset.seq_length} tokens, top-{k}, {time.perf_counter() - t:.0f} s")
    meta = {"mode": "topk", "packing": bench.packing.mode, "teacher_fingerprint": "bench-cache-fidelity-quality",
            "tokenizer_fingerprint": tokenizer_fingerprint(bench.tok),
            "dataset_fingerprint": dataset_fingerprint(bench.student_ds)}
    results = {"preset": bench.results["preset"], "teacher": {key: bench.results["teacher"][key]
                                                              for key in ("parameters", "steps", "heldout_ce")},
               "vocab": bench.vocab, "topk": k, "samples": samples, "codecs": {}, "runs": {}}
    cache = f"top{k}"
    tokens = student_tokens(bench, samples)
    for codec in args.codecs:
        path = bench.work / "caches" / f"{cache}-{codec}"
        with CacheWriter(path, vocab_size=bench.vocab, topk=k, seq_length=preset.seq_length, num_samples=samples,
                         micro_batch_size=preset.micro_batch_size, metadata=meta, codec=codec) as w:
            for sample, (ids, lps) in enumerate(pool):
                w.write(sample, ids, lps, tokens=tokens[sample])
        results["codecs"][codec] = {"bytes_per_token": store_bytes(path) / (samples * preset.seq_length)}
        bench.caches[cache], bench.results["caches"][cache] = path, results["codecs"][codec]
        for tail in args.tails:
            v = replace(bf.parse_variant(f"{cache}-{tail}"), name=f"{cache}-{tail} {codec}")
            bench.train_student(v)
            r = bench.results["variants"][v.name]
            results["runs"][v.name] = {"codec": codec, "tail": tail, "heldout_ce": r["heldout_ce"],
                                       "heldout_kl": r["heldout_kl"]}
    bench.tb.close()
    shutil.rmtree(out / "work", ignore_errors=True)
    return results


def quality_markdown(r: dict) -> str:
    first = next(iter(r["codecs"]))
    lines = [f"# Codec quality on the student (BPE {r['vocab']:,}, top-{r['topk']}, {r['samples']} samples)", "",
             f"Teacher {r['teacher']['parameters']:,} parameters, held-out CE {r['teacher']['heldout_ce']:.4f}. "
             f"Paired runs: the same student start, data order and recipe; only the cache's codec differs.", "",
             "| tail | codec | bytes/token | held-out CE | vs " + first + " | KL(T‖S) | KL vs " + first + " |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for run in r["runs"].values():
        base = r["runs"][f"top{r['topk']}-{run['tail']} {first}"]
        lines.append(f"| {run['tail']} | {run['codec']} | {r['codecs'][run['codec']]['bytes_per_token']:.1f} | "
                     f"{run['heldout_ce']:.4f} | {run['heldout_ce'] / base['heldout_ce'] - 1:+.3%} | "
                     f"{run['heldout_kl']:.4f} | {run['heldout_kl'] / base['heldout_kl'] - 1:+.2%} |")
    return "\n".join(lines) + "\n"


def sweep_variants(draws: list[int]) -> list[str]:
    return ["ce", "online", *(f"sampled{n}" for n in draws), "top100-renorm"]


def sweep_summary(results: dict) -> dict:
    v, caches = results["variants"], results["caches"]
    online = v["online"]
    rows = []
    for name, r in v.items():
        if r["kind"] not in ("sampled", "topk"):
            continue
        cache = caches[f"{'sampled' if r['kind'] == 'sampled' else 'top'}{r['k']}"]
        gap = r["heldout_ce"] / online["heldout_ce"] - 1
        rows.append({"variant": name, "bytes_per_token": cache["bytes_per_token"], "heldout_ce": r["heldout_ce"],
                     "vs_online": gap, "heldout_kl": r["heldout_kl"], "kl_vs_online": r["heldout_kl"] / online["heldout_kl"] - 1,
                     "meets": cache["bytes_per_token"] <= TARGET_BYTES and gap <= TARGET_GAP})
    return {"online": {"heldout_ce": online["heldout_ce"], "heldout_kl": online["heldout_kl"]},
            "ce_only": v.get("ce", {}).get("heldout_ce"), "rows": rows}


def sweep_markdown(results: dict, summary: dict) -> str:
    o = summary["online"]
    lines = [f"# Sampled cache draws vs online KD ({results['device']}, preset {results['preset']['vocab']:,} BPE)", "",
             f"Online full-vocabulary KD: held-out CE {o['heldout_ce']:.4f}, KL(T||S) {o['heldout_kl']:.4f}; CE only "
             f"{summary['ce_only']:.4f}. Target: <= {TARGET_BYTES:.0f} bytes/token and CE within "
             f"{TARGET_GAP:.0%} of online.", "",
             "| variant | bytes/token | held-out CE | vs online | KL(T‖S) | KL vs online | target |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in summary["rows"]:
        lines.append(f"| {r['variant']} | {r['bytes_per_token']:.1f} | {r['heldout_ce']:.4f} | {r['vs_online']:+.2%} | "
                     f"{r['heldout_kl']:.4f} | {r['kl_vs_online']:+.1%} | {'met' if r['meets'] else ''} |")
    return "\n".join(lines) + "\n"


def log(msg: str):
    print(msg, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("rows", "sweep", "quality"))
    parser.add_argument("--size", choices=sorted(bf.PRESETS), default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a preset field (bench_fidelity)")
    parser.add_argument("--draws", default="8,16,32,64,128", help="sampled caches: draws per token")
    parser.add_argument("--topk", type=int, default=100, help="rows: K of the top-K stream")
    parser.add_argument("--rows", type=int, default=128, help="rows: samples per stream")
    parser.add_argument("--rows-per-shard", type=int, default=32, help="rows: samples per shard file")
    parser.add_argument("--repeats", type=int, default=3, help="rows: read passes (best of)")
    parser.add_argument("--codecs", default="topk-v2,topk-v3", help="quality: top-K codecs, the reference first")
    parser.add_argument("--tails", default="renorm,ghost,none", help="quality: loss tails")
    parser.add_argument("--resume", action="store_true", help="continue a stopped run in --out (same settings)")
    args = parser.parse_args(argv)
    try:
        args.draws = [int(x) for x in args.draws.split(",") if x.strip()]
        args.codecs = [c for c in args.codecs.split(",") if c.strip()]
        args.tails = [t for t in args.tails.split(",") if t.strip()]
        preset = replace(bf.PRESETS[args.size], **bf.preset_overrides(args.set))
    except ValueError as e:
        parser.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    from megatron_kd.demo import _init_single_process

    if bf.default_device().type == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.what in ("rows", "quality"):
        _init_single_process()
        if bf.default_device().type == "cuda":
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(preset.seed)
        if args.what == "quality":
            results = run_quality(args, preset, args.out)
            (args.out / "quality.json").write_text(json.dumps(results, indent=1))
            (args.out / "quality.md").write_text(quality_markdown(results))
            print(quality_markdown(results))
            return 0
        results = run_rows(args, preset, args.out)
        (args.out / "rows.json").write_text(json.dumps(results, indent=1))
        (args.out / "rows.md").write_text(rows_markdown(results))
        print(rows_markdown(results))
        return 0
    results = bf.run(args.size, args.out / "fidelity", sweep_variants(args.draws), log=log, resume=args.resume,
                     **bf.preset_overrides(args.set))
    summary = sweep_summary(results)
    (args.out / "sweep.json").write_text(json.dumps({"summary": summary, "caches": results["caches"]}, indent=1))
    (args.out / "sweep.md").write_text(sweep_markdown(results, summary))
    print(sweep_markdown(results, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
