"""``megatron-kd prune``: a student made from the teacher, for healing by distillation
(``prune/run.py``).

    torchrun --nproc-per-node 8 -m megatron_kd.cli prune <the teacher's model flags> \\
        <the student run's data flags> --kd-teacher-hf /models/gpt-oss-120b \\
        --prune-num-experts 64 [--prune-num-layers 24] --prune-calib-samples 256 --out /models/student

The student run starts from the directory written with ``--kd-student-hf DIR`` and the teacher's
model flags with the student's sizes (``--num-layers``, ``--num-experts``, ``--ffn-hidden-size``,
``--moe-ffn-hidden-size``, ``--num-attention-heads`` and ``--hidden-size`` with ``--kv-channels``),
which the command prints.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from megatron_kd.errors import FlagError, FlagParser
from megatron_kd.options import Range, option

MEGATRON = True
HELP = ("A student cut from a Hugging Face teacher by importance from a calibration pass (GPUs; torchrun): "
        "--prune-num-experts / --prune-num-layers / --prune-ffn-hidden-size, --out DIR.")
DESCRIPTION = ("A student cut from a Hugging Face teacher (experts, layers, FFN width) by importance from a "
               "calibration pass over the run's data: the teacher's model flags, the data flags, --kd-teacher-hf "
               "DIR, the --prune-* targets and --out DIR; launch with torchrun.")
# the teacher is loaded for its weights only
ARGS_DEFAULTS = {"no_load_optim": True, "no_load_rng": True}
PREFIX = "prune"


@dataclass
class Calibration:
    """calibration (megatron-kd prune)"""

    calib_samples: int = option(128, metavar="N", rule=Range(1, integer=True))
    """Training samples of the calibration pass."""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from megatron_kd.options import add_option_group
    from megatron_kd.prune import PruneTargets

    group = add_option_group(parser, PruneTargets, prefix=PREFIX)
    group.add_argument("--out", metavar="DIR", help="Where to write the pruned student (Hugging Face directory): "
                       "new or empty, not the teacher's; written beside it and renamed into place once whole.")
    add_option_group(parser, Calibration, prefix=PREFIX)
    return parser


def prune_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """prune's own flags (one ``FlagError`` each) and the Megatron-LM flags."""
    from megatron_kd.options import option_rules
    from megatron_kd.prune import PruneTargets

    opts, rest = add_arguments(FlagParser(prog="megatron-kd prune", add_help=False)).parse_known_args(argv)
    if not opts.out:
        raise FlagError("prune needs --out DIR: where to write the pruned student")
    for dest in (*option_rules(PruneTargets, prefix=PREFIX), *option_rules(Calibration, prefix=PREFIX)):
        value = getattr(opts, dest)
        if value is not None and value < 1:
            raise FlagError(f"--{dest.replace('_', '-')} must be >= 1, got {value}")
    targets = [f"{PREFIX}_{f.name}" for f in fields(PruneTargets)]
    if all(getattr(opts, dest) is None for dest in targets):
        raise FlagError("prune needs a target: " + ", ".join("--" + f.replace("_", "-") for f in targets))
    return opts, rest


def student_flags(args, opts) -> list[str]:
    """The flags that change from the teacher's to build the pruned student."""
    flags = []
    for flag, value in (("--num-layers", opts.prune_num_layers), ("--num-experts", opts.prune_num_experts),
                        ("--ffn-hidden-size", opts.prune_ffn_hidden_size),
                        ("--moe-ffn-hidden-size", opts.prune_moe_ffn_hidden_size),
                        ("--num-attention-heads", opts.prune_num_attention_heads),
                        ("--hidden-size", opts.prune_hidden_size)):
        if value is not None:
            flags += [flag, str(value)]
    if opts.prune_num_attention_heads is not None or opts.prune_hidden_size is not None:  # heads keep their width
        flags += ["--kv-channels", str(args.kv_channels or args.hidden_size // args.num_attention_heads)]
    return flags + ["--kd-student-hf", opts.out]


@dataclass
class Pruning:
    opts: argparse.Namespace
    run: object  # megatron.flags.MegatronRun
    targets: object  # prune.PruneTargets


def _needs(flags, out: str) -> None:
    from megatron_kd.prune.hf_checkpoint import check_student_dir

    if not flags.kd_teacher_hf:
        raise FlagError("prune cuts a Hugging Face teacher: --kd-teacher-hf DIR (its model flags as for cache build)")
    # before Megatron-LM's validation and the CUDA check: --out never the teacher's, never an older model
    check_student_dir(out, flags.kd_teacher_hf)


def check(argv: list[str]) -> Pruning:
    from megatron_kd.megatron.flags import check_megatron_run
    from megatron_kd.options import from_args
    from megatron_kd.prune import PruneTargets, check_targets
    from megatron_kd.prune.run import layer_group_size, teacher_sizes

    opts, megatron_argv = prune_options(argv)
    run = check_megatron_run(megatron_argv, "prune", ARGS_DEFAULTS, needs=lambda flags: _needs(flags, opts.out))
    if run.args.pipeline_model_parallel_size > 1:
        raise FlagError("prune runs the teacher with --pipeline-model-parallel-size 1 (use tensor / expert "
                        "parallelism to fit it)")
    targets = from_args(PruneTargets, opts, prefix=PREFIX)
    check_targets(targets, group_size=layer_group_size(run.args), **teacher_sizes(run.args))  # a bad cut
    return Pruning(opts, run, targets)


def run(pruning: Pruning) -> int:
    from megatron.training import print_rank_0

    from megatron_kd.prune.run import prune_hf_teacher

    args, opts = pruning.run.megatron_args(), pruning.opts
    kept, tokens = prune_hf_teacher(args, pruning.targets, calib_samples=opts.prune_calib_samples, out=opts.out)
    print_rank_0(f"pruned {args.kd_teacher_hf} -> {opts.out} ({tokens} calibration tokens): layers "
                 f"{kept.layers}; the student run: the teacher's model flags + {' '.join(student_flags(args, opts))}")
    return 0
