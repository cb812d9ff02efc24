"""``megatron-kd data chat``: OpenAI-style conversations (JSONL) -> a Megatron indexed dataset with a
per-token loss mask beside it (``data/chat.py`` renders and writes it).

    megatron-kd data chat --input conversations.jsonl --output PREFIX \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR \\
        [--seq-length N --overlong truncate|refuse] [--loss-roles assistant] \\
        [--loss-channels analysis,commentary,final] [--loss-header generated|none] [--renderer auto] \\
        [--overwrite]
"""

from __future__ import annotations

import argparse

from megatron_kd.errors import FlagParser

HELP = ("OpenAI-style conversations (JSONL) -> a Megatron indexed dataset in harmony format (or the tokenizer's chat "
        "template) with a loss mask on the assistant's tokens; --help lists the flags.")


def chat_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import _add_tokenizer_args

    from megatron_kd.data.chat import RENDERERS
    from megatron_kd.data.conversation import MaskSettings
    from megatron_kd.options import add_option_group

    parser = FlagParser(prog="megatron-kd data chat",
                        description="OpenAI-style conversations (JSONL) -> a Megatron indexed dataset in GPT-OSS's "
                                    "harmony format (or the tokenizer's chat template) with a per-token loss mask "
                                    "beside it. Megatron-LM's --tokenizer-* flags name the tokenizer.")
    group = parser.add_argument_group("chat data")
    group.add_argument("--input", required=True, metavar="JSONL", help="Conversations, one JSON object per line.")
    group.add_argument("--output", required=True, metavar="PREFIX",
                       help="Writes PREFIX.bin/.idx (tokens), PREFIX_loss_mask.bin/.idx (one byte per token) and "
                            "PREFIX_chat.json (mask settings and fingerprint), each under a temporary name first, "
                            "moved into place once the whole input was read.")
    group.add_argument("--overwrite", action="store_true",
                       help="Replace a dataset already at PREFIX (only once the new one is complete); without it, "
                            "existing files there are refused.")
    group.add_argument("--renderer", choices=RENDERERS, default="auto",
                       help="harmony (GPT-OSS), template (the tokenizer's chat template), or auto (default): "
                            "harmony when the tokenizer has its special tokens.")
    add_option_group(parser, MaskSettings)
    return _add_tokenizer_args(parser)


def check(argv: list[str]) -> argparse.Namespace:
    return chat_parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from megatron_kd.data.chat import build_chat_dataset, build_tokenizer, chat_files, check_output
    from megatron_kd.data.conversation import MaskSettings
    from megatron_kd.options import from_args

    settings = from_args(MaskSettings, args)
    check_output(args.output, chat_files(args.output), overwrite=args.overwrite)  # before loading the tokenizer
    summary = build_chat_dataset(args.input, args.output, build_tokenizer(args), settings, renderer=args.renderer,
                                 overwrite=args.overwrite)
    print(f"{args.output}: {summary['documents']} conversations, {summary['tokens']:,} tokens, "
          f"{summary['loss_tokens']:,} carry loss ({summary['loss_tokens'] / summary['tokens']:.1%}; "
          f"{summary['mask']}); {summary['truncated']} truncated; mask fingerprint {summary['fingerprint']}")
    return 0
