"""``--kd-*`` command-line flags (a Megatron ``extra_args_provider``) and the KDConfig they fill.

``add_kd_args`` adds one argument group and returns the parser, so it chains with any other
provider: ``extra_args_provider=chain_args_providers(add_kd_args, add_modelopt_args)``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Literal

from megatron_kd.ops import IMPLS, TAILS

KD_IMPLS = ("fused", "dense")
CE_IMPLS = ("fused", "megatron")
CACHE_MODES = ("topk", "sampled")


@dataclass
class KDConfig:
    """Distillation settings of a student run (see ``add_kd_args`` for each flag's meaning)."""

    cache: str | None = None
    weight: float = 1.0
    ce_weight: float = 0.0
    temperature: float = 1.0
    tail: Literal["none", "renorm", "ghost"] = "renorm"
    chunk_size: int | None = None
    impl: Literal["fused", "dense"] = "fused"
    op_impl: str = "auto"
    ce_impl: Literal["fused", "megatron"] = "fused"

    def __post_init__(self):
        if self.tail not in TAILS:
            raise ValueError(f"--kd-tail must be one of {TAILS}, got {self.tail!r}")
        if self.impl not in KD_IMPLS:
            raise ValueError(f"--kd-impl must be one of {KD_IMPLS}, got {self.impl!r}")
        if self.ce_impl not in CE_IMPLS:
            raise ValueError(f"--kd-ce-impl must be one of {CE_IMPLS}, got {self.ce_impl!r}")
        if self.weight < 0 or self.ce_weight < 0:
            raise ValueError("--kd-weight and --kd-ce-weight must be >= 0")
        if self.temperature <= 0:
            raise ValueError(f"--kd-temperature must be > 0, got {self.temperature}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "KDConfig":
        return cls(**{f.name: getattr(args, f"kd_{f.name}") for f in fields(cls)})


def add_kd_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="knowledge distillation (megatron_kd)")
    group.add_argument("--kd-cache", type=str, default=None,
                       help="Path of the teacher top-K cache (Zarr store) to distill from. Its vocabulary, "
                            "sequence length, tokenizer and dataset fingerprints must match this run's.")
    group.add_argument("--kd-weight", type=float, default=1.0,
                       help="Weight of the distillation term; it is multiplied by temperature squared.")
    group.add_argument("--kd-ce-weight", type=float, default=0.0,
                       help="Weight of the hard-label cross-entropy term (computed at temperature 1 in the "
                            "same pass over the logits).")
    group.add_argument("--kd-temperature", type=float, default=1.0,
                       help="Softmax temperature of the student; the cached teacher is tempered within its top-K.")
    group.add_argument("--kd-tail", choices=TAILS, default="renorm",
                       help="Teacher mass outside the top-K: 'renorm' renormalizes the top-K to 1 (the default: "
                            "the best tail at K = 8, 32 and 100 in benchmarks/bench_fidelity.py, and the right one "
                            "for caches built with --kd-cache-mode sampled), 'none' ignores it, 'ghost' keeps it "
                            "as one extra outcome (a true KL over K+1 outcomes).")
    group.add_argument("--kd-chunk-size", type=int, default=None,
                       help="Tokens per chunk of the fused loss (default: a logits block the size of one bf16 "
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
    # teacher pass (megatron-kd cache build)
    group.add_argument("--kd-topk", type=int, default=100,
                       help="Entries per token stored by the teacher pass (K).")
    group.add_argument("--kd-cache-mode", choices=CACHE_MODES, default="topk",
                       help="Teacher pass: store the top-K ('topk') or --kd-samples tokens drawn from the teacher "
                            "with their counts ('sampled', Random-Sampling KD: unbiased).")
    group.add_argument("--kd-samples", type=int, default=None,
                       help="Draws per token in sampled mode (default: --kd-topk).")
    group.add_argument("--kd-capture-temperature", type=float, default=1.0,
                       help="Teacher pass: temperature of the teacher's softmax at capture.")
    group.add_argument("--kd-teacher-hf", type=str, default=None,
                       help="Teacher pass: a local Hugging Face directory to use as the teacher instead of --load. "
                            "With GPT-OSS model flags it is imported into the Megatron model those flags describe "
                            "(sharded by tensor / expert parallelism, through nvidia-modelopt); otherwise it runs as "
                            "a transformers causal LM on each rank.")
    group.add_argument("--kd-student-hf", type=str, default=None,
                       help="Initialize the student from a local Hugging Face directory (GPT-OSS: bf16, or MXFP4 "
                            "experts dequantized) through nvidia-modelopt's importer; it must match the model flags "
                            "(fewer --num-layers take its first layers). Also the default --tokenizer-model. A "
                            "checkpoint in --load takes precedence (resuming).")
    return parser


def chain_args_providers(*providers):
    """One extra_args_provider that applies several (e.g. ours and ModelOpt's) in order."""
    def provider(parser):
        for p in providers:
            parser = p(parser) or parser
        return parser
    return provider
