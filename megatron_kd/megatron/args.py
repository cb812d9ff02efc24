"""The ``--kd-*`` flags, declared once as three configs (``megatron_kd/options.py``): the student's
loss (``KDConfig``), the student run's start and optimizer (``StudentConfig``) and the teacher pass
(``TeacherPassConfig``). ``add_kd_args`` is a Megatron ``extra_args_provider`` built from them; the
README's flag table is ``kd_option_table()``.

``add_kd_args`` returns the parser, so it chains with any other provider:
``extra_args_provider=chain_args_providers(add_kd_args, add_modelopt_args)``. ``check_kd_flags``
builds every config from parsed flags, so a flag is checked by the same rules (a numeric flag's
``Range``, the rules that tie flags together) whether it came from the command line or from code.
"""

import argparse
from dataclasses import dataclass
from typing import Literal

from megatron_kd.cache.encodings import CODECS, SAMPLED_COUNTS_V1
from megatron_kd.errors import FlagError
from megatron_kd.ops import DIVERGENCES, IMPLS, TAILS
from megatron_kd.optim.megatron import DEFAULT_OPTIMIZER, OPTIMIZERS
from megatron_kd.options import (Range, add_option_group, check_ranges, flag_name, from_args, option, option_rules,
                                 option_table)

KD_IMPLS = ("fused", "dense")
CE_IMPLS = ("fused", "megatron")
CACHE_MODES = ("topk", "sampled")
QUANT_FORMATS = ("mxfp4", "nvfp4")  # megatron_kd.ops.quant.FORMATS
CACHE_CODECS = ("auto", *CODECS)
# cache build's defaults: the fidelity benchmark's choice (benchmarks/RESULTS.md, "Which cache")
DEFAULT_CACHE_MODE = "sampled"
DEFAULT_DRAWS = 64
DEFAULT_TOPK = 100
PREFIX = "kd"


def _check_choices(config, hints: dict) -> None:
    for name, choices in hints.items():
        if getattr(config, name) not in choices:
            raise FlagError(f"{flag_name(f'{PREFIX}_{name}')} must be one of {choices}, got {getattr(config, name)!r}")


@dataclass
class KDConfig:
    """knowledge distillation (megatron_kd): the student's loss"""

    cache: str | None = option(metavar="PATH")
    """The teacher cache to distill from (train), or to write (cache build): a Zarr store whose
    vocabulary, sequence length, tokenizer, packing and loss mask must match the run's; each of the
    run's samples is found in it by its tokens."""
    weight: float = option(1.0, metavar="W", rule=Range(0))
    """Weight of the distillation term, multiplied by the temperature squared."""
    ce_weight: float = option(0.0, metavar="W", rule=Range(0))
    """Weight of hard-label cross-entropy, at temperature 1 in the same pass over the logits."""
    temperature: float = option(1.0, metavar="T", rule=Range(0, low_open=True))
    """Softmax temperature of the student; the cached teacher is tempered within its entries."""
    tail: Literal[TAILS] = option("renorm")
    """The teacher's mass outside the cached entries: 'renorm' renormalizes the entries to 1 (exact
    for sampled caches), 'none' ignores it, 'ghost' keeps it as one extra outcome (a true KL over
    K + 1 outcomes)."""
    divergence: Literal[DIVERGENCES] = option("forward")
    """Over the cached support, P the teacher and Q the student: 'forward' KL(P||Q), 'reverse'
    KL(Q||P), 'jsd' beta KL(P||M) + (1 - beta) KL(Q||M) with M = beta P + (1 - beta) Q; reverse and
    jsd need --kd-tail renorm or ghost."""
    jsd_beta: float = option(0.5, metavar="B", rule=Range(0, low_open=True, high=1, high_open=True))
    """beta of --kd-divergence jsd, in (0, 1): the teacher's weight in the mixture M."""
    chunk_size: int | None = option(metavar="N", rule=Range(1, integer=True), unset="auto")
    """Tokens per chunk of the fused loss (auto: a logits block the size of one bf16 weight gradient
    plus 0.5 GiB, less the loss's own buffers); longer chunks are faster and cost memory."""
    impl: Literal[KD_IMPLS] = option("fused")
    """'fused': the chunked loss from hidden states; 'dense': the materializing baseline (full
    logits), for comparisons."""
    ce_impl: Literal[CE_IMPLS] = option("fused")
    """Batches without a teacher (no --kd-cache, validation): cross-entropy through the fused op (no
    [tokens x vocabulary] logits), or 'megatron': Megatron's output layer + vocab-parallel CE."""
    op_impl: Literal[IMPLS] = option("auto")
    """The fused op: 'triton' (CUDA kernels), 'torch' (plain torch), 'auto' (Triton on CUDA, torch
    on CPU)."""

    def __post_init__(self):
        _check_choices(self, {"tail": TAILS, "divergence": DIVERGENCES, "impl": KD_IMPLS, "ce_impl": CE_IMPLS,
                              "op_impl": IMPLS})
        check_ranges(self, prefix=PREFIX)
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
        full softmax)."""
        if self.divergence != "forward" and self.tail == "renorm" and self.weight > 0:
            return (f"warning: --kd-divergence {self.divergence} with --kd-tail renorm gives no gradient to the "
                    f"student's mass outside the cached tokens; on a 64-draw cache it trained students worse than "
                    f"cross-entropy alone (benchmarks/RESULTS.md, 'Distillation fidelity'); forward KL does not")
        return None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "KDConfig":
        return from_args(cls, args, prefix=PREFIX)


@dataclass
class StudentConfig:
    """the student run (megatron_kd): its start and its optimizer"""

    student_hf: str | None = option(metavar="DIR")
    """Initialize the student from a local Hugging Face directory (GPT-OSS: bf16, or MXFP4 experts
    dequantized; Llama 3.x; Qwen3) through nvidia-modelopt's importer; it must match the model
    flags (fewer --num-layers take its first layers). Also the default --tokenizer-model. A
    checkpoint in --load takes precedence (resuming)."""
    optimizer: Literal[OPTIMIZERS] = option(DEFAULT_OPTIMIZER)
    """Optimizer state. 'megatron': what megatron-core builds from its own flags (fp32 master
    weights and moments by default). 'bf16-sr-8bit': Adam on the bf16 weights with stochastic
    rounding (no fp32 master copy), 8-bit blockwise moments and bf16 gradients; it implies --bf16
    --use-distributed-optimizer --use-precision-aware-optimizer --main-grads-dtype bf16
    --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8, and its checkpoints hold fp32 values (Megatron's
    format) that resume it exactly."""
    fused_adam: bool = option(False)
    """Without Transformer Engine or Apex, megatron-core's Adam is torch's AdamW; this builds it
    with fused=True (one kernel per group of tensors, the same fp32 arithmetic). No effect where
    TE's or Apex's FusedAdam is installed."""
    quant: Literal[QUANT_FORMATS] | None = option(None)
    """Quantization-aware distillation: the MoE experts' weights (GPT-OSS's MXFP4 set) are
    fake-quantized in every forward, 'mxfp4' (FP4 E2M1 in blocks of 32 inputs with an E8M0 scale:
    GPT-OSS's release format) or 'nvfp4' (blocks of 16 with an E4M3 scale and a tensor scale); the
    gradient passes straight through to the weights the optimizer keeps. megatron_kd's grouped
    experts (the local spec) only."""


@dataclass
class TeacherPassConfig:
    """the teacher pass (megatron-kd cache build)"""

    cache_mode: Literal[CACHE_MODES] = option(DEFAULT_CACHE_MODE)
    """What a new cache stores per token: 'sampled' --kd-draws tokens drawn from the teacher with
    their counts (Random-Sampling KD: unbiased), or 'topk' the teacher's --kd-topk most likely
    tokens."""
    draws: int | None = option(metavar="N", rule=Range(1, integer=True), unset=str(DEFAULT_DRAWS))
    """Draws per token of a sampled cache (refused with --kd-cache-mode topk)."""
    topk: int | None = option(metavar="K", rule=Range(1, integer=True), unset=str(DEFAULT_TOPK))
    """Entries per token of a top-K cache (refused with --kd-cache-mode sampled)."""
    cache_codec: Literal[CACHE_CODECS] = option("auto")
    """How a new cache stores its rows: 'auto' is topk-v3 for top-K (probabilities in one-byte
    levels) and sampled-counts-v1 (exact counts) for sampled; topk-v2 stores the top-K losslessly;
    topk-v1 is the first format. A resumed build keeps its store's."""
    cache_workers: int | None = option(metavar="N", rule=Range(1, integer=True), unset="the rank's cores, at most 8")
    """Threads per data-parallel rank that compress and write the cache's shards behind the
    forward (by default the rank's share of its node's CPU cores, at most 8); the store's bytes do
    not depend on it."""
    capture_temperature: float = option(1.0, metavar="T", rule=Range(0, low_open=True))
    """The teacher's softmax temperature at capture."""
    teacher_hf: str | None = option(metavar="DIR")
    """A local Hugging Face directory as the teacher instead of --load (cache build, prune). With
    GPT-OSS model flags it is imported into the Megatron model those flags describe (sharded by
    tensor / expert parallelism, through nvidia-modelopt); any other causal LM (Llama, Qwen3, ...)
    runs as a transformers model on each rank in the teacher pass, and prune imports it into the
    Megatron model its flags describe."""
    cache: str | None = option(metavar="PATH")
    """Where the cache is written (the flag is KDConfig's --kd-cache)."""
    chunk_size: int | None = option(metavar="N", rule=Range(1, integer=True), unset="auto")
    """Tokens per projection chunk of the teacher's output layer (the flag is KDConfig's
    --kd-chunk-size)."""

    def __post_init__(self):
        _check_choices(self, {"cache_mode": CACHE_MODES, "cache_codec": CACHE_CODECS})
        check_ranges(self, prefix=PREFIX)
        if self.draws is not None and self.cache_mode != "sampled":
            raise FlagError(f"--kd-draws {self.draws} is for --kd-cache-mode sampled (this run stores the top-K: "
                            "--kd-topk sets K)")
        if self.topk is not None and self.cache_mode != "topk":
            raise FlagError(f"--kd-topk {self.topk} is for --kd-cache-mode topk (this run's mode is "
                            f"{self.cache_mode}, the default: --kd-draws sets its draws, {DEFAULT_DRAWS} unless given)")
        if self.cache_codec == SAMPLED_COUNTS_V1 and self.cache_mode != "sampled":
            raise FlagError(f"--kd-cache-codec {SAMPLED_COUNTS_V1} stores draw counts: it needs --kd-cache-mode "
                            "sampled (top-K caches: auto, topk-v2 or topk-v3)")

    @property
    def entries(self) -> int:
        """Entries per token of the cache: K of a top-K cache, the draws of a sampled one."""
        if self.cache_mode == "sampled":
            return self.draws or DEFAULT_DRAWS
        return self.topk or DEFAULT_TOPK

    @property
    def codec(self) -> str | None:
        """The codec a new store is written in (None: the mode's default)."""
        return None if self.cache_codec == "auto" else self.cache_codec

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TeacherPassConfig":
        return from_args(cls, args, prefix=PREFIX)


# every --kd-* flag: each config's group, less the fields whose flag another config declares
KD_OPTION_GROUPS = ((KDConfig, ()), (StudentConfig, ()), (TeacherPassConfig, ("cache", "chunk_size")))
# dest -> range, for every int / float --kd-* flag
NUMERIC_FLAG_RULES = {dest: rule for config, _ in KD_OPTION_GROUPS for dest, rule in
                      option_rules(config, prefix=PREFIX).items()}
# the name of the draws' flag before it said draws
RENAMED_FLAGS = {"--kd-samples": "--kd-draws"}


def cache_entries(args: argparse.Namespace) -> int:
    """Entries per token of the cache the flags describe: K of a top-K cache, the draws of a sampled one."""
    return TeacherPassConfig.from_args(args).entries


def check_kd_flags(args: argparse.Namespace) -> KDConfig:
    """Every --kd-* flag of parsed ``args`` against its rule (one ``FlagError`` line), including the
    teacher pass's; returns the student's KDConfig."""
    for dest, rule in NUMERIC_FLAG_RULES.items():
        rule.check(flag_name(dest), getattr(args, dest))
    TeacherPassConfig.from_args(args)
    return KDConfig.from_args(args)


def refuse_renamed_flags(argv: list[str]) -> None:
    for arg in argv:
        new = RENAMED_FLAGS.get(arg.split("=", 1)[0])
        if new is not None:
            raise FlagError(f"{arg.split('=', 1)[0]} is now {new}")


def _check_rules_cover(group) -> None:
    """A bug, not a user mistake: a numeric --kd-* flag without an entry in NUMERIC_FLAG_RULES."""
    numeric = {a.dest for a in group._group_actions if a.type in (int, float)}
    if not numeric <= set(NUMERIC_FLAG_RULES):
        raise RuntimeError(f"NUMERIC_FLAG_RULES and the numeric --kd-* flags differ: "
                           f"{sorted(numeric - set(NUMERIC_FLAG_RULES))}")


def add_kd_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for config, declared_elsewhere in KD_OPTION_GROUPS:
        _check_rules_cover(add_option_group(parser, config, prefix=PREFIX, exclude=declared_elsewhere))
    return parser


def kd_option_table() -> list[str]:
    """The README's table of every --kd-* flag (flag, default, meaning)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for config, declared_elsewhere in KD_OPTION_GROUPS:
        rows += option_table(config, prefix=PREFIX, exclude=declared_elsewhere)
    return rows


def chain_args_providers(*providers):
    """One extra_args_provider that applies several (e.g. ours and ModelOpt's) in order."""
    def provider(parser):
        for p in providers:
            parser = p(parser) or parser
        return parser
    return provider
