"""GPT-OSS students at full depth through ``megatron-kd train`` on one node: step time, model
TFLOP/s per GPU and peak memory per loss path and memory layout, against ``megatron-kd plan``.

    python benchmarks/bench_node.py --size 20b --gpus 8 --out runs/node20b                # fused, ce, dense
    python benchmarks/bench_node.py --size 120b --gpus 8 --experts 64 --losses fused --out runs/node120b
    python benchmarks/bench_node.py --size 20b --gpus 1 --layers 2 --experts 4 --seq 4096 --iters 3   # smoke run
    python benchmarks/bench_node.py --size 20b --rank-of 8 --losses fused --iters 4 \\
        --recompute block:10 --recompute-modules moe_act --optimizer fused --memory-snapshot \\
        --also "--losses ce"                                         # and Megatron's CE in the recipe's layout

What runs is what users run: torchrun, ``megatron-kd train`` with the recipe's flags
(examples/gpt_oss: architecture, size and its one-node layout, expert parallelism capped at
``--gpus``), ``--bf16 --calculate-per-token-loss``, Megatron's optimizer step included. Only the
values are synthetic, because no checkpoint reaches the machine and neither memory nor speed depends
on them: random-initialized weights, uniformly random tokens, and a teacher cache that
``megatron-kd cache build`` writes from a tiny random Hugging Face teacher whose logits are scaled to
teacher-like distributions (top-1 probability ~0.4, top-100 mass ~0.93).

``--rank-of N``: one rank of an N-GPU node on one GPU. In the recipe's layout (EP = N) a rank holds
experts / N of the experts and, with top-k routing over them, computes the expert FLOPs of all its
tokens; one GPU with experts / N experts, expert parallelism 1 and the same 2 micro-batches does
that work without the all-to-all, with the dense part's optimizer state unsharded (the real rank
shards it over N data-parallel ranks: the output says by how many GiB the run holds more).

Per loss path, one ``megatron-kd train`` run:
  fused  fused top-K KD from the cache (the default path)
  ce     no teacher, Megatron's output layer + cross-entropy (``--kd-ce-impl megatron``)
  fused-ce  no teacher, cross-entropy through the fused op (the default without a cache)
  dense  KD on materialized logits (``--kd-impl dense``; expected out of memory at 32K)
Memory layout and optimizer, passed to Megatron-LM (the recipe's own recompute flags are replaced):
  --recompute full | block:N | selective | none   full: every layer (the recipe's uniform, 1 layer);
                 block:N: the first N layers whole (--recompute-method block), the others not;
                 selective: the --recompute-modules only; none: no recompute
  --recompute-modules moe_act,...   Megatron's --recompute-modules (moe_act: the experts' activation,
                 which megatron_kd's experts also honour under block recompute for the other layers)
  --offload-modules expert_fc1,...  --fine-grained-activation-offloading (needs Transformer Engine)
  --optimizer fused   torch's fused AdamW (``--kd-fused-adam``) instead of the multi-tensor one;
                 bf16-sr-8bit: ``--kd-optimizer bf16-sr-8bit`` (bf16 weights, 8-bit moments)
  --extra "<flags>"   any other Megatron-LM / --kd-* flags
Data: random documents of --document-tokens tokens (8,192), each ending with EOD, packed by Megatron's
GPTDataset; --packing documents adds --reset-attention-mask --reset-position-ids --eod-mask-loss
to the cache build and every run (attention and positions within each document).
  --also "<options>"  one more configuration in the same call: losses, layout, optimizer and label
                 options over their defaults (the model, data and --out are this call's)
Each (loss, configuration) is one run, labelled "<loss>" for the recipe's layout, else
"<loss> <what differs>" (or ``--label``): results.json keeps every label, and a label that
finished is skipped when re-run.

Reported from Megatron's own log: median time per iteration after the first two, peak allocated
memory (``--log-memory-interval``, data-parallel rank 0), out-of-memory if it happens. Model
TFLOP/s per GPU in two conventions = FLOPs per step / GPUs / step time:
  bench     the matmuls of forward and backward (``bench_gptoss.model_flops``): attention scores
            and values over the causal half on full layers and 128 keys on window layers, the
            gated experts' three matrices; recompute not counted. With --packing documents the
            attention is counted per document (the causal half of each --document-tokens document),
            as the attention kernels compute it
  megatron  Megatron-LM's ``num_floating_point_operations`` on the run's arguments (what
            ``--log-throughput`` prints, also parsed from the log): full causal attention on every
            layer (it knows no windows), the gated-unit factor only from ``--swiglu`` (GPT-OSS's
            ``--quick-geglu`` counts the experts as two matrices)
``--memory-snapshot`` passes ``--record-memory-history --memory-snapshot-path`` and summarizes the
allocator snapshot that Megatron dumps after the last iteration into ``memory_<label>.json``
(bytes by category and the allocation sites, between iterations and at the peak of the recorded
trace; a few KB). Its step times include writing the snapshot. Every stage is kept in ``--out``
and skipped when re-run (data, teacher, cache, finished runs).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import pickle
import re
import shlex
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

VOCAB = 201088  # GPT-OSS's embedding rows; NullTokenizer ids 0..201086, end-of-document 201087
TEACHER_HIDDEN = 64
TEACHER_LOGIT_STD = 5.5  # Gaussian logits over 201,088 ids: top-1 p ~0.4, top-100 mass ~0.93
LOSSES = ("fused", "ce", "fused-ce", "dense")
# --optimizer: the flags of each choice (megatron: what megatron-core builds from its own flags)
OPTIMIZER_FLAGS = {"megatron": [], "fused": ["--kd-fused-adam"], "bf16-sr-8bit": ["--kd-optimizer", "bf16-sr-8bit"]}
# the recipe's recompute and optimizer flags, replaced by --recompute / --recompute-modules / --optimizer
# (flag -> number of values it takes; None: every value up to the next flag)
RECIPE_RECOMPUTE_FLAGS = {"--recompute-granularity": 1, "--recompute-method": 1, "--recompute-num-layers": 1,
                          "--recompute-modules": None, "--kd-fused-adam": 0, "--kd-optimizer": 1}
# options that fix the model, the data and the cache: the call's, for every configuration of it
SHARED_OPTIONS = ("size", "gpus", "rank_of", "layers", "experts", "seq", "global_batch_size", "iters", "packing",
                  "document_tokens", "timeout", "out")
# --packing documents: Megatron-LM's flags that keep packed documents apart, for the cache build and
# every training run alike (the cache records its packing and a run with other flags is refused)
PACKING_FLAGS = {"none": [], "documents": ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]}


def recompute_choice(text: str) -> str:
    if text in ("full", "selective", "none") or re.fullmatch(r"block:[1-9][0-9]*", text):
        return text
    raise argparse.ArgumentTypeError(f"--recompute: expected full, selective, none or block:N (N >= 1), got {text!r}")


def module_list(text: str) -> list[str]:
    return [m for m in re.split(r"[,\s]+", text) if m]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("20b", "120b"), default="20b")
    p.add_argument("--gpus", type=int, default=None, help="GPUs of the run (default 8; 1 with --rank-of)")
    p.add_argument("--rank-of", type=int, default=None, metavar="N",
                   help="one rank of an N-GPU node on one GPU: experts / N local experts, expert parallel 1")
    p.add_argument("--layers", type=int, default=None, help="override the recipe's depth")
    p.add_argument("--experts", type=int, default=None, help="override the recipe's number of experts")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--global-batch-size", type=int, default=None, help="default: 2 micro-batches per GPU")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--packing", choices=tuple(PACKING_FLAGS), default="none",
                   help="documents: attention and positions kept within each packed document")
    p.add_argument("--document-tokens", type=int, default=8192,
                   help="tokens per document of the random data, its EOD included (default 8192)")
    p.add_argument("--losses", default="fused,ce,dense")
    p.add_argument("--recompute", type=recompute_choice, default="full")
    p.add_argument("--recompute-modules", type=module_list, default=None)
    p.add_argument("--offload-modules", type=module_list, default=None)
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_FLAGS), default="megatron")
    p.add_argument("--extra", default="", help="more Megatron-LM / --kd-* flags, one string")
    p.add_argument("--label", default=None, help="name of this configuration in results (default: what differs)")
    p.add_argument("--memory-snapshot", action="store_true")
    p.add_argument("--also", action="append", default=[], metavar="OPTIONS",
                   help="another configuration: these options over this call's (repeatable)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per training run")
    p.add_argument("--out", type=Path, default=Path("runs/node"))
    return p


def recipe_experts(size: str) -> int:
    from tiny_gpt_oss import recipe_flags

    flags = recipe_flags(size)
    return int(flags[len(flags) - 1 - flags[::-1].index("--num-experts") + 1])


def _finish(p: argparse.ArgumentParser, opts: argparse.Namespace) -> argparse.Namespace:
    if opts.rank_of is not None:
        if opts.gpus not in (None, 1) or opts.experts is not None:
            p.error("--rank-of N sets --gpus 1 and --experts (experts / N): give neither")
        experts = recipe_experts(opts.size)
        if opts.rank_of < 1 or experts % opts.rank_of:
            p.error(f"--rank-of must divide the {opts.size} recipe's {experts} experts, got {opts.rank_of}")
        opts.gpus, opts.experts = 1, experts // opts.rank_of
    opts.gpus = opts.gpus or 8
    opts.global_batch_size = opts.global_batch_size or 2 * opts.gpus
    opts.out = opts.out.resolve()  # the launcher runs from the repository root
    unknown = set(opts.losses.split(",")) - set(LOSSES)
    if unknown:
        p.error(f"unknown losses {sorted(unknown)}: choose from {LOSSES}")
    if opts.recompute_modules and opts.recompute == "none":
        p.error("--recompute-modules needs --recompute selective, full or block:N")
    if opts.offload_modules and not importlib.util.find_spec("transformer_engine"):
        p.error("--offload-modules: Megatron's fine-grained activation offloading needs Transformer Engine "
                "(megatron-core 0.19 asserts --transformer-impl transformer_engine), not installed here")
    return opts


def parse(argv=None) -> argparse.Namespace:
    """This call's configuration; ``opts.configs`` lists it and one per ``--also``: the losses,
    layout, optimizer and label options that ``--also`` gives, over their defaults (not over this
    call's), with this call's model, data and --out."""
    p = parser()
    given = p.parse_args(sys.argv[1:] if argv is None else argv)
    defaults = p.parse_args([])
    configs = []
    for extra in given.also:
        more = p.parse_args(shlex.split(extra))
        changed = [name for name in (*SHARED_OPTIONS, "also") if getattr(more, name) != getattr(defaults, name)]
        if changed:
            p.error(f"--also {extra!r}: sets only losses, layout, optimizer and label options, not "
                    + ", ".join("--" + name.replace("_", "-") for name in changed))
        for name in SHARED_OPTIONS:
            setattr(more, name, getattr(given, name))
        configs.append(more)
    opts = _finish(p, given)
    opts.configs = [opts, *(_finish(p, more) for more in configs)]
    return opts


def layout_label(opts) -> str:
    """What differs from the recipe's layout: '' for the recipe's own."""
    if opts.label:
        return opts.label
    parts = []
    if opts.recompute != "full":
        parts.append(f"recompute={opts.recompute}")
    if opts.recompute_modules:
        parts.append("modules=" + ",".join(opts.recompute_modules))
    if opts.offload_modules:
        parts.append("offload=" + ",".join(opts.offload_modules))
    if opts.optimizer != "megatron":
        parts.append(f"optimizer={opts.optimizer}")
    if opts.extra:
        parts.append(f"extra={opts.extra}")
    return " ".join(parts)


def run_label(loss: str, opts) -> str:
    return f"{loss} {layout_label(opts)}".strip()


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-")


def data_flags(opts, data_prefix: str) -> list[str]:
    """Flags the cache build and every training run share (the cache is keyed by their samples)."""
    return ["--data-path", data_prefix, "--split", "100,0,0", "--seq-length", str(opts.seq), "--seed", "1234",
            "--train-iters", str(opts.iters), "--global-batch-size", str(opts.global_batch_size),
            "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--data-cache-path", str(opts.out / "work" / "index-cache"), "--num-workers", "2",
            "--eval-iters", "0", "--eval-interval", "1000000", *PACKING_FLAGS[opts.packing]]


def no_te_flags() -> list[str]:
    if importlib.util.find_spec("transformer_engine"):
        return []
    return ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
            "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"]


def strip_flags(flags: list[str], drop: dict[str, int]) -> list[str]:
    """``flags`` without each flag of ``drop`` and its values."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] in drop:
            values, i = drop[flags[i]], i + 1
            if values is None:  # a list flag: its values run up to the next flag
                while i < len(flags) and not flags[i].startswith("--"):
                    i += 1
            else:
                i += values
            continue
        out.append(flags[i])
        i += 1
    return out


def student_flags(opts) -> list[str]:
    from tiny_gpt_oss import recipe_flags

    flags = [*strip_flags(recipe_flags(opts.size), RECIPE_RECOMPUTE_FLAGS), *no_te_flags(),
             "--seq-length", str(opts.seq), "--expert-model-parallel-size", str(min(8, opts.gpus))]
    if opts.layers:
        flags += ["--num-layers", str(opts.layers)]
    if opts.experts:
        flags += ["--num-experts", str(opts.experts)]
    return flags


def layout_flags(opts) -> list[str]:
    """Megatron-LM flags of this configuration's recompute, offload and optimizer choices."""
    flags = []
    if opts.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif opts.recompute.startswith("block:"):
        flags += ["--recompute-granularity", "full", "--recompute-method", "block",
                  "--recompute-num-layers", opts.recompute.split(":")[1]]
    elif opts.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    if opts.recompute_modules:
        flags += ["--recompute-modules", *opts.recompute_modules]
        if "moe_act" in opts.recompute_modules and opts.recompute == "selective":
            # megatron-core accepts moe_act only with --moe-grouped-gemm; on the local spec the
            # experts are megatron_kd's grouped ones either way
            flags.append("--moe-grouped-gemm")
    if opts.offload_modules:
        flags += ["--fine-grained-activation-offloading", "--offload-modules", *opts.offload_modules]
    return flags + OPTIMIZER_FLAGS[opts.optimizer] + shlex.split(opts.extra)


def write_data(opts) -> str:
    """Uniformly random documents of --document-tokens tokens (the last one EOD), enough for every
    sample the runs read."""
    import numpy as np

    from megatron_kd.megatron.data import write_indexed_dataset

    n = opts.document_tokens
    prefix = opts.out / "work" / "data" / f"random-doc{n}"
    if not Path(str(prefix) + ".idx").exists():
        tokens = math.ceil(1.1 * opts.global_batch_size * opts.iters * (opts.seq + 1)) + n
        rng = np.random.default_rng(0)
        docs = ([*rng.integers(0, VOCAB - 1, size=n - 1), VOCAB - 1] for _ in range(tokens // n + 1))
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


def cache_name(opts) -> str:
    """One cache per data and packing (a cache built without packing refuses a packed run)."""
    return f"cache-doc{opts.document_tokens}-{opts.packing}"


def build_cache(opts, data_prefix: str) -> Path:
    cache = opts.out / "work" / cache_name(opts)
    done = cache.with_name(cache.name + ".done")
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


def _steady(values: list[float]) -> float | None:
    """Median after the first two log lines (start-up, and Megatron's first line averaging two)."""
    steady = values[2:] or values[1:] or values
    return statistics.median(steady) if steady else None


def parse_log(text: str) -> dict:
    times = [float(t) / 1e3 for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
    peaks = [float(m) / 1024 for m in re.findall(r"memory \(MB\) \| allocated: [0-9.]+ \| max allocated: ([0-9.]+)",
                                                  text)]
    throughput = [float(t) for t in re.findall(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)", text)]
    out = {"iteration_s": times, "peak_gib": max(peaks) if peaks else None,
           "oom": bool(re.search(r"OutOfMemoryError|CUDA out of memory", text)), "step_s": _steady(times)}
    if throughput:
        out["megatron_log_tflops_per_gpu"] = _steady(throughput)
    return out


def plan_gib(flags: list[str], gpus: int, loss: str) -> float:
    from megatron_kd.megatron.plan import GIB, estimate, plan_args

    args, layout = plan_args(flags, gpus)
    return estimate(args, layout, gpus=gpus, loss="fused" if loss.startswith("fused") else loss).total / GIB


def model_flops_per_step(args, opts) -> float:
    """The benchmark's convention (see the module docstring), one global batch."""
    from bench_gptoss import model_flops

    document = opts.document_tokens if opts.packing != "none" else None
    return model_flops(args, opts.seq, document) * opts.global_batch_size


def megatron_flops_per_step(args, opts) -> float:
    """Megatron-LM's own count for one global batch (``--log-throughput``'s numerator)."""
    from megatron.training.training import num_floating_point_operations

    return num_floating_point_operations(copy.copy(args), opts.global_batch_size)


def unsharded_optimizer_gib(args, opts) -> float:
    """What one GPU standing in for a rank of ``--rank-of N`` holds more than the real rank: the
    non-expert parameters' optimizer state, which the real rank's distributed optimizer shards
    over the N data-parallel ranks (experts: expert-data-parallel size 1 at EP = N, unsharded)."""
    from megatron_kd.megatron.plan import GIB, Layout, _optimizer_bytes_per_param, estimate

    dense = estimate(args, Layout(), gpus=1).params["non-expert"]
    return dense * _optimizer_bytes_per_param(args) * (1 - 1 / opts.rank_of) / GIB


NVLINK_GB_S = 450  # H200 NVLink 4: 900 GB/s per GPU, the two directions together


def all_to_all_estimate(args, opts) -> dict:
    """What the expert all-to-alls of a real rank of ``--rank-of N`` move, which the one-GPU run
    leaves out: each dispatch and each combine sends every routed token's hidden state (top-k copies,
    bf16) whose expert lives elsewhere, (N - 1)/N of them under uniform routing; per micro-batch
    both run in forward and in backward on every layer, and in forward again on each recomputed
    layer. The time is a lower bound: those bytes at NVLink's per-direction bandwidth, nothing
    overlapped with compute."""
    per_pass = opts.seq * args.moe_router_topk * args.hidden_size * 2 * (1 - 1 / opts.rank_of)
    recomputed = 0
    if args.recompute_granularity == "full":
        recomputed = args.num_layers if args.recompute_method == "uniform" else args.recompute_num_layers
    passes = 4 * args.num_layers + 2 * recomputed
    gb = per_pass * passes * opts.global_batch_size / 1e9  # micro-batches of one sample, one data-parallel rank
    return {"all_to_all_gb": gb, "all_to_all_s": gb / NVLINK_GB_S}


def rank_note(results: dict) -> str:
    if not results.get("rank_of"):
        return ""
    n = results["rank_of"]
    return (f"One rank of an {n}-GPU node on one GPU: {results['experts']} of {results['experts'] * n} experts, "
            f"no all-to-all, dense optimizer state unsharded (+{results['unsharded_optimizer_gib']:.1f} GiB "
            "vs a real rank).")


# ---------------------------------------------------------------------------------------------
# allocator snapshots (--memory-snapshot)

# (substring of a frame's file or function, category): the first rule that any frame matches
MEMORY_CATEGORIES = (
    ("param_and_grad_buffer", "weights and main_grad (DDP buffers)"),
    ("optimizer", "optimizer"),
    ("megatron_kd/ops", "loss"),
    ("megatron_kd/megatron/loss", "loss"),
    ("output_layer", "loss"),
    ("kd_data", "batch"),
    ("moe", "MoE (router, dispatch, experts)"),
    ("experts", "MoE (router, dispatch, experts)"),
    ("attention", "attention"),
    ("rotary", "attention"),
    ("norm", "norms"),
    ("transformer_layer", "layer (other)"),
    ("embedding", "embedding"),
    ("autograd", "autograd engine (backward)"),
)


def _short_path(filename: str) -> str:
    for marker in ("site-packages/", "/megatron_kd/", "/benchmarks/"):
        if marker in filename:
            tail = filename.split(marker, 1)[1]
            return tail if marker == "site-packages/" else marker.strip("/") + "/" + tail
    return filename


def _category(frames: list[dict]) -> str:
    if not frames:
        return "unknown (no allocation history)"
    text = " ".join(f"{f.get('filename', '')}:{f.get('name', '')}" for f in frames)
    for key, category in MEMORY_CATEGORIES:
        if key in text:
            return category
    return "other"


def _site(frames: list[dict]) -> str:
    """The innermost frame outside torch itself: where the model asked for the memory."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and not name.startswith("??") and name:
            return f"{_short_path(name)}:{f.get('line', 0)} {f.get('name', '')}"
    return "(torch internals)" if frames else "(no history)"


def _describe(blocks: list[tuple[int, list]], top: int) -> dict:
    by_category, by_site, counts = defaultdict(int), defaultdict(int), defaultdict(int)
    for size, frames in blocks:
        by_category[_category(frames)] += size
        site = (_category(frames), _site(frames))
        by_site[site] += size
        counts[site] += 1
    sites = sorted(by_site.items(), key=lambda kv: -kv[1])[:top]
    return {"allocated_gib": sum(s for s, _ in blocks) / 2**30,
            "by_category_gib": {k: v / 2**30 for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "top_sites": [{"gib": v / 2**30, "blocks": counts[k], "category": k[0], "site": k[1]} for k, v in sites]}


def summarize_memory_snapshot(snapshot: dict, *, top: int = 25) -> dict:
    """Allocated memory by category and allocation site at the snapshot (Megatron dumps it after an
    iteration: the steady state between iterations) and at the peak of the recorded trace.

    The peak is found by walking the trace backwards from the snapshot's live blocks (undoing each
    allocation and each completed free), so it is exact within the trace even when the allocator's
    ring buffer dropped its oldest events; a block allocated before the trace's window shows as
    unknown."""
    segments = snapshot.get("segments", [])
    traces = snapshot.get("device_traces", [])
    device = max(range(len(traces)), key=lambda d: len(traces[d])) if traces else 0
    live = {}
    for seg in segments:
        if seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", []):
            if b.get("state") in ("active_allocated", "active_awaiting_free"):
                live[b["address"]] = (b["size"], b.get("frames", []))
    trace = traces[device] if traces else []
    freed = ("free_completed", "free")
    current = sum(s for s, _ in live.values())
    peak, peak_index = current, len(trace)
    for i in range(len(trace) - 1, -1, -1):  # the state before event i
        e = trace[i]
        if e["action"] == "alloc":
            current -= e["size"]
        elif e["action"] in freed:
            current += e["size"]
        if current > peak:
            peak, peak_index = current, i
    at_peak = dict(live)
    for e in reversed(trace[peak_index:]):
        if e["action"] == "alloc":
            at_peak.pop(e["addr"], None)
        elif e["action"] in freed:
            at_peak[e["addr"]] = (e["size"], None)  # frames: from its allocation, earlier in the trace
    missing = {a for a, (_, frames) in at_peak.items() if frames is None}
    for e in reversed(trace[:peak_index]):
        if not missing:
            break
        if e["action"] == "alloc" and e["addr"] in missing:
            at_peak[e["addr"]] = (at_peak[e["addr"]][0], e.get("frames", []))
            missing.discard(e["addr"])
    history = any(frames for _, frames in live.values()) or any(e.get("frames") for e in trace[:100])
    summary = {"history": bool(history), "trace_events": len(trace),
               "steady": _describe(list(live.values()), top),
               "peak": {"events_before_snapshot": len(trace) - peak_index,
                        **_describe([(s, f or []) for s, f in at_peak.values()], top)}}
    if not history:
        summary["note"] = ("no allocation history in the snapshot: the allocator's recording was not started "
                           "before the model was built (megatron-core 0.19 starts it only on its ModelConfig path)")
    return summary


def memory_snapshot_summary(path: Path, plan_static_gib: float) -> dict | None:
    if not path.exists():
        return None
    with open(path, "rb") as f:
        summary = summarize_memory_snapshot(pickle.load(f))
    summary["plan_static_gib"] = plan_static_gib
    return summary


def plan_static_gib(flags: list[str], gpus: int) -> float:
    """The plan's weights + gradients + optimizer state (what stays between iterations)."""
    from megatron_kd.megatron.plan import GIB, estimate, plan_args

    args, layout = plan_args(flags, gpus)
    terms = estimate(args, layout, gpus=gpus).gpu_bytes
    return sum(terms[k] for k in ("weights", "gradients", "optimizer")) / GIB


# ---------------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    lines = [f"# {results['size']} student, {results['layers']} layers x {results['experts']} experts, "
             f"{results['seq']:,} tokens, {results['gpus']} GPUs, global batch {results['global_batch_size']}", ""]
    if results.get("packing", "none") != "none":
        lines += [f"Packed documents of {results['document_tokens']:,} tokens kept apart ({results['packing']}: "
                  + " ".join(PACKING_FLAGS[results["packing"]]) + ").", ""]
    if results.get("rank_of"):
        lines += [rank_note(results), ""]
    per_document = " attention counted per document," if results.get("packing", "none") != "none" else ""
    lines += [f"Model FLOPs per step: {results['model_tflop_per_step']:.0f} TFLOP (bench convention,{per_document} "
              f"recompute not counted), "
              f"{results['megatron_tflop_per_step']:.0f} TFLOP (Megatron-LM's num_floating_point_operations). "
              f"{results.get('cache', '')}", "",
              "| run | step (s) | model TFLOP/s per GPU: bench | Megatron | peak GiB (rank 0) | plan GiB | plan error |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for label, r in results["runs"].items():
        if r.get("oom") or r["step_s"] is None:
            lines.append(f"| {label} | {'OOM' if r.get('oom') else 'failed (exit %s)' % r['rc']} | | | | "
                         f"{r['plan_gib']:.1f} | |")
            continue
        err = "" if r["peak_gib"] is None else f"{r['plan_gib'] / r['peak_gib'] - 1:+.1%}"
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        megatron = f"{r['megatron_tflops_per_gpu']:.0f}" if "megatron_tflops_per_gpu" in r else ""
        lines.append(f"| {label} | {r['step_s']:.2f} | {r['tflops_per_gpu']:.0f} | {megatron} "
                     f"| {peak} | {r['plan_gib']:.1f} | {err} |")
    moved = {label: r for label, r in results["runs"].items() if "all_to_all_s" in r}
    if moved:
        lines += ["", f"The expert all-to-alls a real rank adds (not run here; uniform routing, at least this at "
                  f"{NVLINK_GB_S} GB/s per direction, none of it overlapped): "
                  + "; ".join(f"{label}: {r['all_to_all_gb']:.0f} GB, {r['all_to_all_s']:.2f} s per step"
                              for label, r in moved.items())]
    snapshots = [label for label, r in results["runs"].items() if r.get("memory_snapshot")]
    if snapshots:
        lines += ["", "Runs with --memory-snapshot (their step times include writing the snapshot): "
                  + ", ".join(f"{label} -> {results['runs'][label]['memory_snapshot']}" for label in snapshots)]
    return "\n".join(lines) + "\n"


def train_flags(opts, data_prefix: str) -> list[str]:
    return [*student_flags(opts), *data_flags(opts, data_prefix), "--bf16", "--calculate-per-token-loss",
            "--lr", "1e-5", "--min-lr", "1e-6", "--lr-decay-style", "cosine", "--log-interval", "1",
            "--log-memory-interval", "1", "--log-throughput"]


def main(argv=None):
    opts = parse(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    results_path = opts.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results.setdefault("runs", {})
    data_prefix = write_data(opts)
    student = train_flags(opts, data_prefix)
    from megatron_kd.megatron.plan import plan_args

    args, _ = plan_args(student, opts.gpus)
    results.update(size=opts.size, layers=args.num_layers, experts=args.num_experts, seq=opts.seq, gpus=opts.gpus,
                   global_batch_size=opts.global_batch_size, iters=opts.iters, rank_of=opts.rank_of,
                   packing=opts.packing, document_tokens=opts.document_tokens,
                   model_tflop_per_step=model_flops_per_step(args, opts) / 1e12,
                   megatron_tflop_per_step=megatron_flops_per_step(args, opts) / 1e12)
    if opts.rank_of:
        results["unsharded_optimizer_gib"] = unsharded_optimizer_gib(args, opts)
        print(rank_note(results), flush=True)
    runs = [(loss, config) for config in opts.configs for loss in config.losses.split(",")]
    cache = build_cache(opts, data_prefix) if {"fused", "dense"} & {loss for loss, _ in runs} else None
    if cache is not None:
        results["cache"] = cache.with_name(cache.name + ".done").read_text().strip()
    for loss, config in runs:
        label = run_label(loss, config)
        if results["runs"].get(label, {}).get("rc") == 0:
            continue
        flags = [*student, *layout_flags(config), *loss_flags(loss, cache)]
        snapshot = opts.out / "work" / f"snapshot_{slug(label)}.pickle"
        if config.memory_snapshot:
            snapshot.unlink(missing_ok=True)
            flags += ["--record-memory-history", "--memory-snapshot-path", str(snapshot)]
        rc, text = torchrun(opts, ["train", *flags], opts.out / f"train_{slug(label)}.log")
        r = {"loss": loss, "layout_flags": layout_flags(config), "rc": rc, **parse_log(text),
             "plan_gib": plan_gib(flags, opts.gpus, loss)}
        if opts.rank_of:
            r.update(all_to_all_estimate(plan_args(flags, opts.gpus)[0], opts))
        if r["step_s"]:
            r["tflops_per_gpu"] = results["model_tflop_per_step"] / opts.gpus / r["step_s"]
            r["megatron_tflops_per_gpu"] = results["megatron_tflop_per_step"] / opts.gpus / r["step_s"]
        if config.memory_snapshot:
            summary = memory_snapshot_summary(snapshot, plan_static_gib(flags, opts.gpus))
            if summary is not None:
                summary["logged_peak_gib"] = r["peak_gib"]
                path = opts.out / f"memory_{slug(label)}.json"
                path.write_text(json.dumps(summary, indent=1))
                r["memory_snapshot"] = path.name
        results["runs"][label] = r
        print(f"{label}: {json.dumps(r)}", flush=True)
        results_path.write_text(json.dumps(results, indent=1))
    (opts.out / "results.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
