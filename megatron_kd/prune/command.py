"""``megatron-kd prune``: a student made from the teacher, for healing by distillation.

    torchrun --nproc-per-node 8 -m megatron_kd.cli prune <the teacher's model flags> \\
        <the student run's data flags> --kd-teacher-hf /models/gpt-oss-120b \\
        --prune-num-experts 64 [--prune-num-layers 24] --prune-calib-samples 256 --out /models/student

The teacher is built as ``cache build`` builds it (the same model flags, layout and data flags, so
one ``cache build`` serves every pruned candidate), run over the first ``--prune-calib-samples``
samples of the training set with the importance hooks of ``megatron_kd.prune.importance``, and
the parts the targets keep are chosen by those scores (``prune.cuts``). Rank 0 then writes the
student as a Hugging Face directory of the teacher's own tensors, cut (``prune.hf_checkpoint``);
the student run starts from it with ``--kd-student-hf DIR`` and the teacher's model flags with the
student's sizes (``--num-layers``, ``--num-experts``, ``--ffn-hidden-size``, ``--moe-ffn-hidden-size``,
``--num-attention-heads`` and ``--hidden-size`` with ``--kv-channels``), which the command prints.
"""

from __future__ import annotations

import argparse

from megatron_kd.errors import FlagError, FlagParser


def add_prune_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("pruning (megatron-kd prune)")
    group.add_argument("--out", metavar="DIR", help="Where to write the pruned student (Hugging Face directory).")
    group.add_argument("--prune-num-layers", type=int, default=None, metavar="N",
                       help="Layers the student keeps: the teacher's most influential ones (GPT-OSS: whole "
                            "window / full-attention pairs). Default: all.")
    group.add_argument("--prune-num-experts", type=int, default=None, metavar="N",
                       help="Experts each MoE layer keeps: those with the most routing mass. Default: all.")
    group.add_argument("--prune-ffn-hidden-size", type=int, default=None, metavar="N",
                       help="FFN channels each dense MLP layer keeps (Llama, Qwen3): those with the largest "
                            "activation norms. Default: all.")
    group.add_argument("--prune-num-attention-heads", type=int, default=None, metavar="N",
                       help="Attention heads each layer keeps: in every query group the same number, those "
                            "with the largest context norms (N a multiple of the query groups). Default: all.")
    group.add_argument("--prune-moe-ffn-hidden-size", type=int, default=None, metavar="N",
                       help="FFN channels each expert keeps (GPT-OSS; Megatron's --moe-ffn-hidden-size): those "
                            "with the largest activation norms over the tokens routed to it. MXFP4 experts are "
                            "then written dequantized (bf16). Default: all.")
    group.add_argument("--prune-hidden-size", type=int, default=None, metavar="N",
                       help="Hidden channels the model keeps, the same in every layer, the embedding and the "
                            "output layer: those with the largest norm outputs (N a multiple of the tensor-"
                            "parallel size; heads keep their width: the student adds --kv-channels; MXFP4 "
                            "experts are written dequantized). Default: all.")
    group.add_argument("--prune-calib-samples", type=int, default=128, metavar="N",
                       help="Training samples of the calibration pass (default 128).")
    return parser


TARGET_FLAGS = ("prune_num_layers", "prune_num_experts", "prune_ffn_hidden_size", "prune_num_attention_heads",
                "prune_moe_ffn_hidden_size", "prune_hidden_size")


def prune_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """prune's own flags (one ``FlagError`` each) and the Megatron-LM flags."""
    opts, rest = add_prune_args(FlagParser(prog="megatron-kd prune", add_help=False)).parse_known_args(argv)
    if not opts.out:
        raise FlagError("prune needs --out DIR: where to write the pruned student")
    for flag in (*TARGET_FLAGS, "prune_calib_samples"):
        value = getattr(opts, flag)
        if value is not None and value < 1:
            raise FlagError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if all(getattr(opts, f) is None for f in TARGET_FLAGS):
        raise FlagError("prune needs a target: " + ", ".join("--" + f.replace("_", "-") for f in TARGET_FLAGS))
    return opts, rest


def layer_group_size(args) -> int:
    """Layers dropped together: GPT-OSS's window / full-attention pairs (``--window-attn-skip-freq 2``)."""
    freq = getattr(args, "window_attn_skip_freq", None)
    return freq if isinstance(freq, int) and args.window_size is not None else 1


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


def main(argv: list[str]) -> int:
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model
    from megatron.training import print_rank_0
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model, get_train_valid_test_num_samples

    from megatron_kd.megatron.packing import DocumentPacking
    from megatron_kd.megatron.train import (build_datasets, check_megatron_flags, check_megatron_run, model_provider,
                                            parse_megatron_args)
    from megatron_kd.models.hf import init_from_hf
    from megatron_kd.prune import PruneTargets, calibrate, check_targets, choose_kept, write_pruned_hf
    from megatron_kd.teacher.sources import MegatronTeacher

    opts, megatron_argv = prune_options(argv)
    if not check_megatron_flags(megatron_argv).kd_teacher_hf:
        raise FlagError("prune cuts a Hugging Face teacher: --kd-teacher-hf DIR (its model flags as for cache build)")
    defaults = {"no_load_optim": True, "no_load_rng": True}
    check_megatron_run(megatron_argv, "prune", defaults)  # every mistake before start-up, CUDA included
    args = parse_megatron_args(megatron_argv, defaults)
    if args.pipeline_model_parallel_size > 1:
        raise FlagError("prune runs the teacher with --pipeline-model-parallel-size 1 (use tensor / expert "
                        "parallelism to fit it)")
    targets = PruneTargets(num_layers=opts.prune_num_layers, num_experts=opts.prune_num_experts,
                           ffn_hidden_size=opts.prune_ffn_hidden_size,
                           num_attention_heads=opts.prune_num_attention_heads,
                           moe_ffn_hidden_size=opts.prune_moe_ffn_hidden_size, hidden_size=opts.prune_hidden_size)
    teacher_sizes = dict(num_layers=args.num_layers, num_experts=args.num_experts,
                         experts_per_token=args.moe_router_topk,
                         # every layer of an MoE teacher is MoE: no dense MLP width to cut
                         ffn_hidden_size=None if args.num_experts else args.ffn_hidden_size,
                         num_attention_heads=args.num_attention_heads,
                         num_query_groups=args.num_query_groups if args.group_query_attention else None,
                         moe_ffn_hidden_size=(args.moe_ffn_hidden_size or args.ffn_hidden_size) if args.num_experts
                         else None, hidden_size=args.hidden_size,
                         # the student's head dim is written out (head_dim, --kv-channels), never derived
                         tensor_parallel_size=args.tensor_model_parallel_size, head_dim_derived=False)
    check_targets(targets, group_size=layer_group_size(args), **teacher_sizes)  # a bad cut: before any work
    initialize_megatron()
    (train, _, _), tokenizer = build_datasets(list(get_train_valid_test_num_samples()),
                                              is_built_on_rank=lambda *a, **k: True)
    model = get_model(model_provider, wrap_with_ddp=False)
    init_from_hf(unwrap_model(model[0]), args.kd_teacher_hf, args)
    teacher = MegatronTeacher(model[0].eval(), tp_group=parallel_state.get_tensor_model_parallel_group(),
                              sequence_parallel=args.sequence_parallel,
                              packing=DocumentPacking.from_args(args, eod=tokenizer.eod))
    scores = calibrate(teacher, train, num_samples=min(opts.prune_calib_samples, len(train)),
                       micro_batch_size=args.micro_batch_size, group_size=layer_group_size(args),
                       dp_rank=parallel_state.get_data_parallel_rank(),
                       dp_size=parallel_state.get_data_parallel_world_size(),
                       dp_group=parallel_state.get_data_parallel_group())
    kept = choose_kept(scores, targets, **teacher_sizes)
    if torch_rank() == 0:
        write_pruned_hf(args.kd_teacher_hf, opts.out, kept)
    print_rank_0(f"pruned {args.kd_teacher_hf} -> {opts.out} ({scores.tokens} calibration tokens): layers "
                 f"{kept.layers}; the student run: the teacher's model flags + {' '.join(student_flags(args, opts))}")
    return 0


def torch_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
