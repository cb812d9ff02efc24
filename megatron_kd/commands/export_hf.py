"""``megatron-kd export-hf``: a trained student's Megatron checkpoint -> a Hugging Face directory
(``megatron/export_hf.py``).

    torchrun --nproc-per-node 1 -m megatron_kd.cli export-hf <the student's model flags> \\
        --load CKPT --out /models/my-student [--kd-student-hf /models/gpt-oss-20b]
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_kd.errors import FlagParser, ModelConfigError

MEGATRON = True
HELP = ("Write a student checkpoint as a Hugging Face directory (GPT-OSS, Llama, Qwen3; torchrun, 1 GPU): the "
        "student's model flags, --load CKPT and --out DIR.")
DESCRIPTION = ("Write a student checkpoint as a Hugging Face directory: the student's model flags, --load CKPT and "
               "--out DIR (torchrun, one GPU).")


def add_arguments(parser):
    parser.add_argument("--out", metavar="DIR", required=True, help="Where to write the Hugging Face directory.")
    return parser


@dataclass
class Export:
    out: str
    run: object  # megatron.flags.MegatronRun


def _needs(flags) -> None:
    if flags.load is None:
        raise ModelConfigError("export-hf needs the student's checkpoint: --load CKPT_DIR")


def check(argv: list[str]) -> Export:
    from megatron_kd.megatron.export_hf import EXPORT_FLAGS
    from megatron_kd.megatron.flags import check_megatron_run

    opts, megatron_argv = add_arguments(FlagParser(prog="megatron-kd export-hf", add_help=False)).parse_known_args(argv)
    return Export(opts.out, check_megatron_run([*megatron_argv, *EXPORT_FLAGS], "export-hf", needs=_needs))


def run(export: Export) -> int:
    from megatron.training import print_rank_0

    from megatron_kd.megatron.export_hf import export_hf

    args = export.run.megatron_args()
    done = export_hf(args, export.out)
    config = done["config"]
    experts = getattr(config, "num_local_experts", None)
    print_rank_0(f"exported {args.load} (iteration {done['iteration']}) to {export.out}: {config.architectures[0]}, "
                 f"{config.num_hidden_layers} layers" + (f", {experts} experts" if experts else "")
                 + f", vocabulary {done['vocab']}, {done['dtype']}"
                 + (", experts in the MXFP4 release layout" if done["experts"] == "mxfp4" else ""))
    return 0
