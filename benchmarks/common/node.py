"""GPT-OSS and Llama students at full depth through ``megatron-kd train`` on one node: step time,
tokens/s and model TFLOP/s per GPU and peak memory per loss path and memory layout, against
``megatron-kd plan``.

    python -m benchmarks.bench_node --size 20b --gpus 8 --out runs/node20b                # fused, ce, dense
    python -m benchmarks.bench_node --size 120b --gpus 8 --experts 64 --losses fused --out runs/node120b
    python -m benchmarks.bench_node --size 20b --gpus 1 --layers 2 --experts 4 --seq 4096 --iters 3   # smoke run
    python -m benchmarks.bench_node --size 20b --rank-of 8 --losses fused --iters 4 \\
        --recompute block:10 --recompute-modules moe_act --optimizer fused --memory-snapshot \\
        --also "--losses ce"                                         # and Megatron's CE in the recipe's layout

The one-GPU Llama table: a Llama-3.2-3B student (examples/llama/3b.sh) distilled from
Llama-3.1-8B-Instruct's vocabulary (128,256 ids, a top-100 cache) on one H200. At 8K, 8 samples per
step (micro-batch 1, 65,536 tokens; the paper this product implements states no batch), 3b.sh's
layout (no recompute) with Megatron's optimizer, and the fused path once more with bf16-sr-8bit:

    python -m benchmarks.bench_node --size llama3-3b --losses fused,ce,dense,online --iters 6 \\
        --also "--losses fused --optimizer bf16-sr-8bit" --out runs/llama3b-8k

(2026-12-03, one H200, 741b820, ``--losses fused,online --iters 5``: fused 3.17 s per step, 20,703
tokens/s, 487 model TFLOP/s, 76.4 GiB peak, plan 77.7; online 5.60 s, 11,708 tokens/s, 275, 115.7 GiB.
The paper's 58.3 / 102.8 GB lie about as far apart: 41.4 GiB against these 39.3.)

At 32K, 64K and 128K tokens per sample, 65,536 tokens per step (2 samples at 32K, one sample at 64K
and at 128K), bf16-sr-8bit, the recompute ``megatron-kd plan --search`` ranks first for each run
(no recompute at 32K, block 14 at 64K, block 21 at 128K for the fused path: examples/llama/3b_128k.sh;
Megatron's CE fits no layout at 128K and is reported so, not run), and every layer recomputed beside it:

    for seq in 32768 65536 131072; do
      python -m benchmarks.bench_node --size llama3-3b --seq $seq --losses fused,ce --iters 5 \\
          --recompute plan --optimizer bf16-sr-8bit --also "--losses fused --recompute full --optimizer bf16-sr-8bit" \\
          --out runs/llama3b-$seq
    done

What runs is what users run: torchrun, ``megatron-kd train`` with the recipe's flags (examples/gpt_oss
or examples/llama: architecture, size and its layout, expert parallelism capped at ``--gpus``),
``--bf16 --calculate-per-token-loss``, Megatron's optimizer step included. Only the values are
synthetic, because no checkpoint reaches the machine and neither memory nor speed depends on them:
random-initialized weights, uniformly random tokens, and a teacher cache that ``megatron-kd cache
build`` writes from a tiny random Hugging Face teacher at the student's vocabulary whose logits are
scaled to teacher-like distributions (top-1 probability ~0.4, top-100 mass ~0.93). ``--size``
(``SIZES``) names the recipe, the vocabulary, the defaults (GPUs, --seq, global batch, recompute)
and the teacher of online KD: 20b, 120b and 120b_e64 (the 64-expert student pruned from the 120B
teacher; 8 GPUs, 32K, 2 samples per GPU, full recompute) and llama3-3b (1 GPU, 8K, 65,536 tokens per
GPU, no recompute, the 8B teacher).

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
  online the teacher in the same process (llama3-3b: examples/llama/8b.sh, random weights, bf16, no
         grad) and dense KL over the full vocabulary: benchmarks/common/online_kd.py, a benchmark-only
         path around ``megatron-kd train``'s entry; the plan does not count its teacher, and its
         model FLOPs are the student's (the teacher's forward is what online KD adds to the step)
Memory layout and optimizer, passed to Megatron-LM (the recipe's own recompute flags are replaced):
  --recompute full | block:N | selective | none | plan   full: every layer (uniform, 1 layer);
                 block:N: the first N layers whole (--recompute-method block), the others not;
                 selective: the --recompute-modules only; none: no recompute; plan: the layout
                 ``megatron-kd plan --search`` ranks first for the run (its flags and loss path,
                 --gpu-memory: 141GB, an H200, unless given) with the run's parallel sizes and
                 micro-batch, labelled with it; a run no layout fits is reported, not run
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
Each (loss, configuration) is one run, labelled "<loss>" for the size's default layout, else
"<loss> <what differs>" (or ``--label``): results.json keeps every label, and a label that
finished is skipped when re-run.

Reported from Megatron's own log: median time per iteration after the first two, peak allocated
memory (``--log-memory-interval``, data-parallel rank 0), out-of-memory if it happens; tokens/s per
GPU = global batch x --seq / GPUs / step time; beside the plan's GiB, the peaks the paper
reported where the size has them (llama3-3b at 8K: 58.3 GB fused, 102.8 GB online). Model TFLOP/s
per GPU in two conventions = FLOPs per step / GPUs / step time:
  bench     the matmuls of forward and backward (``benchmarks.common.gpt_oss.model_flops``): attention scores
            and values over the causal half on full layers and 128 keys on window layers, the
            gated experts' (and a gated dense MLP's) three matrices; recompute not counted. With --packing documents the
            attention is counted per document (the causal half of each --document-tokens document),
            as the attention kernels compute it
  megatron  Megatron-LM's ``num_floating_point_operations`` on the run's arguments (what
            ``--log-throughput`` prints, also parsed from the log): full causal attention on every
            layer (it knows no windows), the gated-unit factor only from ``--swiglu`` (GPT-OSS's
            ``--quick-geglu`` counts the experts as two matrices); for a dense Llama the two agree
            but for half a key per query
``--memory-snapshot`` passes ``--record-memory-history --memory-snapshot-path`` and summarizes the
allocator snapshot that Megatron dumps after the last iteration into ``memory_<label>.json``
(bytes by category and the allocation sites, between iterations and at the peak of the recorded
trace; a few KB). Its step times include writing the snapshot. Every stage is kept in ``--out``
and skipped when re-run (data, teacher, cache, finished runs).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import math
import os
import pickle
import re
import shlex
import statistics
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TEACHER_HIDDEN = 64
# Gaussian logits: top-1 p ~0.4, top-100 mass ~0.93 over 201,088 ids (the max of 128,256 such logits
# is 2% lower: about the same distribution)
TEACHER_LOGIT_STD = 5.5
TOPK = 100  # the cache's K
LOSSES = ("fused", "ce", "fused-ce", "dense", "online")
ONLINE_ENTRY = "benchmarks.common.online_kd"  # the module --losses online runs


@dataclass(frozen=True)
class Recipe:
    """A model as examples/ spells it: ``<family>/<arch>`` then ``<family>/<size>``, whose arrays
    ``<prefix>_ARCH``, ``_SIZE`` and ``_LAYOUT`` are the flags the family's distill.sh passes."""
    family: str
    arch: str
    size: str
    prefix: str

    def flags(self, *, layout: bool = True) -> list[str]:
        here = ROOT / "examples" / self.family
        arrays = [f'"${{{self.prefix}_{part}[@]}}"' for part in ("ARCH", "SIZE", *(("LAYOUT",) if layout else ()))]
        script = f'source "{here / self.arch}"; source "{here / self.size}"; printf "%s\\n" {" ".join(arrays)}'
        out = subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout
        return out.split("\n")[:-1]


@dataclass(frozen=True)
class ModelSize:
    """One ``--size``: the student's recipe and vocabulary, its runs' defaults, and the teacher of
    ``--losses online``. The cache's teacher is always the tiny random one (``write_teacher``)
    at this vocabulary, K = TOPK; the model FLOPs come from the flags (``benchmarks.common.gpt_oss.model_flops``:
    MoE or dense)."""
    recipe: Recipe
    vocab: int  # embedding rows; NullTokenizer ids 0..vocab-2, end-of-document vocab-1
    gpus: int  # default --gpus
    seq: int  # default --seq
    recompute: str  # default --recompute: the layout whose runs are labelled by their loss alone
    samples_per_gpu: int = 2  # default global batch: micro-batches of one sample per GPU, or
    tokens_per_gpu: int | None = None  # this many tokens per GPU per step (at least one sample)
    online_teacher: Recipe | None = None  # --losses online: the teacher's architecture and size
    origin_gb: dict = field(default_factory=dict)  # {loss: GB} the paper reported at origin_seq
    origin_seq: int | None = None

    @functools.cached_property
    def moe(self) -> bool:
        return "--num-experts" in self.recipe.flags(layout=False)


LLAMA3 = dict(family="llama", arch="llama3.sh", prefix="LLAMA3")
SIZES = {
    "20b": ModelSize(Recipe("gpt_oss", "gpt_oss.sh", "20b.sh", "GPT_OSS"), vocab=201088, gpus=8, seq=32768,
                     recompute="full"),
    "120b": ModelSize(Recipe("gpt_oss", "gpt_oss.sh", "120b.sh", "GPT_OSS"), vocab=201088, gpus=8, seq=32768,
                      recompute="full"),
    # the 64-expert student pruned from the 120B teacher (megatron-kd prune --prune-num-experts 64)
    "120b_e64": ModelSize(Recipe("gpt_oss", "gpt_oss.sh", "120b_e64.sh", "GPT_OSS"), vocab=201088, gpus=8,
                          seq=32768, recompute="full"),
    # Llama-3.2-3B from Llama-3.1-8B-Instruct on one GPU (both 128,256 ids): 8 samples of 8K per step,
    # no recompute (3b.sh); the paper's peaks at 8K: 58.3 GB fused, 102.8 GB online
    "llama3-3b": ModelSize(Recipe(size="3b.sh", **LLAMA3), vocab=128256, gpus=1, seq=8192, recompute="none",
                           tokens_per_gpu=65536, online_teacher=Recipe(size="8b.sh", **LLAMA3),
                           origin_gb={"fused": 58.3, "online": 102.8}, origin_seq=8192),
}
# --optimizer: the flags of each choice (megatron: what megatron-core builds from its own flags)
OPTIMIZER_FLAGS = {"megatron": [], "fused": ["--kd-fused-adam"], "bf16-sr-8bit": ["--kd-optimizer", "bf16-sr-8bit"]}
# the recipe's recompute and optimizer flags, replaced by --recompute / --recompute-modules / --optimizer
# (flag -> number of values it takes; None: every value up to the next flag)
RECIPE_RECOMPUTE_FLAGS = {"--recompute-granularity": 1, "--recompute-method": 1, "--recompute-num-layers": 1,
                          "--recompute-modules": None, "--kd-fused-adam": 0, "--kd-optimizer": 1}
# options that fix the model, the data and the cache: the call's, for every configuration of it
SHARED_OPTIONS = ("size", "gpus", "rank_of", "layers", "experts", "seq", "global_batch_size", "iters", "packing",
                  "document_tokens", "gpu_memory", "timeout", "out")
# --packing documents: Megatron-LM's flags that keep packed documents apart, for the cache build and
# every training run alike (the cache records its packing and a run with other flags is refused)
PACKING_FLAGS = {"none": [], "documents": ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]}


def recompute_choice(text: str) -> str:
    if text in ("full", "selective", "none", "plan") or re.fullmatch(r"block:[1-9][0-9]*", text):
        return text
    raise argparse.ArgumentTypeError(f"--recompute: expected full, selective, none, plan or block:N (N >= 1), "
                                     f"got {text!r}")


def module_list(text: str) -> list[str]:
    return [m for m in re.split(r"[,\s]+", text) if m]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=tuple(SIZES), default="20b")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs of the run (default: the size's, 8 for GPT-OSS, 1 for Llama; 1 with --rank-of)")
    p.add_argument("--rank-of", type=int, default=None, metavar="N",
                   help="one rank of an N-GPU node on one GPU: experts / N local experts, expert parallel 1")
    p.add_argument("--layers", type=int, default=None, help="override the recipe's depth")
    p.add_argument("--experts", type=int, default=None, help="override the recipe's number of experts")
    p.add_argument("--seq", type=int, default=None, help="tokens per sample (default: the size's, 32K / Llama 8K)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="default: 2 micro-batches per GPU (GPT-OSS), 65,536 tokens per GPU (Llama)")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--packing", choices=tuple(PACKING_FLAGS), default="none",
                   help="documents: attention and positions kept within each packed document")
    p.add_argument("--document-tokens", type=int, default=8192,
                   help="tokens per document of the random data, its EOD included (default 8192)")
    p.add_argument("--losses", default="fused,ce,dense")
    p.add_argument("--recompute", type=recompute_choice, default=None,
                   help="default: the size's (GPT-OSS full, Llama none)")
    p.add_argument("--recompute-modules", type=module_list, default=None)
    p.add_argument("--gpu-memory", default=None,
                   help="memory of one GPU that --recompute plan plans for (default: megatron-kd plan's, 141GB)")
    p.add_argument("--offload-modules", type=module_list, default=None)
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_FLAGS), default="megatron")
    p.add_argument("--extra", default="", help="more Megatron-LM / --kd-* flags, one string")
    p.add_argument("--impl", choices=("auto", "local", "te"), default="auto",
                   help="the layer spec: megatron-core's local spec with megatron_kd's attention and experts, or "
                        "Transformer Engine's (auto: TE where it is importable)")
    p.add_argument("--label", default=None, help="name of this configuration in results (default: what differs)")
    p.add_argument("--memory-snapshot", action="store_true")
    p.add_argument("--also", action="append", default=[], metavar="OPTIONS",
                   help="another configuration: these options over this call's (repeatable)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per training run")
    p.add_argument("--out", type=Path, default=Path("runs/node"))
    return p


def recipe_experts(size: str) -> int:
    flags = SIZES[size].recipe.flags()
    return int(flags[len(flags) - 1 - flags[::-1].index("--num-experts") + 1])


def default_global_batch(size: ModelSize, seq: int, gpus: int) -> int:
    per_gpu = max(1, size.tokens_per_gpu // seq) if size.tokens_per_gpu else size.samples_per_gpu
    return per_gpu * gpus


def _finish(p: argparse.ArgumentParser, opts: argparse.Namespace) -> argparse.Namespace:
    size = SIZES[opts.size]
    if not size.moe and (opts.rank_of is not None or opts.experts is not None):
        p.error(f"--rank-of / --experts: the {opts.size} recipe has no experts")
    if opts.rank_of is not None:
        if opts.gpus not in (None, 1) or opts.experts is not None:
            p.error("--rank-of N sets --gpus 1 and --experts (experts / N): give neither")
        experts = recipe_experts(opts.size)
        if opts.rank_of < 1 or experts % opts.rank_of:
            p.error(f"--rank-of must divide the {opts.size} recipe's {experts} experts, got {opts.rank_of}")
        opts.gpus, opts.experts = 1, experts // opts.rank_of
    opts.gpus = opts.gpus or size.gpus
    opts.seq = opts.seq or size.seq
    opts.global_batch_size = opts.global_batch_size or default_global_batch(size, opts.seq, opts.gpus)
    opts.recompute = opts.recompute or size.recompute
    if opts.gpu_memory is None:
        from megatron_kd.megatron.plan import DEFAULT_GPU_MEMORY

        opts.gpu_memory = DEFAULT_GPU_MEMORY
    opts.out = opts.out.resolve()  # the launcher runs from the repository root
    losses = set(opts.losses.split(","))
    if losses - set(LOSSES):
        p.error(f"unknown losses {sorted(losses - set(LOSSES))}: choose from {LOSSES}")
    if "online" in losses and size.online_teacher is None:
        p.error(f"--losses online: the {opts.size} size has no online teacher (llama3-3b has the 8B)")
    if "online" in losses and opts.recompute == "plan":
        p.error("--losses online with --recompute plan: megatron-kd plan does not count an online teacher; "
                "give the layout (--recompute full, ...)")
    if opts.recompute_modules and opts.recompute in ("none", "plan"):
        p.error("--recompute-modules needs --recompute selective, full or block:N (plan picks its own)")
    have_te = importlib.util.find_spec("transformer_engine") is not None
    if opts.impl == "te" and not have_te:
        p.error("--impl te: Transformer Engine is not installed here (launch/install_te.sh)")
    opts.spec = opts.impl if opts.impl != "auto" else ("te" if have_te else "local")
    if opts.offload_modules and not have_te:
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
    """What differs from the size's default layout: '' for that one."""
    if opts.label:
        return opts.label
    parts = []
    if opts.recompute != SIZES[opts.size].recompute:
        parts.append(f"recompute={opts.recompute}")
    if opts.recompute_modules:
        parts.append("modules=" + ",".join(opts.recompute_modules))
    if opts.offload_modules:
        parts.append("offload=" + ",".join(opts.offload_modules))
    if opts.optimizer != "megatron":
        parts.append(f"optimizer={opts.optimizer}")
    if opts.impl != "auto":
        parts.append(f"spec={opts.impl}")
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
            "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(SIZES[opts.size].vocab),
            "--data-cache-path", str(opts.out / "work" / "index-cache"), "--num-workers", "2",
            "--eval-iters", "0", "--eval-interval", "1000000", *PACKING_FLAGS[opts.packing]]


def spec_flags(opts) -> list[str]:
    """The flags of the configuration's layer spec: the local spec's, or Transformer Engine's (without
    Apex, no gradient accumulation fusion; GPT-OSS's biased experts without bias-dropout fusion, which
    TE's grouped experts refuse)."""
    from benchmarks.common.gpt_oss import LOCAL_SPEC_FLAGS

    if opts.spec == "local":
        return list(LOCAL_SPEC_FLAGS)
    flags = ["--transformer-impl", "transformer_engine"]
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        flags.append("--no-gradient-accumulation-fusion")
    if SIZES[opts.size].moe:
        flags.append("--no-bias-dropout-fusion")
    return flags


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
    size = SIZES[opts.size]
    flags = [*strip_flags(size.recipe.flags(), RECIPE_RECOMPUTE_FLAGS), *spec_flags(opts), "--seq-length", str(opts.seq)]
    if size.moe:
        flags += ["--expert-model-parallel-size", str(min(8, opts.gpus))]
    if opts.layers:
        flags += ["--num-layers", str(opts.layers)]
    if opts.experts:
        flags += ["--num-experts", str(opts.experts)]
    return flags


def layout_flags(opts, planned=None) -> list[str]:
    """Megatron-LM flags of this configuration's recompute, offload and optimizer choices;
    ``--recompute plan``: ``planned``'s recompute (a plan ``Layout``), none without it (what
    ``planned_layout`` searches from)."""
    flags = []
    if opts.recompute == "plan":
        flags += planned.recompute_flags() if planned is not None else []
    elif opts.recompute == "full":
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

    n, vocab = opts.document_tokens, SIZES[opts.size].vocab
    prefix = opts.out / "work" / "data" / f"random-v{vocab}-doc{n}"
    if not Path(str(prefix) + ".idx").exists():
        tokens = math.ceil(1.1 * opts.global_batch_size * opts.iters * (opts.seq + 1)) + n
        rng = np.random.default_rng(0)
        docs = ([*rng.integers(0, vocab - 1, size=n - 1), vocab - 1] for _ in range(tokens // n + 1))
        write_indexed_dataset(prefix, docs, vocab)
    return str(prefix)


def write_teacher(opts) -> Path:
    """A one-layer random Llama at the student's vocabulary, its output layer scaled so that the
    logits of a normalized hidden state have std TEACHER_LOGIT_STD."""
    vocab = SIZES[opts.size].vocab
    path = opts.out / "work" / f"teacher-hf-v{vocab}"
    if not (path / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=vocab, hidden_size=TEACHER_HIDDEN, intermediate_size=2 * TEACHER_HIDDEN,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=opts.seq, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, TEACHER_LOGIT_STD / math.sqrt(TEACHER_HIDDEN))
        model.save_pretrained(path)
    return path


def torchrun(opts, args: list[str], log: Path, module: str | None = None) -> tuple[int, str]:
    """``megatron-kd args`` on ``--gpus`` GPUs through the project's launcher (launch/torchrun.sh);
    ``module``: that Python module instead (``-m``, from the repository root as the launcher runs),
    with the launcher's environment (launch/env.sh)."""
    cmd = ["bash", str(ROOT / "launch" / "torchrun.sh"), *args]
    if module is not None:
        launch = ('source "$0/launch/env.sh"; cd "$_root"; exec "${TORCHRUN[@]}" --standalone --nproc-per-node '
                  '"$GPUS" --master-port "${MASTER_PORT:-29500}" -m "$@"')
        cmd = ["bash", "-c", launch, str(ROOT), module, *args]
    env = {**os.environ, "GPUS": str(opts.gpus), "PYTHON": sys.executable}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=opts.timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    log.write_text(text)
    return rc, text


def cache_name(opts) -> str:
    """One cache per vocabulary, sequence length, data and packing (a cache built without packing
    refuses a packed run)."""
    return f"cache-v{SIZES[opts.size].vocab}-s{opts.seq}-doc{opts.document_tokens}-{opts.packing}"


def cache_build_args(opts, data_prefix: str, teacher: Path, cache: Path) -> list[str]:
    """``megatron-kd cache build`` of the tiny teacher at ``teacher`` (``write_teacher``: the size's
    vocabulary) over the runs' data, top-TOPK."""
    model = ["--num-layers", "1", "--hidden-size", str(TEACHER_HIDDEN), "--num-attention-heads", "4",
             "--max-position-embeddings", str(opts.seq), *spec_flags(opts), "--bf16"]
    return ["cache", "build", *data_flags(opts, data_prefix), *model, "--kd-teacher-hf", str(teacher),
            "--kd-cache", str(cache), "--kd-cache-mode", "topk", "--kd-topk", str(TOPK)]


def build_cache(opts, data_prefix: str) -> Path:
    cache = opts.out / "work" / cache_name(opts)
    done = cache.with_name(cache.name + ".done")
    if not done.exists():
        rc, text = torchrun(opts, cache_build_args(opts, data_prefix, write_teacher(opts), cache),
                            opts.out / "cache_build.log")
        if rc != 0:
            raise SystemExit(f"cache build failed (exit {rc}), see {opts.out / 'cache_build.log'}:\n{text[-3000:]}")
        done.write_text(re.findall(r"teacher cache .*", text)[-1] + "\n")
    return cache


def loss_flags(loss: str, cache: Path) -> list[str]:
    """``online``: no cache, the teacher in the process (``online_command``)."""
    return {"fused": ["--kd-cache", str(cache)], "dense": ["--kd-cache", str(cache), "--kd-impl", "dense"],
            "ce": ["--kd-ce-impl", "megatron"], "fused-ce": [], "online": []}[loss]


def online_command(opts, flags: list[str]) -> list[str]:
    """benchmarks.common.online_kd's arguments: the teacher's model flags (its recipe without layout),
    then the student's ``megatron-kd train`` flags."""
    teacher = SIZES[opts.size].online_teacher.flags(layout=False)
    return ["--online-teacher", shlex.join(teacher), *flags]


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


def plan_loss(loss: str) -> str:
    return "fused" if loss.startswith("fused") else loss


def plan_gib(flags: list[str], gpus: int, loss: str) -> float | None:
    """The plan of the run; None for online KD (the plan knows no teacher in the process)."""
    from megatron_kd.megatron.plan import GIB, estimate, plan_args

    if loss == "online":
        return None
    args, layout = plan_args(flags, gpus)
    return estimate(args, layout, gpus=gpus, loss=plan_loss(loss), kd_topk=TOPK).total / GIB


def planned_layout(flags: list[str], gpus: int, loss: str, gpu_memory: str):
    """``--recompute plan``: the layout ``megatron-kd plan --search`` ranks first for the run
    ``flags`` (model, data, optimizer and extra flags, the loss path, ``gpu_memory`` per GPU) among
    those with the run's own parallel sizes and micro-batch: on one GPU, its recompute. None if none fits."""
    from megatron_kd.megatron.plan import parse_size, plan_args, search

    args, run = plan_args(flags, gpus)
    sizes = lambda layout: (layout.tp, layout.pp, layout.ep, layout.cp, layout.micro_batch)  # noqa: E731
    fits = [p for p in search(args, gpus, gpu_memory=parse_size(gpu_memory), loss=plan_loss(loss),
                              kd_topk=TOPK) if sizes(p.layout) == sizes(run)]
    return fits[0].layout if fits else None


def model_flops_per_step(args, opts) -> float:
    """The benchmark's convention (see the module docstring), one global batch."""
    from benchmarks.common.gpt_oss import model_flops

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


def _number(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(results: dict) -> str:
    experts = f" x {results['experts']} experts" if results.get("experts") else ""
    lines = [f"# {results['size']} student, {results['layers']} layers{experts}, {results['seq']:,} tokens, "
             f"{results['gpus']} GPUs, global batch {results['global_batch_size']}", ""]
    if results.get("packing", "none") != "none":
        lines += [f"Packed documents of {results['document_tokens']:,} tokens kept apart ({results['packing']}: "
                  + " ".join(PACKING_FLAGS[results["packing"]]) + ").", ""]
    if results.get("rank_of"):
        lines += [rank_note(results), ""]
    origin = results.get("origin_gb") or {}
    if origin:
        lines += ["Origin: the peaks the product's origin reported on one H200 for this student and teacher at this "
                  "length, in GB as it printed them (1 GiB = 1.074 GB).", ""]
    per_document = " attention counted per document," if results.get("packing", "none") != "none" else ""
    lines += [f"Model FLOPs per step: {results['model_tflop_per_step']:.0f} TFLOP (bench convention,{per_document} "
              f"recompute not counted), "
              f"{results['megatron_tflop_per_step']:.0f} TFLOP (Megatron-LM's num_floating_point_operations). "
              f"{results.get('cache', '')}", "",
              "| run | step (s) | tokens/s per GPU | model TFLOP/s per GPU: bench | Megatron | peak GiB (rank 0) "
              "| plan GiB | plan error |" + (" origin GB |" if origin else ""),
              "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if origin else "")]
    for label, r in results["runs"].items():
        name = label + (f" ({r['plan_layout']})" if r.get("plan_layout") else "")
        theirs = f" {_number(origin.get(r['loss']), '.1f')} |" if origin else ""
        plan = _number(r.get("plan_gib"), ".1f")
        if r.get("no_fit"):
            lines.append(f"| {name} | not run: plan --search finds no layout that fits | | | | | | |" + theirs)
            continue
        if r.get("oom") or r["step_s"] is None:
            lines.append(f"| {name} | {'OOM' if r.get('oom') else 'failed (exit %s)' % r['rc']} | | | | | {plan} | |"
                         + theirs)
            continue
        err = "" if r["peak_gib"] is None or r.get("plan_gib") is None else f"{r['plan_gib'] / r['peak_gib'] - 1:+.1%}"
        lines.append(f"| {name} | {r['step_s']:.2f} | {_number(r.get('tokens_per_s_per_gpu'), ',.0f')} "
                     f"| {r['tflops_per_gpu']:.0f} | {_number(r.get('megatron_tflops_per_gpu'), '.0f')} "
                     f"| {_number(r['peak_gib'], '.1f')} | {plan} | {err} |" + theirs)
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
