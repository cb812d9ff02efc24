"""GPT-OSS students at full depth through ``megatron-kd train`` on one node: step time, model
TFLOP/s per GPU and peak memory per loss path, against ``megatron-kd plan``.

    python benchmarks/bench_node.py --size 20b --gpus 8 --out runs/node20b                # fused, ce, dense
    python benchmarks/bench_node.py --size 120b --gpus 8 --experts 64 --losses fused --out runs/node120b
    python benchmarks/bench_node.py --size 20b --gpus 1 --layers 2 --experts 4 --seq 4096 --iters 3   # smoke run

What runs is what users run: torchrun, ``megatron-kd train`` with the recipe's flags
(examples/gpt_oss: architecture, size and its one-node layout, expert parallelism capped at
``--gpus``), ``--bf16 --calculate-per-token-loss``, Megatron's optimizer step included. Only the
values are synthetic, because no checkpoint reaches the machine and neither memory nor speed depends
on them: random-initialized weights, uniformly random tokens, and a teacher cache that
``megatron-kd cache build`` writes from a tiny random Hugging Face teacher whose logits are scaled to
teacher-like distributions (top-1 probability ~0.4, top-100 mass ~0.93).

Per loss path, one ``megatron-kd train`` run:
  fused  fused top-K KD from the cache (the default path)
  ce     no teacher, Megatron's output layer + cross-entropy (``--kd-ce-impl megatron``)
  fused-ce  no teacher, cross-entropy through the fused op (the default without a cache)
  dense  KD on materialized logits (``--kd-impl dense``; expected out of memory at 32K)
Reported from Megatron's own log: median time per iteration after the first two, peak allocated
memory (``--log-memory-interval``, data-parallel rank 0), out-of-memory if it happens. Model FLOPs
per step are the matmuls of forward and backward (``bench_gptoss.model_flops``; recompute not
counted), so TFLOP/s per GPU = FLOPs per step / GPUs / step time. Every stage is kept in ``--out``
and skipped when re-run (data, teacher, cache, finished losses).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

VOCAB = 201088  # GPT-OSS's embedding rows; NullTokenizer ids 0..201086, end-of-document 201087
TEACHER_HIDDEN = 64
TEACHER_LOGIT_STD = 5.5  # Gaussian logits over 201,088 ids: top-1 p ~0.4, top-100 mass ~0.93
LOSSES = ("fused", "ce", "fused-ce", "dense")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("20b", "120b"), default="20b")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--layers", type=int, default=None, help="override the recipe's depth")
    p.add_argument("--experts", type=int, default=None, help="override the recipe's number of experts")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--global-batch-size", type=int, default=None, help="default: 2 micro-batches per GPU")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--losses", default="fused,ce,dense")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per training run")
    p.add_argument("--out", type=Path, default=Path("runs/node"))
    opts = p.parse_args(argv)
    opts.global_batch_size = opts.global_batch_size or 2 * opts.gpus
    opts.out = opts.out.resolve()  # the launcher runs from the repository root
    unknown = set(opts.losses.split(",")) - set(LOSSES)
    if unknown:
        p.error(f"unknown losses {sorted(unknown)}: choose from {LOSSES}")
    return opts


def data_flags(opts, data_prefix: str) -> list[str]:
    """Flags the cache build and every training run share (the cache is keyed by their samples)."""
    return ["--data-path", data_prefix, "--split", "100,0,0", "--seq-length", str(opts.seq), "--seed", "1234",
            "--train-iters", str(opts.iters), "--global-batch-size", str(opts.global_batch_size),
            "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--data-cache-path", str(opts.out / "work" / "index-cache"), "--num-workers", "2",
            "--eval-iters", "0", "--eval-interval", "1000000"]


def no_te_flags() -> list[str]:
    if importlib.util.find_spec("transformer_engine"):
        return []
    return ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
            "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"]


def student_flags(opts) -> list[str]:
    from tiny_gpt_oss import recipe_flags

    flags = [*recipe_flags(opts.size), *no_te_flags(), "--seq-length", str(opts.seq),
             "--expert-model-parallel-size", str(min(8, opts.gpus))]
    if opts.layers:
        flags += ["--num-layers", str(opts.layers)]
    if opts.experts:
        flags += ["--num-experts", str(opts.experts)]
    return flags


def write_data(opts) -> str:
    """Uniformly random documents of 8K tokens, enough for every sample the runs read."""
    import numpy as np

    from megatron_kd.megatron.data import write_indexed_dataset

    prefix = opts.out / "work" / "data" / "random"
    if not Path(str(prefix) + ".idx").exists():
        tokens = math.ceil(1.1 * opts.global_batch_size * opts.iters * (opts.seq + 1)) + 8192
        rng = np.random.default_rng(0)
        docs = ([*rng.integers(0, VOCAB - 1, size=8191), VOCAB - 1] for _ in range(tokens // 8192 + 1))
        write_indexed_dataset(prefix, docs, VOCAB)
    return str(prefix)


def write_teacher(opts) -> Path:
    """A one-layer random Llama at the student's vocabulary, its output layer scaled so that the
    logits of a normalized hidden state have std TEACHER_LOGIT_STD."""
    path = opts.out / "work" / "teacher-hf"
    if not (path / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=TEACHER_HIDDEN, intermediate_size=2 * TEACHER_HIDDEN,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=opts.seq, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, TEACHER_LOGIT_STD / math.sqrt(TEACHER_HIDDEN))
        model.save_pretrained(path)
    return path


def torchrun(opts, args: list[str], log: Path) -> tuple[int, str]:
    """``megatron-kd args`` on ``--gpus`` GPUs through the project's launcher (launch/torchrun.sh)."""
    cmd = ["bash", str(ROOT / "launch" / "torchrun.sh"), *args]
    env = {**os.environ, "GPUS": str(opts.gpus), "PYTHON": sys.executable}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=opts.timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    log.write_text(text)
    return rc, text


def build_cache(opts, data_prefix: str) -> Path:
    cache = opts.out / "work" / "cache"
    done = opts.out / "work" / "cache.done"
    if not done.exists():
        teacher = write_teacher(opts)
        model = ["--num-layers", "1", "--hidden-size", str(TEACHER_HIDDEN), "--num-attention-heads", "4",
                 "--max-position-embeddings", str(opts.seq), *no_te_flags(), "--bf16"]
        rc, text = torchrun(opts, ["cache", "build", *data_flags(opts, data_prefix), *model,
                                   "--kd-teacher-hf", str(teacher), "--kd-cache", str(cache), "--kd-topk", "100"],
                            opts.out / "cache_build.log")
        if rc != 0:
            raise SystemExit(f"cache build failed (exit {rc}), see {opts.out / 'cache_build.log'}:\n{text[-3000:]}")
        done.write_text(re.findall(r"teacher cache .*", text)[-1] + "\n")
    return cache


def loss_flags(loss: str, cache: Path) -> list[str]:
    return {"fused": ["--kd-cache", str(cache)], "dense": ["--kd-cache", str(cache), "--kd-impl", "dense"],
            "ce": ["--kd-ce-impl", "megatron"], "fused-ce": []}[loss]


def parse_log(text: str) -> dict:
    times = [float(t) / 1e3 for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
    peaks = [float(m) / 1024 for m in re.findall(r"memory \(MB\) \| allocated: [0-9.]+ \| max allocated: ([0-9.]+)",
                                                  text)]
    out = {"iteration_s": times, "peak_gib": max(peaks) if peaks else None,
           "oom": bool(re.search(r"OutOfMemoryError|CUDA out of memory", text))}
    steady = times[2:] or times[1:] or times
    out["step_s"] = statistics.median(steady) if steady else None
    return out


def plan_gib(flags: list[str], gpus: int, loss: str) -> float:
    from megatron_kd.megatron.plan import GIB, estimate, plan_args

    args, layout = plan_args(flags, gpus)
    return estimate(args, layout, gpus=gpus, loss="fused" if loss.startswith("fused") else loss).total / GIB


def model_flops_per_step(args, opts) -> float:
    from bench_gptoss import model_flops

    return model_flops(args, opts.seq) * opts.global_batch_size


def markdown(results: dict) -> str:
    lines = [f"# {results['size']} student, {results['layers']} layers x {results['experts']} experts, "
             f"{results['seq']:,} tokens, {results['gpus']} GPUs, global batch {results['global_batch_size']}", "",
             f"Model FLOPs per step: {results['model_tflop_per_step']:.0f} TFLOP. {results.get('cache', '')}", "",
             "| loss | step (s) | model TFLOP/s per GPU | peak GiB (rank 0) | plan GiB | plan error |",
             "|---|---:|---:|---:|---:|---:|"]
    for loss, r in results["losses"].items():
        if r.get("oom") or r["step_s"] is None:
            lines.append(f"| {loss} | {'OOM' if r.get('oom') else 'failed (exit %s)' % r['rc']} | | | "
                         f"{r['plan_gib']:.1f} | |")
            continue
        err = "" if r["peak_gib"] is None else f"{r['plan_gib'] / r['peak_gib'] - 1:+.1%}"
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        lines.append(f"| {loss} | {r['step_s']:.2f} | {r['tflops_per_gpu']:.0f} | {peak} | {r['plan_gib']:.1f} | {err} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    opts = parse(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    results_path = opts.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"losses": {}}
    data_prefix = write_data(opts)
    student = [*student_flags(opts), *data_flags(opts, data_prefix), "--bf16", "--calculate-per-token-loss",
               "--lr", "1e-5", "--min-lr", "1e-6", "--lr-decay-style", "cosine", "--log-interval", "1",
               "--log-memory-interval", "1"]
    from megatron_kd.megatron.plan import plan_args

    args, _ = plan_args(student, opts.gpus)
    results.update(size=opts.size, layers=args.num_layers, experts=args.num_experts, seq=opts.seq, gpus=opts.gpus,
                   global_batch_size=opts.global_batch_size, iters=opts.iters,
                   model_tflop_per_step=model_flops_per_step(args, opts) / 1e12)
    losses = opts.losses.split(",")
    cache = build_cache(opts, data_prefix) if {"fused", "dense"} & set(losses) else None
    if cache is not None:
        results["cache"] = (opts.out / "work" / "cache.done").read_text().strip()
    for loss in losses:
        if loss in results["losses"]:
            continue
        flags = [*student, *loss_flags(loss, cache)]
        rc, text = torchrun(opts, ["train", *flags], opts.out / f"train_{loss}.log")
        r = {"rc": rc, **parse_log(text), "plan_gib": plan_gib(flags, opts.gpus, loss)}
        if r["step_s"]:
            r["tflops_per_gpu"] = results["model_tflop_per_step"] / opts.gpus / r["step_s"]
        results["losses"][loss] = r
        print(f"{loss}: {json.dumps(r)}", flush=True)
        results_path.write_text(json.dumps(results, indent=1))
    (opts.out / "results.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
