"""``megatron-kd hf-flags``: the Megatron-LM model flags that build a Llama / Qwen3 Hugging Face
directory (``models/llama.py``), printed for ``--kd-student-hf`` / ``--kd-teacher-hf`` runs."""

from __future__ import annotations

import argparse

HELP = ("Print the Megatron-LM model flags that build a Llama / Qwen3 Hugging Face directory (for --kd-student-hf / "
        "--kd-teacher-hf).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="DIR", help="The Hugging Face directory (config.json and its weights).")


def run(args: argparse.Namespace) -> int:
    import shlex

    from transformers import AutoConfig

    from megatron_kd.megatron.hf_check import check_hf_dir
    from megatron_kd.models.llama import megatron_flags

    check_hf_dir(args.path, "hf-flags", tokenizer=False)
    print(shlex.join(megatron_flags(AutoConfig.from_pretrained(args.path))))
    return 0
