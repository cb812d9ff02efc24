"""``megatron-kd hf-flags``: the Megatron-LM model flags that build a Llama / Qwen3 Hugging Face
directory (``models/llama.py``), printed for ``--kd-student-hf`` / ``--kd-teacher-hf`` runs."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from megatron_kd.errors import ModelConfigError

HELP = ("Print the Megatron-LM model flags that build a Llama / Qwen3 Hugging Face directory (for --kd-student-hf / "
        "--kd-teacher-hf).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="DIR", help="The Hugging Face directory (config.json and its weights).")


def run(args: argparse.Namespace) -> int:
    import shlex

    from megatron_kd.megatron.hf_check import check_hf_dir
    from megatron_kd.models.llama import megatron_flags

    check_hf_dir(args.path, "hf-flags", tokenizer=False)
    hf_config, source = read_config(Path(args.path))
    try:
        flags = megatron_flags(hf_config)
    except ModelConfigError as e:
        raise ModelConfigError(f"{source}: {e}") from None
    print(shlex.join(flags))
    return 0


def read_config(path: Path):
    """(transformers' config of the directory ``path``, the name of its config.json in messages). The
    file as written is checked first (``llama.check_raw_config``: model type, remote code, the sizes,
    the RoPE type); transformers' own notices on the RoPE parameters, which that check has judged,
    are kept quiet while it reads the file."""
    import json

    from transformers import AutoConfig

    from megatron_kd.models.llama import check_raw_config

    file = path / "config.json"
    source = f"hf-flags: {file}"
    check_raw_config(json.loads(file.read_text()), source)
    rope_logger = logging.getLogger("transformers.modeling_rope_utils")
    level = rope_logger.level
    rope_logger.setLevel(logging.ERROR)
    try:
        return AutoConfig.from_pretrained(str(path)), source
    except (ValueError, TypeError, KeyError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelConfigError(f"{source}: transformers cannot read it ({first})") from None
    finally:
        rope_logger.setLevel(level)
