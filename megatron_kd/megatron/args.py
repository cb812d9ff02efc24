"""``--kd-*`` command-line flags (a Megatron ``extra_args_provider``) and the KDConfig they fill.

``add_kd_args`` adds one argument group and returns the parser, so it chains with any other
provider: ``extra_args_provider=chain_args_providers(add_kd_args, add_modelopt_args)``.

Every numeric flag has a rule in ``NUMERIC_FLAG_RULES`` (finite, its range); ``check_kd_flags``
applies them (and the rules that tie flags together) to parsed flags, ``KDConfig.__post_init__``
to the student's fields. ``add_kd_args`` refuses to build a parser with a numeric flag that has no
rule, so a new flag cannot skip the check.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields
from typing import Literal

from megatron_kd.cache.encodings import CODECS, SAMPLED_COUNTS_V1
from megatron_kd.errors import FlagError
from megatron_kd.ops import DIVERGENCES, IMPLS, TAILS
from megatron_kd.optim.megatron import DEFAULT_OPTIMIZER, OPTIMIZERS
from megatron_kd.optim.megatron import HELP as OPTIMIZER_HELP

KD_IMPLS = ("fused", "dense")
CE_IMPLS = ("fused", "megatron")
CACHE_MODES = ("topk", "sampled")
# cache build's defaults, from the fidelity benchmark's GPU preset (README, "Which cache"): 64 draws
# per token (33 bytes/token) came within 0.6% of online KD in held-out CE; top-100 (213) 3.9% off
DEFAULT_CACHE_MODE = "sampled"
DEFAULT_DRAWS = 64
DEFAULT_TOPK = 100


@dataclass(frozen=True)
class Range:
    """Where a numeric flag's value makes sense: finite, above ``low`` (``>`` or ``>=``) and below
    ``high`` (``<`` or ``<=``) when given, an integer when ``integer``. ``None`` is the flag's
    "not given" (its default) and is always allowed."""

    low: float
    low_open: bool = False
    high: float | None = None
    high_open: bool = False
    integer: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.high is None:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{kind} in {left}{self.low:g}, {self.high:g}{right}"

    def allows(self, value) -> bool:
        if value is None:
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.integer and value != int(value):
            return False
        if value < self.low or (self.low_open and value == self.low):
            return False
        return self.high is None or value < self.high or (not self.high_open and value == self.high)

    def check(self, flag: str, value) -> None:
        if not self.allows(value):
            raise FlagError(f"{flag} must be {self.describe()}, got {value!r}")


# dest -> range, for every int / float --kd-* flag (add_kd_args asserts none is missing)
NUMERIC_FLAG_RULES = {
    "kd_weight": Range(0),
    "kd_ce_weight": Range(0),
    "kd_temperature": Range(0, low_open=True),
    "kd_jsd_beta": Range(0, low_open=True, high=1, high_open=True),
    "kd_chunk_size": Range(1, integer=True),
    "kd_topk": Range(1, integer=True),
    "kd_samples": Range(1, integer=True),
    "kd_capture_temperature": Range(0, low_open=True),
    "kd_cache_workers": Range(1, integer=True),
}


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


@dataclass
class KDConfig:
    """Distillation settings of a student run (see ``add_kd_args`` for each flag's meaning)."""

    cache: str | None = None
    weight: float = 1.0
    ce_weight: float = 0.0
    temperature: float = 1.0
    tail: Literal["none", "renorm", "ghost"] = "renorm"
    divergence: Literal["forward", "reverse", "jsd"] = "forward"
    jsd_beta: float = 0.5
    chunk_size: int | None = None
    impl: Literal["fused", "dense"] = "fused"
    op_impl: str = "auto"
    ce_impl: Literal["fused", "megatron"] = "fused"

    def __post_init__(self):
        for name, choices in (("tail", TAILS), ("divergence", DIVERGENCES), ("impl", KD_IMPLS),
                              ("ce_impl", CE_IMPLS), ("op_impl", IMPLS)):
            if getattr(self, name) not in choices:
                raise FlagError(f"{flag_name('kd_' + name)} must be one of {choices}, got {getattr(self, name)!r}")
        for f in fields(self):
            rule = NUMERIC_FLAG_RULES.get(f"kd_{f.name}")
            if rule is not None:
                rule.check(flag_name(f"kd_{f.name}"), getattr(self, f.name))
        if self.cache and self.weight == 0 and self.ce_weight == 0:
            raise FlagError("--kd-weight and --kd-ce-weight are both 0: the loss would be 0 (give either a weight > 0)")
        # without a KD term (weight 0: the CE-only batches) the divergence is not used
        if self.weight > 0 and self.divergence != "forward" and self.tail == "none":
            raise FlagError(f"--kd-divergence {self.divergence} needs --kd-tail renorm or ghost: with tail none the "
                            "student distribution is not defined on the teacher's support")

    @property
    def divergence_warning(self) -> str | None:
        """A line for a combination measured to fail, allowed but said at start-up: reverse KL and JSD
        with the renorm tail compare the student renormalized over the cached tokens (docs/DESIGN.md
        §1), so nothing lowers its mass on the rest of the vocabulary (forward KL's renorm scores the
        full softmax). At the fidelity benchmark's GPU preset such students ended worse than
        cross-entropy alone (README, "Which cache")."""
        if self.divergence != "forward" and self.tail == "renorm" and self.weight > 0:
            return (f"warning: --kd-divergence {self.divergence} with --kd-tail renorm gives no gradient to the "
                    f"student's mass outside the cached tokens; at the fidelity benchmark's GPU preset (64-draw cache) "
                    f"it trained students worse than cross-entropy alone (held-out CE 8.9-9.0 against 3.94; forward "
                    f"KL 3.66)")
        return None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "KDConfig":
        return cls(**{f.name: getattr(args, f"kd_{f.name}") for f in fields(cls)})


def cache_entries(args: argparse.Namespace) -> int:
    """Entries per token of the cache the flags describe: K of a top-K cache, the draws of a sampled one."""
    if args.kd_cache_mode == "sampled":
        return args.kd_samples or DEFAULT_DRAWS
    return args.kd_topk or DEFAULT_TOPK


def check_kd_flags(args: argparse.Namespace) -> KDConfig:
    """Every --kd-* flag of parsed ``args`` against its rule (one ``FlagError`` line), including the
    teacher pass's; returns the student's KDConfig."""
    for dest, rule in NUMERIC_FLAG_RULES.items():
        rule.check(flag_name(dest), getattr(args, dest))
    if args.kd_samples is not None and args.kd_cache_mode != "sampled":
        raise FlagError(f"--kd-samples {args.kd_samples} is for --kd-cache-mode sampled (this run stores the top-K: "
                        "--kd-topk sets K)")
    if args.kd_topk is not None and args.kd_cache_mode != "topk":
        raise FlagError(f"--kd-topk {args.kd_topk} is for --kd-cache-mode topk (this run's mode is "
                        f"{args.kd_cache_mode}, the default: --kd-samples sets its draws, {DEFAULT_DRAWS} unless given)")
    if args.kd_cache_codec == SAMPLED_COUNTS_V1 and args.kd_cache_mode != "sampled":
        raise FlagError(f"--kd-cache-codec {SAMPLED_COUNTS_V1} stores draw counts: it needs --kd-cache-mode sampled "
                        "(top-K caches: auto, topk-v2 or topk-v3)")
    return KDConfig.from_args(args)


def _check_rules_cover(group) -> None:
    """A bug, not a user mistake: a numeric --kd-* flag without an entry in NUMERIC_FLAG_RULES."""
    numeric = {a.dest for a in group._group_actions if a.type in (int, float)}
    if numeric != set(NUMERIC_FLAG_RULES):
        raise RuntimeError(f"NUMERIC_FLAG_RULES and the numeric --kd-* flags differ: "
                           f"{sorted(numeric ^ set(NUMERIC_FLAG_RULES))}")


def add_kd_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="knowledge distillation (megatron_kd)")
    group.add_argument("--kd-cache", type=str, default=None,
                       help="Path of the teacher top-K cache (Zarr store) to distill from. Its vocabulary, "
                            "sequence length, tokenizer and dataset fingerprints must match this run's.")
    group.add_argument("--kd-weight", type=float, default=1.0,
                       help="Weight of the distillation term (>= 0); it is multiplied by temperature squared.")
    group.add_argument("--kd-ce-weight", type=float, default=0.0,
                       help="Weight of the hard-label cross-entropy term (>= 0; computed at temperature 1 in the "
                            "same pass over the logits).")
    group.add_argument("--kd-temperature", type=float, default=1.0,
                       help="Softmax temperature of the student (> 0); the cached teacher is tempered within its "
                            "top-K.")
    group.add_argument("--kd-tail", choices=TAILS, default="renorm",
                       help="Teacher mass outside the top-K: 'renorm' renormalizes the top-K to 1 (the default: "
                            "the best tail at K = 8, 32 and 100 in benchmarks/bench_fidelity.py, and the right one "
                            "for caches built with --kd-cache-mode sampled), 'none' ignores it, 'ghost' keeps it "
                            "as one extra outcome (a true KL over K+1 outcomes).")
    group.add_argument("--kd-divergence", choices=DIVERGENCES, default="forward",
                       help="The distillation term, over the cached support (tail renorm: the K entries; ghost: the "
                            "K entries plus one outcome for the rest), P the teacher, Q the student: 'forward' "
                            "KL(P||Q) (the default); 'reverse' KL(Q||P); 'jsd' the generalized Jensen-Shannon "
                            "divergence beta*KL(P||M) + (1-beta)*KL(Q||M), M = beta*P + (1-beta)*Q. 'reverse' and "
                            "'jsd' need --kd-tail renorm or ghost.")
    group.add_argument("--kd-jsd-beta", type=float, default=0.5,
                       help="beta of --kd-divergence jsd, in (0, 1): the weight of the teacher in the mixture M.")
    group.add_argument("--kd-chunk-size", type=int, default=None,
                       help="Tokens per chunk of the fused loss (>= 1; default: a logits block the size of one bf16 "
                            "weight gradient plus 0.5 GiB, less the loss's own buffers; 3,648 tokens at GPT-OSS "
                            "32K). Longer chunks are faster and cost memory: the weight gradient is accumulated "
                            "once per chunk.")
    group.add_argument("--kd-impl", choices=KD_IMPLS, default="fused",
                       help="'fused': the chunked loss from hidden states; 'dense': the materializing baseline "
                            "(full logits), for comparisons.")
    group.add_argument("--kd-ce-impl", choices=CE_IMPLS, default="fused",
                       help="Batches without a teacher (training without --kd-cache, validation): 'fused' computes "
                            "the cross-entropy with the fused chunked op (no [tokens x vocabulary] logits), "
                            "'megatron' with Megatron's output layer + vocab-parallel cross-entropy.")
    group.add_argument("--kd-op-impl", choices=IMPLS, default="auto",
                       help="Implementation of the fused op: 'triton' (CUDA kernels), 'torch' (plain torch), "
                            "'auto' (Triton on CUDA, torch on CPU).")
    group.add_argument("--kd-fused-adam", action="store_true",
                       help="Without Transformer Engine or Apex, megatron-core's Adam is torch.optim.AdamW with its "
                            "default multi-tensor update; this builds it with fused=True (one kernel per group of "
                            "tensors, the same fp32 arithmetic). No effect where TE's or Apex's FusedAdam is installed.")
    group.add_argument("--kd-optimizer", choices=OPTIMIZERS, default=DEFAULT_OPTIMIZER, help=OPTIMIZER_HELP)
    # teacher pass (megatron-kd cache build)
    group.add_argument("--kd-topk", type=int, default=None,
                       help=f"Entries per token of a top-K cache (--kd-cache-mode topk; K >= 1, default {DEFAULT_TOPK}).")
    group.add_argument("--kd-cache-mode", choices=CACHE_MODES, default=DEFAULT_CACHE_MODE,
                       help="Teacher pass: store --kd-samples tokens drawn from the teacher with their counts "
                            "('sampled', Random-Sampling KD: unbiased; the default) or the top-K ('topk').")
    group.add_argument("--kd-cache-codec", choices=("auto", *CODECS), default="auto",
                       help="Teacher pass: how a new cache stores its rows. auto: topk-v3 for top-K (probabilities "
                            "in one-byte levels, within 6.5%% of p or of 1-p near 1; ~180 bytes/token at K=100, "
                            "V=201,088), sampled-counts-v1 for sampled (exact counts); topk-v2: lossless top-K "
                            "(~257 bytes/token); topk-v1: the first format. A resumed build keeps its store's.")
    group.add_argument("--kd-samples", type=int, default=None,
                       help=f"Draws per token in sampled mode (>= 1; default {DEFAULT_DRAWS}).")
    group.add_argument("--kd-cache-workers", type=int, default=None,
                       help="Teacher pass: threads per data-parallel rank that compress and write the cache's "
                            "shards behind the forward (>= 1; default: the CPU cores of the rank, its node's cores "
                            "divided by the ranks on it, at most 8). The store's bytes do not depend on it.")
    group.add_argument("--kd-capture-temperature", type=float, default=1.0,
                       help="Teacher pass: temperature of the teacher's softmax at capture (> 0).")
    group.add_argument("--kd-teacher-hf", type=str, default=None,
                       help="Teacher pass (and prune): a local Hugging Face directory to use as the teacher instead "
                            "of --load. With GPT-OSS model flags it is imported into the Megatron model those flags "
                            "describe (sharded by tensor / expert parallelism, through nvidia-modelopt); otherwise "
                            "(Llama, Qwen3, any causal LM) the teacher pass runs it as a transformers model on each "
                            "rank, and prune imports it into the Megatron model its flags describe.")
    group.add_argument("--kd-student-hf", type=str, default=None,
                       help="Initialize the student from a local Hugging Face directory (GPT-OSS: bf16, or MXFP4 "
                            "experts dequantized; Llama 3.x; Qwen3) through nvidia-modelopt's importer; it must match "
                            "the model flags "
                            "(fewer --num-layers take its first layers). Also the default --tokenizer-model. A "
                            "checkpoint in --load takes precedence (resuming).")
    _check_rules_cover(group)
    return parser


def chain_args_providers(*providers):
    """One extra_args_provider that applies several (e.g. ours and ModelOpt's) in order."""
    def provider(parser):
        for p in providers:
            parser = p(parser) or parser
        return parser
    return provider
