"""``megatron-kd train``: a Megatron-LM GPT pretraining run that distills from a teacher cache.
Launch with torchrun; every usual Megatron-LM flag works, plus ``--kd-*`` (``megatron/args.py``).
Without ``--kd-cache`` it is plain cross-entropy pretraining.

    torchrun --nproc-per-node 8 -m megatron_kd.cli train <Megatron-LM flags> --kd-cache PATH ...

The run is megatron.training's ``pretrain`` over our hooks (``megatron/run.py``), started from the
arguments the check validated (``megatron/flags.py``).
"""

from __future__ import annotations

import os

from megatron_kd.errors import FlagError

MEGATRON = True
HELP = ("Distill a student with megatron.training (GPUs; launch with torchrun). Takes every Megatron-LM flag plus "
        "the --kd-* flags.")
DESCRIPTION = "Distill a student (or pretrain without --kd-cache) with megatron.training; launch with torchrun."


def _needs(flags) -> None:
    if flags.kd_cache and not os.path.isdir(flags.kd_cache):
        raise FlagError(f"--kd-cache {flags.kd_cache}: no such directory (build it with megatron-kd cache build)")


def check(argv: list[str]):
    from megatron_kd.megatron.flags import check_megatron_run

    return check_megatron_run(argv, "train", needs=_needs)


def run(checked) -> int:
    from megatron_kd.console import code_path_line, say
    from megatron_kd.megatron.run import pretrain

    say(code_path_line(checked.flags.transformer_impl))
    pretrain(checked.megatron_args())
    return 0
