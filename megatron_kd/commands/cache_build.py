"""``megatron-kd cache build``: the teacher pass (``teacher/build.py``) on GPUs, launched by torchrun
with the student run's data flags and the teacher's model flags.

    torchrun --nproc-per-node 8 -m megatron_kd.cli cache build <data flags> <teacher model flags> \\
        --load CKPT (or --kd-teacher-hf DIR) --kd-cache PATH
"""

from __future__ import annotations

from megatron_kd.errors import FlagError

MEGATRON = True
HELP = ("Teacher pass (GPUs; launch with torchrun): the student's Megatron-LM data flags, the teacher's model flags "
        "and --load (or --kd-teacher-hf), and --kd-cache PATH.")
DESCRIPTION = ("Teacher pass: the student run's data flags, the teacher's model flags and --load (or --kd-teacher-hf), "
               "and --kd-cache PATH; launch with torchrun.")
# a teacher is loaded for its weights only
ARGS_DEFAULTS = {"no_load_optim": True, "no_load_rng": True}


def _needs(flags) -> None:
    if not flags.kd_cache:
        raise FlagError("cache build needs --kd-cache PATH: where to write the teacher cache")


def check(argv: list[str]):
    from megatron_kd.megatron.flags import check_megatron_run

    return check_megatron_run(argv, "cache build", ARGS_DEFAULTS, needs=_needs)


def run(checked) -> int:
    from megatron.training import print_rank_0

    from megatron_kd.console import code_path_line, say
    from megatron_kd.megatron.args import TeacherPassConfig
    from megatron_kd.teacher.build import build_cache

    say(code_path_line(checked.flags.transformer_impl))
    args = checked.megatron_args()
    config = TeacherPassConfig.from_args(args)
    done = build_cache(args, config)
    # a resumed pass computes only what was missing: say so, and size the store by what it holds
    total, samples = done["total"], done["samples"]
    already = f" ({total - samples} were already in the cache)" if samples < total else ""
    this_pass = f"mean teacher mass {done['mass']:.4f} over them" if done["tokens"] else "nothing left to compute"
    if done["loss_mask"]:
        this_pass += f"; entries only where the loss mask {done['loss_mask']['mask']!r} keeps the loss"
    print_rank_0(f"teacher cache {config.cache}: {total} samples, {done['bytes_per_token']:.1f} bytes/token, mode "
                 f"{done['mode']}, K={done['k']}; this pass computed {samples} samples, {done['tokens']:,} tokens"
                 f"{already}, {this_pass}")
    return 0
